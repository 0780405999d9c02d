"""Transform stage, its layer split (``--unstack-layers``): a tensor stacked on a leading layer dim as one tensor per layer.

Megatron-Core's ``torch_dist`` checkpoints store each ``decoder.layers.<name>`` once, of shape
``(L, ...)`` (``TransformerBlock.sharded_state_dict``); ``--unstack-layers`` writes layer ``i`` as
``decoder.layers.<i>.<name>`` of shape ``(...)``, the names a live model's ``state_dict()`` has. Which
FQNs are stacked is the producer's record (``producers.Producer.stacked_layers``), never guessed from
shapes. Each layer is a ``derive.Derived`` reading rows ``[i * R, (i + 1) * R)`` of the tensor's
``(L * R, ...)`` view (``R`` its rows per layer), so the mover copies it block by block, within
``--memory-budget``, bit for bit (a copy; ``--dtype`` may still cast). Pure functions; FQNs are
given with wrapper names already removed.

``check_split`` bounds every split of a tensor on dim 0 (these layers, an adapter's experts): a
claimed shape with a zero-size dim holds no bytes, so its dim 0 alone must not set the output count.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from fsdp_convert.derive import Derived, Input, Segment, Sourced, TensorInfo
from fsdp_convert.dtypes import DType, as_dtype
from fsdp_convert.errors import InvalidOptionError, UnsupportedTransformError
from fsdp_convert.formats.index import CheckpointIndex, Entry, TensorEntry
from fsdp_convert.producers import detect_producer
from fsdp_convert.roles import EntryRole

if TYPE_CHECKING:
    import torch

__all__ = ["LayerSplit", "stacked_prefix", "layer_counts", "layer_fqn", "layer_slice", "MAX_EMPTY_SPLIT", "check_split"]

MAX_EMPTY_SPLIT = 1024
"""The most pieces a tensor of fewer bytes may be split into (``check_split``): more than any model's layers or experts."""


def check_split(fqn: str, shape: tuple[int, ...], dtype: DType | torch.dtype, pieces: int, what: str) -> None:
    """Refuse a split of a tensor into more than ``max(MAX_EMPTY_SPLIT, its bytes)`` output tensors.

    A real split (layers, experts, rows) gives each piece a byte or more, so the output count
    stays within the bytes read. A claimed shape with a zero-size dim, ``(10**6, 0, 2)``, holds no
    bytes: a 3 KB checkpoint would otherwise make a million tensors, for minutes and gigabytes.

    Args:
        fqn: the tensor split (named in the error).
        shape: its shape, in elements.
        dtype: its element type (a ``torch.dtype`` is taken too).
        pieces: how many outputs the split makes.
        what: what the pieces are (``layers (--unstack-layers)``), for the error.

    Raises:
        UnsupportedTransformError: more pieces than the bound.
    """
    nbytes = math.prod(shape) * as_dtype(dtype).itemsize
    if pieces > max(MAX_EMPTY_SPLIT, nbytes):
        raise UnsupportedTransformError(
            f"{fqn}: shape {shape} holds {nbytes} bytes but would split into {pieces} {what}; "
            f"a split makes at most {MAX_EMPTY_SPLIT} pieces of a tensor of fewer bytes, refused"
        )


def stacked_prefix(index: CheckpointIndex) -> str:
    """The FQN prefix of the tensors the checkpoint's producer stacks on a layer dim (``decoder.layers.``).

    Raises:
        InvalidOptionError: its producer stacks no layers (``Producer.stacked_layers`` empty).
    """
    producer = detect_producer(index)
    if not producer.stacked_layers:
        raise InvalidOptionError(
            f"--unstack-layers: {index.checkpoint_id} is a {producer.name} checkpoint, whose layers are not "
            "stacked (Megatron-Core's torch_dist stacks decoder.layers.*)"
        )
    return producer.stacked_layers


def layer_counts(
    index: CheckpointIndex, slots: Sequence[EntryRole], cleaned: Sequence[str | None], prefix: str
) -> dict[str, int]:
    """The layer count ``L`` (dim 0) of each stacked model tensor, by its FQN (wrapper names removed).

    Args:
        index: the checkpoint.
        slots: ``producers.classify(index)``.
        cleaned: per entry, its parameter's FQN with wrapper names removed (None: not a parameter).
        prefix: ``stacked_prefix(index)``.

    Raises:
        UnsupportedTransformError: a model tensor under ``prefix`` with no dim to split (0-dim), or
            more layers than ``check_split`` allows (a claimed ``(10**6, 0, 2)``).
    """
    counts: dict[str, int] = {}
    for slot, entry, fqn in zip(slots, index.entries, cleaned, strict=True):
        if slot.role != "model" or fqn is None or not fqn.startswith(prefix) or not isinstance(entry, TensorEntry):
            continue
        if not entry.shape:
            raise UnsupportedTransformError(f"{entry.fqn}: a 0-dim tensor under {prefix}, with no layer dim to unstack")
        check_split(entry.fqn, entry.shape, entry.dtype, entry.shape[0], "layers (--unstack-layers)")
        counts[fqn] = entry.shape[0]
    return counts


def layer_fqn(fqn: str, prefix: str, layer: int) -> str:
    """``decoder.layers.<layer>.<name>`` for the stacked ``decoder.layers.<name>`` (``prefix`` ``decoder.layers.``)."""
    return f"{prefix}{layer}.{fqn.removeprefix(prefix)}"


def layer_slice(entry: Entry, layer: int, layers: int) -> Derived | None:
    """Layer ``layer`` of ``entry`` stacked on ``layers`` layers: ``entry.shape[1:]``, a copy of its rows.

    For a tensor of shape ``(L, R, ...)``, read through its ``(L * R, ...)`` view, the output's rows
    are rows ``[layer * R, (layer + 1) * R)`` (a ``(L, H)`` norm weight: its ``H`` elements, a ``(L,)``
    tensor: one element, 0-dim). A value or a 0-dim tensor (an optimizer's per-parameter ``step``)
    has no layer dim: None, each layer gets it whole.

    Raises:
        UnsupportedTransformError: a tensor whose dim 0 is not ``layers`` (names it).
    """
    if not isinstance(entry, TensorEntry) or not entry.shape:
        return None
    if entry.shape[0] != layers:
        raise UnsupportedTransformError(
            f"{entry.fqn}: shape {entry.shape} is not stacked on the {layers} layers of its parameter; "
            "--unstack-layers cannot split it"
        )
    rows = entry.shape[1] if len(entry.shape) > 1 else 1
    view = (layers * rows, *entry.shape[2:])
    derived = Derived(
        inputs=(Input(fqn=entry.fqn, rows=Segment(0, rows, layer * rows), view=view),),
        shape=entry.shape[1:],
        dtype=entry.dtype,
    )
    derived.check(entry.fqn, {entry.fqn: TensorInfo(entry.fqn, entry.dtype, entry.shape)})
    return derived


def _same(fqn: str) -> str:
    return fqn


@dataclass(frozen=True, slots=True)
class LayerSplit:
    """What ``--unstack-layers`` splits: the stacked model tensors' layer counts, by cleaned FQN; empty when off.

    Attributes:
        prefix: ``stacked_prefix``'s (``decoder.layers.``); empty when off.
        counts: ``layer_counts``'s.
        clean: a parameter FQN as ``counts`` keys it (``transform.clean_fqn``, wrapper names removed).
    """

    prefix: str = ""
    counts: Mapping[str, int] = field(default_factory=dict)
    clean: Callable[[str], str] = _same

    @classmethod
    def of(cls, index: CheckpointIndex, slots: Sequence[EntryRole], clean: Callable[[str], str]) -> LayerSplit:
        """The stacked tensors of ``index``.

        Raises:
            InvalidOptionError: its producer stacks no layers (``stacked_prefix``).
            UnsupportedTransformError: a 0-dim model tensor under the prefix (``layer_counts``).
        """
        prefix = stacked_prefix(index)
        cleaned = [clean(s.param) if isinstance(s.param, str) else None for s in slots]
        return cls(prefix, layer_counts(index, slots, cleaned, prefix), clean)

    def _count(self, param: str | int) -> tuple[str, int | None]:
        if not self.counts or not isinstance(param, str):
            return "", None
        fqn = self.clean(param)
        return fqn, self.counts.get(fqn)

    def params(self, param: str | int) -> list[str | int]:
        """A parameter's names in a param group: its layers' when it is stacked, else itself."""
        fqn, count = self._count(param)
        return [param] if count is None else [layer_fqn(fqn, self.prefix, n) for n in range(count)]

    def model_outputs(self, entry: Entry, fqn: str, param: str, name: Callable[[str], str]) -> list[Sourced]:
        """A model entry's outputs: itself as ``fqn``, or, when ``param`` is stacked, each layer named by ``name``.

        Raises:
            UnsupportedTransformError: as ``layer_slice``.
        """
        cleaned, count = self._count(param)
        if count is None or not isinstance(entry, TensorEntry):
            return [(entry, fqn, None, ())]
        return [(entry, name(layer_fqn(cleaned, self.prefix, n)), layer_slice(entry, n, count), (entry,)) for n in range(count)]

    def state_outputs(self, entry: Entry, param: str | int) -> list[tuple[str | int, Derived | None, tuple[TensorEntry, ...]]]:
        """An optimizer state entry's outputs: ``(param, None, ())``, or per layer its name, slice and source.

        A value or a 0-dim tensor (a per-parameter ``step``) goes whole to every layer.

        Raises:
            UnsupportedTransformError: as ``layer_slice``.
        """
        fqn, count = self._count(param)
        if count is None:
            return [(param, None, ())]
        out: list[tuple[str | int, Derived | None, tuple[TensorEntry, ...]]] = []
        for n in range(count):
            derived = layer_slice(entry, n, count)
            sources = (entry,) if derived is not None and isinstance(entry, TensorEntry) else ()
            out.append((layer_fqn(fqn, self.prefix, n), derived, sources))
        return out
