"""The CLI's one error handler: CheckpointError to ``error: ...`` and its exit code."""

from __future__ import annotations

import contextlib
import os
import signal
import traceback
from collections.abc import Iterator

import typer

from fsdp_convert.cli._output import err_console
from fsdp_convert.errors import CheckpointError, TerminatedError
from fsdp_convert.writers._atomic import kept_note

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


def _kept(e: BaseException) -> str:
    """``; the temporary ... is kept: ...`` when a resumable run kept its temporary on ``e``, else nothing."""
    note = kept_note(e)
    return f"; {note}" if note else ""


def _signal_name(signum: int) -> str:
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


@contextlib.contextmanager
def handle_errors() -> Iterator[None]:
    """Turn exceptions into one line on stderr and the exit code of their kind.

    ``CheckpointError`` exits with its ``exit_code``; any other exception exits 1 with a hint;
    Ctrl-C exits 130, SIGTERM 143, SIGHUP 129 (``interrupted (SIGTERM)``); a resumable run that
    kept its temporary (``writers._atomic.kept_note``) says so on the same line. With ``--debug``
    the traceback is printed too. First, a torch that lacks an API this tool uses is a one-line
    error naming its version (``_torch.check_torch``).
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
        err_console.print(f"{rank_prefix()}error: {e}{_kept(e)}", markup=False, highlight=False)
        raise typer.Exit(e.exit_code) from None
    except KeyboardInterrupt as e:
        err_console.print(f"error: interrupted (SIGINT){_kept(e)}", markup=False, highlight=False)
        raise typer.Exit(130) from None
    except TerminatedError as e:
        err_console.print(f"error: interrupted ({_signal_name(e.signum)}){_kept(e)}", markup=False, highlight=False)
        raise typer.Exit(128 + e.signum) from None
    except Exception as e:
        if debug_enabled():
            err_console.print(traceback.format_exc(), markup=False, highlight=False)
            err_console.print(f"error: {type(e).__name__}: {e}", markup=False, highlight=False)
        else:
            err_console.print(f"error: {type(e).__name__}: {e} ({DEBUG_HINT})", markup=False, highlight=False)
        raise typer.Exit(1) from None
