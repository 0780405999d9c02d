"""fsdp-convert: inspect, consolidate and reshard PyTorch distributed (DCP) checkpoints."""

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from fsdp_convert.convert import (
        ConsolidateResult,
        Difference,
        EntrySummary,
        InspectResult,
        ReshardResult,
        VerifyResult,
        consolidate,
        inspect_checkpoint,
        reshard,
        verify,
    )

    inspect = inspect_checkpoint

from fsdp_convert.errors import (
    CheckpointError,
    CheckpointNotFoundError,
    CorruptChunkError,
    CoverageError,
    InvalidOptionError,
    MissingDataFileError,
    NotADcpCheckpointError,
    OutputExistsError,
    OutputWriteError,
    ShapeMismatchError,
    UnsafeContentError,
    UnsupportedTransformError,
    VerificationError,
    WorkerFailedError,
)

_FROM_CONVERT = frozenset(
    {
        "ConsolidateResult",
        "Difference",
        "EntrySummary",
        "InspectResult",
        "ReshardResult",
        "VerifyResult",
        "consolidate",
        "inspect_checkpoint",
        "reshard",
        "verify",
    }
)


def __getattr__(name: str) -> Any:
    """The operations, imported on first use.

    Importing the package (and the CLI) stays free of torch until a command runs, so the CLI can
    set torch's C++ log level first.
    """
    if name in _FROM_CONVERT or name == "inspect":
        from fsdp_convert import convert

        return getattr(convert, "inspect_checkpoint" if name == "inspect" else name)
    raise AttributeError(f"module 'fsdp_convert' has no attribute {name!r}")


__version__ = "0.1.0"

__all__ = [
    "inspect_checkpoint",
    "inspect",
    "consolidate",
    "reshard",
    "ReshardResult",
    "verify",
    "VerifyResult",
    "Difference",
    "InspectResult",
    "EntrySummary",
    "ConsolidateResult",
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
    "WorkerFailedError",
    "VerificationError",
]
