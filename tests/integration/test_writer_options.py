"""Every FileSystemWriter option that changes what is on disk: consolidated to the run's own truth, resharded
to 3 ranks that FSDP2 loads; and reshard's zstd output read by torch's own ``dcp.load``.

One FSDP2 run on 2 gloo ranks saves once per option (``tests/_writer_options.py``): one file per
tensor (``single_file_per_rank=False``), three files per rank (``thread_count=3``),
``sync_files=False``, ``dcp.async_save``, zstd (``_extensions=[ZStandard()]``) and tensors stored
as safetensors (``serialization_format=SAFETENSORS``, which torch 2.13's own ``dcp.load`` cannot
read back).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import MetadataIndex
from typer.testing import CliRunner

import fsdp_convert
from fsdp_convert.cli import app
from fsdp_convert.formats import open_checkpoint
from fsdp_convert.formats.dcp import DcpReader
from fsdp_convert.formats.index import TensorEntry
from fsdp_convert.ops.reshard import reshard
from fsdp_convert.writers.dcp import ZSTD_DESCRIPTOR
from tests._compare import assert_same_state
from tests._dist import run_ranks
from tests._writer_options import TRUTH, WRITER_OPTIONS, writer_options_run
from tests.integration.test_reshard import _load_at_new_world_size, _reference_losses


@pytest.fixture(scope="session")
def writer_options(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The run's folder: one checkpoint per ``WRITER_OPTIONS`` name, and ``truth.pt``."""
    out = tmp_path_factory.mktemp("writer_options")
    run_ranks(writer_options_run, 2, out)
    return out


def _truth(root: Path) -> dict[str, object]:
    return torch.load(root / TRUTH, weights_only=True)  # type: ignore[no-any-return]


def test_each_option_changes_what_is_on_disk(writer_options: Path) -> None:
    """The options are not no-ops: each leaves the mark torch documents for it (from torch's own reading)."""
    md = {name: FileSystemReader(str(writer_options / name)).read_metadata() for name in WRITER_OPTIONS}
    files = {name: sorted(p.name for p in (writer_options / name).glob("*.distcp")) for name in WRITER_OPTIONS}
    assert files["async_save"] == files["sync_files_false"] == ["__0_0.distcp", "__1_0.distcp"]
    assert len(files["thread_count_3"]) == 6
    assert len(files["single_file_per_rank_false"]) == len(md["single_file_per_rank_false"].storage_data)
    assert {tuple(i.transform_descriptors or ()) for i in md["zstd"].storage_data.values()} == {(ZSTD_DESCRIPTOR,)}
    weight = md["safetensors"].state_dict_metadata["model.tok_embeddings.weight"]
    info = md["safetensors"].storage_data[MetadataIndex("model.tok_embeddings.weight", weight.chunks[0].offsets)]  # type: ignore[union-attr]
    assert info.length == weight.chunks[0].sizes.numel() * 4  # type: ignore[union-attr]  # bare elements, no zip


@pytest.mark.parametrize("name", sorted(WRITER_OPTIONS))
def test_writer_option_consolidates_to_the_run_truth(writer_options: Path, tmp_path: Path, name: str) -> None:
    """Consolidated (and read back by --verify): bitwise the run's full state dict, model and optimizer."""
    ckpt = writer_options / name
    info = fsdp_convert.inspect_checkpoint(ckpt)
    assert info.producer == "fsdp2" and info.world_size == 2
    out = tmp_path / "full.pt"
    fsdp_convert.consolidate(ckpt, out, nproc=1, verify_output=True)
    assert assert_same_state(torch.load(out, weights_only=True), _truth(writer_options)) > 0


def _load_each(rank: int, world_size: int, jobs: list[tuple[Path, Path, Path]]) -> None:
    """``_load_at_new_world_size`` for each (checkpoint, truth, work folder), in one process group."""
    for checkpoint, truth, work in jobs:
        _load_at_new_world_size(rank, world_size, checkpoint, truth, work)


ZSTD_OUTPUT = "zstd_output"  # the zstd source resharded with zstd output (reshard --compress zstd)


@pytest.fixture(scope="module")
def loaded_at_3(writer_options: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Each option's checkpoint resharded to 3 (and the zstd one with zstd output), all loaded by FSDP2
    on 3 ranks in one forked job (the ranks' start is most of its time); the work folders by name."""
    root = tmp_path_factory.mktemp("writer_options_ws3")
    works: dict[str, Path] = {}
    jobs = []
    for name in [*sorted(WRITER_OPTIONS), ZSTD_OUTPUT]:
        out = root / name
        if name == ZSTD_OUTPUT:
            _compressed_reshard(writer_options / "zstd", out)
        else:
            reshard(writer_options / name, out, world_size=3, nproc=1)
        works[name] = root / f"{name}.load"
        works[name].mkdir()
        jobs.append((out, writer_options / TRUTH, works[name]))
    run_ranks(_load_each, 3, jobs)
    return works


@pytest.mark.parametrize("name", [*sorted(WRITER_OPTIONS), ZSTD_OUTPUT])
def test_writer_option_resharded_to_3_loads_in_fsdp2(writer_options: Path, loaded_at_3: dict[str, Path], name: str) -> None:
    """FSDP2 at world size 3 loads the reshard (torch's ``dcp.load``, each rank from its own file) to
    the run's full state bitwise (checked on rank 0 by ``_load_at_new_world_size``), and its next
    training step gives the loss one process gets from the truth. The output is compressed only
    when asked: a zstd source reshards to plain torch.save payloads."""
    meta = FileSystemReader(str(loaded_at_3[name].with_suffix(""))).read_metadata()
    want = (ZSTD_DESCRIPTOR,) if name == ZSTD_OUTPUT else ()
    assert {tuple(i.transform_descriptors or ()) for i in meta.storage_data.values()} == {want}
    losses = json.loads((loaded_at_3[name] / "losses.json").read_text())
    assert losses == pytest.approx(_reference_losses(_truth(writer_options)), rel=1e-6)


def test_safetensors_payloads_move_undecoded(writer_options: Path) -> None:
    """serialization_format=SAFETENSORS: every tensor chunk is located (its bare elements, by byte
    range) and no two chunks share bytes, though .metadata gives them all one offset per file."""
    source = open_checkpoint(writer_options / "safetensors")
    index, reader = source.index, source.open_reader()
    ranges = set()
    with reader:
        for entry in index.tensors():
            for chunk in entry.chunks:
                if chunk.relative_path is None:
                    continue
                stored = reader.locate(entry, chunk)
                assert stored is not None and stored.nbytes == chunk.numel * entry.dtype.itemsize, entry.fqn
                ranges.add((chunk.relative_path, chunk.offset_bytes, chunk.length_bytes))
    spans = sorted(ranges)
    assert all(a[0] != b[0] or a[1] + a[2] <= b[1] for a, b in zip(spans, spans[1:]))


def test_safetensors_consolidate_decodes_no_tensor(writer_options: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The move stage streams every safetensors-stored chunk by byte range: with chunk decoding
    made to fail, consolidate still writes the run's full state dict."""

    def no_decode(self: object, entry: TensorEntry, chunk: object) -> None:
        raise AssertionError(f"{entry.fqn} was decoded")

    monkeypatch.setattr(DcpReader, "_load_chunk", no_decode)
    out = tmp_path / "full.pt"
    fsdp_convert.consolidate(writer_options / "safetensors", out, nproc=1)
    assert assert_same_state(torch.load(out, weights_only=True), _truth(writer_options)) > 0


def _compressed_reshard(source: Path, out: Path) -> None:
    """``fsdp-convert reshard SOURCE OUT --world-size 3 --compress zstd``, through the CLI."""
    result = CliRunner().invoke(
        app, ["reshard", str(source), str(out), "--world-size", "3", "--nproc", "1", "--compress", "zstd"]
    )
    assert result.exit_code == 0, result.output


def test_compress_takes_zstd_only(writer_options: Path, tmp_path: Path) -> None:
    out = tmp_path / "gz"
    result = CliRunner().invoke(
        app, ["reshard", str(writer_options / "zstd"), str(out), "--world-size", "3", "--compress", "gzip"]
    )
    assert result.exit_code == 2 and "--compress 'gzip': use zstd" in result.output and not out.exists()


def test_zstd_reshard_is_read_by_torch_dcp_load(writer_options: Path, tmp_path: Path) -> None:
    """A zstd source resharded to 3 with zstd output: every payload torch's own FileSystemReader
    reads says stream.zstd/1, and torch's dcp.load (no process group) reads the model bitwise (FSDP2
    at world size 3 loads it too: ``test_writer_option_resharded_to_3_loads_in_fsdp2[zstd_output]``)."""
    out = tmp_path / "ws3"
    _compressed_reshard(writer_options / "zstd", out)
    meta = FileSystemReader(str(out)).read_metadata()
    assert {tuple(i.transform_descriptors or ()) for i in meta.storage_data.values()} == {(ZSTD_DESCRIPTOR,)}
    truth = _truth(writer_options)
    source = open_checkpoint(out)
    index, reader = source.index, source.open_reader()
    with reader:  # a target of the right shapes for torch's loader, made from the index (no values read)
        target: dict[str, dict[str, object]] = {"model": {}}
        for entry in index.tensors():
            if entry.path[0] == "model":
                target["model"][str(entry.path[1])] = torch.zeros(entry.shape, dtype=entry.dtype.torch)
            assert isinstance(entry, TensorEntry)
    dcp.load(target, checkpoint_id=out, no_dist=True)
    assert_same_state(target["model"], truth["model"])  # type: ignore[index]


@pytest.mark.parametrize(
    ("name", "line"),
    [
        ("zstd", "payloads: stream.zstd/1, torch_save"),
        ("safetensors", "payloads: safetensors, torch_save"),
        ("thread_count_3", None),
    ],
)
def test_inspect_names_how_the_payloads_are_stored(writer_options: Path, name: str, line: str | None) -> None:
    result = CliRunner().invoke(app, ["inspect", str(writer_options / name)])
    assert result.exit_code == 0, result.output
    assert (line in result.output.splitlines()) if line else "payloads:" not in result.output
    shown = json.loads(CliRunner().invoke(app, ["inspect", str(writer_options / name), "--json"]).stdout)
    assert shown["payload_formats"] == (line.removeprefix("payloads: ").split(", ") if line else ["torch_save"])
