#!/usr/bin/env bash
# Set up (scripts/setup.sh) and run the whole test suite, end-to-end torchrun tests included.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
export OMP_NUM_THREADS=1
exec .venv/bin/python -m pytest -q "$@"
