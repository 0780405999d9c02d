"""The side files a producer's loader merges (Megatron-Core's ``common.pt``, Lightning's ``meta.pt``) are read as the rest.

``plan.items._load_merged`` read them by name after the read side moved to the held-root walk: a
``common.pt`` linked to a file outside the checkpoint was merged into OUT (issue 37 N2's class),
and a 2 KB ``meta.pt`` sharing one tensor-holding list at every level ended in exit 70.
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp

import fsdp_convert
from fsdp_convert.errors import UnsafeContentError, UnsupportedTransformError

from ._attack import SECONDS_BOUND, attack


def _dcp(root: Path) -> Path:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save({"model": {"w": torch.ones(2, 3)}}, checkpoint_id=root, no_dist=True)
    return root


def test_a_common_pt_linked_out_of_the_checkpoint_is_not_merged(tmp_path: Path) -> None:
    outside = tmp_path / "outside"
    outside.mkdir()
    torch.save({"stolen_secret": 4242}, outside / "secret.pt")
    ckpt = _dcp(tmp_path / "mg")
    (ckpt / "metadata.json").write_text(json.dumps({"sharded_backend": "torch_dist", "sharded_backend_version": 1}))
    (ckpt / "common.pt").symlink_to(outside / "secret.pt")
    out = tmp_path / "o.pt"
    run = attack(["consolidate", ckpt, out, "--format", "torch"])
    assert run.code == 1 and len(run.error_lines) == 1, run.stderr
    assert "common.pt" in run.error_lines[0] and "outside" in run.error_lines[0] and "4242" not in run.stderr
    assert run.seconds < 3 * SECONDS_BOUND and not out.exists()
    with pytest.raises(UnsafeContentError):
        fsdp_convert.consolidate(ckpt, out)
    fsdp_convert.consolidate(ckpt, out, follow_symlinks=True)  # a link into a shared store, as the user says
    assert torch.load(out, weights_only=True)["stolen_secret"] == 4242


def test_a_meta_pt_sharing_a_tensor_holding_list_everywhere_is_one_line(tmp_path: Path) -> None:
    x: Any = [torch.zeros(1)]
    for _ in range(30):
        x = [x, x]
    ckpt = _dcp(tmp_path / "lt")
    torch.save({"hyper": x}, ckpt / "meta.pt")
    assert (ckpt / "meta.pt").stat().st_size < 4096
    run = attack(["consolidate", ckpt, tmp_path / "o.pt", "--format", "torch"])
    assert run.code == 1 and len(run.error_lines) == 1, run.stderr  # was 70: ValueShapeError
    assert "meta.pt" in run.error_lines[0] and "--layout nested" in run.error_lines[0]
    with pytest.raises(UnsupportedTransformError):
        fsdp_convert.consolidate(ckpt, tmp_path / "o.pt")
