"""Output channels: the result on stdout, everything else on stderr."""

from __future__ import annotations

import json
import sys
from typing import Any

from rich.console import Console

__all__ = ["console", "err_console", "print_json", "human_bytes"]

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
