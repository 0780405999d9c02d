"""Warm-cache and scaling tables for scripts/bench.py (issue 26): the tool against `cat` and `cp` of the same bytes.

``bench_warm``: with the data files in the page cache (read once before, never dropped), rows run
side by side, ``--rounds`` times in rotating order:
  cat          ``cat`` of the data files to /dev/null (reading the cache)
  cp-disk      ``cp`` of the data files into a folder beside the output, then ``sync`` of the copies
               (an fsync of each; consolidate fsyncs its output too)
  n1-disk ...  ``consolidate --nproc N`` to a .pt in that folder (``--warm-nproc``, default 1,2)
  cp-tmpfs     ``cp`` into a folder on tmpfs (``--tmpfs``, default /dev/shm): no disk at all
  n1-tmpfs ... the same consolidate runs with the .pt on tmpfs
  inspect      ``inspect`` of the checkpoint (metadata only): start-up plus reading .metadata
The table gives, per row, the median wall (min-max), its ratio to cp's (cp + sync for the disk
rows, cp on tmpfs for the tmpfs rows, cp + sync for cat), the CPU seconds of the whole process tree
and per GB of data files, that per-GB cost as a ratio to cp's, and (consolidate and cp rows) the
time from the start to the first data written in the output folder. ``scripts/_bench_tree.py``
says how tree CPU and first byte are measured.

``bench_scaling``: the same warm cache, OUT on tmpfs, cp and ``consolidate --nproc N`` for each N of
``--scaling`` (e.g. 1,2,4,8,16): wall, GB/s, speed-up over the first N, tree CPU per GB, first byte.

Both run the package from this source tree (``PYTHONPATH``) with ``--python`` (default: the Python
running the bench), so they also run where the package is not installed; they import neither
torch nor the package themselves.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import shutil
import statistics
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from _bench_measure import rotating
from _bench_tree import FIRST_BYTE_BYTES, TreeRun, find_cpu_cgroup, run_tree

ROOT = Path(__file__).resolve().parent.parent
GB = 1e9


@dataclass(frozen=True)
class Row:
    key: str
    label: str
    cmd: list[str]
    out: Path | None  # a folder only this row writes in: emptied before each run, watched for the first byte
    reference: str | None  # the key of the cp row its ratios divide by
    per_gb: bool = True  # the row moves the data files' bytes (CPU per GB applies)


def python_command(args: argparse.Namespace) -> list[str]:
    return shlex.split(args.python) if args.python else [sys.executable]


def child_env() -> dict[str, str]:
    """The environment of every measured command: this source tree first on the path, one OpenMP thread."""
    path = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    return {**os.environ, "PYTHONPATH": path, "OMP_NUM_THREADS": "1"}


def build_rows(ck: Path, py: list[str], disk: Path, tmpfs: Path | None, nprocs: list[int], *, inspect: bool) -> dict[str, Row]:
    files = [str(p) for p in sorted(ck.glob("*.distcp"))]
    fc = [*py, "-m", "fsdp_convert"]
    rows: dict[str, Row] = {"cat": Row("cat", "`cat` of the data files > /dev/null", ["cat", *files], None, "cp-disk")}
    places = [("disk", disk)] + ([("tmpfs", tmpfs)] if tmpfs is not None else [])
    for place, folder in places:
        out = folder / f"cp-{place}"
        if place == "disk":
            cp = ["sh", "-c", 'd=$1; shift; cp -- "$@" "$d"/ && sync -- "$d"/*', "sh", str(out), *files]
            rows["cp-disk"] = Row("cp-disk", "`cp` of the data files, then `sync` of the copies", cp, out, "cp-disk")
        else:
            rows["cp-tmpfs"] = Row("cp-tmpfs", "tmpfs: `cp` of the data files", ["cp", "--", *files, str(out)], out, "cp-tmpfs")
        for n in nprocs:
            out = folder / f"n{n}-{place}"
            cmd = [*fc, "consolidate", str(ck), str(out / "full.pt"), "--nproc", str(n), "--quiet"]
            where = "" if place == "disk" else "tmpfs: "
            rows[f"n{n}-{place}"] = Row(f"n{n}-{place}", f"{where}`consolidate --nproc {n}` (.pt)", cmd, out, f"cp-{place}")
    if inspect:
        rows["inspect"] = Row("inspect", "`inspect` (metadata only)", [*fc, "inspect", str(ck)], None, None, per_gb=False)
    return rows


def room_for(folder: Path, need_bytes: int) -> str | None:
    folder.mkdir(parents=True, exist_ok=True)
    free = shutil.disk_usage(folder).free
    if free >= need_bytes * 1.05:
        return None
    return f"{folder}: {free / GB:.2f} GB free, {need_bytes * 1.05 / GB:.2f} GB needed"


def warm_cache(files: list[Path]) -> None:
    """Read every data file once (into the page cache), as a run right after training finds them."""
    subprocess.run(["cat", *map(str, files)], stdout=subprocess.DEVNULL, check=True)


def run_rounds(rows: dict[str, Row], rounds: int, data_bytes: int, files: list[Path]) -> tuple[dict[str, list[TreeRun]], str]:
    """Every row ``rounds`` times in rotating order, the cache warmed first; returns the runs and the CPU method."""
    found = find_cpu_cgroup()
    cgroup = found if isinstance(found, tuple) else None
    method = f"cgroup {found[0]} under {found[1]}" if cgroup else f"rusage of a subreaper (no CPU cgroup: {found})"
    print(f"tree CPU: {method}", file=sys.stderr)
    env = child_env()
    first_byte = min(FIRST_BYTE_BYTES, max(1, data_bytes // 100))
    warm_cache(files)
    names = list(rows)
    runs: dict[str, list[TreeRun]] = {k: [] for k in names}
    for r, key in rotating(names, rounds):
        row = rows[key]
        if row.out is not None:
            shutil.rmtree(row.out, ignore_errors=True)
            row.out.mkdir(parents=True)
        run = run_tree(row.cmd, env=env, cgroup=cgroup, watch=row.out, first_byte_bytes=first_byte)
        if row.out is not None:
            shutil.rmtree(row.out, ignore_errors=True)
        runs[key].append(run)
        fb = "" if run.first_byte_s is None else f"  first byte {run.first_byte_s:6.2f} s"
        status = "ok" if run.returncode == 0 else f"failed (rc {run.returncode})"
        cpu = f"CPU {run.cpu_s:7.2f} s (rusage {run.rusage_cpu_s:.2f})"
        print(f"round {r + 1}: {row.label:52s} {run.wall_s:7.2f} s  {cpu}{fb}  {status}", file=sys.stderr)
        if run.returncode != 0:
            print(run.stderr_tail, file=sys.stderr)
    return runs, method


def _spread(values: list[float], spec: str = ".2f") -> str:
    if not values:
        return "—"
    med = format(statistics.median(values), spec)
    return med if len(values) == 1 else f"{med} ({min(values):{spec}}-{max(values):{spec}})"


def summarize(rows: dict[str, Row], runs: dict[str, list[TreeRun]], data_bytes: int) -> list[dict[str, Any]]:
    """One JSON-ready dict per row: medians of the runs that succeeded, with ratios to the row's reference."""
    gb = data_bytes / GB
    med: dict[str, tuple[float, float] | None] = {}
    for key, row_runs in runs.items():
        ok = [r for r in row_runs if r.returncode == 0]
        med[key] = (statistics.median(r.wall_s for r in ok), statistics.median(r.cpu_s for r in ok)) if ok else None
    out = []
    for key, row in rows.items():
        ok = [r for r in runs[key] if r.returncode == 0]
        bad = len(runs[key]) - len(ok)
        m, ref = med[key], med.get(row.reference) if row.reference else None
        firsts = [r.first_byte_s for r in ok if r.first_byte_s is not None]
        out.append(
            {
                "key": key,
                "row": row.label,
                "command": shlex.join(row.cmd),
                "result": "ok" if not bad else f"failed in {bad}/{len(runs[key])} runs",
                "wall_s_median": None if m is None else round(m[0], 3),
                "wall_s_all": [round(r.wall_s, 3) for r in runs[key]],
                "cpu_s_median": None if m is None else round(m[1], 3),
                "cpu_s_all": [round(r.cpu_s, 3) for r in runs[key]],
                "rusage_cpu_s_all": [round(r.rusage_cpu_s, 3) for r in runs[key]],
                "cpu_method_all": [r.cpu_method for r in runs[key]],
                "cpu_s_per_gb": None if m is None or not row.per_gb else round(m[1] / gb, 3),
                "gb_per_s": None if m is None or not row.per_gb else round(gb / m[0], 3),
                "reference": row.reference,
                "wall_vs_reference": None if m is None or not ref else round(m[0] / ref[0], 3),
                "cpu_per_gb_vs_reference": None if m is None or not ref or not row.per_gb else round(m[1] / ref[1], 3),
                "first_byte_s_median": round(statistics.median(firsts), 3) if firsts else None,
                "first_byte_s_all": [None if r.first_byte_s is None else round(r.first_byte_s, 3) for r in runs[key]],
                "stragglers_max": max((r.stragglers for r in runs[key]), default=0),
            }
        )
    return out


def _fmt(value: object, spec: str = ".2f") -> str:
    return "—" if value is None else format(value, spec)


def warm_table(summary: list[dict[str, Any]], runs: dict[str, list[TreeRun]], data_bytes: int) -> str:
    lines = [
        "| row | result | wall s | x cp | tree CPU s | CPU s per GB | CPU per GB x cp | first byte s |",
        "|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    for row in summary:
        ok = [r for r in runs[str(row["key"])] if r.returncode == 0]
        walls = _spread([r.wall_s for r in ok])
        cpus = _spread([r.cpu_s for r in ok])
        per_gb = _spread([r.cpu_s / (data_bytes / GB) for r in ok]) if row["cpu_s_per_gb"] is not None else "—"
        firsts = _spread([r.first_byte_s for r in ok if r.first_byte_s is not None])
        lines.append(
            f"| {row['row']} | {row['result']} | {walls} | {_fmt(row['wall_vs_reference'])} | {cpus} | {per_gb} "
            f"| {_fmt(row['cpu_per_gb_vs_reference'])} | {firsts} |"
        )
    return "\n".join(lines)


def machine_line(py: list[str]) -> str:
    """Cores, CPU, kernel, and the measured Python's version, torch and CRC-32 modules (one line)."""
    probe = (
        "import importlib.util as u, platform, torch; "
        "crc = ','.join(m for m in ('isal', 'zlib_ng') if u.find_spec(m)) or 'zlib-only'; "
        "print(platform.python_version(), torch.__version__, crc)"
    )
    try:
        got = subprocess.run([*py, "-c", probe], capture_output=True, text=True, timeout=120, env=child_env())
        python, torch, crc = got.stdout.split() if got.returncode == 0 else ("?", "?", "?")
    except (OSError, ValueError, subprocess.TimeoutExpired):
        python, torch, crc = "?", "?", "?"
    model = "?"
    try:
        model = next(
            line.split(":", 1)[1].strip()
            for line in Path("/proc/cpuinfo").read_text().splitlines()
            if line.startswith("model name")
        )
    except (OSError, StopIteration):
        pass
    cores = len(os.sched_getaffinity(0))
    return f"{cores} cores ({model}), Linux {platform.release()}, Python {python}, torch {torch}, CRC-32 modules: {crc}"


def _prepare(args: argparse.Namespace, ck: Path, *, disk_rows: bool) -> tuple[list[Path], int, Path, Path | None, list[str]]:
    """Data files, their bytes, the disk and tmpfs output folders (tmpfs None if too small), why tmpfs is skipped."""
    files = sorted(ck.glob("*.distcp"))
    if not files or not (ck / ".metadata").is_file():
        sys.exit(f"{ck}: not a DCP checkpoint folder (.metadata and *.distcp)")
    data_bytes = sum(p.stat().st_size for p in files)
    disk = (args.out_dir or args.cache / "out-warm").resolve()
    tmpfs: Path | None = args.tmpfs / f"fsdp-convert-bench-{os.getpid()}"
    notes = []
    if disk_rows and (why := room_for(disk, data_bytes)):
        sys.exit(f"not enough room for one output: {why}")
    assert tmpfs is not None
    if why := room_for(tmpfs, data_bytes):
        notes.append(f"tmpfs rows skipped: {why}")
        shutil.rmtree(tmpfs, ignore_errors=True)
        tmpfs = None
    return files, data_bytes, disk, tmpfs, notes


def _finish(doc: dict[str, Any], table: str, header: str, json_out: Path) -> None:
    print(f"\n{header}\n\n{table}\n")
    json_out.parent.mkdir(parents=True, exist_ok=True)
    json_out.write_text(json.dumps(doc, indent=2) + "\n")
    print(f"JSON: {json_out}", file=sys.stderr)


def bench_warm(args: argparse.Namespace, ck: Path) -> None:
    py = python_command(args)
    files, data_bytes, disk, tmpfs, notes = _prepare(args, ck, disk_rows=True)
    nprocs = [int(n) for n in args.warm_nproc.split(",") if n.strip()]
    rows = build_rows(ck, py, disk, tmpfs, nprocs, inspect=True)
    try:
        runs, method = run_rounds(rows, args.rounds, data_bytes, files)
    finally:
        if tmpfs is not None:
            shutil.rmtree(tmpfs, ignore_errors=True)
    summary = summarize(rows, runs, data_bytes)
    header = (
        f"checkpoint: {ck} ({data_bytes / GB:.2f} GB in {len(files)} data files), page cache warm, "
        f"rounds: {args.rounds} (median, min-max); disk OUT {disk}, tmpfs OUT {args.tmpfs}\n"
        f"{machine_line(py)}; tree CPU: {method}" + "".join(f"\n{n}" for n in notes)
    )
    doc = {"checkpoint": str(ck), "data_bytes": data_bytes, "rounds": args.rounds, "cpu_method": method, "rows": summary}
    _finish(doc, warm_table(summary, runs, data_bytes), header, args.json_out or args.cache / "bench-warm.json")


def bench_scaling(args: argparse.Namespace, ck: Path) -> None:
    py = python_command(args)
    files, data_bytes, _, tmpfs, notes = _prepare(args, ck, disk_rows=False)
    if tmpfs is None:
        sys.exit(notes[0])
    nprocs = [int(n) for n in args.scaling.split(",") if n.strip()]
    rows = {k: r for k, r in build_rows(ck, py, tmpfs, tmpfs, nprocs, inspect=False).items() if k.endswith("-tmpfs")}
    try:
        runs, method = run_rounds(rows, args.rounds, data_bytes, files)
    finally:
        shutil.rmtree(tmpfs, ignore_errors=True)
    summary = summarize(rows, runs, data_bytes)
    base = next((row["wall_s_median"] for row in summary if row["key"] != "cp-tmpfs"), None)
    lines = [
        "| row | result | wall s | GB/s | speed-up | tree CPU s per GB | CPU per GB x cp | first byte s |",
        "|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    for row in summary:
        ok = [r for r in runs[str(row["key"])] if r.returncode == 0]
        wall = row["wall_s_median"]
        speed = None if wall is None or base is None or row["key"] == "cp-tmpfs" else base / wall
        row["speed_up"] = None if speed is None else round(speed, 3)
        lines.append(
            f"| {row['row']} | {row['result']} | {_spread([r.wall_s for r in ok])} | {_fmt(row['gb_per_s'])} | {_fmt(speed)} "
            f"| {_spread([r.cpu_s / (data_bytes / GB) for r in ok])} | {_fmt(row['cpu_per_gb_vs_reference'])} "
            f"| {_spread([r.first_byte_s for r in ok if r.first_byte_s is not None])} |"
        )
    header = (
        f"scaling: {ck} ({data_bytes / GB:.2f} GB in {len(files)} data files), page cache warm, OUT on tmpfs ({args.tmpfs}), "
        f"rounds: {args.rounds} (median, min-max); speed-up: wall of --nproc {nprocs[0]} / wall\n"
        f"{machine_line(py)}; tree CPU: {method}"
    )
    doc = {"checkpoint": str(ck), "data_bytes": data_bytes, "rounds": args.rounds, "cpu_method": method, "rows": summary}
    _finish(doc, "\n".join(lines), header, args.json_out or args.cache / "bench-scaling.json")
