"""Run one attack as a user would: ``python -m fsdp_convert ARGS`` in a fresh process, timed and measured.

Each red-team test (``tests/redteam/``) crafts its input in ``tmp_path``, runs the command through
``attack`` and asserts the exit code, the one-line message, the wall time and the peak RSS. The
run is a subprocess of its own so that a hang is cut off (``timeout``, then SIGKILL of its whole
process group) and its peak RSS is its own (``os.wait4``'s ``ru_maxrss``, which covers the
children it waited for, e.g. a forkserver's workers).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

# the bound for a worst-case input of at most 1 MB, on any command
SECONDS_BOUND = 5.0
RSS_BOUND_BYTES = 512 * 2**20


@dataclass(frozen=True)
class Attack:
    """What one command did: exit code (``None`` when it was killed at the timeout), output, wall and peak RSS."""

    code: int | None
    stdout: str
    stderr: str
    seconds: float
    max_rss_bytes: int

    @property
    def error_lines(self) -> list[str]:
        """stderr's ``error: ...`` lines."""
        return [line for line in self.stderr.splitlines() if line.startswith("error:")]


def attack(
    args: Sequence[str | os.PathLike[str]],
    *,
    cwd: Path | None = None,
    env: Mapping[str, str] | None = None,
    timeout: float = 60.0,
    python_args: Sequence[str] = (),
) -> Attack:
    """``python [PYTHON_ARGS] -m fsdp_convert ARGS`` in a new process group; killed (code None) past ``timeout`` seconds.

    ``env`` is added to this process's environment (``OMP_NUM_THREADS=1``, and the checkout on
    ``PYTHONPATH`` so the command imports this tree wherever ``cwd`` is).
    """
    full_env = dict(os.environ)
    full_env["OMP_NUM_THREADS"] = "1"
    root = str(Path(__file__).resolve().parents[2])
    full_env["PYTHONPATH"] = root + (os.pathsep + full_env["PYTHONPATH"] if full_env.get("PYTHONPATH") else "")
    full_env.update(env or {})
    argv = [sys.executable, *python_args, "-m", "fsdp_convert", *map(os.fspath, args)]
    with tempfile.TemporaryDirectory() as scratch:
        out_path, err_path, rss_path = (Path(scratch) / name for name in ("out", "err", "rss"))
        start = time.monotonic()
        with open(out_path, "wb") as out, open(err_path, "wb") as err:
            proc = subprocess.Popen(
                [sys.executable, "-c", _MEASURE, str(rss_path), *argv],
                cwd=cwd,
                env=full_env,
                stdout=out,
                stderr=err,
                start_new_session=True,
            )
            try:
                proc.wait(timeout=timeout)
                killed = False
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
                killed = True
        seconds = time.monotonic() - start
        code: int | None = None
        max_rss_bytes = 0
        if not killed:
            code, max_rss_bytes = (int(n) for n in rss_path.read_text().split())
        return Attack(
            code=code,
            stdout=out_path.read_text(errors="replace"),
            stderr=err_path.read_text(errors="replace"),
            seconds=seconds,
            max_rss_bytes=max_rss_bytes,
        )


# A small interpreter starts the command and reaps it with wait4: the command's ru_maxrss (which
# covers the descendants it reaped, a forkserver's workers) then starts from this small process's
# RSS, not from the test process's (a forked child counts its parent's pages: pytest holds over 1 GB)
_MEASURE = """
import os, sys
pid = os.posix_spawn(sys.argv[2], sys.argv[2:], os.environ)
_, status, usage = os.wait4(pid, 0)
with open(sys.argv[1], "w") as f:
    f.write(f"{os.waitstatus_to_exitcode(status)} {usage.ru_maxrss * 1024}")
"""
