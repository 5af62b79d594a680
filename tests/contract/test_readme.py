"""The README's links to its own sections: a heading retitled (a session count in it, say) must
take its links along, or the contents line points nowhere (it did, from 2026-11-26 until the next
session read it)."""

from __future__ import annotations

import re

from launch import REPO_ROOT

README = REPO_ROOT / "README.md"


def github_anchor(heading: str) -> str:
    """The fragment GitHub gives a heading: lower case, punctuation but ``-`` and ``_`` dropped,
    each space a ``-``."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def test_github_anchor_drops_punctuation_and_joins_words_with_hyphens() -> None:
    assert github_anchor("Your own script: `attach`, the Trainer callback, Accelerate") == \
        "your-own-script-attach-the-trainer-callback-accelerate"
    assert github_anchor("Seen on a real GPU (one lent H100, 2026-11-22/23)") == "seen-on-a-real-gpu-one-lent-h100-2026-11-2223"


def test_every_link_to_a_section_of_the_readme_names_a_heading_it_has() -> None:
    text = README.read_text()
    headings = {github_anchor(match) for match in re.findall(r"^#+ (.+)$", text, flags=re.MULTILINE)}
    links = re.findall(r"\]\(#([^)]+)\)", text)
    assert links  # the contents line, at least
    assert [link for link in links if link not in headings] == []
