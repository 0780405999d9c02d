"""Temporary-sibling outputs renamed into place only when complete.

Every name written here is opened relative to a descriptor of OUT's folder and without following
a link (``writers._nofollow``): the temporary is created with ``O_EXCL`` (a folder with
``mkdir``, which never follows one), a reused one (``--resume``, a peer's) must be no link and
hold none, and the final rename is ``renameat`` in that folder, which replaces a name and never
writes through a link.

The temporary is held open from its creation to its rename, and renamed (or removed) only while
its name still is that file (``st_dev``, ``st_ino``): a temporary another process replaced (a run
given this one's temporary as its OUT, a ``mv``) is neither published nor removed
(``TemporaryReplacedError``).
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import shutil
import time
import uuid
from collections.abc import Callable, Iterator
from functools import partial
from pathlib import Path

from fsdp_convert.errors import (
    OutputExistsError,
    OutputWriteError,
    TemporaryExistsError,
    TerminatedError,
    WorkerFailedError,
)
from fsdp_convert.signals import hold_signals
from fsdp_convert.writers._lock import acquire_lock
from fsdp_convert.writers._nofollow import NOFOLLOW, link_refused, open_folder, open_nofollow, refuse_link, refuse_links_inside
from fsdp_convert.writers._output_check import check_output_free

__all__ = [
    "atomic_output",
    "check_output_free",
    "check_no_temporary",
    "fsync_dir",
    "writing",
    "LeaveToOwner",
    "temporary_path",
    "temporaries",
    "LOCAL_TAG",
    "KEPT_ON",
    "kept_note",
    "TemporaryReplacedError",
]

logger = logging.getLogger(__name__)

_WRITE_ERRNOS = {errno.ENOSPC, errno.EDQUOT, errno.EACCES, errno.EPERM, errno.EROFS, errno.EFBIG}


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


class TemporaryReplacedError(OutputWriteError):
    """The temporary's name no longer holds the file this run created (another process replaced it): nothing is published."""


def _make_temporary(tmp: Path, dir_fd: int, *, directory: bool, reuse: bool) -> int:
    """Create the temporary ``tmp`` (its name in OUT's folder ``dir_fd``), or check the one reused; return a descriptor of it.

    A new one is made exclusively (``mkdir``, ``O_EXCL``), so a link planted at its name is never
    followed. One reused (``reuse``: a peer's of this job, or ``--resume``'s) must not be a link,
    and a folder must hold none: its files are opened by name. Nor may its manifest folder
    (``writers._manifest.manifest_dir``), whose records logs are appended to; checked here, so a
    refusal leaves the interrupted run's temporary and manifest as they were.

    Returns:
        A descriptor of the temporary (the file opened for writing; the folder read-only), which
        ``atomic_output`` holds until the rename and checks the name against (``_still_held``).

    Raises:
        OutputWriteError: the name is a link (or holds one), is of the wrong kind, or cannot be made.
    """
    try:
        found = False  # a folder that was there already (a peer's, --resume's): its entries are checked
        if directory:
            try:
                os.mkdir(tmp.name, dir_fd=dir_fd)
            except FileExistsError:
                if not reuse:
                    raise
                found = True
            fd = os.open(tmp.name, os.O_RDONLY | os.O_DIRECTORY | NOFOLLOW, dir_fd=dir_fd)
        else:
            fd = open_nofollow(tmp, os.O_WRONLY | os.O_CREAT | (0 if reuse else os.O_EXCL), dir_fd=dir_fd)
        try:
            if found:
                refuse_links_inside(tmp)
            if reuse:
                from fsdp_convert.writers._manifest import manifest_dir  # here: it imports the index (torch); this module may not

                refuse_link(manifest_dir(tmp), dir_fd=dir_fd)
                if os.path.isdir(manifest_dir(tmp)):
                    refuse_links_inside(manifest_dir(tmp))
        except BaseException:
            os.close(fd)
            raise
        return fd
    except NotADirectoryError as e:  # O_DIRECTORY | O_NOFOLLOW on a link: ENOTDIR, not ELOOP
        raise (
            link_refused(tmp) if os.path.islink(tmp) else OutputWriteError(f"cannot write {tmp}: not a folder; remove it")
        ) from e
    except FileExistsError as e:
        raise link_refused(tmp) if os.path.islink(tmp) else OutputWriteError(f"cannot create {tmp}: File exists") from e
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise link_refused(tmp) from e
        raise OutputWriteError(f"cannot create {tmp}: {e.strerror}") from e


def _still_held(tmp: Path, fd: int, dir_fd: int) -> bool:
    """Whether the name ``tmp`` (in folder ``dir_fd``, not following a link) still is the file open as ``fd``."""
    try:
        st = os.stat(tmp.name, dir_fd=dir_fd, follow_symlinks=False)
    except FileNotFoundError:
        return False
    mine = os.fstat(fd)
    return (st.st_dev, st.st_ino) == (mine.st_dev, mine.st_ino)


def _replaced(output: Path, tmp: Path) -> TemporaryReplacedError:
    return TemporaryReplacedError(
        f"cannot write {output}: its temporary {tmp} was replaced by another process while this run wrote it, "
        f"so nothing was published; remove {tmp} unless another run is writing it, and run again"
    )


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


LOCAL_TAG = "local"  # the temporary's tag in a run of one process, or of workers on one node


def temporary_path(output: Path, tag: str | None, *, directory: bool) -> Path:
    """The hidden temporary sibling of ``output`` for run ``tag``: deterministic, so a later run finds it.

    ``tag`` is the shared tag of a multi-process job (``launch.shared_tag``: ``rdzv-<rdzv id>``,
    ``torchrun-<run id>``), None for a run on one node (``local``): ``.OUT.tmp-local`` for a
    folder, ``.full.tmp-local.pt`` for ``full.pt``. It keeps the suffix, so the temporary reads
    back as the same format (``consolidate --verify``).
    """
    tag = tag or LOCAL_TAG
    return output.parent / (f".{output.name}.tmp-{tag}" if directory else f".{output.stem}.tmp-{tag}{output.suffix}")


def temporaries(output: Path, *, directory: bool) -> list[Path]:
    """Every temporary of ``output`` in its folder, whatever its run's tag (an earlier version's random tag too)."""
    pattern = f".{output.name}.tmp-*" if directory else f".{output.stem}.tmp-*{output.suffix}"
    return sorted(output.parent.glob(pattern)) if output.parent.is_dir() else []


def _age(seconds: float) -> str:
    if seconds < 120:
        return f"{max(seconds, 0):.0f} s"
    if seconds < 7200:
        return f"{seconds / 60:.0f} min"
    return f"{seconds / 3600:.1f} h" if seconds < 172800 else f"{seconds / 86400:.0f} days"


def check_no_temporary(output: Path, tmp: Path, *, directory: bool, resume: bool, overwrite: bool = False) -> None:
    """Refuse when an earlier run's temporary of ``output`` is left (a SIGKILL, a lost node), or discard it with ``overwrite``.

    Called by the process that takes the output's lock, so no live run owns it. With ``resume``
    this run's own temporary (``tmp``) is kept for reuse; another run's is still refused. With
    ``overwrite`` and without ``resume`` every left temporary of ``output`` is removed, with its
    manifest (``writers._manifest.manifest_dir``), and a warning names it: the run starts afresh.

    Raises:
        TemporaryExistsError: naming the temporary, its age, and ``--resume``.
        OutputWriteError: a temporary's name is a symbolic link.
    """
    for left in temporaries(output, directory=directory):
        if left.is_symlink():
            raise link_refused(left)  # not a run's: planted, and never written through
        if resume and left == tmp:
            continue
        try:
            age = _age(time.time() - left.lstat().st_mtime)
        except FileNotFoundError:
            continue
        if overwrite and not resume:
            _discard_left(left, age)
            continue
        how = "pass --resume to continue it, or remove it" if left.name == tmp.name else "remove it (another job's)"
        raise TemporaryExistsError(f"{left} is left from an earlier run writing {output.name} ({age} old); {how}")


def _discard_left(left: Path, age: str) -> None:
    """Remove an interrupted run's temporary ``left`` and its manifest folder (``overwrite``), saying so.

    Raises:
        OutputWriteError: the manifest folder's name is a symbolic link, or either cannot be removed.
    """
    from fsdp_convert.writers._manifest import manifest_dir  # here: it imports the index (torch); this module may not

    manifest = manifest_dir(left)
    refuse_link(manifest)  # planted: never removed through
    try:
        for path in (left, manifest):
            if path.is_dir():
                shutil.rmtree(path)
            else:
                with contextlib.suppress(FileNotFoundError):
                    path.unlink()
    except OSError as e:
        raise OutputWriteError(f"cannot remove {left}, left by an interrupted run: {e.strerror}; remove it") from e
    logger.warning("--overwrite: discarded the temporary %s (%s old) left by an interrupted run; starting afresh", left, age)


KEPT_ON = (KeyboardInterrupt, TerminatedError, WorkerFailedError)
"""What may stop a run whose temporary is worth finishing: Ctrl-C, SIGTERM/SIGHUP, a failed or dead worker.

Any other error (bad input, a failed verification, a failed write: no space, permission) removes it.
"""


def kept_note(exc: BaseException) -> str | None:
    """What ``atomic_output`` said of the temporary it kept when ``exc`` stopped its block (for the error line), or None.

    A signal that arrives while an error unwinds (torchrun's SIGTERM to a worker whose peer died)
    replaces that error; the note is then found on the error it interrupted (``__context__``).
    """
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        note = getattr(current, "kept_temporary", None)
        if isinstance(note, str):
            return note
        seen.add(id(current))
        current = current.__context__
    return None


def _keep(tmp: Path, exc: BaseException, keep: Callable[[Path], str | None] | None) -> bool:
    """Whether to keep ``tmp`` after ``exc``: one of ``KEPT_ON``, and ``keep`` says why (the note set on ``exc``)."""
    if keep is None or not isinstance(exc, KEPT_ON) or not tmp.exists():
        return False
    note = keep(tmp)
    if note is None:
        return False
    setattr(exc, "kept_temporary", note)  # noqa: B010 (read back by kept_note)
    return True


@contextlib.contextmanager
def atomic_output(
    output: Path,
    *,
    overwrite: bool,
    directory: bool = False,
    tag: str | None = None,
    resume: bool = False,
    keep: Callable[[Path], str | None] | None = None,
    temporary: Path | None = None,
) -> Iterator[Path]:
    """Yield a temporary sibling path; move it onto ``output`` if the block completes.

    The temporary is created here, empty (a file with ``O_EXCL | O_NOFOLLOW``; a folder with
    ``directory=True``), in OUT's folder opened once (``dir_fd``), and the block writes or fills
    it; a reused one (``resume``, ``tag``) must be no link and hold none. The block must flush
    and fsync what it writes. On any exception (KeyboardInterrupt included) the temporary is
    removed and ``output`` is left untouched, except that with ``keep`` (a resumable run) an
    exception of ``KEPT_ON`` (Ctrl-C, SIGTERM/SIGHUP, a failed worker) keeps the temporary when
    ``keep(tmp)`` returns a note (its manifest is written): the note is set on the exception
    (``kept_note``) and the lock released. An existing ``output`` is replaced only at the end
    (a file by one ``os.replace``; a folder by moving the old one aside, renaming the new one into
    place, then deleting the old one).

    One writer per output: the lock file ``.OUT.lock`` beside it (``writers._lock``) is taken
    first and held until the end (removed on success or failure). The temporary's name is
    deterministic (``temporary_path``); one left by an earlier run is refused unless ``resume``,
    which reuses this run's own (same tag) as it is, or ``temporary``: an earlier job's that
    ``writers._temporary.find_temporary`` chose (every process of the job chose the same); without
    ``resume``, ``overwrite`` discards it with its manifest (``check_no_temporary``) and starts afresh.

    With ``tag`` (a run id every node of a multi-node run shares) the temporary's name is the same
    in every process, a folder may already exist, the job's processes share the lock (the first
    takes it, the others see its record), and a block that raises ``LeaveToOwner`` leaves without
    touching the temporary (rank 0's process renames it and removes the lock file).

    A folder at ``output`` that does not look like this tool's output is refused before, by the
    operations' ``writers._output_check.check_output`` (unless ``--force``), not here.

    Raises:
        OutputExistsError: ``output`` exists and ``overwrite`` is false, or is a link.
        OutputLockedError: another run holds the output's lock (naming its host and pid).
        TemporaryExistsError: an earlier run's temporary is left and neither ``resume`` nor ``overwrite`` is given.
        OutputWriteError: the folder cannot be created or written (permission, space), or a name
            written (the lock, the temporary) is a link.
    """
    check_output_free(output, overwrite=overwrite, force=True, directory=directory)  # force: see above
    tmp = temporary or temporary_path(output, tag, directory=directory)  # a sibling: its name is opened in OUT's folder
    try:
        output.parent.mkdir(parents=True, exist_ok=True)
        dir_fd = open_folder(output.parent)
    except OSError as e:
        raise OutputWriteError(f"cannot create {output.parent}: {e.strerror}") from e
    at = {"src_dir_fd": dir_fd, "dst_dir_fd": dir_fd}  # renameat in OUT's folder
    remove_lock = True
    try:
        lock = acquire_lock(
            output,
            tag,
            before_record=partial(check_no_temporary, output, tmp, directory=directory, resume=resume, overwrite=overwrite),
        )
        try:
            held = _make_temporary(tmp, dir_fd, directory=directory, reuse=tag is not None or resume)
        except BaseException:
            lock.release(remove=True)
            raise
    except BaseException:
        os.close(dir_fd)
        raise

    def discard() -> None:
        if _still_held(tmp, held, dir_fd):  # not a file another process put at the name
            _remove(tmp)

    try:
        try:
            yield tmp
        except LeaveToOwner:
            remove_lock = False  # rank 0's process removes it once the output is in place
            return
        # someone may have created it meanwhile
        check_output_free(output, overwrite=overwrite, force=True, directory=directory)
        if directory:
            os.fsync(held)
        if not _still_held(tmp, held, dir_fd):
            raise _replaced(output, tmp)
        if directory and os.path.lexists(output):
            _replace_folder(output, tmp, dir_fd)
        else:
            os.replace(tmp.name, output.name, **at)
        os.fsync(dir_fd)
    except TemporaryReplacedError:
        raise  # not this run's file: neither published nor removed
    except OSError as e:
        discard()
        if e.errno in _WRITE_ERRNOS:
            raise OutputWriteError(f"cannot write {output}: {e.strerror}") from e
        if e.errno == errno.EBUSY:  # a mount point that check_output_free could not see as one
            raise OutputExistsError(f"cannot replace {output}: {e.strerror} (a mount point?); name another OUT") from e
        raise
    except OutputWriteError as e:
        discard()
        # name the output the user asked for, not its temporary sibling
        raise OutputWriteError(
            str(e).replace(str(tmp), str(output)), cli_message=e.cli_text().replace(str(tmp), str(output))
        ) from e
    except BaseException as e:
        with hold_signals():  # a signal now is raised after the temporary is kept (and noted) or removed
            if not _keep(tmp, e, keep):
                discard()
        raise
    finally:
        lock.release(remove=remove_lock)
        os.close(held)
        os.close(dir_fd)


def _replace_folder(output: Path, tmp: Path, dir_fd: int) -> None:
    """Move the folder at ``output`` aside, rename ``tmp`` onto its name, then delete the old one (all in folder ``dir_fd``).

    If the second rename fails, the old folder is put back before the error goes on.
    """
    at = {"src_dir_fd": dir_fd, "dst_dir_fd": dir_fd}
    old = output.parent / f".{output.name}.old-{uuid.uuid4().hex[:12]}"
    os.replace(output.name, old.name, **at)
    try:
        os.replace(tmp.name, output.name, **at)
    except BaseException:
        with contextlib.suppress(OSError):
            os.replace(old.name, output.name, **at)
        raise
    _remove(old)
