"""Checkpoints and outputs on object storage or other filesystems, through fsspec (``s3://``, ``gs://``...).

Local paths never come here. A remote checkpoint is read by byte range: ``.metadata`` whole (it is
small), then each chunk payload by one ranged GET (``fs.cat_file(path, start, end)``), never a
whole data file. A remote output is written to a local temporary first and uploaded when
complete (``fs.put_file``; s3fs uploads large files in parts), the index or ``.metadata`` last. An
output folder's files go up in waves as they are complete (``upload_in_waves``), so local disk
holds two waves at most, not the whole output. Credentials and endpoints come from the
backend's usual settings (``AWS_*`` for s3fs) or fsspec's ``FSSPEC_<PROTOCOL>_<OPTION>``
variables (``FSSPEC_S3_ENDPOINT_URL``).

One writer per remote output: ``staged_upload`` holds a lock object ``.<name>.lock`` beside it
for the whole block (``_object_lock``, which says what each backend guarantees).

The local staging folder is ``TMPDIR/fsdp-convert-upload-<url>_<host>_<pid>_<random>``
(``staging_prefix``: a digest of the normalized URL, one of the host name; then the writing
process's pid and ``mkdtemp``'s random tail). A run that was killed (SIGKILL, a lost node)
cannot remove its own, so the next run writing the same URL on the same host removes each one
whose process is gone, with a warning naming it (``_remove_dead_staging``).
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import logging
import os
import posixpath
import shutil
import socket
import stat
import tempfile
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any, TypeVar

from fsdp_convert._object_lock import lock_url, object_lock
from fsdp_convert.errors import (
    CheckpointNotFoundError,
    InvalidOptionError,
    MissingDataFileError,
    OutputExistsError,
    OutputWriteError,
)
from fsdp_convert.location import Location, Url
from fsdp_convert.lock_record import pid_alive

__all__ = [
    "Url",
    "Location",
    "is_url",
    "as_location",
    "normal_url",
    "filesystem",
    "read_bytes",
    "read_range",
    "size_of",
    "exists",
    "upload",
    "upload_in_waves",
    "staged_upload",
    "local_output",
    "lock_url",
    "staging_prefix",
]

logger = logging.getLogger(__name__)

STAGING_PREFIX = "fsdp-convert-upload-"  # TMPDIR/fsdp-convert-upload-<url digest>_<host digest>_<pid>_<random>


def is_url(location: object) -> bool:
    """True for ``scheme://...`` strings other than ``file://`` (which is a local path)."""
    return isinstance(location, str) and "://" in location and not location.startswith("file://")


def as_location(location: str | os.PathLike[str]) -> Path | Url:
    """A ``Url`` for a remote location, else a ``Path`` (``file://`` prefix removed)."""
    if is_url(location):
        return Url(str(location).rstrip("/"))
    text = os.fspath(location)
    return Path(text.removeprefix("file://"))


def normal_url(url: str) -> str:
    """``url`` as two URLs are compared: scheme and bucket (host) lower-cased; ``.``, ``..``, repeated and trailing ``/`` removed.

    ``S3://Bucket/a//b/./c/`` and ``s3://bucket/a/b/c`` are the same output.
    """
    scheme, _, rest = url.partition("://")
    host, _, path = rest.partition("/")
    path = posixpath.normpath("/" + path).lstrip("/")
    return f"{scheme.lower()}://{host.lower()}" + (f"/{path}" if path else "")


def filesystem(protocol: str) -> Any:
    """The fsspec filesystem for ``protocol`` (one per process: a worker forked from another makes its own).

    Raises:
        InvalidOptionError: fsspec or the protocol's backend is not installed.
    """
    return _filesystem(protocol, os.getpid())


@functools.cache
def _filesystem(protocol: str, pid: int) -> Any:
    try:
        import fsspec  # type: ignore[import-untyped]

        return fsspec.filesystem(protocol)
    except ImportError as e:
        raise InvalidOptionError(
            f"{protocol}:// paths need fsspec and its {protocol} backend: pip install 'fsdp-convert[s3]' ({e})"
        ) from e
    except ValueError as e:
        raise InvalidOptionError(f"{protocol}:// is not a known fsspec protocol ({e})") from e


def _fs(url: Url) -> Any:
    return filesystem(url.split("://", 1)[0])


def size_of(url: Url) -> int | None:
    """The object's size in bytes, or None when it does not exist."""
    try:
        return int(_fs(url).size(str(url)))
    except FileNotFoundError:
        return None


def read_bytes(url: Url) -> bytes:
    """A whole (small) object, such as ``.metadata``.

    Raises:
        CheckpointNotFoundError: it does not exist.
    """
    try:
        return bytes(_fs(url).cat_file(str(url)))
    except FileNotFoundError as e:
        raise CheckpointNotFoundError(f"{url} does not exist") from e


def read_range(url: Url, offset: int, length: int) -> bytes:
    """``length`` bytes at ``offset`` of an object, in one ranged read.

    Raises:
        MissingDataFileError: the object does not exist.
    """
    if length == 0:
        return b""
    try:
        return bytes(_fs(url).cat_file(str(url), start=offset, end=offset + length))
    except FileNotFoundError as e:
        raise MissingDataFileError(f"{url} is missing") from e


def exists(url: Url) -> bool:
    """True when an object or a prefix ("folder") exists at ``url``."""
    return bool(_fs(url).exists(str(url)))


def upload(local: Path, url: Url, *, last: tuple[str, ...] = ()) -> None:
    """Upload a finished local file or folder to ``url``.

    In a folder, the files named in ``last`` go after all others (an index or ``.metadata``
    appears only once the data is there).

    Raises:
        OutputWriteError: the upload fails.
    """
    fs = _fs(url)
    try:
        if local.is_file():
            fs.put_file(str(local), str(url))
            return
        files = sorted(p for p in local.rglob("*") if p.is_file())
        files.sort(key=lambda p: p.name in last)
        for path in files:
            fs.put_file(str(path), str(url / path.relative_to(local).as_posix()))
    except OSError as e:
        raise OutputWriteError(f"cannot write {url}: {e}") from e


T = TypeVar("T")


def upload_in_waves(folder: Path, url: Url, waves: Iterable[tuple[Callable[[], T], tuple[str, ...]]]) -> tuple[list[T], int]:
    """Write an output folder wave by wave, each wave's files uploaded (and deleted here) while the next is written.

    Each wave is a ``write`` that completes some files of ``folder`` and their names (relative to
    it, ``/``-separated). Once ``write`` returns, one background thread uploads those files to
    ``url / name`` (``put_file``, in parts as the backend does it) and deletes them; the next
    wave's ``write`` runs meanwhile, and its upload starts once the previous one has finished.
    So local disk holds at most two waves (``plan.staging_bytes``), and what is left in ``folder``
    (an index, ``.metadata``) is uploaded last by the caller. If a wave fails (its ``write`` or an
    upload, Ctrl-C included), the objects already uploaded are removed again, best effort, so no
    part of the output is left at ``url``.

    Returns:
        Each wave's ``write`` result, in order, and the bytes uploaded.

    Raises:
        OutputWriteError: an upload fails (naming the object); a ``write``'s own errors pass through
            once the upload in flight has finished.
    """
    results: list[T] = []
    uploaded = 0
    done: list[str] = []  # the objects put so far (appended by the upload thread)
    try:
        with ThreadPoolExecutor(max_workers=1, thread_name_prefix="fsdp-convert-upload") as pool:
            pending: Future[int] | None = None
            for write, names in waves:
                results.append(write())
                if pending is not None:
                    uploaded += pending.result()
                pending = pool.submit(_put_and_remove, folder, url, names, done)
            if pending is not None:
                uploaded += pending.result()
    except BaseException:
        _remove_objects(url, done)  # the pool has finished: no upload is in flight
        raise
    return results, uploaded


def _put_and_remove(folder: Path, url: Url, names: tuple[str, ...], done: list[str]) -> int:
    """Upload each file of ``folder`` to ``url / name``, then delete it; the bytes uploaded.

    Each name is appended to ``done`` once its object is put.

    Raises:
        OutputWriteError: an upload fails.
    """
    fs = _fs(url)
    total = 0
    for name in names:
        path = folder / name
        size = path.stat().st_size
        try:
            fs.put_file(str(path), str(url / name))
        except OSError as e:
            raise OutputWriteError(f"cannot write {url / name}: {e}") from e
        done.append(name)
        path.unlink()
        total += size
    return total


def _remove_objects(url: Url, names: list[str]) -> None:
    """Delete ``url / name`` for each name, ignoring what cannot be deleted (best effort, after a failure)."""
    fs = _fs(url)
    for name in names:
        with contextlib.suppress(Exception):
            fs.rm_file(str(url / name))


def staging_prefix(url: Url) -> str:
    """The start of the name of every staging folder for ``url`` on this host: ``fsdp-convert-upload-<url>_<host>_``.

    ``<url>`` is 16 hex digits of the SHA-256 of ``normal_url(url)``, ``<host>`` 8 of this host's
    name. A run's folder adds its pid and ``mkdtemp``'s random tail (``<pid>_<random>``): the same
    URL gives the same start, so a later run finds what a killed one left, and the random tail
    keeps another user from taking the name first.
    """
    key = hashlib.sha256(normal_url(url).encode()).hexdigest()[:16]
    host = hashlib.sha256(socket.gethostname().encode()).hexdigest()[:8]
    return f"{STAGING_PREFIX}{key}_{host}_"


def _remove_dead_staging(url: Url, mine: Path) -> None:
    """Remove each staging folder of ``url`` beside ``mine`` (this run's) that a run of this host left and whose pid is gone.

    Only folders (not links) owned by this user are looked at; one whose pid is alive is another
    run's, and left alone (its lock object is held, so there should be none). Each removal is
    logged as a warning, naming the folder.
    """
    prefix = staging_prefix(url)
    for path in sorted(mine.parent.glob(prefix + "*")):
        pid = path.name[len(prefix) :].partition("_")[0]
        try:
            st = path.lstat()
        except FileNotFoundError:
            continue
        if path == mine or not pid.isdigit() or not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid():
            continue
        if int(pid) != os.getpid() and pid_alive(int(pid)):
            continue
        shutil.rmtree(path, ignore_errors=True)
        logger.warning("removed %s, the staging folder an earlier run writing %s left (pid %s, gone)", path, url, pid)


@contextlib.contextmanager
def staged_upload(url: Url, *, overwrite: bool, last: tuple[str, ...] = ()) -> Iterator[Path]:
    """Yield a local path to write ``url``'s content to; upload it when the block completes.

    The output's lock object (``lock_url``) is taken first and held until the upload is done,
    every upload of the block included (``upload_in_waves``); it is removed at the end, on success
    or failure. The local copy lives in the staging folder (``staging_prefix``, deleted afterwards),
    named like the output so its suffix still says the format; a staging folder of the same URL
    that a killed run left on this host is removed first, with a warning.

    Raises:
        OutputExistsError: something exists at ``url`` and ``overwrite`` is false (checked first,
            and again once the lock is held).
        OutputLockedError: another run holds the output's lock (exit 4), naming its pid and host.
        InvalidOptionError: ``url`` is a bucket itself (no folder for the lock).
        OutputWriteError: the lock object cannot be created, or the upload fails.
    """
    if not overwrite and exists(url):
        raise OutputExistsError(f"{url} already exists; pass --overwrite to replace it")
    with object_lock(_fs(url), url):
        _fs(url).invalidate_cache(str(url))
        if not overwrite and exists(url):  # another run finished it between the check and the lock
            raise OutputExistsError(f"{url} already exists; pass --overwrite to replace it")
        folder = Path(tempfile.mkdtemp(prefix=f"{staging_prefix(url)}{os.getpid()}_"))  # 0o700, made exclusively
        _remove_dead_staging(url, folder)
        try:
            yield folder / url.name
            upload(folder / url.name, url, last=last)
        finally:
            shutil.rmtree(folder, ignore_errors=True)


@contextlib.contextmanager
def local_output(
    output: str | os.PathLike[str], *, overwrite: bool, shared: bool, last: tuple[str, ...]
) -> Iterator[tuple[Path, Location]]:
    """The local path to write an output to, and the location to report.

    A local ``output`` is written in place. An fsspec URL is written to a local temporary and
    uploaded when the block completes (``staged_upload``; the files in ``last`` go last); an
    operation may upload a folder's files before that, wave by wave (``upload_in_waves``). The
    URL's lock object is held for the whole block (``staged_upload``).

    Args:
        output: the output path or URL.
        overwrite: replace what is at a URL.
        shared: a multi-node run, whose nodes write to a filesystem they all mount.
        last: names of files in an output folder to upload after all others.

    Raises:
        InvalidOptionError: an fsspec URL for a multi-node run (nodes write to a shared filesystem),
            or a bucket itself.
        OutputExistsError: the URL exists and ``overwrite`` is false.
        OutputLockedError: another run is writing the URL (its lock object, ``staged_upload``).
        OutputWriteError: the upload fails.
    """
    location = as_location(output)
    if isinstance(location, Path):
        yield location, location
        return
    if shared:
        raise InvalidOptionError(f"{location}: a multi-node run writes to a filesystem every node shares, not to object storage")
    with staged_upload(location, overwrite=overwrite, last=last) as local:
        yield local, location
