"""The n-gram proposer's token trees (ngram.py, ngram_tree): grown best first from every earlier
occurrence of the longest matching suffix and from the datastore's top continuations, parents first,
within the node, width and depth limits."""

from __future__ import annotations

from tokenmill.spec_decode.datastore import SuffixDatastore
from tokenmill.spec_decode.ngram import PROMPT_MATCH_PRECISION, ngram_tree
from tokenmill.spec_decode.tree import TokenTree

TOKENS = [5, 7, 9, 2, 8, 5, 7, 9, 4, 8, 5, 7, 9]  # the suffix 5 7 9 occurred twice before: then 2, then 4


def paths(tokens, parents):
    tree = TokenTree(tokens, parents, [False] * len(tokens))
    return [tuple(tree.path(i)) for i in range(tree.size)]


def test_every_occurrence_gives_a_branch_that_keeps_following_it():
    toks, par = ngram_tree(TOKENS, max_nodes=6, max_width=3, max_depth=3, min_n=1, max_n=3)
    got = paths(toks, par)
    # root: 2 and 4 at 0.79 / 2 each; each continues its own occurrence (8, then 5) at 0.79 per token
    assert set(got[:2]) == {(2,), (4,)}
    assert {(2, 8), (4, 8), (2, 8, 5), (4, 8, 5)} == set(got[2:])
    assert all(p < i for i, p in enumerate(par))  # parents first


def test_limits_hold():
    toks, par = ngram_tree(TOKENS, max_nodes=3, max_width=1, max_depth=2, min_n=1, max_n=3)
    assert len(toks) <= 3 and max(len(p) for p in paths(toks, par)) <= 2
    assert sum(1 for p in par if p == -1) == 1  # width 1 at the root
    assert ngram_tree([1, 2, 3], 5, 3, 3, min_n=2, max_n=3) == ([], [])  # nothing to match, no datastore


def test_datastore_siblings_and_agreement():
    # the corpus continues [7, 9] with 4 twice and 6 once: 4 (share 2/3) agrees with a prompt branch
    store = SuffixDatastore.build([[7, 9, 4], [7, 9, 4], [7, 9, 6]], min_n=2, max_n=2)
    toks, par = ngram_tree(
        TOKENS, max_nodes=3, max_width=3, max_depth=1, min_n=3, max_n=3, datastore=store, min_share=0.0
    )
    assert toks[0] == 4  # 1 - (1 - 0.395)(1 - 2/3) = 0.80: the best child
    assert set(toks) == {4, 2, 6} and par == [-1, -1, -1]
    assert 1 - (1 - PROMPT_MATCH_PRECISION / 2) * (1 - 2 / 3) > PROMPT_MATCH_PRECISION / 2


def test_tree_config_errors_name_the_problem():
    import pytest

    from tokenmill.config import SpeculativeConfig, TreeConfig

    with pytest.raises(ValueError, match="max_nodes must be in"):
        SpeculativeConfig.from_dict({"method": "ngram", "tree": {"max_nodes": 40}})
    with pytest.raises(ValueError, match="unknown speculative_config.tree keys"):
        SpeculativeConfig.from_dict({"method": "ngram", "tree": {"nodes": 4}})
    with pytest.raises(ValueError, match="must be true or an object"):
        SpeculativeConfig.from_dict({"method": "ngram", "tree": 5})
    with pytest.raises(ValueError, match="drafts chains only"):
        SpeculativeConfig.from_dict({"method": "draft_model", "model": "m", "tree": True})
    cfg = SpeculativeConfig.from_dict({"method": "ngram", "num_speculative_tokens": 3, "tree": True})
    assert cfg.tree == TreeConfig() and cfg.tree_max_depth == 3 and cfg.max_draft_tokens == TreeConfig().max_nodes
    assert SpeculativeConfig.from_dict({"method": "ngram", "tree": False}).tree is None
