"""Run-to-run spread of our GPTQ (docs/gptq_vs_autogptq.md, "Update 2026-11-30").

Reruns our shipped GPTQ (4 bits, group 64, asymmetric, damp 0.01) on the calibration windows of
`benchmarks/research_code_compare.py prepare` (<work>/calib.pt, the windows AutoGPTQ was fed), with
one float-level perturbation per run: windows per forward batch, and/or the windows' order (H is a
sum over windows, so both change only its summation order). Each run's weights are dequantized into
the fp32 model and scored on the first 40 and 8 WikiText-2 windows (<work>/wikitext2_ids.pt).
Appends one JSON line per run to <work>/spread.jsonl. ~15 CPU-min per run at 1 thread.

    python benchmarks/research_code_compare.py prepare --work-dir W
    python benchmarks/gptq_spread.py --work-dir W --runs b4:none b8:1 b8:2 --threads 1
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from tokenmill.eval.perplexity import evaluate_perplexity
from tokenmill.models.loader import load_model
from tokenmill.quant.pipeline import QuantConfig, gptq_quantize_layers


def one_run(work: Path, batch: int, perm_seed: int | None) -> dict:
    model = load_model(str(work / "base-hf"), dtype=torch.float32, load_tokenizer=False).model
    calib = torch.load(work / "calib.pt")
    if perm_seed is not None:
        calib = calib[torch.randperm(calib.shape[0], generator=torch.Generator().manual_seed(perm_seed))]
    cfg = QuantConfig(method="gptq", bits=4, group_size=64, sym=False, damp_percent=0.01, batch_size=batch)
    t0 = time.process_time()
    weights = gptq_quantize_layers(model, cfg, calib, progress=False)
    quant_s = time.process_time() - t0
    modules = dict(model.named_modules())
    for name, qw in weights.items():
        modules[name].weight.data = qw.dequantize().to(torch.float32)
    ids = torch.load(work / "wikitext2_ids.pt")
    with torch.inference_mode():
        r40 = evaluate_perplexity(model, ids, 2048, 40, progress=False)
        r8 = evaluate_perplexity(model, ids, 2048, 8, progress=False)
    return {
        "batch": batch,
        "perm_seed": perm_seed,
        "ppl_first_40": r40.perplexity,
        "ppl_first_8": r8.perplexity,
        "quant_cpu_s": round(quant_s, 1),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--work-dir", required=True, help="research_code_compare.py's work dir (after prepare)")
    ap.add_argument(
        "--runs",
        nargs="+",
        default=["b4:none", "b8:1", "b8:2"],
        help="BATCH:SEED per run; SEED none keeps the windows' order",
    )
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    work = Path(args.work_dir)
    for spec in args.runs:
        b, seed = spec.split(":")
        row = one_run(work, int(b.lstrip("b")), None if seed == "none" else int(seed))
        print(json.dumps(row), flush=True)
        with open(work / "spread.jsonl", "a") as f:
            f.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()
