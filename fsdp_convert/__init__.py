"""fsdp-convert: inspect, consolidate and reshard PyTorch distributed (DCP) checkpoints."""

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from fsdp_convert.launch import Cluster
    from fsdp_convert.ops.consolidate import ConsolidateResult, consolidate
    from fsdp_convert.ops.inspect import EntrySummary, InspectResult, inspect_checkpoint
    from fsdp_convert.ops.options import ConsolidateOptions, ReshardOptions, VerifyOptions
    from fsdp_convert.ops.reshard import ReshardResult, reshard
    from fsdp_convert.ops.verify import Difference, VerifyResult, verify
    from fsdp_convert.transform import TransformOptions

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
    OutputLockedError,
    OutputWriteError,
    ShapeMismatchError,
    TemporaryExistsError,
    TerminatedError,
    TorchFeatureError,
    UnsafeContentError,
    UnsupportedTransformError,
    VerificationError,
    WorkerFailedError,
)

# public name -> (module, its name there): the operations, their options and their results
_LAZY = {
    "inspect": ("fsdp_convert.ops.inspect", "inspect_checkpoint"),
    "inspect_checkpoint": ("fsdp_convert.ops.inspect", "inspect_checkpoint"),
    "EntrySummary": ("fsdp_convert.ops.inspect", "EntrySummary"),
    "InspectResult": ("fsdp_convert.ops.inspect", "InspectResult"),
    "consolidate": ("fsdp_convert.ops.consolidate", "consolidate"),
    "ConsolidateResult": ("fsdp_convert.ops.consolidate", "ConsolidateResult"),
    "reshard": ("fsdp_convert.ops.reshard", "reshard"),
    "ReshardResult": ("fsdp_convert.ops.reshard", "ReshardResult"),
    "verify": ("fsdp_convert.ops.verify", "verify"),
    "VerifyResult": ("fsdp_convert.ops.verify", "VerifyResult"),
    "Difference": ("fsdp_convert.ops.verify", "Difference"),
    "ConsolidateOptions": ("fsdp_convert.ops.options", "ConsolidateOptions"),
    "ReshardOptions": ("fsdp_convert.ops.options", "ReshardOptions"),
    "VerifyOptions": ("fsdp_convert.ops.options", "VerifyOptions"),
    "TransformOptions": ("fsdp_convert.transform", "TransformOptions"),
    "Cluster": ("fsdp_convert.launch", "Cluster"),
}


def __getattr__(name: str) -> Any:
    """The operations, their options and results, imported on first use.

    Importing the package (and the CLI) stays free of torch until a command runs, so the CLI can
    set torch's C++ log level first. The operations live in ``fsdp_convert.ops``, not in top-level
    modules named like them: importing such a submodule would bind its name on this package and
    shadow the function.
    """
    if name in _LAZY:
        import importlib

        module, attr = _LAZY[name]
        return getattr(importlib.import_module(module), attr)
    raise AttributeError(f"module 'fsdp_convert' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted({*globals(), *_LAZY})


__version__ = "0.1.0"

__all__ = [
    # operations
    "inspect_checkpoint",
    "inspect",
    "consolidate",
    "reshard",
    "verify",
    # their options
    "ConsolidateOptions",
    "ReshardOptions",
    "VerifyOptions",
    "TransformOptions",
    "Cluster",
    # their results
    "InspectResult",
    "EntrySummary",
    "ConsolidateResult",
    "ReshardResult",
    "VerifyResult",
    "Difference",
    # errors
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
    "OutputLockedError",
    "TemporaryExistsError",
    "OutputWriteError",
    "WorkerFailedError",
    "VerificationError",
    "TorchFeatureError",
    "TerminatedError",
]
