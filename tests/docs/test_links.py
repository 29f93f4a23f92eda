"""Every relative link of the project's Markdown documents reaches a file of the repository, and every
``#anchor`` a heading (or an explicit ``<a id>``) of its target: docs link to rendered sections and to
each other by anchor, and a renamed heading must not leave a dead link behind."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
DOCUMENTS = sorted(
    [REPO / "README.md", *REPO.glob("docs/**/*.md"), *REPO.glob("benchmarks/**/*.md"), *REPO.glob("examples/**/*.md")]
)
LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)")  # [text](target); images too, through the same pattern below
IMAGE = re.compile(r"!\[[^\]]*\]\(([^)\s]+)\)")
FENCE = re.compile(r"^(```|~~~).*?^\1", re.MULTILINE | re.DOTALL)


def anchor(heading: str) -> str:
    """GitHub's anchor of a Markdown heading: lower case, punctuation but ``-`` and ``_`` dropped, spaces to ``-``."""
    text = re.sub(r"`|\*\*|\*", "", heading.lstrip("#").strip()).lower()
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", text)  # a link in a heading keeps its text
    return "".join(c for c in text if c.isalnum() or c in "-_ ").replace(" ", "-")


def anchors(document: Path) -> set[str]:
    text = FENCE.sub("", document.read_text())
    found: set[str] = set()
    seen: dict[str, int] = {}
    for line in text.splitlines():
        if re.match(r"#{1,6} ", line):
            base = anchor(line)
            n = seen.get(base, 0)
            seen[base] = n + 1
            found.add(base if n == 0 else f"{base}-{n}")  # GitHub numbers repeated headings
    found |= set(re.findall(r"<a (?:id|name)=\"([^\"]+)\"", text))
    return found


def links(document: Path) -> list[str]:
    text = FENCE.sub("", document.read_text())
    text = re.sub(r"`[^`\n]*`", "", text)  # code spans are not links
    return [t for t in LINK.findall(text) + IMAGE.findall(text) if not re.match(r"[a-z][a-z0-9+.-]*:", t)]


def test_the_documents_are_found() -> None:
    names = {p.relative_to(REPO).as_posix() for p in DOCUMENTS}
    assert {"README.md", "docs/architecture.md", "benchmarks/README.md"} <= names


def dead_links(document: Path, root: Path = REPO) -> list[str]:
    """The relative links of ``document`` whose file, or heading in a Markdown file, does not exist."""
    dead = []
    for target in links(document):
        path, _, fragment = target.partition("#")
        resolved = (document.parent / path).resolve() if path else document
        shown = resolved.relative_to(root) if resolved.is_relative_to(root) else resolved
        if not resolved.exists():
            dead.append(f"{target}: no {shown}")
        elif fragment and resolved.suffix == ".md" and fragment not in anchors(resolved):
            dead.append(f"{target}: no heading #{fragment} in {shown}")
    return dead


@pytest.mark.parametrize("document", DOCUMENTS, ids=lambda p: p.relative_to(REPO).as_posix())
def test_relative_links_reach_a_file_and_a_heading(document: Path) -> None:
    dead = dead_links(document)
    assert not dead, f"{document.relative_to(REPO)}: dead links:\n" + "\n".join(dead)


def test_a_dead_file_or_heading_is_found(tmp_path: Path) -> None:
    (tmp_path / "b.md").write_text("# B\n\n## Two words\n\n```\n## not a heading\n```\n")
    (tmp_path / "a.md").write_text(
        "[ok](b.md#two-words) [self](#a) [gone](c.md) [moved](b.md#three-words) [fenced](b.md#not-a-heading) "
        "[web](https://example.com/x#y) `[code](nowhere.md)`\n\n# A\n"
    )
    assert dead_links(tmp_path / "a.md", tmp_path) == [
        "c.md: no c.md",
        "b.md#three-words: no heading #three-words in b.md",
        "b.md#not-a-heading: no heading #not-a-heading in b.md",
    ]


@pytest.mark.parametrize(
    ("heading", "expected"),
    [
        ("## Latest figures", "latest-figures"),
        ("### Rendezvous settings (`--rdzv-conf`)", "rendezvous-settings---rdzv-conf"),
        ("## What counts as a peer's failure?", "what-counts-as-a-peers-failure"),
        ("### latest failures_fsdp", "latest-failures_fsdp"),
    ],
)
def test_anchor_follows_github(heading: str, expected: str) -> None:
    assert anchor(heading) == expected
