#!/usr/bin/env bash
# Create a venv (if missing) and install fsdp-convert with its test and lint extras.
#
# torch is pinned: TORCH_VERSION (default 2.13.0, the CPU build this project's machines hold; an
# unpinned torch pulls a multi-GB CUDA build). Another TORCH_VERSION gets its own venv,
# .venv-torch-<version>, so the main .venv is never changed; VENV overrides the folder.
# The package itself asks for torch>=2.13,<2.15, the range the whole suite has passed on.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
TORCH_VERSION=${TORCH_VERSION:-2.13.0}
if [ "$TORCH_VERSION" = "2.13.0" ]; then
  VENV=${VENV:-.venv}
else
  VENV=${VENV:-.venv-torch-$TORCH_VERSION}
fi
if [ ! -x "$VENV/bin/python" ]; then
  "$PYTHON" -m venv "$VENV"
fi
"$VENV/bin/python" -m pip install -q --disable-pip-version-check "torch==$TORCH_VERSION"
"$VENV/bin/python" -m pip install -q --disable-pip-version-check -e '.[test,lint]'
# OLMo-core without its declared dependencies (scripts/requirements-olmo.txt says why)
"$VENV/bin/python" -m pip install -q --disable-pip-version-check --no-deps -r scripts/requirements-olmo.txt
# DeepSpeed (tests/_deepspeed.py trains and saves ZeRO checkpoints with it): a source package, built
# pure-Python without its CUDA ops (DS_BUILD_OPS=0, about 30 s); pip skips it once installed
DS_BUILD_OPS=0 "$VENV/bin/python" -m pip install -q --disable-pip-version-check "deepspeed==0.19.8"
echo "$VENV"
