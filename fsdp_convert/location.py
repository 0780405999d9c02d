"""Where a checkpoint's bytes live: a local ``Path`` or a remote ``Url``; a leaf below the index and ``remote``.

``formats/index.py`` records these in every ``ChunkEntry`` and ``remote.py`` reads and writes them,
so both import the types from here (and ``remote`` needs nothing from the read side).

Local reads stay inside the folder they were given: every file the read side opens (``.metadata``,
data files, shards, rank files, ``meta.pt``, a full file's side files) and every ``--hf-assets``
file is checked by ``inside`` (or opened by ``open_inside``), so a symbolic link in a checkpoint
from elsewhere cannot make this tool read (or copy, or quote in an error) a file outside it. A
cluster's checkpoint whose data files link into a shared store is read with ``--follow-symlinks``
(``follow_symlinks=True``), the process's setting ``following_symlinks`` holds for its workers.
"""

from __future__ import annotations

import os
import re
import stat
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from fsdp_convert.errors import CorruptChunkError, UnsafeContentError

__all__ = [
    "Url",
    "Location",
    "FOLLOW_SYMLINKS_ENV",
    "follows_symlinks",
    "following_symlinks",
    "inside",
    "open_inside",
    "read_inside",
]

# the process's setting, "1" to follow links out of a checkpoint; an environment variable, so the
# workers ``launch`` starts (which take the caller's environment) read as the caller does
FOLLOW_SYMLINKS_ENV = "FSDP_CONVERT_FOLLOW_SYMLINKS"
# a Hugging Face hub cache: a snapshot's files are links to ../../blobs/<hash> of the same repo folder
_HUB_SNAPSHOT = re.compile(r"^(models|datasets|spaces)--[^/]+$")


class Url(str):
    """A remote location (``s3://bucket/ckpt``) that joins like a ``Path``: ``url / "__0_0.distcp"``."""

    __slots__ = ()

    def __truediv__(self, other: str | os.PathLike[str]) -> Url:
        return Url(self.rstrip("/") + "/" + os.fspath(other))

    @property
    def name(self) -> str:
        """The last component."""
        return self.rstrip("/").rsplit("/", 1)[-1]


Location = Path | Url


def follows_symlinks(follow_symlinks: bool | None = None) -> bool:
    """``follow_symlinks``, or when None the process's setting (``following_symlinks``; default False)."""
    if follow_symlinks is not None:
        return follow_symlinks
    return os.environ.get(FOLLOW_SYMLINKS_ENV, "") == "1"


@contextmanager
def following_symlinks(follow_symlinks: bool | None) -> Iterator[None]:
    """Within the block, the process's setting is ``follow_symlinks`` (None: left as it is); restored after.

    Workers started inside the block (``launch``) take it with the environment.
    """
    if follow_symlinks is None:
        yield
        return
    before = os.environ.get(FOLLOW_SYMLINKS_ENV)
    os.environ[FOLLOW_SYMLINKS_ENV] = "1" if follow_symlinks else "0"
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(FOLLOW_SYMLINKS_ENV, None)
        else:
            os.environ[FOLLOW_SYMLINKS_ENV] = before


def _allowed_root(real_root: Path) -> Path:
    """The folder a root's links may lead into: itself, or for a hub cache snapshot its repo folder (blobs)."""
    snapshots = real_root.parent
    if snapshots.name == "snapshots" and _HUB_SNAPSHOT.match(snapshots.parent.name):
        return snapshots.parent
    return real_root


def inside(root: Path, path: Path, *, follow_symlinks: bool | None = None, what: str = "the checkpoint") -> Path:
    """The real path of ``path``, a file in the folder ``root``, checked to lie in ``root``'s real path.

    A link inside the folder is fine, and so is ``root`` itself being a link; a hub cache
    snapshot (``models--org--name/snapshots/<rev>``) may also link into its repo folder's
    ``blobs``. Nothing is opened (a missing file is left to whoever opens it).

    Args:
        root: the checkpoint folder (or file, or ``--hf-assets`` folder) the user named.
        path: a file in it, as the format names it.
        follow_symlinks: allow links that lead anywhere; None: the process's setting (``follows_symlinks``).
        what: what ``root`` is, for the message.

    Raises:
        UnsafeContentError: a symbolic link takes ``path`` outside ``root`` (one line naming ``path``).
    """
    real = Path(os.path.realpath(path))
    if follows_symlinks(follow_symlinks):
        return real
    allowed = _allowed_root(Path(os.path.realpath(root)))
    if real != allowed and not real.is_relative_to(allowed):
        refused = f"{path} is a symbolic link that leads outside {what} ({root}); refused. If it links into a shared store,"
        raise UnsafeContentError(f"{refused} pass follow_symlinks=True", cli_message=f"{refused} pass --follow-symlinks")
    return real


def open_inside(root: Path, path: Path, *, follow_symlinks: bool | None = None, what: str = "the checkpoint") -> int:
    """A read-only descriptor of ``path``, a regular file inside ``root`` (see ``inside``).

    The real path is opened without following a link at its end (``O_NOFOLLOW``), and without
    blocking on a FIFO; anything but a regular file is refused.

    Raises:
        UnsafeContentError: as ``inside``.
        CorruptChunkError: not a regular file (a FIFO, a device, a folder).
        OSError: it cannot be opened (the caller names the file).
    """
    real = inside(root, path, follow_symlinks=follow_symlinks, what=what)
    fd = os.open(real, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK)
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise CorruptChunkError(f"{path} is not a regular file; refused")
        os.set_blocking(fd, True)
    except BaseException:
        os.close(fd)
        raise
    return fd


def read_inside(
    root: Path, path: Path, max_bytes: int, *, follow_symlinks: bool | None = None, what: str = "the checkpoint"
) -> bytes | None:
    """The whole of ``path``, a small regular file inside ``root`` (see ``open_inside``); None past ``max_bytes``.

    At most ``max_bytes + 1`` bytes are read, so a huge (or sparse) file costs no memory.

    Raises:
        As ``open_inside``.
    """
    with open(open_inside(root, path, follow_symlinks=follow_symlinks, what=what), "rb") as f:
        if os.fstat(f.fileno()).st_size > max_bytes:
            return None
        data = f.read(max_bytes + 1)
    return data if len(data) <= max_bytes else None
