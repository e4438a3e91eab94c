"""The block drafter's proposer (`{"method": "dflash"}`): one drafter forward proposes a whole block.

The target's runner hands the sink the outputs of the drafter's `target_layers` at every position it computes
(models/interface.py's LayerTaps, from the C++ layer loop or the modules). The sink keeps them per request, by
position (`RequestContext`); they become the drafter's context keys and values (`BlockDrafter.context_kv`) once,
when the request next drafts (or in bulk past a bound), so steps that draft nothing encode nothing:

    request holds t_0 .. t_{N-1}; context K/V held for positions first .. N-2 (what the target computed)
    block at positions N-1 .. N+B-2: [t_{N-1}, mask, ..., mask]  ->  one forward  ->  q_1 .. q_{B-1}

A chain takes draft j from q_j: the argmax for greedy rows, a sample of q_j (after the request's temperature and
filters) otherwise, with q_j handed to the rejection sampler, so the output stays the target's. Draft j does not
depend on drafts 1..j-1 (the block is denoised at once), so q_j is also its distribution given them. A tree takes
the per-position top-k: best-first by the sum of draft log-probabilities along a path, up to the node budget
(point masses for the tree verifier, as EAGLE's trees are).

With `choose_proposer` (the default) every request also gets lookup's draft (the n-gram proposer: the request's
own tokens, the online suffix store of what the server wrote for the same cache_salt unless `suffix_max_tokens` is
0, and the offline datastore when one is given). Per request and step the proposer keeps the one whose source
predicts more tokens per unit of step time: E = (1 - α^(k+1)) / (1 - α) for a k-token draft, the drafter's
divided by 1 + c, c its measured cost share (`DrafterCost`: its passes' seconds over the rest of the time
between proposals; lookup's cost, a dictionary walk per row, is taken as 0), lookup on a tie. Each source's α is
a running estimate from what its drafts got accepted (the row's next length tells: accepted = tokens gained - 1).
Adaptive γ then weighs the chosen draft once more and turns drafting off where it does not pay. At batch > 1 the
drafter's pass is shared by the rows that chose it, so dividing each row's E by the whole pass's 1 + c leans
towards lookup.

Rows of rejected drafts never reach the sink (the runner hands it `kept_rows`), and a position written again (a
rebuilt row) replaces what was held from there on. After a prefix-cache hit the target computes no features for
the cached positions: the context then starts at the first computed one, which can cost acceptance, never
exactness.
"""

from __future__ import annotations

import dataclasses
import heapq
import time
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from tokenmill.layers.sampler import (
    DRAFT_STREAM,
    SamplingMetadata,
    process_logits,
    sample_inverse_cdf,
    sampling_metadata,
    uniform_draws,
)
from tokenmill.spec_decode.adaptive import expected_tokens
from tokenmill.spec_decode.block_drafter import BlockDrafter, load_block_drafter
from tokenmill.spec_decode.draft_model import draft_loop, take_rows
from tokenmill.spec_decode.ngram import NgramProposer
from tokenmill.spec_decode.proposer import DraftRequest, Proposal, draft_budget

if TYPE_CHECKING:
    from tokenmill.config import SpeculativeConfig, TreeConfig
    from tokenmill.core.step_io import StepInput, StepTokens
    from tokenmill.spec_decode.proposer import ProposerContext

DRAFTERS = Path(__file__).resolve().parents[1] / "drafters"
"""The drafters shipped in the package: one directory per target alias."""


def shipped_drafter(target_model: str) -> Path:
    """The drafter shipped for `target_model`: one whose directory names the model alias the target is, or
    resolves to the same file as. A ValueError says which targets have one."""
    from tokenmill.models.loader import resolve_model_path

    known = (
        sorted(p.name for p in DRAFTERS.iterdir() if (p / "drafter_config.json").is_file()) if DRAFTERS.is_dir() else []
    )
    for alias in known:
        if target_model == alias:
            return DRAFTERS / alias
        try:
            if Path(resolve_model_path(alias)).resolve() == Path(resolve_model_path(target_model)).resolve():
                return DRAFTERS / alias
        except (OSError, ValueError):
            continue
    raise ValueError(
        f"speculative_config: no block drafter ships for {target_model!r} (shipped: {known}); train one with "
        '`tokenmill train-drafter --model ... --out DIR` and pass "model": DIR'
    )


class RequestContext:
    """One request's drafter context: each draft layer's keys and values for positions first .. encoded_end - 1,
    in buffers that grow by doubling (a step appends, it does not copy what is held), then the target's raw
    feature rows for positions encoded_end .. end - 1 not encoded yet.

    The sink only appends raw rows; they are encoded (BlockDrafter.encode_context + context_kv) when the request
    is about to draft, or in bulk once PENDING_LIMIT rows wait. So steps where adaptive γ drafts nothing (most
    steps at batch 32) cost a list append per request, and the encoding runs as a few large calls.

        first 10; 6 positions encoded (10..15), pending rows for 16..18  ->  end 19
        write at 17 (a rebuilt row)  ->  pending keeps 16 only, then the new rows from 17
        write at 12                  ->  encoded cut back to 10..11, pending the new rows from 12
        write at 25 (a gap) or at 5  ->  a fresh context from there
    """

    PENDING_LIMIT = 256
    """Raw rows a request holds before they are encoded whether it drafts or not (bounds their memory)."""

    def __init__(self, first: int) -> None:
        self.first = first
        self.num_encoded = 0
        self.buffers: list[tuple[torch.Tensor, torch.Tensor]] = []
        """Per draft layer (keys, values) [capacity, kv_heads, d]; the first num_encoded rows are held."""
        self.pending: list[torch.Tensor] = []
        """Raw feature rows [n, F] in position order, from encoded_end on."""
        self.num_pending = 0

    @property
    def encoded_end(self) -> int:
        return self.first + self.num_encoded

    @property
    def end(self) -> int:
        """One past the last position held, encoded or not."""
        return self.encoded_end + self.num_pending

    def append_rows(self, start: int, rows: torch.Tensor) -> bool:
        """Feature rows for positions start .. start + n - 1; what was held from `start` on is replaced. False
        (nothing changed) when start is before the first position held or past the end: the caller starts afresh."""
        if start < self.first or start > self.end:
            return False
        if start < self.encoded_end:
            self.num_encoded = start - self.first
            self.pending, self.num_pending = [], 0
        elif start < self.end:
            keep = start - self.encoded_end
            self.pending = [torch.cat(self.pending)[:keep]] if keep else []
            self.num_pending = keep
        self.pending.append(rows)
        self.num_pending += rows.shape[0]
        return True

    def take_pending(self) -> torch.Tensor | None:
        """The raw rows not encoded yet, [num_pending, F] (None if none); `add_encoded` must follow."""
        if not self.num_pending:
            return None
        rows = torch.cat(self.pending) if len(self.pending) > 1 else self.pending[0]
        self.pending, self.num_pending = [], 0
        return rows

    def add_encoded(self, kv: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Append the encoded keys and values of the rows take_pending returned."""
        need = self.num_encoded + kv[0][0].shape[0]
        self.make_room(need, kv)
        for (bk, bv), (k, v) in zip(self.buffers, kv):
            bk[self.num_encoded : need] = k
            bv[self.num_encoded : need] = v
        self.num_encoded = need

    def reserve(self, extra: int) -> None:
        """Room for `extra` rows past the encoded ones (the fused forward writes a block there as scratch).
        Needs encoded rows."""
        assert self.buffers, "reserve follows an encoding"
        self.make_room(self.num_encoded + extra, self.buffers)

    def make_room(self, need: int, like: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Buffers of at least `need` rows (shaped and typed as `like`'s per-layer tensors), the encoded rows kept:
        grown to twice the need, in 16s (the fused forward reads them as 16-row blocks of a paged cache)."""
        if self.buffers and need <= self.buffers[0][0].shape[0]:
            return
        cap = max(64, (2 * need + 15) // 16 * 16)
        n = self.num_encoded
        grown = []
        for layer, (k, v) in enumerate(like):
            nk, nv = k.new_empty((cap, *k.shape[1:])), v.new_empty((cap, *v.shape[1:]))
            if self.buffers:
                nk[:n], nv[:n] = self.buffers[layer][0][:n], self.buffers[layer][1][:n]
            grown.append((nk, nv))
        self.buffers = grown

    @property
    def kv(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per draft layer (keys, values) [num_encoded, kv_heads, d] (views of the buffers)."""
        return [(k[: self.num_encoded], v[: self.num_encoded]) for k, v in self.buffers]


class SourceStats:
    """One draft source's acceptance: exponentially weighted accepted / judged draft tokens (judged: up to and
    including the first rejection), with a prior of α = 0.5 worth 4 tokens."""

    def __init__(self, decay: float = 0.95) -> None:
        self.decay = decay
        self.accepted = 0.0
        self.judged = 0.0

    def observe(self, k: int, accepted: int) -> None:
        self.accepted = self.decay * self.accepted + accepted
        self.judged = self.decay * self.judged + min(accepted + 1, k)

    @property
    def alpha(self) -> float:
        return min(0.99, (self.accepted + 2.0) / (self.judged + 4.0))

    def expected(self, k: int) -> float:
        """Tokens a k-token draft is expected to emit per target pass."""
        return expected_tokens(self.alpha, k)


class DrafterCost:
    """The drafter's measured cost c as a share of a step: the seconds of its passes (encoding and the block) over
    the rest of the wall time from one proposal to the next (the target's step and the engine around it), each
    exponentially weighted. Times are passed in, so tests can give them."""

    def __init__(self, decay: float = 0.8) -> None:
        self.decay = decay
        self.forward = 0.0
        """Seconds of the drafter's passes in a proposal that ran it."""
        self.rest = 0.0
        """Seconds from the end of one proposal to the start of the next."""
        self.last_end: float | None = None

    def proposal(self, start: float, end: float, forward: float | None) -> None:
        """A proposal ran from `start` to `end`; `forward`: seconds of drafter passes in it (None: it ran none)."""
        if self.last_end is not None and start > self.last_end:
            self.rest = self.weighted(self.rest, start - self.last_end)
        if forward is not None:
            self.forward = self.weighted(self.forward, forward)
        self.last_end = end

    def weighted(self, mean: float, sample: float) -> float:
        """The exponentially weighted mean after `sample` (the first sample, while the mean is 0)."""
        return sample if mean == 0 else self.decay * mean + (1 - self.decay) * sample

    @property
    def share(self) -> float:
        """c: drafter seconds per second of the rest of a step (0 until both were seen)."""
        return self.forward / self.rest if self.rest > 0 else 0.0


class DFlashProposer:
    def __init__(
        self,
        drafter: BlockDrafter,
        vocab_size: int,
        device: torch.device,
        tree: TreeConfig | None = None,
        max_depth: int = 7,
        max_model_len: int = 1 << 30,
        seed: int = 0,
        lookup: NgramProposer | None = None,
    ) -> None:
        self.drafter = drafter
        self.vocab_size = vocab_size
        self.device = device
        self.tree = tree
        self.max_depth = max_depth
        self.max_model_len = max_model_len
        self.feature_layers: tuple[int, ...] = drafter.target_layers
        self.feature_sink = self.write
        self.context: dict[str, RequestContext] = {}
        self.generators: dict[str, torch.Generator] = {}
        """Seeded requests' own generators for the drafts (the target's are the runner's)."""
        self.global_gen = torch.Generator(device=device)
        self.global_gen.manual_seed(seed + 1)
        self.num_blocks_drafted = 0
        """Drafter forwards' blocks (tests and metrics read it)."""
        self.lookup = lookup
        """Prompt lookup (and a datastore), the other source the per-request choice weighs; None: the drafter only."""
        self.sources = {"drafter": SourceStats(), "lookup": SourceStats()}
        self.pending: dict[str, tuple[str, int, int]] = {}
        """request id -> (source, draft length, tokens held) of its last draft, until its next proposal judges it."""
        self.num_chosen = {"drafter": 0, "lookup": 0}
        """Drafts each source made (tests and benchmarks read it)."""
        self.cost = DrafterCost()
        """The drafter's measured c; lookup's is taken as 0 (a dictionary walk per row)."""

    @classmethod
    def from_context(cls, config: SpeculativeConfig, ctx: ProposerContext) -> DFlashProposer:
        path = config.model or str(shipped_drafter(ctx.target_model))
        embed, lm = ctx.tables()
        drafter = load_block_drafter(
            path, ctx.target_arch, embed, lm, ctx.dtype, ctx.device, weights=config.draft_weights
        )
        depth = min(config.tree_max_depth, drafter.block_size - 1)
        lookup = None
        if config.choose_proposer:  # matches of 2+ tokens only: one-token matches guess right ~1 time in 5
            n = max(2, config.prompt_lookup_max)
            method = "suffix" if config.suffix_max_tokens > 0 else "ngram"  # with the online store, if it may hold
            lookup_config = dataclasses.replace(config, method=method, prompt_lookup_min=2, prompt_lookup_max=n)
            lookup = NgramProposer.from_context(lookup_config, ctx)
        return cls(
            drafter, ctx.target_arch.vocab_size, ctx.device, config.tree, depth, ctx.max_model_len, ctx.seed, lookup
        )

    # ------------------------------------------------------------------ rows
    def forget(self, request_ids: list[str]) -> None:
        for rid in request_ids:
            self.context.pop(rid, None)
            self.generators.pop(rid, None)
            self.pending.pop(rid, None)
        if self.lookup is not None:  # finished text joins its tenant's online store
            self.lookup.forget(request_ids)

    def restart(self, request_ids: list[str]) -> None:
        for rid in request_ids:  # its features come again as the rebuilt row is recomputed
            self.context.pop(rid, None)
            self.pending.pop(rid, None)
        if self.lookup is not None:
            self.lookup.restart(request_ids)

    def on_step(self, step: StepInput) -> None:
        pass

    def write(self, batch: list[StepTokens], features: torch.Tensor) -> None:
        """The runner's sink: features [num_tokens, len(target_layers) * H] for `batch` in order (each request's
        num_new_tokens rows at start_pos ..), held raw per request (`RequestContext`); requests past
        PENDING_LIMIT raw rows get them encoded now, in one drafter pass."""
        off = 0
        full: list[RequestContext] = []
        for s in batch:
            n = s.num_new_tokens
            rows = features[off : off + n].clone()  # not a view that keeps the step's whole buffer alive
            off += n
            held = self.context.get(s.request_id)
            if held is None or not held.append_rows(s.start_pos, rows):
                held = self.context[s.request_id] = RequestContext(s.start_pos)
                held.append_rows(s.start_pos, rows)
            if held.num_pending >= RequestContext.PENDING_LIMIT:
                full.append(held)
        self.encode(full)

    @torch.inference_mode()
    def encode(self, contexts: list[RequestContext]) -> None:
        """Encode every given context's pending rows into its keys and values, all in one drafter pass."""
        starts = [c.encoded_end for c in contexts]
        rows = [c.take_pending() for c in contexts]
        todo = [(c, st, r) for c, st, r in zip(contexts, starts, rows) if r is not None]
        if not todo:
            return
        pos = torch.cat([torch.arange(st, st + r.shape[0]) for _, st, r in todo]).to(self.device)
        kv = self.drafter.context_kv(self.drafter.encode_context(torch.cat([r for *_, r in todo])), pos)
        off = 0
        for c, _, r in todo:
            n = r.shape[0]
            c.add_encoded([(k[off : off + n], v[off : off + n]) for k, v in kv])
            off += n

    # ---------------------------------------------------------------- propose
    @torch.inference_mode()
    def propose(self, requests: list[DraftRequest], num_tokens: list[int]) -> Proposal:
        start = time.perf_counter()
        out, forward = self.choose_and_draft(requests, num_tokens)
        self.cost.proposal(start, time.perf_counter(), forward)
        return out

    def choose_and_draft(self, requests: list[DraftRequest], num_tokens: list[int]) -> tuple[Proposal, float | None]:
        """The proposal, and the seconds the drafter's passes took in it (None if it ran none)."""
        self.judge(requests)
        looked = self.lookup.propose(requests, num_tokens) if self.lookup is not None else None
        use_lookup = [
            looked is not None and self.prefers_lookup(looked.token_ids[i], k) for i, k in enumerate(num_tokens)
        ]
        active = []
        for i, (r, k) in enumerate(zip(requests, num_tokens)):
            held = self.context.get(r.request_id)
            if k > 0 and not use_lookup[i] and held is not None and held.end == r.num_tokens - 1:
                active.append(i)
        t0 = time.perf_counter()
        self.encode([self.context[requests[i].request_id] for i in active])
        out = self.propose_blocks(requests, num_tokens, active)
        forward = time.perf_counter() - t0 if active else None
        drafted = set(active)
        if looked is not None:  # lookup's drafts where it was chosen (or the drafter had no context)
            for i in range(len(requests)):
                if i not in drafted and looked.token_ids[i]:
                    out.token_ids[i] = looked.token_ids[i]
                    if out.parents is not None and looked.parents is not None:
                        out.parents[i] = looked.parents[i]
        for i, r in enumerate(requests):
            if out.token_ids[i]:
                source = "drafter" if i in drafted else "lookup"
                self.num_chosen[source] += 1
                self.pending[r.request_id] = (source, len(out.token_ids[i]), r.num_tokens)
        return out, forward

    def judge(self, requests: list[DraftRequest]) -> None:
        """Each request's last draft, judged by how many tokens its row gained since (accepted + 1), feeds its
        source's acceptance estimate. (A tree's length is its node count; its accepted depth is judged the same.)"""
        for r in requests:
            last = self.pending.pop(r.request_id, None)
            if last is not None:
                source, k, held = last
                self.sources[source].observe(k, max(0, min(k, r.num_tokens - held - 1)))

    def prefers_lookup(self, lookup_draft: list[int], k: int) -> bool:
        """Lookup has a draft whose expected tokens per step time reach the drafter's: E_lookup >= E_drafter / (1 + c),
        c the drafter's measured cost share (lookup's taken as 0; the drafter's E depth-capped at its block)."""
        if not lookup_draft or k <= 0:
            return False
        depth = k if self.tree is None else self.max_depth
        drafter = self.sources["drafter"].expected(min(depth, self.drafter.block_size - 1))
        lookup_depth = len(lookup_draft) if self.tree is None else min(len(lookup_draft), self.max_depth)
        return self.sources["lookup"].expected(lookup_depth) * (1 + self.cost.share) >= drafter

    def propose_blocks(self, requests: list[DraftRequest], num_tokens: list[int], active: list[int]) -> Proposal:
        """The drafter's drafts (a chain or a tree) for requests[i], i in active; [] for the others."""
        if not active:
            return Proposal([[] for _ in requests], None, None if self.tree is None else [[] for _ in requests])
        reqs = [requests[i] for i in active]
        logits = self.block_logits(reqs)  # [R, B - 1, N]
        self.num_blocks_drafted += len(reqs)
        if self.tree is not None:
            trees = {
                r.request_id: self.tree_from_block(logits[j].log_softmax(-1), num_tokens[i], r)
                for j, (i, r) in enumerate(zip(active, reqs))
            }
            empty: tuple[list[int], list[int]] = ([], [])
            return Proposal(
                [trees.get(r.request_id, empty)[0] for r in requests],
                None,
                [trees.get(r.request_id, empty)[1] for r in requests],
            )
        ks = [min(num_tokens[i], logits.shape[1]) for i in active]
        meta = sampling_metadata(reqs, self.vocab_size, self.device, self.generators, DRAFT_STREAM)
        if self.plain_greedy(meta):  # every row's drafts are the argmaxes: one op, no per-position loop
            top = self.drafter.draft_vocab[logits.argmax(-1)].tolist()
            by_id = {r.request_id: top[j][: ks[j]] for j, r in enumerate(reqs)}
            return Proposal([by_id.get(r.request_id, []) for r in requests], None)
        if self.unconstrained(meta):
            return self.sample_blocks(requests, reqs, ks, meta, logits)

        def step(alive: list[int], keep: list[int], j: int, last: list[int]) -> torch.Tensor:
            return logits[torch.tensor(alive), j + 1]

        drafts, probs = draft_loop(reqs, ks, meta, logits[:, 0], self.sample, step)
        return Proposal([drafts.get(r.request_id, []) for r in requests], probs)

    def block_logits(self, reqs: list[DraftRequest]) -> torch.Tensor:
        """One drafter forward over every request's block: logits over the draft vocab at its mask rows,
        [R, B - 1, N]. Contexts of unequal length are padded and masked."""
        d = self.drafter
        B, R = d.block_size, len(reqs)
        ctxs = [self.context[r.request_id] for r in reqs]
        x = d.block_rows(torch.tensor([r.all_token_ids[-1] for r in reqs], device=self.device))
        pos = torch.tensor([r.num_tokens - 1 for r in reqs], device=self.device)[:, None] + torch.arange(B)
        if d.fused:  # each request's own buffers, the block written after its context
            for c in ctxs:
                c.reserve(B)
            hidden = d.forward_blocks_fused(x, pos, [c.buffers for c in ctxs], [c.num_encoded for c in ctxs])
            return d.compute_logits(hidden[:, 1:])
        lens = [c.kv[0][0].shape[0] for c in ctxs]
        T = max(lens)
        mask = None
        if R > 1 and min(lens) < T:
            mask = torch.ones(R, B, T + B, dtype=torch.bool, device=self.device)
            for j, n in enumerate(lens):
                mask[j, :, n:T] = False
        ctx_kv = []
        for layer in range(len(d.layers)):
            ks, vs = [c.kv[layer][0] for c in ctxs], [c.kv[layer][1] for c in ctxs]
            if R == 1:
                ctx_kv.append((ks[0][None], vs[0][None]))
            else:
                pad = [(0, 0, 0, 0, 0, T - n) for n in lens]
                ctx_kv.append(
                    (
                        torch.stack([torch.nn.functional.pad(k, p) for k, p in zip(ks, pad)]),
                        torch.stack([torch.nn.functional.pad(v, p) for v, p in zip(vs, pad)]),
                    )
                )
        hidden = d.forward_blocks(x, pos, ctx_kv, mask)
        return d.compute_logits(hidden[:, 1:])

    @staticmethod
    def plain_greedy(meta: SamplingMetadata) -> bool:
        """Every row greedy, with no penalty or min_tokens ban that could move its argmax."""
        return (
            meta.all_greedy and meta.output_counts is None and meta.prompt_mask is None and meta.min_tokens_mask is None
        )

    @staticmethod
    def unconstrained(meta: SamplingMetadata) -> bool:
        """No penalty, min_tokens ban or grammar: a draft's q depends on nothing drafted before it."""
        return (
            meta.output_counts is None
            and meta.prompt_mask is None
            and meta.min_tokens_mask is None
            and meta.allowed is None
            and meta.allowed_per_position is None
        )

    def sample_blocks(
        self,
        requests: list[DraftRequest],
        reqs: list[DraftRequest],
        ks: list[int],
        meta: SamplingMetadata,
        logits: torch.Tensor,
    ) -> Proposal:
        """Every position of every block sampled at once, over the draft vocabulary: q_j after the request's
        temperature and top-k/top-p/min-p (over the draft vocabulary these equal the full vocabulary's with -inf
        outside it), then q_j scattered into the full vocabulary for the verifier. Equivalent to the per-position
        loop when nothing drafted earlier changes q_j (`unconstrained`), and a few times cheaper."""
        R, P, N = logits.shape
        rows = take_rows(meta, [j for j in range(R) for _ in range(P)])
        processed = process_logits(logits.reshape(R * P, N), rows)
        q = processed.softmax(-1)
        drawn = sample_inverse_cdf(q, uniform_draws(rows.generators, q.device, self.global_gen))
        picked = torch.where(rows.temperature > 0, drawn, processed.argmax(-1))
        toks = self.drafter.draft_vocab[picked].view(R, P).tolist()
        full = q.new_zeros(R * P, self.vocab_size)
        full[:, self.drafter.draft_vocab] = q
        full = full.view(R, P, -1)
        by_id = {r.request_id: toks[j][: ks[j]] for j, r in enumerate(reqs)}
        probs = {r.request_id: full[j, : ks[j]] for j, r in enumerate(reqs) if ks[j] > 0}
        return Proposal([by_id.get(r.request_id, []) for r in requests], probs)

    def sample(self, sub_logits: torch.Tensor, meta: SamplingMetadata) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Draft tokens [n] (vocabulary ids) and q [n, V] over the full vocabulary (None when every row is
        greedy); q is 0 outside the draft vocabulary."""
        vocab = self.drafter.draft_vocab
        if self.plain_greedy(meta):
            return vocab[sub_logits.argmax(-1)], None
        full = sub_logits.new_full((sub_logits.shape[0], self.vocab_size), float("-inf"))
        full[:, vocab] = sub_logits
        processed = process_logits(full, meta)
        greedy = processed.argmax(-1)
        if meta.all_greedy:
            return greedy, None
        q = processed.softmax(-1)
        drawn = sample_inverse_cdf(q, uniform_draws(meta.generators, q.device, self.global_gen))
        return torch.where(meta.temperature > 0, drawn, greedy), q

    def tree_from_block(self, logp: torch.Tensor, budget: int, r: DraftRequest) -> tuple[list[int], list[int]]:
        """A token tree from one block's per-position log-probabilities logp [B - 1, N]: best-first by the sum of
        log-probabilities along the path, each node's children the `max_width` likeliest tokens of the next
        position, until `budget` nodes (a child never outscores its parent: the kept nodes form a tree).

            logp top: pos 1 a -0.1, b -1.5; pos 2 c -0.2, d -0.9   budget 3, width 2
            pop a (-0.1) -> push a.c (-0.3), a.d (-1.0); pop a.c -> ...; pop a.d (-1.0) -> nodes a, a.c, a.d
        """
        assert self.tree is not None  # trees are drafted only with a tree config
        width = self.tree.max_width
        depth_cap = min(logp.shape[0], draft_budget(r, self.max_depth, self.max_model_len))
        if depth_cap <= 0 or budget <= 0:
            return [], []
        top = logp[:depth_cap].topk(width, dim=-1)
        vals, idx = top.values.tolist(), self.drafter.draft_vocab[top.indices].tolist()
        heap = [(-vals[0][w], 0, -1, idx[0][w]) for w in range(width)]
        heapq.heapify(heap)
        toks: list[int] = []
        parents: list[int] = []
        while heap and len(toks) < budget:
            neg, depth, parent, tok = heapq.heappop(heap)
            node = len(toks)
            toks.append(tok)
            parents.append(parent)
            if depth + 1 < depth_cap:
                for w in range(width):
                    heapq.heappush(heap, (neg - vals[depth + 1][w], depth + 1, node, idx[depth + 1][w]))
        return toks, parents
