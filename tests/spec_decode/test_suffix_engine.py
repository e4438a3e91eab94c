"""The suffix method in the engine (spec_decode/suffix.py through the n-gram proposer), on the tiny random Llama:
greedy output equals plain decoding, a repeated request drafts from the text served before it, a tenant's text
never drafts for another (counted per cache_salt), and the store keeps within its bound."""

from __future__ import annotations

from tokenmill import LLM, SamplingParams

PROMPT = [3, 97, 41, 250, 18, 77, 5, 160]  # no repeats: prompt lookup alone finds little
GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
SUFFIX = {"method": "suffix", "num_speculative_tokens": 4, "adaptive": False, "prompt_lookup_min": 2}


def generate(llm: LLM, salt: str | None) -> list[int]:
    out = llm.generate([PROMPT], GREEDY, use_tqdm=False, cache_salt=salt)[0].outputs[0].token_ids
    llm.check_integrity()
    return out


def accepted(llm: LLM) -> int:
    return llm.stats().spec_decode["num_accepted_tokens"]


def test_repeat_drafts_from_served_text_of_its_own_tenant_only(tiny_llama):
    ref = generate(LLM(str(tiny_llama), dtype="float32"), None)
    llm = LLM(str(tiny_llama), dtype="float32", speculative_config=SUFFIX, enable_prefix_caching=False)
    online = llm.engine.executor.runner.speculator.proposer.online
    assert generate(llm, "alice") == ref
    before = accepted(llm)
    # the same request from another tenant: alice's answer joined her store when the engine's next step said she
    # finished (before bob's first draft), and is not offered to bob
    assert generate(llm, "bob") == ref
    assert online.tenant_tokens_held("alice") > len(ref) // 2
    assert online.stats("bob").hits == 0 and online.stats("bob").lookups > 0
    bob_gain = accepted(llm) - before
    before = accepted(llm)
    assert generate(llm, "alice") == ref  # alice again: her earlier answer drafts this one
    alice_gain = accepted(llm) - before
    assert online.stats("alice").hits > 0
    assert alice_gain >= len(ref) // 2 > bob_gain


def test_store_keeps_within_its_bound(tiny_llama):
    cfg = {**SUFFIX, "suffix_max_tokens": 40}
    llm = LLM(str(tiny_llama), dtype="float32", speculative_config=cfg)
    online = llm.engine.executor.runner.speculator.proposer.online
    for i in range(6):
        prompt = [(p + 13 * i) % 256 for p in PROMPT]
        llm.generate([prompt], GREEDY, use_tqdm=False, cache_salt=f"t{i % 2}")
        assert online.tokens_held <= 40
    evicted = online.stats("t0").sequences_evicted + online.stats("t1").sequences_evicted
    assert evicted >= 3 and online.tokens_held == online.tenant_tokens_held("t0") + online.tenant_tokens_held("t1")
    llm.check_integrity()
