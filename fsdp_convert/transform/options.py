"""Transform options: what ``consolidate`` and ``reshard`` do to keys and dtypes, checked as they are built.

``TransformOptions`` also takes the command line's spellings (``dtype="bf16"``,
``renames="^=model."``, ``include="layers.*"``) and normalizes them to its field
types, so a Python caller can write what the CLI takes; a bad value is an ``InvalidOptionError``
naming the field and the values it takes, before anything is read.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal, TypeVar, get_args

from fsdp_convert.derive import Adapter
from fsdp_convert.dtypes import CAST_NAMES, DType, as_dtype
from fsdp_convert.errors import InvalidOptionError

if TYPE_CHECKING:
    pass

__all__ = ["OptimKeys", "Layout", "Quantize", "TransformOptions", "choice", "dtype_names", "parse_dtype", "parse_rename"]

OptimKeys = Literal["names", "ids"]
Layout = Literal["producer", "nested"]
Quantize = Literal["fp8-block128"]
S = TypeVar("S", bound=str)


def _listed(names: Iterable[str]) -> str:
    """``a, b or c``."""
    *rest, last = names
    return f"{', '.join(rest)} or {last}" if rest else last


def dtype_names() -> tuple[str, ...]:
    """The dtype names the CLI lists (``fp32``, ``bf16``, ``fp16``): each dtype's first in ``dtypes.CAST_NAMES``."""
    first: dict[str, str] = {}
    for name, dtype in CAST_NAMES.items():
        first.setdefault(dtype, name)
    return tuple(first.values())


def parse_dtype(text: str) -> DType:
    """``fp32``/``bf16``/``fp16`` (or ``float32``, ``bfloat16``, ``float16``, ``half``; any case) to its dtype.

    Raises:
        InvalidOptionError: any other name.
    """
    name = CAST_NAMES.get(text.strip().lower())
    if name is None:
        raise InvalidOptionError(f"{text!r} is not a dtype; use {_listed(dtype_names())}")
    return DType(name)


def parse_rename(text: str) -> tuple[str, str]:
    r"""``REGEX=REPLACEMENT`` to a pair; the last ``=`` separates them (a regex may hold ``(?=``).

    The replacement follows ``re.sub``: ``\1`` or ``\g<name>`` refer to groups.

    Raises:
        InvalidOptionError: no ``=``, or the regex does not compile.
    """
    pattern, sep, replacement = text.rpartition("=")
    if not sep or not pattern:
        raise InvalidOptionError(f"--rename {text!r}: expected REGEX=REPLACEMENT, e.g. '^layers\\.=model.layers.'")
    _check_regex(pattern, text)
    return pattern, replacement


def _check_regex(pattern: str, rule: str) -> None:
    try:
        re.compile(pattern)
    except re.error as e:
        raise InvalidOptionError(f"--rename {rule!r}: bad regex ({e})") from e


@dataclass(frozen=True, slots=True, kw_only=True)
class TransformOptions:
    """How checkpoint keys and dtypes become the output's (``consolidate`` and ``reshard``).

    Each field also takes the command line's spelling, normalized when the options are built:
    ``dtype`` / ``optim_dtype`` a name (``"bf16"``, ``"float32"``, ``"half"``: ``dtypes.CAST_NAMES``),
    ``renames`` ``"REGEX=REPLACEMENT"`` strings, ``(regex, replacement)`` pairs or a dict of them,
    ``include`` / ``exclude`` one glob or a list. A value a field does not take raises
    ``InvalidOptionError`` naming the field (``options.dtype='fp8' is not a dtype; use fp32, bf16
    or fp16``).

    Attributes:
        optim_keys: ``names`` keys optimizer state by parameter FQN (as
            ``get_optimizer_state_dict`` does); ``ids`` by integer in param-group order, with each
            group's ``params`` a list of those integers (as ``torch.optim.Optimizer.state_dict``).
        keep_wrapper_names: keep ``_fsdp_wrapped_module.``, ``_checkpoint_wrapped_module.``,
            ``_orig_mod.`` and a leading ``module.`` in FQNs (they are removed by default).
        renames: ``(regex, replacement)`` pairs applied in order with ``re.sub`` to every
            parameter FQN, model and optimizer alike, after wrapper names are removed.
        include: glob patterns (``fnmatch``); when given, only model FQNs matching one are kept.
        exclude: glob patterns; model FQNs matching one are dropped. Both match the FQN after
            wrapper names are removed and before renames.
        dtype: cast floating-point model tensors to this (floating-point) dtype; None keeps them.
        optim_dtype: cast floating-point optimizer state (but never ``step``) to this dtype.
        adapter: the model's tensors (wrapper names removed, ``include``/``exclude`` applied,
            then ``renames``) to the output's (``derive.Adapter``, ``adapters.load_adapter``): the
            adapter sees the renamed FQNs. Model only.
        layout: top-level names of a consolidation: ``producer`` keeps the producer's name for the
            optimizer state (``optimizer`` for Lightning, accelerate and torchtitan) and merges
            Lightning's ``meta.pt`` (``plan.items.prepare_items``), so that its own loader reads the
            file; ``nested`` writes ``optim`` for every producer and leaves ``meta.pt`` out.
            Either way model weights go under ``model``. ``reshard`` keeps every key as saved.
        unstack_layers: split each model tensor the producer stacks on a leading layer dim
            (``producers.Producer.stacked_layers``: Megatron-Core's ``decoder.layers.<name>`` of
            shape ``(L, ...)``) into ``L`` tensors ``decoder.layers.<i>.<name>`` of shape ``(...)``,
            and its optimizer state alike; before renames, after ``include``/``exclude``. Keyed by
            names only (not ``optim_keys="ids"``), and not with ``adapter`` (which maps the stacked
            tensors itself). A producer that stacks no layers refuses it.
        dequantize: dequantize block-quantized FP8 model weights (a ``float8_e4m3fn`` ``<fqn>``
            with ``<fqn>_scale_inv``, DeepSeek-V3's layout: ``transform.fp8``) to float32, then
            ``adapter`` (it sees the float32 weights, without scales), then ``dtype``; the scales
            are left out. An ``hf-to-torchtitan-*`` adapter does it without being asked
            (``adapters.load_adapter``). Not with ``unstack_layers``. Without it, ``dtype``
            refuses such weights (a cast would drop their scales).
        quantize: ``fp8-block128`` writes the model weights DeepSeek-V3 quantizes
            (``transform.fp8.quantized_by_deepseek``) as ``float8_e4m3fn``, each with
            ``<fqn>_scale_inv`` (1 / (448 / amax) per 128x128 block), from the weights as read or
            as ``adapter`` makes them (its HF names: each expert quantized on its own); ``dtype``
            casts the others. None: no quantizing. Not with ``unstack_layers`` or ``dequantize``.
    """

    optim_keys: OptimKeys = "names"
    keep_wrapper_names: bool = False
    renames: tuple[tuple[str, str], ...] = ()
    include: tuple[str, ...] = ()
    exclude: tuple[str, ...] = ()
    dtype: DType | None = None
    optim_dtype: DType | None = None
    layout: Layout = "producer"
    adapter: Adapter | None = None
    unstack_layers: bool = False
    dequantize: bool = False
    quantize: Quantize | None = None

    def __post_init__(self) -> None:
        """Normalize the command line's spellings to the field types, and check every field.

        Raises:
            InvalidOptionError: a value a field does not take (the message names the field and what it takes).
        """
        # messages name the flag, which str(e) words as the field (errors.FLAG_KEYWORDS): --dtype -> options.dtype
        set_field = object.__setattr__  # frozen: fields are set once, here
        set_field(self, "optim_keys", choice("--optim-keys", self.optim_keys, get_args(OptimKeys)))
        set_field(self, "layout", choice("--layout", self.layout, get_args(Layout)))
        if not isinstance(self.keep_wrapper_names, bool):
            raise InvalidOptionError(f"options.keep_wrapper_names: expected True or False, got {self.keep_wrapper_names!r}")
        set_field(self, "renames", _renames(self.renames))
        set_field(self, "include", _globs("--include", self.include))
        set_field(self, "exclude", _globs("--exclude", self.exclude))
        set_field(self, "dtype", _cast_dtype("--dtype", self.dtype))
        set_field(self, "optim_dtype", _cast_dtype("--optim-dtype", self.optim_dtype))
        if self.adapter is not None and not callable(self.adapter):
            raise InvalidOptionError(
                f"--adapter: expected a derive.Adapter (adapters.load_adapter), got {type(self.adapter).__name__}"
            )
        self._check_unstack()
        if not isinstance(self.dequantize, bool):
            raise InvalidOptionError(f"options.dequantize: expected True or False, got {self.dequantize!r}")
        if self.dequantize and self.unstack_layers:
            raise InvalidOptionError("--dequantize and --unstack-layers exclude each other: dequantize to a folder first")
        if self.quantize is not None:
            set_field(self, "quantize", choice("--quantize", self.quantize, get_args(Quantize)))
            if self.unstack_layers or self.dequantize:
                raise InvalidOptionError(
                    "--quantize goes alone (or after --adapter): run --unstack-layers or --dequantize to a folder first, "
                    "then quantize it"
                )

    def _check_unstack(self) -> None:
        """``unstack_layers``: a bool, with names as optimizer keys and no adapter."""
        if not isinstance(self.unstack_layers, bool):
            raise InvalidOptionError(f"options.unstack_layers: expected True or False, got {self.unstack_layers!r}")
        if self.unstack_layers and self.adapter is not None:
            raise InvalidOptionError(
                "--unstack-layers and --adapter exclude each other: an adapter maps the stacked layers itself"
            )
        if self.unstack_layers and self.optim_keys == "ids":
            raise InvalidOptionError("--unstack-layers names each layer's optimizer state; use --optim-keys names, not ids")


def choice(flag: str, value: object, allowed: tuple[S, ...]) -> S:
    """``value`` if it is one of ``allowed`` (``typing.get_args`` of the field's or keyword's ``Literal``).

    Returns the plain string, for a member of a CLI ``str`` enum too.

    Raises:
        InvalidOptionError: anything else; ``flag`` names it (``--layout 'flat': use producer or
            nested``, in library wording ``options.layout='flat': ...``).
    """
    if isinstance(value, str) and value in allowed:
        return allowed[allowed.index(value)]
    raise InvalidOptionError(f"{flag} {value!r}: use {_listed(allowed)}")


def _renames(value: object) -> tuple[tuple[str, str], ...]:
    """One ``REGEX=REPLACEMENT`` string, or a sequence of them and ``(regex, replacement)`` pairs, or a dict, to pairs."""
    rules = [value] if isinstance(value, str) else list(value.items()) if isinstance(value, Mapping) else value
    if not isinstance(rules, Iterable):
        raise InvalidOptionError(f"--rename {value!r}: expected 'REGEX=REPLACEMENT' strings or (regex, replacement) pairs")
    pairs: list[tuple[str, str]] = []
    for rule in rules:
        if isinstance(rule, str) and isinstance(value, tuple) and len(value) == 2 and "=" not in rule:
            raise InvalidOptionError(f"--rename {value!r}: one (regex, replacement) pair goes in a list: [{value!r}]")
        if isinstance(rule, str):
            pairs.append(parse_rename(rule))
        elif isinstance(rule, (tuple, list)) and len(rule) == 2 and all(isinstance(part, str) for part in rule):
            _check_regex(rule[0], f"{rule[0]}={rule[1]}")
            pairs.append((rule[0], rule[1]))
        else:
            raise InvalidOptionError(f"--rename {rule!r}: expected 'REGEX=REPLACEMENT' or a (regex, replacement) pair")
    return tuple(pairs)


def _globs(flag: str, value: object) -> tuple[str, ...]:
    """One glob, or a sequence of them, to a tuple (never a string's characters)."""
    globs = (value,) if isinstance(value, str) else tuple(value) if isinstance(value, Iterable) else None
    if globs is None or not all(isinstance(g, str) for g in globs):
        raise InvalidOptionError(f"{flag} {value!r}: expected a glob or a list of globs (strings)")
    return globs


def _cast_dtype(flag: str, value: object) -> DType | None:
    """A dtype name (``dtypes.CAST_NAMES``), a floating-point ``DType`` or torch dtype, as a ``DType``; None stays None."""
    if value is None:
        return None
    if isinstance(value, str):
        try:
            return parse_dtype(value)
        except InvalidOptionError as e:
            raise InvalidOptionError(f"{flag} {e.cli_text()}") from None
    try:
        dtype = as_dtype(value)
    except TypeError:
        dtype = None
    if dtype is not None and dtype.is_floating_point:
        return dtype
    raise InvalidOptionError(f"{flag} {value!r}: use {_listed(dtype_names())}, or a floating-point torch.dtype")
