"""Launch stage: the only module that starts workers or touches a process group.

``run_workers`` starts N workers with torch's elastic launcher (``torch.distributed.launcher.api``,
the machinery behind ``torchrun --standalone``), each joining a gloo process group on CPU.
``WorkerGroup`` carries the small records rank 0 gathers (CRC-32s and sizes); every worker
writes its own bytes into the output, so no tensor crosses the group.
"""

from __future__ import annotations

import json
import logging
import multiprocessing
import os
import re
import shutil
import signal
import sys
import tempfile
import threading
import traceback
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from fsdp_convert import errors
from fsdp_convert.constants import WORKER_PRELOAD, quiet_workers
from fsdp_convert.errors import CheckpointError, InvalidOptionError, TerminatedError, WorkerFailedError
from fsdp_convert.progress import Bars

__all__ = [
    "WorkerGroup",
    "Cluster",
    "run_workers",
    "launched_by_torchrun",
    "run_in_place",
    "run_ranks",
    "job_world_size",
    "shared_tag",
    "JobCounter",
    "worker_bars",
]

logger = logging.getLogger(__name__)

Job = TypeVar("Job")


class WorkerGroup:
    """The job's gloo process group, for small records only: CRC-32s, sizes, errors. Bulk data never crosses it.

    Every worker writes its own tensors straight into the output files, so what rank 0 needs from
    the others is a list of ``(offset, length, CRC-32)`` per worker.
    """

    def gather(self, obj: Any) -> list[Any] | None:
        """Send ``obj`` to rank 0: the list of every rank's, by rank, on rank 0; None elsewhere.

        ``obj`` travels as JSON (lists, dicts, strings, numbers) in a uint8 tensor, its length
        first: never as a pickle, so a peer cannot make rank 0 run anything.
        """
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
        """Wait until every rank gets here."""
        dist.barrier()


class JobCounter:
    """Integer counters in the job's c10d store (``MASTER_ADDR:MASTER_PORT``, which every worker of the job reaches).

    Each run of the workers counts under its own prefix: every worker numbers its runs in the store
    and takes part in every run, so their numbers agree (waves under one torchrun start at 0).
    """

    def __init__(self, host: str, port: int, rank: int) -> None:
        # torch.distributed.TCPStore is public (documented), but torch does not mark the re-export for mypy
        self._store = dist.TCPStore(host, port, is_master=False, timeout=timedelta(seconds=60))  # type: ignore[attr-defined]
        self._lock = threading.Lock()  # called from mover threads and the bar's
        self._prefix = f"fsdp_convert/progress/run{self._store.add(f'fsdp_convert/progress/runs/{rank}', 1)}/"

    def add(self, name: str, amount: int) -> int:
        """Add ``amount`` to counter ``name`` (0 when new); its new value, every worker's adds included."""
        with self._lock:
            return int(self._store.add(self._prefix + name, amount))


def worker_bars(enabled: bool, rank: int, group: WorkerGroup | None) -> Bars:
    """A worker's progress bars, shown by rank 0 and counting every worker's bytes through a ``JobCounter``.

    Called on every worker of a job, or on none. Off, it reaches no store. A group joined without
    ``MASTER_ADDR``/``MASTER_PORT`` (a script's own ``init_process_group``) counts each worker's share.
    """
    host, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")
    if not enabled or group is None or not host or not port:
        return Bars(enabled=enabled, show=rank == 0, whole_job=group is None)
    return Bars(enabled=True, show=rank == 0, shared=JobCounter(host, int(port), rank))


@dataclass(frozen=True, slots=True, kw_only=True)
class Cluster:
    """torchrun's multi-node options, passed to torch's elastic launcher as torchrun passes them.

    Attributes:
        nnodes: nodes taking part; each runs fsdp-convert with the same arguments.
        node_rank: this node's rank (``static`` rendezvous; ``c10d`` assigns ranks as nodes join).
        rdzv_backend: ``c10d`` (a TCP store on the endpoint's host) or ``static``.
        rdzv_endpoint: ``host:port`` every node reaches (the store, or node 0 for ``static``).
        rdzv_id: the run's id, the same on every node; it also names the shared temporary output.
    """

    nnodes: int = 1
    node_rank: int = 0
    rdzv_backend: str = "c10d"
    rdzv_endpoint: str = ""
    rdzv_id: str = ""

    @property
    def multi_node(self) -> bool:
        """True for more than one node."""
        return self.nnodes > 1


def launched_by_torchrun() -> bool:
    """True when this process is a worker of the user's own launcher (torchrun sets these)."""
    return all(name in os.environ for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"))


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
    try:
        return fn(job, rank, world_size, WorkerGroup())
    except RuntimeError as e:  # gloo's errors (torch.distributed.DistError is one)
        described = _describe(e)
        if described.startswith(_PEER_LOST):
            raise WorkerFailedError(f"worker rank {rank} {described}") from e
        if isinstance(e, dist.DistError):  # any other failure of the group (a timeout, a store gone)
            raise WorkerFailedError(f"worker rank {rank} lost its process group: {described}") from e
        raise


@dataclass(frozen=True, slots=True)
class _WorkerCall:
    fn: Callable[[Any, int, int, WorkerGroup], Any]
    job: Any
    error_dir: str
    environ: dict[str, str]  # the caller's environment when it launched


# what torch's elastic agent sets for each worker (local_elastic_agent.py ``worker_env``)
_LAUNCHER_VARS = re.compile(
    r"^(LOCAL_RANK|RANK|GROUP_RANK|ROLE_RANK|ROLE_NAME|(LOCAL_|GROUP_|ROLE_)?WORLD_SIZE|MASTER_ADDR|MASTER_PORT|TORCHELASTIC_.*|TORCH_.*)$"
)


def _take_callers_environ(environ: dict[str, str]) -> None:
    """Make this worker's environment the caller's at launch, plus what the launcher set for the worker.

    A forkserver child starts with the server's environment, taken when the server started (at
    this process's first launch); a caller may have changed its own since.
    """
    for name in [n for n in os.environ if n not in environ and not _LAUNCHER_VARS.match(n)]:
        del os.environ[name]
    os.environ.update({n: v for n, v in environ.items() if not _LAUNCHER_VARS.match(n)})


def prefix_worker_logs(rank: int) -> None:
    """Send this worker's log records and Python warnings to stderr as ``[rank N] ...`` lines.

    Rank 0's stay as they are; many workers' output stays readable.
    """
    if rank == 0:
        return
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter(f"[rank {rank}] %(levelname)s %(name)s: %(message)s"))
    for name in ("fsdp_convert", "py.warnings"):
        logger_ = logging.getLogger(name)
        logger_.handlers[:] = [handler]
        logger_.propagate = False
    logging.captureWarnings(True)


def _worker_main(call: _WorkerCall) -> Any:
    """Entry point of one worker process: join the gloo group, run the job, report errors."""
    # the launcher turns SIGINT/SIGTERM into exceptions in its process: a worker takes them as
    # a fresh interpreter does (SIGTERM ends it; the launcher reports the exit)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    _take_callers_environ(call.environ)
    rank = int(os.environ["RANK"])
    world_size = int(os.environ["WORLD_SIZE"])
    torch.set_num_threads(1)
    prefix_worker_logs(rank)
    try:
        dist.init_process_group("gloo", rank=rank, world_size=world_size)
        result = call.fn(call.job, rank, world_size, WorkerGroup())
        # only on success: after a failure a peer may be gone and teardown could wait on it
        dist.destroy_process_group()
        return result
    except BaseException as e:  # report, then exit quietly: the parent prints the one line
        record = {
            "rank": rank,
            "type": type(e).__name__ if isinstance(e, CheckpointError) else None,
            "message": str(e) if isinstance(e, CheckpointError) else _describe(e),
            "cli_message": e.cli_text() if isinstance(e, CheckpointError) else None,  # the CLI's wording (flags)
            "traceback": traceback.format_exc(),
        }
        Path(call.error_dir, f"rank{rank}.json").write_text(json.dumps(record))
        code = e.exit_code if isinstance(e, CheckpointError) else 1
        raise SystemExit(code) from None


def _describe(e: BaseException) -> str:
    """One line for a worker's unexpected error; a gloo connection lost to a peer says so."""
    text = str(e)
    if "gloo" in text and any(s in text for s in ("Connection reset", "Connection closed", "Broken pipe", "Read error")):
        m = re.search(r"\[([0-9a-fA-F.:]+)\]:(\d+)", text)
        peer = f" at {m.group(1)}:{m.group(2)}" if m else ""
        return f"{_PEER_LOST}{peer} (that worker, or its node, died)"
    return f"{type(e).__name__}: {_first_line(text)}"


def _first_line(text: str) -> str:
    return text.strip().splitlines()[0] if text.strip() else ""


def _describe_exit(code: int) -> str:
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit code {code}"


_PEER_LOST = "lost its connection to a peer worker"


def _failure(error_dir: Path, exit_codes: dict[int, int], ranks: range | None = None) -> CheckpointError:
    """The root cause of a failed launch, from the workers' error records and exit codes.

    ``ranks``: every rank of the job when this node holds them all (one node), so a worker that
    died without a word is named even when the launcher reported only the peers it broke.
    """
    records = sorted((json.loads(p.read_text()) for p in error_dir.glob("rank*.json")), key=lambda r: r["rank"])
    # a CheckpointError is the root cause; the others are peers torn down after it
    for record in records:
        cls = getattr(errors, record["type"] or "", None)
        if isinstance(cls, type) and issubclass(cls, CheckpointError):
            err = cls(record["message"], cli_message=record.get("cli_message"))
            err.__notes__ = [f"worker rank {record['rank']}:\n{record['traceback']}"]
            return err
    # a worker that died without a word (SIGKILL, out of memory) broke the others' connections
    reported = {r["rank"] for r in records}
    for rank, code in sorted(exit_codes.items()):
        if rank not in reported:
            return WorkerFailedError(f"worker rank {rank} died without a report ({_describe_exit(code)}; out of memory?)")
    silent = [rank for rank in ranks or () if rank not in reported]
    if records and len(silent) == 1 and all(r["message"].startswith(_PEER_LOST) for r in records):
        # the launcher saw the peers fail first; the one worker that said nothing is the one that died
        return WorkerFailedError(f"worker rank {silent[0]} died without a report (its peers lost their connections to it)")
    if records:
        first = records[0]
        err = WorkerFailedError(f"worker rank {first['rank']} failed: {first['message']}")
        err.__notes__ = [first["traceback"]]
        return err
    return WorkerFailedError("the workers failed without a report")


def run_workers(
    fn: Callable[[Job, int, int, WorkerGroup], Any],
    job: Job,
    nproc: int,
    *,
    cluster: Cluster | None = None,
) -> dict[int, Any]:
    """Run ``fn(job, rank, world_size, group)`` in ``nproc`` new worker processes on this node.

    Workers are started by torch's elastic launcher (forkserver, no restarts) and join a gloo process
    group. Alone, the rendezvous is c10d on a free loopback port; with a multi-node ``cluster``
    every node's call meets at its endpoint and the group spans ``cluster.nnodes x nproc``
    workers. ``fn`` and ``job`` must be picklable. Blocks until every worker exits.

    Returns:
        The return values of this node's workers, by global rank (rank 0's only on the node
        that holds it).

    Raises:
        CheckpointError: re-raised in the parent, same class and message, if a worker raised one.
        WorkerFailedError: a worker failed otherwise or died (the message names its rank).
    """
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.elastic.rendezvous.api import RendezvousError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    error_dir = Path(tempfile.mkdtemp(prefix="fsdp-convert-"))
    cluster = cluster or Cluster()
    config = LaunchConfig(
        min_nodes=cluster.nnodes,
        max_nodes=cluster.nnodes,
        nproc_per_node=nproc,
        run_id=cluster.rdzv_id or f"fsdp-convert-{uuid.uuid4().hex[:8]}",
        rdzv_backend=cluster.rdzv_backend,
        rdzv_endpoint=cluster.rdzv_endpoint or "127.0.0.1:0",
        rdzv_configs={"rank": cluster.node_rank} if cluster.rdzv_backend == "static" else {},
        max_restarts=0,
        monitor_interval=0.1,
        # forkserver: workers are forked from one single-threaded server that imported torch and
        # this package once, so they share those pages (about 150 MiB of private pages a process)
        # copy-on-write and start at once; spawn re-imports torch in each (about 2 s). A plain fork
        # of this process is not safe: the launcher's threads may hold a lock (getaddrinfo's) that
        # the child then waits on forever.
        start_method="forkserver",
    )
    # The launcher logs each worker's exit and the peers' teardown; the one-line error we raise
    # says the same thing (its traceback goes in the error's notes, shown by --debug).
    prefixes = ("torch.distributed.elastic", "torch.distributed.launcher", "torch.multiprocessing")
    names = [n for n in logging.Logger.manager.loggerDict if n.startswith(prefixes)]
    quiet = [logging.getLogger(name) for name in {*names, *prefixes}]
    old_levels = [lg.level for lg in quiet]
    for lg in quiet:
        lg.setLevel(logging.CRITICAL + 1)
    # the forkserver and its workers keep the environment it started with (the CLI may have started it
    # already: cli._run_options.start_worker_server, the same two steps)
    os.environ["PYTHONWARNINGS"] = quiet_workers(os.environ.get("PYTHONWARNINGS", ""))
    multiprocessing.set_forkserver_preload(list(WORKER_PRELOAD))
    try:
        results = elastic_launch(config, _worker_main)(_WorkerCall(fn, job, str(error_dir), dict(os.environ)))
    except ChildFailedError as e:
        ranks = range(nproc) if cluster.nnodes == 1 else None
        raise _failure(error_dir, {rank: f.exitcode for rank, f in e.failures.items()}, ranks) from None
    except RendezvousError as e:  # the store's host (a node) is gone, or nodes never all came
        raise WorkerFailedError(
            f"lost the rendezvous at {config.rdzv_endpoint} ({type(e).__name__}): a node left the job or never joined"
        ) from e
    except SignalException as e:  # the launcher caught SIGINT/SIGTERM and stopped the workers
        if e.sigval == signal.SIGINT:
            raise KeyboardInterrupt from None
        raise TerminatedError(int(e.sigval)) from None
    finally:
        for lg, level in zip(quiet, old_levels, strict=True):
            lg.setLevel(level)
        shutil.rmtree(error_dir, ignore_errors=True)
    return dict(results)


def job_world_size(nproc: int | None, cluster: Cluster | None) -> int | None:
    """Workers of the whole job.

    torchrun's ``WORLD_SIZE``; ``nnodes x nproc`` for a multi-node run (which needs ``nproc``:
    every node must plan for the same world size); else ``nproc``.

    Raises:
        InvalidOptionError: a multi-node run without ``--nproc-per-node``, ``--rdzv-endpoint`` or ``--rdzv-id``.
    """
    if launched_by_torchrun():
        return int(os.environ["WORLD_SIZE"])
    if cluster is None or not cluster.multi_node:
        return nproc
    missing = [
        flag
        for flag, value in (
            ("--nproc-per-node", nproc),
            ("--rdzv-endpoint", cluster.rdzv_endpoint),
            ("--rdzv-id", cluster.rdzv_id),
        )
        if not value
    ]
    if missing:
        raise InvalidOptionError(f"--nnodes {cluster.nnodes} needs {', '.join(missing)}, the same on every node")
    assert nproc is not None
    return cluster.nnodes * nproc


def shared_tag(cluster: Cluster | None) -> str | None:
    """The temporary output's tag every process of a multi-process job agrees on, if it shares one."""
    if launched_by_torchrun():
        return "torchrun-" + re.sub(r"[^A-Za-z0-9_.-]", "_", os.environ.get("TORCHELASTIC_RUN_ID", os.environ["MASTER_PORT"]))
    if cluster is not None and cluster.multi_node:
        return "rdzv-" + re.sub(r"[^A-Za-z0-9_.-]", "_", cluster.rdzv_id)
    return None


def run_ranks(
    fn: Callable[[Any, int, int, WorkerGroup | None], Any],
    job: Any,
    world_size: int,
    cluster: Cluster | None,
) -> tuple[bool, Any]:
    """Run every rank of a job: in this process, in workers on this node, or as the user's torchrun worker.

    Returns:
        Whether this process holds rank 0's result (it then owns the output), and that result.
    """
    if launched_by_torchrun():
        rank, result = run_in_place(fn, job)
        return rank == 0, result
    if world_size == 1 and (cluster is None or not cluster.multi_node):
        return True, fn(job, 0, 1, None)
    per_node = world_size // (cluster.nnodes if cluster is not None else 1)
    results = run_workers(fn, job, per_node, cluster=cluster)
    return 0 in results, results.get(0)
