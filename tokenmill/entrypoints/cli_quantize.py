"""`tokenmill quantize --method rtn|gptq|awq --bits 4 --group-size 64 [--lm-head] --calib FILE --out DIR`."""

from __future__ import annotations

import argparse
import json
import logging
from dataclasses import fields

import torch

log = logging.getLogger("tokenmill.quantize")

C4_FILE = "c4_en_train_00000_first1000.jsonl"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="smollm2-135m", help="Model to quantize (GGUF, HF dir or alias).")
    parser.add_argument("--method", choices=["rtn", "gptq", "awq"], default="gptq", help="Quantization algorithm.")
    parser.add_argument("--bits", type=int, default=4, choices=[2, 3, 4, 8], help="Bits per weight.")
    parser.add_argument(
        "--group-size",
        type=int,
        default=64,
        help="Input columns per scale/zero group; -1 per channel. 64 suits hidden size 576.",
    )
    parser.add_argument("--sym", action="store_true", help="Symmetric grid (default: asymmetric).")
    parser.add_argument("--desc-act", action="store_true", help="GPTQ act-order.")
    parser.add_argument("--static-groups", action="store_true", help="GPTQ: group grids fitted up front.")
    parser.add_argument("--damp-percent", type=float, default=0.01, help="GPTQ Hessian dampening.")
    parser.add_argument(
        "--format",
        choices=["auto", "gptq", "awq"],
        default="auto",
        help="Checkpoint format (auto: awq for 4-bit AWQ, gptq otherwise).",
    )
    parser.add_argument(
        "--lm-head",
        action="store_true",
        help="Also quantize the LM head (for tied embeddings the shared table; same bits and group "
        "size), after the decoder layers: GPTQ with the Hessian of the final hidden states of "
        "the quantized model on the calibration windows for --method gptq and awq, RTN for rtn. "
        'Saved as lm_head.qweight/qzeros/scales/g_idx with "lm_head": true (GPTQ layout '
        "only: with --method awq add --format gptq); the fp16 embedding stays in the file. "
        "Default: off (head kept in fp16).",
    )
    parser.add_argument(
        "--calib",
        default=None,
        help=f"Calibration JSONL with a 'text' field (default: ../shared/data/{C4_FILE} next to the repository).",
    )
    parser.add_argument("--num-calib", type=int, default=128, help="Calibration windows.")
    parser.add_argument("--calib-seqlen", type=int, default=512, help="Tokens per calibration window.")
    parser.add_argument("--seed", type=int, default=0, help="Seed of the window draw.")
    parser.add_argument("--threads", type=int, default=None, help="torch intra-op threads.")
    parser.add_argument("--out", required=True, help="Output directory (Hugging Face layout).")


def run(args: argparse.Namespace) -> int:
    from tokenmill.models.loader import load_model
    from tokenmill.quant.calibration import calibration_windows, default_data_dir, read_jsonl_texts
    from tokenmill.quant.pipeline import QuantConfig, quantize_model
    from tokenmill.quant.save import save_quantized

    if args.threads:
        torch.set_num_threads(args.threads)
    qcfg = QuantConfig(
        method=args.method,
        bits=args.bits,
        group_size=args.group_size,
        sym=args.sym,
        desc_act=args.desc_act,
        static_groups=args.static_groups,
        damp_percent=args.damp_percent,
        format=args.format,
        lm_head=args.lm_head,
    )
    loaded = load_model(args.model, dtype=torch.float32, gguf_dequantize=True)  # quantizers read dense weights
    calib = None
    if qcfg.method != "rtn":
        texts = read_jsonl_texts(args.calib or default_data_dir() / C4_FILE)
        calib = calibration_windows(
            texts,
            lambda s: loaded.tokenizer.encode(s, add_special_tokens=False),
            args.num_calib,
            args.calib_seqlen,
            args.seed,
        )
    report = quantize_model(loaded.model, qcfg, calib)
    out = save_quantized(
        loaded.model,
        loaded.config,
        loaded.tokenizer,
        report.weights,
        qcfg.resolved_format,
        args.out,
        qcfg.sym,
        qcfg.desc_act,
        qcfg.static_groups,
        qcfg.damp_percent,
    )
    size = sum(f.stat().st_size for f in out.iterdir() if f.is_file())
    summary = {
        "out": str(out),
        "seconds": round(report.seconds, 1),
        "lm_head_seconds": round(report.head_seconds, 1),
        "bytes_on_disk": size,
        **{f.name: getattr(qcfg, f.name) for f in fields(qcfg)},
        "format": qcfg.resolved_format,
        "num_calib": 0 if calib is None else calib.shape[0],
        "calib_seqlen": args.calib_seqlen,
    }
    print(json.dumps(summary))
    return 0
