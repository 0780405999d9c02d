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
import os
import sys
from collections.abc import Callable
from typing import Any

from fsdp_convert.errors import InvalidOptionError

__all__ = ["load_user_function"]


def load_user_function(spec: str) -> Callable[..., Any]:
    """Import ``module:function`` (the current folder first on ``sys.path``) and return the function.

    Warning:
        Runs the module's code: only with ``--adapter module:function``, the user's own.

    Raises:
        InvalidOptionError: no ``:``, the module does not import, or the name is missing or not callable.
    """
    module_name, _, attr = spec.partition(":")
    if not module_name or not attr:
        raise InvalidOptionError(f"--adapter {spec!r}: expected module:function, e.g. my_adapters:to_hf")
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())  # as `python -m` does, so a module beside the user imports
    try:
        module = importlib.import_module(module_name)
    except Exception as e:
        raise InvalidOptionError(f"--adapter {spec}: module {module_name!r} does not import ({type(e).__name__}: {e})") from e
    function = getattr(module, attr, None)
    if not callable(function):
        raise InvalidOptionError(f"--adapter {spec}: {module_name} has no function {attr!r}")
    return function  # type: ignore[no-any-return]
