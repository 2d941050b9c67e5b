"""Incremental detokenization: streamed text only grows, never shows a broken character, and ends
equal to decoding the whole output; stop strings and stop tokens are trimmed as SGLang does."""

from __future__ import annotations

import pytest
from transformers import AutoTokenizer

from sglang_vericache.managers.detokenizer import (
    IncrementalDetokenizer,
    held_back_len,
    trim_matched_stop_text,
)

TEXT = "def café(x): return 'naïve 😀 東京' if x else \"ünïcödé\""


@pytest.fixture(scope="module")
def tok(default_model_dir):
    return AutoTokenizer.from_pretrained(default_model_dir)


def test_multibyte_characters_split_over_tokens_are_never_emitted_broken(tok):
    prompt = tok.encode("print(", add_special_tokens=False)
    ids = tok.encode(TEXT, add_special_tokens=False)
    # Byte-level BPE: some characters span several tokens, so some prefixes decode broken.
    assert any("\ufffd" in tok.decode(ids[:k]) for k in range(1, len(ids)))
    detok = IncrementalDetokenizer(tok, prompt, skip_special_tokens=True, spaces_between_special_tokens=True)
    seen = ""
    for t in ids:
        detok.add([t])
        assert detok.text.startswith(seen)
        assert "\ufffd" not in detok.text
        seen = detok.text
    assert detok.finish(None, no_stop_trim=False) == tok.decode(ids) == TEXT


def test_adding_tokens_in_chunks_gives_the_same_text(tok):
    ids = tok.encode(TEXT, add_special_tokens=False)
    detok = IncrementalDetokenizer(tok, tok.encode("x = ", add_special_tokens=False), True, True)
    for i in range(0, len(ids), 3):
        detok.add(ids[i : i + 3])
    assert detok.finish(None, False) == TEXT


def test_special_tokens_follow_skip_special_tokens(tok):
    ids = tok.encode("a b", add_special_tokens=False) + [tok.eos_token_id]
    skip = IncrementalDetokenizer(tok, [], True, True)
    keep = IncrementalDetokenizer(tok, [], False, True)
    skip.add(ids)
    keep.add(ids)
    assert skip.finish(None, False) == "a b"
    assert keep.finish(None, False) == "a b" + tok.eos_token


def test_stop_string_trim_rules():
    reason = {"type": "stop", "matched": "END"}
    assert trim_matched_stop_text("abcENDxyz", reason, no_stop_trim=False) == "abc"
    assert trim_matched_stop_text("abcENDxyz", reason, no_stop_trim=True) == "abcEND"
    assert trim_matched_stop_text("abc", {"type": "length", "length": 3}, False) == "abc"
    # A stop token id is trimmed as an id (ReqState leaves it out of the text), not as text here.
    assert trim_matched_stop_text("abc7", {"type": "stop", "matched": 7}, False) == "abc7"


def test_held_back_len_is_the_longest_stop_prefix_at_the_end():
    assert held_back_len("hello wo", ["world"]) == 2
    assert held_back_len("hello w", ["world", "xyz"]) == 1
    assert held_back_len("hello", ["world"]) == 0
    assert held_back_len("ab\n", ["\n\n", "b\nc"]) == 2
