"""The MoE row of scripts/bench.py: plain ``consolidate`` to a Hugging Face folder vs the same with the qwen3 adapter.

Writes (once, cached in the bench cache) a DCP checkpoint of about --moe-mb MB: stacked expert
weights as torchtitan's Qwen 3 MoE holds them (``w1_EFD`` / ``w3_EFD`` of shape ``(E, F, D)``,
``w2_EDF`` of ``(E, D, F)``, fp32) in as many layers as the size takes, saved by ``dcp.save``.
Then alternates, --rounds times (the order flipped every round, input pages dropped before each
run), ``consolidate`` to a folder and ``consolidate --adapter torchtitan-qwen3-to-hf`` to a folder
(every expert weight split into one tensor per expert), and prints their median walls and the
ratio adapter / plain.

    python scripts/bench.py --moe-mb 200 --rounds 3                          # 128 experts of (64, 128)
    python scripts/bench.py --moe-mb 200 --rounds 3 --moe-shape 16,512,512  # 16 experts of (512, 512)
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
from pathlib import Path

from _bench_measure import drop_cache, run_measured

MiB = 2**20


def make_moe_checkpoint(size_mb: int, shape: tuple[int, int, int], cache: Path) -> Path:
    """The synthetic MoE checkpoint of about ``size_mb`` MB, experts ``shape`` (E, F, D), cached, with its ``config.json``."""
    import torch
    import torch.distributed.checkpoint as dcp

    EXPERTS, FFN, DIM = shape  # noqa: N806
    layers = max(1, round(size_mb * 1e6 / (3 * EXPERTS * FFN * DIM * 4)))
    ck = cache / f"moe-e{EXPERTS}-f{FFN}-d{DIM}-l{layers}" / "checkpoint"
    if (ck / ".metadata").exists():
        return ck
    print(f"writing a synthetic MoE checkpoint ({layers} layers of {EXPERTS} experts) to {ck}", file=sys.stderr)
    gen = torch.Generator().manual_seed(0)
    experts = "layers.{}.moe.routed_experts.inner_experts."
    state = {"norm.weight": torch.randn(DIM, generator=gen)}
    for n in range(layers):
        for name, shape in (("w1_EFD", (EXPERTS, FFN, DIM)), ("w2_EDF", (EXPERTS, DIM, FFN)), ("w3_EFD", (EXPERTS, FFN, DIM))):
            state[experts.format(n) + name] = torch.randn(*shape, generator=gen)
    dcp.save(state, checkpoint_id=ck, no_dist=True)
    (ck.parent / "config.json").write_text(json.dumps({"tie_word_embeddings": False}))
    return ck


def bench_moe(args: argparse.Namespace) -> None:
    """Run the two systems --rounds times, alternating; print the row and write it as JSON."""
    shape = tuple(int(n) for n in args.moe_shape.split(","))
    assert len(shape) == 3, "--moe-shape: E,F,D"
    ck = make_moe_checkpoint(args.moe_mb, shape, args.cache)  # type: ignore[arg-type]
    data_files = sorted(ck.glob("*.distcp"))
    work = args.cache / "out-moe"
    fc = [sys.executable, "-m", "fsdp_convert", "consolidate", str(ck)]
    adapter = ["--adapter", "torchtitan-qwen3-to-hf", "--model-config", str(ck.parent / "config.json")]
    systems = {
        "plain": [*fc, str(work / "plain"), "--quiet", "--nproc", str(args.moe_nproc)],
        "adapter": [*fc, str(work / "adapter"), "--quiet", "--nproc", str(args.moe_nproc), *adapter],
    }
    walls: dict[str, list[float]] = {name: [] for name in systems}
    for r in range(args.rounds):
        for name in list(systems)[:: 1 if r % 2 == 0 else -1]:
            if work.exists():
                shutil.rmtree(work)
            work.mkdir(parents=True)
            drop_cache(data_files)
            run = run_measured(systems[name])
            if run.returncode != 0:
                raise SystemExit(f"{name} failed (rc {run.returncode}): {run.stderr_tail}")
            walls[name].append(run.wall_s)
            print(f"round {r + 1} {name}: {run.wall_s:.2f} s, peak RSS {run.peak_rss_bytes / MiB:.0f} MiB", file=sys.stderr)
    plain, split = (statistics.median(walls[name]) for name in systems)
    size = sum(p.stat().st_size for p in data_files) / 1e6
    rounds = f"--nproc {args.moe_nproc}, median of {args.rounds} alternating rounds"
    print(f"\nMoE expert split, {size:.0f} MB, experts (E, F, D) {shape} fp32, {rounds}\n")
    print("| plain consolidate s | --adapter torchtitan-qwen3-to-hf s | ratio adapter / plain |")
    print("|---:|---:|---:|")
    print(f"| {plain:.2f} | {split:.2f} | {split / plain:.2f} |")
    json_out = args.json_out or args.cache / "bench-moe.json"
    json_out.write_text(json.dumps({"rounds": args.rounds, "mb": size, "walls": walls, "ratio": split / plain}, indent=2) + "\n")
    print(f"JSON: {json_out}")
