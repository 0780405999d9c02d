"""run_ranks: fork ``world_size`` processes into a gloo group on loopback and run ``fn`` in each."""

from __future__ import annotations

import multiprocessing as mp
import os
import socket
import traceback
from collections.abc import Callable
from typing import Any


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _child(fn: Callable[..., None], rank: int, world_size: int, port: int, args: tuple[Any, ...], errors: Any) -> None:
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world_size))
    try:
        dist.init_process_group("gloo", rank=rank, world_size=world_size)
        fn(rank, world_size, *args)
        dist.barrier()  # tear gloo down together, not under a rank that is still checking
        dist.destroy_process_group()
    except BaseException:
        errors.put((rank, traceback.format_exc()))
        os._exit(1)


def run_ranks(fn: Callable[..., None], world_size: int, *args: Any, timeout: float = 120.0) -> None:
    """Run ``fn(rank, world_size, *args)`` on forked ranks; raise if any rank fails or times out."""
    ctx = mp.get_context("fork")
    errors = ctx.SimpleQueue()
    port = free_port()
    procs = [ctx.Process(target=_child, args=(fn, r, world_size, port, args, errors)) for r in range(world_size)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout)
    hung = [r for r, p in enumerate(procs) if p.is_alive()]
    for p in procs:
        if p.is_alive():
            p.kill()
            p.join()
    failures = []
    while not errors.empty():
        failures.append(errors.get())
    if hung or failures or any(p.exitcode != 0 for p in procs):
        detail = "\n".join(f"[rank {r}]\n{tb}" for r, tb in sorted(failures))
        raise RuntimeError(f"run_ranks failed (hung ranks: {hung}, exit codes: {[p.exitcode for p in procs]})\n{detail}")
