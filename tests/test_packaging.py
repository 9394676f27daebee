"""Packaging: one distribution `fusedserve` whose subpackages live in the top-level folders operator/,
worker/ and models/; both the editable install and a built wheel import."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path
from typing import Any

import tomllib

REPO_ROOT = Path(__file__).resolve().parents[1]
# Top-level folder -> the package it is imported as.
FOLDERS = {
    "fusedserve": "fusedserve",
    "operator": "fusedserve.operator",
    "worker": "fusedserve.worker",
    "models": "fusedserve.models",
}


def setuptools_table() -> dict[str, Any]:
    table: dict[str, Any] = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    return table


def package_folders() -> dict[str, Path]:
    """Every folder holding an __init__.py under the package roots, as package name -> folder."""
    found = {}
    for top, package in FOLDERS.items():
        for init in sorted((REPO_ROOT / top).rglob("__init__.py")):
            rel = init.parent.relative_to(REPO_ROOT / top)
            found[".".join([package, *rel.parts])] = init.parent
    return found


def test_every_package_folder_is_listed_in_pyproject() -> None:
    table = setuptools_table()
    assert table["package-dir"] == {package: top for top, package in FOLDERS.items()}
    listed = set(table["packages"])
    found = set(package_folders())
    assert found - listed == set(), "add these to [tool.setuptools] packages in pyproject.toml"
    assert listed - found == set(), "listed in pyproject.toml but no such package folder"


def test_every_folder_with_python_files_is_a_package() -> None:
    """A folder of modules without __init__.py would be left out of the wheel silently."""
    for top in FOLDERS:
        for py in (REPO_ROOT / top).rglob("*.py"):
            if "__pycache__" not in py.parts:
                assert (py.parent / "__init__.py").is_file(), f"{py.parent} has modules but no __init__.py"


def test_import_direction() -> None:
    """The operator never imports torch (or ray) at import time; models never import ray or kopf."""
    code = (
        "import sys\n"
        "import fusedserve, fusedserve.operator\n"
        "heavy = {'torch', 'ray', 'kopf'} & set(sys.modules)\n"
        "assert not heavy, heavy\n"
        "import fusedserve.models.llama, fusedserve.models.loader, fusedserve.verify, fusedserve.cli\n"
        "heavy = {'ray', 'kopf'} & set(sys.modules)\n"
        "assert not heavy, heavy\n"
        "import operator; assert hasattr(operator, 'itemgetter'), 'the stdlib operator module is shadowed'\n"
    )
    proc = subprocess.run(
        check=False, args=[sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd="/"
    )
    assert proc.returncode == 0, proc.stderr


def test_wheel_builds_installs_and_imports_outside_the_repo(tmp_path: Path) -> None:
    # Build from a copy of the sources, so the shared checkout gets no build/ or egg-info churn.
    src = tmp_path / "src"
    src.mkdir()
    for name in ("pyproject.toml", "README.md", "LICENSE"):
        if (REPO_ROOT / name).is_file():
            shutil.copy(REPO_ROOT / name, src / name)
    for top in FOLDERS:
        shutil.copytree(
            REPO_ROOT / top, src / top, ignore=shutil.ignore_patterns("__pycache__", "*.egg-info")
        )
    env = {**os.environ, "PIP_DISABLE_PIP_VERSION_CHECK": "1", "PIP_NO_INDEX": "1"}
    pip = [sys.executable, "-m", "pip"]
    dist = tmp_path / "dist"
    proc = subprocess.run(
        check=False,
        args=[*pip, "wheel", "--no-deps", "--no-build-isolation", "-w", str(dist), str(src)],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    (wheel,) = dist.glob("fusedserve-*.whl")

    # Every module of every package folder is in the wheel, under its package name.
    with zipfile.ZipFile(wheel) as z:
        names = set(z.namelist())
        entry_points = next(z.read(n).decode() for n in names if n.endswith(".dist-info/entry_points.txt"))
    for package, folder in package_folders().items():
        for py in folder.glob("*.py"):
            assert "/".join([*package.split("."), py.name]) in names, f"{py} missing from the wheel"
    assert "fusedserve = fusedserve.cli:main" in entry_points

    site = tmp_path / "site"
    proc = subprocess.run(
        check=False,
        args=[*pip, "install", "--no-deps", "--target", str(site), str(wheel)],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    proc = subprocess.run(
        check=False,
        args=[sys.executable, "-c", IMPORT_FROM_WHEEL],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=outside,
        env={**os.environ, "PYTHONPATH": str(site)},
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert Path(proc.stdout.splitlines()[0]) == site / "fusedserve" / "models" / "parallel" / "groups.py"


# Runs outside the repository with only the installed wheel providing `fusedserve`: the pure groups module
# first (no torch), then every module of the distribution, each of which must come from the wheel. A module
# needing an optional third-party package that is not installed here (e.g. flashinfer on CPU) is skipped;
# one importing `models.` / `worker.` instead of `fusedserve.models.` fails.
IMPORT_FROM_WHEEL = """
import importlib, pkgutil, sys
import fusedserve.models.parallel.groups as g
from fusedserve.models.parallel.groups import ParallelConfig, plan_group_ranks
assert plan_group_ranks(ParallelConfig(2))['tp'] == [[0, 1]]
import fusedserve.operator, fusedserve.worker
assert 'torch' not in sys.modules
print(g.__file__)
root = fusedserve.__path__[0]
ours = ('fusedserve', 'models', 'worker')
for info in pkgutil.walk_packages(fusedserve.__path__, 'fusedserve.'):
    try:
        module = importlib.import_module(info.name)
    except ModuleNotFoundError as e:
        if e.name is None or e.name.split('.')[0] in ours:
            raise
        print('skipped', info.name, 'needs', e.name)
        continue
    assert module.__file__.startswith(root), (info.name, module.__file__)
"""
