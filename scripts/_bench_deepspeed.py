"""The DeepSpeed row of scripts/bench.py: consolidate of a real ZeRO-3 save against DeepSpeed's own zero_to_fp32.

Writes (once, cached in the bench cache) a DeepSpeed 0.19.8 ZeRO-3 fp32 save at 4 ranks whose files
total about --deepspeed-gb GB: as many pairs (``pairs_for``) of ``Linear(D_IN, D_HID)`` + ``Linear(D_HID, D_IN)``
(odd sizes, so ZeRO-3 pads every partition), two param groups (weights with weight decay, biases
without, another lr), torch's AdamW, ``STEPS`` steps on a tiny batch, under
``torchrun --standalone --nproc-per-node 4`` on gloo (this file's ``train`` mode). The save holds
the fp32 masters (``fp32_flat_groups``) and AdamW's ``exp_avg`` / ``exp_avg_sq``: 12 bytes per
parameter, split over 4 ``zero_pp_rank_<r>_mp_rank_00_optim_states.pt`` files.

Then alternates, --rounds times in rotating order, each system its own process with every file of
the save dropped from the page cache first (``drop_cache``) and the output folder emptied:

  zero_to_fp32            ``python DIR/zero_to_fp32.py DIR OUT_DIR``, the script DeepSpeed copies into
                          the save: ``pytorch_model.bin`` (torch.save of the fp32 model)
  fc-bin / fc-bin-n1      ``fsdp-convert consolidate DIR model.bin --only model`` (default workers /
                          ``--nproc 1``): the same kind of file
  zero_to_fp32-st         the same script with ``--safe_serialization``: ``model.safetensors``
  fc-st / fc-st-n1        ``fsdp-convert consolidate DIR model.safetensors --only model``
  fc-all                  ``fsdp-convert consolidate DIR full.pt``: model and optimizer state, which
                          zero_to_fp32 cannot write (for information)

Each row records the wall time, the peak RSS and PSS of the process tree (``run_measured``) and the
largest peak RSS of any one process of the tree (GNU time's ``%M``, from ``wait4``; see ``measure``).
The one-process peak of fsdp-convert's rows is checked against ``--memory-budget``'s default
(256 MiB) plus the interpreter: the peak RSS of ``python -c INTERPRETER`` (torch and fsdp-convert's
CLI imported), measured the same way. Once, outside the timed runs, the model tensors of
fsdp-convert's .bin and .safetensors are compared bit for bit with zero_to_fp32's
``pytorch_model.bin``, and one ``--nproc 1`` run is profiled (cProfile of the main thread, the
read / write / fsync syscalls timed in every thread). Prints the markdown table with ratios to
zero_to_fp32 of the same output kind and writes JSON (default ``<cache>/bench-deepspeed.json``).

    python scripts/bench.py --deepspeed-gb 1 --rounds 2
"""

from __future__ import annotations

import argparse
import importlib
import json
import math
import os
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from _bench_measure import Run, cold_rounds, drop_cache, run_measured
from _bench_measure import median_or_none as _median
from _bench_measure import shown_mib as _mib
from _bench_measure import shown_number as _num

GB = 1e9
MiB = 2**20
D_IN = 1531
D_HID = 2053
STEPS = 2
BATCH = 2
TAG = "step2"
WORLD_SIZE = 4
BUDGET_DEFAULT = 256 * MiB  # fsdp-convert consolidate --memory-budget's default
INTERPRETER = "import torch, fsdp_convert, fsdp_convert.cli.app"


def pairs_for(size_gb: float) -> int:
    """How many Linear pairs make a save of at least ``size_gb`` GB (12 bytes per parameter: master, exp_avg, exp_avg_sq)."""
    per_pair = 2 * D_IN * D_HID + D_IN + D_HID
    return max(1, math.ceil(size_gb * GB / 12 / per_pair))


# ---------------------------------------------------------------- the training run (torchrun, every rank)


def _train(out: Path, pairs: int) -> None:
    """Build the model, train ``STEPS`` steps under ZeRO-3 and ``save_checkpoint(out, tag=TAG)``; every rank."""
    import deepspeed  # type: ignore[import-untyped,unused-ignore]
    import torch
    import torch.distributed as dist
    from torch import nn

    class Stack(nn.Module):
        """``pairs`` x (Linear(D_IN, D_HID), relu, Linear(D_HID, D_IN)); ``forward(x)``: fp32 ``[batch, D_IN]`` -> same."""

        def __init__(self) -> None:
            super().__init__()
            self.layers = nn.ModuleList(
                nn.Sequential(nn.Linear(D_IN, D_HID), nn.ReLU(), nn.Linear(D_HID, D_IN)) for _ in range(pairs)
            )

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            for layer in self.layers:
                x = x + layer(x) / D_HID
            return x

    config = {
        "train_micro_batch_size_per_gpu": BATCH,
        "zero_optimization": {"stage": 3, "reduce_bucket_size": 20_000_000, "stage3_prefetch_bucket_size": 20_000_000},
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "weight_decay": 0.1, "torch_adam": True}},
    }
    torch.manual_seed(0)
    # zero.Init partitions each Linear as it is made, so no rank holds the whole fp32 model.
    with deepspeed.zero.Init(config_dict_or_path=config):
        model = Stack()
    named = list(model.named_parameters())
    groups = [
        {"params": [p for n, p in named if n.endswith("weight")], "weight_decay": 0.1},
        {"params": [p for n, p in named if n.endswith("bias")], "weight_decay": 0.0, "lr": 2e-3},
    ]
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=groups, config=config)
    gen = torch.Generator().manual_seed(1 + engine.global_rank)
    for step in range(STEPS):
        loss = engine(torch.randn(BATCH, D_IN, generator=gen)).pow(2).mean()
        engine.backward(loss)
        engine.step()
        if engine.global_rank == 0:
            print(f"step {step + 1}: loss {float(loss.detach()):.4f}", file=sys.stderr, flush=True)
    engine.save_checkpoint(str(out), tag=TAG)
    dist.barrier()


def train_main(argv: list[str]) -> None:
    """``train OUT --pairs N`` under torchrun: the ZeRO-3 save; ends with ``os._exit(0)``."""
    parser = argparse.ArgumentParser(prog="torchrun ... scripts/_bench_deepspeed.py")
    parser.add_argument("mode", choices=["train"])
    parser.add_argument("out", type=Path)
    parser.add_argument("--pairs", type=int, required=True)
    args = parser.parse_args(argv)
    import deepspeed

    # The CPU backend JIT-builds a shared-memory op with g++ (about 60 s) that only
    # inference_all_reduce uses (as tests/_deepspeed.py does).
    ds_torch_backend: Any = importlib.import_module("deepspeed.comm.torch")
    ds_torch_backend.build_shm_op = lambda: None
    deepspeed.init_distributed(dist_backend="gloo")
    _train(args.out, args.pairs)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # ZeRO-3 ranks may abort in interpreter teardown


def make_deepspeed_checkpoint(size_gb: float, cache: Path) -> Path:
    """The cached ZeRO-3 save of about ``size_gb`` GB at 4 ranks (the folder with ``latest``), made if missing.

    Raises:
        subprocess.CalledProcessError: the training launch failed (its log: ``<folder>/../torchrun.log``).
    """
    pairs = pairs_for(size_gb)
    ck = cache / f"deepspeed-z3-ws{WORLD_SIZE}-d{D_IN}-h{D_HID}-p{pairs}" / "checkpoint"
    done = ck.parent / ".complete"
    if done.exists():
        return ck
    shutil.rmtree(ck.parent, ignore_errors=True)
    ck.parent.mkdir(parents=True)
    params = pairs * (2 * D_IN * D_HID + D_IN + D_HID)
    print(f"writing a ZeRO-3 save of {params / 1e6:.1f}M parameters ({pairs} Linear pairs) at 4 ranks to {ck}", file=sys.stderr)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={WORLD_SIZE}"]
    cmd += [str(Path(__file__).resolve()), "train", str(ck), "--pairs", str(pairs)]
    log = ck.parent / "torchrun.log"
    start = time.monotonic()
    with open(log, "wb") as f:
        proc = subprocess.run(cmd, env={**os.environ, "OMP_NUM_THREADS": "1"}, stdout=f, stderr=subprocess.STDOUT)
    if proc.returncode != 0:
        sys.stderr.write(log.read_text(errors="replace")[-6000:])
        raise subprocess.CalledProcessError(proc.returncode, cmd)
    print(f"trained and saved in {time.monotonic() - start:.0f} s", file=sys.stderr)
    done.touch()
    return ck


# ---------------------------------------------------------------- measuring


@dataclass(frozen=True)
class Measured:
    """One run: ``run_measured``'s wall and process-tree peaks, and the largest peak RSS of any one process."""

    run: Run
    max_process_rss_bytes: int | None  # None: no GNU time here
    cpu_s: float | None  # user + system CPU seconds of the tree (its reaped processes); None: no GNU time


def _gnu_time() -> str | None:
    """``/usr/bin/time`` if it is GNU time (``-f %M``: the peak RSS in KiB that ``wait4`` reports), else None."""
    path = shutil.which("time", path="/usr/bin:/bin")
    if path is None:
        return None
    probe = subprocess.run([path, "--version"], capture_output=True, text=True)
    return path if "GNU" in probe.stdout + probe.stderr else None


def measure(cmd: list[str], scratch: Path) -> Measured:
    """Run ``cmd`` through ``run_measured``, wrapped in GNU time for the largest one-process peak RSS and the CPU time.

    ``wait4`` gives a child's peak RSS together with those of the descendants it reaped (Linux keeps
    the maximum, ``cmaxrss``), so GNU time's ``%M`` is the largest peak of any one process of the
    tree, exactly, not sampled; ``%U`` + ``%S`` the tree's CPU seconds, which other load on the
    machine changes less than the wall. The wrapper is a small C program (a few MiB of the tree's RSS).
    """
    gnu_time = _gnu_time()
    if gnu_time is None:
        return Measured(run_measured(cmd), None, None)
    report = scratch / "maxrss.txt"
    report.unlink(missing_ok=True)
    run = run_measured([gnu_time, "-f", "%M %U %S", "-o", str(report), *cmd])
    try:
        max_kib, user, system = report.read_text().splitlines()[-1].split()
        return Measured(run, int(max_kib) * 1024, float(user) + float(system))
    except (OSError, ValueError, IndexError):
        return Measured(run, None, None)


@dataclass(frozen=True)
class System:
    label: str
    kind: str  # the output kind: "bin" (torch.save of the model), "safetensors", "all" (model + optimizer)
    cmd: list[str]
    baseline: str  # the key of the zero_to_fp32 row of the same output kind
    ours: bool  # an fsdp-convert row: its one-process peak is checked against the budget


def build_systems(ck: Path, work: Path) -> dict[str, System]:
    py = sys.executable
    z2f = [py, str(ck / "zero_to_fp32.py"), str(ck), str(work / "zero_to_fp32")]
    fc = [py, "-m", "fsdp_convert", "consolidate", str(ck)]
    bin_out, st_out = str(work / "model.bin"), str(work / "model.safetensors")
    return {
        "zero_to_fp32": System("zero_to_fp32.py", "bin", z2f, "zero_to_fp32", False),
        "fc-bin": System("fsdp-convert --only model", "bin", [*fc, bin_out, "--only", "model", "-q"], "zero_to_fp32", True),
        "fc-bin-n1": System(
            "fsdp-convert --only model --nproc 1",
            "bin",
            [*fc, bin_out, "--only", "model", "--nproc", "1", "-q"],
            "zero_to_fp32",
            True,
        ),
        "zero_to_fp32-st": System(
            "zero_to_fp32.py --safe_serialization", "safetensors", [*z2f, "--safe_serialization"], "zero_to_fp32-st", False
        ),
        "fc-st": System(
            "fsdp-convert --only model", "safetensors", [*fc, st_out, "--only", "model", "-q"], "zero_to_fp32-st", True
        ),
        "fc-st-n1": System(
            "fsdp-convert --only model --nproc 1",
            "safetensors",
            [*fc, st_out, "--only", "model", "--nproc", "1", "-q"],
            "zero_to_fp32-st",
            True,
        ),
        "fc-all": System("fsdp-convert (model + optimizer)", "all", [*fc, str(work / "full.pt"), "-q"], "zero_to_fp32", True),
    }


def _clear(folder: Path) -> None:
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)


# ---------------------------------------------------------------- checks outside the timed runs

# argv: zero_to_fp32's pytorch_model.bin, fsdp-convert's .bin (model under "model"), its .safetensors.
# Prints one JSON document: per output, whether its model tensors equal zero_to_fp32's bit for bit.
COMPARE_SCRIPT = """
import json, sys, torch
from safetensors.torch import load_file
want = torch.load(sys.argv[1], map_location="cpu", weights_only=True, mmap=True)
def same(got):
    bad = sorted(set(want) ^ set(got))
    for fqn, t in want.items():
        g = got.get(fqn)
        if g is None:
            continue
        flat_g, flat_t = g.reshape(-1).view(torch.uint8), t.reshape(-1).view(torch.uint8)
        if g.dtype != t.dtype or g.shape != t.shape or not torch.equal(flat_g, flat_t):
            bad.append(fqn)
    return {"tensors": len(want), "equal": not bad, "mismatched": bad[:10]}
ours = torch.load(sys.argv[2], map_location="cpu", weights_only=True, mmap=True)
print(json.dumps({
    "bin_top_level_keys": sorted(ours),
    "bin": same(ours["model"] if set(ours) == {"model"} else ours),
    "safetensors": same(load_file(sys.argv[3])),
}))
"""

# argv: CHECKPOINT OUT JSON_OUT. One in-process `consolidate CHECKPOINT OUT --only model --nproc 1`
# under cProfile (the main thread), with os.preadv/pread/pwrite/write/fsync timed in every thread
# (the copy runs in threads cProfile does not see). Writes the stages as JSON.
PROFILE_SCRIPT = """
import cProfile, json, os, pstats, sys, threading, time
ck, out, json_out = sys.argv[1:4]
spent = {}
lock = threading.Lock()
def timed(name, fn):
    def call(*a, **k):
        t = time.perf_counter()
        try:
            return fn(*a, **k)
        finally:
            with lock:
                n, s = spent.get(name, (0, 0.0))
                spent[name] = (n + 1, s + time.perf_counter() - t)
    return call
for name in ("preadv", "pread", "pwrite", "write", "fsync"):
    setattr(os, name, timed(name, getattr(os, name)))
sys.argv = ["fsdp-convert", "consolidate", ck, out, "--only", "model", "--nproc", "1", "-q"]
prof = cProfile.Profile()
code = 0
start = time.perf_counter()
prof.enable()
try:
    from fsdp_convert.cli.app import app
    app()
except SystemExit as e:
    code = e.code
prof.disable()
wall = time.perf_counter() - start
stats = pstats.Stats(prof)
stats.calc_callees()
def find(file_end, name):
    return [f for f in stats.stats if f[0].replace(os.sep, "/").endswith(file_end) and f[2] == name]
def cum(file_end, name):
    return sum(stats.stats[f][3] for f in find(file_end, name))
stages = []
for f in find("fsdp_convert/ops/consolidate.py", "consolidate"):
    for callee, (cc, nc, tt, ct) in stats.all_callees[f].items():
        if ct >= 0.01:
            where = os.path.relpath(callee[0]) if callee[0].startswith("/") else callee[0]
            stages.append({"function": f"{where}:{callee[2]}", "cum_s": round(ct, 3)})
stages.sort(key=lambda s: -s["cum_s"])
top = sorted(((v[2], k) for k, v in stats.stats.items()), key=lambda x: -x[0])[:12]
torch_s = cum("torch/__init__.py", "<module>")
index_s = cum("fsdp_convert/formats/__init__.py", "open_checkpoint")
copy_s = cum("fsdp_convert/ops/consolidate.py", "_move")
fsync_s = spent.get("fsync", (0, 0.0))[1]
# torch is first imported inside open_checkpoint (the DeepSpeed reader needs it): counted once, as import
stages_s = {"import torch": torch_s, "index (open_checkpoint, less import torch)": max(index_s - torch_s, 0.0),
            "copy (_move: read + CRC + pwrite)": copy_s, "fsync (all)": fsync_s}
stages_s["rest (CLI, plan, output header, rename)"] = wall - sum(stages_s.values())
doc = {
    "exit": code,
    "wall_s": round(wall, 3),
    "stages_s": {k: round(v, 3) for k, v in stages_s.items()},
    "bound_by": max(stages_s, key=stages_s.get),
    "consolidate_s": round(sum(stats.stats[f][3] for f in find("fsdp_convert/ops/consolidate.py", "consolidate")), 3),
    "consolidate_callees": stages[:12],
    "syscalls_thread_s": {k: {"calls": n, "s": round(s, 3)} for k, (n, s) in sorted(spent.items())},
    "top_own_time": [{"function": f"{k[0]}:{k[1]}({k[2]})", "s": round(t, 3)} for t, k in top],
}
with open(json_out, "w") as f:
    json.dump(doc, f, indent=1)
"""


def compare_outputs(ck: Path, work: Path) -> dict[str, Any]:
    """zero_to_fp32's ``pytorch_model.bin`` against fsdp-convert's .bin and .safetensors, bit for bit, and the default nproc.

    Raises:
        SystemExit: a conversion failed.
    """
    systems = build_systems(ck, work)
    _clear(work)
    for key in ("zero_to_fp32", "fc-st"):
        proc = subprocess.run(systems[key].cmd, capture_output=True, text=True)
        if proc.returncode != 0:
            raise SystemExit(f"{key} failed (rc {proc.returncode}): {proc.stderr[-2000:]}")
    # fc-bin again with --json instead of -q: the worker count the default picks
    proc = subprocess.run([*systems["fc-bin"].cmd[:-1], "--json"], capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"fc-bin failed (rc {proc.returncode}): {proc.stderr[-2000:]}")
    default_nproc = json.loads(proc.stdout)["nproc"]
    cmd = [sys.executable, "-c", COMPARE_SCRIPT, str(work / "zero_to_fp32" / "pytorch_model.bin")]
    cmd += [str(work / "model.bin"), str(work / "model.safetensors")]
    result: dict[str, Any] = json.loads(subprocess.run(cmd, check=True, capture_output=True, text=True).stdout)
    result["default_nproc"] = default_nproc
    _clear(work)
    return result


def profile_once(ck: Path, work: Path) -> dict[str, Any]:
    """One ``--nproc 1`` run under cProfile, cache dropped first; the stages (``PROFILE_SCRIPT``)."""
    _clear(work)
    drop_cache([p for p in ck.rglob("*") if p.is_file()])
    out = work.parent / "deepspeed-profile.json"
    subprocess.run(
        [sys.executable, "-c", PROFILE_SCRIPT, str(ck), str(work / "model.bin"), str(out)],
        check=True,
        stdout=subprocess.DEVNULL,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    _clear(work)
    doc: dict[str, Any] = json.loads(out.read_text())
    return doc


# ---------------------------------------------------------------- the row


def bench_deepspeed(args: argparse.Namespace) -> None:
    """Make the save, check the outputs, run every system --rounds times in rotating order; print the table, write JSON."""
    load_before = os.getloadavg()
    ck = make_deepspeed_checkpoint(args.deepspeed_gb, args.cache)
    inputs = sorted(p for p in ck.rglob("*") if p.is_file())
    data_bytes = sum(p.stat().st_size for p in inputs if p.suffix == ".pt")
    work = args.cache / "out-deepspeed"
    need = 1.6 * data_bytes  # full.pt (all the data) and the scratch
    if shutil.disk_usage(args.cache).free < need:
        raise SystemExit(f"not enough disk in {args.cache}: need {need / GB:.1f} GB")

    print("checking the outputs against zero_to_fp32 (untimed) ...", file=sys.stderr)
    check = compare_outputs(ck, work)
    print(f"  {json.dumps(check)}", file=sys.stderr)
    print("profiling one fsdp-convert --nproc 1 run ...", file=sys.stderr)
    profile = profile_once(ck, work)

    scratch = args.cache / "scratch-deepspeed"
    scratch.mkdir(parents=True, exist_ok=True)
    interpreter = measure([sys.executable, "-c", INTERPRETER], scratch)
    budget_line = interpreter.max_process_rss_bytes
    limit = None if budget_line is None else budget_line + BUDGET_DEFAULT

    systems = build_systems(ck, work)

    def cold() -> None:
        _clear(work)
        drop_cache(inputs)

    runs = cold_rounds(
        list(systems),
        args.rounds,
        cold,
        lambda key: measure(systems[key].cmd, scratch),
        lambda m: (
            f"{m.run.wall_s:7.2f} s  tree RSS {_mib(m.run.peak_rss_bytes):>5} MiB  PSS {_mib(m.run.peak_pss_bytes):>5} MiB"
            f"  one process {_mib(m.max_process_rss_bytes):>5} MiB  CPU {m.cpu_s if m.cpu_s is not None else float('nan'):6.2f} s"
        ),
    )
    _clear(work)
    load_after = os.getloadavg()

    rows: list[dict[str, Any]] = []
    for key, system in systems.items():
        ok = [m for m in runs[key] if m.run.returncode == 0]
        procs = [m.max_process_rss_bytes for m in runs[key] if m.max_process_rss_bytes is not None]
        rows.append(
            {
                "key": key,
                "system": system.label,
                "output": system.kind,
                "baseline": system.baseline,
                "result": "ok" if len(ok) == len(runs[key]) else f"failed in {len(runs[key]) - len(ok)}/{len(runs[key])} runs",
                "wall_s_median": _median([m.run.wall_s for m in ok]),
                "wall_s_all": [round(m.run.wall_s, 3) for m in runs[key]],
                "cpu_s_median": _median([m.cpu_s for m in ok if m.cpu_s is not None]),
                "cpu_s_all": [m.cpu_s for m in runs[key]],
                "peak_rss_tree_bytes": max(m.run.peak_rss_bytes for m in runs[key]),
                "peak_pss_tree_bytes": max(m.run.peak_pss_bytes for m in runs[key]),
                "max_process_rss_bytes": max(procs) if procs else None,
                "within_budget": None if limit is None or not procs or not system.ours else max(procs) <= limit,
            }
        )
    by_key = {row["key"]: row for row in rows}
    for row in rows:
        base = by_key[row["baseline"]]
        row["wall_vs_zero_to_fp32"] = (
            None if not row["wall_s_median"] or not base["wall_s_median"] else row["wall_s_median"] / base["wall_s_median"]
        )
        cpu, base_cpu = row["cpu_s_median"], base["cpu_s_median"]
        row["cpu_vs_zero_to_fp32"] = None if cpu is None or not base_cpu else cpu / base_cpu
        row["tree_rss_vs_zero_to_fp32"] = row["peak_rss_tree_bytes"] / base["peak_rss_tree_bytes"]
        one, base_one = row["max_process_rss_bytes"], base["max_process_rss_bytes"]
        row["max_process_rss_vs_zero_to_fp32"] = None if one is None or not base_one else one / base_one

    params = pairs_for(args.deepspeed_gb) * (2 * D_IN * D_HID + D_IN + D_HID)
    print(
        f"\nDeepSpeed 0.19.8 ZeRO-3 fp32 save at 4 ranks: {ck} ({data_bytes / GB:.3f} GB in {len(inputs)} files; "
        f"{params / 1e6:.1f}M parameters, model {params * 4 / GB:.3f} GB), median of {args.rounds} rounds, rotating order, "
        f"page cache dropped before each run; load average {load_before[0]:.1f} before, {load_after[0]:.1f} after\n"
    )
    print(
        "| system | output | result | wall s | wall / z2f | CPU s | CPU / z2f | tree peak RSS MiB | tree peak PSS MiB "
        "| max one-process RSS MiB | tree RSS / z2f | one-process RSS / z2f | within budget |"
    )
    print("|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|")
    for row in rows:
        budget = {None: "—", True: "yes", False: "NO"}[row["within_budget"]]
        print(
            f"| {row['system']} | {row['output']} | {row['result']} | {_num(row['wall_s_median'])} "
            f"| {_num(row['wall_vs_zero_to_fp32'])} | {_num(row['cpu_s_median'])} | {_num(row['cpu_vs_zero_to_fp32'])} "
            f"| {_mib(row['peak_rss_tree_bytes'])} | {_mib(row['peak_pss_tree_bytes'])} | {_mib(row['max_process_rss_bytes'])} "
            f"| {_num(row['tree_rss_vs_zero_to_fp32'])} | {_num(row['max_process_rss_vs_zero_to_fp32'])} | {budget} |"
        )
    print(
        "\nz2f: zero_to_fp32.py writing the same kind of file (the model + optimizer row: its .bin). Wall and CPU: "
        "medians; CPU: user + system seconds of the process tree (GNU time); peaks: the largest over the rounds."
    )
    print(
        f"interpreter floor (`python -c '{INTERPRETER}'`, warm cache): {_num(interpreter.run.wall_s)} s wall, "
        f"{_num(interpreter.cpu_s)} s CPU"
    )
    print(
        f"budget: --memory-budget default {BUDGET_DEFAULT / MiB:.0f} MiB + the interpreter "
        f"(`python -c '{INTERPRETER}'`: {_mib(budget_line)} MiB peak RSS) = {_mib(limit)} MiB per process. "
        f""
        f"fsdp-convert's default picked --nproc {check['default_nproc']} here."
    )
    print(
        f"outputs vs zero_to_fp32 (bit for bit, model tensors): .bin {check['bin']['equal']} "
        f"({check['bin']['tensors']} tensors; top-level keys {check['bin_top_level_keys']}), "
        f".safetensors {check['safetensors']['equal']}"
    )
    syscalls = ", ".join(f"{k} {v['s']:.2f} s ({v['calls']} calls)" for k, v in profile["syscalls_thread_s"].items())
    stages = ", ".join(f"{k} {v:.2f} s" for k, v in profile["stages_s"].items())
    print(
        f"profile (one --nproc 1 run, cold cache, in-process, cProfile): wall {profile['wall_s']:.2f} s = {stages}; "
        f"bound by: {profile['bound_by']}. Read/write syscalls, summed over threads: {syscalls}"
    )
    json_out = args.json_out or args.cache / "bench-deepspeed.json"
    doc = {
        "checkpoint": str(ck),
        "data_bytes": data_bytes,
        "parameters": params,
        "rounds": args.rounds,
        "load_average_before": load_before,
        "load_average_after": load_after,
        "memory_budget_default_bytes": BUDGET_DEFAULT,
        "interpreter_peak_rss_bytes": budget_line,
        "interpreter_wall_s": interpreter.run.wall_s,
        "interpreter_cpu_s": interpreter.cpu_s,
        "per_process_limit_bytes": limit,
        "check": check,
        "profile": profile,
        "rows": rows,
    }
    json_out.write_text(json.dumps(doc, indent=2) + "\n")
    print(f"JSON: {json_out}")


if __name__ == "__main__":
    train_main(sys.argv[1:])
