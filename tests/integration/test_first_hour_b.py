"""A newcomer's first hour, rows 5 and 6: what a rerun after an interrupted run says and does.

Row 5: ``--resume`` with other options than the interrupted run's names the options that differ
(``--only``, ``--dtype``, ...), and says the checkpoint differs only when it does. Row 6:
``--overwrite`` (without ``--resume``) discards the temporary an interrupted run of the same OUT
left, with its manifest, saying so, and writes the output afresh; a live run's is still refused.
The interrupted runs are real: a consolidation SIGTERMed half way (as a preemption, or Ctrl-C,
stops it: the temporary and its manifest are kept), by ``tests/_resume.py``'s hook.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

import pytest

from fsdp_convert.errors import OutputLockedError, OutputWriteError
from fsdp_convert.writers._atomic import atomic_output
from fsdp_convert.writers._manifest import NamedOptions, Record, check_manifest, manifest_dir, start_manifest
from fsdp_convert.writers._source_state import SourceDigest
from tests._resume import CASES, Reference, run_cli, same_output
from tests._samples import Sample


def _stopped(ws3_ckpt: Sample, ref: Reference, resume_hook: Path, folder: Path) -> tuple[list[str], Path]:
    """A ``.pt`` consolidation SIGTERMed half way: its arguments, and the temporary it kept (with its manifest)."""
    args, out_name = CASES["pt"]
    argv = [a.format(ck=ws3_ckpt.checkpoint, out=folder / out_name) for a in args]
    stopped = run_cli(argv, hook=resume_hook, kill={"RESUME_TEST_TERM_AFTER": str(ref[2] // 2)})
    assert stopped.returncode == 143 and "is kept: run again with --resume" in stopped.stderr, stopped.stderr
    tmp = folder / ".full.tmp-local.pt"
    assert sorted(p.name for p in folder.iterdir()) == [".full.manifest-local.pt", tmp.name]
    return argv, tmp


def _snapshot(tmp: Path) -> tuple[bytes, list[bytes]]:
    return tmp.read_bytes(), sorted(p.read_bytes() for p in manifest_dir(tmp).iterdir())


@pytest.mark.slow
def test_row5_resume_with_other_options_names_them(
    ws3_ckpt: Sample, resume_references: dict[str, Reference], resume_hook: Path, tmp_path: Path
) -> None:
    """``--resume --only model`` after an interrupted full run: one line naming ``--only`` (not the checkpoint), exit 1,
    nothing touched; ``--dtype bf16`` names ``--dtype``; the same arguments then finish it byte-identical."""
    argv, tmp = _stopped(ws3_ckpt, resume_references["pt"], resume_hook, tmp_path)
    before = _snapshot(tmp)
    for extra, named in ((["--only", "model"], "--only"), (["--dtype", "bf16"], "--dtype")):
        done = run_cli([*argv, "--resume", *extra])
        assert done.returncode == 1, done.stderr
        (line,) = done.stderr.strip().splitlines()
        assert f"cannot resume {tmp}: the options differ ({named}) from the interrupted run's; " in line, line
        assert "checkpoint differs" not in line and line.endswith("run without --resume"), line
        assert _snapshot(tmp) == before
    resumed = run_cli([*argv, "--resume"])
    assert resumed.returncode == 0, resumed.stderr
    same_output(tmp_path / "full.pt", resume_references["pt"][0])


_NAMED = NamedOptions(
    {"--format/--lora-only": "pt"},
    {"model": {"--include/--exclude": "m", "--dtype": "f32"}, "optim": {"--include/--exclude": "o", "--optim-dtype": "f32"}},
)


@pytest.mark.parametrize(
    ("checkpoint", "source", "named", "said"),
    [
        ("ck2", "read", _NAMED, "the checkpoint differs from the interrupted run's"),
        ("ck", "read2", NamedOptions(_NAMED.whole, {"model": _NAMED.groups["model"]}), "the options differ (--only)"),
        (
            "ck",
            "read",
            NamedOptions(
                {"--format/--lora-only": "st"}, {**_NAMED.groups, "model": {"--include/--exclude": "m", "--dtype": "bf16"}}
            ),
            "the options differ (--dtype, --format/--lora-only)",
        ),
        (
            "ck",
            "read2",
            NamedOptions(_NAMED.whole, {**_NAMED.groups, "model": {"--include/--exclude": "m2", "--dtype": "bf16"}}),
            "the options differ (--include/--exclude)",  # other entries: their dtypes are not compared
        ),
    ],
)
def test_row5_a_changed_option_is_named_and_a_changed_checkpoint_is_said(
    tmp_path: Path, checkpoint: str, source: str, named: NamedOptions, said: str
) -> None:
    """The manifest's checkpoint digest decides "the checkpoint differs"; the options by name decide which are named."""
    tmp = tmp_path / ".full.tmp-local.pt"
    tmp.write_bytes(b"\0" * 8)
    start_manifest(
        tmp, source=SourceDigest("read", {}, "", "ck"), options="o", named=_NAMED, files={"": 8}, records=[Record("", 0, 8)]
    )
    check_manifest(
        tmp, source=SourceDigest("read", {}, "", "ck"), options="o", named=_NAMED, files={"": 8}, records=[Record("", 0, 8)]
    )
    with pytest.raises(OutputWriteError, match=r"^cannot resume \S+: ") as e:
        check_manifest(
            tmp,
            source=SourceDigest(source, {}, "", checkpoint),
            options="o",
            named=named,
            files={"": 8},
            records=[Record("", 0, 8)],
        )
    assert said in e.value.cli_text()


@pytest.mark.slow
def test_row6_overwrite_discards_an_interrupted_runs_temporary(
    ws3_ckpt: Sample, resume_references: dict[str, Reference], resume_hook: Path, tmp_path: Path
) -> None:
    """``--overwrite`` after an interrupted run: its temporary and manifest are discarded (a warning names the temporary),
    the output is written afresh, byte-identical, and nothing is left beside it."""
    argv, tmp = _stopped(ws3_ckpt, resume_references["pt"], resume_hook, tmp_path)
    refused = run_cli(argv)  # without --overwrite or --resume: refused, as before
    assert refused.returncode == 4 and f"{tmp} is left from an earlier run" in refused.stderr, refused.stderr
    done = run_cli([*argv, "--overwrite"])
    assert done.returncode == 0, done.stderr
    said = "".join(done.stderr.split())  # the log handler wraps long lines
    assert f"discardedthetemporary{tmp}(" in said and "leftbyaninterruptedrun" in said, done.stderr
    same_output(tmp_path / "full.pt", resume_references["pt"][0])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["full.pt"]


def test_row6_overwrite_discards_a_left_temporary_but_not_a_live_runs(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """A live run's temporary (its lock held) is still refused with ``overwrite``; once it is gone, it is discarded."""
    out = tmp_path / "hf"
    live = atomic_output(out, overwrite=False, directory=True)
    tmp = live.__enter__()
    (tmp / "a").write_bytes(b"a")
    manifest_dir(tmp).mkdir()
    with pytest.raises(OutputLockedError, match=f"pid {os.getpid()}"), atomic_output(out, overwrite=True, directory=True):
        pass
    assert (tmp / "a").read_bytes() == b"a" and manifest_dir(tmp).is_dir()  # untouched
    assert not caplog.records
    live.__exit__(None, None, None)  # the live run finishes as it would have
    assert (out / "a").read_bytes() == b"a"


def test_row6_overwrite_discards_a_temporary_and_its_manifest(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    out = tmp_path / "full.pt"
    left = tmp_path / ".full.tmp-local.pt"
    left.write_bytes(b"partial")
    manifest_dir(left).mkdir()
    (manifest_dir(left) / "manifest.json").write_text("{}")
    other = tmp_path / ".full.tmp-rdzv-j.pt"  # another job's, stopped too: no live run holds the lock
    other.write_bytes(b"")
    with caplog.at_level(logging.WARNING), atomic_output(out, overwrite=True) as tmp:
        assert tmp == left and tmp.read_bytes() == b""  # afresh
        tmp.write_bytes(b"whole")
    assert out.read_bytes() == b"whole" and sorted(p.name for p in tmp_path.iterdir()) == ["full.pt"]
    said = [r.getMessage() for r in caplog.records]
    assert any(f"discarded the temporary {left} (" in m and "left by an interrupted run" in m for m in said), said
