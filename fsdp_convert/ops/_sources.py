"""Sides of ``verify``: two checkpoints of any formats, each found once, seen as flat keys whose values load one at a time.

A side is found once (``find_source``: ``formats.open_checkpoint`` decides its format, full files
included, and reads its index) and read as ``consolidate`` reads its input: its items built by
``plan.items.prepare_items``, each value read with its ``Source``'s reader. ``Side`` says how a side is
seen (its transforms, a ``model.`` prefix for weights standing alone, the key a folder's optimizer
state is shown under); it travels to verify's workers as is, and each process opens a
``SideView`` of it.
"""

from __future__ import annotations

import dataclasses
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from fsdp_convert.dtypes import as_dtype
from fsdp_convert.formats import Reader, Source, open_checkpoint
from fsdp_convert.formats.index import BytesEntry, TensorEntry, check_coverage, dcp_key
from fsdp_convert.formats.reader import StoredBytes
from fsdp_convert.item import OutputItem
from fsdp_convert.plan.items import prepare_items
from fsdp_convert.remote import as_location
from fsdp_convert.roles import GROUPS, Group, group_of_top
from fsdp_convert.transform import TransformOptions

if TYPE_CHECKING:
    from fsdp_convert.ops._compare import StoredPieces

__all__ = ["MODEL_PREFIX", "Side", "SideView", "find_source", "key_group", "open_sides", "open_source", "open_views"]

MODEL_PREFIX = "model."  # consolidate writes model weights as model.<FQN>
_AS_SAVED = TransformOptions(keep_wrapper_names=True)  # items named as stored: no wrapper name removed, nothing renamed


def key_group(key: str) -> Group:
    """The group of a flat key, by its top-level key (``model``, ``optim``/``optimizer``, anything else)."""
    return group_of_top(key.split(".", 1)[0])


@dataclass(frozen=True, slots=True)
class Side:
    """How one side of ``verify`` is seen; picklable (it travels to verify's workers).

    Attributes:
        source: the checkpoint, found once (``find_source``).
        transform: the transforms its items are built with, as ``consolidate`` builds them
            (nested layout); None: its keys as saved, in its own order (what torch's
            ``dcp_to_torch_save`` gives for a DCP checkpoint).
        weights_alone: it holds safetensors weights named by FQN alone (a file, a folder without
            ``optimizer.pt``, a PEFT adapter): seen as ``model.`` + FQN, and only model weights compared.
        optimizer_key: the top-level key its ``optim`` state is shown under (a Hugging Face
            folder's ``optimizer.pt`` compared with a checkpoint that keeps ``optimizer``); None: as indexed.
        items: its items, in the order its keys come, once built (``SideView``: workers take them
            as built, and read no param group value again); None: not yet.
    """

    source: Source
    transform: TransformOptions | None = None
    weights_alone: bool = False
    optimizer_key: str | None = None
    items: tuple[OutputItem, ...] | None = None

    @property
    def classified(self) -> bool:
        """Its groups are ``consolidate``'s classification (a sharded checkpoint, or one seen through transforms).

        A full checkpoint read as saved (an output of ``consolidate``) is grouped by its top-level keys.
        """
        return self.transform is not None or not self.source.format.full


def find_source(checkpoint: str | os.PathLike[str] | Source, *, check_crc: bool = True) -> Source:
    """A side's ``Source``, its format decided and its index read once; its data files are checked to exist.

    Args:
        checkpoint: a DCP folder (local or fsspec URL), any other sharded checkpoint, a torch.save or
            safetensors file, or a Hugging Face or PEFT folder; or its ``Source``, already found
            (not read again; its readers then check CRC-32s as ``check_crc`` says).
        check_crc: its readers check CRC-32s of DCP payloads.

    Raises:
        CheckpointNotFoundError: the path does not exist.
        NotADcpCheckpointError: a folder of no known format (named by DCP's reader), or a malformed index.
        UnsafeContentError: a pickle that would run code, or a file linked from outside the folder.
        MissingDataFileError: a data file the index names is missing.
    """
    if isinstance(checkpoint, Source):
        source = dataclasses.replace(checkpoint, check_crc=check_crc)
    else:
        source = open_checkpoint(as_location(checkpoint), full_files=True, check_crc=check_crc)
    source.check_data_files()
    return source


def _weights_alone(source: Source) -> bool:
    """True for a full checkpoint of safetensors weights named by FQN alone, as ``model.state_dict()`` names them.

    A fact its format recorded (``formats.full_file.file_index``: ``weights_alone`` in the index's
    marks): a safetensors file, or a folder of weights without ``optimizer.pt`` or ``extra_state.pt``.
    """
    return "weights_alone" in source.index.marks


def _sides(a: Source, b: Source, transform: TransformOptions | None, files_too: bool) -> tuple[Side, Side]:
    """How each side is seen: a sharded one through ``transform``, a full one as saved (A through it too with ``files_too``).

    When one side holds weights alone and the other is sharded, with no transform, the sharded side
    is seen as ``consolidate`` names the weights (``model.`` + FQN, wrapper names kept), a full A
    too with ``files_too``.
    """
    alone = (_weights_alone(a), _weights_alone(b))
    if transform is None and any(alone) and not (a.format.full and b.format.full):
        transform = _AS_SAVED
    through = (not a.format.full or (files_too and transform is not None), not b.format.full)
    side_a, side_b = (
        Side(source, transform if seen else None, weights_alone=weights and not seen)
        for source, seen, weights in zip((a, b), through, alone, strict=True)
    )
    return side_a, side_b


def _built(side: Side, reader: Reader) -> tuple[OutputItem, ...]:
    """``side``'s items (``plan.items.prepare_items``): as saved in the checkpoint's order, through transforms in the output's.

    The param group values they need are read with ``reader``, the side's own, already open: a
    full file is not loaded again for them.

    Raises:
        As ``plan.items.prepare_items``.
    """
    as_saved = side.transform is None
    items = prepare_items(side.source, side.transform or _AS_SAVED, GROUPS, keep_layout=as_saved, reader=reader)
    if not as_saved:
        return items
    position = {id(entry): i for i, entry in enumerate(side.source.index.entries)}
    return tuple(sorted(items, key=lambda item: position.get(id(item.entry), len(position))))


class SideView:
    """A side seen as flat keys: its items, each value read on demand with its ``Source``'s reader.

    Keys are ``formats.index.dcp_key`` of each item's path (``model.layers.0.attn.wq.weight``,
    ``optim.state.<fqn>.exp_avg``, ``optim.param_groups.0.lr``), after the side's prefix and
    optimizer key. Close it (it holds the reader's open files).

    Args:
        side: the side; its items are built here unless it carries them (``Side.items``).

    Raises:
        As ``plan.items.prepare_items`` and the side's ``Source.open_reader``.
    """

    def __init__(self, side: Side) -> None:
        self._reader = side.source.open_reader()
        try:
            self.side = side if side.items is not None else dataclasses.replace(side, items=_built(side, self._reader))
        except BaseException:
            self._reader.close()
            raise
        self._items = self._keyed()

    def _keyed(self) -> dict[str, OutputItem]:
        prefix, shown = MODEL_PREFIX if self.side.weights_alone else "", self.side.optimizer_key
        keyed: dict[str, OutputItem] = {}
        for item in self.side.items or ():
            key = prefix + dcp_key(item.path)
            top, dot, rest = key.partition(".")
            keyed[shown + dot + rest if shown is not None and top == "optim" else key] = item
        return keyed

    @property
    def model_only(self) -> bool:
        """It holds model weights alone (``Side.weights_alone``)."""
        return self.side.weights_alone

    def show_optimizer_as(self, key: str) -> None:
        """Show the ``optim`` state under the top-level key ``key`` from now on (``Side.optimizer_key``)."""
        self.side = dataclasses.replace(self.side, optimizer_key=key)
        self._items = self._keyed()

    def keys(self) -> list[str]:
        """Every flat key: as saved, in the checkpoint's order; through transforms, in the output's."""
        return list(self._items)

    def item(self, key: str) -> OutputItem:
        """``key``'s item: its group as classified (torchtitan's top-level weights are ``model``), its bytes as read."""
        return self._items[key]

    def group(self, key: str) -> Group | None:
        """``key``'s group as ``consolidate`` classifies it (``Side.classified``); None for a full checkpoint as saved."""
        return self._items[key].group if self.side.classified else None

    def was_cast(self, key: str) -> bool:
        """True when ``key``'s tensor is read in another dtype than stored (``--dtype``/``--optim-dtype``)."""
        item = self._items[key]
        return isinstance(item.entry, TensorEntry) and item.dtype not in (None, item.entry.dtype)

    def tensor_bytes(self, key: str) -> int:
        """Bytes of ``key``'s tensor as ``get`` gives it, from the index (0 for a plain value)."""
        item = self._items[key]
        return item.nbytes if item.is_tensor else 0

    def located(self, key: str) -> StoredPieces | None:
        """Where ``key``'s tensor lies as stored, read as it is: its pieces in C order (``ops._compare.StoredPieces``); else None.

        Each chunk must be a slab of whole rows (dim 0; a 0-dim tensor's one chunk), the chunks
        back to back over the whole tensor, and each located by the reader (``Reader.locate``:
        DCP payloads, a torch.save file's contiguous tensors). None for anything else, or a tensor
        read otherwise than stored (cast, derived, a constant): ``get`` reads those.

        Raises:
            As the reader's ``locate``.
        """
        item = self._items[key]
        entry = item.entry
        if not item.is_tensor or item.derived is not None or self.was_cast(key) or not isinstance(entry, TensorEntry):
            return None
        rest = entry.shape[1:]
        row_bytes = entry.itemsize * math.prod(rest)
        pieces: list[tuple[int, StoredBytes]] = []
        at = 0
        for chunk in sorted((c for c in entry.chunks if c.numel > 0), key=lambda c: c.offsets[:1]):
            starts_at = chunk.offsets[0] * row_bytes if chunk.offsets else 0
            if chunk.offsets[1:] != (0,) * len(rest) or chunk.sizes[1:] != rest or starts_at != at:
                return None  # not whole rows, or a gap or overlap (check_coverage names it when read)
            stored = self._reader.locate(entry, chunk)
            if stored is None or stored.nbytes != chunk.numel * entry.itemsize:
                return None
            pieces.append((at, stored))
            at += stored.nbytes
        return pieces if at == entry.nbytes else None

    def get(self, key: str) -> Any:
        """The value of ``key``: a new CPU tensor (cast as the transforms ask), or a plain Python value.

        Raises:
            As the reader's ``read_tensor`` and ``read_value``; CoverageError: a tensor's chunks leave a gap.
        """
        item = self._items[key]
        if item.constant:
            return item.value
        entry = item.entry
        if isinstance(entry, BytesEntry):
            return self._reader.read_value(entry)
        if item.derived is not None:  # an adapter's rows: recomputed from its whole inputs (derive.Derived.compute)
            for source in item.sources:
                check_coverage(source)
            tensor = item.derived.compute([self._reader.read_tensor(source) for source in item.sources])
        else:
            check_coverage(entry)
            tensor = self._reader.read_tensor(entry)
        if item.dtype is None or item.dtype == as_dtype(tensor.dtype):
            return tensor
        # cast as consolidate's writers do, element by element (a 0-dim tensor would take torch's
        # scalar path); NaN bits still vary by torch's code path, so a cast key compares NaNs as NaNs
        return tensor.reshape(-1).to(item.dtype.torch).reshape(tensor.shape)

    def close(self) -> None:
        """Release the reader's open files."""
        self._reader.close()


def open_views(sides: tuple[Side, Side]) -> tuple[SideView, SideView]:
    """Both sides opened, A first (A is closed again when B cannot be opened).

    Raises:
        As ``SideView``.
    """
    view_a = SideView(sides[0])
    try:
        return view_a, SideView(sides[1])
    except BaseException:
        view_a.close()
        raise


def _optimizer_tops(view: SideView) -> set[str]:
    """The top-level keys of ``view``'s optimizer state (``optim``, ``optimizer``)."""
    return {key.split(".", 1)[0] for key in view.keys() if key_group(key) == "optim"}


def open_sides(
    a: Source, b: Source, transform: TransformOptions | None, *, files_too: bool = False
) -> tuple[tuple[Side, Side], tuple[SideView, SideView]]:
    """Both sides, as seen (``Side``) and opened; each index as found, not read again.

    A sharded side is seen through ``transform`` (None: its keys as saved), a full checkpoint as
    saved (A through ``transform`` too with ``files_too``: ``consolidate``'s own input). When one
    side holds weights alone (safetensors, HF, PEFT: no group) and the other is sharded, with no
    transform, the sharded side is seen as ``consolidate`` names the weights (``model.`` + FQN,
    whether it nests them or saved them flat: a reshard of such a file). A Hugging Face folder's
    ``optimizer.pt`` (read as ``optim``: it holds the optimizer state dict itself) is shown under
    the other side's optimizer key when that is another (``optimizer``: Lightning, accelerate,
    torchtitan, Megatron-Core keep their producer's key).

    Returns:
        The sides as seen, and their open views (close them).

    Raises:
        As ``SideView``.
    """
    views = open_views(_sides(a, b, transform, files_too))
    tops = [_optimizer_tops(view) for view in views]
    for i, view in enumerate(views):
        root, other = view.side.source.checkpoint_id, tops[1 - i]
        folder = view.side.transform is None and view.side.source.format.full and isinstance(root, Path) and root.is_dir()
        if folder and tops[i] == {"optim"} and len(other) == 1 and other != {"optim"}:
            view.show_optimizer_as(next(iter(other)))
    return (views[0].side, views[1].side), views


def open_source(
    path: str | os.PathLike[str],
    *,
    check_crc: bool = True,
    options: TransformOptions | None = None,
    transform_files: bool = False,
) -> SideView:
    """Open one checkpoint of any supported format as flat keys (``find_source``, then a ``SideView``).

    A folder with ``.metadata`` is DCP; a folder with ``model.safetensors.index.json`` or
    ``model.safetensors`` is a Hugging Face folder; a file is torch.save or safetensors, told by
    its first bytes. A sharded checkpoint's keys are as saved (as torch's ``dcp_to_torch_save``
    gives them), or, with ``options``, those ``consolidate`` writes under them; a full checkpoint's
    as saved (with ``transform_files``, through ``options`` too); safetensors weights alone as
    ``model.`` + FQN; a Hugging Face folder's ``optimizer.pt`` and ``extra_state.pt`` come in as
    ``optim.*`` and their own keys. Close it.

    Raises:
        As ``find_source`` and ``SideView``.
    """
    source = find_source(path, check_crc=check_crc)
    seen = options is not None and (transform_files or not source.format.full)
    alone = not seen and _weights_alone(source)
    return SideView(Side(source, options if seen else None, weights_alone=alone))
