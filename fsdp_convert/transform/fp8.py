"""Transform stage, block FP8: DeepSeek-V3's ``float8_e4m3fn`` weights with a ``weight_scale_inv`` per 128x128 block, dequantized.

A Hugging Face folder quantized as DeepSeek-V3's (``quantization_config`` ``{"quant_method": "fp8",
"weight_block_size": [128, 128]}``) holds each quantized 2-D weight ``W`` of shape ``(rows, cols)``
as ``float8_e4m3fn`` beside ``<fqn>_scale_inv`` (``W.weight_scale_inv``), float32 of shape
``(ceil(rows / 128), ceil(cols / 128))``. The weight's value is ``W.float() * scale_inv[i // 128,
j // 128]`` at ``(i, j)``: the Hub reference ``weight_dequant`` and torch's
``QuantizedHuggingFaceStorageReader`` (block 128, float32 target), one float32 multiply each.
``dequantize_rules`` makes that a ``derive.Derived`` per weight, built row block by row block, and
does the same for gpt-oss's MXFP4 experts (``*_blocks`` with ``*_scales``: ``transform.mxfp4``);
``quantize_rules`` the other way (transformers' ``Fp8Quantize``). ``with_fp8`` puts either around a
model-family adapter (``transform.chain.Chain``): dequantized before it (``--dequantize``, implied by
an ``hf-to-torchtitan-*`` adapter), quantized after it (``--quantize fp8-block128``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

from fsdp_convert.derive import Adapter, Derived, Input, TensorInfo, copy_of
from fsdp_convert.dtypes import DType, as_dtype
from fsdp_convert.errors import UnsupportedTransformError
from fsdp_convert.transform.chain import Chain, Staged
from fsdp_convert.transform.mxfp4 import dequantize_rule, mxfp4_pairs

if TYPE_CHECKING:
    import torch

__all__ = [
    "BLOCK",
    "SCALE_SUFFIX",
    "ScaleRows",
    "BlockDequant",
    "quantized_fqns",
    "dequantize_rules",
    "QUANTIZATION_CONFIG",
    "BlockHead",
    "BlockTail",
    "BlockRowsOf",
    "BlockScaleInv",
    "BlockQuantize",
    "quantized_by_deepseek",
    "quantize_rules",
    "keeps_dtype",
    "dequantizes",
    "with_fp8",
]

BLOCK = 128
"""Rows and columns of a quantization block (``weight_block_size`` [128, 128])."""

SCALE_SUFFIX = "_scale_inv"
"""A quantized tensor ``<fqn>``'s scales are ``<fqn>_scale_inv``."""

_FP8 = DType("float8_e4m3fn")


@dataclass(frozen=True, slots=True)
class ScaleRows:
    """Output row ``i`` of a dequantized weight takes scale row ``i // block`` (a row map, ``derive.RowMap``)."""

    one_per_row: ClassVar[bool] = True  # transform.chain: one scale row per weight row
    block: int = BLOCK

    def __call__(self, r0: int, r1: int) -> Sequence[int]:
        """The scale row of each weight row ``[r0, r1)``, repeated per row."""
        return [i // self.block for i in range(r0, r1)]

    def span(self, r0: int, r1: int) -> tuple[int, int] | None:
        """The scale rows of the blocks ``[r0, r1)`` falls in (see ``derive.row_span``)."""
        return (r0 // self.block, (r1 - 1) // self.block + 1) if r0 < r1 else None


@dataclass(frozen=True, slots=True)
class BlockDequant:
    """``combine`` of a dequantized weight: weight rows ``(n, cols)`` and their scale rows ``(n, ceil(cols / block))``.

    Returns float32 ``(n, cols)``: each element times its block's scale, one float32 multiply.
    """

    block: int = BLOCK

    def __call__(self, parts: Sequence[torch.Tensor]) -> torch.Tensor:
        """The dequantized rows, float32."""
        import torch

        weight, scale = parts
        out = weight.to(torch.float32)
        scale = scale.to(torch.float32)
        n, cols = out.shape
        whole = cols // self.block  # column blocks of full width, multiplied at once; then the partial one
        if whole:
            out[:, : whole * self.block].view(n, whole, self.block).mul_(scale[:, :whole, None])
        if whole * self.block < cols:
            out[:, whole * self.block :] *= scale[:, whole : whole + 1]
        return out


def _scale_shape(shape: tuple[int, ...]) -> tuple[int, ...]:
    return tuple(-(-n // BLOCK) for n in shape)


def quantized_fqns(tensors: Sequence[TensorInfo]) -> list[str]:
    """The ``float8_e4m3fn`` tensors that have a ``<fqn>_scale_inv`` beside them, in order."""
    fqns = {t.fqn for t in tensors}
    return [t.fqn for t in tensors if as_dtype(t.dtype) == _FP8 and t.fqn + SCALE_SUFFIX in fqns]


def dequantize_rules(tensors: Sequence[TensorInfo]) -> Mapping[str, Derived]:
    """Every tensor as it is, but block FP8 and MXFP4 weights dequantized to float32, scales left out (a ``derive.Adapter``).

    Args:
        tensors: the model's tensors; a ``float8_e4m3fn`` ``<fqn>`` with ``<fqn>_scale_inv`` beside
            it is block FP8 (``quantized_fqns``), a uint8 ``<name>_blocks`` with a uint8
            ``<name>_scales`` MXFP4 (``transform.mxfp4.mxfp4_pairs``).

    Returns:
        Output FQN to rule, in input order: a block FP8 weight ``(rows, cols)`` read with its
        scales (``ScaleRows``, ``BlockDequant``), float32, under its own FQN; MXFP4 nibbles
        ``(*prefix, G, B)`` with theirs as float32 ``(*prefix, G * 2 * B)`` under the ``*_blocks``
        FQN (``transform.mxfp4.dequantize_rule``, torch's reader's name and shape); the others copied.

    Raises:
        UnsupportedTransformError: a block FP8 tensor that is not 2-D, or whose scales are not
            ``(ceil(rows / 128), ceil(cols / 128))``; MXFP4 scales that are not the nibbles' shape
            without its last dim (names the tensor).
    """
    by_fqn = {t.fqn: t for t in tensors}
    quantized = quantized_fqns(tensors)
    mxfp4 = mxfp4_pairs(tensors)
    scales = {fqn + SCALE_SUFFIX for fqn in quantized} | set(mxfp4.values())
    rules: dict[str, Derived] = {}
    for info in tensors:
        if info.fqn in scales:
            continue
        if info.fqn in mxfp4:
            rules[info.fqn] = dequantize_rule(info, by_fqn[mxfp4[info.fqn]])
            continue
        if info.fqn not in quantized:
            rules[info.fqn] = copy_of(info)
            continue
        scale = by_fqn[info.fqn + SCALE_SUFFIX]
        if len(info.shape) != 2 or scale.shape != _scale_shape(info.shape):
            raise UnsupportedTransformError(
                f"{info.fqn}: block FP8 needs a 2-D weight and {scale.fqn} of shape {_scale_shape(info.shape)} "
                f"(blocks of {BLOCK}x{BLOCK}); got {info.shape} and {scale.shape}"
            )
        inputs = (Input(fqn=info.fqn), Input(fqn=scale.fqn, rows=ScaleRows()))
        rules[info.fqn] = Derived(inputs=inputs, shape=info.shape, dtype=DType("float32"), combine=BlockDequant())
    return rules


# --- quantizing: transformers' ``Fp8Quantize`` (integrations/finegrained_fp8.py), block by block

_FP8_MAX = 448.0  # torch.finfo(torch.float8_e4m3fn).max (tests/unit/test_dtypes.py)
_KEPT = ("embed", "norm", "lm_head")  # DeepSeek-V3 keeps embeddings, norms and the head high precision
QUANTIZATION_CONFIG = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [BLOCK, BLOCK]}
"""The ``quantization_config`` of ``config.json`` for a ``--quantize fp8-block128`` output (DeepSeek-V3's)."""


@dataclass(frozen=True, slots=True)
class BlockHead:
    """The rows of the 128-row block before output row ``r0``: ``[r0 // block * block, r0)`` (its quantized part's context)."""

    contiguous: ClassVar[bool] = True  # transform.chain: one ascending range per block
    block: int = BLOCK

    def __call__(self, r0: int, r1: int) -> Sequence[int]:
        """Rows from ``r0``'s block start to ``r0`` (none when ``r0`` starts a block)."""
        return range(r0 // self.block * self.block, r0) if r0 < r1 else range(0)

    def span(self, r0: int, r1: int) -> tuple[int, int] | None:
        """Every row a block inside ``[r0, r1)`` may ask (see ``derive.row_span``)."""
        return (r0 // self.block * self.block, r1) if r0 < r1 else None


@dataclass(frozen=True, slots=True)
class BlockTail:
    """The rows of the 128-row block after output row ``r1 - 1``: ``[r1, min(ceil(r1 / block) * block, rows))``."""

    contiguous: ClassVar[bool] = True  # transform.chain: one ascending range per block
    rows: int
    block: int = BLOCK

    def __call__(self, r0: int, r1: int) -> Sequence[int]:
        """Rows from ``r1`` to its block's end (none when ``r1`` ends a block)."""
        return range(r1, min(-(-r1 // self.block) * self.block, self.rows)) if r0 < r1 else range(0)

    def span(self, r0: int, r1: int) -> tuple[int, int] | None:
        """Every row a block inside ``[r0, r1)`` may ask (see ``derive.row_span``)."""
        return (r0, min(-(-r1 // self.block) * self.block, self.rows)) if r0 < r1 else None


@dataclass(frozen=True, slots=True)
class BlockRowsOf:
    """Scale row ``k`` reads weight rows ``[k * block, (k + 1) * block)`` (a row map; its rows are scale rows)."""

    contiguous: ClassVar[bool] = True  # transform.chain: one ascending range per block
    rows: int
    block: int = BLOCK

    def __call__(self, r0: int, r1: int) -> Sequence[int]:
        """The weight rows of scale rows ``[r0, r1)``."""
        return range(r0 * self.block, min(r1 * self.block, self.rows))

    def span(self, r0: int, r1: int) -> tuple[int, int] | None:
        """As ``__call__`` (see ``derive.row_span``)."""
        rows = self(r0, r1)
        return (rows[0], rows[-1] + 1) if rows else None


def _scales(rows: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Weight rows starting at a block's first row: (forward scales 448 / amax, per block; their inverses), float32.

    As transformers' ``Fp8Quantize._quantize_one``: an all-zero block has scale 1.
    """
    import torch

    n, cols = rows.shape
    padded = torch.nn.functional.pad(rows.to(torch.float32).abs(), (0, -cols % block, 0, -n % block))  # zeros: amax as is
    amax = padded.view(padded.shape[0] // block, block, padded.shape[1] // block, block).amax(dim=(1, 3))
    safe = torch.where(amax > 0, amax, torch.ones_like(amax))
    scales = torch.where(amax > 0, _FP8_MAX / safe, torch.ones_like(amax))
    return scales, (1.0 / scales).to(torch.float32)


@dataclass(frozen=True, slots=True)
class BlockScaleInv:
    """``combine`` of ``<fqn>_scale_inv``: whole blocks of weight rows to their ``1 / (448 / amax)``, float32."""

    block: int = BLOCK

    def __call__(self, parts: Sequence[torch.Tensor]) -> torch.Tensor:
        """Scale rows, ``(ceil(n / block), ceil(cols / block))``."""
        return _scales(parts[0], self.block)[1]


@dataclass(frozen=True, slots=True)
class BlockQuantize:
    """``combine`` of a quantized weight: (head rows, the output rows, tail rows) to ``clamp(w * 448 / amax)`` as FP8."""

    block: int = BLOCK

    def __call__(self, parts: Sequence[torch.Tensor]) -> torch.Tensor:
        """The output rows, ``float8_e4m3fn``."""
        import torch

        head, rows, tail = parts
        whole = torch.cat([head, rows, tail]).to(torch.float32)
        scales = _scales(whole, self.block)[0]
        per_row = scales.repeat_interleave(self.block, dim=0)[: whole.shape[0]]
        per_elem = per_row.repeat_interleave(self.block, dim=1)[:, : whole.shape[1]]
        mine = slice(head.shape[0], head.shape[0] + rows.shape[0])
        return torch.clamp(whole[mine] * per_elem[mine], min=-_FP8_MAX, max=_FP8_MAX).to(_FP8.torch)


def quantized_by_deepseek(info: TensorInfo) -> bool:
    """True for what DeepSeek-V3 quantizes: 2-D ``.weight`` s but embeddings, norms, ``lm_head``, routers (``mlp.gate``)."""
    return (
        len(info.shape) == 2
        and info.dtype.is_floating_point
        and info.fqn.endswith(".weight")
        and not info.fqn.endswith("mlp.gate.weight")
        and not any(part in info.fqn for part in _KEPT)
    )


def quantize_rules(tensors: Sequence[TensorInfo]) -> Mapping[str, Derived]:
    """Every tensor as it is, but DeepSeek-V3's quantized weights as FP8, each with ``<fqn>_scale_inv`` (a ``derive.Adapter``).

    Returns:
        Output FQN to rule, in input order: a quantized weight ``(rows, cols)`` (``quantized_by_deepseek``)
        as ``float8_e4m3fn`` (``BlockHead``, ``BlockTail``, ``BlockQuantize``), then
        ``<fqn>_scale_inv``, float32 ``(ceil(rows / 128), ceil(cols / 128))`` (``BlockRowsOf``,
        ``BlockScaleInv``); the others copied.
    """
    rules: dict[str, Derived] = {}
    for info in tensors:
        if not quantized_by_deepseek(info):
            rules[info.fqn] = copy_of(info)
            continue
        rows = info.shape[0]
        inputs = (Input(fqn=info.fqn, rows=BlockHead()), Input(fqn=info.fqn), Input(fqn=info.fqn, rows=BlockTail(rows)))
        rules[info.fqn] = Derived(inputs=inputs, shape=info.shape, dtype=_FP8, combine=BlockQuantize())
        scale = Input(fqn=info.fqn, rows=BlockRowsOf(rows))
        rules[info.fqn + SCALE_SUFFIX] = Derived(
            inputs=(scale,), shape=_scale_shape(info.shape), dtype=DType("float32"), combine=BlockScaleInv()
        )
    return rules


def keeps_dtype(derived: Derived | None) -> bool:
    """True for a quantized weight or its scales (``--dtype`` casts neither), also at the end of a chain."""
    combine = derived.combine if derived is not None else None
    if isinstance(combine, Staged):
        combine = combine.outer
    return isinstance(combine, (BlockQuantize, BlockScaleInv))


def dequantizes(adapter: Adapter | None) -> bool:
    """True when ``adapter`` dequantizes (block FP8, MXFP4) before anything else (``dequantize_rules``, first in a chain)."""
    while isinstance(adapter, Chain):
        adapter = adapter.first
    return adapter is dequantize_rules


def with_fp8(adapter: Adapter | None, *, dequantize: bool = False, quantize: bool = False) -> Adapter | None:
    """``adapter`` with block FP8 around it: dequantized before it (MXFP4 too), quantized after it (``transform.chain.Chain``).

    Args:
        adapter: the model-family adapter, or None.
        dequantize: ``--dequantize``: ``dequantize_rules`` first (once, when ``adapter`` already does).
        quantize: ``--quantize fp8-block128``: ``quantize_rules`` last, on the adapter's outputs.

    Returns:
        The rules to run (``derive.Adapter``), or None when there is neither an adapter nor FP8 to do.
    """
    if dequantize and not dequantizes(adapter):
        adapter = dequantize_rules if adapter is None else Chain(dequantize_rules, adapter)
    if quantize:
        adapter = quantize_rules if adapter is None else Chain(adapter, quantize_rules)
    return adapter
