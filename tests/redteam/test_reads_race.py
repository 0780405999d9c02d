"""Issue 37 N2: the folder's owner swaps the checkpoint folder (or a folder above it, or ``--hf-assets``) for a link.

Before, ``held_roots.inside`` checked a path's real path and the reader then opened it by name: a
``renameat2(RENAME_EXCHANGE)`` loop between the two made the tool read (copy into OUT, quote in an
error) a file outside the folder. Now every read walks from the root's descriptor, held from the
run's first read, with ``O_NOFOLLOW`` on each component: the folder first opened is read
throughout, and a link met on the way is resolved inside it or refused.

The race tests run the library in-process against a swapper process for a few seconds; the walk's
own tests swap a component between two opens deterministically.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from fsdp_convert.errors import CheckpointError, UnsafeContentError
from fsdp_convert.held_roots import HELD_ROOTS_ENV, following_symlinks, open_inside, stat_inside
from fsdp_convert.location import read_inside

SECRET = b"API_KEY=hunter2-" * 64  # 1 KiB: the outside tensor's bytes, and the outside tokenizer.json
MARKERS = (b"API_KEY", b"hunter2", str(int.from_bytes(SECRET[:8], "little")).encode(), str(int.from_bytes(SECRET[:8])).encode())
RACE_SECONDS = 3.0  # today's code leaked within a second here; the fixed code must hold for all of it

# swaps two names in a tight loop: renameat2(RENAME_EXCHANGE), or two renames where it is missing
_SWAPPER = """
import ctypes, os, sys
a, b = sys.argv[1].encode(), sys.argv[2].encode()
libc = ctypes.CDLL(None, use_errno=True)
exchange = getattr(libc, "renameat2", None)
while True:
    if exchange is not None:
        exchange(-100, a, -100, b, 2)
    else:
        os.rename(a, a + b".t"); os.rename(b, a); os.rename(a + b".t", b)
"""


def _dcp(folder: Path, data: bytes) -> None:
    """A one-tensor DCP checkpoint: ``w``, uint8, holding ``data``."""
    import torch
    import torch.distributed.checkpoint as dcp

    dcp.save({"w": torch.frombuffer(bytearray(data), dtype=torch.uint8).clone()}, checkpoint_id=str(folder), no_dist=True)


def _leaks(blob: bytes | str) -> bool:
    raw = blob.encode(errors="replace") if isinstance(blob, str) else blob
    return any(m in raw for m in MARKERS)


def _race(swap: tuple[Path, Path], call: Callable[[], object], outputs: Path) -> tuple[int, int]:
    """Run ``call()`` for RACE_SECONDS while ``swap``'s names are exchanged; assert no secret ever shows.

    Returns:
        (calls that succeeded, calls refused).
    """
    swapper = subprocess.Popen([sys.executable, "-c", _SWAPPER, str(swap[0]), str(swap[1])])
    ok = refused = 0
    try:
        end = time.monotonic() + RACE_SECONDS
        while time.monotonic() < end:
            try:
                call()
                ok += 1
            except CheckpointError as e:  # a raw OSError would be exit 70: every race ends in one line
                refused += 1
                assert not _leaks(str(e)) and not _leaks(getattr(e, "cli_message", "") or ""), f"an error quoted the secret: {e}"
            for f in (p for p in outputs.rglob("*") if p.is_file()):
                assert not _leaks(f.read_bytes()), f"{f} holds the outside file's bytes (after {ok + refused} calls)"
    finally:
        swapper.kill()
        swapper.wait()
    return ok, refused


@pytest.fixture()
def scene(tmp_path: Path) -> dict[str, Path]:
    """``work/parent/ckpt`` (inside: zeros) and ``outside/ckpt`` (the secret's bytes as ``w``, no ``.metadata``).

    ``outside`` alone is no checkpoint, so a run that reads it consistently is refused; only a run
    that mixes the inside ``.metadata`` with an outside data file reads the secret.
    """
    inside, outside = tmp_path / "work" / "parent" / "ckpt", tmp_path / "outside" / "ckpt"
    _dcp(inside, bytes(len(SECRET)))
    _dcp(outside, SECRET)
    (outside / ".metadata").unlink()
    assets, secret_assets = tmp_path / "work" / "assets", tmp_path / "outside" / "assets"
    assets.mkdir()
    (assets / "config.json").write_text(json.dumps({"tie_word_embeddings": True}))
    (assets / "tokenizer.json").write_text('{"inside": true}')
    secret_assets.mkdir()
    (secret_assets / "tokenizer.json").write_bytes(SECRET)  # and no config.json: alone it is no assets folder
    return {"inside": inside, "outside": outside, "assets": assets, "secret_assets": secret_assets, "out": tmp_path / "out"}


def _consolidate(checkpoint: Path, out: Path, **kwargs: object) -> Callable[[], object]:
    from fsdp_convert import consolidate

    return lambda: consolidate(checkpoint, out, overwrite=True, **kwargs)


def test_swapping_the_checkpoint_folder_reads_nothing_outside(scene: dict[str, Path]) -> None:
    """The checkpoint folder exchanged with a link to ``outside/ckpt``: no output or error holds the secret."""
    link = scene["inside"].with_name("ckpt-link")
    link.symlink_to(scene["outside"], target_is_directory=True)
    scene["out"].mkdir()
    ok, refused = _race((scene["inside"], link), _consolidate(scene["inside"], scene["out"] / "o.safetensors"), scene["out"])
    assert ok + refused > 5, (ok, refused)


def test_swapping_a_folder_above_the_checkpoint_reads_nothing_outside(scene: dict[str, Path]) -> None:
    """``work/parent`` exchanged with a link to ``outside`` (which holds its own ``ckpt``): nothing outside is read."""
    parent = scene["inside"].parent
    link = parent.with_name("parent-link")
    link.symlink_to(scene["outside"].parent, target_is_directory=True)
    scene["out"].mkdir()
    ok, refused = _race((parent, link), _consolidate(scene["inside"], scene["out"] / "o.safetensors"), scene["out"])
    assert ok + refused > 5, (ok, refused)


def test_swapping_the_hf_assets_folder_copies_nothing_outside(scene: dict[str, Path]) -> None:
    """``--hf-assets`` exchanged with a link to a folder whose ``tokenizer.json`` is the secret: OUT never holds it."""
    link = scene["assets"].with_name("assets-link")
    link.symlink_to(scene["secret_assets"], target_is_directory=True)
    scene["out"].mkdir()
    call = _consolidate(scene["inside"], scene["out"] / "model", hf_assets=scene["assets"])
    ok, refused = _race((scene["assets"], link), call, scene["out"])
    assert ok + refused > 5, (ok, refused)


# --- the walk itself, deterministic ---


def _tree(tmp_path: Path) -> tuple[Path, Path]:
    root, outside = tmp_path / "root", tmp_path / "outside"
    (root / "sub").mkdir(parents=True)
    (root / "sub" / "f").write_bytes(b"inside")
    (outside / "sub").mkdir(parents=True)
    (outside / "sub" / "f").write_bytes(SECRET)
    return root, outside


def test_a_folder_swapped_for_a_link_between_two_opens_is_refused(tmp_path: Path) -> None:
    """``root/sub`` replaced by a link out of the root after a first read: the second read is refused."""
    root, outside = _tree(tmp_path)
    with following_symlinks(None):
        assert read_inside(root, root / "sub" / "f", 100) == b"inside"
        (root / "sub").rename(tmp_path / "moved")
        (root / "sub").symlink_to(outside / "sub", target_is_directory=True)
        with pytest.raises(UnsafeContentError, match="leads outside") as caught:
            read_inside(root, root / "sub" / "f", 100)
        assert not _leaks(str(caught.value))
        with pytest.raises(UnsafeContentError, match="leads outside"):
            stat_inside(root, root / "sub" / "f")


def test_a_root_swapped_after_its_first_read_is_read_as_first_opened(tmp_path: Path) -> None:
    """Within a run the root is held: its name now a link elsewhere, reads still come from the folder first opened."""
    root, outside = _tree(tmp_path)
    with following_symlinks(None):
        assert read_inside(root, root / "sub" / "f", 100) == b"inside"
        root.rename(tmp_path / "moved")
        root.symlink_to(outside, target_is_directory=True)
        assert read_inside(root, root / "sub" / "f", 100) == b"inside"
    # a worker (the identity comes in the environment) opening the swapped root refuses it
    moved = tmp_path / "moved"
    st = os.stat(moved)
    os.environ[HELD_ROOTS_ENV] = json.dumps({os.path.abspath(root): [st.st_dev, st.st_ino]})
    try:
        with pytest.raises(UnsafeContentError, match="swapped"):
            read_inside(root, root / "sub" / "f", 100)
    finally:
        del os.environ[HELD_ROOTS_ENV]


def test_links_inside_the_folder_are_still_followed(tmp_path: Path) -> None:
    """Relative and absolute links that stay inside, a root that is itself a link, and a hub snapshot's ../../blobs."""
    root, outside = _tree(tmp_path)
    (root / "rel").symlink_to("sub/f")
    (root / "abs").symlink_to(root / "sub" / "f")
    (root / "dir").symlink_to("sub", target_is_directory=True)
    (root / "up").symlink_to("../outside/sub/f")
    (root / "sub" / "back").symlink_to("../rel")
    alias = tmp_path / "alias"
    alias.symlink_to(root, target_is_directory=True)
    for name in ("rel", "abs", "dir/f", "sub/back", "sub/../rel"):
        assert read_inside(alias, alias / name, 100) == b"inside", name
    with pytest.raises(UnsafeContentError, match="leads outside"):
        read_inside(root, root / "up", 100)
    assert read_inside(root, root / "up", 10**4, follow_symlinks=True) == SECRET
    repo = tmp_path / "models--org--name"
    (repo / "blobs").mkdir(parents=True)
    (repo / "blobs" / "abc").write_bytes(b"blob")
    (repo / "snapshots" / "rev").mkdir(parents=True)
    (repo / "snapshots" / "rev" / "config.json").symlink_to("../../blobs/abc")
    snap = repo / "snapshots" / "rev"
    assert read_inside(snap, snap / "config.json", 100) == b"blob"
    assert stat_inside(snap, snap / "config.json").st_size == 4
    fd = open_inside(snap / "config.json", snap / "config.json")  # a single file, named as the root
    os.close(fd)


def test_a_root_walked_by_another_thread_outlives_the_block_that_held_it(tmp_path: Path) -> None:
    """A worker's mover thread reads (outside any block) while another thread's block ends: the root it walks stays open
    until its walk ends, then closes (was: closed under it, so its open failed with EBADF, or walked a reused number)."""
    from fsdp_convert import held_roots, location

    root = tmp_path / "ck"
    root.mkdir()
    (root / "f").write_bytes(b"x")
    with held_roots.following_symlinks(None):
        assert location.read_inside(root, root / "f", 10) == b"x"  # the block holds the root from here
        walk = held_roots._root(root, "the checkpoint")
        held = walk.__enter__()  # another thread's walk, begun while the block holds the root
    os.fstat(held.base)  # the block ended; the walk goes on
    assert location.read_inside(root, root / "f", 10) == b"x"
    walk.__exit__(None, None, None)
    with pytest.raises(OSError):
        os.fstat(held.base)  # closed by its last walk, once


def test_a_linked_assets_folder_inside_the_checkpoint_is_a_root_of_its_own(tmp_path: Path) -> None:
    """``--hf-assets ck/tokenizer`` where ``tokenizer`` links into a shared store reads as it does alone (a root may be a
    link), even after the checkpoint's own root is held; a format's own subfolder linked out of the checkpoint does not."""
    shared = tmp_path / "shared"
    shared.mkdir()
    (shared / "tok.json").write_text("{}")
    root = tmp_path / "ck"
    root.mkdir()
    (root / "x").write_text("x")
    (root / "tokenizer").symlink_to(shared)
    for what in ("the --hf-assets folder", "the checkpoint"):
        with following_symlinks(None):
            assert read_inside(root, root / "x", 10) == b"x"  # the checkpoint's root is held from here
            if what == "the checkpoint":  # a subfolder of the checkpoint's format: reached from its root, not followed out
                with pytest.raises(UnsafeContentError, match="leads outside"):
                    read_inside(root / "tokenizer", root / "tokenizer" / "tok.json", 10, what=what)
            else:
                assert read_inside(root / "tokenizer", root / "tokenizer" / "tok.json", 10, what=what) == b"{}"
