"""Markdown tables from the JSON files benchmarks/run_cpu_suite.sh writes (bench_out/ by default):

python benchmarks/report.py [bench_out]
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def load(d: Path, name: str) -> dict | None:
    p = d / name
    return json.loads(p.read_text()) if p.exists() else None


def f(x, nd=1) -> str:
    return "-" if x is None else f"{x:,.{nd}f}"


def main() -> int:
    d = Path(sys.argv[1] if len(sys.argv) > 1 else "bench_out")
    out = []
    for name in ("engine_vs_hf.json", "engine_vs_hf_tp128.json", "engine_vs_hf_fp32.json"):
        r = load(d, name)
        if not r:
            continue
        c = r["config"]
        out.append(
            f"**tokenmill vs HF transformers** (torch {r['env'].get('torch', '')}), "
            f"{c['dtype']}, {c['threads']} threads, "
            f"load average at start {tuple(round(x, 1) for x in r['env']['loadavg'])} "
            f"(`python benchmarks/engine_vs_hf.py --num-threads {c['threads']} --dtype {c['dtype']}"
            + (f" --max-output-len {c['max_output_len']}" if c.get("max_output_len") else "")
            + (f" --skip {c['skip']}" if c.get("skip") else "")
            + "`):\n"
        )
        out.append("| measure | tokenmill | HF transformers | ratio | target | met |")
        out.append("|---|---|---|---|---|---|")
        s = r.get("single_stream")
        if s:
            out.append(
                f"| single-stream decode tok/s (batch 1, {c['output_len']} new; "
                f"median of {c['repeats']} interleaved runs) "
                f"| {f(s['tokenmill_decode_tok_s'])} | {f(s['hf_decode_tok_s'])} | {s['ratio']:.2f}x "
                f"| ≥ {s['target']}x "
                f"| {'yes' if s['meets_target'] else 'no'} |"
            )
        t = r.get("throughput")
        if t:
            o, h = t["tokenmill"], t["hf"]
            out.append(
                f"| offline output tok/s ({o['num_requests']} ShareGPT prompts, {o['prompt_tokens']} prompt + "
                f"{o['output_tokens']} output tokens; HF static batches of {h['max_batch_size']}) "
                f"| {f(o['output_tok_s'])} | {f(h['output_tok_s'])} | {t['ratio']:.2f}x | ≥ {t['target']}x "
                f"| {'yes' if t['meets_target'] else 'no'} |"
            )
        out.append("")
    r = load(d, "roofline.json")
    if r:
        bw, mb = r["bandwidth"], r["model"]
        linear = " / ".join(f"{k} {v:.3f}" for k, v in r.get("linear_tflop_s", {}).items())
        out.append(
            f"**Roofline** ({r['config']['dtype']}, {r['config']['threads']} threads; `tokenmill bench roofline`): "
            f"read bandwidth {bw['read_gb_s']:.1f} GB/s (copy {bw['copy_gb_s']:.1f}), the engine's linears "
            f"{linear} TFLOP/s; "
            f"{mb['weight_bytes_per_step'] / 2**20:.0f} MiB read per decode step; single-stream bound "
            f"{r['single_stream_bound_tok_s']:.1f} tok/s, measured {f(r.get('measured_decode_tok_s'))} tok/s = "
            f"{100 * r.get('fraction_of_bound', float('nan')):.0f}% of the bound.\n"
        )
    r = load(d, "ablation.json")
    rq = load(d, "ablation_quant.json")
    if r and rq and "quantization" not in r:
        r["quantization"] = rq.get("quantization", {})
    if r:
        out.append("**Ablation** (`tokenmill bench ablation`, bf16):\n")
        out.append("| technique | workload | off → on | gain |")
        out.append("|---|---|---|---|")
        b = r.get("batching", {})
        if "speedup" in b:
            out.append(
                f"| paging + continuous batching vs static batches of {b['static_batch_size']} | {b['workload']} | "
                f"{b['static_output_tok_s']:.1f} → {b['continuous_output_tok_s']:.1f} output tok/s "
                f"| {b['speedup']:.2f}x |"
            )
        c = r.get("chunked_prefill", {})
        if "on" in c:
            on, off = c["on"], c["off"]
            out.append(
                f"| chunked prefill (budget {on['max_num_batched_tokens']}) | {c['workload']} | ITL p50 "
                f"{off['itl_p50_ms']:.0f} / p99 {off['itl_p99_ms']:.0f} / max {off['itl_max_ms']:.0f} ms → p50 "
                f"{on['itl_p50_ms']:.0f} / p99 {on['itl_p99_ms']:.0f} / max {on['itl_max_ms']:.0f} ms; p99/p50 "
                f"{off['p99_over_p50']:.1f} → {on['p99_over_p50']:.1f} "
                f"| max ITL {off['itl_max_ms'] / on['itl_max_ms']:.1f}x lower |"
            )
        p = r.get("prefix_caching", {})
        if "on" in p:
            out.append(
                f"| prefix caching | {p['workload']} "
                f"| TTFT {p['off']['mean_ttft_ms']:.0f} → {p['on']['mean_ttft_ms']:.0f} ms, "
                f"{p['off']['requests_per_s']:.2f} → {p['on']['requests_per_s']:.2f} req/s | {p['speedup']:.2f}x |"
            )
        q = r.get("quantization", {})
        for k, v in q.items():
            if isinstance(v, dict) and "speedup" in v:
                out.append(
                    f"| weight-only {k} (RTN) | batch-1 decode "
                    f"| {q['base']['decode_tok_s']:.1f} → {v['decode_tok_s']:.1f} tok/s | {v['speedup']:.2f}x |"
                )
        s = r.get("speculation", {})
        if "speedup" in s:
            out.append(
                f"| n-gram speculation (k=4) | {s['workload']} "
                f"| {s['off']['decode_tok_s']:.1f} → {s['ngram']['decode_tok_s']:.1f} tok/s | {s['speedup']:.2f}x |"
            )
        for k in ("batching", "chunked_prefill", "prefix_caching", "quantization", "speculation"):
            if r.get(k, {}).get("available") is False:
                out.append(f"| {k} | not available | {r[k]['reason'][:120]} | |")
        out.append("")
    r = load(d / "serve", "serve.json")
    if r:
        out.append(
            f"**Serving** (`tokenmill bench serve --launch-server`, {r['dataset']} prompts, {r['arrival']} arrivals; "
            f"latencies in ms; goodput SLOs {r['goodput_slos_ms']}):\n"
        )
        out.append(
            "| rate | max conc. | req/s | output tok/s | TTFT median / p99 | TPOT median / p99 "
            "| ITL median / p99 | E2EL median | goodput |"
        )
        out.append("|---|---|---|---|---|---|---|---|---|")
        for run in r["runs"]:
            m = run["metrics"]
            out.append(
                f"| {run['request_rate']:g} | {run['max_concurrency'] or '-'} | {m['request_throughput']:.2f} | "
                f"{m['output_throughput']:.1f} | {m['ttft_ms']['median']:.0f} / {m['ttft_ms']['p99']:.0f} | "
                f"{m['tpot_ms']['median']:.0f} / {m['tpot_ms']['p99']:.0f} | {m['itl_ms']['median']:.0f} / "
                f"{m['itl_ms']['p99']:.0f} | {m['e2el_ms']['median']:.0f} | {f(m['request_goodput'], 2)} |"
            )
        out.append(
            "\nPlots: `bench_out/serve/latency_vs_request_rate.png`, `bench_out/serve/throughput_vs_concurrency.png`.\n"
        )
    print("\n".join(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
