"""Model-family adapters: a model's tensors to another framework's names and layouts, as ``derive`` rules.

Each built-in adapter follows the framework's own converter, named in its module, and returns
``derive.Derived`` rules, so the mover computes every output row block by row block while it
copies: key maps, the Q/K RoPE row permutation, fused-QKV splits, stacked-expert splits and joins.

``load_adapter(name, config)`` binds one to the model's configuration (a Hugging Face
``config.json``'s fields: ``num_attention_heads``, ``num_key_value_heads``, ``tie_word_embeddings``,
``num_experts``...). ``NAME`` is a built-in (``ADAPTERS``) or ``module:function``, the user's own
(``adapters.user``): the one place this tool imports code it was not shipped with. An
``hf-to-torchtitan-*`` adapter reads a block-FP8 folder (DeepSeek-V3's Hub weights) dequantized
first (``transform.fp8.with_fp8``), as torchtitan reads one through ``QuantizedHuggingFaceStorageReader``.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Mapping, Sequence
from functools import partial
from pathlib import Path
from typing import Any

from fsdp_convert.adapters import deepseek_v3, gpt_oss, llama3, megatron, olmo, qwen3, torchtune
from fsdp_convert.adapters.user import load_user_function
from fsdp_convert.derive import Adapter, Derived, TensorInfo
from fsdp_convert.errors import InvalidOptionError
from fsdp_convert.transform.fp8 import with_fp8

__all__ = ["ADAPTERS", "DEQUANTIZING_PREFIX", "load_adapter", "read_model_config", "parse_adapter_option", "configured_adapter"]

AdapterFunction = Callable[[Sequence[TensorInfo], Mapping[str, Any]], Mapping[str, Derived]]

ADAPTERS: dict[str, AdapterFunction] = {
    "torchtitan-llama3-to-hf": llama3.to_hf,
    "hf-to-torchtitan-llama3": llama3.from_hf,
    "torchtitan-qwen3-to-hf": qwen3.to_hf,
    "hf-to-torchtitan-qwen3": qwen3.from_hf,
    "torchtitan-deepseek-v3-to-hf": deepseek_v3.to_hf,
    "hf-to-torchtitan-deepseek-v3": deepseek_v3.from_hf,
    "torchtitan-gpt-oss-to-hf": gpt_oss.to_hf,
    "hf-to-torchtitan-gpt-oss": gpt_oss.from_hf,
    "torchtitan-gpt-oss-to-transformers": gpt_oss.to_transformers,
    "transformers-to-torchtitan-gpt-oss": gpt_oss.from_transformers,
    "torchtune-llama-to-hf": torchtune.to_hf,
    "olmo-core-to-hf": olmo.to_hf,
    "megatron-gpt-to-hf": megatron.to_hf,
}
DEQUANTIZING_PREFIX = "hf-to-torchtitan-"
"""A built-in adapter whose name starts so reads block-FP8 weights dequantized to float32 (an implied ``--dequantize``)."""


def read_model_config(path: str | os.PathLike[str]) -> dict[str, Any]:
    """A model configuration file (a Hugging Face ``config.json``) as a dict.

    Raises:
        InvalidOptionError: it does not exist, is not JSON, or is not a JSON object.
    """
    try:
        config = json.loads(Path(path).read_text())
    except OSError as e:
        raise InvalidOptionError(f"--model-config {path}: cannot read it ({e.strerror or e})") from e
    except ValueError as e:
        raise InvalidOptionError(f"--model-config {path}: not JSON ({e})") from e
    if not isinstance(config, dict):
        raise InvalidOptionError(f"--model-config {path}: expected a JSON object (a config.json), got {type(config).__name__}")
    return config


def parse_adapter_option(text: str) -> tuple[str, Any]:
    """``KEY=VALUE`` to a pair, the value read as JSON when it parses (``8``, ``true``), else as the string.

    Raises:
        InvalidOptionError: no ``=`` or an empty key.
    """
    key, sep, value = text.partition("=")
    if not sep or not key.strip():
        raise InvalidOptionError(f"--adapter-option {text!r}: expected KEY=VALUE, e.g. num_key_value_heads=8")
    try:
        return key.strip(), json.loads(value)
    except ValueError:
        return key.strip(), value


def load_adapter(name: str, config: Mapping[str, Any] | None = None) -> Adapter:
    """The adapter ``name`` with ``config`` bound: a ``derive.Adapter`` for ``TransformOptions.adapter``.

    Args:
        name: a built-in (``ADAPTERS``: ``torchtitan-llama3-to-hf``, ``hf-to-torchtitan-llama3``,
            ``torchtitan-qwen3-to-hf``, ``hf-to-torchtitan-qwen3``, ``torchtitan-deepseek-v3-to-hf``,
            ``hf-to-torchtitan-deepseek-v3``, ``torchtitan-gpt-oss-to-hf``, ``hf-to-torchtitan-gpt-oss``...)
            or ``module:function``, which
            imports ``module`` (installed, else ``module.py`` or the package ``module/`` in the
            current folder, from its file, the folder kept off ``sys.path``) and takes its
            ``function`` (see ``adapters.user`` for its interface).
        config: the model's configuration (``read_model_config``, plus ``--adapter-option`` s).

    Returns:
        The bound adapter; for an ``hf-to-torchtitan-*`` one (``DEQUANTIZING_PREFIX``), chained after
        ``transform.fp8.dequantize_rules``, so a block-FP8 folder's weights reach it as float32
        without their scales (an unquantized folder passes unchanged).

    Raises:
        InvalidOptionError: an unknown name, or a user module that does not import or lacks the function.
    """
    if ":" in name:
        function = load_user_function(name)
    else:
        found = ADAPTERS.get(name)
        if found is None:
            known = ", ".join(ADAPTERS)
            raise InvalidOptionError(f"--adapter {name!r}: unknown; use one of {known}, or module:function for your own")
        function = found
    bound = partial(function, config=dict(config or {}))
    if ":" not in name and name.startswith(DEQUANTIZING_PREFIX):
        return with_fp8(bound, dequantize=True) or bound
    return bound


def configured_adapter(
    name: str | None,
    *,
    model_config: str | os.PathLike[str] | None = None,
    settings: Sequence[str] = (),
    hf_assets: str | os.PathLike[str] | None = None,
) -> Adapter | None:
    """The adapter the command line asks for, bound to its config; None without ``--adapter``.

    The config is ``model_config`` (``--model-config``), else ``hf_assets``'s ``config.json`` when
    that is a local folder holding one (``--hf-assets``), else empty; each ``KEY=VALUE`` of
    ``settings`` (``--adapter-option``) is set over it.

    Raises:
        InvalidOptionError: ``model_config`` or ``settings`` without ``name``, and as
            ``load_adapter``, ``read_model_config`` and ``parse_adapter_option``.
    """
    if name is None:
        if model_config is not None or settings:
            raise InvalidOptionError("--model-config and --adapter-option go with --adapter")
        return None
    config: dict[str, Any] = {}
    if model_config is not None:
        config = read_model_config(model_config)
    elif hf_assets is not None and (Path(hf_assets) / "config.json").is_file():
        config = read_model_config(Path(hf_assets) / "config.json")
    config.update(parse_adapter_option(text) for text in settings)
    return load_adapter(name, config)
