"""Options that say how a long run starts and is checked, shared by ``consolidate`` and ``reshard``.

Apart from ``cli/_options.py`` (at the module size limit): resuming an interrupted run, the space check.
"""

from __future__ import annotations

from typing import Annotated

import typer

__all__ = ["ResumeOpt", "NoSpaceCheckOpt"]


ResumeOpt = Annotated[
    bool,
    typer.Option(
        "--resume",
        help="Finish the interrupted run's temporary of OUT (.OUT.tmp-local, or .OUT.tmp-rdzv-ID of a multi-node or "
        "torchrun job, after a crash, SIGKILL or preemption): run with the same arguments (the job id may differ); what "
        "it wrote and fsynced is checked by CRC-32 and kept, the rest written.",
    ),
]


NoSpaceCheckOpt = Annotated[
    bool,
    typer.Option(
        "--no-space-check",
        help="Skip checking, before anything is read, that OUT fits in the free space where its temporary is written "
        "(for an fsspec URL: the local staging folder, under TMPDIR).",
    ),
]
