"""Errors: the one exception hierarchy, each class carrying the CLI exit code for its kind.

Exit codes follow ``shared/STYLE.md``: 0 success, 1 conversion failed, 2 usage error, 3 input
missing or not a DCP checkpoint, 4 output exists (or is being
written, or an earlier run's temporary of it is left).
"""

from __future__ import annotations

import errno
import os
import re

__all__ = [
    "FLAG_KEYWORDS",
    "library_wording",
    "CheckpointError",
    "CheckpointNotFoundError",
    "NotADcpCheckpointError",
    "MissingDataFileError",
    "UnsafeContentError",
    "CorruptChunkError",
    "CoverageError",
    "ShapeMismatchError",
    "UnsupportedTransformError",
    "InvalidOptionError",
    "OutputExistsError",
    "OutputWriteError",
    "OutputLockedError",
    "TemporaryExistsError",
    "WorkerFailedError",
    "VerificationError",
    "TorchFeatureError",
    "TerminatedError",
]


# A command-line flag in a message -> how a Python caller says the same: a keyword argument of
# consolidate / reshard / verify, a TransformOptions field (options.<field>) or a Cluster field
# (cluster.<field>). The one table: messages are written with flags, which CheckpointError.__str__
# rewrites through it and cli_text() keeps. A flag taking a value becomes the keyword's bare name
# (joined by "=" to a quoted value: --format 'x' -> output_format='x'); a switch becomes the keyword
# with the value it sets. Flags not listed have no such keyword and stay as written: --debug, --json,
# and those of the CLI's helpers, which Python calls with their own arguments (--model-config and
# --adapter-option: adapters.configured_adapter / load_adapter; --merge-lora, --lora-only,
# --lora-config, --lora-alpha, --lora-r: lora.lora_options).
FLAG_KEYWORDS: dict[str, str] = {
    # consolidate / reshard / verify keywords
    "--overwrite": "overwrite=True",
    "--force": "force=True",
    "--follow-symlinks": "follow_symlinks=True",
    "--resume": "resume=True",
    "--no-space-check": "space_check=False",
    "--no-crc": "check_crc=False",
    "--verify": "verify_output=True",
    "--progress": "progress=True",
    "--no-progress": "progress=False",
    "--nproc": "nproc",
    "--nproc-per-node": "nproc",
    "--only": "only",
    "--weights": "weights",
    "--format": "output_format",
    "--memory-budget": "memory_budget_bytes",
    "--max-shard-size": "max_shard_bytes",
    "--hf-assets": "hf_assets",
    "--world-size": "world_size",
    "--compress": "compress",
    "--atol": "atol",
    "--rtol": "rtol",
    "--as-consolidated": "options=TransformOptions()",
    # TransformOptions fields
    "--optim-keys": "options.optim_keys",
    "--layout": "options.layout",
    "--keep-wrapper-names": "options.keep_wrapper_names=True",
    "--rename": "options.renames",
    "--include": "options.include",
    "--exclude": "options.exclude",
    "--dtype": "options.dtype",
    "--optim-dtype": "options.optim_dtype",
    "--adapter": "options.adapter",
    "--unstack-layers": "options.unstack_layers=True",
    # Cluster fields
    "--nnodes": "cluster.nnodes",
    "--node-rank": "cluster.node_rank",
    "--rdzv-backend": "cluster.rdzv_backend",
    "--rdzv-endpoint": "cluster.rdzv_endpoint",
    "--rdzv-id": "cluster.rdzv_id",
}

# a flag, or flags joined by "/" (--include/--exclude), standing alone: after the start, a space or
# an opening bracket, not inside a path or a word (dir/--x, --x/y, --x.pt), and not torchrun's
# --flag=value; then the space before a quoted value, if one follows
_FLAGS = re.compile(r"(?<![^\s(\[])--[a-z][a-z0-9-]*(?:/--[a-z][a-z0-9-]*)*(?![\w=/])(?!\.\S)(?P<quoted> (?=['\"]))?")


def library_wording(text: str) -> str:
    """``text`` with each flag of ``FLAG_KEYWORDS`` in its Python spelling; other text as it is.

    ``pass --overwrite to replace it`` becomes ``pass overwrite=True to replace it``; ``--format
    'gguf': use ...`` becomes ``output_format='gguf': use ...``. Text without such flags (already
    in library wording) comes back unchanged.
    """

    def rewrite(m: re.Match[str]) -> str:
        flags = m.group(0).rstrip(" ").split("/")
        words = [FLAG_KEYWORDS.get(flag, flag) for flag in flags]
        if m.group("quoted") is None:
            return "/".join(words)
        last = words[-1]
        join = "=" if flags[-1] in FLAG_KEYWORDS and "=" not in last else " "
        return "/".join(words) + join

    return _FLAGS.sub(rewrite, text)


class CheckpointError(Exception):
    """Base of every error this tool raises on purpose; ``exit_code`` is the CLI's exit status.

    Messages are written as the command line words them, naming flags (``pass --overwrite to
    replace it``). ``str(e)`` is the library's wording: each flag that has a keyword argument is
    named as a Python caller passes it (``pass overwrite=True to replace it``, through
    ``FLAG_KEYWORDS``); ``cli_text()`` is the message as written, which the CLI prints. Where the
    two need different sentences, pass the library's as the message and the command line's as
    ``cli_message``: ``str(e)`` is then the message as it is.
    """

    exit_code: int = 1

    def __init__(self, *args: object, cli_message: str | None = None) -> None:
        super().__init__(*args)
        self.cli_message = cli_message

    def _written(self) -> str:
        # BaseException's own: OSError's would print "[Errno 2] ..." for CheckpointNotFoundError
        return BaseException.__str__(self)

    def __str__(self) -> str:
        return self._written() if self.cli_message is not None else library_wording(self._written())

    def cli_text(self) -> str:
        """The message as the CLI prints it (flags, not keyword arguments)."""
        return self.cli_message if self.cli_message is not None else self._written()


class CheckpointNotFoundError(CheckpointError, FileNotFoundError):
    """The checkpoint path does not exist.

    Also a ``FileNotFoundError`` (``errno`` ``ENOENT``), so ``except FileNotFoundError`` (or
    ``OSError``) catches it; ``str(e)`` is the message, not ``[Errno 2] ...``, and ``filename`` is
    None (the message names the path).
    """

    exit_code = 3

    def __init__(self, *args: object, cli_message: str | None = None) -> None:
        super().__init__(*args, cli_message=cli_message)
        # set here, not passed to OSError.__init__: args stay (message,), which pickling replays
        self.errno = errno.ENOENT
        self.strerror = os.strerror(errno.ENOENT)


class NotADcpCheckpointError(CheckpointError):
    """The path exists but holds no readable DCP ``.metadata``."""

    exit_code = 3


class MissingDataFileError(CheckpointError):
    """A data file (``__<rank>_<n>.distcp``) named by ``.metadata`` is missing or unreadable."""

    exit_code = 3


class UnsafeContentError(CheckpointError):
    """A pickle in the input asks for a global outside the allow-list (it would run code)."""


class CorruptChunkError(CheckpointError):
    """A chunk payload is truncated or does not decode as a torch.save tensor."""


class CoverageError(CheckpointError):
    """A tensor's chunks leave a gap, overlap, or fall outside its global shape."""


class ShapeMismatchError(CheckpointError):
    """A payload's shape or dtype disagrees with what ``.metadata`` says."""


class UnsupportedTransformError(CheckpointError):
    """A chunk was written through a stream transform (e.g. compression) this tool cannot undo."""


class InvalidOptionError(CheckpointError):
    """A combination of options that cannot work (e.g. optimizer state into safetensors)."""

    exit_code = 2


class OutputExistsError(CheckpointError):
    """The output path exists and ``overwrite`` was not given."""

    exit_code = 4


class OutputLockedError(CheckpointError):
    """Another run is writing the same output: its lock file ``.OUT.lock`` is held (the message names its host and pid)."""

    exit_code = 4


class TemporaryExistsError(CheckpointError):
    """An earlier run's temporary of the output is still there (a SIGKILL, a lost node); resume it or remove it."""

    exit_code = 4


class OutputWriteError(CheckpointError):
    """The output could not be written (permission denied, no space left, ...)."""


class WorkerFailedError(CheckpointError):
    """A worker process started by the launcher died or failed without a CheckpointError."""


class VerificationError(CheckpointError):
    """What was written does not read back equal to the source (``consolidate --verify``)."""


class TorchFeatureError(CheckpointError):
    """The installed torch lacks a (private) API this tool relies on; the message names the torch version."""


class TerminatedError(BaseException):
    """The process got SIGTERM (or SIGHUP); raised so cleanup runs. Not a CheckpointError.

    Attributes:
        signum: the signal number; the CLI exits with 128 + signum.
    """

    def __init__(self, signum: int) -> None:
        super().__init__(f"terminated by signal {signum}")
        self.signum = signum
