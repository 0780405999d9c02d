"""The user's own adapter, ``--adapter module:function``: the one place this tool imports code it was not shipped with.

The function is called once, in the planning process, before any tensor is read::

    from fsdp_convert.derive import ALIGNED, Derived, HeadPermute, Input, TensorInfo

    def to_mine(tensors: Sequence[TensorInfo], config: Mapping[str, Any]) -> dict[str, Derived]:
        out = {}
        for t in tensors:  # every model tensor: fqn (wrapper names removed), dtype, shape
            if t.fqn.endswith("wq.weight"):
                rows = HeadPermute(config["num_attention_heads"], t.shape[0] // config["num_attention_heads"])
                out[t.fqn.replace("wq", "q_proj")] = Derived(inputs=(Input(fqn=t.fqn, rows=rows),), shape=t.shape, dtype=t.dtype)
            else:
                out[t.fqn] = Derived(inputs=(Input(fqn=t.fqn),), shape=t.shape, dtype=t.dtype)
        return out

It receives the model's tensors (``derive.TensorInfo``: FQN, dtype, global shape; no data) and the
configuration (``--model-config`` JSON with ``--adapter-option KEY=VALUE`` on top), and returns
the output tensors by FQN, in output order, each a ``derive.Derived``: its inputs (by FQN), which
of their rows each output row block needs (``Aligned``, ``Segment``, ``Gather``, ``HeadPermute``,
or ``None``: whole), and a row-wise ``combine`` function. Tensors no rule reads are left out.
Row maps and combine functions must be importable module-level names (they travel to the
worker processes by pickle, by reference): of an installed module, or of the user's module,
which each worker imports as the planning process did, from the same file.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import sys
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any

from fsdp_convert.errors import InvalidOptionError
from fsdp_convert.syspath import clean_sys_path, import_file_module

__all__ = ["load_user_function"]


def load_user_function(spec: str) -> Callable[..., Any]:
    """Import ``module:function`` (or ``path/to/file.py:function``) and return the function.

    A module name is imported as installed: from ``sys.path`` less the current folder (as the
    workers have it, ``syspath.worker_sys_path``). Only when no such module is installed is it
    taken from the current folder: ``NAME.py`` or the package ``NAME/``, imported from that file
    (``syspath.import_file_module``), so a ``json.py`` or ``transformers.py`` there is never
    imported, by this module or anything after it. A file path is imported from that file, under
    its stem, refused if an installed module has that name. The folder is never put on
    ``sys.path``: the workers of ``--nproc`` import the module from the same file, and a module
    that imports its neighbours must be a package (or installed).

    Warning:
        Runs the module's code: only with ``--adapter module:function``, the user's own.

    Raises:
        InvalidOptionError: no ``:``, the module does not import, or the name is missing or not callable.
    """
    module_ref, _, attr = spec.rpartition(":")
    if not module_ref or not attr:
        raise InvalidOptionError(f"--adapter {spec!r}: expected module:function, e.g. my_adapters:to_hf")
    try:
        if module_ref.endswith(".py") or "/" in module_ref or os.sep in module_ref:
            module = _import_file(Path(module_ref), spec)
        else:
            module = _import_name(module_ref)
    except InvalidOptionError:
        raise
    except Exception as e:
        raise InvalidOptionError(f"--adapter {spec}: module {module_ref!r} does not import ({type(e).__name__}: {e})") from e
    function = getattr(module, attr, None)
    if not callable(function):
        raise InvalidOptionError(f"--adapter {spec}: {module_ref} has no function {attr!r}")
    return function  # type: ignore[no-any-return]


def _installed(name: str) -> bool:
    """Whether top-level module ``name`` is imported already or found without the current folder."""
    if name in sys.modules:
        return True
    with clean_sys_path():
        return importlib.util.find_spec(name) is not None


def _import_name(name: str) -> ModuleType:
    top = name.partition(".")[0]
    if not _installed(top):
        folder = Path.cwd()
        if (folder / top / "__init__.py").is_file():
            import_file_module(top, folder / top / "__init__.py", package=True)
        elif (folder / f"{top}.py").is_file():
            import_file_module(top, folder / f"{top}.py")
        else:
            raise ModuleNotFoundError(f"No module named {top!r} installed or in {folder}", name=top)
    with clean_sys_path():  # an installed module's own imports come from where it is installed
        return importlib.import_module(name)


def _import_file(path: Path, spec: str) -> ModuleType:
    path = path.resolve()
    name = path.stem
    if not path.is_file() or not name.isidentifier():
        raise InvalidOptionError(f"--adapter {spec}: {path} is not a Python file with a module name (my_adapters.py)")
    loaded = sys.modules.get(name)
    if loaded is not None and getattr(loaded, "__file__", None) and Path(str(loaded.__file__)).resolve() == path:
        return loaded
    if _installed(name):
        raise InvalidOptionError(f"--adapter {spec}: an installed module is named {name!r}; rename {path.name}")
    return import_file_module(name, path)
