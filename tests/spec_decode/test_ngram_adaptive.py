"""The n-gram matcher and the adaptive-γ cost model as pure functions."""

from __future__ import annotations

import pytest

from tokenmill.spec_decode.adaptive import (
    AdaptiveGamma,
    LinearCost,
    best_gamma,
    expected_tokens,
    fit_linear_cost,
    predicted_speedup,
)
from tokenmill.spec_decode.ngram import ngram_propose
from tokenmill.spec_decode.stats import SpecDecodeStats


def test_ngram_docstring_example():
    assert ngram_propose([5, 7, 9, 2, 5, 7, 9], 1, 3, 2) == [2, 5]


def test_ngram_prefers_the_longest_suffix_then_the_latest_match():
    toks = [1, 2, 3, 8, 4, 3, 9, 1, 2, 3]
    # n = 3: [1, 2, 3] at 0 -> continuation [8, 4, 3]; a 1-gram match of [3] at 5 would give [9, ...].
    assert ngram_propose(toks, 1, 3, 3) == [8, 4, 3]
    assert ngram_propose(toks, 1, 1, 2) == [9, 1]  # latest earlier occurrence of [3] is at 5
    assert ngram_propose(toks, 1, 1, 6) == [9, 1, 2, 3, 9, 1]


def test_ngram_no_match_and_limits():
    assert ngram_propose([1, 2, 3, 4], 1, 3, 4) == []
    assert ngram_propose([1, 2, 1], 2, 3, 4) == []  # only 1-grams repeat, but min_n = 2
    assert ngram_propose([1, 2, 1], 1, 3, 4) == [2, 1, 2, 1]  # continuation runs into the suffix
    assert ngram_propose([7], 1, 3, 4) == []
    assert ngram_propose([1, 1, 1, 1], 1, 3, 0) == []


def test_periodic_loop_drafts_the_period():
    assert ngram_propose([4, 5, 6] * 3, 1, 4, 5) == [4, 5, 6, 4, 5]


def test_expected_tokens_and_speedup():
    assert expected_tokens(0.0, 4) == 1.0
    assert expected_tokens(1.0, 4) == 5.0
    assert expected_tokens(0.5, 1) == pytest.approx(1.5)
    # Seeds' formula: E[T] / (γ c + 1).
    assert predicted_speedup(0.8, 4, 0.1) == pytest.approx((1 - 0.8**5) / 0.2 / 1.4)


def test_best_gamma_lowers_and_switches_off():
    assert best_gamma(0.9, 0.0, 8) == 8  # free drafts, high acceptance: go long
    assert best_gamma(0.9, 0.3, 8) < 8  # costly drafts: shorter
    assert best_gamma(0.05, 0.3, 8) == 0  # hopeless: off
    # Compute-bound target (verification tokens cost as much as decodes): off even at α = 0.7.
    assert best_gamma(0.7, 0.0, 8, verify_cost_ratio=lambda g: 1 + g) == 0


def test_linear_cost_fit():
    fit = fit_linear_cost([(n, 0.01 + 0.001 * n) for n in (1, 8, 32, 64)], LinearCost(1.0, 0.0))
    assert fit.a == pytest.approx(0.01) and fit.b == pytest.approx(0.001)
    flat = fit_linear_cost([(4, 0.02), (4, 0.03)], LinearCost(0.0, 0.5))  # no spread: keep the prior slope
    assert flat.b == 0.5


def test_cost_uses_measured_steps_where_the_line_misprices_them():
    """CPU steps are flat up to 8 tokens and jump above (the few-row kernels stop there): a line
    through n = 8 and 16 would price 16 right but 24 wrong; measured counts are used as measured."""
    ad = AdaptiveGamma(4, adaptive=True)
    ad.alpha_prior, ad.prior_weight = 0.4, 1e9  # α pinned at 0.4 for the test
    for _ in range(20):
        ad.observe_target_step(8, 0.010)
    ad.observe_target_step(16, 0.016)
    assert ad.cost(8) == pytest.approx(0.010) and ad.cost(16) == pytest.approx(0.016)
    assert ad.verify_cost_ratio(8, 1) == pytest.approx(1.6)
    # E[T] = 1.4 at γ = 1 against r = 1.6: off (the line fitted to these samples agrees here)
    assert ad.choose(8) == 0
    for _ in range(5):
        ad.observe_target_step(2, 0.0101)  # single stream: 2 tokens cost one token's time
        ad.observe_target_step(1, 0.0100)
    assert ad.verify_cost_ratio(1, 1) == pytest.approx(1.01, abs=1e-3)
    assert ad.choose(1) >= 1


def test_one_probe_outweighs_many_plain_steps_in_the_fit():
    """Batch 8 on CPU: 60 plain steps of 8 tokens at 5 ms, one probe whose drafts made 13 tokens at
    9 ms (past the few-row kernels). A step of 16 tokens (γ = 1 for all 8) must cost more than the
    probe, so at α = 0.4 speculation stays off, whatever slope the calibration prior had."""
    ad = AdaptiveGamma(4, adaptive=True)
    ad.prior_cost = LinearCost(0.005, 0.00001)  # a shallow slope, as dense calibration passes give
    ad.alpha_prior, ad.prior_weight = 0.4, 1e9
    for _ in range(60):
        ad.observe_target_step(8, 0.005)
    ad.observe_target_step(13, 0.009)
    assert ad.cost(16) > 0.009
    assert ad.choose(8) == 0


def test_adaptive_gamma_reacts_to_acceptance_and_batch():
    ad = AdaptiveGamma(6, adaptive=True, probe_interval=3)
    ad.prior_cost = LinearCost(0.04, 0.0005)  # memory-bound at small n, compute-bound at large n
    for _ in range(50):
        ad.observe_acceptance(10, 9)
    assert ad.choose(1) >= 4
    assert ad.choose(256) < ad.choose(1)
    for _ in range(200):
        ad.observe_acceptance(10, 0)
    # Off, with a probe after 3 steps, then after 6 (backoff while probes keep failing).
    assert [ad.choose(1) for _ in range(9)] == [0, 0, 1, 0, 0, 0, 0, 0, 1]
    assert AdaptiveGamma(5, adaptive=False).choose(512) == 5


def test_a_probe_drafts_for_a_few_requests_in_turn():
    """At batch 32 a probe drafts for probe_rows requests, the next probe for the ones after them; the steps
    between probes draft nothing, and c comes from passes that drafted for the whole batch only."""
    ad = AdaptiveGamma(4, adaptive=True, probe_interval=2, probe_rows=4)
    ad.prior_cost = LinearCost(0.01, 0.001)  # verification far from free at batch 32
    ad.alpha_prior, ad.prior_weight = 0.1, 1e9
    chosen = [ad.choose(32) for _ in range(6)]
    assert chosen == [0, 1, 0, 0, 0, 1]  # probes after 2 steps off, then after 4
    assert ad.choose(32) == 0 and not ad.probing
    ks = [1] * 10
    ks[2] = 0  # a request that may not draft (its budget is spent) is never picked
    ad.probing = True
    assert ad.probe_budgets(ks) == [1, 1, 0, 1, 1, 0, 0, 0, 0, 0]
    assert ad.probe_budgets(ks) == [0, 0, 0, 0, 0, 1, 1, 1, 1, 0]
    assert ad.probe_budgets(ks) == [1, 1, 0, 1, 0, 0, 0, 0, 0, 1]
    assert ad.probe_budgets([1, 0, 1]) == [1, 0, 1]  # fewer than probe_rows: all of them
    assert ad.num_probe_rows == 14
    # a probe's draft time (4 of 32 requests) is only c's floor until a pass for all 32 sets c: T(32) = 42 ms
    assert ad.c == 0.0
    ad.observe_draft(1, 32, 0.001, num_drafted=4)
    assert ad.c == pytest.approx(0.001 / 0.042)  # the floor, not 0: a probe's pass is not free
    ad.observe_draft(1, 32, 0.0042, num_drafted=32)
    assert ad.c == pytest.approx(0.1)  # the whole pass replaces the floor, not averaged with it
    ad.observe_draft(1, 32, 0.0001, num_drafted=4)
    assert ad.c == pytest.approx(0.1)  # later probes leave a measured c alone


def test_decoder_probes_with_a_few_requests(tiny_llama):
    """Through the engine: with acceptance estimated at 0, batch 12 decodes without drafts except in probes, and
    each probe drafts for probe_rows requests only (counted)."""
    from tokenmill import LLM, SamplingParams

    llm = LLM(
        model=str(tiny_llama),
        dtype="float32",
        max_model_len=256,
        num_gpu_blocks_override=256,
        speculative_config={"method": "ngram", "num_speculative_tokens": 3},
    )
    spec = llm.engine.executor.runner.speculator
    ad = spec.adaptive
    ad.alpha_prior, ad.prior_weight, ad.probe_rows = 0.0, 1e9, 3
    prompts = [[5 + i, 9, 200, 31, 7] * 3 for i in range(12)]
    # the default schedule: a probe after 16 steps off, the next after 32 more
    llm.generate(prompts, SamplingParams(max_tokens=56, temperature=0.0, ignore_eos=True), use_tqdm=False)
    assert spec.num_draft_calls > 0  # probes ran, each for 3 of the 12 requests
    assert ad.num_probe_rows == 3 * spec.num_draft_calls
    assert 0 < spec.stats.num_drafts <= ad.num_probe_rows


def test_stats_vllm_names():
    s = SpecDecodeStats()
    s.observe(4, 2)
    s.observe(4, 4)
    s.observe(0, 0)
    d = s.as_dict()
    assert (d["num_drafts"], d["num_draft_tokens"], d["num_accepted_tokens"]) == (2, 8, 6)
    assert d["mean_acceptance_length"] == 4.0
    assert [d[f"num_accepted_tokens_per_pos_{i}"] for i in range(4)] == [2, 2, 1, 1]
    assert s.alpha == pytest.approx(6 / 7)
