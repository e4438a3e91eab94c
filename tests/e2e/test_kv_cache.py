"""Whole-engine KV-cache equivalences on a tiny random Llama: prefix caching on/off (shared system
prompt, partial eviction, preemption), n > 1 sharing by copy-on-write, int8 KV, beam search."""

from __future__ import annotations

import itertools
import random

import pytest
import torch

from tokenmill import SamplingParams
from tokenmill.engine.beam_search import BeamSearchParams, beam_score
from tokenmill.engine.llm import LLM

GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
BS = 4


def make_llm(path, num_blocks: int = 256, **kw) -> LLM:
    kw.setdefault("dtype", "float32")  # the dense references and byte counts below are float32
    kw.setdefault("max_num_seqs", 16)
    kw.setdefault("max_num_batched_tokens", 256)
    return LLM(str(path), block_size=BS, num_gpu_blocks_override=num_blocks, max_model_len=256, **kw)


def ids(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(100, 40000) for _ in range(n)]


SYSTEM = ids(0, 41)  # 10 full blocks + 1 token
PROMPTS = [SYSTEM + ids(10 + i, 3 + 2 * i) for i in range(6)]


def greedy(llm: LLM, prompts, params=GREEDY) -> list[list[int]]:
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    llm.check_integrity()
    return [o.outputs[0].token_ids for o in outs]


@pytest.fixture(scope="module")
def reference(tiny_llama) -> list[list[int]]:
    return greedy(make_llm(tiny_llama, enable_prefix_caching=False), PROMPTS)


def test_prefix_caching_on_equals_off_with_shared_system_prompt(tiny_llama, reference):
    llm = make_llm(tiny_llama)
    first = greedy(llm, PROMPTS[:2])
    hits_before = llm.stats().prefix_cache_hits
    rest = greedy(llm, PROMPTS[2:])
    assert first + rest == reference
    # every later request found the 10 full system-prompt blocks cached
    assert llm.stats().prefix_cache_hits - hits_before >= 4 * 40
    assert llm.engine.stats().num_blocks_cached_free > 0


def test_prefix_caching_after_partial_eviction(tiny_llama, reference):
    llm = make_llm(tiny_llama, num_blocks=32)  # 128 slots
    assert greedy(llm, PROMPTS[:1]) == reference[:1]
    # an unrelated request takes most of the pool: the system prompt's tail blocks go first
    greedy(llm, [ids(99, 96)], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))  # 26 blocks
    probe = llm.engine.scheduler.kv
    from tokenmill.request import Request

    n_hit = len(probe.get_computed_blocks(Request("probe", PROMPTS[1], GREEDY, None, 1)).blocks)
    assert n_hit == 6  # system blocks 6..9 were evicted
    hits_before = llm.stats().prefix_cache_hits
    assert greedy(llm, PROMPTS[1:]) == reference[1:]
    assert llm.stats().prefix_cache_hits > hits_before


@pytest.mark.parametrize("caching", [True, False])
def test_greedy_equal_with_preemption(tiny_llama, reference, caching):
    llm = make_llm(tiny_llama, num_blocks=30, enable_prefix_caching=caching)  # 6 prompts of ~60 tokens
    assert greedy(llm, PROMPTS) == reference
    assert llm.stats().num_preemptions > 0


def run_counting(llm: LLM, prompts, params) -> tuple[list, int, int]:
    """Generate; return the outputs, the peak number of used blocks (right after scheduling, before
    finished requests free theirs) and the number of tokens computed."""
    eng = llm.engine
    sched = eng.scheduler
    peak = computed = 0
    schedule = sched.schedule

    def counting_schedule():
        nonlocal peak, computed
        out = schedule()
        peak = max(peak, sched.kv.pool.num_blocks - sched.kv.pool.num_free_blocks)
        computed += out.num_tokens
        return out

    sched.schedule = counting_schedule
    for i, (p, sp) in enumerate(zip(prompts, params)):
        eng.add_request(f"r{i}", p, sp)
    outs = {}
    while eng.has_unfinished_requests():
        for o in eng.step():
            if o.finished:
                outs[o.request_id] = o
    sched.schedule = schedule
    llm.check_integrity()
    return [outs[f"r{i}"] for i in range(len(prompts))], peak, computed


def test_n4_shares_prompt_blocks_and_equals_separate_seeded_requests(tiny_llama):
    prompt = ids(5, 30)  # 7 full blocks + 2 tokens; 38 tokens with outputs
    n4 = SamplingParams(n=4, temperature=1.0, seed=123, max_tokens=8, ignore_eos=True)
    sep = [SamplingParams(temperature=1.0, seed=123 + i, max_tokens=8, ignore_eos=True) for i in range(4)]
    # prefix caching off: whatever is shared is shared by the fork, not by the cache
    llm = make_llm(tiny_llama, enable_prefix_caching=False)
    (out,), peak_n4, computed_n4 = run_counting(llm, [prompt], [n4])
    outs, peak_sep, computed_sep = run_counting(make_llm(tiny_llama, enable_prefix_caching=False), [prompt] * 4, sep)
    assert [c.token_ids for c in out.outputs] == [o.outputs[0].token_ids for o in outs]
    # 4 x 10 blocks apart; forked: 7 shared full prompt blocks + 3 own blocks each (copy of the
    # partial prompt block + 2 for outputs)
    assert (peak_sep, peak_n4) == (40, 7 + 4 * 3)
    # the prompt is computed once: 30 + 4 x 7 decodes, against 4 x (30 + 7)
    assert (computed_sep, computed_n4) == (4 * 37, 30 + 4 * 7)


def test_n4_greedy_samples_equal_single_request(tiny_llama):
    llm = make_llm(tiny_llama)
    single = greedy(llm, [PROMPTS[0]])[0]
    out = llm.generate(
        [{"prompt_token_ids": PROMPTS[0]}],
        SamplingParams(n=4, temperature=0, max_tokens=12, ignore_eos=True),
        use_tqdm=False,
    )[0]
    assert [c.token_ids for c in out.outputs] == [single] * 4
    llm.check_integrity()


def test_cache_salt_isolates_prefix_cache(tiny_llama):
    llm = make_llm(tiny_llama)
    greedy(llm, [PROMPTS[0]])
    before = llm.stats().prefix_cache_hits
    llm.generate([{"prompt_token_ids": PROMPTS[1], "cache_salt": "tenant-b"}], GREEDY, use_tqdm=False)
    assert llm.stats().prefix_cache_hits == before
    out = llm.generate([{"prompt_token_ids": PROMPTS[2], "cache_salt": "tenant-b"}], GREEDY, use_tqdm=False)[0]
    assert out.num_cached_tokens == 40
    llm.check_integrity()


@pytest.mark.parametrize("salt", ["", "\ud800"])
def test_bad_cache_salt_is_rejected_before_it_reaches_the_engine(tiny_llama, salt):
    """A lone surrogate used to fail inside the step loop's block hashing and stop the engine."""
    llm = make_llm(tiny_llama)
    with pytest.raises(ValueError, match="cache_salt"):
        llm.engine.add_request("bad", PROMPTS[0], GREEDY, cache_salt=salt)
    assert greedy(llm, [PROMPTS[0]])  # the engine still serves
    llm.check_integrity()


def test_memory_accounting(tiny_llama):
    llm = make_llm(tiny_llama, num_blocks=64)
    st = llm.stats()
    cfg = llm.engine.arch
    assert st.kv_bytes_per_token == 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * cfg.head_dim * 4
    assert (st.num_blocks_total, st.kv_pool_tokens, st.num_blocks_free, st.num_blocks_used) == (64, 256, 64, 0)
    eng = llm.engine
    eng.add_request("a", PROMPTS[0], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    eng.step()  # prefill of 44 tokens: 11 blocks, 44 filled slots
    st = llm.stats()
    assert (st.num_blocks_used, st.num_allocated_slots, st.num_filled_slots, st.num_unfilled_slots) == (11, 44, 44, 0)
    eng.step()  # decode: position 44 opens block 12
    st = llm.stats()
    assert (st.num_blocks_used, st.num_allocated_slots, st.num_filled_slots, st.num_unfilled_slots) == (12, 48, 45, 3)
    while eng.has_unfinished_requests():
        eng.step()
    st = llm.stats()
    # 44 prompt + 3 computed output tokens: 11 full blocks and a tail of 3 stay cached
    assert st.num_blocks_used == 0 and st.num_blocks_cached_free == 12 and st.num_blocks_free == 64
    int8 = make_llm(tiny_llama, num_blocks=64, kv_cache_dtype="int8").stats()
    assert int8.kv_bytes_per_token == 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * (cfg.head_dim + 2)
    assert int8.kv_cache_dtype == "int8"


# -------------------------------------------------------------------------------- int8 KV cache


def test_int8_kv_with_prefix_caching_forks_and_preemption(tiny_llama, reference):
    big = make_llm(tiny_llama, kv_cache_dtype="int8")
    int8_ref = greedy(big, PROMPTS)
    agree = sum(a == b for x, y in zip(int8_ref, reference) for a, b in zip(x, y)) / sum(map(len, reference))
    assert agree >= 0.5, agree
    small = make_llm(tiny_llama, num_blocks=30, kv_cache_dtype="int8")
    outs = greedy(small, PROMPTS)
    assert small.stats().num_preemptions > 0 and small.stats().prefix_cache_hits > 0
    assert outs[0][:4] == int8_ref[0][:4]
    out = small.generate(
        [{"prompt_token_ids": PROMPTS[0]}],
        SamplingParams(n=4, temperature=0, max_tokens=12, ignore_eos=True),
        use_tqdm=False,
    )[0]
    assert len({tuple(c.token_ids) for c in out.outputs}) == 1
    small.check_integrity()


# ---------------------------------------------------------------------------------- beam search


@pytest.fixture(scope="module")
def tiny_vocab8(tmp_path_factory, gguf_tokenizer):
    from tests.conftest import write_tiny_checkpoint

    return write_tiny_checkpoint(tmp_path_factory.mktemp("tiny_v8"), "llama", gguf_tokenizer, seed=3, vocab_size=8)


def seq_logprobs(model, prompt: list[int], seqs: list[list[int]]) -> list[float]:
    """Dense (no paged cache) log p(seq | prompt) for equal-length seqs, in one batched forward."""
    x = torch.tensor([prompt + list(t) for t in seqs])  # [B, T]
    with torch.inference_mode():
        hidden = model(x, torch.arange(x.shape[1])[None].expand_as(x))  # [B, T, hidden]
        lp = model.compute_logits(hidden.flatten(0, 1)).view(*x.shape, -1).log_softmax(-1)
    n = len(seqs[0])
    pos = torch.arange(len(prompt) - 1, len(prompt) - 1 + n)
    return lp[:, pos].gather(2, x[:, len(prompt) :, None])[..., 0].sum(-1).tolist()


def test_beam_search_exhaustive_equals_brute_force(tiny_vocab8):
    llm = make_llm(tiny_vocab8, max_num_seqs=64)
    prompt = [3, 1, 4, 1, 5, 6]  # 6 tokens: beams fork inside block 1
    params = BeamSearchParams(beam_width=64, max_tokens=3, ignore_eos=True)
    (out,) = llm.beam_search([prompt], params)
    llm.check_integrity()
    seqs = [list(t) for t in itertools.product(range(8), repeat=3)]
    brute = sorted(zip(seq_logprobs(llm.engine.model, prompt, seqs), seqs), key=lambda x: -x[0])
    # width 64 = 8^2 keeps every 2-token prefix alive, so the search is exhaustive
    assert len(out.sequences) == 64
    assert [s.score for s in out.sequences] == pytest.approx([lp / 3 for lp, _ in brute[:64]], abs=1e-4)
    assert out.sequences[0].tokens == brute[0][1]
    dense = seq_logprobs(llm.engine.model, prompt, [s.tokens for s in out.sequences])
    assert [s.cum_logprob for s in out.sequences] == pytest.approx(dense, abs=1e-4)


def reference_beam_search(model, prompt, params: BeamSearchParams, eos: int) -> list[tuple[list[int], float]]:
    """Same algorithm, every sequence recomputed from scratch with dense attention."""
    W = params.beam_width
    beams: list[tuple[list[int], float]] = [([], 0.0)]
    done: list[tuple[list[int], float]] = []
    for step in range(params.max_tokens):
        cands = []
        for bi, (toks, cum) in enumerate(beams):
            x = torch.tensor([prompt + toks])
            with torch.inference_mode():
                lp = model.compute_logits(model(x, torch.arange(x.shape[1])[None])[0, -1:])[0].log_softmax(-1)
            top = lp.topk(min(2 * W, lp.numel()))
            cands += [(cum + v, bi, t) for v, t in zip(top.values.tolist(), top.indices.tolist())]
        cands.sort(key=lambda c: (-c[0], c[1], c[2]))
        new = []
        for rank, (cum, bi, t) in enumerate(cands):
            if t == eos and not params.ignore_eos:
                if rank < W:
                    done.append((beams[bi][0] + [t], cum))
                continue
            new.append((beams[bi][0] + [t], cum))
            if len(new) == W:
                break
        if step == params.max_tokens - 1:
            done += new
            new = []
        beams = new
        if not beams:
            break
    done.sort(key=lambda d: -beam_score(d[1], len(d[0]), params.length_penalty))
    return done[:W]


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "int8"])
def test_beam_search_matches_dense_reference(tiny_vocab8, kv_cache_dtype):
    llm = make_llm(tiny_vocab8, kv_cache_dtype=kv_cache_dtype)
    eos = llm.engine.eos_token_id
    assert eos is not None and eos < 8
    params = BeamSearchParams(beam_width=3, max_tokens=9, length_penalty=0.7)
    prompts = [[3, 1, 4, 1, 5], [2, 7, 1, 6, 2, 6, 1]]
    outs = llm.beam_search(prompts, params)
    llm.check_integrity()
    for prompt, out in zip(prompts, outs):
        ref = reference_beam_search(llm.engine.model, prompt, params, eos)
        if kv_cache_dtype == "auto":
            assert [s.tokens for s in out.sequences] == [t for t, _ in ref]
            assert [s.cum_logprob for s in out.sequences] == pytest.approx([c for _, c in ref], abs=1e-4)
        else:  # quantized keys/values: same best beam, scores close
            assert out.sequences[0].tokens[:3] == ref[0][0][:3]
        assert all(s.finish_reason in ("stop", "length") for s in out.sequences)
