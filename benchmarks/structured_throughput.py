"""Decode throughput with a JSON schema vs none, at batch 1 and 32, in one run (offline engine, default model).

    .venv/bin/python benchmarks/structured_throughput.py [--dtype bfloat16] [--rounds 2] [--tokens 128]

Each request decodes exactly --tokens tokens (temperature 0, ignore_eos): the schema asks for a list of
80 strings (two tokens or more each), longer than --tokens, so constrained requests end at max_tokens like the
free ones and both sides decode the same number of tokens. Conditions alternate (none, schema, schema, none, ...)
so drift falls on both; reported: output tok/s medians, their ratio, and the grammar's share of the step (masks
computed).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tokenmill import LLM, SamplingParams  # noqa: E402
from tokenmill.bench.common import environment, format_table, write_json  # noqa: E402
from tokenmill.sampling_params import StructuredOutputs  # noqa: E402

SCHEMA = {
    "type": "object",
    "properties": {
        "cities": {"type": "array", "minItems": 80, "maxItems": 80, "items": {"type": "string", "maxLength": 24}}
    },
    "required": ["cities"],
    "additionalProperties": False,
}
PROMPT = "List eighty European cities as JSON."


def timed(llm: LLM, batch: int, tokens: int, constrained: bool) -> dict:
    so = StructuredOutputs(json=SCHEMA) if constrained else None
    params = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True, structured_outputs=so)
    prompts = [
        {"prompt": llm.tokenizer.apply_chat_template([{"role": "user", "content": f"{PROMPT} ({i})"}])}
        for i in range(batch)
    ]
    m0 = llm.stats().num_grammar_masks
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    dt = time.perf_counter() - t0
    n = sum(len(o.outputs[0].token_ids) for o in outs)
    assert all(len(o.outputs[0].token_ids) == tokens for o in outs), "a reply ended before max_tokens"
    return {"tok_s": n / dt, "seconds": dt, "tokens": n, "masks": llm.stats().num_grammar_masks - m0}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--tokens", type=int, default=128)
    p.add_argument("--batches", default="1,32")
    p.add_argument("--output-json", default="bench_out/structured_throughput.json")
    args = p.parse_args()
    llm = LLM(dtype=args.dtype, max_num_seqs=32, max_model_len=1024)
    timed(llm, 2, 16, True)  # warm-up: the grammar tokenizer is built on first use
    timed(llm, 2, 16, False)
    res: dict = {}
    rows = []
    for b in [int(x) for x in args.batches.split(",")]:
        runs: dict[str, list[dict]] = {"none": [], "json_schema": []}
        for r in range(args.rounds):
            order = ("none", "json_schema") if r % 2 == 0 else ("json_schema", "none")
            for cond in order:
                runs[cond].append(timed(llm, b, args.tokens, cond == "json_schema"))
        med = {c: statistics.median(x["tok_s"] for x in v) for c, v in runs.items()}
        res[b] = {"runs": runs, "median_tok_s": med, "ratio": med["json_schema"] / med["none"]}
        rows.append([b, med["none"], med["json_schema"], res[b]["ratio"], runs["json_schema"][0]["masks"]])
        print(f"batch {b}: none {med['none']:.1f} tok/s, json_schema {med['json_schema']:.1f} tok/s", flush=True)
    print(format_table(["batch", "none tok/s", "json_schema tok/s", "schema / none", "masks per run"], rows))
    write_json(args.output_json, {"env": environment(), "args": vars(args), "results": res})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
