"""pytest setup: one OpenMP thread before torch is imported, and the shared fixtures of tests/_samples.py.

Where each sample checkpoint comes from, and what it holds, is in ``tests/_samples.py``.
"""

from __future__ import annotations

import os
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")  # before torch: forked ranks and a 2-core CI box

import warnings  # noqa: E402

warnings.filterwarnings("ignore", message="Failed to initialize NumPy")

import pytest  # noqa: E402

from tests._resume import resume_hook, resume_references  # noqa: E402, F401  (the --resume tests' hook and references)
from tests._samples import (  # noqa: E402, F401  (fixtures, registered by being imported here)
    accelerate_run,
    big_sample,
    fsdp1_layouts,
    fsdp2_ckpt,
    fsdp2_layouts,
    lightning_run,
    runner,
    samples_root,
    torchtitan_run,
    ws3_bf16_ckpt,
    ws3_ckpt,
)


@pytest.fixture(scope="session")
def ds_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny torchtitan DeepSeek-V3 run (``tests/_deepseek.py``): ``checkpoint/`` (DCP, 2 ranks) and ``truth.pt``; one run."""
    from tests._deepseek import ds_run
    from tests._dist import run_ranks
    from tests._frameworks import preload

    preload("torchtitan")
    out = tmp_path_factory.mktemp("deepseek_v3")
    run_ranks(ds_run, 2, out)
    return out


@pytest.fixture(scope="session")
def megatron_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Megatron-Core's own save of a tiny GPT (``tests/_megatron.py``): ``iter_0000003/`` and ``truth.pt``; one run."""
    from tests import _megatron
    from tests._dist import run_ranks

    _megatron.preload()
    out = tmp_path_factory.mktemp("megatron_run")
    run_ranks(_megatron.megatron_run, 2, out, timeout=300)
    return out


@pytest.fixture(scope="session")
def deepspeed_runs(tmp_path_factory: pytest.TempPathFactory) -> dict[int, Path]:
    """DeepSpeed's own ZeRO saves (``tests/_deepspeed.py``) at 2 and 3 ranks: ``{ws: dir}``; ``dir/<variant>/truth.pt``."""
    from tests._deepspeed import train_launches

    return train_launches(tmp_path_factory.mktemp("deepspeed_runs"), world_sizes=(2, 3), timeout=300)
