"""llguidance vs xgrammar on this project's tokenizer: set-up, schema compile and per-token mask time, one run.

    .venv/bin/python benchmarks/grammar_backends.py [--schemas 20] [--repeat 3]

For each JSON schema (a fixed family: flat, nested, enums, arrays, numbers) both engines compile it, then walk
the tokens of one valid instance (json.dumps, tokenized by the default model's tokenizer): at every position
the allowed-token bitmask is computed and the next token accepted. Reported: tokenizer set-up (once per
engine), compile ms per schema (median), mask µs per token (median over positions, all schemas) and how many
instance tokens each engine accepted (both must accept all). xgrammar is a benchmark peer here, not a
dependency: install it with `pip install --no-deps xgrammar apache-tvm-ffi` (its declared dependencies
include triton and transformers).
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tokenmill.bench.common import environment, format_table, write_json  # noqa: E402
from tokenmill.bench.serve import load_tokenizer  # noqa: E402


def schema_and_instance(rng: random.Random, depth: int = 0) -> tuple[dict, object]:
    kind = rng.choice(["str", "int", "enum", "bool", "arr"] + (["obj", "obj"] if depth < 2 else []))
    if kind == "str":
        word = rng.choice(["alpha", "Berlin", "blue sky", "x-12", "über"])
        return {"type": "string", "maxLength": 16}, word
    if kind == "int":
        return {"type": "integer", "minimum": 0, "maximum": 10_000}, rng.randint(0, 10_000)
    if kind == "enum":
        opts = rng.sample(["red", "green", "blue", "cyan"], 3)
        return {"enum": opts}, opts[0]
    if kind == "bool":
        return {"type": "boolean"}, rng.random() < 0.5
    if kind == "arr":
        item, value = schema_and_instance(rng, depth + 1)
        return {"type": "array", "items": item, "maxItems": 4}, [value, value]
    props = {f"field_{i}": schema_and_instance(rng, depth + 1) for i in range(rng.randint(2, 4))}
    return (
        {
            "type": "object",
            "properties": {k: s for k, (s, _) in props.items()},
            "required": sorted(props),
            "additionalProperties": False,
        },
        {k: v for k, (_, v) in props.items()},
    )


def walk_llguidance(tok, vocab: int, schema: dict, tokens: list[int]):
    import llguidance

    t0 = time.perf_counter()
    grammar = llguidance.LLMatcher.grammar_from_json_schema(schema, defaults={"whitespace_flexible": False})
    m = llguidance.LLMatcher(tok, grammar, log_level=0)
    compile_s = time.perf_counter() - t0
    mask = np.zeros((vocab + 31) // 32, dtype=np.int32)
    times, accepted = [], 0
    for t in tokens:
        t1 = time.perf_counter()
        m.unsafe_compute_mask_ptr(mask.ctypes.data, mask.nbytes)
        times.append(time.perf_counter() - t1)
        if not (mask[t // 32] >> (t % 32)) & 1 or not m.consume_token(t):
            break
        accepted += 1
    return compile_s, times, accepted


def walk_xgrammar(compiler, vocab: int, schema: dict, tokens: list[int]):
    import xgrammar as xgr

    t0 = time.perf_counter()
    cg = compiler.compile_json_schema(json.dumps(schema), any_whitespace=False, separators=(",", ":"))
    m = xgr.GrammarMatcher(cg)
    compile_s = time.perf_counter() - t0
    mask = xgr.allocate_token_bitmask(1, vocab)
    times, accepted = [], 0
    for t in tokens:
        t1 = time.perf_counter()
        m.fill_next_token_bitmask(mask)
        times.append(time.perf_counter() - t1)
        if not (int(mask[0, t // 32]) >> (t % 32)) & 1 or not m.accept_token(t):
            break
        accepted += 1
    return compile_s, times, accepted


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--schemas", type=int, default=20)
    p.add_argument("--repeat", type=int, default=3, help="walks per schema and engine (fresh matcher each)")
    p.add_argument("--output-json", default="bench_out/grammar_backends.json")
    args = p.parse_args()
    tokenizer = load_tokenizer("smollm2-135m")
    vocab = tokenizer.vocab_size
    rng = random.Random(7)
    cases = []
    for _ in range(args.schemas):
        schema, inst = schema_and_instance(rng)
        if not isinstance(inst, dict):
            schema, inst = (
                {"type": "object", "properties": {"v": schema}, "required": ["v"], "additionalProperties": False},
                {"v": inst},
            )
        text = json.dumps(inst, ensure_ascii=False, separators=(",", ":"))  # compact, as both grammars are set
        cases.append((schema, tokenizer.encode(text, add_special_tokens=False)))
    res: dict = {}
    import llguidance

    t0 = time.perf_counter()
    ll_tok = llguidance.LLTokenizer(tokenizer.hf.to_str(), n_vocab=vocab, eos_token=[tokenizer.eos_token_id])
    res["llguidance"] = {"setup_s": time.perf_counter() - t0}
    engines = {"llguidance": lambda s, t: walk_llguidance(ll_tok, vocab, s, t)}
    try:
        import transformers
        import xgrammar as xgr
    except ImportError as e:
        res["xgrammar"] = {"available": False, "reason": f"not installed ({e})"}
    else:
        t0 = time.perf_counter()
        hf = transformers.PreTrainedTokenizerFast(tokenizer_object=tokenizer.hf)
        info = xgr.TokenizerInfo.from_huggingface(hf, vocab_size=vocab, stop_token_ids=[tokenizer.eos_token_id])
        compiler = xgr.GrammarCompiler(info, cache_enabled=False)
        res["xgrammar"] = {"setup_s": time.perf_counter() - t0}
        engines["xgrammar"] = lambda s, t: walk_xgrammar(compiler, vocab, s, t)
    for name, walk in engines.items():
        compiles, per_token, accepted, total = [], [], 0, 0
        for _ in range(args.repeat):
            for schema, toks in cases:
                c, times, a = walk(schema, toks)
                compiles.append(c)
                per_token += times
                accepted += a
                total += len(toks)
        res[name].update(
            compile_ms_median=statistics.median(compiles) * 1e3,
            mask_us_median=statistics.median(per_token) * 1e6,
            mask_us_p99=float(np.percentile(per_token, 99)) * 1e6,
            tokens_accepted=accepted,
            tokens_total=total,
        )
    rows = [
        [
            n,
            r.get("setup_s", float("nan")),
            r.get("compile_ms_median", float("nan")),
            r.get("mask_us_median", float("nan")),
            r.get("mask_us_p99", float("nan")),
            f"{r.get('tokens_accepted', 0)}/{r.get('tokens_total', 0)}",
        ]
        if r.get("available", True)
        else [n, r["reason"], "", "", "", ""]
        for n, r in res.items()
    ]
    print(format_table(["engine", "setup s", "compile ms p50", "mask µs/token p50", "mask µs p99", "accepted"], rows))
    print(f"({args.schemas} schemas x {args.repeat} walks, vocabulary {vocab}, one thread)")
    write_json(args.output_json, {"env": environment(), "args": vars(args), "results": res})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
