"""Index stage, shared: the globals torch's pickles name (dtypes, layouts, ``torch.Size``, ``OrderedDict``), vetted.

A torch pickle names torch's dtypes (``torch.float32``) and layouts as globals and makes a few calls
(``torch.Size(dims)``, ``torch.serialization._get_layout(name)``, ``collections.OrderedDict()``).
A ``_safe_pickle.SafeUnpickler`` subclass admits exactly these: a dtype or layout by its name in a
table (never ``getattr(torch, name)``), a call through ``VETTED_CALLS``, whose functions check
their arguments and return a fresh object. torch is imported at first use only: ``.metadata``'s
unpickler needs none.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from fsdp_convert.formats._safe_pickle import MalformedError

__all__ = ["TORCH_DTYPES", "TORCH_LAYOUTS", "VETTED_CALLS", "torch_size"]  # for the rank files' and .metadata's unpicklers


if TYPE_CHECKING:  # names are looked up in these tables, never with getattr(torch, name): torch.__getattr__ imports modules
    import torch

    TORCH_DTYPES: dict[str, torch.dtype]
    TORCH_LAYOUTS: dict[str, torch.layout]


def __getattr__(name: str) -> Any:
    """``TORCH_DTYPES`` and ``TORCH_LAYOUTS``, built with torch at first use (.metadata's unpickler needs no torch)."""
    if name not in ("TORCH_DTYPES", "TORCH_LAYOUTS"):
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    import torch

    globals()["TORCH_DTYPES"] = {n: v for n, v in vars(torch).items() if isinstance(v, torch.dtype)}
    globals()["TORCH_LAYOUTS"] = {f"torch.{n}": v for n, v in vars(torch).items() if isinstance(v, torch.layout)}
    return globals()[name]


def torch_size(dims: Any) -> torch.Size:
    """``torch.Size(dims)`` of a tuple or list of 64-bit ints; else MalformedError, TypeError or ValueError."""
    if type(dims) is not tuple and type(dims) is not list:
        raise MalformedError("a torch.Size of something other than a sequence")
    import torch

    return torch.Size(dims)  # TypeError or ValueError unless every item is a 64-bit int


def _layout(name: Any) -> torch.layout:
    layouts: dict[str, torch.layout] = globals().get("TORCH_LAYOUTS") or __getattr__("TORCH_LAYOUTS")
    if type(name) is not str or name not in layouts:
        raise MalformedError("an unknown torch layout")
    return layouts[name]


def _ordered_dict(*args: Any) -> OrderedDict[Any, Any]:
    if args:
        raise MalformedError("an OrderedDict with arguments")  # pickled as OrderedDict() then SETITEMS
    return OrderedDict()


# Calls torch's pickles make, with their arguments checked; each returns a fresh object.
VETTED_CALLS: dict[tuple[str, str], Callable[..., Any]] = {
    ("torch", "Size"): torch_size,
    ("torch.serialization", "_get_layout"): _layout,  # a layout pickles as _get_layout("torch.strided")
    ("collections", "OrderedDict"): _ordered_dict,
}
