"""What ``--overwrite`` may replace (issue 37, N6, N7, N14): a regular file, or a folder this tool wrote; nothing else.

Each attack crafts its OUT in ``tmp_path``: a device node, a FIFO or a socket (N7: ``--overwrite``
turned ``/dev/null`` into a regular file); the name of another run's lock, temporary, manifest or
staging folder, and a live run's temporary swapped under it (N6: the live run published the other
run's bytes as its own); a mount point, ``.`` and ``..`` (N14: exit 70 ``EBUSY``, and
``error: , ..old-…``). Each is refused in one line, before any work, and leaves OUT as it was.
The source is a tiny ``torch.save`` file made here, so each command runs in about a second.
"""

from __future__ import annotations

import contextlib
import os
import socket
import stat
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from fsdp_convert.errors import InvalidOptionError, OutputExistsError, OutputWriteError
from fsdp_convert.lock_record import lock_name
from fsdp_convert.writers import atomic_output, check_output
from fsdp_convert.writers._manifest import manifest_dir
from fsdp_convert.writers._staging import STAGING_PREFIX
from fsdp_convert.writers.transaction import temporary_output, temporary_path
from tests.redteam._attack import RSS_BOUND_BYTES, SECONDS_BOUND, Attack, attack

_ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def source(tmp_path: Path) -> Path:
    """A two-tensor ``torch.save`` checkpoint (1.8 KB): what run A converts."""
    path = tmp_path / "src.pt"
    torch.save({"w": torch.arange(6.0).reshape(2, 3), "b": torch.ones(3)}, path)
    return path


def _refused(result: Attack, code: int, *needles: str) -> str:
    """Assert one ``error:`` line with ``code``, naming each of ``needles``, within the issue's bounds."""
    assert result.code == code, result.stderr
    assert len(result.error_lines) == 1 and "Traceback" not in result.stderr, result.stderr
    line = result.error_lines[0]
    for needle in needles:
        assert needle in line, line
    assert "internal error" not in line
    assert result.seconds < SECONDS_BOUND, result.seconds
    assert result.max_rss_bytes < RSS_BOUND_BYTES
    return line


@contextlib.contextmanager
def _special(path: Path, kind: str) -> Iterator[None]:
    """Make a node of ``kind`` at ``path``: a private char device like /dev/null's (1, 3), a FIFO, or a bound socket."""
    if kind == "character device":
        os.mknod(path, stat.S_IFCHR | 0o600, os.makedev(1, 3))
    elif kind == "FIFO":
        os.mkfifo(path)
    else:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
            sock.bind(str(path))
            yield
            return
    yield


_IS_KIND = {"character device": stat.S_ISCHR, "FIFO": stat.S_ISFIFO, "socket": stat.S_ISSOCK}
# mknod of a char device needs root (the tests run as root here and in CI); FIFOs and sockets anyone may make
_NODE_KINDS = [*(["character device"] if os.geteuid() == 0 else []), "FIFO", "socket"]


# --- N7: a device node, FIFO or socket at OUT --------------------------------------------------------------------


@pytest.mark.parametrize("kind", _NODE_KINDS)
@pytest.mark.parametrize("as_folder", [False, True], ids=["file", "folder"])
def test_overwrite_refuses_a_device_fifo_or_socket_at_out(source: Path, tmp_path: Path, kind: str, as_folder: bool) -> None:
    """Before: exit 0, and the node became a regular file (``--format torch``) or a folder (an HF folder OUT)."""
    out = tmp_path / ("node" if as_folder else "node.pt")
    with _special(out, kind):
        before = os.lstat(out)
        extra = ["--force"] if as_folder else ["--format", "torch"]
        result = attack(["consolidate", source, out, "--overwrite", *extra])
        _refused(result, 4, str(out), kind, "name another OUT")
        after = os.lstat(out)
        assert _IS_KIND[kind](after.st_mode) and after.st_ino == before.st_ino and after.st_rdev == before.st_rdev
        assert sorted(p.name for p in tmp_path.iterdir()) == sorted([out.name, source.name])  # no lock, no temporary left


def test_a_device_made_at_out_during_the_run_is_not_replaced(tmp_path: Path) -> None:
    """The check before the final rename: a device that appears at OUT while the run writes is kept, the run refused."""
    out, kind = tmp_path / "full.pt", _NODE_KINDS[0]
    with pytest.raises(OutputExistsError, match=kind):
        with atomic_output(out, overwrite=True) as tmp:
            tmp.write_bytes(b"data")
            if kind == "character device":
                os.mknod(out, stat.S_IFCHR | 0o600, os.makedev(1, 3))
            else:
                os.mkfifo(out)
    assert _IS_KIND[kind](os.lstat(out).st_mode)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["full.pt"]  # the temporary and the lock are gone


# --- N6: another run's lock, temporary, manifest or staging folder at OUT ----------------------------------------


def _run_names(folder: Path) -> dict[str, Path]:
    """Every name a run writing ``folder/full.pt`` or ``folder/out`` gives its own files, from the functions that name them."""
    full, out = folder / "full.pt", folder / "out"
    tmp_file, tmp_dir = temporary_path(full, None, directory=False), temporary_path(out, "rdzv-7", directory=True)
    return {
        "lock": folder / lock_name(full.name),
        "folder lock": folder / lock_name(out.name),
        "temporary": tmp_file,
        "folder temporary": tmp_dir,
        "inside a folder temporary": tmp_dir / "model.safetensors",
        "manifest": manifest_dir(tmp_file),
        "manifest file": manifest_dir(tmp_file) / "manifest.json",
        "folder manifest": manifest_dir(tmp_dir),
        "old folder": folder / ".out.old-0123456789ab",
        "staging folder": folder / f"{STAGING_PREFIX}abc_def_123_xyz",
    }


@pytest.mark.parametrize("what", list(_run_names(Path("x"))))
@pytest.mark.parametrize("resume", [False, True])
def test_out_may_not_name_a_runs_lock_temporary_or_manifest(tmp_path: Path, what: str, resume: bool) -> None:
    """In process, every name (the library's ``check_output``, which the CLI's precheck and the operations call)."""
    out = _run_names(tmp_path)[what]
    with pytest.raises(InvalidOptionError, match="fsdp-convert gives"):
        check_output(out, (tmp_path / "src.pt",), overwrite=True, force=True, free=not resume)


@pytest.mark.parametrize("name", ["full.pt", ".hidden.pt", "out", "model.lock.pt", "tmp-local.pt", "my.tmp"])
def test_ordinary_names_are_not_taken_for_a_runs_own(tmp_path: Path, name: str) -> None:
    check_output(tmp_path / name, (tmp_path / "src.pt",), overwrite=True)


def test_out_may_not_name_a_url_runs_lock_object() -> None:
    with pytest.raises(InvalidOptionError, match="fsdp-convert gives"):
        check_output("s3://bucket/ckpt/.full.pt.lock", ("s3://bucket/src",), overwrite=True)


_GATE_HOOK = '''
"""Test hook: hold the run at its first data write (its lock, temporary and manifest made) until GATE.go exists."""
import os, time
import fsdp_convert.blocks as _blocks
import fsdp_convert.move as _move
_write, _gate = _move.pwrite_all, os.environ["GATE"]
def pwrite_all(fd, data, offset):
    if not os.path.exists(_gate + ".go"):
        open(_gate + ".ready", "w").close()
        while not os.path.exists(_gate + ".go"):
            time.sleep(0.01)
    return _write(fd, data, offset)
_move.pwrite_all = _blocks.pwrite_all = pwrite_all
'''


def test_a_live_runs_temporary_is_neither_replaced_nor_published_once_swapped(source: Path, tmp_path: Path) -> None:
    """Before: run B's ``--overwrite`` replaced run A's temporary (exit 0), and A published B's bytes as its ``full.pt`` (exit 0).

    Now B is refused (exit 2) before it reads anything; and when the temporary is swapped anyway
    (``mv``, an older version), A sees that the name no longer holds the file it created, publishes
    nothing (exit 1, naming the temporary) and leaves the intruder's file as it is.
    """
    hook, folder, gate = tmp_path / "hook", tmp_path / "o", tmp_path / "gate"
    hook.mkdir()
    folder.mkdir()
    (hook / "sitecustomize.py").write_text(_GATE_HOOK)
    out = folder / "full.pt"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "GATE": str(gate), "PYTHONPATH": f"{hook}{os.pathsep}{_ROOT}"}
    argv = [sys.executable, "-m", "fsdp_convert", "consolidate", str(source), str(out), "--nproc", "1"]
    run_a = subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 60
        while not (gate.parent / "gate.ready").exists():
            assert run_a.poll() is None and time.monotonic() < deadline, run_a.communicate()
            time.sleep(0.02)
        tmp = temporary_path(out, None, directory=False)
        assert (manifest_dir(tmp) / "manifest.json").is_file()
        other = tmp_path / "other.pt"
        torch.save({"x": torch.zeros(5)}, other)
        for target in (tmp, folder / lock_name(out.name)):
            before = target.read_bytes()
            result = attack(["consolidate", other, target, "--format", "torch", "--overwrite"])
            _refused(result, 2, str(target), "fsdp-convert gives")
            assert target.read_bytes() == before
        intruder = folder / "intruder"
        intruder.write_bytes(other.read_bytes())
        os.replace(intruder, tmp)  # what B did, by hand
        (gate.parent / "gate.go").touch()
        _, stderr = run_a.communicate(timeout=60)
    finally:
        (gate.parent / "gate.go").touch()
        if run_a.poll() is None:
            run_a.kill()
            run_a.wait()
    assert run_a.returncode == 1, stderr
    lines = [line for line in stderr.splitlines() if line.startswith("error:")]
    assert len(lines) == 1 and str(tmp) in lines[0] and "replaced" in lines[0], stderr
    assert not out.exists()
    assert tmp.read_bytes() == other.read_bytes()  # not this run's to remove


@pytest.mark.parametrize("directory", [False, True], ids=["file", "folder"])
def test_a_temporary_swapped_in_process_is_not_published(tmp_path: Path, directory: bool) -> None:
    """The identity check alone: the name the run renames must still be the file (or folder) it created and holds open."""
    out = tmp_path / ("out" if directory else "full.pt")
    with pytest.raises(OutputWriteError, match="replaced by another process"):
        with atomic_output(out, overwrite=False, directory=directory) as tmp:
            swap = tmp_path / "swap"
            if directory:
                swap.mkdir()
                (swap / "model.safetensors").write_bytes(b"theirs")
                tmp.rmdir()
            else:
                swap.write_bytes(b"theirs")
            os.replace(swap, tmp)
    assert not out.exists()
    assert tmp.exists()  # the intruder's, left alone
    assert not (tmp_path / lock_name(out.name)).exists()


def test_the_manifest_of_a_replaced_temporary_is_removed(tmp_path: Path) -> None:
    """No later --resume takes the other process's file for this run's: the manifest describing it goes too."""
    out = tmp_path / "full.pt"
    with pytest.raises(OutputWriteError, match="replaced by another process"):
        with temporary_output(out, overwrite=False, directory=False, tag=None, fingerprint=None, resume=False) as (tmp, _):
            manifest_dir(tmp).mkdir()
            (manifest_dir(tmp) / "manifest.json").write_text("{}")
            (tmp_path / "swap").write_bytes(b"theirs")
            os.replace(tmp_path / "swap", tmp)
    assert sorted(p.name for p in tmp_path.iterdir()) == [tmp.name]


# --- N14: a mount point, `.` or `..` at OUT ----------------------------------------------------------------------


def _mount(args: list[str]) -> bool:
    """``mount ARGS``; False where this machine does not let the tests mount (not root, no CAP_SYS_ADMIN)."""
    return subprocess.run(["mount", *args], capture_output=True, text=True).returncode == 0


@pytest.mark.parametrize("kind", ["tmpfs", "bind"])
def test_overwrite_force_refuses_a_mount_point(source: Path, tmp_path: Path, kind: str) -> None:
    """Before: exit 70, ``internal error: OSError: [Errno 16] Device or resource busy``. Now one line, exit 4.

    A mount of the test's own (tmpfs, or a bind mount: same device as its folder) where the machine allows it; else the
    check itself on a mount point the machine already has (``/proc``), which nothing then writes to.
    """
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    real = tmp_path / "real"
    real.mkdir()
    if not _mount(["-t", "tmpfs", "none", str(mnt)] if kind == "tmpfs" else ["--bind", str(real), str(mnt)]):
        assert os.path.ismount("/proc")
        with pytest.raises(OutputExistsError, match="is a mount point"):
            check_output(Path("/proc"), [source], overwrite=True, force=True, directory=True)
        return
    try:
        (mnt / "model.safetensors").write_bytes(b"kept")
        result = attack(["consolidate", source, mnt, "--overwrite", "--force"])
        _refused(result, 4, str(mnt), "is a mount point")
        assert (mnt / "model.safetensors").read_bytes() == b"kept"
        assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".")) == []
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)


@pytest.mark.parametrize("spelling", [".", "..", "sub/.."])
@pytest.mark.parametrize("force", [False, True])
def test_out_spelled_dot_or_dotdot_is_refused_naming_it(source: Path, tmp_path: Path, spelling: str, force: bool) -> None:
    """Before: ``error: , ..old-…: No such file or directory`` (exit 1). Now a usage error naming OUT as given."""
    cwd = tmp_path / "a" / "here"  # so that .. does not hold the source
    (cwd / "sub").mkdir(parents=True)
    (cwd / "model.safetensors").write_bytes(b"kept")
    result = attack(["consolidate", source, spelling, "--overwrite", *(["--force"] if force else [])], cwd=cwd)
    line = _refused(result, 2, "name the folder by its own name")
    assert line.startswith(f"error: {spelling} ") or line.startswith(f"error: {Path(spelling)} "), line
    assert (cwd / "model.safetensors").read_bytes() == b"kept"
    assert sorted(p.name for p in cwd.iterdir()) == ["model.safetensors", "sub"]
