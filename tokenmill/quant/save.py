"""Write a quantized model as a Hugging Face directory that this loader, transformers and vLLM read:

    config.json              the Llama config + quantization_config (quant_method gptq | awq)
    quantize_config.json     GPTQ only, as AutoGPTQ / GPTQModel write it
    model.safetensors        per checkpoint linear (q_proj, k_proj, ... split back out of the packed
                             qkv_proj / gate_up_proj): qweight, qzeros, scales (+ g_idx for GPTQ);
                             everything else (embeddings, norms, lm_head) in float16
    tokenizer.json, tokenizer_config.json

A quantized LM head (`weights["lm_head"]`, from QuantConfig.lm_head) is written as
lm_head.qweight / qzeros / scales / g_idx in the GPTQ layout with "lm_head": true, GPTQModel's
spelling; for tied embeddings model.embed_tokens.weight stays in the file in fp16 (other loaders
look the embedding up there) and tie_word_embeddings is left as it is.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from tokenmill.config import ModelArchConfig
from tokenmill.layers.linear import Linear
from tokenmill.quant.formats import to_awq_tensors, to_gptq_tensors
from tokenmill.quant.grid import QuantizedWeight

if TYPE_CHECKING:
    from tokenmill.models.causal_lm import CausalLM  # the common base of every model class

SAVE_DTYPE = torch.float16
_MODEL_TYPES = {"LlamaForCausalLM": "llama", "Qwen2ForCausalLM": "qwen2", "MistralForCausalLM": "mistral"}


def quantization_config(
    fmt: str,
    bits: int,
    group_size: int,
    sym: bool,
    desc_act: bool = False,
    static_groups: bool = False,
    damp_percent: float = 0.01,
) -> dict[str, Any]:
    if fmt == "gptq":
        return {
            "quant_method": "gptq",
            "bits": bits,
            "group_size": group_size,
            "desc_act": desc_act,
            "sym": sym,
            "static_groups": static_groups,
            "damp_percent": damp_percent,
            "true_sequential": True,
            "checkpoint_format": "gptq",
            "lm_head": False,
            "model_name_or_path": None,
            "model_file_base_name": "model",
        }
    if fmt == "awq":
        return {
            "quant_method": "awq",
            "bits": bits,
            "group_size": group_size,
            "zero_point": True,
            "version": "gemm",
            "modules_to_not_convert": None,
        }
    raise ValueError(f"unknown format {fmt!r}")


def hf_config_dict(
    cfg: ModelArchConfig, qconfig: dict[str, Any] | None, dtype: torch.dtype = SAVE_DTYPE
) -> dict[str, Any]:
    eos = list(cfg.eos_token_ids)
    d: dict[str, Any] = {
        "architectures": [cfg.architecture],
        "model_type": _MODEL_TYPES.get(cfg.architecture, "llama"),
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "num_hidden_layers": cfg.num_hidden_layers,
        "num_attention_heads": cfg.num_attention_heads,
        "num_key_value_heads": cfg.num_key_value_heads,
        "head_dim": cfg.head_dim,
        "max_position_embeddings": cfg.max_position_embeddings,
        "rms_norm_eps": cfg.rms_norm_eps,
        "rope_theta": cfg.rope_theta,
        "rope_scaling": cfg.rope_scaling,
        "tie_word_embeddings": cfg.tie_word_embeddings,
        "attention_bias": cfg.attention_bias,
        "mlp_bias": cfg.mlp_bias,
        "hidden_act": "silu",
        "bos_token_id": cfg.bos_token_id,
        "eos_token_id": eos[0] if len(eos) == 1 else (eos or None),
        "torch_dtype": str(dtype).removeprefix("torch."),
    }
    if qconfig is not None:
        d["quantization_config"] = qconfig
    return d


def _part_names(model: CausalLM) -> dict[tuple[str, int], str]:
    """(packed module leaf, part index) -> checkpoint leaf, e.g. ("qkv_proj", 1) -> "k_proj"."""
    return {v: k for k, v in model.packed_modules_mapping.items()}


def checkpoint_tensors(
    model: CausalLM, weights: dict[str, QuantizedWeight], fmt: str, dtype: torch.dtype = SAVE_DTYPE
) -> dict[str, torch.Tensor]:
    """The model's tensors under checkpoint names, quantized linears in `fmt` layout."""
    from tokenmill.quant.head import QuantizedEmbedding

    parts = _part_names(model)
    out: dict[str, torch.Tensor] = {}
    tables = {n: m for n, m in model.named_modules() if isinstance(m, QuantizedEmbedding)}
    for name, q in tables.items():
        if q.checkpoint_table is None:
            raise ValueError(
                f"{name} is a quantized table without its fp16 original; a model whose embedding "
                "was quantized at load time cannot be saved"
            )
        out[f"{name}.weight"] = q.checkpoint_table.to(dtype).contiguous()
    if model.lm_head is None and "lm_head" in weights:  # tied: the head exists only as weights
        packed = to_gptq_tensors(weights["lm_head"]) if fmt == "gptq" else to_awq_tensors(weights["lm_head"])
        out.update({f"lm_head.{k}": v.contiguous() for k, v in packed.items()})
    for name, mod in model.named_modules():
        if not isinstance(mod, Linear) or name.rpartition(".")[0] in tables:
            continue
        parent, _, leaf = name.rpartition(".")
        n_parts = len(mod.output_sizes)
        for shard in range(n_parts):
            ck = f"{parent}.{parts[(leaf, shard)]}" if n_parts > 1 else name
            rows = mod.shard_rows(shard)
            if name in weights:
                qw = weights[name].rows(rows)
                packed = to_gptq_tensors(qw) if fmt == "gptq" else to_awq_tensors(qw)
                out.update({f"{ck}.{k}": v.contiguous() for k, v in packed.items()})
            elif mod.weight is not None:
                out[f"{ck}.weight"] = mod.weight.data[rows].to(dtype).contiguous()
            if mod.bias is not None:
                out[f"{ck}.bias"] = mod.bias.data[rows].to(dtype).contiguous()
    linear_params = {f"{n}.{p}" for n, m in model.named_modules() if isinstance(m, Linear) for p in ("weight", "bias")}
    for name, p in model.named_parameters():
        if name not in linear_params:
            out[name] = p.data.to(dtype).contiguous()
    return out


def round_unquantized_params(model: nn.Module, dtype: torch.dtype = SAVE_DTYPE) -> None:
    """Pass every remaining dense parameter through `dtype`, so the in-memory model equals the saved one."""
    for p in model.parameters():
        p.data = p.data.to(dtype).to(p.dtype)


def save_tokenizer(tokenizer, out: Path) -> None:
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers.processors import TemplateProcessing

    hf = HFTokenizer.from_str(tokenizer.hf.to_str())
    if tokenizer.add_bos_token and tokenizer.bos_token_id is not None:
        bos = tokenizer.special_tokens.get("bos_token") or hf.id_to_token(tokenizer.bos_token_id)
        hf.post_processor = TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, tokenizer.bos_token_id)]
        )
    hf.save(str(out / "tokenizer.json"))
    tc: dict[str, Any] = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "clean_up_tokenization_spaces": False,
        "add_bos_token": bool(tokenizer.add_bos_token),
    }
    for key in ("bos_token", "eos_token"):
        if tokenizer.special_tokens.get(key):
            tc[key] = tokenizer.special_tokens[key]
    if tokenizer.chat_template:
        tc["chat_template"] = tokenizer.chat_template
    (out / "tokenizer_config.json").write_text(json.dumps(tc, indent=2, ensure_ascii=False))


def save_quantized(
    model: nn.Module,
    cfg: ModelArchConfig,
    tokenizer,
    weights: dict[str, QuantizedWeight],
    fmt: str,
    out_dir: str | Path,
    sym: bool,
    desc_act: bool = False,
    static_groups: bool = False,
    damp_percent: float = 0.01,
) -> Path:
    """Write the directory; `weights` are the QuantizedWeights of quantize_model (all share bits/groups)."""
    from safetensors.torch import save_file

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    first = next(iter(weights.values()))
    qc = quantization_config(fmt, first.bits, first.group_size, sym, desc_act, static_groups, damp_percent)
    if "lm_head" in weights:
        head = weights["lm_head"]
        if fmt != "gptq":
            raise ValueError(
                f"a quantized LM head is saved in the GPTQ layout only, not {fmt!r} "
                "(AutoAWQ's format has no quantized lm_head)"
            )
        if (head.bits, head.group_size) != (first.bits, first.group_size):
            raise ValueError(
                f"the LM head ({head.bits} bits, group {head.group_size}) must share the checkpoint's "
                f"bits and group size ({first.bits}, {first.group_size}): quantization_config has one"
            )
        qc["lm_head"] = True
    tensors = checkpoint_tensors(model, weights, fmt)
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(hf_config_dict(cfg, qc), indent=2))
    if fmt == "gptq":
        qfile = {k: v for k, v in qc.items() if k != "lm_head" or v}  # GPTQModel reads lm_head here too
        (out / "quantize_config.json").write_text(json.dumps(qfile, indent=2))
    if tokenizer is not None:
        save_tokenizer(tokenizer, out)
    return out
