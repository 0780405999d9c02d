"""transform.py: FQN cleaning, renames, include/exclude, casts and optimizer ids, on hand-made indexes."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest
import torch

from fsdp_convert.cli._options import DtypeChoice, OptimKeysChoice
from fsdp_convert.constants import DTYPE_NAMES
from fsdp_convert.errors import InvalidOptionError
from fsdp_convert.formats.index import BytesEntry, CheckpointIndex, ChunkEntry, TensorEntry
from fsdp_convert.item import OutputItem
from fsdp_convert.producers import classify
from fsdp_convert.transform import TransformOptions, build_items, clean_fqn, needs_group_values, parse_dtype, parse_rename
from fsdp_convert.transform.options import dtype_names


@pytest.mark.parametrize(
    ("fqn", "clean"),
    [
        ("_fsdp_wrapped_module.layers.0._fsdp_wrapped_module.attn.wq.weight", "layers.0.attn.wq.weight"),
        ("layers.0._checkpoint_wrapped_module.mlp.0.weight", "layers.0.mlp.0.weight"),
        ("_orig_mod.output.weight", "output.weight"),
        ("module._orig_mod.output.weight", "output.weight"),
        ("encoder.module.weight", "encoder.module.weight"),  # only a leading module. is DDP's
        ("module", "module"),
    ],
)
def test_clean_fqn(fqn: str, clean: str) -> None:
    assert clean_fqn(fqn) == clean
    assert clean_fqn(fqn, keep_wrapper_names=True) == fqn


WQ = "layers.0._checkpoint_wrapped_module.attn.wq.weight"  # as saved: an activation checkpointing wrapper in it
NORM = "_orig_mod.norm.weight"  # as saved by a torch.compile'd model


def _tensor(path: tuple[str | int, ...], dtype: torch.dtype = torch.float32, shape: tuple[int, ...] = (4, 4)) -> TensorEntry:
    chunk = ChunkEntry(offsets=(0,) * len(shape), sizes=shape, relative_path="__0_0.distcp", offset_bytes=0, length_bytes=64)
    return TensorEntry(fqn=".".join(map(str, path)), path=path, shape=shape, dtype=dtype, chunks=(chunk,))


def _value(path: tuple[str | int, ...]) -> BytesEntry:
    return BytesEntry(fqn=".".join(map(str, path)), path=path, relative_path="__0_0.distcp", offset_bytes=0, length_bytes=8)


# A hand-made index in get_state_dict's layout: two weights, an int buffer, AdamW state, one param
# group listing NORM before WQ (not the model's order), and a train step.
ENTRIES = (
    _tensor(("model", WQ)),
    _tensor(("model", NORM), shape=(4,)),
    _tensor(("model", "tok_ids"), dtype=torch.int64, shape=(3,)),
    _tensor(("optim", "state", WQ, "exp_avg")),
    _tensor(("optim", "state", WQ, "step"), shape=()),
    _tensor(("optim", "state", NORM, "exp_avg"), shape=(4,)),
    _value(("optim", "param_groups", 0, "lr")),
    _value(("optim", "param_groups", 0, "params")),
    _value(("train_state", "step")),
)
INDEX = CheckpointIndex(checkpoint_id=Path("/nowhere"), entries=ENTRIES, data_files=("__0_0.distcp",))
PARAMS = 7  # the entry of the group's params
VALUES = {PARAMS: [NORM, WQ]}


def _items(**options: Any) -> dict[tuple[str | int, ...], OutputItem]:
    slots = classify(INDEX)
    assert needs_group_values(slots) == [PARAMS]
    items = build_items(INDEX, slots, TransformOptions(**options), VALUES)
    return {item.path: item for item in items}


def test_wrapper_names_go_and_renames_apply_to_model_and_optimizer_alike() -> None:
    items = _items(renames=((r"^layers\.", "model.layers."), (r"^norm\.", "model.norm.")))
    assert list(items) == [
        ("model", "model.layers.0.attn.wq.weight"),
        ("model", "model.norm.weight"),
        ("model", "tok_ids"),
        ("optim", "state", "model.layers.0.attn.wq.weight", "exp_avg"),
        ("optim", "state", "model.layers.0.attn.wq.weight", "step"),
        ("optim", "state", "model.norm.weight", "exp_avg"),
        ("optim", "param_groups", 0, "lr"),
        ("optim", "param_groups", 0, "params"),
        ("train_state", "step"),
    ]
    params = items["optim", "param_groups", 0, "params"]
    assert params.constant and params.value == ["model.norm.weight", "model.layers.0.attn.wq.weight"]
    assert items["model", "model.norm.weight"].entry is ENTRIES[1]  # read from the saved name


def test_keep_wrapper_names_keeps_every_name_as_saved() -> None:
    items = _items(keep_wrapper_names=True)
    assert ("model", WQ) in items and ("optim", "state", NORM, "exp_avg") in items
    assert items["optim", "param_groups", 0, "params"].value == [NORM, WQ]


@pytest.mark.parametrize(
    ("include", "exclude", "kept"),
    [
        ((), (), ["layers.0.attn.wq.weight", "norm.weight", "tok_ids"]),
        (("layers.0.attn.*",), (), ["layers.0.attn.wq.weight"]),  # matches the name without its wrapper
        ((), ("*.weight",), ["tok_ids"]),
        (("*.weight",), ("norm.*",), ["layers.0.attn.wq.weight"]),
    ],
)
def test_include_and_exclude_select_model_keys_before_renames(
    include: tuple[str, ...], exclude: tuple[str, ...], kept: list[str]
) -> None:
    items = _items(include=include, exclude=exclude, renames=(("^", "renamed."),))
    assert [path[1] for path in items if path[0] == "model"] == [f"renamed.{k}" for k in kept]


def test_casts_change_floating_point_only_and_never_step() -> None:
    items = _items(dtype=torch.bfloat16, optim_dtype=torch.float16)
    assert items["model", "layers.0.attn.wq.weight"].dtype == torch.bfloat16
    assert items["model", "tok_ids"].dtype == torch.int64  # integers are never cast
    assert items["optim", "state", "norm.weight", "exp_avg"].dtype == torch.float16
    assert items["optim", "state", "layers.0.attn.wq.weight", "step"].dtype == torch.float32
    assert items["model", "norm.weight"].nbytes == 4 * 2  # output size follows the cast
    assert _items()["model", "norm.weight"].dtype == torch.float32  # no cast asked, none made


def test_ids_number_params_in_param_group_order() -> None:
    """torch.optim numbers parameters in the order its param groups list them, not the model's."""
    items = list(_items(optim_keys="ids"))
    assert [path for path in items if path[:2] == ("optim", "state")] == [
        ("optim", "state", 0, "exp_avg"),  # NORM, listed first
        ("optim", "state", 1, "exp_avg"),
        ("optim", "state", 1, "step"),
    ]
    assert _items(optim_keys="ids")["optim", "param_groups", 0, "params"].value == [0, 1]


def test_two_keys_renamed_to_one_are_refused() -> None:
    with pytest.raises(InvalidOptionError, match="would both be written as model key 'w'"):
        _items(renames=((r".*weight$", "w"),))


@pytest.mark.parametrize("text", ["no-separator", "=x", "a[=b"])
def test_parse_rename_refuses_malformed_rules(text: str) -> None:
    with pytest.raises(InvalidOptionError, match="options.renames") as caught:
        parse_rename(text)
    assert caught.value.cli_text().startswith(f"--rename {text!r}: ")


def test_parse_rename_splits_at_the_last_equals_sign() -> None:
    assert parse_rename(r"^a(?=b)=c") == (r"^a(?=b)", "c")


def test_parse_dtype() -> None:
    assert parse_dtype(" BF16 ") == torch.bfloat16 and parse_dtype("half") == torch.float16
    with pytest.raises(InvalidOptionError, match="not a dtype"):
        parse_dtype("int8")


def test_dtype_names_come_from_the_one_table() -> None:
    """Every name of ``constants.DTYPE_NAMES`` parses to its dtype; the CLI lists each dtype's first name."""
    assert all(parse_dtype(name) == dtype and parse_dtype(name.upper()) == dtype for name, dtype in DTYPE_NAMES.items())
    assert dtype_names() == ("fp32", "bf16", "fp16")
    assert [m.value for m in DtypeChoice] == list(dtype_names())  # --help's list is the table's, not a copy


# --- TransformOptions takes the command line's strings ---


def test_options_take_the_command_lines_strings() -> None:
    options = TransformOptions(
        optim_keys="ids",
        renames=["^layers\\.=model.layers.", ("^norm", "model.norm")],
        include="layers.*",
        exclude=["*.bias", "tok_ids"],
        dtype="bf16",
        optim_dtype="Float32",
        layout="nested",
    )  # type: ignore[arg-type]
    assert options == TransformOptions(
        optim_keys="ids",
        renames=(("^layers\\.", "model.layers."), ("^norm", "model.norm")),
        include=("layers.*",),
        exclude=("*.bias", "tok_ids"),
        dtype=torch.bfloat16,
        optim_dtype=torch.float32,
        layout="nested",
    )
    assert TransformOptions(renames="^a(?=b)=c").renames == (("^a(?=b)", "c"),)  # type: ignore[arg-type]
    assert TransformOptions(renames={"^a": "b"}).renames == (("^a", "b"),)  # type: ignore[arg-type]
    assert TransformOptions(dtype="half").dtype == torch.float16  # type: ignore[arg-type]
    assert TransformOptions(dtype=torch.float64).dtype == torch.float64  # any floating-point torch dtype
    # the CLI's enum members become the plain strings, and normalizing twice changes nothing
    assert type(TransformOptions(optim_keys=OptimKeysChoice.ids).optim_keys) is str  # type: ignore[arg-type]
    assert dataclasses.replace(options) == options


def test_string_options_build_the_same_items_as_typed_ones() -> None:
    typed = _items(dtype=torch.bfloat16, renames=((r"^norm\.", "model.norm."),), include=("norm.*", "tok_ids"))
    strings = _items(dtype="bf16", renames=r"^norm\.=model.norm.", include=["norm.*", "tok_ids"])
    assert typed == strings and ("model", "model.norm.weight") in strings
    assert _items(include="norm.*").keys() == _items(include=("norm.*",)).keys()  # one glob, not its characters


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("dtype", "fp8", "options.dtype='fp8' is not a dtype; use fp32, bf16 or fp16"),
        ("optim_dtype", torch.int8, "options.optim_dtype torch.int8: use fp32, bf16 or fp16, or a floating-point torch.dtype"),
        ("optim_keys", "numbers", "options.optim_keys='numbers': use names or ids"),
        ("layout", "flat", "options.layout='flat': use producer or nested"),
        ("renames", "no-separator", "options.renames='no-separator': expected REGEX=REPLACEMENT"),
        ("renames", ("^a", "b"), "options.renames ('^a', 'b'): one (regex, replacement) pair goes in a list"),
        ("renames", [("a[", "b")], "options.renames='a[=b': bad regex"),
        ("renames", 3, "options.renames 3: expected 'REGEX=REPLACEMENT' strings or (regex, replacement) pairs"),
        ("include", 3, "options.include 3: expected a glob or a list of globs"),
        ("exclude", [b"x"], "options.exclude [b'x']: expected a glob or a list of globs"),
        ("keep_wrapper_names", "no", "options.keep_wrapper_names: expected True or False, got 'no'"),
        ("adapter", "torchtitan-llama3-to-hf", "options.adapter: expected a derive.Adapter"),
    ],
)
def test_a_bad_option_names_its_field_and_what_it_takes(field: str, value: Any, message: str) -> None:
    with pytest.raises(InvalidOptionError) as caught:
        TransformOptions(**{field: value})
    assert str(caught.value).startswith(message), str(caught.value)
    assert "options." not in caught.value.cli_text() or field in ("keep_wrapper_names",)  # the CLI's words: flags


def _optimizer_named(entries: tuple[Any, ...]) -> CheckpointIndex:
    """INDEX with its optimizer saved under ``optimizer`` (Lightning, accelerate, torchtitan)."""
    renamed = tuple(
        dataclasses.replace(e, fqn="optimizer" + e.fqn.removeprefix("optim"), path=("optimizer", *e.path[1:]))
        if e.path[0] == "optim"
        else e
        for e in entries
    )
    return CheckpointIndex(checkpoint_id=Path("/nowhere"), entries=renamed, data_files=("__0_0.distcp",))


@pytest.mark.parametrize(("layout", "top"), [("producer", "optimizer"), ("nested", "optim")])
def test_layout_keeps_the_producers_optimizer_key_or_writes_optim(layout: str, top: str) -> None:
    """``producer`` (the default) keeps the optimizer's top-level key as saved; ``nested`` writes
    ``optim`` for every producer. Model weights go under ``model`` either way; ``reshard``
    (keep_layout) ignores it."""
    index = _optimizer_named(ENTRIES)
    slots = classify(index)
    items = build_items(index, slots, TransformOptions(layout=layout), VALUES)  # type: ignore[arg-type]
    tops = [item.path[0] for item in items]
    assert tops == ["model"] * 3 + [top] * 5 + ["train_state"]
    assert (top, "param_groups", 0, "params") in {item.path for item in items}
    kept = build_items(index, slots, TransformOptions(layout=layout), VALUES, keep_layout=True)  # type: ignore[arg-type]
    assert [item.path[0] for item in kept] == ["model"] * 3 + ["optimizer"] * 5 + ["train_state"]
    assert TransformOptions().layout == "producer"
