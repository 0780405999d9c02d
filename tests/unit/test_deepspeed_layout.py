"""plan/deepspeed.py: the layout computed for another world size is the one DeepSpeed itself saves at that size.

``deepspeed_runs`` (``tests/_deepspeed.py``) trains each variant with the same model, seed and
config at 2 and at 3 ranks. ``zero_layout`` is given only what the 2-rank save says (its
``zero_save``: stage, param groups, ``param_alignment_paddings``, ``sub_group_size``) and asked for
3 ranks; every layout field must equal what DeepSpeed's engine wrote at 3 ranks, read from its
files with ``load_ds_file``: the fp32 partition sizes per rank, ``group_paddings``,
``param_slice_mappings`` ``(numel, start)``, the optimizer state's partition sizes, and for ZeRO-3
the ``param_shapes`` sub-groups and the param group of each. Then 3 to 2 likewise.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
import torch

from fsdp_convert.formats._flat_ranges import zero3_pieces, zero12_pieces
from fsdp_convert.formats.deepspeed import zero_save
from fsdp_convert.formats.deepspeed_files import deepspeed_files, load_ds_file
from fsdp_convert.plan.deepspeed import ZeroLayout, zero_layout
from tests._deepspeed import VARIANTS

pytestmark = pytest.mark.slow  # the fixture trains every variant under torchrun

DIRECTIONS = [(2, 3), (3, 2)]


class Saved:
    """What DeepSpeed wrote in one save, by rank: its optimizer states (``optimizer_state_dict``) and model states."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.files = deepspeed_files(root)
        self.model0: dict[str, Any] = load_ds_file(root, self.files.model[0], use_torch=True)[0]
        self.osd: list[dict[str, Any]] = [
            load_ds_file(root, name, use_torch=True)[0]["optimizer_state_dict"] for name in self.files.optim
        ]

    @property
    def world_size(self) -> int:
        return self.files.world_size

    def param_shapes(self) -> list[list[tuple[str, tuple[int, ...]]]]:
        return [[(name, tuple(shape)) for name, shape in group.items()] for group in self.model0["param_shapes"]]

    def flats(self, rank: int) -> list[torch.Tensor]:
        """Rank ``rank``'s fp32 partitions: ZeRO-3's ``fp32_flat_groups``, the others' ``single_partition_of_fp32_groups``."""
        osd = self.osd[rank]
        return list(osd["fp32_flat_groups"] if "fp32_flat_groups" in osd else osd["single_partition_of_fp32_groups"])

    def base(self, rank: int) -> dict[str, Any]:
        """Rank ``rank``'s torch optimizer state dict (``state`` by flat tensor, ``param_groups``)."""
        osd = self.osd[rank]
        base: dict[str, Any] = osd["optimizer_state_dict"] if "fp32_flat_groups" in osd else osd["base_optimizer_state"]
        return base


@pytest.fixture(scope="module")
def saves(deepspeed_runs: dict[int, Path]) -> dict[tuple[str, int], Saved]:
    return {(variant, ws): Saved(deepspeed_runs[ws] / variant / "") for variant in VARIANTS for ws in (2, 3)}


def _layout_from(root: Path, world_size: int) -> ZeroLayout:
    """``zero_layout`` for ``world_size`` from what the save at ``root`` says, as ``reshard`` computes it."""
    source = zero_save(root)
    return zero_layout(source.stage, world_size, source.groups, source.paddings, source.sub_group_size)


@pytest.mark.parametrize(("source_ws", "target_ws"), DIRECTIONS)
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_layout_for_another_world_size_is_what_deepspeed_saves(
    saves: dict[tuple[str, int], Saved], variant: str, source_ws: int, target_ws: int
) -> None:
    source, target = saves[variant, source_ws], saves[variant, target_ws]
    layout = _layout_from(source.root, target_ws)
    stage = VARIANTS[variant][0] if VARIANTS[variant][1] != "bf16o" else 0
    assert (layout.stage, layout.world_size, target.world_size) == (stage, target_ws, target_ws)

    # the fp32 partitions, by rank, and the optimizer state's partitions (padding included)
    assert layout.sizes == [[t.numel() for t in target.flats(r)] for r in range(target_ws)]
    for rank in range(target_ws):
        state = target.base(rank)["state"]
        assert [state[i]["exp_avg"].numel() for i in range(len(layout.partition))] == list(layout.partition)
        assert [state[i]["exp_avg_sq"].numel() for i in range(len(layout.partition))] == list(layout.partition)

    if stage == 3:
        assert layout.groups == target.param_shapes()  # the sub-groups, as the target's engine cut them
        group_of = {i: g for g, group in enumerate(target.base(0)["param_groups"]) for i in group["params"]}
        assert list(layout.group_of) == [group_of[i] for i in range(len(layout.groups))]
        assert layout.paddings is None
    else:
        assert layout.groups == target.param_shapes()
        assert [list(p) for p in layout.group_paddings] == [target.osd[r]["group_paddings"] for r in range(target_ws)]
        mappings = [
            [
                {name: (f.fields["numel"], f.fields["start"]) for name, f in m.items()}
                for m in target.osd[r]["param_slice_mappings"]
            ]
            for r in range(target_ws)
        ]
        assert [list(m) for m in layout.slice_mappings] == mappings
        assert layout.paddings == target.osd[0].get("param_alignment_paddings")  # None for BF16_Optimizer


@pytest.mark.parametrize(("source_ws", "target_ws"), DIRECTIONS)
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_layout_pieces_are_where_the_target_save_holds_each_parameter(
    saves: dict[tuple[str, int], Saved], variant: str, source_ws: int, target_ws: int
) -> None:
    """``ZeroLayout.pieces`` (what reshard copies to) equals the pieces read back from DeepSpeed's own target save."""
    target = saves[variant, target_ws]
    layout = _layout_from(saves[variant, source_ws].root, target_ws)
    sizes = [[t.numel() for t in target.flats(r)] for r in range(target_ws)]
    if layout.stage == 3:
        read_back = zero3_pieces(target.param_shapes(), sizes)
    else:
        paddings = target.osd[0].get("param_alignment_paddings") or [[0] * len(g) for g in target.param_shapes()]
        read_back = zero12_pieces(target.param_shapes(), sizes, paddings)
    assert layout.pieces() == read_back
    for group in layout.groups:  # and every trainable element is in exactly one place
        for name, shape in group:
            assert sum(hi - lo for _, _, _, lo, hi in read_back[name]) == math.prod(shape), name


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_zero_save_param_groups_do_not_depend_on_the_world_size(saves: dict[tuple[str, int], Saved], variant: str) -> None:
    """The param groups ``zero_save`` gives (ZeRO-3's sub-groups merged back) are the same at 2 and 3 ranks."""
    at2, at3 = zero_save(saves[variant, 2].root), zero_save(saves[variant, 3].root)
    assert at2.groups == at3.groups and at2.paddings == at3.paddings and at2.sub_group_size == at3.sub_group_size
    assert (at2.files.world_size, at3.files.world_size) == (2, 3)
    assert at2.stage == at3.stage


def test_layout_at_the_same_world_size_is_the_save_itself(saves: dict[tuple[str, int], Saved]) -> None:
    """A layout for the world size that saved: the save's own sizes (the identity of a reshard)."""
    for (variant, ws), saved in saves.items():
        layout = _layout_from(saved.root, ws)
        assert layout.sizes == [[t.numel() for t in saved.flats(r)] for r in range(ws)], (variant, ws)
        assert layout.groups == saved.param_shapes(), (variant, ws)


def test_zero3_sub_groups_differ_between_world_sizes(saves: dict[tuple[str, int], Saved]) -> None:
    """The z3s variant's ``sub_group_size`` (300 elements per rank) cuts its param groups differently at 2 and 3 ranks.

    Guards the layout test above: were the sub-groups the same at both sizes, copying the source's
    ``param_shapes`` would pass it too.
    """
    assert saves["z3s", 2].param_shapes() != saves["z3s", 3].param_shapes()
    assert len(saves["z3s", 2].param_shapes()) > 2
