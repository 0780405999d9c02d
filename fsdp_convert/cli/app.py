"""The Typer app: global options, logging on stderr, and the commands."""

from __future__ import annotations

import logging
import os
import signal
import sys
from importlib.metadata import PackageNotFoundError
from importlib.metadata import version as distribution_version
from typing import Annotated

import typer
from rich.logging import RichHandler

from fsdp_convert._signals import raise_or_defer
from fsdp_convert.cli._errors import set_debug
from fsdp_convert.cli._output import console, err_console
from fsdp_convert.cli.consolidate_cmd import consolidate_command
from fsdp_convert.cli.inspect_cmd import inspect_command
from fsdp_convert.cli.reshard_cmd import reshard_command
from fsdp_convert.cli.verify_cmd import verify_command
from fsdp_convert.errors import TerminatedError

__all__ = ["app", "main", "EXIT_CODES", "version_line"]

EXIT_CODES = """
Exit codes: 0 success (verify: equal); 1 conversion failed, checkpoints differ, or unexpected
error; 2 usage error; 3 input missing or not a DCP checkpoint; 4 output exists and --overwrite
was not given; 130/143 interrupted by SIGINT/SIGTERM.
"""

app = typer.Typer(
    name="fsdp-convert",
    help="Inspect, consolidate, reshard and verify PyTorch distributed (DCP / FSDP) checkpoints.",
    epilog=EXIT_CODES,
    no_args_is_help=True,
    pretty_exceptions_show_locals=False,
)


def version_line() -> str:
    """``fsdp-convert 0.1.0 (torch 2.6.0)``: both from the installed distributions' metadata."""

    def installed(name: str) -> str:
        try:
            return distribution_version(name)
        except PackageNotFoundError:
            return "not installed"

    return f"fsdp-convert {installed('fsdp-convert')} (torch {installed('torch')})"


def _print_version(value: bool) -> None:
    if value:
        console.print(version_line(), markup=False, highlight=False)
        raise typer.Exit()


@app.callback()
def _global_options(
    version: Annotated[
        bool,
        typer.Option("--version", is_eager=True, callback=_print_version, help="Print the fsdp-convert and torch versions."),
    ] = False,
    verbose: Annotated[int, typer.Option("--verbose", "-v", count=True, help="More log output on stderr.")] = 0,
    debug: Annotated[bool, typer.Option("--debug", envvar="FSDP_CONVERT_DEBUG", help="Show tracebacks on errors.")] = False,
) -> None:
    set_debug(debug)
    level = logging.DEBUG if verbose > 1 else logging.INFO if verbose == 1 else logging.WARNING
    root = logging.getLogger("fsdp_convert")
    root.handlers[:] = [RichHandler(console=err_console, show_path=False, show_time=False)]
    root.setLevel(level)


app.command("inspect", epilog=EXIT_CODES)(inspect_command)
app.command("consolidate", epilog=EXIT_CODES)(consolidate_command)
app.command("reshard", epilog=EXIT_CODES)(reshard_command)
app.command("verify", epilog=EXIT_CODES)(verify_command)


_SIGNAL_EXIT_CODES = frozenset({128 + signal.SIGINT, 128 + signal.SIGTERM, 128 + signal.SIGHUP})


def _on_terminate(signum: int, frame: object) -> None:
    raise_or_defer(TerminatedError(signum))


def _on_interrupt(signum: int, frame: object) -> None:
    raise_or_defer(KeyboardInterrupt())


def main() -> None:
    """Console-script entry point: SIGTERM and SIGHUP unwind like Ctrl-C, so no half output stays.

    The handlers hold a signal that lands while torch's C++ code is calling back into Python
    until that call returns (``fsdp_convert._signals``).
    """
    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, _on_terminate)
    signal.signal(signal.SIGINT, _on_interrupt)
    try:
        app()
    except SystemExit as e:
        if e.code in _SIGNAL_EXIT_CODES:
            # Interrupted: the output is already cleaned up and the error printed. Skip interpreter
            # finalization, where a torch thread pool caught mid-task can abort the process
            # ("terminate called without an active exception") and turn exit 130 into a SIGABRT.
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(e.code)
        raise
