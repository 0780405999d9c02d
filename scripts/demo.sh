#!/usr/bin/env bash
# Set up, train a small Transformer with FSDP2 on 3 CPU ranks under torchrun, save it with DCP,
# then inspect it and consolidate it, and check the result against the run's own full state dict.
# Usage: scripts/demo.sh [OUTPUT_DIR]   (default: demo-output)
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
export OMP_NUM_THREADS=1
OUT=${1:-demo-output}
rm -rf "$OUT"
echo "== training with FSDP2 on 3 ranks (torchrun, gloo) -> $OUT/checkpoint" >&2
.venv/bin/python -m torch.distributed.run --standalone --nproc-per-node=3 -m fsdp_convert._sample --out "$OUT"
echo "== fsdp-convert inspect" >&2
.venv/bin/fsdp-convert inspect "$OUT/checkpoint"
echo "== fsdp-convert consolidate (2 workers)" >&2
.venv/bin/fsdp-convert consolidate "$OUT/checkpoint" "$OUT/consolidated.pt" --nproc 2
.venv/bin/fsdp-convert consolidate "$OUT/checkpoint" "$OUT/model.safetensors"
echo "== comparing with the ground truth taken in the training run" >&2
.venv/bin/python - "$OUT" <<'PY'
import sys
import torch
from safetensors.torch import load_file

out = sys.argv[1]


def same_bits(a, b):  # bitwise: the sample holds a NaN and a -0.0, which torch.equal gets wrong
    def raw(t):
        return t.contiguous().reshape(-1).view(torch.uint8)

    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(raw(a), raw(b))


got = torch.load(f"{out}/consolidated.pt", weights_only=True, mmap=True)
want = torch.load(f"{out}/truth.pt", weights_only=True)
n = 0
for fqn, t in want["model"].items():
    assert same_bits(got["model"][fqn], t), fqn
    n += 1
for fqn, state in want["optim"]["state"].items():
    for k, t in state.items():
        assert same_bits(got["optim"]["state"][fqn][k], t), (fqn, k)
        n += 1
assert got["optim"]["param_groups"] == want["optim"]["param_groups"]
st = load_file(f"{out}/model.safetensors")
assert all(same_bits(st[k], v) for k, v in want["model"].items())
print(f"{n} tensors and the param groups equal the ground truth bit for bit")
print(f"output: {out}/consolidated.pt (full model + optimizer state, torch.save)")
print(f"output: {out}/model.safetensors (model weights)")
PY
