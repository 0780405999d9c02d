"""errors.py: each CheckpointError subclass carries the CLI exit code of its kind (3 input, 4 output exists, 2 usage, 1 else)."""

from __future__ import annotations

import copy
import dataclasses
import errno
import inspect
import os
import pickle

import pytest
import typer

from fsdp_convert import errors
from fsdp_convert.errors import CheckpointError, TerminatedError

EXPECTED = {
    "CheckpointError": 1,
    "CheckpointNotFoundError": 3,
    "NotADcpCheckpointError": 3,
    "MissingDataFileError": 3,
    "UnsafeContentError": 1,
    "CorruptChunkError": 1,
    "CoverageError": 1,
    "ShapeMismatchError": 1,
    "UnsupportedTransformError": 1,
    "InvalidOptionError": 2,
    "OutputExistsError": 4,
    "OutputLockedError": 4,
    "TemporaryExistsError": 4,
    "OutputWriteError": 1,
    "WorkerFailedError": 1,
    "VerificationError": 1,
    "TorchFeatureError": 1,
}


@pytest.mark.parametrize(("name", "code"), sorted(EXPECTED.items()))
def test_exit_code_of_each_error(name: str, code: int) -> None:
    cls = getattr(errors, name)
    assert issubclass(cls, CheckpointError)
    assert cls.exit_code == code
    assert cls("x").exit_code == code


def test_every_exported_checkpoint_error_has_an_expected_code() -> None:
    exported = {
        n for n in errors.__all__ if isinstance(getattr(errors, n), type) and issubclass(getattr(errors, n), CheckpointError)
    }
    assert exported == set(EXPECTED)


def test_terminated_is_not_a_checkpoint_error_and_keeps_its_signal() -> None:
    exc = TerminatedError(15)
    assert not isinstance(exc, Exception)  # `except Exception` cleanup paths do not swallow it
    assert exc.signum == 15 and "15" in str(exc)


# --- library wording: str(e) names keyword arguments, cli_text() the flags (errors.FLAG_KEYWORDS) ---


@pytest.mark.parametrize(
    ("written", "library"),
    [
        ("out.pt already exists; pass --overwrite to replace it", "out.pt already exists; pass overwrite=True to replace it"),
        ("free space or pass --no-space-check", "free space or pass space_check=False"),
        ("x is kept; run again with --resume", "x is kept; run again with resume=True"),
        ("--nproc must be at least 1, got 0", "nproc must be at least 1, got 0"),
        ("--format 'gguf': use auto, torch or safetensors", "output_format='gguf': use auto, torch or safetensors"),
        ("--dtype 'fp8' is not a dtype", "options.dtype='fp8' is not a dtype"),
        ("out: --format torch writes one file", "out: output_format torch writes one file"),
        ("left after --only/--include/--exclude)", "left after only/options.include/options.exclude)"),
        ("(check --include/--exclude/--rename)", "(check options.include/options.exclude/options.renames)"),
        ("--nnodes 2 needs --nproc-per-node, --rdzv-id", "cluster.nnodes 2 needs nproc, cluster.rdzv_id"),
        # no library keyword, or not a flag standing alone: as written
        ("run with --debug", "run with --debug"),
        ("--lora-r 2 contradicts --lora-config's 4", "--lora-r 2 contradicts --lora-config's 4"),
        ("/tmp/--overwrite and --overwrite.pt exist", "/tmp/--overwrite and --overwrite.pt exist"),
        ("torchrun --nproc-per-node=2 -m x", "torchrun --nproc-per-node=2 -m x"),
        ("already in library wording: overwrite=True", "already in library wording: overwrite=True"),
    ],
)
def test_library_wording_names_keywords_where_the_cli_names_flags(written: str, library: str) -> None:
    assert errors.library_wording(written) == library
    e = errors.OutputExistsError(written)
    assert str(e) == library and e.cli_text() == written
    assert errors.library_wording(library) == library  # idempotent: a message built from str(e) stays right


def test_cli_message_gives_the_command_lines_own_sentence() -> None:
    e = errors.OutputExistsError("pass overwrite=True, or write elsewhere", cli_message="pass --overwrite")
    assert str(e) == "pass overwrite=True, or write elsewhere" and e.cli_text() == "pass --overwrite"


def test_errors_keep_both_wordings_through_pickle() -> None:
    e = errors.OutputExistsError("x exists; pass --overwrite")
    back = pickle.loads(pickle.dumps(e))
    assert type(back) is errors.OutputExistsError and str(back) == str(e) and back.cli_text() == e.cli_text()
    e = errors.OutputExistsError("library", cli_message="cli")
    back = pickle.loads(pickle.dumps(e))
    assert (str(back), back.cli_text()) == ("library", "cli")


def test_an_error_rebuilt_from_its_cli_text_reads_the_same_both_ways() -> None:
    """What a worker must send its parent (launch.py) so the CLI still prints flags: ``cli_text()``.

    Rebuilt from ``str(e)`` the flags would be gone for good."""
    e = errors.InvalidOptionError("--nproc must be at least 1, got 0")
    rebuilt = errors.InvalidOptionError(e.cli_text())
    assert (str(rebuilt), rebuilt.cli_text()) == (str(e), e.cli_text())
    assert errors.InvalidOptionError(str(e)).cli_text() != e.cli_text()


def _cli_flags() -> set[str]:
    from fsdp_convert.cli import app

    group = typer.main.get_command(app)
    flags: set[str] = set()
    for command in [group, *group.commands.values()]:
        for param in command.params:
            flags.update(o for o in [*param.opts, *param.secondary_opts] if o.startswith("--"))
    return flags


def _library_keywords() -> set[str]:
    """What a table value may name: the operations' keywords, options.<TransformOptions field>, cluster.<Cluster field>."""
    from fsdp_convert import (
        Cluster,
        ConsolidateOptions,
        ReshardOptions,
        TransformOptions,
        VerifyOptions,
        consolidate,
        reshard,
        verify,
    )

    words = {p for fn in (consolidate, reshard, verify) for p in inspect.signature(fn).parameters}
    words |= {f.name for c in (ConsolidateOptions, ReshardOptions, VerifyOptions) for f in dataclasses.fields(c)}
    words |= {f"options.{f.name}" for f in dataclasses.fields(TransformOptions)}
    words |= {f"cluster.{f.name}" for f in dataclasses.fields(Cluster)}
    return words


def test_flag_table_maps_real_flags_to_real_keywords() -> None:
    """Each flag is one the CLI takes; each keyword one the library takes, with a value of its type."""
    assert set(errors.FLAG_KEYWORDS) <= _cli_flags()
    keywords = _library_keywords()
    for flag, word in errors.FLAG_KEYWORDS.items():
        name, _, value = word.partition("=")
        assert name in keywords, (flag, word)
        assert value in ("", "True", "False", "TransformOptions()"), (flag, word)
    # the switches set what the flag means: --no-space-check turns the check off
    assert errors.FLAG_KEYWORDS["--no-space-check"] == "space_check=False"
    assert errors.FLAG_KEYWORDS["--no-crc"] == "check_crc=False"
    assert errors.FLAG_KEYWORDS["--overwrite"] == "overwrite=True"


def test_every_cli_flag_with_a_library_keyword_is_in_the_table() -> None:
    """A new flag whose name is a keyword of the operations (``--foo`` for ``foo=``) must be added."""
    keywords = _library_keywords()
    missing = {f for f in _cli_flags() if f[2:].replace("-", "_") in keywords and f not in errors.FLAG_KEYWORDS}
    assert not missing


# --- CheckpointNotFoundError is a FileNotFoundError ---


def test_checkpoint_not_found_is_a_file_not_found_error() -> None:
    e = errors.CheckpointNotFoundError("/nowhere does not exist")
    assert isinstance(e, FileNotFoundError) and isinstance(e, OSError) and isinstance(e, CheckpointError)
    assert e.exit_code == 3 and e.errno == errno.ENOENT and e.strerror == os.strerror(errno.ENOENT)
    assert str(e) == "/nowhere does not exist" and e.args == ("/nowhere does not exist",)  # not "[Errno 2] ..."
    assert e.filename is None
    back = pickle.loads(pickle.dumps(e))
    assert type(back) is errors.CheckpointNotFoundError and back.errno == errno.ENOENT and str(back) == str(e)
    assert copy.copy(e).errno == errno.ENOENT
    with pytest.raises(FileNotFoundError):
        raise errors.CheckpointNotFoundError("--hf-assets x does not exist")
