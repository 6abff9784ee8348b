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


def test_the_distribution_has_a_name_of_its_own_and_every_install_hint_uses_it():
    """`kiln` on PyPI is an unrelated package: the distribution is kiln-llm (import name and command stay kiln),
    and no install hint in the code or the docs names `kiln[...]`."""
    import re

    from kiln.distribution import DISTRIBUTION, install_hint

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert project["name"] == DISTRIBUTION == "kiln-llm"
    assert project["scripts"] == {"kiln": "kiln.cli:main"}
    assert install_hint("quant") == "pip install 'kiln-llm[quant]' (from a clone: pip install -e '.[quant]')"
    files = [*(ROOT / "kiln").rglob("*.py"), *(ROOT / "docs").glob("*.md"), *(ROOT / "scripts").iterdir(),
             ROOT / "README.md"]
    wrong = [f"{path.relative_to(ROOT)}:{n}" for path in files if path.suffix in (".py", ".md", ".sh")
             for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1)
             if re.search(r"(?<![\w.-])kiln\[", line)]
    assert not wrong, f"install hints naming the unrelated `kiln` distribution: {wrong}"
