"""``import fsdp_convert`` as a user calls it: the names it exports, the strings its options take, the errors it raises."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

import fsdp_convert
from fsdp_convert import errors
from fsdp_convert.ops import _arguments
from fsdp_convert.output_table import format_names
from fsdp_convert.plan.consolidate import Only
from tests._samples import Sample

# where each exported name is defined (the operations, their options and results live below the package)
HOMES = {
    "inspect": "fsdp_convert.ops.inspect",
    "inspect_checkpoint": "fsdp_convert.ops.inspect",
    "InspectResult": "fsdp_convert.ops.inspect",
    "EntrySummary": "fsdp_convert.ops.inspect",
    "consolidate": "fsdp_convert.ops.consolidate",
    "ConsolidateResult": "fsdp_convert.ops.consolidate",
    "ConsolidateOptions": "fsdp_convert.ops.options",
    "ReshardOptions": "fsdp_convert.ops.options",
    "VerifyOptions": "fsdp_convert.ops.options",
    "reshard": "fsdp_convert.ops.reshard",
    "ReshardResult": "fsdp_convert.ops.reshard",
    "verify": "fsdp_convert.ops.verify",
    "VerifyResult": "fsdp_convert.ops.verify",
    "Difference": "fsdp_convert.ops.verify",
    "TransformOptions": "fsdp_convert.transform.options",
    "Cluster": "fsdp_convert.launch",
}


@pytest.mark.parametrize("name", fsdp_convert.__all__)
def test_each_exported_name_resolves(name: str) -> None:
    value = getattr(fsdp_convert, name)
    assert value.__module__ == HOMES.get(name, "fsdp_convert.errors"), value
    assert name in dir(fsdp_convert)


def test_every_error_is_exported() -> None:
    exported = {n for n in errors.__all__ if isinstance(getattr(errors, n), type)}
    assert exported <= set(fsdp_convert.__all__)
    assert {"TransformOptions", "Cluster", "ConsolidateResult", "ReshardResult", "VerifyResult"} <= set(fsdp_convert.__all__)


def test_an_unknown_name_is_an_attribute_error() -> None:
    with pytest.raises(AttributeError, match="no attribute 'consolidat'"):
        fsdp_convert.consolidat  # noqa: B018


def test_importing_the_package_and_its_errors_does_not_import_torch() -> None:
    """torch takes seconds to import and the CLI sets its log level first: it comes with the first operation."""
    probe = (
        "import sys\n"
        "import fsdp_convert\n"
        "from fsdp_convert import CheckpointError, CheckpointNotFoundError, __all__\n"
        "assert 'torch' not in sys.modules, 'imported torch'\n"
        "fsdp_convert.TransformOptions\n"
        "assert 'torch' not in sys.modules, 'TransformOptions imported torch'\n"
        "import fsdp_convert.formats.rank_files\n"  # reads torch.save files with torch: the probe can see an import
        "assert 'torch' in sys.modules, 'rank_files did not import torch: the probe proves nothing'\n"
    )
    proc = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr


@pytest.mark.parametrize(
    "call",
    [
        lambda out: fsdp_convert.consolidate("/nonexistent/ckpt", out / "full.pt"),
        lambda out: fsdp_convert.reshard("/nonexistent/ckpt", out / "resharded", world_size=2),
        lambda out: fsdp_convert.verify("/nonexistent/ckpt", out),
        lambda out: fsdp_convert.inspect("/nonexistent/ckpt"),
    ],
    ids=["consolidate", "reshard", "verify", "inspect"],
)
def test_a_missing_checkpoint_is_a_file_not_found_error(call: object, tmp_path: Path) -> None:
    try:
        call(tmp_path)  # type: ignore[operator]
    except FileNotFoundError as e:
        assert isinstance(e, fsdp_convert.CheckpointNotFoundError) and e.exit_code == 3
        assert "/nonexistent/ckpt" in str(e) and not str(e).startswith("[Errno")
    else:
        pytest.fail("no error")


def test_an_existing_output_names_the_keyword_not_the_flag(tmp_path: Path) -> None:
    dcp.save({"model": {"w": torch.ones(2)}}, checkpoint_id=tmp_path / "ckpt", no_dist=True)
    (tmp_path / "full.pt").write_bytes(b"")
    with pytest.raises(fsdp_convert.OutputExistsError) as caught:
        fsdp_convert.consolidate(tmp_path / "ckpt", tmp_path / "full.pt", nproc=1)
    assert str(caught.value).endswith("already exists; pass overwrite=True to replace it")
    assert caught.value.cli_text().endswith("already exists; pass --overwrite to replace it")


def test_consolidate_with_the_command_lines_strings_writes_what_typed_options_write(ws3_ckpt: Sample, tmp_path: Path) -> None:
    """``TransformOptions(dtype="bf16", renames="...", include="...")`` is the typed options, down to the bytes."""
    typed = fsdp_convert.TransformOptions(
        dtype=torch.bfloat16, optim_dtype=torch.float32, renames=((r"^layers\.", "blocks."),), include=("layers.*", "norm.*")
    )
    strings = fsdp_convert.TransformOptions(
        dtype="bf16",  # type: ignore[arg-type]
        optim_dtype="fp32",  # type: ignore[arg-type]
        renames=r"^layers\.=blocks.",  # type: ignore[arg-type]
        include=["layers.*", "norm.*"],  # type: ignore[arg-type]
    )
    assert strings == typed
    fsdp_convert.consolidate(ws3_ckpt.checkpoint, tmp_path / "typed.pt", nproc=1, options=typed)
    fsdp_convert.consolidate(ws3_ckpt.checkpoint, tmp_path / "strings.pt", nproc=1, options=strings)
    assert (tmp_path / "typed.pt").read_bytes() == (tmp_path / "strings.pt").read_bytes()
    model = torch.load(tmp_path / "strings.pt", weights_only=True)["model"]
    truth = ws3_ckpt.truth()["model"]
    assert model and all(k.startswith(("blocks.", "norm.")) for k in model)
    for key, tensor in model.items():
        assert tensor.dtype == torch.bfloat16
        assert torch.equal(tensor, truth[key.replace("blocks.", "layers.", 1)].to(torch.bfloat16)), key
    assert fsdp_convert.verify(ws3_ckpt.checkpoint, tmp_path / "strings.pt", options=strings, only="model").equal


# --- the operations' own keywords: ops/_arguments (a bad value names the keyword) ---


def test_choice_takes_the_keywords_values_and_names_the_keyword() -> None:
    from typing import get_args

    assert _arguments.choice("--only", "model", get_args(Only)) == "model"
    with pytest.raises(errors.InvalidOptionError) as caught:
        _arguments.choice("--only", "weights", get_args(Only))
    assert str(caught.value) == "only='weights': use all, model or optim"
    assert caught.value.cli_text() == "--only 'weights': use all, model or optim"
    with pytest.raises(errors.InvalidOptionError, match="^output_format='gguf': use auto, torch or safetensors$"):
        _arguments.choice("--format", "gguf", format_names())


@pytest.mark.parametrize("value", ["4", 0, -1, 2.0, True])
def test_count_refuses_anything_but_a_positive_int(value: object) -> None:
    with pytest.raises(errors.InvalidOptionError, match=r"^nproc[ =].*: expected an int of at least 1$"):
        _arguments.count("--nproc", value)


@pytest.mark.parametrize("value", ["1GiB", 0, -5, 1.5, False])
def test_byte_count_refuses_anything_but_a_positive_int(value: object) -> None:
    with pytest.raises(errors.InvalidOptionError, match=r"^memory_budget_bytes[ =].*: expected a positive int, in bytes"):
        _arguments.byte_count("--memory-budget", value)


def test_counts_and_tolerances_pass_good_values() -> None:
    assert _arguments.count("--world-size", 3) == 3 and _arguments.byte_count("--max-shard-size", 2**30) == 2**30
    assert _arguments.tolerance("--atol", None) is None and _arguments.tolerance("--rtol", 0) == 0.0
    for bad in ("1e-3", -1.0, float("nan"), True):
        with pytest.raises(errors.InvalidOptionError, match="^atol[ =]"):
            _arguments.tolerance("--atol", bad)


def test_transform_options_takes_options_a_dict_of_fields_or_none() -> None:
    options = fsdp_convert.TransformOptions(dtype=torch.bfloat16)
    assert _arguments.transform_options(options) is options
    assert _arguments.transform_options(None) == fsdp_convert.TransformOptions()
    assert _arguments.transform_options({"dtype": "bf16"}) == options
    with pytest.raises(errors.InvalidOptionError, match="^options: expected a TransformOptions .* got str$"):
        _arguments.transform_options("bf16")
    with pytest.raises(errors.InvalidOptionError, match="unexpected keyword argument 'dtyp'"):
        _arguments.transform_options({"dtyp": "bf16"})
    with pytest.raises(errors.InvalidOptionError, match="^options.dtype='fp8' is not a dtype"):
        _arguments.transform_options({"dtype": "fp8"})


@pytest.mark.parametrize(
    ("call", "keyword"),
    [
        (lambda ck, out: fsdp_convert.consolidate(ck, out, only="weights"), "only"),
        (lambda ck, out: fsdp_convert.consolidate(ck, out, nproc="2"), "nproc"),
        (lambda ck, out: fsdp_convert.consolidate(ck, out, memory_budget_bytes="1GiB"), "memory_budget_bytes"),
        (lambda ck, out: fsdp_convert.consolidate(ck, out, options="bf16"), "options"),
        (lambda ck, out: fsdp_convert.reshard(ck, out, world_size="2"), "world_size"),
        (lambda ck, out: fsdp_convert.verify(ck, ck, atol="x"), "atol"),
        (lambda ck, out: fsdp_convert.verify(ck, ck, only="x"), "only"),
    ],
)
def test_a_bad_keyword_value_is_an_invalid_option_naming_the_keyword(
    call: object, keyword: str, ws3_ckpt: Sample, tmp_path: Path
) -> None:
    """Not a TypeError or AttributeError from deep in a plan (which the CLI would report as an internal error)."""
    with pytest.raises(fsdp_convert.InvalidOptionError, match=keyword):
        call(ws3_ckpt.checkpoint, tmp_path / "out.pt")  # type: ignore[operator]
    assert not (tmp_path / "out.pt").exists()
