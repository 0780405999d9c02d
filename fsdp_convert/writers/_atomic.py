"""Temporary-sibling outputs renamed into place only when complete."""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
import uuid
from collections.abc import Iterator
from pathlib import Path

from fsdp_convert.errors import OutputExistsError, OutputWriteError

__all__ = ["atomic_output", "check_output_free", "fsync_dir", "writing", "LeaveToOwner", "temporary_path"]

_WRITE_ERRNOS = {errno.ENOSPC, errno.EDQUOT, errno.EACCES, errno.EPERM, errno.EROFS, errno.EFBIG}


def check_output_free(output: Path, *, overwrite: bool, directory: bool = False) -> None:
    """Raise unless ``output`` may be written.

    Args:
        output: the final output path.
        overwrite: whether an existing output may be replaced.
        directory: whether the output is a folder (sharded outputs) rather than a file.

    Raises:
        OutputExistsError: ``output`` exists and ``overwrite`` is false.
        OutputWriteError: an existing folder where a file is wanted.
    """
    if output.exists() or output.is_symlink():
        if not overwrite:
            raise OutputExistsError(f"{output} already exists; pass --overwrite to replace it")
        if output.is_dir() and not directory:
            raise OutputWriteError(f"{output} is a folder; give a file path")


@contextlib.contextmanager
def writing(path: Path) -> Iterator[None]:
    """Turn an OSError of a failed write (no space, file too large, permission) into OutputWriteError.

    Raises:
        OutputWriteError: naming ``path`` and the reason.
    """
    try:
        yield
    except OSError as e:
        if e.errno in _WRITE_ERRNOS:
            raise OutputWriteError(f"cannot write {path}: {e.strerror}") from e
        raise


def fsync_dir(path: Path) -> None:
    """Fsync a folder so a rename inside it is durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        with contextlib.suppress(FileNotFoundError):
            path.unlink()


class LeaveToOwner(Exception):  # noqa: N818 (a signal to atomic_output, not an error)
    """Raised in an ``atomic_output`` block by a process that does not hold rank 0 of a shared job.

    Such a process (another node, another torchrun worker) shares the temporary with rank 0's
    process, which moves it into place; it neither renames nor removes it.
    """


def temporary_path(output: Path, tag: str, *, directory: bool) -> Path:
    """The hidden temporary sibling of ``output`` for run ``tag``.

    It keeps the suffix, so the temporary reads back as the same format (``consolidate --verify``).
    """
    return output.parent / (f".{output.name}.tmp-{tag}" if directory else f".{output.stem}.tmp-{tag}{output.suffix}")


@contextlib.contextmanager
def atomic_output(output: Path, *, overwrite: bool, directory: bool = False, tag: str | None = None) -> Iterator[Path]:
    """Yield a temporary sibling path; move it onto ``output`` if the block completes.

    For a file output the block creates the file at the yielded path; for a folder output
    (``directory=True``) the folder is created here and the block fills it. The block must flush
    and fsync what it writes. On any exception (KeyboardInterrupt included) the temporary is
    removed and ``output`` is left untouched; an existing ``output`` is replaced only at the end
    (a file by one ``os.replace``; a folder by moving the old one aside, renaming the new one into
    place, then deleting the old one).

    With ``tag`` (a run id every node of a multi-node run shares) the temporary's name is the same
    in every process, a folder may already exist, and a block that raises ``LeaveToOwner`` leaves
    without touching it (rank 0's process renames it).

    Raises:
        OutputExistsError: ``output`` exists and ``overwrite`` is false.
        OutputWriteError: the folder cannot be created or written (permission, space).
    """
    check_output_free(output, overwrite=overwrite, directory=directory)
    tmp = temporary_path(output, tag or uuid.uuid4().hex[:12], directory=directory)
    try:
        output.parent.mkdir(parents=True, exist_ok=True)
        if directory:
            tmp.mkdir(exist_ok=tag is not None)
    except OSError as e:
        raise OutputWriteError(f"cannot create {tmp.parent}: {e.strerror}") from e
    try:
        try:
            yield tmp
        except LeaveToOwner:
            return
        check_output_free(output, overwrite=overwrite, directory=directory)  # someone may have created it meanwhile
        if directory:
            fsync_dir(tmp)
        if directory and output.exists():
            old = output.parent / f".{output.name}.old-{uuid.uuid4().hex[:12]}"
            os.replace(output, old)
            os.replace(tmp, output)
            _remove(old)
        else:
            os.replace(tmp, output)
        fsync_dir(output.parent)
    except OSError as e:
        _remove(tmp)
        if e.errno in _WRITE_ERRNOS:
            raise OutputWriteError(f"cannot write {output}: {e.strerror}") from e
        raise
    except OutputWriteError as e:
        _remove(tmp)
        # name the output the user asked for, not its temporary sibling
        raise OutputWriteError(str(e).replace(str(tmp), str(output))) from e
    except BaseException:
        _remove(tmp)
        raise
