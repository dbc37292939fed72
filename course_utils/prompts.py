"""Prompts and texts every chapter shares (chapter 01 onwards).

* :func:`chat_prompt_ids` -- one user turn in the model's chat template, ready for the answer;
* :func:`book_token_ids` / :func:`book_prompts` -- real prose (*Pride and Prejudice*) as
  prompts of exact lengths, so every prompt length is an ordinary prompt;
* :func:`load_eval_text` -- a shipped text by name, or any UTF-8 file by path;
* :func:`split_text` / :func:`book_split` -- **the** split of a text into a calibration /
  training part and a held-out part. Every chapter from 05 on calibrates (AWQ, SmoothQuant),
  trains (a draft head, a distilled student) and measures (perplexity, KL divergence) with
  this one split, so nothing is ever evaluated on the text it was fitted to.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from .data import TEXTS, load_text
from .validation import check_positive_int

BOOK = "pride_and_prejudice"
#: Where the held-out part starts, as a fraction of the text's characters (moved to a paragraph start).
HELDOUT_FROM = 0.5


def chat_prompt_ids(tok, question: str, system: str | None = None) -> list[int]:
    """Token ids of ``question`` as one user turn in the model's chat template (after ``system``, if given),
    ready for the assistant's answer. A tokenizer without a chat template gets the plain text."""
    if not getattr(tok, "chat_template", None):
        return [int(t) for t in tok((system + "\n\n" if system else "") + question).input_ids]
    messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": question}]
    out = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    ids = out["input_ids"] if hasattr(out, "keys") else out
    return [int(t) for t in ids]


def load_eval_text(source: str = BOOK) -> str:
    """A shipped text by its short name (see :data:`course_utils.data.TEXTS`) or any UTF-8 text file by path."""
    if source in TEXTS:
        return load_text(source)
    path = Path(source).expanduser()
    if not path.is_file():
        raise ValueError(f"TEXT must be one of the shipped texts {sorted(TEXTS)} or a path to a UTF-8 text file; "
                         f"no file at {path}")
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise ValueError(f"{path} is not UTF-8 text ({exc})") from None


def token_ids(tok, text: str, n_tokens: int | None = None, *, device="cpu") -> torch.Tensor:
    """The first ``n_tokens`` tokens of ``text`` (all of them when None), as a (1, n) tensor.

    No special tokens are added: the ids are the text's own.
    """
    if n_tokens is not None:
        check_positive_int("n_tokens", n_tokens)
        piece = text[: 8 * n_tokens + 1000]                   # tokenize only what is needed (most tokens are shorter)
        ids = tok(piece, add_special_tokens=False, return_tensors="pt").input_ids
        if ids.shape[1] < n_tokens:
            ids = tok(text, add_special_tokens=False, return_tensors="pt").input_ids
        if ids.shape[1] < n_tokens:
            raise ValueError(f"the text has only {ids.shape[1]:,} tokens; asked for {n_tokens:,}")
        ids = ids[:, :n_tokens]
    else:
        ids = tok(text, add_special_tokens=False, return_tensors="pt").input_ids
    return ids.to(device)


def book_token_ids(tok, n_tokens: int, *, device="cpu", text: str = BOOK) -> torch.Tensor:
    """The first ``n_tokens`` tokens of a shipped text (default: the novel's opening), (1, n_tokens)."""
    return token_ids(tok, load_text(text), n_tokens, device=device)


def book_prompts(tok, n: int, length: int) -> list[list[int]]:
    """``n`` different prompts of exactly ``length`` tokens: consecutive pieces of *Pride and Prejudice*."""
    check_positive_int("n", n)
    check_positive_int("length", length)
    ids = book_token_ids(tok, n * length)[0].tolist()
    return [ids[i * length:(i + 1) * length] for i in range(n)]


@dataclass(frozen=True)
class TextSplit:
    """A text cut in two at a paragraph start: ``train`` (calibration / training) and ``heldout`` (measurement)."""

    train: str
    heldout: str


def split_text(text: str, *, heldout_from: float = HELDOUT_FROM) -> TextSplit:
    """Cut ``text`` at the first paragraph start (a blank line) at or after ``heldout_from`` of its characters.

    Falls back to the first line start, then to the exact character, for text without paragraphs.
    """
    if not 0 < heldout_from < 1:
        raise ValueError(f"heldout_from must be a fraction strictly between 0 and 1, got {heldout_from!r}")
    if len(text) < 2:
        raise ValueError("the text is too short to split")
    at = int(len(text) * heldout_from)
    for sep in ("\n\n", "\n"):
        i = text.find(sep, at)
        if i != -1 and i + len(sep) < len(text):
            cut = i + len(sep)
            break
    else:
        cut = at
    return TextSplit(text[:cut], text[cut:])


def book_split(source: str = BOOK) -> TextSplit:
    """The course's one split of the evaluation text (default: the novel): first half to calibrate and train,
    second half held out to measure."""
    return split_text(load_eval_text(source))
