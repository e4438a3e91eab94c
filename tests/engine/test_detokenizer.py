"""Incremental detokenization: multi-byte characters split across tokens, stop strings that
span tokens, hold-back of a partial stop string."""

from __future__ import annotations

from tokenmill.engine.detokenizer import IncrementalDetokenizer


def feed_one_by_one(tok, ids, stop=(), include=False):
    d = IncrementalDetokenizer(tok, [], list(stop), include_stop_str_in_output=include)
    seen = []
    for t in ids:
        hit = d.update([t])
        seen.append(d.visible_text(False))
        if hit:
            return d, hit, seen
    return d, None, seen


def test_multibyte_characters(gguf_tokenizer):
    text = "naïve café 你好世界 🎉🚀 done"
    ids = gguf_tokenizer.encode(text)
    assert len(ids) > len(text.split())  # some characters span several byte-level tokens
    d, _, seen = feed_one_by_one(gguf_tokenizer, ids)
    assert d.text == text
    assert all("\ufffd" not in s for s in seen), "a partial character was emitted"
    assert all(b.startswith(a) for a, b in zip(seen, seen[1:])), "text must only grow"


def test_stop_string_spanning_tokens(gguf_tokenizer):
    text = "Hello there, General Kenobi! You are a bold one."
    ids = gguf_tokenizer.encode(text)
    d, hit, seen = feed_one_by_one(gguf_tokenizer, ids, stop=["General Kenobi"])
    assert hit == "General Kenobi"
    assert d.text == "Hello there, "
    # never streamed a prefix of the stop string beyond what survives
    assert all(s == d.text[: len(s)] for s in seen)
    d, hit, _ = feed_one_by_one(gguf_tokenizer, ids, stop=["General Kenobi"], include=True)
    assert d.text == "Hello there, General Kenobi"


def test_earliest_stop_wins(gguf_tokenizer):
    ids = gguf_tokenizer.encode("one two three four")
    d = IncrementalDetokenizer(gguf_tokenizer, [], ["four", "two"])
    assert d.update(ids) == "two"
    assert d.text == "one "
