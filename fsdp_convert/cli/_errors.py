"""The CLI's one error handler: CheckpointError to ``error: ...`` and its exit code."""

from __future__ import annotations

import contextlib
import os
import traceback
from collections.abc import Iterator

import typer

from fsdp_convert.cli._output import err_console
from fsdp_convert.errors import CheckpointError, TerminatedError

__all__ = ["handle_errors", "set_debug", "debug_enabled", "rank_prefix"]

_DEBUG = {"on": False}
DEBUG_HINT = "run with --debug (or FSDP_CONVERT_DEBUG=1) for a traceback"


def set_debug(on: bool) -> None:
    """Show tracebacks (``--debug``)."""
    _DEBUG["on"] = on


def debug_enabled() -> bool:
    """Whether ``--debug`` or ``FSDP_CONVERT_DEBUG=1`` is in effect."""
    return _DEBUG["on"] or os.environ.get("FSDP_CONVERT_DEBUG", "") not in ("", "0")


def rank_prefix() -> str:
    """``[rank N] `` in a non-zero worker of the user's torchrun, so many workers' lines stay readable."""
    rank = os.environ.get("RANK")
    return f"[rank {rank}] " if rank not in (None, "0") and "LOCAL_RANK" in os.environ else ""


@contextlib.contextmanager
def handle_errors() -> Iterator[None]:
    """Turn exceptions into one line on stderr and the exit code of their kind.

    ``CheckpointError`` exits with its ``exit_code``; any other exception exits 1 with a hint;
    Ctrl-C exits 130. With ``--debug`` the traceback is printed too. First, a torch that lacks
    an API this tool uses is a one-line error naming its version (``_torch.check_torch``).
    """
    try:
        from fsdp_convert._torch import check_torch  # imports torch: only once a command runs, never for --help

        check_torch()
        yield
    except typer.Exit:
        raise
    except CheckpointError as e:
        if debug_enabled():
            err_console.print(traceback.format_exc(), markup=False, highlight=False)
            for note in getattr(e, "__notes__", []):
                err_console.print(note, markup=False, highlight=False)
        err_console.print(f"{rank_prefix()}error: {e}", markup=False, highlight=False)
        raise typer.Exit(e.exit_code) from None
    except KeyboardInterrupt:
        err_console.print("error: interrupted (SIGINT)", markup=False, highlight=False)
        raise typer.Exit(130) from None
    except TerminatedError as e:
        err_console.print(f"error: {e}", markup=False, highlight=False)
        raise typer.Exit(128 + e.signum) from None
    except Exception as e:
        if debug_enabled():
            err_console.print(traceback.format_exc(), markup=False, highlight=False)
            err_console.print(f"error: {type(e).__name__}: {e}", markup=False, highlight=False)
        else:
            err_console.print(f"error: {type(e).__name__}: {e} ({DEBUG_HINT})", markup=False, highlight=False)
        raise typer.Exit(1) from None
