"""EAGLE head and proposer on the tiny random Llama: the training forward is the inference
forward, the runner hands the proposer the target's true features, a short training run learns,
greedy output is token-identical to plain decoding (mixed batches, chunked prefill, preemption,
prefix hits), seeded sampling reproduces, and bad head files get errors that name the file."""

from __future__ import annotations

import json

import pytest
import torch

from tests.spec_decode.test_engine import MIXED_PARAMS, PROMPTS, TIGHT, run
from tokenmill import LLM, SamplingParams
from tokenmill.spec_decode.eagle_head import load_eagle_head, target_tables, train_forward
from tokenmill.training import eagle as et


def _target(path):
    from tokenmill.models.loader import load_model

    return load_model(str(path), dtype=torch.float32, device="cpu", load_tokenizer=False).model


def greedy_corpus(path, seed: int, num_prompts: int, max_prompt_len: int):
    """Random prompts, the tiny target's greedy continuations (its own outputs) and their features:
    (target, sequences, prompt lengths, features, argmaxes). Every LLM here is float32: heads train on the
    float32 target's features (`_target`)."""
    llm = LLM(str(path), dtype="float32")
    g = torch.Generator().manual_seed(seed)
    prompts = [
        torch.randint(3, 2000, (int(n),), generator=g).tolist()
        for n in torch.randint(4, max_prompt_len, (num_prompts,), generator=g)
    ]
    outs = run(llm, prompts, SamplingParams(temperature=0, max_tokens=40, ignore_eos=True))
    seqs = [p + o for p, o in zip(prompts, outs)]
    target = _target(path)
    feats, argmaxes = et.extract_features(target, seqs, log=lambda *_: None)
    return target, seqs, [len(p) for p in prompts], feats, argmaxes


@pytest.fixture(scope="module")
def corpus(tiny_llama):
    target, seqs, _, feats, argmaxes = greedy_corpus(tiny_llama, 0, 24, 24)
    return target, seqs, feats, argmaxes


@pytest.fixture(scope="module")
def trained_head(corpus, tmp_path_factory):
    target, seqs, feats, argmaxes = corpus
    vocab = et.choose_draft_vocab(argmaxes, target.config.vocab_size, 256)
    head = et.init_head_from_target(target, vocab)
    first = et.train_head(head, seqs, feats, argmaxes, epochs=1, lr=3e-3, tokens_per_batch=256, log=lambda *_: None)
    last = et.train_head(head, seqs, feats, argmaxes, epochs=6, lr=3e-3, tokens_per_batch=256, log=lambda *_: None)
    path = tmp_path_factory.mktemp("eagle")
    head.save(path, "tiny")
    return path, head, first, last


def test_train_forward_is_the_inference_forward(corpus):
    target, seqs, feats, argmaxes = corpus
    head = et.init_head_from_target(target, torch.arange(100))
    ids = torch.tensor([seqs[0][1:], seqs[1][1 : len(seqs[0])]])
    f = torch.stack([feats[0][:-1], feats[1][: len(seqs[0]) - 1]]).float()
    with torch.no_grad():
        dense = head(ids, torch.arange(ids.shape[1]).expand(2, -1).contiguous(), f)  # the module, no forward context
        trained = train_forward(head, ids, f)
    assert torch.allclose(dense, trained, atol=1e-5, rtol=1e-5)


def _draft_dense(head, ids: list[int], feats: torch.Tensor, a: int, depth: int) -> list[torch.Tensor]:
    """Serving-time drafting spelled out with the dense module: the real features up to position a, then
    each step's own prediction fed back with the next token; the output of every draft step."""
    f = [feats[i].float() for i in range(a + 1)]
    outs = []
    for k in range(depth):
        n = a + 1 + k
        x = head(torch.tensor(ids[1 : n + 1]), torch.arange(n), torch.stack(f))
        outs.append(x[-1])
        f.append(x[-1])
    return outs


def test_unrolled_training_forward_is_drafting_on_own_predictions(corpus):
    """train_forward(..., steps=3) at position a + k equals drafting k + 1 tokens from a with the module."""
    target, seqs, feats, argmaxes = corpus
    head = et.init_head_from_target(target, torch.arange(100))
    s = seqs[2]
    ids, f = torch.tensor([s[1:]]), feats[2][:-1].float()[None]
    with torch.no_grad():
        outs = train_forward(head, ids, f, steps=3)
        assert torch.allclose(outs[0], train_forward(head, ids, f), atol=1e-6)
        for a in (0, 5, len(s) - 5):
            drafted = _draft_dense(head, s, feats[2], a, 3)
            for k in range(3):
                assert torch.allclose(outs[k][0, a + k], drafted[k], atol=1e-4, rtol=1e-4), (a, k)


def test_chain_acceptance_counts_what_drafting_accepts(trained_head, corpus):
    """chain_acceptance's counts equal a greedy drafting loop checked against the target's argmax."""
    _, head, _, _ = trained_head
    target, seqs, feats, argmaxes = corpus
    seqs, feats, argmaxes = seqs[:3], feats[:3], argmaxes[:3]
    starts = [len(s) - 30 for s in seqs]
    got = et.chain_acceptance(head, seqs, feats, argmaxes, starts, depth=3)
    counts = [0, 0, 0, 0]
    with torch.no_grad():
        for s, f, am, st in zip(seqs, feats, argmaxes, starts):
            for a in range(st, len(s) - 1 - 3 + 1):
                outs = _draft_dense(head, s, f, a, 3)
                n = 0
                while n < 3 and int(head.draft_vocab[head.compute_logits(outs[n][None]).argmax()]) == int(
                    am[a + n + 1]
                ):
                    n += 1
                counts[n] += 1
    total = sum(counts)
    assert got["starts"] == total
    assert got["accepted"] == pytest.approx(sum(i * c for i, c in enumerate(counts)) / total)
    assert got["alpha1"] == pytest.approx(1 - counts[0] / total)
    assert 0 < got["accepted"] < 3  # the trained head gets some drafts right, not all


def test_training_on_own_drafts_reports_each_step(corpus):
    target, seqs, feats, argmaxes = corpus
    head = et.init_head_from_target(target, et.choose_draft_vocab(argmaxes, target.config.vocab_size, 256))
    st = et.train_head(
        head, seqs, feats, argmaxes, epochs=2, lr=3e-3, tokens_per_batch=256, steps=3, log=lambda *_: None
    )
    assert {"top1_step1", "top1_step2", "top1_step3"} <= set(st)
    assert st["top1_step1"] == st["top1"] and st["top1_step1"] > 0


def test_features_and_argmax_are_the_targets(corpus):
    target, seqs, feats, argmaxes = corpus
    with torch.no_grad():
        h = target(torch.tensor(seqs[3]), torch.arange(len(seqs[3])))
    assert torch.equal(h, feats[3])
    # the corpus is the target's own greedy output: the argmax at each answer position is the next token
    s, a = seqs[3], argmaxes[3]
    answer_start = len(s) - 40
    assert a[answer_start - 1 : -1].tolist() == s[answer_start:]


def test_training_learns(trained_head):
    _, _, first, last = trained_head
    assert last["smooth_l1"] < first["smooth_l1"]
    assert last["top1"] > first["top1"] and last["top1"] > 0.3


def test_runner_hands_the_true_features(tiny_llama, trained_head):
    path, *_ = trained_head
    cfg = {"method": "eagle", "model": str(path), "num_speculative_tokens": 3, "adaptive": False}
    llm = LLM(str(tiny_llama), dtype="float32", speculative_config=cfg)
    runner = llm.engine.executor.runner
    seen: list[tuple[list[int], int, torch.Tensor]] = []
    write = runner.feature_sink

    def spy(batch, hidden):
        off = 0
        for s in batch:
            seen.append(
                (
                    runner.requests[s.request_id].token_ids[: s.start_pos] + list(s.token_ids),
                    s.start_pos,
                    hidden[off : off + s.num_new_tokens].clone(),
                )
            )
            off += s.num_new_tokens
        write(batch, hidden)

    runner.feature_sink = spy  # a test's spy on the declared hook
    run(llm, PROMPTS[:2], SamplingParams(temperature=0, max_tokens=10, ignore_eos=True))
    target = _target(tiny_llama)
    # verification steps happened; the sink gets their kept rows only (real tokens and accepted drafts)
    assert len(seen) > 4 and llm.stats().spec_decode["num_drafts"] > 0
    for tokens, start, rows in seen:
        with torch.no_grad():
            ref = target(torch.tensor(tokens), torch.arange(len(tokens)))[start:]
        torch.testing.assert_close(rows, ref, atol=1e-4, rtol=1e-4)


@pytest.fixture(scope="module")
def greedy_ref(tiny_llama):
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    return params, run(LLM(str(tiny_llama), dtype="float32", **TIGHT), PROMPTS, params)


@pytest.mark.parametrize("adaptive", [False, True])
def test_greedy_identical_with_chunking_preemption_and_prefix_hits(tiny_llama, trained_head, greedy_ref, adaptive):
    path, *_ = trained_head
    params, ref = greedy_ref
    cfg = {"method": "eagle", "model": str(path), "num_speculative_tokens": 4, "adaptive": adaptive}
    llm = LLM(str(tiny_llama), dtype="float32", speculative_config=cfg, **TIGHT)
    assert run(llm, PROMPTS, params) == ref  # mixed batch, 8-token budget, a pool that preempts
    assert run(llm, PROMPTS[:1], params) == ref[:1]  # alone, with prefix-cache hits
    stats = llm.stats()
    assert stats.num_preemptions > 0
    spec = stats.spec_decode  # drafts were made and verified, adaptive γ included (it drafts less: few accepted)
    assert spec["num_drafts"] > 0 and spec["num_accepted_tokens"] <= spec["num_draft_tokens"]
    if not adaptive:
        assert spec["num_accepted_tokens"] > 0
    head_loop = llm.engine.executor.runner.speculator.proposer.runner.decode_loop  # the head runs in the C++ loop
    assert head_loop is not None and head_loop.steps_served > 0


def _greedy_with_drafts(tiny_llama, head_dir) -> tuple[list[int], list[tuple[int, int]]]:
    """PROMPTS[2] and its greedy answer under the head at γ = 1, and every draft made: (tokens the request held,
    the draft)."""
    cfg = {"method": "eagle", "model": str(head_dir), "num_speculative_tokens": 1, "adaptive": False}
    llm = LLM(str(tiny_llama), dtype="float32", speculative_config=cfg)
    prop = llm.engine.executor.runner.speculator.proposer
    inner, log = prop.propose, []

    def spy(reqs, ks):
        out = inner(reqs, ks)
        log.extend((r.num_tokens, d[0]) for r, d in zip(reqs, out.token_ids) if d)
        return out

    prop.propose = spy  # a test's spy on the proposer's own method
    prompt = PROMPTS[2]
    return prompt + run(llm, [prompt], SamplingParams(temperature=0, max_tokens=30, ignore_eos=True))[0], log


def test_drafts_are_the_heads_teacher_forced_predictions(tiny_llama, trained_head):
    """Greedy, γ = 1: when a request holds N tokens, its draft is the head's prediction from the
    target's feature at N - 2 and token N - 1, as the dense training forward computes it."""
    path, head, *_ = trained_head
    full, log = _greedy_with_drafts(tiny_llama, path)
    target = _target(tiny_llama)
    feats, _ = et.extract_features(target, [full], log=lambda *_: None)
    with torch.no_grad():
        pred = head.draft_vocab[
            head.compute_logits(train_forward(head, torch.tensor([full[1:]]), feats[0][None, :-1].float())[0]).argmax(
                -1
            )
        ]
    assert len(log) >= 10
    matches = sum(d == int(pred[n - 2]) for n, d in log)
    assert matches >= len(log) - 1, (matches, len(log))


def test_seeded_sampling_reproduces_and_greedy_rows_match(tiny_llama, trained_head, greedy_ref):
    path, *_ = trained_head
    _, ref = greedy_ref
    cfg = {"method": "eagle", "model": str(path), "num_speculative_tokens": 3, "adaptive": False}
    params = MIXED_PARAMS
    a = run(LLM(str(tiny_llama), dtype="float32", speculative_config=cfg, **TIGHT), PROMPTS, params)
    b = run(LLM(str(tiny_llama), dtype="float32", speculative_config=cfg, **TIGHT), PROMPTS, params)
    assert a == b and a[0] == ref[0] and a[2] == ref[2] and len(a[1]) == len(a[3]) == 12


def test_bad_head_files_name_the_file(tiny_llama, trained_head, tmp_path):
    import shutil

    path, *_ = trained_head
    target = _target(tiny_llama)
    embed, lm = target_tables(target)
    with pytest.raises(FileNotFoundError, match="eagle_config.json"):
        load_eagle_head(tmp_path, target.config, embed, lm, torch.float32)
    bad = tmp_path / "bad"
    shutil.copytree(path, bad)
    cfg = json.loads((bad / "eagle_config.json").read_text())
    (bad / "eagle_config.json").write_text(json.dumps({**cfg, "target_hidden_size": 7}))
    with pytest.raises(ValueError, match="eagle_config.json.*hidden size 7"):
        load_eagle_head(bad, target.config, embed, lm, torch.float32)
    (bad / "eagle_config.json").write_text(json.dumps(cfg))
    (bad / "model.safetensors").write_bytes(b"not a safetensors file")
    with pytest.raises(ValueError, match="model.safetensors"):
        load_eagle_head(bad, target.config, embed, lm, torch.float32)
    with pytest.raises(ValueError, match="model is required"):
        LLM(str(tiny_llama), dtype="float32", speculative_config={"method": "eagle"})


def test_answers_only_bf16_training_runs(corpus):
    target, seqs, feats, argmaxes = corpus
    head = et.init_head_from_target(target, et.choose_draft_vocab(argmaxes, target.config.vocab_size, 256))
    starts = [len(s) - 41 for s in seqs]  # the last 40 tokens of each sequence are its answer
    st = et.train_head(
        head, seqs, feats, argmaxes, epochs=1, tokens_per_batch=256, loss_start=starts, bf16=True, log=lambda *_: None
    )
    assert all(v == v and abs(v) < 1e6 for v in st.values())  # finite


def test_train_eagle_command_end_to_end(tiny_llama, tmp_path):
    """`tokenmill train-eagle` on the tiny model: corpus from ShareGPT, features, training, a head
    that loads into the engine and drafts."""
    from tests.conftest import SHARED_DATA
    from tokenmill.entrypoints.cli import main

    data = SHARED_DATA / "sharegpt_v3_first_exchange_5000.jsonl"
    if not data.is_file():
        pytest.fail(f"{data} not found: the shared data folder must sit next to the repository")
    out = tmp_path / "head"
    assert (
        main(
            [
                "train-eagle",
                "--model",
                str(tiny_llama),
                "--out",
                str(out),
                "--sharegpt",
                str(data),
                "--num-prompts",
                "4",
                "--max-tokens",
                "8",
                "--epochs",
                "1",
                "--draft-vocab",
                "128",
                "--unroll",
                "2",
                "--eval-prompts",
                "2",
            ]
        )
        == 0
    )
    stats = json.loads((out / "train_stats.json").read_text())
    assert stats["tokens"] > 4 * 8
    assert "top1_step2" in stats and stats["heldout_before_starts"] == stats["heldout_after_starts"] > 0
    llm = LLM(
        str(tiny_llama),
        dtype="float32",
        speculative_config={"method": "eagle", "model": str(out), "num_speculative_tokens": 2, "adaptive": False},
    )
    run(llm, PROMPTS[:1], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    assert llm.stats().spec_decode["num_drafts"] > 0


@pytest.mark.parametrize("adaptive", [False, True])
def test_dynamic_tree_greedy_identical(tiny_llama, trained_head, greedy_ref, adaptive):
    """The head drafts a dynamic tree (one head pass per level over the tree so far): output stays plain
    decoding's through chunking, preemption and prefix hits."""
    path, *_ = trained_head
    params, ref = greedy_ref
    cfg = {
        "method": "eagle",
        "model": str(path),
        "num_speculative_tokens": 3,
        "adaptive": adaptive,
        "tree": {"max_nodes": 6, "max_width": 2},
    }
    llm = LLM(str(tiny_llama), dtype="float32", speculative_config=cfg, **TIGHT)
    assert run(llm, PROMPTS, params) == ref
    assert run(llm, PROMPTS[:1], params) == ref[:1]
    spec = llm.stats().spec_decode
    assert spec["num_drafts"] > 0  # drafts made, adaptive γ included
    if not adaptive:
        assert spec["mean_draft_size"] > 3  # trees: more nodes than depth


def test_dynamic_tree_nodes_are_the_heads_top_guesses(tiny_llama, trained_head):
    """Width 1 makes the dynamic tree a chain of the head's argmax guesses: the same drafts as chain drafting."""
    path, *_ = trained_head
    base = {"method": "eagle", "model": str(path), "num_speculative_tokens": 3, "adaptive": False}
    outs = {}
    for name, cfg in (("chain", base), ("tree", {**base, "tree": {"max_nodes": 3, "max_width": 1}})):
        llm = LLM(str(tiny_llama), dtype="float32", speculative_config=cfg)
        seen = []
        prop = llm.engine.executor.runner.speculator.proposer
        inner = prop.propose

        def spy(reqs, ks, inner=inner, seen=seen):
            p = inner(reqs, ks)
            seen.append(p.token_ids)
            return p

        prop.propose = spy
        run(llm, PROMPTS[:2], SamplingParams(temperature=0, max_tokens=10, ignore_eos=True))
        outs[name] = seen
    assert outs["chain"] == outs["tree"] and any(any(d) for d in outs["chain"])


# ------------------------------------------------------------------ multi-layer features (EAGLE-3's)
MULTI_LAYERS = (0, 1)
"""Both layers of the tiny target (the last one must be among them)."""


@pytest.fixture(scope="module")
def multi_head(corpus, tmp_path_factory):
    """A head reading the outputs of both tiny layers, trained briefly on the same corpus (two steps unrolled)."""
    target, seqs, _, argmaxes = corpus
    taps, _ = et.extract_features(target, seqs, MULTI_LAYERS, log=lambda *_: None)
    vocab = et.choose_draft_vocab(argmaxes, target.config.vocab_size, 256)
    head = et.init_head_from_target(target, vocab, target_layers=MULTI_LAYERS)
    first = et.train_head(
        head, seqs, taps, argmaxes, epochs=1, lr=3e-3, tokens_per_batch=256, steps=2, log=lambda *_: None
    )
    last = et.train_head(
        head, seqs, taps, argmaxes, epochs=6, lr=3e-3, tokens_per_batch=256, steps=2, log=lambda *_: None
    )
    path = tmp_path_factory.mktemp("eagle-multi")
    head.save(path, "tiny")
    return path, head, taps, first, last


def test_multi_layer_head_starts_from_the_final_hidden_state(corpus):
    """Untrained, the fused feature of the layers' outputs is the target's final hidden state (fuse starts as the
    identity on the last layer's part, fuse_norm as the final norm), and the training forward is the module's."""
    target, seqs, feats, argmaxes = corpus
    head = et.init_head_from_target(target, torch.arange(100), target_layers=MULTI_LAYERS)
    taps, _ = et.extract_features(target, seqs[:2], MULTI_LAYERS, log=lambda *_: None)
    assert taps[0].shape == (len(seqs[0]), 2 * target.config.hidden_size)
    with torch.no_grad():
        torch.testing.assert_close(head.target_features(taps[0].float()), feats[0].float(), atol=1e-5, rtol=1e-5)
        n = len(seqs[0])
        ids = torch.tensor([seqs[0][1:], seqs[1][1:n]])
        f = torch.stack([taps[0][:-1], taps[1][: n - 1]]).float()
        dense = head(ids, torch.arange(n - 1).expand(2, -1).contiguous(), f)
        assert torch.allclose(dense, train_forward(head, ids, f), atol=1e-5, rtol=1e-5)


def test_multi_layer_head_learns_and_round_trips(tiny_llama, multi_head, tmp_path):
    path, head, _, first, last = multi_head
    assert last["ce"] < first["ce"] and last["top1"] > first["top1"]
    assert last["smooth_l1"] == 0  # tokens only: no feature to regress to
    target = _target(tiny_llama)
    embed, lm = target_tables(target)
    loaded = load_eagle_head(path, target.config, embed, lm, torch.float32)
    assert loaded.target_layers == MULTI_LAYERS
    assert torch.equal(loaded.fuse.weight, head.fuse.weight)
    import shutil

    bad = tmp_path / "bad"
    shutil.copytree(path, bad)
    cfg = json.loads((bad / "eagle_config.json").read_text())
    (bad / "eagle_config.json").write_text(json.dumps({**cfg, "target_layers": [0, 7]}))
    with pytest.raises(ValueError, match=r"eagle_config.json: target_layers \[0, 7\] outside"):
        load_eagle_head(bad, target.config, embed, lm, torch.float32)
    (bad / "eagle_config.json").write_text(json.dumps({**cfg, "target_layers": []}))
    with pytest.raises(ValueError, match="model.safetensors: missing tensors.*unexpected.*fuse"):
        load_eagle_head(bad, target.config, embed, lm, torch.float32)


@pytest.fixture(scope="module")
def trained_prompts_ref(tiny_llama, corpus):
    """Prompts the heads were trained on (the weak tiny heads get drafts accepted there) and plain greedy output."""
    _, seqs, _, _ = corpus
    prompts = [s[: len(s) - 40] for s in seqs[:4]]  # the last 40 tokens of each sequence are its answer
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    return prompts, params, run(LLM(str(tiny_llama), dtype="float32", **TIGHT), prompts, params)


@pytest.mark.parametrize("tree", [False, True])
def test_multi_layer_head_greedy_identical(tiny_llama, multi_head, trained_prompts_ref, tree):
    """The runner taps both layers for the head (it names them), drafts are accepted, and greedy output stays plain
    decoding's through chunking, preemption and prefix hits, for chains and trees."""
    path, *_ = multi_head
    prompts, params, ref = trained_prompts_ref
    cfg: dict = {"method": "eagle", "model": str(path), "num_speculative_tokens": 3, "adaptive": False}
    if tree:
        cfg["tree"] = {"max_nodes": 6, "max_width": 2}
    llm = LLM(str(tiny_llama), dtype="float32", speculative_config=cfg, **TIGHT)
    runner = llm.engine.executor.runner
    assert runner.feature_layers == MULTI_LAYERS
    assert run(llm, prompts, params) == ref
    assert run(llm, prompts[:1], params) == ref[:1]
    assert llm.stats().num_preemptions > 0
    spec = llm.stats().spec_decode
    assert spec["num_drafts"] > 0 and 0 < spec["num_accepted_tokens"] <= spec["num_draft_tokens"]


def test_multi_layer_drafts_are_the_training_forwards(tiny_llama, multi_head):
    """Greedy, γ = 1: each draft is the multi-layer head's teacher-forced prediction from the target's taps, as the
    dense training forward computes it (so the runner's taps are the layers the head was trained on)."""
    path, head, *_ = multi_head
    full, log = _greedy_with_drafts(tiny_llama, path)
    taps, _ = et.extract_features(_target(tiny_llama), [full], MULTI_LAYERS, log=lambda *_: None)
    with torch.no_grad():
        out = train_forward(head, torch.tensor([full[1:]]), taps[0][None, :-1].float())[0]
        pred = head.draft_vocab[head.compute_logits(out).argmax(-1)]
    assert len(log) >= 10
    assert sum(d == int(pred[n - 2]) for n, d in log) >= len(log) - 1
