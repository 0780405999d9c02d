"""A newcomer's first hour: --debug after the command, --help at 80 columns, what a folder OUT holds,
what ``producer: fsdp`` means, and a demo that installs only what the tool needs."""

from __future__ import annotations

import re
import shlex
from pathlib import Path
from typing import Any

import pytest
import typer
from typer.testing import CliRunner

from fsdp_convert.cli import app, consolidate_cmd, inspect_cmd
from fsdp_convert.ops.inspect import InspectResult

ROOT = Path(__file__).resolve().parents[2]
COMMANDS = ("", "inspect", "consolidate", "reshard", "verify")
# the narrowest description column --help may leave at 80 columns (it was 26): a panel's column is what
# its longest option name and longest value leave; --format's value, [auto|torch|safetensors], is the
# longest any option shows, so its panel's column is narrower
MIN_DESCRIPTION = 37
MIN_BESIDE_FORMAT = 34


def _help(runner: CliRunner, command: str, columns: int = 80) -> str:
    result = runner.invoke(app, [*command.split(), "--help"], env={"COLUMNS": str(columns)})
    assert result.exit_code == 0, result.stderr
    return result.stdout


def _options(command: str) -> list[Any]:
    group = typer.main.get_command(app)
    cmd = group.commands[command] if command else group  # type: ignore[attr-defined]
    return [p for p in cmd.get_params(typer.Context(cmd)) if p.param_type_name == "option" and not getattr(p, "hidden", False)]


def _description_width(lines: list[str], name: str, metavar: str, help_text: str) -> int:
    """Columns from where an option's description starts, on its first line, to the panel's right border."""
    row = next(line for line in lines if re.match(rf"│[ *]{{1,6}}{re.escape(name)}(?![\w-])", line))
    after = row.index(name) + len(name)
    if metavar:
        after = row.index(metavar, after) + len(metavar)
    first_word = help_text.replace("\\", "").split()[0]
    start = row.index(" " + first_word, after) + 1
    return row.rindex("│") - 1 - start


@pytest.mark.parametrize("command", ["consolidate", "reshard", "verify", "inspect"])
def test_row13_debug_after_the_command_shows_the_traceback(
    runner: CliRunner, monkeypatch: pytest.MonkeyPatch, tmp_path: Path, command: str
) -> None:
    monkeypatch.delenv("FSDP_CONVERT_DEBUG", raising=False)
    assert "--debug" in [opt for p in _options(command) for opt in p.opts]
    if command != "consolidate":
        return  # each command takes it as consolidate does (set_verbosity); one runs here

    def fake(*args: Any, **kwargs: Any) -> None:
        raise RuntimeError("a bug")

    monkeypatch.setattr(consolidate_cmd, "consolidate", fake)
    (tmp_path / "ck").mkdir()
    args = ["consolidate", str(tmp_path / "ck"), str(tmp_path / "o.pt")]
    plain = runner.invoke(app, args)
    assert plain.exit_code == 70 and "Traceback" not in plain.stderr, plain.stderr
    assert "with the output of --debug" in plain.stderr
    after = runner.invoke(app, [*args, "--debug"])
    assert after.exit_code == 70, after.stderr
    assert "Traceback" in after.stderr and "RuntimeError: a bug" in after.stderr
    again = runner.invoke(app, args)  # the next invocation starts without it
    assert "Traceback" not in again.stderr


@pytest.mark.parametrize("command", COMMANDS)
def test_row15_help_at_80_columns_shows_no_bool_and_leaves_descriptions_the_width(runner: CliRunner, command: str) -> None:
    text = _help(runner, command)
    assert "<bool>" not in text, [line for line in text.splitlines() if "<bool>" in line]
    lines = text.splitlines()
    options = [p for p in _options(command) if p.help]
    format_panel = next((p.rich_help_panel for p in options if p.opts[0] == "--format"), None)
    narrow = {}
    for p in options:
        width = _description_width(lines, p.opts[0], p.metavar or "", p.help)
        floor = MIN_BESIDE_FORMAT if format_panel and p.rich_help_panel == format_panel else MIN_DESCRIPTION
        if width < floor:
            narrow[p.opts[0]] = width
    assert not narrow, narrow


def test_row10_out_help_says_what_a_folder_holds(runner: CliRunner) -> None:
    text = _help(runner, "consolidate")
    arguments = text[text.index("Arguments") : text.index("╰")]
    words = " ".join(re.sub(r"[│╭╮─]", " ", arguments).split())
    out = words[words.index("OUT") :]
    for said in ("shards", "index", "optimizer.pt", "extra_state.pt", "unless --only model"):
        assert said in out, (said, out)


def test_row7_inspect_says_what_fsdp_means(runner: CliRunner, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """A checkpoint whose layout FSDP1 and FSDP2 both write (no tensor small enough to tell them apart)."""
    (tmp_path / "ck").mkdir()
    (tmp_path / "ck" / ".metadata").write_bytes(b"")

    def fake(checkpoint: str) -> InspectResult:
        return InspectResult(
            checkpoint_id=Path(checkpoint),
            producer="fsdp",
            world_size=2,
            total_bytes=0,
            data_files=(),
            version=None,
            entries=(),
        )

    monkeypatch.setattr(inspect_cmd, "inspect_checkpoint", fake)
    result = runner.invoke(app, ["inspect", str(tmp_path / "ck")])
    assert result.exit_code == 0, result.stderr
    assert "producer: fsdp (FSDP1 or FSDP2: the same layout)   world size: 2" in result.stdout
    assert inspect_cmd.producer_text("fsdp2") == "fsdp2"  # a name that says it all stays as it is
    assert inspect_cmd.producer_text("no-such-producer") == "no-such-producer"
    json_result = runner.invoke(app, ["inspect", str(tmp_path / "ck"), "--json"])
    assert '"producer": "fsdp"' in json_result.stdout  # the JSON keeps the name


def _pip_installs(script: str) -> list[list[str]]:
    """The arguments of each ``pip install`` in ``script`` (lines joined at a trailing backslash)."""
    installs = []
    for line in script.replace("\\\n", " ").splitlines():
        words = shlex.split(line, comments=True)
        if "pip" in words and "install" in words[words.index("pip") :]:
            installs.append(words[words.index("install", words.index("pip")) + 1 :])
    return installs


def test_row3_demo_venv_installs_the_runtime_only() -> None:
    """The demo installs torch (pinned as scripts/setup.sh pins it), the package without extras, and numpy
    (the training run's dcp.save needs it): never setup.sh's test and lint venv."""
    script = (ROOT / "scripts" / "demo.sh").read_text()
    setup = (ROOT / "scripts" / "setup.sh").read_text()
    commands = [line for line in script.splitlines() if line.strip() and not line.lstrip().startswith("#")]
    assert not any("setup.sh" in line for line in commands), "the demo runs scripts/setup.sh (test and lint extras)"
    installs = _pip_installs(script)
    assert installs, "the demo installs nothing of its own"
    requirements = [w for args in installs for w in args if not w.startswith("-")]
    assert not any("[" in r for r in requirements), requirements  # no extras
    assert not any(w in ("-r", "--requirement") for args in installs for w in args)
    assert sorted(requirements) == sorted(["torch==$TORCH_VERSION", "numpy", "."]), requirements
    pinned = re.compile(r"^TORCH_VERSION=\$\{TORCH_VERSION:-([\d.]+)\}$", re.M)
    assert pinned.findall(script) == pinned.findall(setup), "the demo pins torch as scripts/setup.sh does"
    assert all("-q" in args for args in installs), "pip quiet"
    # its transcript: inspect's header and table titles, not its whole table
    assert re.search(r"fsdp-convert inspect .*>\s*\"\$OUT/inspect.txt\"", script)
