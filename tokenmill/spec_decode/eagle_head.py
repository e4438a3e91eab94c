"""An EAGLE-style draft head: one decoder layer that extrapolates the target's last hidden state.

The target's feature f_i is its final hidden state at position i (after the final norm, the
vector its LM head reads). The head, at position i, reads f_i and the embedding of the token
that follows it, t_{i+1}, and predicts the next feature:

    x_i    = fc([embed(t_{i+1}) ; f_i])              [2H] -> [H]
    y_i    = decoder_layer(x_i)                      causal attention over the head's own KV cache
    f^_i+1 = norm(y_i)                               lands in the space of the target's features
    logits = f^_i+1 @ W[draft_vocab]^T               the target's own tied LM-head rows, a subset

Drafting continues from its own prediction: (f^_{i+1}, drafted t_{i+2}) at position i + 1, and so
on (EAGLE, Li et al. 2024).

Multi-layer features (EAGLE-3's idea, `target_layers` non-empty): f_i is then not the final hidden state but
the outputs of several target layers (shallow to deep, the runner's LayerTaps) fused into one row,

    f_i = fuse_norm(fuse([rms(h_i^a) | rms(h_i^b) | rms(h_i^c)]))      [3H] -> [H], each layer normalized first

and the head is trained on the target's tokens only (no feature regression: there is no single target feature
to regress to). Its own outputs f^ still feed the steps after the first, which training teaches by unrolling.

The LM head keeps only `draft_vocab` rows (the tokens the target emits most often in the training data):
the full 49,152-row head costs about a fifth of a SmolLM2-135M decode step, the 8,192-row subset a sixth of
that. A draft outside the subset is never proposed, which costs acceptance, never exactness (the rejection
sampler takes q = 0 there).

Checkpoint directory (written by `tokenmill train-eagle`):

    eagle_config.json    {"format": "tokenmill-eagle", "version": 1, "target_hidden_size": ...,
                          "arch": {the one-layer ModelArchConfig fields}, "num_draft_vocab": N,
                          "target_layers": [...] (absent or [] for the final hidden state)}
    model.safetensors    fc.weight, layer.*, norm.weight, draft_vocab (int64 [N]); fuse.weight and
                         fuse_norm.weight with target_layers

The head's own embedding and LM head are the target's (shared tensors, not stored).
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import TYPE_CHECKING, NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from tokenmill.attention.backend import TorchPagedAttention
from tokenmill.config import ModelArchConfig
from tokenmill.layers.embedding import VocabEmbedding
from tokenmill.layers.linear import Linear
from tokenmill.layers.norm import GemmaRMSNorm, RMSNorm, normalize_parts, plain_rms_norm
from tokenmill.layers.rotary import RotaryEmbedding
from tokenmill.models.interface import DecoderLayout
from tokenmill.models.llama import LlamaAttention, LlamaDecoderLayer

if TYPE_CHECKING:
    from tokenmill.models.causal_lm import CausalLM

FORMAT = "tokenmill-eagle"
VERSION = 1
CONFIG_FILE = "eagle_config.json"
WEIGHTS_FILE = "model.safetensors"


def head_arch(target: ModelArchConfig) -> ModelArchConfig:
    """The head's decoder layer has the target's layer shape; one layer, no quantization."""
    return dataclasses.replace(target, num_hidden_layers=1, quantization_config=None)


class EagleHead(nn.Module):
    """See the module docstring. `embed` is the target's token embedding table [V, H] (shared);
    `lm_rows` the target's LM-head rows of `draft_vocab` [N, H]."""

    draft_vocab: torch.Tensor  # a buffer (register_buffer in __init__)

    def __init__(
        self,
        arch: ModelArchConfig,
        embed: torch.Tensor,
        lm_rows: torch.Tensor,
        draft_vocab: torch.Tensor,
        dtype: torch.dtype = torch.float32,
        target_layers: tuple[int, ...] = (),
    ) -> None:
        super().__init__()
        if arch.num_hidden_layers != 1:
            raise ValueError("an EAGLE head has exactly one decoder layer")
        h = arch.hidden_size
        self.arch = arch
        self.target_layers = tuple(target_layers)
        """The target layers whose outputs it reads (the runner's LayerTaps); () reads the final hidden state."""
        self.fc = Linear(2 * h, h, dtype=dtype)
        self.fuse: Linear | None = None
        self.fuse_norm: RMSNorm | None = None
        if self.target_layers:
            self.fuse = Linear(len(self.target_layers) * h, h, dtype=dtype)
            self.fuse_norm = RMSNorm(h, arch.rms_norm_eps, dtype)
        self.rotary = RotaryEmbedding(arch.head_dim, arch.max_position_embeddings, arch.rope_theta, arch.rope_scaling)
        self.layer = LlamaDecoderLayer(arch, 0, self.rotary, TorchPagedAttention(), dtype)
        self.norm = RMSNorm(h, arch.rms_norm_eps, dtype)
        self.embed = embed  # [V, H], the target's (not a parameter here)
        self.register_buffer("draft_vocab", draft_vocab.to(torch.long), persistent=False)
        if tuple(lm_rows.shape) != (len(draft_vocab), h):
            raise ValueError(f"lm_rows must be [{len(draft_vocab)}, {h}], got {tuple(lm_rows.shape)}")
        self.head = Linear(h, len(draft_vocab), dtype=dtype)  # the target's LM-head rows of draft_vocab
        self.head.weight = nn.Parameter(lm_rows.detach().to(dtype).contiguous(), requires_grad=False)

    # The runner binds KV caches through these (one layer).
    def decoder_layout(self) -> DecoderLayout:
        """Its one Llama layer and final norm, for the C++ layer loop. The loop starts from the head's input rows
        (`input_rows`: fc over [embedding | feature]), which the proposer hands the runner (ModelRunner.run_rows);
        `embed` is the target's token embedding, for the layout's form only."""
        a = self.layer.self_attn
        return DecoderLayout(
            self.token_rows,
            [self.layer.parts()],
            self.norm.weight,
            self.norm.eps,
            a.num_heads,
            a.num_kv_heads,
            a.head_dim,
            a.scale,
            [self.rotary.cos_sin],
        )

    def token_rows(self, input_ids: torch.Tensor) -> torch.Tensor:
        """[T] -> the target's embedding rows [T, H]."""
        return F.embedding(input_ids, self.embed)

    def attention_layers(self) -> list[LlamaAttention]:
        return [self.layer.self_attn]

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, features: torch.Tensor) -> torch.Tensor:
        """input_ids [T] (the token after each feature), positions [T], the target's features [T, F] (as the
        runner hands them: `target_features`) -> predicted next features [T, H]. Inside a forward context
        attention goes through the paged cache; outside, dense causal over [T] or [B, T]."""
        return self.forward_rows(positions, self.input_rows(input_ids, self.target_features(features)))

    def target_features(self, rows: torch.Tensor) -> torch.Tensor:
        """What the runner handed the feature sink, [n, F], as the head reads it, [n, H]: the final hidden states
        as they are, or the chosen layers' outputs fused (module docstring)."""
        if self.fuse is None or self.fuse_norm is None:
            return rows
        return self.fuse_norm(self.fuse(normalize_parts(rows, self.arch.hidden_size, self.arch.rms_norm_eps)))

    def input_rows(self, input_ids: torch.Tensor, features: torch.Tensor) -> torch.Tensor:
        """The decoder layer's input [T, H]: fc over [the token's embedding | the feature before it]."""
        e = F.embedding(input_ids, self.embed).to(features.dtype)
        return self.fc(torch.cat([e, features], dim=-1))

    def forward_rows(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """The decoder layer and final norm over input rows x [T, H] (the module path of the C++ layer loop)."""
        with self.rotary.cached(positions):
            y = self.layer(positions, x)
        return self.norm(y)

    def compute_logits(self, features: torch.Tensor) -> torch.Tensor:
        """[N, H] -> logits over draft_vocab [N, len(draft_vocab)] in float32."""
        return self.head(features).float()

    # ------------------------------------------------------------------ files
    def state_for_save(self) -> dict[str, torch.Tensor]:
        out = {k: v.detach().contiguous() for k, v in self.named_parameters() if not k.startswith("head.")}
        out["draft_vocab"] = self.draft_vocab.detach().cpu().contiguous()
        return out

    def save(self, directory: str | Path, target_name: str) -> None:
        from safetensors.torch import save_file

        d = Path(directory)
        d.mkdir(parents=True, exist_ok=True)
        arch = arch_to_dict(self.arch)
        cfg = {
            "format": FORMAT,
            "version": VERSION,
            "target": target_name,
            "target_hidden_size": self.arch.hidden_size,
            "num_draft_vocab": int(len(self.draft_vocab)),
            "arch": arch,
            "target_layers": list(self.target_layers),
        }
        (d / CONFIG_FILE).write_text(json.dumps(cfg, indent=1) + "\n")
        save_file(
            {k: v.float().cpu() if v.is_floating_point() else v for k, v in self.state_for_save().items()},
            str(d / WEIGHTS_FILE),
        )


class TargetTables(NamedTuple):
    """A target's token tables, dense in its dtype: what a draft head embeds with and projects onto."""

    embed: torch.Tensor
    """The embedding table [V, H]."""
    lm_head: torch.Tensor
    """The LM-head weight [V, H] (equal to `embed` when tied)."""


def target_tables(target: CausalLM) -> TargetTables:
    """The embedding table and LM-head weight of a whole (unsplit) target, dense in its dtype, whatever
    its embedding or head kernels (quantized, prepacked, tied or not): read through the model's
    own forward paths, so the head sees exactly what the target computes with."""
    from tokenmill.quant.gguf import GGUFEmbedding
    from tokenmill.quant.head import QuantizedEmbedding

    inner = target.model
    H = target.config.hidden_size
    table, norm = inner.embed_tokens, inner.norm
    assert isinstance(table, (VocabEmbedding, QuantizedEmbedding, GGUFEmbedding)), "the body's table (models/llama.py)"
    assert isinstance(norm, (RMSNorm, GemmaRMSNorm)), "the body's final norm"
    with torch.no_grad():  # not inference_mode: training reads these tables under autograd
        dev = norm.weight.device
        embed = table.dense_table()
        lm = target.compute_logits(torch.eye(H, dtype=norm.weight.dtype, device=dev)).t()
    return TargetTables(embed, lm.to(embed.dtype).contiguous())


def read_head_config(path: Path, fmt: str, version: int, missing: str) -> dict:
    """A draft head's JSON config (EAGLE, Medusa), checked for its format and version; errors name the file."""
    if not path.is_file():
        raise FileNotFoundError(f"{path}: {missing}")
    try:
        cfg = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: not valid JSON ({e})") from None
    if not isinstance(cfg, dict) or cfg.get("format") != fmt or cfg.get("version") != version:
        got = (cfg.get("format"), cfg.get("version")) if isinstance(cfg, dict) else (None, None)
        raise ValueError(f"{path}: format {got[0]!r} v{got[1]}, expected {fmt!r} v{version}")
    return cfg


def arch_to_dict(arch: ModelArchConfig) -> dict:
    """A head's layer arch as its JSON config stores it (arch_from_dict reads it back)."""
    out = dataclasses.asdict(arch)
    out["eos_token_ids"] = list(out["eos_token_ids"])
    return out


def arch_from_dict(d: dict) -> ModelArchConfig:
    a = dict(d)
    a["eos_token_ids"] = tuple(a.get("eos_token_ids") or ())
    return ModelArchConfig(**a)


def read_head_weights(
    w_path: Path, what: str, num_draft_vocab: int | None, vocab_size: int
) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """A draft head's safetensors (EAGLE, the block drafter): its tensors and its draft vocabulary (popped from
    them), checked against the config's length and the target's vocabulary; errors name the file."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    try:
        tensors = load_file(str(w_path))
    except (FileNotFoundError, SafetensorError, OSError) as e:
        raise ValueError(f"{w_path}: cannot read {what} weights ({e})") from None
    vocab = tensors.pop("draft_vocab", None)
    if vocab is None or vocab.dim() != 1 or len(vocab) != num_draft_vocab:
        raise ValueError(f"{w_path}: draft_vocab missing or not of length num_draft_vocab")
    if int(vocab.min()) < 0 or int(vocab.max()) >= vocab_size:
        raise ValueError(f"{w_path}: draft_vocab has token ids outside [0, {vocab_size})")
    return tensors, vocab


def copy_checked(w_path: Path, own: dict[str, nn.Parameter], tensors: dict[str, torch.Tensor]) -> None:
    """Copy a file's tensors into a module's parameters: exactly the same names and shapes, or an error naming
    the file."""
    missing, unexpected = set(own) - set(tensors), set(tensors) - set(own)
    if missing or unexpected:
        raise ValueError(f"{w_path}: missing tensors {sorted(missing)}, unexpected {sorted(unexpected)}")
    for k, p in own.items():
        if tuple(tensors[k].shape) != tuple(p.shape):
            raise ValueError(f"{w_path}: {k} has shape {tuple(tensors[k].shape)}, expected {tuple(p.shape)}")
        p.data.copy_(tensors[k].to(p.dtype))


def load_eagle_head(
    directory: str | Path,
    target_arch: ModelArchConfig,
    embed: torch.Tensor,
    lm_weight: torch.Tensor,
    dtype: torch.dtype,
    device: str | torch.device = "cpu",
) -> EagleHead:
    """Load a head written by EagleHead.save, checking it fits the target; errors name the file."""

    d = Path(directory)
    cfg_path, w_path = d / CONFIG_FILE, d / WEIGHTS_FILE
    cfg = read_head_config(
        cfg_path, FORMAT, VERSION, "no EAGLE head config here (train one with `tokenmill train-eagle`)"
    )
    if cfg.get("target_hidden_size") != target_arch.hidden_size:
        raise ValueError(
            f"{cfg_path}: head made for hidden size {cfg.get('target_hidden_size')}, "
            f"the target has {target_arch.hidden_size}"
        )
    arch = arch_from_dict(cfg["arch"])
    if arch.vocab_size != target_arch.vocab_size:
        raise ValueError(f"{cfg_path}: head made for vocab {arch.vocab_size}, the target has {target_arch.vocab_size}")
    layers = cfg.get("target_layers") or []
    if not all(isinstance(i, int) and 0 <= i < target_arch.num_hidden_layers for i in layers):
        raise ValueError(f"{cfg_path}: target_layers {layers} outside the target's {target_arch.num_hidden_layers}")
    tensors, vocab = read_head_weights(w_path, "EAGLE head", cfg.get("num_draft_vocab"), target_arch.vocab_size)
    with torch.device(device):
        rows = lm_weight[vocab.to(lm_weight.device)]
        head = EagleHead(arch, embed, rows, vocab, dtype=dtype, target_layers=tuple(layers))
    copy_checked(w_path, {k: v for k, v in head.named_parameters() if not k.startswith("head.")}, tensors)
    head.eval()
    for m in head.modules():  # weights final: build the copies the linears' kernels read
        if isinstance(m, Linear):
            m.process_weights_after_loading()
    return head


# ---------------------------------------------------------------------------------- training
def unrolled_key_mask(T: int, step: int) -> torch.Tensor:
    """Which keys a step-`step` query at position j reads when the head is trained on its own drafts
    (`train_forward(..., steps)`), over the keys of steps 1..step concatenated, [T, step * T] bool.

    At drafting time, step s at position j drafts the s-th token after the last accepted position
    a = j - s + 1: it reads the step-1 keys of positions 0..a (computed from the target's features,
    as after verification) and the keys its own chain wrote at a + 1 .. j (step r at position a + r - 1,
    r = 2..s). Worked example, T = 4, step 2 (rows j = 0..3; columns step-1 keys 0..3 | step-2 keys 0..3):

        j=0   . . . . | 1 . . .      a = -1: not a draft that happens (never scored), only its own key
        j=1   1 . . . | . 1 . .      a = 0: step-1 key 0, its own key at 1
        j=2   1 1 . . | . . 1 .
        j=3   1 1 1 . | . . . 1
    """
    j = torch.arange(T)[:, None]
    p = torch.arange(T)[None, :]
    blocks = [p <= j - step + 1]
    for r in range(2, step + 1):
        blocks.append(p == j - step + r)
    return torch.cat(blocks, dim=1)


def train_forward(
    head: EagleHead, input_ids: torch.Tensor, features: torch.Tensor, steps: int = 1
) -> torch.Tensor | list[torch.Tensor]:
    """The head's forward in plain differentiable torch ops, dense causal over [B, T] (positions
    0..T-1). The inference kernels (fused norms, in-place RoPE) bypass autograd, so training uses
    this; tests check it equals `head(...)` outside a forward context. `features` [B, T, F] are the target's, as the
    runner hands them (several layers side by side for a multi-layer head, fused here).

    steps > 1 also runs the head on its own drafts, as it drafts at serving time (EAGLE-3's
    "training-time test"): step s at position j reads the step-(s-1) prediction made at j - 1 (the
    head's guess of f_j) and the same token t_{j+1}, and attends as `unrolled_key_mask` says. Every
    step predicts f_{j+1} at position j, so all steps share one set of labels; step s is valid for
    j >= s - 1. Returns [B, T, H] for steps == 1, else the list of the steps' outputs."""
    arch = head.arch
    nh, nkv, d = arch.num_attention_heads, arch.num_key_value_heads, arch.head_dim
    eps = arch.rms_norm_eps

    def rms(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))

    B, T = input_ids.shape
    if head.fuse is not None and head.fuse_norm is not None:  # target_features, in plain ops
        features = F.linear(normalize_parts(features, arch.hidden_size, eps), head.fuse.weight)
        features = plain_rms_norm(features, head.fuse_norm.weight, eps)
    e = F.embedding(input_ids, head.embed.detach()).to(features.dtype)
    lay = head.layer
    cs = head.rotary.cos_sin[:T].to(features.dtype)
    cos, sin = cs[:, None, : d // 2], cs[:, None, d // 2 :]

    def rope(x: torch.Tensor) -> torch.Tensor:
        x1, x2 = x[..., : d // 2], x[..., d // 2 :]
        return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)

    rep = nh // nkv
    keys: list[torch.Tensor] = []
    values: list[torch.Tensor] = []
    outs: list[torch.Tensor] = []
    feat = features
    for step in range(1, steps + 1):
        if step > 1:  # position j reads the previous step's guess made at j - 1
            feat = torch.cat([torch.zeros_like(outs[-1][:, :1]), outs[-1][:, :-1]], dim=1)
        h = F.linear(torch.cat([e, feat], dim=-1), head.fc.weight)
        qkv = F.linear(rms(h, lay.input_layernorm.weight), lay.self_attn.qkv_proj.weight)
        q, k, v = qkv.split([nh * d, nkv * d, nkv * d], dim=-1)
        q, k, v = rope(q.view(B, T, nh, d)), rope(k.view(B, T, nkv, d)), v.view(B, T, nkv, d)
        keys.append(k.repeat_interleave(rep, dim=2).transpose(1, 2))
        values.append(v.repeat_interleave(rep, dim=2).transpose(1, 2))
        if step == 1:
            o = F.scaled_dot_product_attention(q.transpose(1, 2), keys[0], values[0], is_causal=True, scale=d**-0.5)
        else:
            mask = unrolled_key_mask(T, step).to(q.device)
            o = F.scaled_dot_product_attention(
                q.transpose(1, 2), torch.cat(keys, dim=2), torch.cat(values, dim=2), attn_mask=mask, scale=d**-0.5
            )
        h = h + F.linear(o.transpose(1, 2).reshape(B, T, nh * d), lay.self_attn.o_proj.weight)
        gu = F.linear(rms(h, lay.post_attention_layernorm.weight), lay.mlp.gate_up_proj.weight)
        g, u = gu.chunk(2, dim=-1)
        h = h + F.linear(F.silu(g) * u, lay.mlp.down_proj.weight)
        outs.append(rms(h, head.norm.weight))
    return outs[0] if steps == 1 else outs
