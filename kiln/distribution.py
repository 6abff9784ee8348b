"""kiln's name on the package index, and the install hints that name it.

The import name and the command are `kiln`; the distribution is `kiln-llm`, because `kiln` on PyPI is an
unrelated package. Every hint that tells a user to install an extra comes from `install_hint`, so it names
the right distribution and the command that works from a clone too.
"""

from __future__ import annotations

DISTRIBUTION = "kiln-llm"  # pyproject.toml's [project] name (tests/test_packaging.py checks they agree)


def install_hint(extra: str) -> str:
    """The commands that install kiln with `extra` (e.g. "quant"): from the package index, and from a clone."""
    return f"pip install '{DISTRIBUTION}[{extra}]' (from a clone: pip install -e '.[{extra}]')"
