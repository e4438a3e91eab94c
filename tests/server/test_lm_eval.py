"""lm-evaluation-harness end to end: the `lm_eval` package's `local-completions` model against the real
`tokenmill serve` (float32, the default 135M model) on two local tasks (tests/server/lm_eval_tasks/) whose
documents are written from ../shared/data at test time: a loglikelihood multiple-choice cloze over WikiText-2
sentences and a greedy generate_until continuation. Each choice's loglikelihood equals Hugging Face
transformers' on the same GGUF within 1e-3 and the chosen answers are identical; each generation is the text
the server's own greedy completion gives."""

from __future__ import annotations

import json
import math
from pathlib import Path

import openai
import pytest
import torch

from tests.server.conftest import MODEL, SHARED_DATA

lm_eval = pytest.importorskip("lm_eval", reason="lm-evaluation-harness: installed by scripts/install.sh test")

pytestmark = pytest.mark.slow

TASKS_DIR = Path(__file__).parent / "lm_eval_tasks"
CLOZE = "tokenmill_wikitext_cloze"
CONTINUE = "tokenmill_wikitext_continue"
NUM_CLOZE = 20
NUM_CONTINUE = 4


def wikitext_paragraphs() -> list[str]:
    path = SHARED_DATA / "wikitext2_raw_test.jsonl"
    if not path.is_file():
        pytest.fail(f"{path} not found: the shared data folder must sit next to the repository")
    with open(path) as f:
        rows = [json.loads(line)["text"].strip() for line in f]
    return [r for r in rows if r and not r.startswith("=")]  # "= Heading =" rows are titles


def cloze_docs(paragraphs: list[str], n: int) -> list[dict]:
    """The next word of a paragraph's first sentence, after at least 6 words, as the gold choice; the gold words
    of the next three items as distractors; the gold at position i % 4.

    e.g. "Robert Boulter is an English film , television and theatre actor . He ..." gives the context
    "Robert Boulter is an English film , television and theatre" and the gold choice "actor"."""
    items = []
    for text in paragraphs:
        words = text.split(" . ")[0].split()
        k = max((i for i, w in enumerate(words) if i >= 6 and w.isalpha() and len(w) >= 3), default=None)
        if k is not None and len(words[:k]) <= 40:
            items.append((" ".join(words[:k]), words[k]))
        if len(items) == n + 3:
            break
    docs = []
    for i, (context, gold) in enumerate(items[:n]):
        distractors = [w for _, w in items[i + 1 :] + items[:i] if w.lower() != gold.lower()]
        distractors = list(dict.fromkeys(distractors))[:3]
        choices = distractors[: i % 4] + [gold] + distractors[i % 4 :]
        docs.append({"context": context, "choices": choices, "label": i % 4})
    return docs


def continue_docs(paragraphs: list[str], n: int) -> list[dict]:
    """Short paragraphs (12 to 40 words) without their last 4 words: the model continues to the end of the line."""
    docs = []
    for text in paragraphs[100:]:
        words = text.split()
        if 12 <= len(words) <= 40:
            docs.append({"prompt": " ".join(words[:-4]), "target": " " + " ".join(words[-4:])})
        if len(docs) == n:
            break
    return docs


@pytest.fixture(scope="module")
def hf_tokenizer_dir(tmp_path_factory, real_model_path) -> Path:
    """transformers' tokenizer of the GGUF saved as a directory: lm_eval's huggingface backend, offline."""
    transformers = pytest.importorskip("transformers")
    out = tmp_path_factory.mktemp("smollm2_tokenizer")
    tok = transformers.AutoTokenizer.from_pretrained(str(real_model_path.parent), gguf_file=real_model_path.name)
    tok.save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def hf_tokenizer(hf_tokenizer_dir):
    import transformers

    return transformers.AutoTokenizer.from_pretrained(str(hf_tokenizer_dir))


@pytest.fixture(scope="module")
def evaluation(fp32_server, hf_tokenizer_dir, tmp_path_factory) -> dict:
    """One lm_eval run of both tasks through its Python API, as `lm-eval run --model local-completions
    --include_path tests/server/lm_eval_tasks --log_samples` runs them from a folder holding the documents."""
    from lm_eval.tasks import TaskManager

    paragraphs = wikitext_paragraphs()
    data_dir = tmp_path_factory.mktemp("lm_eval_data")
    for name, docs in ((CLOZE, cloze_docs(paragraphs, NUM_CLOZE)), (CONTINUE, continue_docs(paragraphs, NUM_CONTINUE))):
        (data_dir / f"{name}.jsonl").write_text("".join(json.dumps(d) + "\n" for d in docs))
    model_args = {
        "model": MODEL,
        "base_url": f"{fp32_server.url}/v1/completions",
        "tokenizer_backend": "huggingface",
        "tokenizer": str(hf_tokenizer_dir),
        "max_length": 512,
        "max_retries": 1,
        "timeout": 120,
    }
    with pytest.MonkeyPatch.context() as mp:
        mp.chdir(data_dir)  # the task files name their documents relative to the working directory
        mp.setenv("OPENAI_API_KEY", fp32_server.api_key)  # local-completions sends it as the bearer token
        mp.setenv("HF_DATASETS_OFFLINE", "1")
        mp.setenv("HF_HUB_OFFLINE", "1")
        mp.setenv("HF_DATASETS_CACHE", str(data_dir / "hf_datasets"))
        results = lm_eval.simple_evaluate(
            model="local-completions",
            model_args=model_args,
            tasks=[CLOZE, CONTINUE],
            task_manager=TaskManager(include_path=str(TASKS_DIR), include_defaults=False),
            batch_size=4,
            log_samples=True,
            bootstrap_iters=0,
            random_seed=None,  # leave the test process's random streams alone: nothing here samples
            numpy_random_seed=None,
            torch_random_seed=None,
        )
    assert results is not None
    return results


def hf_loglikelihood(hf, tokenizer, context: str, continuation: str) -> tuple[float, bool]:
    """What lm_eval's causal models score: the whole text tokenized, the context's tokens cut off the front, the
    continuation's log-probabilities summed, and whether each continuation token was the argmax."""
    whole = tokenizer(context + continuation, add_special_tokens=False).input_ids
    num_context = len(tokenizer(context, add_special_tokens=False).input_ids)
    with torch.no_grad():
        logprobs = hf(torch.tensor([whole])).logits[0].float().log_softmax(-1)  # [len(whole), vocab]
    rows = logprobs[num_context - 1 : len(whole) - 1]  # row i scores token i + 1
    targets = torch.tensor(whole[num_context:])
    ll = rows.gather(1, targets[:, None]).sum().item()
    return ll, bool((rows.argmax(-1) == targets).all())


def test_cloze_loglikelihoods_and_answers_equal_transformers(evaluation, hf, hf_tokenizer):
    samples = evaluation["samples"][CLOZE]
    assert len(samples) == NUM_CLOZE
    # NOTE: one torch thread for the oracle: beside a busy process on 2 cores, two OpenMP threads took 0.5-2.7 s
    # per 30-token forward here, one thread 0.13 s.
    num_threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        refs = [[hf_loglikelihood(hf, hf_tokenizer, *args[:2]) for args in s["arguments"]] for s in samples]
    finally:
        torch.set_num_threads(num_threads)
    max_delta, num_correct = 0.0, 0
    for sample, ref in zip(samples, refs):
        choices = sample["doc"]["choices"]
        assert [args[1] for args in sample["arguments"]] == [" " + c for c in choices]
        served = [resp[0] for resp in sample["resps"]]  # (loglikelihood, is_greedy) per choice
        for (ll, is_greedy), (ref_ll, ref_greedy) in zip(served, ref):
            assert ll == pytest.approx(ref_ll, abs=1e-3), sample["arguments"]
            assert is_greedy == ref_greedy, sample["arguments"]
            max_delta = max(max_delta, abs(ll - ref_ll))
        chosen = max(range(len(choices)), key=lambda i: served[i][0])
        assert chosen == max(range(len(choices)), key=lambda i: ref[i][0]), (served, ref)
        assert sample["acc"] == float(chosen == sample["target"])
        num_correct += chosen == sample["target"]
    accuracy = evaluation["results"][CLOZE]["acc,none"]
    assert accuracy == pytest.approx(num_correct / NUM_CLOZE)
    print(f"lm_eval cloze: accuracy {accuracy:.2f} over {NUM_CLOZE}, max |Δ loglikelihood| vs HF {max_delta:.2e}")
    assert accuracy > 0.25 + 1 / math.sqrt(NUM_CLOZE), "scores near chance: the echoed logprobs are off"


def test_generate_until_equals_server_greedy_completions(evaluation, fp32_server, hf_tokenizer, gguf_tokenizer):
    client = openai.OpenAI(base_url=f"{fp32_server.url}/v1", api_key=fp32_server.api_key, max_retries=0, timeout=120)
    samples = evaluation["samples"][CONTINUE]
    assert len(samples) == NUM_CONTINUE
    finish_reasons = []
    for sample in samples:
        prompt, gen_kwargs = sample["arguments"][0][:2]
        assert gen_kwargs["until"] == ["\n"] and gen_kwargs["do_sample"] is False
        # lm_eval sent transformers' token ids; the server's own tokenizer gives the same for the text
        assert hf_tokenizer(prompt, add_special_tokens=False).input_ids == gguf_tokenizer.encode(prompt)
        r = client.completions.create(
            model=MODEL, prompt=prompt, max_tokens=gen_kwargs["max_gen_toks"], temperature=0, stop=["\n"]
        )
        assert sample["resps"][0][0] == r.choices[0].text, prompt
        assert r.choices[0].text.strip()
        finish_reasons.append(r.choices[0].finish_reason)
    print(f"lm_eval generate_until: finish reasons {finish_reasons}")
