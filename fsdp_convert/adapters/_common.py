"""What the built-in adapters share: torchtitan's abstract keys, the config fields they read, plain copies."""

from __future__ import annotations

import logging
import re
from collections.abc import Mapping, Sequence
from typing import Any

from fsdp_convert.derive import Derived, Gather, HeadPermute, Input, RowMap, Segment, TensorInfo
from fsdp_convert.errors import InvalidOptionError, UnsupportedTransformError
from fsdp_convert.transform.unstack import check_split

__all__ = ["abstract_key", "config_int", "heads", "tied", "moved", "rope_rows", "split_experts", "stack_experts", "warn_left_out"]

logger = logging.getLogger(__name__)


def abstract_key(fqn: str, count: int = 1) -> tuple[str, list[str]]:
    r"""Torchtitan's abstract key: the first ``count`` numbers of a ``layers`` key as ``{}``, and those numbers.

    ``layers.3.attention.wo.weight`` gives ``("layers.{}.attention.wo.weight", ["3"])``, as its
    adapters' ``re.sub(r"(\d+)", "{}", key, count=1)``; a key without ``layers`` is its own.
    """
    if "layers" not in fqn:
        return fqn, []
    return re.sub(r"(\d+)", "{}", fqn, count=count), re.findall(r"\d+", fqn)[:count]


def config_int(config: Mapping[str, Any], *names: str, default: int | None = None) -> int:
    """The first of ``names`` the config has, as a positive int (HF names first, then torchtitan's).

    Raises:
        InvalidOptionError: none is given (and no default), or the value is not a positive integer.
    """
    for name in names:
        value = config.get(name)
        if value is not None:
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise InvalidOptionError(f"model config {name}={value!r}: expected a positive integer")
            return value
    if default is None:
        raise InvalidOptionError(
            f"the adapter needs {names[0]}: pass --model-config config.json (or --hf-assets DIR), "
            f"or --adapter-option {names[0]}=N"
        )
    return default


def heads(config: Mapping[str, Any]) -> tuple[int, int]:
    """``(n_heads, n_kv_heads)`` from a config (``num_attention_heads``, ``num_key_value_heads``; kv defaults to all)."""
    n_heads = config_int(config, "num_attention_heads", "n_heads")
    return n_heads, config_int(config, "num_key_value_heads", "n_kv_heads", default=n_heads)


def tied(config: Mapping[str, Any]) -> bool:
    """``tie_word_embeddings`` (torchtitan: ``enable_weight_tying``); False when not said."""
    return bool(config.get("tie_word_embeddings", config.get("enable_weight_tying", False)))


def rope_rows(info: TensorInfo, n_heads: int, *, to_hf: bool, rows_from: Sequence[int] | None = None) -> RowMap:
    """The Q/K RoPE permutation of ``info``'s rows for ``n_heads`` heads (composed with ``rows_from``, a selection).

    Raises:
        UnsupportedTransformError: the rows do not split into ``n_heads`` heads of an even size.
    """
    rows = len(rows_from) if rows_from is not None else info.shape[0] if info.shape else 0
    if len(info.shape) != 2 or rows % n_heads or (rows // n_heads) % 2:
        raise UnsupportedTransformError(
            f"{info.fqn}: {rows} rows do not split into {n_heads} heads of an even head_dim (shape {info.shape}); "
            "check num_attention_heads / num_key_value_heads"
        )
    permute = HeadPermute(n_heads, rows // n_heads, to_hf=to_hf)
    if rows_from is None:
        return permute
    return Gather(tuple(rows_from[i] for i in permute(0, rows)))


def moved(info: TensorInfo, rows: RowMap | None = None, *, rows_count: int | None = None) -> Derived:
    """``info`` under a new name: as it is, or with its rows picked by ``rows`` (``rows_count`` of them)."""
    if rows is None:
        return Derived(inputs=(Input(fqn=info.fqn),), shape=info.shape, dtype=info.dtype)
    shape = (rows_count if rows_count is not None else info.shape[0], *info.shape[1:])
    return Derived(inputs=(Input(fqn=info.fqn, rows=rows),), shape=shape, dtype=info.dtype)


def warn_left_out(adapter: str, fqns: Sequence[str]) -> None:
    """Log the tensors an adapter leaves out, as torchtitan's own ``to_hf`` skips them silently."""
    if fqns:
        logger.warning(
            "%s leaves out %d tensor(s) it does not map, as torchtitan's to_hf does: %s", adapter, len(fqns), ", ".join(fqns)
        )


def split_experts(info: TensorInfo, hf_abstract: str, layer: str) -> dict[str, Derived]:
    """One HF tensor per expert of a stacked ``(E, F, D)`` weight: expert ``e`` is ``[e * F, (e + 1) * F)`` of ``(E * F, D)``."""
    if len(info.shape) != 3:
        raise UnsupportedTransformError(f"{info.fqn}: expected a stacked (experts, out, in) weight, got shape {info.shape}")
    n, rows, cols = info.shape
    check_split(info.fqn, info.shape, info.dtype, n, "experts")  # a claimed (10**6, 0, 2) holds no bytes
    view = (n * rows, cols)
    return {
        hf_abstract.format(layer, e): Derived(
            inputs=(Input(fqn=info.fqn, rows=Segment(0, rows, src_start=e * rows), view=view),),
            shape=(rows, cols),
            dtype=info.dtype,
        )
        for e in range(n)
    }


def stack_experts(key: str, by_expert: dict[int, TensorInfo]) -> Derived:
    """Experts ``0..E-1`` of one weight stacked: in the output's ``(E * F, D)`` view, expert ``e`` is ``[e * F, (e + 1) * F)``."""
    first = by_expert[min(by_expert)]
    n = len(by_expert)
    if sorted(by_expert) != list(range(n)) or any((i.shape, i.dtype) != (first.shape, first.dtype) for i in by_expert.values()):
        raise UnsupportedTransformError(f"{key}: its experts are not 0..{n - 1} of one shape and dtype")
    if len(first.shape) != 2:
        raise UnsupportedTransformError(f"{first.fqn}: expected a 2-d expert weight, got shape {first.shape}")
    rows, cols = first.shape
    return Derived(
        inputs=tuple(Input(fqn=by_expert[e].fqn, rows=Segment(e * rows, rows)) for e in range(n)),
        shape=(n, rows, cols),
        dtype=first.dtype,
        view=(n * rows, cols),
    )
