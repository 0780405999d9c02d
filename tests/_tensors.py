"""Small hand-made tensors for unit tests: every dtype the writers handle, filled with seeded random bits."""

from __future__ import annotations

import torch

DTYPES = [
    torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64, torch.int32, torch.int16, torch.int8,
    torch.uint8, torch.bool, torch.float8_e4m3fn, torch.float8_e5m2, torch.uint16, torch.complex64,
]  # fmt: skip


def _tensor(dtype: torch.dtype, shape: tuple[int, ...], seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    raw = torch.randint(0, 256, (max(1, torch.Size(shape).numel()) * dtype.itemsize,), dtype=torch.uint8, generator=g)
    t = raw.view(dtype)[: torch.Size(shape).numel()].reshape(shape)
    return t.to(torch.bool) if dtype == torch.bool else t
