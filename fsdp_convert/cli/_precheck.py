"""The command line's own checks that need no torch: option values, OUT's kind, which paths exist.

They run before torch is imported (seconds on a cold cache), so a usage mistake is told at once.
Each repeats a rule the library applies again later, in the same words, for callers of the
library: ``transform.parse_dtype`` (``constants.DTYPE_NAMES``) and ``transform.parse_rename``;
``formats.dcp.read_dcp_index`` and ``ops.verify.open_source`` (a missing input);
``formats.check_not_one_dcp_file`` (one file of a DCP folder given as the checkpoint). OUT's kind and
what it refuses are the library's own functions, which import no torch: the outputs table's
``output_table.choose_row`` (which ``outputs.output_kind`` calls), ``check_only`` and
``check_verifiable``; OUT itself is checked by ``writers.check_output`` (not an input or around one,
no link, free, a folder replaced only if it is this tool's or with ``--force``).
tests/cli/test_precheck.py checks that each pair agrees. An fsspec URL (``scheme://``) is left to
the library, but for ``check_output``; ``file://`` is local.
"""

from __future__ import annotations

import re
from pathlib import Path

from fsdp_convert.errors import CheckpointNotFoundError, InvalidOptionError
from fsdp_convert.formats import check_not_one_dcp_file  # a name and a stat: no torch
from fsdp_convert.output_table import check_only, check_verifiable, choose_row
from fsdp_convert.outputs import own_files  # the tables, without torch
from fsdp_convert.writers import check_output

__all__ = [
    "DTYPE_NAMES",
    "dtype_name",
    "check_rename",
    "check_nodes",
    "check_lora_flags",
    "check_unstack",
    "check_checkpoint",
    "check_consolidate",
    "check_reshard",
    "check_verify",
    "check_argv",
]

# constants.DTYPE_NAMES (which maps to torch dtypes): every spelling, to the --dtype choice it means
DTYPE_NAMES = {
    "fp32": "fp32", "float32": "fp32",
    "bf16": "bf16", "bfloat16": "bf16",
    "fp16": "fp16", "float16": "fp16", "half": "fp16",
}  # fmt: skip
_COUNTED = re.compile(r"-[vq]+|--verbose|--quiet")  # -v, -vv, -q, ...: counts, not levels


def dtype_name(text: str, flag: str) -> str:
    """The ``--dtype`` choice (``fp32``, ``bf16`` or ``fp16``) that ``text`` spells, in any case.

    Raises:
        InvalidOptionError: not a dtype name (``transform.parse_dtype``'s words after the flag).
    """
    name = DTYPE_NAMES.get(text.strip().lower())
    if name is None:
        raise InvalidOptionError(f"{flag} {text!r} is not a dtype; use fp32, bf16 or fp16")
    return name


def check_rename(text: str) -> None:
    r"""Check one ``--rename REGEX=REPLACEMENT`` (``transform.parse_rename``: the last ``=`` splits).

    Raises:
        InvalidOptionError: no ``=``, nothing before it, or a regex that does not compile.
    """
    pattern, sep, _ = text.rpartition("=")
    if not sep or not pattern:
        raise InvalidOptionError(f"--rename {text!r}: expected REGEX=REPLACEMENT, e.g. '^layers\\.=model.layers.'")
    try:
        re.compile(pattern)
    except re.error as e:
        raise InvalidOptionError(f"--rename {text!r}: bad regex ({e})") from e


def check_nodes(nnodes: int, node_rank: int) -> None:
    """Check torchrun's ``--node-rank`` against ``--nnodes``.

    Raises:
        InvalidOptionError: a node rank outside ``--nnodes``.
    """
    if node_rank >= nnodes:
        raise InvalidOptionError(f"--node-rank {node_rank} is not below --nnodes {nnodes}")


def check_lora_flags(merge: bool, only: bool, config: str | None, alpha: float | None, r: int | None) -> None:
    """Check that the LoRA flags of ``consolidate`` go together.

    Raises:
        InvalidOptionError: ``--merge-lora`` with ``--lora-only``, or a LoRA setting without either.
    """
    if merge and only:
        raise InvalidOptionError("--merge-lora and --lora-only exclude each other: merge the adapter, or write it alone")
    if not (merge or only) and (config is not None or alpha is not None or r is not None):
        raise InvalidOptionError("--lora-config, --lora-alpha and --lora-r go with --merge-lora or --lora-only")


def check_unstack(unstack_layers: bool, optim_keys: str, adapter: str | None) -> None:
    """Check that ``--unstack-layers`` goes with the other flags (``transform.TransformOptions``' own check).

    Raises:
        InvalidOptionError: beside ``--adapter`` or ``--optim-keys ids``.
    """
    if unstack_layers and adapter is not None:
        raise InvalidOptionError("--unstack-layers and --adapter exclude each other: an adapter maps the stacked layers itself")
    if unstack_layers and optim_keys == "ids":
        raise InvalidOptionError("--unstack-layers names each layer's optimizer state; use --optim-keys names, not ids")


def _local(location: str) -> Path | None:
    """``remote.as_location`` for a local path (``file://`` removed); None for an fsspec URL."""
    if "://" in location and not location.startswith("file://"):
        return None
    return Path(location.removeprefix("file://"))


def check_checkpoint(checkpoint: str) -> None:
    """Check that a local checkpoint path exists and is not one file of a DCP folder.

    ``formats.dcp.read_dcp_index``'s first check, and ``formats.open_checkpoint``'s
    (``formats.check_not_one_dcp_file``).

    Raises:
        CheckpointNotFoundError: no such local path.
        NotADcpCheckpointError: ``.metadata`` or a ``__<rank>_<n>.distcp`` file, not its folder.
    """
    root = _local(checkpoint)
    if root is not None and not root.exists():
        raise CheckpointNotFoundError(f"{root} does not exist")
    if root is not None:
        check_not_one_dcp_file(root)


def check_consolidate(
    checkpoint: str,
    output: str,
    *,
    output_format: str,
    only: str,
    lora_only: bool,
    verify_output: bool,
    overwrite: bool,
    resume: bool,
    force: bool = False,
    hf_assets: str | None = None,
) -> None:
    """What ``ops.consolidate.consolidate`` checks first, in its order, without reading the checkpoint.

    The checkpoint exists; with ``--format auto``, OUT's suffix names a kind
    (``output_table.choose_row``: ``--lora-only`` has a folder OUT), which ``--verify`` reads back
    and whose groups ``--only`` names; OUT passes ``check_output`` (with ``--resume``, whether OUT
    is free is left to the library). An explicit ``--format`` is left to the library, which
    checks OUT once it is known free; ``check_output`` takes a name with a file suffix as a file.

    Raises:
        CheckpointNotFoundError: no such local checkpoint path.
        NotADcpCheckpointError: the checkpoint is one file of a DCP folder.
        InvalidOptionError: an unknown suffix, ``--lora-only`` with a file OUT or ``--verify``,
            optimizer state into a ``.safetensors`` file; OUT is the checkpoint or ``--hf-assets``,
            inside one or one of their folders; OUT's folder does not exist; an existing folder
            where a file is wanted.
        OutputExistsError: OUT is a link; a local OUT exists (but for an empty folder, for a folder
            output), without ``--overwrite`` or ``--resume``; a folder not this tool's, without ``--force``.
    """
    check_checkpoint(checkpoint)
    out = _local(output)
    directory = None
    if out is not None and output_format == "auto":
        row = choose_row(out, output_format, lora_only=lora_only)
        if verify_output:
            check_verifiable(row)
        check_only(row, only)
        directory = row.folder
    # with --resume the library decides whether OUT is free (a run's temporary beside OUT, its lock)
    check_output(
        output,
        (checkpoint, hf_assets),
        overwrite=overwrite,
        force=force,
        directory=directory,
        free=not resume,
        own_files=own_files(),  # the output kinds' files and the producers' beside them, from the tables
    )


def check_reshard(checkpoint: str, output: str, *, overwrite: bool, resume: bool, force: bool = False) -> None:
    """What ``ops.reshard.reshard`` checks first: the checkpoint exists and OUT passes ``check_output`` as a folder.

    Raises:
        CheckpointNotFoundError: no such local checkpoint path.
        NotADcpCheckpointError: the checkpoint is one file of a DCP folder.
        InvalidOptionError: OUT is the checkpoint, inside it or one of its folders; OUT's folder
            does not exist; OUT has a file suffix (``.pt``...), which a DCP folder does not take.
        OutputExistsError: OUT is a link; a local OUT exists (but for an empty folder), without
            ``--overwrite`` or ``--resume``; a folder not this tool's, without ``--force``.
    """
    check_checkpoint(checkpoint)
    check_output(output, (checkpoint,), overwrite=overwrite, force=force, directory=True, free=not resume, own_files=own_files())


def check_verify(a: str, b: str) -> None:
    """What ``ops.verify.open_source`` checks first: both local paths exist (taken as given, as it does).

    Raises:
        CheckpointNotFoundError: A or B does not exist.
    """
    for path in (a, b):
        if not ("://" in path and not path.startswith("file://")) and not Path(path).exists():
            raise CheckpointNotFoundError(f"{Path(path)} does not exist")


def check_argv(args: list[str]) -> None:
    """Catch ``-v 2`` before the command, which would otherwise read as the command ``2``.

    ``-v`` and ``-q`` count (``-vv``); a number is never a command, so one right after them is
    taken as a level the user meant.

    Raises:
        InvalidOptionError: a number right after ``-v``/``-q``, before the command.
    """
    for previous, arg in zip(args, args[1:]):
        if not previous.startswith("-"):
            return  # the command: what follows is its own
        if _COUNTED.fullmatch(previous) and arg.isdigit():
            raise InvalidOptionError(f"{previous} {arg}: {previous} takes no number; -v logs info, -vv debug, -q errors only")
