"""``--dry-run`` of ``consolidate`` and ``reshard``: the plan is printed, nothing is created, and the run holds to it.

The plan's output size bounds what the run then writes (and is close to it); its peak memory per
process bounds every process's measured peak (``VmHWM``, recorded by a ``sitecustomize`` hook on
the run's ``PYTHONPATH``, as in ``test_memory``), and its figure for the whole tree bounds their sum.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from fsdp_convert.ops.dry_run import RunPlan, dry_run_consolidate, dry_run_reshard
from tests._samples import Sample

HOOK = '''
"""Test hook (tests/integration/test_first_hour_e.py): each process's peak resident memory."""
import atexit, functools, json, os
import fsdp_convert.ops.consolidate, fsdp_convert.ops._consolidate_rank

LOG = os.environ["DRY_RUN_TEST_LOG"]


def record(role):
    with open("/proc/self/status") as f:
        peak = next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM:"))
    with open(os.path.join(LOG, f"{os.getpid()}.json"), "w") as f:
        json.dump({"pid": os.getpid(), "role": role, "peak": peak}, f)


atexit.register(record, "process")  # the CLI's process and the forkserver's helpers, at their exit
_run_rank = fsdp_convert.ops._consolidate_rank.consolidate_rank


@functools.wraps(_run_rank)  # same name and module: the launcher pickles it by reference
def consolidate_rank(job, rank, world_size, group):
    result = _run_rank(job, rank, world_size, group)
    record(f"rank{rank}")  # a worker leaves with os._exit: no atexit
    return result


fsdp_convert.ops.consolidate.consolidate_rank = fsdp_convert.ops._consolidate_rank.consolidate_rank = consolidate_rank
'''


def _cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "fsdp_convert", *args], capture_output=True, text=True, timeout=300, env=env)


def _tree(*roots: Path) -> dict[str, tuple[int, int]]:
    """Every path under ``roots`` (hidden ones too), with its size and mtime."""
    found = {}
    for root in roots:
        for dirpath, dirnames, filenames in os.walk(root):
            for name in dirnames + filenames:
                st = os.lstat(os.path.join(dirpath, name))
                found[os.path.join(dirpath, name)] = (st.st_size, st.st_mtime_ns)
    return found


def _size(path: Path) -> int:
    """A file's size, or the sum of a folder's files', in bytes."""
    if path.is_file():
        return path.stat().st_size
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


COMMANDS = {
    "consolidate-torch": ("consolidate", "full.pt"),
    "consolidate-hf": ("consolidate", "hf"),
    "consolidate-safetensors": ("consolidate", "model.safetensors"),
    "reshard": ("reshard", "ws2"),
}


def _args(name: str, ckpt: Path, out: Path) -> list[str]:
    command, _ = COMMANDS[name]
    extra = ["--world-size", "2"] if command == "reshard" else []
    return [command, str(ckpt), str(out), *extra]


@pytest.mark.parametrize("name", sorted(COMMANDS))
def test_dry_run_prints_the_plan_and_creates_nothing(ws3_ckpt: Sample, tmp_path: Path, name: str) -> None:
    out = tmp_path / COMMANDS[name][1]
    before = _tree(tmp_path, ws3_ckpt.checkpoint)
    start = time.monotonic()
    proc = _cli(*_args(name, ws3_ckpt.checkpoint, out), "--dry-run", "--nproc", "2")
    seconds = time.monotonic() - start
    assert proc.returncode == 0, proc.stderr
    assert _tree(tmp_path, ws3_ckpt.checkpoint) == before  # no OUT, no lock, no temporary, no folder
    lines = proc.stdout.splitlines()
    assert lines[0] == f"dry run of {COMMANDS[name][0]}: nothing was written"
    for word in ("producer    fsdp2", "workers     2", "memory      at most", "space       needs", "time        about"):
        assert any(line.startswith("  " + word) for line in lines), (word, proc.stdout)
    assert max(len(line) for line in lines) <= 80, proc.stdout
    print(f"\n{name}: --dry-run took {seconds:.2f} s of wall (the CLI's start-up included)")


def test_dry_run_json_is_one_document_and_bounds_the_output_size(ws3_ckpt: Sample, tmp_path: Path) -> None:
    for name in sorted(COMMANDS):
        out = tmp_path / COMMANDS[name][1]
        proc = _cli(*_args(name, ws3_ckpt.checkpoint, out), "--dry-run", "--json")
        assert proc.returncode == 0, proc.stderr
        plan = json.loads(proc.stdout)
        assert plan["dry_run"] is True and plan["fits"] is True
        assert not out.exists()
        run = _cli(*_args(name, ws3_ckpt.checkpoint, out), "-q")
        assert run.returncode == 0, run.stderr
        real = _size(out)
        print(f"\n{name}: planned {plan['output_bytes']} B, wrote {real} B ({real / plan['output_bytes']:.2f})")
        assert real <= plan["output_bytes"]  # the space check asks for what the run then holds to
        assert real >= 0.75 * plan["output_bytes"]  # and not far off (item records, .metadata: a few hundred bytes each)
        if out.is_dir():  # every file the plan places is written
            written = {p.relative_to(out).as_posix() for p in out.rglob("*") if p.is_file()}
            assert {f["name"] for f in plan["files"]} <= written


@pytest.mark.parametrize("nproc", [1, 2])
def test_dry_run_peak_memory_bounds_the_run(ws3_ckpt: Sample, tmp_path: Path, nproc: int) -> None:
    out = tmp_path / "full.pt"
    args = ["consolidate", str(ws3_ckpt.checkpoint), str(out), "--nproc", str(nproc)]
    proc = _cli(*args, "--dry-run", "--json")
    assert proc.returncode == 0, proc.stderr
    plan = json.loads(proc.stdout)
    hooks, log = tmp_path / "hooks", tmp_path / "log"
    hooks.mkdir()
    log.mkdir()
    (hooks / "sitecustomize.py").write_text(HOOK)
    path = os.pathsep.join(filter(None, [str(hooks), os.environ.get("PYTHONPATH")]))
    env = {**os.environ, "PYTHONPATH": path, "DRY_RUN_TEST_LOG": str(log)}
    # the largest peak of any process the probe waited for (the CLI's, its children's it waited for)
    probe = "import resource, subprocess, sys; subprocess.run(sys.argv[1:], check=True); "
    probe += "import os; print(os.getpid(), resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024)"
    run = subprocess.run(
        [sys.executable, "-c", probe, sys.executable, "-m", "fsdp_convert", *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stderr
    probe_pid, maxrss = (int(word) for word in run.stdout.split()[-2:])
    records = [r for p in log.iterdir() if (r := json.loads(p.read_text()))["pid"] != probe_pid]
    ranks = sorted(r["role"] for r in records if r["role"].startswith("rank"))
    assert ranks == ([f"rank{k}" for k in range(nproc)] if nproc > 1 else []), records  # --nproc 1 runs in-process
    report = ", ".join(f"{r['role']} {r['peak'] / 2**20:.0f} MiB" for r in records)
    print(
        f"\n--nproc {nproc}: measured {report} (ru_maxrss {maxrss / 2**20:.0f} MiB); planned "
        f"{plan['peak_process_bytes'] / 2**20:.0f} MiB per process, {plan['peak_tree_bytes'] / 2**20:.0f} MiB in all"
    )
    assert max(r["peak"] for r in records) <= plan["peak_process_bytes"], report
    assert maxrss <= plan["peak_process_bytes"]
    assert sum(r["peak"] for r in records) <= plan["peak_tree_bytes"], report
    assert len(records) <= plan["processes"]


def test_dry_run_refuses_what_the_run_refuses(ws3_ckpt: Sample, tmp_path: Path) -> None:
    out = tmp_path / "full.pt"
    out.write_bytes(b"taken")
    proc = _cli("consolidate", str(ws3_ckpt.checkpoint), str(out), "--dry-run")
    assert proc.returncode == 4, proc.stderr  # exists, no --overwrite: as the run
    assert out.read_bytes() == b"taken"
    proc = _cli("consolidate", str(ws3_ckpt.checkpoint), str(out), "--dry-run", "--overwrite")
    assert proc.returncode == 0, proc.stderr
    assert out.read_bytes() == b"taken" and sorted(os.listdir(tmp_path)) == ["full.pt"]


def test_library_dry_run_returns_a_frozen_plan_and_creates_nothing(ws3_ckpt: Sample, tmp_path: Path) -> None:
    before = _tree(tmp_path, ws3_ckpt.checkpoint)
    plans = [
        dry_run_consolidate(ws3_ckpt.checkpoint, tmp_path / "full.pt", nproc=2),
        dry_run_reshard(ws3_ckpt.checkpoint, tmp_path / "ws4", world_size=4),
    ]
    assert _tree(tmp_path, ws3_ckpt.checkpoint) == before
    for plan in plans:
        assert isinstance(plan, RunPlan)
        with pytest.raises(AttributeError):
            plan.workers = 3  # type: ignore[misc]
        doc = json.loads(json.dumps(plan.to_json_dict()))
        assert doc["output_bytes"] == sum(f["nbytes"] for f in doc["files"]) or doc["command"] == "reshard"
        assert sum(doc["worker_bytes"]) == doc["read_bytes"]
        assert doc["probe_bytes"] > 0 and doc["seconds"] is not None
        assert all(len(line) <= 80 for line in plan.lines())
    assert plans[0].workers == 2 and len(plans[0].worker_bytes) == 2
    assert {f.name for f in plans[1].files} >= {"__0_0.distcp", "__3_0.distcp", ".metadata"}
