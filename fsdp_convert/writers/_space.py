"""Space check before any data is read: the plan knows every output byte, so a run that cannot fit fails at once."""

from __future__ import annotations

import os
import resource
from pathlib import Path

from fsdp_convert.errors import OutputWriteError
from fsdp_convert.progress import human_bytes
from fsdp_convert.writers._atomic import temporary_path

__all__ = ["check_space", "free_bytes"]


def _existing(folder: Path) -> Path:
    """``folder``, or its nearest ancestor that exists (the output's folder is created later)."""
    while not folder.exists() and folder != folder.parent:
        folder = folder.parent
    return folder


def free_bytes(folder: Path) -> int:
    """Bytes an unprivileged writer may still use on ``folder``'s filesystem (``f_bavail * f_frsize``)."""
    st = os.statvfs(_existing(folder))
    return st.f_bavail * st.f_frsize


def _used_bytes(path: Path) -> int:
    """Bytes already allocated to an earlier run's temporary (a resumed run only adds the rest)."""
    try:
        if path.is_dir():
            return sum(p.lstat().st_blocks * 512 for p in path.rglob("*") if p.is_file())
        return path.lstat().st_blocks * 512
    except FileNotFoundError:
        return 0


def check_space(output: Path, needed_bytes: int, *, directory: bool, tag: str | None, shown: object = None) -> None:
    """Refuse a run whose output cannot fit where its temporary is written, before anything is read or created.

    The temporary (``writers._atomic.temporary_path``) is written in ``output``'s folder; an
    existing ``output`` replaced with ``--overwrite`` stays until the final rename, so the whole
    size is needed. Bytes an earlier run's temporary already holds (``--resume``) count as there.

    Args:
        output: the local output path (for a remote output, its local staging copy).
        needed_bytes: the output's size from the plan, in bytes.
        directory: whether the output is a folder.
        tag: the run's shared tag (``launch.shared_tag``), which names the temporary.
        shown: the output to name in the message (a remote URL), default ``output``.

    A file output must also fit this process's file-size limit (``RLIMIT_FSIZE``, ``ulimit -f``),
    which a write past it would meet as SIGXFSZ / EFBIG.

    Raises:
        OutputWriteError: ``needed_bytes`` exceed the free bytes there (one line: needed, free, where),
            or a file output exceeds the file-size limit.
    """
    tmp = temporary_path(output, tag, directory=directory)
    limit = resource.getrlimit(resource.RLIMIT_FSIZE)[0]
    if not directory and limit != resource.RLIM_INFINITY and needed_bytes > limit:
        raise OutputWriteError(
            f"cannot write {shown or output}: File too large: it needs {human_bytes(needed_bytes, units='decimal')} but "
            f"this process may write files of at most {human_bytes(limit, units='decimal')} (RLIMIT_FSIZE, ulimit -f); "
            "raise the limit or pass --no-space-check"
        )
    needed = needed_bytes - _used_bytes(tmp)
    free = free_bytes(output.parent)
    if needed <= free:
        return
    if shown is None or shown == output:
        where = f"(its temporary {tmp.name} is written there)"
    else:
        where = "(its local copy is written there, then uploaded; set TMPDIR to a larger folder)"
    raise OutputWriteError(
        f"cannot write {shown or output}: No space left on device: it needs {human_bytes(needed, units='decimal')} but "
        f"{_existing(output.parent)} has {human_bytes(free, units='decimal')} free {where}; free space or pass --no-space-check"
    )
