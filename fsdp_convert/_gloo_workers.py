"""Launch stage, gloo workers: a worker in a gloo process group, started by torch's elastic launcher or the user's torchrun.

Across nodes, or under the user's own torchrun, every worker joins a gloo process group on CPU
and meets its peers in a ``GlooGroup`` (the small records rank 0 gathers, as JSON in uint8
tensors). ``worker_main`` is the elastic launcher's entry point for a worker ``launch`` started
(``WorkerCall``: the job and the caller's environment); ``run_in_place`` runs this process as its
rank of a job torchrun started. A connection lost to a peer, or any other failure of the group, is
a ``WorkerFailedError`` naming the rank. torch is imported only inside these functions.
"""

from __future__ import annotations

import json
import os
import pickle
import re
import signal
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from fsdp_convert._local_workers import WorkerGroup, prefix_worker_logs, take_callers_environ
from fsdp_convert._worker_failures import PEER_LOST, error_record, first_line
from fsdp_convert.errors import WorkerFailedError
from fsdp_convert.syspath import import_file_modules

__all__ = ["GlooGroup", "run_in_place", "WorkerCall", "worker_main"]

Job = TypeVar("Job")


class GlooGroup(WorkerGroup):
    """The job's gloo process group (many nodes, the user's torchrun): a ``WorkerGroup`` over torch.distributed."""

    def gather(self, obj: Any) -> list[Any] | None:
        """As ``WorkerGroup.gather``: the JSON goes in a uint8 tensor, its length first."""
        import torch
        import torch.distributed as dist

        data = torch.frombuffer(bytearray(json.dumps(obj).encode()), dtype=torch.uint8)
        if dist.get_rank() != 0:
            dist.send(torch.tensor([data.numel()], dtype=torch.int64), dst=0)
            dist.send(data, dst=0)
            return None
        out = [obj]
        for src in range(1, dist.get_world_size()):
            length = torch.zeros(1, dtype=torch.int64)
            dist.recv(length, src=src)
            # received into a bytearray this process owns: no NumPy (not a dependency) to read it back
            raw = bytearray(int(length.item()))
            dist.recv(torch.frombuffer(raw, dtype=torch.uint8), src=src)
            out.append(json.loads(raw))
        return out

    def barrier(self) -> None:
        """As ``WorkerGroup.barrier``."""
        import torch.distributed as dist

        dist.barrier()


def run_in_place(fn: Callable[[Job, int, int, WorkerGroup], Any], job: Job) -> tuple[int, Any]:
    """Run ``fn`` as this process's rank of a job the user's launcher started (``torchrun ... -m fsdp_convert``).

    Joins the gloo group from torchrun's environment (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``,
    ``MASTER_PORT``), runs ``fn(job, rank, world_size, group)``, and leaves the group.

    Returns:
        This process's rank and ``fn``'s return value.

    Raises:
        WorkerFailedError: the connection to a peer was lost (that worker died), so the job failed
            as a launch of ours whose worker died does (a resumable output's temporary is kept).
    """
    import torch.distributed as dist

    if dist.is_initialized():  # called from a training script that already joined its group
        return dist.get_rank(), _peers_lost_fail(fn, job, dist.get_rank(), dist.get_world_size())
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    prefix_worker_logs(rank)
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    result = _peers_lost_fail(fn, job, rank, world_size)
    dist.destroy_process_group()  # only on success: after a failure a peer may be gone
    return rank, result


def _peers_lost_fail(fn: Callable[[Job, int, int, WorkerGroup], Any], job: Job, rank: int, world_size: int) -> Any:
    """``fn(job, rank, world_size, group)``; a lost peer or group (``torch.distributed.DistError``) is a WorkerFailedError."""
    import torch.distributed as dist

    try:
        return fn(job, rank, world_size, GlooGroup())
    except RuntimeError as e:  # gloo's errors (torch.distributed.DistError is one)
        described = _describe(e)
        if described.startswith(PEER_LOST):
            raise WorkerFailedError(f"worker rank {rank} {described}") from e
        if isinstance(e, dist.DistError):  # any other failure of the group (a timeout, a store gone)
            raise WorkerFailedError(f"worker rank {rank} lost its process group: {described}") from e
        raise


@dataclass(frozen=True, slots=True)
class WorkerCall:
    """What a worker the elastic launcher starts runs: ``fn(job, rank, world_size, group)``, in the caller's environment."""

    fn: Callable[[Any, int, int, WorkerGroup], Any]
    job: bytes  # pickled: unpickled after file_modules are imported (the user's adapter, from its file)
    file_modules: dict[str, tuple[str, bool]]  # syspath.file_modules() of the caller
    error_dir: str
    environ: dict[str, str]  # the caller's environment when it launched


def worker_main(call: WorkerCall) -> Any:
    """Entry point of one worker process: join the gloo group, run the job, report errors."""
    # the launcher turns SIGINT/SIGTERM into exceptions in its process: a worker takes them as
    # a fresh interpreter does (SIGTERM ends it; the launcher reports the exit)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    take_callers_environ(call.environ)
    rank = int(os.environ["RANK"])
    world_size = int(os.environ["WORLD_SIZE"])
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    prefix_worker_logs(rank)
    try:
        import_file_modules(call.file_modules)
        job = pickle.loads(call.job)
        dist.init_process_group("gloo", rank=rank, world_size=world_size)
        result = call.fn(job, rank, world_size, GlooGroup())
        # only on success: after a failure a peer may be gone and teardown could wait on it
        dist.destroy_process_group()
        return result
    except BaseException as e:  # report, then exit quietly: the parent prints the one line
        raise SystemExit(error_record(call.error_dir, rank, e, _describe(e))) from None


def _describe(e: BaseException) -> str:
    """One line for a worker's unexpected error; a gloo connection lost to a peer says so."""
    text = str(e)
    if "gloo" in text and any(s in text for s in ("Connection reset", "Connection closed", "Broken pipe", "Read error")):
        m = re.search(r"\[([0-9a-fA-F.:]+)\]:(\d+)", text)
        peer = f" at {m.group(1)}:{m.group(2)}" if m else ""
        return f"{PEER_LOST}{peer} (that worker, or its node, died)"
    return f"{type(e).__name__}: {first_line(text)}"
