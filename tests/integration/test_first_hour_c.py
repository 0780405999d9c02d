"""A newcomer's first hour: the library called with workers from a script's top level, without a ``__main__`` guard.

Each scenario is a script written to ``tmp_path`` and run as ``python script.py``: the workers must
not run its top level again (which would call the function again, and find the output locked),
unless the job names something only the script defines; then the error says to guard the call.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import torch

import fsdp_convert
from tests._compare import assert_same_state
from tests._samples import Sample

ROOT = Path(__file__).resolve().parents[2]
ENV = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
TIMEOUT_S = 300

UNGUARDED = """
import json, sys
import fsdp_convert

ckpt = sys.argv[1]
fsdp_convert.consolidate(ckpt, "out/full.pt", nproc=2)
fsdp_convert.reshard(ckpt, "out/ws2", world_size=2, nproc=2)
full = fsdp_convert.verify(ckpt, "out/full.pt", nproc=2)
resharded = fsdp_convert.verify(ckpt, "out/ws2", nproc=2)
print(json.dumps({"full": [full.compared, len(full.differences)], "ws2": [resharded.compared, len(resharded.differences)]}))
"""


def _run(script: str, folder: Path, *args: str) -> subprocess.CompletedProcess[str]:
    (folder / "script.py").write_text(script)
    return subprocess.run(
        [sys.executable, "script.py", *args], cwd=folder, env=ENV, capture_output=True, text=True, timeout=TIMEOUT_S
    )


def test_row1_library_calls_with_workers_work_at_a_scripts_top_level(ws3_ckpt: Sample, tmp_path: Path) -> None:
    (tmp_path / "out").mkdir()
    done = _run(UNGUARDED, tmp_path, str(ws3_ckpt.checkpoint))
    assert done.returncode == 0, done.stderr[-3000:]
    said = json.loads(done.stdout)
    assert said["full"][0] > 0 and said["full"][1] == 0, said
    assert said["ws2"][0] > 0 and said["ws2"][1] == 0, said
    assert_same_state(torch.load(tmp_path / "out" / "full.pt", weights_only=True), ws3_ckpt.truth())
    fsdp_convert.consolidate(tmp_path / "out" / "ws2", tmp_path / "via.pt", nproc=1)
    assert (tmp_path / "via.pt").read_bytes() == (tmp_path / "out" / "full.pt").read_bytes()


NAMES_MAIN = """
from fsdp_convert import launch
from tests import _local_jobs as t

class Box:  # a worker finds Box only by running this script again
    pass

print(launch.run_workers(t.returns, Box(), 2))
"""


def test_row1_a_job_naming_the_unguarded_script_says_to_guard_the_call(tmp_path: Path) -> None:
    done = _run(NAMES_MAIN, tmp_path)
    assert done.returncode == 1
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("fsdp_convert.errors.WorkerFailedError: worker rank "), done.stderr[-3000:]
    assert "running your script's top level again, as each worker does to load Box from it" in last
    assert 'put the call under `if __name__ == "__main__":`, or move Box into a module of its own' in last


def test_row1_a_job_naming_the_guarded_script_runs(tmp_path: Path) -> None:
    guarded = NAMES_MAIN.replace("print(", 'if __name__ == "__main__":\n    print(')
    done = _run(guarded, tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "'rank': 1" in done.stdout
