"""EAGLE proposer: a one-layer head drafts from the target's own features (eagle_head.py).

Per step the target runner hands every computed position's feature to a `FeatureStore` (the
runner's `feature_sink`, which the proposer declares). When a request is about to decode with N tokens, the target
has features for positions 0 .. N-2; the head catches up over the positions it has not seen yet, pairing
feature f_i with token t_{i+1}, and its last output predicts f_{N-1}, whose logits give draft 1.
Each further draft feeds the head its own prediction and the token it drafted:

    position     done .. N-2 (catch-up)        N-1              N          ...
    head input   (f_i, t_{i+1}) real           (f^_{N-1}, d1)   (f^_N, d2)
    head output  f^_{i+1}; the last -> d1      f^_N -> d2       f^_{N+1} -> d3

The head's KV cache is paged like a draft model's (draft_model.py): its pool mirrors the target's
block ids, with scratch blocks for positions the target has not allocated yet. Features of
rejected drafts are overwritten by the next step before they are read (the store keys rows by
position). After a prefix-cache hit the target computes no features for the cached positions;
the head then starts at the first position it has a feature for and reads whatever its mirrored
blocks hold before it (the K/V a request with the same prefix wrote, or stale rows): that can cost
acceptance, never exactness.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from tokenmill.attention.metadata import forward_context
from tokenmill.core.step_io import StepTokens
from tokenmill.layers.sampler import SamplingMetadata
from tokenmill.spec_decode.draft_model import DraftModelProposer, draft_loop
from tokenmill.spec_decode.eagle_head import EagleHead, load_eagle_head
from tokenmill.spec_decode.proposer import DraftRequest, Proposal, draft_budget

if TYPE_CHECKING:
    from tokenmill.config import SpeculativeConfig, TreeConfig
    from tokenmill.spec_decode.proposer import ProposerContext
    from tokenmill.worker.model_runner import StepInputs


class FeatureStore:
    """request id -> (first position held, features [n, H]) of positions the head has not consumed."""

    def __init__(self) -> None:
        self.rows: dict[str, tuple[int, torch.Tensor]] = {}

    def write(self, batch: list[StepTokens], hidden: torch.Tensor) -> None:
        """The runner's hook: `hidden` [num_tokens, H] for `batch` in order, each request's
        num_new_tokens rows for positions start_pos .. start_pos + n - 1."""
        off = 0
        for s in batch:
            n = s.num_new_tokens
            rows = hidden[off : off + n]
            off += n
            rid, start = s.request_id, s.start_pos
            held = self.rows.get(rid)
            if held is None or start < held[0] or start > held[0] + len(held[1]):
                self.rows[rid] = (start, rows.clone())  # first rows, a recompute, or a gap
            else:
                base, buf = held
                self.rows[rid] = (base, torch.cat([buf[: start - base], rows]))

    def take(self, rid: str, start: int, end: int) -> tuple[int, torch.Tensor] | None:
        """Features of positions max(start, first held) .. end - 1 and the first of them, dropping
        everything before `end` from the store; None if position end - 1 is not held."""
        held = self.rows.get(rid)
        if held is None:
            return None
        base, buf = held
        if end - 1 >= base + len(buf) or end - 1 < base:
            return None
        first = max(start, base)
        out = buf[first - base : end - base]
        self.rows[rid] = (end, buf[end - base :])
        return first, out

    def forget(self, rid: str) -> None:
        self.rows.pop(rid, None)


class EagleProposer(DraftModelProposer):
    """The draft model's mirrored paged pool (one layer here) and drafting loop, with the head
    reading target features instead of a second network's own layers."""

    def __init__(
        self,
        head: EagleHead,
        tree: TreeConfig | None = None,
        max_depth: int = 4,
        max_model_len: int = 1 << 30,
        **pool,
    ) -> None:
        super().__init__(head, head.arch, **pool)
        self.head = head
        self.tree = tree
        """Draft a dynamic token tree (`_draft_tree`) instead of a chain."""
        self.max_depth = max_depth
        self.max_model_len = max_model_len
        self.store = FeatureStore()
        self.feature_sink = self.store.write  # the target's runner hands it every step's features
        self.feature_layers = head.target_layers  # () the final hidden states
        # num_computed (inherited): positions whose head K/V came from real target features

    @classmethod
    def from_context(cls, config: SpeculativeConfig, ctx: ProposerContext) -> EagleProposer:
        assert config.model is not None  # SpeculativeConfig requires it for method eagle
        embed, lm = ctx.tables()
        head = load_eagle_head(config.model, ctx.target_arch, embed, lm, ctx.dtype, ctx.device)
        return cls(head, config.tree, config.tree_max_depth, ctx.max_model_len, **cls.pool_args(config, ctx))

    def forget(self, request_ids: list[str]) -> None:
        super().forget(request_ids)
        for rid in request_ids:
            self.store.forget(rid)

    def restart(self, request_ids: list[str]) -> None:
        super().restart(request_ids)
        for rid in request_ids:  # its features come again as the rebuilt row is recomputed
            self.store.forget(rid)

    # ---------------------------------------------------------------- propose
    @torch.inference_mode()
    def propose(self, requests: list[DraftRequest], num_tokens: list[int]) -> Proposal:
        bs = self.block_size
        next_scratch = self.num_mirrored_blocks
        reqs: list[DraftRequest] = []
        ks: list[int] = []
        tables: list[list[int]] = []
        catch_up: list[StepTokens] = []
        feats: list[torch.Tensor] = []
        for r, k in zip(requests, num_tokens):
            if k <= 0:
                continue
            n = r.num_tokens
            real = r.block_ids
            done = min(self.num_computed.get(r.request_id, 0), len(real) * bs, n - 2)
            got = self.store.take(r.request_id, done, n - 1)
            if got is None:  # no feature for position n - 2 (cannot happen after a target step)
                continue
            first, f = got
            f = self.head.target_features(f.to(self.head.norm.weight.dtype))  # [n, H]: fused if multi-layer
            # positions up to n + k - 3 (a chain's last input); a tree's k nodes sit at slots up to n + k - 2
            num_needed = -(-(n + k - 2 + (self.tree is not None)) // bs)
            extra = max(0, num_needed - len(real))
            table = real + list(range(next_scratch, next_scratch + extra))
            next_scratch += extra
            assert next_scratch <= self.runner.kv_spec.num_blocks, "EAGLE scratch blocks exhausted"
            reqs.append(r)
            ks.append(k)
            tables.append(table)
            catch_up.append(StepTokens(r.request_id, first, r.all_token_ids[first + 1 : n], table))
            feats.append(f)
            self.num_computed[r.request_id] = n - 1
        if not reqs:
            return Proposal([[] for _ in requests], None)

        logits, fhat = self._forward_head(catch_up, feats)
        if self.tree is not None:
            drafted = self._draft_tree(reqs, ks, tables, [f[-1:] for f in feats], logits, fhat)
            by_id = {r.request_id: d for r, d in zip(reqs, drafted)}
            return Proposal(
                [by_id.get(r.request_id, ([], []))[0] for r in requests],
                None,
                [by_id.get(r.request_id, ([], []))[1] for r in requests],
            )
        meta = self.runner.sampling_metadata(reqs)

        def step(alive: list[int], keep: list[int], j: int, last: list[int]) -> torch.Tensor:
            nonlocal fhat
            if len(keep) < len(fhat):
                fhat = fhat[torch.tensor(keep, device=fhat.device)]
            slices = [
                StepTokens(reqs[i].request_id, reqs[i].num_tokens - 1 + j, [t], tables[i]) for i, t in zip(alive, last)
            ]
            out, fhat = self._forward_head(slices, list(fhat.unsqueeze(1)))
            return out

        drafts, probs = draft_loop(reqs, ks, meta, logits, self._sample, step)
        return Proposal([drafts.get(r.request_id, []) for r in requests], probs)

    def _draft_tree(
        self,
        reqs: list[DraftRequest],
        budgets: list[int],
        tables: list[list[int]],
        root_feats: list[torch.Tensor],
        logits: torch.Tensor,
        fhat: torch.Tensor,
    ) -> list[tuple[list[int], list[int]]]:
        """A dynamic tree per request (EAGLE-2's expansion, Li et al. 2024, from the paper's description): each
        level keeps the `max_width` nodes of highest cumulative draft log-probability among the children of the
        level before, and one head pass per level over the root and every node kept so far (a token-tree step
        of the head's own cache: each node reads its parent's predicted feature) gives their children. Finally
        the `budget` nodes of highest cumulative log-probability are kept (a child never outscores its parent,
        so they form a tree; here every kept node is verified, up to `budget`). Nodes are the head's
        deterministic top guesses: point masses for the verifier.

            root -> a (-0.1), b (-1.2), c (-2.0)        width 2: keep a, b; their children scored
            a -> d (-0.1 - 0.3), e (...); b -> f ...    keep the 2 best of d, e, f, ... and so on
        """
        assert self.tree is not None  # propose drafts trees only with a tree config
        w, vocab = self.tree.max_width, self.head.draft_vocab
        out: list[tuple[list[int], list[int]]] = []
        root_lp = logits.log_softmax(-1)
        for i, r in enumerate(reqs):
            depth_cap = min(budgets[i], draft_budget(r, self.max_depth, self.max_model_len))
            toks: list[int] = []
            parents: list[int] = []
            scores: list[float] = []
            node_fhat: list[torch.Tensor] = []  # each kept node's predicted feature (its children's input)
            top = root_lp[i].topk(w)
            level = [(float(v), -1, int(vocab[t])) for v, t in zip(top.values, top.indices)]
            for d in range(depth_cap):
                level.sort(key=lambda x: -x[0])
                new = level[: min(w, budgets[i] - len(toks))]
                if not new:
                    break
                first = len(toks)
                for sc, par, t in new:
                    toks.append(t)
                    parents.append(par)
                    scores.append(sc)
                if d + 1 == depth_cap:
                    break
                # one head pass: the root (t_{N-1} with the target's f_{N-2}) and every node so far
                feats_in = [root_feats[i]] + [fhat[i : i + 1] if p < 0 else node_fhat[p] for p in parents]
                step = StepTokens(
                    r.request_id,
                    r.num_tokens - 2,
                    [r.all_token_ids[-1]] + toks,
                    tables[i],
                    len(toks),
                    True,
                    None,
                    list(parents),
                )
                lg, fh = self._forward_tree(step, torch.cat(feats_in))
                node_fhat = [fh[1 + j : 2 + j] for j in range(len(toks))]
                lp = lg.log_softmax(-1)
                level = []
                for j in range(first, len(toks)):
                    tv = lp[1 + j].topk(w)
                    level += [(scores[j] + float(v), j, int(vocab[t])) for v, t in zip(tv.values, tv.indices)]
            keep = sorted(sorted(range(len(toks)), key=lambda j: -scores[j])[: budgets[i]])
            index = {j: n for n, j in enumerate(keep)}
            out.append(([toks[j] for j in keep], [index[parents[j]] if parents[j] >= 0 else -1 for j in keep]))
        return out

    def _run_head(self, inp: StepInputs, feats: torch.Tensor) -> torch.Tensor:
        """The head over a step's inputs and features [n, H]: its input rows (fc over [embedding | feature]) through
        its decoder layer in the C++ layer loop where the loop serves the step, else through its modules."""
        rows = self.head.input_rows(inp.input_ids, feats)
        out = self.runner.run_rows(inp, rows)
        if out is not None:
            return out
        with forward_context(inp.meta):
            return self.head.forward_rows(inp.positions, rows)

    def _forward_tree(self, step: StepTokens, feats: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """One tree step of the head: (logits [1 + k, V'], predicted features [1 + k, H]) of the root and nodes."""
        inp = self.runner.prepare_inputs([step])
        fh = self._run_head(inp, feats.to(self.head.norm.weight.dtype))
        return self.head.compute_logits(fh), fh

    def _forward_head(self, slices: list[StepTokens], feats: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """(logits over the draft vocab [n, V'], predicted features [n, H]) at each slice's last
        position, in slice order. feats[i]: the features paired with slices[i]'s tokens."""
        order = sorted(range(len(slices)), key=lambda i: slices[i].num_new_tokens != 1)  # decodes first
        inp = self.runner.prepare_inputs([slices[i] for i in order])
        x = torch.cat([feats[i] for i in order]).to(self.head.norm.weight.dtype)
        fhat = self._run_head(inp, x)
        last_sorted = fhat[inp.logits_indices]
        last = torch.empty_like(last_sorted)
        last[torch.tensor(order, device=last.device)] = last_sorted
        return self.head.compute_logits(last), last

    def _sample(self, sub_logits: torch.Tensor, meta: SamplingMetadata) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Draft tokens [N] (vocabulary ids) and q [N, V] over the full vocabulary (None when every
        row is greedy); q is 0 outside the draft vocabulary."""
        vocab = self.head.draft_vocab
        if meta.all_greedy and meta.output_counts is None and meta.prompt_mask is None and meta.min_tokens_mask is None:
            return vocab[sub_logits.argmax(-1)], None
        full = sub_logits.new_full((sub_logits.shape[0], self.head.arch.vocab_size), float("-inf"))
        full[:, vocab] = sub_logits
        return super()._sample(full, meta)
