"""The built-in adapters' records: what each says it reads is what its code reads, and docs/huggingface.md is their table."""

from __future__ import annotations

import ast
import inspect
import textwrap
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from fsdp_convert.adapters import ADAPTER_RECORDS, ADAPTERS, STEPS, AdapterRecord, adapter_record, load_adapter, tables
from fsdp_convert.adapters._common import config_int, heads, tied
from fsdp_convert.errors import InvalidOptionError
from fsdp_convert.transform.fp8 import dequantizes

DOCS = Path(__file__).resolve().parents[2] / "docs" / "huggingface.md"


def test_docs_adapter_table_is_the_one_the_records_render() -> None:
    assert tables.render_adapter_table() in DOCS.read_text(), "docs/huggingface.md: paste tables.render_adapter_table()"


def test_docs_rows_name_every_record_in_order() -> None:
    rows = tables.render_adapter_table().splitlines()[2 : 2 + len(ADAPTER_RECORDS)]
    assert [row.split(" | ")[0].removeprefix("| ").strip("`") for row in rows] == [r.name for r in ADAPTER_RECORDS]


def test_adapters_is_the_records_by_name() -> None:
    names = [r.name for r in ADAPTER_RECORDS]
    assert len(set(names)) == len(names), names
    assert ADAPTERS == {r.name: r.function for r in ADAPTER_RECORDS}
    assert all(adapter_record(name) is r for name, r in zip(names, ADAPTER_RECORDS, strict=True))
    assert adapter_record("mymodule:to_hf") is None and adapter_record("no-such-adapter") is None


@pytest.mark.parametrize("record", ADAPTER_RECORDS, ids=lambda r: r.name)
def test_each_record_is_well_formed(record: AdapterRecord) -> None:
    assert "-to-" in record.name and record.direction == f"{record.source} → {record.target}"
    assert set(record.needs) <= set(record.reads), record.needs
    assert set(record.implies) <= set(STEPS), record.implies
    assert record.family and record.follows and record.changes
    doc = record.to_json_dict()
    assert doc["function"] == f"{record.function.__module__}:{record.function.__qualname__}"
    assert "`" not in doc["follows"] + doc["changes"]  # plain text, not Markdown


# --- what each function reads of its config, found in its code -----------------------------------------


def _is_config(node: ast.AST) -> bool:
    return isinstance(node, ast.Name) and node.id == "config"


def _is_config_get(node: ast.AST) -> bool:
    return (
        isinstance(node, ast.Call)
        and isinstance(node.func, ast.Attribute)
        and node.func.attr == "get"
        and _is_config(node.func.value)
    )


def _fields_read(function: Callable[..., Any], seen: set[str] | None = None) -> tuple[list[str], list[str]]:
    """``(fields read, fields needed)`` by ``function``'s code, in the order it names them.

    A field is the first name of a ``config_int(config, NAME, ...)`` call (needed when it has no
    ``default=``; the later names are aliases) or of a ``config.get(NAME, ...)`` call (never needed;
    a ``config.get`` in another's default is an alias) or ``config[NAME]``; a call passing ``config``
    to another function of the adapters package reads what that function reads.
    """
    seen = set() if seen is None else seen
    seen.add(function.__qualname__ + function.__module__)
    tree = ast.parse(textwrap.dedent(inspect.getsource(function)))
    aliases = {id(arg) for node in ast.walk(tree) if _is_config_get(node) for arg in node.args[1:] if _is_config_get(arg)}  # type: ignore[attr-defined]
    reads: list[str] = []
    needs: list[str] = []
    nodes = sorted(
        (n for n in ast.walk(tree) if isinstance(n, (ast.Call, ast.Subscript))), key=lambda n: (n.lineno, n.col_offset)
    )
    for node in nodes:
        if isinstance(node, ast.Subscript):
            if _is_config(node.value) and isinstance(node.slice, ast.Constant):
                reads.append(str(node.slice.value))
                needs.append(str(node.slice.value))
            continue
        if _is_config_get(node) and id(node) not in aliases:
            reads.append(node.args[0].value)  # type: ignore[attr-defined]
            continue
        if not isinstance(node.func, ast.Name) or not any(_is_config(arg) for arg in node.args):
            continue
        callee = function.__globals__.get(node.func.id)
        if callee is config_int:
            field = node.args[1].value  # type: ignore[attr-defined]
            reads.append(field)
            if not any(k.arg == "default" for k in node.keywords):
                needs.append(field)
        elif inspect.isfunction(callee) and callee.__module__.startswith("fsdp_convert.adapters"):
            if callee.__qualname__ + callee.__module__ not in seen:
                more_reads, more_needs = _fields_read(callee, seen)
                reads += more_reads
                needs += more_needs
    return list(dict.fromkeys(reads)), list(dict.fromkeys(needs))


@pytest.mark.parametrize("record", ADAPTER_RECORDS, ids=lambda r: r.name)
def test_each_record_names_the_config_fields_its_code_reads(record: AdapterRecord) -> None:
    reads, needs = _fields_read(record.function)
    assert (list(record.reads), list(record.needs)) == (reads, needs), record.name


def test_the_code_walk_finds_each_kind_of_read() -> None:
    def stub(tensors: Any, config: Any) -> Any:
        n_heads, n_kv = heads(config)  # _common.heads: both, kv with a default
        layers = config_int(config, "num_hidden_layers", "num_layers")
        return n_heads, n_kv, layers, config.get("model_type"), config["prefix"], tied(config)

    reads, needs = _fields_read(stub)
    heads_and_layers = ["num_attention_heads", "num_key_value_heads", "num_hidden_layers"]
    assert reads == [*heads_and_layers, "model_type", "prefix", "tie_word_embeddings"]
    assert needs == ["num_attention_heads", "num_hidden_layers", "prefix"]


# --- the implied steps are what load_adapter does ---------------------------------------------------------


@pytest.mark.parametrize("record", ADAPTER_RECORDS, ids=lambda r: r.name)
def test_an_implied_dequantize_is_what_load_adapter_chains(record: AdapterRecord) -> None:
    config = {"num_attention_heads": 4, "num_hidden_layers": 2}
    assert dequantizes(load_adapter(record.name, config)) == ("dequantize" in record.implies)


def test_an_unknown_name_lists_every_built_in_on_one_line() -> None:
    with pytest.raises(InvalidOptionError) as caught:
        load_adapter("torchtitan-llama4-to-hf")
    message = caught.value.cli_text()  # with the flag, as the CLI prints it
    assert "\n" not in message and message.startswith("--adapter 'torchtitan-llama4-to-hf': unknown; use one of ")
    assert message.index(", ".join(r.name for r in ADAPTER_RECORDS)) > 0
    assert "module:function" in message and "fsdp-convert adapters" in message
