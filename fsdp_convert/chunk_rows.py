"""Move stage, its geometry: a tensor as dim-0 rows, a chunk as a box of rows, a derived tensor as byte runs of chunks.

A derived tensor that is only row segments of its inputs (no ``combine``, no cast: a stacked
expert weight split per expert, experts stacked back, a fused QKV weight cut or joined) needs no
row blocks built: ``segment_runs`` gives its rows as byte ranges of the inputs' dim-0 chunks,
which the mover copies as it copies a plain tensor (``move.Mover``); any other derived tensor is
built block by block (``blocks.move_derived``).
"""

from __future__ import annotations

import math

from fsdp_convert.derive import Derived, Segment
from fsdp_convert.dtypes import DType
from fsdp_convert.formats.index import ChunkEntry, TensorEntry

__all__ = ["rows_of", "box", "SegmentRun", "segment_runs"]


def rows_of(shape: tuple[int, ...]) -> tuple[int, int]:
    """(dim-0 length, elements per dim-0 index); a 0-dim tensor is one row of one element."""
    return (shape[0], math.prod(shape[1:])) if shape else (1, 1)


def box(chunk: ChunkEntry) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """A chunk's (offsets, sizes), a 0-dim tensor's as one row."""
    return (chunk.offsets, chunk.sizes) if chunk.sizes else ((0,), (1,))


SegmentRun = tuple[TensorEntry, ChunkEntry, int, int, int]
"""``(entry, chunk, begin, end, at)``: the chunk's bytes ``[begin, end)`` go to byte ``at`` of the rows written."""


def segment_runs(
    derived: Derived, entries: tuple[TensorEntry, ...], dtype: DType, row_range: tuple[int, int]
) -> list[SegmentRun] | None:
    """Rows ``row_range`` of a derived tensor as byte ranges of its inputs' chunks, when it is only that.

    It is when there is no ``combine``, no cast (every input in ``dtype``), each input's rows a
    ``derive.Segment`` of rows as long as the output's (in the views), the segments tiling the
    output in input order, and every input chunk whole rows (dim-0 chunks: FSDP's ``Shard(0)``).

    Args:
        derived: how the tensor is made.
        entries: the entries of ``derived.inputs``, in order.
        dtype: the dtype written.
        row_range: the tensor's dim-0 rows ``[begin, end)`` written.

    Returns:
        The runs, in output order (offsets ``at`` in bytes from row ``row_range[0]``); None when the
        tensor is not such a copy (``move_derived`` builds it).
    """
    view = derived.out_view
    if derived.combine is not None:
        return None
    row_bytes = math.prod(view[1:]) * dtype.itemsize
    per_row = view[0] // max(rows_of(derived.shape)[0], 1)
    begin, end = row_range[0] * per_row, row_range[1] * per_row
    runs: list[SegmentRun] = []
    tiled = 0
    for inp, entry in zip(derived.inputs, entries, strict=True):
        seg, in_view = inp.rows, inp.view or entry.shape or (1,)
        if not isinstance(seg, Segment) or not entry.shape or seg.start != tiled or entry.dtype != dtype:
            return None
        if in_view[1:] != view[1:]:
            return None
        if seg.src_start < 0 or seg.src_start + seg.length > in_view[0]:
            return None  # move_derived says what is wrong
        tiled += seg.length
        lo, hi = max(begin, seg.start), min(end, seg.start + seg.length)
        if lo >= hi:
            continue
        src_lo, src_hi = (lo - seg.start + seg.src_start) * row_bytes, (hi - seg.start + seg.src_start) * row_bytes
        tensor_row_bytes = rows_of(entry.shape)[1] * dtype.itemsize
        for chunk in sorted((c for c in entry.chunks if c.numel > 0), key=lambda c: c.offsets):
            (c0, *rest_offsets), (c_rows, *rest_sizes) = box(chunk)
            if any(rest_offsets) or tuple(rest_sizes) != tuple(entry.shape[1:]):
                return None
            a, b = max(src_lo, c0 * tensor_row_bytes), min(src_hi, (c0 + c_rows) * tensor_row_bytes)
            if a < b:
                runs.append(
                    (entry, chunk, a - c0 * tensor_row_bytes, b - c0 * tensor_row_bytes, (lo - begin) * row_bytes + a - src_lo)
                )
    return runs if tiled == view[0] else None
