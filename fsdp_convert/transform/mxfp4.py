"""Transform stage, MXFP4: gpt-oss's experts as FP4 nibbles (``*_blocks``) and E8M0 exponents (``*_scales``), dequantized.

gpt-oss as OpenAI released it (``config.json``'s ``quantization_config`` ``{"quant_method":
"mxfp4", ...}``) holds each expert weight ``<name>`` as two uint8 tensors: ``<name>_blocks`` of
shape ``(*prefix, G, B)``, ``G`` groups of ``B`` bytes per row (``B`` = 16: 32 FP4 E2M1 values a
group, two a byte, the low nibble first), and ``<name>_scales`` of shape ``(*prefix, G)``, one E8M0
exponent per group, biased by 127. Value ``2 * j + h`` of group ``g`` (``h`` 0: byte ``j``'s low
nibble, 1: its high one) is ``FP4_VALUES[nibble] * 2 ** (scale - 127)``, and the dequantized
tensor is ``(*prefix, G * 2 * B)``: gpt-oss's ``gate_up_proj_blocks`` ``(E, 2F, D // 32, 16)``
becomes ``(E, 2F, D)``, torchtitan's ``mlp1_weight_EGD``; ``down_proj_blocks`` ``(E, D, F // 32,
16)`` becomes ``(E, D, F)``, its ``mlp2_weight_EDF``.

That is torch's ``QuantizedHuggingFaceStorageReader._dequantize_tensor_mxfp4`` (which keeps the
``*_blocks`` FQN, as here, and torchtitan's ``from_hf`` reads it so) and transformers'
``convert_moe_packed_tensors`` (which gives each expert transposed, ``(E, G * 2 * B, rows)``, under
the name without ``_blocks``), computed as both compute it: the FP4 value looked up as float32, then
``torch.ldexp`` by ``scale - 127``, the same call, so the three agree bit for bit wherever torch's
``ldexp`` rounds or overflows. Every finite value is exact in float32 and in bfloat16 (two
significant bits, exponents from -128 up), so ``--dtype bf16`` of the float32 result is torch's
reader's bfloat16 target too; E8M0 scales 253, 254 and 255 (E8M0's NaN) send values of magnitude at
least 4, 2 and 1 to ±inf (torch 2.13's ``ldexp`` keeps ``0.5 * 2 ** 128`` finite, and zeros zero:
no NaN). ``dequantize_rule`` makes one pair a ``derive.Derived``, float32, built by dim-0 rows:
expert by expert (the mover reads a stored tensor by whole dim-0 rows, so finer blocks would read
each expert again). ``transform.fp8.dequantize_rules`` (``--dequantize``) applies it to every pair.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import TYPE_CHECKING

from fsdp_convert.derive import Derived, Input, TensorInfo
from fsdp_convert.dtypes import DType
from fsdp_convert.errors import UnsupportedTransformError

if TYPE_CHECKING:
    import torch

__all__ = [
    "BLOCKS_SUFFIX",
    "SCALES_SUFFIX",
    "E8M0_BIAS",
    "FP4_VALUES",
    "mxfp4_pairs",
    "dequantized_shape",
    "dequantize_groups",
    "dequantize_rule",
]

BLOCKS_SUFFIX = "_blocks"
"""An MXFP4 tensor ``<name>``'s nibbles are ``<name>_blocks``; its dequantized value keeps that FQN (torch's reader's)."""

SCALES_SUFFIX = "_scales"
"""... and its E8M0 exponents ``<name>_scales``."""

E8M0_BIAS = 127
"""An E8M0 scale ``s`` is the factor ``2 ** (s - 127)``."""

FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
"""FP4 E2M1 by nibble (sign bit 3), as torch's reader and transformers list them."""

_UINT8 = DType("uint8")


def mxfp4_pairs(tensors: Sequence[TensorInfo]) -> dict[str, str]:
    """The MXFP4 tensors: each uint8 ``<name>_blocks`` with a uint8 ``<name>_scales`` beside it, to that scales FQN, in order."""
    dtypes = {t.fqn: t.dtype for t in tensors}
    pairs = {}
    for t in tensors:
        scales = t.fqn.removesuffix(BLOCKS_SUFFIX) + SCALES_SUFFIX
        if t.fqn.endswith(BLOCKS_SUFFIX) and t.dtype == _UINT8 and dtypes.get(scales) == _UINT8:
            pairs[t.fqn] = scales
    return pairs


def dequantized_shape(blocks_shape: tuple[int, ...]) -> tuple[int, ...]:
    """``(*prefix, G, B)`` nibble bytes to the ``(*prefix, G * 2 * B)`` values they hold."""
    *prefix, groups, nbytes = blocks_shape
    return (*prefix, groups * 2 * nbytes)


@functools.cache
def _value_pairs() -> torch.Tensor:
    """Float32 ``(256, 2)``: a byte's two FP4 values, its low nibble's first."""
    import torch

    return torch.tensor([(FP4_VALUES[b & 0x0F], FP4_VALUES[b >> 4]) for b in range(256)], dtype=torch.float32)


def dequantize_groups(parts: Sequence[torch.Tensor]) -> torch.Tensor:
    """``combine`` of a dequantized MXFP4 tensor: rows of nibbles ``(n, *rest, G, B)`` and of scales ``(n, *rest, G)``, uint8.

    Returns:
        Float32 ``(n, *rest, G * 2 * B)``: each byte's low then high nibble's FP4 value,
        ``torch.ldexp`` by its group's ``scale - 127``, as torch's reader and transformers compute
        them. Memory: the result and a 2-byte index per value.
    """
    import torch

    blocks, scales = parts
    *rows, groups, nbytes = blocks.shape
    values = torch.index_select(_value_pairs(), 0, blocks.reshape(-1).to(torch.int32))  # (numel, 2): new memory
    out = values.view(*rows, groups, 2 * nbytes)
    exponents = scales.to(torch.int32) - E8M0_BIAS
    torch.ldexp(out, exponents.unsqueeze(-1), out=out)
    return out.view(*rows, groups * 2 * nbytes)


def dequantize_rule(blocks: TensorInfo, scales: TensorInfo) -> Derived:
    """The dequantized ``blocks``: float32 ``(*prefix, G * 2 * B)``, read with its ``scales`` row by row.

    Args:
        blocks: ``<name>_blocks``, uint8 ``(*prefix, G, B)``, at least one prefix dim.
        scales: ``<name>_scales``, uint8 ``(*prefix, G)``.

    Returns:
        The rule (``dequantize_groups``), built by dim-0 rows (experts, for gpt-oss): a block holds
        at least one, its float32 ``prod(prefix[1:]) * G * 2 * B * 4`` bytes (gpt-oss-120b's
        ``gate_up_proj``: 63 MiB) and its nibbles and scales.

    Raises:
        UnsupportedTransformError: ``blocks`` has fewer than 3 dims, or ``scales`` is not its shape
            without the last dim (names both).
    """
    if len(blocks.shape) < 3 or scales.shape != blocks.shape[:-1]:
        raise UnsupportedTransformError(
            f"{blocks.fqn}: MXFP4 needs nibbles of shape (*prefix, groups, bytes) and {scales.fqn} of shape "
            f"(*prefix, groups); got {blocks.shape} and {scales.shape}"
        )
    inputs = (Input(fqn=blocks.fqn), Input(fqn=scales.fqn))
    return Derived(inputs=inputs, shape=dequantized_shape(blocks.shape), dtype=DType("float32"), combine=dequantize_groups)
