"""The resumable temporary: a plan's record map and fingerprint, the interrupted run's temporary found, entered and kept.

An operation enters its temporary with ``temporary_output`` (every process of the job, before any
data is read; ``writers.transaction.OutputTransaction.begin`` does it); ``--resume`` first finds
the interrupted run's temporary (``find_temporary``: this job's own, or the one another job id
left) and checks its manifest against the new plan, touching nothing. A resumable run (a local
output) keeps its temporary and manifest when Ctrl-C, SIGTERM/SIGHUP or a failed or dead worker
stops it once the manifest is written (``keep_note``, ``writers._atomic.KEPT_ON``), so a
preemption that sends SIGTERM before SIGKILL leaves it to ``--resume``; any other error removes
it, as for every other run. What the workers do with it (the manifest written, records kept and
logged) is ``resume``'s; the manifest format is ``writers._manifest``'s.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from contextlib import AbstractContextManager
from dataclasses import dataclass
from pathlib import Path

from fsdp_convert.errors import OutputWriteError
from fsdp_convert.progress import human_bytes
from fsdp_convert.writers._atomic import TemporaryReplacedError, atomic_output, temporaries, temporary_path
from fsdp_convert.writers._lock import check_not_locked
from fsdp_convert.writers._manifest import NamedOptions, Record, check_manifest, has_manifest, remove_manifest, written_bytes
from fsdp_convert.writers._source_state import SourceDigest

__all__ = ["RecordMap", "Fingerprint", "ResumeState", "find_temporary", "temporary_output", "keep_note"]

logger = logging.getLogger(__name__)


class RecordMap:
    """A plan's output files and records, by file index as the movers number them.

    Attributes:
        names: per file index, its name relative to the output (``""``: a file output itself).
        sizes: per file name, the end of its laid-out data, in bytes.
        records: per record, its file index and ``Record``.
    """

    def __init__(self, names: dict[int, str], sizes: dict[str, int], records: list[tuple[int, Record]]) -> None:
        self.names, self.sizes, self.records = names, sizes, records


@dataclass(frozen=True, slots=True, kw_only=True)
class Fingerprint:
    """What a manifest says of its plan.

    Attributes:
        record_map: the output files and records.
        source: ``resume.source_digest`` of the checkpoint.
        options: digest of everything that changes the output's bytes.
        named: the same by option (``writers._manifest.NamedOptions``), so a resume names those that differ;
            None: not recorded.
    """

    record_map: RecordMap
    source: SourceDigest | str
    options: str
    named: NamedOptions | None = None

    def check(self, tmp: Path) -> None:
        """Raise unless ``tmp``'s manifest was written for this plan (``writers._manifest.check_manifest``)."""
        records = [r for _, r in self.record_map.records]
        files = self.record_map.sizes
        check_manifest(tmp, source=self.source, options=self.options, files=files, records=records, named=self.named)


def find_temporary(output: Path, tag: str | None, *, directory: bool, fingerprint: Fingerprint) -> Path | None:
    """The interrupted run's temporary of ``output`` to resume; read only, before the output is locked.

    This job's own (``writers._atomic.temporary_path`` for ``tag``) if it is there; else the one
    temporary of ``output`` another job left with a manifest (a job id is not always stable:
    torchrun ``--standalone`` draws one, a requeued job may get a new one). Every process of a
    job finds the same one: nothing is written before every worker has started.

    Returns:
        The temporary, its manifest checked against this plan; None when there is none to resume
        (the run starts afresh).

    Raises:
        OutputWriteError: a temporary whose manifest is missing or differs from this plan (the
            message names what differs), or several left with a manifest; nothing is touched.
    """
    own = temporary_path(output, tag, directory=directory)
    if has_manifest(own) or own.is_file() or (own.is_dir() and any(own.iterdir())):
        fingerprint.check(own)
        return own
    left = [t for t in temporaries(output, directory=directory) if t != own and has_manifest(t)]
    if len(left) > 1:
        names = ", ".join(str(t) for t in left)
        raise OutputWriteError(f"cannot resume {output}: {len(left)} interrupted runs left a temporary ({names}); keep one")
    if not left:
        logger.info("--resume: no interrupted run's output at %s; starting afresh", own)
        return None
    fingerprint.check(left[0])
    logger.info("--resume: continuing %s, which a job with another id left", left[0])
    return left[0]


@dataclass(frozen=True, slots=True)
class ResumeState:
    """What every worker of a resumable output needs (``resume.begin_share``).

    Attributes:
        fingerprint: the plan's fingerprint, written to (or checked against) the manifest.
        resume: whether the temporary is an interrupted run's (``find_temporary`` found it).
    """

    fingerprint: Fingerprint
    resume: bool


@contextlib.contextmanager
def temporary_output(
    output: Path, *, overwrite: bool, directory: bool, tag: str | None, fingerprint: Fingerprint | None, resume: bool
) -> Iterator[tuple[Path, ResumeState | None]]:
    """Enter ``output``'s temporary (``writers.atomic_output``), resumable when there is a ``fingerprint``.

    Every process of the job calls it. With ``resume`` the interrupted run's temporary is found and
    checked first (``find_temporary``), before the lock; the block writes into it. A temporary with a
    manifest is kept when a signal or a failed worker stops the block (``keep_note``), and the
    manifest is removed once the temporary is gone (renamed into place or removed).

    Args:
        output: the final output (local).
        overwrite: replace an existing ``output`` (at the final rename).
        directory: a folder output.
        tag: the job's shared tag (``launch.shared_tag``), None on one node.
        fingerprint: the plan's (``resume.consolidate_fingerprint``, ``resume.reshard_fingerprint``);
            None: an output that keeps no manifest (a staged upload to object storage, whose staging
            folder is private).
        resume: ``--resume``; first, another job's live run on ``output`` is refused (``writers._lock.check_not_locked``).

    Yields:
        The temporary, and what the workers need to resume it (None without a fingerprint).

    Raises:
        As ``find_temporary`` and ``writers.atomic_output``.
    """
    found = None
    if fingerprint is None and resume:
        logger.warning("--resume: an output to object storage keeps no manifest (staged in a private folder); writing it afresh")
    if fingerprint is not None and resume:
        check_not_locked(output, tag)  # a live run's temporary is not an interrupted one
        found = find_temporary(output, tag, directory=directory, fingerprint=fingerprint)
        resume = found is not None
    keep = keep_note if fingerprint is not None else None
    temporary = atomic_output(
        output, overwrite=overwrite, directory=directory, tag=tag, resume=resume, keep=keep, temporary=found
    )
    with _follow_temporary(temporary) as tmp:
        yield tmp, (None if fingerprint is None else ResumeState(fingerprint, resume))


@contextlib.contextmanager
def _follow_temporary(temporary: AbstractContextManager[Path]) -> Iterator[Path]:
    """Enter ``temporary`` (``writers.atomic_output``) and remove the manifest beside it once it is gone (renamed or removed).

    A temporary left in place (a SIGKILL, a process leaving it to rank 0's) keeps its manifest; a
    complete one loses it just before its rename (a crash between the two leaves a temporary that
    ``--resume`` refuses, naming it); so does one another process replaced (``TemporaryReplacedError``),
    so no later ``--resume`` takes that file for this run's.
    """
    tmp: Path | None = None
    try:
        with temporary as tmp:
            yield tmp
            remove_manifest(tmp)  # complete: the temporary is renamed next
    except TemporaryReplacedError:
        if tmp is not None:  # it describes this run's temporary, which another process's file replaced
            remove_manifest(tmp)
        raise
    finally:
        if tmp is not None and not tmp.exists():
            remove_manifest(tmp)


def keep_note(tmp: Path) -> str | None:
    """A ``writers.atomic_output`` ``keep``: a temporary with a manifest is worth keeping; say so, with how much is written.

    Returns:
        ``the temporary PATH (1.1 GiB of 3.2 GiB written) is kept: ...`` (binary units, as the progress
        bars), or None without a manifest (stopped before it was written: nothing to resume; the
        temporary is removed).
    """
    if not has_manifest(tmp):
        return None
    written, total = written_bytes(tmp)
    return (
        f"the temporary {tmp} ({human_bytes(written)} of {human_bytes(total)} written) is kept: "
        "run again with --resume to finish it, or remove it"
    )
