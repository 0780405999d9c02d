"""Memory stays bounded by the budget, not by the checkpoint: peak RSS measured in real processes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from fsdp_convert._sample import CHECKPOINT_DIRNAME, TRUTH_FILENAME
from fsdp_convert.metadata import read_index
from tests._compare import assert_same_state

pytestmark = pytest.mark.slow

MiB = 2**20
BUDGET = 8 * MiB
SLACK = 32 * MiB  # allocator arenas, thread stacks, gloo buffers, pickled plan

PROBE = """
import json, resource, sys
import fsdp_convert, fsdp_convert.launch, torch.distributed.launcher.api  # everything the run imports
def peak(who):
    return resource.getrusage(who).ru_maxrss * 1024
base = peak(resource.RUSAGE_SELF)
fsdp_convert.consolidate(sys.argv[1], sys.argv[2], nproc=int(sys.argv[3]), memory_budget_bytes=int(sys.argv[4]))
print(json.dumps({"base": base, "self": peak(resource.RUSAGE_SELF), "children": peak(resource.RUSAGE_CHILDREN)}))
"""


def _probe(ck: Path, out: Path, nproc: int) -> dict[str, int]:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [sys.executable, "-c", PROBE, str(ck), str(out), str(nproc), str(BUDGET)],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1])  # type: ignore[no-any-return]


@pytest.mark.parametrize("nproc", [1, 2])
def test_peak_rss_is_bounded_by_budget_plus_largest_tensor(big_sample: Path, tmp_path: Path, nproc: int) -> None:
    ck = big_sample / CHECKPOINT_DIRNAME
    index = read_index(ck)
    largest = max(e.nbytes for e in index.tensors())
    bound = BUDGET + largest + SLACK
    assert index.total_bytes > 2 * bound, "the checkpoint must dwarf the bound, or the test proves nothing"

    out = tmp_path / "full.pt"
    rss = _probe(ck, out, nproc)
    # a worker starts from the same interpreter baseline as the parent (torch and this package imported)
    peaks = [rss["self"]] if nproc == 1 else [rss["self"], rss["children"]]
    for peak in peaks:
        assert peak - rss["base"] <= bound, (
            f"peak {peak / MiB:.0f} MiB over baseline {rss['base'] / MiB:.0f} MiB exceeds "
            f"budget {BUDGET / MiB:.0f} + largest {largest / MiB:.0f} + slack {SLACK / MiB:.0f} MiB "
            f"(checkpoint {index.total_bytes / MiB:.0f} MiB)"
        )
    truth = torch.load(big_sample / TRUTH_FILENAME, weights_only=True)
    assert_same_state(torch.load(out, weights_only=True, mmap=True), truth)
