"""The n-gram proposer's suffix datastore: table contents against a count done here by hand, the
drafting policy, the file round trip and its errors, greedy identity inside the engine, and
`tokenmill build-datastore` end to end on the tiny model."""

from __future__ import annotations

import collections
import json

import numpy as np
import pytest

from tests.spec_decode.test_engine import PROMPTS, TIGHT, greedy_reference, run  # noqa: F401 (fixture)
from tokenmill import LLM
from tokenmill.spec_decode.datastore import SuffixDatastore
from tokenmill.spec_decode.ngram import NgramProposer

CORPUS = [[1, 2, 3, 4, 5], [1, 2, 3, 9], [7, 2, 3, 4, 8], [1, 2, 3, 4, 5, 6]]


def brute_force(corpus, n):
    """context tuple -> (most frequent next token, its share), counted directly."""
    counts: dict[tuple, collections.Counter] = collections.defaultdict(collections.Counter)
    for s in corpus:
        for i in range(n, len(s)):
            counts[tuple(s[i - n : i])][s[i]] += 1
    return {ctx: (c.most_common(1)[0][0], c.most_common(1)[0][1] / sum(c.values())) for ctx, c in counts.items()}


@pytest.mark.parametrize("n", [1, 2, 3])
def test_tables_match_a_direct_count(n):
    ds = SuffixDatastore.build(CORPUS, min_n=n, max_n=n)
    want = brute_force(CORPUS, n)
    assert len(ds.tables[n][0]) == len(want)
    for ctx, (tok, share) in want.items():
        if share > 0.5:  # ties between equally frequent continuations may go either way
            assert ds.next_token(list(ctx)) == tok
        assert ds.next_token(list(ctx), min_share=share + 1e-6) is None  # one table: no shorter context to fall to


def test_longest_context_wins_and_contexts_never_cross_sequences():
    ds = SuffixDatastore.build(CORPUS, min_n=1, max_n=3)
    # after [2, 3]: 4 three times, 9 once; after [7, 2, 3] only 4; after [1, 2, 3]: 4 twice, 9 once
    assert ds.next_token([2, 3]) == 4
    assert ds.next_token([5, 1, 2, 3], min_share=0.7) == 4  # [1, 2, 3] -> 4 at 2/3 < 0.7, then [2, 3] at 3/4
    assert ds.next_token([5, 1, 2, 3], min_share=0.8) is None
    assert ds.next_token([5]) == 6  # [5] is followed by 6 once and never by 1
    assert ds.draft([1, 2], 4) == [3, 4, 5, 6]
    assert ds.draft([42], 3) == []


def test_policy_prompt_match_then_datastore_then_one_token_match():
    ds = SuffixDatastore.build([[20, 21, 22, 23]], min_n=1, max_n=2)
    p = NgramProposer(1, 4, ds, min_share=0.0)
    assert p.draft([8, 9, 5, 8, 9], 2) == [5, 8]  # a 2-token match in the request wins
    assert p.draft([5, 20, 21], 2) == [22, 23]  # no such match: the datastore
    assert p.draft([30, 31, 30], 2) == [31, 30]  # neither: the one-token match
    assert NgramProposer(2, 4, ds, min_share=0.0).draft([30, 31, 30], 2) == []


def test_file_round_trip_and_errors(tmp_path):
    f = tmp_path / "ds.npz"
    SuffixDatastore.save(f, CORPUS, min_n=1, max_n=3)
    a, b = SuffixDatastore.build(CORPUS, 1, 3), SuffixDatastore.load(f)
    for n in range(1, 4):
        for x, y in zip(a.tables[n], b.tables[n]):
            assert np.array_equal(x, y)
    assert b.num_tokens == sum(map(len, CORPUS))
    with pytest.raises(FileNotFoundError, match="build-datastore"):
        SuffixDatastore.load(tmp_path / "missing.npz")
    bad = tmp_path / "bad.npz"
    np.savez(bad, something=np.zeros(3))
    with pytest.raises(ValueError, match="bad.npz"):
        SuffixDatastore.load(bad)
    from tokenmill.config import SpeculativeConfig

    with pytest.raises(ValueError, match="ngram"):
        SpeculativeConfig(method="eagle", model="x", datastore=str(f))


# F811 is a false positive: the parameter is test_engine's fixture, imported above so that pytest finds it
def test_greedy_identical_with_a_datastore_of_the_targets_answers(tiny_llama, greedy_reference, tmp_path):  # noqa: F811
    """A datastore of the target's own greedy answers: drafts are mostly right, output unchanged
    under a tight pool (chunked prefill, preemption), in a batch and alone."""
    params, ref = greedy_reference
    f = tmp_path / "answers.npz"
    SuffixDatastore.save(f, ref, min_n=2, max_n=4)
    spec = {
        "method": "ngram",
        "num_speculative_tokens": 4,
        "adaptive": False,
        "prompt_lookup_min": 2,
        "datastore": str(f),
        "datastore_min_share": 0.0,
    }
    llm = LLM(str(tiny_llama), speculative_config=spec, **TIGHT)
    assert run(llm, PROMPTS, params) == ref
    assert run(llm, PROMPTS[1:2], params) == ref[1:2]
    stats = llm.stats()
    assert stats.num_preemptions > 0
    assert stats.spec_decode["num_accepted_tokens"] > 0


def test_build_datastore_cli_end_to_end(tiny_llama, tmp_path, capsys):
    from tokenmill.entrypoints.cli import main

    data = tmp_path / "sharegpt.jsonl"
    rows = [{"conversations": [{"from": "human", "value": f"Tell me about topic number {i}."}]} for i in range(1012)]
    data.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    out = tmp_path / "ds.npz"
    assert (
        main(
            [
                "build-datastore",
                "--model",
                str(tiny_llama),
                "--out",
                str(out),
                "--sharegpt",
                str(data),
                "--num-prompts",
                "6",
                "--max-tokens",
                "12",
            ]
        )
        == 0
    )
    stats = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert stats["answers"] == 6 and 0 < stats["tokens"] <= 72
    ds = SuffixDatastore.load(out)
    assert ds.num_tokens == stats["tokens"] and (ds.min_n, ds.max_n) == (2, 6)
