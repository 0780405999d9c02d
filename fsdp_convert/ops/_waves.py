"""Folder outputs to object storage in waves of files: each wave's workers run, then its files go up as the next is written.

A local output never comes here. For an output folder at a URL (an HF folder of several shards;
a reshard's rank files, uncompressed), ``consolidate`` and ``reshard`` cut their plan into waves
of whole output files (``plan.WAVE_BYTES`` each, or one larger file), launch their workers once
per wave over that wave's files only (the wave's tensors striped or balanced over all the workers
anew), and hand each finished wave to ``remote.upload_in_waves``, which uploads and deletes it
while the next wave is written. What stays in the local temporary (an HF index, ``.metadata``,
copied assets) is uploaded last, as for any remote output.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

from fsdp_convert.launch import Cluster, run_ranks
from fsdp_convert.plan.consolidate import WAVE_BYTES, WorkPlan, group_waves, output_bytes, staging_bytes, wave_plans
from fsdp_convert.plan.reshard import ReshardPlan, rank_file_bytes, wave_plan
from fsdp_convert.remote import Url, upload_in_waves
from fsdp_convert.writers.dcp import rank_filename

__all__ = ["consolidate_in_waves", "consolidate_staging_bytes", "reshard_in_waves", "reshard_staging_bytes"]

RankFn = Callable[[Any, int, int, Any], Any]  # a ``launch.run_ranks`` function: (job, rank, world_size, group)
Plans = tuple[tuple[str, ReshardPlan], ...]  # reshard's (folder relative to the output, its plan)


def consolidate_staging_bytes(plan: WorkPlan) -> int:
    """Local bytes ``consolidate_in_waves`` needs for ``plan``: two waves (``plan.consolidate.staging_bytes``)."""
    return staging_bytes([output_bytes(wave) for wave in wave_plans(plan, WAVE_BYTES)])


def consolidate_in_waves(rank_fn: RankFn, job: Any, url: Url, cluster: Cluster | None) -> int:
    """Run a consolidation of a folder to ``url`` wave by wave, uploading each wave's files while the next is written.

    Args:
        rank_fn: ``consolidate``'s rank function.
        job: its job (a dataclass with ``plan: WorkPlan``, ``tmp_output: Path`` and ``index: bool``);
            each wave runs it with the wave's plan and without the folder's index (the caller
            writes it once every wave is up).
        url: the output folder's URL.
        cluster: as for ``launch.run_ranks``.

    Returns:
        The bytes uploaded.

    Raises:
        As ``launch.run_ranks`` and ``remote.upload_in_waves``.
    """
    writes = [
        (
            partial(run_ranks, rank_fn, dataclasses.replace(job, plan=wave, index=False), wave.nproc, cluster),
            tuple(file.filename or "" for file in wave.files),
        )
        for wave in wave_plans(job.plan, WAVE_BYTES)
    ]
    _, uploaded = upload_in_waves(job.tmp_output, url, writes)
    return uploaded


@dataclass(frozen=True, slots=True, kw_only=True)
class _RankWave:
    """Some rank files of a reshard output: ``files`` as (folder index, target rank), their names, the plans to write them."""

    files: frozenset[tuple[int, int]]
    names: tuple[str, ...]
    plans: Plans
    nbytes: int


def _rank_waves(plans: Plans, wave_bytes: int) -> list[_RankWave]:
    """Every folder's rank files, in order, cut into waves (``plan.consolidate.group_waves``), each balanced anew."""
    sizes = [rank_file_bytes(plan) for _, plan in plans]
    files = [(p, rank) for p, size in enumerate(sizes) for rank in sorted(size)]
    waves = []
    for wave in group_waves([sizes[p][rank] for p, rank in files], wave_bytes):
        chosen = frozenset(files[k] for k in wave)
        waves.append(
            _RankWave(
                files=chosen,
                names=tuple((Path(plans[p][0]) / rank_filename(rank)).as_posix() for p, rank in sorted(chosen)),
                plans=tuple(
                    (sub, wave_plan(plan, frozenset(r for q, r in chosen if q == p))) for p, (sub, plan) in enumerate(plans)
                ),
                nbytes=sum(sizes[p][rank] for p, rank in chosen),
            )
        )
    return waves


def reshard_staging_bytes(plans: Plans) -> int:
    """Local bytes ``reshard_in_waves`` needs for ``plans``: two waves of rank files (``plan.consolidate.staging_bytes``)."""
    return staging_bytes([wave.nbytes for wave in _rank_waves(plans, WAVE_BYTES)])


def reshard_in_waves(
    rank_fn: RankFn, job: Any, workers: int, cluster: Cluster | None, url: Url | None
) -> tuple[bool, dict[str, list[Any]], int]:
    """Run a reshard's workers: for a local folder (``url`` None) at once; for ``url`` in waves of rank files, each uploaded.

    Args:
        rank_fn: ``reshard``'s rank function.
        job: its job (a dataclass with ``plans``, ``tmp_output: Path`` and ``files``, the (folder
            index, target rank) data files a run writes); each wave runs it with the wave's plans
            and files, rank 0's values going with rank 0's file.
        workers: workers (per wave).
        cluster: as for ``launch.run_ranks`` (None for a URL: one node writes it).
        url: the output folder's URL, or None for a local output (``run_ranks`` once, nothing uploaded).

    Returns:
        Whether this process holds rank 0, rank 0's values per folder as ``run_ranks`` gives them
        for the whole output, and the bytes uploaded.

    Raises:
        As ``launch.run_ranks`` and ``remote.upload_in_waves``.
    """
    if url is None:
        owner, values = run_ranks(rank_fn, job, workers, cluster)
        return owner, values, 0
    writes = [
        (partial(run_ranks, rank_fn, dataclasses.replace(job, plans=wave.plans, files=wave.files), workers, cluster), wave.names)
        for wave in _rank_waves(job.plans, WAVE_BYTES)
    ]
    results, uploaded = upload_in_waves(job.tmp_output, url, writes)
    values = {sub: [row for _, wave_values in results for row in wave_values[sub]] for sub, _ in job.plans}
    return True, values, uploaded
