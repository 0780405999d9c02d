"""The one error handler: input errors in the CLI's words, user file errors as exit 1, bugs as exit 70; verify as cmp."""

from __future__ import annotations

import dataclasses
import errno
import json
from pathlib import Path
from typing import Any

import pytest
import torch
from typer.testing import CliRunner

from fsdp_convert.cli import app, inspect_cmd, verify_cmd
from fsdp_convert.cli._errors import EX_SOFTWARE
from fsdp_convert.errors import CorruptChunkError, InvalidOptionError, OutputExistsError
from fsdp_convert.ops.verify import Difference, VerifyResult
from tests._samples import Sample


def _one_line(result: Any, code: int) -> str:
    assert result.exit_code == code, (result.exit_code, result.stdout, result.stderr)
    assert result.stdout == ""
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and "Traceback" not in result.stderr, result.stderr
    return str(lines[0])


def _inspect_raising(monkeypatch: pytest.MonkeyPatch, exc: BaseException) -> None:
    def boom(_: object) -> None:
        raise exc

    monkeypatch.setattr(inspect_cmd, "inspect_checkpoint", boom)


@pytest.mark.parametrize(
    ("exc", "line"),
    [
        (PermissionError(errno.EACCES, "Permission denied", "/data/ck/__0_0.distcp"), "/data/ck/__0_0.distcp: Permission denied"),
        (OSError(errno.ENOSPC, "No space left on device", "/out/o.pt"), "/out/o.pt: No space left on device"),
        (FileNotFoundError(errno.ENOENT, "No such file or directory", "/a", None, "/b"), "/a, /b: No such file or directory"),
    ],
)
def test_os_errors_about_the_users_files_exit_1(
    runner: CliRunner, monkeypatch: pytest.MonkeyPatch, tmp_path: Path, exc: OSError, line: str
) -> None:
    _inspect_raising(monkeypatch, exc)
    assert _one_line(runner.invoke(app, ["inspect", str(tmp_path)]), 1) == f"error: {line}"


@pytest.mark.parametrize(
    "exc", [RuntimeError("gloo said no"), KeyError("model.w"), OSError(errno.EBADF, "Bad file descriptor"), TypeError("x")]
)
def test_any_other_exception_is_an_internal_error(
    runner: CliRunner, monkeypatch: pytest.MonkeyPatch, tmp_path: Path, exc: Exception
) -> None:
    _inspect_raising(monkeypatch, exc)
    line = _one_line(runner.invoke(app, ["inspect", str(tmp_path)]), EX_SOFTWARE)
    assert line.startswith(f"error: internal error: {type(exc).__name__}: {exc} (please report this ")
    assert line.endswith(" with the output of --debug)")
    result = runner.invoke(app, ["--debug", "inspect", str(tmp_path)])
    assert result.exit_code == EX_SOFTWARE and "Traceback" in result.stderr


def test_internal_error_names_where_to_report(runner: CliRunner, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    from importlib.metadata import metadata

    urls = dict(entry.split(", ", 1) for entry in metadata("fsdp-convert").get_all("Project-URL") or [])
    _inspect_raising(monkeypatch, ValueError("kaput"))
    line = _one_line(runner.invoke(app, ["inspect", str(tmp_path)]), EX_SOFTWARE)
    where = f"at {urls['Issues']}" if "Issues" in urls else "to the fsdp-convert maintainers"  # as the installed metadata says
    assert f"(please report this {where} with the output of --debug)" in line


def test_checkpoint_errors_print_the_cli_wording(runner: CliRunner, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """``str(e)`` is the library's wording; the CLI prints ``cli_text()``, which names flags."""
    exc = OutputExistsError("o.pt already exists; pass overwrite=True", cli_message="o.pt already exists; pass --overwrite")
    _inspect_raising(monkeypatch, exc)
    assert _one_line(runner.invoke(app, ["inspect", str(tmp_path)]), 4) == "error: o.pt already exists; pass --overwrite"


# --- verify: exit codes as cmp and diff (0 equal, 1 different, 2 trouble)


def _fake_verify(monkeypatch: pytest.MonkeyPatch, outcome: VerifyResult | BaseException) -> dict[str, Any]:
    seen: dict[str, Any] = {}

    def fake(a: str, b: str, options: Any = None, **kwargs: Any) -> VerifyResult:
        if options is not None:  # the command builds VerifyOptions by keyword: its fields are what it asked
            seen.update({f.name: getattr(options, f.name) for f in dataclasses.fields(options)})
        seen.update(kwargs)
        if isinstance(outcome, BaseException):
            raise outcome
        return outcome

    monkeypatch.setattr(verify_cmd, "verify", fake)
    return seen


def test_verify_exit_codes(runner: CliRunner, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    a, b = str(tmp_path), str(tmp_path)
    _fake_verify(monkeypatch, VerifyResult(a=a, b=b, compared=3, differences=()))
    result = runner.invoke(app, ["verify", a, b])
    assert result.exit_code == 0 and result.stdout.startswith("equal: 3 entries match"), result.stderr
    diff = Difference(key="model.w", kind="differs", detail="max abs diff 1")
    _fake_verify(monkeypatch, VerifyResult(a=a, b=b, compared=3, differences=(diff,)))
    result = runner.invoke(app, ["verify", a, b, "--json"])
    assert result.exit_code == 1 and json.loads(result.stdout)["equal"] is False
    for exc in (CorruptChunkError("ck/__0_0.distcp: truncated"), InvalidOptionError("--atol -1: must be positive")):
        _fake_verify(monkeypatch, exc)
        assert _one_line(runner.invoke(app, ["verify", a, b]), 2) == f"error: {exc.cli_text()}"  # not 1: that is "different"
    _fake_verify(monkeypatch, PermissionError(errno.EACCES, "Permission denied", "/x.pt"))
    assert _one_line(runner.invoke(app, ["verify", a, b]), 2) == "error: /x.pt: Permission denied"
    _fake_verify(monkeypatch, ValueError("kaput"))
    assert _one_line(runner.invoke(app, ["verify", a, b]), EX_SOFTWARE).startswith("error: internal error: ValueError")
    missing = str(tmp_path / "nope")
    assert _one_line(runner.invoke(app, ["verify", a, missing]), 2) == f"error: {missing} does not exist"
    assert runner.invoke(app, ["verify", a, b, "--dtype", "fp8"]).exit_code == 2
    assert "0 the two are equal" in " ".join(runner.invoke(app, ["verify", "--help"], env={"COLUMNS": "80"}).stdout.split())


def test_verify_passes_dtypes_and_progress(runner: CliRunner, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    seen = _fake_verify(monkeypatch, VerifyResult(a="a", b="b", compared=1, differences=()))
    result = runner.invoke(app, ["verify", str(tmp_path), str(tmp_path), "--dtype", "bfloat16", "--optim-dtype", "FP16"])
    assert result.exit_code == 0, result.stderr
    assert (seen["dtype"], seen["optim_dtype"], seen["progress"]) == (torch.bfloat16, torch.float16, False)
    result = runner.invoke(app, ["verify", str(tmp_path), str(tmp_path), "--progress", "--nproc-per-node", "2"])
    assert result.exit_code == 0, result.stderr
    assert (seen["dtype"], seen["optim_dtype"], seen["progress"], seen["nproc"]) == (None, None, True, 2)


def test_verify_a_missing_data_file_is_exit_2(runner: CliRunner, ws3_ckpt: Sample, tmp_path: Path) -> None:
    """A real unreadable input, through the library: trouble, not "different"."""
    import shutil

    ck = tmp_path / "ck"
    shutil.copytree(ws3_ckpt.checkpoint, ck)
    (ck / "__1_0.distcp").unlink()
    line = _one_line(runner.invoke(app, ["verify", str(ws3_ckpt.checkpoint), str(ck)]), 2)
    assert str(ck / "__1_0.distcp") in line


def test_verify_hint_goes_to_stderr(runner: CliRunner, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """stdout carries the result (the table of differences); the hint about key names is not part of it."""
    diffs = (Difference(key="w", kind="missing", detail="only in A"), Difference(key="model.w", kind="extra", detail="only in B"))
    _fake_verify(monkeypatch, VerifyResult(a="a", b="b", compared=0, differences=diffs))
    result = runner.invoke(app, ["verify", str(tmp_path), str(tmp_path)])
    assert result.exit_code == 1
    assert "model.w" in result.stdout and "hint" not in result.stdout
    assert result.stderr.startswith("hint: the two sides name keys differently; --as-consolidated")
