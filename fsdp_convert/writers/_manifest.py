"""Write stage, resumable outputs: the manifest beside a temporary output, saying what is safely written.

A run whose output is laid out ahead (``plan``, ``plan.reshard``) writes, beside its temporary
output (``.OUT.tmp-local``, ``.full.tmp-local.pt``), a folder named like it with ``manifest-`` for
``tmp-`` (``.OUT.manifest-local``, ``.full.manifest-local.pt``; ``manifest_dir``) holding:

- ``manifest.json``, written once before any data (write, fsync, rename, fsync the folder)::

      {"version": 1,
       "fingerprint": {"source": "<sha256>", "checkpoint": "<sha256>", "options": "<sha256>", "layout": "<sha256>",
                       "named": {"whole": {"<option>": "<sha256>", ...}, "groups": {"<group>": {"<option>": "<sha256>", ...}}}},
       "files": {"<file name, '' for a file output>": <size in bytes>, ...},
       "records": <number of records>,
       "sources": {"<data file of the checkpoint>": [<size in bytes>, <mtime_ns>, "<sha256>"], ...}}

  ``source`` hashes the checkpoint's index (its ``.metadata`` or index file, and the entries
  read), ``checkpoint`` all of it, ``options`` what changes the output's bytes (transforms, dtypes,
  adapters, buffer size), ``named`` the same by option (``NamedOptions``: a resume names those that differ),
  ``layout`` the record map (``writers._temporary.RecordMap``): every output file's name and size
  and every record's ``(file, offset, length)`` (the key keeps its name, so a manifest an earlier
  version wrote still resumes);
  ``sources`` says what each data file held when the run began (``writers._source_state``): a data
  file replaced since (another save's, same layout and ``.metadata``) would mix two saves in one output.
- ``records-<writer>.jsonl``: one JSON line per record once its bytes are written *and fsynced*,
  ``[file, offset, nbytes, crc32, fqn]`` (bytes, CRC-32 of the bytes, the source key it holds). Append-only, one file per
  writing process (a worker rank), lines appended in batches (``LOG_BATCH_BYTES`` of data), each batch after its data
  is fdatasync'ed: a SIGKILL of any process loses at most its batch in flight, and a torn last line is ignored.

A record is a byte range of an output file that one worker writes whole: a tensor's data in a
consolidation, a payload's tensor bytes in a reshard. Headers, pickles, indexes and ``.metadata``
(rank 0, last) are always rewritten on resume: they are small and derive from the records' CRC-32s.

On resume, ``check_manifest`` compares the fingerprint and sources with the new plan's and ``kept_records``
reads every logged record back from the temporary and keeps only those whose CRC-32 matches, so
a torn or corrupted write is redone, never trusted. JSON only: nothing here is unpickled.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import shutil
import stat
import threading
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

from fsdp_convert.errors import OutputWriteError
from fsdp_convert.formats.crc import crc32
from fsdp_convert.writers._nofollow import open_in, refuse_link
from fsdp_convert.writers._readback import (
    check_logs,
    logged_lines,
    logs_limit_bytes,
    manifest_limit_bytes,
    read_json,
)
from fsdp_convert.writers._source_state import SourceDigest, changed_source

__all__ = [
    "MANIFEST_VERSION",
    "Record",
    "NamedOptions",
    "RecordLog",
    "LOG_BATCH_BYTES",
    "manifest_dir",
    "has_manifest",
    "digest",
    "start_manifest",
    "check_manifest",
    "kept_records",
    "remove_manifest",
    "written_bytes",
]

MANIFEST_VERSION = 1
_MANIFEST_FILENAME = "manifest.json"
_READ_BYTES = 16 << 20  # records are read back in pieces of this size
_ADDRESS_RE = re.compile(r" at 0x[0-9a-fA-F]+")  # object addresses in reprs differ between runs


@dataclass(frozen=True, slots=True, order=True)
class Record:
    """A byte range of one output file that one writer writes whole.

    Attributes:
        file: the file's name relative to the output (``""``: a file output itself).
        offset: where the range starts, in bytes.
        nbytes: its length, in bytes.
    """

    file: str
    offset: int
    nbytes: int


@dataclass(frozen=True, slots=True)
class NamedOptions:
    """Digests of what changes the output's bytes, by the option(s) each comes from: a resume names those that differ.

    Attributes:
        whole: per option (``--format``), a digest of what it sets for the whole output.
        groups: per group the output holds (``model``, ``optim``, ``other``: ``--only`` chooses them), per option a digest
            of what it sets in that group; the first is the entries the group reads, the others compared only where it agrees.
    """

    whole: dict[str, str]
    groups: dict[str, dict[str, str]]

    def to_json(self) -> dict[str, object]:
        """As the manifest's ``fingerprint.named`` holds it."""
        return {"whole": self.whole, "groups": self.groups}

    def differing(self, old: object) -> list[str]:
        """The options whose digests differ from ``old`` (a manifest's ``fingerprint.named``); none for an earlier version's."""
        if not isinstance(old, dict) or not isinstance(old.get("whole"), dict) or not isinstance(old.get("groups"), dict):
            return []
        old_groups: dict[str, object] = old["groups"]
        names = ["--only"] if set(old_groups) != set(self.groups) else []  # the groups held differ
        for group, new in self.groups.items():
            then = old_groups.get(group)
            if isinstance(then, dict):  # its selection (the first) first: the others describe the same entries only then
                selection = next(iter(new))
                differ = [selection] if then.get(selection) != new[selection] else [n for n, v in new.items() if then.get(n) != v]
                names += differ
        names += [name for name in sorted(set(self.whole) | set(old["whole"])) if old["whole"].get(name) != self.whole.get(name)]
        return list(dict.fromkeys(names))


def manifest_dir(tmp: Path) -> Path:
    """The manifest folder of temporary output ``tmp``: its sibling named with ``.manifest-`` for the last ``.tmp-``.

    Not a temporary's name (``writers._atomic.temporaries``), so it is never taken for another run's temporary.
    """
    head, sep, tail = tmp.name.rpartition(".tmp-")
    return tmp.parent / (f"{head}.manifest-{tail}" if sep else f"{tmp.name}.manifest")


def has_manifest(tmp: Path) -> bool:
    """Whether temporary output ``tmp`` has a manifest (its ``manifest.json``)."""
    return (manifest_dir(tmp) / _MANIFEST_FILENAME).is_file()


def digest(*parts: object) -> str:
    """SHA-256 (hex) of the parts' reprs, object addresses removed (so it is the same in every run)."""
    h = hashlib.sha256()
    for part in parts:
        h.update(_ADDRESS_RE.sub("", repr(part)).encode())
        h.update(b"\0")
    return h.hexdigest()


def _record_map_digest(files: dict[str, int], records: Sequence[Record]) -> str:
    return digest(sorted(files.items()), sorted(records))


def _write_json(path: Path, obj: object) -> None:
    """Write ``path`` whole or not at all: a sibling, fsynced, renamed over it, the folder fsynced."""
    part = path.with_name(path.name + ".part")
    with os.fdopen(open_in(part.parent, part.name, os.O_WRONLY | os.O_CREAT | os.O_EXCL), "w", encoding="utf-8") as f:
        json.dump(obj, f, sort_keys=True)
        f.flush()
        os.fsync(f.fileno())
    os.replace(part, path)
    fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def start_manifest(
    tmp: Path,
    *,
    source: str | SourceDigest,
    options: str,
    files: dict[str, int],
    records: Sequence[Record],
    named: NamedOptions | None = None,
) -> None:
    """Write a fresh manifest for temporary output ``tmp`` (any old one is removed first). Rank 0's process, before any data.

    Args:
        tmp: the temporary output (file or folder).
        source: digest of the checkpoint's index (``digest``), with its data files' state (``SourceDigest``).
        options: digest of what changes the output's bytes.
        files: every output file's name (``""`` for a file output) and size, in bytes.
        records: every record of the plan.
        named: ``options`` by option (None: not recorded; a resume then says only that the options differ).

    Raises:
        OutputWriteError: the manifest cannot be written.
    """
    folder = manifest_dir(tmp)
    try:
        refuse_link(folder)  # planted: neither removed nor written through
        shutil.rmtree(folder, ignore_errors=True)
        folder.mkdir(parents=True)
        source = SourceDigest.of(source)
        layout = _record_map_digest(files, records)
        fingerprint: dict[str, object] = {"source": source.digest, "options": options, "layout": layout}
        if source.checkpoint:
            fingerprint["checkpoint"] = source.checkpoint
        if named is not None:
            fingerprint["named"] = named.to_json()
        manifest = {"version": MANIFEST_VERSION, "fingerprint": fingerprint, "files": files, "records": len(records)}
        _write_json(folder / _MANIFEST_FILENAME, {**manifest, "sources": source.files})
    except OSError as e:
        raise OutputWriteError(f"cannot write {folder}: {e.strerror}") from e


def check_manifest(
    tmp: Path,
    *,
    source: str | SourceDigest,
    options: str,
    files: dict[str, int],
    records: Sequence[Record],
    named: NamedOptions | None = None,
) -> None:
    """Check that ``tmp``'s manifest describes the same plan; touches nothing.

    Args:
        tmp: the interrupted run's temporary output.
        source: the new plan's checkpoint digest and data files' state (as for ``start_manifest``).
        options: the new plan's options digest.
        files: the new plan's files and sizes, in bytes.
        records: the new plan's records.
        named: the new plan's ``options`` by option (``NamedOptions``).

    Raises:
        OutputWriteError: no readable manifest, or one that differs (the message names what:
            the checkpoint, a data file of it that changed, the options (naming those that differ,
            when both manifests record them by option), or the output layout, with the first differing file).
    """
    path = manifest_dir(tmp) / _MANIFEST_FILENAME
    try:
        old = read_json(path, tmp, manifest_limit_bytes(len(files) + len(SourceDigest.of(source).files)))
        fingerprint, old_files = old["fingerprint"], old["files"]
        if old["version"] != MANIFEST_VERSION:
            raise ValueError("another version's")  # its value is the file's: not quoted
    except (OSError, ValueError, KeyError, TypeError) as e:
        detail = e.strerror if isinstance(e, OSError) else type(e).__name__ if isinstance(e, (KeyError, TypeError)) else e
        raise OutputWriteError(
            f"cannot resume {tmp}: no usable manifest at {path} ({detail}); remove {tmp} and run without --resume"
        ) from e
    check_logs(manifest_dir(tmp), tmp, logs_limit_bytes(len(records)))
    hint = f"rerun with the interrupted run's arguments, or remove {tmp} and run without --resume"
    source = SourceDigest.of(source)
    then = fingerprint.get("checkpoint")  # without it (an earlier version's), the entries read are compared too
    if (then != source.checkpoint) if then and source.checkpoint else fingerprint.get("source") != source.digest:
        raise OutputWriteError(f"cannot resume {tmp}: the checkpoint differs from the interrupted run's; {hint}")
    if (changed := changed_source(old.get("sources"), source)) is not None:
        raise OutputWriteError(f"cannot resume {tmp}: {changed}; put it back, or remove {tmp} and run without --resume")
    if named is not None and (differ := named.differing(fingerprint.get("named"))):
        raise OutputWriteError(
            f"cannot resume {tmp}: the options differ ({', '.join(differ)}) from the interrupted run's; {hint}"
        )
    if fingerprint.get("options") != options or fingerprint.get("source") != source.digest:
        raise OutputWriteError(
            f"cannot resume {tmp}: the options that change the output differ from the interrupted run's; {hint}"
        )
    if fingerprint.get("layout") != _record_map_digest(files, records):
        name = next((n for n in sorted(set(files) | set(old_files)) if files.get(n) != old_files.get(n)), None)
        shown = name or "(the output file)"
        what = f"{shown}: {old_files.get(name)} bytes then, {files.get(name)} now" if name is not None else "record offsets"
        raise OutputWriteError(f"cannot resume {tmp}: the output layout differs ({what}); {hint}")


def _logged(tmp: Path) -> Iterable[tuple[Record, int]]:
    """Every complete line of every records file of ``tmp`` (``readback.logged_lines``) as a record and its CRC-32."""
    for line in logged_lines(manifest_dir(tmp), tmp):
        try:
            file, offset, nbytes, crc, *_ = line
            yield Record(str(file), int(offset), int(nbytes)), int(crc)
        except (ValueError, TypeError):
            continue


def _crc_of(path: Path, offset: int, nbytes: int) -> int | None:
    """CRC-32 of ``[offset, offset + nbytes)`` of ``path``, or None if the file is shorter or missing."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)  # no FIFO to block on
    except OSError:  # missing, or a link: its records are written again (refuse_links_inside refuses the link)
        return None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return None
        crc, at = 0, offset
        while at < offset + nbytes:
            data = os.pread(fd, min(_READ_BYTES, offset + nbytes - at), at)
            if not data:
                return None
            crc = crc32(data, crc)
            at += len(data)
        return crc
    finally:
        os.close(fd)


def kept_records(tmp: Path, records: Sequence[Record], path_of: Callable[[str], Path]) -> dict[Record, int]:
    """The records of ``records`` that ``tmp``'s logs list and whose bytes, read back, match their CRC-32.

    Reads every logged record back once (``kept bytes`` of I/O).

    Args:
        tmp: the interrupted run's temporary output.
        records: the new plan's records (logged ones not among them are ignored).
        path_of: the file a record's ``file`` names inside ``tmp``.

    Returns:
        Each kept record's CRC-32.
    """
    wanted = set(records)
    kept: dict[Record, int] = {}
    for record, crc in _logged(tmp):
        if record in wanted and record not in kept and _crc_of(path_of(record.file), record.offset, record.nbytes) == crc:
            kept[record] = crc
    return kept


LOG_BATCH_BYTES = 64 << 20
"""Records are logged in batches of this many data bytes (per writer): one fdatasync per data file and one of the log
per batch, not per record. A SIGKILL loses at most the batch in flight (its records are written again on resume)."""


class RecordLog:
    """One writer's append-only records file, ``records-<writer>.jsonl``; thread-safe.

    Records are logged in batches (``LOG_BATCH_BYTES`` of data, read when the log is opened): once
    a batch is full, its data files are fdatasync'ed, then its lines appended and the log
    fdatasync'ed, so a line never names bytes that are not durable. ``flush`` logs the batch so far
    (a worker's share is moved: before rank 0 writes what it writes last); ``close`` does too.

    Args:
        tmp: the temporary output.
        writer: the writing process's name in the file name (its worker rank).
    """

    def __init__(self, tmp: Path, writer: str) -> None:
        self._lock = threading.Lock()
        self._fd = open_in(manifest_dir(tmp), f"records-{writer}.jsonl", os.O_WRONLY | os.O_CREAT | os.O_APPEND)  # no link
        self._batch_bytes = LOG_BATCH_BYTES
        self._lines: list[bytes] = []
        self._data_fds: set[int] = set()
        self._bytes = 0

    def append(self, record: Record, crc32: int, data_fd: int, fqn: str) -> None:
        """Log ``record`` (``fqn``'s bytes, written to ``data_fd``) as written, with the batch it completes.

        Raises:
            OSError: a write or fdatasync failed.
        """
        line = json.dumps([record.file, record.offset, record.nbytes, crc32, fqn]).encode() + b"\n"
        with self._lock:
            self._lines.append(line)
            self._data_fds.add(data_fd)
            self._bytes += record.nbytes
            if self._bytes < self._batch_bytes:
                return
            batch = self._take()
        self._commit(*batch)

    def flush(self) -> None:
        """Log every record appended so far: their data files fdatasync'ed, then their lines.

        Raises:
            OSError: a write or fdatasync failed.
        """
        with self._lock:
            batch = self._take()
        self._commit(*batch)

    def _take(self) -> tuple[list[bytes], set[int]]:
        batch = self._lines, self._data_fds
        self._lines, self._data_fds, self._bytes = [], set(), 0
        return batch

    def _commit(self, lines: list[bytes], data_fds: set[int]) -> None:
        if not lines:
            return
        for fd in data_fds:
            os.fdatasync(fd)
        os.write(self._fd, b"".join(lines))  # O_APPEND: one write, whole lines
        os.fdatasync(self._fd)

    def close(self) -> None:
        """Log what is pending (its bytes are written; a stop by a signal keeps them too), then close the log."""
        with contextlib.suppress(OSError):
            self.flush()
        with contextlib.suppress(OSError):
            os.close(self._fd)


def written_bytes(tmp: Path) -> tuple[int, int]:
    """How much of temporary output ``tmp`` is logged as written, and its planned size, in bytes (read only, no CRC check).

    Returns:
        (the logged records' bytes, each record once; the sum of the manifest's file sizes), or
        (0, 0) without a readable manifest.
    """
    try:
        # no plan here (a progress total, a left temporary's message): bounded as a plan of 8,192 files' would be
        files = read_json(manifest_dir(tmp) / _MANIFEST_FILENAME, tmp, manifest_limit_bytes(8192))["files"]
        total = sum(int(size) for size in files.values())
        written = sum(record.nbytes for record in {record for record, _ in _logged(tmp)})
    except (OutputWriteError, OSError, ValueError, KeyError, TypeError, AttributeError):
        return 0, 0
    return written, total


def remove_manifest(tmp: Path) -> None:
    """Remove ``tmp``'s manifest folder, if any (the output is complete, or its temporary is gone)."""
    shutil.rmtree(manifest_dir(tmp), ignore_errors=True)
