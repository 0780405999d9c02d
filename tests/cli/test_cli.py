"""CLI: results on stdout, one-line errors on stderr with the documented exit codes, no half outputs."""

from __future__ import annotations

import json
import math
import re
import shutil
from pathlib import Path

import pytest
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, MetadataIndex, TensorStorageMetadata
from typer.testing import CliRunner

from fsdp_convert.cli import app
from fsdp_convert.formats import read_index
from tests._samples import Sample

GOLDEN = Path(__file__).parent.parent / "golden" / "inspect_ws3_fp32.json"


def _copy(sample: Sample, tmp_path: Path) -> Path:
    dst = tmp_path / "ck"
    shutil.copytree(sample.checkpoint, dst)
    return dst


def _assert_one_line_error(result, exit_code: int, *needles: str) -> None:  # type: ignore[no-untyped-def]
    assert result.exit_code == exit_code, (result.exit_code, result.stdout, result.stderr)
    assert result.stdout == ""
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    assert "Traceback" not in result.stderr
    for needle in needles:
        assert needle in lines[0], (needle, lines[0])


def test_inspect_json_matches_golden(runner: CliRunner, ws3_ckpt: Sample) -> None:
    result = runner.invoke(app, ["inspect", str(ws3_ckpt.checkpoint), "--json"])
    assert result.exit_code == 0, result.stderr
    doc = json.loads(result.stdout)
    assert doc["checkpoint"] == str(ws3_ckpt.checkpoint)
    doc["checkpoint"] = "<checkpoint>"
    # regenerate deliberately (and review the diff) when the sample model or the schema changes
    assert doc == json.loads(GOLDEN.read_text())
    assert doc["schema_version"] == 1 and doc["producer"] == "fsdp2" and doc["world_size"] == 3
    assert [e["fqn"] for e in doc["groups"]["other"]] == ["train_state.step", "train_state.world_size"]
    assert all(e["kind"] == "bytes" for e in doc["groups"]["other"])


def test_inspect_json_agrees_with_torchs_reading_of_metadata(runner: CliRunner, ws3_ckpt: Sample) -> None:
    """The golden file is a snapshot of the tool's own output; this checks the same document field
    by field against .metadata as torch itself reads it (``FileSystemReader.read_metadata``):
    every FQN once, in its top-level key's group, in the order the state dict was saved; shape,
    dtype, chunk count, chunks per dim and bytes (elements x item size, or a bytes entry's stored length); world
    size (distinct ranks of the ``__<rank>_<n>.distcp`` files), data files, total bytes and DCP version."""
    md = FileSystemReader(str(ws3_ckpt.checkpoint)).read_metadata()
    result = runner.invoke(app, ["inspect", str(ws3_ckpt.checkpoint), "--json"])
    assert result.exit_code == 0, result.stderr
    doc = json.loads(result.stdout)

    want: dict[str, dict[str, object]] = {}
    for fqn, meta in md.state_dict_metadata.items():
        if isinstance(meta, TensorStorageMetadata):
            dtype = meta.properties.dtype
            want[fqn] = {
                "fqn": fqn,
                "kind": "tensor",
                "shape": list(meta.size),
                "dtype": str(dtype).removeprefix("torch."),
                "chunks": len(meta.chunks),
                # FSDP2 alone cuts dim 0 only: pieces on dim 0 are its non-empty chunks
                "chunks_per_dim": [sum(math.prod(c.sizes) > 0 for c in meta.chunks), *([1] * (len(meta.size) - 1))]
                if meta.size
                else [],
                "bytes": math.prod(meta.size) * dtype.itemsize,
            }
        else:
            assert isinstance(meta, BytesStorageMetadata), fqn
            length = md.storage_data[MetadataIndex(fqn)].length
            want[fqn] = {
                "fqn": fqn,
                "kind": "bytes",
                "shape": None,
                "dtype": None,
                "chunks": 1,
                "chunks_per_dim": None,
                "bytes": length,
            }
    assert list(doc["groups"]) == ["model", "optim", "other"]
    rows = [row for group in doc["groups"].values() for row in group]
    assert sorted(row["fqn"] for row in rows) == sorted(want)  # every entry, each once
    saved_order = list(md.planner_data)  # the order of the state dict dcp.save was given
    for group, members in doc["groups"].items():
        fqns = [row["fqn"] for row in members]
        assert fqns == sorted(fqns, key=saved_order.index), group
        for row in members:
            top = md.planner_data[row["fqn"]][0]
            assert group == (top if top in ("model", "optim") else "other"), row["fqn"]
            assert row == want[row["fqn"]]

    files = {info.relative_path for info in md.storage_data.values()}
    ranks = {int(re.fullmatch(r"__(\d+)_\d+\.distcp", name).group(1)) for name in files}  # type: ignore[union-attr]
    assert doc["world_size"] == len(ranks) == ws3_ckpt.world_size
    assert doc["data_files"] == sorted(files)
    assert doc["total_bytes"] == sum(int(row["bytes"]) for row in want.values())  # type: ignore[call-overload]
    assert doc["dcp_version"] == md.version
    # FSDP2 records an empty chunk for a tensor smaller than the world size (docs/producers.md's producer table)
    tensors = [m for m in md.state_dict_metadata.values() if isinstance(m, TensorStorageMetadata)]
    assert doc["producer"] == "fsdp2" and any(math.prod(c.sizes) == 0 for m in tensors for c in m.chunks)


def test_inspect_table(runner: CliRunner, ws3_ckpt: Sample) -> None:
    result = runner.invoke(app, ["inspect", str(ws3_ckpt.checkpoint)])
    assert result.exit_code == 0, result.stderr
    assert "producer: fsdp2" in result.stdout and "world size: 3" in result.stdout
    assert "model.tok_embeddings.weight" in result.stdout and "(101, 16)" in result.stdout
    assert result.stderr == ""


def test_inspect_table_lines_are_one_per_entry_names_as_written(runner: CliRunner, tmp_path: Path) -> None:
    """Each entry is one table line (the columns drawn as one multi-line row), its name never read as markup."""
    import torch
    import torch.distributed.checkpoint as dcp

    names = ["a.weight", "[bold]b[/bold].weight", "[red]c.weight", "d.weight"]
    dcp.save({n: torch.full((i + 1, 2), float(i)) for i, n in enumerate(names)}, checkpoint_id=tmp_path / "ck", no_dist=True)
    result = runner.invoke(app, ["inspect", str(tmp_path / "ck")])
    assert result.exit_code == 0, result.stderr
    rows = [line for line in result.stdout.splitlines() if line.startswith("│")]
    assert len(rows) == len(names)
    for i, (row, name) in enumerate(zip(rows, names)):
        assert name in row and f"({i + 1}, 2)" in row and row.rstrip().endswith(f"{4 * 2 * (i + 1)} │"), row


def test_consolidate_prints_result(runner: CliRunner, ws3_ckpt: Sample, tmp_path: Path) -> None:
    out = tmp_path / "full.pt"
    result = runner.invoke(app, ["consolidate", str(ws3_ckpt.checkpoint), str(out), "--json"])
    assert result.exit_code == 0, result.stderr
    doc = json.loads(result.stdout)
    assert doc["output"] == str(out) and doc["format"] == "torch_save" and doc["tensors"] == 124
    assert out.stat().st_size == doc["file_bytes"]
    assert [p.name for p in tmp_path.iterdir()] == ["full.pt"]


def test_consolidate_refuses_missing_checkpoint(runner: CliRunner, tmp_path: Path) -> None:
    missing = tmp_path / "nope"
    result = runner.invoke(app, ["consolidate", str(missing), str(tmp_path / "o.pt")])
    _assert_one_line_error(result, 3, str(missing))
    result = runner.invoke(app, ["inspect", str(tmp_path)])
    _assert_one_line_error(result, 3, str(tmp_path), ".metadata")
    assert list(tmp_path.iterdir()) == []


def test_consolidate_refuses_missing_data_file(runner: CliRunner, ws3_ckpt: Sample, tmp_path: Path) -> None:
    ck = _copy(ws3_ckpt, tmp_path)
    (ck / "__1_0.distcp").unlink()
    out = tmp_path / "o.pt"
    result = runner.invoke(app, ["consolidate", str(ck), str(out)])
    _assert_one_line_error(result, 3, str(ck / "__1_0.distcp"))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ck"]


def test_consolidate_refuses_existing_output(runner: CliRunner, ws3_ckpt: Sample, tmp_path: Path) -> None:
    out = tmp_path / "o.pt"
    out.write_bytes(b"precious")
    result = runner.invoke(app, ["consolidate", str(ws3_ckpt.checkpoint), str(out)])
    _assert_one_line_error(result, 4, str(out), "--overwrite")
    assert out.read_bytes() == b"precious"
    result = runner.invoke(app, ["consolidate", str(ws3_ckpt.checkpoint), str(out), "--overwrite"])
    assert result.exit_code == 0, result.stderr
    assert out.read_bytes()[:2] == b"PK"  # a zip, i.e. a torch.save file
    assert [p.name for p in tmp_path.iterdir()] == ["o.pt"]


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["--only", "optim", "OUT.safetensors"], "holds model weights only"),
        (["OUT.txt"], "unknown output suffix"),
    ],
)
def test_consolidate_usage_errors_exit_2(
    runner: CliRunner, ws3_ckpt: Sample, tmp_path: Path, args: list[str], needle: str
) -> None:
    args = [a.replace("OUT", str(tmp_path / "o")) for a in args]
    result = runner.invoke(app, ["consolidate", str(ws3_ckpt.checkpoint), *args[-1:], *args[:-1]])
    _assert_one_line_error(result, 2, needle)
    assert list(tmp_path.iterdir()) == []


def test_consolidate_bad_option_values_exit_2(runner: CliRunner, ws3_ckpt: Sample, tmp_path: Path) -> None:
    for extra in (["--only", "weights"], ["--nproc", "0"]):
        result = runner.invoke(app, ["consolidate", str(ws3_ckpt.checkpoint), str(tmp_path / "o.pt"), *extra])
        assert result.exit_code == 2, result.stderr
    assert list(tmp_path.iterdir()) == []


def test_consolidate_reports_corrupt_payload_and_leaves_nothing(runner: CliRunner, ws3_ckpt: Sample, tmp_path: Path) -> None:
    ck = _copy(ws3_ckpt, tmp_path)
    entry = next(e for e in read_index(ck).tensors() if e.fqn == "model.layers.1.mlp.0.weight")
    chunk = next(c for c in entry.chunks if c.relative_path == "__2_0.distcp")
    data = bytearray((ck / "__2_0.distcp").read_bytes())
    data[chunk.offset_bytes : chunk.offset_bytes + 64] = b"\xff" * 64  # the zip's first local header
    (ck / "__2_0.distcp").write_bytes(bytes(data))
    out = tmp_path / "o.pt"
    result = runner.invoke(app, ["consolidate", str(ck), str(out)])
    _assert_one_line_error(result, 1, str(ck / "__2_0.distcp"), "model.layers.1.mlp.0.weight", f"[{chunk.offset_bytes}, ")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ck"]


def test_unexpected_error_is_an_internal_error_exit_70(
    runner: CliRunner, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """An exception that is no CheckpointError is a bug: one line asking for a report, exit 70 (EX_SOFTWARE)."""
    import fsdp_convert.cli.inspect_cmd as inspect_cmd

    def boom(_: object) -> None:
        raise ValueError("kaput")

    monkeypatch.setattr(inspect_cmd, "inspect_checkpoint", boom)
    result = runner.invoke(app, ["inspect", str(tmp_path)])
    _assert_one_line_error(result, 70, "error: internal error: ValueError: kaput", "please report this", "--debug")
    result = runner.invoke(app, ["--debug", "inspect", str(tmp_path)])
    assert result.exit_code == 70 and "Traceback" in result.stderr
