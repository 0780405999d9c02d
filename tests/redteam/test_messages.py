"""Messages carry no file bytes (issue 37 N3) and no raw terminal escapes (N13).

N3: ``.metadata`` chooses where a bare-elements (``serialization_format=SAFETENSORS``) chunk's
safetensors header lies in its data file; the 8 bytes there were printed as the header's length
(``inspect`` printed ``4420640699264356417``, the bytes ``API_KEY=``). Each crafted checkpoint here
points such a chunk at a secret inside a data file, in the ways a header can be read (its length,
its JSON values, its data range), and no output of any command may hold the secret's bytes or any
integer reading of them (every 4- and 8-byte window, either byte order, decimal or hex).

N13: tensor names holding terminal escapes (clear screen, window title) are shown escaped on a
terminal (``\\x1b``), in every command's human output; ``--json`` keeps the exact name.
"""

from __future__ import annotations

import dataclasses
import json
import pickle
import struct
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from typer.testing import CliRunner

from fsdp_convert.cli import app
from tests.redteam._attack import SECONDS_BOUND, attack

SECRET = b"API_KEY=sk-live-0123456789abcdef\n"


def _readings(secret: bytes) -> set[str]:
    """Every integer reading of 4 or 8 bytes of ``secret`` (either byte order), in decimal and in hex."""
    found = set()
    for width in (4, 8):
        for at in range(len(secret) - width + 1):
            for order in ("little", "big"):
                value = int.from_bytes(secret[at : at + width], order)  # type: ignore[arg-type]
                found.update({str(value), f"{value:x}", f"{value:#010x}"})
    return found


SECRET_READINGS = _readings(SECRET)


def _dcp(folder: Path) -> Path:
    """A one-process DCP checkpoint of two tensors (``model.w`` 8 floats, ``model.v`` 4)."""
    import torch.distributed.checkpoint as dcp

    with pytest.warns(UserWarning):  # "assuming the intent is to save in a single process"
        dcp.save({"model": {"w": torch.arange(8.0), "v": torch.ones(4)}}, checkpoint_id=str(folder))
    return folder


def _point_w_at(folder: Path, payload: bytes) -> int:
    """Append ``payload`` to ``model.w``'s data file and make ``.metadata`` call it a bare-elements chunk there."""
    from fsdp_convert.formats.dcp import load_metadata

    meta = load_metadata(folder / ".metadata")
    for key, info in list(meta.storage_data.items()):  # type: ignore[union-attr]
        if key.fqn == "model.w":
            data_file = folder / info.relative_path
            at = data_file.stat().st_size
            with data_file.open("ab") as f:
                f.write(payload)
            meta.storage_data[key] = dataclasses.replace(info, offset=at, length=8 * 4)  # type: ignore[index]
    (folder / ".metadata").write_bytes(pickle.dumps(meta))
    return at


def _header(entry: dict[str, Any]) -> bytes:
    raw = json.dumps({"model.w": entry}).encode()
    return struct.pack("<Q", len(raw)) + raw


_SECRET_TEXT = SECRET.decode().strip()
_SECRET_INT = int.from_bytes(SECRET[:8], "little")
CRAFTED: dict[str, bytes] = {
    # the row's case: the secret's first 8 bytes read as the header length
    "length": SECRET,
    # a header that parses, its values the secret (as text, as numbers)
    "dtype": _header({"dtype": _SECRET_TEXT, "shape": [8], "data_offsets": [0, 32]}) + bytes(32),
    "offsets": _header({"dtype": "F32", "shape": [8], "data_offsets": _SECRET_TEXT}) + bytes(32),
    "shape": _header({"dtype": "F32", "shape": [_SECRET_INT], "data_offsets": [0, 32]}) + bytes(32),
    "range": _header({"dtype": "F32", "shape": [8], "data_offsets": [_SECRET_INT, _SECRET_INT + 32]}) + bytes(32),
    # not JSON: the secret right after a length that fits
    "json": struct.pack("<Q", len(SECRET)) + SECRET,
    # not UTF-8: the decoder's message quotes the byte it stopped at
    "utf8": struct.pack("<Q", len(SECRET) + 1) + b"\xff" + SECRET,
}


@pytest.fixture(scope="module")
def crafted(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("n3")
    folders = {}
    for name, payload in CRAFTED.items():
        folders[name] = _dcp(root / name)
        _point_w_at(folders[name], payload)
    return folders


COMMANDS: dict[str, Callable[[Path, Path], list[str | Path]]] = {
    "inspect": lambda ck, out: ["inspect", ck],
    "consolidate": lambda ck, out: ["consolidate", ck, out / "full.pt", "--nproc", "1"],
    "verify": lambda ck, out: ["verify", ck, ck],
    "reshard": lambda ck, out: ["reshard", ck, out / "ws2", "--world-size", "2", "--nproc", "1"],
}


def _assert_refused(code: int, stdout: str, stderr: str) -> None:
    """Refused in one line naming the data file and FQN; the secret's bytes and numbers appear nowhere."""
    out = stdout + stderr
    for leaked in ("API_KEY", "sk-live", "0123456789abcdef", *SECRET_READINGS):
        assert leaked not in out, (leaked, out)
    assert code in (1, 2, 3), stderr
    lines = [line for line in stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: ") and "Traceback" not in stderr, stderr
    assert "__0_0.distcp" in lines[0] and "model.w" in lines[0], lines[0]


@pytest.mark.parametrize("command", sorted(COMMANDS))
@pytest.mark.parametrize("case", sorted(CRAFTED))
def test_a_chunk_pointed_at_a_secret_prints_none_of_it(
    runner: CliRunner, crafted: dict[str, Path], tmp_path: Path, case: str, command: str
) -> None:
    result = runner.invoke(app, [str(a) for a in COMMANDS[command](crafted[case], tmp_path)])
    _assert_refused(result.exit_code, result.stdout, result.stderr)


def test_inspect_of_the_rows_checkpoint_quotes_no_length(crafted: dict[str, Path]) -> None:
    """The row as filed, a fresh process: before, ``safetensors header length 4420640699264356417 at byte ...``."""
    result = attack(["inspect", crafted["length"]])
    assert result.code is not None and result.seconds < SECONDS_BOUND, result
    _assert_refused(result.code, result.stdout, result.stderr)
    assert "header" in result.error_lines[0], result.error_lines


# --- N13: terminal escapes in names ---

CLEAR, TITLE, CSI8 = "w\x1b[2J", "t\x1b]0;title\x07", "c\x9b31m"  # clear screen, window title, 8-bit CSI
RAW_CONTROLS = ("\x1b", "\x07", "\x9b")


def _escaped_pt(path: Path, value: float) -> Path:
    torch.save({"model": {CLEAR: torch.full((2,), value), TITLE: torch.full((3,), value), CSI8: torch.ones(1)}}, path)
    return path


def _assert_no_raw_controls(stdout: str, stderr: str) -> None:
    for control in RAW_CONTROLS:
        assert control not in stdout + stderr, (control, stdout + stderr)


def test_verify_shows_escaped_names_and_json_keeps_them(runner: CliRunner, tmp_path: Path) -> None:
    """Before: the differences table printed ``model.w\\x1b[2J`` raw (the terminal cleared)."""
    a, b = _escaped_pt(tmp_path / "a.pt", 0.0), _escaped_pt(tmp_path / "b.pt", 1.0)
    result = runner.invoke(app, ["verify", str(a), str(b)])
    assert result.exit_code == 1, result.stderr
    _assert_no_raw_controls(result.stdout, result.stderr)
    assert "model.w\\x1b[2J" in result.stdout and "model.t\\x1b]0;title\\x07" in result.stdout, result.stdout
    result = runner.invoke(app, ["verify", str(a), str(b), "--json"])
    keys = {d["key"] for d in json.loads(result.stdout)["differences"]}
    assert keys == {f"model.{CLEAR}", f"model.{TITLE}"}, keys


def test_error_lines_and_result_lines_escape_names(runner: CliRunner, tmp_path: Path) -> None:
    a = _escaped_pt(tmp_path / "a.pt", 0.0)
    missing = tmp_path / f"gone{CLEAR}.pt"
    result = runner.invoke(app, ["verify", str(missing), str(a)])
    assert result.exit_code == 2 and "gonew\\x1b[2J.pt" in result.stderr, result.stderr
    _assert_no_raw_controls(result.stdout, result.stderr)
    sparse = tmp_path / "sparse.pt"
    torch.save({"model": {TITLE: torch.eye(2).to_sparse()}}, sparse)
    result = runner.invoke(app, ["consolidate", str(sparse), str(tmp_path / "s.pt")])
    assert result.exit_code != 0 and "t\\x1b]0;title\\x07" in result.stderr, result.stderr
    _assert_no_raw_controls(result.stdout, result.stderr)
    result = runner.invoke(app, ["consolidate", str(a), str(tmp_path / f"o{TITLE}.pt"), "--nproc", "1"])
    assert result.exit_code == 0 and "ot\\x1b]0;title\\x07.pt" in result.stdout, result.stderr
    _assert_no_raw_controls(result.stdout, result.stderr)
    # a DCP folder holds printable keys only (issue 37 N12): reshard refuses, naming the key escaped
    result = runner.invoke(app, ["reshard", str(a), str(tmp_path / f"r{CSI8}"), "--world-size", "2", "--nproc", "1"])
    _assert_no_raw_controls(result.stdout, result.stderr)
    assert "\\x1b[2J" in result.stderr or "\\x9b31m" in result.stdout, (result.stdout, result.stderr)
