"""``docs/producers.md``'s two tables, rendered from the producer records (``PRODUCERS``).

``tests/unit/test_producers.py`` keeps the page's tables equal to this text, so a new record shows
up in the docs as it is.
"""

from __future__ import annotations

from fsdp_convert.producers import _AS_FSDP2, PRODUCERS

__all__ = ["render_producer_table", "render_loader_table"]

# Rows of the tables that are not producers: layouts of one, writer options.
_MESH_ROWS = (
    (
        "`fsdp2` on a 2-D mesh",
        'DCP of `get_state_dict` after `parallelize_module` (tensor parallel) and `fully_shard(..., mesh=mesh["dp"])`, '
        "or `fully_shard` on a (replicate, shard) mesh (HSDP)",
        "row-parallel weights are cut on dim 1 too; each replica is stored once, so a tensor can have fewer chunks "
        "than the world size",
    ),
    (
        "`verl` on a 2-D mesh",
        "the same models' DTensors saved rank by rank: `(_StridedShard(0, sf=2), Shard(0))` where FSDP cuts a "
        "tensor-parallel shard again, `(Replicate(), Shard(0))` for HSDP",
        "each rank's box is the one `dcp.save` records (torch's `compute_local_shape_and_global_offset`); a "
        "`_StridedShard` whose rows are not one run is refused, as `dcp.save` refuses it",
    ),
)
_OTHER_LOADER_ROW = ("FileSystemWriter options, 2-D meshes", _AS_FSDP2, "`dcp.load` at M ranks")


def _row(*cells: str) -> str:
    return "| " + " | ".join(cells) + " |"


def render_producer_table() -> str:
    """``docs/producers.md``'s producer table: what each producer writes (Markdown, each line ending in a newline).

    A row per record with ``on_disk``, in table order, then the 2-D mesh rows.
    """
    lines = [_row("producer", "what is on disk", "notes", "tested with"), "|---|---|---|---|"]
    lines += [_row(p.label, p.on_disk, p.notes, p.tested) for p in PRODUCERS if p.on_disk]
    lines += [_row(*cells, "torch 2.13.0") for cells in _MESH_ROWS]
    return "\n".join(lines) + "\n"


def render_loader_table() -> str:
    """``docs/producers.md``'s loader table: what reads each output (Markdown, each line ending in a newline).

    A row per run of consecutive records with ``on_disk`` that are read alike, then the row of
    ``FileSystemWriter`` options and 2-D meshes.
    """
    lines = [_row("producer", "`consolidate` (default) is read by", "`reshard --world-size M` is read by"), "|---|---|---|"]
    groups: list[tuple[list[str], str, str]] = []
    for p in PRODUCERS:
        if not p.on_disk:
            continue
        if groups and groups[-1][1:] == (p.consolidate_loader, p.reshard_loader):
            groups[-1][0].append(p.label)
        else:
            groups.append(([p.label], p.consolidate_loader, p.reshard_loader))
    lines += [_row(", ".join(labels), consolidate, reshard) for labels, consolidate, reshard in groups]
    lines.append(_row(*_OTHER_LOADER_ROW))
    return "\n".join(lines) + "\n"
