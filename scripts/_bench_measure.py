"""Measurement helpers for scripts/bench.py: page-cache drops, process-tree RSS, memory cgroups.

``run_measured`` runs one command and samples the RSS of its whole process tree from /proc every
20 ms. ``MemoryCgroup`` makes a child memory cgroup (v2 ``memory.max`` with ``memory.swap.max``
0, or v1 ``memory.limit_in_bytes`` with ``memory.memsw.limit_in_bytes``) under the cgroup this
process runs in, so the limit nests inside whatever limit the machine already sets.
"""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol, TypeVar

PAGE = os.sysconf("SC_PAGE_SIZE")
MiB = 2**20
CGROUP_SKIPPED = "skipped (needs root and a cgroup memory controller)"


def rotating(names: list[str], rounds: int) -> Iterator[tuple[int, str]]:
    """``(round, name)`` for every name in every round, each round starting one name later (no row always first)."""
    for r in range(rounds):
        for name in names[r % len(names) :] + names[: r % len(names)]:
            yield r, name


class HasRun(Protocol):
    """A measured run of a bench's own kind: ``run`` is ``run_measured``'s."""

    @property
    def run(self) -> Run: ...


M = TypeVar("M", bound=HasRun)


def cold_rounds(
    names: list[str], rounds: int, before: Callable[[], None], run_one: Callable[[str], M], line: Callable[[M], str]
) -> dict[str, list[M]]:
    """Every name ``rounds`` times in ``rotating`` order: ``before`` (empty the output, drop the page cache), then ``run_one``.

    Each run's ``line`` is printed on stderr with its round, name and result (a failure's stderr tail after it).

    Returns:
        The runs of each name, in the order they ran.
    """
    runs: dict[str, list[M]] = {k: [] for k in names}
    width = max(map(len, names), default=0)
    for r, key in rotating(names, rounds):
        before()
        m = run_one(key)
        runs[key].append(m)
        result = "ok" if m.run.returncode == 0 else f"failed (rc {m.run.returncode})"
        print(f"round {r + 1}: {key:{width}s} {line(m)}  {result}", file=sys.stderr)
        if m.run.returncode != 0:
            print(m.run.stderr_tail, file=sys.stderr)
    return runs


def median_or_none(values: list[float]) -> float | None:
    """The median of ``values``, or None for none."""
    return statistics.median(values) if values else None


def shown_number(x: float | None) -> str:
    """``x`` with two decimals for a table, ``—`` for None."""
    return "—" if x is None else f"{x:.2f}"


def shown_mib(n: float | None) -> str:
    """Bytes ``n`` in whole MiB for a table, ``—`` for None."""
    return "—" if n is None else f"{n / MiB:.0f}"


def drop_cache(paths: list[Path]) -> None:
    """Drop ``paths`` from the page cache (posix_fadvise DONTNEED), so the next read hits the disk.

    Everything dirty is written back first (``os.sync``): dirty pages cannot be dropped, and a
    previous run's writeback (a checkpoint just made, an output just removed) would otherwise
    compete with the next run's disk time.
    """
    os.sync()
    for path in paths:
        if path.is_file():
            fd = os.open(path, os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def tree_pids(root: int) -> list[int]:
    """``root`` and its descendants' pids (about a millisecond: every process's ``/proc/<pid>/stat``)."""
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
    return sorted(tree)


def tree_memory(root: int, *, pids: list[int] | None = None, pss: bool = True) -> tuple[int, int]:
    """(RSS, PSS) of ``root`` and its descendants (or of ``pids``), in bytes; PSS 0 unless ``pss``.

    RSS counts a page shared by several processes (forked workers' copy-on-write torch, shared
    libraries) once per process; PSS divides it among them, so the tree's PSS is what it holds.
    Reading PSS walks every page table (``smaps_rollup``: about 18 ms a GiB of RSS), RSS not.
    """
    rss = total_pss = 0
    for pid in pids if pids is not None else tree_pids(root):
        try:
            with open(f"/proc/{pid}/statm") as f:
                rss += int(f.read().split()[1]) * PAGE
            if pss:
                with open(f"/proc/{pid}/smaps_rollup") as f:
                    total_pss += next(int(line.split()[1]) * 1024 for line in f if line.startswith("Pss:"))
        except (OSError, IndexError, ValueError, StopIteration):
            pass
    return rss, total_pss


SAMPLE_S = 0.02  # RSS sampled this often; the tree's pids every 5th sample, PSS every 25th (0.5 s)


def sample_tree(root: int, done: threading.Event, peaks: list[int]) -> None:
    """Keep the peak ``[RSS, PSS]`` of ``root``'s tree, in bytes, in ``peaks`` until ``done`` is set.

    PSS is read every 0.5 s only: read every sample (a GiB tree: 18 ms of every 20), the sampler
    took half a core of a 2-core machine from the runs it measured.
    """
    pids, n = [root], 0
    while not done.is_set():
        if n % 5 == 0:
            pids = tree_pids(root)
        rss, pss = tree_memory(root, pids=pids, pss=n % 25 == 0)
        peaks[0], peaks[1] = max(peaks[0], rss), max(peaks[1], pss)
        n += 1
        done.wait(SAMPLE_S)


@dataclass(frozen=True)
class Run:
    wall_s: float
    peak_rss_bytes: int
    peak_pss_bytes: int
    returncode: int
    stderr_tail: str


def run_measured(cmd: list[str]) -> Run:
    """Run ``cmd`` (OMP_NUM_THREADS=1, stdout discarded); time it and sample its tree's peak RSS."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    start = time.monotonic()
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    peaks = [0, 0]
    done = threading.Event()
    sampler = threading.Thread(target=sample_tree, args=(proc.pid, done, peaks), daemon=True)
    sampler.start()
    _, err = proc.communicate()
    wall = time.monotonic() - start
    done.set()
    sampler.join()
    return Run(wall, peaks[0], peaks[1], proc.returncode, err.decode(errors="replace")[-2000:])


def remove_cgroup(path: Path) -> None:
    """Remove a cgroup made for one run, once its last process has left (up to 5 s), else warn."""
    for _ in range(50):  # the last process may take a moment to leave
        try:
            path.rmdir()
            return
        except OSError:
            time.sleep(0.1)
    print(f"warning: could not remove {path}", flush=True)


def _own_cgroup_dirs() -> tuple[Path | None, Path | None]:
    """(v2 folder, v1 memory folder) of the cgroup this process is in; None where there is none."""
    paths: dict[str, str] = {}  # "v2" or "v1-memory" -> path inside the hierarchy
    for line in Path("/proc/self/cgroup").read_text().splitlines():
        hid, controllers, path = line.split(":", 2)
        if hid == "0" and controllers == "":
            paths["v2"] = path
        elif "memory" in controllers.split(","):
            paths["v1-memory"] = path
    v2 = v1 = None
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        fields = line.split()
        sep = fields.index("-")
        root, mount, fstype, options = fields[3], fields[4], fields[sep + 1], fields[sep + 3]
        kind = "v2" if fstype == "cgroup2" else "v1-memory" if fstype == "cgroup" and "memory" in options.split(",") else None
        if kind is None or kind not in paths:
            continue
        inside = paths[kind]
        rel = inside[len(root) :] if inside.startswith(root) else inside
        folder = Path(mount) / rel.lstrip("/")
        if kind == "v2":
            v2 = folder
        else:
            v1 = folder
    return v2, v1


def find_memory_cgroup() -> tuple[str, Path] | str:
    """("v2" or "v1", parent folder) for child memory cgroups, or why none can be made."""
    if os.geteuid() != 0:
        return f"{CGROUP_SKIPPED}: not root"
    try:
        v2, v1 = _own_cgroup_dirs()
    except (OSError, ValueError) as e:
        return f"{CGROUP_SKIPPED}: {e}"
    if v2 is not None and (v2 / "cgroup.controllers").exists():
        control = v2 / "cgroup.subtree_control"
        if "memory" not in control.read_text().split():
            try:
                control.write_text("+memory")
            except OSError:
                pass  # a v2 cgroup holding processes cannot delegate memory (no internal processes)
        if "memory" in control.read_text().split():
            return "v2", v2
    if v1 is not None and (v1 / "memory.limit_in_bytes").exists():
        return "v1", v1
    return f"{CGROUP_SKIPPED}: no writable memory controller in /proc/self/cgroup"


class MemoryCgroup:
    """A fresh child memory cgroup limited to ``limit_bytes`` (no swap), removed on exit.

    ``wrap(cmd)`` returns a command that moves itself into the cgroup and then execs ``cmd``, so
    every process it starts is limited too. After the run, ``peak_bytes`` (cgroup peak usage,
    page cache included; 0 where the kernel does not report it) and ``oom_kills`` are read.
    """

    _count = 0

    def __init__(self, version: str, parent: Path, limit_bytes: int) -> None:
        MemoryCgroup._count += 1
        self.version = version
        self.dir = parent / f"fsdp-convert-bench-{os.getpid()}-{MemoryCgroup._count}"
        self.limit_bytes = limit_bytes
        self.peak_bytes = 0
        self.oom_kills = 0

    def __enter__(self) -> MemoryCgroup:
        self.dir.mkdir()
        if self.version == "v2":
            (self.dir / "memory.max").write_text(str(self.limit_bytes))
            if (self.dir / "memory.swap.max").exists():
                (self.dir / "memory.swap.max").write_text("0")
        else:
            (self.dir / "memory.limit_in_bytes").write_text(str(self.limit_bytes))
            memsw = self.dir / "memory.memsw.limit_in_bytes"  # absent without swap accounting
            if memsw.exists():
                memsw.write_text(str(self.limit_bytes))
        return self

    def wrap(self, cmd: list[str]) -> list[str]:
        return ["sh", "-c", 'echo $$ > "$0" && exec "$@"', str(self.dir / "cgroup.procs"), *cmd]

    def _read_int(self, name: str, key: str | None = None) -> int:
        try:
            text = (self.dir / name).read_text()
        except OSError:
            return 0
        if key is None:
            return int(text.split()[0])
        for line in text.splitlines():
            k, _, v = line.partition(" ")
            if k == key:
                return int(v)
        return 0

    def __exit__(self, *exc: object) -> None:
        if self.version == "v2":
            self.peak_bytes = self._read_int("memory.peak")
            self.oom_kills = self._read_int("memory.events", "oom_kill")
        else:
            self.peak_bytes = self._read_int("memory.max_usage_in_bytes")
            self.oom_kills = self._read_int("memory.oom_control", "oom_kill")
        remove_cgroup(self.dir)
