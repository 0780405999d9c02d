"""``--resume`` of a job that spans processes: two elastic agents on this machine as two nodes, and the CLI as the workers of
the user's own torchrun.

The job is SIGKILLed half way through its writes (the hook of ``tests/_resume.py``, in every process of the job), then run
again with ``--resume`` under another job id (a requeued job's, torchrun ``--standalone``'s random one): it finds the
temporary the killed job left, and the output is byte for byte what an uninterrupted run writes, with only the missing
records read. Each case prints a row of the fault table.
"""

from __future__ import annotations

import fcntl
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from fsdp_convert.lock_record import LockRecord, pid_alive
from tests._dist import free_port
from tests._resume import CASES, Reference, check_rereads, logged_records, manifest_of, read_log, run_env, same_output
from tests._samples import Sample

pytestmark = pytest.mark.slow

TIMEOUT_S = 180


def _two_nodes(argv: list[str], run_id: str, env: dict[str, str]) -> list[tuple[int, str]]:
    """Run ``argv`` as a job of two nodes (c10d rendezvous on 127.0.0.1, one worker each): each node's exit code and stderr."""
    port = free_port()
    nodes = []
    for node_rank in (0, 1):
        cluster = ["--nnodes", "2", "--node-rank", str(node_rank), "--nproc-per-node", "1"]
        cluster += ["--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", run_id]
        nodes.append(
            subprocess.Popen(
                [sys.executable, "-m", "fsdp_convert", *argv, *cluster],
                env=env,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.PIPE,
                text=True,
                start_new_session=True,  # its own process group: the hook's SIGKILL takes one node
            )
        )
    try:
        stderrs = [node.communicate(timeout=TIMEOUT_S)[1] for node in nodes]
        return [(node.returncode, stderr) for node, stderr in zip(nodes, stderrs, strict=True)]
    finally:
        for node in nodes:
            if node.poll() is None:
                os.killpg(node.pid, signal.SIGKILL)
                node.communicate()


def _torchrun(argv: list[str], env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    """``torchrun --standalone --nproc-per-node 2 -m fsdp_convert ARGV``: every worker is one rank (a random run id each time)."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", "-m", "fsdp_convert", *argv]
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=TIMEOUT_S, start_new_session=True)


def _argv(case: str, ws3_ckpt: Sample, folder: Path) -> list[str]:
    """The case's arguments without ``--nproc``: the job's processes are its workers."""
    args, out_name = CASES[case]
    argv = [a.format(ck=ws3_ckpt.checkpoint, out=folder / out_name) for a in args]
    at = argv.index("--nproc")
    return argv[:at] + argv[at + 2 :]


def _wait_for_lock_holder(folder: Path, timeout_s: float = 30.0) -> None:
    """Wait until the process a lock in ``folder`` names has exited (at most ``timeout_s`` seconds).

    torchrun starts each worker in a session of its own, so the rank that got its SIGTERM may still
    be writing its note and releasing the lock when torchrun has returned; a scheduler starts the
    next job once the last one's processes are gone.
    """
    deadline = time.monotonic() + timeout_s
    for lock in folder.glob(".*.lock"):
        try:
            record = LockRecord.parse(lock.read_text())
        except FileNotFoundError:
            continue  # released meanwhile
        while record is not None and pid_alive(record.pid) and time.monotonic() < deadline:
            time.sleep(0.05)
        while _flock_held(lock) and time.monotonic() < deadline:  # the other rank, which joined it, exiting too
            time.sleep(0.05)


def _flock_held(lock: Path) -> bool:
    """Whether a process still holds ``lock``'s flock (each rank of a job holds it shared)."""
    try:
        fd = os.open(lock, os.O_RDONLY)
    except FileNotFoundError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(fd)  # closing drops the flock taken here
    return False


def _left(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir() if p.name.startswith("."))


def _finish(case: str, argv: list[str], folder: Path, ref: Reference, logged: dict[tuple[str, int, int], str]) -> tuple[int, int]:
    """After the resumed run: the output is identical, nothing is left beside it, only missing records were read."""
    same_output(folder / CASES[case][1], ref[0])
    assert _left(folder) == [], "temporary, manifest or lock left"
    return check_rereads(read_log(folder / "resume-reads"), ref, logged, whole_records=case != "reshard", nothing_missing=False)


@pytest.mark.parametrize("case", ["pt", "reshard"])
def test_a_two_node_job_killed_mid_write_resumes_under_another_job_id(
    case: str, ws3_ckpt: Sample, resume_references: dict[str, Reference], resume_hook: Path, tmp_path: Path
) -> None:
    ref = resume_references[case]
    argv = _argv(case, ws3_ckpt, tmp_path)
    half = ref[2] // 2 // 2  # each node's worker moves about half of what one process moves alone
    killed = _two_nodes(argv, "job-a", run_env(hook=resume_hook, kill={"RESUME_TEST_KILL_AFTER": str(half)}))
    # a node dies by its own SIGKILL; the other too, or it fails on the lost peer and keeps the temporary
    codes = [code for code, _ in killed]
    assert -signal.SIGKILL in codes and set(codes) <= {-signal.SIGKILL, 1}, killed
    for code, stderr in killed:
        if code == 1:
            assert stderr.strip().endswith("is kept: run again with --resume to finish it, or remove it"), stderr
    assert not (tmp_path / CASES[case][1]).exists()
    assert [name for name in _left(tmp_path) if ".tmp-" in name] == [
        f".{Path(CASES[case][1]).stem}.tmp-rdzv-job-a" + (".pt" if case == "pt" else "")
    ]
    logged = logged_records(manifest_of(tmp_path))
    assert logged, "the job was killed before it logged a record"
    assert len({p.name for p in manifest_of(tmp_path).glob("records-*.jsonl")}) == 2, "each rank logs its own records"

    resumed = _two_nodes([*argv, "--resume"], "job-b", run_env(logs=tmp_path / "resume-reads"))
    assert [code for code, _ in resumed] == [0, 0], resumed
    reread, full = _finish(case, argv, tmp_path, ref, logged)
    row = f"{case}, 2 nodes, half way | identical; {len(logged)} records kept, resumed as another job id | {reread} of {full}"
    print(f"\n| SIGKILL of both nodes | {row} bytes read again |")


@pytest.mark.parametrize("killed_ranks", ["both", "1"])
def test_a_users_torchrun_job_killed_mid_write_resumes(
    killed_ranks: str, ws3_ckpt: Sample, resume_references: dict[str, Reference], resume_hook: Path, tmp_path: Path
) -> None:
    """An HF folder by ``torchrun --standalone`` (2 workers) with both workers, or rank 1 alone, SIGKILLed half way (rank 0
    then loses its peer, or gets torchrun's SIGTERM, and keeps the temporary); a new torchrun (a new random run id) with
    ``--resume`` finishes it."""
    ref = resume_references["hf"]
    argv = _argv("hf", ws3_ckpt, tmp_path)
    kill = {"RESUME_TEST_KILL_AFTER": str(ref[2] // 2 // 2)}
    if killed_ranks != "both":
        kill["RESUME_TEST_KILL_RANK"] = killed_ranks
    killed = _torchrun(argv, run_env(hook=resume_hook, kill=kill))
    # torchrun starts each worker in a session of its own: it reports the killed ones and exits 1
    assert killed.returncode == 1, killed.stderr[-2000:]
    if killed_ranks != "both":
        errors = [line for line in killed.stderr.splitlines() if line.startswith("error: ")]
        assert len(errors) == 1, killed.stderr[-4000:]
        (line,) = errors
        assert line.endswith("is kept: run again with --resume to finish it, or remove it"), line
    (tmp,) = [name for name in _left(tmp_path) if ".tmp-" in name]
    assert tmp.startswith(".hf.tmp-torchrun-"), tmp
    logged = logged_records(manifest_of(tmp_path))
    assert logged, "the job was killed before it logged a record"

    _wait_for_lock_holder(tmp_path)
    resumed = _torchrun([*argv, "--resume"], run_env(logs=tmp_path / "resume-reads"))
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    reread, full = _finish("hf", argv, tmp_path, ref, logged)
    row = f"identical; {len(logged)} records kept, resumed by a new torchrun | {reread} of {full}"
    fault = "SIGKILL of torchrun's 2 workers" if killed_ranks == "both" else "SIGKILL of torchrun's rank 1"
    print(f"\n| {fault}, half way | HF folder | {row} bytes read again |")
