"""Transform stage, adapters in sequence: one rule set applied to another's outputs, as one rule set over the checkpoint.

``Chain(first, then)`` is a ``derive.Adapter``: ``then`` sees the tensors ``first`` makes (their
FQNs, dtypes and shapes), and each of its rules is rewritten to read the checkpoint itself
(``compose``), so the mover still builds every output row block by row block, in bounded memory,
with no tensor of ``first``'s written in between. ``--dequantize`` before an adapter (block FP8
weights to float32, then torchtitan's names and stacked experts) and an adapter before
``--quantize fp8-block128`` are such chains (``transform.fp8``).

An input of ``then``'s rule that names a tensor ``first`` copies is renamed to that tensor; one
that names a computed tensor (``first``'s ``Derived`` with a ``combine``, a row map or a cast) is
replaced by that rule's inputs, their row maps composed (``ThenRows``), and the rule's ``combine``
and cast run inside the new ``combine`` (``Staged``), exactly as the mover would have run them on
the block of rows ``then`` reads.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from fsdp_convert.derive import (
    Adapter,
    Aligned,
    Derived,
    Gather,
    HeadPermute,
    Input,
    RowMap,
    Segment,
    TensorInfo,
    concat,
    row_span,
)
from fsdp_convert.dtypes import DType
from fsdp_convert.errors import UnsupportedTransformError

if TYPE_CHECKING:
    import torch

__all__ = ["Chain", "ThenRows", "Fixed", "Widened", "Stage", "Staged", "compose"]

Combine = Callable[[Sequence["torch.Tensor"]], "torch.Tensor"]


def _contiguous(rows: RowMap) -> bool:
    """True for a row map that gives one ascending ``range`` per block: a computed tensor can be built on exactly that block.

    Besides ``derive``'s, a map says so with a class attribute ``contiguous = True`` (``transform.fp8``'s block maps).
    """
    return isinstance(rows, (Aligned, Segment, Fixed)) or getattr(rows, "contiguous", False) is True


def _one_per_row(rows: RowMap | None) -> bool:
    """True for a row map naming exactly one input row per output row (or a whole input): alone as in any block.

    A map outside ``derive`` says so with a class attribute ``one_per_row = True`` (``transform.fp8.ScaleRows``).
    """
    return rows is None or isinstance(rows, (Aligned, Gather, HeadPermute)) or getattr(rows, "one_per_row", False) is True


@dataclass(frozen=True, slots=True)
class ThenRows:
    """An input row map through another: output rows to ``outer``'s rows of a computed tensor, those to ``inner``'s.

    A contiguous block of ``outer`` rows ``[a, b)`` gives ``inner(a, b)``; a selection (a permutation)
    gives ``inner(i, i + 1)`` for each of its rows in order (``compose`` allows that only when every
    input of the computed tensor names one row per row).
    """

    outer: RowMap
    inner: RowMap

    def __call__(self, r0: int, r1: int) -> Sequence[int]:
        """The inner input's rows for output rows ``[r0, r1)``."""
        rows = self.outer(r0, r1)
        if isinstance(rows, range) and rows.step == 1:
            return self.inner(rows.start, rows.stop) if rows else range(0)
        return [i for r in rows for i in self.inner(r, r + 1)]

    def span(self, r0: int, r1: int) -> tuple[int, int] | None:
        """``inner``'s span over ``outer``'s (every map here is monotone; see ``derive.row_span``)."""
        outer = row_span(self.outer, r0, r1)
        return None if outer is None else row_span(self.inner, *outer)


@dataclass(frozen=True, slots=True)
class Fixed:
    """The same input rows ``[start, stop)`` for every block (a computed tensor read whole by the outer rule)."""

    start: int
    stop: int

    def __call__(self, r0: int, r1: int) -> Sequence[int]:
        """``[start, stop)``, whatever the block."""
        return range(self.start, self.stop)

    def span(self, r0: int, r1: int) -> tuple[int, int] | None:
        """``(start, stop)`` (see ``derive.row_span``)."""
        return (self.start, self.stop) if self.start < self.stop else None


@dataclass(frozen=True, slots=True)
class Widened:
    """Rows of a tensor built ``per_row`` view rows to a row: row ``i`` of ``rows`` is view rows ``[i * k, (i + 1) * k)``.

    ``k`` is ``per_row``. A stacked ``(E, F, D)`` expert weight is built in its ``(E * F, D)`` view;
    a rule reading it in its own shape names experts.
    """

    rows: RowMap
    per_row: int

    def __call__(self, r0: int, r1: int) -> Sequence[int]:
        """The view rows of ``rows(r0, r1)``, in order."""
        picked = self.rows(r0, r1)
        k = self.per_row
        if isinstance(picked, range) and picked.step == 1:
            return range(picked.start * k, picked.stop * k)
        return [i * k + j for i in picked for j in range(k)]

    def span(self, r0: int, r1: int) -> tuple[int, int] | None:
        """``rows``' span, widened (see ``derive.row_span``)."""
        span = row_span(self.rows, r0, r1)
        return None if span is None else (span[0] * self.per_row, span[1] * self.per_row)


@dataclass(frozen=True, slots=True)
class Stage:
    """How ``Staged`` makes one input of the outer rule: from ``count`` parts, with ``combine``, cast to ``dtype``.

    ``row_shape`` is the part's shape after dim 0 in the outer rule (its ``Input.view``, or the
    computed tensor's own shape).
    """

    count: int
    combine: Combine | None
    dtype: DType
    row_shape: tuple[int, ...]
    whole: bool = False  # some part is read whole: the stage's rows cannot be told from its parts

    def empty(self, parts: Sequence[torch.Tensor]) -> bool:
        """True when every part is rows and none has any: the block has no rows of this input (another expert's block)."""
        return not self.whole and all(part.shape[0] == 0 for part in parts)


@dataclass(frozen=True, slots=True)
class Staged:
    """``combine`` of a composed rule: each computed input's parts run through its own rule first, then ``outer``.

    Attributes:
        outer: the outer rule's ``combine`` (None: ``derive.concat``).
        stages: per outer input, None (one part, as read) or the ``Stage`` that makes it.
    """

    outer: Combine | None
    stages: tuple[Stage | None, ...]

    def __call__(self, parts: Sequence[torch.Tensor]) -> torch.Tensor:
        """The outer rule's block from the inner inputs' parts (each stage cast as the mover casts)."""
        import torch

        made: list[torch.Tensor] = []
        i = 0
        for stage in self.stages:
            if stage is None:
                made.append(parts[i])
                i += 1
                continue
            mine = parts[i : i + stage.count]
            i += stage.count
            if stage.empty(mine):  # skip the combine: a stacked tensor's block holds one or two of its experts
                made.append(torch.empty((0, *stage.row_shape), dtype=stage.dtype.torch))
                continue
            made.append((stage.combine or concat)(mine).to(stage.dtype.torch).reshape(-1, *stage.row_shape))
        if self.outer is None:  # concat: rows of the parts that have some
            made = [part for part in made if part.shape[0]] or made[:1]
        return (self.outer or concat)(made)


def _plain(rule: Derived, infos: Mapping[str, TensorInfo]) -> bool:
    """True when ``rule`` is its one input as it is (same shape and dtype): only a new name."""
    source = infos.get(rule.inputs[0].fqn)
    return rule.is_copy and source is not None and (rule.shape, rule.dtype) == (source.shape, source.dtype)


def compose(fqn: str, outer: Derived, inner: Mapping[str, Derived], infos: Mapping[str, TensorInfo]) -> Derived:
    """``outer``, a rule over ``inner``'s outputs, as a rule over the tensors ``inner`` reads.

    Args:
        fqn: ``outer``'s output FQN (named in errors).
        outer: the second rule set's rule.
        inner: the first rule set, by output FQN.
        infos: the tensors the first rule set reads, by FQN.

    Returns:
        The same output (shape, dtype, view), reading the checkpoint's tensors.

    Raises:
        UnsupportedTransformError: ``outer`` reads a tensor ``inner`` does not make, reads a computed
            tensor in a view of other rows than it is built in, or through a row selection the
            computed tensor cannot be built for (a block rule such as ``--quantize``'s).
    """
    inputs: list[Input] = []
    stages: list[Stage | None] = []
    for inp in outer.inputs:
        rule = inner.get(inp.fqn)
        if rule is None:
            raise UnsupportedTransformError(f"{fqn}: its input {inp.fqn} is not made by the first rule set")
        if _plain(rule, infos):
            inputs.append(Input(fqn=rule.inputs[0].fqn, rows=inp.rows, view=inp.view))
            stages.append(None)
            continue
        rows_as_read = (inp.view or rule.shape or (1,))[0]
        if rule.out_view[0] % max(rows_as_read, 1):
            raise UnsupportedTransformError(
                f"{fqn}: reads {inp.fqn} as {inp.view or rule.shape}, not in whole rows of the {rule.out_view} it is built in"
            )
        outer_rows: RowMap = Fixed(0, rows_as_read) if inp.rows is None else inp.rows
        if not _contiguous(outer_rows) and not all(_one_per_row(part.rows) for part in rule.inputs):
            raise UnsupportedTransformError(
                f"{fqn}: reads {inp.fqn} through {type(outer_rows).__name__}, a row selection its rule cannot be built for"
            )
        if rule.out_view[0] != rows_as_read:  # e.g. a stacked expert weight, built in its (E * F, D) view, read as (E, F, D)
            outer_rows = Widened(outer_rows, rule.out_view[0] // rows_as_read)
        for part in rule.inputs:
            rows = None if part.rows is None else ThenRows(outer_rows, part.rows)
            inputs.append(Input(fqn=part.fqn, rows=rows, view=part.view))
        row_shape = (inp.view or rule.shape or (1,))[1:]
        whole = any(part.rows is None for part in rule.inputs)
        stages.append(Stage(len(rule.inputs), rule.combine, rule.dtype, tuple(row_shape), whole))
    if all(stage is None for stage in stages):
        return Derived(inputs=tuple(inputs), shape=outer.shape, dtype=outer.dtype, combine=outer.combine, view=outer.view)
    combine = Staged(outer.combine, tuple(stages))
    return Derived(inputs=tuple(inputs), shape=outer.shape, dtype=outer.dtype, combine=combine, view=outer.view)


@dataclass(frozen=True, slots=True)
class Chain:
    """``then`` applied to what ``first`` makes, as one ``derive.Adapter`` over the checkpoint's tensors.

    Attributes:
        first: the first rule set (``transform.fp8.dequantize_rules``, a bound model-family adapter).
        then: the second, given ``first``'s outputs as ``TensorInfo`` s (their FQNs, dtypes, shapes).
    """

    first: Adapter
    then: Adapter

    def __call__(self, tensors: Sequence[TensorInfo]) -> Mapping[str, Derived]:
        """Every output of ``then``, reading ``tensors``.

        Raises:
            UnsupportedTransformError: as either rule set, and as ``compose``.
        """
        infos = {t.fqn: t for t in tensors}
        inner = dict(self.first(tensors))
        made = tuple(TensorInfo(fqn, rule.dtype, rule.shape) for fqn, rule in inner.items())
        return {fqn: compose(fqn, rule, inner, infos) for fqn, rule in self.then(made).items()}
