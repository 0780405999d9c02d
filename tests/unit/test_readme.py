"""README.md and docs/: the README's examples run and print what it shows, and every link resolves.

The "Use it from Python" section runs as a doctest and the command transcripts (```console blocks)
run through the CLI, both on the 3-rank sample checkpoint (``ws3_ckpt``: the model and world size
``scripts/demo.sh`` trains, so the same counts and sizes), in a temporary folder.
"""

from __future__ import annotations

import dataclasses
import doctest
import inspect
import io
import os
import re
import shlex
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

import fsdp_convert
from fsdp_convert.cli import app
from tests._samples import Sample

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
DOCS = sorted((ROOT / "docs").glob("*.md"))
FIRST_SCREEN = 40  # lines


def _section(text: str, title: str) -> str:
    """The body of the ``## title`` section (up to the next ``##`` heading)."""
    match = re.search(rf"^## {re.escape(title)}\n(.*?)(?=^## |\Z)", text, re.M | re.S)
    assert match, f"README.md has no '## {title}' section"
    return match.group(1)


def _fenced(text: str, lang: str) -> list[str]:
    """The contents of the ```lang blocks of ``text``."""
    return re.findall(rf"^```{lang}\n(.*?)^```", text, re.M | re.S)


def test_readme_python_section_runs_as_doctest(ws3_ckpt: Sample, tmp_path: Path) -> None:
    """Each ```python block of the section, in order, one namespace (``ckpt``: the sample, ``out``: an
    empty folder); a failure names its README line."""
    text = README.read_text()
    blocks = _fenced(_section(text, "Use it from Python"), "python")
    globs: dict[str, object] = {"ckpt": ws3_ckpt.checkpoint, "out": tmp_path}
    runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    report = io.StringIO()
    examples = 0
    for block in blocks:
        lineno = text[: text.index(block)].count("\n")  # doctest adds the example's own line
        test = doctest.DocTestParser().get_doctest(block, globs, "README.md: Use it from Python", str(README), lineno)
        runner.run(test, out=report.write, clear_globs=False)
        globs = test.globs
        examples += len(test.examples)
    assert examples >= 10, "the section lost its >>> examples"
    assert runner.failures == 0, report.getvalue()
    assert runner.tries == examples


def _transcript() -> list[tuple[str, list[str]]]:
    """Each ``$ fsdp-convert ...`` line of the README's console blocks with the lines shown after it."""
    steps: list[tuple[str, list[str]]] = []
    for block in _fenced(README.read_text(), "console"):
        for line in block.splitlines():
            if line.startswith("$ "):
                steps.append((line[2:], []))
            else:
                assert steps, f"output before any command in a console block: {line!r}"
                steps[-1][1].append(line)
    return steps


def _without_time(line: str) -> str:
    return re.sub(r" in \d+(\.\d+)? s$", " in <seconds> s", line)


def test_readme_commands_print_what_it_shows(ws3_ckpt: Sample, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every command the README shows runs, in order, on the sample and prints the lines shown
    (up to a closing ``...``; wall times aside); a shown ``error:`` line is a non-zero exit."""
    (tmp_path / "demo-output").mkdir()
    (tmp_path / "demo-output" / "checkpoint").symlink_to(ws3_ckpt.checkpoint, target_is_directory=True)
    monkeypatch.chdir(tmp_path)
    steps = _transcript()
    assert any(cmd.startswith("fsdp-convert consolidate ") for cmd, _ in steps)
    for command, shown in steps:
        args = shlex.split(command)
        assert args[0] == "fsdp-convert", command
        result = CliRunner().invoke(app, args[1:], env={"COLUMNS": "120"})
        failed = bool(shown) and shown[0].startswith("error: ")
        assert (result.exit_code != 0) == failed, (command, result.exit_code, result.stdout, result.stderr)
        got = (result.stderr if failed else result.stdout).splitlines()
        if shown and shown[-1] == "...":
            shown = shown[:-1]
            got = got[: len(shown)]
        assert [_without_time(x) for x in got] == [_without_time(x) for x in shown], command


def test_readme_first_screen_installs_and_runs() -> None:
    first = README.read_text().splitlines()[:FIRST_SCREEN]
    assert any(line.startswith("pip install fsdp-convert") for line in first), "no install line on the first screen"
    assert any(re.match(r"(\$ )?fsdp-convert consolidate \S+ \S+", line) for line in first), "no consolidate example"


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def _anchors(path: Path) -> set[str]:
    text = re.sub(r"^```.*?^```", "", path.read_text(), flags=re.M | re.S)
    return {_slug(h) for h in re.findall(r"^#+ (.*)$", text, re.M)}


def _links(path: Path) -> list[str]:
    text = re.sub(r"^```.*?^```", "", path.read_text(), flags=re.M | re.S)
    text = re.sub(r"`[^`\n]*`", "", text)
    return re.findall(r"\]\(([^)\s]+)\)", text)


@pytest.mark.parametrize("page", [README, *DOCS], ids=lambda p: p.relative_to(ROOT).as_posix())
def test_relative_links_point_at_existing_files(page: Path) -> None:
    links = [x for x in _links(page) if not re.match(r"[a-z]+:", x)]
    for link in links:
        target, _, anchor = link.partition("#")
        path = (page.parent / target).resolve() if target else page
        assert path.exists(), f"{page.name}: {link} points at nothing"
        if anchor and path.suffix == ".md":
            assert anchor in _anchors(path), f"{page.name}: {link}: no such heading in {path.name}"


def test_docs_pages_are_linked_from_the_readme() -> None:
    assert DOCS, "docs/ has no pages"
    linked = {(README.parent / x.partition("#")[0]).resolve() for x in _links(README)}
    assert {p.resolve() for p in DOCS} <= linked, "a docs/ page the README does not link"


def test_readme_setup_commands_are_executable_scripts() -> None:
    blocks = _fenced(_section(README.read_text(), "Set up a checkout"), "bash")
    named = [line.split()[0] for block in blocks for line in block.splitlines() if line.startswith("scripts/")]
    assert {"scripts/demo.sh", "scripts/test.sh"} <= set(named), named
    for script in named:
        path = ROOT / script
        assert path.is_file() and os.access(path, os.X_OK), f"{script} is not an executable file"


def _field_as_parameter(field: dataclasses.Field[Any]) -> inspect.Parameter:
    """A dataclass field as the keyword parameter it stands for (a default factory: any default)."""
    if field.default is not dataclasses.MISSING:
        default: Any = field.default
    elif field.default_factory is not dataclasses.MISSING:
        default = ...
    else:
        default = inspect.Parameter.empty
    return inspect.Parameter(field.name, inspect.Parameter.KEYWORD_ONLY, default=default)


def test_library_page_lists_each_function_with_its_signature() -> None:
    """docs/library.md's table of functions: each parameter, in order, with its default (``...``: any)."""
    rows = re.findall(r"^\| `(\w+)\((.*?)\)`", (ROOT / "docs" / "library.md").read_text(), re.M)
    assert {name for name, _ in rows} == {"inspect", "consolidate", "reshard", "verify"}, rows
    options_class = {"consolidate": "ConsolidateOptions", "reshard": "ReshardOptions", "verify": "VerifyOptions"}
    for name, params in rows:
        shown = [x.strip() for x in params.split(",") if x.strip() != "*"]
        actual: list[Any] = list(inspect.signature(getattr(fsdp_convert, name)).parameters.values())
        if actual[-1].kind is inspect.Parameter.VAR_KEYWORD:  # keyword arguments: the options dataclass's fields
            fields = dataclasses.fields(getattr(fsdp_convert, options_class[name]))
            actual = actual[:-1] + [_field_as_parameter(f) for f in fields]
        assert [x.partition("=")[0] for x in shown] == [p.name for p in actual], name
        for text, param in zip(shown, actual, strict=True):
            _, has_default, default = text.partition("=")
            assert bool(has_default) == (param.default is not param.empty), (name, text)
            if has_default and default != "..." and param.default is not ...:
                assert default == repr(param.default).replace("'", '"'), (name, text, param.default)
