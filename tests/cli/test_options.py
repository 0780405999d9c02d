"""Global options and option values: --version, shell completion, choices listed by --help."""

from __future__ import annotations

import dataclasses
import re
import subprocess
import sys
from importlib.metadata import version
from pathlib import Path
from typing import Any

import pytest
import torch
from typer.testing import CliRunner

from fsdp_convert.cli import app
from fsdp_convert.cli._options import DtypeChoice, OptimKeysChoice, parse_size
from fsdp_convert.errors import InvalidOptionError

WIDE = {"COLUMNS": "250"}  # one help line per option, so each metavar can be found whole


def test_version_prints_package_and_torch_versions(runner: CliRunner) -> None:
    result = runner.invoke(app, ["--version"])
    assert result.exit_code == 0, result.stderr
    assert result.stdout == f"fsdp-convert {version('fsdp-convert')} (torch {version('torch')})\n"
    # the distribution's version: torch.__version__ may add a local build tag (2.14.1+cu130 for 2.14.1)
    assert torch.__version__.split("+")[0] in result.stdout and result.stderr == ""


def test_version_and_help_run_without_importing_torch() -> None:
    """The CLI imports the operations (and so torch, seconds to load) only when a command runs."""
    probe = (
        "import sys\n"
        "from fsdp_convert.cli import main\n"
        "sys.modules['fsdp_convert.cli.app'].exit_process = sys.exit  # else main() ends the process\n"
        "sys.argv = ['fsdp-convert', '--version']\n"
        "try:\n"
        "    main()\n"
        "except SystemExit:\n"
        "    pass\n"
        "assert 'torch' not in sys.modules, 'torch was imported'\n"
    )
    proc = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("fsdp-convert ")
    assert "torch was imported" not in proc.stderr


def test_shell_completion_is_on(runner: CliRunner) -> None:
    result = runner.invoke(app, ["--help"], env=WIDE)
    assert result.exit_code == 0, result.stderr
    assert "--install-completion" in result.stdout and "--show-completion" in result.stdout
    # and the choices of an option complete, as the shell asks through typer's environment protocol
    words = "fsdp-convert consolidate ck o.pt --dtype b"
    env = {"_FSDP_CONVERT_COMPLETE": "complete_bash", "COMP_WORDS": words, "COMP_CWORD": "5"}
    result = runner.invoke(app, [], prog_name="fsdp-convert", env=env)
    assert result.exit_code == 0 and result.stdout.split() == ["bf16"], (result.stdout, result.stderr)


@pytest.mark.parametrize(
    ("command", "choices"),
    [
        (
            "consolidate",
            {
                "--only": "[all|model|optim]",
                "--format": "[auto|torch|safetensors]",
                "--optim-keys": "[names|ids]",
                "--layout": "[producer|nested]",
                "--dtype": "[fp32|bf16|fp16]",
                "--optim-dtype": "[fp32|bf16|fp16]",
                "--rdzv-backend": "[c10d|static]",
            },
        ),
        ("reshard", {"--optim-keys": "[names|ids]", "--dtype": "[fp32|bf16|fp16]", "--rdzv-backend": "[c10d|static]"}),
        ("verify", {"--rdzv-backend": "[c10d|static]"}),
    ],
)
def test_help_lists_the_choices(runner: CliRunner, command: str, choices: dict[str, str]) -> None:
    result = runner.invoke(app, [command, "--help"], env=WIDE)
    assert result.exit_code == 0, result.stderr
    lines = {m.group(1): line for line in result.stdout.splitlines() if (m := re.match(r"│[\s*]+(--[\w-]+)", line))}
    for flag, metavar in choices.items():
        assert metavar in lines[flag], lines[flag]
    assert "[default: keep]" in lines.get("--dtype", "[default: keep]")  # rich markup must not eat it


@pytest.mark.parametrize(
    ("command", "extra", "message"),
    [
        ("consolidate", ["--only", "weights"], "--only 'weights': use all, model or optim"),
        ("consolidate", ["--format", "gguf"], "--format 'gguf': use auto, torch or safetensors"),
        ("consolidate", ["--optim-keys", "numbers"], "--optim-keys 'numbers': use names or ids"),
        ("consolidate", ["--layout", "flat"], "--layout 'flat': use producer or nested"),
        ("consolidate", ["--dtype", "fp8"], "--dtype 'fp8' is not a dtype; use fp32, bf16 or fp16"),
        ("reshard", ["--world-size=2", "--optim-dtype", "int8"], "--optim-dtype 'int8' is not a dtype; use fp32, bf16 or fp16"),
        ("verify", ["--rdzv-backend", "etcd"], "--rdzv-backend 'etcd': use c10d or static"),
        ("consolidate", ["--max-shard-size", "lots"], "'lots' is not a size (examples: 1GiB, 512MiB, 5GB, 4096)"),
    ],
)
def test_bad_choice_is_a_one_line_usage_error(
    runner: CliRunner, tmp_path: Path, command: str, extra: list[str], message: str
) -> None:
    result = runner.invoke(app, [command, str(tmp_path / "missing"), str(tmp_path / "out.pt"), *extra])
    assert result.exit_code == 2, (result.stdout, result.stderr)
    assert result.stdout == "" and result.stderr == f"error: {message}\n"
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(
    ("text", "member"),
    [("fp32", DtypeChoice.fp32), ("float32", DtypeChoice.fp32), (" BF16 ", DtypeChoice.bf16), ("bfloat16", DtypeChoice.bf16)]
    + [("fp16", DtypeChoice.fp16), ("float16", DtypeChoice.fp16), ("half", DtypeChoice.fp16)],
)
def test_dtype_keeps_its_other_spellings(text: str, member: DtypeChoice) -> None:
    assert DtypeChoice.parse(text, "--dtype") is member


def test_the_library_gets_its_own_types(runner: CliRunner, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """Choices are Enums up to the command; consolidate() still takes strings and torch dtypes."""
    import fsdp_convert.cli.consolidate_cmd as consolidate_cmd

    seen: dict[str, Any] = {}

    def fake_consolidate(checkpoint: str, output: str, options: Any = None, **kwargs: Any) -> None:
        if options is not None:  # the command builds ConsolidateOptions by keyword: its fields are what it asked
            seen.update({f.name: getattr(options, f.name) for f in dataclasses.fields(options)})
        seen.update(kwargs)
        raise KeyboardInterrupt  # stop before rendering a result

    monkeypatch.setattr(consolidate_cmd, "consolidate", fake_consolidate)
    (tmp_path / "ck").mkdir()  # the command checks that it exists before it calls the library
    args = ["consolidate", str(tmp_path / "ck"), str(tmp_path / "o.pt"), "--only", "model", "--format", "torch"]
    args += ["--optim-keys", "ids"]
    args += [
        "--dtype",
        "half",
        "--optim-dtype",
        "BF16",
        "--rdzv-backend",
        "static",
        "--max-shard-size",
        "2GB",
        "--layout",
        "nested",
    ]
    result = runner.invoke(app, args)
    assert result.exit_code == 130, result.stderr
    assert type(seen["only"]) is str and seen["only"] == "model"
    assert type(seen["output_format"]) is str and seen["output_format"] == "torch"
    options, cluster = seen["transform"], seen["cluster"]
    assert type(options.optim_keys) is str and options.optim_keys == OptimKeysChoice.ids.value
    assert (options.dtype, options.optim_dtype) == (torch.float16, torch.bfloat16)
    assert type(options.layout) is str and options.layout == "nested"
    assert type(cluster.rdzv_backend) is str and cluster.rdzv_backend == "static"
    assert (seen["max_shard_bytes"], seen["memory_budget_bytes"]) == (2 * 10**9, 256 * 2**20)


@pytest.mark.parametrize(
    ("text", "value"),
    [("4096", 4096), ("1GiB", 2**30), ("512MiB", 512 * 2**20), ("5GB", 5 * 10**9), ("1.5kb", 1500), (" 2 MB ", 2 * 10**6)],
)
def test_parse_size(text: str, value: int) -> None:
    assert parse_size(text) == value


@pytest.mark.parametrize("text", ["", "lots", "1XB", "0", "-5MB"])
def test_parse_size_rejects(text: str) -> None:
    with pytest.raises(InvalidOptionError):
        parse_size(text)


def test_the_default_max_shard_size_is_what_save_pretrained_uses() -> None:
    import inspect as pyinspect

    import transformers
    from transformers import PreTrainedModel

    from fsdp_convert.cli.consolidate_cmd import consolidate_command
    from fsdp_convert.plan.consolidate import DEFAULT_MAX_SHARD_BYTES

    ours = pyinspect.signature(consolidate_command).parameters["max_shard_size"].default
    assert parse_size(ours) == DEFAULT_MAX_SHARD_BYTES == 50 * 10**9
    theirs = pyinspect.signature(PreTrainedModel.save_pretrained).parameters["max_shard_size"].default
    # transformers 5 (what the test extra installs fresh) uses ours; 4.x used 5GB (docs/options.md says so)
    assert parse_size(theirs) == (DEFAULT_MAX_SHARD_BYTES if int(transformers.__version__.split(".")[0]) >= 5 else 5 * 10**9)


def test_every_choice_reads_as_its_value_through_typers_enum_convertor() -> None:
    """typer before 0.28 (the declared floor is 0.12) converts an Enum option's default through
    str() and looks the result up among the values: with Python 3.11+'s 'OptimKeysChoice.names'
    the default arrived as None, and every consolidate without --optim-keys was an internal error."""
    from fsdp_convert.cli import _options

    kinds = [k for k in vars(_options).values() if isinstance(k, type) and issubclass(k, _options.Choice)]
    assert len(kinds) > 5
    for kind in kinds:
        by_value = {str(m.value).lower(): m for m in kind}  # typer 0.12-0.27's generate_enum_convertor
        for member in kind:
            assert by_value.get(str(member).lower()) is member, (kind.__name__, member)
