#!/usr/bin/env bash
# Lint the checkout with the tools scripts/setup.sh installs in .venv (the `lint` extra):
# ruff's rules and formatting, mypy strict on fsdp_convert/, and the import layering
# ([tool.importlinter] in pyproject.toml: imports run downward, no cycle). Runs every check,
# then fails if any failed. Installs nothing.
set -uo pipefail
cd "$(dirname "$0")/.."
failed=()
run() {
  echo "+ $*" >&2
  "$@" || failed+=("$1")
}
run .venv/bin/ruff check
run .venv/bin/ruff format --check
run .venv/bin/mypy
run .venv/bin/lint-imports
if [ ${#failed[@]} -gt 0 ]; then
  echo "lint failed: ${failed[*]}" >&2
  exit 1
fi
