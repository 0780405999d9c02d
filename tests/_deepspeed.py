"""DeepSpeed 0.19.8 producer: real ZeRO training on CPU (gloo) under torchrun, saved with ``engine.save_checkpoint``.

Two entry points, each run on every rank of ``torchrun --standalone --nproc-per-node N -m tests._deepspeed``:

``train OUT [VARIANT ...]`` (all of ``VARIANTS`` when none is named) trains each variant in turn in the
one launch: a fresh ``TinyLM`` (``torch.manual_seed(SEED)``), ``deepspeed.initialize`` with two param
groups and torch's AdamW, ``STEPS`` steps on each rank's own batches, then
``engine.save_checkpoint(OUT/<variant>, tag=TAG, client_state=CLIENT_STATE)``. Rank 0 writes
``OUT/<variant>/truth.pt`` beside it, taken from the live run (never read back from the files)::

    {"model": {fqn: tensor}          # module.state_dict()'s keys, the tied "emb.weight"/"head.weight" both:
                                     #   trainable params as their full fp32 master, frozen params and
                                     #   buffers as the module holds them (module dtype)
     "module": {fqn: tensor},        # engine.module.state_dict() as the run holds it (ZeRO-3 gathered)
     "optim": {"state": {fqn: {"step": 0-d fp32 tensor, "exp_avg": fp32 full shape, "exp_avg_sq": ...}},
                                     #   every trainable param once, a tied one under param_shapes' name
               "param_groups": [{AdamW's hyper-parameters..., "params": [fqn, ...]}]},  # param_shapes' order
     "global_steps": int, "client": CLIENT_STATE, "stage": int, "dtype": "fp32" | "bf16",
     "optimizer_class": str, "world_size": int}

``load --out results.json --case VARIANT DIR TRUTH [--case ...]`` checks each case in turn in the one
launch: it builds a fresh engine of ``VARIANT`` at this launch's world size, calls plain
``engine.load_checkpoint(DIR)`` (the tag ``latest`` names), compares the loaded live state with
``TRUTH`` (a ``truth.pt``) bit for bit, takes one more training step and destroys the engine. Rank 0
writes a JSON list to ``--out``, one entry per case in order, rewritten after each case (a launch cut
short leaves the cases it finished): ``{"variant": str, "checkpoint": str, "ok": bool, "mismatches":
[str, ...], "error": str | None, "loss": float | None}``. It exits 0 whatever it found (a refused
load is ``ok: false`` with DeepSpeed's message in ``error``); the test asserts on the JSON.

DeepSpeed itself loads only at the world size that saved: ZeRO-1/2 and BF16_Optimizer refuse
another with ``ZeRORuntimeException: The checkpoint being loaded used a DP world size of 2 but the
current world size is 3 ...``; ZeRO-3 fails inside with ``RuntimeError: The size of tensor a (38)
must match the size of tensor b (56) ...``.

DeepSpeed quirks met here (see /work/shared/FRAMEWORKS.md "DeepSpeed"): ``deepspeed.init_distributed
(dist_backend="gloo")``, its inference-only shared-memory op left unbuilt (``main``); ZeRO-3 ranks
may abort at interpreter exit, so both modes end with ``os._exit``. ZeRO-1/2 link each param's
optimizer-state fragment once, right after the optimizer's first ``step()``, which there is the
first param group's step (each group steps alone), before torch's AdamW has made state for the
second group; ``safe_get_full_optimizer_state`` then raises "exp_avg not found" for the second
group's params. ``_relink_optimizer_state`` clears the optimizer's ``_hp_optimizer_states_linked``
flag and calls its own ``_lazy_init_hp_params_optimizer_state`` again once every group has state.
"""

from __future__ import annotations

import argparse
import importlib
import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn

TRUTH = "truth.pt"
TAG = "step2"
STEPS = 2
SEED = 0
CLIENT_STATE = {"mine": 7}
VOCAB = 51
DIM = 16
BATCH = 2
SEQ = 7
LR = 1e-2
BIAS_LR = 2e-2
WEIGHT_DECAY = 0.1

# variant -> (ZeRO stage, "fp32" | "bf16" | "bf16o" (bf16 + fp32 grad accumulation: BF16_Optimizer), zero_optimization extras)
VARIANTS: dict[str, tuple[int, str, dict[str, Any]]] = {
    "z1": (1, "fp32", {}),
    "z2": (2, "fp32", {}),
    "z3": (3, "fp32", {}),
    "z1b": (1, "bf16", {}),
    "z2b": (2, "bf16", {}),
    "z3b": (3, "bf16", {}),
    "bfo": (1, "bf16o", {}),
    "z2a": (2, "bf16", {"parameter_alignment": True}),
    "z3s": (3, "fp32", {"sub_group_size": 300}),
}


class TinyLM(nn.Module):
    """An embedding tied to the head, odd Linear sizes (ZeRO pads them at 3 ranks), a frozen Linear, two buffers.

    ``forward(x)``: ``x`` int64 ``[batch, seq]`` token ids below ``VOCAB``; returns logits ``[batch, seq, VOCAB]``
    in the module's dtype. Buffers: ``scale`` (fp32) and ``positions`` (int64); DeepSpeed's bf16 casts neither.
    """

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, DIM)
        self.l1 = nn.Linear(DIM, 23)
        self.l2 = nn.Linear(23, DIM)
        self.frozen = nn.Linear(DIM, 7)
        self.frozen.requires_grad_(False)
        self.up = nn.Linear(7, DIM)
        self.head = nn.Linear(DIM, VOCAB, bias=False)
        self.head.weight = self.emb.weight
        self.register_buffer("scale", torch.arange(5.0))
        self.register_buffer("positions", torch.arange(SEQ, dtype=torch.int64))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.emb(x)
        h = self.up(self.frozen(torch.relu(self.l2(torch.relu(self.l1(h))))))
        logits: torch.Tensor = self.head(h)
        return logits


def config(variant: str) -> dict[str, Any]:
    """The DeepSpeed config of ``variant``: ZeRO stage and extras, bf16 or not, torch's AdamW (``torch_adam``)."""
    stage, dtype, extra = VARIANTS[variant]
    cfg: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": BATCH,
        "zero_optimization": {"stage": stage, **extra},
        "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": WEIGHT_DECAY, "torch_adam": True}},
    }
    if dtype in ("bf16", "bf16o"):
        cfg["bf16"] = {"enabled": True}
    if dtype == "bf16o":
        cfg["data_types"] = {"grad_accum_dtype": "fp32"}
    return cfg


def build(variant: str, *, scramble: bool = False) -> tuple[Any, Any]:
    """A fresh seeded ``TinyLM`` in ``deepspeed.initialize`` for ``variant``: ``(engine, optimizer)``.

    Two param groups: the trainable weights (``weight_decay`` 0.1) and the biases (no decay, ``lr`` 2e-2).
    ``scramble`` (the load mode): another seed, buffers each plus 1, and other ``lr``/``weight_decay``
    in both groups, so what the training run's truth holds can only come from the checkpoint loaded.
    """
    import deepspeed  # type: ignore[import-untyped,unused-ignore]

    torch.manual_seed(SEED + 1 if scramble else SEED)
    model = TinyLM()
    off = 1 if scramble else 0
    with torch.no_grad():
        for buffer in model.buffers():
            buffer.add_(off)
    trainable = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    groups = [
        {
            "params": [p for n, p in trainable if n.endswith("weight")],
            "weight_decay": WEIGHT_DECAY * (1 + off),
            "lr": LR * (1 + off),
        },
        {"params": [p for n, p in trainable if not n.endswith("weight")], "weight_decay": 0.0 + off, "lr": BIAS_LR * (1 + off)},
    ]
    engine, optimizer, _, _ = deepspeed.initialize(model=model, model_parameters=groups, config=config(variant))
    return engine, optimizer


def train_step(engine: Any, gen: torch.Generator) -> float:
    """One step on a batch of ``gen`` (``[BATCH, SEQ]`` token ids); returns the loss (mean squared logit)."""
    x = torch.randint(0, VOCAB, (BATCH, SEQ), generator=gen)
    loss = engine(x).float().pow(2).mean()
    engine.backward(loss)
    engine.step()
    return float(loss.detach())


def _relink_optimizer_state(optimizer: Any) -> None:
    """Link every param's optimizer-state fragment again (ZeRO-1/2, BF16_Optimizer); ZeRO-3 needs none."""
    if hasattr(optimizer, "_hp_optimizer_states_linked"):
        optimizer._hp_optimizer_states_linked = False
        optimizer._lazy_init_hp_params_optimizer_state()


def _cpu(t: torch.Tensor) -> torch.Tensor:
    return t.detach().to("cpu", copy=True)


def _one_step_count(optimizer: Any) -> torch.Tensor:
    """The ``step`` every flat partition on every rank holds (all the same here), as a 0-d tensor.

    Raises:
        RuntimeError: the ranks' partitions hold different step counts, or none holds one.
    """
    import torch.distributed as dist

    steps = [_cpu(s["step"]) for s in optimizer.optimizer.state.values() if "step" in s]
    every: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(every, steps)
    flat: list[torch.Tensor] = [s for rank_steps in every for s in rank_steps]
    if not flat or any(not torch.equal(s, flat[0]) or s.dtype != flat[0].dtype for s in flat):
        raise RuntimeError(f"step counts differ across partitions: {flat}")
    return flat[0]


def live_state(engine: Any, optimizer: Any, variant: str) -> dict[str, Any]:
    """The run's state now, on every rank (collectives inside: call on all ranks), in the ``truth.pt`` layout."""
    import deepspeed  # type: ignore[import-untyped,unused-ignore]
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state  # type: ignore[import-untyped,unused-ignore]

    _relink_optimizer_state(optimizer)
    module = engine.module
    names = {id(p): n for n, p in module.named_parameters()}  # a tied param under its first name
    by_fqn = dict(module.named_parameters(remove_duplicate=False))
    masters = {names[id(p)]: _cpu(safe_get_full_fp32_param(p)) for p in module.parameters() if p.requires_grad}
    with deepspeed.zero.GatheredParameters(list(module.parameters()), modifier_rank=None):
        module_sd = {fqn: _cpu(t) for fqn, t in module.state_dict().items()}
    model = {}
    for fqn, t in module_sd.items():
        param = by_fqn.get(fqn)
        model[fqn] = masters[names[id(param)]] if param is not None and param.requires_grad else t.clone()

    step = _one_step_count(optimizer)
    param_shapes = engine._get_zero_param_shapes()  # what save_checkpoint stores: per group, fqn -> shape
    by_name = dict(module.named_parameters())
    state = {}
    for group_shapes in param_shapes:
        for fqn in group_shapes:
            p = by_name[fqn]
            state[fqn] = {
                "step": step.clone(),
                "exp_avg": _cpu(safe_get_full_optimizer_state(p, "exp_avg")),
                "exp_avg_sq": _cpu(safe_get_full_optimizer_state(p, "exp_avg_sq")),
            }
    # ZeRO-3 lists one param_shapes entry per sub-group (sub_group_size), each within one param group
    group_of = getattr(optimizer, "sub_group_to_group_id", {i: i for i in range(len(param_shapes))})
    param_groups = [{**{k: v for k, v in g.items() if k != "params"}, "params": []} for g in optimizer.optimizer.param_groups]
    for i, group_shapes in enumerate(param_shapes):
        param_groups[group_of[i]]["params"].extend(group_shapes)
    _, dtype, _ = VARIANTS[variant]
    return {
        "model": model,
        "module": module_sd,
        "optim": {"state": state, "param_groups": param_groups},
        "global_steps": int(engine.global_steps),
        "client": dict(CLIENT_STATE),
        "stage": int(engine.zero_optimization_stage()),
        "dtype": "fp32" if dtype == "fp32" else "bf16",
        "optimizer_class": type(optimizer).__name__,
        "world_size": int(engine.world_size),
    }


def _train(out: Path, variants: list[str]) -> None:
    import torch.distributed as dist

    for variant in variants:
        engine, optimizer = build(variant)
        gen = torch.Generator().manual_seed(1 + engine.global_rank)
        for _ in range(STEPS):
            train_step(engine, gen)
        engine.save_checkpoint(str(out / variant), tag=TAG, client_state=dict(CLIENT_STATE))
        truth = live_state(engine, optimizer, variant)
        if engine.global_rank == 0:
            torch.save(truth, out / variant / TRUTH)
        dist.barrier()
        engine.destroy()


def _differences(path: str, got: Any, want: Any) -> list[str]:
    """Where ``got`` differs from ``want``: tensors bit for bit (dtype, shape, bytes), containers key by key."""
    if isinstance(want, torch.Tensor):
        if not isinstance(got, torch.Tensor):
            return [f"{path}: {type(got).__name__}, want a tensor"]
        if got.dtype != want.dtype or got.shape != want.shape:
            return [f"{path}: {got.dtype} {list(got.shape)}, want {want.dtype} {list(want.shape)}"]
        same = torch.equal(got.reshape(-1).view(torch.uint8), want.reshape(-1).view(torch.uint8))
        return [] if same else [f"{path}: values differ"]
    if isinstance(want, dict):
        if not isinstance(got, dict) or list(got) != list(want):
            return [f"{path}: keys {list(got) if isinstance(got, dict) else type(got).__name__}, want {list(want)}"]
        return [d for k in want for d in _differences(f"{path}.{k}", got[k], want[k])]
    if isinstance(want, (list, tuple)):
        if not isinstance(got, (list, tuple)) or len(got) != len(want):
            return [f"{path}: {got!r}, want {want!r}"]
        return [d for i, (g, w) in enumerate(zip(got, want)) for d in _differences(f"{path}[{i}]", g, w)]
    return [] if got == want else [f"{path}: {got!r}, want {want!r}"]


def _check_case(variant: str, checkpoint: Path, truth_path: Path) -> dict[str, Any]:
    """Load ``checkpoint`` into a fresh engine of ``variant``, compare with ``truth_path``, train a step (every rank).

    Returns the case's result (the same on every rank but ``loss``, which is this rank's); the engine is destroyed.
    """
    import torch.distributed as dist

    truth = torch.load(truth_path, weights_only=True)
    engine, optimizer = build(variant, scramble=True)
    result: dict[str, Any] = {"variant": variant, "checkpoint": str(checkpoint)}
    result.update(ok=False, mismatches=[], error=None, loss=None)
    try:
        _, client = engine.load_checkpoint(str(checkpoint))
    except Exception as e:  # DeepSpeed's refusal is the result
        result["error"] = f"{type(e).__name__}: {e}"
    else:
        got = live_state(engine, optimizer, variant)
        got["client"] = {k: (client or {}).get(k) for k in CLIENT_STATE}
        mismatches = [
            d
            for key in ("model", "module", "optim", "global_steps", "client", "stage", "dtype", "optimizer_class")
            for d in _differences(key, got[key], truth[key])
        ]
        gen = torch.Generator().manual_seed(1000 + engine.global_rank)
        loss = train_step(engine, gen)
        if not math.isfinite(loss):
            mismatches.append(f"loss after one more step is {loss}")
        result.update(ok=not mismatches, mismatches=mismatches, loss=loss)
    dist.barrier()
    engine.destroy()
    return result


def _load(cases: list[tuple[str, Path, Path]], out: Path) -> None:
    """Check each ``(variant, checkpoint, truth)`` in turn; rank 0 rewrites ``out`` (a JSON list) after each."""
    import torch.distributed as dist

    results = []
    for variant, checkpoint, truth_path in cases:
        results.append(_check_case(variant, checkpoint, truth_path))
        if dist.get_rank() == 0:
            out.write_text(json.dumps(results, indent=1))


REPO = Path(__file__).resolve().parent.parent
LOG = "torchrun.log"


def _torchrun(nproc: int, args: list[str], log: Path) -> subprocess.Popen[bytes]:
    """Start ``torchrun --standalone --nproc-per-node nproc -m tests._deepspeed *args``; stdout and stderr into ``log``."""
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc-per-node={nproc}",
        "-m",
        "tests._deepspeed",
        *args,
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    with open(log, "wb") as f:
        return subprocess.Popen(cmd, cwd=REPO, env=env, stdout=f, stderr=subprocess.STDOUT)


def _finish(proc: subprocess.Popen[bytes], log: Path, deadline: float) -> None:
    """Wait for ``proc`` until ``deadline`` (``time.monotonic()``); on a timeout or a failure raise with the log's tail.

    On a timeout torchrun gets SIGTERM (it ends its workers) and, 10 s later, SIGKILL.

    Raises:
        RuntimeError: the launch ran past ``deadline`` or exited non-zero.
    """
    try:
        proc.wait(max(deadline - time.monotonic(), 0.1))
        failure = None if proc.returncode == 0 else f"exited {proc.returncode}"
    except subprocess.TimeoutExpired:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        failure = "timed out"
    if failure is not None:
        tail = log.read_text(errors="replace")[-6000:]
        raise RuntimeError(f"{' '.join(map(str, proc.args))} {failure}; the end of {log}:\n{tail}")  # type: ignore[arg-type]


def train_launches(root: Path, world_sizes: tuple[int, ...] = (2, 3), timeout: float = 240.0) -> dict[int, Path]:
    """Train every variant at each world size, one torchrun launch per world size, all launched at once.

    Returns ``{world_size: root/ws<N>}``; each folder holds ``<variant>/`` (DeepSpeed's checkpoint:
    ``latest``, ``TAG/``, its ``zero_to_fp32.py``; and ``truth.pt``) and ``torchrun.log``.

    Raises:
        RuntimeError: a launch failed or ran past ``timeout`` seconds (the log's tail in the message).
    """
    deadline = time.monotonic() + timeout
    outs = {ws: root / f"ws{ws}" for ws in world_sizes}
    procs = {}
    for ws, out in outs.items():
        out.mkdir(parents=True, exist_ok=True)
        procs[ws] = _torchrun(ws, ["train", str(out)], out / LOG)
    try:
        for ws, proc in procs.items():
            _finish(proc, outs[ws] / LOG, deadline)
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    return outs


Case = tuple[str, Path, Path]
"""A load mode case: ``(variant, checkpoint folder, truth.pt)``."""


def _case_args(cases: list[Case]) -> list[str]:
    return [a for variant, checkpoint, truth in cases for a in ("--case", variant, str(checkpoint), str(truth))]


def load_launches(root: Path, cases: dict[int, list[Case]], timeout: float = 180.0) -> dict[int, list[dict[str, Any]]]:
    """Run the ``load`` mode once per world size, all launched at once; each checks its cases in turn.

    ``cases`` maps a world size to its ``(variant, checkpoint, truth.pt)`` cases. Returns ``{world_size:
    [result, ...]}``, one result per case in order (the ``load`` mode's JSON entry). Each launch writes
    ``root/load_ws<N>.json`` and its log ``root/load_ws<N>.log``.

    Raises:
        RuntimeError: a launch failed or ran past ``timeout`` seconds (the log's tail in the message).
    """
    deadline = time.monotonic() + timeout
    root.mkdir(parents=True, exist_ok=True)
    outs = {ws: root / f"load_ws{ws}.json" for ws in cases}
    procs = {
        ws: _torchrun(ws, ["load", "--out", str(outs[ws]), *_case_args(cases[ws])], outs[ws].with_suffix(".log")) for ws in cases
    }
    try:
        for ws, proc in procs.items():
            _finish(proc, outs[ws].with_suffix(".log"), deadline)
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    results: dict[int, list[dict[str, Any]]] = {}
    for ws, out in outs.items():
        results[ws] = json.loads(out.read_text())
        if len(results[ws]) != len(cases[ws]):
            raise RuntimeError(f"{out} holds {len(results[ws])} results for {len(cases[ws])} cases")
    return results


def load_launch(
    variant: str, checkpoint: Path, truth: Path, out: Path, *, world_size: int, timeout: float = 120.0
) -> dict[str, Any]:
    """Run the ``load`` mode at ``world_size`` ranks on one case; its result (the JSON list's one entry).

    The result: ``{"variant", "checkpoint", "ok": bool, "mismatches": [str, ...], "error": str | None,
    "loss": float | None}``; the JSON list is written to ``out``, the launch's log is ``out`` with the suffix ``.log``.

    Raises:
        RuntimeError: the launch failed or ran past ``timeout`` seconds.
    """
    log = out.with_suffix(".log")
    args = ["load", "--out", str(out), *_case_args([(variant, checkpoint, truth)])]
    _finish(_torchrun(world_size, args, log), log, time.monotonic() + timeout)
    results: list[dict[str, Any]] = json.loads(out.read_text())
    return results[0]


def main(argv: list[str] | None = None) -> None:
    """``train OUT [VARIANT ...]`` or ``load --out JSON --case VARIANT DIR TRUTH ...``; ends with ``os._exit(0)``."""
    parser = argparse.ArgumentParser(prog="python -m tests._deepspeed")
    sub = parser.add_subparsers(dest="mode", required=True)
    train = sub.add_parser("train")
    train.add_argument("out", type=Path)
    train.add_argument("variants", nargs="*", metavar="VARIANT", help=f"of {', '.join(VARIANTS)} (default: all)")
    load = sub.add_parser("load")
    load.add_argument("--out", type=Path, required=True)
    load.add_argument(
        "--case",
        nargs=3,
        action="append",
        required=True,
        metavar=("VARIANT", "DIR", "TRUTH"),
        help="repeatable; checked in order",
    )
    args = parser.parse_args(argv)
    named = args.variants if args.mode == "train" else [variant for variant, _, _ in args.case]
    if not set(named) <= set(VARIANTS):
        parser.error(f"unknown variants {sorted(set(named) - set(VARIANTS))}; known: {', '.join(VARIANTS)}")

    import deepspeed  # type: ignore[import-untyped,unused-ignore]

    # The CPU backend JIT-builds a shared-memory op with g++ (about 60 s on a fresh 2-core box) that
    # only inference_all_reduce uses; training, saving and loading never call it. (The module is
    # imported by its name: the attribute deepspeed.comm.torch is torch, imported over it.)
    ds_torch_backend = importlib.import_module("deepspeed.comm.torch")
    ds_torch_backend.build_shm_op = lambda: None  # type: ignore[attr-defined]
    deepspeed.init_distributed(dist_backend="gloo")
    if args.mode == "train":
        _train(args.out, args.variants or list(VARIANTS))
    else:
        _load([(variant, Path(checkpoint), Path(truth)) for variant, checkpoint, truth in args.case], args.out)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # ZeRO-3 ranks may abort in interpreter teardown


if __name__ == "__main__":
    main()
