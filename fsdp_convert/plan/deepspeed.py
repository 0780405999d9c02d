"""Plan stage, DeepSpeed's: the ZeRO partitions of a save laid out for another data-parallel size, as DeepSpeed lays them.

A DeepSpeed engine built at ``M`` ranks computes its partitions from the parameters alone
(``deepspeed/runtime/zero/stage_1_and_2.py``, ``bf16_optimizer.py``, ``stage3.py``, 0.19), and
``engine.load_checkpoint`` copies a saved partition into its own only when both have the same
size and paddings. So a save for ``M`` ranks must hold exactly what that engine would save:

- ZeRO-1/2: each param group flattened with ``param_alignment_paddings`` after each parameter,
  padded to a multiple of ``2 * M`` elements and cut into ``M`` equal partitions; the fp32
  partition is saved without the padding that falls in it (``group_paddings``), the optimizer
  state with it; ``param_slice_mappings`` gives each parameter's ``(numel, start)`` in a partition.
- BF16_Optimizer: the same without parameter paddings, every partition saved whole, the tail
  padding counted on the last rank only.
- ZeRO-3: every parameter cut into ``ceil(numel / M)`` elements per rank; each param group's
  parameters go into sub-groups, a new one once ``sub_group_size`` elements per rank are reached.

Pure arithmetic over parameter names and shapes; no I/O. ``formats._flat_ranges`` turns the
sizes into where each parameter lies, for the source and the target alike.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from fsdp_convert.formats.deepspeed import Piece, zero3_pieces, zero12_pieces
from fsdp_convert.formats.index import ObjPath

__all__ = ["ZeroLayout", "zero_layout"]

_NCCL_START_ALIGNMENT_FACTOR = 2  # stage_1_and_2.py and bf16_optimizer.py: "4-byte alignment/sizeof(fp16)"
Shapes = list[list[tuple[str, tuple[int, ...]]]]


@dataclass(frozen=True, slots=True)
class ZeroLayout:
    """One data-parallel size's partitions of a ZeRO save.

    Attributes:
        stage: 1, 2, 3, or 0 for BF16_Optimizer.
        world_size: the data-parallel size ``M``.
        groups: per flat tensor (param group; ZeRO-3: sub-group), its parameters ``(name, shape)`` in order:
            the model states file's ``param_shapes``.
        group_of: per flat tensor, the param group it belongs to (ZeRO-1/2: itself).
        paddings: ZeRO-1/2's ``param_alignment_paddings`` (elements after each parameter); None for the others.
        partition: per flat tensor, the elements of each rank's partition, padding included.
        saved: per rank, per flat tensor, the elements its fp32 partition is saved with.
        group_paddings: per rank, per flat tensor, the padding elements in its partition (ZeRO-1/2, BF16).
        slice_mappings: per rank, per flat tensor, ``{name: (numel, start)}`` of the parameters in its partition.
    """

    stage: int
    world_size: int
    groups: Shapes
    group_of: tuple[int, ...]
    paddings: list[list[int]] | None
    partition: tuple[int, ...]
    saved: tuple[tuple[int, ...], ...]
    group_paddings: tuple[tuple[int, ...], ...]
    slice_mappings: tuple[tuple[dict[str, tuple[int, int]], ...], ...]

    @property
    def sizes(self) -> list[list[int]]:
        """Per rank, the saved fp32 partition sizes (``formats._flat_ranges``'s ``sizes``)."""
        return [list(s) for s in self.saved]

    def pieces(self) -> dict[str, list[Piece]]:
        """Where each parameter lies in this layout's partitions (``formats.deepspeed``'s rules, for the source alike)."""
        if self.stage == 3:
            return zero3_pieces(self.groups, self.sizes)
        return zero12_pieces(self.groups, self.sizes, self.paddings or [[0] * len(g) for g in self.groups])

    def state_path(self, container: int) -> ObjPath:
        """Where flat tensor ``container``'s optimizer state sits in an optimizer file (its base optimizer's ``state``)."""
        base = "optimizer_state_dict" if self.stage == 3 else "base_optimizer_state"
        return ("optimizer_state_dict", base, "state", container)


def zero_layout(stage: int, world_size: int, groups: Shapes, paddings: list[list[int]] | None, sub_group_size: int) -> ZeroLayout:
    """The partitions a DeepSpeed engine of ``stage`` builds at ``world_size`` ranks (see the module docstring).

    Args:
        stage: 1, 2, 3, or 0 for BF16_Optimizer.
        world_size: the data-parallel size.
        groups: the param groups' parameters ``(name, shape)`` in order (ZeRO-3: whole param groups,
            which are cut into sub-groups here, not a save's sub-groups).
        paddings: ZeRO-1/2's ``param_alignment_paddings`` per group, as the source saved them (they
            depend on the element size, not on the ranks); None for BF16_Optimizer and ZeRO-3.
        sub_group_size: ZeRO-3's ``zero_optimization.sub_group_size`` (elements per rank).

    Raises:
        ValueError: ``world_size < 1``, or paddings that are not one per parameter.
    """
    if world_size < 1:
        raise ValueError("world size must be at least 1")
    if stage == 3:
        return _zero3(world_size, groups, sub_group_size)
    pads = paddings if stage in (1, 2) and paddings is not None else [[0] * len(g) for g in groups]
    if len(pads) != len(groups) or any(len(p) != len(g) for p, g in zip(pads, groups, strict=True)):
        raise ValueError("param_alignment_paddings is not one padding per parameter")
    align = _NCCL_START_ALIGNMENT_FACTOR * world_size
    partition, saved, group_paddings, mappings = [], [], [], []
    for group, group_pads in zip(groups, pads, strict=True):
        used = sum(math.prod(shape) + pad for (_, shape), pad in zip(group, group_pads, strict=True))
        part = -(-used // align) * align // world_size
        partition.append(part)
        if stage == 0:  # BF16_Optimizer counts the whole tail padding on the last rank
            padding = [part * world_size - used if r == world_size - 1 else 0 for r in range(world_size)]
        else:
            padding = [_padding(used, r * part, part) for r in range(world_size)]
        group_paddings.append(padding)
        saved.append([part if stage == 0 else part - padding[r] for r in range(world_size)])
        mappings.append([_slices(group, group_pads, r * part, part) for r in range(world_size)])
    ranks = range(world_size)
    return ZeroLayout(
        stage=stage,
        world_size=world_size,
        groups=groups,
        group_of=tuple(range(len(groups))),
        paddings=pads if stage in (1, 2) else None,
        partition=tuple(partition),
        saved=tuple(tuple(s[r] for s in saved) for r in ranks),
        group_paddings=tuple(tuple(p[r] for p in group_paddings) for r in ranks),
        slice_mappings=tuple(tuple(m[r] for m in mappings) for r in ranks),
    )


def _padding(used: int, left: int, part: int) -> int:
    """ZeRO-1/2's ``groups_padding`` of the partition ``[left, left + part)`` of a group of ``used`` elements."""
    if used <= left:
        return part
    if used < left + part:
        return left + part - used
    return 0


def _slices(group: list[tuple[str, tuple[int, ...]]], pads: list[int], left: int, part: int) -> dict[str, tuple[int, int]]:
    """``param_slice_mappings`` of one partition: each parameter that meets it, ``(numel, start in the partition)``."""
    out, offset = {}, 0
    for (name, shape), pad in zip(group, pads, strict=True):
        numel = math.prod(shape)
        lo, hi = max(offset, left), min(offset + numel, left + part)
        if lo < hi:
            out[name] = (hi - lo, lo - left)
        offset += numel + pad
    return out


def _zero3(world_size: int, groups: Shapes, sub_group_size: int) -> ZeroLayout:
    """ZeRO-3: each param group cut into sub-groups by ``stage3.py``'s ``_create_fp16_sub_groups``."""
    sub_groups: Shapes = []
    group_of: list[int] = []
    for g, group in enumerate(groups):
        share = [-(-math.prod(shape) // world_size) for _, shape in group]
        if sub_group_size >= sum(share):
            sub_groups.append(list(group))
            group_of.append(g)
            continue
        current: list[tuple[str, tuple[int, ...]]] = []
        size = 0
        for i, param in enumerate(group):
            current.append(param)
            size += share[i]
            if size >= sub_group_size or i == len(group) - 1:
                sub_groups.append(current)
                group_of.append(g)
                current, size = [], 0
    partition = tuple(sum(-(-math.prod(shape) // world_size) for _, shape in sub) for sub in sub_groups)
    ranks = range(world_size)
    return ZeroLayout(
        stage=3,
        world_size=world_size,
        groups=sub_groups,
        group_of=tuple(group_of),
        paddings=None,
        partition=partition,
        saved=tuple(partition for _ in ranks),
        group_paddings=tuple(tuple(0 for _ in partition) for _ in ranks),
        slice_mappings=tuple(tuple({} for _ in partition) for _ in ranks),
    )
