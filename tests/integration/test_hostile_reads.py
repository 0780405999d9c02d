"""Reading stays inside the checkpoint: symbolic links out of it are refused, and no error quotes a file's bytes.

A checkpoint from elsewhere may hold links (``__1_0.distcp -> /home/me/.env``); every format
checks each file it opens against the checkpoint's real path (``held_roots.inside``) and refuses
one that leads out in one line naming it, unless ``--follow-symlinks`` (``follow_symlinks=True``)
is given, as a cluster whose checkpoint links into a shared store needs. Links that stay inside
are read as before. The 3-rank sample stands in for a real checkpoint; the other formats are made
by hand (a few tensors), as their readers only need files of the right shape.
"""

from __future__ import annotations

import dataclasses
import json
import os
import pickle
import shutil
import struct
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file
from typer.testing import CliRunner

from fsdp_convert.cli import app
from fsdp_convert.errors import CorruptChunkError, UnsafeContentError
from fsdp_convert.formats import open_reader, read_index
from fsdp_convert.formats.dcp import load_metadata
from fsdp_convert.held_roots import FOLLOW_SYMLINKS_ENV
from tests._compare import assert_same_state
from tests._samples import Sample

pytestmark = pytest.mark.redteam  # last rounds' attacks: part of `pytest -m redteam`

SECRET = b"API_KEY=sk-live-0123456789abcdef\n"
SECRET_AS_LENGTH = str(int.from_bytes(SECRET[:8], "little"))  # what "header length N" printed: the first 8 bytes
SECRET_NEXT_LENGTH = str(int.from_bytes(SECRET[8:16], "little"))


@pytest.fixture
def outside(tmp_path: Path) -> Path:
    """A folder beside the checkpoint, holding a secret the checkpoint must not reach."""
    folder = tmp_path / "outside"
    folder.mkdir()
    (folder / "secret.env").write_bytes(SECRET)
    return folder


@pytest.fixture
def ck(ws3_ckpt: Sample, tmp_path: Path) -> Path:
    """A private copy of the 3-rank sample."""
    return Path(shutil.copytree(ws3_ckpt.checkpoint, tmp_path / "ck"))


def _link_out(path: Path, outside: Path) -> Path:
    """Move ``path`` outside and leave a symbolic link to it in its place (an absolute target)."""
    moved = outside / path.name
    shutil.move(path, moved)
    path.symlink_to(moved)
    return moved


def _one_error_line(result: object, code: int, *needles: str) -> str:
    """The single ``error:`` line of a failed CLI run, checked for ``needles`` and for the secret's bytes."""
    stderr: str = result.stderr  # type: ignore[attr-defined]
    assert result.exit_code == code, stderr  # type: ignore[attr-defined]
    lines = [ln for ln in stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: ") and "Traceback" not in stderr, stderr
    for needle in needles:
        assert needle in lines[0], (needle, lines[0])
    for leaked in ("API_KEY", SECRET_AS_LENGTH, SECRET_NEXT_LENGTH):
        assert leaked not in stderr + result.stdout, stderr  # type: ignore[attr-defined]
    return lines[0]


# --- DCP folders: data files, .metadata, meta.pt ---


def test_a_data_file_linked_out_of_the_checkpoint_is_refused(runner: CliRunner, ck: Path, outside: Path, tmp_path: Path) -> None:
    _link_out(ck / "__1_0.distcp", outside)
    out = tmp_path / "out.pt"
    result = runner.invoke(app, ["consolidate", str(ck), str(out), "--nproc", "1"])
    _one_error_line(result, 1, str(ck / "__1_0.distcp"), "symbolic link", "--follow-symlinks")
    assert not out.exists() and not [p for p in tmp_path.iterdir() if ".tmp-" in p.name]


def test_follow_symlinks_reads_a_checkpoint_linked_into_a_shared_store(
    runner: CliRunner, ck: Path, outside: Path, ws3_ckpt: Sample, tmp_path: Path
) -> None:
    """A cluster's layout: the data files live elsewhere; --follow-symlinks reads them, in every worker."""
    for name in ("__0_0.distcp", "__1_0.distcp", "__2_0.distcp"):
        _link_out(ck / name, outside)
    out = tmp_path / "out.pt"
    result = runner.invoke(app, ["consolidate", str(ck), str(out), "--nproc", "2", "--follow-symlinks"])
    assert result.exit_code == 0, result.stderr
    assert assert_same_state(torch.load(out, weights_only=True), ws3_ckpt.truth()) > 0
    assert FOLLOW_SYMLINKS_ENV not in os.environ  # the flag held for the command only
    result = runner.invoke(app, ["verify", str(ck), str(out), "--as-consolidated", "--follow-symlinks"])
    assert result.exit_code == 0, result.stderr
    result = runner.invoke(app, ["verify", str(ck), str(out), "--as-consolidated"])
    _one_error_line(result, 2, "__0_0.distcp", "symbolic link")


def test_a_link_that_stays_inside_the_checkpoint_is_read(runner: CliRunner, ck: Path, tmp_path: Path) -> None:
    (ck / "store").mkdir()
    shutil.move(ck / "__1_0.distcp", ck / "store" / "__1_0.distcp")
    (ck / "__1_0.distcp").symlink_to(Path("store") / "__1_0.distcp")  # relative, as rsync -l keeps it
    linked_ck = tmp_path / "ck-link"
    linked_ck.symlink_to(ck)  # the checkpoint folder itself may be a link
    result = runner.invoke(app, ["consolidate", str(linked_ck), str(tmp_path / "out.pt"), "--nproc", "1"])
    assert result.exit_code == 0, result.stderr


@pytest.mark.parametrize("name", [".metadata", "meta.pt"])
def test_metadata_linked_out_is_refused_by_inspect(runner: CliRunner, ck: Path, outside: Path, name: str) -> None:
    if name == "meta.pt":
        torch.save({"step": 3}, ck / name)  # Lightning Fabric's file beside .metadata
    _link_out(ck / name, outside)
    result = runner.invoke(app, ["inspect", str(ck)])
    _one_error_line(result, 1, str(ck / name), "symbolic link")
    assert runner.invoke(app, ["inspect", str(ck), "--follow-symlinks"]).exit_code == 0


def test_the_library_keyword_follows_links(ck: Path, outside: Path) -> None:
    _link_out(ck / ".metadata", outside)
    with pytest.raises(UnsafeContentError, match=r"\.metadata is a symbolic link .* pass follow_symlinks=True"):
        read_index(ck)
    index = read_index(ck, follow_symlinks=True)
    _link_out(ck / "__2_0.distcp", outside)
    entry = next(e for e in index.tensors() if any(c.relative_path == "__2_0.distcp" for c in e.chunks))
    with open_reader(ck, follow_symlinks=False) as reader, pytest.raises(UnsafeContentError, match="__2_0.distcp"):
        reader.read_tensor(entry)
    with open_reader(ck, follow_symlinks=True) as reader:
        assert reader.read_tensor(entry).shape == entry.shape


def test_a_raw_chunk_pointed_at_a_secret_is_refused_unread(runner: CliRunner, ck: Path, outside: Path) -> None:
    """.metadata says a chunk is bare elements (a safetensors header at its offset) in a data file linked to a secret.

    Before: ``safetensors header length 4420640699264356417`` (the secret's first 8 bytes, ``API_KEY=``).
    """
    meta = load_metadata(ck / ".metadata")
    fqn = "model.norm.weight"
    chunk = meta.state_dict_metadata[fqn].chunks[0]  # type: ignore[union-attr]
    for key, info in list(meta.storage_data.items()):  # type: ignore[union-attr]
        if key.fqn == fqn and tuple(key.offset) == tuple(chunk.offsets):
            numel = int(torch.Size(chunk.sizes).numel())
            meta.storage_data[key] = dataclasses.replace(info, offset=0, length=numel * 4)  # type: ignore[index]
            data_file = ck / info.relative_path
    (ck / ".metadata").write_bytes(pickle.dumps(meta))
    data_file.unlink()
    data_file.symlink_to(outside / "secret.env")
    result = runner.invoke(app, ["inspect", str(ck)])
    _one_error_line(result, 1, str(data_file), "symbolic link")


# --- the other formats: rank files, HuggingFaceStorageWriter shards, HF folders, full files ---


def test_a_rank_file_linked_out_is_refused(runner: CliRunner, tmp_path: Path, outside: Path) -> None:
    ck = tmp_path / "ranks"
    ck.mkdir()
    for rank in range(2):
        torch.save({"w": torch.arange(4.0)}, ck / f"model_world_size_2_rank_{rank}.pt")
    assert runner.invoke(app, ["inspect", str(ck)]).exit_code == 0
    _link_out(ck / "model_world_size_2_rank_1.pt", outside)
    _one_error_line(runner.invoke(app, ["inspect", str(ck)]), 1, "model_world_size_2_rank_1.pt", "symbolic link")


def _hf_storage_folder(folder: Path) -> Path:
    """One HuggingFaceStorageWriter shard: two tensors with DCP sharding info."""
    folder.mkdir()
    info = {"a": {"saved_offsets": [0]}, "b": {"saved_offsets": [0, 0]}}
    tensors = {"a": torch.arange(6.0), "b": torch.ones(2, 3)}
    save_file(tensors, folder / "shard-00001-model-00001-of-00001.safetensors", metadata={"DCP_SHARDING_INFO": json.dumps(info)})
    return folder


def test_an_hf_storage_shard_linked_out_is_refused(runner: CliRunner, tmp_path: Path, outside: Path) -> None:
    ck = _hf_storage_folder(tmp_path / "hfs")
    assert runner.invoke(app, ["inspect", str(ck)]).exit_code == 0
    _link_out(ck / "shard-00001-model-00001-of-00001.safetensors", outside)
    result = runner.invoke(app, ["inspect", str(ck)])
    _one_error_line(result, 1, "shard-00001-model-00001-of-00001.safetensors", "symbolic link")


def test_overlapping_tensors_in_an_hf_storage_shard_are_refused(runner: CliRunner, tmp_path: Path) -> None:
    ck = _hf_storage_folder(tmp_path / "hfs")
    path = ck / "shard-00001-model-00001-of-00001.safetensors"
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8 : 8 + n])
    header["b"]["data_offsets"] = [0, 24]  # b's bytes are a's: two FQNs over one range
    _, end = header["a"]["data_offsets"]
    new = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(new)) + new + raw[8 + n : 8 + n + end])
    result = runner.invoke(app, ["consolidate", str(ck), str(tmp_path / "out.pt")])
    _one_error_line(result, 1, str(path), "a and b overlap")
    assert not (tmp_path / "out.pt").exists()


@pytest.mark.parametrize("name", ["model.safetensors", "optimizer.pt"])
def test_a_file_of_an_hf_folder_linked_out_is_refused(runner: CliRunner, tmp_path: Path, outside: Path, name: str) -> None:
    ck = tmp_path / "hf"
    ck.mkdir()
    save_file({"w": torch.arange(4.0)}, ck / "model.safetensors")
    torch.save({"state": {}, "param_groups": [{"lr": 0.1, "params": []}]}, ck / "optimizer.pt")
    assert runner.invoke(app, ["consolidate", str(ck), str(tmp_path / "ok.pt")]).exit_code == 0
    _link_out(ck / name, outside)
    result = runner.invoke(app, ["consolidate", str(ck), str(tmp_path / "out.pt")])
    _one_error_line(result, 1, str(ck / name), "symbolic link")


def test_a_safetensors_header_length_is_not_quoted(runner: CliRunner, tmp_path: Path) -> None:
    """A shard whose first 8 bytes are text: before, the error printed them as a number (a secret's bytes)."""
    ck = _hf_storage_folder(tmp_path / "hfs")
    bad = ck / "shard-00002-model-00001-of-00001.safetensors"
    bad.write_bytes(SECRET)
    result = runner.invoke(app, ["consolidate", str(ck), str(tmp_path / "out.pt")])
    _one_error_line(result, 1, str(bad), "header length does not fit the file")
    result = runner.invoke(app, ["consolidate", str(bad), str(tmp_path / "out.pt")])  # the file alone
    _one_error_line(result, 1, str(bad), "not a readable safetensors file")


def test_the_safetensors_librarys_quotes_of_a_header_are_left_out(tmp_path: Path) -> None:
    """serde names the dtype it did not know (``unknown variant `API_KEY```): the message names the file, not the text."""
    from fsdp_convert.formats.full_file import open_full_file

    raw = json.dumps({"w": {"dtype": "API_KEY", "shape": [1], "data_offsets": [0, 4]}}).encode()
    bad = tmp_path / "model.safetensors"
    bad.write_bytes(struct.pack("<Q", len(raw)) + raw + b"\0" * 4)
    with pytest.raises(CorruptChunkError, match="not a readable safetensors file") as caught:
        open_full_file(bad)
    assert str(bad) in str(caught.value) and "API_KEY" not in str(caught.value)


# --- --hf-assets, end to end ---


def test_hf_assets_linked_to_a_secret_are_not_copied(runner: CliRunner, ck: Path, outside: Path, tmp_path: Path) -> None:
    assets = tmp_path / "base"
    assets.mkdir()
    (assets / "config.json").write_text(json.dumps({"model_type": "llama", "tie_word_embeddings": True}))
    (assets / "tokenizer.json").symlink_to(outside / "secret.env")
    out = tmp_path / "hf-out"
    args = ["consolidate", str(ck), str(out), "--only", "model", "--hf-assets", str(assets), "--nproc", "1"]
    _one_error_line(runner.invoke(app, args), 1, str(assets / "tokenizer.json"), "symbolic link")
    assert not out.exists() and not [p for p in tmp_path.iterdir() if ".tmp-" in p.name]
    result = runner.invoke(app, [*args, "--follow-symlinks"])
    assert result.exit_code == 0, result.stderr
    assert (out / "tokenizer.json").read_bytes() == SECRET and (out / "tokenizer.json").stat().st_mode & 0o777 == 0o644
