"""Launch stage, its failures: a failed worker's error record, and a failed launch's root cause from every worker's record.

A worker that raises leaves ``rank<N>.json`` in the launch's error folder (``error_record``) and
exits non-zero; the launcher then reads every record and exit code (``failure``): a
CheckpointError is re-raised as it was, a worker that died without a word is named by rank, and a
peer that only lost its connection to the dead one (``PEER_LOST``) is not the cause. Both
launchers use them: the local workers (``_local_workers``) and torch's elastic launcher's
(``_gloo_workers``, ``launch``).
"""

from __future__ import annotations

import json
import signal
import traceback
from collections.abc import Sequence
from pathlib import Path

from fsdp_convert import errors
from fsdp_convert.errors import CheckpointError, WorkerFailedError

__all__ = ["PEER_LOST", "error_record", "first_line", "describe_exit", "failure"]

PEER_LOST = "lost its connection to a peer worker"


def error_record(error_dir: str, rank: int, e: BaseException, message: str) -> int:
    """Write worker ``rank``'s record of ``e`` as ``<error_dir>/rank<N>.json`` for ``failure``; the exit code to end with.

    ``message`` is the one line for an error that is not a CheckpointError (a CheckpointError's own is used).
    """
    checkpoint_error = isinstance(e, CheckpointError)
    record = {
        "rank": rank,
        "type": type(e).__name__ if checkpoint_error else None,
        "message": str(e) if checkpoint_error else message,
        "cli_message": e.cli_text() if isinstance(e, CheckpointError) else None,  # the CLI's wording (flags)
        "traceback": traceback.format_exc(),
    }
    Path(error_dir, f"rank{rank}.json").write_text(json.dumps(record))
    return e.exit_code if isinstance(e, CheckpointError) else 1


def first_line(text: str) -> str:
    """The first line of ``text``, stripped."""
    return text.strip().splitlines()[0] if text.strip() else ""


def describe_exit(code: int) -> str:
    """A worker's exit code in words: ``killed by SIGKILL``, ``exit code 1``."""
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit code {code}"


def failure(
    error_dir: Path, exit_codes: dict[int, int], ranks: range | None = None, *, main_names: Sequence[str] = ()
) -> CheckpointError:
    """The root cause of a failed launch, from the workers' error records and exit codes.

    ``ranks``: every rank of the job when this node holds them all (one node), so a worker that
    died without a word is named even when the launcher reported only the peers it broke.
    ``main_names``: what the job names of the caller's main script, which each worker ran again
    before its job (``syspath.dumps_naming_main``): a worker that exited non-zero without a word
    failed there.
    """
    records = sorted((json.loads(p.read_text()) for p in error_dir.glob("rank*.json")), key=lambda r: r["rank"])
    # a CheckpointError is the root cause; the others are peers torn down after it
    for record in records:
        cls = getattr(errors, record["type"] or "", None)
        if isinstance(cls, type) and issubclass(cls, CheckpointError):
            err = cls(record["message"], cli_message=record.get("cli_message"))
            err.__notes__ = [f"worker rank {record['rank']}:\n{record['traceback']}"]
            return err
    # a worker that died without a word (SIGKILL, out of memory) broke the others' connections
    reported = {r["rank"] for r in records}
    for rank, code in sorted(exit_codes.items()):
        if rank not in reported and main_names and code > 0:
            return WorkerFailedError(
                f"worker rank {rank} failed ({describe_exit(code)}) running your script's top level again, as each worker "
                f'does to load {main_names[0]} from it: put the call under `if __name__ == "__main__":`, '
                f"or move {main_names[0]} into a module of its own"
            )
        if rank not in reported:
            return WorkerFailedError(f"worker rank {rank} died without a report ({describe_exit(code)}; out of memory?)")
    silent = [rank for rank in ranks or () if rank not in reported]
    if records and len(silent) == 1 and all(r["message"].startswith(PEER_LOST) for r in records):
        # the launcher saw the peers fail first; the one worker that said nothing is the one that died
        return WorkerFailedError(f"worker rank {silent[0]} died without a report (its peers lost their connections to it)")
    if records:  # the first worker's own error, before the peers that lost their connection to it
        first = next((r for r in records if not r["message"].startswith(PEER_LOST)), records[0])
        err = WorkerFailedError(f"worker rank {first['rank']} failed: {first['message']}")
        err.__notes__ = [first["traceback"]]
        return err
    return WorkerFailedError("the workers failed without a report")
