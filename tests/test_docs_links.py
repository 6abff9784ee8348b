"""Every relative markdown link in README.md, DESIGN.md, docs/*.md and tests/README.md resolves: the file exists
and, for a #fragment, a heading of that file has that GitHub slug. README's front door stays a front door."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LINK = re.compile(r"\]\(([^)\s]+)\)")


def _slug(heading: str) -> str:
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())  # GitHub drops punctuation but - and _
    return text.replace(" ", "-")


def _anchors(path: Path) -> set[str]:
    out, fence = set(), False
    for line in path.read_text().splitlines():
        if line.startswith("```"):
            fence = not fence
        elif not fence and line.startswith("#"):
            out.add(_slug(line.lstrip("#")))
    return out


def test_relative_links_resolve():
    files = [ROOT / "README.md", ROOT / "DESIGN.md", ROOT / "tests" / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    broken = []
    for f in files:
        for target in LINK.findall(f.read_text()):
            if re.match(r"[a-z]+:", target):
                continue
            path, _, fragment = target.partition("#")
            dest = (f.parent / path).resolve() if path else f
            if not dest.exists():
                broken.append(f"{f.relative_to(ROOT)}: {target}: no such file")
            elif fragment and fragment not in _anchors(dest):
                broken.append(f"{f.relative_to(ROOT)}: {target}: no heading #{fragment}")
    assert not broken, "\n".join(broken)


def test_readme_is_a_front_door():
    assert len((ROOT / "README.md").read_text().splitlines()) <= 200
