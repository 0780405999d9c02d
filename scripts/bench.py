#!/usr/bin/env python
"""Benchmark: consolidating a real FSDP2 checkpoint, against torch's own converters and the disk.

Writes (once, cached in bench-cache/) a DCP checkpoint of about --size-gb from real FSDP2 training
at world size 4 under torchrun, then alternates, --rounds times and in rotating order (--systems
picks some; default all):
  disk-read           read every data file (the read limit)
  disk-write          write as many bytes to the output folder, with fsync (the write limit)
  dcp_to_torch_save   torch.distributed.checkpoint.format_utils.dcp_to_torch_save
  n1 / n2 / n4        fsdp-convert consolidate --nproc 1 / 2 / 4 (a .pt file)
  safetensors         fsdp-convert consolidate --only model, a .safetensors file (default nproc)
  torch-safetensors   torch's consolidate_safetensors_files on a HuggingFaceStorageWriter
                      checkpoint of the same model (cached; scripts/_bench_hf.py re-saves the DCP
                      checkpoint's model tensors with it, sharded as FSDP2 shards them)
  reshard8            fsdp-convert reshard --world-size 8 (default nproc)
  cgroup              fsdp-convert consolidate, default options, inside a memory cgroup of
                      --cgroup-mib (no swap); needs root and a cgroup memory controller
Each system runs as its own process; before each run the input files are dropped from the page
cache (posix_fadvise DONTNEED), so every system reads from the disk. Peak RSS is of the whole
process tree (sampled from /proc every 20 ms). Prints a markdown table of medians with ratios to
torch (dcp_to_torch_save; for the two safetensors rows, consolidate_safetensors_files) and to the
disk limit (the slower of read and write, scaled to the bytes a row converts), and writes it as
JSON.

--sizes 1,4,8 instead makes (cached) checkpoints of those sizes and prints the scaling table of
fsdp-convert consolidate with default options: wall, GB/s, peak RSS of the process tree.

    python scripts/bench.py --size-gb 3.4 --rounds 3
    python scripts/bench.py --size-gb 3.4 --rounds 3 --systems dcp_to_torch_save,n1,cgroup
    python scripts/bench.py --sizes 1,4,8 --rounds 1

--moe-mb 200 instead prints the MoE row (scripts/_bench_moe.py): plain consolidate to a folder vs
the same with --adapter torchtitan-qwen3-to-hf (an expert split), and their ratio.

--deepspeed-gb 1 instead prints the DeepSpeed row (scripts/_bench_deepspeed.py): a real ZeRO-3 save
(DeepSpeed 0.19.8, 4 ranks under torchrun, cached) of about that size, consolidated by DeepSpeed's
own zero_to_fp32.py (pytorch_model.bin, and --safe_serialization) and by fsdp-convert consolidate
--only model to the same kind of file (default workers and --nproc 1), plus the model + optimizer
.pt; wall, peak RSS of the tree and of the largest process, ratios to zero_to_fp32, the bitwise
check of the outputs against zero_to_fp32's, and a cProfile of one run.

    python scripts/bench.py --deepspeed-gb 1 --rounds 2

--megatron-gb 1 instead prints the Megatron row (scripts/_bench_megatron.py): a Hugging Face Llama
folder (transformers' LlamaForCausalLM with GQA, random bf16 weights, save_pretrained's safetensors
shards; cached) of at least that size, `reshard --world-size 2 --nproc 2` of it plain and with
--adapter hf-to-megatron-gpt; wall, tree CPU, peak RSS, the ratio adapter / plain (the goal: at
most 1.3), the round trip back through megatron-gpt-to-hf checked bit for bit against the folder,
and the stages of one in-process --nproc 1 run of each.

    python scripts/bench.py --megatron-gb 1 --rounds 2

--scale 1040 256 instead prints the scale row (scripts/_bench_scale.py): a synthetic FSDP2 + AdamW
checkpoint of PARAMS parameters over RANKS ranks (DeepSeek-V3-like names, every parameter and moment
cut in row chunks, one per rank, deterministic values; written directly as FileSystemWriter writes
it, cached) read by torch's FileSystemReader.read_metadata and fsdp-convert inspect, and
consolidated by dcp_to_torch_save and consolidate --nproc 1 and 2; wall, peak RSS of the process
tree, time to the first output byte, ratios to torch's rows, and the bitwise check of the .pt files.

    python scripts/bench.py --scale 1040 256 --rounds 2

--warm instead prints the warm-cache table (scripts/_bench_warm.py): `cat` and `cp` of the data
files against consolidate --nproc 1, 2 to disk and to tmpfs, and `inspect`, with tree CPU per GB and
the time to the first output byte; --scaling 1,2,4,8,16 the scaling table of --nproc (OUT on
tmpfs). Both take --checkpoint (any DCP folder instead of the cached sample) and --python (the
command that runs the package from this tree, e.g. "python3"; see scripts/bench_scaling.sh).

    python scripts/bench.py --warm --rounds 2 --checkpoint /tmp/s26/mid/checkpoint
    python3 scripts/bench.py --scaling 1,2,4,8,16 --rounds 2 --checkpoint CK --python python3
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from _bench_measure import MemoryCgroup, Run, drop_cache, find_memory_cgroup, run_measured

ROOT = Path(__file__).resolve().parent.parent
DIM = 1024
GB = 1e9
MiB = 2**20

READ_SCRIPT = """
import os, sys
buf = bytearray(16 << 20)
for path in sys.argv[1:]:
    with open(path, "rb", buffering=0) as f:
        while f.readinto(buf):
            pass
"""
WRITE_SCRIPT = """
import os, sys
path, total = sys.argv[1], int(sys.argv[2])
buf = os.urandom(16 << 20)
with open(path, "wb", buffering=0) as f:
    left = total
    while left > 0:
        left -= f.write(buf[: min(left, len(buf))])
    os.fsync(f.fileno())
"""
DCP_SCRIPT = """
import sys, warnings
warnings.filterwarnings("ignore")
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
dcp_to_torch_save(sys.argv[1], sys.argv[2])
"""
# consolidate_safetensors_files(input_dir, output_dir, fqn_to_index_mapping, num_threads=1): every
# FQN into file 1 (one output file, as fsdp-convert writes); the FQNs come from the shard headers.
# num_threads is left at 1: torch's threads split output files, and there is only one.
HF_SCRIPT = """
import glob, json, os, struct, sys, warnings
warnings.filterwarnings("ignore")
from torch.distributed.checkpoint._consolidate_hf_safetensors import consolidate_safetensors_files
src, dst = sys.argv[1], sys.argv[2]
fqns = {}
for path in glob.glob(os.path.join(src, "*.safetensors")):
    with open(path, "rb") as f:
        header = json.loads(f.read(struct.unpack("<Q", f.read(8))[0]))
    fqns.update(dict.fromkeys((k for k in header if k != "__metadata__"), 1))
os.makedirs(dst, exist_ok=True)
consolidate_safetensors_files(src, dst, fqns)
"""


@dataclass(frozen=True)
class System:
    label: str
    cmd: list[str]
    bytes: int  # what the row converts (all data, or the model only): its GB/s and disk limit
    baseline: str  # the key of the row its "time / torch" divides by
    cgroup: bool = False


def model_shape(size_bytes: float) -> tuple[int, int]:
    """(vocab, layers) of the sample Transformer whose params + AdamW state come to ~size_bytes."""
    params = size_bytes / 12  # fp32 weights, exp_avg, exp_avg_sq
    vocab = int(min(32000, max(1000, params * 0.25 / (2 * DIM))))
    layers = max(1, round((params - 2 * vocab * DIM) / (12 * DIM * DIM)))
    return vocab, layers


def checkpoint_dir(size_gb: float, cache: Path) -> Path:
    vocab, layers = model_shape(size_gb * GB)
    return cache / f"fsdp2-ws4-d{DIM}-v{vocab}-l{layers}" / "checkpoint"


def make_checkpoint(size_gb: float, cache: Path) -> Path:
    vocab, layers = model_shape(size_gb * GB)
    ck = checkpoint_dir(size_gb, cache)
    out = ck.parent
    if (ck / ".metadata").exists():
        return ck
    shutil.rmtree(out, ignore_errors=True)
    print(f"writing a ~{size_gb} GB FSDP2 checkpoint (dim {DIM}, vocab {vocab}, {layers} layers) to {out}", file=sys.stderr)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=4", "-m", "fsdp_convert._sample"]
    cmd += ["--out", str(out), "--dim", str(DIM), "--vocab-size", str(vocab), "--n-layers", str(layers)]
    cmd += ["--steps", "1", "--no-truth"]
    subprocess.run(cmd, check=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    return ck


def make_hf_checkpoint(ck: Path) -> Path:
    """The model of ``ck`` saved by HuggingFaceStorageWriter at world size 4 (cached beside it)."""
    hf = ck.parent / "hf-sharded"
    done = hf / ".complete"
    if done.exists():
        return hf
    shutil.rmtree(hf, ignore_errors=True)
    print(f"re-saving the model of {ck} with HuggingFaceStorageWriter to {hf}", file=sys.stderr)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=4"]
    cmd += [str(Path(__file__).with_name("_bench_hf.py")), str(ck), str(hf)]
    subprocess.run(cmd, check=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    done.touch()
    return hf


def model_bytes_of(ck: Path) -> int:
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    total = 0
    for fqn, md in FileSystemReader(str(ck)).read_metadata().state_dict_metadata.items():
        if fqn.startswith("model.") and isinstance(md, TensorStorageMetadata):
            numel = 1
            for n in md.size:
                numel *= n
            total += numel * md.properties.dtype.itemsize
    return total


def check_room(folder: Path, need_bytes: float, what: str) -> str | None:
    """None if ``folder``'s file system has ``need_bytes`` (+5%) free, else why not."""
    folder.mkdir(parents=True, exist_ok=True)
    free = shutil.disk_usage(folder).free
    if free >= need_bytes * 1.05:
        return None
    return f"not enough disk for {what}: need {need_bytes * 1.05 / GB:.1f} GB, {free / GB:.1f} GB free in {folder}"


def clear(folder: Path) -> None:
    for leftover in folder.iterdir():
        if leftover.is_dir():
            shutil.rmtree(leftover)
        else:
            leftover.unlink()


def build_systems(ck: Path, hf: Path | None, work: Path, data_bytes: int, model_bytes: int, cgroup_mib: int) -> dict[str, System]:
    py = sys.executable
    data_files = sorted(ck.glob("*.distcp"))
    fc = [py, "-m", "fsdp_convert"]
    pt, st = str(work / "full.pt"), str(work / "model.safetensors")
    dcp, dcp_hf = "dcp_to_torch_save", "torch-safetensors"
    systems = {
        "disk-read": System("disk-read", [py, "-c", READ_SCRIPT, *map(str, data_files)], data_bytes, dcp),
        "disk-write": System(
            "disk-write", [py, "-c", WRITE_SCRIPT, str(work / "write-test.bin"), str(data_bytes)], data_bytes, dcp
        ),
        dcp: System(dcp, [py, "-c", DCP_SCRIPT, str(ck), pt], data_bytes, dcp),
    }
    for n in (1, 2, 4):
        systems[f"n{n}"] = System(
            f"fsdp-convert n={n}", [*fc, "consolidate", str(ck), pt, "--nproc", str(n), "--quiet"], data_bytes, dcp
        )
    systems["safetensors"] = System(
        "fsdp-convert safetensors", [*fc, "consolidate", str(ck), st, "--only", "model", "--quiet"], model_bytes, dcp_hf
    )
    if hf is not None:
        hf_cmd = [py, "-c", HF_SCRIPT, str(hf), str(work / "torch-safetensors")]
        systems[dcp_hf] = System("torch consolidate_safetensors_files", hf_cmd, model_bytes, dcp_hf)
    reshard = [*fc, "reshard", str(ck), str(work / "reshard-ws8"), "--world-size", "8"]
    systems["reshard8"] = System("fsdp-convert reshard w=8", reshard, data_bytes, dcp)
    cg_cmd = [*fc, "consolidate", str(ck), pt, "--quiet"]
    systems["cgroup"] = System(f"fsdp-convert n=default in {cgroup_mib}MiB cgroup", cg_cmd, data_bytes, dcp, cgroup=True)
    return systems


ALL_SYSTEMS = "disk-read,disk-write,dcp_to_torch_save,n1,n2,n4,safetensors,torch-safetensors,reshard8,cgroup".split(",")


def measure(system: System, cgroup: tuple[str, Path] | None, limit_bytes: int) -> tuple[Run, str, int]:
    """Run one system; return its run, its result ("ok", "OOM-killed (rc …)", "failed (rc …)") and cgroup peak."""
    if not system.cgroup:
        run = run_measured(system.cmd)
        return run, "ok" if run.returncode == 0 else f"failed (rc {run.returncode})", 0
    assert cgroup is not None
    with MemoryCgroup(*cgroup, limit_bytes) as group:
        run = run_measured(group.wrap(system.cmd))
    if run.returncode == 0:
        return run, "ok", group.peak_bytes
    kind = "OOM-killed" if group.oom_kills else "failed"
    return run, f"{kind} (rc {run.returncode})", group.peak_bytes


def fmt(value: float | None, spec: str = ".2f") -> str:
    return "—" if value is None else format(value, spec)


def bench_systems(args: argparse.Namespace) -> None:
    keys = [k.strip() for k in args.systems.split(",") if k.strip()]
    unknown = [k for k in keys if k not in ALL_SYSTEMS]
    if unknown:
        sys.exit(f"unknown system(s) {', '.join(unknown)}; choose from {','.join(ALL_SYSTEMS)}")
    ck_path = checkpoint_dir(args.size_gb, args.cache)
    cached = (ck_path / ".metadata").exists()
    need = (0 if cached else args.size_gb * GB) + args.size_gb * GB * (1.4 if "torch-safetensors" in keys else 1)
    if why := check_room(args.cache, need, "the checkpoint and the largest output"):
        sys.exit(why)
    ck = make_checkpoint(args.size_gb, args.cache)
    hf = make_hf_checkpoint(ck) if "torch-safetensors" in keys else None
    data_files = sorted(ck.glob("*.distcp"))
    data_bytes = sum(p.stat().st_size for p in data_files)
    model_bytes = model_bytes_of(ck)
    inputs = data_files + (sorted(hf.glob("*.safetensors")) if hf else [])
    work = args.cache / "out"
    work.mkdir(parents=True, exist_ok=True)
    clear(work)
    if why := check_room(work, data_bytes, "the largest output"):
        sys.exit(why)
    systems = {k: s for k, s in build_systems(ck, hf, work, data_bytes, model_bytes, args.cgroup_mib).items() if k in keys}

    skipped: dict[str, str] = {}
    cgroup: tuple[str, Path] | None = None
    if "cgroup" in systems:
        found = find_memory_cgroup()
        if isinstance(found, str):
            skipped["cgroup"] = found
            print(found, file=sys.stderr)
        else:
            cgroup = found
            print(f"memory cgroup {found[0]}: children of {found[1]}, {args.cgroup_mib} MiB, no swap", file=sys.stderr)
    names = [k for k in systems if k not in skipped]
    runs: dict[str, list[tuple[Run, str, int]]] = {k: [] for k in names}
    for r in range(args.rounds):
        order = names[r % len(names) :] + names[: r % len(names)]
        for key in order:
            clear(work)
            drop_cache(inputs)
            run, result, cg_peak = measure(systems[key], cgroup, args.cgroup_mib * MiB)
            runs[key].append((run, result, cg_peak))
            line = (
                f"round {r + 1}: {systems[key].label:40s} {run.wall_s:7.2f} s  peak RSS {run.peak_rss_bytes / 2**30:5.2f} GiB"
                f"  PSS {run.peak_pss_bytes / 2**30:5.2f} GiB"
            )
            print(f"{line}  {result}", file=sys.stderr)
            if result != "ok":
                print(run.stderr_tail, file=sys.stderr)
    clear(work)

    med: dict[str, float | None] = {}
    for key in names:
        ok_walls = [run.wall_s for run, result, _ in runs[key] if result == "ok"]
        med[key] = statistics.median(ok_walls) if ok_walls else None
    read_s, write_s = med.get("disk-read"), med.get("disk-write")
    disk_rate = data_bytes / max(read_s, write_s) if read_s and write_s else None  # bytes/s
    rows = []
    for key, system in systems.items():
        if key in skipped:
            rows.append({"key": key, "system": system.label, "result": skipped[key]})
            continue
        m, base = med[key], med.get(system.baseline)
        results = [result for _, result, _ in runs[key]]
        bad = [x for x in results if x != "ok"]
        row = {
            "key": key,
            "system": system.label,
            "result": "ok" if not bad else f"{bad[0]} in {len(bad)}/{len(results)} runs",
            "bytes": system.bytes,
            "wall_s_median": None if m is None else round(m, 3),
            "wall_s_all": [round(run.wall_s, 3) for run, _, _ in runs[key]],
            "results_all": results,
            "gb_per_s": None if m is None else round(system.bytes / m / GB, 3),
            "peak_rss_bytes": max(run.peak_rss_bytes for run, _, _ in runs[key]),
            "peak_pss_bytes": max(run.peak_pss_bytes for run, _, _ in runs[key]),
            "baseline": system.baseline,
            "time_vs_baseline": None if m is None or not base else round(m / base, 3),
            "time_vs_disk_limit": None if m is None or disk_rate is None else round(m / (system.bytes / disk_rate), 3),
        }
        if system.cgroup:
            row["cgroup_limit_bytes"] = args.cgroup_mib * MiB
            row["cgroup_peak_bytes_incl_page_cache"] = max(p for _, _, p in runs[key])
        rows.append(row)

    print(
        f"\ncheckpoint: {ck} ({data_bytes / GB:.2f} GB in {len(data_files)} data files, world size 4; "
        f"model {model_bytes / GB:.2f} GB), {args.rounds} rounds\n"
    )
    print("| system | result | wall s (median) | GB/s | peak RSS GiB | peak PSS GiB | time / torch | time / disk limit |")
    print("|---|---|---:|---:|---:|---:|---:|---:|")
    for row in rows:
        if "wall_s_median" not in row:
            print(f"| {row['system']} | {row['result']} | — | — | — | — | — |")
            continue
        print(
            f"| {row['system']} | {row['result']} | {fmt(row['wall_s_median'])} | {fmt(row['gb_per_s'])} "
            f"| {row['peak_rss_bytes'] / 2**30:.2f} | {row['peak_pss_bytes'] / 2**30:.2f} "
            f"| {fmt(row['time_vs_baseline'])} | {fmt(row['time_vs_disk_limit'])} |"
        )
    print(
        "\ntime / torch: against dcp_to_torch_save, except the two safetensors rows (model only), against torch "
        "consolidate_safetensors_files. GB/s and the disk limit count the bytes a row converts (the model only for "
        "the safetensors rows)."
    )
    if disk_rate is not None:
        print(f"disk limit = slower of disk-read and disk-write medians = {data_bytes / disk_rate:.2f} s for all data")
    json_out = args.json_out or args.cache / "bench-results.json"
    doc = {
        "checkpoint": str(ck),
        "data_bytes": data_bytes,
        "model_bytes": model_bytes,
        "rounds": args.rounds,
        "disk_limit_s": None if disk_rate is None else data_bytes / disk_rate,
        "rows": rows,
    }
    json_out.write_text(json.dumps(doc, indent=2) + "\n")
    print(f"JSON: {json_out}")


def bench_sizes(args: argparse.Namespace) -> None:
    sizes = [float(s) for s in args.sizes.split(",") if s.strip()]
    work = args.cache / "out"
    rows = []
    for size in sizes:
        cached = (checkpoint_dir(size, args.cache) / ".metadata").exists()
        if why := check_room(args.cache, (0 if cached else size * GB) + size * GB, f"the {size} GB checkpoint and its output"):
            print(f"skipping {size} GB: {why}", file=sys.stderr)
            rows.append({"size_gb": size, "result": f"skipped ({why})"})
            continue
        ck = make_checkpoint(size, args.cache)
        data_files = sorted(ck.glob("*.distcp"))
        data_bytes = sum(p.stat().st_size for p in data_files)
        work.mkdir(parents=True, exist_ok=True)
        cmd = [sys.executable, "-m", "fsdp_convert", "consolidate", str(ck), str(work / "full.pt"), "--quiet"]
        runs = []
        for r in range(args.rounds):
            clear(work)
            drop_cache(data_files)
            run = run_measured(cmd)
            runs.append(run)
            result = "ok" if run.returncode == 0 else f"failed (rc {run.returncode})"
            print(
                f"{size} GB round {r + 1}: {run.wall_s:7.2f} s  peak RSS {run.peak_rss_bytes / MiB:7.0f} MiB  {result}",
                file=sys.stderr,
            )
            if run.returncode != 0:
                print(run.stderr_tail, file=sys.stderr)
        clear(work)
        ok = [run.wall_s for run in runs if run.returncode == 0]
        wall = statistics.median(ok) if ok else None
        rows.append(
            {
                "size_gb": size,
                "checkpoint": str(ck),
                "data_bytes": data_bytes,
                "result": "ok" if len(ok) == len(runs) else f"failed in {len(runs) - len(ok)}/{len(runs)} runs",
                "wall_s_median": None if wall is None else round(wall, 3),
                "wall_s_all": [round(run.wall_s, 3) for run in runs],
                "gb_per_s": None if wall is None else round(data_bytes / wall / GB, 3),
                "peak_rss_bytes": max(run.peak_rss_bytes for run in runs),
                "peak_pss_bytes": max(run.peak_pss_bytes for run in runs),
            }
        )
    print(f"\nfsdp-convert consolidate (default options) to a .pt file, median of {args.rounds} runs, cache dropped before each")
    print()
    print("| checkpoint GB | result | wall s | GB/s | peak RSS MiB (process tree) | peak PSS MiB (process tree) |")
    print("|---:|---|---:|---:|---:|---:|")
    for row in rows:
        if "data_bytes" not in row:
            print(f"| {row['size_gb']:g} | {row['result']} | — | — | — |")
            continue
        print(
            f"| {row['data_bytes'] / GB:.2f} | {row['result']} | {fmt(row['wall_s_median'])} | {fmt(row['gb_per_s'])} "
            f"| {row['peak_rss_bytes'] / MiB:.0f} | {row['peak_pss_bytes'] / MiB:.0f} |"
        )
    json_out = args.json_out or args.cache / "bench-sizes.json"
    json_out.write_text(json.dumps({"rounds": args.rounds, "rows": rows}, indent=2) + "\n")
    print(f"JSON: {json_out}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size-gb", type=float, default=3.4)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--systems", default=",".join(ALL_SYSTEMS), help=f"comma-separated, from {','.join(ALL_SYSTEMS)}")
    parser.add_argument("--cgroup-mib", type=int, default=640, help="memory limit of the cgroup row (default 640)")
    parser.add_argument("--sizes", default=None, help="e.g. 1,4,8: the scaling table of consolidate at these sizes (GB)")
    parser.add_argument("--cache", type=Path, default=ROOT / "bench-cache")
    parser.add_argument("--json-out", type=Path, default=None, help="default: <cache>/bench-results.json (bench-sizes.json)")
    parser.add_argument("--moe-mb", type=int, default=None, help="e.g. 200: the MoE expert-split row (scripts/_bench_moe.py)")
    parser.add_argument("--moe-shape", default="128,64,128", help="E,F,D of the MoE row's expert weights (default 128,64,128)")
    parser.add_argument("--moe-nproc", type=int, default=1, help="--nproc of the MoE row's runs (default 1)")
    parser.add_argument("--deepspeed-gb", type=float, default=None, help="e.g. 1: the ZeRO-3 row (_bench_deepspeed.py)")
    parser.add_argument("--megatron-gb", type=float, default=None, help="e.g. 1: the HF -> Megatron row (_bench_megatron.py)")
    parser.add_argument(
        "--scale",
        type=int,
        nargs=2,
        default=None,
        metavar=("PARAMS", "RANKS"),
        help="e.g. 1040 256: the scale row (_bench_scale.py)",
    )
    parser.add_argument(
        "--scale-rows", default=None, help="--scale: these rows only (default all: read_metadata,inspect,dcp_to_torch_save,n1,n2)"
    )
    parser.add_argument("--warm", action="store_true", help="the warm-cache table (scripts/_bench_warm.py)")
    parser.add_argument("--warm-nproc", default="1,2", help="--nproc values of the warm table's consolidate rows (default 1,2)")
    parser.add_argument("--scaling", default=None, help="e.g. 1,2,4,8,16: the --nproc scaling table, warm cache, OUT on tmpfs")
    parser.add_argument("--checkpoint", type=Path, default=None, help="--warm/--scaling: this DCP folder, not the cached sample")
    parser.add_argument("--python", default=None, help="--warm/--scaling: command running the package from this tree")
    parser.add_argument("--tmpfs", type=Path, default=Path("/dev/shm"), help="--warm/--scaling: a tmpfs folder for OUT")
    parser.add_argument("--out-dir", type=Path, default=None, help="--warm: the disk folder for OUT (default <cache>/out-warm)")
    args = parser.parse_args()
    if args.warm or args.scaling:
        from _bench_warm import bench_scaling, bench_warm

        ck = args.checkpoint.resolve() if args.checkpoint else make_checkpoint(args.size_gb, args.cache)
        (bench_scaling if args.scaling else bench_warm)(args, ck)
    elif args.scale:
        from _bench_scale import bench_scale

        bench_scale(args)
    elif args.megatron_gb:
        from _bench_megatron import bench_megatron

        bench_megatron(args)
    elif args.deepspeed_gb:
        from _bench_deepspeed import bench_deepspeed

        bench_deepspeed(args)
    elif args.moe_mb:
        from _bench_moe import bench_moe

        bench_moe(args)
    elif args.sizes:
        bench_sizes(args)
    else:
        bench_systems(args)


if __name__ == "__main__":
    main()
