#!/usr/bin/env bash
# Lint the checkout with the tools scripts/setup.sh installs in .venv (the `lint` extra):
# ruff's rules and formatting, mypy strict on fsdp_convert/, the import layering
# ([tool.importlinter] in pyproject.toml: imports run downward, no cycle) and module and class
# sizes (STYLE.md section 1). Runs every check, then fails if any failed. Installs nothing.
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
# STYLE.md section 1: no module over 450 lines, no class over 200
run .venv/bin/python - <<'PY'
import ast, pathlib, sys
too_big = []
for f in sorted(pathlib.Path("fsdp_convert").rglob("*.py")):
    text = f.read_text()
    if (n := len(text.splitlines())) > 450:
        too_big.append(f"{f}: {n} lines (at most 450)")
    for c in ast.walk(ast.parse(text)):
        if isinstance(c, ast.ClassDef) and (n := c.end_lineno - c.lineno + 1) > 200:
            too_big.append(f"{f}:{c.lineno}: class {c.name} is {n} lines (at most 200)")
print("\n".join(too_big) or "sizes: every module within 450 lines, every class within 200", file=sys.stderr)
sys.exit(1 if too_big else 0)
PY
if [ ${#failed[@]} -gt 0 ]; then
  echo "lint failed: ${failed[*]}" >&2
  exit 1
fi
