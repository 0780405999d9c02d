"""Model-family adapters: a model's tensors to another framework's names and layouts, as ``derive`` rules.

Each built-in adapter follows the framework's own converter, named in its module, and returns
``derive.Derived`` rules, so the mover computes every output row block by row block while it
copies: key maps, the Q/K RoPE row permutation, fused-QKV splits, stacked-expert splits and joins.

One record per built-in (``AdapterRecord``) in one ordered table, ``ADAPTER_RECORDS``: its name,
function, direction, family, the converter it follows, the config fields it reads, the steps it
implies and, for a target whose loader wants more than tensors, where ``reshard`` files its keys
and the values and files it writes beside them (Megatron's). ``fsdp-convert adapters`` prints the
table, and docs/huggingface.md's list is rendered from it (``adapters.tables``; a test keeps them
equal). Adding an adapter is its module and one record here.

``load_adapter(name, config)`` binds one to the model's configuration (a Hugging Face
``config.json``'s fields: ``num_attention_heads``, ``num_key_value_heads``, ``tie_word_embeddings``,
``num_experts``...). ``NAME`` is a built-in (``ADAPTERS``) or ``module:function``, the user's own
(``adapters.user``): the one place this tool imports code it was not shipped with. An adapter whose
record implies ``dequantize`` (the ``hf-to-torchtitan-*`` ones) reads a block-FP8 folder
(DeepSeek-V3's Hub weights) dequantized first (``transform.fp8.with_fp8``), as torchtitan reads one
through ``QuantizedHuggingFaceStorageReader``.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any, cast

from fsdp_convert.adapters import deepseek_v3, gpt_oss, llama3, megatron, olmo, qwen3, torchtune
from fsdp_convert.adapters.user import load_user_function
from fsdp_convert.derive import Adapter, Derived, TensorInfo
from fsdp_convert.errors import InvalidOptionError
from fsdp_convert.transform.fp8 import with_fp8

__all__ = [
    "AdapterRecord", "ADAPTER_RECORDS", "ADAPTERS", "STEPS", "DEQUANTIZE", "UNSTACK", "adapter_record", "load_adapter",
    "read_model_config", "parse_adapter_option", "configured_adapter",
]  # fmt: skip

AdapterFunction = Callable[[Sequence[TensorInfo], Mapping[str, Any]], Mapping[str, Derived]]

DEQUANTIZE = "dequantize"
UNSTACK = "unstack"
STEPS = {
    DEQUANTIZE: "a block-FP8 folder (DeepSeek) or MXFP4 experts (gpt-oss) are read dequantized to float32, as with "
    "`--dequantize` (an unquantized folder as it is)",
    UNSTACK: "layers stacked on a leading dim are split per layer by the adapter itself (no `--unstack-layers`)",
}
"""The steps an adapter may imply (``AdapterRecord.implies``), each with what it does (Markdown)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class AdapterRecord:
    """One built-in adapter: its ``--adapter`` name, its function, and what ``fsdp-convert adapters`` says of it.

    Attributes:
        name: the ``--adapter`` name, ``<source>-<family>-to-<target>`` (``torchtitan-llama3-to-hf``).
        function: ``function(tensors, config)``, returning ``{output FQN: derive.Derived}``.
        family: the model family it maps (``Llama 3``).
        source: whose names and layout it reads (``torchtitan``, ``HF``...).
        target: whose names and layout it writes.
        follows: the framework's own converter it follows, with its version (Markdown).
        reads: the config fields it reads, by their Hugging Face ``config.json`` names, in the order
            it reads them (``tests/unit/test_adapters_table.py`` checks them against its code).
        needs: those of ``reads`` it refuses to run without (``InvalidOptionError``); the others have defaults.
        implies: the steps (``STEPS``) it runs without their flag: ``dequantize``, ``unstack``.
        changes: what it does besides renaming keys (Markdown); ``keys only`` when nothing.
        nest: the top-level keys ``reshard`` files its outputs under, as the target's own loader
            wants them (OLMo-core's ``model.<fqn>``); ``()``: at the top, as the adapter names them.
        values: the bytes entries ``reshard`` writes beside the adapter's tensors, as the target's
            loader wants them (Megatron's per-layer ``_extra_state``): ``values(config)`` gives
            ``{FQN: plain value}``, each filed under ``nest`` too and stored as ``torch.save(value)``;
            called once the function has accepted the tensors. None: none.
        files: the files ``reshard`` writes beside its output's DCP data, as the target's loader
            wants them (Megatron's ``common.pt`` and ``metadata.json``): ``files(config)`` gives
            ``{file name: bytes}``, written after ``.metadata`` and counted in the space check. None: none.
    """

    name: str
    function: AdapterFunction
    family: str
    source: str
    target: str
    follows: str
    reads: tuple[str, ...] = ()
    needs: tuple[str, ...] = ()
    implies: tuple[str, ...] = ()
    changes: str = "keys only"
    nest: tuple[str, ...] = ()
    values: Callable[[Mapping[str, Any]], dict[str, Any]] | None = None
    files: Callable[[Mapping[str, Any]], dict[str, bytes]] | None = None

    @property
    def direction(self) -> str:
        """``torchtitan → HF``: the source's names and layout to the target's."""
        return f"{self.source} → {self.target}"

    def to_json_dict(self) -> dict[str, Any]:
        """The record as ``fsdp-convert adapters --json`` writes it (plain text: no Markdown backticks)."""
        return {
            "name": self.name,
            "function": f"{self.function.__module__}:{self.function.__qualname__}",
            "direction": self.direction,
            "source": self.source,
            "target": self.target,
            "family": self.family,
            "follows": self.follows.replace("`", ""),
            "reads": list(self.reads),
            "needs": list(self.needs),
            "implies": list(self.implies),
            "changes": self.changes.replace("`", ""),
        }


_HEADS = ("num_attention_heads", "num_key_value_heads")
_TORCHTITAN = "torchtitan 0.3.0"
ADAPTER_RECORDS: tuple[AdapterRecord, ...] = (
    AdapterRecord(
        name="torchtitan-llama3-to-hf",
        function=llama3.to_hf,
        family="Llama 3",
        source="torchtitan",
        target="HF",
        follows=f"{_TORCHTITAN} `Llama3StateDictAdapter.to_hf`",
        reads=(*_HEADS, "tie_word_embeddings"),
        needs=("num_attention_heads",),
        changes="Q/K rows permuted to HF's RoPE layout; a fused `wqkv` split; `lm_head` left out when tied",
    ),
    AdapterRecord(
        name="hf-to-torchtitan-llama3",
        function=llama3.from_hf,
        family="Llama 3",
        source="HF",
        target="torchtitan",
        follows=f"{_TORCHTITAN} `Llama3StateDictAdapter.from_hf`",
        reads=(*_HEADS, "tie_word_embeddings"),
        needs=("num_attention_heads",),
        implies=(DEQUANTIZE,),
        changes="Q/K rows permuted back; `lm_head` copied from the embedding when tied",
    ),
    AdapterRecord(
        name="torchtitan-qwen3-to-hf",
        function=qwen3.to_hf,
        family="Qwen 3 (dense, MoE)",
        source="torchtitan",
        target="HF",
        follows=f"{_TORCHTITAN} `Qwen3StateDictAdapter.to_hf`",
        reads=("tie_word_embeddings",),
        changes="each stacked expert weight split into one tensor per expert; `lm_head` left out when tied",
    ),
    AdapterRecord(
        name="hf-to-torchtitan-qwen3",
        function=qwen3.from_hf,
        family="Qwen 3 (dense, MoE)",
        source="HF",
        target="torchtitan",
        follows=f"{_TORCHTITAN} `Qwen3StateDictAdapter.from_hf`",
        reads=("tie_word_embeddings",),
        implies=(DEQUANTIZE,),
        changes="each layer's experts stacked; `lm_head` copied from the embedding when tied",
    ),
    AdapterRecord(
        name="torchtitan-deepseek-v3-to-hf",
        function=deepseek_v3.to_hf,
        family="DeepSeek-V3",
        source="torchtitan",
        target="HF",
        follows=f"{_TORCHTITAN} `DeepSeekV3StateDictAdapter.to_hf`",
        reads=("num_hidden_layers",),
        changes="each stacked expert weight split per expert; `mtp_layers.I` as layer `num_hidden_layers + I`",
    ),
    AdapterRecord(
        name="hf-to-torchtitan-deepseek-v3",
        function=deepseek_v3.from_hf,
        family="DeepSeek-V3",
        source="HF",
        target="torchtitan",
        follows=f"{_TORCHTITAN} `DeepSeekV3StateDictAdapter.from_hf`",
        reads=("num_hidden_layers",),
        implies=(DEQUANTIZE,),
        changes="each layer's experts stacked; layers from `num_hidden_layers` on as `mtp_layers`",
    ),
    AdapterRecord(
        name="torchtitan-gpt-oss-to-hf",
        function=gpt_oss.to_hf,
        family="gpt-oss",
        source="torchtitan",
        target="HF",
        follows=f"{_TORCHTITAN} `GptOssStateDictAdapter.to_hf`",
        changes="keys only: the stacked experts as they are, under the MXFP4 names (`*_blocks`)",
    ),
    AdapterRecord(
        name="hf-to-torchtitan-gpt-oss",
        function=gpt_oss.from_hf,
        family="gpt-oss",
        source="HF",
        target="torchtitan",
        follows=f"{_TORCHTITAN} `GptOssStateDictAdapter.from_hf`",
        implies=(DEQUANTIZE,),
        changes="keys only: the stacked experts as they are",
    ),
    AdapterRecord(
        name="torchtitan-gpt-oss-to-transformers",
        function=gpt_oss.to_transformers,
        family="gpt-oss",
        source="torchtitan",
        target="transformers",
        follows=f"{_TORCHTITAN} `GptOssStateDictAdapter.to_hf`, experts as transformers' `GptOssForCausalLM` reads them",
        changes="each expert transposed: `(E, D, 2F)` and `(E, F, D)`",
    ),
    AdapterRecord(
        name="transformers-to-torchtitan-gpt-oss",
        function=gpt_oss.from_transformers,
        family="gpt-oss",
        source="transformers",
        target="torchtitan",
        follows=f"{_TORCHTITAN} `GptOssStateDictAdapter.from_hf`, experts as transformers' `GptOssForCausalLM` holds them",
        implies=(DEQUANTIZE,),
        changes="each expert transposed back: `(E, 2F, D)` and `(E, D, F)`",
    ),
    AdapterRecord(
        name="torchtune-llama-to-hf",
        function=torchtune.to_hf,
        family="Llama",
        source="torchtune",
        target="HF",
        follows="torchtune 0.6.1 `convert_weights.tune_to_hf`",
        reads=_HEADS,
        needs=("num_attention_heads",),
        changes="Q/K rows permuted to HF's RoPE layout",
    ),
    AdapterRecord(
        name="olmo-core-to-hf",
        function=olmo.to_hf,
        family="OLMo-2, OLMo-3",
        source="OLMo-core",
        target="HF",
        follows="OLMo-core 3.0.0 `convert_state_to_hf`",
        reads=("model_type",),
    ),
    AdapterRecord(
        name="hf-to-olmo-core",
        function=olmo.from_hf,
        family="OLMo-2, OLMo-3",
        source="HF",
        target="OLMo-core",
        follows="OLMo-core 3.0.0 `convert_state_from_hf`",
        reads=("model_type", "num_hidden_layers", "tie_word_embeddings"),
        changes="`lm_head.w_out.weight` a copy of the embedding when tied; `reshard` files the keys under `model.`",
        nest=("model",),
    ),
    AdapterRecord(
        name="megatron-gpt-to-hf",
        function=megatron.to_hf,
        family="GPT (Llama layout)",
        source="Megatron-Core",
        target="HF",
        follows="Megatron-Bridge 0.3.1 `LlamaBridge.mapping_registry`",
        reads=(*_HEADS, "num_hidden_layers", "tie_word_embeddings"),
        needs=("num_attention_heads", "num_hidden_layers"),
        implies=(UNSTACK,),
        changes="`linear_qkv` split per query group into q/k/v, `linear_fc1` into gate/up; `lm_head` left out when tied",
    ),
    AdapterRecord(
        name="hf-to-megatron-gpt",
        function=megatron.from_hf,
        family="GPT (Llama layout)",
        source="HF",
        target="Megatron-Core",
        follows="Megatron-Bridge 0.3.1 `LlamaBridge.mapping_registry`, inverted; Megatron-Core 0.16.1 `torch_dist`",
        reads=(*_HEADS, "num_hidden_layers", "tie_word_embeddings"),
        needs=("num_attention_heads", "num_hidden_layers"),
        changes=(
            "layers stacked; q/k/v fused per query group into `linear_qkv`, gate/up into `linear_fc1`; `lm_head` left "
            "out when tied; `reshard` adds each layer module's `_extra_state`, `common.pt` and `metadata.json`"
        ),
        values=megatron.extra_state,
        files=megatron.checkpoint_files,
    ),
)
"""The built-in adapters, in the order ``fsdp-convert adapters`` and docs/huggingface.md list them."""
ADAPTERS: dict[str, AdapterFunction] = {record.name: record.function for record in ADAPTER_RECORDS}
"""Each built-in's function by ``--adapter`` name (from ``ADAPTER_RECORDS``): what ``load_adapter`` looks a name up in."""


def adapter_record(name: str) -> AdapterRecord | None:
    """The record of the built-in adapter ``name``; None for another name (``module:function``, or unknown)."""
    return next((record for record in ADAPTER_RECORDS if record.name == name), None)


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
        name: a built-in (``ADAPTERS``: ``torchtitan-llama3-to-hf``, ``hf-to-torchtitan-llama3``...;
            ``fsdp-convert adapters`` lists them) or ``module:function``, which imports ``module``
            (installed, else ``module.py`` or the package ``module/`` in the current folder, from its
            file, the folder kept off ``sys.path``) and takes its ``function`` (see ``adapters.user``
            for its interface).
        config: the model's configuration (``read_model_config``, plus ``--adapter-option`` s).

    Returns:
        The bound adapter; for a built-in whose record implies ``dequantize`` (the
        ``hf-to-torchtitan-*`` ones), chained after ``transform.fp8.dequantize_rules``, so a
        block-FP8 folder's weights reach it as float32 without their scales (an unquantized folder
        passes unchanged). Its record's ``nest`` is its attribute ``nest``, and its ``values`` and
        ``files``, bound to ``config``, are zero-argument callables ``values`` and ``files``.

    Raises:
        InvalidOptionError: an unknown name (the message lists the built-in ones), or a user module
            that does not import or lacks the function.
    """
    if ":" in name:
        function = load_user_function(name)
    else:
        found = ADAPTERS.get(name)
        if found is None:
            known = ", ".join(ADAPTERS)
            raise InvalidOptionError(
                f"--adapter {name!r}: unknown; use one of {known}, or module:function for your own "
                "(fsdp-convert adapters says what each reads)"
            )
        function = found
    bound = partial(function, config=dict(config or {}))
    record = adapter_record(name)  # None for module:function
    adapter: Any = bound
    if record is not None and DEQUANTIZE in record.implies:
        adapter = with_fp8(bound, dequantize=True) or bound
    if record is not None and record.nest:
        adapter.nest = record.nest  # read by transform.build_items for reshard's keys (a partial keeps attributes)
    if record is not None and record.values is not None:
        adapter.values = partial(record.values, dict(config or {}))  # read by transform.build_items, for reshard
    if record is not None and record.files is not None:
        adapter.files = partial(record.files, dict(config or {}))  # read by ops.reshard, at its finish
    return cast(Adapter, adapter)


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
