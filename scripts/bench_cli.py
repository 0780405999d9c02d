"""How long a usage mistake takes to be told: wall time of each, beside ``fsdp-convert --version``.

Each case runs the CLI in a fresh process (as a user types it) ``--repeat`` times after one
warm-up run; the table gives the median wall time, the exit code and the ratio to ``--version``
(the interpreter, typer and the CLI's own imports: the floor for any answer). A mistake found
before torch is imported costs about what ``--version`` does; one found after costs seconds.

Usage (from the repository root):

    .venv/bin/python scripts/bench_cli.py                   # this checkout
    .venv/bin/python scripts/bench_cli.py --tree /tmp/old   # another copy of the package (A/B):
        git archive HEAD fsdp_convert | tar -x -C /tmp/old  # e.g. the last commit's

The cases' checkpoint is a real one, if tiny (one tensor, ``dcp.save`` without a process group),
so an older tree that reads it first (and says so if it is no checkpoint) gets as far as the mistake.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

CASES: list[tuple[str, list[str]]] = [
    ("--version (reference)", ["--version"]),
    ("existing OUT", ["consolidate", "{d}/ck", "{d}/exists.pt"]),
    ("bad suffix", ["consolidate", "{d}/ck", "{d}/out.txt"]),
    ("--dtype fp8", ["consolidate", "{d}/ck", "{d}/out.pt", "--dtype", "fp8"]),
    ("missing checkpoint", ["consolidate", "{d}/nope", "{d}/out.pt"]),
    ("typo'd subcommand", ["consolidat", "{d}/ck", "{d}/out.pt"]),
]


def _command(tree: Path | None) -> tuple[list[str], dict[str, str]]:
    """The CLI as a user runs it: the console script beside this Python, or ``python -m`` for another tree."""
    env = dict(os.environ)
    if tree is not None:
        env["PYTHONPATH"] = str(tree)
        return [sys.executable, "-m", "fsdp_convert"], env
    script = Path(sys.executable).with_name("fsdp-convert")
    return ([str(script)] if script.exists() else [sys.executable, "-m", "fsdp_convert"]), env


def _time(cmd: list[str], env: dict[str, str], cwd: Path, repeat: int) -> tuple[float, int]:
    """Median wall seconds of ``repeat`` runs (after one warm-up) and the exit code.

    Run in ``cwd``, away from the checkout: ``python -m`` puts the working folder first on the path.
    """
    subprocess.run(cmd, env=env, cwd=cwd, capture_output=True, timeout=300)
    times, code = [], 0
    for _ in range(repeat):
        start = time.perf_counter()
        proc = subprocess.run(cmd, env=env, cwd=cwd, capture_output=True, timeout=300)
        times.append(time.perf_counter() - start)
        code = proc.returncode
    return statistics.median(times), code


def _tiny_checkpoint(path: Path) -> None:
    import warnings

    import torch
    import torch.distributed.checkpoint as dcp

    warnings.filterwarnings("ignore", message="torch.distributed is disabled")  # no process group: on purpose
    dcp.save({"model": {"w": torch.zeros(4)}}, storage_writer=dcp.FileSystemWriter(str(path)), no_dist=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeat", type=int, default=5, help="timed runs per case (default 5)")
    parser.add_argument("--tree", type=Path, help="a folder holding another fsdp_convert package to time instead")
    args = parser.parse_args()
    base, env = _command(args.tree)
    folder = Path(tempfile.mkdtemp(prefix="bench-cli-"))
    try:
        _tiny_checkpoint(folder / "ck")
        (folder / "exists.pt").write_bytes(b"precious")
        rows = []
        for name, argv in CASES:
            seconds, code = _time([*base, *(a.format(d=folder) for a in argv)], env, folder, args.repeat)
            rows.append((name, code, seconds))
        reference = rows[0][2]
        print(f"{'case':<24} {'exit':>4} {'seconds':>8} {'x --version':>12}")
        for name, code, seconds in rows:
            print(f"{name:<24} {code:>4} {seconds:>8.2f} {seconds / reference:>11.2f}x")
        print(f"({args.repeat} runs each, median; {' '.join(base)}{' from ' + str(args.tree) if args.tree else ''})")
    finally:
        shutil.rmtree(folder, ignore_errors=True)


if __name__ == "__main__":
    main()
