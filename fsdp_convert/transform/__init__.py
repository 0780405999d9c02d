"""Transform stage: checkpoint entries to output items, with FQNs cleaned, renamed, filtered, re-keyed and cast.

Pure functions over an index, its ``roles.EntryRole`` per entry, and the few small param group values
the caller has read (the ``params`` lists, and every field of a flattened optimizer state dict).
A consolidation's output is the nested layout ``{"model": {fqn: tensor}, <optimizer>: {"state":
{...}, "param_groups": [...]}, <other top-level keys as saved>}``, whatever nesting the producer
used; ``<optimizer>`` is the producer's own name for it (``optim``, ``optimizer``) in the
``producer`` layout, ``optim`` in the ``nested`` one. What to do is a ``TransformOptions``
(``transform.options``, re-exported here).
"""

from __future__ import annotations

import fnmatch
import functools
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from fsdp_convert.derive import Sourced, TensorInfo, apply_adapter
from fsdp_convert.dtypes import UNCASTABLE, DType, as_dtype
from fsdp_convert.errors import InvalidOptionError, UnsupportedTransformError
from fsdp_convert.formats.index import BytesEntry, CheckpointIndex, DictKey, Entry, ObjPath, TensorEntry, dcp_key
from fsdp_convert.item import OutputItem
from fsdp_convert.roles import EntryRole, Group
from fsdp_convert.transform import fp8
from fsdp_convert.transform.options import Layout, OptimKeys, TransformOptions, parse_dtype, parse_rename
from fsdp_convert.transform.unstack import LayerSplit

if TYPE_CHECKING:
    import torch

__all__ = [
    "WRAPPER_NAMES",
    "OptimKeys",
    "Layout",
    "TransformOptions",
    "parse_rename",
    "parse_dtype",
    "clean_fqn",
    "dcp_key",
    "needs_group_values",
    "build_items",
]

# Module names that wrappers insert into FQNs: FSDP1, activation checkpointing, torch.compile.
WRAPPER_NAMES = ("_fsdp_wrapped_module", "_checkpoint_wrapped_module", "_orig_mod")
DDP_PREFIX = "module"
NESTED_OPTIM_TOP = "optim"


def clean_fqn(fqn: str, *, keep_wrapper_names: bool = False) -> str:
    """Remove wrapper module names from an FQN, as ``model.state_dict()`` of the unwrapped model has it.

    ``_fsdp_wrapped_module.``, ``_checkpoint_wrapped_module.`` and ``_orig_mod.`` go wherever they
    stand; ``module.`` only at the start (DDP). ``layers.0._checkpoint_wrapped_module.attn.weight``
    becomes ``layers.0.attn.weight``.
    """
    if keep_wrapper_names:
        return fqn
    parts = [p for p in fqn.split(".") if p not in WRAPPER_NAMES]
    if len(parts) > 1 and parts[0] == DDP_PREFIX:
        parts = parts[1:]
    return ".".join(parts)


def needs_group_values(slots: tuple[EntryRole, ...]) -> list[int]:
    """Indices of the entries whose values ``build_items`` needs (all small plain values).

    Those are the param groups' ``params`` lists and every per-parameter field of a flattened
    optimizer state dict.
    """
    return [i for i, s in enumerate(slots) if s.role == "optim_group" and (s.key == "params" or s.group is None)]


def _param_namer(options: TransformOptions) -> Callable[[str], str]:
    compiled = [(re.compile(p), r) for p, r in options.renames]

    def name(fqn: str) -> str:
        out = clean_fqn(fqn, keep_wrapper_names=options.keep_wrapper_names)
        for pattern, replacement in compiled:
            try:
                out = pattern.sub(replacement, out)
            except (re.error, IndexError) as e:
                raise InvalidOptionError(f"--rename {pattern.pattern}={replacement}: {e} (on {fqn})") from e
        return out

    return name


def _selected(fqn: str, options: TransformOptions) -> bool:
    if options.include and not any(fnmatch.fnmatchcase(fqn, g) for g in options.include):
        return False
    return not any(fnmatch.fnmatchcase(fqn, g) for g in options.exclude)


def _cast(entry: Entry, dtype: torch.dtype | DType | None, keep: bool = False, src: DType | None = None) -> DType | None:
    if not isinstance(entry, TensorEntry):
        return None
    source = as_dtype(src) if src is not None else entry.dtype  # a derived tensor's own dtype
    if dtype is None or keep or not source.is_floating_point or source.name in UNCASTABLE:
        return source  # complex, integer, bool and float4 (torch has no cast for it) are kept
    return as_dtype(dtype)


@dataclass
class _ParamGroup:
    """A param group being rebuilt: its fields in order (entry index, value) and its params."""

    fields: dict[str, tuple[int, Any]]
    params: list[str | int]


def _nested_groups(index: CheckpointIndex, slots: tuple[EntryRole, ...], values: Mapping[int, Any]) -> dict[int, _ParamGroup]:
    groups: dict[int, _ParamGroup] = {}
    for i, slot in enumerate(slots):
        if slot.role != "optim_group" or slot.group is None:
            continue
        group = groups.setdefault(slot.group, _ParamGroup({}, []))
        assert slot.key is not None
        group.fields[slot.key] = (i, None)
        if slot.key == "params":
            params = values[i]
            if not isinstance(params, (list, tuple)) or not all(isinstance(p, (str, int)) for p in params):
                raise UnsupportedTransformError(
                    f"{index.entries[i].fqn}: a param group's params should be a list of FQNs or ids, got {type(params).__name__}"
                )
            group.params = list(params)
    return groups


def _flattened_groups(index: CheckpointIndex, slots: tuple[EntryRole, ...], values: Mapping[int, Any]) -> dict[int, _ParamGroup]:
    """Regroup ``param_groups.<fqn>.<field>`` values: consecutive parameters with equal fields share a group.

    torch's ``_flatten_optim_state_dict`` copies every field of a group to each of its parameters,
    in group order, so this restores the groups. Two adjacent groups with identical fields cannot
    be told apart and become one: ``set_optimizer_state_dict`` loads that the same, but
    ``torch.optim.Optimizer.load_state_dict`` on an optimizer built with both groups refuses the
    group count (build it with one group, or merge them).
    """
    per_param: dict[str, dict[str, tuple[int, Any]]] = {}
    for i, slot in enumerate(slots):
        if slot.role == "optim_group" and slot.group is None:
            assert isinstance(slot.param, str) and slot.key is not None
            per_param.setdefault(slot.param, {})[slot.key] = (i, values[i])
    groups: dict[int, _ParamGroup] = {}
    previous: dict[str, Any] | None = None
    for fqn, fields in per_param.items():
        plain = {k: v for k, (_, v) in fields.items()}
        if previous is None or plain != previous:
            groups[len(groups)] = _ParamGroup(dict(fields), [])
            previous = plain
        groups[len(groups) - 1].params.append(fqn)
    return groups


def build_items(
    index: CheckpointIndex,
    slots: tuple[EntryRole, ...],
    options: TransformOptions,
    values: Mapping[int, Any],
    *,
    groups: tuple[Group, ...] = ("model", "optim", "other"),
    keep_layout: bool = False,
    params_in_model_order: bool = False,
) -> tuple[OutputItem, ...]:
    """The output items of a conversion, in output order: model, optimizer state, param groups, other.

    With ``keep_layout`` false (``consolidate``) the output has the nested layout ``{"model": ...,
    "optim": {"state": ..., "param_groups": [...]}}``, the optimizer's top-level key as saved
    (``optimizer``) when ``options.layout`` is ``producer``. With it true (``reshard``) every item keeps
    its producer's nesting (top-level weights, ``optimizer``, a flattened optimizer state dict) so
    the producer's own loader reads the output; only FQNs, ids and dtypes change. An adapter's
    outputs are filed under its ``nest``, followed there by its ``values`` (``adapters.AdapterRecord``).

    Args:
        index: the checkpoint.
        slots: ``producers.classify(index)``.
        options: renames, filters, re-keying, casts.
        values: the value of every entry ``needs_group_values`` lists, by entry index.
        groups: which groups to produce.
        keep_layout: keep the producer's nesting (see above).
        params_in_model_order: for ``ids``, number each group's params in the model's order rather
            than the saved one (FSDP1, whose saved order can be its flat parameters'); otherwise
            the saved order is the optimizer's own, and ids follow it as torch.optim does.

    Raises:
        InvalidOptionError: two FQNs become the same output key (names both), a ``--rename``
            replacement fails on an FQN (an unknown group reference), or ``unstack_layers`` for a
            producer that stacks no layers.
        UnsupportedTransformError: ``ids`` asked of optimizer state whose parameters no param
            group lists, a ``params`` value that is not a list of FQNs or ids, or a stacked tensor
            (or its optimizer state) with no layer dim to split (``transform.unstack``).
    """
    name = _param_namer(options)
    keep = options.keep_wrapper_names
    layers = (
        LayerSplit.of(index, slots, functools.partial(clean_fqn, keep_wrapper_names=keep))
        if options.unstack_layers
        else LayerSplit()
    )
    items: list[OutputItem] = []
    if options.adapter is not None:  # model weights only: optimizer and other state keep the old FQNs, left out
        groups = tuple(g for g in groups if g == "model")
    nest: tuple[str, ...] = getattr(options.adapter, "nest", ())  # where reshard files an adapter's outputs
    if "model" in groups:
        seen: dict[str, str] = {}
        for entry, out, derived, sources in _model_sources(index, slots, options, name, layers):
            if out in seen:
                raise InvalidOptionError(f"{seen[out]} and {entry.fqn} would both be written as model key {out!r}")
            seen[out] = entry.fqn
            prefix = entry.path[:1] if keep_layout and entry.path[0] == "model" else () if keep_layout else ("model",)
            prefix = nest if keep_layout and nest else prefix
            dtype = _cast(entry, options.dtype, keep=fp8.keeps_dtype(derived), src=derived.dtype if derived else None)
            item = OutputItem(entry=entry, path=(*prefix, out), group="model", dtype=dtype, derived=derived, sources=sources)
            items.append(item)
        if keep_layout and (extra := getattr(options.adapter, "values", None)) is not None:
            items += _adapter_values(extra(), nest, seen, items[0].entry if items else None)
    if "optim" in groups:
        items += _optim_items(index, slots, options, values, name, keep_layout, params_in_model_order, layers)
    if "other" in groups:
        for i, slot in enumerate(slots):
            if slot.role == "other":
                entry = index.entries[i]
                items.append(OutputItem(entry=entry, path=entry.path, group="other", dtype=_cast(entry, None)))
    return tuple(items)


def _adapter_values(
    values: Mapping[str, Any], nest: tuple[str, ...], seen: Mapping[str, str], near: Entry | None
) -> list[OutputItem]:
    """The bytes entries an adapter adds for ``reshard`` (``AdapterRecord.values``), as constant model items under ``nest``.

    Each goes to the DCP folder of ``near`` (the first model item's source: the adapter's tensors' folder).

    Raises:
        InvalidOptionError: a value's FQN is also one of the adapter's outputs.
    """
    if isinstance(near, TensorEntry):
        folder_of = next((c.relative_path for c in near.chunks if c.relative_path is not None), "")
    else:
        folder_of = near.relative_path if isinstance(near, BytesEntry) else ""
    items = []
    for fqn, value in values.items():
        if fqn in seen:
            raise InvalidOptionError(f"the adapter writes {fqn!r} both as a tensor (from {seen[fqn]}) and as a value")
        path = (*nest, fqn)
        entry = BytesEntry(fqn=dcp_key(path), path=path, relative_path=folder_of, offset_bytes=0, length_bytes=0)
        items.append(OutputItem(entry=entry, path=path, group="model", constant=True, value=value))
    return items


def _model_sources(
    index: CheckpointIndex,
    slots: tuple[EntryRole, ...],
    options: TransformOptions,
    name: Callable[[str], str],
    layers: LayerSplit,
) -> list[Sourced]:
    """The selected model entries as ``(entry, output FQN, derived, sources)`` (``derive.apply_adapter``).

    Selection (``include``/``exclude``) sees the FQN with wrapper names removed; then ``name``
    (wrapper names, ``renames``) makes each FQN, and only then does the adapter map those names:
    ``--rename`` can bring a checkpoint's names to the ones an adapter knows. With
    ``--unstack-layers`` a stacked tensor is one output per layer, named before ``renames``.

    Raises:
        InvalidOptionError: two FQNs renamed to one name before the adapter (it would see one tensor).
    """
    selected: list[tuple[Entry, str]] = []
    params: list[str] = []
    renamed: dict[str, str] = {}
    for i, slot in enumerate(slots):
        if slot.role == "model":
            assert isinstance(slot.param, str)
            if not _selected(clean_fqn(slot.param, keep_wrapper_names=options.keep_wrapper_names), options):
                continue
            entry, fqn = index.entries[i], name(slot.param)
            if (options.adapter is not None or options.dequantize or options.quantize) and fqn in renamed:
                raise InvalidOptionError(f"{renamed[fqn]} and {entry.fqn} would both reach --adapter as {fqn!r}")
            renamed[fqn] = entry.fqn
            selected.append((entry, fqn))
            params.append(slot.param)
    adapter = fp8.with_fp8(options.adapter, dequantize=options.dequantize, quantize=options.quantize is not None)
    if options.dtype is not None and not fp8.dequantizes(adapter):
        if quantized := fp8.quantized_fqns([_info(e, fqn) for e, fqn in selected]):
            raise InvalidOptionError(f"{quantized[0]} is block FP8 (with {fp8.SCALE_SUFFIX}): --dtype needs --dequantize")
    if adapter is None:
        return [
            out for (entry, fqn), p in zip(selected, params, strict=True) for out in layers.model_outputs(entry, fqn, p, name)
        ]
    return apply_adapter(adapter, selected)


def _info(entry: Entry, fqn: str) -> TensorInfo:
    """``entry`` as a ``derive.TensorInfo`` under ``fqn`` (a non-tensor as a 0-dim ``uint8``, never quantized)."""
    if isinstance(entry, TensorEntry):
        return TensorInfo(fqn, entry.dtype, entry.shape)
    return TensorInfo(fqn, DType("uint8"), ())


def _optim_top(entry: Entry, options: TransformOptions) -> str | int:
    """The optimizer's top-level key in a consolidation: as saved (``producer``) or ``optim`` (``nested``)."""
    return entry.path[0] if options.layout == "producer" else NESTED_OPTIM_TOP


def _optim_items(
    index: CheckpointIndex,
    slots: tuple[EntryRole, ...],
    options: TransformOptions,
    values: Mapping[int, Any],
    name: Callable[[str], str],
    keep_layout: bool,
    params_in_model_order: bool,
    layers: LayerSplit,
) -> list[OutputItem]:
    flattened = any(s.role == "optim_group" and s.group is None for s in slots)
    if flattened and keep_layout and options.optim_keys == "ids":
        raise UnsupportedTransformError(
            "a flattened optimizer state dict (flatten_optimizer_state_dict=True, as torchtitan saves) "
            "is keyed by FQN only; reshard it with --optim-keys names"
        )
    groups = _flattened_groups(index, slots, values) if flattened else _nested_groups(index, slots, values)
    if options.optim_keys == "ids" and params_in_model_order:
        # FSDP1 with use_orig_params=False lists a group's params in flat-parameter order, not in
        # the order the unwrapped model's parameters() gives, which torch.optim numbers by.
        model_order = {clean_fqn(str(s.param)): k for k, s in enumerate(slots) if s.role == "model"}
        for group in groups.values():
            group.params.sort(key=lambda p: model_order.get(clean_fqn(str(p)), len(model_order)))
    order = [p for g in sorted(groups) for p in groups[g].params]
    ids = {p: k for k, p in enumerate(order)}

    saved_ids = any(isinstance(p, int) for g in groups.values() for p in g.params)

    def state_key(param: str | int, entry: Entry) -> str | int:
        if isinstance(param, str) and saved_ids and param.isdigit():
            param = int(param)  # DCP stores dict keys as strings: optim.state_dict()'s ids come back as "0"
        if isinstance(param, int):
            return DictKey(param)
        if options.optim_keys == "ids":
            if param not in ids:
                raise UnsupportedTransformError(
                    f"{entry.fqn}: no param group lists parameter {param!r}, so it has no id; use --optim-keys names"
                )
            return DictKey(ids[param])
        return name(param)

    state: list[tuple[int, OutputItem]] = []
    seen: dict[tuple[Any, ...], str] = {}
    for i, slot in enumerate(slots):
        if slot.role != "optim_state":
            continue
        entry = index.entries[i]
        assert slot.param is not None and slot.key is not None
        for param, derived, sources in layers.state_outputs(entry, slot.param):  # the parameter, or each of its layers
            key = state_key(param, entry)
            tail: ObjPath = entry.path[3:] if len(entry.path) >= 4 else (slot.key,)
            if (key, *tail) in seen:
                raise InvalidOptionError(f"{seen[(key, *tail)]} and {entry.fqn} would both be written as optimizer state {key!r}")
            seen[(key, *tail)] = entry.fqn
            dtype = _cast(entry, options.optim_dtype, keep=slot.key == "step")
            if not keep_layout:
                path: ObjPath = (_optim_top(entry, options), "state", key, *tail)
            elif len(entry.path) == 2:  # flattened: "state.<fqn>.<name>"
                path = (entry.path[0], f"state.{key}.{slot.key}")
            else:
                path = (entry.path[0], "state", key, *tail)
            item = OutputItem(entry=entry, path=path, group="optim", dtype=dtype, derived=derived, sources=sources)
            state.append((key if isinstance(key, int) and options.optim_keys == "ids" else len(state), item))
    items = [item for _, item in sorted(state, key=lambda pair: pair[0])]  # stable: ids order, else as saved

    if flattened and keep_layout:  # each parameter's copy of its group's fields, renamed
        for i, slot in enumerate(slots):
            if slot.role == "optim_group":
                entry = index.entries[i]
                assert isinstance(slot.param, str)
                path = (entry.path[0], f"param_groups.{name(slot.param)}.{slot.key}")
                items.append(OutputItem(entry=entry, path=path, group="optim"))
        return items
    for g, group in ((k, groups[k]) for k in sorted(groups)):
        first = sum(len(groups[k].params) for k in groups if k < g)
        fields = dict(group.fields)
        if "params" not in fields and group.params:
            fields["params"] = next(iter(fields.values()))  # flattened: params is made, named after a field
        for key, (i, value) in fields.items():
            entry = index.entries[i]
            path = (entry.path[0] if keep_layout else _optim_top(entry, options), "param_groups", g, key)
            if key == "params":
                if options.optim_keys == "ids":
                    params: list[str | int] = list(range(first, first + len(group.params)))
                else:
                    params = [name(q) if isinstance(q, str) else q for p in group.params for q in layers.params(p)]
                items.append(OutputItem(entry=entry, path=path, group="optim", constant=True, value=params))
            elif flattened:
                items.append(OutputItem(entry=entry, path=path, group="optim", constant=True, value=value))
            else:
                items.append(OutputItem(entry=entry, path=path, group="optim", dtype=_cast(entry, None)))
    return items
