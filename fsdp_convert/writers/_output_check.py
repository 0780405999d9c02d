"""Write stage, first of all: may OUT be written? Not onto an input, through a link, or over a folder this tool did not write.

``check_output`` is the one rule. The operations (``ops.consolidate``, ``ops.reshard``) apply it
before anything else, and the command line's precheck (``cli._precheck``) applies the same
function before torch is imported; nothing here imports torch. Its parts:

- **OUT is not an input.** OUT may not be an input (the checkpoint, ``--hf-assets``), inside
  one, or one of its ancestors (which ``--overwrite`` would delete with the input in it): exit 2,
  ``--overwrite`` or not. Local paths are compared by real path (links resolved) and by
  ``(st_dev, st_ino)`` of every existing ancestor (a bind mount, another spelling of the same
  folder); URLs by normalized URL (``remote.normal_url``). A local path and a URL never clash.
- **OUT is named, and not as this tool names its own files.** OUT spelled ``.``, ``..`` or ``/``
  has no name to rename the output onto: exit 2, naming the folder to give instead. No component
  of OUT (as given, or with links resolved) may be a name this tool gives its own files
  (``run_name``): a lock ``.X.lock``, a temporary ``.X.tmp-TAG`` or ``.STEM.tmp-TAG.SUFFIX``, its
  manifest folder ``.STEM.manifest-TAG...``, a folder moved aside ``.X.old-HEX``, a data file
  being compressed ``.X.zstd-tmp``, an upload's staging folder ``fsdp-convert-upload-...``:
  another run may be writing it, and would publish what this run put there as its own (exit 2,
  whatever the command, ``--overwrite`` or not).
- **OUT is no link.** A symbolic link at OUT is refused (exit 4), with ``--overwrite`` too:
  replacing it would leave its target as it was while the user meant to write there, and writing
  through it is what this tool never does (``writers._nofollow``).
- **OUT is a regular file or a folder.** A device node, FIFO or socket at OUT is refused (exit 4),
  with ``--overwrite`` too: replacing ``/dev/null`` with a file breaks every process that writes
  to it. So is a mount point (and a file bind-mounted), which no rename can replace.
- **OUT's folder exists** (as ``cp`` asks): no folder is made for a local OUT (exit 2).
- **OUT's name and kind agree.** A name with a file kind's suffix (``.pt``, ``.safetensors``...)
  is one file: a folder output (``reshard``'s DCP folder) so named is refused, and so is an
  existing folder at a file output, ``--overwrite`` or not (exit 2).
- **OUT is free**, or ``--overwrite`` is given (exit 4). An empty folder is free for a folder output.
- **A folder replaced is this tool's output.** ``--overwrite`` deletes the folder it replaces, so
  an existing folder must *look like this tool's output* (``foreign_entry``), else ``--overwrite
  --force`` is needed (exit 4). A folder looks like this tool's output when it is empty, or every
  entry in it is one of the names this tool writes there, as the caller gives them (an
  ``own_files.OwnFiles``: top-level file names, and folders holding files of given names only).
  The tables say which: the output kinds' names (``output_table.own_files()``, the default: a DCP
  folder's ``.metadata`` and ``__<r>_<n>.distcp``, HF folder shards and index, ``optimizer.pt``,
  ``extra_state.pt``, PEFT's adapter files, ``--hf-assets``' files and chat templates folder)
  and, for ``reshard``'s output, the producers' (``producers.own_files()``: the files it copies
  beside the data, its DCP folders). Any other entry (a ``README.md``, a hidden
  file, a checkpoint folder ``step-1000/``) makes the folder not this tool's: the message names
  the first one found. A URL's objects are not listed: an upload replaces only the objects it
  writes, and deletes none.
"""

from __future__ import annotations

import os
import re
import stat
from collections.abc import Iterable
from pathlib import Path

from fsdp_convert.errors import InvalidOptionError, OutputExistsError
from fsdp_convert.output_table import OUTPUT_ROWS
from fsdp_convert.output_table import own_files as output_files
from fsdp_convert.own_files import OwnFiles
from fsdp_convert.remote import Url, as_location, normal_url
from fsdp_convert.writers._staging import STAGING_PREFIX

__all__ = ["check_output", "check_output_free", "foreign_entry", "run_name"]

# the names a run gives its own files, which no OUT may take (module docstring): the lock (lock_record.lock_name), the
# temporary (writers._atomic.temporary_path, any tag), its manifest folder (writers._manifest.manifest_dir), a replaced
# folder moved aside (writers._atomic.atomic_output), a data file being compressed (writers.dcp), an upload's staging
# folder; tests/redteam/test_output_replace.py checks this against the functions that make the names
_RUN_NAME_RE = re.compile(r"^\..+\.(lock|manifest|old-[0-9a-f]+|zstd-tmp)$|^\..*\.(tmp|manifest)-|^" + re.escape(STAGING_PREFIX))
_KINDS = {stat.S_IFCHR: "a character device", stat.S_IFBLK: "a block device", stat.S_IFIFO: "a FIFO", stat.S_IFSOCK: "a socket"}


def _shown(name: str) -> str:
    """A file name as a message shows it: as it is if printable, else escaped (a name may hold control bytes)."""
    return name if name.isprintable() else ascii(name)


def _ours(entry: os.DirEntry[str], own_files: OwnFiles) -> bool:
    """Whether one top-level entry of an existing output folder is a name this tool writes there (``own_files``)."""
    if not entry.is_dir(follow_symlinks=False):
        return own_files.file(entry.name)
    inner = own_files.folder(entry.name)
    if inner is None:
        return False
    with os.scandir(entry.path) as entries:  # files of its names only, no subfolder
        return all(inner.fullmatch(e.name) is not None and not e.is_dir(follow_symlinks=False) for e in entries)


def foreign_entry(folder: Path, own_files: OwnFiles | None = None) -> str | None:
    """The first entry of ``folder`` this tool does not write there (shown for a message); None if it looks like its output.

    Reads the folder's listing only (and the listing of each subfolder this tool writes), stopping
    at the first foreign entry; nothing is opened.

    Args:
        folder: an existing output folder.
        own_files: the names this tool writes there (the output kinds', and ``reshard``'s producers');
            None: the output kinds' (``output_table.own_files()``, read now).
    """
    own = output_files() if own_files is None else own_files
    with os.scandir(folder) as entries:
        for entry in entries:
            if not _ours(entry, own):
                return _shown(entry.name) + ("/" if entry.is_dir(follow_symlinks=False) else "")
    return None


def run_name(output: Path | Url) -> str | None:
    """The first component of ``output`` named as this tool names its own files (a lock, a temporary...), or None.

    A local path is looked at as given and with its links resolved (a link to another run's temporary
    folder), a URL normalized (``remote.normal_url``); nothing is opened.
    """
    if isinstance(output, Url):
        parts = normal_url(output).partition("://")[2].split("/")
    else:
        parts = [*output.parts, *Path(_realpath(output)).parts]
    return next((part for part in parts if _RUN_NAME_RE.search(part)), None)


def _check_named(out: Path | Url) -> None:
    """Raise unless a local OUT ends in a name (not ``.``, ``..``, ``/``), and no component of OUT is named as a run's own file.

    Raises:
        InvalidOptionError: naming OUT as given (exit 2).
    """
    if isinstance(out, Path) and out.name in ("", ".", ".."):  # a URL is normalized (remote.normal_url) before use
        real = os.path.abspath(out)
        instead = f" (here {real})" if real != "/" else ""
        raise InvalidOptionError(
            f"{out} names no file or folder of its own, which OUT is written onto by a rename: "
            f"name the folder by its own name{instead}"
        )
    taken = run_name(out)
    if taken is not None:
        raise InvalidOptionError(
            f"{out}: {_shown(taken)} is a name fsdp-convert gives its own lock, temporary and manifest files, "
            "which another run may be writing; name another OUT"
        )


def _check_parent(out: Path) -> None:
    """Raise unless the folder OUT goes in exists (as ``cp`` refuses a missing one): no folder is made for OUT.

    Raises:
        InvalidOptionError: OUT's parent does not exist, or is not a folder (exit 2).
    """
    parent = out.parent
    if os.path.isdir(parent):
        return
    why = "is not a folder" if os.path.lexists(parent) else "does not exist"
    raise InvalidOptionError(
        f"cannot write {out}: its folder {parent} {why}; create it first (mkdir -p {parent}), or name another OUT"
    )


def _file_suffix(out: Path) -> str | None:
    """OUT's suffix if a file row of the outputs table claims it (``.pt``, ``.safetensors``...), else None.

    Such a name is always one file: no folder output takes it.
    """
    suffix = out.suffix.lower()
    return out.suffix if any(suffix in row.suffixes for row in OUTPUT_ROWS if not row.folder) else None


def _check_kind_name(out: Path, directory: bool | None) -> None:
    """Raise unless OUT fits the output's kind: a folder output has no file suffix, a file output is no existing folder.

    An OUT with a file row's suffix (``_file_suffix``) is taken as a file when ``directory`` is
    None (not known yet). A link at OUT is left to ``check_output_free``.

    Raises:
        InvalidOptionError: a folder output (``reshard``'s DCP folder) named with a file suffix; an
            existing folder at a file output (exit 2, ``--overwrite`` or not).
    """
    suffix = _file_suffix(out)
    if directory is True and suffix is not None:
        raise InvalidOptionError(
            f"{out}: the output is a folder (reshard writes a DCP folder), not a {suffix} file; name OUT without a file suffix"
        )
    if directory is True or (directory is None and suffix is None):
        return
    try:
        folder = stat.S_ISDIR(os.lstat(out).st_mode)
    except OSError:
        return
    if folder:
        said = f"a {suffix} OUT" if suffix is not None else "this output"
        raise InvalidOptionError(
            f"{out} is a folder; {said} is one file: name a path that is not a folder "
            "(a folder output takes a name without a suffix), or remove the folder"
        )


def _empty(folder: Path) -> bool:
    """Whether ``folder`` holds no entry (an unreadable one counts as not empty)."""
    try:
        with os.scandir(folder) as entries:
            return next(entries, None) is None
    except OSError:
        return False


def _unescape(field: str) -> str:
    """A path of ``/proc/self/mountinfo``, its octal escapes (a backslash and 040 for a space) decoded."""
    return re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), field)


def _mount_point(path: Path) -> bool:
    """Whether ``path`` is a mount point: on another device than its folder, or listed as one (a bind mount, same device)."""
    if os.path.ismount(path):
        return True
    real = _realpath(path)
    try:
        with open("/proc/self/mountinfo", encoding="utf-8", errors="surrogateescape") as table:
            return any(len(fields) > 4 and _unescape(fields[4]) == real for fields in (line.split(" ") for line in table))
    except OSError:
        return False  # no /proc: the rename's EBUSY is still told in one line (writers._atomic)


def check_output_free(
    output: Path, *, overwrite: bool, force: bool = False, directory: bool | None = False, own_files: OwnFiles | None = None
) -> None:
    """Raise unless local ``output`` may be written: no link, free or ``overwrite``, a folder replaced only if it is this tool's.

    Only a regular file or a folder is ever replaced: a device node, FIFO or socket at ``output`` is
    refused, ``overwrite`` or not, and a mount point with ``overwrite``.

    Args:
        output: the final output path.
        overwrite: whether an existing output may be replaced.
        force: replace an existing folder that does not look like this tool's output too.
        directory: whether the output is a folder (sharded outputs) rather than a file; None: not known yet.
        own_files: the names this tool writes in an output folder (``foreign_entry``; None: the output kinds').

    Raises:
        InvalidOptionError: an existing folder where a file is wanted; a folder output named with a file suffix.
        OutputExistsError: ``output`` is a symbolic link, a device node, FIFO or socket, or a mount point;
            it exists (but for an empty folder, for a folder output) and ``overwrite`` is false; or it is
            a folder that does not look like this tool's output and ``force`` is false.
    """
    _check_kind_name(output, directory)
    try:
        st = os.lstat(output)
    except FileNotFoundError:
        return
    if stat.S_ISLNK(st.st_mode):
        raise OutputExistsError(
            f"{output} is a symbolic link; fsdp-convert neither writes through a link nor replaces one: "
            "name the real path, or remove the link"
        )
    if not (stat.S_ISREG(st.st_mode) or stat.S_ISDIR(st.st_mode)):
        kind = _KINDS.get(stat.S_IFMT(st.st_mode), "a special file")
        raise OutputExistsError(
            f"{output} is {kind}, not a regular file or folder; fsdp-convert replaces only a file or a folder it wrote: "
            "name another OUT"
        )
    is_dir = stat.S_ISDIR(st.st_mode)
    if not overwrite and not (is_dir and directory is not False and _empty(output) and not _mount_point(output)):
        raise OutputExistsError(f"{output} already exists; pass --overwrite to replace it")
    if not overwrite:
        return  # an empty folder is a free folder OUT: the output takes its place
    if _mount_point(output):
        raise OutputExistsError(f"{output} is a mount point, which no rename can replace; name a path inside it, or another OUT")
    if not is_dir:
        return
    foreign = None if force else foreign_entry(output, own_files)
    if foreign is not None:
        said = f"{output} is a folder fsdp-convert did not write (it holds {foreign}), which replacing it deletes"
        raise OutputExistsError(
            f"{said}: pass force=True as well to replace it anyway, or name another output",
            cli_message=f"{said}: pass --overwrite --force to replace it anyway, or name another OUT",
        )


def _realpath(path: Path) -> str:
    """``os.path.realpath``, a race that changes a link while it is resolved (readlink: EINVAL) refused in one line."""
    try:
        return os.path.realpath(path)
    except OSError as e:
        raise InvalidOptionError(f"{path} changed while it was being resolved ({e.strerror}); refused") from e


def _real_key(path: Path) -> tuple[str, ...]:
    return Path(_realpath(path)).parts


def _ids(path: Path) -> list[tuple[int, int]]:
    """``(st_dev, st_ino)`` of ``path`` (if it exists) and of each existing ancestor, nearest first."""
    ids = []
    for p in (path, *path.parents):
        try:
            st = os.stat(p)
        except OSError:
            continue
        ids.append((st.st_dev, st.st_ino))
    return ids


def _url_key(url: Url) -> tuple[str, ...]:
    scheme, _, rest = normal_url(url).partition("://")
    return (scheme, *(part for part in rest.split("/") if part))


def _relation(output: Path | Url, source: Path | Url) -> str | None:
    """How ``output`` stands to input ``source``: ``is``, ``is inside``, ``holds``, or None (apart)."""
    if isinstance(output, Url) != isinstance(source, Url):
        return None
    if isinstance(output, Url) and isinstance(source, Url):
        out_key, in_key = _url_key(output), _url_key(source)
    else:
        assert isinstance(output, Path) and isinstance(source, Path)
        out_key, in_key = _real_key(output), _real_key(source)
        out_ids, in_ids = _ids(Path(_realpath(output))), _ids(Path(_realpath(source)))
        out_self = out_ids[0] if os.path.exists(output) else None
        in_self = in_ids[0] if os.path.exists(source) else None
        if out_self is not None and out_self == in_self:
            return "is"
        if in_self is not None and in_self in out_ids:
            return "is inside"
        if out_self is not None and out_self in in_ids:
            return "holds"
    if out_key == in_key:
        return "is"
    if out_key[: len(in_key)] == in_key:
        return "is inside"
    if in_key[: len(out_key)] == out_key:
        return "holds"
    return None


_WHY = {
    "is": "writing it would destroy the input",
    "is inside": "writing there would change the input",
    "holds": "replacing it (--overwrite) would delete the input",
}


def check_output(
    output: str | os.PathLike[str],
    inputs: Iterable[str | os.PathLike[str] | None],
    *,
    overwrite: bool,
    force: bool = False,
    directory: bool | None = None,
    free: bool = True,
    own_files: OwnFiles | None = None,
) -> None:
    """The one check of OUT before anything is read or written (module docstring): not an input, no link, free.

    Args:
        output: OUT as the user gave it (a local path, ``file://`` path or fsspec URL).
        inputs: what the run reads (the checkpoint, ``--hf-assets``); None entries are skipped.
        overwrite: ``--overwrite``.
        force: ``--force``: replace a folder that does not look like this tool's output.
        directory: whether OUT is a folder output; None if not known yet (a name with a file suffix is a file).
        free: check that a local OUT is free (False: leave that to a later check, as with ``--resume``);
            a link at OUT is refused either way.
        own_files: the names this tool writes in an output folder, which ``overwrite`` replaces
            without ``force``: the output kinds' (``output_table.own_files()``; None, the default),
            with the producers' (``producers.own_files()``) for ``reshard``.

    Raises:
        InvalidOptionError: OUT is spelled ``.``, ``..`` or ``/``; a component of it is named as this
            tool's lock, temporary or manifest files (``run_name``); OUT is an input, inside one, or
            one of its ancestors; a local OUT's folder does not exist; a folder output named with a
            file suffix, or an existing folder where a file is wanted (exit 2).
        OutputExistsError: OUT is a link, a device node, FIFO, socket or mount point, exists (but
            for an empty folder, for a folder output) without ``overwrite``, or is a folder not this
            tool's without ``force`` (exit 4).
    """
    out = as_location(output)
    for source in inputs:
        if source is None:
            continue
        relation = _relation(out, as_location(source))
        if relation is not None:
            raise InvalidOptionError(f"{out} {relation} the input {as_location(source)}: {_WHY[relation]}; name another OUT")
    _check_named(out)
    if isinstance(out, Url):
        return
    _check_parent(out)
    if free:
        check_output_free(out, overwrite=overwrite, force=force, directory=directory, own_files=own_files)
    else:
        _check_kind_name(out, directory)
        if out.is_symlink():
            check_output_free(out, overwrite=False)  # the link's own message
