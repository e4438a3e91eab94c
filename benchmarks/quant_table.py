"""The quantization table of the README, measured on the default model in one run.

    python benchmarks/quant_table.py --ppl-windows 4 --num-calib 32      # a stated subset
    python benchmarks/quant_table.py                                     # the full protocol (slow on 2 cores)

Part 1, speed: decode tokens/s through the engine's offline LLM API, bf16 weights vs int8
(RTN, per channel) vs int4 (RTN, group 64), bf16 activations, single stream and batch 32,
side by side, plus the bytes of weights each model holds in memory.
Part 2, quality: WikiText-2 perplexity (eval/perplexity.py protocol) of the unquantized model and
RTN / GPTQ / AWQ at 3 and 4 bits (group 64) and 8 bits (per channel), size on disk, quantization
time. Every finished row is appended to <work-dir>/results.jsonl, so a rerun resumes.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from tokenmill.eval.perplexity import evaluate_perplexity, wikitext2_ids  # noqa: E402
from tokenmill.models.loader import load_model, resolve_model_path  # noqa: E402
from tokenmill.quant.calibration import calibration_windows, default_data_dir, read_jsonl_texts  # noqa: E402
from tokenmill.quant.kernels import quantized_nbytes  # noqa: E402
from tokenmill.quant.pipeline import QuantConfig, quantize_model  # noqa: E402
from tokenmill.quant.save import save_quantized  # noqa: E402

MODEL = "smollm2-135m"
PPL_ROWS = [
    ("rtn", 4, 64),
    ("rtn", 3, 64),
    ("gptq", 4, 64),
    ("gptq", 3, 64),
    ("awq", 4, 64),
    ("awq", 3, 64),
    ("rtn", 8, -1),
    ("gptq", 8, -1),
    ("awq", 8, -1),
]


def dir_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.iterdir() if f.is_file() and f.suffix == ".safetensors")


def load_results(path: Path) -> dict[str, dict]:
    if not path.is_file():
        return {}
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return {r["key"]: r for r in rows}


def append_result(path: Path, row: dict) -> None:
    with open(path, "a") as f:
        f.write(json.dumps(row) + "\n")
    print(json.dumps(row), flush=True)


def quantize_to_dir(method: str, bits: int, group: int, out: Path, calib: torch.Tensor | None, sym: bool = False):
    loaded = load_model(MODEL, dtype=torch.float32)
    qcfg = QuantConfig(method=method, bits=bits, group_size=group, sym=sym)
    report = quantize_model(loaded.model, qcfg, calib if method != "rtn" else None)
    save_quantized(loaded.model, loaded.config, loaded.tokenizer, report.weights, qcfg.resolved_format, out, qcfg.sym)
    return loaded, report, qcfg


def speed_part(args, work: Path, results: Path, done: dict) -> None:
    from tokenmill.engine.llm import LLM
    from tokenmill.sampling_params import SamplingParams

    int8_dir, int4_dir = work / "speed_rtn_w8", work / "speed_rtn_w4g64"
    if not (int8_dir / "config.json").is_file():
        quantize_to_dir("rtn", 8, -1, int8_dir, None, sym=True)
    if not (int4_dir / "config.json").is_file():
        quantize_to_dir("rtn", 4, 64, int4_dir, None)
    models = {"bf16": MODEL, "int8 (w8 per-channel)": str(int8_dir), "int4 (w4 g64)": str(int4_dir)}
    prompts = [f"Write a short story about a robot number {i} who learns to paint." for i in range(args.batch)]
    # All three engines live at once and are timed in interleaved rounds (bf16, int8, int4, bf16, ...):
    # the host's speed drifts by tens of percent within minutes, and a drift must hit every model alike.
    # The figure kept is the median round.
    llms, weight_bytes = {}, {}
    for label, path in models.items():
        llms[label] = LLM(
            model=path,
            dtype="bfloat16",
            max_num_seqs=max(args.batch, 1),
            max_model_len=512,
            enable_prefix_caching=False,
        )
        weight_bytes[label] = quantized_nbytes(llms[label].engine.model)
        llms[label].generate(
            prompts[:2], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), use_tqdm=False
        )  # warm-up
    sp = SamplingParams(temperature=0, max_tokens=args.decode_tokens, ignore_eos=True)
    runs: dict[tuple[str, int], list[float]] = {}
    for _ in range(args.speed_rounds):
        for label, llm in llms.items():
            for batch in (1, args.batch):
                if f"speed|{label}|{batch}" in done:
                    continue
                t0 = time.perf_counter()
                outs = llm.generate(prompts[:batch], sp, use_tqdm=False)
                dt = time.perf_counter() - t0
                n = sum(len(o.outputs[0].token_ids) for o in outs)
                runs.setdefault((label, batch), []).append(n / dt)
    for (label, batch), tps in runs.items():
        append_result(
            results,
            {
                "key": f"speed|{label}|{batch}",
                "model": label,
                "batch": batch,
                "tokens": batch * args.decode_tokens,
                "tok_per_s": statistics.median(tps),
                "rounds": tps,
                "weight_bytes": weight_bytes[label],
                "loadavg": os.getloadavg()[0],
            },
        )
    del llms


def ppl_part(args, work: Path, results: Path, done: dict) -> None:
    ids = None
    calib: dict[int, torch.Tensor] = {}
    texts = read_jsonl_texts(Path(args.data_dir) / "c4_en_train_00000_first1000.jsonl")
    rows = [("fp32", 0, 0)] + [
        r for r in PPL_ROWS if (not args.methods or r[0] in args.methods) and (not args.bits or r[1] in args.bits)
    ]
    for method, bits, group in rows:
        num_calib = {"rtn": 0, "fp32": 0, "awq": args.awq_num_calib or args.num_calib}.get(method, args.num_calib)
        key = f"ppl|{method}|{bits}|{group}|{args.ppl_windows}|{num_calib}x{args.calib_seqlen}"
        if key in done:
            continue
        t0 = time.perf_counter()
        if method == "fp32":
            loaded = load_model(MODEL, dtype=torch.float32)
            qsec, size = 0.0, resolve_model_path(MODEL).stat().st_size
        else:
            if num_calib and num_calib not in calib:
                tok = load_model(MODEL, dtype=torch.float32).tokenizer
                calib[num_calib] = calibration_windows(
                    texts, lambda s, tok=tok: tok.encode(s, add_special_tokens=False), num_calib, args.calib_seqlen, 0
                )
            out = work / f"{method}_w{bits}_g{group}"
            loaded, report, _ = quantize_to_dir(method, bits, group, out, calib.get(num_calib))
            qsec, size = report.seconds, dir_bytes(out)
        if ids is None:
            ids = wikitext2_ids(
                lambda s, loaded=loaded: loaded.tokenizer.encode(s, add_special_tokens=False),
                Path(args.data_dir) / "wikitext2_raw_test.jsonl",
            )
        res = evaluate_perplexity(loaded.model, ids, 2048, args.ppl_windows)
        append_result(
            results,
            {
                "key": key,
                "method": method,
                "bits": bits,
                "group_size": group,
                "ppl": res.perplexity,
                "mean_nll": res.mean_nll,
                "windows": res.num_windows,
                "total_windows": res.total_windows,
                "quant_seconds": qsec,
                "eval_seconds": res.seconds,
                "bytes_on_disk": size,
                "num_calib": num_calib,
                "calib_seqlen": args.calib_seqlen,
                "wall_seconds": time.perf_counter() - t0,
                "loadavg": os.getloadavg()[0],
            },
        )


def render(results: Path) -> str:
    rows = list(load_results(results).values())
    lines = []
    ppl = [r for r in rows if r["key"].startswith("ppl|")]
    if ppl:
        fp = next((r["ppl"] for r in ppl if r["method"] == "fp32"), None)
        lines += [
            "| method | bits | group | WikiText-2 ppl | windows | Δ vs fp32 | recovered of RTN's loss "
            "| size on disk (MB) | quantize time (s) |",
            "|---|---|---|---|---|---|---|---|---|",
        ]
        rtn = {r["bits"]: r["ppl"] for r in ppl if r["method"] == "rtn"}
        for r in ppl:
            delta = "" if fp is None else f"{r['ppl'] - fp:+.3f}"
            rec = ""
            if fp is not None and r["method"] in ("gptq", "awq") and r["bits"] in rtn and rtn[r["bits"]] != fp:
                rec = f"{100 * (rtn[r['bits']] - r['ppl']) / (rtn[r['bits']] - fp):.0f}%"
            grp = "-" if r["method"] == "fp32" else ("channel" if r["group_size"] == -1 else r["group_size"])
            lines.append(
                f"| {r['method']} | {r['bits'] or 32} | {grp} | {r['ppl']:.3f} | {r['windows']}/{r['total_windows']} "
                f"| {delta} | {rec} | {r['bytes_on_disk'] / 1e6:.1f} | {r['quant_seconds']:.0f} |"
            )
    speed = [r for r in rows if r["key"].startswith("speed|")]
    if speed:
        base = {r["batch"]: r["tok_per_s"] for r in speed if r["model"] == "bf16"}
        lines += [
            "",
            "| weights | batch | decode tok/s | vs bf16 | weight bytes in memory (MB) |",
            "|---|---|---|---|---|",
        ]
        for r in speed:
            rel = f"{r['tok_per_s'] / base[r['batch']]:.2f}x" if r["batch"] in base else ""
            lines.append(
                f"| {r['model']} | {r['batch']} | {r['tok_per_s']:.1f} | {rel} | {r['weight_bytes'] / 1e6:.1f} |"
            )
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data-dir", default=str(default_data_dir()), help="Directory with the WikiText-2 and C4 files.")
    ap.add_argument(
        "--work-dir", default=None, help="Where quantized models and results.jsonl go (default: a temp dir)."
    )
    ap.add_argument(
        "--ppl-windows", type=int, default=None, help="Score the first N 2048-token windows (default: all)."
    )
    ap.add_argument("--num-calib", type=int, default=128, help="Calibration windows (GPTQ, AWQ).")
    ap.add_argument("--calib-seqlen", type=int, default=512)
    ap.add_argument(
        "--awq-num-calib", type=int, default=None, help="Calibration windows for AWQ (default: --num-calib)."
    )
    ap.add_argument("--methods", nargs="*", default=None, help="Subset of rtn gptq awq.")
    ap.add_argument("--bits", nargs="*", type=int, default=None, help="Subset of 3 4 8.")
    ap.add_argument("--decode-tokens", type=int, default=64)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--speed-rounds", type=int, default=3, help="Interleaved timing rounds; the median is kept.")
    ap.add_argument("--skip-speed", action="store_true")
    ap.add_argument("--skip-ppl", action="store_true")
    ap.add_argument("--render-only", action="store_true")
    ap.add_argument("--threads", type=int, default=None, help="torch intra-op threads for the whole run.")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    work = Path(args.work_dir or tempfile.mkdtemp(prefix="tokenmill_quant_"))
    work.mkdir(parents=True, exist_ok=True)
    results = work / "results.jsonl"
    if not args.render_only:
        done = load_results(results)
        if not args.skip_speed:
            speed_part(args, work, results, done)
        if not args.skip_ppl:
            ppl_part(args, work, results, done)
    table = render(results)
    (work / "table.md").write_text(table + "\n")
    print(table)


if __name__ == "__main__":
    main()
