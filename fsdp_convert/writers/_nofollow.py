"""Write stage, where bytes land: every name the tool writes is opened without following a link.

A name beside or inside the output (OUT, its lock ``.OUT.lock``, its temporary ``.OUT.tmp-*``, the
manifest folder and its files) may be a symbolic link that someone planted before the run, or swaps
in between a check and its use. So every such name is opened with ``O_NOFOLLOW`` (and ``O_EXCL``
where it is created), relative to a descriptor of the folder that holds it (``dir_fd``): the kernel
refuses a link at the moment of use, and no check-then-use window is left. A file that is written
in place once it exists (the lock, a records log, a resumed temporary) must also be a regular file
with no other hard link, so truncating or appending to it changes nothing else. Such a name is
refused in one line (``OutputWriteError``, exit 1) and left as it is.

OUT's own folder is opened as the user named it (a link there is the user's choice, e.g.
``/scratch -> /mnt/big``); folders the tool creates (the temporary, the manifest folder) are not.
Nothing here imports torch.
"""

from __future__ import annotations

import errno
import os
import stat
from pathlib import Path

from fsdp_convert.errors import OutputWriteError

__all__ = ["link_refused", "refuse_link", "refuse_links_inside", "open_folder", "open_in", "open_nofollow", "NOFOLLOW"]

NOFOLLOW = os.O_NOFOLLOW | os.O_CLOEXEC
_LINK_ERRNOS = {errno.ELOOP, errno.EMLINK}  # what open(O_NOFOLLOW) gives for a link: Linux ELOOP, some BSDs EMLINK


def link_refused(path: Path | str) -> OutputWriteError:
    """The one line refusing a symbolic link at ``path``, a name this tool writes."""
    return OutputWriteError(
        f"cannot write {path}: it is a symbolic link, and fsdp-convert writes through no link; remove it or name another OUT"
    )


def refuse_link(path: Path, *, dir_fd: int | None = None) -> None:
    """Raise if ``path`` (a name, with ``dir_fd``) is a symbolic link; an absent name passes.

    Raises:
        OutputWriteError: it is a link.
    """
    try:
        st = os.stat(path.name if dir_fd is not None else path, dir_fd=dir_fd, follow_symlinks=False)
    except FileNotFoundError:
        return
    if stat.S_ISLNK(st.st_mode):
        raise link_refused(path)


def refuse_links_inside(folder: Path) -> None:
    """Raise if any entry under ``folder`` (a left temporary about to be reused) is a symbolic link.

    A worker opens the files of a temporary folder by name; one planted as a link would be written
    through. A folder this run made holds none; one it reuses (``--resume``, a peer's) is checked
    here, entry by entry, without following a link.

    Raises:
        OutputWriteError: naming the first link found, or an entry that is not a file or folder.
    """
    pending = [folder]
    while pending:
        try:
            entries = os.scandir(pending.pop())
        except FileNotFoundError:
            continue  # removed meanwhile (by a peer of the job): nothing in it to write through
        with entries:
            for entry in entries:
                if entry.is_symlink():
                    raise link_refused(entry.path)
                if entry.is_dir(follow_symlinks=False):
                    pending.append(Path(entry.path))
                elif not entry.is_file(follow_symlinks=False):
                    raise OutputWriteError(f"cannot write {entry.path}: not a regular file; remove it")


def open_folder(path: Path, *, follow: bool = True) -> int:
    """A descriptor of folder ``path`` to open names relative to (``dir_fd``); close it with ``os.close``.

    Args:
        path: the folder.
        follow: False for a folder this tool made (a link there is refused); True for OUT's own
            folder, as the user named it.

    Raises:
        OutputWriteError: ``path`` is a link (``follow=False``) or not a folder.
        FileNotFoundError: it does not exist.
    """
    flags = os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC | (0 if follow else os.O_NOFOLLOW)
    try:
        return os.open(path, flags)
    except NotADirectoryError as e:
        if not follow and os.path.islink(path):
            raise link_refused(path) from e
        raise OutputWriteError(f"cannot write {path}: not a folder") from e
    except OSError as e:
        if e.errno in _LINK_ERRNOS:
            raise link_refused(path) from e
        raise


def open_nofollow(path: Path, flags: int, *, dir_fd: int | None = None, mode: int = 0o644) -> int:
    """Open ``path`` (its name relative to ``dir_fd``, if given) with ``O_NOFOLLOW``; an existing file must stand alone.

    With ``O_CREAT | O_EXCL`` the file is new. Otherwise a file that already exists must be a
    regular file with one link (``st_nlink == 1``), so writing it changes no other name.

    Args:
        path: the file (shown in messages).
        flags: ``os.O_*`` flags; ``O_NOFOLLOW`` and ``O_CLOEXEC`` are added.
        dir_fd: the folder holding ``path``, or None to open ``path`` as given.
        mode: permission bits of a file created.

    Returns:
        The open descriptor.

    Raises:
        OutputWriteError: ``path`` is a symbolic link, not a regular file, or has another hard link.
        OSError: any other failure (FileExistsError with ``O_EXCL``, FileNotFoundError...).
    """
    try:  # O_NONBLOCK: a FIFO planted at the name must not hang the open (cleared below for the file)
        fd = os.open(path.name if dir_fd is not None else path, flags | NOFOLLOW | os.O_NONBLOCK, mode, dir_fd=dir_fd)
    except OSError as e:
        if e.errno in _LINK_ERRNOS:
            raise link_refused(path) from e
        if e.errno == errno.ENXIO:  # a FIFO with no reader, opened for writing without blocking
            raise OutputWriteError(f"cannot write {path}: not a regular file; remove it") from e
        raise
    created = flags & os.O_CREAT and flags & os.O_EXCL
    if not created:
        st = os.fstat(fd)
        problem = None
        if not stat.S_ISREG(st.st_mode):
            problem = "not a regular file"
        elif st.st_nlink != 1:
            problem = "it has other hard links, which writing it would change too"
        if problem is not None:
            os.close(fd)
            raise OutputWriteError(f"cannot write {path}: {problem}; remove it")
    os.set_blocking(fd, True)
    return fd


def open_in(folder: Path, name: str, flags: int, *, mode: int = 0o644) -> int:
    """Open file ``name`` in ``folder``, a folder this tool made: neither may be a link (``open_nofollow``'s rules).

    Raises:
        OutputWriteError: ``folder`` or the file is a link, or the file does not stand alone.
        OSError: any other failure.
    """
    dir_fd = open_folder(folder, follow=False)
    try:
        return open_nofollow(folder / name, flags, dir_fd=dir_fd, mode=mode)
    finally:
        os.close(dir_fd)
