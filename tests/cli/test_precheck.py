"""Usage mistakes are told before torch is imported, in the library's own words (cli/_precheck.py)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from fsdp_convert import constants, transform
from fsdp_convert.cli import _precheck
from fsdp_convert.cli._options import DtypeChoice
from fsdp_convert.cli._precheck import check_argv, check_consolidate, check_rename, check_reshard, check_verify, dtype_name
from fsdp_convert.errors import CheckpointError, InvalidOptionError, OutputExistsError
from fsdp_convert.transform.options import dtype_names
from tests._cli_probe import cli_probe
from tests._samples import Sample

# Each case runs main() in a fresh interpreter; the probe reports the exit code and whether torch
# was imported by then. {d} is a folder holding an empty folder "ck" and a file "exists.pt".
USAGE_ERRORS = {
    "existing OUT": (["consolidate", "{d}/ck", "{d}/exists.pt"], 4, "{d}/exists.pt already exists; pass --overwrite"),
    "file suffix (reshard)": (["reshard", "{d}/ck", "{d}/exists.pt", "--world-size", "2"], 2, "name OUT without a file suffix"),
    "OUT is the input": (["reshard", "{d}/ck", "{d}/ck", "--world-size", "2", "--overwrite"], 2, "{d}/ck is the input {d}/ck"),
    "bad suffix": (["consolidate", "{d}/ck", "{d}/out.txt"], 2, "unknown output suffix '.txt'"),
    "--dtype fp8": (["consolidate", "{d}/ck", "{d}/out.pt", "--dtype", "fp8"], 2, "--dtype 'fp8' is not a dtype"),
    "bad --rename": (["reshard", "{d}/ck", "{d}/new", "--world-size", "1", "--rename", "x"], 2, "expected REGEX=REPLACEMENT"),
    "bad size": (["consolidate", "{d}/ck", "{d}/out.pt", "--max-shard-size", "lots"], 2, "'lots' is not a size"),
    "missing checkpoint": (["consolidate", "{d}/nope", "{d}/out.pt"], 3, "{d}/nope does not exist"),
    "missing checkpoint (inspect)": (["inspect", "{d}/nope"], 3, "{d}/nope does not exist"),
    "missing input (verify)": (["verify", "{d}/nope", "{d}/exists.pt"], 2, "{d}/nope does not exist"),
    "typo'd subcommand": (["consolidat", "{d}/ck", "{d}/out.pt"], 2, "No such command 'consolidat'"),
    "-v 2": (["-v", "2", "consolidate", "{d}/ck", "{d}/out.pt"], 2, "-v takes no number"),
}


@pytest.mark.parametrize("case", sorted(USAGE_ERRORS))
def test_usage_errors_come_before_torch(case: str, tmp_path: Path) -> None:
    (tmp_path / "ck").mkdir()
    (tmp_path / "exists.pt").write_bytes(b"precious")
    argv, code, needle = USAGE_ERRORS[case]
    argv = [a.format(d=tmp_path) for a in argv]
    report, stderr = cli_probe(argv, timeout=120)
    assert report == {"code": code, "modules": []}, (report, stderr)
    assert needle.format(d=tmp_path) in stderr, stderr
    if case != "typo'd subcommand":  # typer's usage box, as before
        assert stderr.startswith("error: ") and len(stderr.strip().splitlines()) == 1, stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ck", "exists.pt"]
    assert (tmp_path / "exists.pt").read_bytes() == b"precious"


# --- the same rule and the same words as the library's own checks, which stay for library callers


def _raised(call: Callable[[], object]) -> CheckpointError:
    with pytest.raises(CheckpointError) as info:
        call()
    return info.value


def _same(ours: Callable[[], object], theirs: Callable[[], object], prefix: str = "") -> str:
    """Both raise: the same class and the same words, as the CLI prints them (``cli_text``) and as ``str``."""
    mine, library = _raised(ours), _raised(theirs)
    assert (type(mine), mine.cli_text()) == (type(library), prefix + library.cli_text())
    if not prefix:
        assert str(mine) == str(library)
    return mine.cli_text()


def _consolidate(checkpoint: Path | str, output: Path, **kwargs: object) -> Callable[[], object]:
    from fsdp_convert.ops.consolidate import consolidate

    return lambda: consolidate(checkpoint, output, **kwargs)  # type: ignore[arg-type]


def _lora_only() -> object:
    from fsdp_convert.lora import LoraAdapter, lora_options

    return transform.TransformOptions(adapter=LoraAdapter(lora_options("only")))


def _consolidate_check(checkpoint: Path | str, output: Path, **kwargs: object) -> Callable[[], object]:
    defaults: dict[str, object] = {"output_format": "auto", "only": "all", "lora_only": False, "verify_output": False}
    defaults |= {"overwrite": False, "resume": False}
    return lambda: check_consolidate(str(checkpoint), str(output), **(defaults | kwargs))  # type: ignore[arg-type]


def test_missing_checkpoint_as_the_library_says(tmp_path: Path) -> None:
    from fsdp_convert.ops.reshard import reshard
    from fsdp_convert.ops.verify import verify

    missing = tmp_path / "nope"
    _same(_consolidate_check(missing, tmp_path / "o.pt"), _consolidate(missing, tmp_path / "o.pt"))
    _same(_consolidate_check(f"file://{missing}", tmp_path / "o.pt"), _consolidate(f"file://{missing}", tmp_path / "o.pt"))
    _same(lambda: check_reshard(str(missing), str(tmp_path / "n"), overwrite=False, resume=False),
          lambda: reshard(missing, tmp_path / "n", world_size=1))  # fmt: skip
    torch.save({"model": {"w": torch.zeros(1)}}, tmp_path / "a.pt")
    message = _same(lambda: check_verify(str(tmp_path / "a.pt"), str(missing)), lambda: verify(tmp_path / "a.pt", missing))
    _same(lambda: check_verify(str(missing), str(tmp_path / "a.pt")), lambda: verify(missing, tmp_path / "a.pt"))
    assert message == f"{missing} does not exist"
    check_verify("s3://bucket/ckpt", str(tmp_path))  # a URL is left to the library


def test_output_checks_as_the_library_says(ws3_ckpt: Sample, tmp_path: Path) -> None:
    from fsdp_convert.ops.reshard import reshard
    from fsdp_convert.outputs import output_kind

    ck = ws3_ckpt.checkpoint
    for name in ("o.txt", "o.PT.gz"):
        _same(_consolidate_check(ck, tmp_path / name), _consolidate(ck, tmp_path / name))
    _same(
        _consolidate_check(ck, tmp_path / "o.safetensors", only="optim"),
        _consolidate(ck, tmp_path / "o.safetensors", only="optim"),
    )
    _same(_consolidate_check(ck, tmp_path / "o.pt", lora_only=True), _consolidate(ck, tmp_path / "o.pt", options=_lora_only()))
    _same(
        _consolidate_check(ck, tmp_path / "adapter", lora_only=True, verify_output=True),
        _consolidate(ck, tmp_path / "adapter", options=_lora_only(), verify_output=True),
    )
    (tmp_path / "exists.pt").write_bytes(b"precious")
    message = _same(_consolidate_check(ck, tmp_path / "exists.pt"), _consolidate(ck, tmp_path / "exists.pt"))
    assert message.endswith("already exists; pass --overwrite to replace it")
    (tmp_path / "exists").mkdir()
    (tmp_path / "exists" / "notes.txt").write_text("")  # an empty folder is a free OUT
    _same(
        lambda: check_reshard(str(ck), str(tmp_path / "exists"), overwrite=False, resume=False),
        lambda: reshard(ck, tmp_path / "exists", world_size=1),
    )
    assert (tmp_path / "exists.pt").read_bytes() == b"precious"
    for name, fmt in (("o.pt", "torch_save"), ("o.safetensors", "safetensors"), ("folder", "hf_dir"), ("exists", "hf_dir")):
        assert _precheck.choose_row(tmp_path / name).name == output_kind(tmp_path / name).name == fmt
    # what the precheck leaves alone: --overwrite, --resume, an explicit --format, a URL
    check_consolidate(str(ck), str(tmp_path / "exists.pt"), output_format="auto", only="all", lora_only=False,
                      verify_output=False, overwrite=True, resume=False)  # fmt: skip
    check_reshard(str(ck), str(tmp_path / "exists"), overwrite=False, resume=True)
    check_consolidate(str(ck), str(tmp_path / "o.ckpt"), output_format="torch", only="all", lora_only=False,
                      verify_output=False, overwrite=False, resume=False)  # fmt: skip
    check_consolidate("s3://bucket/ckpt", "s3://bucket/o.txt", output_format="auto", only="optim", lora_only=True,
                      verify_output=True, overwrite=False, resume=False)  # fmt: skip


def test_the_precheck_and_the_output_kinds_choose_from_one_table() -> None:
    """The CLI's before-torch check calls the outputs table's chooser, whose rows the output kinds take."""
    from fsdp_convert import output_table, outputs

    assert _precheck.choose_row is output_table.choose_row
    assert not hasattr(constants, "TORCH_SAVE_SUFFIXES") and not hasattr(constants, "SAFETENSORS_SUFFIXES")  # one home
    assert [kind.row for kind in outputs.OUTPUT_KINDS] == list(output_table.OUTPUT_ROWS)
    claimed = {s for row in output_table.OUTPUT_ROWS for s in row.suffixes}
    assert claimed == {*output_table.TORCH_SAVE_SUFFIXES, *output_table.SAFETENSORS_SUFFIXES}


def test_dtype_names_are_the_librarys() -> None:
    assert set(_precheck.DTYPE_NAMES) == set(constants.DTYPE_NAMES)
    for name in (*constants.DTYPE_NAMES, " BF16 ", "Half"):
        assert transform.parse_dtype(dtype_name(name, "--dtype")) == transform.parse_dtype(name)
    assert tuple(dict.fromkeys(_precheck.DTYPE_NAMES.values())) == dtype_names() == tuple(m.value for m in DtypeChoice)
    _same(lambda: dtype_name("fp8", "--dtype"), lambda: transform.parse_dtype("fp8"), prefix="--dtype ")


@pytest.mark.parametrize("rule", ["no-equals", "=x", "([=x", r"a\=b(="])
def test_rename_rules_are_the_librarys(rule: str) -> None:
    _same(lambda: check_rename(rule), lambda: transform.parse_rename(rule))


@pytest.mark.parametrize("rule", ["^=model.", "a(?=b)=c", "x=="])
def test_good_renames_pass(rule: str) -> None:
    check_rename(rule)
    transform.parse_rename(rule)


@pytest.mark.parametrize(
    ("argv", "bad"),
    [
        (["-v", "2", "consolidate"], True),
        (["--quiet", "1", "inspect"], True),
        (["--debug", "-v", "3"], True),
        (["-vv", "2", "inspect"], True),
        (["-v", "consolidate", "ck", "2"], False),  # after the command a number is its argument
        (["consolidate", "-v", "2", "out"], False),
        (["-vv", "inspect", "ck"], False),
        ([], False),
    ],
)
def test_a_number_after_v_before_the_command(argv: list[str], bad: bool) -> None:
    if bad:
        with pytest.raises(InvalidOptionError, match="takes no number"):
            check_argv(argv)
    else:
        check_argv(argv)


def test_output_exists_is_output_exists_error(tmp_path: Path) -> None:
    (tmp_path / "ck").mkdir()
    (tmp_path / "o.pt").write_bytes(b"")
    assert isinstance(_raised(_consolidate_check(tmp_path / "ck", tmp_path / "o.pt")), OutputExistsError)
    (tmp_path / "link.pt").symlink_to(tmp_path / "gone.pt")  # a dangling link is taken too, as the library does
    assert isinstance(_raised(_consolidate_check(tmp_path / "ck", tmp_path / "link.pt")), OutputExistsError)
