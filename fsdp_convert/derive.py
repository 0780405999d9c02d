"""Transform stage, its building block: an output tensor derived row block by row block from a few input tensors.

A ``Derived`` states, declaratively, how an output tensor is made from checkpoint tensors: for any
block of its dim-0 rows ``[r0, r1)``, which rows of each input it needs (a ``RowMap``: the same
rows, a slice, a permutation), or that an input is read whole (a small tensor), and a ``combine``
function from those parts to the block. The mover (``move.Mover``) then builds the output one
block at a time, in bounded memory, as it casts: a block of at most about two mover buffers of
output rows, plus the input rows it names (for a permutation, the span they cover).

Model-family adapters (``adapters/``: key maps, the Q/K RoPE permutation, fused-QKV splits and
joins) and LoRA merging are rule sets of ``Derived`` s. LoRA's ``W' = W + scale * B @ A``, with
``W`` of shape ``(out, in)``, ``B`` ``(out, r)`` and ``A`` ``(r, in)``, computed in fp32::

    @dataclass(frozen=True, slots=True)
    class LoraMerge:  # a module-level class or function: plans are pickled to the workers
        scale: float

        def __call__(self, parts: Sequence[torch.Tensor]) -> torch.Tensor:
            w, b, a = parts  # W's and B's rows r0..r1, A whole
            return w.float() + self.scale * (b.float() @ a.float())  # cast to the output dtype by the mover

    Derived(
        inputs=(Input(fqn="q.weight"), Input(fqn="q.lora_B.weight"), Input(fqn="q.lora_A.weight", rows=None)),
        shape=(out, in),
        dtype=torch.bfloat16,
        combine=LoraMerge(2.0),
    )

Every row map, combine function and ``Derived`` must pickle (module-level classes or functions,
``functools.partial`` of them), as the plan travels to the worker processes.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from fsdp_convert.dtypes import DType, as_dtype
from fsdp_convert.errors import UnsupportedTransformError
from fsdp_convert.formats.index import Entry, TensorEntry

if TYPE_CHECKING:
    import torch

__all__ = [
    "RowMap",
    "Aligned",
    "ALIGNED",
    "Segment",
    "Gather",
    "HeadPermute",
    "row_span",
    "Input",
    "Derived",
    "TensorInfo",
    "Adapter",
    "concat",
    "copy_of",
    "Sourced",
    "apply_adapter",
]


class RowMap(Protocol):
    """Which input rows a block of output rows needs: ``rows(r0, r1)``, in the order ``combine`` gets them.

    Rows are dim-0 indices (of the ``view`` when one is given). The result may be empty (the input
    gives nothing to this block) and may be any order (a permutation); the input is read over the
    span the indices cover. A map must be monotone (a later block's span does not start before an
    earlier one's), as every map here is.
    """

    def __call__(self, r0: int, r1: int) -> Sequence[int]:
        """Input rows for output rows ``[r0, r1)``."""
        ...


@dataclass(frozen=True, slots=True)
class Aligned:
    """Output row ``i`` is input row ``i`` (a copy, a cast, a row-wise sum such as LoRA's ``W + B @ A``)."""

    def __call__(self, r0: int, r1: int) -> Sequence[int]:
        """Input rows ``[r0, r1)``."""
        return range(r0, r1)

    def span(self, r0: int, r1: int) -> tuple[int, int] | None:
        """``(r0, r1)`` (see ``row_span``)."""
        return (r0, r1) if r0 < r1 else None


ALIGNED = Aligned()


@dataclass(frozen=True, slots=True)
class Segment:
    """Output rows ``[start, start + length)`` are input rows ``[src_start, src_start + length)``; others none.

    Joins (several inputs, each its ``Segment`` of the output, with ``combine=concat``) and slices
    (one input, ``start=0``) of dim 0: a fused QKV weight and its parts.
    """

    start: int
    length: int
    src_start: int = 0

    def __call__(self, r0: int, r1: int) -> Sequence[int]:
        """The input rows of the part of ``[r0, r1)`` inside the segment (possibly none)."""
        lo, hi = max(r0, self.start), min(r1, self.start + self.length)
        shift = self.src_start - self.start
        return range(lo + shift, hi + shift) if lo < hi else range(0)

    def span(self, r0: int, r1: int) -> tuple[int, int] | None:
        """The input rows of the part inside the segment (see ``row_span``)."""
        rows = self(r0, r1)
        return (rows[0], rows[-1] + 1) if rows else None


@dataclass(frozen=True, slots=True)
class Gather:
    """Output row ``i`` is input row ``index[i]``: any row permutation or selection, listed."""

    index: tuple[int, ...]

    def __call__(self, r0: int, r1: int) -> Sequence[int]:
        """``index[r0:r1]``."""
        return self.index[r0:r1]


@dataclass(frozen=True, slots=True)
class HeadPermute:
    """The Q/K RoPE row permutation between torchtitan (Meta's interleaved pairs) and Hugging Face (halves).

    Within each of ``n_heads`` heads of ``head_dim`` rows, torchtitan's row ``2 * i + p`` is HF's row
    ``p * head_dim // 2 + i``. ``to_hf`` True gives HF's rows from torchtitan's, as torchtitan
    0.3.0's ``Llama3StateDictAdapter._permute`` does (``w.view(n_heads, head_dim // 2, 2, in)
    .transpose(1, 2)``); False its ``_reverse_permute``.
    """

    n_heads: int
    head_dim: int
    to_hf: bool = True

    def __call__(self, r0: int, r1: int) -> Sequence[int]:
        """Input rows for output rows ``[r0, r1)``."""
        half = self.head_dim // 2
        rows = []
        for o in range(r0, r1):
            head, j = divmod(o, self.head_dim)
            if self.to_hf:  # output (HF) row p * half + i <- input row 2 * i + p
                p, i = divmod(j, half)
                rows.append(head * self.head_dim + 2 * i + p)
            else:  # output (torchtitan) row 2 * i + p <- input row p * half + i
                i, p = divmod(j, 2)
                rows.append(head * self.head_dim + p * half + i)
        return rows

    def span(self, r0: int, r1: int) -> tuple[int, int] | None:
        """The whole heads the rows fall in (see ``row_span``)."""
        if r0 >= r1:
            return None
        return (r0 // self.head_dim * self.head_dim, ((r1 - 1) // self.head_dim + 1) * self.head_dim)


def row_span(rows: RowMap, r0: int, r1: int) -> tuple[int, int] | None:
    """The input rows ``[lo, hi)`` that cover every row ``rows(r0, r1)`` names (None: none).

    A map may say it cheaply with a ``span(r0, r1)`` method (every map here does), so that a span
    over a whole tensor is found without listing its rows; otherwise the rows are listed.
    """
    span = getattr(rows, "span", None)
    if span is not None:
        return span(r0, r1)  # type: ignore[no-any-return]
    picked = rows(r0, r1)
    return (min(picked), max(picked) + 1) if picked else None


@dataclass(frozen=True, slots=True, kw_only=True)
class Input:
    """One input of a ``Derived``.

    Attributes:
        fqn: the checkpoint tensor, by its FQN as the adapter was given it (``TensorInfo.fqn``).
        rows: which of its rows each output block needs (``RowMap``); None: read it whole, once per
            output tensor (a small tensor, such as LoRA's ``A``).
        view: read it as this shape (same element count; its dim 0 a multiple of the tensor's,
            so each tensor row is whole view rows), e.g. ``(E * F, D)`` for a stacked ``(E, F, D)``
            expert weight; None: its own shape.
    """

    fqn: str
    rows: RowMap | None = ALIGNED
    view: tuple[int, ...] | None = None


def concat(parts: Sequence[torch.Tensor]) -> torch.Tensor:
    """The parts stacked on dim 0, in input order (one part: itself): the default ``combine``."""
    import torch

    return parts[0] if len(parts) == 1 else torch.cat(list(parts), dim=0)


@dataclass(frozen=True, slots=True, kw_only=True)
class Derived:
    """An output tensor made from ``inputs``, block of rows by block of rows.

    For output rows ``[r0, r1)`` (of ``view`` when given), the mover reads each input's rows
    ``input.rows(r0, r1)`` (or the whole input), calls ``combine(parts)`` and casts the result to
    the output dtype. ``combine`` must be row-wise: it is called once per block, with each part of
    shape ``(len(rows), *view[1:])`` (a whole input in its view or own shape), and returns shape
    ``(r1 - r0, *view[1:])`` in any dtype (compute in fp32 and return that: the mover casts).
    The parts are valid during the call only (the mover reuses their memory for the next block).
    Memory: each input is read over the span its rows cover (``row_span``), so a row map should
    keep a block's rows near each other (a head permutation does; a shuffle of a whole tensor
    would read all of it per block).

    Attributes:
        inputs: the tensors read.
        shape: the output's shape, in elements.
        dtype: the output's dtype (``--dtype`` may still cast floating-point outputs).
        combine: parts to a block; None: ``concat``.
        view: build the output as this shape (same element count, dim 0 a multiple of
            ``shape[0]``), e.g. ``(E * F, D)`` to stack experts' ``(F, D)`` weights; None: ``shape``.
    """

    inputs: tuple[Input, ...]
    shape: tuple[int, ...]
    dtype: DType
    combine: Callable[[Sequence[torch.Tensor]], torch.Tensor] | None = None
    view: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "dtype", as_dtype(self.dtype))  # a torch.dtype is taken too

    @property
    def out_view(self) -> tuple[int, ...]:
        """The shape blocks are built in: ``view``, or ``shape`` (a 0-dim tensor as one row)."""
        return self.view or self.shape or (1,)

    @property
    def is_copy(self) -> bool:
        """True when the output is its one input as it is (only its FQN changes): moved undecoded."""
        (first, *rest) = self.inputs
        return not rest and self.combine is None and self.view is None and first.view is None and first.rows == ALIGNED

    def compute(self, tensors: Sequence[torch.Tensor]) -> torch.Tensor:
        """The whole output from its whole inputs (in ``inputs`` order), in ``dtype``: what the mover writes.

        For checks and tests (``verify``); the mover never calls it.

        Warning:
            Holds every input and the output in memory.
        """
        import torch

        n = self.out_view[0]
        parts = []
        for inp, tensor in zip(self.inputs, tensors, strict=True):
            t = tensor.reshape(inp.view or tensor.shape or (1,))
            parts.append(t if inp.rows is None else t[torch.tensor(list(inp.rows(0, n)), dtype=torch.long)])
        return (self.combine or concat)(parts).to(self.dtype.torch).reshape(self.shape)

    def check(self, fqn: str, tensors: Mapping[str, TensorInfo]) -> None:
        """Check the inputs exist and the shapes, views and row maps fit, before any data is read.

        Args:
            fqn: the output's FQN (named in errors).
            tensors: the checkpoint's tensors, by FQN.

        Raises:
            UnsupportedTransformError: a missing input, a view of another size, a row map past an
                input's rows or of the wrong length for a copy.
        """
        if not self.inputs:
            raise UnsupportedTransformError(f"{fqn}: a derived tensor needs at least one input")
        _check_view(fqn, self.shape, self.view)
        out_rows = self.out_view[0]
        for inp in self.inputs:
            info = tensors.get(inp.fqn)
            if info is None:
                raise UnsupportedTransformError(f"{fqn}: its input {inp.fqn} is not in the checkpoint")
            _check_view(inp.fqn, info.shape, inp.view)
            if inp.rows is None:
                continue
            in_rows = (inp.view or info.shape or (1,))[0]
            span = row_span(inp.rows, 0, out_rows)
            if span is not None and (span[0] < 0 or span[1] > in_rows):
                raise UnsupportedTransformError(
                    f"{fqn}: its row map reads rows up to {span[1] - 1} of {inp.fqn}, which has {in_rows}"
                )
        if self.is_copy and math.prod(self.shape) != math.prod(tensors[self.inputs[0].fqn].shape):
            raise UnsupportedTransformError(
                f"{fqn}: a copy of {self.inputs[0].fqn} of shape {tensors[self.inputs[0].fqn].shape} cannot be {self.shape}"
            )


def _check_view(fqn: str, shape: tuple[int, ...], view: tuple[int, ...] | None) -> None:
    if view is None:
        return
    if math.prod(view) != math.prod(shape) or not shape or not view or view[0] % max(shape[0], 1):
        raise UnsupportedTransformError(
            f"{fqn}: cannot be viewed as {view} (shape {shape}: same element count, dim 0 a multiple of {shape[:1]})"
        )


@dataclass(frozen=True, slots=True)
class TensorInfo:
    """A checkpoint tensor as an adapter sees it.

    Attributes:
        fqn: its FQN, wrapper names removed (``layers.0.attention.qkv_linear.wq.weight``, or an HF
            folder's ``model.layers.0.self_attn.q_proj.weight``).
        dtype: its dtype.
        shape: its global shape, in elements.
    """

    fqn: str
    dtype: DType
    shape: tuple[int, ...]

    def __post_init__(self) -> None:
        object.__setattr__(self, "dtype", as_dtype(self.dtype))  # a torch.dtype is taken too


Adapter = Callable[[Sequence[TensorInfo]], Mapping[str, Derived]]
"""An adapter with its configuration bound: the model's tensors to every output tensor, by output FQN, in order.

A tensor no ``Derived`` reads is left out of the output.
"""


def copy_of(info: TensorInfo, rows: RowMap = ALIGNED) -> Derived:
    """``info`` as it is (or with its rows permuted by ``rows``), under whatever FQN it is given."""
    return Derived(inputs=(Input(fqn=info.fqn, rows=rows),), shape=info.shape, dtype=info.dtype)


Sourced = tuple[Entry, str, Derived | None, tuple[TensorEntry, ...]]
"""An output of the model group: (its first source entry, its FQN, how it is derived or None, its source entries)."""


def apply_adapter(adapter: Adapter, selected: Sequence[tuple[Entry, str]]) -> list[Sourced]:
    """Run ``adapter`` over the selected model entries and resolve every output's inputs to entries.

    Args:
        adapter: the bound adapter.
        selected: the model entries and their FQNs (wrapper names removed), in checkpoint order.

    Returns:
        Per output, in the adapter's order after the non-tensor entries (which pass as they are):
        ``(first source, output FQN, derived, sources)``; an output that is its one input as it
        is (same shape and dtype, rows aligned) has ``derived`` None and no sources, so its bytes
        are copied undecoded.

    Raises:
        UnsupportedTransformError: an output reads a missing tensor or does not fit (``Derived.check``),
            or the adapter returns something other than a mapping of FQNs to ``Derived``.
    """
    tensors = {fqn: e for e, fqn in selected if isinstance(e, TensorEntry)}
    infos = {fqn: TensorInfo(fqn, e.dtype, e.shape) for fqn, e in tensors.items()}
    out: list[Sourced] = [(e, fqn, None, ()) for e, fqn in selected if not isinstance(e, TensorEntry)]
    rules = adapter(tuple(infos.values()))
    if not isinstance(rules, Mapping):
        raise UnsupportedTransformError(f"the adapter returned {type(rules).__name__}, not a mapping of output FQNs to Derived")
    for fqn, derived in rules.items():
        if not isinstance(fqn, str) or not isinstance(derived, Derived):
            raise UnsupportedTransformError(
                f"the adapter's output {fqn!r}: expected an FQN and a Derived, got {type(derived).__name__}"
            )
        derived.check(fqn, infos)
        sources = tuple(tensors[inp.fqn] for inp in derived.inputs)
        plain = derived.is_copy and derived.shape == sources[0].shape and derived.dtype == sources[0].dtype
        out.append((sources[0], fqn, None if plain else derived, () if plain else sources))
    return out
