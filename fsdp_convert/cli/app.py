"""The Typer app: global options, logging on stderr, and the commands."""

from __future__ import annotations

import logging
from typing import Annotated

import typer
from rich.logging import RichHandler

from fsdp_convert.cli._errors import set_debug
from fsdp_convert.cli._output import err_console
from fsdp_convert.cli.consolidate_cmd import consolidate_command
from fsdp_convert.cli.inspect_cmd import inspect_command

__all__ = ["app", "main", "EXIT_CODES"]

EXIT_CODES = """
Exit codes: 0 success; 1 conversion failed or unexpected error; 2 usage error;
3 input missing or not a DCP checkpoint; 4 output exists and --overwrite was not given.
"""

app = typer.Typer(
    name="fsdp-convert",
    help="Inspect and consolidate PyTorch distributed (DCP / FSDP) checkpoints.",
    epilog=EXIT_CODES,
    no_args_is_help=True,
    pretty_exceptions_show_locals=False,
    add_completion=False,
)


@app.callback()
def _global_options(
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


def main() -> None:
    """Console-script entry point."""
    app()
