#!/usr/bin/env bash
# Create .venv (if missing) and install fsdp-convert with its test and lint extras.
# torch is pinned to the CPU build (an unpinned torch pulls a multi-GB CUDA build); the package
# itself only asks for torch>=2.6,<3.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PYTHON" -m venv .venv
fi
.venv/bin/python -m pip install -q --disable-pip-version-check torch==2.13.0
.venv/bin/python -m pip install -q --disable-pip-version-check -e '.[test,lint]'
