"""Adding a model-family adapter is one module plus one row of ``adapters.ADAPTERS``: a stub family, here only.

The stub stands for ``fsdp_convert/adapters/<family>.py`` (its ``to_hf(infos, config)``) and the
``monkeypatch`` for its registration in ``fsdp_convert/adapters/__init__.py``; nothing else in
the package names it, yet ``load_adapter``, ``--adapter`` and ``consolidate`` take it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from safetensors.torch import load_file
from typer.testing import CliRunner

import fsdp_convert
from fsdp_convert import adapters
from fsdp_convert.cli.app import app
from fsdp_convert.derive import Derived, Input, Segment, TensorInfo, concat, copy_of
from fsdp_convert.errors import InvalidOptionError
from fsdp_convert.transform import TransformOptions

NAME = "stubfamily-to-hf"


def stub_to_hf(infos: Sequence[TensorInfo], config: Mapping[str, Any]) -> dict[str, Derived]:
    """A family's adapter: ``blocks.N.w`` to HF's ``model.layers.N.proj.weight``, ``a`` and ``b`` fused on dim 0.

    A module-level function, as an adapter module's: the plan that holds it is pickled to workers.
    """
    by_fqn = {info.fqn: info for info in infos}
    out: dict[str, Derived] = {}
    for info in infos:
        if info.fqn.startswith("blocks."):
            layer = info.fqn.split(".")[1]
            out[f"{config['prefix']}.layers.{layer}.proj.weight"] = copy_of(info)
    a, b = by_fqn["a"], by_fqn["b"]
    out[f"{config['prefix']}.fused.weight"] = Derived(
        inputs=(Input(fqn="a", rows=Segment(0, a.shape[0])), Input(fqn="b", rows=Segment(a.shape[0], b.shape[0]))),
        shape=(a.shape[0] + b.shape[0], *a.shape[1:]),
        dtype=a.dtype,
        combine=concat,
    )
    return out


@pytest.fixture
def registered(monkeypatch: pytest.MonkeyPatch) -> None:
    """What the family's one line in ``adapters/__init__.py`` does: ``ADAPTERS[NAME] = module.to_hf``."""
    monkeypatch.setitem(adapters.ADAPTERS, NAME, stub_to_hf)


@pytest.fixture
def checkpoint(tmp_path: Path) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    sd = {
        "blocks.0.w": torch.randn(4, 3, generator=gen),
        "blocks.1.w": torch.randn(4, 3, generator=gen),
        "a": torch.randn(2, 3, generator=gen).to(torch.bfloat16),
        "b": torch.randn(5, 3, generator=gen).to(torch.bfloat16),
    }
    dcp.save(sd, checkpoint_id=tmp_path / "ck", no_dist=True)
    return sd


def _expected(sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {
        "model.layers.0.proj.weight": sd["blocks.0.w"],
        "model.layers.1.proj.weight": sd["blocks.1.w"],
        "model.fused.weight": torch.cat([sd["a"], sd["b"]]),
    }


def _assert_equal(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert sorted(got) == sorted(want)
    for key, tensor in want.items():
        assert got[key].dtype == tensor.dtype and torch.equal(got[key], tensor), key


def test_an_unregistered_family_is_unknown() -> None:
    with pytest.raises(InvalidOptionError, match=f"'{NAME}': unknown; use one of torchtitan-llama3-to-hf"):
        adapters.load_adapter(NAME)


@pytest.mark.usefixtures("registered")
def test_a_registered_family_converts_keys_through_the_library(checkpoint: dict[str, torch.Tensor], tmp_path: Path) -> None:
    adapter = adapters.load_adapter(NAME, {"prefix": "model"})
    out = tmp_path / "out.safetensors"
    fsdp_convert.consolidate(tmp_path / "ck", out, options=TransformOptions(adapter=adapter), nproc=1)
    _assert_equal(load_file(out), _expected(checkpoint))


@pytest.mark.usefixtures("registered")
def test_a_registered_family_is_an_adapter_name_of_the_cli(checkpoint: dict[str, torch.Tensor], tmp_path: Path) -> None:
    out = tmp_path / "hf"
    args = ["consolidate", str(tmp_path / "ck"), str(out), "--adapter", NAME, "--adapter-option", "prefix=model", "--nproc", "1"]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    _assert_equal(load_file(out / "model.safetensors"), _expected(checkpoint))
