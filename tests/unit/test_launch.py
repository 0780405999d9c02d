"""Worker output stays readable: other ranks' warnings and log records carry ``[rank N]``."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

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
    from fsdp_convert.launch import _PEER_LOST, _failure

    lost = {
        "rank": 0,
        "type": None,
        "message": f"{_PEER_LOST} at 127.0.0.1:1234 (that worker, or its node, died)",
        "traceback": "",
    }
    (tmp_path / "rank0.json").write_text(json.dumps(lost))
    # the launcher's failures name rank 0 alone (rank 1's SIGKILL not seen yet)
    err = _failure(tmp_path, {0: 1}, range(2))
    assert str(err) == "worker rank 1 died without a report (its peers lost their connections to it)"
    assert str(_failure(tmp_path, {0: 1, 1: -9}, range(2))).startswith("worker rank 1 died without a report (killed by SIGKILL")
    # without the job's ranks (many nodes) or with two silent ranks, rank 0's own line is the cause
    assert str(_failure(tmp_path, {0: 1})).startswith(f"worker rank 0 failed: {_PEER_LOST}")
    assert str(_failure(tmp_path, {0: 1}, range(3))).startswith(f"worker rank 0 failed: {_PEER_LOST}")
