"""Write stage for a Hugging Face folder's other files: config, generation config and tokenizer copied beside the shards.

``consolidate --hf-assets DIR`` makes the output a model ``from_pretrained`` loads with no glue
code. The files transformers' ``save_pretrained`` writes beside the weights (``PretrainedConfig``,
``GenerationConfig``, a tokenizer's and a processor's ``save_pretrained``) are copied from DIR, a
local folder or an fsspec URL (``remote``), as bytes and by a fixed allow-list of names
(``ASSET_FILENAMES``): never weights, indexes or code, and only regular files inside DIR (a
symbolic link out of it is refused, ``location.inside``, unless ``--follow-symlinks``; a hub
cache snapshot's links into its repo's ``blobs`` are inside). ``config.json`` (at most
``CONFIG_MAX_BYTES``) is parsed as JSON only; its
``dtype``/``torch_dtype`` is set to the dtype of the weights written (``rewrite_config``), and its
``tie_word_embeddings`` says whether the tied output weight is left out of the shards, as
``save_pretrained`` leaves it out (``tied_output_keys``).
"""

from __future__ import annotations

import importlib
import json
import logging
import os
import re
import shutil
import stat
from collections.abc import Collection, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fsdp_convert.dtypes import DType, as_dtype
from fsdp_convert.errors import CheckpointNotFoundError, InvalidOptionError, OutputWriteError
from fsdp_convert.held_roots import follows_symlinks, open_inside, stat_inside
from fsdp_convert.location import read_inside
from fsdp_convert.output_table import ASSET_FILENAMES, CHAT_TEMPLATE_DIR, CONFIG_FILENAME  # their home: the HF rows
from fsdp_convert.progress import human_bytes
from fsdp_convert.remote import Url, as_location, filesystem, read_bytes, size_of
from fsdp_convert.writers._space import free_bytes

__all__ = [
    "ASSET_FILENAMES",
    "CHAT_TEMPLATE_DIR",
    "CONFIG_FILENAME",
    "CONFIG_MAX_BYTES",
    "TIED_OUTPUT_KEY",
    "HfAssets",
    "open_hf_assets",
    "tie_word_embeddings",
    "tied_output_keys",
    "config_dtype_name",
    "rewrite_config",
    "weights_dtype",
    "write_hf_assets",
]

logger = logging.getLogger(__name__)

CONFIG_MAX_BYTES = 16 << 20  # a model's config.json is a few KB; it is read whole, so larger is refused
_WHAT = "the --hf-assets folder"
TIED_OUTPUT_KEY = "lm_head.weight"  # the output embedding ``_tied_weights_keys`` names in transformers' LM heads
_TEMPLATE_SUFFIX = ".jinja"
_HEAD_ARCHITECTURES = ("ForCausalLM", "LMHeadModel", "ForConditionalGeneration")
_DTYPE_KEYS = ("torch_dtype", "dtype")  # transformers < 4.56 writes torch_dtype, later versions dtype


@dataclass(frozen=True, slots=True, kw_only=True)
class HfAssets:
    """A model folder's files to copy beside the shards, found before anything is written.

    Attributes:
        source: the folder (a local path or an fsspec URL).
        config: ``config.json``, parsed.
        config_bytes: ``config.json`` as read.
        files: the other allowed files found, as relative POSIX paths, sorted.
        nbytes: the bytes the copies take, config included, in bytes (count them in the space check).
        follow_symlinks: whether links out of a local ``source`` are followed (the setting it was opened with).
    """

    source: Path | Url
    config: dict[str, Any]
    config_bytes: bytes
    files: tuple[str, ...]
    nbytes: int = 0
    follow_symlinks: bool = False


def _allowed(relative: str) -> bool:
    parts = relative.split("/")
    if len(parts) == 1:
        return parts[0] in ASSET_FILENAMES
    return len(parts) == 2 and parts[0] == CHAT_TEMPLATE_DIR and parts[1].endswith(_TEMPLATE_SUFFIX)


def _list_local(folder: Path) -> list[str]:
    names = [p.name for p in folder.iterdir() if p.is_file()]  # follows links (a hub cache snapshot's files are links)
    templates = folder / CHAT_TEMPLATE_DIR
    if templates.is_dir():
        names += [f"{CHAT_TEMPLATE_DIR}/{p.name}" for p in templates.iterdir() if p.is_file()]
    return names


def _local_bytes(folder: Path, relative: str, follow_symlinks: bool) -> int:
    """Size in bytes of an asset file, checked to be a regular file inside ``folder``.

    Raises:
        UnsafeContentError: a symbolic link out of the folder. InvalidOptionError: not a regular file.
    """
    mode_size = stat_inside(folder, folder / relative, follow_symlinks=follow_symlinks, what=_WHAT)  # by the walk
    if not stat.S_ISREG(mode_size.st_mode):
        raise InvalidOptionError(f"--hf-assets {folder / relative} is not a regular file; refused")
    return mode_size.st_size


def _json_problem(e: ValueError) -> str:
    """What is wrong with JSON that did not parse, quoting none of it (a decode error would quote a byte)."""
    return f"{e.msg} at byte {e.pos}" if isinstance(e, json.JSONDecodeError) else "it is not UTF-8 JSON"


def _read_config(config_path: Path | Url, follow_symlinks: bool) -> bytes:
    """``config.json``, read whole once it is known to be at most ``CONFIG_MAX_BYTES``.

    Raises:
        InvalidOptionError: larger, or unreadable. UnsafeContentError: a link out of the folder.
    """
    too_big = InvalidOptionError(
        f"{config_path} is larger than {human_bytes(CONFIG_MAX_BYTES, units='decimal')}; refused "
        "(a model's config.json is a few KB)"
    )
    if isinstance(config_path, Url):
        if (size_of(config_path) or 0) > CONFIG_MAX_BYTES:
            raise too_big
        return read_bytes(config_path)
    try:
        raw = read_inside(config_path.parent, config_path, CONFIG_MAX_BYTES, follow_symlinks=follow_symlinks, what=_WHAT)
    except OSError as e:
        raise InvalidOptionError(f"cannot read {config_path}: {e.strerror}") from e
    if raw is None:
        raise too_big
    return raw


def _list_remote(url: Url) -> list[str]:
    fs = filesystem(url.split("://", 1)[0])
    try:
        listing = fs.ls(str(url), detail=True)
    except FileNotFoundError as e:
        raise CheckpointNotFoundError(f"--hf-assets {url} does not exist") from e
    names = [str(e["name"]).rstrip("/").rsplit("/", 1)[-1] for e in listing if e.get("type") == "file"]
    if any(str(e["name"]).rstrip("/").endswith("/" + CHAT_TEMPLATE_DIR) and e.get("type") == "directory" for e in listing):
        inner = fs.ls(str(url / CHAT_TEMPLATE_DIR), detail=True)
        names += [f"{CHAT_TEMPLATE_DIR}/{str(e['name']).rsplit('/', 1)[-1]}" for e in inner if e.get("type") == "file"]
    return names


def open_hf_assets(
    source: str | os.PathLike[str], *, folder_output: bool = True, model: bool = True, follow_symlinks: bool | None = None
) -> HfAssets:
    """Find the files to copy in a model folder and read its ``config.json`` (nothing else is read yet).

    Args:
        source: a local folder or an fsspec URL (``s3://bucket/model``) holding what
            ``save_pretrained`` wrote: ``config.json`` at least.
        folder_output: the output is a Hugging Face folder (the only output assets go with).
        model: the output holds the model weights (not ``--only optim``).
        follow_symlinks: copy what symbolic links in a local folder lead to outside it; None: the
            process's setting (``location.follows_symlinks``).

    Returns:
        The parsed config and the allowed files found (``ASSET_FILENAMES``, and ``*.jinja`` in
        ``additional_chat_templates/``). Other files (weights, indexes, custom code) are skipped;
        custom code a config's ``auto_map`` names is logged as left behind.

    Raises:
        CheckpointNotFoundError: ``source`` does not exist or is not a folder.
        InvalidOptionError: a file output or no model weights; no ``config.json`` there, or it is
            larger than ``CONFIG_MAX_BYTES`` or not a JSON object; an asset that is not a regular
            file; fsspec or its backend is missing for a URL.
        UnsafeContentError: a file to copy is a symbolic link out of a local folder.
    """
    follow = follows_symlinks(follow_symlinks)
    if not folder_output:
        raise InvalidOptionError(
            f"--hf-assets {source}: a model's config and tokenizer go beside the shards of a folder output; "
            "give OUT without a .pt/.safetensors suffix"
        )
    if not model:
        raise InvalidOptionError(f"--hf-assets {source}: the output holds no model weights (--only optim); drop one of them")
    location = as_location(source)
    if isinstance(location, Url):
        names = _list_remote(location)
    elif not location.is_dir():
        raise CheckpointNotFoundError(f"--hf-assets {location} is not a folder (give the folder save_pretrained wrote)")
    else:
        names = _list_local(location)
    if CONFIG_FILENAME not in names:
        raise InvalidOptionError(f"--hf-assets {location}: no {CONFIG_FILENAME} there (give the folder save_pretrained wrote)")
    config_path = location / CONFIG_FILENAME
    raw = _read_config(config_path, follow)
    try:
        config = json.loads(raw)
    except ValueError as e:
        raise InvalidOptionError(f"{config_path}: not valid JSON ({_json_problem(e)})") from e
    if not isinstance(config, dict):
        raise InvalidOptionError(f"{config_path}: expected a JSON object, got {type(config).__name__}")
    code = sorted(n for n in names if n.endswith(".py"))
    if code and config.get("auto_map"):
        logger.warning(
            "%s: custom model code (%s) is not copied; copy it yourself to load with trust_remote_code", location, ", ".join(code)
        )
    files = tuple(sorted(n for n in names if _allowed(n) and n != CONFIG_FILENAME))
    if isinstance(location, Url):
        nbytes = sum(size_of(location / n) or 0 for n in files)
    else:
        nbytes = sum(_local_bytes(location, n, follow) for n in files)
    nbytes += len(rewrite_config(raw, DType("bfloat16"))) + 64  # config.json as written: maybe re-serialized, a dtype name
    return HfAssets(source=location, config=config, config_bytes=raw, files=files, nbytes=nbytes, follow_symlinks=follow)


def _default_tie(model_type: object) -> bool | None:
    """The model type's default ``tie_word_embeddings`` in transformers, or None when unknown or not installed."""
    if not isinstance(model_type, str):
        return None
    try:
        transformers = importlib.import_module("transformers")
        value = getattr(transformers.AutoConfig.for_model(model_type), "tie_word_embeddings", None)
    except Exception:  # noqa: BLE001 (not installed, an unknown model type: say unknown)
        return None
    return value if isinstance(value, bool) else None


def tie_word_embeddings(config: dict[str, Any]) -> bool | None:
    """Whether ``from_pretrained`` ties the output embedding to the input one for this config.

    ``save_pretrained`` writes ``tie_word_embeddings`` only when it differs from a default
    (``to_diff_dict``), so an absent key means the model type's default: transformers'
    ``AutoConfig.for_model(model_type)`` when transformers is installed (Llama: false, Gemma: true).

    Returns:
        True or False, or None when it cannot be told (no key, and transformers or the model type unknown).
    """
    value = config.get("tie_word_embeddings")
    if isinstance(value, bool):
        return value
    return _default_tie(config.get("model_type"))


def _has_head(config: dict[str, Any]) -> bool:
    architectures = config.get("architectures")
    if not isinstance(architectures, list) or not architectures:
        return True  # a bare config (PretrainedConfig.save_pretrained of a causal LM's config)
    return any(isinstance(a, str) and a.endswith(_HEAD_ARCHITECTURES) for a in architectures)


def tied_output_keys(assets: HfAssets, model_keys: Collection[str]) -> tuple[str, ...]:
    """The model keys to leave out of the shards because the config ties them, as ``save_pretrained`` does.

    Args:
        assets: the folder's config.
        model_keys: the tensor names the shards would hold (safetensors names, after renames).

    Returns:
        ``("lm_head.weight",)`` when the config ties the embeddings and the shards would hold it;
        otherwise nothing.

    Raises:
        InvalidOptionError: the config unties them (``tie_word_embeddings`` false) for a model with
            an LM head, and ``lm_head.weight`` is not among ``model_keys``: ``from_pretrained`` would
            initialize it at random.
    """
    tie = tie_word_embeddings(assets.config)
    present = TIED_OUTPUT_KEY in model_keys
    if tie is None:
        logger.warning(
            "%s: cannot tell whether embeddings are tied; %s is written as the checkpoint has it", assets.source, TIED_OUTPUT_KEY
        )
        return ()
    if not tie and not present and _has_head(assets.config):
        raise InvalidOptionError(
            f"{assets.source / CONFIG_FILENAME}: tie_word_embeddings is false but the output holds no {TIED_OUTPUT_KEY} "
            "(check --include/--exclude/--rename); from_pretrained would initialize it at random"
        )
    return (TIED_OUTPUT_KEY,) if tie and present else ()


def config_dtype_name(dtype: DType) -> str:
    """A dtype as transformers writes it in ``config.json`` (``torch.bfloat16`` -> ``"bfloat16"``)."""
    return str(dtype).removeprefix("torch.")


def _version(text: object) -> tuple[int, ...]:
    numbers = re.findall(r"\d+", text) if isinstance(text, str) else []
    return tuple(int(n) for n in numbers[:2])


def rewrite_config(
    config_bytes: bytes,
    dtype: DType | None,
    *,
    quantization: Mapping[str, Any] | None = None,
    dequantized: bool = False,
) -> bytes:
    """``config.json`` with its dtype set to the weights written; otherwise the user's.

    The config keeps whichever of ``torch_dtype`` (transformers < 4.56) and ``dtype`` (4.56 and
    5.x) it has; with neither, it gets the one its ``transformers_version`` reads (``torch_dtype``
    when that is unknown; every version reads it). When the value changes the file is
    re-serialized as ``PretrainedConfig.to_json_string`` writes it (``json.dumps(indent=2,
    sort_keys=True)`` and a newline), so a file ``save_pretrained`` wrote differs only at those
    keys; otherwise the bytes are returned as they are.

    Args:
        config_bytes: the source ``config.json``.
        dtype: the dtype of the weights written, or None to leave the config as it is.
        quantization: set as ``quantization_config`` (weights written quantized: ``--quantize``).
        dequantized: drop ``quantization_config`` (weights written dequantized: ``--dequantize``).
    """
    if dtype is None and quantization is None and not dequantized:
        return config_bytes
    config = json.loads(config_bytes)
    changed = dequantized and config.pop("quantization_config", None) is not None
    if quantization is not None and config.get("quantization_config") != quantization:
        config["quantization_config"], changed = dict(quantization), True
    if dtype is not None:
        keys = [k for k in _DTYPE_KEYS if k in config]
        if not keys:
            keys = ["dtype" if _version(config.get("transformers_version")) >= (4, 56) else "torch_dtype"]
        changed = changed or any(config.get(k) != config_dtype_name(dtype) for k in keys)
        config |= dict.fromkeys(keys, config_dtype_name(dtype))
    return (json.dumps(config, indent=2, sort_keys=True) + "\n").encode() if changed else config_bytes


def write_hf_assets(
    assets: HfAssets,
    folder: Path,
    *,
    dtype: DType | None,
    quantization: Mapping[str, Any] | None = None,
    dequantized: bool = False,
) -> list[Path]:
    """Copy the assets into an output folder (the hidden temporary, before its rename), config last.

    Files are copied as bytes (a local file, or a link's target inside the folder, opened by
    ``location.open_inside``; an fsspec object read whole), written with mode 0644 and fsynced;
    ``config.json`` is ``rewrite_config(..., dtype)``. First, ``assets.nbytes`` must fit the free
    space there.

    Args:
        assets: from ``open_hf_assets``.
        folder: the output folder being written.
        dtype: the dtype of the weights written (``--dtype``, or theirs when uniform), or None.
        quantization: as ``rewrite_config``.
        dequantized: as ``rewrite_config``.

    Returns:
        The paths written.

    Raises:
        CheckpointNotFoundError: a remote file went missing since it was listed.
        OutputWriteError: the copies do not fit the free space.
        UnsafeContentError, CorruptChunkError: a local file became a link out of the folder, or
            not a regular file, since it was listed.
        OSError: a local read or write failed (``writers._atomic.writing`` names it).
    """
    free = free_bytes(folder)
    if assets.nbytes > free:
        raise OutputWriteError(
            f"cannot write {folder}: No space left on device: the --hf-assets files need "
            f"{human_bytes(assets.nbytes, units='decimal')} but {human_bytes(free, units='decimal')} are free there; free space"
        )
    written = []
    for relative in (*assets.files, CONFIG_FILENAME):
        target = folder / relative
        target.parent.mkdir(exist_ok=True)
        source = assets.source / relative
        with open(os.open(target, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644), "wb") as out:
            if relative == CONFIG_FILENAME:
                out.write(rewrite_config(assets.config_bytes, dtype, quantization=quantization, dequantized=dequantized))
            elif isinstance(source, Url):
                out.write(read_bytes(source))
            else:
                assert isinstance(assets.source, Path)
                fd = open_inside(assets.source, source, follow_symlinks=assets.follow_symlinks, what=_WHAT)
                with open(fd, "rb") as f:
                    shutil.copyfileobj(f, out, 1 << 20)
            out.flush()
            os.fsync(out.fileno())
        written.append(target)
    return written


def weights_dtype(requested: DType | None, dtypes: Iterable[DType | None]) -> DType | None:
    """The dtype ``config.json`` should name: ``--dtype``, else the floating-point weights' one when uniform.

    Args:
        requested: the ``--dtype`` cast, or None.
        dtypes: the output dtype of every model tensor written.

    Returns:
        ``requested``; otherwise the one floating-point dtype among ``dtypes``, or None (mixed, or none).
    """
    if requested is not None:
        return as_dtype(requested)
    floating = {d for d in dtypes if d is not None and d.is_floating_point}
    return floating.pop() if len(floating) == 1 else None
