"""Public-domain texts shipped with the course (see README.md in this folder).

``pride_and_prejudice``: Jane Austen, 1813 (Project Gutenberg #1342), for prompts, perplexity,
calibration and agreement measurements. ``papadiamantis_fonissa_ch1-3``: chapters 1-3 of
Alexandros Papadiamantis' *I Fonissa* (1903, Project Gutenberg #36205), Modern Greek, for
the non-English comparison.
"""
from __future__ import annotations

import re
from pathlib import Path

DATA_DIR = Path(__file__).resolve().parent
TEXTS = {
    "pride_and_prejudice": "pride_and_prejudice.txt",
    "papadiamantis_fonissa_ch1-3": "papadiamantis_fonissa_ch1-3.txt",
}
#: The novel proper starts here (before it: the 1894 edition's title page, preface and list of illustrations).
NOVEL_START = "It is a truth universally acknowledged"
#: The printer's colophon after the novel's last sentence.
NOVEL_END = "CHISWICK PRESS"
#: A caption block of the illustrated edition: ``[Illustration: ... [_Copyright ..._]]`` (one level of nesting).
CAPTION = re.compile(r"\n*\[Illustration(?:[^\[\]]|\[[^\[\]]*\])*\]\n*")


def text_path(name: str) -> Path:
    """Path of a shipped text, by its short name."""
    if name not in TEXTS:
        raise ValueError(f"unknown text {name!r}; expected one of {sorted(TEXTS)}")
    return DATA_DIR / TEXTS[name]


def load_text(name: str, *, body_only: bool = True) -> str:
    """A shipped text as a string.

    For *Pride and Prejudice*, ``body_only`` keeps the novel's own prose: from its first
    sentence to its last, without the edition's front matter, the 155 illustration captions
    inside the novel, or the printer's colophon.
    """
    text = text_path(name).read_text(encoding="utf-8")
    if body_only and name == "pride_and_prejudice":
        start = text.index(NOVEL_START)
        text = text[start:text.index(NOVEL_END, start)].rstrip() + "\n"
        text = CAPTION.sub("\n\n", text)
    return text
