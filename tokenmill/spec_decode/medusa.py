"""Medusa heads (Cai et al., "Medusa: Simple LLM Inference Acceleration Framework with Multiple Decoding
Heads", 2024), written from the paper's description: K small heads on the target's own last feature guess
the tokens 1..K places further, and a static token tree of their top guesses is verified in one pass.

The target's feature f_i is its final hidden state at position i (after the final norm: what its LM head
reads). Its LM head turns f_i into token i + 1; head k turns it into a guess of token i + 1 + k:

    head_k(f) = W_lm[draft_vocab] (f + SiLU(A_k f + b_k))       a residual block, then the target's own
                                                                 tied LM-head rows (shared by all heads)

When a request with N tokens is about to be verified, its last token t_{N-1} was sampled from f_{N-2}; the
heads read f_{N-2} and guess t_N (head 1, depth 1 of the tree) .. t_{N-1+K} (head K, depth K).

The tree is static, chosen at load from the heads' measured accuracies (`tokenmill train-medusa` stores,
per head, how often its rank-r guess was the target's token on held-out answers): a path of ranks
(r_1, .., r_d) is worth prod_k acc[k][r_k], and the `max_nodes` best paths, grown best first so every
path's prefix is in, make the tree (`static_tree`). Node tokens are the heads' deterministic top-r
guesses: point masses for the verifier (spec_decode/tree.py), so the output stays exactly the target's.

The LM head keeps only `draft_vocab` rows (the tokens the target emits most often): all K heads cost one
[K * B, H] x [H, |draft_vocab|] product per step. A guess outside the subset is never made.

Checkpoint directory (written by `tokenmill train-medusa`):
    medusa_config.json   {"format": "tokenmill-medusa", "version": 1, "target_hidden_size": H,
                          "vocab_size": V, "num_heads": K, "num_draft_vocab": N, "accuracy": [[acc of rank r]]}
    model.safetensors    blocks.weight [K, H, H], blocks.bias [K, H], draft_vocab (int64 [N])
"""

from __future__ import annotations

import heapq
import json
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from tokenmill.core.step_io import StepTokens
from tokenmill.layers.linear import Linear
from tokenmill.spec_decode.proposer import DraftRequest, Proposal, draft_budget

if TYPE_CHECKING:
    from tokenmill.config import SpeculativeConfig
    from tokenmill.spec_decode.ngram import NgramProposer
    from tokenmill.spec_decode.proposer import ProposerContext

FORMAT = "tokenmill-medusa"
VERSION = 1
CONFIG_FILE = "medusa_config.json"
WEIGHTS_FILE = "model.safetensors"


class MedusaHeads(nn.Module):
    """K residual blocks over the target's feature and the target's LM-head rows of draft_vocab."""

    lm_rows: torch.Tensor  # buffers (register_buffer in __init__)
    draft_vocab: torch.Tensor

    def __init__(
        self,
        hidden_size: int,
        num_heads: int,
        lm_rows: torch.Tensor,
        draft_vocab: torch.Tensor,
        dtype: torch.dtype = torch.float32,
    ) -> None:
        super().__init__()
        if tuple(lm_rows.shape) != (len(draft_vocab), hidden_size):
            raise ValueError(f"lm_rows must be [{len(draft_vocab)}, {hidden_size}], got {tuple(lm_rows.shape)}")
        self.hidden_size = hidden_size
        self.num_heads = num_heads
        # A_k start at zero: every head starts as the target's own LM head (a guess of the next token).
        self.weight = nn.Parameter(torch.zeros(num_heads, hidden_size, hidden_size, dtype=dtype))
        self.bias = nn.Parameter(torch.zeros(num_heads, hidden_size, dtype=dtype))
        self.register_buffer("lm_rows", lm_rows.detach().to(dtype).contiguous(), persistent=False)
        self.register_buffer("draft_vocab", draft_vocab.to(torch.long), persistent=False)
        self.serving: nn.ModuleList | None = None
        """After `prepare_serving`: the K blocks and the LM-head rows as `Linear` layers with their kernels'
        weight copies (an unpacked bf16 weight costs oneDNN a reorder on every call: ~5x the product)."""

    def prepare_serving(self) -> MedusaHeads:
        """The weights are final: serve them through `Linear` (the same kernels as the target's layers)."""
        H, Vd = self.hidden_size, len(self.draft_vocab)
        dtype = self.weight.dtype
        layers: list[Linear] = []
        for k in range(self.num_heads):
            lin = Linear(H, H, bias=True, dtype=dtype)
            assert lin.bias is not None  # bias=True
            lin.weight.data.copy_(self.weight.data[k])
            lin.bias.data.copy_(self.bias.data[k])
            layers.append(lin)
        lm = Linear(H, Vd, dtype=dtype)
        lm.weight.data.copy_(self.lm_rows)
        layers.append(lm)
        self.serving = nn.ModuleList(layers).to(self.weight.device)
        for lin in layers:  # the serving list's modules (moved in place)
            lin.process_weights_after_loading()
        return self

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        """features [N, H] -> logits [K, N, |draft_vocab|] (float32): head k's guess of the token k + 1
        places after the one f predicts."""
        f = features.to(self.weight.dtype)
        if self.serving is not None:
            *blocks, lm = self.serving
            x = torch.stack([f + F.silu(b(f)) for b in blocks])  # [K, N, H]
            return lm(x).float()
        x = f[None] + F.silu(
            torch.baddbmm(self.bias[:, None, :], f[None].expand(self.num_heads, -1, -1), self.weight.transpose(1, 2))
        )  # [K, N, H]
        return (x @ self.lm_rows.t()).float()

    def save(self, directory: str | Path, target_name: str, vocab_size: int, accuracy: list[list[float]]) -> None:
        from safetensors.torch import save_file

        d = Path(directory)
        d.mkdir(parents=True, exist_ok=True)
        cfg = {
            "format": FORMAT,
            "version": VERSION,
            "target": target_name,
            "target_hidden_size": self.hidden_size,
            "vocab_size": vocab_size,
            "num_heads": self.num_heads,
            "num_draft_vocab": int(len(self.draft_vocab)),
            "accuracy": accuracy,
        }
        (d / CONFIG_FILE).write_text(json.dumps(cfg, indent=1) + "\n")
        save_file(
            {
                "blocks.weight": self.weight.detach().float().cpu().contiguous(),
                "blocks.bias": self.bias.detach().float().cpu().contiguous(),
                "draft_vocab": self.draft_vocab.cpu().contiguous(),
            },
            str(d / WEIGHTS_FILE),
        )


def load_medusa(
    directory: str | Path,
    hidden_size: int,
    vocab_size: int,
    lm_weight: torch.Tensor,
    dtype: torch.dtype,
    device: str | torch.device = "cpu",
) -> tuple[MedusaHeads, list[list[float]]]:
    """Heads written by MedusaHeads.save, checked against the target; errors name the file."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    from tokenmill.spec_decode.eagle_head import read_head_config

    d = Path(directory)
    cfg_path, w_path = d / CONFIG_FILE, d / WEIGHTS_FILE
    cfg = read_head_config(cfg_path, FORMAT, VERSION, "no Medusa heads here (train them with `tokenmill train-medusa`)")
    if cfg.get("target_hidden_size") != hidden_size or cfg.get("vocab_size") != vocab_size:
        raise ValueError(
            f"{cfg_path}: heads made for hidden size {cfg.get('target_hidden_size')} and vocab "
            f"{cfg.get('vocab_size')}, the target has {hidden_size} and {vocab_size}"
        )
    k = cfg.get("num_heads")
    acc = cfg.get("accuracy")
    if not isinstance(k, int) or k < 1 or not isinstance(acc, list) or len(acc) != k:
        raise ValueError(f"{cfg_path}: needs num_heads >= 1 and one accuracy list per head")
    try:
        t = load_file(str(w_path))
    except (FileNotFoundError, SafetensorError, OSError) as e:
        raise ValueError(f"{w_path}: cannot read Medusa weights ({e})") from None
    vocab = t.get("draft_vocab")
    if vocab is None or vocab.dim() != 1 or len(vocab) != cfg.get("num_draft_vocab") or len(vocab) == 0:
        raise ValueError(f"{w_path}: draft_vocab missing or not of length num_draft_vocab")
    if int(vocab.min()) < 0 or int(vocab.max()) >= vocab_size:
        raise ValueError(f"{w_path}: draft_vocab has token ids outside [0, {vocab_size})")
    shapes = {"blocks.weight": (k, hidden_size, hidden_size), "blocks.bias": (k, hidden_size)}
    for name, shape in shapes.items():
        if name not in t or tuple(t[name].shape) != shape:
            raise ValueError(
                f"{w_path}: {name} must have shape {shape}, got {None if name not in t else tuple(t[name].shape)}"
            )
    with torch.device(device):
        heads = MedusaHeads(hidden_size, k, lm_weight[vocab.to(lm_weight.device)], vocab, dtype)
    with torch.no_grad():
        heads.weight.copy_(t["blocks.weight"])
        heads.bias.copy_(t["blocks.bias"])
    return heads.eval().prepare_serving(), acc


def static_tree(accuracy: list[list[float]], max_nodes: int, max_width: int, max_depth: int) -> list[tuple[int, ...]]:
    """The max_nodes most likely rank paths, best first, parents before children: a path (r_1, .., r_d) is
    worth prod_k accuracy[k][r_k] (head k's rank-r guess right). Returns the paths in listing order.

        accuracy [[0.6, 0.2], [0.4, 0.1]], 3 nodes -> (0,) 0.6, (0, 0) 0.24, (1,) 0.2
    """
    depth = min(max_depth, len(accuracy))
    out: list[tuple[int, ...]] = []
    heap: list[tuple[float, tuple[int, ...]]] = []
    for r, a in enumerate(accuracy[0][:max_width] if depth else []):
        heapq.heappush(heap, (-a, (r,)))
    while heap and len(out) < max_nodes:
        neg, path = heapq.heappop(heap)
        out.append(path)
        if len(path) < depth:
            for r, a in enumerate(accuracy[len(path)][:max_width]):
                heapq.heappush(heap, (neg * a, path + (r,)))
    return out


class MedusaProposer:
    """Drafts a static tree from the heads' guesses on each request's latest target feature."""

    def __init__(
        self,
        heads: MedusaHeads,
        accuracy: list[list[float]],
        max_nodes: int,
        max_width: int,
        max_depth: int,
        max_model_len: int,
        lookup: NgramProposer | None = None,
    ) -> None:
        self.heads = heads
        self.accuracy = accuracy
        self.paths = static_tree(accuracy, max_nodes, max_width, max_depth)
        self.lookup = lookup
        """With a datastore (`"datastore"` in the config): the heads' guesses join prompt lookup and the datastore
        in one best-first tree (ngram.ngram_tree), each guess scored by its head's held-out rank accuracy."""
        self.max_width = max_width
        self.max_model_len = max_model_len
        self.latest: dict[str, tuple[int, torch.Tensor]] = {}
        """request id -> (position, target feature there) of its latest computed position."""
        self.feature_sink = self.write
        self.feature_layers: tuple[int, ...] = ()  # the final hidden states, if any

    @classmethod
    def from_context(cls, config: SpeculativeConfig, ctx: ProposerContext) -> MedusaProposer:
        assert config.model is not None  # SpeculativeConfig requires it for method medusa
        lm = ctx.tables().lm_head
        heads, acc = load_medusa(
            config.model, ctx.target_arch.hidden_size, ctx.target_arch.vocab_size, lm, ctx.dtype, ctx.device
        )
        tree = config.tree
        nodes = config.num_speculative_tokens if tree is None else tree.max_nodes
        width = 1 if tree is None else tree.max_width
        lookup = None
        if config.datastore:
            from tokenmill.spec_decode.ngram import NgramProposer

            lookup = NgramProposer.from_context(config, ctx)
        return cls(heads, acc, nodes, width, config.tree_max_depth, ctx.max_model_len, lookup)

    def write(self, batch: list[StepTokens], hidden: torch.Tensor) -> None:
        """The runner's hook: keep each request's last row (the feature its next token came from)."""
        off = 0
        for s in batch:
            off += s.num_new_tokens
            self.latest[s.request_id] = (s.start_pos + s.num_new_tokens - 1, hidden[off - 1].clone())

    @torch.inference_mode()
    def propose(self, requests: list[DraftRequest], num_tokens: list[int]) -> Proposal:
        drafts: list[list[int]] = [[] for _ in requests]
        parents: list[list[int]] = [[] for _ in requests]
        rows, feats = [], []
        for i, r in enumerate(requests):
            held = self.latest.get(r.request_id)
            if num_tokens[i] > 0 and held is not None and held[0] == r.num_tokens - 2:
                rows.append(i)
                feats.append(held[1])
        top = None
        if rows:
            logits = self.heads(torch.stack(feats))  # [K, n, Vd]
            top = self.heads.draft_vocab[logits.topk(self.max_width, dim=-1).indices].tolist()  # [K][n][w]
        if self.lookup is not None:
            return self._hybrid(requests, num_tokens, rows, top)
        if not rows:
            return Proposal(drafts, None, parents)
        assert top is not None  # rows to draft for: the heads ran
        for j, i in enumerate(rows):
            depth = min(draft_budget(requests[i], len(top), self.max_model_len), num_tokens[i])
            index: dict[tuple[int, ...], int] = {}
            for path in self.paths:
                if len(path) > depth or len(index) >= num_tokens[i]:
                    continue
                index[path] = len(drafts[i])
                drafts[i].append(top[len(path) - 1][j][path[-1]])
                parents[i].append(index[path[:-1]] if len(path) > 1 else -1)
        return Proposal(drafts, None, parents)

    def _hybrid(self, requests: list[DraftRequest], num_tokens: list[int], rows: list[int], top) -> Proposal:
        from tokenmill.spec_decode.ngram import ngram_tree

        lk = self.lookup
        assert lk is not None  # propose calls this only with a lookup
        row_of = {i: j for j, i in enumerate(rows)}
        drafts, parents = [], []
        for i, r in enumerate(requests):
            depth = min(num_tokens[i], draft_budget(r, lk.max_depth, self.max_model_len))
            guesses = None
            if i in row_of:
                j = row_of[i]
                guesses = [
                    [(top[d][j][rank], self.accuracy[d][rank]) for rank in range(len(top[d][j]))]
                    for d in range(len(top))
                ]
            toks, par = (
                ngram_tree(
                    r.all_token_ids,
                    num_tokens[i],
                    self.max_width,
                    depth,
                    lk.min_n,
                    lk.max_n,
                    lk.datastore,
                    lk.min_share,
                    guesses,
                )
                if depth > 0
                else ([], [])
            )
            drafts.append(toks)
            parents.append(par)
        return Proposal(drafts, None, parents)

    def forget(self, request_ids: list[str]) -> None:
        for rid in request_ids:
            self.latest.pop(rid, None)

    def restart(self, request_ids: list[str]) -> None:
        self.forget(request_ids)

    def on_step(self, step: object) -> None:
        pass
