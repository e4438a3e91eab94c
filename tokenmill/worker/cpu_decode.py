"""The C++ layer loop for CPU steps of a few tokens per request: decodes and speculative verification.

Why: a decode step of the default model spent ~95 us per layer in Python around its kernels (module
calls, method dispatch, views): ~3 ms of an 8-10 ms step, as much as all int4 matmuls together.
`csrc/decode_stack.cpp` runs the layer that `LlamaDecoderLayer` defines, step for step, in one call, with the
other families' steps (Qwen3, Gemma 3: in brackets) where the layout has them:

    h = embed(ids); res = None                      (Gemma: the embed scales the rows)
    for each layer:
        x, res = norm(h)  or  add_norm(h, res)      (residual carried, as vLLM does)
        qkv = linear(x);  [q_norm, k_norm per head];  rope(qkv) in place with the layer's table
        write k, v to their group's slots and attend  (one kernel; every token a decode over its own prefix,
                                                       from its window's first key in a windowed group)
        h = o(attn);  [h = attn_out_norm(h)]
        x, res = add_norm(h, res);  h = down(act(gate_up(x)));  [h = mlp_out_norm(h)]
    return final_norm(h + res)

Llama, Mistral, Qwen2 (q/k/v biases), Qwen3 and Gemma 3 (four norms of 1 + w, GeGLU, two RoPE bases, sliding
windows) all run in it; their differences are the layout's data (models/interface.py), not loops.

It is built once, at load, from the model's `DecoderLayout` (models/interface.py) and each linear's
`LinearKernel` (layers/linear.py): the kernel the layer's method itself calls at those row counts, so
the loop and the module path give the same bits. `build` returns None (the runner keeps the module
path) when a piece is missing: the C++ kernels, float32/bfloat16 activations and KV cache (not int8
KV), or a linear whose method names no kernel (act-order columns, quantized biases, plain int4).
The loop serves a step when the step's tokens are within every kernel's `max_rows` and its attention is one
the loop runs: per-token metadata from the runner (decodes, verification, short chunks; every step where prompts
are attended token by token), or a step with long prompt chunks that the tiled prefill kernel serves (bf16 on
AVX512-BF16 CPUs): the backend's `tiled_plan` for the chunks, per token for the rest, as the module path does.
Without that, a step mixing one prompt chunk with 30 decodes ran all 30 layers on the module path (measured on
an AVX-512 host: 30 decodes 39-43 ms in the loop, 45.6 ms on the module path, 119 ms with 80 prompt tokens).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from tokenmill import native
from tokenmill.attention import cpu_kernels
from tokenmill.attention.backend import tiled_plan
from tokenmill.attention.metadata import AttentionKind, AttentionMetadata
from tokenmill.layers.linear import KernelKind, LinearKernel
from tokenmill.models.interface import DecoderLayout, LayerTaps


class CpuDecodeLoop:
    def __init__(self, stack, layout: DecoderLayout, max_rows: int, tiles_prompts: bool) -> None:
        self.stack = stack
        """torch.classes.tokenmill.DecodeStack holding every layer's tensors."""
        self.embed = layout.embed
        self.num_kv_groups = layout.num_kv_groups
        """The KV-cache groups whose metadata every call takes (group 0's, then groups 1..)."""
        self.max_rows = max_rows
        """The most tokens a step may have for the loop to serve it (the smallest kernel max_rows)."""
        self.tiles_prompts = tiles_prompts
        """The tiled prefill kernel serves this model here (bf16 caches, head_dim 64/128, AVX512-BF16)."""
        self.tiled_steps_served = 0
        """Steps it served with long prompt chunks attended tiled (tests read it)."""
        self.steps_served = 0
        """Steps this loop computed (tests read it to know the loop, not the module path, served)."""
        self.max_tokens_served = 0
        """The largest step (in tokens) it served."""

    def serves(self, meta: AttentionMetadata, num_tokens: int, group_metas: Sequence[AttentionMetadata] = ()) -> bool:
        """meta: KV-cache group 0's; group_metas: groups 1.. (a model with windowed layers), the runner's
        StepInputs.group_metas."""
        if len(group_metas) + 1 != self.num_kv_groups:
            raise ValueError(f"needs {self.num_kv_groups} KV-cache groups' metadata, got {1 + len(group_metas)}")
        metas = [meta, *group_metas]
        if any(m.custom_mask is not None for m in metas) or num_tokens > self.max_rows:
            return False
        if all(m.plan is AttentionKind.PER_TOKEN for m in metas):
            return all(m.token_seq_lens is not None for m in metas)
        # NOTE: a tiled step of a model with windowed groups runs the module path (one TiledPrompts per global
        # group is not written yet); Gemma 3 270M to 12B have head_dim 256, which is never tiled
        return not group_metas and self.tiles_prompts and tiled_plan(meta) is not None

    def __call__(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        meta: AttentionMetadata,
        group_metas: Sequence[AttentionMetadata] = (),
        taps: LayerTaps | None = None,
    ) -> torch.Tensor:
        return self.forward_rows(self.embed(input_ids), positions, meta, group_metas, taps)

    def forward_rows(
        self,
        h: torch.Tensor,
        positions: torch.Tensor,
        meta: AttentionMetadata,
        group_metas: Sequence[AttentionMetadata] = (),
        taps: LayerTaps | None = None,
    ) -> torch.Tensor:
        """The layers and final norm over input rows h [n, hidden] (embedded tokens, or a head's own input);
        `taps` also receives chosen layers' outputs (models/interface.py)."""
        n = h.shape[0]
        tap_rows, tap_layers = (None, []) if taps is None else (taps.buffer(h), list(taps.layers))
        self.steps_served += 1
        self.max_tokens_served = max(self.max_tokens_served, n)
        if meta.plan is AttentionKind.PER_TOKEN:
            metas = [meta, *group_metas]  # every group PER_TOKEN (serves): same lengths and key masks
            return self.stack.forward(
                h,
                positions,
                [m.slot_mapping for m in metas],
                [m.token_block_tables for m in metas],
                meta.token_seq_lens,
                meta.token_key_mask,
                [m.key_start for m in metas],
                None,
                tap_rows,
                tap_layers,
            )
        plan = tiled_plan(meta)
        assert plan is not None, "serves() admitted a step without per-token metadata or long prompt chunks"
        self.tiled_steps_served += 1
        tiled = torch.classes.tokenmill.TiledPrompts(
            plan.block_tables.contiguous(),
            plan.seq_lens.contiguous(),
            plan.q_start.contiguous(),
            plan.q_len.contiguous(),
            None if plan.short is None else plan.short.index,
        )
        if plan.short is None:
            empty = torch.empty(0, 1, dtype=torch.long)
            return self.stack.forward(
                h, positions, [meta.slot_mapping], [empty], empty[:, 0], None, [None], tiled, tap_rows, tap_layers
            )
        short = plan.short.tables
        return self.stack.forward(
            h,
            positions,
            [meta.slot_mapping],
            [short.block_tables],
            short.seq_lens.contiguous(),
            short.key_mask,
            [None],
            tiled,
            tap_rows,
            tap_layers,
        )


def build(layout: DecoderLayout | None, kv_caches: list[torch.Tensor]) -> CpuDecodeLoop | None:
    """The loop for a model's decoder layers and their per-layer caches [2, nb, bs, Hkv, D], or None."""
    if layout is None or not native.available() or len(layout.layers) != len(kv_caches):
        return None
    dtype = layout.final_norm.dtype
    if (
        dtype not in (torch.float32, torch.bfloat16)
        or layout.final_norm.device.type != "cpu"
        or any(t.dtype != torch.float32 for t in layout.cos_sin)
    ):
        return None
    if any(c.dtype != dtype or c.shape[-1] != layout.head_dim for c in kv_caches):  # int8 KV: module path
        return None
    kernels: list[list[LinearKernel]] = []
    for parts in layout.layers:
        maybe = [lin.kernel() for lin in (parts.qkv, parts.o, parts.gate_up, parts.down)]
        ks = [k for k in maybe if k is not None]
        if len(ks) != len(maybe):
            return None
        kernels.append(ks)
    stack = torch.classes.tokenmill.DecodeStack(
        layout.num_heads,
        layout.num_kv_heads,
        layout.head_dim,
        layout.eps,
        layout.scale,
        layout.cos_sin,
        layout.final_norm,
        int(layout.activation),
        layout.unit_offset_norms,
    )
    for parts, ks, cache in zip(layout.layers, kernels, kv_caches):
        stack.add_layer(
            parts.input_norm,
            parts.mlp_norm,
            parts.attn_out_norm,
            parts.mlp_out_norm,
            parts.q_norm,
            parts.k_norm,
            cache[0],
            cache[1],
            parts.kv_group,
            parts.rope,
        )
        for k in ks:
            if k.kind is KernelKind.GGUF:
                stack.add_gguf_linear(list(k.parts), list(k.part_types), k.bias, k.out_features)
            else:
                stack.add_linear(int(k.kind), k.weight, k.aux, k.extra, k.bias, k.group, k.out_features)
    tiles_prompts = cpu_kernels.tiled_prefill_serves(dtype, layout.head_dim)
    return CpuDecodeLoop(stack, layout, min(k.max_rows for ks in kernels for k in ks), tiles_prompts)
