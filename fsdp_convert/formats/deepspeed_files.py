"""DeepSpeed ZeRO checkpoints, the files: which ones a save wrote, and loading them without running anything.

``engine.save_checkpoint(dir, tag)`` (``deepspeed/runtime/engine.py``, 0.19) writes ``dir/latest``
(the tag) and ``dir/<tag>/``: ``mp_rank_00_model_states.pt`` (ZeRO-1/2, BF16_Optimizer) or one
``zero_pp_rank_<r>_mp_rank_00_model_states.pt`` per data-parallel rank (ZeRO-3), and one
``[bf16_]zero_pp_rank_<r>_mp_rank_00_optim_states.pt`` per rank. They are torch.save files whose
pickles name three DeepSpeed classes besides torch's: ``LossScaler``, ``ZeroStageEnum`` and
``fragment_address``. They are loaded with these three as inert ``Record`` stand-ins (never
imported; any other class is refused): by ``_ds_records`` without torch, tensors as ``StoredTensor``
records of where their bytes lie, or where that path declines a file, by ``_rank_unpickler``
(torch's tensors, memory-mapped), which reads it or names the fault. ``FileTensor`` and
``LoadedSave.byte_offset`` read a tensor of either path.
"""

from __future__ import annotations

import os
import re
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

from fsdp_convert.errors import (
    CorruptChunkError,
    MissingDataFileError,
    NotADcpCheckpointError,
    UnsafeContentError,
    UnsupportedTransformError,
)
from fsdp_convert.formats._ds_records import Size, load_ds_records
from fsdp_convert.formats._pt_records import StoredTensor
from fsdp_convert.formats._records import Record, record_classes
from fsdp_convert.formats.index import DTYPE_ITEMSIZES, dtype_name
from fsdp_convert.held_roots import open_inside
from fsdp_convert.location import FdPath, Location
from fsdp_convert.output_table import METADATA_FILENAME
from fsdp_convert.own_files import OwnFiles

__all__ = [
    "DS_CLASS_NAMES",
    "DeepSpeedFiles",
    "FileTensor",
    "LATEST",
    "OWN_FILES",
    "LoadedSave",
    "deepspeed_files",
    "deepspeed_tags",
    "file_tensor",
    "is_deepspeed",
    "is_deepspeed_file",
    "is_size",
    "load_ds_file",
    "stage_of",
]

LATEST = "latest"  # the file naming the last tag (deepspeed/runtime/engine.py save_checkpoint)
_MODEL_RE = re.compile(r"^(?:zero_pp_rank_(?P<dp>\d+)_)?mp_rank_(?P<mp>\d+)_model_states\.pt$")
_OPTIM_RE = re.compile(r"^(?P<bf16>bf16_)?zero_pp_rank_(?P<dp>\d+)_mp_rank_(?P<mp>\d+)_optim_states\.pt$")
_LAYER_RE = re.compile(r"^layer_\d+-model_\d+-model_states\.pt$")  # pipeline parallelism's per-layer files


def _unnamed(pattern: re.Pattern[str]) -> str:
    """A pattern's text without anchors and group names, so that two may be joined by ``|``."""
    return re.sub(r"\(\?P<\w+>", "(", pattern.pattern).removeprefix("^").removesuffix("$")


# What reshard writes for a DeepSpeed save (ops._deepspeed_reshard): `latest`, and a tag folder holding the model and
# optimizer states files alone. The producers table takes it as this tool's own output (--overwrite without --force).
OWN_FILES = OwnFiles(
    files=(re.compile(re.escape(LATEST)),),
    folders=((re.compile(r"(?!\.).+"), re.compile("|".join(_unnamed(p) for p in (_MODEL_RE, _OPTIM_RE)))),),
)
_MAX_TAG = 255

# DeepSpeed's classes its files pickle, read as inert records (``_records.record_classes``), by either loader
DS_CLASS_NAMES = (
    "deepspeed.runtime.fp16.loss_scaler.LossScaler",
    "deepspeed.runtime.fp16.loss_scaler.DynamicLossScaler",
    "deepspeed.runtime.zero.config.ZeroStageEnum",
    "deepspeed.utils.tensor_fragment.fragment_address",
)
_DS_RECORDS: dict[str, type[Record]] = record_classes(DS_CLASS_NAMES)


@dataclass(frozen=True, slots=True)
class DeepSpeedFiles:
    """The files of one DeepSpeed save, relative to the path the user gave.

    Attributes:
        tag: the tag folder's path relative to that path (``step2/``), or ``""`` when it is the tag folder.
        model: the model states files by data-parallel rank (one, rank 0, for ZeRO-1/2).
        optim: the optimizer states files by data-parallel rank, 0..N-1.
        bf16: the optimizer files carry the ``bf16_`` prefix.
    """

    tag: str
    model: tuple[str, ...]
    optim: tuple[str, ...]
    bf16: bool

    @property
    def world_size(self) -> int:
        """The data-parallel size: the number of optimizer files."""
        return len(self.optim)


def _tag_folder(root: Path) -> str | None:
    """``root``'s tag folder relative to it: ``""`` when ``root`` holds model states, ``<tag>/`` named by ``latest``.

    None: neither (no model states, no ``latest``).

    Raises:
        NotADcpCheckpointError: ``latest`` names no tag folder inside ``root`` (missing, a link, a
            path rather than a name, unreadable), naming ``latest`` and what it says.
    """
    try:
        names = os.listdir(root)
    except OSError:
        return None
    if any(_MODEL_RE.match(n) or _LAYER_RE.match(n) for n in names):
        return ""
    if LATEST not in names or (root / METADATA_FILENAME).exists():
        return None
    latest = root / LATEST
    try:
        fd = open_inside(root, latest)  # a regular file inside the save (no FIFO, no link out), as every file it reads
    except UnsafeContentError:
        raise
    except OSError as e:
        raise NotADcpCheckpointError(f"{latest} cannot be read ({e.strerror}); it names the DeepSpeed save's tag") from e
    try:
        raw = os.pread(fd, _MAX_TAG + 1, 0)
    finally:
        os.close(fd)
    tag = raw.decode("utf-8", "replace").strip()
    if not tag or len(raw) > _MAX_TAG or "/" in tag or "\\" in tag or tag in (".", "..") or not tag.isprintable():
        raise NotADcpCheckpointError(
            f"{latest} does not name a tag folder ({shown_tag(tag.encode())}); pass the tag folder itself"
        )
    folder = root / tag
    if folder.is_symlink() or not folder.is_dir():
        what = "is a symbolic link" if folder.is_symlink() else "does not exist"
        tags = ", ".join(d.name for d in deepspeed_tags(root)[:5]) or "none"
        raise NotADcpCheckpointError(f"{latest} names tag {tag}, but {folder} {what} (tags here: {tags}); pass a tag folder")
    return f"{tag}/"


def shown_tag(raw: bytes) -> str:
    """What ``latest`` holds, as one short printable line."""
    text = raw[:60].decode("utf-8", "replace")
    return repr(text if text.isprintable() else text.encode("unicode_escape").decode())


def deepspeed_tags(root: Path) -> list[Path]:
    """The folders in ``root`` that hold a DeepSpeed save's model states (its tags), sorted; none when it cannot be listed."""
    try:
        return sorted(d for d in root.iterdir() if d.is_dir() and not d.is_symlink() and _holds_model_states(d))
    except OSError:
        return []


def _holds_model_states(folder: Path) -> bool:
    try:
        return any(_MODEL_RE.match(n) for n in os.listdir(folder))
    except OSError:
        return False


def is_deepspeed_file(name: str) -> bool:
    """Whether a file name is one a DeepSpeed save writes (``*_model_states.pt``, ``*_optim_states.pt``)."""
    return bool(_MODEL_RE.match(name) or _OPTIM_RE.match(name) or _LAYER_RE.match(name))


def is_deepspeed(root: Location) -> bool:
    """A local folder holding a DeepSpeed save's model states, or a ``latest`` naming a tag folder that does."""
    if not isinstance(root, Path) or not root.is_dir():
        return False
    try:
        tag = _tag_folder(root)
    except NotADcpCheckpointError:
        return True  # a save whose latest is wrong: read as one, whose index names what is wrong
    if tag is None:
        return False
    try:
        return any(_MODEL_RE.match(n) or _LAYER_RE.match(n) for n in os.listdir(root / tag))
    except OSError:
        return False


def deepspeed_files(root: Path) -> DeepSpeedFiles:
    """The files of the save at ``root`` (the tag folder, or the folder whose ``latest`` names it).

    Raises:
        NotADcpCheckpointError: no model states; files of tensor or pipeline parallelism
            (``mp_rank_01``, ``layer_*``), which this tool does not read (names one).
        MissingDataFileError: an optimizer or model states file of a rank is missing (names it).
    """
    tag = _tag_folder(root)
    if tag is None:
        raise NotADcpCheckpointError(f"{root} holds no DeepSpeed model states file (*mp_rank_00_model_states.pt)")
    folder = root / tag
    names = sorted(os.listdir(folder))
    for name in names:
        m = _MODEL_RE.match(name) or _OPTIM_RE.match(name)
        if _LAYER_RE.match(name) or (m and int(m.group("mp")) != 0):
            raise NotADcpCheckpointError(
                f"{folder / name}: a DeepSpeed save with tensor or pipeline parallelism (mp or layer files); "
                "this tool reads data-parallel ZeRO saves (mp_rank_00 only)"
            )
    optim = {int(m.group("dp")): (name, bool(m.group("bf16"))) for name in names if (m := _OPTIM_RE.match(name))}
    model = {int(m.group("dp") or 0): name for name in names if (m := _MODEL_RE.match(name))}
    if not model:
        raise NotADcpCheckpointError(f"{folder} holds no DeepSpeed model states file (*mp_rank_00_model_states.pt)")
    if not optim:
        raise MissingDataFileError(f"{folder} holds no *_optim_states.pt file: the save has no ZeRO optimizer state")
    world_size = max(optim) + 1
    bf16 = optim[0][1] if 0 in optim else next(iter(optim.values()))[1]
    for rank in range(world_size):
        if rank not in optim:
            prefix = "bf16_" if bf16 else ""
            raise MissingDataFileError(f"{folder / f'{prefix}zero_pp_rank_{rank}_mp_rank_00_optim_states.pt'} is missing")
    zero3 = any(k is not None for k in (_MODEL_RE.match(n).group("dp") for n in model.values()))  # type: ignore[union-attr]
    if zero3:
        for rank in range(world_size):
            if rank not in model:
                raise MissingDataFileError(f"{folder / f'zero_pp_rank_{rank}_mp_rank_00_model_states.pt'} is missing")
    ordered_model = tuple(tag + model[r] for r in range(world_size)) if zero3 else (tag + model[0],)
    return DeepSpeedFiles(tag, ordered_model, tuple(tag + optim[r][0] for r in range(world_size)), bf16)


def _torch() -> Any:
    """The torch module where it is imported (a file fell back to torch's loader), else None: no value is a tensor then."""
    return sys.modules.get("torch")


@dataclass(frozen=True, slots=True)
class FileTensor:
    """A tensor of a loaded file (``StoredTensor`` or torch's), as the index needs it: dtype name, shape, element size."""

    dtype_name: str
    shape: tuple[int, ...]
    itemsize: int

    @property
    def numel(self) -> int:
        """Elements."""
        count = 1
        for size in self.shape:
            count *= size
        return count


def file_tensor(value: Any) -> FileTensor | None:
    """``value`` as a ``FileTensor`` where it is a tensor of either loader; None for any other value."""
    if type(value) is StoredTensor:
        return FileTensor(value.dtype_name, value.shape, DTYPE_ITEMSIZES[value.dtype_name])
    torch = _torch()
    if torch is not None and isinstance(value, torch.Tensor):
        return FileTensor(dtype_name(value.dtype), tuple(value.shape), value.element_size())
    return None


def is_size(value: Any) -> bool:
    """Whether ``value`` is a ``torch.Size`` as either loader reads one."""
    torch = _torch()
    return type(value) is Size or (torch is not None and isinstance(value, torch.Size))


class LoadedSave:
    """The save's files, loaded (nothing run; ``load_ds_file``) with where their storages lie.

    Args:
        use_torch: load every file with torch's loader path (tensors as torch's, memory-mapped).
    """

    def __init__(self, root: Path, files: DeepSpeedFiles, *, use_torch: bool = False) -> None:
        self.root, self.files = root, files
        self.model = [load_ds_file(root, name, use_torch=use_torch) for name in files.model]
        self.optim = [load_ds_file(root, name, use_torch=use_torch) for name in files.optim]

    def byte_offset(self, tensor: Any, loaded: tuple[Any, dict[int, int]], where: str) -> tuple[int, FileTensor]:
        """Where ``tensor`` (a ``StoredTensor``, or torch's of ``loaded``) starts in its file, in bytes; and the tensor.

        Raises:
            CorruptChunkError: not a contiguous tensor of the file's storages.
        """
        facts = file_tensor(tensor)
        if type(tensor) is StoredTensor and facts is not None:
            placed = tensor.byte_range()
            if placed is None:
                raise CorruptChunkError(f"{where}: not a contiguous tensor")
            if tensor.storage_nbytes == 0:  # torch's path maps no storage of no bytes from the file
                raise CorruptChunkError(f"{where}: a tensor with no storage in the file")
            return placed[0], facts
        if facts is None or not tensor.is_contiguous():
            raise CorruptChunkError(f"{where}: not a contiguous tensor")
        base = loaded[1].get(tensor.untyped_storage().data_ptr())
        if base is None:
            raise CorruptChunkError(f"{where}: a tensor with no storage in the file")
        return base + int(tensor.storage_offset()) * tensor.element_size(), facts


def load_ds_file(
    root: Path, relative: str, follow_symlinks: bool | None = None, *, use_torch: bool = False
) -> tuple[Any, dict[int, int]]:
    """Load one DeepSpeed file under ``root`` (opened inside it), and where its storages lie.

    Read first without torch (``_ds_records.load_ds_records``: tensors as ``StoredTensor``, sizes
    as ``Size``, no offsets needed); where that declines the file, or with ``use_torch``, by
    ``_rank_unpickler.load_with_offsets`` (torch's tensors memory-mapped, ``{storage data_ptr: byte offset}``).

    Raises:
        MissingDataFileError: it cannot be opened. UnsafeContentError: a link out of ``root``, or a
            class other than torch's and DeepSpeed's three (names it). CorruptChunkError: not a torch.save file.
    """
    path = root / relative
    try:
        fd = open_inside(root, path, follow_symlinks=follow_symlinks)
    except OSError as e:
        raise MissingDataFileError(f"cannot open {path}: {e.strerror}") from e
    try:
        if not use_torch:
            try:
                obj = load_ds_records(fd, os.fstat(fd).st_size, _DS_RECORDS)
            except OSError:
                obj = None  # torch's loader reads it again and names the fault
            if obj is not None:
                return obj, {}
        from fsdp_convert.formats._rank_unpickler import load_with_offsets

        return load_with_offsets(cast(Path, FdPath(fd, path)), _DS_RECORDS)
    finally:
        os.close(fd)


def stage_of(optim_state: dict[str, Any], where: str) -> int:
    """The ZeRO stage an optimizer file's ``optimizer_state_dict`` says: 1, 2 or 3; 0 for BF16_Optimizer (no ``zero_stage``).

    Raises:
        UnsupportedTransformError: a stage this tool does not read.
    """
    stage = optim_state.get("zero_stage")
    if stage is None:
        return 0
    value = stage.args[0] if getattr(stage, "args", None) else stage  # a ZeroStageEnum record: its pickled value
    if type(value) is not int or value not in (1, 2, 3):
        raise UnsupportedTransformError(f"{where}: ZeRO stage {value!r} is not one this tool reads (1, 2, 3)")
    return value
