"""Every pointer to the docs written in code resolves (issue 36).

Code, comments and runtime messages point readers at documentation as ``README "Section"``,
``docs/x.md, "Section"`` or ``docs/x.md#anchor``. A pointer whose file or section no longer
exists sends a user who hit an error nowhere, so each one must name an existing file and, when
it names a section, a heading of that file (or the start of one: "Plain DCP" names
"Plain DCP: `distckpt.dcp`").
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SOURCES = ("distckpt", "launch", "benchmarks")
POINTER = re.compile(
    r"(?P<file>README(?:\.md)?|docs/[\w-]+\.md)"
    r"(?:#(?P<anchor>[\w-]+))?"
    r"(?:,?\s*\\?[\"'](?P<section>[A-Z][^\"'\\\n]{1,60})\\?[\"'])?"
)


def headings(path: Path) -> set[str]:
    """The headings of a markdown file, lower case, without backticks (fenced code skipped)."""
    out, in_fence = set(), False
    for line in path.read_text(encoding="utf-8").splitlines():
        if line.lstrip().startswith(("```", "~~~")):
            in_fence = not in_fence
            continue
        m = re.match(r"^#{1,6}\s+(.*?)\s*#*\s*$", line)
        if m and not in_fence:
            out.add(m.group(1).replace("`", "").strip().lower())
    return out


def slug(heading: str) -> str:
    """GitHub's anchor of a heading (lower case, punctuation dropped, spaces -> '-')."""
    return re.sub(r"[^\w\- ]", "", heading).replace(" ", "-")


def pointers() -> list[tuple[str, int, str, str | None, str | None]]:
    found = []
    for top in SOURCES:
        for src in sorted((REPO / top).rglob("*.py")):
            for lineno, line in enumerate(src.read_text(encoding="utf-8").splitlines(), 1):
                for m in POINTER.finditer(line):
                    rel = f"{src.relative_to(REPO)}:{lineno}"
                    found.append((rel, lineno, m["file"], m["anchor"], m["section"]))
    return found


def problem(file: str, anchor: str | None, section: str | None) -> str | None:
    path = REPO / ("README.md" if file.startswith("README") else file)
    if not path.exists():
        return f"{file} does not exist"
    heads = headings(path)
    wanted = (section or "").replace("`", "").strip().lower()
    if section and not any(h.startswith(wanted) for h in heads):
        return f'{file} has no heading "{section}"'
    if anchor and anchor not in {slug(h) for h in heads}:
        return f"{file} has no heading with anchor #{anchor}"
    return None


def test_every_doc_pointer_resolves():
    bad = [f"{where}: {msg}" for where, _, f, a, s in pointers() if (msg := problem(f, a, s))]
    assert not bad, "doc pointers that resolve nowhere:\n" + "\n".join(bad)


def test_pointers_are_found():
    found = pointers()
    # the check above must see every form, or it passes by seeing nothing
    assert any(s for *_, s in found) and any(a for *_, a, _ in found)
    assert len(found) > 30


@pytest.mark.parametrize(
    "file, anchor, section",
    [
        ("docs/nope.md", None, None),
        ("README", None, "No Such Section"),
        ("docs/memory.md", "no-such-anchor", None),
    ],
)
def test_broken_pointers_are_caught(file, anchor, section):
    assert problem(file, anchor, section)
