"""Row 14 of the newcomer's first hour: user docs speak to users, not about the project's history.

docs/options.md, resume.md, object-storage.md, huggingface.md, library.md and testing.md opened
with notes such as "Moved from the README (issue 22) with its wording: scripts/mutations.py
quotes ..."; a reader of the docs has no use for issue numbers or for where a page came from.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
USER_DOCS = sorted([ROOT / "README.md", *(ROOT / "docs").glob("*.md")])
HISTORY = re.compile(r"\bissue #?\d+|\(issue|moved from the readme|scripts/mutations\.py quotes", re.I)


@pytest.mark.parametrize("doc", USER_DOCS, ids=lambda p: p.name)
def test_row14_user_docs_name_no_issue_and_no_history(doc: Path) -> None:
    hits = [f"{doc.name}:{n}: {line.strip()}" for n, line in enumerate(doc.read_text().splitlines(), 1) if HISTORY.search(line)]
    assert not hits, hits


def test_row14_the_check_sees_an_old_preface() -> None:
    old = "> Moved from the README (issue 22) with its wording: `scripts/mutations.py` quotes its claims."
    assert HISTORY.search(old)
