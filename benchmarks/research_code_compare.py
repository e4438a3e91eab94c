"""Our GPTQ / AWQ against the research code's maintained descendants, on the same model, data and protocol.

The original research repositories (IST-DASLab/gptq, mit-han-lab/llm-awq) are not packaged; their
maintained descendants are: AutoGPTQ (`auto-gptq` 0.7.1) and AutoAWQ (`autoawq` 0.2.9). Both are
CUDA-first and pin old transformers, so they run in a SEPARATE virtual environment and this script
drives them through that environment's python. Everything tokenmill does (calibration windows,
loading their checkpoints, perplexity) runs in the project's own environment.

Steps (all outputs under --work-dir, results appended as JSON lines to <work-dir>/results.jsonl):

  prepare    [tokenmill venv]  GGUF model -> HF safetensors fp32 dir (<work>/base-hf) via transformers;
                               the calibration windows of our pipeline (calibration_windows(C4, 128, 512,
                               seed 0), GGUF tokenizer, no BOS) -> <work>/calib.pt; WikiText-2 test ids of
                               our protocol -> <work>/wikitext2_ids.pt
  autoawq    [research venv]   AutoAWQ, defaults (zero_point, GEMM, duo_scaling, clip) at 4 bits / group 64,
                               fed the same windows as pre-tokenized lists -> <work>/autoawq_w4_g64
  autogptq   [research venv]   AutoGPTQ, 4 bits / group 64 / asymmetric / no act-order / damp 0.01 /
                               true-sequential, fed the same windows -> <work>/autogptq_w4_g64 (GPTQ v1)
  crosscheck [research venv]   their own dequantization of their checkpoint (AutoAWQ `dequantize_gemm`,
                               AutoGPTQ's QuantLinear CPU path) put into a transformers fp32 Llama, and the
                               perplexity of the first --crosscheck-windows windows with transformers' forward
  evaluate   [tokenmill venv]  tokenmill.models.loader.load_model(<dir>) on each checkpoint, WikiText-2
                               perplexity (evaluate_perplexity, 2048-token windows, --ppl-windows of them, fp32;
                               also the first --prefix-windows / --crosscheck-windows windows), and how far
                               tokenmill's decoded weights are from the research code's own weights. A load
                               error is recorded; for AutoGPTQ's all-zero biases (see below) the checkpoint is
                               then evaluated from a copy without them (<dir>-zero-bias-stripped)
  ours       [tokenmill venv]  optional: our pipeline (--method gptq|awq) on exactly the same windows, e.g.
                               the first --awq-num-calib of them, AWQ with duo_scaling like AutoAWQ's default
  all        [tokenmill venv]  prepare, autoawq, autogptq, crosscheck, evaluate in order, the research steps
                               via --research-python

Making the research environment (CPU only; torch 2.13.0 is the CPU build available locally, any other
torch spec would pull a CUDA build, so torch goes first and the two packages go in with --no-deps):

    python3 -m venv /tmp/rc/venv
    /tmp/rc/venv/bin/pip install torch==2.13.0
    /tmp/rc/venv/bin/pip install "transformers==4.51.3" "accelerate==1.6.0" datasets zstandard \
        "huggingface_hub<1.0" sentencepiece safetensors tqdm "peft==0.10.0" gekko rouge numpy
    /tmp/rc/venv/bin/pip download --no-deps -d /tmp/rc/dl autoawq==0.2.9 auto-gptq==0.7.1
    /tmp/rc/venv/bin/pip install --no-deps --no-build-isolation /tmp/rc/dl/autoawq-0.2.9.tar.gz \
        /tmp/rc/dl/auto_gptq-0.7.1-cp311-cp311-manylinux_2_17_x86_64.manylinux2014_x86_64.whl

  (transformers 4.51.3 is AutoAWQ's last tested version and imports everything AutoAWQ imports; AutoGPTQ
  0.7.1 needs a transformers whose decoder layers still return tuples, i.e. < 4.54. AutoGPTQ's wheel
  ships CUDA kernels that do not load on a CPU-only torch; it falls back to pure torch.)

Run (from the repository root; 1 thread, niced, as on the shared 2-core machine):

    OMP_NUM_THREADS=1 nice -n 15 .venv/bin/python benchmarks/research_code_compare.py all \
        --work-dir /tmp/rc/work --research-python /tmp/rc/venv/bin/python

  or step by step:
    .venv/bin/python benchmarks/research_code_compare.py prepare --work-dir W
    /tmp/rc/venv/bin/python benchmarks/research_code_compare.py autoawq --work-dir W
    /tmp/rc/venv/bin/python benchmarks/research_code_compare.py autogptq --work-dir W
    /tmp/rc/venv/bin/python benchmarks/research_code_compare.py crosscheck --work-dir W
    .venv/bin/python benchmarks/research_code_compare.py evaluate --work-dir W [--ours-results RESULTS.jsonl]
    .venv/bin/python benchmarks/research_code_compare.py ours --work-dir W --method awq --awq-num-calib 8

  --ours-results takes the results.jsonl of benchmarks/quant_table.py (same --ppl-windows) and appends
  the relative differences ours vs theirs.

CPU workarounds applied at run time in the research process only (their files are not changed):
  * AutoGPTQ: `BaseGPTQForCausalLM.from_pretrained` refuses to run without CUDA, so the wrapper is built
    directly around a transformers model; its hard-coded `CUDA_0` device is pointed at the CPU; and
    `torch.cuda.synchronize` (called unconditionally in `GPTQ.fasterquant`) is made a no-op.
  * AutoAWQ: the model is loaded in float32 (their default is float16) so that the calibration
    activations match our fp32 pipeline and CPU matmuls stay fast. Unpatched, AutoAWQ 0.2.9 produces a
    broken model on the CPU (perplexity ~2.9e5 here): its scale search snapshots weights with `.cpu()`,
    which is a copy on a GPU but an alias on the CPU. `_cpu_safe_awq_quantizer` passes a quantizer
    subclass (AutoAWQ's own `quantizer_cls` hook) that makes that snapshot a copy;
    --awq-no-cpu-fix reproduces the bug.

What tokenmill meets in these checkpoints:
  * AutoGPTQ always builds its QuantLinear with a bias buffer, so a bias-free Llama checkpoint carries an
    all-zero `<layer>.bias` per quantized linear (210 here). The loader before commit 20099a2 rejected it
    ("checkpoint has a bias for a layer built without one"); evaluate then falls back to a copy without
    those tensors. Scales are stored in the model's dtype (float32 here, float16 on a GPU);
    lm_head.weight is stored although tied.
  * AutoAWQ GEMM checkpoints load as they are.

Cost: on one CPU thread AutoGPTQ takes ~17 CPU-minutes on 128 x 512 tokens; AutoAWQ ~20 CPU-minutes on
8 x 512 and about 16x that on 128 x 512 (its grid search runs the attention / MLP 20 times per group
over all calibration tokens), hence --awq-num-calib.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
DEFAULT_DATA = REPO.parent / "shared" / "data"
MODEL = "smollm2-135m"
BITS, GROUP = 4, 64
AWQ_DIR, GPTQ_DIR = "autoawq_w4_g64", "autogptq_w4_g64"
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
    "generation_config.json",
)


def append_result(work: Path, row: dict) -> None:
    row = {**row, "time": time.strftime("%Y-%m-%d %H:%M:%S")}
    with open(work / "results.jsonl", "a") as f:
        f.write(json.dumps(row) + "\n")
    print(json.dumps(row), flush=True)


def versions(*names: str) -> dict[str, str]:
    from importlib.metadata import PackageNotFoundError, version

    out = {"python": sys.version.split()[0]}
    for n in names:
        try:
            out[n] = version(n)
        except PackageNotFoundError:
            out[n] = "absent"
    return out


def copy_tokenizer(src: Path, dst: Path) -> None:
    for name in TOKENIZER_FILES:
        if (src / name).is_file() and not (dst / name).exists():
            shutil.copy(src / name, dst / name)


# ------------------------------------------------------------------------------ prepare (tokenmill venv)


def cmd_prepare(args) -> None:
    """GGUF -> HF dir, calibration windows and WikiText-2 ids, exactly as our pipeline makes them."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from tokenmill.eval.perplexity import wikitext2_ids
    from tokenmill.models.loader import load_model, resolve_model_path
    from tokenmill.quant.calibration import calibration_windows, read_jsonl_texts

    work, data = Path(args.work_dir), Path(args.data_dir)
    base = work / "base-hf"
    if not (base / "config.json").is_file():
        gguf = Path(resolve_model_path(args.model))
        model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
        tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
        # transformers 5 keeps a "gguf" quantization_config on the (already dequantized) model and then
        # refuses to save it; the weights are plain float32 tensors, so drop the marker.
        model.hf_quantizer = None
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
        model.save_pretrained(str(base))
        tok.save_pretrained(str(base))
        cfg = json.loads((base / "config.json").read_text())
        cfg.pop("quantization_config", None)
        # transformers 5 writes rope_parameters only; older readers (transformers 4.x, and tokenmill's
        # HFDirSource) read the top-level rope_theta and would silently fall back to 10000.
        rope = cfg.get("rope_parameters") or {}
        if "rope_theta" in rope:
            cfg.setdefault("rope_theta", rope["rope_theta"])
        cfg.setdefault("torch_dtype", "float32")
        (base / "config.json").write_text(json.dumps(cfg, indent=2))
        # transformers 5 names its own tokenizer class; transformers 4.x needs the generic fast one.
        tcfg_path = base / "tokenizer_config.json"
        tcfg = json.loads(tcfg_path.read_text())
        for k in ("backend", "is_local", "local_files_only"):
            tcfg.pop(k, None)
        tcfg["tokenizer_class"] = "PreTrainedTokenizerFast"
        tcfg_path.write_text(json.dumps(tcfg, indent=2))
        del model

    ref = load_model(args.model, dtype=torch.float32)  # the GGUF, as our quant_table.py loads it
    conv = load_model(str(base), dtype=torch.float32, load_tokenizer=False)
    pa, pb = dict(ref.model.named_parameters()), dict(conv.model.named_parameters())
    max_diff = max(float((pa[k] - pb[k]).abs().max()) for k in pa) if pa.keys() == pb.keys() else float("nan")
    encode = lambda s: ref.tokenizer.encode(s, add_special_tokens=False)  # noqa: E731
    calib = calibration_windows(
        read_jsonl_texts(data / "c4_en_train_00000_first1000.jsonl"), encode, args.num_calib, args.calib_seqlen, 0
    )
    torch.save(calib, work / "calib.pt")
    ids = wikitext2_ids(encode, data / "wikitext2_raw_test.jsonl")
    torch.save(ids, work / "wikitext2_ids.pt")
    append_result(
        work,
        {
            "key": "prepare",
            "base_dir": str(base),
            "max_abs_diff_gguf_vs_hf_dir": max_diff,
            "calib_shape": list(calib.shape),
            "wikitext2_tokens": ids.numel(),
            "versions": versions("torch", "transformers", "gguf"),
        },
    )


# ------------------------------------------------------------------------------ AutoAWQ (research venv)


def _cpu_safe_awq_quantizer():
    """AutoAWQ's quantizer with its scale-search snapshot made a real copy.

    `AwqQuantizer._compute_best_scale` saves the inspected module's weights as
    `{k: v.cpu() for k, v in module.state_dict().items()}` and restores them after every grid point.
    On a GPU `.cpu()` copies; on the CPU it returns the same tensor, so the snapshot aliases the live
    weights, the in-place `fc.weight.mul_(scales)` of the first grid point leaks into it, and every
    scaled linear (q/k/v, gate/up, down) ends up multiplied by an extra, unfolded scale (WikiText-2
    perplexity ~2.9e5 instead of ~25 on this model). Handing that method a module whose state_dict
    returns clones restores the GPU behaviour without touching anything else.
    """
    from awq.quantize.quantizer import AwqQuantizer

    class CpuSafeAwqQuantizer(AwqQuantizer):
        def _compute_best_scale(self, x, w_mean, x_mean, module2inspect, linears2scale, fp16_output, kwargs=None):
            if kwargs is None:
                kwargs = {}
            live = module2inspect.state_dict
            module2inspect.state_dict = lambda *a, **k: {n: t.clone() for n, t in live(*a, **k).items()}
            try:
                return super()._compute_best_scale(
                    x, w_mean, x_mean, module2inspect, linears2scale, fp16_output, kwargs
                )
            finally:
                del module2inspect.state_dict  # back to the class method

    return CpuSafeAwqQuantizer


def cmd_autoawq(args) -> None:
    from awq import AutoAWQForCausalLM
    from awq.quantize.quantizer import AwqQuantizer
    from awq.utils.calib_data import get_calib_dataset

    work = Path(args.work_dir)
    base, out = work / "base-hf", work / AWQ_DIR
    calib = torch.load(work / "calib.pt")
    if args.awq_num_calib:
        calib = calib[: args.awq_num_calib]
    windows = calib.tolist()
    # AutoAWQ keeps pre-tokenized samples of at most max_calib_seq_len tokens, concatenates the first
    # n_samples and re-splits them into max_calib_seq_len blocks: with 512-token windows that is the
    # identity. Check it rather than trust it.
    blocks = torch.cat(get_calib_dataset(windows, None, n_samples=len(windows), max_seq_len=calib.shape[1]))
    assert torch.equal(blocks, calib), "AutoAWQ would re-split the calibration windows differently"

    model = AutoAWQForCausalLM.from_pretrained(str(base), torch_dtype=torch.float32, device_map="cpu")
    quant_config = {"zero_point": True, "q_group_size": GROUP, "w_bit": BITS, "version": "GEMM"}
    t0, c0 = time.perf_counter(), time.process_time()
    model.quantize(
        None,
        quant_config=quant_config,
        calib_data=windows,
        max_calib_samples=len(windows),
        max_calib_seq_len=calib.shape[1],
        duo_scaling=not args.awq_no_duo,
        quantizer_cls=AwqQuantizer if args.awq_no_cpu_fix else _cpu_safe_awq_quantizer(),
    )
    seconds, cpu_seconds = time.perf_counter() - t0, time.process_time() - c0
    model.save_quantized(str(out))
    copy_tokenizer(base, out)
    append_result(
        work,
        {
            "key": f"quantize|autoawq|{BITS}|{GROUP}",
            "dir": str(out),
            "quant_seconds": seconds,
            "quant_cpu_seconds": cpu_seconds,
            "num_calib": len(windows),
            "cpu_fix": not args.awq_no_cpu_fix,
            "config": {**quant_config, "duo_scaling": not args.awq_no_duo, "apply_clip": True, "dtype": "float32"},
            "threads": torch.get_num_threads(),
            "versions": versions("torch", "transformers", "autoawq", "accelerate"),
        },
    )


# ------------------------------------------------------------------------------ AutoGPTQ (research venv)


def cmd_autogptq(args) -> None:
    import auto_gptq.modeling._base as agb
    from auto_gptq import BaseQuantizeConfig
    from auto_gptq.modeling.llama import LlamaGPTQForCausalLM
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    work = Path(args.work_dir)
    base, out = work / "base-hf", work / GPTQ_DIR
    calib = torch.load(work / "calib.pt")

    # CPU-only torch: see the module docstring.
    agb.CUDA_0 = torch.device("cpu")
    torch.cuda.synchronize = lambda *a, **k: None

    reference: dict[str, torch.Tensor] = {}
    zero_stats = {"groups": 0, "zero_point_0": 0}
    original_pack = agb.pack_model

    def pack_and_record(model, quantizers, *a, **k):
        # Just before packing, the layers hold AutoGPTQ's own fake-quantized weights and `quantizers`
        # the (scale, zero) it chose: keep both to check the checkpoint against.
        layers = dict(model.named_modules())
        for name, (_q, _scale, zero, _g) in quantizers.items():
            reference[name + ".weight"] = layers[name].weight.detach().float().clone()
            zero_stats["groups"] += zero.numel()
            zero_stats["zero_point_0"] += int((zero == 0).sum())
        return original_pack(model, quantizers, *a, **k)

    agb.pack_model = pack_and_record

    hf = AutoModelForCausalLM.from_pretrained(str(base), torch_dtype=torch.float32, use_cache=False)
    qcfg = BaseQuantizeConfig(
        bits=BITS,
        group_size=GROUP,
        desc_act=False,
        sym=False,
        damp_percent=0.01,
        true_sequential=True,
        static_groups=False,
    )
    model = LlamaGPTQForCausalLM(hf, False, qcfg)
    examples = [
        {"input_ids": row.unsqueeze(0), "attention_mask": torch.ones(1, row.numel(), dtype=torch.long)} for row in calib
    ]
    t0, c0 = time.perf_counter(), time.process_time()
    # batch_size only groups windows into one forward (same length, no padding); the Hessians are the same.
    model.quantize(examples, batch_size=args.gptq_batch, use_triton=False, cache_examples_on_gpu=False)
    seconds, cpu_seconds = time.perf_counter() - t0, time.process_time() - c0
    model.save_quantized(str(out), use_safetensors=True)
    copy_tokenizer(base, out)
    save_file({k: v.contiguous() for k, v in reference.items()}, str(work / f"{GPTQ_DIR}.reference.safetensors"))
    append_result(
        work,
        {
            "key": f"quantize|autogptq|{BITS}|{GROUP}",
            "dir": str(out),
            "quant_seconds": seconds,
            "quant_cpu_seconds": cpu_seconds,
            "num_calib": calib.shape[0],
            "config": qcfg.to_dict(),
            "batch_size": args.gptq_batch,
            "dtype": "float32",
            "zero_point_stats": zero_stats,
            "threads": torch.get_num_threads(),
            "versions": versions("torch", "transformers", "auto-gptq", "accelerate"),
        },
    )


# ---------------------------------------------------------------------------- crosscheck (research venv)


def _their_dequantized(kind: str, tensors: dict[str, torch.Tensor], in_f: int, out_f: int) -> torch.Tensor:
    """W [out, in] float32 as the research package itself reads one checkpoint layer."""
    if kind == "awq":
        from awq.utils.packing_utils import dequantize_gemm

        w = dequantize_gemm(tensors["qweight"], tensors["qzeros"], tensors["scales"], BITS, GROUP)  # [in, out]
        return w.float().t().contiguous()
    from auto_gptq.nn_modules.qlinear.qlinear_cuda_old import QuantLinear

    ql = QuantLinear(BITS, GROUP, in_f, out_f, bias=False, use_cuda_fp16=False, weight_dtype=torch.float32)
    ql.qweight, ql.qzeros, ql.g_idx = tensors["qweight"], tensors["qzeros"], tensors["g_idx"]
    ql.scales = tensors["scales"].float()
    with torch.no_grad():  # x = I gives W^T through their own CPU (pure torch) path
        return ql(torch.eye(in_f)).t().contiguous()


def _read_quantized(path: Path) -> dict[str, dict[str, torch.Tensor]]:
    from safetensors import safe_open

    layers: dict[str, dict[str, torch.Tensor]] = {}
    for f in sorted(path.glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as st:
            for name in st.keys():
                prefix, _, kind = name.rpartition(".")
                if kind in ("qweight", "qzeros", "scales", "g_idx"):
                    layers.setdefault(prefix, {})[kind] = st.get_tensor(name)
    return layers


def hf_window_ppl(model, ids: torch.Tensor, seqlen: int, n: int) -> float:
    """Our protocol with a transformers model: non-overlapping windows from position 0, no BOS."""
    import torch.nn.functional as F

    nll = 0.0
    with torch.no_grad():
        for i in range(n):
            w = ids[i * seqlen : (i + 1) * seqlen].unsqueeze(0)
            logits = model(w).logits[0, :-1].float()
            nll += float(F.cross_entropy(logits, w[0, 1:], reduction="sum"))
    return math.exp(nll / (n * (seqlen - 1)))


def cmd_crosscheck(args) -> None:
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    work = Path(args.work_dir)
    ids = torch.load(work / "wikitext2_ids.pt")
    hf = AutoModelForCausalLM.from_pretrained(str(work / "base-hf"), torch_dtype=torch.float32, use_cache=False)
    hf.eval()
    n = args.crosscheck_windows
    t0 = time.perf_counter()
    append_result(
        work,
        {
            "key": f"crosscheck|fp32|transformers|{n}",
            "ppl": hf_window_ppl(hf, ids, 2048, n),
            "windows": n,
            "seconds": time.perf_counter() - t0,
            "versions": versions("torch", "transformers"),
        },
    )
    original = {k: v.clone() for k, v in hf.state_dict().items()}
    for kind, dirname in (("awq", AWQ_DIR), ("gptq", GPTQ_DIR)):
        qdir = work / dirname
        if not qdir.is_dir():
            continue
        hf.load_state_dict(original)
        modules = dict(hf.named_modules())
        theirs = {}
        for prefix, t in _read_quantized(qdir).items():
            lin = modules[prefix]
            w = _their_dequantized(kind, t, lin.in_features, lin.out_features)
            lin.weight.data.copy_(w)
            theirs[prefix + ".weight"] = w
        if kind == "awq":
            # AWQ also folded its scales into the norms: take every non-quantized tensor from their checkpoint.
            from safetensors import safe_open

            sd = hf.state_dict()
            for f in qdir.glob("*.safetensors"):
                with safe_open(str(f), framework="pt") as st:
                    for name in st.keys():
                        if name in sd and not name.endswith((".qweight", ".qzeros", ".scales", ".g_idx")):
                            sd[name].copy_(st.get_tensor(name).float())
        save_file({k: v.contiguous() for k, v in theirs.items()}, str(work / f"{dirname}.their_dequant.safetensors"))
        t0 = time.perf_counter()
        append_result(
            work,
            {
                "key": f"crosscheck|{kind}|transformers|{n}",
                "ppl": hf_window_ppl(hf, ids, 2048, n),
                "windows": n,
                "seconds": time.perf_counter() - t0,
                "note": "research package's own dequantization, transformers fp32 forward",
            },
        )


# ------------------------------------------------------------------------------ evaluate (tokenmill venv)


def _weight_agreement(qdir: Path, reference_file: Path) -> dict:
    """Decode the checkpoint with tokenmill's format code and compare to a reference [out, in] per layer."""
    from safetensors.torch import load_file

    from tokenmill.models.loader import HFDirSource
    from tokenmill.quant.loading import decode_layer, parse_quantization_config

    if not reference_file.is_file():
        return {}
    src = HFDirSource(qdir)
    spec = parse_quantization_config(src.raw["quantization_config"])
    layers: dict[str, dict[str, torch.Tensor]] = {}
    for name, t in src.tensors():
        prefix, _, kind = name.rpartition(".")
        if kind in ("qweight", "qzeros", "scales", "g_idx"):
            layers.setdefault(prefix, {})[kind] = t
    ref = load_file(str(reference_file))
    worst, mismatched_layers, n_elems, n_bad = 0.0, 0, 0, 0
    for prefix, t in layers.items():
        mine = decode_layer(spec, t).dequantize(torch.float32)
        r = ref[prefix + ".weight"].float()
        d = (mine - r).abs()
        tol = 1e-3 * r.abs().max()
        bad = int((d > tol).sum())
        worst = max(worst, float(d.max() / r.abs().max()))
        mismatched_layers += bad > 0
        n_bad += bad
        n_elems += d.numel()
    return {
        "reference": reference_file.name,
        "layers": len(layers),
        "max_rel_diff": worst,
        "layers_with_mismatch": mismatched_layers,
        "mismatched_weights": n_bad,
        "weights": n_elems,
    }


def strip_zero_biases(qdir: Path) -> tuple[Path, int]:
    """A copy of qdir without the all-zero `<layer>.bias` tensors AutoGPTQ writes for every quantized
    layer (its QuantLinear is always built with a bias buffer, even for bias-free Llama linears).
    Returns (copy, number of tensors dropped); raises if any such bias is not zero."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    dst = qdir.with_name(qdir.name + "-zero-bias-stripped")
    dst.mkdir(exist_ok=True)
    dropped = 0
    for f in qdir.iterdir():
        if f.suffix != ".safetensors":
            shutil.copy(f, dst / f.name)
            continue
        kept = {}
        with safe_open(str(f), framework="pt") as st:
            names = set(st.keys())
            for name in names:
                t = st.get_tensor(name)
                if name.endswith(".bias") and name[: -len("bias")] + "qweight" in names:
                    if bool(t.any()):
                        raise ValueError(f"{f}: {name} is not zero; it cannot be dropped")
                    dropped += 1
                    continue
                kept[name] = t
            metadata = st.metadata()
        save_file(kept, str(dst / f.name), metadata=metadata)
    return dst, dropped


def cmd_evaluate(args) -> None:
    from tokenmill.eval.perplexity import evaluate_perplexity
    from tokenmill.models.loader import load_model

    work = Path(args.work_dir)
    ids = torch.load(work / "wikitext2_ids.pt")
    targets = [
        (label, d) for label, d in (("autoawq", AWQ_DIR), ("autogptq", GPTQ_DIR)) if not args.only or label in args.only
    ]
    if args.eval_baseline:
        targets.insert(0, ("fp32", "base-hf"))
    for label, dirname in targets:
        qdir = work / dirname
        if not (qdir / "config.json").is_file():
            print(f"skip {label}: {qdir} not there")
            continue
        row = {"key": f"ppl|{label}|tokenmill|{args.ppl_windows}", "dir": str(qdir)}
        t0 = time.perf_counter()
        try:
            loaded = load_model(str(qdir), dtype=torch.float32, load_tokenizer=False)
        except Exception as e:  # the finding is the error itself
            row["load_error"] = f"{type(e).__name__}: {e}"
            if "bias for a layer built without one" not in str(e):
                append_result(work, row)
                continue
            # AutoGPTQ's zero biases: evaluate an otherwise identical copy without them.
            stripped, n = strip_zero_biases(qdir)
            row.update({"evaluated_dir": str(stripped), "zero_biases_dropped": n})
            t0 = time.perf_counter()
            loaded = load_model(str(stripped), dtype=torch.float32, load_tokenizer=False)
        row["load_seconds"] = time.perf_counter() - t0
        for ref_name in (f"{dirname}.reference.safetensors", f"{dirname}.their_dequant.safetensors"):
            agreement = _weight_agreement(qdir, work / ref_name)
            if agreement:
                row.setdefault("weight_agreement", []).append(agreement)
        for k in sorted(set(args.prefix_windows + [args.crosscheck_windows]) - {0}):
            if k < args.ppl_windows:  # the first k windows too: comparable with crosscheck and shorter runs
                short = evaluate_perplexity(loaded.model, ids, 2048, k, progress=False)
                row[f"ppl_first_{k}"] = short.perplexity
        res = evaluate_perplexity(loaded.model, ids, 2048, args.ppl_windows)
        row.update(
            {
                "ppl": res.perplexity,
                "mean_nll": res.mean_nll,
                "windows": res.num_windows,
                "total_windows": res.total_windows,
                "eval_seconds": res.seconds,
                "threads": torch.get_num_threads(),
            }
        )
        append_result(work, row)
    if args.ours_results:
        compare(work, Path(args.ours_results), args.ppl_windows)


def compare(work: Path, ours_file: Path, windows: int) -> None:
    """Join their figures with ours (benchmarks/quant_table.py rows) and print the relative differences."""
    if not ours_file.is_file():
        print(f"{ours_file}: not there; no comparison")
        return
    ours = {json.loads(line)["key"]: json.loads(line) for line in ours_file.read_text().splitlines() if line.strip()}
    theirs = {
        json.loads(line)["key"]: json.loads(line)
        for line in (work / "results.jsonl").read_text().splitlines()
        if line.strip()
    }
    for method, label in (("gptq", "autogptq"), ("awq", "autoawq")):
        calib = theirs.get(f"quantize|{label}|{BITS}|{GROUP}", {}).get("num_calib", 128)
        mine = ours.get(f"ppl|{method}|{BITS}|{GROUP}|{windows}|{calib}x512")
        other = theirs.get(f"ppl|{label}|tokenmill|{windows}")
        if not mine or not other or "ppl" not in other:
            print(f"{method}: ours {'found' if mine else 'missing'}, theirs {'found' if other else 'missing'}")
            continue
        rel = (mine["ppl"] - other["ppl"]) / other["ppl"]
        append_result(
            work,
            {
                "key": f"compare|{method}|{BITS}|{GROUP}|{windows}|{calib}x512",
                "ours_ppl": mine["ppl"],
                "theirs_ppl": other["ppl"],
                "relative_difference": rel,
                "within_1pct": abs(rel) <= 0.01,
                "ours_quant_seconds": mine.get("quant_seconds"),
                "fp32_ppl": ours.get(f"ppl|fp32|0|0|{windows}|0x512", {}).get("ppl"),
            },
        )


def cmd_ours(args) -> None:
    """Our pipeline on exactly the windows given to the research code (like-for-like when a research run
    used fewer windows than benchmarks/quant_table.py's 128): quantize in memory, then the same perplexity."""
    from tokenmill.eval.perplexity import evaluate_perplexity
    from tokenmill.models.loader import load_model
    from tokenmill.quant.pipeline import QuantConfig, quantize_model

    work = Path(args.work_dir)
    ids = torch.load(work / "wikitext2_ids.pt")
    calib = torch.load(work / "calib.pt")
    n = args.awq_num_calib if (args.method == "awq" and args.awq_num_calib) else calib.shape[0]
    cfg = QuantConfig(
        method=args.method,
        bits=BITS,
        group_size=GROUP,
        sym=False,
        desc_act=False,
        damp_percent=0.01,
        awq_duo_scaling=args.method == "awq" and not args.awq_no_duo,
    )
    loaded = load_model(args.model, dtype=torch.float32)
    t0, c0 = time.perf_counter(), time.process_time()
    report = quantize_model(loaded.model, cfg, calib[:n])
    seconds, cpu_seconds = time.perf_counter() - t0, time.process_time() - c0
    variant = ("|duo" if cfg.awq_duo_scaling else "|noduo") if args.method == "awq" else ""
    row = {
        "key": f"ours|{args.method}|{BITS}|{GROUP}|{args.ppl_windows}|{n}x{calib.shape[1]}{variant}",
        "quant_seconds": seconds,
        "quant_cpu_seconds": cpu_seconds,
        "reported_seconds": report.seconds,
        "config": {
            k: getattr(cfg, k)
            for k in ("bits", "group_size", "sym", "desc_act", "damp_percent", "awq_duo_scaling", "awq_clip", "format")
        },
    }
    for k in sorted(set(args.prefix_windows) - {0}):
        if k < args.ppl_windows:
            row[f"ppl_first_{k}"] = evaluate_perplexity(loaded.model, ids, 2048, k, progress=False).perplexity
    res = evaluate_perplexity(loaded.model, ids, 2048, args.ppl_windows)
    row.update(
        {
            "ppl": res.perplexity,
            "windows": res.num_windows,
            "eval_seconds": res.seconds,
            "threads": torch.get_num_threads(),
        }
    )
    append_result(work, row)


# ------------------------------------------------------------------------------------------------- all


def cmd_all(args) -> None:
    work = Path(args.work_dir)
    cmd_prepare(args)
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads), "BUILD_CUDA_EXT": "0"}
    common = (
        [
            "--work-dir",
            str(work),
            "--threads",
            str(args.threads),
            "--gptq-batch",
            str(args.gptq_batch),
            "--crosscheck-windows",
            str(args.crosscheck_windows),
        ]
        + (["--awq-no-duo"] if args.awq_no_duo else [])
        + (["--awq-no-cpu-fix"] if args.awq_no_cpu_fix else [])
        + (["--awq-num-calib", str(args.awq_num_calib)] if args.awq_num_calib else [])
    )
    for step in ("autoawq", "autogptq", "crosscheck"):
        rc = subprocess.call([args.research_python, __file__, step, *common], env=env)
        if rc != 0:
            append_result(work, {"key": f"failed|{step}", "returncode": rc})
    cmd_evaluate(args)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("step", choices=["prepare", "autoawq", "autogptq", "crosscheck", "evaluate", "ours", "all"])
    ap.add_argument("--method", choices=["gptq", "awq"], default="awq", help="ours: which of our methods to run.")
    ap.add_argument("--work-dir", required=True)
    ap.add_argument("--data-dir", default=str(DEFAULT_DATA), help="C4 and WikiText-2 jsonl files (../shared/data).")
    ap.add_argument("--model", default=MODEL)
    ap.add_argument("--num-calib", type=int, default=128)
    ap.add_argument("--calib-seqlen", type=int, default=512)
    ap.add_argument("--ppl-windows", type=int, default=40, help="2048-token WikiText-2 windows to score.")
    ap.add_argument("--crosscheck-windows", type=int, default=2, help="Windows for the transformers cross-check.")
    ap.add_argument("--gptq-batch", type=int, default=8, help="Calibration windows per AutoGPTQ forward.")
    ap.add_argument("--awq-no-duo", action="store_true", help="AutoAWQ with duo_scaling=False (the paper's s).")
    ap.add_argument(
        "--awq-no-cpu-fix",
        action="store_true",
        help="Run AutoAWQ's quantizer unpatched (reproduces its CPU aliasing bug, see _cpu_safe_awq_quantizer).",
    )
    ap.add_argument(
        "--awq-num-calib",
        type=int,
        default=None,
        help="Use only the first N calibration windows for AutoAWQ (it is ~10x the CPU cost of GPTQ).",
    )
    ap.add_argument("--eval-baseline", action="store_true", help="Also score the converted fp32 HF dir.")
    ap.add_argument(
        "--prefix-windows",
        type=int,
        nargs="*",
        default=[8],
        help="evaluate: also report the perplexity of the first K windows (e.g. to match a shorter run).",
    )
    ap.add_argument(
        "--only", nargs="*", choices=["autoawq", "autogptq"], default=None, help="evaluate: only these checkpoints."
    )
    ap.add_argument("--ours-results", default=None, help="results.jsonl of benchmarks/quant_table.py to compare.")
    ap.add_argument("--research-python", default=None, help="python of the research venv (step all).")
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    Path(args.work_dir).mkdir(parents=True, exist_ok=True)
    if args.step in ("prepare", "evaluate", "ours", "all"):
        sys.path.insert(0, str(REPO))
    if args.step == "all" and not args.research_python:
        ap.error("step all needs --research-python")
    {
        "prepare": cmd_prepare,
        "autoawq": cmd_autoawq,
        "autogptq": cmd_autogptq,
        "crosscheck": cmd_crosscheck,
        "evaluate": cmd_evaluate,
        "ours": cmd_ours,
        "all": cmd_all,
    }[args.step](args)


if __name__ == "__main__":
    main()
