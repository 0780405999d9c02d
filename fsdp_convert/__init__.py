"""fsdp-convert: inspect, consolidate and reshard PyTorch distributed (DCP) checkpoints."""

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from fsdp_convert.ops.consolidate import ConsolidateResult, consolidate
    from fsdp_convert.ops.inspect import EntrySummary, InspectResult, inspect_checkpoint
    from fsdp_convert.ops.reshard import ReshardResult, reshard
    from fsdp_convert.ops.verify import Difference, VerifyResult, verify

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

# public name -> (module under fsdp_convert.ops, its name there)
_OPERATIONS = {
    "inspect": ("inspect", "inspect_checkpoint"),
    "inspect_checkpoint": ("inspect", "inspect_checkpoint"),
    "EntrySummary": ("inspect", "EntrySummary"),
    "InspectResult": ("inspect", "InspectResult"),
    "consolidate": ("consolidate", "consolidate"),
    "ConsolidateResult": ("consolidate", "ConsolidateResult"),
    "reshard": ("reshard", "reshard"),
    "ReshardResult": ("reshard", "ReshardResult"),
    "verify": ("verify", "verify"),
    "VerifyResult": ("verify", "VerifyResult"),
    "Difference": ("verify", "Difference"),
}


def __getattr__(name: str) -> Any:
    """The operations, imported on first use.

    Importing the package (and the CLI) stays free of torch until a command runs, so the CLI can
    set torch's C++ log level first. They live in ``fsdp_convert.ops``, not in top-level modules
    named like them: importing such a submodule would bind its name on this package and shadow
    the function.
    """
    if name in _OPERATIONS:
        import importlib

        module, attr = _OPERATIONS[name]
        return getattr(importlib.import_module(f"fsdp_convert.ops.{module}"), attr)
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
