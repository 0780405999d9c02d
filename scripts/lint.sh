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
# STYLE.md section 1: no module over 420 lines (a second concept by then), no class over 200
run .venv/bin/python - <<'PY'
import ast, pathlib, sys
too_big = []
for f in sorted(pathlib.Path("fsdp_convert").rglob("*.py")):
    text = f.read_text()
    if (n := len(text.splitlines())) > 420:
        too_big.append(f"{f}: {n} lines (at most 420)")
    for c in ast.walk(ast.parse(text)):
        if isinstance(c, ast.ClassDef) and (n := c.end_lineno - c.lineno + 1) > 200:
            too_big.append(f"{f}:{c.lineno}: class {c.name} is {n} lines (at most 200)")
print("\n".join(too_big) or "sizes: every module within 420 lines, every class within 200", file=sys.stderr)
sys.exit(1 if too_big else 0)
PY
# docs/architecture.md: no module imports an underscore module of another package (a package's
# underscore modules are its own; others go through its public modules)
run .venv/bin/python - <<'PY'
import ast, pathlib, sys
crossing = []
for f in sorted(pathlib.Path("fsdp_convert").rglob("*.py")):
    package = ".".join(f.with_suffix("").parts[:-1])
    for node in ast.walk(ast.parse(f.read_text())):
        names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
        for name in names:
            parts = name.split(".")
            for i, part in enumerate(parts):
                if i and part.startswith("_") and not part.startswith("__") and ".".join(parts[:i]) != package:
                    if pathlib.Path(*parts[: i + 1]).with_suffix(".py").is_file():
                        crossing.append(f"{f}:{node.lineno}: imports {'.'.join(parts[: i + 1])}, another package's underscore module")
print("\n".join(dict.fromkeys(crossing)) or "imports: no module imports another package's underscore module", file=sys.stderr)
sys.exit(1 if crossing else 0)
PY
if [ ${#failed[@]} -gt 0 ]; then
  echo "lint failed: ${failed[*]}" >&2
  exit 1
fi
