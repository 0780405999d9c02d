"""Hostile stream-transformed payloads: a zstd bomb is bounded by its chunk's claim, and an absurd claim is refused first.

The checkpoint is real: an FSDP2 run on 2 gloo ranks saved by torch's own
``FileSystemWriter(_extensions=[ZStandard()])`` (``tests/_writer_options.py``). One chunk is then
crafted: its ``.metadata`` claim rewritten (torch's own ``Metadata`` classes, pickled) and its
payload replaced by a zstd frame of RLE blocks, the densest zstd there is (4 bytes per 128 KiB
of zeros), appended to the data file. Before the fix, a 128 KB payload claiming ``[2**31]``
float32 decoded 4 GiB into ``TMPDIR`` (the decode limit was twice the claim), and a claim of
``[2**40, 2**40]`` ended ``consolidate`` in a 4-line ``TypeError``.
"""

from __future__ import annotations

import io
import pickle
import shutil
import struct
import tempfile
from pathlib import Path
from typing import IO, Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint._extension import ZStandard
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorStorageMetadata
from typer.testing import CliRunner

import fsdp_convert.formats._stream_transforms as stream_transforms
from fsdp_convert.cli.app import app
from fsdp_convert.formats import read_index
from fsdp_convert.formats.dcp import DcpReader
from fsdp_convert.formats.index import TensorEntry
from tests._dist import run_ranks
from tests._writer_options import writer_options_run

pytestmark = pytest.mark.redteam  # last rounds' attacks: part of `pytest -m redteam`

pytest.importorskip("zstandard")

FQN = "model.norm.weight"  # two 8-element chunks in the real checkpoint


@pytest.fixture(scope="module")
def zstd_ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The real 2-rank FSDP2 checkpoint torch's FileSystemWriter wrote with ``_extensions=[ZStandard()]``."""
    out = tmp_path_factory.mktemp("hostile-payloads")
    run_ranks(writer_options_run, 2, out)
    return out / "zstd"


def rle_zstd(decoded_bytes: int) -> bytes:
    """One zstd frame of ``decoded_bytes`` zeros in RLE blocks: 4 bytes per 128 KiB, the format's densest."""
    out = [struct.pack("<I", 0xFD2FB528), bytes([0x00, 0x38])]  # magic; no content size, a 128 KiB window
    left = decoded_bytes
    while left:
        n = min(left, 128 << 10)
        left -= n
        out.append(((n << 3) | (1 << 1) | (left == 0)).to_bytes(3, "little") + b"\0")  # RLE block of n zeros
    return b"".join(out)


def craft(src: Path, dst: Path, shape: list[int], payload: bytes) -> None:
    """``src`` copied to ``dst``, ``FQN`` now one chunk of ``shape`` whose zstd payload is ``payload``."""
    shutil.copytree(src, dst)
    meta = FileSystemReader(str(src)).read_metadata()
    tensor = meta.state_dict_metadata[FQN]
    assert isinstance(tensor, TensorStorageMetadata)
    info = meta.storage_data[MetadataIndex(FQN, tensor.chunks[0].offsets)]
    for chunk in tensor.chunks:
        del meta.storage_data[MetadataIndex(FQN, chunk.offsets)]
    data = dst / info.relative_path
    at = data.stat().st_size
    with open(data, "ab") as f:
        f.write(payload)
    offsets = torch.Size([0] * len(shape))
    meta.state_dict_metadata[FQN] = TensorStorageMetadata(
        tensor.properties, torch.Size(shape), [ChunkStorageMetadata(offsets, torch.Size(shape))]
    )
    info.offset, info.length = at, len(payload)
    meta.storage_data[MetadataIndex(FQN, offsets)] = info
    (dst / ".metadata").write_bytes(pickle.dumps(meta))


class _Decodes:
    """Counts the bytes stream transforms decode (all, and ``FQN``'s), and every temporary file made, in this process."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.bytes = self.crafted_bytes = 0
        self.temporary_files = 0
        decode = stream_transforms.decode_stream

        def counted(descriptors: tuple[str, ...], stream: IO[bytes], where: str) -> IO[bytes]:
            inner = decode(descriptors, stream, where)
            outer = self

            class Counted(io.RawIOBase):
                def read(self, n: int = -1) -> bytes:
                    piece = inner.read(n)
                    outer.bytes += len(piece)
                    outer.crafted_bytes += len(piece) if f"({FQN})" in where else 0
                    return piece

            return Counted()  # type: ignore[return-value]

        make = tempfile.TemporaryFile

        def temporary_file(*args: Any, **kwargs: Any) -> Any:
            self.temporary_files += 1
            return make(*args, **kwargs)

        monkeypatch.setattr(stream_transforms, "decode_stream", counted)
        monkeypatch.setattr("fsdp_convert.formats.dcp.decode_stream", counted, raising=False)  # where it was imported
        monkeypatch.setattr(tempfile, "TemporaryFile", temporary_file)


def _one_error_line(result: Any) -> str:
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    assert "Traceback" not in result.stderr and "TypeError" not in result.stderr
    return str(lines[0])


@pytest.mark.parametrize("shape", [[2**31], [2**40, 2**40]], ids=["2^31", "2^40x2^40"])
def test_a_claim_its_payload_cannot_decode_to_is_refused_before_any_decode(
    zstd_ckpt: Path, runner: CliRunner, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, shape: list[int]
) -> None:
    """128 KB of zstd decodes to 4 GiB at most (32768 bytes per byte): a claim of 8 GiB, or of 2^82 bytes, is refused
    by ``inspect`` and ``consolidate`` in one line naming the FQN, exit 3, before the plan, the space check or a decode."""
    ckpt = tmp_path / "bomb"
    craft(zstd_ckpt, ckpt, shape, rle_zstd(4 << 30))
    assert (ckpt / "__0_0.distcp").stat().st_size < (512 << 10)
    decodes = _Decodes(monkeypatch)
    out = tmp_path / "out"
    out.mkdir()
    for args in (["inspect", str(ckpt)], ["consolidate", str(ckpt), str(out / "full.pt"), "--nproc", "1"]):
        result = runner.invoke(app, args)
        assert result.exit_code == 3, (args, result.stderr)
        line = _one_error_line(result)
        assert f"{ckpt / '.metadata'}: chunk of {FQN} at offsets" in line and f"claims {shape} elements" in line, line
        assert "decode to through ['stream.zstd/1'] (at most 4295163904)" in line, line
    assert decodes.bytes == 0 and decodes.temporary_files == 0
    assert list(out.iterdir()) == []


def test_a_bomb_within_the_bound_decodes_at_most_its_claim_into_memory(
    zstd_ckpt: Path, runner: CliRunner, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A 2 KiB payload claiming [2^22] float32 (16 MiB, which 2 KiB of zstd could hold) that decodes to 64 MiB of zeros:
    decoding stops at the claim plus a torch.save zip's records (not twice the claim), in memory, no temporary file;
    one line, exit 1, no output left."""
    ckpt = tmp_path / "bomb"
    shape = [2**22]
    craft(zstd_ckpt, ckpt, shape, rle_zstd(64 << 20))
    decodes = _Decodes(monkeypatch)
    out = tmp_path / "out"
    out.mkdir()
    result = runner.invoke(app, ["consolidate", str(ckpt), str(out / "full.pt"), "--nproc", "1"])
    assert result.exit_code == 1, result.stderr
    line = _one_error_line(result)
    limit = (16 << 20) + (64 << 10) + 64  # its elements, a torch.save zip's records and 64 bytes per dimension
    assert f"({FQN}): decodes to more than {limit} bytes; the payload is corrupt" in line, line
    assert limit < decodes.crafted_bytes <= limit + 1  # read in pieces no larger than what is left of the limit
    assert decodes.temporary_files == 0
    assert list(out.iterdir()) == []
    entry = next(e for e in read_index(ckpt).entries if e.fqn == FQN)
    assert isinstance(entry, TensorEntry) and stream_transforms.chunk_limit_bytes(entry, entry.chunks[0]) == limit


def test_decoding_more_than_the_memory_available_is_refused_in_one_line(
    zstd_ckpt: Path, runner: CliRunner, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A real payload whose claim (plus records) exceeds the memory available: one line, exit 1, nothing decoded."""
    monkeypatch.setattr(stream_transforms, "_available_memory_bytes", lambda: 1000)
    decodes = _Decodes(monkeypatch)
    result = runner.invoke(app, ["consolidate", str(zstd_ckpt), str(tmp_path / "full.pt"), "--nproc", "1"])
    assert result.exit_code == 1, result.stderr
    line = _one_error_line(result)
    assert "bytes of memory, 1000 are available" in line and "__" in line, line
    assert decodes.bytes == 0 and list(tmp_path.iterdir()) == []


def _save_zeros(path: Path, numel: int) -> dict[str, Any]:
    state = {"model": {"zeros": torch.zeros(numel), "w": torch.arange(6.0).reshape(2, 3)}, "lr": 0.5}
    dcp.save(state, storage_writer=FileSystemWriter(path, _extensions=[ZStandard()]), no_dist=True)
    return state


@pytest.mark.parametrize("reader", ["consolidate", "read_chunk"])
def test_zeros_torch_compresses_hardest_are_within_the_bound(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, reader: str
) -> None:
    """16 MiB of zeros, which torch's zstd writer compresses about 13,000-fold, read back bit for bit: the claim bound
    (32768-fold) never refuses a real payload, and the decoded bytes become the tensor, in memory, no temporary file."""
    state = _save_zeros(tmp_path / "ckpt", 4 << 20)
    stored = FileSystemReader(str(tmp_path / "ckpt")).read_metadata().storage_data
    (info,) = [i for k, i in stored.items() if k.fqn == "model.zeros"]
    assert (16 << 20) // info.length > 10_000  # near the format's ceiling
    decodes = _Decodes(monkeypatch)
    if reader == "consolidate":
        import fsdp_convert

        fsdp_convert.consolidate(tmp_path / "ckpt", tmp_path / "full.pt", nproc=1)
        got = torch.load(tmp_path / "full.pt", weights_only=True)["model"]["zeros"]
    else:
        entry = next(e for e in read_index(tmp_path / "ckpt").entries if e.fqn == "model.zeros")
        assert isinstance(entry, TensorEntry)
        with DcpReader(tmp_path / "ckpt") as r:
            got = r.read_chunk(entry, entry.chunks[0])
    assert torch.equal(got, state["model"]["zeros"]) and got.dtype == torch.float32
    assert decodes.temporary_files == 0 and decodes.bytes > (16 << 20)


def test_a_decoded_payload_is_loaded_weights_only(zstd_ckpt: Path, runner: CliRunner, tmp_path: Path) -> None:
    """A zstd payload whose pickle names a global outside torch's weights-only allow-list (``fractions.Fraction``):
    refused as code it would run, one line naming the chunk, exit 1, nothing written."""
    import fractions

    import zstandard

    ckpt = tmp_path / "hostile"
    buffer = io.BytesIO()
    torch.save(fractions.Fraction(1, 2), buffer)
    craft(zstd_ckpt, ckpt, [16], zstandard.ZstdCompressor().compress(buffer.getvalue()))
    out = tmp_path / "out"
    out.mkdir()
    result = runner.invoke(app, ["consolidate", str(ckpt), str(out / "full.pt"), "--nproc", "1"])
    assert result.exit_code == 1, result.stderr
    line = _one_error_line(result)
    assert f"({FQN}): payload would run code, refused" in line and "fractions" in line, line
    assert list(out.iterdir()) == []
