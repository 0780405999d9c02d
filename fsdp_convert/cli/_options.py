"""Reusable ``Annotated`` parameters, shared by the commands, and the help panels that group them."""

from __future__ import annotations

import re
from enum import Enum
from typing import TYPE_CHECKING, Annotated, Any, TypeVar

import typer

from fsdp_convert.cli._errors import handle_errors
from fsdp_convert.cli._precheck import dtype_name
from fsdp_convert.errors import InvalidOptionError
from fsdp_convert.output_table import EXTRA_STATE_FILENAME, OPTIMIZER_FILENAME

# transform imports torch: it is imported where used, so --help, --version and usage errors start without it
if TYPE_CHECKING:
    from fsdp_convert.transform import TransformOptions

__all__ = [
    "OUTPUT", "FOLDER_OUTPUT", "SELECTION", "TRANSFORMS", "CASTING", "ADAPTERS", "LORA", "PERFORMANCE", "SAFETY",
    "MULTI_NODE", "Choice", "OnlyChoice",
    "OptimKeysChoice", "LayoutChoice", "DtypeChoice", "choice_option", "parse_size", "CheckpointArg",
    "OutputArg", "JsonOpt", "MemoryBudgetOpt", "ProgressOpt", "NoCrcOpt", "FollowSymlinksOpt", "OptimKeysOpt", "LayoutOpt",
    "KeepWrapperNamesOpt", "UnstackLayersOpt", "DequantizeOpt", "QuantizeOpt", "RenameOpt", "IncludeOpt", "ExcludeOpt",
    "DtypeOpt", "OptimDtypeOpt", "transform_options", "AdapterOpt", "ModelConfigOpt", "AdapterOptionOpt", "with_adapter",
]  # fmt: skip

# --help's panels, in the order a command first names them (rich_help_panel); the rest is "Options". In each
# panel the description column is what the longest option name and the longest value name leave of 80
# columns: an option with a long name and one with a long value go to different panels.
OUTPUT = "Output"
FOLDER_OUTPUT = "Folder output (Hugging Face)"
SELECTION = "Selection & renaming"
TRANSFORMS = "Transforms"
CASTING = "Casting"
ADAPTERS = "Adapters"
LORA = "LoRA (PEFT)"
PERFORMANCE = "Performance"
SAFETY = "Resume & safety"
MULTI_NODE = "Multi-node (torchrun's flags)"

C = TypeVar("C", bound="Choice")


class Choice(str, Enum):
    """The values an option takes, listed by ``--help`` and offered by shell completion.

    The command receives a member; the library functions take its ``value`` (or, for a dtype,
    the torch dtype), as before.
    """

    def __str__(self) -> str:  # the value, as StrEnum's: typer < 0.28 converts a default through str()
        return str(self.value)

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


class OptimKeysChoice(Choice):
    """``--optim-keys``: optimizer state keyed by parameter FQN or by integer id."""

    names = "names"
    ids = "ids"


class QuantizeChoice(Choice):
    """``--quantize``: the quantized layout an HF folder is written in."""

    fp8_block128 = "fp8-block128"


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
        """The member for any name ``transform.parse_dtype`` takes (``cli._precheck.DTYPE_NAMES``, no torch).

        Raises:
            InvalidOptionError: not a dtype name.
        """
        return cls(dtype_name(text, flag))


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
        help="A DCP folder, accelerate's parent folder, per-rank files, or an fsspec URL (s3://...).",
        show_default=False,
    ),
]
OutputArg = Annotated[
    str,
    typer.Argument(
        metavar="OUT",
        help="A .pt/.pth/.bin file (torch.save), a .safetensors file (the model only), or a folder: Hugging Face "
        f"safetensors shards and their index, with {OPTIMIZER_FILENAME} (the optimizer state) and {EXTRA_STATE_FILENAME} "
        "(any other entries) beside them unless --only model.",
        show_default=False,
    ),
]
JsonOpt = Annotated[bool, typer.Option("--json", metavar="", help="One JSON document on stdout instead of text.")]
MemoryBudgetOpt = Annotated[
    str,
    typer.Option(
        "--memory-budget",
        metavar="SIZE",
        help="Copy buffers per process: peak memory is the interpreter's plus this, whatever the tensors.",
        rich_help_panel=PERFORMANCE,
    ),
]
ProgressOpt = Annotated[
    bool | None,
    typer.Option(
        "--progress/--no-progress",
        metavar="",
        help="Progress bars on stderr. \\[default: when stderr is a terminal, without --json or -q]",
        show_default=False,
    ),
]
NoCrcOpt = Annotated[
    bool,
    typer.Option(
        "--no-crc",
        metavar="",
        help="Skip checking payload CRC-32s (torch never checks them).",
        rich_help_panel=PERFORMANCE,
    ),
]
FollowSymlinksOpt = Annotated[
    bool,
    typer.Option(
        "--follow-symlinks",
        metavar="",
        help="Read files that symbolic links lead to outside an input folder, as a cluster's checkpoint "
        "whose data files link into a shared store needs. Off: such a link is refused.",
        rich_help_panel=SAFETY,
    ),
]

OptimKeysOpt = Annotated[
    OptimKeysChoice,
    choice_option(
        OptimKeysChoice,
        "--optim-keys",
        help="Optimizer state keyed by parameter FQN (names) or by id (ids, as Optimizer.state_dict gives it).",
        rich_help_panel=SELECTION,
    ),
]
LayoutOpt = Annotated[
    LayoutChoice,
    choice_option(
        LayoutChoice,
        "--layout",
        help="Top-level keys of a .pt: as the producer saved them (its loader reads the file), or nested: {model, optim, ...}.",
        rich_help_panel=OUTPUT,
    ),
]
KeepWrapperNamesOpt = Annotated[
    bool,
    typer.Option(
        "--keep-wrapper-names",
        metavar="",
        help="Keep wrapper parts (_fsdp_wrapped_module., _orig_mod., ...) and a leading module. in FQNs.",
        rich_help_panel=TRANSFORMS,
    ),
]
UnstackLayersOpt = Annotated[
    bool,
    typer.Option(
        "--unstack-layers",
        metavar="",
        help="Write each layer of tensors stacked on a layer dim (Megatron-Core's decoder.layers.<name>) as "
        "decoder.layers.<i>.<name>, optimizer state too; before --rename.",
        rich_help_panel=TRANSFORMS,
    ),
]
DequantizeOpt = Annotated[
    bool,
    typer.Option(
        "--dequantize",
        metavar="",
        help="Dequantize block FP8 (DeepSeek-V3's) and MXFP4 (gpt-oss's experts) weights to float32, before any "
        "adapter or cast; implied by hf-to-torchtitan-*.",
        rich_help_panel=CASTING,
    ),
]
QuantizeOpt = Annotated[
    QuantizeChoice | None,
    choice_option(
        QuantizeChoice,
        "--quantize",
        help="Write the weights DeepSeek-V3 quantizes (after --adapter, per expert) as float8_e4m3fn + 128x128 block scales.",
        show_default=False,
        rich_help_panel=CASTING,
    ),
]
RenameOpt = Annotated[
    list[str] | None,
    typer.Option(
        "--rename",
        metavar="REGEX=REPLACEMENT",
        help="Rename parameter FQNs with re.sub (applied in order, before --adapter); repeatable.",
        show_default=False,
        rich_help_panel=SELECTION,
    ),
]
IncludeOpt = Annotated[
    list[str] | None,
    typer.Option(
        "--include",
        metavar="GLOB",
        help="Keep only model FQNs matching GLOB (before renames); repeatable.",
        show_default=False,
        rich_help_panel=SELECTION,
    ),
]
ExcludeOpt = Annotated[
    list[str] | None,
    typer.Option(
        "--exclude",
        metavar="GLOB",
        help="Drop model FQNs matching GLOB (before renames); repeatable.",
        show_default=False,
        rich_help_panel=SELECTION,
    ),
]
DtypeOpt = Annotated[
    DtypeChoice | None,
    choice_option(
        DtypeChoice,
        "--dtype",
        help="Cast floating-point model tensors (float32, bfloat16, half work too). \\[default: keep]",
        show_default=False,
        rich_help_panel=CASTING,
    ),
]
OptimDtypeOpt = Annotated[
    DtypeChoice | None,
    choice_option(
        DtypeChoice,
        "--optim-dtype",
        help="Cast floating-point optimizer state (never step). \\[default: keep]",
        show_default=False,
        rich_help_panel=CASTING,
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
    unstack_layers: bool = False,
    dequantize: bool = False,
    quantize: QuantizeChoice | None = None,
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
        dtype=None if dtype is None else parse_dtype(dtype.value),
        optim_dtype=None if optim_dtype is None else parse_dtype(optim_dtype.value),
        layout=layout.value,
        unstack_layers=unstack_layers,
        dequantize=dequantize,
        quantize=None if quantize is None else quantize.value,
    )


AdapterOpt = Annotated[
    str | None,
    typer.Option(
        "--adapter",
        metavar="NAME",
        help="Map model weights (named after --rename) to another framework's names and layouts: a built-in adapter such as "
        "torchtitan-llama3-to-hf (docs/huggingface.md lists them), or your module:function.",
        show_default=False,
        rich_help_panel=ADAPTERS,
    ),
]
ModelConfigOpt = Annotated[
    str | None,
    typer.Option(
        "--model-config",
        metavar="FILE",
        help="The model's config.json, for --adapter. \\[default: the one in --hf-assets DIR]",
        show_default=False,
        rich_help_panel=ADAPTERS,
    ),
]
AdapterOptionOpt = Annotated[
    list[str] | None,
    typer.Option(
        "--adapter-option",
        metavar="KEY=VALUE",
        help="A config field for --adapter, over --model-config's (VALUE as JSON if it parses); repeatable.",
        show_default=False,
        rich_help_panel=ADAPTERS,
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
