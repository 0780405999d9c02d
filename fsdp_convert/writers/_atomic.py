"""Temporary-sibling outputs renamed into place only when complete."""

from __future__ import annotations

import contextlib
import errno
import os
import uuid
from collections.abc import Iterator
from pathlib import Path

from fsdp_convert.errors import OutputExistsError, OutputWriteError

__all__ = ["atomic_output", "check_output_free", "fsync_dir"]

_WRITE_ERRNOS = {errno.ENOSPC, errno.EDQUOT, errno.EACCES, errno.EPERM, errno.EROFS, errno.EFBIG, errno.EIO}


def check_output_free(output: Path, *, overwrite: bool) -> None:
    """Raise unless ``output`` may be written.

    Raises:
        OutputExistsError: ``output`` exists and ``overwrite`` is false.
        OutputWriteError: ``output`` is an existing folder where a file is wanted.
    """
    if output.exists() or output.is_symlink():
        if not overwrite:
            raise OutputExistsError(f"{output} already exists; pass --overwrite to replace it")
        if output.is_dir():
            raise OutputWriteError(f"{output} is a folder; give a file path")


def fsync_dir(path: Path) -> None:
    """Fsync a folder so a rename inside it is durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@contextlib.contextmanager
def atomic_output(output: Path, *, overwrite: bool) -> Iterator[Path]:
    """Yield a temporary sibling path; rename it onto ``output`` if the block completes.

    The block must write, flush and fsync the temporary file. On any exception (including
    KeyboardInterrupt) the temporary is removed and ``output`` is left untouched; an existing
    ``output`` is replaced only by the final ``os.replace``.

    Raises:
        OutputExistsError: ``output`` exists and ``overwrite`` is false.
        OutputWriteError: the folder cannot be created or written (permission, space).
    """
    check_output_free(output, overwrite=overwrite)
    try:
        output.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise OutputWriteError(f"cannot create {output.parent}: {e.strerror}") from e
    tmp = output.parent / f".{output.name}.tmp-{uuid.uuid4().hex[:12]}"
    try:
        yield tmp
        check_output_free(output, overwrite=overwrite)  # someone may have created it meanwhile
        os.replace(tmp, output)
        fsync_dir(output.parent)
    except OSError as e:
        with contextlib.suppress(FileNotFoundError):
            tmp.unlink()
        if e.errno in _WRITE_ERRNOS:
            raise OutputWriteError(f"cannot write {output}: {e.strerror}") from e
        raise
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            tmp.unlink()
        raise
