"""Where the server tokenizes (entrypoints/openai/serving.py, INLINE_TOKENIZE_CHARS): a short text on the event
loop, because the hop to a worker thread cost 3-87 ms of time to first token on a busy 2-core host; a long one in
a worker thread, so it cannot stall every stream. Same token ids either way."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

from tokenmill.entrypoints.openai import serving
from tokenmill.entrypoints.openai.protocol import TokenizeRequest


def test_short_texts_are_tokenized_on_the_loop_and_long_ones_in_a_thread(gguf_tokenizer):
    # the engine is only what OpenAIServing.tokenize reads of it: its tokenizer and context length
    engine = SimpleNamespace(tokenizer=gguf_tokenizer, max_model_len=1_000_000, vocab_size=gguf_tokenizer.vocab_size)
    api = serving.OpenAIServing(engine, ["m"])
    short = "The quick brown fox jumps over the lazy dog. " * 20
    long = short * (serving.INLINE_TOKENIZE_CHARS // len(short) + 1)
    assert len(short) <= serving.INLINE_TOKENIZE_CHARS < len(long)

    got = asyncio.run(api.tokenize(TokenizeRequest(prompt=short, add_special_tokens=False)))
    assert api.num_tokenized_in_thread == 0
    assert got["tokens"] == gguf_tokenizer.encode(short, add_special_tokens=False)

    got = asyncio.run(api.tokenize(TokenizeRequest(prompt=long, add_special_tokens=False)))
    assert api.num_tokenized_in_thread == 1
    assert got["tokens"] == gguf_tokenizer.encode(long, add_special_tokens=False)
