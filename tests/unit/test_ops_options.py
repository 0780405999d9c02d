"""``ops.options``: the operations' keyword arguments as frozen dataclasses, checked as they are built."""

from __future__ import annotations

import dataclasses
import inspect
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

import fsdp_convert
from fsdp_convert.errors import InvalidOptionError
from fsdp_convert.lora import LoraAdapter, lora_options
from fsdp_convert.ops.options import ConsolidateOptions, ReshardOptions, VerifyOptions
from fsdp_convert.transform import TransformOptions

REQUIRED = object()

# Each operation's keyword arguments and defaults as its signature gave them before the options
# classes (commit d729265), in order; ``options`` (a TransformOptions or None) is the ``transform`` field.
SIGNATURES: dict[type, dict[str, object]] = {
    ConsolidateOptions: {
        "nproc": None,
        "only": "all",
        "options": None,
        "output_format": "auto",
        "overwrite": False,
        "force": False,
        "memory_budget_bytes": 256 << 20,
        "max_shard_bytes": 50 * 10**9,
        "check_crc": True,
        "verify_output": False,
        "space_check": True,
        "progress": False,
        "cluster": None,
        "hf_assets": None,
        "resume": False,
        "follow_symlinks": None,
        "weights": "master",
    },
    ReshardOptions: {
        "world_size": REQUIRED,
        "nproc": None,
        "options": None,
        "overwrite": False,
        "force": False,
        "space_check": True,
        "check_crc": True,
        "cluster": None,
        "compress": None,
        "resume": False,
        "progress": False,
        "follow_symlinks": None,
        "output_format": "auto",
    },
    VerifyOptions: {
        "atol": None,
        "rtol": None,
        "only": "all",
        "check_crc": True,
        "options": None,
        "nproc": None,
        "cluster": None,
        "in_process": False,
        "dtype": None,
        "optim_dtype": None,
        "progress": False,
        "transform_files": False,
        "follow_symlinks": None,
    },
}
OPERATIONS = {ConsolidateOptions: "consolidate", ReshardOptions: "reshard", VerifyOptions: "verify"}


def _field_name(keyword: str) -> str:
    return "transform" if keyword == "options" else keyword


def _built(cls: type, **fields: object) -> Any:
    """An instance with the required fields filled in (reshard's world_size)."""
    return cls(**({"world_size": 2} if cls is ReshardOptions else {}), **fields)


@pytest.mark.parametrize("cls", list(SIGNATURES))
def test_one_field_per_keyword_argument_with_todays_default(cls: type) -> None:
    fields = dataclasses.fields(cls)
    assert [f.name for f in fields] == [_field_name(k) for k in SIGNATURES[cls]]
    built = _built(cls)
    for keyword, default in SIGNATURES[cls].items():
        name = _field_name(keyword)
        if default is REQUIRED:
            f = next(f for f in fields if f.name == name)
            assert f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
        elif name == "transform" and cls is not VerifyOptions:  # options=None meant TransformOptions()
            assert built.transform == TransformOptions()
        else:
            assert getattr(built, name) == default and type(getattr(built, name)) is type(default), name


@pytest.mark.parametrize("cls", list(SIGNATURES))
def test_every_keyword_the_operation_still_lists_is_a_field_with_its_default(cls: type) -> None:
    """While an operation keeps explicit keywords, each is a field with the same default (no second table)."""
    operation = getattr(fsdp_convert, OPERATIONS[cls])
    defaults = {f.name: f.default for f in dataclasses.fields(cls)}
    for name, parameter in inspect.signature(operation).parameters.items():
        if parameter.kind is not inspect.Parameter.KEYWORD_ONLY or name == "options":
            continue
        assert name in defaults, f"{OPERATIONS[cls]}({name}=) has no {cls.__name__} field"
        default = dataclasses.MISSING if parameter.default is inspect.Parameter.empty else parameter.default
        assert defaults[name] == default, name


@pytest.mark.parametrize("cls", list(SIGNATURES))
def test_every_field_has_a_docstring(cls: type) -> None:
    """Each field is documented by the string after it (shown by IDEs and doc builders)."""
    source = inspect.getsource(cls)
    for f in dataclasses.fields(cls):
        head, _, rest = source.partition(f"\n    {f.name}: ")
        assert rest, f.name
        assert rest.split("\n", 1)[1].lstrip().startswith('"""'), f"{cls.__name__}.{f.name} has no docstring"


@pytest.mark.parametrize("cls", list(SIGNATURES))
def test_frozen_and_keyword_only(cls: type) -> None:
    built = _built(cls)
    with pytest.raises(dataclasses.FrozenInstanceError):
        built.progress = True
    with pytest.raises(TypeError):
        cls(2)


@pytest.mark.parametrize(
    ("build", "message"),
    [
        (lambda: ConsolidateOptions(only="weights"), "^only='weights': use all, model or optim$"),
        (lambda: ConsolidateOptions(output_format="gguf"), "^output_format='gguf': use auto, torch or safetensors$"),
        (lambda: ConsolidateOptions(nproc="4"), r"^nproc[ =]'4': expected an int of at least 1$"),
        (lambda: ConsolidateOptions(nproc=0), r"^nproc[ =]0: expected an int of at least 1$"),
        (
            lambda: ConsolidateOptions(memory_budget_bytes="1GiB"),
            "^memory_budget_bytes[ =]'1GiB': expected a positive int, in bytes",
        ),
        (lambda: ConsolidateOptions(max_shard_bytes=0), "^max_shard_bytes[ =]0: expected a positive int, in bytes"),
        (lambda: ConsolidateOptions(transform="bf16"), "^transform: expected a TransformOptions .* got str$"),
        (lambda: ConsolidateOptions(transform={"dtyp": "bf16"}), "^transform .*unexpected keyword argument 'dtyp'"),
        (lambda: ConsolidateOptions(transform={"dtype": "fp8"}), "^options.dtype='fp8' is not a dtype"),
        (lambda: ReshardOptions(world_size="2"), r"^world_size[ =]'2': expected an int of at least 1$"),
        (lambda: ReshardOptions(world_size=True), r"^world_size[ =]True: expected an int of at least 1$"),
        (lambda: ReshardOptions(world_size=2, nproc=-1), r"^nproc[ =]-1: expected an int of at least 1$"),
        (lambda: ReshardOptions(world_size=2, compress="gzip"), "^compress gzip: only zstd is supported$"),
        (lambda: VerifyOptions(atol="1e-3"), "^atol[ =]'1e-3': expected None or a finite number of at least 0$"),
        (lambda: VerifyOptions(rtol=float("nan")), "^rtol[ =]nan: expected None or a finite number of at least 0$"),
        (lambda: VerifyOptions(only="weights"), "^only='weights': use all, model or optim$"),
        (lambda: VerifyOptions(dtype="int8"), "^'int8' is not a dtype; use fp32, bf16 or fp16$"),
        (lambda: VerifyOptions(optim_dtype=3), "^optim_dtype 3: expected None, a torch.dtype or a dtype name"),
    ],
)
def test_a_bad_value_is_an_invalid_option_naming_the_keyword(build: Any, message: str) -> None:
    with pytest.raises(InvalidOptionError, match=message):
        build()


def test_the_cli_wording_names_the_flag() -> None:
    """The messages are written with flags (the CLI's words); ``str(e)`` gives the keyword."""
    with pytest.raises(InvalidOptionError) as caught:
        ConsolidateOptions(memory_budget_bytes=-1)
    assert caught.value.cli_text().startswith("--memory-budget -1: expected a positive int")


def test_lora_only_with_verify_output_is_refused_before_anything_is_read() -> None:
    lora = TransformOptions(adapter=LoraAdapter(lora_options("only", r=4)))
    assert ConsolidateOptions(transform=lora).transform is lora  # alone it is fine
    ConsolidateOptions(transform=TransformOptions(adapter=LoraAdapter(lora_options("merge", alpha=8.0))), verify_output=True)
    with pytest.raises(InvalidOptionError, match="^verify_output=True does not read a PEFT adapter folder back"):
        ConsolidateOptions(transform=lora, verify_output=True)


def test_compress_zstd_needs_the_zstandard_package(monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("zstandard")
    assert ReshardOptions(world_size=2, compress="zstd").compress == "zstd"
    monkeypatch.setitem(sys.modules, "zstandard", None)  # import zstandard now raises ImportError
    with pytest.raises(InvalidOptionError, match="zstandard"):
        ReshardOptions(world_size=2, compress="zstd")


def test_strings_are_accepted_and_normalized_where_the_library_takes_them(tmp_path: Path) -> None:
    built = ConsolidateOptions(transform={"dtype": "bf16", "renames": "^=model."}, hf_assets=tmp_path)
    assert built.transform == TransformOptions(dtype=torch.bfloat16, renames=(("^", "model."),))
    assert built.hf_assets == tmp_path
    assert ReshardOptions(world_size=3, transform=None).transform == TransformOptions()
    checked = VerifyOptions(dtype="BF16", optim_dtype="float32", atol=1, transform={"keep_wrapper_names": True})
    assert (checked.dtype, checked.optim_dtype, checked.atol) == (torch.bfloat16, torch.float32, 1.0)
    assert type(checked.atol) is float and checked.transform == TransformOptions(keep_wrapper_names=True)
    assert VerifyOptions(dtype=torch.float16).dtype is torch.float16
    assert VerifyOptions().transform is None  # verify tells None (as saved) from TransformOptions()


# --- from_call: what the operation gets from its call ---


def test_from_call_builds_from_keywords_alone() -> None:
    assert ConsolidateOptions.from_call(None, {}) == ConsolidateOptions()
    assert ConsolidateOptions.from_call(None, {"nproc": 2, "only": "model"}) == ConsolidateOptions(nproc=2, only="model")
    assert ReshardOptions.from_call(None, {"world_size": 4}) == ReshardOptions(world_size=4)


def test_from_call_takes_a_transform_options_as_before() -> None:
    transform = TransformOptions(dtype=torch.bfloat16)
    assert ConsolidateOptions.from_call(transform, {"nproc": 2}) == ConsolidateOptions(transform=transform, nproc=2)
    assert ReshardOptions.from_call({"dtype": "bf16"}, {"world_size": 2}).transform == transform
    assert VerifyOptions.from_call(transform, {}).transform is transform
    with pytest.raises(InvalidOptionError, match="^options .*unexpected keyword argument 'dtyp'"):
        VerifyOptions.from_call({"dtyp": "bf16"}, {})
    with pytest.raises(InvalidOptionError, match="one option; give it once"):
        ConsolidateOptions.from_call(transform, {"transform": transform})


def test_from_call_with_options_replaces_the_fields_given_as_keywords() -> None:
    base = ConsolidateOptions(only="model", nproc=3)
    assert ConsolidateOptions.from_call(base, {}) is base
    assert ConsolidateOptions.from_call(base, {"overwrite": True}) == ConsolidateOptions(only="model", nproc=3, overwrite=True)
    with pytest.raises(InvalidOptionError, match=r"^nproc[ =]0"):  # the replaced value is checked too
        ConsolidateOptions.from_call(base, {"nproc": 0})


def test_from_call_refuses_an_unknown_keyword_naming_it() -> None:
    with pytest.raises(InvalidOptionError, match="^'nprocs' is not a keyword argument of consolidate; it takes nproc, "):
        ConsolidateOptions.from_call(None, {"nprocs": 2})
    with pytest.raises(InvalidOptionError, match="^'verify_output' is not a keyword argument of reshard"):
        ReshardOptions.from_call(None, {"world_size": 2, "verify_output": True})


def test_from_call_refuses_options_of_another_kind() -> None:
    with pytest.raises(InvalidOptionError, match="^options: expected a ReshardOptions or .* got ConsolidateOptions$"):
        ReshardOptions.from_call(ConsolidateOptions(), {"world_size": 2})
    with pytest.raises(InvalidOptionError, match="^options: expected a ConsolidateOptions .* got str$"):
        ConsolidateOptions.from_call("bf16", {})


def test_from_call_names_a_missing_required_keyword() -> None:
    with pytest.raises(InvalidOptionError, match=r"^reshard needs world_size= \(it has no default\)$"):
        ReshardOptions.from_call(TransformOptions(), {"nproc": 2})


def test_the_package_exports_the_options() -> None:
    assert fsdp_convert.ConsolidateOptions is ConsolidateOptions
    assert fsdp_convert.ReshardOptions is ReshardOptions and fsdp_convert.VerifyOptions is VerifyOptions
    assert {"ConsolidateOptions", "ReshardOptions", "VerifyOptions"} <= set(fsdp_convert.__all__)
