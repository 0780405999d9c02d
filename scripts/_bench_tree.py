"""Measurement of one command for scripts/bench.py's warm-cache and scaling tables: wall, tree CPU, first byte.

Every command runs under a small reaper (``REAPER``, a Python process that is not itself measured)
that times it, waits for it and for everything it left behind, and reports the rusage of all of it:

- **Wall**: from just before the reaper forks the command to the command's exit (CLOCK_MONOTONIC in
  the reaper, so the reaper's own start-up is not in it).
- **Tree CPU** (user + system seconds of every process the command started): from a CPU cgroup
  made for the run when one can be made (root; cgroup v2 ``cpu.stat`` ``usage_usec``, present in
  every v2 cgroup without enabling a controller, else cgroup v1 ``cpuacct.usage``); the command
  moves itself into it between fork and exec, so everything it starts is counted, whoever waits
  for it. Without a cgroup, the reaper's ``getrusage(RUSAGE_CHILDREN)``: the kernel adds a child's
  CPU, and that of every descendant the child waited for, to its parent's children total when the
  parent waits for it. A forkserver worker is a child of the forkserver, which is a child of the
  CLI: the forkserver reaps its workers and the CLI its forkserver (torch's elastic launcher stops
  it), so they are counted; a process whose parent exits without waiting is re-parented to the
  reaper (``PR_SET_CHILD_SUBREAPER``), which waits for it too. ``RUSAGE_CHILDREN`` alone (no
  subreaper) misses exactly those orphans. Both numbers are kept (``cpu_s`` and ``rusage_cpu_s``)
  so each run checks one against the other; on the 2-core CI machine kind they agree within 1-2%
  for ``--nproc 1`` and ``--nproc 2`` (the cgroup also counts the exit of the last processes).
- **First byte** (optional, ``watch``: a fresh folder that only the command writes in): the time
  from the command's start to when the files in that folder first hold ``first_byte_bytes``
  allocated (``st_blocks``, polled every 5 ms by a thread of this process, summed over the folder
  and its subfolders). The output's temporary is created sparse (``ftruncate``) and its headers
  are KiB, so its allocation first passes 1 MiB when the movers have written (or, through a shared
  mapping, stored) data there; on ext4 ``st_blocks`` counts delayed-allocation blocks as soon as
  they are written, on tmpfs each page as it is touched. A writer that preallocated the file
  (``fallocate``) would make this the preallocation's time: such a change needs another marker.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from _bench_measure import remove_cgroup, sample_tree

FIRST_BYTE_BYTES = 1 << 20
POLL_S = 0.005
STRAGGLER_GRACE_S = 10.0

# argv: result file, cgroup.procs to join ("-": none), command... Writes one JSON object.
REAPER = r"""
import ctypes, json, os, resource, subprocess, sys, time
result, procs, cmd = sys.argv[1], sys.argv[2], sys.argv[3:]
subreaper = os.environ.get("BENCH_SUBREAPER", "1") == "1"  # 0: to see what RUSAGE_CHILDREN alone misses
subreaper = subreaper and ctypes.CDLL(None, use_errno=True).prctl(36, 1, 0, 0, 0) == 0  # PR_SET_CHILD_SUBREAPER

def join():
    if procs != "-":
        with open(procs, "w") as f:
            f.write("0")

start = time.monotonic()
proc = subprocess.Popen(cmd, preexec_fn=join)
end = code = None
grace, left = float(os.environ.get("BENCH_GRACE_S", "10")), 0
while True:
    try:
        pid, status, _ = os.wait4(-1, 0 if end is None else os.WNOHANG)
    except ChildProcessError:
        break  # every descendant waited for
    if pid == 0:  # the command is done; what it left behind gets a grace period, not for ever
        if time.monotonic() - end > grace:
            try:
                left = len(open("/proc/self/task/%d/children" % os.getpid()).read().split())
            except OSError:
                left = -1
            break
        time.sleep(0.01)
        continue
    if pid == proc.pid:
        end, code = time.monotonic(), os.waitstatus_to_exitcode(status)
        proc.returncode = code
ru = resource.getrusage(resource.RUSAGE_CHILDREN)
doc = dict(start=start, end=end, returncode=code, user_s=ru.ru_utime, sys_s=ru.ru_stime, stragglers=left, subreaper=subreaper)
with open(result, "w") as f:
    json.dump(doc, f)
"""


@dataclass(frozen=True)
class TreeRun:
    wall_s: float
    cpu_s: float  # the cgroup's where there is one, else rusage_cpu_s
    rusage_cpu_s: float
    cpu_method: str  # "cgroup v2", "cgroup v1", "rusage"
    first_byte_s: float | None
    returncode: int
    stragglers: int  # processes still alive STRAGGLER_GRACE_S after the command exited (not in rusage_cpu_s)
    stderr_tail: str
    peak_rss_bytes: int = 0  # of the whole tree (the reaper's ~10 MiB included), with sample_memory; else 0
    peak_pss_bytes: int = 0


def _mounts() -> list[tuple[str, str, str, list[str]]]:
    """(root, mount point, fstype, super options) of every mount."""
    out = []
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        fields = line.split()
        sep = fields.index("-")
        out.append((fields[3], fields[4], fields[sep + 1], fields[sep + 3].split(",")))
    return out


def _own_cgroup(v2: bool) -> Path | None:
    """This process's cgroup folder: the v2 one, or the v1 one with cpuacct; None where there is none."""
    inside = None
    for line in Path("/proc/self/cgroup").read_text().splitlines():
        hid, controllers, path = line.split(":", 2)
        if (v2 and hid == "0" and controllers == "") or (not v2 and "cpuacct" in controllers.split(",")):
            inside = path
    if inside is None:
        return None
    for root, mount, fstype, options in _mounts():
        if (v2 and fstype == "cgroup2") or (not v2 and fstype == "cgroup" and "cpuacct" in options):
            rel = inside[len(root) :] if inside.startswith(root) else inside
            return Path(mount) / rel.lstrip("/")
    return None


class CpuCgroup:
    """A fresh child CPU-accounting cgroup for one run, removed on exit; ``usage_s`` is read on exit."""

    _count = 0

    def __init__(self, version: str, parent: Path) -> None:
        CpuCgroup._count += 1
        self.version = version
        self.dir = parent / f"fsdp-convert-bench-cpu-{os.getpid()}-{CpuCgroup._count}"
        self.usage_s = 0.0

    @property
    def procs(self) -> Path:
        return self.dir / "cgroup.procs"

    def __enter__(self) -> CpuCgroup:
        self.dir.mkdir()
        return self

    def read_usage_s(self) -> float:
        if self.version == "v2":
            for line in (self.dir / "cpu.stat").read_text().splitlines():
                key, _, value = line.partition(" ")
                if key == "usage_usec":
                    return int(value) / 1e6
            raise OSError(f"no usage_usec in {self.dir / 'cpu.stat'}")
        return int((self.dir / "cpuacct.usage").read_text()) / 1e9

    def __exit__(self, *exc: object) -> None:
        self.usage_s = self.read_usage_s()
        remove_cgroup(self.dir)


def find_cpu_cgroup() -> tuple[str, Path] | str:
    """("v2" or "v1", parent folder) under which a CPU cgroup per run can be made, or why none can."""
    if os.geteuid() != 0:
        return "not root"
    why = []
    for version in ("v2", "v1"):
        try:
            parent = _own_cgroup(version == "v2")
        except (OSError, ValueError) as e:
            why.append(f"{version}: {e}")
            continue
        if parent is None:
            why.append(f"{version}: not mounted")
            continue
        try:
            with CpuCgroup(version, parent) as group:
                group.read_usage_s()
        except OSError as e:
            why.append(f"{version}: {e}")
            continue
        return version, parent
    return "; ".join(why)


def _allocated_bytes(folder: Path) -> int:
    total = 0
    try:
        entries = list(os.scandir(folder))
    except OSError:
        return 0
    for entry in entries:
        try:
            if entry.is_dir(follow_symlinks=False):
                total += _allocated_bytes(Path(entry.path))
            else:
                total += entry.stat(follow_symlinks=False).st_blocks * 512
        except OSError:
            pass  # a temporary renamed or removed meanwhile
    return total


def run_tree(
    cmd: list[str],
    *,
    env: dict[str, str],
    cgroup: tuple[str, Path] | None,
    watch: Path | None = None,
    first_byte_bytes: int = FIRST_BYTE_BYTES,
    cwd: Path | None = None,
    sample_memory: bool = False,
) -> TreeRun:
    """Run ``cmd`` (stdout discarded, stderr kept) under the reaper; see the module docstring.

    With ``sample_memory``, the tree's RSS is sampled every 20 ms, its PSS every 0.5 s (``_bench_measure.sample_tree``).
    """
    fd, result_name = tempfile.mkstemp(prefix="bench-reaper-", suffix=".json")
    os.close(fd)
    result = Path(result_name)
    seen: list[float] = []
    stop = threading.Event()
    peaks = [0, 0]  # RSS, PSS

    def poll() -> None:
        while not stop.is_set():
            if watch is not None and _allocated_bytes(watch) >= first_byte_bytes:
                seen.append(time.monotonic())
                return
            stop.wait(POLL_S)

    group = CpuCgroup(*cgroup) if cgroup else None
    try:
        if group is not None:
            group.__enter__()
        procs = str(group.procs) if group is not None else "-"
        reaper = [sys.executable, "-c", REAPER, str(result), procs, *cmd]
        proc_env = {**env, "BENCH_GRACE_S": str(STRAGGLER_GRACE_S)}
        poller = threading.Thread(target=poll, daemon=True)
        proc = subprocess.Popen(reaper, env=proc_env, cwd=cwd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        sampler = threading.Thread(target=sample_tree, args=(proc.pid, stop, peaks), daemon=True)
        if watch is not None:
            poller.start()
        if sample_memory:
            sampler.start()
        _, err = proc.communicate()
        stop.set()
        if watch is not None:
            poller.join()
        if sample_memory:
            sampler.join()
    finally:
        if group is not None:
            group.__exit__(None, None, None)
    try:
        doc = json.loads(result.read_text())
    except (OSError, ValueError):
        doc = None
    finally:
        result.unlink(missing_ok=True)
    tail = err.decode(errors="replace")[-2000:]
    if doc is None or doc["end"] is None:
        return TreeRun(
            0.0, 0.0, 0.0, "none", None, proc.returncode or 1, 0, f"reaper failed (rc {proc.returncode}): {tail}", *peaks
        )
    rusage_s = doc["user_s"] + doc["sys_s"]
    first = seen[0] - doc["start"] if seen else None
    return TreeRun(
        wall_s=doc["end"] - doc["start"],
        cpu_s=group.usage_s if group is not None else rusage_s,
        rusage_cpu_s=rusage_s,
        cpu_method=f"cgroup {group.version}" if group is not None else "rusage" + ("" if doc["subreaper"] else " (no subreaper)"),
        first_byte_s=first,
        returncode=doc["returncode"],
        stragglers=doc["stragglers"],
        stderr_tail=tail,
        peak_rss_bytes=peaks[0],
        peak_pss_bytes=peaks[1],
    )
