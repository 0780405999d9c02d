"""Jobs for tests/unit/test_local_workers.py, run in local workers: no torch, no pytest (each worker imports this module)."""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Any

from fsdp_convert.errors import OutputExistsError

HANG_S = 120  # a scenario still going after this long has hung


def probe(job: Any, rank: int, world_size: int, group: Any) -> Any:
    """Every rank: gather, counter adds from two threads (later ranks later), a barrier, the job's total; rank 0 the lot."""
    time.sleep(0.1 * rank)  # a barrier that does not wait lets rank 0 read the total before the others add

    def add() -> None:
        for _ in range(100):
            group.counter.add("write/moved", rank + 1)

    threads = [threading.Thread(target=add) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    group.barrier()
    total = group.counter.add("write/moved", 0)
    return group.gather({"rank": rank, "torch": "torch" in sys.modules, "total": total, "env": os.environ["RANK"]})


def dies(job: Any, rank: int, world_size: int, group: Any) -> Any:
    """Rank ``job`` is SIGKILLed; rank 0 waits for it in the gather, the others in the barrier after."""
    if rank == job:
        os.kill(os.getpid(), signal.SIGKILL)
    group.gather(rank)
    group.barrier()
    return rank


def raises(job: Any, rank: int, world_size: int, group: Any) -> Any:
    """Rank 2 raises a CheckpointError; the others wait for it in a barrier."""
    if rank == 2:
        raise OutputExistsError(f"{job} exists: pass --overwrite to replace it")
    group.barrier()
    return rank


def gathers_a_set(job: Any, rank: int, world_size: int, group: Any) -> Any:
    """A gather takes JSON only: a set is refused on the worker that sends it."""
    return group.gather({rank} if rank == 1 else [rank])


def returns(job: Any, rank: int, world_size: int, group: Any) -> Any:
    return {"rank": rank, "job": job}


class PerRank:
    """A job that sends each worker its own share (``for_rank``), as ``ConsolidateJob`` sends its index."""

    def for_rank(self, rank: int) -> str:
        return f"share {rank}"


def sleeps(job: Any, rank: int, world_size: int, group: Any) -> Any:
    """Write this worker's pid into folder ``job`` and sleep: for a signal to the parent to stop."""
    Path(job, f"{rank}.tmp").write_text(str(os.getpid()))
    Path(job, f"{rank}.tmp").rename(Path(job, f"{rank}.pid"))  # whole when the test sees it
    time.sleep(HANG_S)


def noop(job: Any, rank: int, world_size: int, group: Any) -> None:
    return None


def main_dep_imported_here(job: Any, rank: int, world_size: int, group: Any) -> bool:
    """Whether this worker imported the main script's module ``dep`` itself (its ``IMPORTED_BY`` is the importer's pid)."""
    return bool(sys.modules["dep"].IMPORTED_BY == os.getpid())
