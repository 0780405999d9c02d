"""Reusable ``Annotated`` parameters, shared by the commands."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

__all__ = ["CheckpointArg", "OutputArg", "JsonOpt", "OverwriteOpt", "NprocOpt", "ProgressOpt"]

CheckpointArg = Annotated[
    Path, typer.Argument(metavar="CHECKPOINT_DIR", help="DCP checkpoint folder (the one holding .metadata).", show_default=False)
]
OutputArg = Annotated[
    Path,
    typer.Argument(metavar="OUT", help="Output file: .pt/.pth/.bin (torch.save) or .safetensors.", show_default=False),
]
JsonOpt = Annotated[bool, typer.Option("--json", help="Print one JSON document on stdout instead of a table.")]
OverwriteOpt = Annotated[bool, typer.Option("--overwrite", help="Replace OUT if it exists (only once the new one is complete).")]
NprocOpt = Annotated[
    int,
    typer.Option("--nproc", min=1, help="Reading workers; above 1 they are started with torch's elastic launcher (gloo, CPU)."),
]
ProgressOpt = Annotated[
    bool | None,
    typer.Option(
        "--progress/--quiet", help="Progress bar on stderr [default: on when stderr is a terminal].", show_default=False
    ),
]
