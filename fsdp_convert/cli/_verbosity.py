"""``-v`` / ``-q`` / ``--debug``: how much the CLI says on stderr, before the command or after it (as pip and hf take them)."""

from __future__ import annotations

import logging
import sys
from typing import Annotated

import typer
from rich.logging import RichHandler

from fsdp_convert.cli._errors import set_debug
from fsdp_convert.cli._output import err_console
from fsdp_convert.cli._terminal import escape_controls

__all__ = ["VerboseOpt", "QuietOpt", "DebugOpt", "set_verbosity", "quiet_requested", "show_progress"]

_COUNTS = {"verbose": 0, "quiet": 0, "debug": 0}

VerboseOpt = Annotated[
    int,
    typer.Option(
        "--verbose", "-v", count=True, metavar="", show_default=False, help="More log lines on stderr: -v info, -vv debug."
    ),
]
QuietOpt = Annotated[
    int,
    typer.Option("--quiet", "-q", count=True, metavar="", show_default=False, help="Errors only on stderr, no progress bars."),
]

DebugOpt = Annotated[
    bool,
    typer.Option("--debug", metavar="", envvar="FSDP_CONVERT_DEBUG", help="Show tracebacks on errors."),
]


def set_verbosity(verbose: int, quiet: int, debug: bool = False, *, reset: bool = False) -> None:
    """Add ``-v``/``-q`` counts and ``--debug`` (``reset``: the app's, given before the command, come first); set the log level.

    ``--debug`` before or after the command shows tracebacks (``_errors.set_debug``).

    The level of the ``fsdp_convert`` logger, whose records a rich handler writes to stderr:
    ``-vv`` DEBUG, ``-v`` INFO, WARNING by default, ``-q`` ERROR; one ``-v`` and one ``-q`` cancel.
    """
    if reset:
        _COUNTS.update(verbose=0, quiet=0, debug=0)
    _COUNTS["verbose"] += verbose
    _COUNTS["quiet"] += quiet
    _COUNTS["debug"] += debug
    set_debug(_COUNTS["debug"] > 0)
    net = _COUNTS["verbose"] - _COUNTS["quiet"]
    level = logging.DEBUG if net > 1 else logging.INFO if net == 1 else logging.WARNING if net == 0 else logging.ERROR
    root = logging.getLogger("fsdp_convert")
    handler = RichHandler(console=err_console, show_path=False, show_time=False)
    handler.addFilter(_escape_record)
    root.handlers[:] = [handler]
    root.setLevel(level)


def _escape_record(record: logging.LogRecord) -> bool:
    """Make a record's message terminal-safe (``escape_controls``: it may name a checkpoint's keys); keeps every record."""
    try:
        message = record.getMessage()
    except Exception:  # a call's bad arguments: left to the handler, which reports it as logging does
        return True
    record.msg, record.args = escape_controls(message), None
    return True


def quiet_requested() -> bool:
    """Whether ``-q`` was given, before or after the command (no progress bars unless ``--progress``)."""
    return _COUNTS["quiet"] > 0


def _stderr_is_terminal() -> bool:
    return sys.stderr.isatty()


def show_progress(progress: bool | None, json_output: bool) -> bool:
    """Whether the library shows progress bars.

    ``--progress`` or ``--no-progress`` as given; else when stderr is a terminal, without ``--json``
    or ``-q``. Called by the command, after ``set_verbosity``.
    """
    if progress is not None:
        return progress
    return not json_output and not quiet_requested() and _stderr_is_terminal()
