"""docs/architecture.md and the code agree: the stages of an operation, and the extension cases' files.

The stage table is the one list of stages; ``consolidate`` and ``reshard`` mark each stage in their
body with a ``# N. <stage>:`` comment, in order, so a renumbered or reordered stage fails here.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
ARCHITECTURE = ROOT / "docs" / "architecture.md"
STAGE_ROW = re.compile(r"^\| (\d+) \| ([a-z ]+) \|", re.M)
STAGE_COMMENT = re.compile(r"#\s*(\d+)\.\s+([a-z ]+):")


def _doc_stages() -> list[tuple[int, str]]:
    text = ARCHITECTURE.read_text()
    table = text.split("## The stages of an operation", 1)[1].split("\n## ", 1)[0]
    return [(int(n), name) for n, name in STAGE_ROW.findall(table)]


def _code_stages(module: str, function: str) -> list[tuple[int, str]]:
    source = (ROOT / "fsdp_convert" / module).read_text()
    node = next(n for n in ast.walk(ast.parse(source)) if isinstance(n, ast.FunctionDef) and n.name == function)
    body = "\n".join(source.splitlines()[node.body[1].lineno - 1 : node.end_lineno])  # after the docstring
    return [(int(n), name) for n, name in STAGE_COMMENT.findall(body)]


def test_the_stage_table_is_numbered_in_order() -> None:
    stages = _doc_stages()
    assert [n for n, _ in stages] == list(range(1, len(stages) + 1)), stages
    assert len(stages) >= 8


@pytest.mark.parametrize(("module", "function"), [("ops/consolidate.py", "consolidate"), ("ops/reshard.py", "reshard")])
def test_each_operation_runs_the_documented_stages_in_order(module: str, function: str) -> None:
    assert _code_stages(module, function) == _doc_stages()


def test_operations_docstrings_do_not_restate_the_stages() -> None:
    """The stages live in the table and the code's comments; a docstring that numbers them would drift."""
    for module in ("ops/consolidate.py", "ops/reshard.py"):
        text = (ROOT / "fsdp_convert" / module).read_text()
        assert not re.search(r"\(\d+\) |Stages: 1\.", text), module


# each worked example registers its extension in the test alone: the modules it patches are the files
# of fsdp_convert/ a newcomer edits (an adapter's own module is a new file, here the test itself)
EXTENSIONS = {
    "tests/unit/test_producer_extension.py": {"fsdp_convert.producers"},  # one record
    "tests/unit/test_output_kind_extension.py": {"fsdp_convert.output_table", "fsdp_convert.outputs"},  # a row, a class
    "tests/unit/test_adapter_extension.py": {"fsdp_convert.adapters"},  # one row, beside the family's new module
}
PATCH = re.compile(r"monkeypatch\.(?:setattr|setitem)\(\s*(\w+)")
FROM_IMPORT = re.compile(r"^from (fsdp_convert(?:\.\w+)*) import ([\w, ]+)$", re.M)


@pytest.mark.parametrize("test_file", sorted(EXTENSIONS))
def test_each_extension_case_takes_at_most_two_files(test_file: str) -> None:
    text = (ROOT / test_file).read_text()
    modules = {name: f"{package}.{name}" for package, names in FROM_IMPORT.findall(text) for name in names.split(", ")}
    patched = {modules.get(target, target) for target in PATCH.findall(text)}
    assert patched == EXTENSIONS[test_file]
    new_module = test_file.endswith("adapter_extension.py")
    assert len(patched) + new_module <= 2
