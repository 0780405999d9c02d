"""A real 2-rank DCP checkpoint holding every dtype torch and safetensors share, with adversarial bytes.

``save_dtypes`` runs on each forked gloo rank (``tests._dist.run_ranks``): every rank builds the
same full tensors (``dtype_state``, seeded), distributes each as a DTensor on a 1-D CPU mesh
(``Shard(0)``; a 0-dim one ``Replicate()``), and ``dcp.save`` writes them with the default
``FileSystemWriter``. Rank 0 also ``torch.save``s the full tensors: the ground truth.

Per dtype the tensors are ``<dtype>.odd`` (7, 5: 7 rows do not split evenly over 2 or 3 ranks),
``<dtype>.row`` (1, 3: one rank's shard is empty), ``<dtype>.scalar`` (0-dim) and ``<dtype>.empty``
(0, 3). Their bytes are random bits (``torch.randint(...).view(dtype)``), and the first elements
are planted: for floats a NaN with sign and every payload bit set (all bytes 0xFF), the sign bit
alone (-0.0 where the format has it), NaN, -inf, +inf and -0.0 as torch casts them from float32,
and a signalling NaN with payload 1 for the IEEE formats; for integers -1/max and min. Only such
bits survive a copy that goes through values instead of bytes.
"""

from __future__ import annotations

import math
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    get_state_dict,
)
from torch.distributed.checkpoint.state_dict_saver import save as dcp_save
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

FLOAT4 = getattr(torch, "float4_e2m1fn_x2", None)  # torch >= 2.8

# every dtype torch can store in a checkpoint and safetensors names (and complex128/complex32,
# which safetensors cannot hold), by the name used in the FQNs
DTYPES: dict[str, torch.dtype] = {
    str(dtype).removeprefix("torch."): dtype
    for dtype in (
        torch.float64, torch.float32, torch.float16, torch.bfloat16,
        torch.float8_e4m3fn, torch.float8_e5m2, torch.float8_e4m3fnuz, torch.float8_e5m2fnuz, torch.float8_e8m0fnu,
        *([FLOAT4] if FLOAT4 is not None else []),
        torch.complex128, torch.complex64, torch.complex32,
        torch.int64, torch.int32, torch.int16, torch.int8,
        torch.uint64, torch.uint32, torch.uint16, torch.uint8, torch.bool,
    )
}  # fmt: skip

SHAPES: dict[str, tuple[int, ...]] = {"odd": (7, 5), "row": (1, 3), "scalar": (), "empty": (0, 3)}

# a signalling NaN with payload 1 (exponent all ones, lowest mantissa bit), little-endian
_SNAN: dict[torch.dtype, bytes] = {
    torch.float16: (0x7C01).to_bytes(2, "little"),
    torch.bfloat16: (0x7F81).to_bytes(2, "little"),
    torch.float32: (0x7F800001).to_bytes(4, "little"),
    torch.float64: (0x7FF0000000000001).to_bytes(8, "little"),
}
_COMPONENT = {torch.complex128: torch.float64, torch.complex64: torch.float32, torch.complex32: torch.float16}


def fqn(name: str, shape_name: str) -> str:
    """The FQN of a tensor below ``model`` (``float8_e4m3fn.odd``)."""
    return f"{name}.{shape_name}"


def _specials(dtype: torch.dtype) -> list[bytes]:
    """Bit patterns, one element each, to plant at the start of a tensor of ``dtype``."""
    size = dtype.itemsize
    if dtype in _COMPONENT:  # pairs of the component's specials: (re, im)
        parts = _specials(_COMPONENT[dtype])
        return [a + b for a, b in zip(parts, parts[1:] + parts[:1], strict=True)]
    if dtype == torch.bool:
        return []
    ones, sign = b"\xff" * size, b"\x00" * (size - 1) + b"\x80"
    if not dtype.is_floating_point:
        return [ones, sign]  # -1 (or the max), the min (or 2**(bits-1))
    out = [ones, sign]
    if dtype != FLOAT4:  # float4_e2m1fn_x2 has no casts on CPU (and no NaN or inf)
        cast = torch.tensor([math.nan, -math.inf, math.inf, -0.0]).to(dtype)
        out += [bytes(cast[i : i + 1].view(torch.uint8).tolist()) for i in range(4)]
    if dtype in _SNAN:
        out.append(_SNAN[dtype])
    return out


def adversarial(dtype: torch.dtype, shape: tuple[int, ...], seed: int) -> torch.Tensor:
    """A contiguous tensor of ``dtype`` and ``shape`` of random bits, its first elements planted (see module)."""
    numel = math.prod(shape)
    g = torch.Generator().manual_seed(seed)
    if dtype == torch.bool:  # a bool byte other than 0 or 1 is not a bool
        return torch.randint(0, 2, shape, generator=g, dtype=torch.uint8).to(torch.bool)
    raw = torch.randint(0, 256, (max(numel, 1) * dtype.itemsize,), dtype=torch.uint8, generator=g)
    for i, pattern in enumerate(_specials(dtype)[:numel]):
        raw[i * dtype.itemsize : (i + 1) * dtype.itemsize] = torch.tensor(list(pattern), dtype=torch.uint8)
    with warnings.catch_warnings():  # complex32: "ComplexHalf support is experimental"
        warnings.simplefilter("ignore", UserWarning)
        return raw.view(dtype)[:numel].reshape(shape).clone()


def dtype_state() -> dict[str, dict[str, torch.Tensor]]:
    """The full tensors: ``{"model": {"<dtype>.<shape>": tensor}}``, the same on every call."""
    model: dict[str, torch.Tensor] = {}
    for i, (name, dtype) in enumerate(DTYPES.items()):
        for j, (shape_name, shape) in enumerate(SHAPES.items()):
            model[fqn(name, shape_name)] = adversarial(dtype, shape, seed=1000 + 10 * i + j)
    return {"model": model}


def distribute(t: torch.Tensor, mesh: DeviceMesh) -> DTensor:
    """``t`` as a DTensor, ``Shard(0)`` (0-dim: ``Replicate()``), each rank taking its shard locally.

    Every rank holds the same full tensors, so no data is sent (``src_data_rank=None``; gloo has
    no scatter for float8 or uint16+). DTensor pads empty shards with ``new_zeros``, which float4
    lacks on CPU: that one is distributed as its bytes (same dim 0) and viewed back.
    """
    if t.dim() == 0:
        return distribute_tensor(t, mesh, [Replicate()], src_data_rank=None)
    if t.dtype != FLOAT4:
        return distribute_tensor(t, mesh, [Shard(0)], src_data_rank=None)
    local = distribute_tensor(t.view(torch.uint8), mesh, [Shard(0)], src_data_rank=None).to_local()
    return DTensor.from_local(local.view(t.dtype), mesh, [Shard(0)], shape=t.shape, stride=t.stride())


class BufferModel(nn.Module):
    """Two linear layers (7 rows: uneven over 2 or 3 ranks) and buffers in dtypes FSDP2 leaves alone.

    A float8 scale, float8_e8m0fnu block scales (as MX formats keep them), uint16 token ids, a
    bool mask and a complex64 phase: FSDP2 shards parameters only, so buffers are saved whole.
    """

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(6, 7)
        self.out = nn.Linear(7, 3)
        self.register_buffer("fp8_scale", adversarial(torch.float8_e4m3fn, (5,), seed=1))
        self.register_buffer("mx_scales", adversarial(torch.float8_e8m0fnu, (7, 2), seed=2))
        self.register_buffer("token_ids", adversarial(torch.uint16, (9,), seed=3))
        self.register_buffer("mask", adversarial(torch.bool, (4,), seed=4))
        self.register_buffer("phase", adversarial(torch.complex64, (3,), seed=5))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(torch.relu(self.inp(x)))  # type: ignore[no-any-return]


def save_fsdp2_buffers(out: Path) -> None:
    """One rank of an FSDP2 run of ``BufferModel``: one AdamW step, then ``dcp.save`` of
    ``{"model", "optim"}`` to ``out/fsdp2`` and, on rank 0, the full state dicts to ``out/fsdp2_truth.pt``."""
    torch.manual_seed(0)
    model = BufferModel()
    fully_shard(model)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model(torch.randn(4, 6, generator=torch.Generator().manual_seed(1))).square().sum().backward()
    optim.step()
    optim.zero_grad()
    model_sd, optim_sd = get_state_dict(model, optim)
    dcp_save({"model": model_sd, "optim": optim_sd}, checkpoint_id=out / "fsdp2")
    full = StateDictOptions(full_state_dict=True, cpu_offload=True)
    truth = {"model": get_model_state_dict(model, options=full), "optim": get_optimizer_state_dict(model, optim, options=full)}
    if dist.get_rank() == 0:
        torch.save(truth, out / "fsdp2_truth.pt")


def save_dtypes(rank: int, world_size: int, out: Path) -> None:
    """One rank of the save: ``out/checkpoint`` (DCP, DTensors) and, on rank 0, ``out/truth.pt``;
    then ``save_fsdp2_buffers``."""
    mesh = init_device_mesh("cpu", (world_size,))
    state = dtype_state()
    sharded = {key: distribute(t, mesh) for key, t in state["model"].items()}
    dcp_save({"model": sharded}, checkpoint_id=out / "checkpoint")
    if rank == 0:
        torch.save(state, out / "truth.pt")
    save_fsdp2_buffers(out)
