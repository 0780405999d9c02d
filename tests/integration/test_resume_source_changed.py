"""``--resume`` refuses a checkpoint whose data files changed since the interrupted run: mixing two saves is never resumed.

A consolidation of (a copy of) the 3-rank sample is SIGKILLed half way (``tests/_resume.py``'s
hook); then the data files of a second save of the same run (one more training step: the same
layout, every payload the same size) are copied over the checkpoint's, its ``.metadata`` kept.
Before the fix ``--resume`` exited 0 with an output whose kept tensors came from the first save
and the rest from the second. Now it exits 1 with one line naming the data file, before anything
is read or moved: whether the copy gives the files a new modification time (``cp``) or keeps the
old one (``cp -p``, where the payloads' CRC-32s tell them apart).
"""

from __future__ import annotations

import shutil
import signal
from pathlib import Path

import pytest
import torch

from fsdp_convert._sample import CHECKPOINT_DIRNAME, SampleConfig, train_and_save
from tests._dist import run_ranks
from tests._resume import CASES, Reference, logged_records, manifest_of, read_log, run_cli
from tests._samples import Sample

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def second_save(ws3_ckpt: Sample, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The sample's run trained one step further, saved the same way: the same data files, sizes and ``.metadata`` ranges."""
    out = tmp_path_factory.mktemp("second-save")
    run_ranks(train_and_save, ws3_ckpt.world_size, out, SampleConfig(dtype=ws3_ckpt.dtype, steps=SampleConfig().steps + 1))
    ckpt = out / CHECKPOINT_DIRNAME
    first = {p.name: p.stat().st_size for p in ws3_ckpt.checkpoint.glob("*.distcp")}
    assert {p.name: p.stat().st_size for p in ckpt.glob("*.distcp")} == first  # the same layout
    assert all((ckpt / n).read_bytes() != (ws3_ckpt.checkpoint / n).read_bytes() for n in first)  # other data
    return ckpt


def _snapshot(folder: Path) -> dict[str, bytes]:
    return {p.relative_to(folder).as_posix(): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


@pytest.mark.parametrize("copy", ["cp", "cp -p"])
def test_resume_refuses_data_files_another_save_replaced(
    copy: str,
    ws3_ckpt: Sample,
    second_save: Path,
    resume_references: dict[str, Reference],
    resume_hook: Path,
    tmp_path: Path,
) -> None:
    ckpt, work = tmp_path / "ckpt", tmp_path / "out"
    shutil.copytree(ws3_ckpt.checkpoint, ckpt)
    work.mkdir()
    args, out_name = CASES["pt"]
    argv = [a.format(ck=ckpt, out=work / out_name) for a in args]
    half = resume_references["pt"][2] // 2  # the bytes an uninterrupted run moves, halved
    killed = run_cli(argv, hook=resume_hook, kill={"RESUME_TEST_KILL_AFTER": str(half)})
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    logged = logged_records(manifest_of(work))
    assert logged, "the run was killed before it logged a record"

    for data_file in sorted(second_save.glob("*.distcp")):
        shutil.copyfile(data_file, ckpt / data_file.name)  # a new modification time
        if copy == "cp -p":  # the time the replaced file had: its size and time are the same, its data is not
            shutil.copystat(ws3_ckpt.checkpoint / data_file.name, ckpt / data_file.name)
            assert (ckpt / data_file.name).stat().st_mtime_ns == (ws3_ckpt.checkpoint / data_file.name).stat().st_mtime_ns
    before = _snapshot(work)

    resumed = run_cli([*argv, "--resume"], logs=tmp_path / "reads")
    assert resumed.returncode == 1, resumed.stderr
    lines = resumed.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: cannot resume "), resumed.stderr
    what = "modification time differs" if copy == "cp" else "payloads' CRC-32s differ"
    named = f"the checkpoint's data file {ckpt / '__0_0.distcp'} changed since the interrupted run began"
    assert f"{named} (its {what}); put it back, or remove " in lines[0], lines[0]
    assert read_log(tmp_path / "reads") == [], "read before refusing"
    assert _snapshot(work) == before, "the temporary or its manifest was touched"
    assert not (work / out_name).exists()

    # the same files put back as they were: the interrupted run resumes, and the output is the first save's alone
    for data_file in sorted(ws3_ckpt.checkpoint.glob("*.distcp")):
        shutil.copy2(data_file, ckpt / data_file.name)
    resumed = run_cli([*argv, "--resume"])
    assert resumed.returncode == 0, resumed.stderr
    assert (work / out_name).read_bytes() == resume_references["pt"][0].read_bytes()
    got = torch.load(work / out_name, weights_only=True)
    assert torch.equal(got["model"]["output.weight"], ws3_ckpt.truth()["model"]["output.weight"])
