"""Scale-out through real processes: two elastic agents on this machine acting as two nodes, and
the CLI started as the workers of the user's own torchrun."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections import defaultdict
from pathlib import Path

import pytest

import fsdp_convert
from fsdp_convert._sample import CHECKPOINT_DIRNAME
from fsdp_convert.formats import open_checkpoint
from fsdp_convert.outputs import TorchSaveFile
from fsdp_convert.plan.consolidate import plan_consolidate
from fsdp_convert.plan.items import prepare_items
from fsdp_convert.transform import TransformOptions
from tests._dist import free_port
from tests._samples import Sample

pytestmark = pytest.mark.slow

ENV = {**os.environ, "OMP_NUM_THREADS": "1"}
HANG_S = 120  # a surviving node still going this long after the other died has hung


def _node(node_rank: int, port: int, run_id: str, args: list[str], env: dict[str, str]) -> subprocess.Popen[str]:
    cluster = ["--nnodes", "2", "--node-rank", str(node_rank), "--nproc-per-node", "1"]
    cluster += ["--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", run_id]
    return subprocess.Popen(
        [sys.executable, "-m", "fsdp_convert", *args, *cluster],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,  # its own process group: a test can kill a whole node
    )


def _reads(log_dir: Path) -> dict[int, list[tuple[str, tuple[int, ...]]]]:
    """The chunks each rank read, from the FSDP_CONVERT_READ_LOG files."""
    reads: dict[int, list[tuple[str, tuple[int, ...]]]] = defaultdict(list)
    for log in log_dir.glob("reads-*.jsonl"):
        for line in log.read_text().splitlines():
            rank, fqn, offsets, *_ = json.loads(line)
            reads[int(rank)].append((fqn, tuple(offsets)))
    return reads


def test_two_nodes_write_what_one_node_writes(ws3_ckpt: Sample, tmp_path: Path) -> None:
    """c10d rendezvous on 127.0.0.1: the output is byte-identical to a single-node run, and each
    node's worker read exactly the chunks of the tensors the plan gave its rank, each once."""
    out, logs = tmp_path / "two-nodes.pt", tmp_path / "reads"
    logs.mkdir()
    env = {**ENV, "FSDP_CONVERT_READ_LOG": str(logs)}
    port, args = free_port(), ["consolidate", str(ws3_ckpt.checkpoint), str(out)]
    nodes = [_node(rank, port, "two-nodes", args, env) for rank in (0, 1)]
    results = [node.communicate(timeout=180) for node in nodes]
    for node, (_, stderr) in zip(nodes, results, strict=True):
        assert node.returncode == 0, stderr
    assert sum(stdout.startswith("wrote ") for stdout, _ in results) == 1  # rank 0's node alone wrote
    single = tmp_path / "one-node.pt"
    fsdp_convert.consolidate(ws3_ckpt.checkpoint, single, nproc=1)
    assert out.read_bytes() == single.read_bytes()

    source = open_checkpoint(ws3_ckpt.checkpoint, full_files=True)
    index = source.index
    items = prepare_items(source, TransformOptions(), TorchSaveFile().groups("all"))
    plan = plan_consolidate(index, items, out, kind=TorchSaveFile(), nproc=2)
    reads = _reads(logs)
    assert sorted(reads) == [0, 1]
    for rank in (0, 1):
        want = sorted(
            (item.entry.fqn, c.offsets)
            for item, owner in zip(plan.items, plan.owners, strict=True)
            if owner == rank and item.is_tensor
            for c in item.entry.chunks  # type: ignore[union-attr]
            if c.relative_path is not None and c.numel > 0  # empty chunks are not read
        )
        assert sorted(reads[rank]) == want, rank
    assert sorted({*reads[0], *reads[1]}) == sorted([*reads[0], *reads[1]])  # no chunk read twice


def test_a_dead_node_fails_the_job(big_sample: Path, tmp_path: Path) -> None:
    """SIGKILL one node mid-run: the other fails naming what it lost (within seconds; a run still
    going HANG_S later fails as hung), no output is left, and the temporary and its manifest are kept
    for ``--resume`` (test_resume_multinode.py finishes such a job)."""
    out, logs = tmp_path / "full.pt", tmp_path / "reads"
    logs.mkdir()
    env = {**ENV, "FSDP_CONVERT_READ_LOG": str(logs)}
    args = ["consolidate", str(big_sample / CHECKPOINT_DIRNAME), str(out), "--memory-budget", "1MiB", "--verify"]
    port = free_port()
    nodes = [_node(rank, port, "dead-node", args, env) for rank in (0, 1)]
    deadline = time.monotonic() + 120
    while sum(len(v) for v in _reads(logs).values()) < 20:  # both nodes are reading
        assert time.monotonic() < deadline and all(n.poll() is None for n in nodes), "the run did not get going"
        time.sleep(0.05)
    os.killpg(nodes[1].pid, signal.SIGKILL)
    killed_at = time.monotonic()
    try:
        _, stderr = nodes[0].communicate(timeout=HANG_S)
    except subprocess.TimeoutExpired:
        os.killpg(nodes[0].pid, signal.SIGKILL)
        nodes[0].communicate()
        raise AssertionError(f"the surviving node was still going {HANG_S} s after the other died: it hung") from None
    nodes[1].communicate(timeout=30)
    # how soon is reported, not asserted: a loaded 2-core CI box can take many seconds
    print(f"\nthe surviving node failed {time.monotonic() - killed_at:.1f} s after the other died")
    assert nodes[0].returncode == 1, stderr
    lines = stderr.strip().splitlines()
    assert len(lines) == 1, stderr
    # what the survivor saw go: a peer's connection, or (when the dead node held the store) the rendezvous
    assert lines[0].startswith(("error: worker rank ", "error: lost the rendezvous at 127.0.0.1:")), lines[0]
    assert lines[0].endswith("is kept: run again with --resume to finish it, or remove it"), lines[0]
    kept = [".full.manifest-rdzv-dead-node.pt", ".full.tmp-rdzv-dead-node.pt"]
    assert sorted(p.name for p in tmp_path.iterdir()) == [*kept, "reads"]  # no output, no lock


def test_cli_runs_as_the_workers_of_users_torchrun(ws3_ckpt: Sample, tmp_path: Path) -> None:
    """``torchrun ... -m fsdp_convert consolidate``: each worker is one rank, rank 0 writes."""
    out, logs = tmp_path / "hf", tmp_path / "reads"
    logs.mkdir()
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2"]
    cmd += ["-m", "fsdp_convert", "consolidate", str(ws3_ckpt.checkpoint), str(out), "--max-shard-size", "8000"]
    proc = subprocess.run(cmd, env={**ENV, "FSDP_CONVERT_READ_LOG": str(logs)}, capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "[rank 1] this node's share is in place" in proc.stdout
    # the two processes shared the work as ranks 0 and 1 of one job: each read, no chunk twice
    reads = _reads(logs)
    assert sorted(reads) == [0, 1] and all(reads.values()), reads
    assert sorted({*reads[0], *reads[1]}) == sorted([*reads[0], *reads[1]])
    shutil.rmtree(logs)
    single = tmp_path / "single"
    fsdp_convert.consolidate(ws3_ckpt.checkpoint, single, nproc=1, max_shard_bytes=8000)
    names = sorted(p.name for p in single.iterdir())
    assert names == sorted(p.name for p in out.iterdir()) and len(names) > 3
    for name in names:
        assert (out / name).read_bytes() == (single / name).read_bytes(), name
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf", "single"]


def test_verify_with_two_workers_gathers_every_difference(ws3_ckpt: Sample, tmp_path: Path) -> None:
    """verify --nproc 2: each worker compares every other key; rank 0 reports both workers' finds."""
    import torch

    good, bad = tmp_path / "good.pt", tmp_path / "bad.pt"
    fsdp_convert.consolidate(ws3_ckpt.checkpoint, good, nproc=1)
    state = torch.load(good, weights_only=True)
    keys = list(state["model"])
    for fqn in keys[:2]:  # neighbours in key order: one falls to each worker
        state["model"][fqn] = state["model"][fqn] + 1
    torch.save(state, bad)
    cmd = [sys.executable, "-m", "fsdp_convert", "verify", str(ws3_ckpt.checkpoint), str(bad), "--nproc", "2", "--json"]
    proc = subprocess.run(cmd, env=ENV, capture_output=True, text=True, timeout=180)
    assert proc.returncode == 1, proc.stderr
    doc = json.loads(proc.stdout)
    assert [d["key"] for d in doc["differences"]] == [f"model.{k}" for k in keys[:2]]
    assert doc["compared"] == len(fsdp_convert.inspect_checkpoint(ws3_ckpt.checkpoint).entries)
    cmd[5] = str(good)
    assert subprocess.run(cmd, env=ENV, capture_output=True, text=True, timeout=180).returncode == 0
