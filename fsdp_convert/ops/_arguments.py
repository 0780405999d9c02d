"""The operations' own keyword arguments, checked before anything is read.

A Python caller's bad value (``only="weights"``, ``nproc="4"``, ``memory_budget_bytes="1GiB"``,
``options={"dtype": "bf16"}``) is an ``InvalidOptionError`` naming the keyword and what it takes,
never a ``TypeError`` or ``AttributeError`` from deep in a plan. The CLI checks its flags before it
calls an operation, so these fire for Python callers only; the messages name the flag, which
``str(e)`` words as the keyword (``errors.FLAG_KEYWORDS``). ``ops.options`` runs them as its
dataclasses are built.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

from fsdp_convert.errors import InvalidOptionError
from fsdp_convert.transform import TransformOptions
from fsdp_convert.transform.options import choice

__all__ = ["choice", "count", "byte_count", "tolerance", "transform_options"]


def count(flag: str, value: object) -> int:
    """A count of at least 1 (``world_size``, an ``nproc`` that is not None).

    Raises:
        InvalidOptionError: not an int (a bool, a string, a float), or below 1.
    """
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise InvalidOptionError(f"{flag} {value!r}: expected an int of at least 1")
    return value


def byte_count(flag: str, value: object) -> int:
    """A positive number of bytes (``memory_budget_bytes``, ``max_shard_bytes``); no unit strings.

    Raises:
        InvalidOptionError: not an int, or not positive (``memory_budget_bytes='1GiB'``: pass ``2**30``).
    """
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise InvalidOptionError(f"{flag} {value!r}: expected a positive int, in bytes (1 GiB is 2**30)")
    return value


def tolerance(flag: str, value: object) -> float | None:
    """``atol`` / ``rtol``: None, or a finite number of at least 0.

    Raises:
        InvalidOptionError: a string, a bool, a negative or non-finite number.
    """
    if value is None:
        return None
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value) or value < 0:
        raise InvalidOptionError(f"{flag} {value!r}: expected None or a finite number of at least 0")
    return float(value)


def transform_options(value: object, keyword: str = "options") -> TransformOptions:
    """A ``TransformOptions``, a mapping of its fields (``{"dtype": "bf16"}``), or None (the defaults).

    Args:
        value: what the caller passed.
        keyword: the keyword the messages name: ``options`` (the operations' argument) or
            ``transform`` (the field of ``ops.options``' classes).

    Raises:
        InvalidOptionError: another type, an unknown field, or a bad field value (``TransformOptions``).
    """
    if value is None:
        return TransformOptions()
    if isinstance(value, TransformOptions):
        return value
    if isinstance(value, Mapping):
        try:
            return TransformOptions(**value)
        except TypeError as e:  # an unknown field, or a positional-only mistake
            raise InvalidOptionError(f"{keyword} {dict(value)!r}: {e}") from None
    raise InvalidOptionError(f"{keyword}: expected a TransformOptions (or a dict of its fields), got {type(value).__name__}")
