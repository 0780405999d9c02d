"""Multi-worker runs need no NumPy: it is not a dependency, so a wheel installed without extras has none.

``WorkerGroup.gather`` once read each peer's record back through ``Tensor.numpy()``, and every
``--nproc 2`` run of such an install failed with "Numpy is not available". Here the CLI runs in a
process where ``import numpy`` fails (a ``sitecustomize`` on ``PYTHONPATH``, which the launched
workers inherit), on a real FSDP2 checkpoint.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests._compare import assert_same_state
from tests._samples import Sample

# None in sys.modules makes `import numpy` raise ImportError, as where it is not installed; torch,
# imported after it, then has no NumPy either (Tensor.numpy() raises "Numpy is not available").
NO_NUMPY = 'import sys\n\nsys.modules["numpy"] = None\n'


@pytest.fixture(scope="module")
def no_numpy_env(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    site = tmp_path_factory.mktemp("no_numpy")
    (site / "sitecustomize.py").write_text(NO_NUMPY)
    path = os.pathsep.join(filter(None, [str(site), os.environ.get("PYTHONPATH")]))
    env = {**os.environ, "PYTHONPATH": path, "OMP_NUM_THREADS": "1"}
    probe = subprocess.run([sys.executable, "-c", "import numpy"], env=env, capture_output=True, text=True, timeout=60)
    assert probe.returncode != 0 and "ModuleNotFoundError" in probe.stderr, probe.stderr  # numpy really is out of reach
    return env


def _cli(env: dict[str, str], *args: str | Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "fsdp_convert", *map(str, args)], env=env, capture_output=True, text=True, timeout=300
    )


def test_consolidate_and_verify_with_two_workers_need_no_numpy(
    ws3_ckpt: Sample, no_numpy_env: dict[str, str], tmp_path: Path
) -> None:
    out = tmp_path / "full.pt"
    proc = _cli(no_numpy_env, "consolidate", ws3_ckpt.checkpoint, out, "--nproc", "2")
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr == "", proc.stderr  # not even torch's "Failed to initialize NumPy" from a worker
    assert assert_same_state(torch.load(out, weights_only=True, mmap=True), ws3_ckpt.truth()) == 124

    proc = _cli(no_numpy_env, "verify", ws3_ckpt.checkpoint, out, "--nproc", "2")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("equal: 138 entries match"), proc.stdout


def test_a_merged_meta_tensor_is_written_without_numpy(no_numpy_env: dict[str, str], tmp_path: Path) -> None:
    """Rank 0 writes a merged file's tensors (Lightning's ``meta.pt``) itself: through a byte view, not ``Tensor.numpy()``."""
    import torch.distributed.checkpoint as dcp

    ckpt = tmp_path / "ckpt"
    dcp.save({"model": {"w": torch.arange(4.0)}, "optimizer": {"state": {}}}, checkpoint_id=ckpt, no_dist=True)
    meta = {"step": torch.tensor(3.0), "seen": torch.tensor([-0.0, float("nan")], dtype=torch.bfloat16)}
    torch.save(meta, ckpt / "meta.pt")
    out = tmp_path / "full.pt"
    proc = _cli(no_numpy_env, "consolidate", ckpt, out, "--nproc", "1")
    assert proc.returncode == 0, proc.stderr
    got = torch.load(out, weights_only=True)
    assert assert_same_state({"step": got["step"], "seen": got["seen"]}, meta) == 2
