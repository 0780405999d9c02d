"""fsdp-convert: inspect, consolidate and reshard PyTorch distributed (DCP) checkpoints."""

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

inspect = inspect_checkpoint  # the short name the CLI command has

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
