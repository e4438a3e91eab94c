"""Load GPTQ / AWQ checkpoints (ours or the ecosystem's) into a model built unquantized.

The format is detected from config.json's quantization_config:
    quant_method "gptq": bits, group_size, sym, desc_act, checkpoint_format ("gptq" v1 | "gptq_v2")
    quant_method "awq":  bits (4), group_size, zero_point, version "gemm" (AutoAWQ also writes
                         w_bit / q_group_size)
Checkpoint parts of one packed layer (q/k/v, gate/up) are unpacked, stacked and repacked for the
kernels in one go.

A quantized LM head (lm_head.qweight / qzeros / scales / g_idx, "lm_head": true in GPTQModel's
spelling) goes into an untied model's lm_head Linear like any other layer; for a model with tied
embeddings it has no Linear to go to, so `load_quantized_weights` decodes it and returns it, and
`load_model` decides (quantize_lm_head) whether it becomes the model's embedding + head
(quant/head.py). The fp16 model.embed_tokens.weight beside it loads as usual.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from tokenmill.errors import ModelLoadError
from tokenmill.layers.linear import Linear
from tokenmill.quant.formats import awq_shape_problem, from_awq_tensors, from_gptq_tensors, gptq_shape_problem
from tokenmill.quant.grid import QuantizedWeight, concat_rows
from tokenmill.quant.kernels import install_quantized

if TYPE_CHECKING:
    from tokenmill.models.causal_lm import CausalLM  # the common base of every model class

_QUANT_SUFFIXES = ("qweight", "qzeros", "scales", "g_idx")


@dataclass(frozen=True)
class CheckpointQuantSpec:
    method: str
    bits: int
    group_size: int
    sym: bool
    checkpoint_format: str


def parse_quantization_config(qc: dict[str, Any], where: str = "config.json") -> CheckpointQuantSpec:
    method = str(qc.get("quant_method", "")).lower()
    if method == "gptq":
        bits = int(qc.get("bits", 4))
        fmt = qc.get("checkpoint_format", "gptq")
        spec = CheckpointQuantSpec("gptq", bits, int(qc.get("group_size", 128)), bool(qc.get("sym", True)), fmt)
        if bits not in (2, 3, 4, 8):
            raise ValueError(f"{where}: GPTQ with {bits} bits is not supported (2, 3, 4, 8)")
        if fmt not in ("gptq", "gptq_v2"):
            raise ValueError(f"{where}: GPTQ checkpoint_format {fmt!r} is not supported (gptq, gptq_v2)")
        return spec
    if method == "awq":
        bits = int(qc.get("bits", qc.get("w_bit", 4)))
        version = str(qc.get("version", "gemm")).lower()
        if bits != 4 or version != "gemm":
            raise ValueError(f"{where}: AWQ {version} with {bits} bits is not supported (GEMM, 4 bits)")
        if not qc.get("zero_point", True):
            raise ValueError(f"{where}: AWQ without zero points is not supported")
        return CheckpointQuantSpec("awq", 4, int(qc.get("group_size", qc.get("q_group_size", 128))), False, "awq")
    raise ValueError(f"{where}: quantization_config.quant_method {method!r} is not supported (gptq, awq)")


def decode_layer(spec: CheckpointQuantSpec, tensors: dict[str, torch.Tensor]) -> QuantizedWeight:
    if spec.method == "gptq":
        return from_gptq_tensors(tensors, spec.bits, spec.group_size, spec.sym, spec.checkpoint_format)
    return from_awq_tensors(tensors, spec.group_size)


def shape_problem(spec: CheckpointQuantSpec, tensors: dict[str, torch.Tensor], out: int, cols: int) -> str | None:
    """What is wrong with one layer's tensor shapes for a weight [out, cols] in this format, or None."""
    if spec.method == "gptq":
        return gptq_shape_problem(tensors, spec.bits, out, cols)
    return awq_shape_problem(tensors, out, cols)


def load_quantized_weights(
    net: CausalLM,
    cfg,
    tensors: Iterable[tuple[str, torch.Tensor]],
    path: Path,
    file_of: Callable[[str], Path | None] | None = None,
) -> QuantizedWeight | None:
    """Fill `net` from a quantized checkpoint: quantized linears get packed buffers and kernels,
    everything else loads as usual. Returns the quantized LM head of a model with tied embeddings
    (None if the checkpoint has none; an untied lm_head is installed like any other layer).
    Raises ModelLoadError naming the file (file_of: tensor name -> its file) on any inconsistency."""

    def where(name: str) -> Path:
        f = file_of(name) if file_of is not None else None
        return f if f is not None else path

    try:
        spec = parse_quantization_config(cfg.quantization_config, f"{path}/config.json")
    except ValueError as e:
        raise ModelLoadError(str(e)) from None
    quant: dict[str, dict[str, torch.Tensor]] = {}
    dense: list[tuple[str, torch.Tensor]] = []
    for name, t in tensors:
        prefix, _, kind = name.rpartition(".")
        if kind in _QUANT_SUFFIXES:
            quant.setdefault(prefix, {})[kind] = t
        else:
            dense.append((name, t))
    modules = dict(net.named_modules())
    mapping = net.packed_modules_mapping
    parts: dict[str, dict[int, QuantizedWeight]] = {}
    tied_head: QuantizedWeight | None = None
    if cfg.quantization_config.get("lm_head") and "lm_head" not in quant:
        raise ModelLoadError(
            f"{path}/config.json: quantization_config says lm_head is quantized, but the checkpoint "
            "has no lm_head.qweight"
        )
    for prefix, t in quant.items():
        missing = {"qweight", "qzeros", "scales"} - set(t)
        if missing:
            raise ModelLoadError(f"{where(prefix + '.' + next(iter(t)))}: {prefix} lacks {sorted(missing)}")
        parent, _, leaf = prefix.rpartition(".")
        target, shard = (f"{parent}.{mapping[leaf][0]}", mapping[leaf][1]) if leaf in mapping else (prefix, 0)
        tied = prefix == "lm_head" and net.lm_head is None
        if tied:
            out, cols = cfg.vocab_size, cfg.hidden_size
        elif isinstance(modules.get(target), Linear):
            out, cols = modules[target].output_sizes[shard], modules[target].in_features
        else:
            raise ModelLoadError(f"{path}: quantized tensor {prefix}.qweight has no place in the model")
        what = "the LM head" if prefix == "lm_head" else prefix
        problem = shape_problem(spec, t, out, cols)
        if problem:
            raise ModelLoadError(f"{where(prefix + '.qweight')}: {what}: {problem}")
        try:
            qw = decode_layer(spec, t)
        except (ValueError, RuntimeError) as e:
            raise ModelLoadError(f"{where(prefix + '.qweight')}: {what}: {e}") from e
        if tied:
            tied_head = qw
        else:
            parts.setdefault(target, {})[shard] = qw
    dtype = next(p.dtype for p in net.parameters() if p.is_floating_point())
    try:
        loaded = net.load_weights(dense)
    except (KeyError, ValueError) as e:
        raise ModelLoadError(f"{path}: {e}") from e
    for target, by_shard in parts.items():
        mod = modules[target]
        if sorted(by_shard) != list(range(len(mod.output_sizes))):
            raise ModelLoadError(
                f"{path}: {target} needs {len(mod.output_sizes)} quantized parts, got {sorted(by_shard)}"
            )
        try:
            install_quantized(mod, concat_rows([by_shard[i] for i in range(len(by_shard))]), dtype)
        except ValueError as e:
            raise ModelLoadError(f"{path}: {target}: {e}") from e
    expected = {n for n, _ in net.named_parameters()}
    missing = expected - loaded
    if missing:
        raise ModelLoadError(f"{path}: checkpoint lacks {len(missing)} tensors, e.g. {sorted(missing)[:3]}")
    return tied_head
