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
worker processes by pickle, by reference); the module must be importable by the workers too
(on ``sys.path`` or ``PYTHONPATH``).
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

__all__ = ["load_user_function"]


def load_user_function(spec: str) -> Callable[..., Any]:
    """Import ``module:function`` (or ``path/to/file.py:function``) and return the function.

    A module name is imported from ``sys.path`` as it stands; only when no such module is
    installed is the current folder searched, appended *last* to ``sys.path`` (a ``json.py`` or
    ``transformers.py`` there never shadows an installed module). A file path is imported from
    that file, under its stem, refused if an installed module has that name. Either folder stays
    last on ``sys.path``: the workers of ``--nproc`` import the module by name from there.

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


def _append_to_path(folder: str) -> None:
    """Put ``folder`` last on ``sys.path``: it supplies only modules nothing installed provides."""
    if folder not in sys.path:
        sys.path.append(folder)
        importlib.invalidate_caches()


def _import_name(name: str) -> ModuleType:
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError as e:
        if e.name != name.partition(".")[0]:
            raise  # the module was found; something it imports is missing
    _append_to_path(os.getcwd())
    return importlib.import_module(name)


def _import_file(path: Path, spec: str) -> ModuleType:
    path = path.resolve()
    name = path.stem
    if not path.is_file() or not name.isidentifier():
        raise InvalidOptionError(f"--adapter {spec}: {path} is not a Python file with a module name (my_adapters.py)")
    loaded = sys.modules.get(name)
    found = importlib.util.find_spec(name) if loaded is None else None
    origin = getattr(loaded, "__file__", None) or getattr(found, "origin", None)
    if (loaded is not None or found is not None) and (origin is None or Path(origin).resolve() != path):
        raise InvalidOptionError(f"--adapter {spec}: an installed module is named {name!r}; rename {path.name}")
    _append_to_path(str(path.parent))
    return importlib.import_module(name)
