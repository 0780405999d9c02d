"""Launch stage: the one module through which the operations start workers or join a process group.

``run_workers`` starts N workers. On one node they are forked from a torch-free forkserver and
joined by pipes (``_local_workers``: a worker that needs no torch starts in milliseconds); across
nodes they are started by torch's elastic launcher (``torch.distributed.launcher.api``, the
machinery behind ``torchrun``), each joining a gloo process group on CPU (``_gloo_workers``), as
are the user's own torchrun workers (``run_in_place``). A ``WorkerGroup`` carries the small records
rank 0 gathers (CRC-32s and sizes); every worker writes its own bytes into the output, so no
tensor crosses the group. torch is imported only where the gloo path runs.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import pickle
import re
import shutil
import signal
import sys
import tempfile
import threading
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from types import ModuleType
from typing import Any, TypeVar

from fsdp_convert._gloo_workers import WorkerCall, run_in_place, worker_main
from fsdp_convert._local_workers import LIGHT_WORKER_PRELOAD, MAX_LOCAL_WORKERS, WorkerGroup, prefix_worker_logs, run_local
from fsdp_convert._worker_failures import failure
from fsdp_convert.constants import WORKER_PRELOAD, quiet_workers
from fsdp_convert.errors import InvalidOptionError, TerminatedError, WorkerFailedError
from fsdp_convert.progress import Bars
from fsdp_convert.syspath import clean_sys_path, file_modules

__all__ = [
    "WorkerGroup",
    "start_worker_server",
    "prefix_worker_logs",
    "Cluster",
    "run_workers",
    "launched_by_torchrun",
    "run_ranks",
    "job_world_size",
    "shared_tag",
    "JobCounter",
    "worker_bars",
]

logger = logging.getLogger(__name__)

Job = TypeVar("Job")


def start_worker_server(*modules: str) -> None:
    """Start the forkserver local workers are forked from, importing what they need once there; returns at once.

    Its preload: ``_local_workers.LIGHT_WORKER_PRELOAD`` (no torch, no ``__main__``), the modules
    the main script imports (for a job that names something of the main script, whose workers run
    it again: ``syspath.main_not_run_again``), and ``modules`` (the job function's). The server
    keeps the environment of its start, so ``PYTHONWARNINGS`` gets the workers' filters first, and
    ``sys.path`` without the current folder (``syspath.clean_sys_path``). A server already running
    is kept, with its preload.
    """
    import multiprocessing.forkserver

    os.environ["PYTHONWARNINGS"] = quiet_workers(os.environ.get("PYTHONWARNINGS", ""))
    multiprocessing.set_forkserver_preload(list(dict.fromkeys([*LIGHT_WORKER_PRELOAD, *_main_script_imports(), *modules])))
    with clean_sys_path():
        multiprocessing.forkserver.ensure_running()


def _main_script_imports() -> list[str]:
    """The modules (already imported here) that the main script's names come from, for workers that run it again.

    A worker runs a script again (``fsdp-convert``'s console script, a user's ``train.py``), not
    ``python -m pkg``'s ``pkg.__main__`` nor ``python -c``. Only modules imported here are named:
    an import that failed otherwise than with ImportError would stop the server.
    """
    main = sys.modules.get("__main__")
    spec_name = str(getattr(getattr(main, "__spec__", None), "name", ""))
    if main is None or not getattr(main, "__file__", None) or spec_name.endswith("__main__"):
        return []
    names = [getattr(v, "__name__" if isinstance(v, ModuleType) else "__module__", None) for v in vars(main).values()]
    return [n for n in names if isinstance(n, str) and n in sys.modules and n not in ("__main__", "__mp_main__", "builtins")]


class JobCounter:
    """Integer counters in the job's c10d store (``MASTER_ADDR:MASTER_PORT``, which every worker of the job reaches).

    Each run of the workers counts under its own prefix: every worker numbers its runs in the store
    and takes part in every run, so their numbers agree (waves under one torchrun start at 0).
    """

    def __init__(self, host: str, port: int, rank: int) -> None:
        import torch.distributed as dist

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

    Called on every worker of a job, or on none. Off, it reaches no store. A group that carries its
    counters (local workers) counts there; a group joined without ``MASTER_ADDR``/``MASTER_PORT``
    (a script's own ``init_process_group``) counts each worker's share.
    """
    if enabled and group is not None and group.counter is not None:
        return Bars(enabled=True, show=rank == 0, shared=group.counter)
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


def run_workers(
    fn: Callable[[Job, int, int, WorkerGroup], Any],
    job: Job,
    nproc: int,
    *,
    cluster: Cluster | None = None,
) -> dict[int, Any]:
    """Run ``fn(job, rank, world_size, group)`` in ``nproc`` new worker processes on this node.

    On one node the workers are forked from a torch-free forkserver and meet in a
    ``_local_workers.PipeGroup`` (``_local_workers.run_local``): no torch is imported for them
    unless ``fn``'s module imports it. With a multi-node ``cluster``, or under the user's
    torchrun, they are started by torch's elastic launcher (forkserver, no restarts) and join a
    gloo process group; every node's call meets at the cluster's endpoint and the group spans
    ``cluster.nnodes x nproc`` workers. ``fn`` and ``job`` must be picklable. Blocks until every
    worker exits.

    Returns:
        The return values of this node's workers, by global rank (rank 0's only on the node
        that holds it).

    Raises:
        CheckpointError: re-raised in the parent, same class and message, if a worker raised one.
        WorkerFailedError: a worker failed otherwise or died (the message names its rank).
        KeyboardInterrupt: SIGINT stopped the workers.
        TerminatedError: SIGTERM (SIGHUP, SIGQUIT) stopped the workers.
    """
    if (cluster is None or not cluster.multi_node) and not launched_by_torchrun() and nproc <= MAX_LOCAL_WORKERS:
        start_worker_server(*[m for m in [getattr(fn, "__module__", None)] if m and m != "__main__"])
        return run_local(fn, job, nproc)
    return _run_elastic(fn, job, nproc, cluster)


def _run_elastic(
    fn: Callable[[Job, int, int, WorkerGroup], Any], job: Job, nproc: int, cluster: Cluster | None
) -> dict[int, Any]:
    """``run_workers`` through torch's elastic launcher and gloo. Alone, the rendezvous is c10d on a free loopback port."""
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
    call = WorkerCall(fn, pickle.dumps(job), file_modules(), str(error_dir), dict(os.environ))
    try:
        with clean_sys_path():  # the workers (and a forkserver started here) get sys.path without the current folder
            results = elastic_launch(config, worker_main)(call)
    except ChildFailedError as e:
        ranks = range(nproc) if cluster.nnodes == 1 else None
        raise failure(error_dir, {rank: f.exitcode for rank, f in e.failures.items()}, ranks) from None
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
