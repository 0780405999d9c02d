"""Output channels: the result on stdout, everything else on stderr."""

from __future__ import annotations

import dataclasses
import json
import sys
from typing import Any

from rich.console import Console

__all__ = ["console", "err_console", "print_json", "human_bytes", "print_result"]

console = Console(soft_wrap=True)
err_console = Console(stderr=True, soft_wrap=True)


def print_json(doc: dict[str, Any]) -> None:
    """Write exactly one JSON document to stdout (no colour, no wrapping)."""
    sys.stdout.write(json.dumps(doc, indent=2) + "\n")
    sys.stdout.flush()


def human_bytes(n: int) -> str:
    """``1536`` -> ``"1.5 KiB"``."""
    size = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if size < 1024 or unit == "TiB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    raise AssertionError("unreachable")


# JSON names of result fields where they differ from the attribute's
_JSON_NAMES = {"output_format": "format", "target_world_size": "world_size", "owner": "wrote"}


def print_result(result: Any, *, json_output: bool, done: str, elsewhere: str, prefix: str = "") -> None:
    """Report a ``ConsolidateResult`` or ``ReshardResult``.

    ``--json``: one document of all its fields (``schema_version`` 1, seconds rounded to ms).
    Otherwise one line: ``done`` where this process wrote the output, ``prefix + elsewhere``
    where rank 0's process did.
    """
    if json_output:
        doc: dict[str, Any] = {"schema_version": 1}
        for field in dataclasses.fields(result):
            value = getattr(result, field.name)
            doc[_JSON_NAMES.get(field.name, field.name)] = (
                round(value, 3) if field.name == "seconds" else (str(value) if field.name == "output" else value)
            )
        print_json(doc)
    elif not result.owner:
        console.print(prefix + elsewhere, markup=False, highlight=False)
    else:
        console.print(done, highlight=False)
