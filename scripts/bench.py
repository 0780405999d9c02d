#!/usr/bin/env python
"""Benchmark: consolidating a real FSDP2 checkpoint, against torch's dcp_to_torch_save and the disk.

Writes (once, cached in bench-cache/) a DCP checkpoint of about --size-gb from real FSDP2 training
at world size 4 under torchrun, then alternates, --rounds times and in rotating order:
  disk-read    read every data file (the read limit)
  disk-write   write as many bytes to the output folder, with fsync (the write limit)
  dcp_to_torch_save   torch.distributed.checkpoint.format_utils.dcp_to_torch_save
  fsdp-convert n=1 / n=2   fsdp-convert consolidate --nproc 1 / 2
Each system runs as its own process; before each run the data files are dropped from the page
cache (posix_fadvise DONTNEED), so every system reads from the disk. Peak RSS is of the whole
process tree (sampled from /proc every 20 ms). Prints a markdown table of medians with ratios to
dcp_to_torch_save and to the disk limit (the slower of read and write), and writes it as JSON.

    python scripts/bench.py --size-gb 3.4 --rounds 3
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PAGE = os.sysconf("SC_PAGE_SIZE")
DIM = 1024

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


def model_shape(size_bytes: float) -> tuple[int, int]:
    """(vocab, layers) of the sample Transformer whose params + AdamW state come to ~size_bytes."""
    params = size_bytes / 12  # fp32 weights, exp_avg, exp_avg_sq
    vocab = int(min(32000, max(1000, params * 0.25 / (2 * DIM))))
    layers = max(1, round((params - 2 * vocab * DIM) / (12 * DIM * DIM)))
    return vocab, layers


def make_checkpoint(size_gb: float, cache: Path) -> Path:
    vocab, layers = model_shape(size_gb * 1e9)
    out = cache / f"fsdp2-ws4-d{DIM}-v{vocab}-l{layers}"
    ck = out / "checkpoint"
    if (ck / ".metadata").exists():
        return ck
    shutil.rmtree(out, ignore_errors=True)
    print(f"writing a ~{size_gb} GB FSDP2 checkpoint (dim {DIM}, vocab {vocab}, {layers} layers) to {out}", file=sys.stderr)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=4", "-m", "fsdp_convert._sample"]
    cmd += ["--out", str(out), "--dim", str(DIM), "--vocab-size", str(vocab), "--n-layers", str(layers)]
    cmd += ["--steps", "1", "--no-truth"]
    subprocess.run(cmd, check=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    return ck


def drop_cache(paths: list[Path]) -> None:
    for path in paths:
        if path.exists():
            fd = os.open(path, os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def _tree_rss(root: int) -> int:
    parents: dict[int, int] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    parents[int(entry)] = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                pass
    tree, frontier = {root}, [root]
    while frontier:
        pid = frontier.pop()
        kids = [p for p, pp in parents.items() if pp == pid and p not in tree]
        tree.update(kids)
        frontier.extend(kids)
    total = 0
    for pid in tree:
        try:
            with open(f"/proc/{pid}/statm") as f:
                total += int(f.read().split()[1]) * PAGE
        except (OSError, IndexError, ValueError):
            pass
    return total


def run_measured(cmd: list[str]) -> tuple[float, int]:
    """Run ``cmd``; return (wall seconds, peak RSS of its process tree in bytes)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    start = time.monotonic()
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    peak = 0
    done = threading.Event()

    def sample() -> None:
        nonlocal peak
        while not done.is_set():
            peak = max(peak, _tree_rss(proc.pid))
            done.wait(0.02)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    _, err = proc.communicate()
    wall = time.monotonic() - start
    done.set()
    sampler.join()
    if proc.returncode != 0:
        raise RuntimeError(f"{cmd[:4]}... failed ({proc.returncode}): {err.decode()[-2000:]}")
    return wall, peak


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size-gb", type=float, default=3.4)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--cache", type=Path, default=ROOT / "bench-cache")
    parser.add_argument("--json-out", type=Path, default=None, help="default: <cache>/bench-results.json")
    args = parser.parse_args()

    ck = make_checkpoint(args.size_gb, args.cache)
    data_files = sorted(ck.glob("*.distcp"))
    data_bytes = sum(p.stat().st_size for p in data_files)
    work = args.cache / "out"
    work.mkdir(parents=True, exist_ok=True)
    out_pt = work / "full.pt"
    py = sys.executable
    systems: dict[str, list[str]] = {
        "disk-read": [py, "-c", READ_SCRIPT, *map(str, data_files)],
        "disk-write": [py, "-c", WRITE_SCRIPT, str(work / "write-test.bin"), str(data_bytes)],
        "dcp_to_torch_save": [py, "-c", DCP_SCRIPT, str(ck), str(out_pt)],
        "fsdp-convert n=1": [py, "-m", "fsdp_convert", "consolidate", str(ck), str(out_pt), "--nproc", "1", "--quiet"],
        "fsdp-convert n=2": [py, "-m", "fsdp_convert", "consolidate", str(ck), str(out_pt), "--nproc", "2", "--quiet"],
    }
    results: dict[str, list[tuple[float, int]]] = {name: [] for name in systems}
    names = list(systems)
    for r in range(args.rounds):
        order = names[r % len(names) :] + names[: r % len(names)]
        for name in order:
            for leftover in work.iterdir():
                leftover.unlink()
            drop_cache(data_files)
            wall, peak = run_measured(systems[name])
            results[name].append((wall, peak))
            print(f"round {r + 1}: {name:18s} {wall:7.2f} s  peak RSS {peak / 2**30:5.2f} GiB", file=sys.stderr)
    for leftover in work.iterdir():
        leftover.unlink()

    med = {n: statistics.median(w for w, _ in runs) for n, runs in results.items()}
    peak = {n: max(p for _, p in runs) for n, runs in results.items()}
    disk_limit = max(med["disk-read"], med["disk-write"])
    rows = []
    for name in names:
        rows.append(
            {
                "system": name,
                "wall_s_median": round(med[name], 3),
                "wall_s_all": [round(w, 3) for w, _ in results[name]],
                "gb_per_s": round(data_bytes / med[name] / 1e9, 3),
                "peak_rss_bytes": peak[name],
                "time_vs_dcp_to_torch_save": round(med[name] / med["dcp_to_torch_save"], 3),
                "time_vs_disk_limit": round(med[name] / disk_limit, 3),
            }
        )
    print(f"\ncheckpoint: {ck} ({data_bytes / 1e9:.2f} GB in {len(data_files)} data files, world size 4), {args.rounds} rounds\n")
    print("| system | wall s (median) | GB/s | peak RSS GiB | time / dcp_to_torch_save | time / disk limit |")
    print("|---|---:|---:|---:|---:|---:|")
    for row in rows:
        print(
            f"| {row['system']} | {row['wall_s_median']:.2f} | {row['gb_per_s']:.2f} | {row['peak_rss_bytes'] / 2**30:.2f} "
            f"| {row['time_vs_dcp_to_torch_save']:.2f} | {row['time_vs_disk_limit']:.2f} |"
        )
    print(f"\ndisk limit = slower of disk-read and disk-write medians = {disk_limit:.2f} s")
    json_out = args.json_out or args.cache / "bench-results.json"
    doc = {"checkpoint": str(ck), "data_bytes": data_bytes, "rounds": args.rounds, "disk_limit_s": disk_limit, "rows": rows}
    json_out.write_text(json.dumps(doc, indent=2) + "\n")
    print(f"JSON: {json_out}")


if __name__ == "__main__":
    main()
