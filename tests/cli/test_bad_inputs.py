"""Every kind of bad input: one line naming the file or FQN, the documented exit code, nothing at OUT."""

from __future__ import annotations

import multiprocessing as mp
import os
import pickle
import shutil
import subprocess
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from fsdp_convert.cli import app
from fsdp_convert.formats import read_index
from fsdp_convert.formats.dcp import load_metadata
from fsdp_convert.zip_records import read_records
from tests._samples import Sample

Case = Callable[[Path, Path], tuple[list[str], int, list[str]]]  # (ck, tmp) -> (extra args, exit code, needles)


class Evil:
    """Pickles to a call of os.system; loading it would create ``marker``."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[object, ...]:
        return (os.system, (f"touch {self.marker}",))


def _rewrite_metadata(ck: Path, mutate: Callable[[object], None]) -> None:
    meta = load_metadata(ck / ".metadata")  # our own fresh copy, read through the safe unpickler
    mutate(meta)
    (ck / ".metadata").write_bytes(pickle.dumps(meta))


def _tensor_chunk(ck: Path, fqn: str = "model.layers.1.mlp.0.weight", file: str = "__1_0.distcp"):  # type: ignore[no-untyped-def]
    entry = next(e for e in read_index(ck).tensors() if e.fqn == fqn)
    return entry, next(c for c in entry.chunks if c.relative_path == file)


def _missing_metadata(ck: Path, tmp: Path) -> tuple[list[str], int, list[str]]:
    (ck / ".metadata").unlink()
    return [], 3, [str(ck), "no .metadata"]


def _missing_data_file(ck: Path, tmp: Path) -> tuple[list[str], int, list[str]]:
    (ck / "__1_0.distcp").unlink()
    return [], 3, [str(ck / "__1_0.distcp"), "missing"]


def _truncated_data_file(ck: Path, tmp: Path) -> tuple[list[str], int, list[str]]:
    path = ck / "__1_0.distcp"
    os.truncate(path, path.stat().st_size // 2)
    return [], 1, [str(path), "truncated", "past the end"]


def _broken_zip(ck: Path, tmp: Path) -> tuple[list[str], int, list[str]]:
    entry, chunk = _tensor_chunk(ck)
    with open(ck / "__1_0.distcp", "r+b") as f:  # the payload's end-of-central-directory record
        f.seek(chunk.offset_bytes + chunk.length_bytes - 22)
        f.write(b"\0" * 22)
    return [], 1, [str(ck / "__1_0.distcp"), f"[{chunk.offset_bytes}, ", entry.fqn, "not a torch.save zip"]


def _zeros_in_tensor_data(ck: Path, tmp: Path) -> tuple[list[str], int, list[str]]:
    entry, chunk = _tensor_chunk(ck)
    with open(ck / "__1_0.distcp", "r+b") as f:
        fd = f.fileno()
        records = read_records(lambda n, off: os.pread(fd, n, chunk.offset_bytes + off), chunk.length_bytes)
        data = next(r for r in records if r.short_name == "data/0")
        f.seek(chunk.offset_bytes + data.data_offset + data.size // 3)
        f.write(b"\0" * min(4096, data.size // 3))  # torch's own loader returns wrong values here, exit 0
    return [], 1, [str(ck / "__1_0.distcp"), entry.fqn, "CRC-32 mismatch"]


def _zeros_mid_file(ck: Path, tmp: Path) -> tuple[list[str], int, list[str]]:
    path = ck / "__1_0.distcp"
    with open(path, "r+b") as f:
        f.seek(path.stat().st_size // 2)
        f.write(b"\0" * 4096)
    return [], 1, [str(path)]


def _gap(ck: Path, tmp: Path) -> tuple[list[str], int, list[str]]:
    def drop_chunk(meta: object) -> None:
        meta.state_dict_metadata["model.output.weight"].chunks.pop()  # type: ignore[attr-defined]

    _rewrite_metadata(ck, drop_chunk)
    return [], 1, ["model.output.weight", "gap"]


def _overlap(ck: Path, tmp: Path) -> tuple[list[str], int, list[str]]:
    def shift_chunk(meta: object) -> None:
        from torch.distributed.checkpoint.metadata import MetadataIndex

        chunk = meta.state_dict_metadata["model.output.weight"].chunks[1]  # type: ignore[attr-defined]
        info = meta.storage_data.pop(MetadataIndex("model.output.weight", chunk.offsets))  # type: ignore[attr-defined]
        chunk.offsets = torch.Size([chunk.offsets[0] - 1, 0])
        meta.storage_data[MetadataIndex("model.output.weight", chunk.offsets)] = info  # type: ignore[attr-defined]

    _rewrite_metadata(ck, shift_chunk)
    return [], 1, ["model.output.weight", "overlap"]


def _dtype_mismatch(ck: Path, tmp: Path) -> tuple[list[str], int, list[str]]:
    def to_fp16(meta: object) -> None:
        meta.state_dict_metadata["model.norm.weight"].properties.dtype = torch.float16  # type: ignore[attr-defined]

    _rewrite_metadata(ck, to_fp16)
    return [], 1, ["model.norm.weight", "torch.float32", "torch.float16"]


def _unknown_transform(ck: Path, tmp: Path) -> tuple[list[str], int, list[str]]:
    def zstd(meta: object) -> None:
        for key, info in meta.storage_data.items():  # type: ignore[attr-defined]
            if key.fqn == "model.norm.bias":
                info.transform_descriptors = ["zstd"]

    _rewrite_metadata(ck, zstd)
    return [], 1, ["model.norm.bias", "stream transform", "zstd"]


def _unsafe_metadata(ck: Path, tmp: Path) -> tuple[list[str], int, list[str]]:
    def plant(meta: object) -> None:
        meta.planner_data["model.norm.bias"] = Evil(tmp / "pwned")  # type: ignore[attr-defined]

    _rewrite_metadata(ck, plant)
    return [], 1, [str(ck / ".metadata"), "refusing global", "system"]


def _unsafe_payload(ck: Path, tmp: Path) -> tuple[list[str], int, list[str]]:
    path = ck / "__0_0.distcp"
    offset = path.stat().st_size
    with open(path, "ab") as f:
        torch.save(Evil(tmp / "pwned"), f)
    length = path.stat().st_size - offset

    def point_at_it(meta: object) -> None:
        for key, info in meta.storage_data.items():  # type: ignore[attr-defined]
            if key.fqn == "train_state.step":
                info.relative_path, info.offset, info.length = "__0_0.distcp", offset, length

    _rewrite_metadata(ck, point_at_it)
    return [], 1, [str(path), "train_state.step", "would run code"]


def _existing_output(ck: Path, tmp: Path) -> tuple[list[str], int, list[str]]:
    (tmp / "out.pt").write_bytes(b"precious")
    return [], 4, [str(tmp / "out.pt"), "--overwrite"]


CASES: dict[str, Case] = {
    "missing .metadata": _missing_metadata,
    "missing .distcp": _missing_data_file,
    "truncated .distcp": _truncated_data_file,
    "broken payload zip": _broken_zip,
    "zeros inside tensor data (CRC)": _zeros_in_tensor_data,
    "4 KiB of zeros mid-file": _zeros_mid_file,
    "chunks leave a gap": _gap,
    "chunks overlap": _overlap,
    "payload dtype != metadata": _dtype_mismatch,
    "unknown stream transform": _unknown_transform,
    ".metadata would run code": _unsafe_metadata,
    "payload would run code": _unsafe_payload,
    "output exists": _existing_output,
}


def _assert_failed_cleanly(result, code: int, needles: list[str], tmp: Path, out: Path) -> None:  # type: ignore[no-untyped-def]
    assert result.exit_code == code, (result.exit_code, result.stdout, result.stderr)
    assert result.stdout == ""
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and "Traceback" not in result.stderr, result.stderr
    for needle in needles:
        assert needle in lines[0], (needle, lines[0])
    if code != 4:
        assert not out.exists()
    assert not [p for p in out.parent.iterdir() if ".tmp-" in p.name]  # no temporary left behind
    assert not (tmp / "pwned").exists()  # no payload ran


@pytest.mark.parametrize("case", sorted(CASES))
def test_bad_input_fails_cleanly(case: str, runner: CliRunner, ws3_ckpt: Sample, tmp_path: Path) -> None:
    ck = tmp_path / "ck"
    shutil.copytree(ws3_ckpt.checkpoint, ck)
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    out = out_dir / "out.pt"
    extra, code, needles = CASES[case](ck, out_dir)
    result = runner.invoke(app, ["consolidate", str(ck), str(out), *extra])
    _assert_failed_cleanly(result, code, needles, out_dir, out)


def test_zeros_in_tensor_data_pass_silently_without_crc(runner: CliRunner, ws3_ckpt: Sample, tmp_path: Path) -> None:
    """The corruption CRC checking catches is invisible to torch.load: --no-crc gives wrong values."""
    ck = tmp_path / "ck"
    shutil.copytree(ws3_ckpt.checkpoint, ck)
    _zeros_in_tensor_data(ck, tmp_path)
    out = tmp_path / "out.pt"
    result = runner.invoke(app, ["consolidate", str(ck), str(out), "--no-crc"])
    assert result.exit_code == 0, result.stderr
    got = torch.load(out, weights_only=True)["model"]["layers.1.mlp.0.weight"]
    assert not torch.equal(got, ws3_ckpt.truth()["model"]["layers.1.mlp.0.weight"])


def test_verify_refuses_a_pt_that_would_run_code(runner: CliRunner, ws3_ckpt: Sample, tmp_path: Path) -> None:
    bad = tmp_path / "bad.pt"
    torch.save({"model": {"w": torch.zeros(2)}, "x": Evil(tmp_path / "pwned")}, bad)
    result = runner.invoke(app, ["verify", str(ws3_ckpt.checkpoint), str(bad)])
    assert result.exit_code == 2  # verify: 1 is "different", 2 any trouble (as cmp and diff)
    assert result.stderr.startswith("error: ") and "would run code" in result.stderr and str(bad) in result.stderr
    assert not (tmp_path / "pwned").exists()


def _cli_in_child(args: list[str], setup: Callable[[], None]) -> tuple[int, str, str]:
    """Run the CLI in a forked child after ``setup`` (drop privileges, set an rlimit)."""
    parent, child = mp.get_context("fork").Pipe()

    def run() -> None:
        setup()
        result = CliRunner().invoke(app, args)
        child.send((result.exit_code, result.stdout, result.stderr))

    proc = mp.get_context("fork").Process(target=run)
    proc.start()
    proc.join(120)
    if proc.is_alive():
        proc.kill()
        raise AssertionError("CLI child hung")
    assert parent.poll(1), f"CLI child died with exit code {proc.exitcode} before reporting"
    return parent.recv()  # type: ignore[no-any-return]


class _Result:
    def __init__(self, exit_code: int, stdout: str, stderr: str) -> None:
        self.exit_code, self.stdout, self.stderr = exit_code, stdout, stderr


@pytest.fixture
def shared_dir() -> Iterator[Path]:
    """A folder outside pytest's private tmp, readable by an unprivileged user."""
    path = Path(tempfile.mkdtemp(prefix="fsdp-convert-test-"))
    path.chmod(0o755)
    yield path
    shutil.rmtree(path, ignore_errors=True)


def _as_unprivileged() -> None:
    if os.geteuid() == 0:  # root ignores permission bits: become nobody (65534) first
        os.setgroups([])
        os.setgid(65534)
        os.setuid(65534)


def _copy_readable(sample: Sample, dst: Path) -> Path:
    shutil.copytree(sample.checkpoint, dst)
    for p in [dst, *dst.iterdir()]:
        p.chmod(0o755 if p.is_dir() else 0o644)
    return dst


def test_permission_denied_on_output_folder(ws3_ckpt: Sample, shared_dir: Path) -> None:
    ck = _copy_readable(ws3_ckpt, shared_dir / "ck")
    locked = shared_dir / "locked"
    locked.mkdir(mode=0o555)
    out = locked / "out.pt"
    code, stdout, stderr = _cli_in_child(["consolidate", str(ck), str(out)], _as_unprivileged)
    _assert_failed_cleanly(_Result(code, stdout, stderr), 1, [str(locked), "Permission denied"], shared_dir, out)


def test_unreadable_data_file(ws3_ckpt: Sample, shared_dir: Path) -> None:
    ck = _copy_readable(ws3_ckpt, shared_dir / "ck")
    (ck / "__2_0.distcp").chmod(0o000)
    out = shared_dir / "out.pt"
    code, stdout, stderr = _cli_in_child(["consolidate", str(ck), str(out)], _as_unprivileged)
    _assert_failed_cleanly(_Result(code, stdout, stderr), 3, [str(ck / "__2_0.distcp"), "not readable"], shared_dir, out)


@pytest.fixture
def tiny_filesystem(tmp_path: Path) -> Iterator[tuple[Path, Callable[[], None]]]:
    """A 64 KiB tmpfs when we may mount one (root); else a 64 KiB file-size rlimit for the child."""
    mount = tmp_path / "tiny"
    mount.mkdir()
    mounted = (
        os.geteuid() == 0
        and subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(mount)], capture_output=True).returncode == 0
    )

    def limit_file_size() -> None:
        if not mounted:
            import resource
            import signal

            signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # get EFBIG instead of being killed
            resource.setrlimit(resource.RLIMIT_FSIZE, (64 * 1024, 64 * 1024))

    try:
        yield mount, limit_file_size
    finally:
        if mounted:
            subprocess.run(["umount", str(mount)], check=True)


def test_no_space_left_on_output_device(ws3_ckpt: Sample, tiny_filesystem: tuple[Path, Callable[[], None]]) -> None:
    folder, setup = tiny_filesystem
    out = folder / "out.pt"
    code, stdout, stderr = _cli_in_child(["consolidate", str(ws3_ckpt.checkpoint), str(out)], setup)
    reason = "No space left on device" if os.path.ismount(folder) else "File too large"
    _assert_failed_cleanly(_Result(code, stdout, stderr), 1, [str(out), reason], folder, out)
