"""Checkpoints and outputs on object storage or other filesystems, through fsspec (``s3://``, ``gs://``...).

Local paths never come here. A remote checkpoint is read by byte range: ``.metadata`` whole (it is
small), then each chunk payload by one ranged GET (``fs.cat_file(path, start, end)``), never a
whole data file. A remote output is written to a local temporary first and uploaded when
complete (``fs.put_file``; s3fs uploads large files in parts), the index or ``.metadata`` last. An
output folder's files go up in waves as they are complete (``upload_in_waves``), so local disk
holds two waves at most, not the whole output. Credentials and endpoints come from the
backend's usual settings (``AWS_*`` for s3fs) or fsspec's ``FSSPEC_<PROTOCOL>_<OPTION>``
variables (``FSSPEC_S3_ENDPOINT_URL``).

The staging of an output (its local folder, its lock object, the upload when complete) is the
output transaction's: ``writers._staging``.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import posixpath
from collections.abc import Callable, Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any, TypeVar

from fsdp_convert.errors import (
    CheckpointNotFoundError,
    InvalidOptionError,
    MissingDataFileError,
    OutputWriteError,
)
from fsdp_convert.location import Location, Url

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
]

logger = logging.getLogger(__name__)


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
    So local disk holds at most two waves (``plan.consolidate.staging_bytes``), and what is left in ``folder``
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
