"""A block drafter (DFlash-style): a few transformer layers that denoise a whole block of positions in one pass,
conditioned on the target's hidden states from several of its layers.

At drafting time a request holds tokens t_0 .. t_{N-1}; the target has computed positions 0 .. N-2 (t_{N-1}, the
token it just sampled, is not fed yet). The drafter's block sits at positions N-1 .. N+B-2:

    position      0 .. N-2 (context)                 N-1          N        ...     N+B-2
    input         target features f_p (chosen        embed(t_N-1)  [mask]   ...     [mask]
                  layers, side by side)
    drafter       c_p = ctx_norm(fc([rms(f_p^1) | rms(f_p^2) | ...]))  ->  each draft layer's keys and values
    output                                           -            d_1      ...     d_{B-1}

Every draft layer's attention reads the context rows' keys and values (its own k/v projections of c_p, RoPE at
p) and the block's own, bidirectionally inside the block; block rows never see later context because there is
none. The mask rows predict the tokens at their positions, so one forward gives B - 1 drafts. The embedding and
the LM head are the target's (tied, shared tensors): the head keeps only `draft_vocab` rows, the tokens the target
emits most often, as EAGLE's does here (a draft outside them is never proposed: acceptance, never exactness).

One plain-torch forward serves training (autograd); drafting runs the same math through the runtime's kernels
(`forward_blocks_fused`: fused norms, RoPE and SwiGLU, the prepared linears, bf16 or Q8_0, the decode attention
kernel over each request's own context buffers), and tests hold the two together within a tolerance. Context
keys and values depend only on c_p and p, so drafting computes them once per position (`context_kv`) and keeps
them.

Directory (written by `tokenmill train-drafter`, read by `load_block_drafter`):

    drafter_config.json   {"format": "tokenmill-block-drafter", "version": 1, "target": NAME, "target_arch": {...},
                           "arch": {draft layers' ModelArchConfig}, "target_layers": [...], "block_size": B,
                           "num_draft_vocab": N, "training": {...}}
    model.safetensors     fc, ctx_norm, mask_embed, layers.{i}.*, norm, draft_vocab (int64 [N]); bfloat16
    README.md             the card: how it was trained, on what, what it measured
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import cast

import torch
import torch.nn.functional as F
from torch import nn

from tokenmill import native
from tokenmill.config import ModelArchConfig
from tokenmill.layers import fused_ops
from tokenmill.layers.linear import Linear
from tokenmill.layers.norm import normalize_parts, plain_rms_norm
from tokenmill.layers.rotary import RotaryEmbedding
from tokenmill.quant.gguf import GGUFPart, install_gguf, kernel_name
from tokenmill.spec_decode.eagle_head import (
    arch_from_dict,
    arch_to_dict,
    copy_checked,
    read_head_config,
    read_head_weights,
)

ContextKV = list[tuple[torch.Tensor, torch.Tensor]]
"""Per draft layer, (keys after RoPE, values) of context rows, each [..., T, kv_heads, d]."""
Mask = torch.Tensor | None
"""[S, Q, T + Q] bool, True = may attend; None: every row sees every key."""

FORMAT = "tokenmill-block-drafter"
VERSION = 1
CONFIG_FILE = "drafter_config.json"
WEIGHTS_FILE = "model.safetensors"
TARGET_FIELDS = ("hidden_size", "vocab_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads")
"""The target's arch fields a drafter is bound to: another target is refused when any differs."""


def default_target_layers(num_layers: int, count: int = 3) -> tuple[int, ...]:
    """`count` target layers spread from shallow to deep, the last included (30 layers, 3 -> (1, 15, 29))."""
    if count == 1:
        return (num_layers - 1,)
    return tuple(sorted({round(1 + i * (num_layers - 2) / (count - 1)) for i in range(count)}))


class DraftLayer(nn.Module):
    """A pre-norm Llama layer (SwiGLU) whose attention also reads the context's keys and values."""

    def __init__(self, arch: ModelArchConfig, dtype: torch.dtype) -> None:
        super().__init__()
        h, d = arch.hidden_size, arch.head_dim
        nh, nkv = arch.num_attention_heads, arch.num_key_value_heads
        self.in_norm = nn.Parameter(torch.ones(h, dtype=dtype))
        self.qkv = nn.Parameter(torch.empty((nh + 2 * nkv) * d, h, dtype=dtype))
        self.o = nn.Parameter(torch.empty(h, nh * d, dtype=dtype))
        self.mlp_norm = nn.Parameter(torch.ones(h, dtype=dtype))
        self.gate_up = nn.Parameter(torch.empty(2 * arch.intermediate_size, h, dtype=dtype))
        self.down = nn.Parameter(torch.empty(h, arch.intermediate_size, dtype=dtype))


class BlockDrafter(nn.Module):
    """See the module docstring. `embed` [V, H] is the target's token table; `lm_rows` [N, H] its LM-head rows of
    `draft_vocab` (both shared, not parameters)."""

    draft_vocab: torch.Tensor  # buffers (register_buffer in __init__)
    cos_sin: torch.Tensor
    ones: torch.Tensor

    def __init__(
        self,
        arch: ModelArchConfig,
        target_layers: tuple[int, ...],
        block_size: int,
        embed: torch.Tensor,
        lm_rows: torch.Tensor,
        draft_vocab: torch.Tensor,
        dtype: torch.dtype = torch.float32,
    ) -> None:
        super().__init__()
        if block_size < 2:
            raise ValueError("a block drafter's block holds the last token and at least one mask: block_size >= 2")
        h = arch.hidden_size
        self.arch = arch
        self.target_layers = tuple(target_layers)
        self.block_size = block_size
        self.fc = nn.Parameter(torch.empty(h, len(target_layers) * h, dtype=dtype))
        self.ctx_norm = nn.Parameter(torch.ones(h, dtype=dtype))
        self.mask_embed = nn.Parameter(torch.zeros(h, dtype=dtype))
        self.layers = nn.ModuleList(DraftLayer(arch, dtype) for _ in range(arch.num_hidden_layers))
        self.norm = nn.Parameter(torch.ones(h, dtype=dtype))
        rot = RotaryEmbedding(arch.head_dim, arch.max_position_embeddings, arch.rope_theta, arch.rope_scaling)
        self.register_buffer("cos_sin", rot.cos_sin, persistent=False)
        self.register_buffer("draft_vocab", draft_vocab.to(torch.long), persistent=False)
        self.register_buffer("ones", torch.ones(h, dtype=dtype), persistent=False)
        if tuple(lm_rows.shape) != (len(draft_vocab), h):
            raise ValueError(f"lm_rows must be [{len(draft_vocab)}, {h}], got {tuple(lm_rows.shape)}")
        self.embed = embed.detach()
        self.lm_rows = lm_rows.detach().to(dtype).contiguous()
        self.kernels: dict[str, Linear] = {}
        """Inference copies of the weights for the runtime's linear kernels (oneDNN reorders a plain bf16 weight on
        every call: F.linear made a draft step cost more than a target step), built by `prepare_kernels` once the
        weights are final; empty (training): plain F.linear, which autograd follows."""

    def prepare_kernels(self, weights: str = "auto") -> None:
        """The weights are final (loaded): build the kernels' copies of every matrix. weights "dense": in the
        drafter's dtype; "q8_0": int8 codes per 32 weights with a float16 scale (quant/gguf.py's Q8_0), read by the
        GGUF integer kernel, about half the bytes of bf16 (the pass reads every matrix once, so it runs at the
        memory bound: fewer bytes, a cheaper draft); "auto": q8_0 on a CPU whose integer kernel runs when every
        matrix packs, else dense. The checkpoint stays bf16; only these copies are Q8_0."""
        a = self.arch
        split = a.num_attention_heads * a.head_dim
        self.kernels = {}
        if weights == "auto":  # q8_0 wherever it can run
            weights = "q8_0" if kernel_name() != "none" and self.fc.device.type == "cpu" and self.fits_q8_0 else "dense"
        if weights == "q8_0":
            if kernel_name() == "none":
                raise RuntimeError(
                    "block drafter weights q8_0 need the GGUF integer kernel (AVX2 or AVX512-VNNI and tokenmill's C++ "
                    f"kernels); this CPU runs none (ISA {native.isa()}): use draft_weights dense"
                )
            if not self.fits_q8_0:
                raise ValueError(
                    "block drafter weights q8_0 need every matrix's rows in 16s and inputs in 32s (hidden "
                    f"{a.hidden_size}, intermediate {a.intermediate_size}, head_dim {a.head_dim}): "
                    "use draft_weights dense"
                )
            fc, lm = GGUFPart.from_dense_q8_0(self.fc), GGUFPart.from_dense_q8_0(self.lm_rows)
            parts: dict[str, list[GGUFPart]] = {"fc": [fc], "lm": [lm]}
            for i, layer in enumerate(self.draft_layers):
                q, kv = GGUFPart.from_dense_q8_0(layer.qkv[:split]), GGUFPart.from_dense_q8_0(layer.qkv[split:])
                parts |= {f"{i}.qkv": [q, kv], f"{i}.kv": [kv]}  # one copy of the k/v rows serves both
                parts |= {f"{i}.o": [GGUFPart.from_dense_q8_0(layer.o)]}
                parts |= {f"{i}.gate_up": [GGUFPart.from_dense_q8_0(layer.gate_up)]}
                parts |= {f"{i}.down": [GGUFPart.from_dense_q8_0(layer.down)]}
            for name, ps in parts.items():
                lin = Linear(ps[0].cols, sum(p.rows for p in ps), dtype=self.dtype)
                install_gguf(lin, ps)
                self.kernels[name] = lin
            return
        if weights != "dense":
            raise ValueError(f"block drafter weights must be dense or q8_0, got {weights!r}")
        mats = {"fc": self.fc, "lm": self.lm_rows}
        for i, layer in enumerate(self.draft_layers):
            mats |= {f"{i}.qkv": layer.qkv, f"{i}.kv": layer.qkv[split:], f"{i}.o": layer.o}
            mats |= {f"{i}.gate_up": layer.gate_up, f"{i}.down": layer.down}
        for name, w in mats.items():
            lin = Linear(w.shape[1], w.shape[0], dtype=w.dtype)
            lin.weight = nn.Parameter(w.detach().contiguous(), requires_grad=False)
            lin.process_weights_after_loading()
            self.kernels[name] = lin

    @property
    def fits_q8_0(self) -> bool:
        """Every matrix packs into the GGUF kernel's row groups: rows in 16s, inputs in 32s."""
        a = self.arch
        rows = (a.num_attention_heads * a.head_dim, a.num_key_value_heads * a.head_dim, a.hidden_size)
        cols = (a.hidden_size, a.intermediate_size, a.num_attention_heads * a.head_dim)
        return all(r % 16 == 0 for r in (*rows, 2 * a.intermediate_size, len(self.draft_vocab))) and all(
            c % 32 == 0 for c in cols
        )

    def _linear(self, x: torch.Tensor, w: torch.Tensor, name: str) -> torch.Tensor:
        k = self.kernels.get(name)
        if k is None:
            return F.linear(x, w)
        return k(x.reshape(-1, x.shape[-1])).reshape(*x.shape[:-1], -1)

    @property
    def dtype(self) -> torch.dtype:
        return self.fc.dtype

    @property
    def draft_layers(self) -> list[DraftLayer]:
        return cast("list[DraftLayer]", list(self.layers))

    # ------------------------------------------------------------------ pieces
    def _rope(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """x [..., T, heads, d] at positions [..., T] (the half-rotation layout of layers/rotary.py)."""
        d = x.shape[-1]
        cs = self.cos_sin[positions].to(x.dtype)  # [..., T, d]
        cos, sin = cs[..., None, : d // 2], cs[..., None, d // 2 :]
        x1, x2 = x[..., : d // 2], x[..., d // 2 :]
        return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)

    def encode_context(self, features: torch.Tensor) -> torch.Tensor:
        """Target features [..., len(target_layers) * H] -> context rows c [..., H]: each layer's feature RMS-
        normalized (their scales differ by depth), fused by fc, normed."""
        h, eps = self.arch.hidden_size, self.arch.rms_norm_eps
        if self.fused:  # every part normed at once: [n, k H] seen as [n k, H]; the weight of ones changes nothing
            f = features.to(self.dtype).contiguous()
            parts = fused_ops.rms_norm(f.view(-1, h), self.ones, eps).view(f.shape)
            return fused_ops.rms_norm(self._linear(parts, self.fc, "fc"), self.ctx_norm, eps)
        parts = normalize_parts(features.to(self.dtype), h, eps)
        return plain_rms_norm(self._linear(parts, self.fc, "fc"), self.ctx_norm, eps)

    def context_kv(self, ctx: torch.Tensor, positions: torch.Tensor) -> ContextKV:
        """Context rows [..., T, H] at positions [..., T] -> per draft layer (keys after RoPE, values), each
        [..., T, kv_heads, d]: what every block after them attends to."""
        a = self.arch
        nh, nkv, d = a.num_attention_heads, a.num_key_value_heads, a.head_dim
        out = []
        if self.fused:  # RoPE in place on the keys of each packed [k | v] row
            flat_pos = positions.reshape(-1).to(torch.long).contiguous()
            for i in range(len(self.layers)):
                kv = self.kernels[f"{i}.kv"](ctx.reshape(-1, ctx.shape[-1]))
                self._rope_rows(kv, nkv, flat_pos)
                k, v = kv.view(*ctx.shape[:-1], 2, nkv, d).unbind(-3)
                out.append((k, v))
            return out
        for i, layer in enumerate(self.draft_layers):
            kv = self._linear(ctx, layer.qkv[nh * d :], f"{i}.kv")
            k, v = kv.split([nkv * d, nkv * d], dim=-1)
            k = self._rope(k.unflatten(-1, (nkv, d)), positions)
            out.append((k, v.unflatten(-1, (nkv, d))))
        return out

    def block_rows(self, anchor_ids: torch.Tensor) -> torch.Tensor:
        """Anchor tokens [...] -> the blocks' input rows [..., B, H]: the anchor's embedding, then mask rows."""
        e = F.embedding(anchor_ids, self.embed).to(self.dtype)
        masks = self.mask_embed.expand(*anchor_ids.shape, self.block_size - 1, -1)
        return torch.cat([e.unsqueeze(-2), masks], dim=-2)

    def forward_blocks(self, x: torch.Tensor, positions: torch.Tensor, ctx_kv: ContextKV, mask: Mask) -> torch.Tensor:
        """Block rows x [S, Q, H] (Q = blocks x B, block by block) at positions [S, Q], attending to the context
        keys/values ctx_kv (per layer, [S, T, kv_heads, d]) and to the block rows themselves, as `mask`
        [S, Q, T + Q] (True = may attend) says; None: every row sees every key (one block per row of S).
        Returns the final-normed hidden states [S, Q, H]."""
        a = self.arch
        nh, nkv, d, eps = a.num_attention_heads, a.num_key_value_heads, a.head_dim, a.rms_norm_eps
        S, Q, _ = x.shape
        rep = nh // nkv
        attn_mask = None if mask is None else mask[:, None]
        for i, (layer, (kc, vc)) in enumerate(zip(self.draft_layers, ctx_kv)):
            qkv = self._linear(plain_rms_norm(x, layer.in_norm, eps), layer.qkv, f"{i}.qkv")
            q, k, v = qkv.split([nh * d, nkv * d, nkv * d], dim=-1)
            q = self._rope(q.unflatten(-1, (nh, d)), positions)
            k = self._rope(k.unflatten(-1, (nkv, d)), positions)
            keys = torch.cat([kc, k], dim=1).repeat_interleave(rep, dim=2).transpose(1, 2)
            vals = torch.cat([vc, v.unflatten(-1, (nkv, d))], dim=1).repeat_interleave(rep, dim=2).transpose(1, 2)
            o = F.scaled_dot_product_attention(q.transpose(1, 2), keys, vals, attn_mask=attn_mask, scale=d**-0.5)
            x = x + self._linear(o.transpose(1, 2).reshape(S, Q, nh * d), layer.o, f"{i}.o")
            g, u = self._linear(plain_rms_norm(x, layer.mlp_norm, eps), layer.gate_up, f"{i}.gate_up").chunk(2, dim=-1)
            x = x + self._linear(F.silu(g) * u, layer.down, f"{i}.down")
        return plain_rms_norm(x, self.norm, eps)

    def forward_blocks_fused(
        self, x: torch.Tensor, positions: torch.Tensor, buffers: list[ContextKV], lengths: list[int]
    ) -> torch.Tensor:
        """forward_blocks when drafting, one block per request: x [S, B, H] at positions [S, B]; request s's
        context keys and values are the first lengths[s] rows of buffers[s] (per draft layer (keys, values)
        [capacity, kv_heads, d], capacity a multiple of 16 and at least lengths[s] + B). The same math as
        forward_blocks through the runtime's kernels: fused RMS norms, RoPE in place on the packed qkv rows,
        SwiGLU, the prepared linears, and attention by the decode kernel (csrc/attention.cpp): the block's keys
        and values are written into the buffer after the context, and each block row attends to all
        lengths[s] + B keys, which is the block's bidirectional attention:

            buffer rows  0 .. T-1 context | T .. T+B-1 this block (scratch: the next encoding overwrites them)
            every block row: seq_len T + B over 16-row blocks 0, 1, ... of the buffer

        Rounding differs from the plain forward's (tests bound it); drafts are exact whatever q is, since the
        verifier is given the q each draft was drawn from."""
        a = self.arch
        nh, nkv, d, eps = a.num_attention_heads, a.num_key_value_heads, a.head_dim, a.rms_norm_eps
        S, Q, H = x.shape
        ops = native.ops()
        assert ops is not None  # `fused` checked it
        pos = positions.reshape(-1).to(torch.long).contiguous()
        x = x.reshape(S * Q, H).contiguous()
        seq_lens = [torch.full((Q,), n + Q, dtype=torch.long) for n in lengths]
        tables = []
        for buf, n in zip(buffers, lengths):
            cap = buf[0][0].shape[0]
            if cap % 16 or cap < n + Q:
                raise ValueError(
                    f"drafter context buffer of {cap} rows cannot take {n} + {Q} (16s, room for the block)"
                )
            tables.append(torch.arange(cap // 16).expand(Q, -1).contiguous())
        for i in range(len(self.layers)):
            layer = self.draft_layers[i]
            qkv = self.kernels[f"{i}.qkv"](fused_ops.rms_norm(x, layer.in_norm, eps))
            self._rope_rows(qkv, nh, pos)
            self._rope_rows(qkv[:, nh * d :], nkv, pos)
            o = x.new_empty(S * Q, nh, d)
            for r in range(S):
                rows = qkv[r * Q : (r + 1) * Q]
                kb, vb = buffers[r][i]
                n = lengths[r]
                k, v = rows[:, nh * d :].view(Q, 2, nkv, d).unbind(1)
                kb[n : n + Q], vb[n : n + Q] = k, v
                ops.paged_decode(
                    o[r * Q : (r + 1) * Q],
                    rows[:, : nh * d].view(Q, nh, d),
                    kb.view(-1, 16, nkv, d),
                    vb.view(-1, 16, nkv, d),
                    tables[r],
                    seq_lens[r],
                    d**-0.5,
                )
            h, x = fused_ops.add_rms_norm(self.kernels[f"{i}.o"](o.view(S * Q, nh * d)), x, layer.mlp_norm, eps)
            x = x + self.kernels[f"{i}.down"](fused_ops.silu_and_mul(self.kernels[f"{i}.gate_up"](h)))
        return fused_ops.rms_norm(x, self.norm, eps).view(S, Q, H)

    def _rope_rows(self, rows: torch.Tensor, heads: int, positions: torch.Tensor) -> None:
        """RoPE in place on the first `heads` heads of every row of rows [n, width] (the fused kernel)."""
        if not fused_ops.rope_inplace(rows, heads, self.arch.head_dim, self.cos_sin, positions):
            raise RuntimeError(f"the fused RoPE kernel refused rows {tuple(rows.shape)} {rows.dtype}")

    @property
    def fused(self) -> bool:
        """Drafting through the runtime's kernels (forward_blocks_fused, and the fused encoding): they were
        prepared (not training), the C++ ops exist, and autograd is off."""
        return bool(self.kernels) and native.ops() is not None and not torch.is_grad_enabled()

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[..., H] -> logits over draft_vocab [..., N] in float32."""
        return self._linear(hidden, self.lm_rows, "lm").float()

    # ------------------------------------------------------------------ files
    def save(self, directory: str | Path, target_name: str, target_arch: ModelArchConfig, training: dict) -> None:
        from safetensors.torch import save_file

        d = Path(directory)
        d.mkdir(parents=True, exist_ok=True)
        cfg = {
            "format": FORMAT,
            "version": VERSION,
            "target": target_name,
            "target_arch": {k: getattr(target_arch, k) for k in TARGET_FIELDS},
            "arch": arch_to_dict(self.arch),
            "target_layers": list(self.target_layers),
            "block_size": self.block_size,
            "num_draft_vocab": int(len(self.draft_vocab)),
            "training": training,
        }
        (d / CONFIG_FILE).write_text(json.dumps(cfg, indent=1) + "\n")
        tensors = {k: v.detach().to(torch.bfloat16).contiguous() for k, v in self.named_parameters()}
        tensors["draft_vocab"] = self.draft_vocab.detach().cpu().contiguous()
        save_file(tensors, str(d / WEIGHTS_FILE))


def drafter_arch(target: ModelArchConfig, num_layers: int) -> ModelArchConfig:
    """The draft layers have the target's layer shape, `num_layers` of them, no quantization."""
    return dataclasses.replace(target, num_hidden_layers=num_layers, quantization_config=None)


def read_drafter_config(directory: str | Path) -> dict:
    return read_head_config(
        Path(directory) / CONFIG_FILE,
        FORMAT,
        VERSION,
        "no block drafter here (train one with `tokenmill train-drafter`)",
    )


def load_block_drafter(
    directory: str | Path,
    target_arch: ModelArchConfig,
    embed: torch.Tensor,
    lm_weight: torch.Tensor,
    dtype: torch.dtype,
    device: str | torch.device = "cpu",
    for_training: bool = False,
    weights: str = "auto",
) -> BlockDrafter:
    """A drafter written by BlockDrafter.save, checked against the target it will draft for; every error names
    the file and the fault (a drafter made for another target is refused). for_training: no kernel copies (the
    plain forward, which autograd follows), to continue training it. weights: the kernels' copies, auto, dense or
    q8_0 (BlockDrafter.prepare_kernels)."""
    d = Path(directory)
    cfg_path, w_path = d / CONFIG_FILE, d / WEIGHTS_FILE
    cfg = read_drafter_config(d)
    made_for = cfg.get("target_arch") or {}
    wrong = {
        k: (made_for.get(k), getattr(target_arch, k))
        for k in TARGET_FIELDS
        if made_for.get(k) != getattr(target_arch, k)
    }
    if wrong:
        detail = ", ".join(f"{k} {a} vs the target's {b}" for k, (a, b) in wrong.items())
        raise ValueError(f"{cfg_path}: drafter made for another target ({cfg.get('target')!r}): {detail}")
    arch = arch_from_dict(cfg["arch"])
    layers = tuple(int(x) for x in cfg.get("target_layers", ()))
    if not layers or any(not 0 <= x < target_arch.num_hidden_layers for x in layers):
        raise ValueError(
            f"{cfg_path}: target_layers {list(layers)} not within the target's {target_arch.num_hidden_layers} layers"
        )
    tensors, vocab = read_head_weights(w_path, "block drafter", cfg.get("num_draft_vocab"), target_arch.vocab_size)
    with torch.device(device):
        drafter = BlockDrafter(
            arch, layers, int(cfg["block_size"]), embed, lm_weight[vocab.to(lm_weight.device)], vocab, dtype=dtype
        )
    copy_checked(w_path, dict(drafter.named_parameters()), tensors)
    for p in drafter.parameters():
        p.requires_grad_(False)
    drafter.eval()
    if not for_training:
        drafter.prepare_kernels(weights)
    return drafter
