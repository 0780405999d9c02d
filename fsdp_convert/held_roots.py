"""Local reads confined to the folder named: each root held open, each file reached by a walk from its descriptor.

Every file the read side opens (``.metadata``, data files, shards, rank files, ``meta.pt``, a full
file's side files) and every ``--hf-assets`` file is opened by ``open_inside``, so a symbolic link
in a checkpoint from elsewhere cannot make this tool read (or copy, or quote in an error) a file
outside it, unless ``--follow-symlinks`` (``follow_symlinks=True``; the process's setting
``following_symlinks`` holds for its workers).

A check by name and a later open by name would race with the folder's owner, who can swap the folder
(or any folder on the way) for a link in between. So every read walks from a descriptor of the root
(``_Root``): each component is opened with ``O_NOFOLLOW`` relative to the folder before it, and a link
met on the way is resolved by this walk (its target's components, from the root's descriptor; ``..``
never climbs above the root), so what is opened lies inside the folder whatever is swapped meanwhile.
Within a ``following_symlinks`` block (every operation enters one) a root is opened once, at its first
read, and its identity (device, inode) goes to the workers in the environment (``HELD_ROOTS_ENV``): a
root that is another folder when opened again is refused. A root is closed by the last walk using it.
A leaf: it imports only ``errors``.
"""

from __future__ import annotations

import errno
import json
import os
import re
import stat
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from fsdp_convert.errors import CorruptChunkError, UnsafeContentError

__all__ = [
    "FOLLOW_SYMLINKS_ENV",
    "follows_symlinks",
    "following_symlinks",
    "HELD_ROOTS_ENV",
    "inside",
    "open_inside",
    "stat_inside",
]

# the process's setting, "1" to follow links out of a checkpoint; an environment variable, so the
# workers ``launch`` starts (which take the caller's environment) read as the caller does
FOLLOW_SYMLINKS_ENV = "FSDP_CONVERT_FOLLOW_SYMLINKS"
# a Hugging Face hub cache: a snapshot's files are links to ../../blobs/<hash> of the same repo folder
_HUB_SNAPSHOT = re.compile(r"^(models|datasets|spaces)--[^/]+$")
# the roots held in a ``following_symlinks`` block, as JSON {absolute path as named: [st_dev, st_ino]}:
# workers (which take the caller's environment) refuse a root that opens as another folder
HELD_ROOTS_ENV = "FSDP_CONVERT_HELD_ROOTS"
_MAX_LINKS = 40  # links one walk resolves (the kernel's own limit), then it is refused as a loop


def follows_symlinks(follow_symlinks: bool | None = None) -> bool:
    """``follow_symlinks``, or when None the process's setting (``following_symlinks``; default False)."""
    if follow_symlinks is not None:
        return follow_symlinks
    return os.environ.get(FOLLOW_SYMLINKS_ENV, "") == "1"


@contextmanager
def following_symlinks(follow_symlinks: bool | None) -> Iterator[None]:
    """Within the block, the process's setting is ``follow_symlinks`` (None: left as it is); restored after.

    Workers started inside the block (``launch``) take it with the environment. The block also holds
    the roots read in it: each is opened once, at its first read, and read from that descriptor until
    the outermost block ends (see the module's docstring); their identities travel to the workers.
    """
    before = os.environ.get(FOLLOW_SYMLINKS_ENV)
    before_held = os.environ.get(HELD_ROOTS_ENV)
    global _scopes
    with _lock:
        _scopes += 1
    if follow_symlinks is not None:
        os.environ[FOLLOW_SYMLINKS_ENV] = "1" if follow_symlinks else "0"
    try:
        yield
    finally:
        with _lock:
            _scopes -= 1
            outermost = _scopes == 0
            released = list(_held.values()) if outermost else []
            if outermost:
                _held.clear()
            unused = [held for held in released if not held.users]  # one another thread walks now: its walk closes it
        for held in unused:
            held.close()
        if follow_symlinks is not None:
            _restore(FOLLOW_SYMLINKS_ENV, before)
        if outermost:
            _restore(HELD_ROOTS_ENV, before_held)


def _restore(name: str, value: str | None) -> None:
    if value is None:
        os.environ.pop(name, None)
    else:
        os.environ[name] = value


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
    """A read-only descriptor of ``path``, a regular file inside ``root``, opened by a walk from ``root``'s descriptor.

    Each component is opened with ``O_NOFOLLOW`` relative to the folder before it (the last one
    without blocking on a FIFO); a link met on the way is resolved by the walk, inside ``root`` (or a
    hub cache snapshot's repo folder, as ``inside``), so a folder swapped for a link meanwhile is
    followed inside the folder or refused, never out of it. Anything but a regular file is refused.
    With ``follow_symlinks`` the path is opened as it resolves (links anywhere are allowed).

    Raises:
        UnsafeContentError: a symbolic link takes ``path`` outside ``root``, or ``root`` is not the
            folder this run first opened (as ``inside``'s, one line naming ``path``).
        CorruptChunkError: not a regular file (a FIFO, a device, a folder).
        OSError: it cannot be opened (the caller names the file).
    """
    if follows_symlinks(follow_symlinks):
        fd = os.open(os.path.realpath(path), _LAST)
    else:
        with _root(root, what) as held:
            fd = held.walk(path, what, open_last=True)
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise CorruptChunkError(f"{path} is not a regular file; refused")
        os.set_blocking(fd, True)
    except BaseException:
        os.close(fd)
        raise
    return fd


def stat_inside(root: Path, path: Path, *, follow_symlinks: bool | None = None, what: str = "the checkpoint") -> os.stat_result:
    """``os.stat`` of ``path``, a file inside ``root``, reached by ``open_inside``'s walk (nothing at its end is opened).

    Raises:
        UnsafeContentError: as ``open_inside``.
        OSError: it cannot be reached.
    """
    if follows_symlinks(follow_symlinks):
        return os.stat(os.path.realpath(path))
    with _root(root, what) as held:
        fd = held.walk(path, what, open_last=False)
    try:
        return os.fstat(fd)
    finally:
        os.close(fd)


# the last component: never through a link, never blocking on a FIFO, never a controlling terminal
_LAST = os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_NOCTTY
_FOLDER = os.O_PATH | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_DIRECTORY  # O_PATH: a folder one may only traverse (x, not r) is walked
_lock = threading.Lock()
_scopes = 0  # following_symlinks blocks open in this process
_held: dict[str, _Root] = {}  # absolute root as named -> its descriptor, while a block is open


@dataclass(eq=False)
class _Root:
    """A root opened once: its descriptor, and the folder its links may lead into (``_allowed_root``).

    Attributes:
        named: the root as the caller named it, for messages.
        fd: the root itself (a folder, or the file a single-file checkpoint is).
        base: the folder links may lead into, and walks start from: ``fd``, or a hub snapshot's repo folder.
        base_real: ``base``'s real path (an absolute link target must lie in it).
        below: ``fd``'s components below ``base`` (a hub snapshot's ``snapshots/<rev>``; else none).
    """

    named: Path
    fd: int
    base: int
    base_real: str
    below: tuple[str, ...]
    users: int = 0  # walks in progress (any thread), under ``_lock``: the last one closes a root no block holds
    what: str = ""  # what it is, for messages; a folder below it is reached from it only if of the same kind

    def close(self) -> None:
        for fd in {self.base, self.fd}:
            os.close(fd)

    def refuse(self, path: Path, what: str) -> UnsafeContentError:
        refused = f"{path} is a symbolic link that leads outside {what} ({self.named}); refused. If it links into a shared store,"
        return UnsafeContentError(f"{refused} pass follow_symlinks=True", cli_message=f"{refused} pass --follow-symlinks")

    def walk(self, path: Path, what: str, *, open_last: bool) -> int:
        """A descriptor of ``path`` reached from ``base`` through folders opened with ``O_NOFOLLOW``.

        ``open_last`` False: the last component's parent is walked and the component opened with
        ``O_PATH`` (no open of a FIFO or device), for its ``fstat``.

        Raises:
            UnsafeContentError: a link, or ``..``, leads above ``base``. OSError: as ``os.open``.
        """
        if os.path.abspath(path) == os.path.abspath(self.named):  # a single-file checkpoint: the file held
            # the descriptor's own link in /proc reopens the very file held, whatever its name leads to now
            return os.open(f"/proc/self/fd/{self.fd}", _LAST & ~os.O_NOFOLLOW if open_last else os.O_PATH | os.O_CLOEXEC)
        relative = os.path.relpath(os.path.abspath(path), os.path.abspath(self.named))
        return self.walk_parts(relative.split("/"), path, what, open_last)

    def walk_parts(self, parts: list[str], path: Path, what: str, open_last: bool) -> int:
        """``walk`` of ``parts``, components below the root (``path`` names them in a refusal)."""
        pending = [*parts[::-1], *self.below[::-1]]  # a stack: the next component last
        stack = [self.base]
        links = 0
        try:
            while pending:
                name = pending.pop()
                if name in ("", "."):
                    continue
                if name == "..":
                    if len(stack) == 1:
                        raise self.refuse(path, what)
                    os.close(stack.pop())
                    continue
                last = not any(n not in ("", ".") for n in pending)
                try:
                    if last and not open_last:
                        fd = os.open(name, os.O_PATH | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=stack[-1])
                        if stat.S_ISLNK(os.fstat(fd).st_mode):
                            os.close(fd)
                            raise OSError(errno.ELOOP, os.strerror(errno.ELOOP))
                    else:
                        fd = os.open(name, _LAST if last else _FOLDER, dir_fd=stack[-1])
                except OSError as e:
                    if e.errno not in (errno.ELOOP, errno.ENOTDIR):
                        raise
                    try:
                        target = os.readlink(name, dir_fd=stack[-1])
                    except OSError:
                        raise e from None  # not a link: a file where a folder should be
                    links += 1
                    if links > _MAX_LINKS:
                        raise
                    if target.startswith("/"):  # from the top again: it must resolve inside base
                        real = os.path.realpath(target)  # a proposal only: the walk below follows no link
                        if real != self.base_real and not real.startswith(self.base_real.rstrip("/") + "/"):
                            raise self.refuse(path, what) from None
                        while len(stack) > 1:
                            os.close(stack.pop())
                        target = os.path.relpath(real, self.base_real)
                    pending.extend(target.split("/")[::-1])
                    continue
                stack.append(fd)
            if len(stack) == 1:  # path is base itself
                stack.append(os.open(".", _LAST if open_last else os.O_PATH | os.O_CLOEXEC, dir_fd=self.base))
            return stack.pop()
        finally:
            for fd in stack[1:]:
                os.close(fd)


@contextmanager
def _root(root: Path, what: str) -> Iterator[_Root]:
    """``root`` opened: the one held by the open ``following_symlinks`` block, or a fresh one closed after.

    Raises:
        UnsafeContentError: ``HELD_ROOTS_ENV`` records another folder under this name (swapped since).
        OSError: ``root`` cannot be opened.
    """
    key = os.path.abspath(root)
    with _lock:
        held = _held.get(key)
        if held is None:
            # a format's folder below its held root (accelerate's) is reached from it; --hf-assets is a root of its own
            above = [h for k, h in _held.items() if key.startswith(k.rstrip("/") + "/") and h.fd == h.base and h.what == what]
            held = _open_root(Path(root), key, what, above[0].walk(Path(root), what, open_last=False) if above else None)
            held.what = what
            if _scopes:
                _held[key] = held
                st = os.fstat(held.fd)
                recorded = json.loads(os.environ.get(HELD_ROOTS_ENV) or "{}")
                recorded[key] = [st.st_dev, st.st_ino]
                os.environ[HELD_ROOTS_ENV] = json.dumps(recorded)
        held.users += 1
    try:
        yield held
    finally:
        with _lock:
            held.users -= 1
            done = not held.users and _held.get(key) is not held
        if done:
            held.close()


def _open_root(root: Path, key: str, what: str, fd: int | None = None) -> _Root:
    """Open ``root`` (following a link there: the root may be one), checked against ``HELD_ROOTS_ENV``'s record.

    ``fd``: ``root`` already reached (``O_PATH``) by a walk from a held root above it; taken over.
    """
    if fd is None:
        fd = os.open(root, os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK | os.O_NOCTTY)
    try:
        st = os.fstat(fd)
        recorded = json.loads(os.environ.get(HELD_ROOTS_ENV) or "{}").get(key)
        if recorded is not None and recorded != [st.st_dev, st.st_ino]:
            raise UnsafeContentError(f"{root} is not the folder this run first opened as {what} (it was swapped); refused")
        try:
            real = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            real = os.path.realpath(root)
        if not stat.S_ISDIR(st.st_mode):
            return _Root(root, fd, fd, real, ())
        allowed = str(_allowed_root(Path(real)))
        if allowed == real:
            return _Root(root, fd, fd, real, ())
        base = os.open("../..", _FOLDER, dir_fd=fd)  # ``..`` is never a link: the snapshot's own repo folder
        held = _Root(root, fd, base, allowed, tuple(Path(real).relative_to(allowed).parts))
        try:
            again = held.walk_parts([], root, what, open_last=False)
            same = os.fstat(again)
            os.close(again)
        except (OSError, UnsafeContentError):
            same = None
        if same is None or (same.st_dev, same.st_ino) != (st.st_dev, st.st_ino):  # moved meanwhile: no blobs
            os.close(base)
            return _Root(root, fd, fd, real, ())
        return held
    except BaseException:
        os.close(fd)
        raise
