"""The real server through the official `openai` client: completions with echo and logprobs (OpenAI's semantics,
max_tokens 0 as lm-evaluation-harness sends it), vLLM's prompt_logprobs on both endpoints, and /v1/embeddings;
numbers against Hugging Face transformers' dense forward of the same GGUF in float32."""

from __future__ import annotations

import math

import httpx
import openai
import pytest
import torch

from tests.server.conftest import MODEL

pytestmark = pytest.mark.slow

CONTEXT = "Question: What is the capital of France?\nAnswer:"
GOOD = " The capital of France is Paris."
BAD = " Purple giraffes compile the ocean backwards."


@pytest.fixture(scope="module")
def client(fp32_server) -> openai.OpenAI:
    """float32 whatever the host: the tests compare with transformers' float32 numerics within 1e-3."""
    return openai.OpenAI(base_url=f"{fp32_server.url}/v1", api_key=fp32_server.api_key, max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def tokenizer(gguf_tokenizer):
    return gguf_tokenizer


def hf_logprobs(hf, ids: list[int]) -> torch.Tensor:
    """[len(ids), vocab]: row i is log p(next token | ids[: i + 1])."""
    with torch.no_grad():
        return hf(torch.tensor([ids])).logits[0].float().log_softmax(-1)


def loglikelihood(client, context: list[int], continuation: list[int], max_tokens: int) -> tuple[float, bool]:
    """lm-evaluation-harness's local-completions scoring: the echoed prompt's logprobs summed over the
    continuation (with max_tokens 1 the generated token is dropped, as lm-eval slices [ctxlen:-1]), and whether
    each continuation token was the top one."""
    r = client.completions.create(
        model=MODEL, prompt=[context + continuation], max_tokens=max_tokens, echo=True, logprobs=1, temperature=0
    )
    lp = r.choices[0].logprobs
    end = len(lp.token_logprobs) - max_tokens
    tokens = lp.token_logprobs[len(context) : end]
    tops = lp.top_logprobs[len(context) : end]
    return sum(tokens), all(t == max(top.values()) for t, top in zip(tokens, tops))


def test_echo_logprobs_max_tokens_zero_equal_hf(client, hf, tokenizer):
    ids = tokenizer.encode(CONTEXT + GOOD)
    r = client.completions.create(model=MODEL, prompt=[ids], max_tokens=0, echo=True, logprobs=2, temperature=0)
    c = r.choices[0]
    assert c.finish_reason == "length" and r.usage.completion_tokens == 0 and r.usage.prompt_tokens == len(ids)
    assert c.text == tokenizer.decode(ids, skip_special_tokens=False)
    lp = c.logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == len(ids)
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None  # the first token has no context
    assert "".join(lp.tokens) == c.text and lp.text_offset[0] == 0
    assert all(lp.text_offset[i + 1] == lp.text_offset[i] + len(lp.tokens[i]) for i in range(len(ids) - 1))
    ref = hf_logprobs(hf, ids)
    for i in range(1, len(ids)):
        assert lp.token_logprobs[i] == pytest.approx(ref[i - 1, ids[i]].item(), abs=1e-3)
        top = lp.top_logprobs[i]
        assert 2 <= len(top) <= 3 and lp.token_logprobs[i] in top.values()
        assert max(top.values()) == pytest.approx(ref[i - 1].max().item(), abs=1e-3)


def test_loglikelihood_ranks_a_sensible_continuation_first(client, hf, tokenizer):
    """lm-eval style: the sensible answer scores above nonsense, max_tokens 0 and 1 give the same loglikelihood,
    and it equals transformers' within 1e-3."""
    context = tokenizer.encode(CONTEXT)
    scores = {}
    for name, text in (("good", GOOD), ("bad", BAD)):
        cont = tokenizer.encode(text, add_special_tokens=False)
        ll0, _ = loglikelihood(client, context, cont, 0)
        ll1, _ = loglikelihood(client, context, cont, 1)
        assert ll0 == pytest.approx(ll1, abs=1e-4)
        ids = context + cont
        ref = hf_logprobs(hf, ids)
        expected = sum(ref[i - 1, ids[i]].item() for i in range(len(context), len(ids)))
        assert ll0 == pytest.approx(expected, abs=1e-3)
        scores[name] = ll0
    assert scores["good"] > scores["bad"] + 10, scores


def test_echo_logprobs_with_generation_stream_and_not(client, tokenizer):
    prompt = "The three primary colors are"
    r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=3, echo=True, logprobs=2, temperature=0)
    plain = client.completions.create(model=MODEL, prompt=prompt, max_tokens=3, logprobs=2, temperature=0)
    n = len(tokenizer.encode(prompt))
    c, p = r.choices[0], plain.choices[0]
    assert c.text == prompt + p.text
    assert len(c.logprobs.tokens) == n + 3 and c.logprobs.token_logprobs[0] is None
    assert c.logprobs.tokens[n:] == p.logprobs.tokens
    assert c.logprobs.token_logprobs[n:] == pytest.approx(p.logprobs.token_logprobs, abs=1e-5)
    assert c.logprobs.text_offset[n:] == [len(prompt) + x for x in p.logprobs.text_offset]
    chunks = [
        ch.choices[0]
        for ch in client.completions.create(
            model=MODEL, prompt=prompt, max_tokens=3, echo=True, logprobs=2, temperature=0, stream=True
        )
        if ch.choices
    ]
    assert "".join(ch.text for ch in chunks) == c.text
    streamed = [t for ch in chunks if ch.logprobs for t in ch.logprobs.tokens]
    assert streamed == c.logprobs.tokens
    offsets = [t for ch in chunks if ch.logprobs for t in ch.logprobs.text_offset]
    assert offsets == c.logprobs.text_offset


def test_vllm_prompt_logprobs_on_both_endpoints(client, fp32_server, hf, tokenizer):
    r = client.completions.create(
        model=MODEL, prompt=CONTEXT, max_tokens=2, temperature=0, extra_body={"prompt_logprobs": 1}
    )
    ids = tokenizer.encode(CONTEXT)
    plp = r.choices[0].model_extra["prompt_logprobs"]
    assert len(plp) == len(ids) and plp[0] is None
    ref = hf_logprobs(hf, ids)
    for i in range(1, len(ids)):
        entry = plp[i][str(ids[i])]
        assert entry["logprob"] == pytest.approx(ref[i - 1, ids[i]].item(), abs=1e-3)
        assert entry["rank"] >= 1 and isinstance(entry["decoded_token"], str)
    chat = httpx.post(
        f"{fp32_server.url}/v1/chat/completions",
        headers=fp32_server.headers,
        timeout=120,
        json={"model": MODEL, "messages": [{"role": "user", "content": "Hi!"}], "max_tokens": 2, "prompt_logprobs": 0},
    ).json()
    plp = chat["prompt_logprobs"]
    assert len(plp) == chat["usage"]["prompt_tokens"] and plp[0] is None
    assert all(len(e) == 1 and next(iter(e.values()))["logprob"] <= 0 for e in plp[1:])


def hf_embedding(hf, ids: list[int]) -> torch.Tensor:
    """Last-token pooling (the server's default) of the final-normed hidden states, L2-normalised."""
    with torch.no_grad():
        h = hf.model(torch.tensor([ids])).last_hidden_state[0, -1]
    return torch.nn.functional.normalize(h.float(), dim=0)


def test_embeddings_equal_hf_pooled_hidden_states(client, hf, tokenizer):
    texts = ["The cat sat on the mat.", "Embeddings come from the served model.", "Paris"]
    batch = client.embeddings.create(model=MODEL, input=texts)  # the client asks for base64 and decodes it
    floats = client.embeddings.create(model=MODEL, input=texts, encoding_format="float")
    assert [d.index for d in batch.data] == [0, 1, 2]
    lengths = [len(tokenizer.encode(t)) for t in texts]
    assert batch.usage.prompt_tokens == batch.usage.total_tokens == sum(lengths)
    for text, d, f in zip(texts, batch.data, floats.data):
        got = torch.tensor(d.embedding)
        assert got.shape == (576,) and got.norm().item() == pytest.approx(1.0, abs=1e-4)
        # a second request: its prompt may come from the prefix cache (last pooling reads one position), which
        # computes the last token through other shapes
        assert f.embedding == pytest.approx(d.embedding, abs=1e-4)
        ref = hf_embedding(hf, tokenizer.encode(text))
        assert torch.dot(got, ref).item() >= 0.999
        alone = client.embeddings.create(model=MODEL, input=text, encoding_format="float").data[0].embedding
        assert alone == pytest.approx(f.embedding, abs=1e-4)


def test_embeddings_token_ids_and_dimensions(client, tokenizer):
    ids = [tokenizer.encode("The cat sat on the mat."), tokenizer.encode("Paris")]
    by_ids = client.embeddings.create(model=MODEL, input=ids, encoding_format="float")
    by_text = client.embeddings.create(model=MODEL, input=["The cat sat on the mat.", "Paris"], encoding_format="float")
    for a, b in zip(by_ids.data, by_text.data):
        assert a.embedding == pytest.approx(b.embedding, abs=1e-4)
    one = client.embeddings.create(model=MODEL, input=ids[1], encoding_format="float")
    assert one.data[0].embedding == pytest.approx(by_ids.data[1].embedding, abs=1e-4)
    short = client.embeddings.create(model=MODEL, input=ids, encoding_format="float", dimensions=64)
    for s, full in zip(short.data, by_ids.data):
        head = full.embedding[:64]
        norm = math.sqrt(sum(x * x for x in head))
        assert len(s.embedding) == 64 and s.embedding == pytest.approx([x / norm for x in head], abs=1e-4)
    with pytest.raises(openai.BadRequestError) as e:
        client.embeddings.create(model=MODEL, input="hi", dimensions=577)
    err = e.value.body
    assert (err.get("error", err) if isinstance(err, dict) else {})["param"] == "dimensions"
