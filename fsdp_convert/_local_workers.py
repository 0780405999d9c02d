"""Launch stage, one node: workers forked from a torch-free forkserver, joined by pipes, counting in a shared file.

``run_local`` starts N workers with Python's ``multiprocessing`` (a forkserver whose preload imports
no torch), so a worker whose job needs no torch starts in milliseconds. They meet in a ``PipeGroup``
(a socket pair between rank 0 and each other rank, JSON records only, never a peer's pickle) and
count progress in one small file every worker maps (``FileCounter``). The parent watches every
worker's sentinel: one that dies fails the job at once, its peers stopped, and the workers' error
records name the cause (``_worker_failures``). Many nodes and torchrun use torch's elastic
launcher and gloo instead (``launch``, ``_gloo_workers``).
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import logging
import mmap
import multiprocessing
import multiprocessing.connection
import os
import pickle
import re
import shutil
import signal
import struct
import sys
import tempfile
import threading
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from fsdp_convert._worker_failures import PEER_LOST, error_record, failure, first_line
from fsdp_convert.errors import TerminatedError
from fsdp_convert.signals import hold_signals, raise_or_defer
from fsdp_convert.stall import StallWatch
from fsdp_convert.syspath import clean_sys_path, dumps_naming_main, file_modules, import_file_modules, main_not_run_again

if TYPE_CHECKING:
    from multiprocessing.connection import Connection
    from multiprocessing.process import BaseProcess

    from fsdp_convert.progress import SharedCounter

__all__ = [
    "MAX_LOCAL_WORKERS",
    "LIGHT_WORKER_PRELOAD",
    "WorkerGroup",
    "PipeGroup",
    "PeerLostError",
    "FileCounter",
    "LAUNCHER_VARS",
    "take_callers_environ",
    "prefix_worker_logs",
    "run_local",
]

# what the torch-free forkserver imports once, before it forks any worker (launch.start_worker_server); never
# "__main__": a Python whose forkserver can preload it would run the user's script there
LIGHT_WORKER_PRELOAD = ("fsdp_convert._local_workers",)
STOP_WAIT_S = 5.0  # a worker told to stop (SIGTERM) is killed (SIGKILL) after this many seconds


class WorkerGroup:
    """The workers of one job, for small records only: CRC-32s, sizes, errors. Bulk data never crosses it.

    Every worker writes its own tensors straight into the output files, so what rank 0 needs from
    the others is a list of ``(offset, length, CRC-32)`` per worker. Two kinds: ``PipeGroup`` (local
    workers) and ``_gloo_workers.GlooGroup`` (torch's gloo: many nodes, the user's torchrun).

    Attributes:
        counter: the job's progress counters, where the group carries them (None: ``launch.worker_bars``
            finds the launcher's c10d store, if any).
    """

    counter: SharedCounter | None = None

    def gather(self, obj: Any) -> list[Any] | None:
        """Send ``obj`` to rank 0: the list of every rank's, by rank, on rank 0; None elsewhere. Called on every rank.

        ``obj`` travels as JSON (lists, dicts, strings, numbers): never as a pickle, so a peer cannot
        make rank 0 run anything.
        """
        raise NotImplementedError

    def barrier(self) -> None:
        """Wait until every rank gets here. Called on every rank."""
        raise NotImplementedError


class PeerLostError(ConnectionError):
    """A peer worker's end of its pipe closed: that worker died (its record, if any, says why)."""


class PipeGroup(WorkerGroup):
    """A local job's group: one socket pair between rank 0 and each other rank, JSON records on them.

    Args:
        rank: this worker's rank.
        peers: on rank 0, the connections to ranks 1..N-1 in order; elsewhere, the one to rank 0.
        counter: the job's progress counters.
    """

    def __init__(self, rank: int, peers: Sequence[Connection], counter: SharedCounter | None) -> None:
        self._rank = rank
        self._peers = list(peers)
        self.counter = counter

    def gather(self, obj: Any) -> list[Any] | None:
        """As ``WorkerGroup.gather``.

        Raises:
            PeerLostError: a peer died (rank 0 waits for each; the others for rank 0 to read).
        """
        if self._rank != 0:
            self._send(0, json.dumps(obj).encode())
            return None
        out = [obj]
        for src in range(1, len(self._peers) + 1):
            out.append(json.loads(self._recv(src)))
        return out

    def barrier(self) -> None:
        """As ``WorkerGroup.barrier``: every rank tells rank 0, which answers each once all have.

        Raises:
            PeerLostError: a peer died before it got here.
        """
        if self._rank != 0:
            self._send(0, b"")
            self._recv(0)
            return
        for src in range(1, len(self._peers) + 1):
            self._recv(src)
        for dst in range(1, len(self._peers) + 1):
            self._send(dst, b"")

    def _send(self, peer: int, data: bytes) -> None:
        try:
            self._peers[peer - 1 if self._rank == 0 else 0].send_bytes(data)
        except OSError as e:  # BrokenPipeError, ConnectionResetError: the peer's end is gone
            raise PeerLostError(f"{PEER_LOST} (rank {peer}, which died)") from e

    def _recv(self, peer: int) -> bytes:
        try:
            return self._peers[peer - 1 if self._rank == 0 else 0].recv_bytes()
        except (EOFError, OSError) as e:
            raise PeerLostError(f"{PEER_LOST} (rank {peer}, which died)") from e


MAX_LOCAL_WORKERS = 250  # rank 0 gets a socket per peer through the forkserver, which passes at most 256 descriptors
_SLOT = struct.Struct("<56sq")  # a counter: its name (UTF-8, NUL-padded), its value
_SLOTS = 256


class FileCounter:
    """Integer counters in one small file every worker of a local job maps (a ``progress.SharedCounter``).

    A read-modify-write holds the file's ``flock`` (the kernel drops it if its worker dies), so
    every worker's adds count. The file is made by ``run_local``; a worker maps it at its first add.

    Args:
        path: the counters' file (``_SLOTS`` zeroed slots of ``_SLOT.size`` bytes).
    """

    def __init__(self, path: str) -> None:
        self._path = path
        self._lock = threading.Lock()  # called from mover threads and the bar's: flock does not exclude threads
        self._fd = -1
        self._map: mmap.mmap | None = None

    def add(self, name: str, amount: int) -> int:
        """Add ``amount`` to counter ``name`` (0 when new); its new value, every worker's adds included.

        Raises:
            ValueError: more than ``_SLOTS`` names in one job.
        """
        key = name.encode()
        if len(key) > 56 or not key or b"\0" in key:
            key = hashlib.blake2b(key, digest_size=28).hexdigest().encode()
        key = key.ljust(56, b"\0")
        with self._lock:
            if self._map is None:
                self._fd = os.open(self._path, os.O_RDWR)
                self._map = mmap.mmap(self._fd, _SLOTS * _SLOT.size)
            fcntl.flock(self._fd, fcntl.LOCK_EX)
            try:
                for offset in range(0, _SLOTS * _SLOT.size, _SLOT.size):
                    stored, value = _SLOT.unpack_from(self._map, offset)
                    if stored == key or not stored.strip(b"\0"):
                        _SLOT.pack_into(self._map, offset, key, value + amount)
                        return int(value + amount)
            finally:
                fcntl.flock(self._fd, fcntl.LOCK_UN)
        raise ValueError(f"more than {_SLOTS} progress counters in one job (adding {name!r})")


# what a launcher sets for each worker (torch's local_elastic_agent.py ``worker_env``; run_local sets the first four)
LAUNCHER_VARS = re.compile(
    r"^(LOCAL_RANK|RANK|GROUP_RANK|ROLE_RANK|ROLE_NAME|(LOCAL_|GROUP_|ROLE_)?WORLD_SIZE|MASTER_ADDR|MASTER_PORT|TORCHELASTIC_.*|TORCH_.*)$"
)


def take_callers_environ(environ: dict[str, str]) -> None:
    """Make this worker's environment the caller's at launch, plus what the launcher set for the worker.

    A forkserver child starts with the server's environment, taken when the server started (at
    this process's first launch); a caller may have changed its own since.
    """
    for name in [n for n in os.environ if n not in environ and not LAUNCHER_VARS.match(n)]:
        del os.environ[name]
    os.environ.update({n: v for n, v in environ.items() if not LAUNCHER_VARS.match(n)})


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


@dataclass(frozen=True, slots=True)
class _LocalCall:
    fn: Callable[[Any, int, int, WorkerGroup], Any]
    job: bytes  # pickled: unpickled after file_modules are imported (the user's adapter, from its file)
    file_modules: dict[str, tuple[str, bool]]  # syspath.file_modules() of the caller
    error_dir: str
    counter_path: str
    environ: dict[str, str]  # the caller's environment when it launched


def _local_worker(call: _LocalCall, rank: int, world_size: int, peers: list[Connection], result: Connection) -> None:
    """Entry point of one local worker: run the job, send its value to the parent, or leave a record and exit non-zero."""
    # the parent turns SIGINT/SIGTERM into exceptions; a worker takes them as a fresh interpreter does
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    take_callers_environ(call.environ)
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_WORLD_SIZE=str(world_size))
    torch = sys.modules.get("torch")
    if torch is not None:  # imported by the preload or the job's module: one thread per worker, as under the launcher
        torch.set_num_threads(1)
    prefix_worker_logs(rank)
    try:
        import_file_modules(call.file_modules)
        job = pickle.loads(call.job)
        result.send(call.fn(job, rank, world_size, PipeGroup(rank, peers, FileCounter(call.counter_path))))
    except BaseException as e:  # report, then exit quietly: the parent raises the one line
        message = str(e) if isinstance(e, PeerLostError) else f"{type(e).__name__}: {first_line(str(e))}"
        raise SystemExit(error_record(call.error_dir, rank, e, message)) from None


@contextmanager
def _signals_raise() -> Iterator[None]:
    """While workers run: SIGINT raises KeyboardInterrupt, SIGTERM/SIGHUP/SIGQUIT TerminatedError (as torch's launcher did)."""

    def handler(signum: int, frame: object) -> None:
        raise_or_defer(KeyboardInterrupt() if signum == signal.SIGINT else TerminatedError(signum))

    old: dict[signal.Signals, Any] = {}
    if threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT):
            old[sig] = signal.signal(sig, handler)
    try:
        yield
    finally:
        for sig, previous in old.items():
            signal.signal(sig, previous)


def _wait(procs: list[BaseProcess], results: list[Connection]) -> tuple[dict[int, Any], dict[int, int]]:
    """Until every worker exits, or one fails: (values by rank, exit codes of the workers that failed)."""
    running = {p.sentinel: rank for rank, p in enumerate(procs)}
    pending = dict(enumerate(results))
    values: dict[int, Any] = {}
    failed: dict[int, int] = {}
    watch = StallWatch({rank: p.pid for rank, p in enumerate(procs) if p.pid is not None})
    while (running or pending) and not failed:
        ready = multiprocessing.connection.wait([*running, *pending.values()], timeout=watch.interval)
        watch.check(running.values())  # a stopped worker's sentinel never fires: named after the stall timeout
        for rank, conn in [(r, c) for r, c in pending.items() if c in ready]:
            del pending[rank]
            try:
                values[rank] = conn.recv()
            except EOFError:  # exited without its value: its exit code says why
                pass
        failed = _exited(procs, running, [s for s in running if s in ready])
    # peers that exited by themselves in the same moment (a dead worker's peers losing it) are reported too
    failed |= _exited(procs, running, [s for s in running if s in multiprocessing.connection.wait(list(running), timeout=0)])
    if not failed and len(values) < len(procs):  # every worker exited 0, one of them without its value
        failed = {rank: 0 for rank in range(len(procs)) if rank not in values}
    return values, failed


def _exited(procs: list[BaseProcess], running: dict[int, int], sentinels: list[int]) -> dict[int, int]:
    """Take the workers of ``sentinels`` out of ``running``: the exit codes of those that failed."""
    failed = {}
    for sentinel in sentinels:
        rank = running.pop(sentinel)
        if (code := procs[rank].exitcode) != 0:
            failed[rank] = 1 if code is None else code
    return failed


def _stop(procs: list[BaseProcess]) -> None:
    """Stop every worker still running (SIGTERM, then SIGKILL after ``STOP_WAIT_S``) and release them all."""
    alive = [p for p in procs if p.exitcode is None]
    for p in alive:
        p.terminate()
    for p in alive:
        p.join(STOP_WAIT_S)
        if p.exitcode is None:
            p.kill()
    for p in procs:
        p.join()
        p.close()


def _rank_jobs(job: Any, nproc: int) -> list[Any]:
    """What each rank is sent: ``job.for_rank(rank)`` where the job has it (each worker unpickles its own share), else ``job``."""
    for_rank = getattr(job, "for_rank", None)
    return [for_rank(rank) for rank in range(nproc)] if callable(for_rank) else [job] * nproc


def run_local(fn: Callable[[Any, int, int, WorkerGroup], Any], job: Any, nproc: int) -> dict[int, Any]:
    """Run ``fn(job, rank, nproc, group)`` in ``nproc`` workers forked from the forkserver on this node.

    Start the server first (``launch.start_worker_server``: the workers share what it preloads).
    ``fn`` and ``job`` must be picklable; a job with a ``for_rank(rank)`` method sends each worker
    what that gives (``ConsolidateJob``: its share of the index). The workers run the caller's main script again only
    when ``fn`` or ``job`` names a class or function of it (``syspath.main_not_run_again``). The
    workers meet in a ``PipeGroup``; the parent watches them and stops the rest as soon as one
    fails. Blocks until every worker exits.

    Returns:
        The workers' return values, by rank.

    Raises:
        CheckpointError: re-raised in the parent, same class and message, if a worker raised one.
        WorkerFailedError: a worker failed otherwise or died (the message names its rank).
        KeyboardInterrupt: SIGINT (the workers are stopped).
        TerminatedError: SIGTERM, SIGHUP or SIGQUIT (the workers are stopped).
    """
    ctx = multiprocessing.get_context("forkserver")
    error_dir = Path(tempfile.mkdtemp(prefix="fsdp-convert-"))
    counter_path = error_dir / "counters"
    counter_path.write_bytes(bytes(_SLOTS * _SLOT.size))
    calls, main_names, dumped, modules = [], dumps_naming_main(fn)[1], {}, file_modules()
    for rank_job in _rank_jobs(job, nproc):
        if id(rank_job) not in dumped:  # one pickle of a job every rank gets
            dumped[id(rank_job)], names = dumps_naming_main(rank_job)
            main_names += [n for n in names if n not in main_names]
        calls.append(_LocalCall(fn, dumped[id(rank_job)], modules, str(error_dir), str(counter_path), dict(os.environ)))
    links = [ctx.Pipe() for _ in range(nproc - 1)]  # (rank 0's end, rank r's end) for r = 1..nproc-1
    pipes = [ctx.Pipe(duplex=False) for _ in range(nproc)]  # (the parent's reader, the worker's writer)
    procs: list[BaseProcess] = []
    try:
        with _signals_raise(), clean_sys_path():  # workers get sys.path without the current folder
            try:
                # a start cut in two would leave its worker a truncated pickle
                with hold_signals(), main_not_run_again(bool(main_names)):
                    for rank in range(nproc):
                        peers = [a for a, _ in links] if rank == 0 else [links[rank - 1][1]]
                        proc = ctx.Process(target=_local_worker, args=(calls[rank], rank, nproc, peers, pipes[rank][1]))
                        proc.start()
                        procs.append(proc)
                # only the workers hold their ends now: a dead worker's peers then read EOF at once
                for conn in [c for pair in links for c in pair] + [w for _, w in pipes]:
                    conn.close()
                values, failed = _wait(procs, [r for r, _ in pipes])
            finally:
                with hold_signals():
                    _stop(procs)
        if failed:
            raise failure(error_dir, failed, range(nproc), main_names=main_names) from None
        return values
    finally:
        for conn in [c for pair in links + pipes for c in pair]:
            conn.close()
        shutil.rmtree(error_dir, ignore_errors=True)
