"""Write a GGUF model as a Hugging Face checkpoint directory (safetensors in bf16, config.json, the
tokenizer, the GGUF's chat template), for peers that load only such directories (vLLM). The weights are
tokenmill's own dequantization of the GGUF (models/loader.GGUFSource, Q/K rows already in HF order); the
tokenizer files are transformers' conversion of the same GGUF.

    .venv/bin/python benchmarks/gguf_to_hf.py --model smollm2-135m --out ../peers/smollm2-135m-hf
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tokenmill.models.loader import GGUFSource, resolve_model_path  # noqa: E402


def hf_config(src: GGUFSource, dtype: str) -> dict:
    c = src.config()
    eos = list(c.eos_token_ids)
    return {
        "architectures": [c.architecture],
        "model_type": "llama",
        "vocab_size": c.vocab_size,
        "hidden_size": c.hidden_size,
        "intermediate_size": c.intermediate_size,
        "num_hidden_layers": c.num_hidden_layers,
        "num_attention_heads": c.num_attention_heads,
        "num_key_value_heads": c.num_key_value_heads,
        "head_dim": c.head_dim,
        "max_position_embeddings": c.max_position_embeddings,
        "rms_norm_eps": c.rms_norm_eps,
        "rope_theta": c.rope_theta,
        "rope_scaling": c.rope_scaling,
        "tie_word_embeddings": c.tie_word_embeddings,
        "attention_bias": c.attention_bias,
        "mlp_bias": c.mlp_bias,
        "hidden_act": "silu",
        "bos_token_id": c.bos_token_id,
        "eos_token_id": eos[0] if len(eos) == 1 else eos,
        "torch_dtype": dtype,
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m", help="GGUF path or alias")
    p.add_argument("--out", required=True, help="directory to write")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    args = p.parse_args()
    from safetensors.torch import save_file
    from transformers import AutoTokenizer

    path = resolve_model_path(args.model)
    if path.suffix != ".gguf":
        raise SystemExit(f"{path}: not a GGUF file")
    src = GGUFSource(path)
    cfg = hf_config(src, args.dtype)
    dtype = getattr(torch, args.dtype)
    weights = {name: w.to(dtype).contiguous() for name, w in src.tensors()}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    save_file(weights, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    tok = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    template = src.tokenizer().chat_template
    if template:
        tok.chat_template = template
    tok.save_pretrained(out)
    print(
        f"wrote {out}: {len(weights)} tensors ({args.dtype}), chat template {'from the GGUF' if template else 'none'}"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
