"""Sample producer: real FSDP2 training that writes a DCP checkpoint and its ground truth.

Used by the README demo (under torchrun), the tests (forked ranks) and the benchmarks. Not part of
the conversion pipeline; it only imports torch.

Run under torchrun::

    python -m torch.distributed.run --standalone --nproc-per-node=3 \
        -m fsdp_convert._sample --out /tmp/sample
"""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    get_state_dict,
)
from torch.distributed.checkpoint.state_dict_saver import save as dcp_save
from torch.distributed.fsdp import fully_shard

from fsdp_convert.signals import exit_process

CHECKPOINT_DIRNAME = "checkpoint"
TRUTH_FILENAME = "truth.pt"


@dataclass(frozen=True, slots=True, kw_only=True)
class SampleConfig:
    """Shape of the sample model and its training run.

    ``vocab_size`` is prime by default so no world size above 1 divides it; ``logit_scale`` has
    shape ``(1,)``, so its dim 0 is smaller than any world size above 1.
    """

    vocab_size: int = 101
    dim: int = 16
    n_layers: int = 2
    n_heads: int = 2
    seq_len: int = 8
    batch_size: int = 2
    steps: int = 3
    dtype: torch.dtype = torch.float32
    seed: int = 0


class Attention(nn.Module):
    def __init__(self, dim: int, n_heads: int) -> None:
        super().__init__()
        self.n_heads = n_heads
        self.wq = nn.Linear(dim, dim, bias=False)
        self.wk = nn.Linear(dim, dim, bias=False)
        self.wv = nn.Linear(dim, dim, bias=False)
        self.wo = nn.Linear(dim, dim, bias=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, d = x.shape
        q, k, v = (w(x).view(b, s, self.n_heads, -1).transpose(1, 2) for w in (self.wq, self.wk, self.wv))
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.wo(out.transpose(1, 2).reshape(b, s, d))


class Block(nn.Module):
    def __init__(self, dim: int, n_heads: int) -> None:
        super().__init__()
        self.attn_norm = nn.LayerNorm(dim)
        self.attn = Attention(dim, n_heads)
        self.mlp_norm = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x))
        return x + self.mlp(self.mlp_norm(x))


class Transformer(nn.Module):
    """Embedding, ``n_layers`` pre-norm blocks (attention + MLP), final norm, output head."""

    def __init__(self, cfg: SampleConfig) -> None:
        super().__init__()
        self.tok_embeddings = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.layers = nn.ModuleList(Block(cfg.dim, cfg.n_heads) for _ in range(cfg.n_layers))
        self.norm = nn.LayerNorm(cfg.dim)
        self.output = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
        self.logit_scale = nn.Parameter(torch.ones(1))

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.tok_embeddings(tokens)
        for layer in self.layers:
            x = layer(x)
        return self.output(self.norm(x)) * self.logit_scale


def odd_nan(dtype: torch.dtype) -> torch.Tensor:
    """A 0-dim NaN of ``dtype`` that is not torch's own NaN: sign bit and lowest payload bit set.

    A conversion that canonicalizes NaNs (or turns them into numbers) changes its bytes.
    """
    int_dtype = {2: torch.int16, 4: torch.int32, 8: torch.int64}[dtype.itemsize]
    bits = torch.full((1,), float("nan"), dtype=dtype).view(int_dtype)
    bits |= 1
    bits |= torch.iinfo(int_dtype).min
    return bits.view(dtype)[0]


def plant_special_values(model: Transformer, optim: torch.optim.Optimizer, rank: int, world_size: int) -> None:
    """Put values only a bitwise copy keeps into the last embedding row, on the rank whose shard holds it.

    ``tok_embeddings.weight[-1]``: a NaN (``odd_nan``) at column 0 and -0.0 at column 1; its AdamW
    ``exp_avg`` -0.0 at column 0 and ``exp_avg_sq`` a NaN at column 1. The last token's row is read by
    no forward pass unless that token is an input, so a model loaded from the checkpoint still trains
    on other tokens with finite losses.
    """
    weight = model.tok_embeddings.weight
    rows = weight.shape[0]
    per_rank = -(-rows // world_size)  # FSDP2's Shard(0): torch.chunk sizes
    start = rank * per_rank
    row = rows - 1
    with torch.no_grad():
        for tensor, column, value in (
            (weight, 0, odd_nan(weight.dtype)),
            (weight, 1, torch.tensor(-0.0, dtype=weight.dtype)),
            (optim.state[weight]["exp_avg"], 0, torch.tensor(-0.0, dtype=weight.dtype)),
            (optim.state[weight]["exp_avg_sq"], 1, odd_nan(weight.dtype)),
        ):
            local = tensor.to_local() if hasattr(tensor, "to_local") else tensor
            if start <= row < start + local.shape[0]:
                local[row - start, column] = value


def train_and_save(
    rank: int, world_size: int, out_dir: str | os.PathLike[str], cfg: SampleConfig, write_truth: bool = True
) -> None:
    """Train ``cfg.steps`` AdamW steps with FSDP2 and save DCP plus full ground truth.

    Called on every rank of an initialised process group (gloo, CPU). Writes
    ``out_dir/checkpoint`` with ``dcp.save({"model", "optim", "train_state"})`` and, on rank 0,
    ``out_dir/truth.pt``: the same nested state dict with full tensors, taken with
    ``get_model_state_dict`` / ``get_optimizer_state_dict(full_state_dict=True, cpu_offload=True)``
    (skipped when ``write_truth`` is false, as the benchmark does for large checkpoints). After
    training, a NaN and a -0.0 are planted in the weights and the optimizer state
    (``plant_special_values``), so both go through the checkpoint and the truth holds them.
    """
    torch.manual_seed(cfg.seed)
    model = Transformer(cfg).to(cfg.dtype)
    for layer in model.layers:
        fully_shard(layer)
    fully_shard(model)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    gen = torch.Generator().manual_seed(cfg.seed + 1 + rank)
    for _ in range(cfg.steps):
        tokens = torch.randint(0, cfg.vocab_size, (cfg.batch_size, cfg.seq_len + 1), generator=gen)
        logits = model(tokens[:, :-1])
        loss = F.cross_entropy(logits.float().reshape(-1, cfg.vocab_size), tokens[:, 1:].reshape(-1))
        loss.backward()
        optim.step()
        optim.zero_grad()

    plant_special_values(model, optim, rank, world_size)
    train_state = {"step": cfg.steps, "world_size": world_size}
    model_sd, optim_sd = get_state_dict(model, optim)
    out = Path(out_dir)
    dcp_save({"model": model_sd, "optim": optim_sd, "train_state": train_state}, checkpoint_id=out / CHECKPOINT_DIRNAME)

    if not write_truth:
        dist.barrier()
        return
    full = StateDictOptions(full_state_dict=True, cpu_offload=True)
    full_model = get_model_state_dict(model, options=full)
    full_optim = get_optimizer_state_dict(model, optim, options=full)
    if rank == 0:
        torch.save({"model": full_model, "optim": full_optim, "train_state": train_state}, out / TRUTH_FILENAME)
    dist.barrier()


def main() -> None:
    defaults = SampleConfig()
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="folder for checkpoint/ and truth.pt")
    parser.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32")
    parser.add_argument("--dim", type=int, default=defaults.dim)
    parser.add_argument("--n-layers", type=int, default=defaults.n_layers)
    parser.add_argument("--vocab-size", type=int, default=defaults.vocab_size)
    parser.add_argument("--steps", type=int, default=defaults.steps)
    parser.add_argument("--no-truth", action="store_true", help="skip writing truth.pt")
    args = parser.parse_args()
    cfg = SampleConfig(
        dim=args.dim,
        n_layers=args.n_layers,
        vocab_size=args.vocab_size,
        steps=args.steps,
        dtype=torch.bfloat16 if args.dtype == "bf16" else torch.float32,
    )
    dist.init_process_group("gloo")
    try:
        train_and_save(dist.get_rank(), dist.get_world_size(), args.out, cfg, write_truth=not args.no_truth)
    finally:
        dist.destroy_process_group()
    exit_process(0)  # no C++ teardown after the group is gone: it can abort a finished run


if __name__ == "__main__":
    main()
