#!/usr/bin/env bash
# Install what the tool needs, train a small Transformer with FSDP2 on 3 CPU ranks under torchrun,
# save it with DCP, then inspect, consolidate and verify it, and check the result bit for bit against
# the training run's own full state dict. Prints a short transcript: each command and what it says.
# Usage: scripts/demo.sh [OUTPUT_DIR]   (default: demo-output)
#
# Its venv, .venv-demo (DEMO_VENV names another), holds what a user installs: torch pinned as
# scripts/setup.sh pins it (TORCH_VERSION, default 2.13.0, the CPU build; unpinned, pip pulls the
# multi-GB CUDA build), then fsdp-convert without extras, and numpy, which the training run's
# dcp.save needs (torch's object collectives call Tensor.numpy()). About 0.9 GB; the first run
# spends most of its time installing. The test and lint venv (.venv, scripts/setup.sh) is not used.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
TORCH_VERSION=${TORCH_VERSION:-2.13.0}
VENV=${DEMO_VENV:-.venv-demo}
OUT=${1:-demo-output}
export OMP_NUM_THREADS=1 PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_ROOT_USER_ACTION=ignore
say() { printf '\n$ %s\n' "$*"; }

echo "== $VENV: torch==$TORCH_VERSION, fsdp-convert without extras, numpy for the training run"
if [ ! -x "$VENV/bin/python" ]; then
  "$PYTHON" -m venv "$VENV"
fi
"$VENV/bin/python" -m pip install -q "torch==$TORCH_VERSION" numpy
"$VENV/bin/python" -m pip install -q -e .
export PATH="$(cd "$VENV/bin" && pwd):$PATH"
rm -rf "$OUT"

echo "== training with FSDP2 on 3 ranks (torchrun, gloo) -> $OUT/checkpoint"
python -m torch.distributed.run --standalone --nproc-per-node=3 -m fsdp_convert._sample --out "$OUT"

say fsdp-convert inspect "$OUT/checkpoint" "# its header and each table's title; all of it in $OUT/inspect.txt"
fsdp-convert inspect "$OUT/checkpoint" >"$OUT/inspect.txt"
grep -E '^(checkpoint|producer|payloads|cuts|model|optim|other):|^     ' "$OUT/inspect.txt" | sed 's/ *$//'
say fsdp-convert consolidate "$OUT/checkpoint" "$OUT/consolidated.pt" --nproc 2
fsdp-convert consolidate "$OUT/checkpoint" "$OUT/consolidated.pt" --nproc 2
say fsdp-convert consolidate "$OUT/checkpoint" "$OUT/model.safetensors"
fsdp-convert consolidate "$OUT/checkpoint" "$OUT/model.safetensors"
say fsdp-convert verify "$OUT/checkpoint" "$OUT/consolidated.pt" --as-consolidated
fsdp-convert verify "$OUT/checkpoint" "$OUT/consolidated.pt" --as-consolidated

echo
echo "== comparing with the ground truth taken in the training run"
python - "$OUT" <<'PY'
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
