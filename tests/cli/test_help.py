"""--help as a newcomer meets it in an 80-column terminal: nothing cut or wider, examples whole, true defaults."""

from __future__ import annotations

import dataclasses
import logging
import re
from pathlib import Path
from typing import Any

import pytest
import typer
from rich.cells import cell_len
from typer.testing import CliRunner

from fsdp_convert.cli import app, consolidate_cmd, inspect_cmd, reshard_cmd, verify_cmd
from fsdp_convert.cli._run_options import NPROC_DEFAULT
from fsdp_convert.cli.app import EXIT_CODES

COMMANDS = {"": None, "inspect": inspect_cmd, "consolidate": consolidate_cmd, "reshard": reshard_cmd, "verify": verify_cmd}
# typer's own flags, rendered by typer (their type column is not ours to set)
TYPERS_OWN = ("--help", "--install-completion", "--show-completion")


def _command(command: str) -> Any:
    """A command (or the app, for ""), as typer builds it."""
    group = typer.main.get_command(app)
    return group.commands[command] if command else group  # type: ignore[attr-defined]


def _params(command: str) -> list[Any]:
    """The declared parameters of a command (or of the app, for ""), but the hidden ones."""
    return [p for p in _command(command).params if not getattr(p, "hidden", False)]


def _help(runner: CliRunner, command: str, columns: int = 80) -> str:
    result = runner.invoke(app, [*command.split(), "--help"], env={"COLUMNS": str(columns)})
    assert result.exit_code == 0, result.stderr
    return result.stdout


def _whole(word: str) -> re.Pattern[str]:
    """``word`` not cut and not part of a longer name (--nproc is not --nproc-per…)."""
    return re.compile(rf"(?<![\w-]){re.escape(word)}(?![\w-])")


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_help_fits_80_columns_and_cuts_nothing(runner: CliRunner, command: str) -> None:
    text = _help(runner, command)
    lines = text.splitlines()
    assert len(lines) > 10
    assert max(cell_len(line) for line in lines) <= 80, "\n".join(line for line in lines if cell_len(line) > 80)
    # rich's mark of a cut cell (option name, type, help word): only where our own texts write one
    ours = [_command(command).help or "", *(getattr(p, "help", None) or "" for p in _params(command))]
    assert text.count("…") == sum(t.count("…") for t in ours)
    for param in _params(command):
        names = [*param.opts, *param.secondary_opts] if param.param_type_name == "option" else [param.metavar]
        for name in names:
            assert _whole(name).search(text), f"{name} is cut or missing"
        row = next(line for line in lines if re.match(rf"│[\s*]*{re.escape(names[0])}(?![\w-])", line))  # its first line
        if param.param_type_name == "option" and param.metavar:  # its choices or value name, whole on that line
            assert param.metavar in row, (param.metavar, row)
        if param.param_type_name == "option" and names[0] not in TYPERS_OWN:
            assert "<bool>" not in row and "<int>" not in row, row  # a flag shows no type; values have names
    # each example is one line, never broken mid-command
    for example in (COMMANDS[command].EXAMPLES if COMMANDS[command] else "").splitlines():
        if example.strip().startswith("fsdp-convert"):
            assert example.strip() in [line.strip() for line in lines], example
    # the exit codes: one line each, as written
    epilog = verify_cmd.EXIT_CODES if command == "verify" else EXIT_CODES
    for line in epilog.splitlines():
        assert line.strip() in [rendered.strip() for rendered in lines], line


def test_brackets_meant_literally_survive_rich_markup(runner: CliRunner) -> None:
    assert "pip install 'fsdp-convert[zstd]'" in " ".join(_help(runner, "reshard", 250).split())
    for command in ("consolidate", "reshard", "verify"):
        assert "[default: keep]" in _help(runner, command, 250)


@pytest.mark.parametrize(
    ("command", "default"), [("consolidate", NPROC_DEFAULT), ("reshard", NPROC_DEFAULT), ("verify", NPROC_DEFAULT)]
)
def test_nproc_default_says_what_is_picked(runner: CliRunner, command: str, default: str) -> None:
    row = next(line for line in _help(runner, command, 250).splitlines() if re.match(r"│\s*--nproc ", line))
    assert f"[default: {default}]" in row and "--nproc-per-node" in row, row


def test_the_nproc_default_text_is_plans_rule() -> None:
    """NPROC_DEFAULT is what plan.default_nproc computes (consolidate and reshard call it when --nproc is not given)."""
    from fsdp_convert.plan.consolidate import MIN_BYTES_PER_WORKER, default_nproc

    assert f"per {MIN_BYTES_PER_WORKER >> 30} GiB" in NPROC_DEFAULT and "one per CPU core" in NPROC_DEFAULT
    gib = 1 << 30
    assert default_nproc(100 * gib, data_files=100, cpus=4) == 4  # one per core
    assert default_nproc(100 * gib, data_files=3, cpus=8) == 3  # at most one per data file
    assert default_nproc(3 * gib, data_files=100, cpus=8) == 2  # at most one per 2 GiB
    assert default_nproc(1, data_files=1, cpus=1) == 1


def test_nproc_per_node_still_works_hidden(runner: CliRunner, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    seen: dict[str, Any] = {}

    def fake(checkpoint: str, output: str, options: Any = None, **kwargs: Any) -> None:
        if options is not None:  # the command builds ConsolidateOptions by keyword
            seen.update({f.name: getattr(options, f.name) for f in dataclasses.fields(options)})
        seen.update(kwargs)
        raise KeyboardInterrupt

    monkeypatch.setattr(consolidate_cmd, "consolidate", fake)
    (tmp_path / "ck").mkdir()
    result = runner.invoke(app, ["consolidate", str(tmp_path / "ck"), str(tmp_path / "o.pt"), "--nproc-per-node", "3"])
    assert result.exit_code == 130 and seen["nproc"] == 3, result.stderr
    rows = _help(runner, "consolidate").splitlines()
    assert not [row for row in rows if re.match(r"│ ?--nproc(,--nproc-per-node|-per-node)", row)]  # not in the name column
    result = runner.invoke(
        app, ["consolidate", str(tmp_path / "ck"), str(tmp_path / "o.pt"), "--nproc", "2", "--nproc-per-node", "3"]
    )
    assert result.exit_code == 2 and result.stderr.startswith("error: --nproc 2 and --nproc-per-node 3"), result.stderr


@pytest.mark.parametrize(
    ("before", "after", "level"),
    [
        ([], [], logging.WARNING),
        (["-v"], [], logging.INFO),
        ([], ["-v"], logging.INFO),  # after the command, as pip and hf users type it
        ([], ["-vv"], logging.DEBUG),
        (["--verbose"], ["-v"], logging.DEBUG),
        ([], ["-q"], logging.ERROR),
        (["--quiet"], [], logging.ERROR),
        (["-v"], ["-q"], logging.WARNING),
    ],
)
def test_verbosity_before_or_after_the_command(
    runner: CliRunner, monkeypatch: pytest.MonkeyPatch, tmp_path: Path, before: list[str], after: list[str], level: int
) -> None:
    seen: dict[str, Any] = {}

    def fake(checkpoint: str, output: str, *_: Any, **kwargs: Any) -> None:
        seen["level"] = logging.getLogger("fsdp_convert").getEffectiveLevel()
        logging.getLogger("fsdp_convert.ops.consolidate").info("an info line of the library")
        raise KeyboardInterrupt

    monkeypatch.setattr(consolidate_cmd, "consolidate", fake)
    (tmp_path / "ck").mkdir()
    result = runner.invoke(app, [*before, "consolidate", str(tmp_path / "ck"), str(tmp_path / "o.pt"), *after])
    assert result.exit_code == 130, result.stderr
    assert seen["level"] == level
    assert ("an info line of the library" in result.stderr) == (level <= logging.INFO)


@pytest.mark.parametrize(
    ("args", "terminal", "progress"),
    [
        ([], True, True),
        ([], False, False),
        (["-q"], True, False),  # -q: no bars
        (["--json"], True, False),
        (["-q", "--progress"], False, True),  # asked for
        (["--no-progress"], True, False),
    ],
)
def test_progress_default(
    runner: CliRunner, monkeypatch: pytest.MonkeyPatch, tmp_path: Path, args: list[str], terminal: bool, progress: bool
) -> None:
    from fsdp_convert.cli import _verbosity

    seen: dict[str, Any] = {}

    def fake(*args: Any, **kwargs: Any) -> None:
        for arg in args:  # an options dataclass built by keyword: its fields are what the command asked
            if dataclasses.is_dataclass(arg):
                seen.update({f.name: getattr(arg, f.name) for f in dataclasses.fields(arg)})
        seen.update(kwargs)
        raise KeyboardInterrupt

    monkeypatch.setattr(_verbosity, "_stderr_is_terminal", lambda: terminal)
    (tmp_path / "ck").mkdir()
    for module, name, argv in (
        (consolidate_cmd, "consolidate", ["consolidate", str(tmp_path / "ck"), str(tmp_path / "o.pt")]),
        (reshard_cmd, "reshard", ["reshard", str(tmp_path / "ck"), str(tmp_path / "new"), "--world-size", "1"]),
        (verify_cmd, "verify", ["verify", str(tmp_path / "ck"), str(tmp_path / "ck")]),
    ):
        monkeypatch.setattr(module, name, fake)
        seen.clear()
        result = runner.invoke(app, [*argv, *args])
        assert result.exit_code == 130, result.stderr
        assert seen["progress"] is progress, name
