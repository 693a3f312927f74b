"""Every relative link in README.md and docs/ leads to a file that exists, and every
``#anchor`` to a heading of that file (GitHub's slug rules)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = sorted([ROOT / "README.md", *(ROOT / "docs").rglob("*.md")])
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def _anchors(page: Path) -> set[str]:
    text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)
    return {_slug(m) for m in re.findall(r"^#{1,6} (.+)$", text, flags=re.M)}


def _links(page: Path) -> list[str]:
    text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)
    return [t for t in LINK.findall(text) if not re.match(r"[a-z]+:", t)]


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(page: Path) -> None:
    broken = []
    for target in _links(page):
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        if not dest.exists():
            broken.append(f"{target}: no such file")
        elif anchor and dest.suffix == ".md" and anchor not in _anchors(dest):
            broken.append(f"{target}: no heading #{anchor} in {dest.relative_to(ROOT)}")
    assert not broken, f"{page.relative_to(ROOT)}: " + "; ".join(broken)


def test_the_docs_tree_is_linked_from_the_readme_or_another_page() -> None:
    """No page is an orphan: each is reached by a link from README.md or another page."""
    reached = set()
    for page in PAGES:
        for target in _links(page):
            path = target.partition("#")[0]
            if path:
                reached.add((page.parent / path).resolve())
    orphans = [str(p.relative_to(ROOT)) for p in PAGES if p.name != "README.md" and p.resolve() not in reached]
    assert not orphans


def test_every_page_a_message_links_exists_with_its_heading() -> None:
    """A refusal that ends with ``(see docs/PAGE.md#ANCHOR)`` (a disallowed global, a push refused with
    400 or 401, an unsigned build under PACKER_REQUIRE_SIGNATURE) sends the reader to a heading that exists."""
    found = {}
    for source in sorted((ROOT / "packer").rglob("*.py")):
        for target in re.findall(r"docs/[\w./-]+\.md(?:#[\w-]+)?", source.read_text()):
            found[target] = source.relative_to(ROOT)
    assert {"docs/troubleshooting.md#checkpoints", "docs/troubleshooting.md#a-push-refused-with-400-or-401",
            "docs/troubleshooting.md#a-build-refused-under-packer_require_signature"} <= set(found)
    broken = []
    for target, source in sorted(found.items()):
        path, _, anchor = target.partition("#")
        if not (ROOT / path).is_file() or (anchor and anchor not in _anchors(ROOT / path)):
            broken.append(f"{source}: {target}")
    assert not broken
