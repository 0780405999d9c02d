"""Red team, workers (issue 37): no code from the current folder in workers (N1) or via ``--adapter`` (F14); stalls named.

N1: ``cd CKPT && fsdp-convert consolidate . ../out.pt --nproc 2`` with a ``rich.py`` in ``CKPT``:
the forkserver (a ``python -c``, the current folder first on its ``sys.path``) and the workers
(the parent's ``sys.path``) imported it. F14: ``--adapter module:function`` left the current
folder on ``sys.path``, so a module not installed was then imported from there. And a worker
stopped with SIGSTOP stalled the run without a word.
"""

from __future__ import annotations

import contextlib
import importlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.redteam._attack import attack

ROOT = Path(__file__).resolve().parents[2]
# a module that leaves a mark (its name and importer's pid) in folder MARKS when imported, then fails to import
PLANTED = "import os, pathlib\npathlib.Path({marks!r}, __name__ + '-' + str(os.getpid())).touch()\nraise ImportError('planted')\n"
PLANTED_NAMES = ("rich", "typer", "transformers", "safetensors", "click")
# runs the CLI as the fsdp-convert console script does (its folder first on sys.path, not the current one);
# attack() passes "-m fsdp_convert" before the arguments
CONSOLE_SCRIPT = (
    "import sys\nfrom fsdp_convert.cli import main\nif __name__ == '__main__':\n    del sys.argv[1:3]\n    sys.exit(main())\n"
)
START_BOUND_S = 15.0  # two workers and their forkserver start on a shared 2-core machine


def _plant(folder: Path, marks: Path) -> None:
    """``rich.py``, ``typer.py``... and a package ``fsdp_convert/`` in ``folder``, each marking ``marks`` when imported."""
    for name in PLANTED_NAMES:
        (folder / f"{name}.py").write_text(PLANTED.format(marks=str(marks)))
    (folder / "fsdp_convert").mkdir()
    (folder / "fsdp_convert" / "__init__.py").write_text(PLANTED.format(marks=str(marks)))


@pytest.fixture
def planted(tmp_path: Path) -> tuple[Path, Path]:
    """A small DCP checkpoint (two tensors) holding planted modules, and the (empty) folder of their marks."""
    import torch
    import torch.distributed.checkpoint as dcp

    ckpt, marks = tmp_path / "ckpt", tmp_path / "marks"
    marks.mkdir()
    with pytest.warns(UserWarning, match="single process"):
        dcp.save({"model": {"w": torch.arange(12.0).reshape(3, 4), "b": torch.ones(5)}}, checkpoint_id=ckpt, no_dist=True)
    _plant(ckpt, marks)
    return ckpt, marks


def test_a_console_script_run_in_the_checkpoint_folder_imports_nothing_from_it(planted: tuple[Path, Path]) -> None:
    """N1: the parent (the script's folder first on sys.path), the forkserver and both workers import no planted module."""
    ckpt, marks = planted
    script = ckpt.parent / "bin" / "fsdp_convert_script.py"
    script.parent.mkdir()
    script.write_text(CONSOLE_SCRIPT)
    run = attack(["consolidate", ".", "../out.pt", "--nproc", "2"], cwd=ckpt, python_args=[str(script)])
    assert run.code == 0, run.stderr
    assert sorted(p.name for p in marks.iterdir()) == []
    assert (ckpt.parent / "out.pt").is_file() and run.seconds < START_BOUND_S


def test_the_installed_fsdp_convert_script_in_the_checkpoint_folder_imports_nothing_from_it(planted: tuple[Path, Path]) -> None:
    """N1 through the real ``fsdp-convert`` console script of this environment (scripts/setup.sh installs it)."""
    script = Path(sys.executable).with_name("fsdp-convert")
    assert script.is_file(), f"no console script at {script}: install the package (scripts/setup.sh)"
    ckpt, marks = planted
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    done = subprocess.run(
        [str(script), "consolidate", ".", "../out.pt", "--nproc", "2"],
        cwd=ckpt,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    assert sorted(p.name for p in marks.iterdir()) == []


# --- F14: --adapter module:function -------------------------------------------------------------------------------

ADAPTER = """
from fsdp_convert.derive import Derived, Input


def probe_and_flip(parts):
    # a combine function, run by the workers: what it imports must not come from the current folder
    try:
        import not_installed_probe_mod  # noqa: F401
    except ImportError:
        pass
    return parts[0].flip(0)


def flip_all(tensors, config):
    flip = dict(combine=probe_and_flip)
    return {t.fqn: Derived(inputs=(Input(fqn=t.fqn, rows=None),), shape=t.shape, dtype=t.dtype, **flip) for t in tensors}
"""


@pytest.fixture
def adapter_folder(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[Path, Path]]:
    """The current folder: the user's adapter ``redteam_adapter_mod.py`` and a planted ``not_installed_probe_mod.py``."""
    marks = tmp_path / "marks"
    marks.mkdir()
    folder = tmp_path / "work"
    folder.mkdir()
    (folder / "redteam_adapter_mod.py").write_text(ADAPTER)
    (folder / "not_installed_probe_mod.py").write_text(PLANTED.format(marks=str(marks)))
    monkeypatch.chdir(folder)
    monkeypatch.setattr(sys, "path", list(sys.path))
    names = ("redteam_adapter_mod", "not_installed_probe_mod")
    for name in names:
        monkeypatch.delitem(sys.modules, name, raising=False)
    yield folder, marks
    for name in names:
        sys.modules.pop(name, None)


def test_an_adapter_from_the_current_folder_leaves_no_other_module_importable_from_it(adapter_folder: tuple[Path, Path]) -> None:
    """F14: after ``--adapter redteam_adapter_mod:flip_all``, a module not installed is not imported from the current folder."""
    from fsdp_convert.adapters.user import load_user_function

    folder, marks = adapter_folder
    assert load_user_function("redteam_adapter_mod:flip_all").__module__ == "redteam_adapter_mod"
    with pytest.raises(ModuleNotFoundError):
        importlib.import_module("not_installed_probe_mod")
    assert sorted(p.name for p in marks.iterdir()) == []
    assert str(folder) not in sys.path


def test_the_workers_import_the_users_adapter_from_its_file_and_nothing_else_from_its_folder(
    adapter_folder: tuple[Path, Path], tmp_path: Path
) -> None:
    """F14 and N1 in the workers: ``python -m fsdp_convert ... --adapter mod:fn --nproc 2`` from the adapter's folder.

    Each worker imports the user's module (its combine function runs there) and nothing else from the folder.
    """
    import torch
    import torch.distributed.checkpoint as dcp
    from safetensors.torch import load_file

    folder, marks = adapter_folder
    tensors = {"w": torch.arange(12.0).reshape(3, 4), "b": torch.arange(5.0)}
    with pytest.warns(UserWarning, match="single process"):
        dcp.save(dict(tensors), checkpoint_id=folder / "ck", no_dist=True)
    args = ["consolidate", "ck", "out.safetensors", "--nproc", "2", "--adapter", "redteam_adapter_mod:flip_all"]
    run = attack(args, cwd=folder)
    assert run.code == 0, run.stderr
    got = load_file(folder / "out.safetensors")
    assert sorted(got) == ["b", "w"] and all(torch.equal(got[k], t.flip(0)) for k, t in tensors.items())
    assert sorted(p.name for p in marks.iterdir()) == [] and run.seconds < START_BOUND_S


# --- a stalled worker -----------------------------------------------------------------------------------------------

STALLED = r"""
import sys
sys.modules["torch"] = None
from fsdp_convert import launch
from tests.redteam import test_workers as t
print(sorted(launch.run_workers(t.waits_for_go, sys.argv[1], 2).items()))
"""


def waits_for_go(job: Any, rank: int, world_size: int, group: Any) -> int:
    """A local job: write this worker's pid into folder ``job``, then wait (polling) for the file ``go`` there."""
    Path(job, f"{rank}.tmp").write_text(str(os.getpid()))
    Path(job, f"{rank}.tmp").rename(Path(job, f"{rank}.pid"))
    deadline = time.monotonic() + 60
    while not Path(job, "go").exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    return rank


def test_a_stopped_worker_is_named_once_by_rank_and_pid_and_the_run_goes_on(tmp_path: Path) -> None:
    """A SIGSTOPped worker is reported after FSDP_CONVERT_STALL_SECONDS (1 s here) in one line; continued, the run ends well."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "FSDP_CONVERT_STALL_SECONDS": "1"}
    stderr_path = tmp_path / "stderr"
    with stderr_path.open("w") as stderr:
        proc = subprocess.Popen(
            [sys.executable, "-c", STALLED, str(tmp_path)], cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=stderr, text=True
        )
    pid = 0
    try:
        deadline = time.monotonic() + 30
        while not (tmp_path / "1.pid").exists():
            assert proc.poll() is None and time.monotonic() < deadline, stderr_path.read_text()
            time.sleep(0.01)
        pid = int((tmp_path / "1.pid").read_text())
        os.kill(pid, signal.SIGSTOP)
        stopped = time.monotonic()
        while f"pid {pid}" not in stderr_path.read_text():
            assert proc.poll() is None and time.monotonic() - stopped < 10, stderr_path.read_text()
            time.sleep(0.05)
        reported_after = time.monotonic() - stopped
        time.sleep(1.5)  # still stopped: not reported again
        (tmp_path / "go").touch()
        os.kill(pid, signal.SIGCONT)
        stdout, _ = proc.communicate(timeout=30)
    finally:
        if pid:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    lines = stderr_path.read_text().splitlines()
    assert proc.returncode == 0 and stdout.strip() == "[(0, 0), (1, 1)]", lines
    assert len(lines) == 1 and f"worker rank 1 (pid {pid}) is stopped" in lines[0], lines  # once, and not its waiting peer
    assert 0.9 < reported_after < 5


def test_a_library_caller_run_as_python_m_keeps_its_own_package_for_the_workers(tmp_path: Path) -> None:
    """N1's fix leaves the user's own code importable: ``python -m mytools.run`` from its project folder runs its
    module-level job in 2 local workers (was: ModuleNotFoundError in the workers once the current folder was dropped)."""
    project = tmp_path / "proj"
    (project / "mytools").mkdir(parents=True)
    (project / "mytools" / "__init__.py").write_text("")
    (project / "mytools" / "jobs.py").write_text("def fn(job, rank, nproc, group):\n    return rank * 10\n")
    (project / "mytools" / "run.py").write_text(
        "import mytools.jobs\n"
        "from fsdp_convert._local_workers import run_local\n"
        "from fsdp_convert.launch import start_worker_server\n"
        "if __name__ == '__main__':\n"
        "    start_worker_server()\n"
        "    print(sorted(run_local(mytools.jobs.fn, None, 2).items()))\n"
    )
    root = str(Path(__file__).resolve().parents[2])
    env = {**os.environ, "PYTHONPATH": root, "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, "-m", "mytools.run"], cwd=project, env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[(0, 0), (1, 10)]"
