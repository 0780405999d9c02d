#!/usr/bin/env bash
# Set up (scripts/setup.sh) and run the whole test suite, end-to-end torchrun tests included.
#
#   scripts/test.sh [pytest args]                      # torch 2.13.0 (CPU) in .venv: what CI runs
#   TORCH_VERSION=2.14.1 scripts/test.sh [pytest args] # the same suite against another torch, in
#                                                      # its own .venv-torch-2.14.1 (not in CI: only
#                                                      # a CPU wheel of 2.13.0 is at hand there)
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=$(scripts/setup.sh | tail -n 1)
export OMP_NUM_THREADS=1
echo "torch $("$VENV/bin/python" -c 'import torch; print(torch.__version__)') in $VENV" >&2
exec "$VENV/bin/python" -m pytest -q "$@"
