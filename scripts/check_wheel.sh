#!/usr/bin/env bash
# The wheel users install works: build it from the checkout's files, install it into a fresh venv
# with only torch==$TORCH_VERSION before it and no extras (so no numpy, fsspec's s3fs or zstandard),
# and run the main job with that venv's fsdp-convert alone, on a real FSDP2 checkpoint at world
# size 3, with 2 workers: inspect; consolidate to a .pt and to a Hugging Face folder; verify both
# against the checkpoint (and the .pt against the training run's own state dict); reshard both back
# to world size 2 and verify those. Prints each command and its output; exits 1 if any step failed.
#
#   scripts/check_wheel.sh               # CI runs it after lint (.ci/run); 3 to 4 minutes on a busy 2-core machine
#   KEEP_WORK=1 scripts/check_wheel.sh   # keep the temporary folder (venv, wheel, outputs)
#
# torch is pinned: 2.13.0 is the CPU wheel this project's machines hold; unpinned, pip pulls the
# multi-GB CUDA build. The sample checkpoint is trained with the dev venv (.venv, scripts/setup.sh):
# dcp.save's object collectives need numpy (torch's _tensor_to_object calls Tensor.numpy()), which
# the wheel does not depend on and the clean venv must not have.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
PYTHON=${PYTHON:-python3}
TORCH_VERSION=${TORCH_VERSION:-2.13.0}
DEV_VENV=${DEV_VENV:-.venv}
export OMP_NUM_THREADS=1 PIP_DISABLE_PIP_VERSION_CHECK=1
unset PYTHONPATH  # the clean venv must see the wheel only, never this checkout

if [ ! -x "$DEV_VENV/bin/python" ]; then
  echo "check_wheel: no $DEV_VENV (it trains the sample checkpoint): run scripts/setup.sh first" >&2
  exit 1
fi
WORK=$(mktemp -d "${TMPDIR:-/tmp}/fsdp-convert-wheel.XXXXXX")
finish() {
  if [ "${KEEP_WORK:-0}" = 1 ]; then echo "check_wheel: kept $WORK" >&2; else rm -rf "$WORK"; fi
  echo "check_wheel: ${SECONDS} s in all" >&2
}
trap finish EXIT
say() { printf '\n$ %s\n' "$*"; }
section() { printf '\n== [%d s] %s\n' "$SECONDS" "$*"; }
step() { say "$@"; "$@"; }

section "building the wheel from the checkout's files (tracked, and untracked ones git does not ignore)"
# a copy, so a stale build/ of the checkout cannot put a deleted module into the wheel
mkdir "$WORK/src"
git ls-files -z --cached --others --exclude-standard | tar --null --files-from=- --ignore-failed-read -cf - 2>/dev/null |
  tar -xf - -C "$WORK/src"
step "$PYTHON" -m venv "$WORK/venv"
V=$WORK/venv/bin
say "$V/pip" wheel -v --no-deps -w "$WORK/dist" "$WORK/src" "> $WORK/build.log"
if ! "$V/pip" wheel -v --no-deps -w "$WORK/dist" "$WORK/src" >"$WORK/build.log" 2>&1; then
  cat "$WORK/build.log"
  echo "check_wheel: building the wheel failed" >&2
  exit 1
fi
grep -E "Successfully installed setuptools|Created wheel|Stored in directory" "$WORK/build.log" || true
# any Python warning from the build backend (SetuptoolsDeprecationWarning about the license table, say)
if grep -nE "[A-Za-z]*Warning: " "$WORK/build.log"; then
  echo "check_wheel: the build printed the warnings above" >&2
  exit 1
fi
WHEEL=$(ls "$WORK"/dist/fsdp_convert-*.whl)

section "a fresh venv: torch==$TORCH_VERSION, then the wheel with no extras"
# --no-compile: byte-compiling all of torch takes longer than installing it; what runs compiles on import
step "$V/pip" install -q --no-compile "torch==$TORCH_VERSION"
step "$V/pip" install -q --no-compile "$WHEEL"
step "$V/pip" freeze
say "$V/python" -c "(numpy must not be importable)"
if "$V/python" -c 'import importlib.util, sys; sys.exit(importlib.util.find_spec("numpy") is not None)'; then
  echo "numpy: not installed"
else
  echo "check_wheel: numpy is installed in the clean venv, so this check would not see a use of it" >&2
  exit 1
fi

section "the sample checkpoint: FSDP2 training on 3 ranks under torchrun, with $DEV_VENV (needs numpy)"
step "$DEV_VENV/bin/python" -m torch.distributed.run --standalone --nproc-per-node=3 -m fsdp_convert._sample --out "$WORK/sample"

section "the main job, with the clean venv's fsdp-convert only"
cd "$WORK"
# as in a user's venv, the first run caches the bytecode of what it imports (pip ran --no-compile)
unset PYTHONDONTWRITEBYTECODE
# the package comes from the clean venv, not this checkout
step "$V/python" -c 'import fsdp_convert, sys; print(fsdp_convert.__file__); sys.exit(not fsdp_convert.__file__.startswith(sys.prefix))'
set +e
failed=()
fc() {  # run the clean venv's fsdp-convert; a failure is recorded and the job goes on
  say fsdp-convert "$@"
  "$V/fsdp-convert" "$@"
  local rc=$?
  [ $rc -eq 0 ] || failed+=("fsdp-convert $* (exit $rc)")
  return $rc
}
rank_files_are() {  # a reshard output holds exactly the rank files __0_0.distcp ... __{$2-1}_0.distcp
  say ls "$1" "| (rank files of world size $2?)"
  local got want
  got=$(cd "$1" && ls -- *.distcp | sort | tr '\n' ' ')
  want=$(for ((r = 0; r < $2; r++)); do echo "__${r}_0.distcp"; done | sort | tr '\n' ' ')
  echo "$got"
  [ "$got" = "$want" ] || failed+=("$1: rank files $got, not $want")
}
CK=sample/checkpoint
fc inspect "$CK"
if fc consolidate "$CK" full.pt --nproc 2; then
  fc verify "$CK" full.pt --nproc 2
  fc verify full.pt sample/truth.pt # the training run's own full state dict
  if fc reshard full.pt from-pt --world-size 2 --nproc 2; then
    fc verify "$CK" from-pt --nproc 2
    rank_files_are from-pt 2
  fi
fi
if fc consolidate "$CK" hf --nproc 2; then
  fc verify "$CK" hf --nproc 2
  if fc reshard hf from-hf --world-size 2 --nproc 2; then
    fc verify "$CK" from-hf --nproc 2
    rank_files_are from-hf 2
  fi
fi
cd "$ROOT"

echo
if [ ${#failed[@]} -gt 0 ]; then
  printf 'check_wheel: FAILED (%d s):\n' "$SECONDS" >&2
  printf '  %s\n' "${failed[@]}" >&2
  exit 1
fi
echo "check_wheel: the wheel installed without extras ran every step (${SECONDS} s)"
