"""consolidate on real FSDP2 checkpoints, checked bitwise against the same run's full state dict."""

from __future__ import annotations

import json
import zipfile
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file
from typer.testing import CliRunner

import fsdp_convert
from fsdp_convert.cli import app
from fsdp_convert.move import MoveJob
from tests._compare import assert_same_state, same_bits
from tests._samples import Sample


def test_consolidate_pt_equals_ground_truth(fsdp2_ckpt: Sample, tmp_path: Path) -> None:
    out = tmp_path / "full.pt"
    result = fsdp_convert.consolidate(fsdp2_ckpt.checkpoint, out)
    got = torch.load(out, weights_only=True, mmap=True)
    want = fsdp2_ckpt.truth()
    n = assert_same_state(got, want)
    with zipfile.ZipFile(out) as z:  # CRCs combined from the checked chunk CRCs must be right
        assert z.testzip() is None
    # every model tensor, and exp_avg/exp_avg_sq/step for every parameter
    assert n == len(want["model"]) * 4 == result.tensors
    assert got["optim"]["param_groups"] == want["optim"]["param_groups"]
    assert got["model"]["tok_embeddings.weight"].dtype == fsdp2_ckpt.dtype
    assert got["optim"]["state"]["logit_scale"]["step"].shape == ()


def test_consolidate_covers_awkward_shapes(fsdp2_ckpt: Sample) -> None:
    """The fixtures really contain the cases the tests claim to cover."""
    index = fsdp_convert.inspect_checkpoint(fsdp2_ckpt.checkpoint)
    rows = {e.fqn: e for e in index.entries}
    assert index.world_size == fsdp2_ckpt.world_size
    assert rows["model.tok_embeddings.weight"].shape[0] % fsdp2_ckpt.world_size != 0
    assert rows["model.logit_scale"].shape == (1,) and rows["model.logit_scale"].chunks >= 2
    assert rows["optim.state.logit_scale.step"].shape == ()
    # values only a bitwise copy keeps: a NaN (sign and payload bits set) and -0.0, in weights and moments
    truth = fsdp2_ckpt.truth()
    weight, moments = truth["model"]["tok_embeddings.weight"], truth["optim"]["state"]["tok_embeddings.weight"]
    for t in (weight, moments["exp_avg_sq"]):
        assert torch.isnan(t).any()
    for t in (weight, moments["exp_avg"]):
        assert ((t == 0) & torch.signbit(t)).any()


def test_consolidate_safetensors_holds_model_weights(fsdp2_ckpt: Sample, tmp_path: Path) -> None:
    out = tmp_path / "model.safetensors"
    fsdp_convert.consolidate(fsdp2_ckpt.checkpoint, out)
    want = fsdp2_ckpt.truth()["model"]
    got = load_file(out)
    assert sorted(got) == sorted(want)
    for fqn, tensor in want.items():
        assert same_bits(got[fqn], tensor), fqn
    with safe_open(out, "pt") as f:
        assert f.metadata() == {"format": "pt"}
        assert list(f.keys()) == sorted(want)


@pytest.mark.parametrize("only", ["model", "optim"])
def test_consolidate_only_one_group(ws3_ckpt: Sample, tmp_path: Path, only: str) -> None:
    out = tmp_path / f"{only}.pt"
    fsdp_convert.consolidate(ws3_ckpt.checkpoint, out, only=only)  # type: ignore[arg-type]
    got = torch.load(out, weights_only=True)
    assert list(got) == [only]
    assert_same_state(got[only], ws3_ckpt.truth()[only])


@pytest.mark.slow
@pytest.mark.parametrize("name", ["ws3_fp32", "ws3_bf16"])
def test_consolidate_nproc2_is_byte_identical_to_nproc1(name: str, request: pytest.FixtureRequest, tmp_path: Path) -> None:
    sample: Sample = request.getfixturevalue("ws3_ckpt" if name == "ws3_fp32" else "ws3_bf16_ckpt")
    one, two = tmp_path / "one.pt", tmp_path / "two.pt"
    fsdp_convert.consolidate(sample.checkpoint, one, nproc=1)
    result = fsdp_convert.consolidate(sample.checkpoint, two, nproc=2)
    assert result.nproc == 2
    assert one.read_bytes() == two.read_bytes()
    assert_same_state(torch.load(two, weights_only=True), sample.truth())


def _load_hf_folder(folder: Path) -> tuple[dict[str, torch.Tensor], dict[str, object]]:
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    tensors: dict[str, torch.Tensor] = {}
    for name in sorted(set(index["weight_map"].values())):
        shard = load_file(folder / name)
        assert all(index["weight_map"][k] == name for k in shard)
        tensors.update(shard)
    return tensors, index


def test_consolidate_folder_writes_hf_shards_and_index(ws3_ckpt: Sample, tmp_path: Path) -> None:
    out = tmp_path / "hf"
    result = fsdp_convert.consolidate(ws3_ckpt.checkpoint, out, nproc=1, max_shard_bytes=8000)
    want = ws3_ckpt.truth()["model"]
    got, index = _load_hf_folder(out)
    assert sorted(got) == sorted(want) == sorted(index["weight_map"])
    for fqn, tensor in want.items():
        assert same_bits(got[fqn], tensor), fqn
    assert index["metadata"] == {"total_size": sum(t.nbytes for t in want.values())}
    # beside the shards, as transformers' Trainer keeps them: the optimizer state dict itself, and the rest
    truth = ws3_ckpt.truth()
    assert_same_state(torch.load(out / "optimizer.pt", weights_only=True), truth["optim"])
    assert torch.load(out / "extra_state.pt", weights_only=True) == {"train_state": truth["train_state"]}
    optim_bytes = sum(t.nbytes for s in truth["optim"]["state"].values() for t in s.values())
    assert result.tensor_bytes == index["metadata"]["total_size"] + optim_bytes
    shards = sorted(out.glob("model-*.safetensors"))
    assert len(shards) > 3 and shards[0].name == f"model-00001-of-{len(shards):05d}.safetensors"
    for shard in shards:
        with safe_open(shard, "pt") as f:
            sizes = [f.get_slice(k).get_shape() for k in f.keys()]
            assert f.metadata() == {"format": "pt"}  # as transformers' save_pretrained writes it
        data_bytes = sum(4 * torch.Size(s).numel() for s in sizes)
        assert data_bytes <= 8000 or len(sizes) == 1  # only a tensor over the limit stands alone
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf"]


@pytest.mark.slow
def test_consolidate_folder_with_two_workers_writes_the_same_files(ws3_ckpt: Sample, tmp_path: Path) -> None:
    one, two = tmp_path / "one", tmp_path / "two"
    fsdp_convert.consolidate(ws3_ckpt.checkpoint, one, nproc=1, max_shard_bytes=8000)
    fsdp_convert.consolidate(ws3_ckpt.checkpoint, two, nproc=2, max_shard_bytes=8000)
    names = sorted(p.name for p in one.iterdir())
    assert names == sorted(p.name for p in two.iterdir())
    for name in names:
        assert (one / name).read_bytes() == (two / name).read_bytes(), name


def _readers(log_dir: Path) -> set[int]:
    """The ranks that read a chunk, from the FSDP_CONVERT_READ_LOG files (then emptied)."""
    ranks = set()
    for log in log_dir.glob("reads-*.jsonl"):
        ranks |= {int(json.loads(line)[0]) for line in log.read_text().splitlines()}
        log.unlink()
    return ranks


@pytest.mark.slow
def test_consolidate_nproc3_is_byte_identical_to_nproc1(
    ws3_ckpt: Sample, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Three workers each write their own run of tensors into the same file, and into a folder's
    shards (of uneven sizes; with --only model every worker writes into some shard); every output
    file is the same bytes as one in-process worker writes, and bitwise the run's own full state dict."""
    from fsdp_convert.constants import READ_LOG_ENV

    logs = tmp_path / "reads"
    logs.mkdir()
    truth = ws3_ckpt.truth()
    one, three = tmp_path / "one", tmp_path / "three"
    one.mkdir()
    three.mkdir()
    fsdp_convert.consolidate(ws3_ckpt.checkpoint, one / "full.pt", nproc=1)
    fsdp_convert.consolidate(ws3_ckpt.checkpoint, one / "hf", nproc=1, max_shard_bytes=5000)
    monkeypatch.setenv(READ_LOG_ENV, str(logs))

    result = fsdp_convert.consolidate(ws3_ckpt.checkpoint, three / "full.pt", nproc=3)
    assert result.nproc == 3 and _readers(logs) == {0, 1, 2}
    assert (one / "full.pt").read_bytes() == (three / "full.pt").read_bytes()
    assert_same_state(torch.load(three / "full.pt", weights_only=True), truth)

    result = fsdp_convert.consolidate(ws3_ckpt.checkpoint, three / "hf", nproc=3, max_shard_bytes=5000)
    assert result.nproc == 3 and _readers(logs) == {0, 1, 2}
    names = sorted(p.name for p in (one / "hf").iterdir())
    assert names == sorted(p.name for p in (three / "hf").iterdir())
    shards = [n for n in names if n.startswith("model-")]
    assert len(shards) > 6 and len({(one / "hf" / n).stat().st_size for n in shards}) > 2  # many, uneven
    for name in names:
        assert (one / "hf" / name).read_bytes() == (three / "hf" / name).read_bytes(), name
    got, _ = _load_hf_folder(three / "hf")
    assert_same_state({k: got[k] for k in truth["model"]}, truth["model"])
    assert_same_state(torch.load(three / "hf" / "optimizer.pt", weights_only=True), truth["optim"])

    model_logs = tmp_path / "model-reads"
    model_logs.mkdir()
    monkeypatch.setenv(READ_LOG_ENV, str(model_logs))
    fsdp_convert.consolidate(ws3_ckpt.checkpoint, three / "hf-model", nproc=3, only="model", max_shard_bytes=5000)
    assert _readers(model_logs) == {0, 1, 2}  # the model alone: every worker moves tensors into shards
    monkeypatch.delenv(READ_LOG_ENV)
    fsdp_convert.consolidate(ws3_ckpt.checkpoint, one / "hf-model", nproc=1, only="model", max_shard_bytes=5000)
    names = sorted(p.name for p in (one / "hf-model").iterdir())
    assert names == sorted(p.name for p in (three / "hf-model").iterdir()) and len(names) > 6
    for name in names:
        assert (one / "hf-model" / name).read_bytes() == (three / "hf-model" / name).read_bytes(), name


def test_verify_equal_across_formats(ws3_ckpt: Sample, tmp_path: Path) -> None:
    pt, st, hf = tmp_path / "full.pt", tmp_path / "model.safetensors", tmp_path / "hf"
    fsdp_convert.consolidate(ws3_ckpt.checkpoint, pt, verify_output=True)
    fsdp_convert.consolidate(ws3_ckpt.checkpoint, st, verify_output=True)
    fsdp_convert.consolidate(ws3_ckpt.checkpoint, hf, max_shard_bytes=8000, verify_output=True)
    full = fsdp_convert.verify(ws3_ckpt.checkpoint, pt)
    assert full.equal and full.compared == len(fsdp_convert.inspect_checkpoint(ws3_ckpt.checkpoint).entries)
    assert fsdp_convert.verify(ws3_ckpt.truth_path, pt).equal
    for a, b, compared in [(ws3_ckpt.checkpoint, st, 31), (pt, hf, full.compared), (st, hf, 31)]:
        result = fsdp_convert.verify(a, b)
        assert result.equal and result.compared == compared, (a, b, result.differences[:3])


def test_verify_reports_differing_missing_and_extra(ws3_ckpt: Sample, tmp_path: Path) -> None:
    state = ws3_ckpt.truth()
    state["model"]["norm.weight"] = state["model"]["norm.weight"].clone()
    state["model"]["norm.weight"][3] += 1e-3
    del state["model"]["norm.bias"]
    state["model"]["extra.weight"] = torch.zeros(2)
    state["optim"]["param_groups"][0]["lr"] = 0.5
    # beside a NaN (equal on both sides) a real difference; -0.0 made 0.0, a difference in bits alone
    emb = state["model"]["tok_embeddings.weight"] = state["model"]["tok_embeddings.weight"].clone()
    emb[0, 0] += 1e-3
    moments = state["optim"]["state"]["tok_embeddings.weight"]
    moments["exp_avg"] = torch.where(moments["exp_avg"] == 0, 0.0, moments["exp_avg"])
    other = tmp_path / "other.pt"
    torch.save(state, other)
    result = fsdp_convert.verify(ws3_ckpt.checkpoint, other)
    kinds = {(d.key, d.kind) for d in result.differences}
    assert kinds == {
        ("model.norm.weight", "differs"),
        ("model.norm.bias", "missing"),
        ("model.extra.weight", "extra"),
        ("optim.param_groups.0.lr", "differs"),
        ("model.tok_embeddings.weight", "differs"),
        ("optim.state.tok_embeddings.weight.exp_avg", "differs"),
    }
    details = {d.key: d.detail for d in result.differences}
    assert details["model.tok_embeddings.weight"] == "values differ (max abs difference 0.001)"
    assert "bits only" in details["optim.state.tok_embeddings.weight.exp_avg"]
    loose = fsdp_convert.verify(ws3_ckpt.checkpoint, other, atol=1e-2)
    assert {d.key for d in loose.differences} == {"model.norm.bias", "model.extra.weight", "optim.param_groups.0.lr"}


def test_verify_cli_exit_codes(runner: CliRunner, ws3_ckpt: Sample, tmp_path: Path) -> None:
    pt = tmp_path / "full.pt"
    fsdp_convert.consolidate(ws3_ckpt.checkpoint, pt)
    ok = runner.invoke(app, ["verify", str(ws3_ckpt.checkpoint), str(pt), "--json"])
    assert ok.exit_code == 0, ok.stderr
    assert json.loads(ok.stdout)["equal"] is True
    state = torch.load(pt, weights_only=True)
    state["model"]["output.weight"][0, 0] = 7.0
    bad = tmp_path / "bad.pt"
    torch.save(state, bad)
    diff = runner.invoke(app, ["verify", str(ws3_ckpt.checkpoint), str(bad)])
    assert diff.exit_code == 1
    assert "model.output.weight" in diff.stdout and "differs" in diff.stdout and diff.stderr == ""


def _corrupt_written_tensor(monkeypatch: pytest.MonkeyPatch, fqn: str) -> None:
    """Make the mover flip the lowest bit of ``fqn``'s first byte once written, with a CRC-32 to match."""
    import os
    import zlib

    from fsdp_convert.move import Mover
    from fsdp_convert.pieces import Piece

    original = Mover.move

    def move(self: Mover, job: MoveJob) -> list[Piece]:
        pieces = original(self, job)
        if not job.entry.fqn.endswith(fqn):
            return pieces
        first = min(pieces, key=lambda p: p.offset)
        os.pwrite(job.fd, bytes([os.pread(job.fd, 1, first.offset)[0] ^ 1]), first.offset)
        crc = zlib.crc32(os.pread(job.fd, first.nbytes, first.offset))
        return [Piece(p.file, p.offset, p.nbytes, crc) if p is first else p for p in pieces]

    monkeypatch.setattr(Mover, "move", move)


@pytest.mark.parametrize("name", ["full.pt", "hf"])
def test_verify_option_catches_a_corrupt_write(
    ws3_ckpt: Sample, runner: CliRunner, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, name: str
) -> None:
    """--verify reads the output back: one flipped bit in one written tensor fails the run, and
    neither the output nor its temporary is left behind."""
    from fsdp_convert.errors import VerificationError

    _corrupt_written_tensor(monkeypatch, "layers.1.mlp.0.weight")
    out = tmp_path / name
    options = {"max_shard_bytes": 5000} if name == "hf" else {}
    with pytest.raises(VerificationError, match=r"model\.layers\.1\.mlp\.0\.weight values differ"):
        fsdp_convert.consolidate(ws3_ckpt.checkpoint, out, nproc=1, verify_output=True, **options)
    assert list(tmp_path.iterdir()) == []

    args = ["consolidate", str(ws3_ckpt.checkpoint), str(out), "--nproc", "1", "--verify"]
    args += ["--max-shard-size", "5000"] if name == "hf" else []
    result = runner.invoke(app, args)
    assert result.exit_code == 1, (result.stdout, result.stderr)
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), lines
    assert "model.layers.1.mlp.0.weight" in lines[0] and "nothing was written" in lines[0], lines
    assert list(tmp_path.iterdir()) == []

    monkeypatch.undo()  # the same run, written right, passes and leaves the output
    result = runner.invoke(app, args)
    assert result.exit_code == 0, result.stderr
    assert [p.name for p in tmp_path.iterdir()] == [name]
