"""A DeepSpeed save whose files were tampered with: nothing in them runs, and each refusal is one line naming the file.

DeepSpeed's files are torch.save zips whose pickles name three DeepSpeed classes (``LossScaler``,
``ZeroStageEnum``, ``fragment_address``), which ``deepspeed_files`` admits as inert records. Each
attack starts from a real save (``deepspeed_runs``, copied into ``tmp_path``) and replaces one
file's ``data.pkl`` (written opcode by opcode, the zip rewritten with ``zipfile`` as torch lays it
out: ``<name>/data.pkl`` beside the storage records), or splices a few opcodes into the real pickle.
A successful exploit would create the marker file (``os.system("touch MARKER")``); every run checks
it is absent. Then the tag lookup (``latest`` naming a folder outside the save, links out of it),
and ``reshard``, which writes the records back: its pickles may name only torch's, ``collections``'
and DeepSpeed's globals.
"""

from __future__ import annotations

import os
import pickletools
import re
import shutil
import zipfile
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner, Result

from fsdp_convert.cli.app import app
from fsdp_convert.errors import UnsafeContentError

from ._attack import SECONDS_BOUND, Attack, attack

TAG = "step2"
OPTIM_1 = f"{TAG}/zero_pp_rank_1_mp_rank_00_optim_states.pt"
OPTIM_0 = f"{TAG}/zero_pp_rank_0_mp_rank_00_optim_states.pt"
LOSS_SCALER = ("deepspeed.runtime.fp16.loss_scaler", "LossScaler")
ZERO_STAGE = ("deepspeed.runtime.zero.config", "ZeroStageEnum")
FRAGMENT = ("deepspeed.utils.tensor_fragment", "fragment_address")

# --- pickles by opcode ----------------------------------------------------------------------------

PROTO, STOP, MARK, NONE = b"\x80\x02", b".", b"(", b"N"
EMPTY_DICT, EMPTY_TUPLE, EMPTY_LIST = b"}", b")", b"]"
TUPLE, TUPLE1, TUPLE2 = b"t", b"\x85", b"\x86"
SETITEM, BUILD, REDUCE, NEWOBJ = b"s", b"b", b"R", b"\x81"


def text(s: str) -> bytes:
    raw = s.encode()
    return b"\x8c" + bytes([len(raw)]) + raw


def glob(module: str, name: str) -> bytes:
    return b"c" + module.encode() + b"\n" + name.encode() + b"\n"


def stack_glob(module: str, name: str) -> bytes:
    return text(module) + text(name) + b"\x93"


def item(key: str, value: bytes) -> bytes:
    """``key: value`` added to the dict on top of the stack."""
    return text(key) + value + SETITEM


def optim_file(value: bytes) -> bytes:
    """A whole optimizer file's pickle: ``{"optimizer_state_dict": {"loss_scaler": value}}``."""
    return PROTO + EMPTY_DICT + text("optimizer_state_dict") + EMPTY_DICT + item("loss_scaler", value) + SETITEM + STOP


def system(marker: Path) -> bytes:
    """``os.system("touch MARKER")``: what every attack tries to reach."""
    return glob("os", "system") + text(f"touch {marker}") + TUPLE1 + REDUCE


# --- the save and its files -----------------------------------------------------------------------


def copy_save(deepspeed_runs: dict[int, Path], tmp_path: Path, variant: str = "z1", world_size: int = 2) -> Path:
    """DeepSpeed's own save of ``variant`` (``latest`` and the tag folder), copied to ``tmp_path/<variant>``."""
    ckpt = tmp_path / variant
    ckpt.mkdir()
    shutil.copy(deepspeed_runs[world_size] / variant / "latest", ckpt / "latest")
    shutil.copytree(deepspeed_runs[world_size] / variant / TAG, ckpt / TAG)
    return ckpt


def read_pickle(path: Path) -> bytes:
    with zipfile.ZipFile(path) as z:
        (name,) = [n for n in z.namelist() if n.endswith("/data.pkl")]
        return z.read(name)


def write_pickle(path: Path, data: bytes) -> None:
    """``path`` (a torch.save zip) with its ``data.pkl`` replaced by ``data``, every other record as it was, stored."""
    tmp = path.with_name(path.name + ".tmp")
    with zipfile.ZipFile(path) as zin, zipfile.ZipFile(tmp, "w", zipfile.ZIP_STORED) as zout:
        for info in zin.infolist():
            zout.writestr(info.filename, data if info.filename.endswith("/data.pkl") else zin.read(info))
    tmp.replace(path)


def _ops(data: bytes) -> list[tuple[str, Any, int]]:
    return [(op.name, arg, pos or 0) for op, arg, pos in pickletools.genops(data)]


def before_build_of(data: bytes, cls: tuple[str, str], extra: bytes) -> bytes:
    """``extra`` spliced into the real pickle just before the BUILD of the first ``cls`` instance (its state dict on top)."""
    ops = _ops(data)
    at = next(i for i, (name, arg, _) in enumerate(ops) if name == "GLOBAL" and arg == " ".join(cls))
    build = next(pos for name, _, pos in ops[at:] if name == "BUILD")
    return data[:build] + extra + data[build:]


def replace_first_int_after(data: bytes, cls: tuple[str, str], value: bytes) -> bytes:
    """The real pickle with the first small int after ``cls``'s global (``ZeroStageEnum(1)``'s 1) replaced by ``value``."""
    ops = _ops(data)
    at = next(i for i, (name, arg, _) in enumerate(ops) if name == "GLOBAL" and arg == " ".join(cls))
    pos = next(pos for name, _, pos in ops[at:] if name == "BININT1")
    return data[:pos] + value + data[pos + 2 :]


def tensor_with_state(data: bytes, state: bytes) -> bytes:
    """The real pickle with its first tensor pickled as torch pickles a tensor with a ``__dict__``: ``state`` its BUILD.

    ``_rebuild_tensor_v2(args)`` becomes ``_rebuild_from_type_v2(_rebuild_tensor_v2, Tensor, args, state)``
    (``Tensor._reduce_ex_internal``); the memo keeps ``_rebuild_tensor_v2`` where the file put it.
    """
    ops = _ops(data)
    at = next(i for i, (name, arg, _) in enumerate(ops) if name == "GLOBAL" and arg == "torch._utils _rebuild_tensor_v2")
    after = ops[at + 2][2] if ops[at + 1][0] in ("BINPUT", "LONG_BINPUT", "MEMOIZE") else ops[at + 1][2]
    depth = 0
    for name, _, pos in ops[at + 1 :]:
        depth += {"MARK": 1, "TUPLE": -1}.get(name, 0)
        if name == "REDUCE" and depth == 0:
            reduce = pos
            break
    start = ops[at][2]
    return (
        data[:start]
        + glob("torch._tensor", "_rebuild_from_type_v2")
        + MARK
        + data[start:after]
        + glob("torch", "Tensor")
        + data[after:reduce]
        + state
        + TUPLE
        + data[reduce:]
    )


def refused_one_line(run: Attack, file: Path, *named: str) -> None:
    """A fresh process: exit 1, stderr one ``error:`` line naming ``file`` and each of ``named``, within the time bound."""
    assert run.code == UnsafeContentError.exit_code == 1, run.stderr
    assert run.stderr.strip().splitlines() == run.error_lines and len(run.error_lines) == 1, run.stderr
    line = run.error_lines[0]
    assert str(file) in line and all(n in line for n in named), line
    assert run.seconds < 3 * SECONDS_BOUND


def inspect(runner: CliRunner, *args: str | Path) -> Result:
    """``fsdp-convert inspect ARGS`` in this process (the command as the CLI runs it, without a process's start-up)."""
    return runner.invoke(app, ["inspect", *map(str, args)])


def one_line(result: Result, exit_code: int, *named: str) -> str:
    """Exit ``exit_code``, nothing on stdout, stderr one ``error:`` line naming each of ``named``; the line."""
    assert result.exit_code == exit_code, (result.exit_code, result.stdout, result.stderr)
    lines = result.stderr.strip().splitlines()
    assert result.stdout == "" and len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    assert all(n in lines[0] for n in named), (named, lines[0])
    return lines[0]


# --- a hostile optimizer file, per admitted class ---------------------------------------------------


def _hostile(marker: Path) -> dict[str, tuple[bytes, str]]:
    """Whole optimizer pickles that would reach ``os.system`` through an admitted class, and the global each names.

    The value is what the error line must name: the refused global, or the refused operation on the admitted class.
    """
    call = system(marker)
    ls_module, zs_module, fa_module = LOSS_SCALER[0], ZERO_STAGE[0], FRAGMENT[0]
    return {
        # LossScaler
        "LossScaler state holding a call": (
            glob(*LOSS_SCALER) + EMPTY_TUPLE + NEWOBJ + EMPTY_DICT + item("cur_scale", call) + BUILD,
            "global os.system",
        ),
        "LossScaler's module as a path to os.system": (
            glob(ls_module, "os.system") + text(f"touch {marker}") + TUPLE1 + REDUCE,
            f"global {ls_module}.os.system",
        ),
        "the os module LossScaler's module imports": (
            glob("builtins", "getattr") + glob(ls_module, "os") + text("system") + TUPLE2 + REDUCE,
            f"global {ls_module}.os ",
        ),
        "LossScaler's module as a package, STACK_GLOBAL": (
            stack_glob(f"{ls_module}.os", "system") + text(f"touch {marker}") + TUPLE1 + REDUCE,
            f"global {ls_module}.os.system",
        ),
        "getattr of LossScaler's __init__": (
            glob("builtins", "getattr") + glob(*LOSS_SCALER) + text("__init__") + TUPLE2 + REDUCE,
            "getattr(class LossScaler, __init__)",
        ),
        "BUILD on the LossScaler class sets __reduce__": (
            glob(*LOSS_SCALER) + NONE + EMPTY_DICT + item("__reduce__", text("x")) + TUPLE2 + BUILD,
            "set the state of class LossScaler",
        ),
        "BUILD on a LossScaler sets __class__ to os.system": (
            glob(*LOSS_SCALER)
            + EMPTY_TUPLE
            + NEWOBJ
            + NONE
            + EMPTY_DICT
            + item("__class__", glob("os", "system"))
            + TUPLE2
            + BUILD,
            "global os.system",
        ),
        "DynamicLossScaler made with a call as its argument": (
            glob(ls_module, "DynamicLossScaler") + call + TUPLE1 + REDUCE,
            "global os.system",
        ),
        # ZeroStageEnum
        "ZeroStageEnum of a call": (glob(*ZERO_STAGE) + call + TUPLE1 + REDUCE, "global os.system"),
        "a ZeroStageEnum record called": (
            glob(*ZERO_STAGE) + b"K\x01" + TUPLE1 + REDUCE + text(f"touch {marker}") + TUPLE1 + REDUCE,
            "calling a ZeroStageEnum",
        ),
        "ZeroStageEnum's __new__": (
            glob(f"{zs_module}.ZeroStageEnum", "__new__") + EMPTY_TUPLE + REDUCE,
            "ZeroStageEnum.__new__",
        ),
        # fragment_address
        "fragment_address.__init__, nested GLOBAL": (glob(fa_module, "fragment_address.__init__"), "fragment_address.__init__"),
        "fragment_address.__init__.__globals__, STACK_GLOBAL": (
            stack_glob(f"{fa_module}.fragment_address", "__init__.__globals__"),
            "fragment_address.__init__.__globals__",
        ),
        "fragment_address made with posix.system": (
            glob(*FRAGMENT) + glob("posix", "system") + TUPLE1 + NEWOBJ,
            "global posix.system",
        ),
        "fragment_address state holding eval": (
            glob(*FRAGMENT)
            + EMPTY_TUPLE
            + NEWOBJ
            + EMPTY_DICT
            + item("numel", glob("builtins", "eval") + text("__import__('os').system('true')") + TUPLE1 + REDUCE)
            + BUILD,
            "global builtins.eval",
        ),
        # classes not admitted
        "DeepSpeedZeroConfig": (
            glob(zs_module, "DeepSpeedZeroConfig") + EMPTY_TUPLE + NEWOBJ + EMPTY_DICT + item("stage", b"K\x03") + BUILD,
            f"global {zs_module}.DeepSpeedZeroConfig",
        ),
        "CreateLossScaler": (glob(ls_module, "CreateLossScaler") + EMPTY_TUPLE + REDUCE, f"global {ls_module}.CreateLossScaler"),
        "deepspeed.initialize": (glob("deepspeed", "initialize") + EMPTY_TUPLE + REDUCE, "global deepspeed.initialize"),
    }


CASES = sorted(_hostile(Path("MARKER")))
# in a fresh process, as a user runs it: one per admitted class and one not admitted
IN_A_PROCESS = [
    "LossScaler state holding a call",
    "a ZeroStageEnum record called",
    "fragment_address.__init__, nested GLOBAL",
    "DeepSpeedZeroConfig",
]


@pytest.mark.parametrize("case", CASES)
def test_a_hostile_optimizer_file_is_refused_naming_it_and_nothing_runs(
    deepspeed_runs: dict[int, Path], runner: CliRunner, tmp_path: Path, case: str
) -> None:
    marker = tmp_path / "pwned"
    ckpt = copy_save(deepspeed_runs, tmp_path)
    value, named = _hostile(marker)[case]
    write_pickle(ckpt / OPTIM_1, optim_file(value))
    one_line(inspect(runner, ckpt), 1, str(ckpt / OPTIM_1), "would run code", named)
    assert not marker.exists()
    if case in IN_A_PROCESS:
        refused_one_line(attack(["inspect", ckpt]), ckpt / OPTIM_1, "would run code", named)
        assert not marker.exists()


@pytest.mark.parametrize(
    ("variant", "world_size", "file"),
    [
        ("z3", 3, f"{TAG}/zero_pp_rank_2_mp_rank_00_model_states.pt"),  # ZeRO-3: one model states file per rank
        ("z1", 2, f"{TAG}/mp_rank_00_model_states.pt"),
        ("bfo", 3, f"{TAG}/bf16_zero_pp_rank_0_mp_rank_00_optim_states.pt"),
        ("z3s", 2, OPTIM_0),
    ],
)
def test_every_file_of_every_layout_goes_through_the_same_refusal(
    deepspeed_runs: dict[int, Path], runner: CliRunner, tmp_path: Path, variant: str, world_size: int, file: str
) -> None:
    marker = tmp_path / "pwned"
    ckpt = copy_save(deepspeed_runs, tmp_path, variant, world_size)
    hostile = PROTO + EMPTY_DICT + item("module", glob(*LOSS_SCALER) + EMPTY_TUPLE + NEWOBJ + system(marker) + BUILD) + STOP
    write_pickle(ckpt / file, hostile)
    one_line(inspect(runner, ckpt), 1, str(ckpt / file), "global os.system")
    assert not marker.exists()


# --- what the admitted classes may carry: inert ---------------------------------------------------


def test_a_loss_scaler_state_setting_class_and_reduce_stays_inert(deepspeed_runs: dict[int, Path], tmp_path: Path) -> None:
    """``__class__``, ``__reduce__`` and ``__setstate__`` in a LossScaler's BUILD state are data on a record: inspect
    reads the save, nothing runs, and DeepSpeed is never imported (``-X importtime`` lists every import)."""
    marker = tmp_path / "pwned"
    ckpt = copy_save(deepspeed_runs, tmp_path)
    extra = item("__class__", glob("torch", "Tensor")) + item("__reduce__", text(f"touch {marker}"))
    extra += item("__setstate__", glob("torch._utils", "_rebuild_tensor_v2"))
    for file in (OPTIM_0, OPTIM_1):
        write_pickle(ckpt / file, before_build_of(read_pickle(ckpt / file), LOSS_SCALER, extra))
    run = attack(["inspect", ckpt], python_args=["-X", "importtime"])
    assert run.code == 0 and not run.error_lines, run.stderr[-2000:]
    assert "deepspeed: ZeRO-1" in run.stdout
    imported = [line.rsplit("|", 1)[-1].strip() for line in run.stderr.splitlines() if line.startswith("import time:")]
    assert "fsdp_convert.formats.deepspeed_files" in imported
    assert not [m for m in imported if m.startswith("deepspeed")]
    assert not marker.exists()


def test_a_zero_stage_that_is_a_command_string_is_refused_as_unsupported(
    deepspeed_runs: dict[int, Path], runner: CliRunner, tmp_path: Path
) -> None:
    marker = tmp_path / "pwned"
    ckpt = copy_save(deepspeed_runs, tmp_path)
    write_pickle(ckpt / OPTIM_0, replace_first_int_after(read_pickle(ckpt / OPTIM_0), ZERO_STAGE, text(f"touch {marker}")))
    one_line(inspect(runner, ckpt), 1, str(ckpt / OPTIM_0), "ZeRO stage", "is not one this tool reads")
    assert not marker.exists()


# --- a tensor's pickled attributes ----------------------------------------------------------------


def _state(**values: bytes) -> bytes:
    return EMPTY_DICT + b"".join(item(k, v) for k, v in values.items())


@pytest.mark.parametrize(
    ("case", "state"),
    [
        ("a dict", _state(evil=EMPTY_DICT + item("cmd", text("touch pwned")))),
        ("a list", _state(evil=EMPTY_LIST)),
        ("a tuple", _state(evil=EMPTY_TUPLE)),
        ("a record", _state(evil=glob(*FRAGMENT) + EMPTY_TUPLE + NEWOBJ)),
        ("a dtype", _state(evil=glob("torch", "float32"))),
        ("a class", _state(evil=glob("torch", "Tensor"))),
        ("a dict state among slots", NONE + _state(evil=EMPTY_DICT) + TUPLE2),
    ],
)
def test_a_tensor_with_a_non_scalar_attribute_is_refused(
    deepspeed_runs: dict[int, Path], runner: CliRunner, tmp_path: Path, case: str, state: bytes
) -> None:
    ckpt = copy_save(deepspeed_runs, tmp_path)
    write_pickle(ckpt / OPTIM_1, tensor_with_state(read_pickle(ckpt / OPTIM_1), state))
    one_line(inspect(runner, ckpt), 1, str(ckpt / OPTIM_1), "a tensor with Python attributes")


def test_a_tensor_attribute_nested_a_hundred_thousand_tuples_deep_is_one_line(
    deepspeed_runs: dict[int, Path], tmp_path: Path
) -> None:
    ckpt = copy_save(deepspeed_runs, tmp_path)
    write_pickle(ckpt / OPTIM_1, tensor_with_state(read_pickle(ckpt / OPTIM_1), EMPTY_TUPLE + TUPLE1 * 100_000))
    run = attack(["inspect", ckpt])
    assert run.code == 1 and len(run.error_lines) == 1 and str(ckpt / OPTIM_1) in run.error_lines[0], run.stderr
    assert run.stderr.strip().splitlines() == run.error_lines and run.seconds < 3 * SECONDS_BOUND


@pytest.mark.parametrize(
    "state", [_state(ds_id=b"K\x07"), _state(ds_id=b"K\x07", name=text("w"), flag=b"\x88", none=NONE, scale=b"G" + bytes(8))]
)
def test_a_tensor_with_scalar_attributes_is_read(
    deepspeed_runs: dict[int, Path], runner: CliRunner, tmp_path: Path, state: bytes
) -> None:
    """DeepSpeed's ``ds_id`` (and other plain scalars) on a tensor: dropped, the tensor read (the control of the above)."""
    ckpt = copy_save(deepspeed_runs, tmp_path)
    write_pickle(ckpt / OPTIM_1, tensor_with_state(read_pickle(ckpt / OPTIM_1), state))
    result = inspect(runner, ckpt, "--json")
    assert result.exit_code == 0 and not result.stderr.strip(), result.stderr


# --- the tag folder: inside the save only -----------------------------------------------------------


@pytest.fixture
def outside(deepspeed_runs: dict[int, Path], tmp_path: Path) -> Path:
    """A whole tag folder of a real save outside the checkpoint the user names: read, ``inspect`` would succeed."""
    folder = tmp_path / "outside"
    shutil.copytree(deepspeed_runs[2] / "z1" / TAG, folder)
    return folder


@pytest.mark.parametrize("latest", ["../outside", "..", ".", "{outside}", "step2/../../outside", "\x1b[2Jstep2", "x" * 300])
def test_latest_naming_a_folder_outside_the_save_is_not_followed(
    outside: Path, runner: CliRunner, tmp_path: Path, latest: str
) -> None:
    """The tag must be a folder right inside the save: exit 3, one line naming ``latest`` (its text escaped, cut short)."""
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    (ckpt / "latest").write_text(latest.format(outside=outside))
    result = inspect(runner, ckpt)
    line = one_line(result, 3, str(ckpt / "latest"), "does not name a tag folder")
    assert "\x1b" not in result.stderr and len(line) < 200 + len(str(ckpt))


@pytest.mark.parametrize("target", ["absolute", "relative"])
def test_a_tag_folder_linked_outside_the_save_is_not_followed(
    outside: Path, runner: CliRunner, tmp_path: Path, target: str
) -> None:
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    (ckpt / "latest").write_text(TAG)
    (ckpt / TAG).symlink_to(outside if target == "absolute" else Path("..") / "outside")
    one_line(inspect(runner, ckpt), 3, str(ckpt / "latest"), f"{ckpt / TAG} is a symbolic link")


def test_a_tag_folder_linked_outside_is_not_followed_in_a_fresh_process(outside: Path, tmp_path: Path) -> None:
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    (ckpt / "latest").write_text(TAG)
    (ckpt / TAG).symlink_to(outside)
    run = attack(["inspect", ckpt])
    assert run.code == 3 and run.stderr.strip().splitlines() == run.error_lines and len(run.error_lines) == 1, run.stderr
    assert f"{ckpt / TAG} is a symbolic link" in run.error_lines[0] and run.stdout == "" and run.seconds < 3 * SECONDS_BOUND


def test_latest_that_is_a_fifo_does_not_block(deepspeed_runs: dict[int, Path], tmp_path: Path) -> None:
    """A FIFO named ``latest`` (no writer): refused or skipped at once, never waited on."""
    ckpt = copy_save(deepspeed_runs, tmp_path)
    (ckpt / "latest").unlink()
    os.mkfifo(ckpt / "latest")
    run = attack(["inspect", ckpt], timeout=3 * SECONDS_BOUND)
    assert run.code in (1, 3) and len(run.error_lines) == 1 and str(ckpt / "latest") in run.error_lines[0], run.stderr


def test_latest_linked_outside_the_save_is_not_followed(
    deepspeed_runs: dict[int, Path], runner: CliRunner, tmp_path: Path
) -> None:
    """``latest`` a link to a file outside the save: refused as the save's other files are (unless ``--follow-symlinks``)."""
    ckpt = copy_save(deepspeed_runs, tmp_path)
    (tmp_path / "elsewhere").write_text(TAG)
    (ckpt / "latest").unlink()
    (ckpt / "latest").symlink_to(tmp_path / "elsewhere")
    assert inspect(runner, ckpt, "--follow-symlinks").exit_code == 0
    result = inspect(runner, ckpt)
    assert result.exit_code != 0, "read through the link"
    one_line(result, result.exit_code, str(ckpt / "latest"))


@pytest.mark.parametrize("file", [OPTIM_1, f"{TAG}/mp_rank_00_model_states.pt"])
def test_a_file_of_the_save_linked_outside_it_is_refused(
    deepspeed_runs: dict[int, Path], runner: CliRunner, outside: Path, tmp_path: Path, file: str
) -> None:
    ckpt = copy_save(deepspeed_runs, tmp_path)
    (ckpt / file).unlink()
    (ckpt / file).symlink_to(outside / Path(file).name)
    for given in (ckpt, ckpt / TAG):  # through latest, and the tag folder named directly
        one_line(inspect(runner, given), 1, str(ckpt / file), "symbolic link", "outside the checkpoint")
    assert inspect(runner, ckpt, "--follow-symlinks").exit_code == 0  # as the user says: a link into a shared store


def test_latest_with_a_trailing_newline_is_read(deepspeed_runs: dict[int, Path], runner: CliRunner, tmp_path: Path) -> None:
    """The control of the above: a tag inside the save is found (DeepSpeed writes it without a newline; one is fine)."""
    ckpt = copy_save(deepspeed_runs, tmp_path)
    (ckpt / "latest").write_text(f"{TAG}\n")
    result = inspect(runner, ckpt)
    assert result.exit_code == 0 and re.search(r"producer: deepspeed\s+world size: 2", result.stdout), result.stderr


# --- reshard writes the records back: only DeepSpeed's, torch's and plain values --------------------

_OUTPUT_MODULES = ("torch", "collections", "deepspeed.")


def _output_globals(root: Path) -> set[str]:
    names = set()
    for path in root.rglob("*.pt"):
        names |= {str(arg) for name, arg, _ in _ops(read_pickle(path)) if name in ("GLOBAL", "STACK_GLOBAL")}
    return names


@pytest.mark.parametrize(
    "value",
    [
        pytest.param(glob("torch", "Tensor"), id="a torch class"),
        pytest.param(glob(*ZERO_STAGE), id="an admitted DeepSpeed class"),
        pytest.param(glob("torch._utils", "_rebuild_tensor_v2"), id="an admitted torch function"),
    ],
)
def test_reshard_of_a_record_state_holding_a_global_names_nothing_new(
    deepspeed_runs: dict[int, Path], runner: CliRunner, tmp_path: Path, value: bytes
) -> None:
    """A LossScaler state holding an admitted class or function: inspect reads it; reshard either refuses in one line
    or writes pickles whose globals are torch's, ``collections``' and DeepSpeed's only (what DeepSpeed's loader resolves)."""
    ckpt = copy_save(deepspeed_runs, tmp_path)
    for file in (OPTIM_0, OPTIM_1):
        write_pickle(ckpt / file, before_build_of(read_pickle(ckpt / file), LOSS_SCALER, item("__class__", value)))
    assert inspect(runner, ckpt).exit_code == 0
    out = tmp_path / "out"
    result = runner.invoke(app, ["reshard", str(ckpt), str(out), "--world-size", "3"])
    if result.exit_code != 0:
        one_line(result, 1)
    else:
        names = _output_globals(out)
        assert names and all(n.startswith(_OUTPUT_MODULES) for n in names), sorted(names)
