"""Where workers import from: the parent's ``sys.path`` less the current folder, and the user's modules by file.

Python puts the current folder first on ``sys.path`` for ``python -m`` and ``python -c`` (the
forkserver local workers are forked from is a ``python -c``), and ``multiprocessing`` hands the
parent's ``sys.path`` to every worker. Run from a checkpoint folder (``cd CKPT && fsdp-convert
... --nproc 2``), a ``rich.py`` or ``typer.py`` there would then run in the workers. So workers
start with ``worker_sys_path()``: no folder the user did not install from (``clean_sys_path``
while they start), and the one module the user named from a folder (``--adapter module:function``)
is imported from its file (``import_file_module``) and again from that file in each worker
(``file_modules``, ``import_file_modules``), never by putting its folder on ``sys.path``. Nor do
workers run the user's main script again unless their job names something of it
(``dumps_naming_main``, ``main_not_run_again``).
"""

from __future__ import annotations

import importlib.util
import io
import os
import pickle
import sys
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from multiprocessing import process
from pathlib import Path
from types import FunctionType, ModuleType
from typing import Any

__all__ = [
    "worker_sys_path",
    "clean_sys_path",
    "import_file_module",
    "file_modules",
    "import_file_modules",
    "dumps_naming_main",
    "main_not_run_again",
]

# the folder this package was imported from (site-packages, or an editable checkout): installed, so kept
_PACKAGE_HOME = os.path.realpath(Path(__file__).parents[1])
# name -> (file, is a package, the module object): the modules import_file_module loaded, for the workers
_FILE_MODULES: dict[str, tuple[str, bool, ModuleType]] = {}


def _main_script_dir() -> str | None:
    """The folder the user's own main code was imported from, if any.

    A script's (``python train.py``, the ``fsdp-convert`` console script), or the folder holding
    the top package of ``python -m tools.run``: the user chose that code, and its workers import it.
    """
    main = sys.modules.get("__main__")
    if main is None or not getattr(main, "__file__", None):
        return None  # python -c, an interactive session: their first entry is the current folder, not a script's
    file = Path(os.path.abspath(str(main.__file__)))
    spec = getattr(main, "__spec__", None)
    depth = len(spec.name.split(".")) if spec is not None and spec.name else 1  # tools.run: tools/run.py, two up
    return os.path.realpath(file.parents[depth - 1])


def worker_sys_path() -> list[str]:
    """``sys.path`` less every entry that is the current folder (``''``, ``.``, its path, or the folder Python started in).

    Such an entry stays where it holds this package (an editable checkout run from its root) or
    the script the user ran (``python train.py`` from its folder): the user chose that code.
    """
    cwd = os.getcwd()
    started_in = getattr(process, "ORIGINAL_DIR", None) or cwd  # multiprocessing's record of it (not in its stubs)
    here = {os.path.realpath(cwd), os.path.realpath(started_in)}
    keep = {_PACKAGE_HOME, _main_script_dir()}
    out = []
    for entry in sys.path:
        real = os.path.realpath(os.path.join(cwd, entry)) if isinstance(entry, str) else None
        if real is None or real not in here or real in keep:
            out.append(entry)
    return out


@contextmanager
def clean_sys_path() -> Iterator[None]:
    """While workers (or their forkserver) start, or a user's module is looked up: ``sys.path`` is ``worker_sys_path()``.

    ``multiprocessing`` sends each new worker (and, from Python 3.12, the forkserver) this
    process's ``sys.path``. The forkserver is a ``python -c``, whose own first entry is its
    current folder: ``PYTHONSAFEPATH=1`` (Python 3.11+) leaves that out. Both restored after.
    """
    saved_path = list(sys.path)
    saved_safe = os.environ.get("PYTHONSAFEPATH")
    sys.path[:] = worker_sys_path()
    os.environ["PYTHONSAFEPATH"] = "1"
    try:
        yield
    finally:
        sys.path[:] = saved_path
        if saved_safe is None:
            os.environ.pop("PYTHONSAFEPATH", None)
        else:
            os.environ["PYTHONSAFEPATH"] = saved_safe


def import_file_module(name: str, file: Path, *, package: bool = False) -> ModuleType:
    """Import module ``name`` from ``file`` (a package's ``__init__.py`` with ``package``), its folder kept off ``sys.path``.

    A package's submodules import from its folder (its ``__path__``); nothing else does. The
    workers of a later launch import it from the same file (``file_modules``).

    Raises:
        ImportError: ``file`` is not a Python source; and whatever the module raises.
    """
    spec = importlib.util.spec_from_file_location(name, file, submodule_search_locations=[str(file.parent)] if package else None)
    if spec is None or spec.loader is None:
        raise ImportError(f"{file} is not a Python source file", name=name)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        sys.modules.pop(name, None)
        raise
    _FILE_MODULES[name] = (str(file), package, module)
    return module


def file_modules() -> dict[str, tuple[str, bool]]:
    """The modules ``import_file_module`` loaded that this process still holds: name -> (file, is a package)."""
    return {name: (file, package) for name, (file, package, module) in _FILE_MODULES.items() if sys.modules.get(name) is module}


def import_file_modules(modules: Mapping[str, tuple[str, bool]]) -> None:
    """In a worker, before its job is unpickled: import each of the parent's ``file_modules()`` from its file."""
    for name, (file, package) in modules.items():
        if name not in sys.modules:
            import_file_module(name, Path(file), package=package)


_MAIN_MODULES = ("__main__", "__mp_main__")  # the user's main module, and its name where multiprocessing runs it again


class _MainSpotter(pickle.Pickler):
    """``pickle.Pickler``, noting the classes and functions it pickles by name from the user's main module."""

    def __init__(self, file: Any) -> None:
        super().__init__(file)
        self.main_names: list[str] = []

    def reducer_override(self, obj: Any) -> Any:
        if isinstance(obj, (type, FunctionType)) and obj.__module__ in _MAIN_MODULES:
            self.main_names.append(obj.__qualname__)
        return NotImplemented  # pickled as pickle.Pickler does


def dumps_naming_main(obj: Any) -> tuple[bytes, list[str]]:
    """``pickle.dumps(obj)``, and the classes and functions of the user's main module it names (a worker finds them only there).

    Raises:
        pickle.PicklingError: and whatever else ``pickle.dumps`` raises.
    """
    buf = io.BytesIO()
    spotter = _MainSpotter(buf)
    spotter.dump(obj)
    return buf.getvalue(), spotter.main_names


@contextmanager
def main_not_run_again(needed: bool) -> Iterator[None]:
    """While workers start: unless ``needed``, they do not run the user's main script (or ``python -m`` module) again.

    ``multiprocessing`` has each new worker run the parent's main module again, as ``__mp_main__``,
    for what its job pickled by name from there: a script's top level that is not under
    ``if __name__ == "__main__":`` then runs in every worker. A job that names nothing of it
    (``dumps_naming_main``) needs none of it: while its workers start, ``sys.modules["__main__"]``
    is a stand-in with no file, so what they are sent names no main module. Restored after.
    """
    main = sys.modules.get("__main__")
    if needed or main is None:
        yield
        return
    sys.modules["__main__"] = ModuleType("__main__")
    try:
        yield
    finally:
        sys.modules["__main__"] = main
