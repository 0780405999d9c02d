"""One writer per object-storage output: a lock object ``.<name>.lock`` beside it, created exclusively.

``writers._staging.staged_upload`` holds it from before the staging folder is made until the last upload
(the operations' wave uploads included), and removes it at the end, on success or failure (Ctrl-C
included), if it still holds this process's ``LockRecord`` (``host pid since -``: remote outputs
are single-node only). A lock already there is seen by an existence check; if none is, the lock
is created by ``fs.pipe_file(lock, record, mode="create")``, whose guarantee is the backend's:

- s3fs sends ``PutObject`` with ``If-None-Match: *``: atomic on AWS S3 and on servers that honour
  conditional writes (moto does; the tests check it); the loser gets ``PreconditionFailed``, which
  s3fs raises as ``FileExistsError``. On a server that ignores the header the existence check is
  all there is (as below), and reading the record back catches a run overwritten before it read.
- ``memory://`` (the unit tests' stand-in) checks, then stores, in one process's memory that no
  other process sees.
- Other backends (gs://, az://... not checked here) give what their ``pipe_file`` does with
  ``mode="create"``. fsspec's default, and an older fsspec whose ``pipe_file`` takes no ``mode``
  (a plain write here), are the existence check, then a write: not atomic, two runs starting
  within that window may both write.

A lock naming this host and a pid that is gone here is stale and taken over: removed, then created
exclusively again (if that create fails another run won, and this one is refused). Two runs taking
over the same stale lock at once may both succeed (the removal is not conditional). A lock naming
another host is refused: whether its process lives cannot be checked from here.
"""

from __future__ import annotations

import contextlib
import inspect
import logging
import os
from collections.abc import Iterator
from typing import Any

from fsdp_convert.errors import InvalidOptionError, OutputLockedError, OutputWriteError
from fsdp_convert.location import Url
from fsdp_convert.lock_record import LockRecord, lock_name, locked_message, pid_alive

__all__ = ["lock_url", "object_lock"]

logger = logging.getLogger(__name__)

_TRIES = 3  # a lock let go between our create and our read is tried for again, this many times in all


def lock_url(url: Url) -> Url:
    """The lock object of the output at ``url``: ``.<name>.lock`` beside it (as ``writers._lock.lock_path``).

    Raises:
        InvalidOptionError: ``url`` is a bucket itself, with no folder to hold its lock.
    """
    parent, _, name = url.rstrip("/").rpartition("/")
    if parent.endswith(":/"):
        raise InvalidOptionError(f"{url}: name a path inside the bucket; the output's lock {lock_name(name)} goes beside it")
    return Url(parent) / lock_name(name)


@contextlib.contextmanager
def object_lock(fs: Any, url: Url) -> Iterator[None]:
    """Hold the lock object of the output at ``url`` (on fsspec filesystem ``fs``) for the block.

    Taken before the block, removed after it (success, error or Ctrl-C) if it still holds this
    process's record. Called in the process that uploads; a forked child leaving the block does
    not remove it.

    Raises:
        OutputLockedError: another live run holds it, or a run on another host (exit 4), naming its
            pid and host.
        InvalidOptionError: ``url`` is a bucket itself.
        OutputWriteError: the lock object cannot be created, read or removed (permission, endpoint).
    """
    lock = lock_url(url)
    me = _take(fs, url, lock)
    try:
        yield
    finally:
        _release(fs, lock, me)


def _take(fs: Any, url: Url, lock: Url) -> LockRecord:
    """Create ``lock`` exclusively, taking over a stale one; this process's record."""
    me = LockRecord.mine(None)
    for _ in range(_TRIES):
        if _create(fs, lock, me):
            return me
        try:
            holder = LockRecord.parse(bytes(fs.cat_file(str(lock))).decode(errors="replace"))
        except FileNotFoundError:
            continue  # its holder let it go meanwhile
        except OSError as e:
            raise OutputWriteError(f"cannot read {lock}: {e}") from e
        if holder is None or holder.host != me.host or pid_alive(holder.pid):
            raise OutputLockedError(locked_message(url, lock, holder))
        logger.info("Taking over %s: its holder, pid %d on this host, is gone", lock, holder.pid)
        try:
            fs.rm_file(str(lock))
        except FileNotFoundError:
            pass
        except OSError as e:
            raise OutputWriteError(f"cannot remove the stale lock {lock}: {e}") from e
        if _create(fs, lock, me):
            return me
        break  # another run took it over first
    raise OutputLockedError(locked_message(url, lock, _read(fs, lock)))


def _create(fs: Any, lock: Url, me: LockRecord) -> bool:
    """Create ``lock`` holding ``me`` if no object is there: True when this process holds it then.

    Raises:
        OutputWriteError: the create fails for another reason.
    """
    data = me.text().encode()
    try:
        fs.invalidate_cache(str(lock))  # a cached listing may predate the lock
        if fs.exists(str(lock)):
            return False
        if "mode" in inspect.signature(fs.pipe_file).parameters:
            fs.pipe_file(str(lock), data, mode="create")
        else:  # an older fsspec, without exclusive writes: the check above is all (not atomic)
            fs.pipe_file(str(lock), data)
    except FileExistsError:  # s3fs's PreconditionFailed on If-None-Match; memory://; fsspec's check
        return False
    except OSError as e:
        if _lost_create(e):
            return False
        raise OutputWriteError(f"cannot create {lock}: {e}") from e
    holder = _read(fs, lock)  # a store that ignores If-None-Match overwrites: the last writer holds it
    return holder is None or holder == me  # None: the read-back failed, the create did not


def _lost_create(error: OSError) -> bool:
    """True for S3's other answers to a conditional create that lost.

    A ``PreconditionFailed`` without its ``Condition`` (s3fs raises it as ``OSError(EINVAL)``), or
    a 409 ``ConditionalRequestConflict`` (another create of the key in flight).
    """
    response = getattr(error.__cause__, "response", None)
    code = response.get("Error", {}).get("Code") if isinstance(response, dict) else None
    return code in {"PreconditionFailed", "ConditionalRequestConflict"}


def _read(fs: Any, lock: Url) -> LockRecord | None:
    """The record ``lock`` holds; None when it is gone or unreadable."""
    try:
        return LockRecord.parse(bytes(fs.cat_file(str(lock))).decode(errors="replace"))
    except OSError:
        return None


def _release(fs: Any, lock: Url, me: LockRecord) -> None:
    """Remove ``lock`` if it still holds ``me``; best effort (a failure is logged, not raised)."""
    if os.getpid() != me.pid:
        return  # a forked child never lets its parent's lock go
    try:
        if _read(fs, lock) == me:
            fs.rm_file(str(lock))
    except OSError as e:
        logger.warning("Could not remove the lock %s (%s); remove it before writing this output again", lock, e)
