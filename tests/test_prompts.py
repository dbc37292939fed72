"""Prompts and texts: chat ids, the book's prose, and the one calibration / held-out split."""
from __future__ import annotations

import pytest

from course_utils.data import load_text
from course_utils.prompts import (book_prompts, book_split, book_token_ids, chat_prompt_ids, load_eval_text,
                                  split_text, token_ids)


def test_the_novel_is_its_own_prose_only():
    text = load_text("pride_and_prejudice")
    assert text.startswith("It is a truth universally acknowledged")
    assert "[Illustration" not in text and "Copyright 1894" not in text and "CHISWICK" not in text
    assert text.rstrip().endswith("uniting them.")
    raw = load_text("pride_and_prejudice", body_only=False)
    assert "Saintsbury" in raw and "[Illustration" in raw


def test_split_cuts_at_a_paragraph_start_and_loses_nothing():
    text = "one two.\n\nthree four five.\n\nsix seven eight nine.\n\nten."
    s = split_text(text, heldout_from=0.4)
    assert s.train + s.heldout == text
    assert s.heldout.startswith("six") and s.train.endswith("\n\n")
    assert split_text("abcdef", heldout_from=0.5) == split_text("abcdef", heldout_from=0.5)
    assert split_text("abcdef", heldout_from=0.5).heldout == "def"       # no line breaks: the exact character


def test_book_split_is_fixed_and_disjoint():
    a, b = book_split(), book_split()
    assert a == b
    novel = load_text("pride_and_prejudice")
    assert a.train + a.heldout == novel
    assert 0.45 < len(a.train) / len(novel) < 0.55
    assert a.heldout[:2000] not in a.train


def test_eval_text_by_name_or_path(tmp_path):
    assert load_eval_text("papadiamantis_fonissa_ch1-3").startswith("Η ΦΟΝΙΣΣΑ")
    f = tmp_path / "book.txt"
    f.write_text("Ένα βιβλίο.\n", encoding="utf-8")
    assert load_eval_text(str(f)) == "Ένα βιβλίο.\n"
    with pytest.raises(ValueError, match="no file"):
        load_eval_text(str(tmp_path / "missing.txt"))
    (tmp_path / "latin1.txt").write_bytes("caf\xe9".encode("latin-1"))
    with pytest.raises(ValueError, match="UTF-8"):
        load_eval_text(str(tmp_path / "latin1.txt"))


def test_bad_split_input():
    with pytest.raises(ValueError, match="heldout_from"):
        split_text("some text", heldout_from=1.5)
    with pytest.raises(ValueError, match="too short"):
        split_text("a")


def test_token_helpers(embedded):
    _, tok = embedded
    ids = book_token_ids(tok, 300)
    assert ids.shape == (1, 300) and tok.decode(ids[0, :5]).startswith("It is a truth")
    prompts = book_prompts(tok, 3, 7)
    assert [len(p) for p in prompts] == [7, 7, 7] and sum(prompts, []) == ids[0, :21].tolist()
    assert token_ids(tok, "hello world").shape[0] == 1
    with pytest.raises(ValueError, match="n_tokens"):
        book_token_ids(tok, 0)
    with pytest.raises(ValueError, match="only"):
        token_ids(tok, "short", 100)


def test_chat_prompt_ids_use_the_template(embedded):
    _, tok = embedded
    ids = chat_prompt_ids(tok, "What is the capital of France?")
    text = tok.decode(ids)
    assert "What is the capital of France?" in text and text.rstrip().endswith("assistant")
    with_system = chat_prompt_ids(tok, "Hi", system="Be brief.")
    assert "Be brief." in tok.decode(with_system)
