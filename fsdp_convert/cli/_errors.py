"""The CLI's one error handler: CheckpointError to ``error: ...`` and its exit code; anything else is a bug."""

from __future__ import annotations

import contextlib
import errno
import os
import signal
import traceback
from collections.abc import Iterator
from importlib.metadata import PackageNotFoundError, metadata

import typer

from fsdp_convert.cli._output import err_console
from fsdp_convert.cli._terminal import escape_controls
from fsdp_convert.errors import CheckpointError, TerminatedError
from fsdp_convert.writers import kept_note

__all__ = ["handle_errors", "torch_ready", "set_debug", "debug_enabled", "rank_prefix", "EX_SOFTWARE"]

_DEBUG = {"on": False}
EX_SOFTWARE = 70  # sysexits.h: an internal software error
# OSErrors that are about the user's files or machine, not a bug: one line naming the file, exit 1
_USER_ERRNOS = frozenset(
    {
        errno.EACCES, errno.EPERM, errno.ENOENT, errno.ENOTDIR, errno.EISDIR, errno.EEXIST, errno.ENAMETOOLONG,
        errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EROFS, errno.EIO, errno.EMFILE, errno.ENFILE, errno.ELOOP,
    }
)  # fmt: skip


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


def torch_ready(*, dcp: bool = False) -> None:
    """Import torch, once the torch-free checks (``cli._precheck``) have passed, and check its APIs.

    Args:
        dcp: check the APIs that write DCP's own ``.metadata`` too (``reshard``); they import
            ``torch.distributed.checkpoint`` (~0.5 s), which no other command needs.

    Raises:
        TorchFeatureError: the installed torch lacks an API this tool uses (the message names its version).
    """
    from fsdp_convert.torch_compat import check_torch

    check_torch(dcp=dcp)


def _kept(e: BaseException) -> str:
    """``; the temporary ... is kept: ...`` when a resumable run kept its temporary on ``e``, else nothing."""
    note = kept_note(e)
    return f"; {note}" if note else ""


def _signal_name(signum: int) -> str:
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


def _report_to() -> str:
    """``at <issues URL>`` from the installed distribution's ``Project-URL``s, else whom to tell."""
    try:
        urls = metadata("fsdp-convert").get_all("Project-URL") or []
    except PackageNotFoundError:
        urls = []
    for entry in urls:
        label, _, url = entry.partition(",")
        if label.strip().lower() in ("issues", "bug tracker", "bugs") and url.strip():
            return f"at {url.strip()}"
    return "to the fsdp-convert maintainers"


def _user_os_error(e: OSError) -> str:
    """``<file>: <reason>`` for an OSError about the user's files (no space, permission denied, ...)."""
    files = ", ".join(os.fspath(f) for f in (e.filename, e.filename2) if f is not None)
    reason = e.strerror or str(e)
    return f"{files}: {reason}" if files else reason


def _print(text: str) -> None:
    """``text`` on stderr, each of its lines with its control characters escaped (it names a checkpoint's files and keys)."""
    err_console.print("\n".join(map(escape_controls, text.split("\n"))), markup=False, highlight=False)


@contextlib.contextmanager
def handle_errors(trouble: int | None = None) -> Iterator[None]:
    """Turn exceptions into one line on stderr and the exit code of their kind.

    ``CheckpointError`` prints its ``cli_text()`` (the message naming flags) and exits with its
    ``exit_code``; an ``OSError`` about the user's files (permission denied, no space left, no such
    file) exits 1 naming the file. With ``trouble`` (``verify``'s 2, as ``cmp`` and ``diff``) both
    exit with that code instead. Any other exception is a bug: ``internal error: ...``, exit 70
    (``EX_SOFTWARE``). Ctrl-C exits 130, SIGTERM 143, SIGHUP 129 (``interrupted (SIGTERM)``); a
    resumable run that kept its temporary (``writers.kept_note``) says so on the same line.
    With ``--debug`` the traceback is printed too. Imports no torch: ``torch_ready`` does, when a
    command gets that far.
    """
    try:
        yield
    except typer.Exit:
        raise
    except CheckpointError as e:
        if debug_enabled():
            _print(traceback.format_exc())
            for note in getattr(e, "__notes__", []):
                _print(note)
        _print(f"{rank_prefix()}error: {e.cli_text()}{_kept(e)}")
        raise typer.Exit(e.exit_code if trouble is None else trouble) from None
    except KeyboardInterrupt as e:
        _print(f"error: interrupted (SIGINT){_kept(e)}")
        raise typer.Exit(130) from None
    except TerminatedError as e:
        _print(f"error: interrupted ({_signal_name(e.signum)}){_kept(e)}")
        raise typer.Exit(128 + e.signum) from None
    except Exception as e:
        if debug_enabled():
            _print(traceback.format_exc())
        if isinstance(e, OSError) and e.errno in _USER_ERRNOS:
            _print(f"{rank_prefix()}error: {_user_os_error(e)}{_kept(e)}")
            raise typer.Exit(1 if trouble is None else trouble) from None
        report = f"please report this {_report_to()} with the output of --debug"
        _print(f"{rank_prefix()}error: internal error: {type(e).__name__}: {e}{_kept(e)} ({report})")
        raise typer.Exit(EX_SOFTWARE) from None
