"""Worker output stays readable: other ranks' warnings and log records carry ``[rank N]``."""

from __future__ import annotations

import subprocess
import sys

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
