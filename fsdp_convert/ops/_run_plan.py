"""The plan ``--dry-run`` prints: ``RunPlan``, what a ``consolidate`` or ``reshard`` run will need, as text or JSON.

Made by ``ops.dry_run`` from the run's own stages; sizes in bytes, times in seconds.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from fsdp_convert.progress import human_bytes

__all__ = ["SLACK_BYTES", "PlannedFile", "RunPlan"]

SLACK_BYTES = 24 << 20  # per process: allocator arenas, thread stacks, the pickled plan, the read log


@dataclass(frozen=True, slots=True, kw_only=True)
class PlannedFile:
    """One output file: its name in the output (``""``: OUT itself) and its planned size, in bytes."""

    name: str
    nbytes: int


@dataclass(frozen=True, slots=True, kw_only=True)
class RunPlan:
    """What a run would do, from its plan; nothing was created to make it.

    Attributes:
        command: ``consolidate`` or ``reshard``.
        checkpoint: the checkpoint as named.
        output: OUT as named.
        producer: the producer detected from the index (``producers.detect_producer``).
        output_kind: the output kind's name (``torch_save``, ``safetensors``, ``hf_dir``, ``dcp``...).
        files: every output file the plan places, with its size in bytes.
        output_bytes: the output's size, in bytes, as the run's space check counts it (an upper bound).
        workers: worker processes (all nodes).
        worker_bytes: bytes each worker moves, by rank.
        processes: processes of the run on this node (the caller's, and with workers the
            forkserver, its resource tracker and each worker).
        baseline_bytes: resident memory of one process before it moves anything, in bytes
            (``baseline_note`` says how it was measured).
        baseline_note: how ``baseline_bytes`` was measured.
        buffer_bytes: the mover buffers each moving process holds at most, in bytes.
        peak_process_bytes: the peak resident memory of any one process, in bytes (an upper bound).
        peak_tree_bytes: the peak resident memory of all the run's processes on this node together, in bytes.
        temporary: where the run's temporary would be written.
        space_folder: the folder whose filesystem's free space was read.
        needed_bytes: what the run's space check asks for there, in bytes.
        free_bytes: what is free there, in bytes.
        read_bytes: source bytes the workers move, in bytes.
        probe_bytes: bytes the read-speed probe read; 0 when there was nothing local to read.
        probe_seconds: how long the probe took, in seconds.
        seconds: the estimated run time, in seconds (None: no probe).
        estimate_note: how ``seconds`` was estimated.
    """

    command: str
    checkpoint: str
    output: str
    producer: str
    output_kind: str
    files: tuple[PlannedFile, ...]
    output_bytes: int
    workers: int
    worker_bytes: tuple[int, ...]
    processes: int
    baseline_bytes: int
    baseline_note: str
    buffer_bytes: int
    peak_process_bytes: int
    peak_tree_bytes: int
    temporary: str
    space_folder: str
    needed_bytes: int
    free_bytes: int
    read_bytes: int
    probe_bytes: int
    probe_seconds: float
    seconds: float | None
    estimate_note: str

    @property
    def fits(self) -> bool:
        """Whether the output fits in the free space where its temporary is written."""
        return self.needed_bytes <= self.free_bytes

    def to_json_dict(self) -> dict[str, Any]:
        """The plan as one JSON document (every size in bytes, times in seconds)."""
        return {"schema_version": 1, "dry_run": True, **asdict(self), "fits": self.fits}

    def lines(self) -> list[str]:
        """The plan for people, one fact a line, each within 80 columns (long paths shortened in the middle)."""
        shown = 12  # files listed before a count of the rest

        def size(n: int) -> str:
            return human_bytes(n)

        out = [
            f"dry run of {self.command}: nothing was written",
            f"  checkpoint  {_fit(self.checkpoint, 66)}",
            f"  producer    {self.producer}",
            f"  output      {_fit(self.output, 50)} ({self.output_kind})",
            f"  files       {len(self.files)}, {size(self.output_bytes)} in all (an upper bound)",
        ]
        out += [f"    {_fit(f.name or Path(self.output).name, 60):<60} {size(f.nbytes):>12}" for f in self.files[:shown]]
        if len(self.files) > shown:
            out.append(f"    ... and {len(self.files) - shown} more")
        loads = ", ".join(size(n) for n in self.worker_bytes[:6]) + (", ..." if len(self.worker_bytes) > 6 else "")
        out += [
            f"  workers     {self.workers}, moving {_fit(loads, 56)}",
            f"  memory      at most {size(self.peak_process_bytes)} per process, "
            f"{size(self.peak_tree_bytes)} for {self.processes} process(es)",
            f"              = baseline {size(self.baseline_bytes)} + buffers {size(self.buffer_bytes)} "
            f"+ slack {size(SLACK_BYTES)}",
            *(f"              {line}" for line in _wrap("baseline: " + self.baseline_note, 66)),
            f"  space       needs {size(self.needed_bytes)}, {size(self.free_bytes)} free"
            + ("" if self.fits else " (DOES NOT FIT)"),
            f"              in {_fit(self.space_folder, 63)}",
            f"  temporary   {_fit(self.temporary, 66)}",
        ]
        time_line = "unknown" if self.seconds is None else f"about {self.seconds:.1f} s"
        out += [f"  time        {time_line}", *(f"              {line}" for line in _wrap(self.estimate_note, 66))]
        return out


def _fit(text: str, width: int) -> str:
    """``text`` in at most ``width`` characters, its middle replaced by ``...``."""
    if len(text) <= width:
        return text
    keep = width - 3
    return text[: keep // 2] + "..." + text[len(text) - (keep - keep // 2) :]


def _wrap(text: str, width: int) -> list[str]:
    """``text`` in lines of at most ``width`` characters, broken at spaces."""
    lines: list[str] = []
    for word in text.split():
        if lines and len(lines[-1]) + 1 + len(word) <= width:
            lines[-1] += " " + word
        else:
            lines.append(word)
    return lines
