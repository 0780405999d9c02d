r"""Text bound for a terminal: names from a checkpoint (FQNs, keys, paths) with their control characters escaped.

A checkpoint's names are its author's text: ``model.w\x1b[2J`` would clear the screen of whoever
runs ``verify``, ``\x1b]0;...\x07`` would retitle their window, and a bidi override would show a
name other than the one stored. Every human-mode line (tables, result lines, notes, ``error:``
lines) passes through ``escape_controls``; ``--json`` keeps the exact string (JSON escapes it).
"""

from __future__ import annotations

import re

__all__ = ["escape_controls"]

# C0 and DEL, C1, lone surrogates, the line and paragraph separators, and the bidi controls (which
# reorder what follows them on the line)
_CONTROLS = re.compile("[\x00-\x1f\x7f-\x9f\ud800-\udfff\u2028\u2029\u200e\u200f\u202a-\u202e\u2066-\u2069]")


def _escaped(match: re.Match[str]) -> str:
    code = ord(match.group())
    return f"\\x{code:02x}" if code <= 0xFF else f"\\u{code:04x}"


def escape_controls(text: str) -> str:
    r"""``text`` with each control character shown as Python's repr shows it (``\x1b``, ``\x9b``, ``\udc80``).

    Control characters are C0 (tab and newline included: a name is one line), DEL, C1, lone
    surrogates, U+2028/U+2029 and the bidi controls; everything else (any script, emoji,
    backslashes) is kept as it is, so a printable name reads unchanged.
    """
    return _CONTROLS.sub(_escaped, text)
