"""Options that say how a long run starts and is checked: workers, nodes, an existing OUT, resuming, free space.

Shared by ``consolidate`` and ``reshard`` (and ``verify``'s workers and nodes); apart from
``cli/_options.py``, which says what is converted.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Annotated, Any

import typer

from fsdp_convert.cli._options import MULTI_NODE, PERFORMANCE, SAFETY, Choice, choice_option
from fsdp_convert.cli._precheck import check_nodes
from fsdp_convert.errors import InvalidOptionError

# launch is imported where used, so --help, --version and usage errors start with the least
if TYPE_CHECKING:
    from fsdp_convert.launch import Cluster

__all__ = [
    "NPROC_DEFAULT",
    "nproc_option",
    "NprocPerNodeOpt",
    "workers",
    "start_workers_early",
    "OverwriteOpt",
    "ForceOpt",
    "ResumeOpt",
    "NoSpaceCheckOpt",
    "RdzvBackendChoice",
    "NnodesOpt",
    "NodeRankOpt",
    "RdzvBackendOpt",
    "RdzvEndpointOpt",
    "RdzvIdOpt",
    "cluster_options",
]

# plan.default_nproc, what consolidate and reshard start when --nproc is not given
NPROC_DEFAULT = "one per CPU core, at most one per data file and per 2 GiB"


def nproc_option(help: str) -> Any:
    """``--nproc N`` (``--nproc-per-node``, torchrun's name, is a hidden alias: ``NprocPerNodeOpt``)."""
    return typer.Option("--nproc", metavar="N", min=1, help=help, show_default=False, rich_help_panel=PERFORMANCE)


NprocPerNodeOpt = Annotated[int | None, typer.Option("--nproc-per-node", min=1, hidden=True)]


def start_workers_early(nproc: int | None, *modules: str, torch: bool = False) -> None:
    """Start the forkserver the workers are forked from now, where ``--nproc`` asks for several; returns at once.

    Call after the torch-free checks: the server imports what the workers need (``modules``: the
    job function's; and torch with ``torch``, where the options compute tensors) in its own process while this
    one reads the index and plans; ``launch.run_workers`` then forks the workers from it at once
    (``launch.start_worker_server``). Not under the user's torchrun (no workers of ours), nor for
    the default ``--nproc`` (the plan may choose one worker).
    """
    if nproc is None or nproc < 2 or "LOCAL_RANK" in os.environ:
        return
    from fsdp_convert.launch import start_worker_server

    start_worker_server(*modules, *(["torch"] if torch else []))


def workers(nproc: int | None, nproc_per_node: int | None) -> int | None:
    """``--nproc``, or its alias ``--nproc-per-node``.

    Raises:
        InvalidOptionError: both, with different values.
    """
    if nproc is not None and nproc_per_node is not None and nproc != nproc_per_node:
        raise InvalidOptionError(f"--nproc {nproc} and --nproc-per-node {nproc_per_node} are one option; give it once")
    return nproc if nproc is not None else nproc_per_node


OverwriteOpt = Annotated[
    bool,
    typer.Option(
        "--overwrite", metavar="", help="Replace OUT if it exists (once the new one is complete).", rich_help_panel=SAFETY
    ),
]
ForceOpt = Annotated[
    bool,
    typer.Option(
        "--force",
        metavar="",
        help="With --overwrite, replace an OUT folder that does not look like fsdp-convert's output "
        "(files it does not write there): it is deleted.",
        rich_help_panel=SAFETY,
    ),
]
ResumeOpt = Annotated[
    bool,
    typer.Option(
        "--resume",
        metavar="",
        help="Finish the temporary (.OUT.tmp-*) a crashed or killed run left: same arguments; what it wrote "
        "and fsynced is checked by CRC-32 and kept.",
        rich_help_panel=SAFETY,
    ),
]
NoSpaceCheckOpt = Annotated[
    bool,
    typer.Option(
        "--no-space-check",
        metavar="",
        help="Skip checking, up front, that OUT fits in the free space (for a URL: in TMPDIR, where it is staged).",
        rich_help_panel=SAFETY,
    ),
]


class RdzvBackendChoice(Choice):
    """``--rdzv-backend``: torchrun's rendezvous backends that need no extra service."""

    c10d = "c10d"
    static = "static"


NnodesOpt = Annotated[
    int,
    typer.Option("--nnodes", metavar="N", min=1, help="Nodes; run the same command on each.", rich_help_panel=MULTI_NODE),
]
NodeRankOpt = Annotated[
    int,
    typer.Option(
        "--node-rank",
        metavar="N",
        min=0,
        help="This node's rank (static; c10d assigns them).",
        rich_help_panel=MULTI_NODE,
    ),
]
RdzvBackendOpt = Annotated[
    RdzvBackendChoice,
    choice_option(RdzvBackendChoice, "--rdzv-backend", help="Rendezvous backend.", rich_help_panel=MULTI_NODE),
]
RdzvEndpointOpt = Annotated[
    str,
    typer.Option(
        "--rdzv-endpoint",
        metavar="HOST:PORT",
        help="Endpoint every node reaches.",
        show_default=False,
        rich_help_panel=MULTI_NODE,
    ),
]
RdzvIdOpt = Annotated[
    str,
    typer.Option(
        "--rdzv-id", metavar="ID", help="The run's id, the same on every node.", show_default=False, rich_help_panel=MULTI_NODE
    ),
]


def cluster_options(nnodes: int, node_rank: int, rdzv_backend: RdzvBackendChoice, rdzv_endpoint: str, rdzv_id: str) -> Cluster:
    """The ``Cluster`` torchrun's flags describe.

    Raises:
        InvalidOptionError: a node rank outside ``--nnodes``.
    """
    check_nodes(nnodes, node_rank)
    from fsdp_convert.launch import Cluster

    return Cluster(
        nnodes=nnodes, node_rank=node_rank, rdzv_backend=rdzv_backend.value, rdzv_endpoint=rdzv_endpoint, rdzv_id=rdzv_id
    )
