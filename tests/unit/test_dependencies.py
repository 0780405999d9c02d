"""Every import the package can reach is the stdlib, fsdp_convert itself or a declared runtime dependency.

A wheel installed without extras has ``[project].dependencies`` and what they pull in, nothing
else: numpy (in the test extra only) once failed every multi-worker run of such an install. The
imports a feature makes only when asked for (fsspec for ``s3://``, zstandard for zstd payloads)
sit inside a function, guarded, and their module names the extra to install.
"""

from __future__ import annotations

import ast
import importlib.metadata
import importlib.util
import json
import os
import re
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "fsdp_convert"
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())

# distribution name (normalized) -> the top-level module it installs, where the two differ
IMPORT_NAMES: dict[str, str] = {}

# Imports a feature makes only when it is used: each inside a function and a try that catches the
# ImportError, its module saying `pip install 'fsdp-convert[<extra>]'`.
OPTIONAL = {
    "fsspec": "s3",  # remote.py: s3:// and other fsspec URLs
    "zstandard": "zstd",  # zstd payloads (formats/_stream_transforms.py), reshard --compress zstd (writers/dcp.py)
}
# Imports used when installed and skipped otherwise (guarded the same way; nothing to install).
WHEN_INSTALLED = {
    "transformers": "writers/hf_assets.py: a model type's default tie_word_embeddings",
}
IMPORT_ERRORS = {"ImportError", "ModuleNotFoundError", "Exception", "BaseException"}


def _normalize(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _requirement_name(requirement: str) -> str:
    match = re.match(r"\s*([A-Za-z0-9][A-Za-z0-9._-]*)", requirement)
    assert match, requirement
    return _normalize(match.group(1))


def declared_imports() -> set[str]:
    """The top-level modules ``[project].dependencies`` install, by their import names."""
    names = {_requirement_name(r) for r in PYPROJECT["project"]["dependencies"]}
    return {IMPORT_NAMES.get(n, n.replace("-", "_")) for n in names}


@dataclass(frozen=True)
class ImportSite:
    path: Path
    lineno: int
    top: str  # the top-level module imported
    in_function: bool
    guarded: bool  # inside the body of a try whose handlers catch ImportError

    def __str__(self) -> str:
        return f"{self.path.relative_to(ROOT)}:{self.lineno}: {self.top}"


def _literal_import(node: ast.Call) -> str | None:
    """The module of ``importlib.import_module("x")`` / ``import_module("x")`` / ``__import__("x")``."""
    func = node.func
    name = func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else None
    if name not in ("import_module", "__import__") or not node.args:
        return None
    arg = node.args[0]
    return arg.value if isinstance(arg, ast.Constant) and isinstance(arg.value, str) else None


def _type_checking(node: ast.AST) -> bool:
    return isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)


def _catches_import_error(handler: ast.ExceptHandler) -> bool:
    if handler.type is None:
        return True
    types = handler.type.elts if isinstance(handler.type, ast.Tuple) else [handler.type]
    return any(isinstance(t, ast.Name) and t.id in IMPORT_ERRORS for t in types)


def import_sites(tree: ast.AST, path: Path) -> Iterator[ImportSite]:
    """Every absolute import in ``tree`` that runs when its code runs (not those under ``if TYPE_CHECKING:``)."""

    def visit(node: ast.AST, in_function: bool, guarded: bool) -> Iterator[ImportSite]:
        tops: list[str] = []
        if isinstance(node, ast.Import):
            tops = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            tops = [node.module]
        elif isinstance(node, ast.Call) and (module := _literal_import(node)):
            tops = [module]
        for top in tops:
            yield ImportSite(path, getattr(node, "lineno", 0), top.partition(".")[0], in_function, guarded)
        if _type_checking(node):
            return  # for the type checker only; never imported at run time
        for field, value in ast.iter_fields(node):
            children = value if isinstance(value, list) else [value]
            for child in children:
                if not isinstance(child, ast.AST):
                    continue
                func = in_function or isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
                guard = guarded or (
                    isinstance(node, ast.Try) and field == "body" and any(_catches_import_error(h) for h in node.handlers)
                )
                yield from visit(child, func, guard)

    yield from visit(tree, False, False)


def package_import_sites() -> list[ImportSite]:
    files = sorted(PACKAGE.rglob("*.py"))
    assert len(files) > 50, files  # the walk sees the package
    return [site for f in files for site in import_sites(ast.parse(f.read_text(), str(f)), f)]


def test_the_walk_finds_each_kind_of_import() -> None:
    code = """
import numpy.linalg
from a.b import c
from . import sibling
if TYPE_CHECKING:
    import typing_only
def f():
    try:
        mod = importlib.import_module("zstandard")
    except ImportError:
        mod = __import__("x")
"""
    sites = {s.top: s for s in import_sites(ast.parse(code), ROOT / "snippet.py")}
    assert sorted(sites) == ["a", "numpy", "x", "zstandard"]
    assert not sites["numpy"].in_function and not sites["numpy"].guarded
    assert sites["zstandard"].in_function and sites["zstandard"].guarded
    assert sites["x"].in_function and not sites["x"].guarded  # a handler is not guarded by its own try


def test_each_declared_dependency_installs_the_module_named_for_it() -> None:
    installed_by = importlib.metadata.packages_distributions()
    for requirement in PYPROJECT["project"]["dependencies"]:
        name = _requirement_name(requirement)
        top = IMPORT_NAMES.get(name, name.replace("-", "_"))
        distributions = {_normalize(d) for d in installed_by.get(top, [])}
        assert name in distributions, f"{requirement} does not install {top!r}: see IMPORT_NAMES"


def test_every_import_is_the_stdlib_the_package_or_a_declared_dependency() -> None:
    allowed = set(sys.stdlib_module_names) | {"fsdp_convert"} | declared_imports()
    sites = package_import_sites()
    assert {"torch", "typer", "rich", "safetensors"} <= {s.top for s in sites}
    undeclared = [str(s) for s in sites if s.top not in allowed and s.top not in OPTIONAL and s.top not in WHEN_INSTALLED]
    assert undeclared == [], (
        "imports of packages [project].dependencies does not declare (a wheel installed without extras lacks them): "
        "declare them, or import them inside a function, guarded, naming an extra (OPTIONAL here)"
    )


def test_optional_imports_are_guarded_inside_a_function_and_name_their_extra() -> None:
    extras = PYPROJECT["project"]["optional-dependencies"]
    sites = [s for s in package_import_sites() if s.top in OPTIONAL or s.top in WHEN_INSTALLED]
    assert {s.top for s in sites} == set(OPTIONAL) | set(WHEN_INSTALLED), "an entry here the package no longer imports"
    unguarded = [str(s) for s in sites if not (s.in_function and s.guarded)]
    assert unguarded == [], "optional imports must be inside a function and a try that catches ImportError"
    for top, extra in OPTIONAL.items():
        assert extra in extras, f"{top}: no extra {extra!r} in pyproject.toml"
        assert top not in declared_imports(), f"{top} is a runtime dependency, not optional"
        for site in (s for s in sites if s.top == top):
            assert f"fsdp-convert[{extra}]" in site.path.read_text(), f"{site}: no message naming fsdp-convert[{extra}]"
    for extra in set(OPTIONAL.values()):
        installs = {_requirement_name(r) for r in extras[extra]}
        assert any(_normalize(top) in installs for top, e in OPTIONAL.items() if e == extra), (extra, installs)


def _distribution_closure(names: set[str]) -> set[str]:
    """``names`` and every distribution they require, transitively (requirements of extras left out)."""
    seen: set[str] = set()
    todo = list(names)
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        try:
            requirements = importlib.metadata.requires(name) or []
        except importlib.metadata.PackageNotFoundError:
            continue
        todo += [_requirement_name(r) for r in requirements if "extra" not in r.partition(";")[2]]
    return seen


def clean_site(folder: Path) -> set[str]:
    """A site folder of links to what installing ``[project].dependencies`` brings, and to this package.

    Each distribution in the dependencies' closure is linked by its top-level entries (packages,
    modules, its .dist-info), as the installed distributions list them.

    Returns:
        The distributions linked (normalized names).
    """
    closure = _distribution_closure({_requirement_name(r) for r in PYPROJECT["project"]["dependencies"]})
    folder.mkdir()
    for name in closure:
        try:
            dist = importlib.metadata.distribution(name)
        except importlib.metadata.PackageNotFoundError:
            continue  # a requirement for another platform or Python
        for top in sorted({f.parts[0] for f in dist.files or []} - {"..", "__pycache__"}):
            if not (folder / top).exists():
                (folder / top).symlink_to(Path(str(dist.locate_file(top))))
    (folder / "fsdp_convert").symlink_to(PACKAGE)
    return closure


# Run in `python -S` (no site-packages) over clean_site's folder alone: every module of fsdp_convert
# imports, and the main commands run in process, where only the stdlib, the package and what its
# dependencies install can be imported, as in a venv where the wheel was installed without extras.
CLEAN_INSTALL = r"""
import importlib, importlib.util, json, pkgutil, sys
checkpoint, out = sys.argv[1], sys.argv[2]
assert importlib.util.find_spec("numpy") is None, "numpy is importable: not a clean install"
import fsdp_convert
for module in pkgutil.walk_packages(fsdp_convert.__path__, "fsdp_convert."):
    importlib.import_module(module.name)

from fsdp_convert.cli import main
sys.modules["fsdp_convert.cli.app"].exit_process = sys.exit  # main() ends the process otherwise
codes = {}
for args in (
    ["inspect", checkpoint, "--json"],
    ["consolidate", checkpoint, f"{out}/full.pt"],
    ["consolidate", checkpoint, f"{out}/hf"],
    ["reshard", f"{out}/full.pt", f"{out}/ws2", "--world-size", "2", "--nproc", "1"],
    ["verify", checkpoint, f"{out}/ws2"],
    ["verify", checkpoint, f"{out}/hf"],
    # the extras' features, without them: one line naming the extra
    ["reshard", checkpoint, f"{out}/zstd", "--world-size", "2", "--nproc", "1", "--compress", "zstd"],
    ["inspect", "s3://bucket/ckpt"],
):
    sys.argv = ["fsdp-convert", *args]
    try:
        main()
    except SystemExit as e:
        codes[" ".join(args).replace(checkpoint, "CKPT").replace(out, "OUT")] = e.code or 0
print(json.dumps(codes), file=sys.stderr)
"""


@pytest.fixture
def small_checkpoint(tmp_path: Path) -> Path:
    """A no-dist DCP save of a model and its Adam state (nested as FSDP2's get_state_dict returns it)."""
    import torch.distributed.checkpoint as dcp

    gen = torch.Generator().manual_seed(0)
    model = {"layer.weight": torch.randn(6, 4, generator=gen), "layer.bias": torch.randn(6, generator=gen)}
    state = {fqn: {"step": torch.tensor(2.0), "exp_avg": torch.randn(t.shape, generator=gen)} for fqn, t in model.items()}
    optim = {"state": state, "param_groups": [{"lr": 0.01, "betas": (0.9, 0.95), "params": list(model)}]}
    dcp.save({"model": model, "optim": optim}, checkpoint_id=tmp_path / "ckpt", no_dist=True)
    return tmp_path / "ckpt"


def test_the_main_commands_run_with_only_what_the_dependencies_install(small_checkpoint: Path, tmp_path: Path) -> None:
    closure = clean_site(tmp_path / "site")
    assert "torch" in closure and "numpy" not in closure, closure
    assert importlib.util.find_spec("numpy") is not None  # installed here, so the clean run's check means something
    out = tmp_path / "out"
    out.mkdir()
    proc = subprocess.run(
        [sys.executable, "-S", "-c", CLEAN_INSTALL, str(small_checkpoint), str(out)],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": str(tmp_path / "site"), "OMP_NUM_THREADS": "1"},
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    codes = json.loads(proc.stderr.strip().splitlines()[-1])
    assert codes == {
        "inspect CKPT --json": 0,
        "consolidate CKPT OUT/full.pt": 0,
        "consolidate CKPT OUT/hf": 0,
        "reshard OUT/full.pt OUT/ws2 --world-size 2 --nproc 1": 0,
        "verify CKPT OUT/ws2": 0,
        "verify CKPT OUT/hf": 0,
        "reshard CKPT OUT/zstd --world-size 2 --nproc 1 --compress zstd": 2,
        "inspect s3://bucket/ckpt": 2,
    }, proc.stdout + proc.stderr[-4000:]
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 2, proc.stderr[-4000:]
    assert "pip install 'fsdp-convert[zstd]'" in errors[0]
    assert "pip install 'fsdp-convert[s3]'" in errors[1]


def test_no_tensor_goes_through_numpy() -> None:
    """``Tensor.numpy()`` needs NumPy, which is not a dependency: a wheel installed without extras
    fails there ("Numpy is not available"). Bytes of a tensor go through ``writers.buffer.byte_view``."""
    calls = [
        f"{path.relative_to(ROOT)}:{node.lineno}"
        for path in sorted(PACKAGE.rglob("*.py"))
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "numpy"
    ]
    assert not calls, f"Tensor.numpy() in {calls}"
