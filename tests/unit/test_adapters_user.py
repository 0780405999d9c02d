"""adapters/user.py: ``--adapter module:function`` imports the user's module and nothing else from their folder."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from fsdp_convert.adapters.user import load_user_function
from fsdp_convert.errors import InvalidOptionError

ADAPTER = "def to_mine(tensors, config):\n    return {}\n"
# a file named like an installed module that leaves a mark when imported (colorsys: stdlib, tiny, pure)
SHADOW = "import pathlib\npathlib.Path(__file__).with_name('shadow-ran').touch()\n"


@pytest.fixture
def folder(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """The current folder, holding the user's adapter and a ``colorsys.py``; sys.path and sys.modules restored after."""
    (tmp_path / "my_adapter_mod.py").write_text(ADAPTER)
    (tmp_path / "colorsys.py").write_text(SHADOW)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", list(sys.path))
    for name in ("my_adapter_mod", "colorsys"):
        monkeypatch.delitem(sys.modules, name, raising=False)
    yield tmp_path
    for name in ("my_adapter_mod", "colorsys"):
        sys.modules.pop(name, None)


def test_a_module_in_the_current_folder_never_shadows_an_installed_one(folder: Path) -> None:
    first = sys.path[0]
    assert load_user_function("my_adapter_mod:to_mine").__name__ == "to_mine"
    assert sys.path[0] == first and str(folder) not in sys.path  # imported from its file: the folder stays off sys.path
    import colorsys

    assert Path(colorsys.__file__).parent != folder and not (folder / "shadow-ran").exists()


def test_an_installed_module_wins_over_one_of_its_name_in_the_current_folder(folder: Path) -> None:
    (folder / "colorsys.py").write_text(SHADOW + "def to_mine(tensors, config):\n    return {}\n")
    with pytest.raises(InvalidOptionError, match="colorsys has no function 'to_mine'"):
        load_user_function("colorsys:to_mine")
    assert not (folder / "shadow-ran").exists()


def test_a_file_path_is_imported_from_that_file(folder: Path, tmp_path_factory: pytest.TempPathFactory) -> None:
    elsewhere = tmp_path_factory.mktemp("adapters")
    (elsewhere / "their_adapter_mod.py").write_text(ADAPTER)
    try:
        function = load_user_function(f"{elsewhere / 'their_adapter_mod.py'}:to_mine")
        assert function.__module__ == "their_adapter_mod" and str(elsewhere) not in sys.path
    finally:
        sys.modules.pop("their_adapter_mod", None)
    with pytest.raises(InvalidOptionError, match="an installed module is named 'colorsys'; rename colorsys.py"):
        load_user_function(f"{folder / 'colorsys.py'}:to_mine")
    assert not (folder / "shadow-ran").exists()


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("no_colon", "expected module:function"),
        ("nowhere_mod_xyz:f", "module 'nowhere_mod_xyz' does not import"),
        ("my_adapter_mod:missing", "my_adapter_mod has no function 'missing'"),
        ("missing_dir/x.py:f", "is not a Python file"),
    ],
)
def test_bad_specs_are_one_line_option_errors(folder: Path, spec: str, message: str) -> None:
    with pytest.raises(InvalidOptionError, match=message) as bad:
        load_user_function(spec)
    assert "\n" not in str(bad.value)
