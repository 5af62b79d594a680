"""The README stays a front door and the docs say what is true now.

The README is read by someone deciding in five minutes: at most 300 lines. Neither it nor a docs
page holds the record of its own making (a dated entry, a "by hand" account, a test cited by
name as proof): that story lives in git, in CHANGELOG.md and in the raw outputs of
``docs/gpu-runs/``. The pages for contributors (architecture, contributing) may name test files,
which is where a contributor looks for them.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from launch import REPO_ROOT

README_MOST_LINES = 300
FOR_CONTRIBUTORS = {"architecture.md", "contributing.md"}


def user_pages() -> list[Path]:
    docs = REPO_ROOT / "docs"
    return [REPO_ROOT / "README.md"] + [page for page in sorted(docs.rglob("*.md"))
                                        if "gpu-runs" not in page.parts and page.name not in FOR_CONTRIBUTORS]


def test_the_readme_is_at_most_300_lines() -> None:
    assert len((REPO_ROOT / "README.md").read_text().splitlines()) <= README_MOST_LINES


@pytest.mark.parametrize(("pattern", "what"), [
    (r"\b20\d\d-\d\d-\d\d\b", "a dated entry"),
    (r"\bby hand\b", "a by-hand account"),
    (r"\btest_\w+", "a test cited by name"),
    (r"\bseed blog\b", "an article not named"),
])
def test_no_page_holds_the_history_of_its_making(pattern: str, what: str) -> None:
    found = [f"{page.relative_to(REPO_ROOT)}:{number}: {line.strip()[:80]}"
             for page in user_pages() for number, line in enumerate(page.read_text().splitlines(), start=1)
             if re.search(pattern, line, flags=re.IGNORECASE)]
    assert found == [], what


def test_the_pages_checked_include_the_readme_and_the_guides() -> None:
    names = {page.relative_to(REPO_ROOT).as_posix() for page in user_pages()}
    assert {"README.md", "docs/index.md", "docs/guide/own-script.md", "docs/reference/figures.md"} <= names
