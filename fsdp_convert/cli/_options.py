"""Reusable ``Annotated`` parameters, shared by the commands."""

from __future__ import annotations

import re
from enum import Enum
from typing import TYPE_CHECKING, Annotated, Any, TypeVar

import typer

from fsdp_convert.cli._errors import handle_errors
from fsdp_convert.errors import InvalidOptionError

# launch and transform import torch: they are imported where used, so --help and --version start without it
if TYPE_CHECKING:
    from fsdp_convert.launch import Cluster
    from fsdp_convert.transform import TransformOptions

__all__ = [
    "Choice",
    "OnlyChoice",
    "FormatChoice",
    "OptimKeysChoice",
    "LayoutChoice",
    "DtypeChoice",
    "RdzvBackendChoice",
    "choice_option",
    "parse_size",
    "CheckpointArg",
    "OutputArg",
    "JsonOpt",
    "OverwriteOpt",
    "NprocOpt",
    "MemoryBudgetOpt",
    "ProgressOpt",
    "NoCrcOpt",
    "OptimKeysOpt",
    "LayoutOpt",
    "KeepWrapperNamesOpt",
    "RenameOpt",
    "IncludeOpt",
    "ExcludeOpt",
    "DtypeOpt",
    "OptimDtypeOpt",
    "transform_options",
    "AdapterOpt",
    "ModelConfigOpt",
    "AdapterOptionOpt",
    "with_adapter",
    "NnodesOpt",
    "NodeRankOpt",
    "RdzvBackendOpt",
    "RdzvEndpointOpt",
    "RdzvIdOpt",
    "cluster_options",
]

C = TypeVar("C", bound="Choice")


class Choice(str, Enum):
    """The values an option takes, listed by ``--help`` and offered by shell completion.

    The command receives a member; the library functions take its ``value`` (or, for a dtype,
    the torch dtype), as before.
    """

    @classmethod
    def metavar(cls) -> str:
        """``[a|b|c]``, as ``--help`` shows the option's value."""
        return "[" + "|".join(m.value for m in cls) + "]"

    @classmethod
    def parse(cls: type[C], text: str, flag: str) -> C:
        """The member spelled ``text``.

        Raises:
            InvalidOptionError: any other spelling.
        """
        try:
            return cls(text)
        except ValueError:
            *rest, last = [m.value for m in cls]
            use = f"{', '.join(rest)} or {last}" if rest else last
            raise InvalidOptionError(f"{flag} {text!r}: use {use}") from None


class OnlyChoice(Choice):
    """``consolidate --only``: which part of the state dict to write."""

    all = "all"
    model = "model"
    optim = "optim"


class FormatChoice(Choice):
    """``consolidate --format``: the writer, or ``auto`` by OUT's suffix."""

    auto = "auto"
    torch = "torch"
    safetensors = "safetensors"


class OptimKeysChoice(Choice):
    """``--optim-keys``: optimizer state keyed by parameter FQN or by integer id."""

    names = "names"
    ids = "ids"


class LayoutChoice(Choice):
    """``consolidate --layout``: top-level names as the producer's loader reads them, or ``model``/``optim`` for all."""

    producer = "producer"
    nested = "nested"


class DtypeChoice(Choice):
    """``--dtype`` / ``--optim-dtype``: also spelled float32, bfloat16, float16 or half, in any case."""

    fp32 = "fp32"
    bf16 = "bf16"
    fp16 = "fp16"

    @classmethod
    def parse(cls: type[C], text: str, flag: str) -> C:
        """The member for any name ``transform.parse_dtype`` takes.

        Raises:
            InvalidOptionError: not a dtype name.
        """
        from fsdp_convert.transform import parse_dtype

        try:
            dtype = parse_dtype(text)
        except InvalidOptionError as e:
            raise InvalidOptionError(f"{flag} {e}") from None
        return next(m for m in cls if parse_dtype(m.value) == dtype)


class RdzvBackendChoice(Choice):
    """``--rdzv-backend``: torchrun's rendezvous backends that need no extra service."""

    c10d = "c10d"
    static = "static"


def choice_option(kind: type[Choice], flag: str, *, help: str, **kwargs: Any) -> Any:
    """A ``typer.Option`` taking one of ``kind``'s values.

    ``--help`` lists them and shell completion offers them. A bad value is one line, ``error:
    --flag 'x': use a, b or c``, and exit code 2, like every other bad option value (rather than
    typer's usage box).
    """

    def parse(value: str) -> Choice:
        if isinstance(value, kind):  # the default
            return value
        with handle_errors():
            return kind.parse(value, flag)

    def complete(incomplete: str) -> list[str]:
        return [m.value for m in kind if m.value.startswith(incomplete)]

    return typer.Option(flag, metavar=kind.metavar(), parser=parse, autocompletion=complete, help=help, **kwargs)


_SIZE_UNITS = {
    "": 1, "b": 1,
    "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
    "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40,
}  # fmt: skip


def parse_size(text: str) -> int:
    """A byte size such as ``1GiB``, ``512MiB``, ``5GB`` or ``4096``; in bytes.

    For ``--memory-budget`` and ``--max-shard-size``; the library takes bytes. Decimal units
    (``KB``, ``MB``, ``GB``, ``TB``) are powers of 1000, binary ones (``KiB``, ...) powers of 1024,
    as in transformers' ``max_shard_size``.

    Raises:
        InvalidOptionError: not a size, or not positive.
    """
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*", text)
    unit = m.group(2).lower() if m else ""
    if m is None or unit not in _SIZE_UNITS:
        raise InvalidOptionError(f"{text!r} is not a size (examples: 1GiB, 512MiB, 5GB, 4096)")
    value = int(float(m.group(1)) * _SIZE_UNITS[unit])
    if value <= 0:
        raise InvalidOptionError(f"size {text!r} must be positive")
    return value


CheckpointArg = Annotated[
    str,
    typer.Argument(
        metavar="CHECKPOINT_DIR",
        help="Checkpoint folder: DCP (.metadata), accelerate's parent folder, per-rank files, or s3://... (fsspec).",
        show_default=False,
    ),
]
OutputArg = Annotated[
    str,
    typer.Argument(
        metavar="OUT",
        help="Output: a .pt/.pth/.bin file (torch.save), a .safetensors file, or a folder (HF safetensors shards + index).",
        show_default=False,
    ),
]
JsonOpt = Annotated[bool, typer.Option("--json", help="Print one JSON document on stdout instead of a table.")]
OverwriteOpt = Annotated[bool, typer.Option("--overwrite", help="Replace OUT if it exists (only once the new one is complete).")]
NprocOpt = Annotated[
    int | None,
    typer.Option(
        "--nproc",
        "--nproc-per-node",
        min=1,
        help="Workers, started with torch's elastic launcher (gloo, CPU); 1 runs in-process. "
        "(default: one per CPU core; at most one per data file and per 2 GiB)",
        show_default=False,
    ),
]
MemoryBudgetOpt = Annotated[
    str,
    typer.Option(
        "--memory-budget", help="Mover buffers per process (peak is about the interpreter + this, whatever the largest tensor)."
    ),
]
ProgressOpt = Annotated[
    bool | None,
    typer.Option(
        "--progress/--quiet",
        help="Progress bars (bytes, rate, ETA) on stderr (default: when stderr is a terminal).",
        show_default=False,
    ),
]
NoCrcOpt = Annotated[
    bool, typer.Option("--no-crc", help="Skip checking the CRC-32 of every payload record (torch itself never checks them).")
]

OptimKeysOpt = Annotated[
    OptimKeysChoice,
    choice_option(
        OptimKeysChoice,
        "--optim-keys",
        help="Key optimizer state by parameter FQN (names, as get_optimizer_state_dict) or by integer id in "
        "param-group order (ids, as torch.optim.Optimizer.state_dict, for load_state_dict on a plain model).",
    ),
]
LayoutOpt = Annotated[
    LayoutChoice,
    choice_option(
        LayoutChoice,
        "--layout",
        help="Top-level keys of a .pt output: producer (as the producer saved them, so its own loader reads the file: "
        "Lightning's {model, optimizer, <meta.pt entries>}; optimizer stays optimizer) or nested "
        "({model, optim, ...} for every producer; meta.pt left out).",
    ),
]
KeepWrapperNamesOpt = Annotated[
    bool,
    typer.Option(
        "--keep-wrapper-names",
        help="Keep _fsdp_wrapped_module., _checkpoint_wrapped_module., _orig_mod. and a leading module. in FQNs.",
    ),
]
RenameOpt = Annotated[
    list[str] | None,
    typer.Option(
        "--rename",
        metavar="REGEX=REPLACEMENT",
        help="Rename parameter FQNs (model and optimizer) with re.sub; repeatable, applied in order.",
        show_default=False,
    ),
]
IncludeOpt = Annotated[
    list[str] | None,
    typer.Option(
        "--include", metavar="GLOB", help="Keep only model FQNs matching a glob (before renames); repeatable.", show_default=False
    ),
]
ExcludeOpt = Annotated[
    list[str] | None,
    typer.Option(
        "--exclude", metavar="GLOB", help="Drop model FQNs matching a glob (before renames); repeatable.", show_default=False
    ),
]
DtypeOpt = Annotated[
    DtypeChoice | None,
    choice_option(
        DtypeChoice,
        "--dtype",
        help="Cast floating-point model tensors (float32, bfloat16, float16 or half work too). \\[default: keep]",
        show_default=False,
    ),
]
OptimDtypeOpt = Annotated[
    DtypeChoice | None,
    choice_option(
        DtypeChoice,
        "--optim-dtype",
        help="Cast floating-point optimizer state (never step). \\[default: keep]",
        show_default=False,
    ),
]


def transform_options(
    optim_keys: OptimKeysChoice,
    keep_wrapper_names: bool,
    rename: list[str] | None,
    include: list[str] | None,
    exclude: list[str] | None,
    dtype: DtypeChoice | None,
    optim_dtype: DtypeChoice | None,
    layout: LayoutChoice = LayoutChoice.producer,
) -> TransformOptions:
    """The ``TransformOptions`` the command line asks for (``layout``: ``consolidate --layout``).

    Raises:
        InvalidOptionError: a bad ``--rename``.
    """
    from fsdp_convert.transform import TransformOptions, parse_dtype, parse_rename

    return TransformOptions(
        optim_keys=optim_keys.value,
        keep_wrapper_names=keep_wrapper_names,
        renames=tuple(parse_rename(r) for r in rename or ()),
        include=tuple(include or ()),
        exclude=tuple(exclude or ()),
        dtype=None if dtype is None else parse_dtype(dtype),
        optim_dtype=None if optim_dtype is None else parse_dtype(optim_dtype),
        layout=layout.value,
    )


AdapterOpt = Annotated[
    str | None,
    typer.Option(
        "--adapter",
        metavar="NAME",
        help="Map the model weights to another framework's names and layouts, computed as they are copied: "
        "torchtitan-llama3-to-hf, hf-to-torchtitan-llama3, torchtitan-qwen3-to-hf, hf-to-torchtitan-qwen3, "
        "or module:function, your own (imports that module). Model weights only.",
        show_default=False,
        rich_help_panel="Model-family adapters",
    ),
]
ModelConfigOpt = Annotated[
    str | None,
    typer.Option(
        "--model-config",
        metavar="FILE",
        help="The model's config.json (num_attention_heads, num_key_value_heads, tie_word_embeddings) for --adapter; "
        "default: --hf-assets DIR's config.json.",
        show_default=False,
        rich_help_panel="Model-family adapters",
    ),
]
AdapterOptionOpt = Annotated[
    list[str] | None,
    typer.Option(
        "--adapter-option",
        metavar="KEY=VALUE",
        help="A config field for --adapter, over --model-config's (VALUE read as JSON when it parses); repeatable.",
        show_default=False,
        rich_help_panel="Model-family adapters",
    ),
]


def with_adapter(
    options: TransformOptions,
    adapter: str | None,
    model_config: str | None,
    adapter_option: list[str] | None,
    hf_assets: str | None = None,
) -> TransformOptions:
    """``options`` with ``--adapter`` bound to its config (``adapters.configured_adapter``).

    Raises:
        InvalidOptionError: as ``adapters.configured_adapter``.
    """
    import dataclasses

    from fsdp_convert.adapters import configured_adapter

    bound = configured_adapter(adapter, model_config=model_config, settings=adapter_option or (), hf_assets=hf_assets)
    return options if bound is None else dataclasses.replace(options, adapter=bound)


NnodesOpt = Annotated[
    int,
    typer.Option(
        "--nnodes",
        min=1,
        help="Nodes taking part (torchrun's flag); run the same command on each.",
        rich_help_panel="Multi-node (torchrun's flags)",
    ),
]
NodeRankOpt = Annotated[
    int,
    typer.Option(
        "--node-rank",
        min=0,
        help="This node's rank (static rendezvous; c10d assigns ranks as nodes join).",
        rich_help_panel="Multi-node (torchrun's flags)",
    ),
]
RdzvBackendOpt = Annotated[
    RdzvBackendChoice,
    choice_option(
        RdzvBackendChoice, "--rdzv-backend", help="Rendezvous backend.", rich_help_panel="Multi-node (torchrun's flags)"
    ),
]
RdzvEndpointOpt = Annotated[
    str,
    typer.Option(
        "--rdzv-endpoint",
        metavar="HOST:PORT",
        help="Rendezvous endpoint every node reaches.",
        show_default=False,
        rich_help_panel="Multi-node (torchrun's flags)",
    ),
]
RdzvIdOpt = Annotated[
    str,
    typer.Option(
        "--rdzv-id",
        help="The run's id, the same on every node.",
        show_default=False,
        rich_help_panel="Multi-node (torchrun's flags)",
    ),
]


def cluster_options(nnodes: int, node_rank: int, rdzv_backend: RdzvBackendChoice, rdzv_endpoint: str, rdzv_id: str) -> Cluster:
    """The ``Cluster`` torchrun's flags describe.

    Raises:
        InvalidOptionError: a node rank outside ``--nnodes``.
    """
    if node_rank >= nnodes:
        raise InvalidOptionError(f"--node-rank {node_rank} is not below --nnodes {nnodes}")
    from fsdp_convert.launch import Cluster

    return Cluster(
        nnodes=nnodes, node_rank=node_rank, rdzv_backend=rdzv_backend.value, rdzv_endpoint=rdzv_endpoint, rdzv_id=rdzv_id
    )
