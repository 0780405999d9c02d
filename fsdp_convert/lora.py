"""Transform stage, LoRA: PEFT adapter FQNs to merged base names or to an adapter folder's, and the merge's math.

Names and formula as PEFT 0.21.2 writes them (``peft/tuners/lora/layer.py``,
``peft/utils/save_and_load.py``). A ``PeftModel``'s state dict (and so an FSDP2 checkpoint of
one) holds, for each adapted ``nn.Linear`` ``<module>``:

- ``base_model.model.<module>.base_layer.weight``, shape ``(out, in)`` (and ``.bias``): the frozen base;
- ``base_model.model.<module>.lora_A.<adapter>.weight``, shape ``(r, in)``;
- ``base_model.model.<module>.lora_B.<adapter>.weight``, shape ``(out, r)``;

every other weight as ``base_model.model.<fqn>``. ``merge_and_unload()`` gives the base model back
with ``W + scaling * (B @ A)`` under ``<module>.weight``, ``scaling = lora_alpha / r``
(``lora_alpha / sqrt(r)`` with ``use_rslora``); ``save_pretrained`` writes
``adapter_model.safetensors`` with the LoRA tensors only, named without the adapter
(``base_model.model.<module>.lora_A.weight``), beside ``adapter_config.json``.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

from fsdp_convert.derive import Derived, Input, TensorInfo, copy_of
from fsdp_convert.errors import InvalidOptionError, UnsupportedTransformError
from fsdp_convert.formats.index import CheckpointIndex
from fsdp_convert.item import OutputItem
from fsdp_convert.output_table import ADAPTER_CONFIG_FILENAME
from fsdp_convert.producers import classify
from fsdp_convert.transform import TransformOptions, clean_fqn

if TYPE_CHECKING:
    import torch

__all__ = [
    "LoraMode",
    "LoraOptions",
    "LoraTarget",
    "PEFT_PREFIX",
    "lora_scale",
    "read_lora_config",
    "lora_options",
    "merge_rows",
    "lora_targets",
    "adapter_config",
    "LoraMerge",
    "LoraAdapter",
    "lora_only",
    "write_adapter_config",
]

LoraMode = Literal["merge", "only"]
PEFT_PREFIX = "base_model.model."  # PeftModel.base_model (LoraModel) .model (the wrapped transformers model)
_LORA = ("lora_A", "lora_B")
_BASE = "base_layer"
# PEFT config fields this tool cannot honour: each changes the merge or the names it would write.
_REFUSED = {
    "use_dora": "DoRA's magnitude vector",
    "fan_in_fan_out": "fan_in_fan_out (Conv1D weights, stored transposed)",
    "rank_pattern": "per-module ranks (rank_pattern)",
    "alpha_pattern": "per-module alphas (alpha_pattern)",
    "lora_bias": "lora_B biases (lora_bias)",
    "modules_to_save": "modules_to_save",
}


@dataclass(frozen=True, slots=True, kw_only=True)
class LoraOptions:
    """What ``--merge-lora`` / ``--lora-only`` ask for.

    Attributes:
        mode: ``merge`` writes ``W + scale * B @ A`` under the base names and drops the adapter;
            ``only`` writes the adapter alone, named as PEFT's ``save_pretrained`` names it.
        alpha: ``lora_alpha``; None: not given (``merge`` needs it).
        r: the rank; None: read from the ``lora_A`` shapes (all must agree).
        use_rslora: scale by ``alpha / sqrt(r)`` instead of ``alpha / r``.
        config: the ``adapter_config.json`` read (written back as the ``only`` folder's), or None.
    """

    mode: LoraMode
    alpha: float | None = None
    r: int | None = None
    use_rslora: bool = False
    config: dict[str, Any] | None = field(default=None, compare=False)


@dataclass(frozen=True, slots=True, kw_only=True)
class LoraTarget:
    """What becomes of one model entry under a LoRA option.

    Attributes:
        fqn: the output FQN (before ``--rename``).
        lora_a: for a merged base weight, the index of its ``lora_A`` entry, shape ``(r, in)``; else None.
        lora_b: likewise its ``lora_B`` entry, shape ``(out, r)``.
        scale: the merge's ``scaling`` (``lora_scale``); 0.0 when nothing is merged.
    """

    fqn: str
    lora_a: int | None = None
    lora_b: int | None = None
    scale: float = 0.0


def lora_scale(alpha: float, r: int, use_rslora: bool = False) -> float:
    """PEFT's ``LoraLayer.update_layer`` scaling: ``alpha / r``, or ``alpha / sqrt(r)`` with ``use_rslora``.

    Raises:
        InvalidOptionError: ``r`` not positive.
    """
    if r <= 0:
        raise InvalidOptionError(f"--lora-r {r}: the LoRA rank must be positive")
    return alpha / math.sqrt(r) if use_rslora else alpha / r


def read_lora_config(path: str | os.PathLike[str]) -> dict[str, Any]:
    """Read a PEFT ``adapter_config.json`` (parsed as JSON, nothing else) and check this tool can honour it.

    Raises:
        InvalidOptionError: unreadable, not JSON, not a LoRA config (``peft_type`` other than
            ``LORA``), no ``r`` / ``lora_alpha``, or a field that changes the merge or the names
            (DoRA, ``fan_in_fan_out``, ``rank_pattern``, ``alpha_pattern``, ``lora_bias``,
            ``modules_to_save``).
    """
    try:
        with open(path, encoding="utf-8") as f:
            config = json.load(f)
    except (OSError, ValueError) as e:
        raise InvalidOptionError(f"--lora-config {os.fspath(path)}: cannot read it as JSON ({e})") from e
    if not isinstance(config, dict):
        raise InvalidOptionError(f"--lora-config {os.fspath(path)}: expected a JSON object, got {type(config).__name__}")
    if config.get("peft_type", "LORA") != "LORA":
        raise InvalidOptionError(f"--lora-config {os.fspath(path)}: peft_type is {config['peft_type']!r}, not LORA")
    for key in ("r", "lora_alpha"):
        if not isinstance(config.get(key), (int, float)) or isinstance(config.get(key), bool):
            raise InvalidOptionError(f"--lora-config {os.fspath(path)}: no numeric {key!r}")
    for key, what in _REFUSED.items():
        if config.get(key):
            raise InvalidOptionError(f"--lora-config {os.fspath(path)}: {what} is not supported ({key}={config[key]!r})")
    return config


def lora_options(
    mode: LoraMode,
    *,
    config_path: str | os.PathLike[str] | None = None,
    alpha: float | None = None,
    r: int | None = None,
    use_rslora: bool | None = None,
) -> LoraOptions:
    """``LoraOptions`` from ``--lora-config`` and the flags; a flag given beside the config must agree with it.

    Raises:
        InvalidOptionError: as ``read_lora_config``; a flag that contradicts the config; ``merge``
            without an alpha; a rank that is not positive.
    """
    config = read_lora_config(config_path) if config_path is not None else None
    if config is not None:
        given = {"--lora-alpha": (alpha, config["lora_alpha"]), "--lora-r": (r, config["r"])}
        for flag, (flag_value, value) in given.items():
            if flag_value is not None and flag_value != value:
                raise InvalidOptionError(f"{flag} {flag_value} contradicts --lora-config's {value}")
        alpha, r = float(config["lora_alpha"]), int(config["r"])
        use_rslora = bool(config.get("use_rslora", False)) if use_rslora is None else use_rslora
    if mode == "merge" and alpha is None:
        raise InvalidOptionError(
            "--merge-lora needs the adapter's lora_alpha: pass --lora-config adapter_config.json or --lora-alpha"
        )
    if r is not None:
        lora_scale(1.0, r)  # a positive rank
    return LoraOptions(mode=mode, alpha=alpha, r=r, use_rslora=bool(use_rslora), config=config)


def merge_rows(w: torch.Tensor, b: torch.Tensor, a: torch.Tensor, scale: float, dtype: torch.dtype) -> torch.Tensor:
    """Rows of a merged weight: ``W + (B @ A) * scale``, computed in float32 and cast to ``dtype``.

    PEFT's ``Linear.get_delta_weight`` computes ``(B @ A) * scaling`` and ``merge`` adds it to the
    base weight; for float32 tensors this is the same sequence of float32 operations, row for row.

    Args:
        w: base weight rows, shape ``(rows, in)``, any floating dtype.
        b: the same rows of ``lora_B``, shape ``(rows, r)``.
        a: all of ``lora_A``, shape ``(r, in)``.
        scale: ``lora_scale(alpha, r, use_rslora)``.
        dtype: output dtype.

    Returns:
        Shape ``(rows, in)``, ``dtype``.

    Raises:
        ValueError: the shapes do not chain.
    """
    if w.shape != (b.shape[0], a.shape[1]) or b.shape[1] != a.shape[0]:
        raise ValueError(f"LoRA shapes do not chain: W {tuple(w.shape)}, B {tuple(b.shape)}, A {tuple(a.shape)}")
    return (w.float() + (b.float() @ a.float()) * scale).to(dtype)


def _split(fqn: str) -> tuple[str, str, str | None, str] | None:
    """``(module, kind, adapter, tail)`` of a PEFT LoRA or base-layer FQN; None for any other."""
    parts = fqn.split(".")
    for k, part in enumerate(parts):
        if part in _LORA and k + 2 < len(parts):
            return ".".join(parts[:k]), part, parts[k + 1], ".".join(parts[k + 2 :])
        if part == _BASE and k + 1 < len(parts):
            return ".".join(parts[:k]), part, None, ".".join(parts[k + 1 :])
    return None


def _refuse_other_peft(fqn: str) -> None:
    parts = fqn.split(".")
    other = next((p for p in parts if p.startswith("lora_") or p in ("modules_to_save", "original_module")), None)
    if other is not None:
        raise UnsupportedTransformError(
            f"{fqn}: PEFT's {other} is not supported (only nn.Linear LoRA: lora_A, lora_B and base_layer)"
        )


def lora_targets(fqns: Mapping[int, str], shapes: Mapping[int, tuple[int, ...]], options: LoraOptions) -> dict[int, LoraTarget]:
    """The model entries kept under a LoRA option, by entry index, with their output FQNs.

    ``merge``: each ``<module>.base_layer.<tail>`` becomes ``<module>.<tail>`` (its ``weight``
    merged with the module's ``lora_A``/``lora_B``), every FQN loses ``base_model.model.``, and
    the adapter's tensors are dropped: ``merge_and_unload()``'s names. ``only``: just the adapter's
    tensors, as ``<PEFT_PREFIX><module>.lora_A.weight`` (the prefix added if the checkpoint's FQNs
    lack it), ``save_pretrained``'s names.

    Args:
        fqns: every model entry's FQN, wrapper names removed, by entry index.
        shapes: their shapes.
        options: the LoRA options.

    Raises:
        UnsupportedTransformError: no LoRA tensor at all; two adapters; a ``lora_A`` without its
            ``lora_B`` or base weight (or the reverse); a tail other than ``weight``; shapes that do
            not chain (A ``(r, in)``, B ``(out, r)``, W ``(out, in)``); an ``r`` that differs from
            ``options.r``; another PEFT tensor (DoRA, embeddings, ``modules_to_save``). Each names the FQN.
        InvalidOptionError: ``merge`` without ``options.alpha``.
    """
    parsed = {i: _split(fqn) for i, fqn in fqns.items()}
    adapters = sorted({p[2] for p in parsed.values() if p is not None and p[2] is not None})
    if not adapters:
        raise UnsupportedTransformError("no PEFT LoRA tensor (<module>.lora_A.<adapter>.weight) in the checkpoint's model")
    if len(adapters) > 1:
        raise UnsupportedTransformError(f"the checkpoint holds several LoRA adapters ({', '.join(adapters)}); one is supported")
    modules: dict[str, dict[str, int]] = {}
    for i, p in parsed.items():
        if p is None:
            _refuse_other_peft(fqns[i])
            continue
        module, kind, _, tail = p
        if tail != "weight" and not (kind == _BASE and tail == "bias"):
            raise UnsupportedTransformError(f"{fqns[i]}: unexpected PEFT tensor (expected {kind}.weight)")
        modules.setdefault(module, {})[kind if tail == "weight" else "bias"] = i
    for module, parts in modules.items():
        _check_module(module, parts, fqns, shapes, options)
    prefixed = all(f.startswith(PEFT_PREFIX) for f in fqns.values())
    out: dict[int, LoraTarget] = {}
    for i, fqn in fqns.items():
        p = parsed[i]
        if options.mode == "only":
            if p is not None and p[1] in _LORA:
                out[i] = LoraTarget(fqn=("" if prefixed else PEFT_PREFIX) + f"{p[0]}.{p[1]}.{p[3]}")
            continue
        bare = fqn.removeprefix(PEFT_PREFIX) if prefixed else fqn
        if p is None:
            out[i] = LoraTarget(fqn=bare)
        elif p[1] == _BASE:
            parts = modules[p[0]]
            name = bare.replace(f".{_BASE}.", ".", 1) if f".{_BASE}." in bare else bare.removeprefix(f"{_BASE}.")
            if p[3] != "weight":
                out[i] = LoraTarget(fqn=name)
                continue
            if options.alpha is None:
                raise InvalidOptionError(f"{fqn}: merging a LoRA adapter needs its lora_alpha (--lora-alpha or --lora-config)")
            scale = lora_scale(options.alpha, shapes[parts["lora_A"]][0], options.use_rslora)
            out[i] = LoraTarget(fqn=name, lora_a=parts["lora_A"], lora_b=parts["lora_B"], scale=scale)
    return out


def _check_module(
    module: str, parts: dict[str, int], fqns: Mapping[int, str], shapes: Mapping[int, tuple[int, ...]], options: LoraOptions
) -> None:
    """One adapted module's entries: all three there, their shapes chained, the rank as told."""
    where = fqns[next(iter(parts.values()))]
    for kind in (*_LORA, _BASE):
        if kind not in parts:
            raise UnsupportedTransformError(f"{where}: module {module or '(root)'} has no {kind}.weight beside it")
    a, b, w = (shapes[parts[k]] for k in (*_LORA, _BASE))
    if len(a) != 2 or len(b) != 2 or len(w) != 2 or b[1] != a[0] or w != (b[0], a[1]):
        raise UnsupportedTransformError(
            f"{fqns[parts['lora_A']]}: shapes do not chain: lora_A {a}, lora_B {b}, base weight {w} "
            "(expected (r, in), (out, r), (out, in))"
        )
    if options.r is not None and a[0] != options.r:
        raise UnsupportedTransformError(f"{fqns[parts['lora_A']]}: rank {a[0]}, but --lora-r / --lora-config say r={options.r}")


def adapter_config(options: LoraOptions, adapter: Mapping[str, tuple[int, ...]], model_fqns: list[str]) -> dict[str, Any]:
    """The ``adapter_config.json`` of a ``--lora-only`` folder.

    The ``--lora-config`` file as read, if given; otherwise a LoRA config from the flags and the
    shapes: ``r`` (from the ``lora_A`` shapes when not given), ``lora_alpha`` (``r`` when not
    given, noted nowhere else), ``use_rslora`` and ``target_modules``: the modules' last names
    (``q_proj``) when every module so named carries the adapter, else their full names (which
    PEFT matches exactly). PEFT's ``LoraConfig`` fills in every other field with its default.

    Args:
        options: the LoRA options.
        adapter: the adapter's output FQNs (``base_model.model.<module>.lora_A.weight``) and shapes.
        model_fqns: every model FQN of the checkpoint, wrapper names removed.

    Raises:
        UnsupportedTransformError: without ``--lora-r`` or a config, ``lora_A`` ranks that differ
            (PEFT's ``rank_pattern``, which this tool does not write).
    """
    if options.config is not None:
        return dict(options.config)
    ranks = {shape[0]: fqn for fqn, shape in adapter.items() if fqn.endswith(".lora_A.weight")}
    if options.r is None and len(ranks) > 1:
        raise UnsupportedTransformError(
            f"{', '.join(sorted(ranks.values())[:2])}: LoRA ranks differ ({sorted(ranks)}); pass --lora-config"
        )
    r = options.r if options.r is not None else next(iter(ranks))
    modules = sorted({f.removeprefix(PEFT_PREFIX).rsplit(".", 2)[0] for f in adapter})
    every = {m for f in model_fqns if (s := _split(f)) is not None and (m := s[0].removeprefix(PEFT_PREFIX))}
    every |= {f.removeprefix(PEFT_PREFIX).rsplit(".", 1)[0] for f in model_fqns if _split(f) is None}
    short = {m.rsplit(".", 1)[-1] for m in modules}
    whole = all(m in modules for m in every if m.rsplit(".", 1)[-1] in short)
    return {
        "peft_type": "LORA",
        "r": r,
        "lora_alpha": options.alpha if options.alpha is not None else r,
        "use_rslora": options.use_rslora,
        "target_modules": sorted(short) if whole else modules,
        "bias": "none",
        "fan_in_fan_out": False,
        "lora_dropout": 0.0,
        "inference_mode": True,
        "task_type": None,
        "base_model_name_or_path": None,
    }


@dataclass(frozen=True, slots=True)
class LoraMerge:
    """A ``derive.Derived`` combine: rows of ``W + (B @ A) * scale`` in float32 (the mover casts).

    Parts, in order: ``W``'s rows ``(rows, in)``, ``B``'s same rows ``(rows, r)``, ``A`` whole ``(r, in)``.
    """

    scale: float

    def __call__(self, parts: Sequence[torch.Tensor]) -> torch.Tensor:
        """The block's merged rows, float32, shape ``(rows, in)``."""
        import torch

        w, b, a = parts
        return merge_rows(w, b, a, self.scale, torch.float32)


@dataclass(frozen=True, slots=True)
class LoraAdapter:
    """``--merge-lora`` / ``--lora-only`` as a ``derive.Adapter``: the model's tensors to the output's.

    ``merge``: every tensor copied under its ``merge_and_unload()`` name, each adapted base weight
    derived as ``LoraMerge`` (``W`` and ``B`` read by row blocks aligned with the output's rows,
    ``A`` whole), the adapter's tensors left out. ``only``: the adapter's tensors alone, copied
    under ``save_pretrained``'s names. See ``lora_targets`` for the names and the errors raised.
    """

    options: LoraOptions

    def __call__(self, tensors: Sequence[TensorInfo]) -> dict[str, Derived]:
        """Every output tensor by output FQN, in the checkpoint's order."""
        fqns = {i: t.fqn for i, t in enumerate(tensors)}
        targets = lora_targets(fqns, {i: t.shape for i, t in enumerate(tensors)}, self.options)
        out: dict[str, Derived] = {}
        for i, target in sorted(targets.items()):
            info = tensors[i]
            if target.lora_a is None or target.lora_b is None:
                out[target.fqn] = copy_of(info)
                continue
            inputs = (Input(fqn=info.fqn), Input(fqn=fqns[target.lora_b]), Input(fqn=fqns[target.lora_a], rows=None))
            out[target.fqn] = Derived(inputs=inputs, shape=info.shape, dtype=info.dtype, combine=LoraMerge(target.scale))
        return out


def lora_only(options: TransformOptions) -> LoraOptions | None:
    """The LoRA options when ``options`` asks for ``--lora-only`` (a PEFT adapter folder), else None."""
    adapter = options.adapter
    return adapter.options if isinstance(adapter, LoraAdapter) and adapter.options.mode == "only" else None


def write_adapter_config(
    folder: str | os.PathLike[str], lora: LoraOptions, index: CheckpointIndex, items: Sequence[OutputItem]
) -> None:
    """Write a ``--lora-only`` folder's ``adapter_config.json`` (``adapter_config``) and fsync it. Rank 0 only.

    Args:
        folder: the output folder, beside its ``adapter_model.safetensors``.
        lora: the LoRA options.
        index: the checkpoint (every model FQN, for ``target_modules``).
        items: the output items (the adapter's tensors, under their output names).

    Raises:
        As ``adapter_config``; OSError: the file cannot be written.
    """
    fqns = [clean_fqn(str(s.param)) for s in classify(index) if s.role == "model"]
    adapter = {str(item.path[-1]): item.shape for item in items if item.group == "model" and item.is_tensor}
    config = adapter_config(lora, adapter, fqns)
    with open(os.path.join(folder, ADAPTER_CONFIG_FILENAME), "x", encoding="utf-8") as f:
        f.write(json.dumps(config, indent=2, sort_keys=True) + "\n")
        f.flush()
        os.fsync(f.fileno())
