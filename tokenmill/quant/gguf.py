"""GGUF (llama.cpp) weights kept quantized: linears and the embedding table read the file's codes and scales.

A GGUF file's Q4_0, Q4_1, Q5_0, Q8_0, Q4_K, Q5_K and Q6_K tensors are not dequantized at load. Their blocks

    Q4_0   32 weights   d f16 | 16 B of nibbles               w = d (q - 8)
    Q4_1   32           d f16 | m f16 | 16 B of nibbles       w = d q + m
    Q5_0   32           d | 32 fifth bits | 16 B of nibbles   w = d (q - 16)
    Q8_0   32           d | 32 int8                           w = d q
    Q4_K   256          d | dmin | 8 x (6-bit sc, 6-bit m) | 128 B of nibbles      w = d sc q - dmin m  (per 32)
    Q5_K   256          as Q4_K with a fifth bit per weight
    Q6_K   256          128 B low nibbles | 64 B 2-bit highs | 16 int8 sc | d     w = d sc (q - 32)  (per 16)

are repacked at load, losslessly, into row groups (csrc/gguf_layout.h): 16 weight rows at a time, each 32-weight
unit's codes interleaved by row so that one 512-bit integer dot product (vpdpbusd) serves 16 output rows, and
the float work per unit (two FMAs) is paid once per 16 rows instead of once per row. Every code, scale and
minimum is kept as the file has it, so every format is exact (the weights are the file's, to the float32
rounding ggml's own dequantizer does), and the resident weights are the file's bytes (Q4_K and Q5_K: 4 bytes
more per 256 weights, each 6-bit scale in a byte). Rows are independent, which is all the loader needs: Llama's
Q/K rows are put back in Hugging Face order by moving whole rows before packing, and a packed layer (q|k|v,
gate|up) keeps one part per checkpoint tensor, each with its own type (Gemma 3's Q4_K_M file mixes Q5_0 and Q8_0
inside one qkv). A tensor whose rows are not a multiple of 16 loads dense, and the log names it.

The kernel quantizes each activation row to int8 in groups of 32 (scale max|x| / 127, as llama.cpp's Q8
activations) and takes integer dot products with the codes: vpdpbusd on AVX512-VNNI, maddubs + madd on AVX2.
This is the one inexact step: logits differ from a float matmul against the dequantized weights by the
activations' rounding (bounded in tests/quant/test_gguf_native.py). Each row is computed alone, in the same
order whatever else is in the batch, so outputs are batch-invariant in float32 and bf16 alike.

Below AVX2 there is no integer kernel: the layer dequantizes its weights and runs a dense matmul, and says so in
the log once. `--gguf-dequantize` (ModelConfig.gguf_dequantize) restores the old load: every tensor
dequantized to the model dtype.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import nn

from tokenmill import native
from tokenmill.layers.linear import ANY_ROWS, KernelKind, Linear, LinearKernel

if TYPE_CHECKING:
    from tokenmill.models.causal_lm import CausalLM

logger = logging.getLogger("tokenmill")

GGML_TYPES = {"Q4_0": 2, "Q4_1": 3, "Q5_0": 6, "Q8_0": 8, "Q4_K": 12, "Q5_K": 13, "Q6_K": 14}
"""The block formats kept quantized (ggml type names -> ids, gguf.GGMLQuantizationType)."""
BLOCKS = {2: (32, 18), 3: (32, 20), 6: (32, 22), 8: (32, 34), 12: (256, 144), 13: (256, 176), 14: (256, 210)}
"""ggml type id -> (weights per block, bytes per block)."""
BITS = {2: 4, 3: 4, 6: 5, 8: 8, 12: 4, 13: 5, 14: 6}
"""ggml type id -> bits per weight code (Linear.quant_bits)."""


GROUP_ROWS = 16
"""Weight rows per packed group (csrc/gguf_layout.h): a tensor's rows must be a multiple of it to run packed."""


def served(ggml_type: int) -> bool:
    return ggml_type in BLOCKS


def packable(ggml_type: int, rows: int) -> bool:
    """A tensor of `rows` rows in `ggml_type` can run packed (otherwise it loads dense)."""
    return served(ggml_type) and rows % GROUP_ROWS == 0


def kernel_name() -> str:
    """The integer kernel at the ISA level in force: "avx512_vnni", "avx2", or "none" (dequantize instead)."""
    m = native.module()
    return "none" if m is None else m.gguf_kernel()


@functools.cache
def _warn_no_kernel() -> None:
    """Says once per process that the GGUF linears dequantize at every call."""
    logger.warning(
        "GGUF weights: no integer kernel on this CPU (%s: needs AVX2); every quantized linear dequantizes its "
        "weights at each call (slow). --gguf-dequantize dequantizes once at load instead.",
        "C++ kernels unavailable" if native.module() is None else f"ISA {native.isa()}",
    )


def _ops() -> Any:
    ops = native.ops()
    if ops is None:
        raise RuntimeError("GGUF weights kept quantized need tokenmill's C++ kernels (`bash scripts/install.sh`)")
    return ops


def quantize_q8_0(weight: torch.Tensor) -> torch.Tensor:
    """A dense weight [rows, cols] (cols a multiple of 32) as Q8_0 blocks [rows, cols / 32 * 34] uint8, as
    ggml's reference quantizer writes them: per 32 weights d = max|w| / 127, stored as float16 ahead of the 32
    codes round(w / d) (int8, within +-127; an all-zero block gets d = 0 and zero codes).

        w = [0.5, -1.0, 0.25, 0, ...]  ->  d = 1/127, codes [64, -127, 32, 0, ...]  (0.5 * 127 = 63.5 rounds to 64)
    """
    rows, cols = weight.shape
    if cols % 32:
        raise ValueError(f"Q8_0 needs a multiple of 32 weights per row, got {cols}")
    g = weight.detach().float().reshape(rows, cols // 32, 32)
    d = g.abs().amax(-1, keepdim=True) / 127.0
    inv = torch.where(d > 0, 1.0 / d, torch.zeros_like(d))
    codes = (g * inv).round().clamp(-127, 127).to(torch.int8)
    scale = d.to(torch.float16).view(torch.uint8).reshape(rows, cols // 32, 2)
    return torch.cat([scale, codes.view(torch.uint8)], dim=-1).reshape(rows, cols // 32 * 34).contiguous()


@dataclass(frozen=True)
class GGUFPart:
    """One checkpoint tensor of a (possibly packed) linear, its file's blocks repacked into row groups."""

    ggml_type: int
    packed: torch.Tensor
    """[rows / 16, in_features / block weights * record bytes] uint8 (csrc/gguf_layout.h)."""
    cols: int
    """in_features: the weights per row."""

    @classmethod
    def from_blocks(cls, ggml_type: int, blocks: torch.Tensor) -> GGUFPart:
        """Pack the file's blocks [rows, row bytes] uint8 (rows a multiple of 16): lossless."""
        weights, nbytes = BLOCKS[ggml_type]
        packed = _ops().gguf_pack(blocks.contiguous(), ggml_type)
        return cls(ggml_type, packed, blocks.shape[1] // nbytes * weights)

    @classmethod
    def from_dense_q8_0(cls, weight: torch.Tensor) -> GGUFPart:
        """A dense [rows, cols] weight (rows a multiple of 16, cols of 32) quantized to Q8_0 and packed: weights
        tokenmill makes itself (the block drafter's) read by the same integer kernel as a file's."""
        return cls.from_blocks(GGML_TYPES["Q8_0"], quantize_q8_0(weight))

    @property
    def rows(self) -> int:
        return self.packed.shape[0] * GROUP_ROWS

    def dequantize(self, dtype: torch.dtype, rows: torch.Tensor | None = None) -> torch.Tensor:
        """[R, in_features] in `dtype`: the rows `rows` (all when None), as ggml's dequantizer computes them."""
        idx = torch.arange(self.rows) if rows is None else rows.reshape(-1).long()
        out_dtype = dtype if dtype in (torch.float32, torch.bfloat16) else torch.float32
        out = torch.empty(idx.numel(), self.cols, dtype=out_dtype)
        _ops().gguf_dequantize_rows(out, self.packed, self.ggml_type, idx.contiguous())
        return out.to(dtype)


def linear(x2: torch.Tensor, parts: list[GGUFPart]) -> torch.Tensor | None:
    """x2 [M, K] (float32 or bf16, CPU) @ the parts' weights^T -> [M, sum of rows] in x2's dtype, or None where
    the integer kernel cannot serve (no kernels, below AVX2, another dtype or device)."""
    ops = native.ops()
    if ops is None or x2.device.type != "cpu" or x2.dtype not in (torch.float32, torch.bfloat16):
        return None
    x2 = x2.contiguous()
    y = x2.new_empty(x2.shape[0], sum(p.rows for p in parts))
    if not ops.gguf_linear(y, x2, [p.packed for p in parts], [p.ggml_type for p in parts]):
        return None
    return y


class GGUFLinearMethod:
    """A Linear whose weight is packed GGUF blocks, one GGUFPart per checkpoint tensor (layers/linear.py's method
    protocol). Holds no dense copy; `dequantize` builds one on demand (tests, the path below AVX2)."""

    def __init__(self, parts: list[GGUFPart]) -> None:
        self.parts = parts

    def dequantize(self, layer: Linear, dtype: torch.dtype) -> torch.Tensor:
        """[N, K] weight in `dtype` (a new tensor)."""
        return torch.cat([p.dequantize(dtype) for p in self.parts])

    def process_weights_after_loading(self, layer: Linear) -> None:
        """Nothing to build: the parts were packed at load."""

    def apply(self, layer: Linear, x: torch.Tensor) -> torch.Tensor:
        lead = x.shape[:-1]
        x2 = x.reshape(-1, x.shape[-1])
        y = linear(x2, self.parts)
        if y is None:
            _warn_no_kernel()
            y = F.linear(x2, self.dequantize(layer, x2.dtype))
        if layer.bias is not None:
            y = y + layer.bias
        return y.reshape(*lead, layer.out_features)

    def kernel(self, layer: Linear) -> LinearKernel | None:
        """The integer kernel at any row count (it is the one `apply` runs), or None without it."""
        if kernel_name() == "none" or self.parts[0].packed.device.type != "cpu":
            return None
        return LinearKernel(
            KernelKind.GGUF,
            self.parts[0].packed,
            None,
            None,
            layer.bias,
            0,
            layer.out_features,
            ANY_ROWS,
            tuple(p.packed for p in self.parts),
            tuple(p.ggml_type for p in self.parts),
        )


def install_gguf(layer: Linear, parts: list[GGUFPart]) -> None:
    """Make `layer` read `parts` (its checkpoint tensors in output order): the dense weight is dropped."""
    if sum(p.rows for p in parts) != layer.out_features:
        raise ValueError(f"GGUF parts have {sum(p.rows for p in parts)} rows, the layer {layer.out_features}")
    for p in parts:
        if p.cols != layer.in_features:
            raise ValueError(f"GGUF part of type {p.ggml_type}: {p.cols} inputs, the layer {layer.in_features}")
    if "weight" in layer._parameters:
        del layer._parameters["weight"]
    layer.weight = None  # type: ignore[assignment]  # a quantized layer has no dense weight (as quant/kernels.py)
    layer.quant_method = GGUFLinearMethod(parts)
    layer.quant_bits = max(BITS[p.ggml_type] for p in parts)


class GGUFEmbedding(nn.Module):
    """The token table kept quantized (a packed GGUFPart): rows for lookups (dequantized per requested row)
    and, for tied embeddings, the logits through the same kernel as any GGUF linear. Answers the calls a
    VocabEmbedding does (layers/embedding.py): forward(ids), as_lm_head(hidden), dense_table()."""

    def __init__(self, part: GGUFPart, embedding_dim: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.embedding_dim = embedding_dim
        self.dtype = dtype
        self.head = Linear(embedding_dim, part.rows, dtype=dtype)
        install_gguf(self.head, [part])

    @property
    def part(self) -> GGUFPart:
        method = self.head.quant_method
        assert isinstance(method, GGUFLinearMethod)
        return method.parts[0]

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """ids [*] -> [*, hidden] in the model dtype."""
        return self.part.dequantize(self.dtype, ids).reshape(*ids.shape, self.embedding_dim)

    def as_lm_head(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.head(hidden)

    def process_weights_after_loading(self) -> None:
        """Nothing to build."""

    def dense_table(self) -> torch.Tensor:
        """The whole table [vocab, hidden] dequantized (a new tensor)."""
        return self.part.dequantize(self.dtype)


# ------------------------------------------------------------------------------------------ loading

EMBED_NAME = "model.embed_tokens.weight"


def install_native(net: CausalLM, tensors: Iterable[tuple[str, GGUFPart]], dtype: torch.dtype) -> set[str]:
    """Put a GGUF file's quantized tensors (HF name, blocks) into `net` while it is still on the meta device:
    each linear whose every part came quantized reads them (its dense weight is dropped before `to_empty` could
    allocate it), a quantized token table becomes a GGUFEmbedding. Returns the HF names placed; the caller loads
    the rest dense (a packed layer with one dense part loads all its parts dense). Call `register_blocks` after
    `to_empty`. Raises ValueError naming the tensor when its shape does not fit the model."""
    modules = dict(net.named_modules())
    mapping = net.packed_modules_mapping
    by_target: dict[str, dict[int, tuple[str, GGUFPart]]] = {}
    placed: set[str] = set()
    for name, part in tensors:
        if name == EMBED_NAME:
            cfg = net.config
            if part.rows != cfg.vocab_size or part.cols != cfg.hidden_size:
                raise ValueError(f"{name}: [{part.rows}, {part.cols}] does not fit the table")
            with torch.device("meta"):
                net.model.embed_tokens = GGUFEmbedding(part, cfg.hidden_size, dtype)
            placed.add(name)
            continue
        module_path, _, _ = name.rpartition(".")
        parent, _, leaf = module_path.rpartition(".")
        target, shard = (f"{parent}.{mapping[leaf][0]}", mapping[leaf][1]) if leaf in mapping else (module_path, 0)
        mod = modules.get(target)
        if not isinstance(mod, Linear):
            continue  # the dense load names it
        if part.rows != mod.output_sizes[shard] or part.cols != mod.in_features:
            raise ValueError(
                f"{name}: [{part.rows}, {part.cols}] does not fit {target} "
                f"([{mod.output_sizes[shard]}, {mod.in_features}])"
            )
        by_target.setdefault(target, {})[shard] = (name, part)
    for target, shards in by_target.items():
        mod = modules[target]
        assert isinstance(mod, Linear)
        if sorted(shards) != list(range(len(mod.output_sizes))):
            continue
        install_gguf(mod, [shards[i][1] for i in range(len(shards))])
        placed.update(n for n, _ in shards.values())
    return placed


def register_blocks(net: nn.Module) -> None:
    """Register every GGUF linear's packed weights as its buffers (after `to_empty`, which would have emptied
    them), so that the module's buffers account for them."""
    for m in net.modules():
        if isinstance(m, Linear) and isinstance(m.quant_method, GGUFLinearMethod):
            for i, p in enumerate(m.quant_method.parts):
                m.register_buffer(f"gguf_blocks_{i}", p.packed, persistent=False)


def replace_table(net: CausalLM, choice: str, dtype: torch.dtype) -> None:
    """quantize_lm_head none / int8 / int4 over a GGUF token table: the dense table, or an RTN one built from it."""
    from tokenmill.layers.embedding import VocabEmbedding
    from tokenmill.quant.head import QuantizedEmbedding

    embed = net.model.embed_tokens
    if not isinstance(embed, GGUFEmbedding):
        return
    table = embed.dense_table().float()
    if choice == "none":
        dense = VocabEmbedding(table.shape[0], table.shape[1], dtype=dtype)
        dense.weight.data.copy_(table)
        net.model.embed_tokens = dense
    else:
        net.model.embed_tokens = QuantizedEmbedding(table, int(choice[3:]), dtype)
