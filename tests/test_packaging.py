"""A non-editable install (the GPU check's, a user's wheel) carries every package of the source tree: the package
lives physically under kiln/, found by setuptools without a remapping table."""

from __future__ import annotations

from pathlib import Path

import tomllib
from setuptools import find_packages

ROOT = Path(__file__).resolve().parent.parent


def test_the_package_has_one_home():
    setuptools = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    assert "package-dir" not in setuptools and "packages" in setuptools
    assert setuptools["packages"]["find"]["include"] == ["kiln*"]


def test_every_source_folder_is_a_package_setuptools_finds():
    found = set(find_packages(str(ROOT), include=["kiln*"]))
    folders = {".".join(p.parent.relative_to(ROOT).parts) for p in (ROOT / "kiln").rglob("*.py")
               if "__pycache__" not in p.parts}
    assert folders <= found, f"folders with Python files but no __init__.py: {sorted(folders - found)}"
