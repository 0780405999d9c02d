"""Write stage, the output transaction: the one context an operation writes its output in.

An operation opens one ``OutputTransaction`` per output and writes everything inside it:

1. ``OutputTransaction(output, inputs=..., own_files=...)``: OUT is checked before anything is read
   (``check_output``: not an input, inside one or around one; no link; free, or ``--overwrite``
   onto a folder of the names this tool writes there, which the caller gives from the tables).
2. ``with ... as tx``: an fsspec URL is staged in a private local folder under its lock object
   (``writers._staging.local_output``); ``tx.output`` is where to write, ``tx.shown`` what the
   user named.
3. ``tx.check_free(directory=...)`` once the output's kind is known (optional: ``begin`` does it).
4. ``tx.begin(...)``: OUT free again (``check_output_free``), the space check (``check_space``),
   then the lock (``writers._lock``) and the temporary sibling (``writers._atomic``), resumable
   with a manifest (``writers._temporary.temporary_output``, ``writers._manifest``).
5. Leaving the block renames the temporary into place, then uploads a staged output. An error
   removes the temporary (Ctrl-C, SIGTERM and a failed worker keep a resumable one, with a note:
   ``kept_note``); ``LeaveToOwner`` (a process that does not hold rank 0 of a shared job) leaves
   it to rank 0's process and is not an error.

The names other packages use from the write side's private modules are re-exported here, so
nothing outside ``writers/`` imports them.
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path
from types import TracebackType

from fsdp_convert.location import Location, Url
from fsdp_convert.own_files import OwnFiles
from fsdp_convert.writers._atomic import KEPT_ON, LeaveToOwner, kept_note, temporary_path, writing
from fsdp_convert.writers._dcp_pickle import is_plain, value_payload
from fsdp_convert.writers._lock import check_not_locked
from fsdp_convert.writers._manifest import NamedOptions, Record, RecordLog, digest, kept_records, start_manifest, written_bytes
from fsdp_convert.writers._output_check import check_output, check_output_free
from fsdp_convert.writers._source_state import SourceDigest
from fsdp_convert.writers._space import check_space, free_bytes
from fsdp_convert.writers._staging import local_output, staging_prefix
from fsdp_convert.writers._temporary import Fingerprint, RecordMap, ResumeState, find_temporary, keep_note, temporary_output

__all__ = [
    "OutputTransaction",
    # the pieces the transaction composes, and what workers and the CLI use of them
    "KEPT_ON",
    "Fingerprint",
    "LeaveToOwner",
    "NamedOptions",
    "Record",
    "RecordLog",
    "RecordMap",
    "ResumeState",
    "SourceDigest",
    "check_not_locked",
    "check_output",
    "check_output_free",
    "check_space",
    "digest",
    "find_temporary",
    "free_bytes",
    "is_plain",
    "keep_note",
    "kept_note",
    "kept_records",
    "local_output",
    "staging_prefix",
    "start_manifest",
    "temporary_output",
    "temporary_path",
    "value_payload",
    "writing",
    "written_bytes",
]


class OutputTransaction:
    """One operation's output, from the check of OUT to the rename into place (and the upload of a staged one).

    Called in every process of a job, with the same arguments. The steps are the module
    docstring's; a typical use::

        with OutputTransaction(output, inputs=(checkpoint_id,), overwrite=overwrite, tag=tag) as tx:
            ...  # read the index, plan, writing nothing
            tmp, resumable = tx.begin(directory=False, needed_bytes=n, fingerprint=fp, resume=resume)
            ...  # write into tmp; raise LeaveToOwner in a process that does not hold rank 0
        # tmp is now at tx.output (and uploaded to tx.url, when staged)

    Attributes:
        output: where to write locally: OUT itself, or its local staging copy for a URL.
        shown: OUT as the user named it (a ``Path`` or a ``Url``): the result reports it.
        url: the remote output when staged, else None.
        tag: the temporary's name every process of a multi-process job shares (``launch.shared_tag``),
            None for a job on one node.
    """

    output: Path
    shown: Location
    url: Url | None

    def __init__(
        self,
        output: str | os.PathLike[str],
        *,
        inputs: tuple[str | os.PathLike[str] | None, ...],
        overwrite: bool = False,
        force: bool = False,
        tag: str | None = None,
        last: tuple[str, ...] = (),
        own_files: OwnFiles | None = None,
    ) -> None:
        """Check OUT at once, before anything is read (``check_output``).

        Args:
            output: OUT: a local path, ``file://`` path or fsspec URL.
            inputs: what the operation reads (the checkpoint, ``--hf-assets``); None entries are skipped.
            overwrite: replace an existing OUT (at the final rename only), and discard the temporary an
                interrupted run of it left (``writers._atomic.check_no_temporary``) rather than refuse it.
            force: with ``overwrite``, replace a folder that does not look like this tool's output too.
            tag: the job's shared tag (``launch.shared_tag(cluster)``), None on one node; with a tag
                OUT may not be a URL (the nodes write to a filesystem they share).
            last: names of files in an output folder to upload after all others (an index, ``.metadata``).
            own_files: the names this tool writes in an output folder, which ``overwrite`` replaces
                without ``force`` (``check_output``): None, the output kinds' (``output_table.own_files()``);
                ``reshard`` joins the producers' (``producers.own_files()``).

        Raises:
            InvalidOptionError: OUT is an input, inside one, or one of its folders.
            OutputExistsError: OUT is a link, exists without ``overwrite``, or is a folder not this
                tool's without ``force``.
            InvalidOptionError: an existing folder where a file is wanted.
        """
        check_output(output, inputs, overwrite=overwrite, force=force, own_files=own_files)  # not onto an input, first
        self._requested = output
        self._overwrite, self._force, self._own_files = overwrite, force, own_files
        self.tag = tag
        self._last = last
        self._stack: contextlib.ExitStack | None = None
        self._begun = False

    def __enter__(self) -> OutputTransaction:
        """Stage a URL output locally under its lock object (``writers._staging.local_output``); a local one is used in place.

        Raises:
            InvalidOptionError: a URL with a shared ``tag`` (a multi-node run), or a bucket itself.
            OutputExistsError: the URL exists and ``overwrite`` is false.
            OutputLockedError: another run is writing the URL.
        """
        with contextlib.ExitStack() as stack:
            staging = local_output(self._requested, overwrite=self._overwrite, shared=self.tag is not None, last=self._last)
            self.output, self.shown = stack.enter_context(staging)
            self.url = self.shown if isinstance(self.shown, Url) else None
            self._stack = stack.pop_all()
        return self

    def check_free(self, *, directory: bool) -> None:
        """Refuse an OUT that is taken (``check_output_free``), as soon as the output's kind is known.

        ``begin`` checks it again; an operation calls this first to refuse a taken OUT before it
        reads or plans anything.

        Args:
            directory: whether the output is a folder.

        Raises:
            OutputExistsError: OUT exists and ``overwrite`` is false, is a link, or is a folder not
                this tool's and ``force`` is false.
            InvalidOptionError: an existing folder where a file is wanted.
        """
        own = self._own_files
        check_output_free(self.output, overwrite=self._overwrite, force=self._force, directory=directory, own_files=own)

    def begin(
        self, *, directory: bool, needed_bytes: int | None, fingerprint: Fingerprint | None, resume: bool
    ) -> tuple[Path, ResumeState | None]:
        """Check OUT and the space, then take the lock and enter the temporary; every process of the job calls it.

        Args:
            directory: whether the output is a folder.
            needed_bytes: the output's size (or, for a URL, what its staging folder holds at most),
                in bytes; None skips the space check (``--no-space-check``).
            fingerprint: the plan's (``resume.consolidate_fingerprint``, ``resume.reshard_fingerprint``),
                which makes the temporary resumable; ignored for a staged URL, whose staging folder
                is private and keeps no manifest. None: not resumable.
            resume: ``--resume``: continue the interrupted run's temporary (its manifest must match
                ``fingerprint``).

        Returns:
            The temporary to write into (renamed onto ``output`` when the block completes), and what
            the workers need to resume it (None when not resumable).

        Raises:
            OutputExistsError, OutputWriteError: as ``check_free``; the output does not fit
                (``check_space``); the temporary or the lock cannot be made.
            OutputLockedError: another run holds the output's lock.
            TemporaryExistsError: an earlier run's temporary is left, and neither ``resume`` nor ``overwrite`` is given.
            RuntimeError: called outside the ``with`` block, or twice.
        """
        if self._stack is None or self._begun:
            raise RuntimeError("OutputTransaction.begin: call it once, inside the with block")
        self._begun = True
        self.check_free(directory=directory)
        if needed_bytes is not None:
            check_space(self.output, needed_bytes, directory=directory, tag=self.tag, shown=self.shown)
        if self.url is not None:
            fingerprint = None  # a staged upload keeps no manifest
        temporary = temporary_output(
            self.output, overwrite=self._overwrite, directory=directory, tag=self.tag, fingerprint=fingerprint, resume=resume
        )
        return self._stack.enter_context(temporary)

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> bool:
        """Rename the temporary into place and upload a staged output; on an error, remove (or keep) it and upload nothing.

        Returns:
            True when the block raised ``LeaveToOwner`` (the exception is swallowed: rank 0's
            process renames the shared temporary), else False.
        """
        stack, self._stack = self._stack, None
        if stack is None:
            return False
        return bool(stack.__exit__(exc_type, exc, tb))
