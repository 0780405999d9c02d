"""Local workers (``launch.run_workers`` on one node) import no torch, share JSON and counters, fail by rank.

Each scenario runs ``launch.run_ranks`` / ``run_workers`` in a subprocess whose ``import torch``
fails (``sys.modules["torch"] = None``), so the parent importing torch anywhere fails the run; the
workers report whether torch is in theirs. The job functions are in ``tests/_local_jobs.py``
(the workers import it by name), which imports neither torch nor pytest.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from tests._local_jobs import HANG_S

ROOT = Path(__file__).resolve().parents[2]
ENV = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}

# --- the scenarios (run in a subprocess without torch) -----------------------------------------------------------

SCENARIOS = r"""
import json, sys
sys.modules["torch"] = None  # any import of torch here fails the run
from fsdp_convert import launch
from tests import _local_jobs as t

def outcome(fn, job, nproc):
    try:
        return {"value": launch.run_workers(fn, job, nproc)}
    except Exception as e:
        return {"error": type(e).__name__, "message": str(e), "cli": getattr(e, "cli_text", lambda: None)()}

runs = {
    "probe": {"value": launch.run_ranks(t.probe, None, 3, None)},
    "returns": outcome(t.returns, "j", 3),
    "dies": outcome(t.dies, 1, 3),
    "dies0": outcome(t.dies, 0, 3),
    "raises": outcome(t.raises, "/out/full.pt", 3),
    "set": outcome(t.gathers_a_set, None, 2),
    "per_rank": outcome(t.returns, t.PerRank(), 2),
}
runs["parent_torch"] = sorted(m for m in sys.modules if m == "torch" or m.startswith("torch."))
print(json.dumps(runs))
"""


@pytest.fixture(scope="module")
def runs() -> dict[str, Any]:
    done = subprocess.run(
        [sys.executable, "-c", SCENARIOS], cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=HANG_S, check=False
    )
    assert done.returncode == 0, done.stderr[-3000:]
    result: dict[str, Any] = json.loads(done.stdout)
    return result


def test_local_workers_import_no_torch_in_the_parent_or_the_workers(runs: dict[str, Any]) -> None:
    assert runs["parent_torch"] == ["torch"]  # our None: nothing under it was imported
    owner, gathered = runs["probe"]["value"]
    assert owner is True
    assert [g["torch"] for g in gathered] == [False, False, False]


def test_gather_barrier_and_counters_span_three_workers(runs: dict[str, Any]) -> None:
    _, gathered = runs["probe"]["value"]
    assert [g["rank"] for g in gathered] == [0, 1, 2]
    assert [g["env"] for g in gathered] == ["0", "1", "2"]
    # every worker's 200 adds of rank + 1 from two threads, all in before the barrier let anyone read
    assert [g["total"] for g in gathered] == [200 * (1 + 2 + 3)] * 3
    assert runs["returns"]["value"] == {str(r): {"rank": r, "job": "j"} for r in range(3)}  # by rank (JSON keys)
    # a job with for_rank: each worker unpickles only what it gives for its rank
    assert runs["per_rank"]["value"] == {str(r): {"rank": r, "job": f"share {r}"} for r in range(2)}


@pytest.mark.parametrize("scenario", ["dies", "dies0"])
def test_a_sigkilled_worker_is_named_by_rank_and_its_waiting_peers_stopped(runs: dict[str, Any], scenario: str) -> None:
    run = runs[scenario]
    assert run["error"] == "WorkerFailedError", run
    rank = 1 if scenario == "dies" else 0
    assert run["message"].startswith(f"worker rank {rank} died without a report ("), run


def test_a_workers_checkpoint_error_is_raised_in_the_parent(runs: dict[str, Any]) -> None:
    run = runs["raises"]
    assert (run["error"], run["cli"]) == ("OutputExistsError", "/out/full.pt exists: pass --overwrite to replace it")
    assert run["message"] == "/out/full.pt exists: pass overwrite=True to replace it"  # the library's wording


def test_gather_takes_json_only(runs: dict[str, Any]) -> None:
    assert runs["set"]["error"] == "WorkerFailedError"
    assert runs["set"]["message"] == "worker rank 1 failed: TypeError: Object of type set is not JSON serializable"


SIGNALLED = r"""
import sys
sys.modules["torch"] = None
from fsdp_convert import launch
from fsdp_convert.errors import TerminatedError
from tests import _local_jobs as t
try:
    launch.run_workers(t.sleeps, sys.argv[1], 2)
except (KeyboardInterrupt, TerminatedError) as e:
    print(type(e).__name__, getattr(e, "signum", ""))
"""


@pytest.mark.parametrize(("sig", "said"), [(signal.SIGINT, "KeyboardInterrupt "), (signal.SIGTERM, "TerminatedError 15")])
def test_a_signal_to_the_parent_stops_the_workers(tmp_path: Path, sig: int, said: str) -> None:
    proc = subprocess.Popen(
        [sys.executable, "-c", SIGNALLED, str(tmp_path)],
        cwd=ROOT,
        env=ENV,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.monotonic() + HANG_S
        while len(list(tmp_path.glob("*.pid"))) < 2:
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
            time.sleep(0.01)
        pids = [int(p.read_text()) for p in tmp_path.glob("*.pid")]
        proc.send_signal(sig)
        stdout, stderr = proc.communicate(timeout=30)  # the workers sleep HANG_S: stopped, not waited for
    finally:
        if proc.poll() is None:
            proc.kill()
    assert stdout.strip() == said.strip(), stderr
    for pid in pids:  # gone, or a zombie its forkserver has yet to reap
        assert not Path(f"/proc/{pid}").exists() or "State:\tZ" in Path(f"/proc/{pid}/status").read_text()


MAIN = """
import json
import dep  # what a worker would import again when it runs this script again (as Python 3.11's forkserver has it do)
from fsdp_convert import launch
from tests import _local_jobs as t

if __name__ == "__main__":
    print(json.dumps(launch.run_workers(t.main_dep_imported_here, None, 2)))
"""


def test_workers_do_not_import_again_what_the_main_script_imported(tmp_path: Path) -> None:
    (tmp_path / "dep.py").write_text("import os\nIMPORTED_BY = os.getpid()\n")
    (tmp_path / "main.py").write_text(MAIN)
    env = {**ENV, "PYTHONPATH": f"{ROOT}{os.pathsep}{tmp_path}"}
    done = subprocess.run(
        [sys.executable, str(tmp_path / "main.py")], cwd=ROOT, env=env, capture_output=True, text=True, timeout=HANG_S
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert json.loads(done.stdout) == {"0": False, "1": False}  # imported once, by the forkserver they are forked from


# --- the start's cost, reported (not asserted): torch's elastic launcher + gloo vs local workers ---------------

TIMED = r"""
import json, resource, sys, time
mode = sys.argv[1]
if mode == "elastic":
    import torch.distributed  # what launch imported before local workers
from fsdp_convert import launch
from tests import _local_jobs as t
cpu = resource.getrusage(resource.RUSAGE_SELF)
start = time.monotonic()
launch._run_elastic(t.noop, None, 2, None) if mode == "elastic" else launch.run_workers(t.noop, None, 2)
print(json.dumps({"wall_s": time.monotonic() - start, "cpu_before_s": cpu.ru_utime + cpu.ru_stime}))
"""

# the timed run under a child subreaper, so the forkserver and the resource tracker, orphaned when the
# run exits, are reaped here and their CPU (and their workers') counts in RUSAGE_CHILDREN
TREE = r"""
import ctypes, json, os, resource, subprocess, sys
ctypes.CDLL(None, use_errno=True).prctl(36, 1, 0, 0, 0)  # PR_SET_CHILD_SUBREAPER
out = subprocess.run([sys.executable, "-c", sys.argv[1], sys.argv[2]], capture_output=True, text=True, check=True).stdout
while True:
    try:
        os.waitpid(-1, 0)
    except ChildProcessError:
        break
ru = resource.getrusage(resource.RUSAGE_CHILDREN)
print(json.dumps({**json.loads(out), "tree_cpu_s": ru.ru_utime + ru.ru_stime}))
"""


@pytest.mark.slow
def test_two_noop_workers_start_cost_is_reported() -> None:
    rows: dict[str, list[dict[str, float]]] = {"elastic": [], "local": []}
    for _ in range(3):
        for mode in ("elastic", "local"):  # alternating, on a shared machine
            done = subprocess.run(
                [sys.executable, "-c", TREE, TIMED, mode], cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=HANG_S
            )
            assert done.returncode == 0, done.stderr[-3000:]
            rows[mode].append(json.loads(done.stdout))
    print("\nrun_workers, 2 no-op workers (median of 3 alternating rounds; CPU of the whole process tree):")
    for mode, runs in rows.items():
        med = {k: sorted(r[k] for r in runs)[1] for k in runs[0]}
        call = sorted(r["tree_cpu_s"] - r["cpu_before_s"] for r in runs)[1]
        print(f"  {mode:8} call wall {med['wall_s']:.3f} s, call CPU {call:.3f} s, tree CPU {med['tree_cpu_s']:.3f} s")
