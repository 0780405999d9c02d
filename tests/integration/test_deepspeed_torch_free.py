"""Indexing and reading a DeepSpeed save imports no torch, and gives the bytes torch's loader path gives.

Each probe runs the CLI in a fresh interpreter (``deepspeed_runs``: DeepSpeed's own saves at 2
ranks) and reports whether ``torch`` was imported. The reference output is the same command with
the torch-free file reader turned off (``deepspeed_files.load_ds_records`` declining every file, so
every file takes ``_rank_unpickler``), the path every DeepSpeed read took before.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

_PROBE = """
import sys
from fsdp_convert.formats import deepspeed_files
if sys.argv[1] == "torch-loader":
    deepspeed_files.load_ds_records = lambda *args: None
try:
    if sys.argv[2] == "inspect":  # the library's (the CLI's inspect imports torch for any folder but DCP's)
        import json
        import fsdp_convert
        print(json.dumps(fsdp_convert.inspect(sys.argv[3]).to_json_dict()))
    else:
        from fsdp_convert.cli.app import app
        app(sys.argv[2:], standalone_mode=False)
finally:
    print("TORCH" if "torch" in sys.modules else "NO-TORCH", file=sys.stderr)
"""


def _run(mode: str, *args: str | Path) -> tuple[bool, str]:
    """``fsdp-convert ARGS`` in a fresh interpreter: (whether it imported torch, its stdout); fails on a non-zero exit."""
    done = subprocess.run(
        [sys.executable, "-c", _PROBE, mode, *map(str, args)], capture_output=True, text=True, timeout=300, check=False
    )
    assert done.returncode == 0, done.stderr
    return done.stderr.strip().splitlines()[-1] == "TORCH", done.stdout


@pytest.mark.parametrize("variant", ["z3", "z1b", "z3b", "bfo", "z2a"])
def test_inspect_imports_no_torch_and_says_what_the_torch_loader_says(deepspeed_runs: dict[int, Path], variant: str) -> None:
    ckpt = deepspeed_runs[2] / variant
    used_torch_fast, fast = _run("records", "inspect", ckpt)
    used_torch, slow = _run("torch-loader", "inspect", ckpt)
    assert not used_torch_fast and used_torch
    assert fast == slow


@pytest.mark.parametrize(
    ("variant", "output"),
    [("z1b", "model.bin"), ("z1b", "model.safetensors"), ("z2a", "all.pt"), ("bfo", "model.bin"), ("z3", "model.bin")],
)
def test_consolidate_gives_the_torch_loader_bytes(
    deepspeed_runs: dict[int, Path], tmp_path: Path, variant: str, output: str
) -> None:
    ckpt = deepspeed_runs[2] / variant
    only = [] if output.startswith("all") else ["--only", "model"]
    (tmp_path / "fast").mkdir()
    (tmp_path / "slow").mkdir()
    used_torch, _ = _run("records", "consolidate", ckpt, tmp_path / "fast" / output, *only)
    _run("torch-loader", "consolidate", ckpt, tmp_path / "slow" / output, *only)
    assert (tmp_path / "fast" / output).read_bytes() == (tmp_path / "slow" / output).read_bytes()
    assert not used_torch  # a piece of a row (ZeRO-3's partitions cut rows) is one run of bytes too


def test_consolidate_of_zero3_imports_no_torch(deepspeed_runs: dict[int, Path], tmp_path: Path) -> None:
    """ZeRO-3 cuts rows at its partitions' edges: each piece is one run of the tensor, copied as bytes (move._one_run)."""
    used_torch, _ = _run("records", "consolidate", deepspeed_runs[2] / "z3", tmp_path / "model.bin", "--only", "model")
    assert not used_torch
