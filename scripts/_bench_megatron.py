"""The Megatron row of scripts/bench.py: an HF folder resharded for Megatron-Core beside a plain reshard of it.

Writes (once, cached in the bench cache) a Hugging Face Llama-family folder of at least
--megatron-gb GB: transformers' ``LlamaForCausalLM`` of ``llama_config`` (hidden 2048, 16 query
heads in 4 groups of head_dim 128, so GQA; intermediate 5632, vocab 32000, untied ``lm_head``,
as many layers as the size takes), bf16, every parameter drawn from one seeded generator in
``named_parameters`` order (``0.02 * randn``; the norms ``1 + 0.1 * randn``, so a norm filed as
another would show), so the folder's tensors are the same on every run of the same torch.
``save_pretrained`` writes it as safetensors shards of at most a quarter of the model
(``max_shard_size``), about as many shards as a released 8B model has at its 5 GB.

Then alternates, --rounds times in rotating order, each system its own process with the folder's
shards dropped from the page cache first (``drop_cache``) and the output folder emptied:

  plain      ``fsdp-convert reshard HF OUT --world-size 2 --nproc 2``: the folder's tensors as
             they are, as DCP for 2 ranks
  megatron   the same with ``--adapter hf-to-megatron-gpt --model-config HF/config.json``: layers
             stacked, ``linear_qkv`` fused by query group, ``linear_fc1`` as ``[gate; up]``,
             ``common.pt`` and ``metadata.json`` beside (what Megatron-Core's
             ``dist_checkpointing.load`` reads at any TP)

Each run records the wall (until the command's main process exits), the CPU seconds of every
process of the tree, the peak RSS and PSS of the process tree (``run_measured``) and the largest
peak RSS of any one process (``measure``: the command run under a child subreaper that reaps the
forkserver and its workers too, which GNU time misses). Outside the timed runs: each command's
``--dry-run --json`` (its planned per-process peak and the bytes each worker moves);
``consolidate OUT x.safetensors --adapter megatron-gpt-to-hf`` of the Megatron output, compared
with the HF folder's tensors bit for bit (dtype, shape, bytes; no tensor missing or extra); and one
run of each system at ``--nproc 1`` (its worker in-process, so the syscalls are timed too) and at
``--nproc 2``, cold cache, with the reshard stages timed (``PROFILE_SCRIPT``). Prints the markdown
table with the ratio megatron / plain and writes JSON (default ``<cache>/bench-megatron.json``).

    python scripts/bench.py --megatron-gb 1 --rounds 2
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from _bench_measure import Run, cold_rounds, drop_cache, run_measured
from _bench_measure import median_or_none as _median
from _bench_measure import shown_mib as _mib
from _bench_measure import shown_number as _num

GB = 1e9
MiB = 2**20
SEED = 35
WORLD_SIZE = 2
NPROC = 2
RATIO_GOAL = 1.3  # issue 35: the adapter's wall at most 1.3x a plain reshard's
ADAPTER = "hf-to-megatron-gpt"
BACK = "megatron-gpt-to-hf"
HIDDEN, HEADS, GROUPS, FFN, VOCAB = 2048, 16, 4, 5632, 32000


def layers_for(size_gb: float) -> int:
    """Layers of ``llama_config`` whose bf16 weights come to at least ``size_gb`` GB (2 at least)."""
    head_dim = HIDDEN // HEADS
    per_layer = 2 * HIDDEN * HIDDEN + 2 * GROUPS * head_dim * HIDDEN + 3 * HIDDEN * FFN + 2 * HIDDEN
    rest = 2 * VOCAB * HIDDEN + HIDDEN  # embedding, lm_head, final norm
    return max(2, math.ceil((size_gb * GB / 2 - rest) / per_layer))


def llama_config(layers: int) -> dict[str, Any]:
    """The ``LlamaConfig`` fields of the bench model (GQA: ``HEADS`` query heads in ``GROUPS`` groups)."""
    return {
        "hidden_size": HIDDEN,
        "intermediate_size": FFN,
        "num_attention_heads": HEADS,
        "num_key_value_heads": GROUPS,
        "num_hidden_layers": layers,
        "vocab_size": VOCAB,
        "tie_word_embeddings": False,
        "max_position_embeddings": 4096,
    }


def make_hf_folder(size_gb: float, cache: Path) -> Path:
    """The cached HF Llama folder of at least ``size_gb`` GB (bf16 safetensors shards), made if missing.

    Returns:
        The folder (``config.json``, ``model-0000N-of-0000M.safetensors``, ``model.safetensors.index.json``).
    """
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    layers = layers_for(size_gb)
    hf = cache / f"hf-llama-bf16-h{HIDDEN}-q{HEADS}-kv{GROUPS}-f{FFN}-v{VOCAB}-l{layers}-s{SEED}"
    done = hf / ".complete"
    if done.exists():
        return hf
    shutil.rmtree(hf, ignore_errors=True)
    config = LlamaConfig(**llama_config(layers))
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    model = model.to_empty(device="cpu").bfloat16()
    gen = torch.Generator().manual_seed(SEED)
    total = 0
    with torch.no_grad():
        for name, param in model.named_parameters():
            drawn = torch.randn(param.shape, generator=gen, dtype=torch.float32)
            param.copy_(1 + 0.1 * drawn if name.endswith("norm.weight") else 0.02 * drawn)
            total += param.numel() * param.element_size()
    shard_mb = max(1, int(total / 4 / 1e6))
    print(
        f"writing an HF Llama folder ({layers} layers, {total / GB:.3f} GB bf16, shards <= {shard_mb} MB) to {hf}",
        file=sys.stderr,
    )
    model.save_pretrained(hf, max_shard_size=f"{shard_mb}MB")
    del model
    done.touch()
    return hf


# ---------------------------------------------------------------- measuring

# argv: REPORT then the command. Runs the command as a child subreaper (prctl PR_SET_CHILD_SUBREAPER)
# and reaps every descendant, orphans too, before writing REPORT: the command's own wall (until its
# main process exits), getrusage(RUSAGE_CHILDREN) of all of them, and each descendant's peak
# RssAnon and RssFile (/proc/<pid>/status, sampled every 20 ms by a thread). GNU time misses what
# this catches: fsdp-convert's workers are forked by a multiprocessing forkserver that outlives the
# main process, is re-parented and never waited for by it, so their CPU and peak RSS never reach
# ``wait4`` of the main process (measured on a 0.44 GB folder: 1.7 s of a run's 5.9 s of CPU, 239 of
# its 544 MiB one-process peak). Where a worker memory-maps the shards, its RSS counts the pages it
# has touched (RssFile, page cache the kernel can drop: 603 of a 945 MiB peak then); its own memory
# is RssAnon.
REAPER = """
import ctypes, json, os, resource, sys, threading, time
ctypes.CDLL(None, use_errno=True).prctl(36, 1, 0, 0, 0)
report, cmd = sys.argv[1], sys.argv[2:]
me, peaks, done = os.getpid(), {}, threading.Event()
def status(pid):
    with open(f"/proc/{pid}/status") as f:
        rows = (line.partition(":") for line in f)
        return {k: int(v.split()[0]) for k, _, v in rows if k in ("PPid", "RssAnon", "RssFile")}
def sample():
    while not done.is_set():
        kids = {}
        for entry in os.listdir("/proc"):
            if entry.isdigit():
                try:
                    got = status(entry)
                except (OSError, ValueError, IndexError):
                    continue
                kids.setdefault(got.get("PPid"), []).append((int(entry), got))
        frontier = [me]
        while frontier:
            for pid, got in kids.get(frontier.pop(), []):
                anon, file = peaks.get(pid, (0, 0))
                peaks[pid] = (max(anon, got.get("RssAnon", 0)), max(file, got.get("RssFile", 0)))
                frontier.append(pid)
        done.wait(0.02)
sampler = threading.Thread(target=sample, daemon=True)
sampler.start()
start = time.monotonic()
main = os.posix_spawnp(cmd[0], cmd, os.environ)
main_wall, code = None, 1
while True:
    try:
        pid, status_ = os.wait()
    except ChildProcessError:
        break
    if pid == main:
        main_wall, code = time.monotonic() - start, os.waitstatus_to_exitcode(status_)
all_wall = time.monotonic() - start
done.set()
sampler.join()
ru = resource.getrusage(resource.RUSAGE_CHILDREN)
with open(report, "w") as f:
    json.dump({"main_wall_s": main_wall, "all_wall_s": all_wall, "cpu_s": ru.ru_utime + ru.ru_stime,
               "max_rss_kib": ru.ru_maxrss, "max_anon_kib": max((a for a, _ in peaks.values()), default=0),
               "max_file_kib": max((f for _, f in peaks.values()), default=0), "processes": len(peaks)}, f)
sys.exit(code)
"""


@dataclass(frozen=True)
class Measured:
    """One run: ``run_measured``'s process-tree peaks (sampled) and what ``REAPER`` reports of every descendant."""

    run: Run
    wall_s: float  # until the command's main process exits (what its caller waits for), seconds
    cpu_s: float  # user + system CPU seconds of every process of the tree, workers and forkserver included
    max_process_rss_bytes: int  # the largest peak RSS of any one process of the tree (wait4's maxrss)
    max_process_anon_bytes: int  # the largest peak RssAnon of any one process (sampled): its own memory
    max_process_file_bytes: int  # the largest peak RssFile of any one process (sampled): mapped files, libraries


def measure(cmd: list[str], scratch: Path) -> Measured:
    """Run ``cmd`` under ``REAPER`` (itself under ``run_measured``, whose sampled tree RSS includes its ~10 MiB).

    Raises:
        SystemExit: the reaper wrote no report.
    """
    report = scratch / "reaper.json"
    report.unlink(missing_ok=True)
    run = run_measured([sys.executable, "-S", "-c", REAPER, str(report), *cmd])
    try:
        doc = json.loads(report.read_text())
    except (OSError, ValueError) as e:
        raise SystemExit(f"no report from the reaper ({e}): {run.stderr_tail}") from e
    wall = doc["main_wall_s"] if doc["main_wall_s"] is not None else run.wall_s
    kib = 1024
    return Measured(run, wall, doc["cpu_s"], doc["max_rss_kib"] * kib, doc["max_anon_kib"] * kib, doc["max_file_kib"] * kib)


# ---------------------------------------------------------------- checks outside the timed runs

# argv: the HF folder, the round trip's .safetensors. Prints one JSON document: whether every
# tensor of the folder's shards equals the round trip's, bit for bit (dtype, shape, bytes).
COMPARE_SCRIPT = """
import json, sys, torch
from pathlib import Path
from safetensors import safe_open
want = {}
for shard in sorted(Path(sys.argv[1]).glob("*.safetensors")):
    with safe_open(str(shard), "pt") as f:
        for key in f.keys():
            want[key] = (shard.name, f.get_tensor(key))
bad = []
with safe_open(sys.argv[2], "pt") as f:
    got = set(f.keys())
    missing, extra = sorted(set(want) - got), sorted(got - set(want))
    for key in sorted(set(want) & got):
        t, g = want[key][1], f.get_tensor(key)
        same = g.dtype == t.dtype and g.shape == t.shape
        if not (same and torch.equal(g.reshape(-1).view(torch.uint8), t.reshape(-1).view(torch.uint8))):
            bad.append(key)
print(json.dumps({
    "tensors": len(want), "shards": len({s for s, _ in want.values()}),
    "bytes": sum(t.numel() * t.element_size() for _, t in want.values()),
    "dtypes": sorted({str(t.dtype) for _, t in want.values()}),
    "equal": not (missing or extra or bad), "missing": missing[:10], "extra": extra[:10], "mismatched": bad[:10],
}))
"""

# argv: JSON_OUT then reshard's arguments (at --nproc 1 its one worker is this process, so the
# syscalls are timed too; at --nproc 2 "move" is the workers' start and run). Wraps the stage
# functions ops.reshard calls by their global names and times os.preadv/pread/pwrite/fsync in every
# thread; writes the stages as JSON. Where the source's shards are read through a memory mapping
# (fsdp-convert did so until its safetensors reads moved to preadv), the reads are page faults inside
# pwrite and no preadv shows: pwrite's time is then read and write together.
PROFILE_SCRIPT = """
import json, os, sys, threading, time
json_out, argv = sys.argv[1], sys.argv[2:]
start = time.perf_counter()
import torch
torch_s = time.perf_counter() - start
import fsdp_convert.ops.reshard as op
from fsdp_convert.cli.app import app
import_s = time.perf_counter() - start
lock = threading.Lock()
def timed(table, name, fn):
    def call(*a, **k):
        t = time.perf_counter()
        try:
            return fn(*a, **k)
        finally:
            with lock:
                n, s = table.get(name, (0, 0.0))
                table[name] = (n + 1, s + time.perf_counter() - t)
    return call
syscalls, stages = {}, {}
for name in ("preadv", "pread", "pwrite", "fsync"):
    setattr(os, name, timed(syscalls, name, getattr(os, name)))
STAGES = {
    "open_checkpoint": "index (open_checkpoint)",
    "prepare_items": "items (prepare_items: adapter rules)",
    "folder_plans": "plan (folder_plans)",
    "files_beside": "files beside + adapter files",
    "adapter_files": "files beside + adapter files",
    "reshard_in_waves": "move (the worker: read + CRC + pwrite + fsync)",
}
for fn, label in STAGES.items():
    setattr(op, fn, timed(stages, label, getattr(op, fn)))
sys.argv = ["fsdp-convert", "reshard", *argv]
code, t0 = 0, time.perf_counter()
try:
    app()
except SystemExit as e:
    code = e.code
run_s = time.perf_counter() - t0
stages_s = {"import (torch, fsdp_convert)": import_s}
for label, (_, s) in stages.items():
    stages_s[label] = s
stages_s["rest (CLI, output checks, transaction, .metadata, rename)"] = run_s - sum(s for _, s in stages.values())
with open(json_out, "w") as f:
    json.dump({
        "exit": code, "wall_s": round(import_s + run_s, 3), "import_torch_s": round(torch_s, 3),
        "stages_s": {k: round(v, 3) for k, v in stages_s.items()},
        "bound_by": max(stages_s, key=stages_s.get),
        "syscalls_thread_s": {k: {"calls": n, "s": round(s, 3)} for k, (n, s) in sorted(syscalls.items())},
    }, f, indent=1)
"""


def _clear(folder: Path) -> None:
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)


def _run(cmd: list[str], what: str) -> str:
    """Run ``cmd``; its stdout. Raises SystemExit naming ``what`` if it fails."""
    proc = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    if proc.returncode != 0:
        raise SystemExit(f"{what} failed (rc {proc.returncode}): {proc.stderr[-2000:]}")
    return proc.stdout


def check_round_trip(hf: Path, work: Path, megatron_cmd: list[str]) -> dict[str, Any]:
    """Reshard for Megatron once, ``consolidate`` it back with ``megatron-gpt-to-hf``; compare with ``hf`` bit for bit.

    Raises:
        SystemExit: a conversion failed.
    """
    _clear(work)
    _run(megatron_cmd, "the megatron reshard")
    out = work / "megatron"
    files = sorted(p.name for p in out.iterdir())
    back = work / "back.safetensors"
    cmd = [sys.executable, "-m", "fsdp_convert", "consolidate", str(out), str(back), "--adapter", BACK]
    _run([*cmd, "--model-config", str(hf / "config.json"), "-q"], f"consolidate --adapter {BACK}")
    result: dict[str, Any] = json.loads(_run([sys.executable, "-c", COMPARE_SCRIPT, str(hf), str(back)], "the comparison"))
    result["megatron_files"] = files
    _clear(work)
    return result


def dry_runs(systems: dict[str, System]) -> dict[str, dict[str, Any]]:
    """Each system's ``--dry-run --json`` document (its plan: workers, bytes per worker, planned peak per process)."""
    return {key: json.loads(_run([*s.cmd[:-1], "--dry-run", "--json"], f"{key} --dry-run")) for key, s in systems.items()}


def profile_once(system: System, nproc: int, hf: Path, work: Path) -> dict[str, Any]:
    """One run of ``system`` at ``--nproc nproc``, cache dropped first; its stages (``PROFILE_SCRIPT``)."""
    _clear(work)
    drop_cache(sorted(hf.glob("*.safetensors")))
    doc_path = work.parent / f"megatron-profile-{system.key}-n{nproc}.json"
    args = system.cmd[4:-1]  # after "python -m fsdp_convert reshard", less -q
    args[args.index("--nproc") + 1] = str(nproc)
    _run([sys.executable, "-c", PROFILE_SCRIPT, str(doc_path), *args, "-q"], f"profile of {system.key} at --nproc {nproc}")
    _clear(work)
    doc: dict[str, Any] = json.loads(doc_path.read_text())
    return doc


# ---------------------------------------------------------------- the row


@dataclass(frozen=True)
class System:
    key: str
    label: str
    cmd: list[str]


def build_systems(hf: Path, work: Path) -> dict[str, System]:
    """The two reshards of ``hf`` into ``work``: ``plain`` and ``megatron`` (the adapter)."""
    fc = [sys.executable, "-m", "fsdp_convert", "reshard", str(hf)]
    at = ["--world-size", str(WORLD_SIZE), "--nproc", str(NPROC)]
    adapter = ["--adapter", ADAPTER, "--model-config", str(hf / "config.json")]
    return {
        "plain": System("plain", f"reshard --world-size {WORLD_SIZE} --nproc {NPROC}", [*fc, str(work / "plain"), *at, "-q"]),
        "megatron": System("megatron", f"reshard ... --adapter {ADAPTER}", [*fc, str(work / "megatron"), *at, *adapter, "-q"]),
    }


def _ratio(a: float | None, b: float | None) -> float | None:
    return None if a is None or not b else a / b


def bench_megatron(args: argparse.Namespace) -> None:
    """Make the folder, check the round trip, run both systems --rounds times in rotating order; print the table, write JSON."""
    load_before = os.getloadavg()
    hf = make_hf_folder(args.megatron_gb, args.cache)
    shards = sorted(hf.glob("*.safetensors"))
    data_bytes = sum(p.stat().st_size for p in shards)
    work = args.cache / "out-megatron"
    if shutil.disk_usage(args.cache).free < 2.2 * data_bytes:  # an output, and the round trip's file beside it
        raise SystemExit(f"not enough disk in {args.cache}: need {2.2 * data_bytes / GB:.1f} GB")
    systems = build_systems(hf, work)

    print(f"checking {ADAPTER} -> {BACK} against the HF folder (untimed) ...", file=sys.stderr)
    check = check_round_trip(hf, work, systems["megatron"].cmd)
    print(f"  {json.dumps(check)}", file=sys.stderr)
    plans = dry_runs(systems)
    print(f"profiling one run of each at --nproc 1 and {NPROC} ...", file=sys.stderr)
    profiles = {f"{key} n{n}": profile_once(s, n, hf, work) for n in (1, NPROC) for key, s in systems.items()}

    scratch = args.cache / "scratch-megatron"
    scratch.mkdir(parents=True, exist_ok=True)

    def cold() -> None:
        _clear(work)
        drop_cache(shards)

    runs = cold_rounds(
        list(systems),
        args.rounds,
        cold,
        lambda key: measure(systems[key].cmd, scratch),
        lambda m: (
            f"{m.wall_s:7.2f} s  tree RSS {_mib(m.run.peak_rss_bytes):>5} MiB  PSS {_mib(m.run.peak_pss_bytes):>5} MiB"
            f"  one process {_mib(m.max_process_rss_bytes):>5} MiB (anon {_mib(m.max_process_anon_bytes):>4} MiB)"
            f"  CPU {m.cpu_s:6.2f} s"
        ),
    )
    _clear(work)
    load_after = os.getloadavg()

    rows: list[dict[str, Any]] = []
    for key, system in systems.items():
        ok = [m for m in runs[key] if m.run.returncode == 0]
        wall = _median([m.wall_s for m in ok])
        rows.append(
            {
                "key": key,
                "system": system.label,
                "command": system.cmd[1:],
                "result": "ok" if len(ok) == len(runs[key]) else f"failed in {len(runs[key]) - len(ok)}/{len(runs[key])} runs",
                "wall_s_median": wall,
                "wall_s_all": [round(m.wall_s, 3) for m in runs[key]],
                "tree_done_s_all": [round(m.run.wall_s, 3) for m in runs[key]],
                "gb_per_s": None if not wall else data_bytes / wall / GB,
                "cpu_s_median": _median([m.cpu_s for m in ok]),
                "cpu_s_all": [m.cpu_s for m in runs[key]],
                "peak_rss_tree_bytes": max(m.run.peak_rss_bytes for m in runs[key]),
                "peak_pss_tree_bytes": max(m.run.peak_pss_bytes for m in runs[key]),
                "max_process_rss_bytes": max(m.max_process_rss_bytes for m in runs[key]),
                "max_process_anon_bytes": max(m.max_process_anon_bytes for m in runs[key]),
                "max_process_file_bytes": max(m.max_process_file_bytes for m in runs[key]),
                "planned_peak_process_bytes": plans[key]["peak_process_bytes"],
                "planned_worker_bytes": plans[key]["worker_bytes"],
            }
        )
    plain, meg = rows
    ratio = _ratio(meg["wall_s_median"], plain["wall_s_median"])
    for row in rows:
        row["wall_vs_plain"] = _ratio(row["wall_s_median"], plain["wall_s_median"])
        row["cpu_vs_plain"] = _ratio(row["cpu_s_median"], plain["cpu_s_median"])

    layers = layers_for(args.megatron_gb)
    params = data_bytes / 2  # bf16; the safetensors headers are a few KiB
    print(
        f"\nHF Llama folder ({layers} layers, hidden {HIDDEN}, {HEADS} query heads in {GROUPS} groups, bf16, random "
        f"weights; {data_bytes / GB:.3f} GB in {len(shards)} safetensors shards, ~{params / 1e6:.0f}M parameters): {hf}. "
        f"Median of {args.rounds} rounds, rotating order, page cache dropped before each run; "
        f"load average {load_before[0]:.1f} before, {load_after[0]:.1f} after; {os.cpu_count()} CPUs\n"
    )
    print(
        "| system | result | wall s | wall / plain | GB/s | CPU s | CPU / plain | tree peak RSS MiB | tree peak PSS MiB "
        "| max one-process RSS MiB | max one-process anon MiB | planned per-process peak MiB |"
    )
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for row in rows:
        print(
            f"| {row['system']} | {row['result']} | {_num(row['wall_s_median'])} | {_num(row['wall_vs_plain'])} "
            f"| {_num(row['gb_per_s'])} | {_num(row['cpu_s_median'])} | {_num(row['cpu_vs_plain'])} "
            f"| {_mib(row['peak_rss_tree_bytes'])} | {_mib(row['peak_pss_tree_bytes'])} | {_mib(row['max_process_rss_bytes'])} "
            f"| {_mib(row['max_process_anon_bytes'])} "
            f"| {_mib(row['planned_peak_process_bytes'])} |"
        )
    verdict = "—" if ratio is None else ("yes" if ratio <= RATIO_GOAL else "NO")
    print(
        f"\nratio megatron / plain (median walls): {_num(ratio)} (goal <= {RATIO_GOAL}: {verdict}). Wall and CPU: medians; "
        "CPU: user + system seconds of every process of the tree (forkserver and workers included); peaks: the largest "
        "over the rounds; one-process RSS counts mapped files too (libraries; a memory-mapped source's pages), anon a "
        "process's own memory (largest RssAnon, sampled); planned: the command's --dry-run estimate."
    )
    print(
        f"round trip ({ADAPTER}, then consolidate --adapter {BACK}) vs the HF folder, bit for bit: {check['equal']} "
        f"({check['tensors']} tensors, {check['dtypes']}); the Megatron folder holds {check['megatron_files']}"
    )
    for key, profile in profiles.items():
        stages = ", ".join(f"{k} {v:.2f} s" for k, v in profile["stages_s"].items() if v >= 0.005)
        syscalls = ", ".join(f"{k} {v['s']:.2f} s ({v['calls']})" for k, v in profile["syscalls_thread_s"].items())
        print(f"profile {key} (cold cache): wall {profile['wall_s']:.2f} s = {stages}; syscalls in this process: {syscalls}")
    deltas = {}
    for n in (1, NPROC):
        plain_stages, meg_stages = profiles[f"plain n{n}"]["stages_s"], profiles[f"megatron n{n}"]["stages_s"]
        deltas[f"n{n}"] = {k: v - plain_stages.get(k, 0.0) for k, v in meg_stages.items()}
        widest = max(deltas[f"n{n}"], key=deltas[f"n{n}"].__getitem__)
        print(
            f"profile finding at --nproc {n}: the megatron run is bound by {profiles[f'megatron n{n}']['bound_by']}; "
            f"its largest excess over plain: {widest} ({deltas[f'n{n}'][widest]:+.2f} s)"
        )
    json_out = args.json_out or args.cache / "bench-megatron.json"
    doc = {
        "hf_folder": str(hf),
        "config": llama_config(layers),
        "dtype": "bfloat16",
        "data_bytes": data_bytes,
        "shards": len(shards),
        "rounds": args.rounds,
        "world_size": WORLD_SIZE,
        "nproc": NPROC,
        "cpus": os.cpu_count(),
        "load_average_before": load_before,
        "load_average_after": load_after,
        "ratio_megatron_vs_plain": ratio,
        "ratio_goal": RATIO_GOAL,
        "check": check,
        "dry_runs": plans,
        "profiles": profiles,
        "profile_excess_s": deltas,
        "rows": rows,
    }
    json_out.write_text(json.dumps(doc, indent=2) + "\n")
    print(f"JSON: {json_out}")
