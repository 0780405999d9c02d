"""The operations' options: one frozen dataclass per operation, checked whole before anything is read.

``ConsolidateOptions``, ``ReshardOptions`` and ``VerifyOptions`` hold every keyword argument of
``consolidate``, ``reshard`` and ``verify`` (same names and defaults; the ``TransformOptions``
argument is the ``transform`` field). A bad value or a bad combination (``only="weights"``,
``nproc="4"``, ``compress="gzip"``, ``--lora-only`` with ``verify_output``) is an
``InvalidOptionError`` naming the keyword as it is built; checks that need the checkpoint or OUT
stay in the operation. Strings are accepted where the library takes them (``transform={"dtype":
"bf16"}``, ``dtype="bf16"``) and normalized. Each operation calls ``from_call(options, kwargs)``:

    consolidate(ckpt, "out.pt", ConsolidateOptions(only="model", nproc=4))
    consolidate(ckpt, "out.pt", only="model", nproc=4)  # the same
    consolidate(ckpt, "out.pt", TransformOptions(dtype="bf16"))  # options= as before: the transform
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar, Literal, TypeVar, get_args

from fsdp_convert.errors import InvalidOptionError
from fsdp_convert.launch import Cluster
from fsdp_convert.lora import lora_only
from fsdp_convert.ops._arguments import byte_count, choice, count, tolerance, transform_options
from fsdp_convert.output_table import PEFT_ROW, check_format, check_verifiable
from fsdp_convert.plan.consolidate import DEFAULT_MAX_SHARD_BYTES, DEFAULT_MEMORY_BUDGET_BYTES, Only, RequestedFormat
from fsdp_convert.transform import TransformOptions, parse_dtype
from fsdp_convert.writers.dcp import require_zstd

if TYPE_CHECKING:
    import torch

__all__ = ["ConsolidateOptions", "ReshardOptions", "VerifyOptions"]

_Options = TypeVar("_Options", "ConsolidateOptions", "ReshardOptions", "VerifyOptions")


def _set(options: object, name: str, value: object) -> None:
    """Store a normalized value on a frozen dataclass, in ``__post_init__`` only."""
    object.__setattr__(options, name, value)


def _from_call(cls: type[_Options], options: object, kwargs: Mapping[str, Any]) -> _Options:
    """The options an operation was called with: ``options`` (positional or ``options=``) and its other keywords.

    Args:
        cls: the operation's options class.
        options: None; an instance of ``cls`` (``kwargs`` then replace its fields); or, as before
            the options classes, a ``TransformOptions`` or a mapping of its fields, meaning ``transform=``.
        kwargs: the call's other keyword arguments, each a field of ``cls``.

    Raises:
        InvalidOptionError: an unknown keyword, a required one missing, ``options`` of another type,
            ``transform`` given twice, or a bad value (``__post_init__``).
    """
    names = [f.name for f in dataclasses.fields(cls)]
    for keyword in kwargs:
        if keyword not in names:
            raise InvalidOptionError(f"{keyword!r} is not a keyword argument of {cls.operation}; it takes {', '.join(names)}")
    if isinstance(options, cls):
        return dataclasses.replace(options, **kwargs) if kwargs else options
    fields = dict(kwargs)
    if options is not None:
        if not isinstance(options, (TransformOptions, Mapping)):
            got = type(options).__name__
            raise InvalidOptionError(
                f"options: expected a {cls.__name__} or a TransformOptions (or a dict of its fields), got {got}"
            )
        if "transform" in fields:
            raise InvalidOptionError("options (a TransformOptions) and transform are one option; give it once")
        fields["transform"] = transform_options(options)
    for f in dataclasses.fields(cls):
        if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING and f.name not in fields:
            raise InvalidOptionError(f"{cls.operation} needs {f.name}= (it has no default)")
    return cls(**fields)


@dataclass(frozen=True, slots=True, kw_only=True)
class ConsolidateOptions:
    """How ``consolidate`` writes a checkpoint as one full (unsharded) state dict; see its docstring for OUT's forms.

    Raises:
        InvalidOptionError: a bad value (named by its keyword), or ``--lora-only`` with ``verify_output``.
    """

    operation: ClassVar[str] = "consolidate"

    nproc: int | None = None
    """Workers; 1 runs in the calling process, more start workers with torch's elastic launcher (gloo on CPU).
    None: ``plan.consolidate.default_nproc`` (one per CPU core, at most one per data file and per 2 GiB)."""
    only: Only = "all"
    """``all``, ``model`` or ``optim``: which groups to write."""
    transform: TransformOptions = field(default_factory=TransformOptions)
    """Key and dtype transforms (a ``TransformOptions``, or a dict of its fields; None: the defaults): wrapper
    names removed, optimizer state keyed by FQN, dtypes kept, the producer's layout. A ``lora.LoraAdapter`` of
    mode ``only`` (``--lora-only``) makes OUT a PEFT adapter folder (``adapter_model.safetensors``, then
    ``adapter_config.json``); it refuses a file OUT and ``verify_output``."""
    output_format: RequestedFormat = "auto"
    """``auto`` (by OUT's suffix), ``torch`` (torch.save under any name but ``.safetensors``, e.g. Lightning's
    ``.ckpt``), ``safetensors``, or another row's ``--format`` name (``output_table.format_names``;
    ``outputs.output_kind``)."""
    overwrite: bool = False
    """Replace an existing OUT, at the final rename only. OUT may never be the checkpoint (nor ``hf_assets``),
    inside it or one of its folders, nor a link."""
    force: bool = False
    """With ``overwrite``, replace an existing folder that does not look like this tool's output too."""
    memory_budget_bytes: int = DEFAULT_MEMORY_BUDGET_BYTES
    """Buffers each process may hold, in bytes (256 MiB): peak memory per process is the interpreter's plus
    this when chunks are read in place; a chunk that must be decoded (remote, stream-transformed) adds its size."""
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES
    """Largest shard of a folder OUT, in bytes (50 GB, 50 * 10**9, as ``save_pretrained``)."""
    check_crc: bool = True
    """Check the CRC-32 of every zip record of every payload read (torch does not); sources without CRC-32s
    (safetensors shards, per-rank torch.save files) are read as they are."""
    verify_output: bool = False
    """Read the written output back and compare it with the checkpoint (through the same transforms), key by
    key, before moving it into place; not with a computed tensor (``--merge-lora``) nor ``--lora-only``."""
    space_check: bool = True
    """Before anything is read or created, check that OUT's size from the plan, in bytes (to a URL: what its
    local staging folder holds), fits in the free space where its temporary is written."""
    progress: bool = False
    """Bars on stderr (bytes of every worker, binary units, rate, time left), drawn by rank 0's worker:
    ``write``, ``re-check`` first when resuming, ``verify`` last with ``verify_output``."""
    cluster: Cluster | None = None
    """torchrun's multi-node options: every node calls with the same options and ``nproc`` workers per node;
    rank 0's node writes OUT (on storage every node reaches). Under the user's own torchrun (``RANK`` and
    ``WORLD_SIZE`` set) this process is one worker and ``nproc`` is ignored."""
    hf_assets: str | os.PathLike[str] | None = None
    """A folder (local or an fsspec URL) whose ``config.json``, generation config and tokenizer files are copied
    beside a folder OUT's shards, so ``from_pretrained`` loads it; ``lm_head.weight`` is left out when the
    config ties it, and the config's dtype follows the weights written."""
    resume: bool = False
    """Finish the interrupted run's temporary output, on one node or many: its manifest must match this plan;
    records whose bytes read back with their CRC-32 are kept, the rest written."""
    follow_symlinks: bool | None = None
    """Read files of the checkpoint that are symbolic links out of its folder (a shared store the step folder
    links into); False refuses them (UnsafeContentError). None: the process's setting (``--follow-symlinks``)."""
    weights: Literal["master", "module"] = "master"
    """A DeepSpeed save's model: ``master``, the fp32 master weights (what ``zero_to_fp32`` returns);
    ``module``, the module's own weights in its dtype as the model states file holds them (ZeRO-1/2 only)."""

    def __post_init__(self) -> None:
        # the messages name the flags; str(e) words each as its keyword (errors.FLAG_KEYWORDS)
        _set(self, "only", choice("--only", self.only, get_args(Only)))
        _set(self, "weights", choice("--weights", self.weights, ("master", "module")))
        _set(self, "output_format", check_format(self.output_format))  # a name of the outputs table, at call time
        _set(self, "transform", transform_options(self.transform, keyword="transform"))
        _set(self, "nproc", None if self.nproc is None else count("--nproc", self.nproc))
        _set(self, "memory_budget_bytes", byte_count("--memory-budget", self.memory_budget_bytes))
        _set(self, "max_shard_bytes", byte_count("--max-shard-size", self.max_shard_bytes))
        if self.verify_output and lora_only(self.transform) is not None:
            check_verifiable(PEFT_ROW)  # --lora-only writes a PEFT adapter folder, which --verify does not read back

    @classmethod
    def from_call(cls, options: object, kwargs: Mapping[str, Any]) -> ConsolidateOptions:
        """``consolidate``'s options from its call (``_from_call``: options may be a TransformOptions, as before).

        Raises:
            InvalidOptionError: an unknown keyword, or a bad value naming its keyword.
        """
        return _from_call(cls, options, kwargs)


@dataclass(frozen=True, slots=True, kw_only=True)
class ReshardOptions:
    """How ``reshard`` lays a checkpoint out for ``world_size`` ranks (a DCP folder any DCP loader reads).

    Raises:
        InvalidOptionError: a bad value (named by its keyword); ``compress="zstd"`` without ``zstandard``.
    """

    operation: ClassVar[str] = "reshard"

    world_size: int
    """The target world size (ranks; one data file each, if it holds chunks). Required."""
    nproc: int | None = None
    """Workers, each moving its share of the chunks (balanced by bytes) into any rank file; None:
    ``plan.consolidate.default_nproc`` (one per CPU core, at most one per data file and per 2 GiB)."""
    transform: TransformOptions = field(default_factory=TransformOptions)
    """Key and dtype transforms, as for ``consolidate``; the output keeps the source's nesting, so the
    producer's own loader reads it."""
    overwrite: bool = False
    """Replace an existing OUT, at the final rename only; never the checkpoint, inside it or one of its folders."""
    force: bool = False
    """With ``overwrite``, replace a folder that does not look like this tool's output too."""
    space_check: bool = True
    """Check OUT's size from the plan, in bytes (rank files, ``.metadata``, files copied beside; counted
    uncompressed), against the free space where its temporary is written, before anything is read."""
    check_crc: bool = True
    """Check CRC-32s of the source payloads."""
    cluster: Cluster | None = None
    """torchrun's multi-node options, as for ``consolidate``; rank 0's node writes ``.metadata``."""
    compress: Literal["zstd"] | None = None
    """``"zstd"``: every payload a zstd stream (``stream.zstd/1``, as ``FileSystemWriter(_extensions=[ZStandard()])``
    writes); needs the ``zstandard`` package. None: uncompressed, whatever the source."""
    resume: bool = False
    """Finish the interrupted run's temporary output, as for ``consolidate``."""
    progress: bool = False
    """A bar on stderr (bytes of every worker, binary units, rate, time left), drawn by rank 0's worker."""
    follow_symlinks: bool | None = None
    """As for ``consolidate``: links out of the checkpoint's folder are read (True), refused (False), or as the
    process's setting says (None)."""
    output_format: Literal["auto", "dcp", "deepspeed"] = "auto"
    """``dcp``: a DCP folder (``dcp.load``; FSDP2 with ``set_state_dict``); ``deepspeed``: a DeepSpeed ZeRO save of
    the same stage and dtype that ``engine.load_checkpoint`` reads at ``world_size`` ranks (a DeepSpeed source
    only); ``auto``: the source's own kind (DeepSpeed for a DeepSpeed save, else DCP)."""

    def __post_init__(self) -> None:
        _set(self, "world_size", count("--world-size", self.world_size))
        if self.output_format not in ("auto", "dcp", "deepspeed"):
            raise InvalidOptionError(f"--format {self.output_format}: choose auto, dcp or deepspeed")
        _set(self, "transform", transform_options(self.transform, keyword="transform"))
        _set(self, "nproc", None if self.nproc is None else count("--nproc", self.nproc))
        if self.compress is not None:
            if self.compress != "zstd":
                raise InvalidOptionError(f"--compress {self.compress}: only zstd is supported")
            require_zstd()

    @classmethod
    def from_call(cls, options: object, kwargs: Mapping[str, Any]) -> ReshardOptions:
        """``reshard``'s options from its call (``_from_call``: ``world_size`` is required).

        Raises:
            InvalidOptionError: an unknown or missing keyword, or a bad value naming its keyword.
        """
        return _from_call(cls, options, kwargs)


def _dtype(keyword: str, value: object) -> torch.dtype | None:
    """``verify``'s ``dtype`` / ``optim_dtype``: None, a ``torch.dtype``, or a name ``parse_dtype`` takes.

    Raises:
        InvalidOptionError: an unknown name (``parse_dtype``'s message), or another type.
    """
    if value is None:  # no cast: no torch (verify of stored bytes imports none)
        return None
    import torch

    if isinstance(value, torch.dtype):
        return value
    if isinstance(value, str):
        return parse_dtype(value).torch
    raise InvalidOptionError(f"{keyword} {value!r}: expected None, a torch.dtype or a dtype name (fp32, bf16, fp16)")


@dataclass(frozen=True, slots=True, kw_only=True)
class VerifyOptions:
    """How ``verify`` compares two checkpoints of any formats key by key.

    Raises:
        InvalidOptionError: a bad value (named by its keyword); a ``dtype``/``optim_dtype`` naming no dtype.
    """

    operation: ClassVar[str] = "verify"

    atol: float | None = None
    """Absolute tolerance for floating tensors (``torch.allclose``); None: bitwise (unless ``rtol``)."""
    rtol: float | None = None
    """Relative tolerance for floating tensors (``torch.allclose``); None: bitwise (unless ``atol``)."""
    only: Only = "all"
    """Compare only this top-level group (``model``, ``optim``) or ``all``."""
    check_crc: bool = True
    """Check CRC-32s of DCP payloads while reading."""
    transform: TransformOptions | None = None
    """The transforms a DCP side is seen through (``open_source``); None: as saved, or as ``consolidate``
    names the weights when the other side holds weights alone."""
    nproc: int | None = None
    """Workers comparing keys in parallel (each opens both sides and compares every ``nproc``-th key);
    None: ``plan.consolidate.default_nproc`` of both sides' bytes and data files (one worker compares
    in the calling process)."""
    cluster: Cluster | None = None
    """torchrun's multi-node options; rank 0's process returns the whole result, the others an empty one."""
    in_process: bool = False
    """Compare here, one process, even under torchrun (``consolidate``'s ``verify_output``, on rank 0 alone)."""
    dtype: torch.dtype | str | None = None
    """Cast model tensors to this dtype first, as ``consolidate`` casts (a ``torch.dtype``, or ``fp32``/``bf16``/
    ``fp16``, normalized to the ``torch.dtype``)."""
    optim_dtype: torch.dtype | str | None = None
    """The same for optimizer state, never ``step``."""
    progress: bool = False
    """A ``verify`` bar on stderr of A's tensor bytes compared (every worker's, drawn by rank 0's)."""
    transform_files: bool = False
    """See A through ``transform`` even when it is a file (``consolidate``'s ``verify_output`` of a file input)."""
    follow_symlinks: bool | None = None
    """As for ``consolidate``: links out of a checkpoint's folder are read (True), refused (False), or as the
    process's setting says (None)."""

    def __post_init__(self) -> None:
        _set(self, "only", choice("--only", self.only, ("all", "model", "optim")))
        _set(self, "atol", tolerance("--atol", self.atol))
        _set(self, "rtol", tolerance("--rtol", self.rtol))
        _set(self, "nproc", None if self.nproc is None else count("--nproc", self.nproc))
        if self.transform is not None:
            _set(self, "transform", transform_options(self.transform, keyword="transform"))
        _set(self, "dtype", _dtype("dtype", self.dtype))
        _set(self, "optim_dtype", _dtype("optim_dtype", self.optim_dtype))

    @classmethod
    def from_call(cls, options: object, kwargs: Mapping[str, Any]) -> VerifyOptions:
        """``verify``'s options from its call (``_from_call``: options may be a TransformOptions, as before).

        Raises:
            InvalidOptionError: an unknown keyword, or a bad value naming its keyword.
        """
        return _from_call(cls, options, kwargs)
