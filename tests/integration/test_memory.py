"""Memory stays bounded by the budget, not by the checkpoint nor its largest tensor: peak resident memory of every process.

Each process of a run (the parent; at ``--nproc 2`` also rank 0 and rank 1, each moving its own
tensors into the output) reports its own peak, ``VmHWM`` from ``/proc/self/status``, against its
own baseline: the parent's right after the imports a run needs, a worker's (forked from the
launcher's forkserver, which made the imports) when it starts its rank. ``VmHWM`` starts afresh at exec and at fork, unlike
``ru_maxrss``, which Linux carries over from the parent (pytest's own peak). The reports
come from a ``sitecustomize`` module put on the probe's ``PYTHONPATH``, which every Python process
of the run loads at start-up, the elastic launcher's spawned workers included; the package itself
has no test hook. The checkpoint's largest tensors (64 MiB) are larger than the whole bound, so a
process that held one, or one rank's 32 MiB chunk of one, fails the test.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from fsdp_convert._sample import CHECKPOINT_DIRNAME, TRUTH_FILENAME
from fsdp_convert.formats import read_index
from tests._compare import assert_same_state

pytestmark = pytest.mark.slow

MiB = 2**20
BUDGET = 8 * MiB
SLACK = 24 * MiB  # allocator arenas, thread stacks, the pickled plan, the read log

HOOK = '''
"""Test hook (tests/integration/test_memory.py): per-process peak memory records."""
import functools, json, os
import torch.distributed.launcher.api  # everything a run imports, before the baseline
import fsdp_convert, fsdp_convert.ops.consolidate, fsdp_convert.ops._consolidate_rank, fsdp_convert.launch
# imported during a run, not at its start (format detection, --adapter): safetensors' extension alone is MiB
import fsdp_convert.formats.full_file, fsdp_convert.adapters, fsdp_convert.lora


def vm_hwm():
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmHWM in /proc/self/status")


BASE = vm_hwm()
PARENT = os.getpid()
LOG = os.environ["MEMORY_TEST_LOG"]


def record(role):
    with open(os.path.join(LOG, f"{os.getpid()}-{role}.json"), "w") as f:
        json.dump({"pid": os.getpid(), "role": role, "base": BASE, "peak": vm_hwm()}, f)


_run_rank = fsdp_convert.ops._consolidate_rank.consolidate_rank


@functools.wraps(_run_rank)  # same name and module: the launcher pickles it by reference
def consolidate_rank(job, rank, world_size, group):
    global BASE
    if os.getpid() != PARENT:  # a worker forked from the forkserver: its peak starts afresh at the fork, imports done
        BASE = vm_hwm()
    result = _run_rank(job, rank, world_size, group)
    record(f"rank{rank}")
    return result


# the name the operation calls, and the one the launcher pickles it by
fsdp_convert.ops.consolidate.consolidate_rank = fsdp_convert.ops._consolidate_rank.consolidate_rank = consolidate_rank
'''

PROBE = """
import sys, torch, fsdp_convert, sitecustomize
from fsdp_convert.adapters import load_adapter
from fsdp_convert.transform import TransformOptions
options = TransformOptions(dtype=getattr(torch, sys.argv[5])) if sys.argv[5] not in ("keep", "permute", "merge") else None
if sys.argv[5] == "permute":
    options = TransformOptions(adapter=load_adapter("memory_adapter:permute_heads"))
if sys.argv[5] == "merge":
    options = TransformOptions(adapter=load_adapter("memory_adapter:merge_like_lora"))
fsdp_convert.consolidate(sys.argv[1], sys.argv[2], nproc=int(sys.argv[3]), memory_budget_bytes=int(sys.argv[4]), options=options)
sitecustomize.record("parent")
"""


# A user adapter (--adapter module:function) that applies the Q/K RoPE row permutation to every 2-d
# tensor, as to_hf does to q_proj, in heads of HEAD_ROWS rows: the 64 MiB tensors are rebuilt block
# by block from the rows each block needs, never whole.
HEAD_ROWS = 64
LORA_IN, LORA_A, LORA_SCALE = 128, "layers.0.attn.wq.weight", 0.5
ADAPTER = f"""
from fsdp_convert.derive import Derived, HeadPermute, Input
from fsdp_convert.lora import LoraMerge

def permute_heads(tensors, config):
    out = {{}}
    for t in tensors:
        heads = len(t.shape) == 2 and t.shape[0] % {HEAD_ROWS} == 0
        rows = HeadPermute(t.shape[0] // {HEAD_ROWS}, {HEAD_ROWS}) if heads else None
        out[t.fqn] = Derived(inputs=(Input(fqn=t.fqn, rows=rows) if rows else Input(fqn=t.fqn),), shape=t.shape, dtype=t.dtype)
    return out

def merge_like_lora(tensors, config):
    # --merge-lora's combine (W + (B @ A) * scale, fp32) on every (rows, {LORA_IN}) weight, with
    # B = W itself and A = {LORA_A} read whole: W and B by row blocks, as a LoRA merge reads them
    out = {{}}
    for t in tensors:
        merge = len(t.shape) == 2 and t.shape[1] == {LORA_IN}
        inputs = (Input(fqn=t.fqn), Input(fqn=t.fqn), Input(fqn="{LORA_A}", rows=None)) if merge else (Input(fqn=t.fqn),)
        out[t.fqn] = Derived(inputs=inputs, shape=t.shape, dtype=t.dtype, combine=LoraMerge({LORA_SCALE}) if merge else None)
    return out
"""


def _permuted(t: torch.Tensor) -> torch.Tensor:
    """torchtitan 0.3.0's Llama3StateDictAdapter._permute with heads of ``HEAD_ROWS`` rows."""
    if t.dim() != 2 or t.shape[0] % HEAD_ROWS:
        return t
    rows, cols = t.shape
    return t.view(rows // HEAD_ROWS, HEAD_ROWS // 2, 2, cols).transpose(1, 2).reshape(rows, cols)


def _probe(ck: Path, out: Path, nproc: int, tmp_path: Path, dtype: str) -> list[dict[str, int | str]]:
    hooks, log = tmp_path / "hooks", tmp_path / "memory"
    hooks.mkdir()
    log.mkdir()
    (hooks / "sitecustomize.py").write_text(HOOK)
    (hooks / "memory_adapter.py").write_text(ADAPTER)
    path = os.pathsep.join(filter(None, [str(hooks), os.environ.get("PYTHONPATH")]))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": path, "MEMORY_TEST_LOG": str(log)}
    proc = subprocess.run(
        [sys.executable, "-c", PROBE, str(ck), str(out), str(nproc), str(BUDGET), dtype],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    return sorted((json.loads(p.read_text()) for p in log.iterdir()), key=lambda r: str(r["role"]))


@pytest.mark.parametrize(
    "dtype", ["keep", "bfloat16", "permute", "merge"], ids=["copy", "cast", "adapter-permutation", "lora-merge"]
)
@pytest.mark.parametrize("nproc", [1, 2])
def test_peak_memory_is_bounded_by_budget_whatever_the_largest_tensor(
    big_sample: Path, tmp_path: Path, nproc: int, dtype: str
) -> None:
    """Growth over the baseline stays within budget + slack: the bytes are moved in pieces, in place
    (``copy``), or cast block by block (``cast``), or permuted block by block by an adapter
    (``adapter-permutation``), never held as a whole tensor or chunk."""
    ck = big_sample / CHECKPOINT_DIRNAME
    index = read_index(ck)
    largest = max(e.nbytes for e in index.tensors())
    bound = BUDGET + SLACK
    assert largest > bound, "the largest tensor must not fit in the bound, or the test proves nothing"
    assert max(c.length_bytes for e in index.tensors() for c in e.chunks) > bound, "nor a rank's chunk of it"

    out = tmp_path / "full.pt"
    start = time.monotonic()
    records = _probe(ck, out, nproc, tmp_path, dtype)
    seconds = time.monotonic() - start
    roles = ["parent", "rank0"] if nproc == 1 else ["parent", "rank0", "rank1"]
    assert sorted(str(r["role"]) for r in records) == roles, records
    report = ", ".join(
        f"{r['role']}: {base / MiB:.0f} -> {peak / MiB:.0f} MiB (+{(peak - base) / MiB:.1f})"
        for r in records
        for base, peak in [(int(r["base"]), int(r["peak"]))]
    )
    print(f"\n--nproc {nproc}, {dtype}, {seconds:.1f} s: {report}; bound +{bound / MiB:.0f} MiB")
    for r in records:
        growth = int(r["peak"]) - int(r["base"])
        assert growth <= bound, (
            f"{r['role']} grew {growth / MiB:.1f} MiB over its baseline ({report}), more than "
            f"budget {BUDGET / MiB:.0f} + slack {SLACK / MiB:.0f} MiB "
            f"(largest tensor {largest / MiB:.0f} MiB, checkpoint {index.total_bytes / MiB:.0f} MiB)"
        )
    truth = torch.load(big_sample / TRUTH_FILENAME, weights_only=True)
    if dtype == "permute":  # an adapter writes model weights only
        truth = {"model": {k: _permuted(v) for k, v in truth["model"].items()}}
    elif dtype == "merge":  # float arithmetic by row blocks: within rounding of the whole-tensor merge
        got = torch.load(out, weights_only=True, mmap=True)["model"]
        a = truth["model"][LORA_A].float()
        for k, w in truth["model"].items():
            want = (w.float() + (w.float() @ a) * LORA_SCALE).to(w.dtype) if w.dim() == 2 and w.shape[1] == LORA_IN else w
            torch.testing.assert_close(got[k], want, rtol=1e-5, atol=1e-5, equal_nan=True)  # the sample has a NaN row
        return
    elif dtype != "keep":
        truth["model"] = {k: v.to(torch.bfloat16) if v.is_floating_point() else v for k, v in truth["model"].items()}
    assert_same_state(torch.load(out, weights_only=True, mmap=True), truth)
