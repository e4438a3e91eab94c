"""A token tree in one forward pass over the paged cache (spec_decode/tree.py's mask and positions): each
node's hidden state equals a plain causal forward over the prefix and that node's own path; after the
accepted path's K/V are moved into place (worker/kv_cache_ops.py), the next decode sees exactly that path."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from tokenmill.attention import cpu_kernels
from tokenmill.attention.metadata import forward_context, tree_key_masks
from tokenmill.config import KVCacheSpec
from tokenmill.core.step_io import StepTokens
from tokenmill.models.loader import load_model
from tokenmill.spec_decode.tree import TokenTree
from tokenmill.worker.kv_cache_ops import compact_accepted_path
from tokenmill.worker.model_runner import ModelRunner

PREFIX = [5, 9, 200, 31, 7, 8, 11]  # the last one is the root: its K/V is computed in the tree step
TREE = TokenTree([40, 41, 42, 43, 44], [-1, -1, 0, 0, 2], [True] * 5)
BLOCKS = list(range(6))


def setup(tiny_llama):
    loaded = load_model(str(tiny_llama), dtype=torch.float32, load_tokenizer=False)
    arch = loaded.config
    kv = KVCacheSpec(8, 4, arch.num_hidden_layers, arch.num_key_value_heads, arch.head_dim, torch.float32)
    runner = ModelRunner(loaded.model, arch, kv, torch.device("cpu"))
    return loaded.model, runner


@torch.inference_mode()
def forward(model, runner, start: int, tokens: list[int], positions: list[int], mask=None) -> torch.Tensor:
    inp = runner.prepare_inputs([StepTokens("r", start, tokens, BLOCKS)])
    meta = (
        inp.meta
        if mask is None
        else dataclasses.replace(inp.meta, custom_mask=mask, token_block_tables=None, token_seq_lens=None)
    )
    with forward_context(meta):
        return model(inp.input_ids, torch.tensor(positions))


@torch.inference_mode()
def dense_last(model, tokens: list[int]) -> torch.Tensor:
    return model(torch.tensor(tokens), torch.arange(len(tokens)))[-1]


def path_tokens(node: int) -> list[int]:
    path = []
    while node >= 0:
        path.append(TREE.tokens[node])
        node = TREE.parents[node]
    return path[::-1]


def test_each_node_sees_only_its_own_path(tiny_llama):
    model, runner = setup(tiny_llama)
    n = len(PREFIX)
    forward(model, runner, 0, PREFIX[:-1], list(range(n - 1)))  # the prefix into the cache
    mask = TREE.attention_mask(num_cached=n - 1)
    hidden = forward(model, runner, n - 1, [PREFIX[-1]] + TREE.tokens, TREE.positions(n - 1), mask)
    torch.testing.assert_close(hidden[0], dense_last(model, PREFIX), atol=1e-4, rtol=1e-4)
    for i in range(TREE.size):
        torch.testing.assert_close(hidden[1 + i], dense_last(model, PREFIX + path_tokens(i)), atol=1e-4, rtol=1e-4)


def test_accepted_path_moved_into_place_serves_the_next_decode(tiny_llama):
    model, runner = setup(tiny_llama)
    n = len(PREFIX)
    forward(model, runner, 0, PREFIX[:-1], list(range(n - 1)))
    forward(model, runner, n - 1, [PREFIX[-1]] + TREE.tokens, TREE.positions(n - 1), TREE.attention_mask(n - 1))
    accepted = [0, 2, 4]  # tokens 40, 42, 44
    compact_accepted_path(runner.kv_caches, BLOCKS, n, accepted)
    kept = PREFIX + [TREE.tokens[a] for a in accepted]
    nxt = 77
    hidden = forward(model, runner, len(kept), [nxt], [len(kept)])  # a plain decode after the path
    torch.testing.assert_close(hidden[0], dense_last(model, kept + [nxt]), atol=1e-4, rtol=1e-4)


def test_tree_key_masks_worked_example():
    assert tree_key_masks([-1, 0, -1, 1]) == [0, 0, 6, 2]
    assert tree_key_masks([-1, 0, 1]) == [0, 0, 0]  # a chain hides nothing


@pytest.mark.parametrize("path", ["decode_loop", "kernels", "torch"])
def test_runner_tree_step_matches_dense_forward(tiny_llama, monkeypatch, path):
    """The runner's own metadata for a tree step (positions by depth, key masks), served by the C++ layer
    loop, by the module path over the C++ attention kernels, and by the pure PyTorch reference."""
    model, runner = setup(tiny_llama)
    n = len(PREFIX)
    forward(model, runner, 0, PREFIX[:-1], list(range(n - 1)))
    step = StepTokens("r", n - 1, [PREFIX[-1]] + TREE.tokens, BLOCKS, TREE.size, True, None, TREE.parents)
    inp = runner.prepare_inputs([step])
    assert inp.positions.tolist() == TREE.positions(n - 1)
    assert inp.meta.token_key_mask is not None
    if path == "torch":
        monkeypatch.setattr(cpu_kernels, "_load", lambda: None)
    with torch.inference_mode():
        if path == "decode_loop":
            assert runner.decode_loop is not None, "the C++ layer loop is built whenever the kernels are"
            assert runner.decode_loop.serves(inp.meta, inp.input_ids.shape[0])
            hidden = runner.decode_loop(inp.input_ids, inp.positions, inp.meta)
        else:
            with forward_context(inp.meta):
                hidden = model(inp.input_ids, inp.positions)
    torch.testing.assert_close(hidden[0], dense_last(model, PREFIX), atol=1e-4, rtol=1e-4)
    for i in range(TREE.size):
        torch.testing.assert_close(hidden[1 + i], dense_last(model, PREFIX + path_tokens(i)), atol=1e-4, rtol=1e-4)


def test_feature_sink_gets_the_kept_rows_only():
    from tokenmill.core.step_io import SamplerResult
    from tokenmill.worker.model_runner import kept_rows

    a = StepTokens("a", 9, [50, 51, 52, 53], BLOCKS, 3, True, None, [-1, -1, 0])  # a tree: accepted [1]
    b = StepTokens("b", 4, [60, 61, 62], BLOCKS, 2)  # a chain: 1 accepted
    c = StepTokens("c", 0, [70, 71], BLOCKS, 0, False)  # a prompt chunk
    hidden = torch.arange(9.0)[:, None]
    batch, rows = kept_rows([a, b, c], hidden, {"a": SamplerResult([52, 9], None, [1]), "b": SamplerResult([61, 8])})
    assert [(s.request_id, s.start_pos, s.token_ids) for s in batch] == [
        ("a", 9, [50, 52]),
        ("b", 4, [60, 61]),
        ("c", 0, [70, 71]),
    ]
    assert rows[:, 0].tolist() == [0, 2, 4, 5, 7, 8]
