"""Worker output stays readable (other ranks' warnings and log records carry ``[rank N]``), and failures name their rank."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch.distributed as dist

from fsdp_convert._gloo_workers import _peers_lost_fail
from fsdp_convert.errors import WorkerFailedError

CODE = """
import logging, warnings
from fsdp_convert.launch import prefix_worker_logs
prefix_worker_logs(3)
logging.getLogger("fsdp_convert.reader").warning("a chunk was slow")
warnings.warn("a deprecation", UserWarning)
"""


def test_other_ranks_warnings_are_prefixed() -> None:
    proc = subprocess.run([sys.executable, "-c", CODE], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert lines[0] == "[rank 3] WARNING fsdp_convert.reader: a chunk was slow"
    assert lines[1].startswith("[rank 3] WARNING py.warnings: ") and "a deprecation" in lines[1]


def test_a_silent_worker_is_named_when_the_launcher_reports_only_the_peers_it_broke(tmp_path: Path) -> None:
    from fsdp_convert._worker_failures import PEER_LOST, failure

    lost = {
        "rank": 0,
        "type": None,
        "message": f"{PEER_LOST} at 127.0.0.1:1234 (that worker, or its node, died)",
        "traceback": "",
    }
    (tmp_path / "rank0.json").write_text(json.dumps(lost))
    # the launcher's failures name rank 0 alone (rank 1's SIGKILL not seen yet)
    err = failure(tmp_path, {0: 1}, range(2))
    assert str(err) == "worker rank 1 died without a report (its peers lost their connections to it)"
    assert str(failure(tmp_path, {0: 1, 1: -9}, range(2))).startswith("worker rank 1 died without a report (killed by SIGKILL")
    # without the job's ranks (many nodes) or with two silent ranks, rank 0's own line is the cause
    assert str(failure(tmp_path, {0: 1})).startswith(f"worker rank 0 failed: {PEER_LOST}")
    assert str(failure(tmp_path, {0: 1}, range(3))).startswith(f"worker rank 0 failed: {PEER_LOST}")


def test_a_torchrun_worker_that_loses_its_group_fails_as_a_failed_worker() -> None:
    """Under the user's torchrun a lost peer or any other process-group error is a WorkerFailedError (a resumable
    output's temporary is then kept); any other error passes through."""

    def raising(e: BaseException) -> object:
        def fn(job: object, rank: int, world_size: int, group: object) -> object:
            raise e

        return fn

    lost = RuntimeError("[gloo/transport/tcp/pair.cc:553] Connection closed by peer [127.0.0.1]:8087. GLHF")
    with pytest.raises(WorkerFailedError, match=r"^worker rank 0 lost its connection to a peer worker at 127\.0\.0\.1:8087"):
        _peers_lost_fail(raising(lost), None, 0, 2)
    with pytest.raises(WorkerFailedError, match=r"^worker rank 1 lost its process group: DistBackendError: timed out"):
        _peers_lost_fail(raising(dist.DistBackendError("timed out")), None, 1, 2)
    with pytest.raises(RuntimeError, match="a bug"):
        _peers_lost_fail(raising(RuntimeError("a bug")), None, 0, 2)
