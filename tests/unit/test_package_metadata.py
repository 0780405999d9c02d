"""The wheel's metadata (pyproject.toml): an SPDX license with its file, and no License classifier beside it.

scripts/check_wheel.sh builds the wheel and fails on any setuptools warning; this keeps the
fields that warning was about in the form PEP 639 asks for.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

ROOT = Path(__file__).resolve().parents[2]
PROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
BUILD = tomllib.loads((ROOT / "pyproject.toml").read_text())["build-system"]


def test_license_is_an_spdx_expression_with_its_file() -> None:
    assert PROJECT["license"] == "BSD-3-Clause"
    assert PROJECT["license-files"] == ["LICENSE"]
    text = (ROOT / "LICENSE").read_text()
    assert text.startswith("BSD 3-Clause License\n") and "Copyright (c) 2026 the fsdp-convert authors" in text
    # PEP 639: with a license expression, a License classifier is an error in the tools that check it
    assert not [c for c in PROJECT["classifiers"] if c.startswith("License ::")]
    # setuptools reads PEP 639's string `license` and `license-files` from 77 on
    (setuptools,) = [r for r in BUILD["requires"] if r.startswith("setuptools")]
    match = re.fullmatch(r"setuptools>=(\d+)(\.\d+)*", setuptools)
    assert match and int(match.group(1)) >= 77, setuptools


def test_classifiers_name_each_python_from_the_oldest_allowed_on() -> None:
    oldest = re.fullmatch(r">=3\.(\d+)", PROJECT["requires-python"])
    assert oldest, PROJECT["requires-python"]
    pythons = sorted(
        int(c.rpartition(".")[2]) for c in PROJECT["classifiers"] if re.fullmatch(r"Programming Language :: Python :: 3\.\d+", c)
    )
    assert pythons == list(range(int(oldest.group(1)), int(oldest.group(1)) + len(pythons))) and len(pythons) >= 4, pythons
    assert set(PROJECT["urls"]) == {"Homepage", "Documentation", "Issues", "Changelog"}
    assert all(url.startswith("https://github.com/fsdp-convert/fsdp-convert") for url in PROJECT["urls"].values())
