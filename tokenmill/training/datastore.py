"""`tokenmill build-datastore`: the target answers ShareGPT prompts greedily; its answers become the
n-gram proposer's suffix datastore (spec_decode/datastore.py).

The prompts are rows 1000 onward of the seed-0 shuffle, as for `tokenmill train-eagle`;
benchmarks/spec_decode.py draws its prompts from the front and never reaches row 1000.
Only answer tokens are stored; prompts are not the target's words.

    tokenmill build-datastore --out smollm2-datastore.npz          # ~3,300 answers, ~10 min on 2 cores
    LLM(..., speculative_config={"method": "ngram", "num_speculative_tokens": 5,
                                 "datastore": "smollm2-datastore.npz"})
"""

from __future__ import annotations

import json
import time
from pathlib import Path


def main(
    model: str,
    out: str,
    sharegpt: str,
    num_prompts: int = 3300,
    max_tokens: int = 192,
    min_n: int = 2,
    max_n: int = 6,
    threads: int | None = None,
) -> dict:
    import torch

    from tokenmill import LLM
    from tokenmill.spec_decode.datastore import SuffixDatastore
    from tokenmill.training.eagle import generate_corpus

    if threads:
        torch.set_num_threads(threads)
    t0 = time.perf_counter()
    llm = LLM(model, dtype="bfloat16", enable_prefix_caching=False)
    corpus = generate_corpus(llm, sharegpt, num_prompts, max_tokens)
    answers = [s[p:] for s, p in zip(corpus.sequences, corpus.prompt_lens)]
    SuffixDatastore.save(out, answers, min_n, max_n)
    stats = {
        "out": out,
        "answers": len(answers),
        "tokens": sum(len(a) for a in answers),
        "seconds": round(time.perf_counter() - t0, 1),
        "min_n": min_n,
        "max_n": max_n,
    }
    print(json.dumps(stats))
    return stats


def add_arguments(p) -> None:
    from tokenmill.training.eagle import add_corpus_arguments

    add_corpus_arguments(p)
    p.add_argument("--out", required=True, help="the datastore file (.npz)")
    p.add_argument("--min-n", type=int, default=2, help="shortest context looked up")
    p.add_argument("--max-n", type=int, default=6, help="longest context looked up")


def run(args) -> int:
    if not Path(args.sharegpt).is_file():
        raise ValueError(f"{args.sharegpt}: ShareGPT file not found (pass --sharegpt)")
    main(args.model, args.out, args.sharegpt, args.num_prompts, args.max_tokens, args.min_n, args.max_n, args.threads)
    return 0
