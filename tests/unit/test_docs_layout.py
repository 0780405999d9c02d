"""docs/layout.md names every module of the package, so a moved or new module updates the map."""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_layout_names_every_module() -> None:
    text = (ROOT / "docs" / "layout.md").read_text()
    package = ROOT / "fsdp_convert"
    missing = []
    for path in sorted(package.rglob("*.py")):
        rel = path.relative_to(package).as_posix()
        if path.name in ("__init__.py", "__main__.py") and rel not in text:
            continue  # a package's door: named where it holds a table (formats/, outputs/, transform/)
        # adapters/ is one line; the CLI's command modules share one line by their file names
        if rel not in text and f"{rel.split('/')[0]}/ " not in text and f" {path.name}" not in text:
            missing.append(rel)
    assert not missing, f"docs/layout.md does not name {missing}"
    for line in text.splitlines():  # and names nothing that is gone
        word = line.strip().split(" ")[0]
        if word.endswith(".py") and "/" in word or word.endswith(".py") and line.startswith("  "):
            assert (package / word).is_file(), f"docs/layout.md names {word}, which is not a module"
