"""Resume's reads of an interrupted run's manifest folder: regular files only, bounded by the plan, never blocking.

The manifest folder (``writers._manifest``) sits beside OUT, where anyone who can write OUT's
folder can put anything: a FIFO ``manifest.json`` would block ``--resume`` for good, a 2 GiB
sparse ``records-0.jsonl`` would be read whole. Each file is opened ``O_NOFOLLOW | O_NONBLOCK``,
must be a regular file no larger than what the plan can have written (``manifest_limit_bytes``,
``logs_limit_bytes``), and the logs are read line by line, a line longer than any record's
skipped. A file that fails is refused in one line naming it and the way forward. Nothing here
imports torch.
"""

from __future__ import annotations

import errno
import json
import os
import stat
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from fsdp_convert.errors import OutputWriteError
from fsdp_convert.writers._nofollow import link_refused

__all__ = ["manifest_limit_bytes", "logs_limit_bytes", "UNPLANNED_LIMIT_BYTES", "read_json", "check_logs", "logged_lines"]

# the manifest holds a name and a state per output file and per data file; a log line is ~100-600
# bytes, and a record may be logged again by a later resume
_MANIFEST_BASE_BYTES, _MANIFEST_BYTES_PER_FILE = 1 << 20, 8 << 10
_LOGS_BASE_BYTES, _LOG_BYTES_PER_RECORD = 1 << 20, 4 << 10
_LOG_LINE_MAX_BYTES = 64 << 10  # a longer line is no record's: skipped, read in pieces
UNPLANNED_LIMIT_BYTES = 1 << 30  # where no plan bounds them (a left temporary's progress, for a message)


def manifest_limit_bytes(files: int) -> int:
    """The largest manifest a plan of ``files`` output and data files writes, in bytes."""
    return _MANIFEST_BASE_BYTES + _MANIFEST_BYTES_PER_FILE * files


def logs_limit_bytes(records: int) -> int:
    """The most bytes the records files of a plan of ``records`` records hold together."""
    return _LOGS_BASE_BYTES + _LOG_BYTES_PER_RECORD * records


def _open(path: Path, tmp: Path, max_bytes: int) -> int:
    """A descriptor of ``path``, a file of ``tmp``'s manifest folder: no link, no FIFO to block on, at most ``max_bytes``.

    Raises:
        FileNotFoundError: it is missing.
        OutputWriteError: it cannot be opened, is not a regular file, or is larger (naming it, and the way forward).
    """
    forward = f"remove {tmp} and run without --resume"
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        raise  # the caller says what a missing file means
    except OSError as e:
        if e.errno == errno.ELOOP:  # O_NOFOLLOW met a link: refused as every link where this tool writes
            raise link_refused(path) from e
        raise OutputWriteError(f"cannot resume {tmp}: cannot open {path} ({e.strerror}); {forward}") from e
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode) or st.st_size > max_bytes:
        os.close(fd)
        what = (
            "is not a regular file" if not stat.S_ISREG(st.st_mode) else f"is larger than this run's can be ({max_bytes} bytes)"
        )
        raise OutputWriteError(f"cannot resume {tmp}: {path} {what}; {forward}")
    return fd


def read_json(path: Path, tmp: Path, max_bytes: int) -> dict[str, Any]:
    """The JSON object in ``path`` (at most ``max_bytes``).

    Raises:
        OutputWriteError: as ``_open``.
        ValueError: not UTF-8 JSON, or not an object.
    """
    with os.fdopen(_open(path, tmp, max_bytes), "rb") as f:
        obj = json.loads(f.read(max_bytes + 1).decode("utf-8"))
    if not isinstance(obj, dict):
        raise ValueError("not a JSON object")
    return obj


def check_logs(folder: Path, tmp: Path, max_bytes: int) -> None:
    """Raise unless ``folder``'s records files are regular files of at most ``max_bytes`` together; reads none.

    Raises:
        OutputWriteError: naming the first that is not, and the way forward.
    """
    for log in sorted(folder.glob("records-*.jsonl")):
        fd = _open(log, tmp, max_bytes)
        max_bytes -= os.fstat(fd).st_size
        os.close(fd)


def logged_lines(folder: Path, tmp: Path, max_bytes: int = UNPLANNED_LIMIT_BYTES) -> Iterable[list[Any]]:
    """Every complete line of every records file of ``folder``, parsed (a torn last line, a SIGKILL mid-append, is skipped).

    Raises:
        OutputWriteError: a records file is not a regular file, or larger than ``max_bytes``.
    """
    for log in sorted(folder.glob("records-*.jsonl")):
        with os.fdopen(_open(log, tmp, max_bytes), "rb") as f:
            inside_long = False  # inside a line longer than any record's: skipped to its end
            while line := f.readline(_LOG_LINE_MAX_BYTES):
                whole, inside_long = not inside_long and line.endswith(b"\n"), not line.endswith(b"\n")
                if whole:
                    try:
                        yield json.loads(line)
                    except ValueError:
                        continue
