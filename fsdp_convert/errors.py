"""Errors: the one exception hierarchy, each class carrying the CLI exit code for its kind.

Exit codes follow ``shared/STYLE.md``: 0 success, 1 conversion failed, 2 usage error, 3 input
missing or not a DCP checkpoint, 4 output exists (or is being
written, or an earlier run's temporary of it is left).
"""

from __future__ import annotations

__all__ = [
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


class CheckpointError(Exception):
    """Base of every error this tool raises on purpose; ``exit_code`` is the CLI's exit status.

    ``str(e)`` is the library's wording (it names keyword arguments: ``overwrite=True``);
    ``cli_text()`` is the command line's (it names flags: ``--overwrite``), given as
    ``cli_message`` where the two differ.
    """

    exit_code: int = 1

    def __init__(self, *args: object, cli_message: str | None = None) -> None:
        super().__init__(*args)
        self.cli_message = cli_message

    def cli_text(self) -> str:
        """The message as the CLI prints it (flags, not keyword arguments)."""
        return self.cli_message if self.cli_message is not None else str(self)


class CheckpointNotFoundError(CheckpointError):
    """The checkpoint path does not exist."""

    exit_code = 3


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
