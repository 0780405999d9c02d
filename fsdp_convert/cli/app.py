"""The Typer app: global options, logging on stderr, and the commands."""

from __future__ import annotations

import signal
import sys
from importlib.metadata import PackageNotFoundError
from importlib.metadata import version as distribution_version
from typing import Annotated, Any

import typer
from typer.core import TyperCommand, TyperGroup, TyperOption

from fsdp_convert.cli import verify_cmd
from fsdp_convert.cli._output import console, err_console
from fsdp_convert.cli._precheck import check_argv
from fsdp_convert.cli._terminal import escape_controls
from fsdp_convert.cli._verbosity import DebugOpt, QuietOpt, VerboseOpt, set_verbosity
from fsdp_convert.cli.adapters_cmd import adapters_command
from fsdp_convert.cli.consolidate_cmd import consolidate_command
from fsdp_convert.cli.inspect_cmd import inspect_command
from fsdp_convert.cli.reshard_cmd import reshard_command
from fsdp_convert.errors import InvalidOptionError, TerminatedError
from fsdp_convert.signals import exit_process, raise_or_defer

__all__ = ["app", "main", "EXIT_CODES", "version_line"]

# typer keeps single line breaks of an epilog: one line per code, each under 78 columns; the last
# line starts at column 0 so the codes keep their indent
EXIT_CODES = """Exit codes:
  0    success
  1    failed: corrupt data, no space left, a worker died, ...
  2    usage error: a bad option or argument, OUT's suffix
  3    input missing or not a checkpoint, or a data file missing
  4    OUT exists (--overwrite replaces it), another run is writing it,
       or an earlier run's temporary of it is left (--resume finishes it)
  70   internal error: a bug, please report it
  130  interrupted (143: SIGTERM, 129: SIGHUP)
Errors are one line on stderr; --debug adds the traceback."""


def _no_flag_types(params: list[Any]) -> list[Any]:
    """``params`` with typer's own flags (``--help``, ``--install-completion``, ...) shown without a type, as ours are.

    ``--help`` would show them as ``--help <bool>``; a flag takes no value, so it shows none.
    """
    for param in params:
        if isinstance(param, TyperOption) and param.is_flag and param.metavar is None:
            param.metavar = ""
    return params


class _Group(TyperGroup):
    """The app: its ``--help`` shows no type for a flag."""

    def get_params(self, ctx: Any) -> list[Any]:
        return _no_flag_types(super().get_params(ctx))


class _Command(TyperCommand):
    """A command: its ``--help`` shows no type for a flag."""

    def get_params(self, ctx: Any) -> list[Any]:
        return _no_flag_types(super().get_params(ctx))


app = typer.Typer(
    cls=_Group,
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
        typer.Option(
            "--version", metavar="", is_eager=True, callback=_print_version, help="Print the fsdp-convert and torch versions."
        ),
    ] = False,
    verbose: VerboseOpt = 0,
    quiet: QuietOpt = 0,
    debug: DebugOpt = False,
) -> None:
    set_verbosity(verbose, quiet, debug, reset=True)


app.command("inspect", cls=_Command, epilog=EXIT_CODES)(inspect_command)
app.command("consolidate", cls=_Command, epilog=EXIT_CODES)(consolidate_command)
app.command("reshard", cls=_Command, epilog=EXIT_CODES)(reshard_command)
app.command("verify", cls=_Command, epilog=verify_cmd.EXIT_CODES)(verify_cmd.verify_command)
app.command("adapters", cls=_Command, epilog=EXIT_CODES)(adapters_command)


def _on_terminate(signum: int, frame: object) -> None:
    raise_or_defer(TerminatedError(signum))


def _on_interrupt(signum: int, frame: object) -> None:
    raise_or_defer(KeyboardInterrupt())


def main() -> None:
    """Console-script entry point: SIGTERM and SIGHUP unwind like Ctrl-C, so no half output stays.

    The handlers hold a signal that lands while torch's C++ code is calling back into Python
    until that call returns (``fsdp_convert.signals``).
    """
    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, _on_terminate)
    signal.signal(signal.SIGINT, _on_interrupt)
    try:
        check_argv(sys.argv[1:])
    except InvalidOptionError as e:
        err_console.print(f"error: {escape_controls(e.cli_text())}", markup=False, highlight=False)
        sys.exit(e.exit_code)
    try:
        app()
    except SystemExit as e:
        # The work is done, or cleaned up and its error printed. Skip interpreter finalization,
        # where a torch thread still joinable (a gloo group under torchrun, a thread pool caught
        # mid-task by a signal) can abort the process and turn its exit code into a SIGABRT.
        if isinstance(e.code, str):
            err_console.print(escape_controls(e.code), markup=False, highlight=False)
        exit_process(e.code if isinstance(e.code, int) else 0 if e.code is None else 1)
