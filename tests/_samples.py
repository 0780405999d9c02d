"""Where the tests' checkpoints are made: real FSDP2 runs on forked gloo ranks, with their ground truth.

The fixtures here are registered by ``tests/conftest.py``; a test names them as arguments
(``ws3_ckpt``, ``fsdp2_ckpt``, ``torchtitan_run``...) and imports ``Sample`` from here for its type.
Session-scoped samples are trained once per pytest run, on first use.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
from typer.testing import CliRunner

from fsdp_convert._sample import CHECKPOINT_DIRNAME, TRUTH_FILENAME, SampleConfig, train_and_save
from tests._dist import run_ranks


@dataclass(frozen=True)
class Sample:
    """A DCP checkpoint from real FSDP2 training and the full state dict taken in the same run."""

    name: str
    world_size: int
    dtype: torch.dtype
    checkpoint: Path
    truth_path: Path

    def truth(self) -> dict[str, Any]:
        return torch.load(self.truth_path, weights_only=True)


# vocab 101 is divisible by neither 2 nor 3; logit_scale has shape (1,), smaller than any world size
SAMPLES = {
    "ws2_fp32": (2, torch.float32),
    "ws3_fp32": (3, torch.float32),
    "ws3_bf16": (3, torch.bfloat16),
}


def _make_sample(root: Path, name: str) -> Sample:
    world_size, dtype = SAMPLES[name]
    out = root / name
    run_ranks(train_and_save, world_size, out, SampleConfig(dtype=dtype))
    return Sample(name, world_size, dtype, out / CHECKPOINT_DIRNAME, out / TRUTH_FILENAME)


@pytest.fixture(scope="session")
def samples_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("samples")


@pytest.fixture(scope="session", params=sorted(SAMPLES))
def fsdp2_ckpt(request: pytest.FixtureRequest, samples_root: Path) -> Sample:
    """Each sample checkpoint in turn (session-scoped: trained once)."""
    return _sample(request.param, samples_root)


_CACHE: dict[str, Sample] = {}


def _sample(name: str, root: Path) -> Sample:
    if name not in _CACHE:
        _CACHE[name] = _make_sample(root, name)
    return _CACHE[name]


@pytest.fixture(scope="session")
def ws3_ckpt(samples_root: Path) -> Sample:
    """The 3-rank fp32 sample alone."""
    return _sample("ws3_fp32", samples_root)


@pytest.fixture(scope="session")
def ws3_bf16_ckpt(samples_root: Path) -> Sample:
    """The 3-rank bf16 sample alone."""
    return _sample("ws3_bf16", samples_root)


@pytest.fixture
def runner() -> CliRunner:
    return CliRunner()


@pytest.fixture(scope="session")
def big_sample(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """About 420 MB of FSDP2 state on 2 ranks whose largest tensors are 64 MiB (folder with checkpoint/, truth.pt).

    The embedding and output head (131072 x 128 float32) and their Adam moments dwarf a small
    memory budget, so a bound that held a whole tensor, or a whole rank's chunk of one, shows.
    """
    out = tmp_path_factory.mktemp("big")
    run_ranks(train_and_save, 2, out, SampleConfig(dim=128, n_layers=4, vocab_size=131072, steps=1))
    return out


@pytest.fixture(scope="session")
def fsdp2_layouts(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One FSDP2 run on 2 ranks saved by torch's own writers (wrapper-named, HuggingFaceStorageWriter)
    and in verl's layout, an imitation (see tests/_producers.py)."""
    from tests._producers import fsdp2_layouts as write

    out = tmp_path_factory.mktemp("fsdp2_layouts")
    run_ranks(write, 2, out)
    return out


@pytest.fixture(scope="session")
def fsdp1_layouts(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """FSDP1 runs on 2 ranks (use_orig_params True and False) saved with SHARDED_STATE_DICT (see tests/_producers.py)."""
    from tests._producers import fsdp1_layouts as write

    out = tmp_path_factory.mktemp("fsdp1_layouts")
    run_ranks(write, 2, out)
    return out


def _framework_run(name: str, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One 2-rank forked run of ``tests._frameworks.<name>_run``: the framework's own training and save."""
    from tests import _frameworks

    _frameworks.preload(name)
    out = tmp_path_factory.mktemp(f"{name}_run")
    run_ranks(getattr(_frameworks, f"{name}_run"), 2, out)
    return out


@pytest.fixture(scope="session")
def accelerate_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """accelerate's FSDP2 ``save_state`` folder at ``accelerate/`` with its ``truth.pt`` (see tests/_frameworks.py)."""
    return _framework_run("accelerate", tmp_path_factory)


@pytest.fixture(scope="session")
def lightning_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Lightning Fabric's ``fabric.save``: FSDP1 (``lightning_fsdp1/``), FSDP2 (``lightning_fsdp2/``), each with truth.pt."""
    return _framework_run("lightning", tmp_path_factory)


@pytest.fixture(scope="session")
def torchtitan_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """torchtitan's Trainer and CheckpointManager: ``torchtitan/checkpoint/step-2`` and ``torchtitan/truth.pt``."""
    return _framework_run("torchtitan", tmp_path_factory)
