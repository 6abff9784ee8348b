"""A non-editable install (the GPU check's, a user's wheel) carries every package of the source tree."""

from __future__ import annotations

from pathlib import Path

import tomllib

ROOT = Path(__file__).resolve().parent.parent


def test_every_source_package_is_listed_in_pyproject():
    setuptools = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    listed, dirs = set(setuptools["packages"]), setuptools["package-dir"]
    missing = set()
    for package, folder in dirs.items():
        for init in (ROOT / folder).rglob("__init__.py"):
            parts = init.parent.relative_to(ROOT / folder).parts
            name = ".".join([package, *parts])
            if name not in listed:
                missing.add(name)
    assert not missing, f"packages missing from pyproject.toml [tool.setuptools] packages: {sorted(missing)}"
