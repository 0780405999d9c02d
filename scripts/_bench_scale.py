"""The scale row of scripts/bench.py: a synthetic FSDP2 + AdamW checkpoint of many ranks, index-bound.

``make_scale_checkpoint(params, ranks, cache)`` writes (once, cached) the checkpoint a run of
``params`` parameters over ``ranks`` FSDP2 ranks saves with ``dcp.save``, without running any rank:
``{"model": {fqn: tensor}, "optim": {"state": {fqn: {"step", "exp_avg", "exp_avg_sq"}},
"param_groups": [AdamW's group]}}``. Every parameter and both moments are float32, cut in row
chunks along dim 0, one chunk per rank (rank ``r`` holds rows ``[r*m, (r+1)*m)`` of a tensor of
``ranks * m`` rows, ``m`` 1 or 2); each ``step`` is a 0-dim float32 tensor saved once (on rank
``i % ranks`` for parameter ``i``, as ``dcp.save``'s dedup spreads replicated items); the param
group's values are bytes entries on rank 0. Names and kinds follow torchtitan's DeepSeek-V3 (1040
parameters: the embedding, 61 layers of 17, the final norm and the output; 1-D norms, 2-D
projections, 3-D experts). Values are exact in float32 and the same on every run: parameter ``i``'s
model tensor is ``arange(numel) + i`` (reshaped), ``exp_avg`` that times -0.5, ``exp_avg_sq`` that
plus 0.25, ``step`` ``i + 1``.

The files are what ``FileSystemWriter`` writes: ``__<rank>_0.distcp`` holds that rank's payloads,
each a ``torch.save`` of the chunk (``_write_item``), bytes entries first; ``.metadata`` is
``pickle.dump`` of torch's own ``Metadata`` (``TensorStorageMetadata`` with one
``ChunkStorageMetadata`` per rank, ``BytesStorageMetadata``, ``planner_data`` {fqn: path tuple},
``storage_data`` {``MetadataIndex(fqn, offsets, index)``: ``_StorageInfo(file, offset, length)``},
``StorageMeta``, version ``CURRENT_DCP_VERSION``). The rank files are written by a pool of processes.

``bench_scale(args)`` then alternates, --rounds times in rotating order (page cache warm; each its
own process, under ``_bench_tree.REAPER`` so forkserver workers and orphans stay in the measured
tree):

  read_metadata      torch ``FileSystemReader(ck).read_metadata()``
  inspect            ``fsdp-convert inspect ck --json`` (stdout discarded)
  dcp_to_torch_save  torch ``dcp_to_torch_save(ck, out.pt)``
  n1 / n2            ``fsdp-convert consolidate ck out.pt --nproc 1`` / ``--nproc 2``

Each run records the wall (the command's start to its exit), the peak RSS and PSS of the whole
process tree (sampled from /proc every 20 ms; the reaper's ~10 MiB included) and the time to the
first output byte (the output folder's allocation first passing min(1 MiB, 1% of the model +
optimizer bytes)). Outside the timed runs: consolidate's .pt is compared with dcp_to_torch_save's
bit for bit (the file's bytes, and every tensor's dtype, shape and bytes). Prints the markdown table
(medians; ratios to read_metadata for inspect, to dcp_to_torch_save for the consolidate rows, and
n2 to n1) and writes JSON (default ``<cache>/bench-scale-<params>x<ranks>.json``).

    python scripts/bench.py --scale 1040 256 --rounds 2
"""

from __future__ import annotations

import argparse
import io
import json
import multiprocessing
import os
import pickle
import shutil
import statistics
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from _bench_measure import rotating
from _bench_tree import TreeRun, run_tree

ROOT = Path(__file__).resolve().parent.parent
MiB = 2**20
GB = 1e9
FIRST_BYTE_BYTES = 1 << 20
GENERATOR_VERSION = 1  # bump when the checkpoint's layout or values change (the cache key)

# one DeepSeek-V3 layer under torchtitan: (name, kind); kind "1d" (dim 0 only), "2d" (dim 0, cols), "3d" (dim 0, 2, 16)
LAYER = [
    ("attention_norm.weight", "1d"),
    ("attention.wq_a.weight", "2d"),
    ("attention.q_norm.weight", "1d"),
    ("attention.wq_b.weight", "2d"),
    ("attention.wkv_a.weight", "2d"),
    ("attention.kv_norm.weight", "1d"),
    ("attention.wkv_b.weight", "2d"),
    ("attention.wo.weight", "2d"),
    ("ffn_norm.weight", "1d"),
    ("moe.router.gate.weight", "2d"),
    ("moe.experts.w1", "3d"),
    ("moe.experts.w2", "3d"),
    ("moe.experts.w3", "3d"),
    ("moe.shared_experts.w1.weight", "2d"),
    ("moe.shared_experts.w2.weight", "2d"),
    ("moe.shared_experts.w3.weight", "2d"),
    ("moe.expert_bias", "1d"),
]
MOMENTS = (("exp_avg", -0.5, 0.0), ("exp_avg_sq", 1.0, 0.25))  # (key, scale, shift) of the model values
PARAM_GROUP: dict[str, Any] = {
    "lr": 2.2e-4,
    "betas": (0.9, 0.95),
    "eps": 1e-8,
    "weight_decay": 0.1,
    "amsgrad": False,
    "foreach": None,
    "maximize": False,
    "capturable": False,
    "differentiable": False,
    "fused": None,
    "decoupled_weight_decay": True,
}


@dataclass(frozen=True)
class Param:
    """One parameter: its fqn, global shape (elements; dim 0 = ranks * rows_per_rank) and rows per rank."""

    index: int
    fqn: str
    shape: tuple[int, ...]
    rows_per_rank: int


def param_table(params: int, ranks: int) -> list[Param]:
    """The ``params`` parameters of the synthetic model over ``ranks`` ranks, in state-dict order."""
    names = [("tok_embeddings.weight", "2d")]
    layer = 0
    while len(names) < max(0, params - 2):
        names += [(f"layers.{layer}.{n}", k) for n, k in LAYER]
        layer += 1
    names = names[: max(1, params - 2)] + [("norm.weight", "1d"), ("output.weight", "2d")]
    names = names[:params]
    table = []
    for i, (fqn, kind) in enumerate(names):
        m = 1 + i % 2
        cols = 32 if i % 3 else 64
        shape = (ranks * m,) if kind == "1d" else (ranks * m, cols) if kind == "2d" else (ranks * m, 2, 16)
        table.append(Param(i, fqn, shape, m))
    return table


def _values(p: Param, rows: range, scale: float, shift: float) -> Any:
    """Rows ``rows`` of parameter ``p``'s tensor of the given moment (scale 1, shift 0: the model)."""
    import torch

    row_elems = 1
    for d in p.shape[1:]:
        row_elems *= d
    flat = torch.arange(rows.start * row_elems, rows.stop * row_elems, dtype=torch.float32) + p.index
    return (flat * scale + shift).reshape((len(rows), *p.shape[1:]))


def _payload(obj: Any) -> bytes:
    import torch

    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def _write_rank(job: tuple[Path, int, int, int]) -> list[tuple[str, int, int, int]]:
    """Write rank ``rank``'s data file; returns its payloads as (fqn, chunk index, offset, length)."""
    folder, params, ranks, rank = job
    import torch

    torch.set_num_threads(1)
    rows: list[tuple[str, int, int, int]] = []
    with open(folder / f"__{rank}_0.distcp", "wb") as f:

        def put(fqn: str, data: bytes, index: int) -> None:
            rows.append((fqn, index, f.tell(), len(data)))
            f.write(data)

        if rank == 0:
            table = param_table(params, ranks)
            for key, value in PARAM_GROUP.items():
                put(f"optim.param_groups.0.{key}", _payload(value), -1)
            put("optim.param_groups.0.params", _payload([p.fqn for p in table]), -1)
        for p in param_table(params, ranks):
            span = range(rank * p.rows_per_rank, (rank + 1) * p.rows_per_rank)
            put(f"model.{p.fqn}", _payload(_values(p, span, 1.0, 0.0)), rank)
            if p.index % ranks == rank:
                put(f"optim.state.{p.fqn}.step", _payload(torch.tensor(float(p.index + 1))), 0)
            for key, scale, shift in MOMENTS:
                put(f"optim.state.{p.fqn}.{key}", _payload(_values(p, span, scale, shift)), rank)
    return rows


def make_scale_checkpoint(params: int, ranks: int, cache: Path, workers: int | None = None) -> Path:
    """The cached synthetic checkpoint of ``params`` parameters over ``ranks`` ranks, written if missing.

    Returns:
        The DCP folder (``.metadata``, ``__0_0.distcp`` ... ``__<ranks-1>_0.distcp``).
    """
    import torch
    from torch.distributed.checkpoint.filesystem import CURRENT_DCP_VERSION, _StorageInfo
    from torch.distributed.checkpoint.metadata import (
        BytesStorageMetadata,
        ChunkStorageMetadata,
        Metadata,
        MetadataIndex,
        StorageMeta,
        TensorProperties,
        TensorStorageMetadata,
    )

    ck = cache / f"scale-p{params}-r{ranks}-v{GENERATOR_VERSION}"
    if (ck / ".complete").exists():
        return ck
    shutil.rmtree(ck, ignore_errors=True)
    ck.mkdir(parents=True)
    start = time.monotonic()
    table = param_table(params, ranks)
    jobs = [(ck, params, ranks, r) for r in range(ranks)]
    n = workers or os.cpu_count() or 1
    with multiprocessing.get_context("fork").Pool(n) as pool:
        per_rank = pool.map(_write_rank, jobs, chunksize=max(1, ranks // (4 * n)))

    props = TensorProperties(dtype=torch.float32)
    sdm: dict[str, Any] = {}
    planner: dict[str, tuple[Any, ...]] = {}
    for p in table:
        m = p.rows_per_rank
        rest = (0,) * (len(p.shape) - 1)
        chunks = [ChunkStorageMetadata(torch.Size((r * m, *rest)), torch.Size((m, *p.shape[1:]))) for r in range(ranks)]
        sdm[f"model.{p.fqn}"] = TensorStorageMetadata(props, torch.Size(p.shape), chunks)
        planner[f"model.{p.fqn}"] = ("model", p.fqn)
    for p in table:
        m = p.rows_per_rank
        rest = (0,) * (len(p.shape) - 1)
        sdm[f"optim.state.{p.fqn}.step"] = TensorStorageMetadata(
            props, torch.Size(()), [ChunkStorageMetadata(torch.Size(()), torch.Size(()))]
        )
        planner[f"optim.state.{p.fqn}.step"] = ("optim", "state", p.fqn, "step")
        for key, _, _ in MOMENTS:
            chunks = [ChunkStorageMetadata(torch.Size((r * m, *rest)), torch.Size((m, *p.shape[1:]))) for r in range(ranks)]
            sdm[f"optim.state.{p.fqn}.{key}"] = TensorStorageMetadata(props, torch.Size(p.shape), chunks)
            planner[f"optim.state.{p.fqn}.{key}"] = ("optim", "state", p.fqn, key)
    for key in [*PARAM_GROUP, "params"]:
        sdm[f"optim.param_groups.0.{key}"] = BytesStorageMetadata()
        planner[f"optim.param_groups.0.{key}"] = ("optim", "param_groups", 0, key)

    storage: dict[Any, Any] = {}
    for rank, rows in enumerate(per_rank):
        relative = f"__{rank}_0.distcp"
        for fqn, index, offset, length in rows:
            if index < 0:
                where = MetadataIndex(fqn)
            else:
                chunk = sdm[fqn].chunks[index]
                where = MetadataIndex(fqn, chunk.offsets, index)
            storage[where] = _StorageInfo(relative, offset, length)
    save_id = str(uuid.uuid5(uuid.NAMESPACE_URL, f"fsdp-convert-bench-scale/{params}/{ranks}/{GENERATOR_VERSION}"))
    md = Metadata(
        state_dict_metadata=sdm,
        planner_data=planner,
        storage_data=storage,
        storage_meta=StorageMeta(checkpoint_id=ck, save_id=save_id),
        version=CURRENT_DCP_VERSION,
    )
    with open(ck / ".metadata", "wb") as f:
        pickle.dump(md, f)
    os.sync()
    (ck / ".complete").touch()
    data = sum(p.stat().st_size for p in ck.glob("*.distcp"))
    print(
        f"wrote {ck}: {len(storage)} records, .metadata {(ck / '.metadata').stat().st_size / MiB:.1f} MiB, "
        f"{data / MiB:.0f} MiB of data, in {time.monotonic() - start:.1f} s",
        file=sys.stderr,
        flush=True,
    )
    return ck


def tensor_bytes(params: int, ranks: int) -> int:
    """Bytes of every tensor the checkpoint holds (model, both moments, steps), as consolidated."""
    total = 0
    for p in param_table(params, ranks):
        n = 1
        for d in p.shape:
            n *= d
        total += 3 * 4 * n + 4
    return total


# ---------------------------------------------------------------- measuring


def measure(cmd: list[str], env: dict[str, str], watch: Path | None, first_byte_bytes: int) -> TreeRun:
    """Run ``cmd`` under ``_bench_tree.REAPER`` (a subreaper), its tree's RSS sampled, ``watch`` polled for the first byte."""
    return run_tree(cmd, env=env, cgroup=None, watch=watch, first_byte_bytes=first_byte_bytes, sample_memory=True)


READ_METADATA = """import sys
from torch.distributed.checkpoint import FileSystemReader
FileSystemReader(sys.argv[1]).read_metadata()
"""
DCP_TO_TORCH = """import sys
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
dcp_to_torch_save(sys.argv[1], sys.argv[2])
"""

# argv: two .pt files. Prints one JSON object: same file bytes, and every tensor equal bit for bit.
COMPARE = """
import filecmp, json, sys, torch
a, b = (torch.load(p, weights_only=True, mmap=True) for p in sys.argv[1:3])
fa, fb = {}, {}
def flat(x, pre, out):
    if isinstance(x, dict):
        for k, v in x.items():
            flat(v, f"{pre}{k}.", out)
    elif isinstance(x, (list, tuple)) and x and not isinstance(x[0], str):
        for i, v in enumerate(x):
            flat(v, f"{pre}{i}.", out)
    else:
        out[pre[:-1]] = x
flat(a, "", fa); flat(b, "", fb)
bad = [k for k in fa if k not in fb or type(fa[k]) is not type(fb[k]) or (
    torch.is_tensor(fa[k]) and not (fa[k].dtype == fb[k].dtype and fa[k].shape == fb[k].shape
    and torch.equal(fa[k].reshape(-1).view(torch.uint8), fb[k].reshape(-1).view(torch.uint8))))
    or (not torch.is_tensor(fa[k]) and fa[k] != fb[k])]
print(json.dumps({"entries": len(fa), "tensors": sum(torch.is_tensor(v) for v in fa.values()),
    "equal": not bad and set(fa) == set(fb), "mismatched": bad[:10], "extra": sorted(set(fb) - set(fa))[:10],
    "same_file_bytes": filecmp.cmp(sys.argv[1], sys.argv[2], shallow=False)}))
"""


@dataclass(frozen=True)
class System:
    key: str
    label: str
    cmd: list[str]
    out: Path | None  # a folder only this system writes in: emptied before each run, watched for the first byte
    reference: str | None  # the row its ratios are to


def systems(ck: Path, scratch: Path) -> dict[str, System]:
    py = sys.executable
    fc = [py, "-m", "fsdp_convert"]
    rows = [
        System("read_metadata", "torch `FileSystemReader.read_metadata`", [py, "-c", READ_METADATA, str(ck)], None, None),
        System("inspect", "fsdp-convert `inspect --json`", [*fc, "inspect", str(ck), "--json"], None, "read_metadata"),
        System(
            "dcp_to_torch_save",
            "torch `dcp_to_torch_save`",
            [py, "-c", DCP_TO_TORCH, str(ck), str(scratch / "torch" / "full.pt")],
            scratch / "torch",
            None,
        ),
    ]
    for n in (1, 2):
        out = scratch / f"n{n}"
        cmd = [*fc, "consolidate", str(ck), str(out / "full.pt"), "--nproc", str(n), "--quiet"]
        rows.append(System(f"n{n}", f"fsdp-convert `consolidate --nproc {n}`", cmd, out, "dcp_to_torch_save"))
    return {s.key: s for s in rows}


def child_env() -> dict[str, str]:
    path = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    return {**os.environ, "PYTHONPATH": path, "OMP_NUM_THREADS": "1"}


def reset(folder: Path | None) -> None:
    if folder is not None:
        shutil.rmtree(folder, ignore_errors=True)
        folder.mkdir(parents=True)


def _fmt(value: float | None, spec: str = ".2f") -> str:
    return "-" if value is None else format(value, spec)


def bench_scale(args: argparse.Namespace) -> None:
    params, ranks = args.scale
    cache: Path = args.cache
    ck = make_scale_checkpoint(params, ranks, cache)
    md_bytes = (ck / ".metadata").stat().st_size
    files = sorted(ck.glob("*.distcp"))
    data_bytes = sum(p.stat().st_size for p in files)
    records = 3 * params * ranks + params + len(PARAM_GROUP) + 1  # chunks, steps, the param group's bytes
    out_bytes = tensor_bytes(params, ranks)
    scratch = cache / f"scale-out-{os.getpid()}"
    rows = systems(ck, scratch)
    if args.scale_rows:  # e.g. at 1024 ranks, without torch's hour-long dcp_to_torch_save
        chosen = args.scale_rows.split(",")
        if not set(chosen) <= set(rows):
            raise SystemExit(f"--scale-rows: rows are {','.join(rows)}")
        rows = {k: v for k, v in rows.items() if k in chosen}
    env = child_env()
    for f in files + [ck / ".metadata"]:  # warm the page cache once
        with open(f, "rb") as fh:
            while fh.read(64 * MiB):
                pass
    first_byte = min(FIRST_BYTE_BYTES, max(1, out_bytes // 100))
    runs: dict[str, list[TreeRun]] = {k: [] for k in rows}
    order = list(rows)
    try:
        for rnd, key in rotating(order, args.rounds):
            row = rows[key]
            reset(row.out)
            run = measure(row.cmd, env, row.out, first_byte)
            runs[key].append(run)
            status = "ok" if run.returncode == 0 else f"rc {run.returncode}: {run.stderr_tail.strip()[-400:]}"
            print(
                f"round {rnd + 1} {key:18s} {run.wall_s:8.2f} s  tree RSS {run.peak_rss_bytes / MiB:7.0f} MiB"
                f"  first byte {_fmt(run.first_byte_s)} s  {status}",
                file=sys.stderr,
                flush=True,
            )
        # the bitwise check, untimed: both outputs of the last round are still there
        compare: dict[str, Any] = {}
        want = scratch / "torch" / "full.pt"
        for n in (1, 2):
            if f"n{n}" not in rows:
                continue
            got = scratch / f"n{n}" / "full.pt"
            if want.exists() and got.exists():
                done = subprocess.run(
                    [sys.executable, "-c", COMPARE, str(want), str(got)], capture_output=True, text=True, env=env
                )
                compare[f"n{n}"] = json.loads(done.stdout) if done.returncode == 0 else {"error": done.stderr[-1000:]}
            else:
                compare[f"n{n}"] = {"error": "an output is missing"}
    finally:
        shutil.rmtree(scratch, ignore_errors=True)

    summary: dict[str, dict[str, Any]] = {}
    for key, row in rows.items():
        ok = [r for r in runs[key] if r.returncode == 0]
        firsts = [r.first_byte_s for r in ok if r.first_byte_s is not None]
        summary[key] = {
            "label": row.label,
            "result": "ok" if ok and len(ok) == len(runs[key]) else f"{len(runs[key]) - len(ok)} failed",
            "wall_s_median": round(statistics.median(r.wall_s for r in ok), 3) if ok else None,
            "wall_s_all": [round(r.wall_s, 3) for r in runs[key]],
            "peak_rss_bytes": int(statistics.median(r.peak_rss_bytes for r in ok)) if ok else None,
            "peak_pss_bytes": int(statistics.median(r.peak_pss_bytes for r in ok)) if ok else None,
            "first_byte_s_median": round(statistics.median(firsts), 3) if firsts else None,
            "stderr_tail": None if ok else runs[key][-1].stderr_tail,
        }
    for key, row in rows.items():
        ref = summary.get(row.reference) if row.reference else None
        mine = summary[key]
        for what in ("wall_s_median", "peak_rss_bytes"):
            ratio = None
            if ref and mine[what] and ref[what]:
                ratio = round(mine[what] / ref[what], 3)
            mine[f"{what}_vs_reference"] = ratio
    if "n1" in summary and "n2" in summary and summary["n1"]["wall_s_median"] and summary["n2"]["wall_s_median"]:
        summary["n2"]["wall_vs_n1"] = round(summary["n2"]["wall_s_median"] / summary["n1"]["wall_s_median"], 3)
        summary["n2"]["rss_vs_n1"] = round(summary["n2"]["peak_rss_bytes"] / summary["n1"]["peak_rss_bytes"], 3)

    header = (
        f"{params} parameters x AdamW over {ranks} ranks: {records} records, .metadata {md_bytes / MiB:.1f} MiB, "
        f"{data_bytes / MiB:.0f} MiB of data ({len(files)} files), {out_bytes / MiB:.1f} MiB of tensors; "
        f"{args.rounds} round(s), page cache warm, {os.cpu_count()} cores"
    )
    lines = [
        header,
        "",
        "| row | result | wall s | x ref | tree peak RSS MiB | x ref | tree PSS MiB | first byte s |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for s in summary.values():
        rss = s["peak_rss_bytes"]
        pss = s["peak_pss_bytes"]
        lines.append(
            f"| {s['label']} | {s['result']} | {_fmt(s['wall_s_median'])} | {_fmt(s['wall_s_median_vs_reference'])} "
            f"| {_fmt(rss / MiB if rss else None, '.0f')} | {_fmt(s['peak_rss_bytes_vs_reference'])} "
            f"| {_fmt(pss / MiB if pss else None, '.0f')} | {_fmt(s['first_byte_s_median'])} |"
        )
    n2 = summary.get("n2", {})
    lines += [
        "",
        "x ref: inspect to read_metadata, consolidate to dcp_to_torch_save. "
        f"--nproc 2 / --nproc 1: wall {_fmt(n2.get('wall_vs_n1'))}, tree RSS {_fmt(n2.get('rss_vs_n1'))}.",
        "bitwise vs dcp_to_torch_save: "
        + ", ".join(
            f"n{n} "
            + (
                f"{'equal' if c.get('equal') else 'DIFFERENT'} ({c.get('tensors')} tensors, file bytes "
                f"{'same' if c.get('same_file_bytes') else 'differ'})"
                if "error" not in c
                else f"not checked ({c['error'][-200:]})"
            )
            for n, c in ((int(k[1:]), c) for k, c in compare.items())
        ),
    ]
    table = "\n".join(lines)
    print(table)
    json_out = args.json_out or cache / f"bench-scale-{params}x{ranks}.json"
    doc = {
        "params": params,
        "ranks": ranks,
        "records": records,
        "metadata_bytes": md_bytes,
        "data_bytes": data_bytes,
        "tensor_bytes": out_bytes,
        "rounds": args.rounds,
        "rows": summary,
        "bitwise": compare,
        "table": table,
    }
    json_out.parent.mkdir(parents=True, exist_ok=True)
    json_out.write_text(json.dumps(doc, indent=2) + "\n")
    print(f"JSON: {json_out}")
