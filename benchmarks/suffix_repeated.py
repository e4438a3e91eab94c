"""A repeated-task workload for speculation's online suffix store (spec_decode/suffix.py): the same kind of request
again and again, as an agent sends it, one at a time (batch 1, greedy), on the default model.

Each request asks for one record as JSON, about another person; the answers share their skeleton, which neither
a new prompt nor the offline datastore (answers to ShareGPT chats) holds. Three engines in one process, each
with its own store, take the requests round-robin (request i on every engine before request i + 1, so a noisy
neighbour hits all three alike):

    plain          no speculation
    offline        {"method": "ngram", "datastore": FILE}       prompt lookup + the offline datastore
    suffix         {"method": "suffix", "datastore": FILE}      + the online store of this engine's own answers

    python benchmarks/suffix_repeated.py --datastore smollm2-datastore.npz --num-requests 32 --out /tmp/suffix.json

Without --datastore both speculative engines run without the offline seed (then "offline" is prompt lookup
alone). Reported: output tok/s over all requests, mean acceptance length, the online store's tokens held against
its bound, and suffix / offline.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

NAMES = ["Alice", "Bruno", "Chen", "Dana", "Emeka", "Farah", "Goran", "Hana", "Ivan", "Jia", "Kofi", "Lena"]
CITIES = ["Lisbon", "Osaka", "Lagos", "Quito", "Oslo", "Perth", "Cairo", "Austin"]
JOBS = ["nurse", "pilot", "baker", "teacher", "engineer", "farmer"]


def prompts(n: int) -> list[str]:
    out = []
    for i in range(n):
        name, city, job = NAMES[i % len(NAMES)], CITIES[(i * 5) % len(CITIES)], JOBS[(i * 7) % len(JOBS)]
        age = 21 + (i * 11) % 50
        out.append(
            f"Return a JSON object with the keys name, age, city, job and email for this person: {name}, {age} "
            f"years old, a {job} living in {city}. Answer with the JSON only."
        )
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--datastore", default=None, help="the offline datastore (tokenmill build-datastore)")
    ap.add_argument("--num-requests", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--gamma", type=int, default=5)
    ap.add_argument("--suffix-max-tokens", type=int, default=65536)
    ap.add_argument("--num-threads", type=int, default=2)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()

    import torch

    from tokenmill import LLM, SamplingParams

    torch.set_num_threads(args.num_threads)
    seed = {"datastore": args.datastore} if args.datastore else {}
    configs: dict[str, dict | None] = {
        "plain": None,
        "offline": {"method": "ngram", "num_speculative_tokens": args.gamma, **seed},
        "suffix": {
            "method": "suffix",
            "num_speculative_tokens": args.gamma,
            "suffix_max_tokens": args.suffix_max_tokens,
            **seed,
        },
    }
    engines = {name: LLM(args.model, speculative_config=cfg) for name, cfg in configs.items()}
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens)
    seconds = dict.fromkeys(engines, 0.0)
    tokens = dict.fromkeys(engines, 0)
    outputs: dict[str, list[list[int]]] = {name: [] for name in engines}
    for text in prompts(args.num_requests):
        for name, llm in engines.items():
            t0 = time.perf_counter()
            out = llm.chat([{"role": "user", "content": text}], params, use_tqdm=False)[0].outputs[0]
            seconds[name] += time.perf_counter() - t0
            tokens[name] += len(out.token_ids)
            outputs[name].append(list(out.token_ids))
    result: dict = {"model": args.model, "num_requests": args.num_requests, "datastore": args.datastore}
    for name, llm in engines.items():
        row = {"output_tokens": tokens[name], "seconds": seconds[name], "tok_s": tokens[name] / seconds[name]}
        if configs[name] is not None:
            spec = llm.stats().spec_decode
            row["mean_acceptance_length"] = spec.get("mean_acceptance_length")
            row["identical_to_plain"] = outputs[name] == outputs["plain"]
        result[name] = row
    online = engines["suffix"].engine.executor.runner.speculator.proposer.online
    assert online is not None
    result["suffix"]["tokens_held"] = online.tokens_held
    result["suffix"]["max_tokens"] = online.max_tokens
    result["suffix_vs_offline"] = result["suffix"]["tok_s"] / result["offline"]["tok_s"]
    result["suffix_vs_plain"] = result["suffix"]["tok_s"] / result["plain"]["tok_s"]
    result["offline_vs_plain"] = result["offline"]["tok_s"] / result["plain"]["tok_s"]
    print(json.dumps(result, indent=1))
    if args.out:
        args.out.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
