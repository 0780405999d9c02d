"""``docs/huggingface.md``'s table of the built-in adapters, rendered from their records (``ADAPTER_RECORDS``).

``tests/unit/test_adapters_table.py`` keeps the page's table equal to this text, so a new record
shows up in the docs as it is; ``fsdp-convert adapters`` prints the same records.
"""

from __future__ import annotations

from fsdp_convert.adapters import ADAPTER_RECORDS, STEPS, AdapterRecord

__all__ = ["render_adapter_table", "fields_text"]


def _row(*cells: str) -> str:
    return "| " + " | ".join(cells) + " |"


def fields_text(record: AdapterRecord, code: str = "`", sep: str = ", ") -> str:
    """The config fields ``record`` reads, those it needs marked: ``num_attention_heads (needed), tie_word_embeddings``.

    Args:
        record: the adapter's record.
        code: the mark around each field's name (Markdown's backtick; ``""`` for plain text).
        sep: what goes between two fields (a newline: one a line).

    Returns:
        The fields, ``sep`` between them, or ``none`` when it reads none.
    """
    fields = [f"{code}{field}{code}" + (" (needed)" if field in record.needs else "") for field in record.reads]
    return sep.join(fields) or "none"


def render_adapter_table() -> str:
    """``docs/huggingface.md``'s adapter table (Markdown, each line ending in a newline).

    A row per record, in table order, then one line per step an adapter may imply, saying what it does.
    """
    lines = [
        _row("adapter", "direction", "family", "follows", "config fields it reads", "implies", "besides renaming keys"),
        "|---|---|---|---|---|---|---|",
    ]
    for r in ADAPTER_RECORDS:
        implies = ", ".join(f"`{step}`" for step in r.implies)
        lines.append(_row(f"`{r.name}`", r.direction, r.family, r.follows, fields_text(r), implies, r.changes))
    lines.append("")
    lines += [f"- `{step}`: {what}." for step, what in STEPS.items()]
    return "\n".join(lines) + "\n"
