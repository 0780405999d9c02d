"""Reusable ``Annotated`` parameters, shared by the commands."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

__all__ = ["CheckpointArg", "OutputArg", "JsonOpt", "OverwriteOpt", "NprocOpt", "MemoryBudgetOpt", "ProgressOpt", "NoCrcOpt"]

CheckpointArg = Annotated[
    Path, typer.Argument(metavar="CHECKPOINT_DIR", help="DCP checkpoint folder (the one holding .metadata).", show_default=False)
]
OutputArg = Annotated[
    Path,
    typer.Argument(
        metavar="OUT",
        help="Output: a .pt/.pth/.bin file (torch.save), a .safetensors file, or a folder (HF safetensors shards + index).",
        show_default=False,
    ),
]
JsonOpt = Annotated[bool, typer.Option("--json", help="Print one JSON document on stdout instead of a table.")]
OverwriteOpt = Annotated[bool, typer.Option("--overwrite", help="Replace OUT if it exists (only once the new one is complete).")]
NprocOpt = Annotated[
    int | None,
    typer.Option(
        "--nproc",
        min=1,
        help="Reading workers, started with torch's elastic launcher (gloo, CPU); 1 runs in-process. "
        "(default: one per two CPU cores for a file, one per core for a folder; at most one per data file and per 256 MiB)",
        show_default=False,
    ),
]
MemoryBudgetOpt = Annotated[
    str,
    typer.Option(
        "--memory-budget", help="Read-ahead and transfer buffers per process (peak is about this + the largest tensor)."
    ),
]
ProgressOpt = Annotated[
    bool | None,
    typer.Option(
        "--progress/--quiet",
        help="Progress bars (bytes, rate, ETA) on stderr (default: when stderr is a terminal).",
        show_default=False,
    ),
]
NoCrcOpt = Annotated[
    bool, typer.Option("--no-crc", help="Skip checking the CRC-32 of every payload record (torch itself never checks them).")
]
