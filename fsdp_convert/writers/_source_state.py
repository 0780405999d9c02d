"""Write stage, resumable outputs: what the checkpoint's data files held when a run began, and how they changed since.

A resumable run records, in its manifest (``writers._manifest``), each data file's size,
modification time and a hash of the CRC-32s its payloads carry (``source_state``); a resume
compares them with the data files now (``changed_source``), so a data file replaced since
(another save's, same layout and ``.metadata``) is named, never mixed with the first save's
bytes in one output. Reads a few bytes per payload, no tensor data.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
from dataclasses import dataclass
from pathlib import Path

from fsdp_convert.formats.index import BytesEntry, CheckpointIndex
from fsdp_convert.held_roots import open_inside

__all__ = ["SourceFiles", "PAYLOAD_TAIL_BYTES", "SourceDigest", "source_state", "changed_source"]

SourceFiles = dict[str, list[int | str]]  # data file -> [size in bytes, mtime_ns, SHA-256 of its payloads' last bytes]
PAYLOAD_TAIL_BYTES = 1024  # a one-tensor torch.save zip's central directory (every record's CRC-32) is its last 561


@dataclass(frozen=True, slots=True)
class SourceDigest:
    """What a run reads: the digest of the checkpoint's index and each data file's state when the run began.

    Attributes:
        digest: ``_manifest.digest`` of the checkpoint's index and the entries read (``resume.source_digest``).
        files: ``source_state`` of its data files.
        root: the checkpoint, to name a data file in messages (not recorded: it may move).
        checkpoint: digest of the checkpoint whatever is read of it (its ``.metadata``, or every entry of its
            index); empty: not known (``digest`` then stands for it).
    """

    digest: str
    files: SourceFiles
    root: str = ""
    checkpoint: str = ""

    @classmethod
    def of(cls, source: str | SourceDigest, index: CheckpointIndex | None = None) -> SourceDigest:
        """``source`` as a ``SourceDigest``: a bare digest gets ``index``'s ``source_state`` (none without an index)."""
        if isinstance(source, SourceDigest):
            return source
        return cls(source, {}) if index is None else cls(source, source_state(index), str(index.checkpoint_id))


def source_state(index: CheckpointIndex) -> SourceFiles:
    """Each data file's size, modification time (``st_mtime_ns``) and a hash of the CRC-32s its payloads carry.

    The hash covers the last ``PAYLOAD_TAIL_BYTES`` of every payload range the index names in the
    file: a torch.save zip's central directory, which holds the CRC-32 of every record, so a file
    with the same size and time but other data (``cp -p`` of another save) differs too; one pread
    per payload, none of its data. Safetensors-stored chunks (no CRC-32) and zstd payloads give
    their last bytes all the same. A file that cannot be read is left out (the run reports it);
    a checkpoint in object storage has none (its ``.metadata`` is in the digest).

    Raises:
        UnsafeContentError, CorruptChunkError: a data file is a link out of the checkpoint, or not
            a regular file (``held_roots.open_inside``, as every reader opens it).
    """
    root = index.checkpoint_id
    if not isinstance(root, Path):
        return {}
    spans: dict[str, set[tuple[int, int]]] = {name: set() for name in index.data_files}
    for entry in index.entries:
        ranges = [entry] if isinstance(entry, BytesEntry) else entry.chunks
        for r in ranges:
            if r.relative_path is not None and r.length_bytes > 0:
                spans.setdefault(r.relative_path, set()).add((r.offset_bytes, r.length_bytes))
    state: SourceFiles = {}
    for name, ranges_of_file in sorted(spans.items()):
        with contextlib.suppress(OSError):
            fd = open_inside(root, root / name)  # no link out of it, no FIFO to block on (as the readers open it)
            try:
                st = os.fstat(fd)
                state[name] = [st.st_size, st.st_mtime_ns, _tails_digest(fd, sorted(ranges_of_file), st.st_size)]
            finally:
                os.close(fd)
    return state


_WINDOW_BYTES = 256 << 10  # tails this close together are read with one pread (a million small payloads)


def _tails_digest(fd: int, ranges: list[tuple[int, int]], size: int) -> str:
    """SHA-256 of the last ``PAYLOAD_TAIL_BYTES`` of each ``(offset, length)`` range (sorted) inside ``size`` bytes.

    Consecutive tails that end within ``_WINDOW_BYTES`` of the first are read with one ``pread``;
    a tail farther off (a large payload) is read alone: never more than the tails and what lies
    between close ones.
    """
    tails = [(end - min(length, PAYLOAD_TAIL_BYTES), end) for offset, length in ranges if (end := offset + length) <= size]
    digest = hashlib.sha256()
    i = 0
    while i < len(tails):
        start, j = tails[i][0], i
        while j + 1 < len(tails) and tails[j + 1][0] >= tails[j][1] and tails[j + 1][1] - start <= _WINDOW_BYTES:
            j += 1
        window = memoryview(os.pread(fd, tails[j][1] - start, start))
        for at, end in tails[i : j + 1]:
            digest.update(window[at - start : end - start])
        i = j + 1
    return digest.hexdigest()


def changed_source(old: object, source: SourceDigest) -> str | None:
    """How the first data file whose state differs from the recorded one (``old``, a manifest's ``sources``) changed.

    Returns:
        One clause for a message naming the data file and what differs (its size, time or payloads' CRC-32s, or that
        it is new or gone; or that ``old`` recorded no state), or None if every data file is as recorded.
    """
    if not isinstance(old, dict):
        return "the interrupted run recorded no state of the checkpoint's data files (an older fsdp-convert)"
    new = source.files
    name = next((n for n in sorted(set(old) | set(new)) if old.get(n) != new.get(n)), None)
    if name is None:
        return None
    then, now, path = old.get(name), new.get(name), Path(source.root) / name
    if not isinstance(then, list) or len(then) != 3 or now is None:
        return (
            f"the checkpoint's data file {path} is {'new' if now is not None else 'gone or unreadable'} since the interrupted run"
        )
    what = (
        "size differs" if then[0] != now[0] else "modification time differs" if then[1] != now[1] else "payloads' CRC-32s differ"
    )
    return f"the checkpoint's data file {path} changed since the interrupted run began (its {what})"
