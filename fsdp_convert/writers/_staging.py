"""Staging of an output to object storage: written to a private local folder, uploaded when complete, one writer at a time.

An fsspec URL output (``s3://``, ``gs://``...) is written to a local staging folder and uploaded
when the block completes (``remote.upload``, the index or ``.metadata`` last); an operation may
upload a folder's files before that, wave by wave (``remote.upload_in_waves``). One writer per
remote output: ``staged_upload`` holds a lock object ``.<name>.lock`` beside it for the whole
block (``writers._object_lock``, which says what each backend guarantees).

The local staging folder is ``TMPDIR/fsdp-convert-upload-<url>_<host>_<pid>_<random>``
(``staging_prefix``: a digest of the normalized URL, one of the host name; then the writing
process's pid and ``mkdtemp``'s random tail). A run that was killed (SIGKILL, a lost node)
cannot remove its own, so the next run writing the same URL on the same host removes each one
whose process is gone, with a warning naming it (``_remove_dead_staging``).
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import shutil
import socket
import stat
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from fsdp_convert.errors import InvalidOptionError, OutputExistsError
from fsdp_convert.location import Location, Url
from fsdp_convert.lock_record import pid_alive
from fsdp_convert.remote import as_location, exists, filesystem, normal_url, upload
from fsdp_convert.writers._object_lock import object_lock

__all__ = ["STAGING_PREFIX", "staging_prefix", "staged_upload", "local_output"]

logger = logging.getLogger(__name__)

STAGING_PREFIX = "fsdp-convert-upload-"  # TMPDIR/fsdp-convert-upload-<url digest>_<host digest>_<pid>_<random>


def _fs(url: Url) -> Any:
    return filesystem(url.split("://", 1)[0])


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
