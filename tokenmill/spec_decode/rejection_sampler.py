"""Exact verification of draft tokens (speculative sampling, Leviathan et al. / Chen et al.).

For a request with k drafts x_1..x_k, the target pass yields k + 1 distributions p_1..p_{k+1}
(p_j conditions on the drafts before j) and the proposer drew x_j from q_j. Walking j = 1..k:

    accept x_j with probability min(1, p_j(x_j) / q_j(x_j));
    at the first rejection emit y ~ norm(max(p_j - q_j, 0)) and stop;
    if all k are accepted emit a bonus y ~ p_{k+1}.

Every emitted token is then distributed exactly as the target would sample it. A proposer
without probabilities (n-gram) is a point mass q_j = onehot(x_j): accept with probability
p_j(x_j), residual = p_j with x_j removed. Greedy requests accept exactly while x_j equals the
target's argmax and emit the argmax at the first mismatch.

Worked example (the seeds'): q = [0.10, 0.60, 0.20, 0.10], p = [0.05, 0.30, 0.55, 0.10],
x = 1: accept with 0.30 / 0.60 = 0.5; residual max(p - q, 0) = [0, 0, 0.35, 0] -> [0, 0, 1, 0].

Row layout of one verification batch (two requests: A with 2 drafts, B with none):

    rows                [A:x1  A:x2  A:bonus | B:bonus]     num_draft_tokens = [2, 0]
    row_start           [0, 3]                              cumsum(k + 1) - (k + 1)
    draft_start         [0, 2]                              cumsum(k) - k
    draft rows          [0, 1]                              row_start[i] + j for draft j of request i
    if A accepts 1:     final row = 0 + 1 = 1 (residual at x2), B: final row 3 (plain sample)
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

import torch

from tokenmill.core.step_io import SamplerResult, SamplingRow, StepTokens
from tokenmill.layers.sampler import (
    SamplingMetadata,
    apply_penalties,
    apply_temperature_and_masks,
    gather_logprobs,
    sample_inverse_cdf,
)
from tokenmill.spec_decode.stats import SpecDecodeStats

# ------------------------------------------------------------------------------ pure functions


def acceptance_probs(
    target_probs: torch.Tensor, draft_probs: torch.Tensor | None, draft_token_ids: torch.Tensor
) -> torch.Tensor:
    """min(1, p(x) / q(x)) per draft token.

    target_probs: [num_draft, V]; draft_probs: [num_draft, V] or None (point mass);
    draft_token_ids: [num_draft] -> [num_draft] float32.
    """
    p = target_probs.gather(1, draft_token_ids[:, None])[:, 0]
    if draft_probs is None:
        return p.clamp(max=1.0)
    q = draft_probs.gather(1, draft_token_ids[:, None])[:, 0]
    # q(x) > 0 since x was drawn from q; guard anyway so a zero never yields NaN.
    return torch.where(q > 0, (p / q.clamp(min=1e-30)).clamp(max=1.0), torch.ones_like(p))


def residual_distribution(
    target_probs: torch.Tensor, draft_probs: torch.Tensor | None, draft_token_ids: torch.Tensor
) -> torch.Tensor:
    """norm(max(p - q, 0)) per draft row; rows whose residual has no mass fall back to p.

    [num_draft, V] (+ [num_draft, V] or None, [num_draft]) -> [num_draft, V].
    """
    if draft_probs is None:
        r = target_probs.scatter(1, draft_token_ids[:, None], 0.0)
    else:
        r = (target_probs - draft_probs).clamp(min=0.0)
    mass = r.sum(-1, keepdim=True)
    return torch.where(mass > 0, r / mass.clamp(min=1e-30), target_probs)


@dataclass
class RejectionOutput:
    output_token_ids: list[list[int]]
    """Per request: accepted drafts followed by one recovered or bonus token."""
    num_accepted: list[int]
    final_rows: torch.Tensor
    """[N] row of each request's last emitted token (row_start + num_accepted)."""


def rejection_sample(
    target_logits: torch.Tensor,
    draft_token_ids: torch.Tensor,
    draft_probs: torch.Tensor | None,
    num_draft_tokens: list[int],
    is_greedy: torch.Tensor,
    uniforms: torch.Tensor | None,
    sample_uniforms: torch.Tensor | None,
) -> RejectionOutput:
    """Verify a batch of drafts.

    target_logits:   [num_rows, V] processed (penalties, temperature, masks) target logits;
                     request i owns k_i + 1 consecutive rows (see the module docstring).
    draft_token_ids: [num_draft] int64, num_draft = sum(k_i).
    draft_probs:     [num_draft, V] q of each draft token's row, or None for point masses.
    num_draft_tokens: k_i per request (0 = plain sampling from its only row).
    is_greedy:       [N] bool.
    uniforms:        [num_draft] U(0, 1) acceptance draws (None if every request is greedy).
    sample_uniforms: [N] U(0, 1) for the one token each request samples (bonus or residual; None if all greedy),
                     by inverse CDF (layers/sampler.py's sample_inverse_cdf).
    """
    dev = target_logits.device
    n = len(num_draft_tokens)
    k = torch.tensor(num_draft_tokens, dtype=torch.long, device=dev)  # [N]
    row_start = torch.cumsum(k + 1, 0) - (k + 1)  # [N]
    draft_start = torch.cumsum(k, 0) - k  # [N]
    req_of_draft = torch.repeat_interleave(torch.arange(n, device=dev), k)  # [num_draft]
    pos_of_draft = torch.arange(len(draft_token_ids), device=dev) - draft_start[req_of_draft]  # j within request
    draft_rows = row_start[req_of_draft] + pos_of_draft  # [num_draft]

    argmax = target_logits.argmax(-1)  # [num_rows]
    greedy_ok = argmax[draft_rows] == draft_token_ids
    if bool(is_greedy.all()):
        accepted = greedy_ok
        probs = None
    else:
        assert uniforms is not None, "uniforms are None only when every request is greedy"
        probs = target_logits.softmax(-1)  # [num_rows, V]
        p_draft = probs[draft_rows]
        accept_p = acceptance_probs(p_draft, draft_probs, draft_token_ids)
        accepted = torch.where(is_greedy[req_of_draft], greedy_ok, uniforms < accept_p)

    # Leading run of acceptances per request.
    max_k = int(k.max()) if n else 0
    grid = torch.zeros(n, max(max_k, 1), dtype=torch.bool, device=dev)  # [N, max_k]
    grid[req_of_draft, pos_of_draft] = accepted
    num_accepted = grid.long().cumprod(1).sum(1)  # [N]
    final_rows = row_start + num_accepted  # [N]

    final = argmax[final_rows]  # greedy answer
    if probs is not None:
        assert sample_uniforms is not None, "sample_uniforms is None only when every request is greedy"
        dist = probs[final_rows]  # [N, V] bonus: p
        rejected = num_accepted < k
        if bool(rejected.any()):
            rej_req = rejected.nonzero()[:, 0]
            d = draft_start[rej_req] + num_accepted[rej_req]  # the rejected drafts
            q_rej = None if draft_probs is None else draft_probs[d]
            dist[rej_req] = residual_distribution(probs[final_rows[rej_req]], q_rej, draft_token_ids[d])
        sampled = sample_inverse_cdf(dist, sample_uniforms)
        final = torch.where(is_greedy, final, sampled)

    acc = num_accepted.tolist()
    drafts = draft_token_ids.tolist()
    fin = final.tolist()
    out: list[list[int]] = []
    d0 = 0
    for i, ki in enumerate(num_draft_tokens):
        out.append(drafts[d0 : d0 + acc[i]] + [fin[i]])
        d0 += ki
    return RejectionOutput(out, acc, final_rows)


def expand_sampling_metadata(
    meta: SamplingMetadata, drafts: list[list[int]], num_output_tokens: list[int], min_tokens: list[int]
) -> SamplingMetadata:
    """Per-request metadata -> per-row metadata for k_i + 1 rows each.

    Row j of request i sees drafts[i][:j] as already generated: they count for frequency,
    presence and repetition penalties and for min_tokens, exactly as if sampled one by one.
    """
    return expand_rows(meta, [[d[:j] for j in range(len(d) + 1)] for d in drafts], num_output_tokens, min_tokens)


def expand_rows(
    meta: SamplingMetadata, prefixes: list[list[list[int]]], num_output_tokens: list[int], min_tokens: list[int]
) -> SamplingMetadata:
    """Per-request metadata -> per-row metadata: request i owns len(prefixes[i]) rows, and row j sees the
    tokens prefixes[i][j] as already generated (a chain's row j: its first j drafts; a tree node's row: its
    path, spec_decode/tree.py)."""
    reps = torch.tensor([len(p) for p in prefixes], dtype=torch.long, device=meta.temperature.device)

    def rep(t: torch.Tensor | None) -> torch.Tensor | None:
        return None if t is None else t.repeat_interleave(reps, dim=0)

    counts = rep(meta.output_counts)
    if counts is not None:
        row = 0
        for rows in prefixes:
            for pre in rows:
                for tok in pre:
                    counts[row, tok] += 1
                row += 1
    ban = rep(meta.min_tokens_mask)
    if ban is not None:
        row = 0
        for rows, n_out, mt in zip(prefixes, num_output_tokens, min_tokens):
            for pre in rows:
                if n_out + len(pre) >= mt:
                    ban[row] = False
                row += 1
    gens = [g for rows, g in zip(prefixes, meta.generators) for _ in rows]
    allowed = None
    if meta.allowed_per_position is not None:  # a grammar's mask per position: row j after prefixes[i][j]
        V = next(a.shape[-1] for a in meta.allowed_per_position if a is not None)
        parts = []
        for rows, a in zip(prefixes, meta.allowed_per_position):
            if a is None:
                parts.append(torch.ones(len(rows), V, dtype=torch.bool, device=reps.device))
            else:
                assert a.shape[0] == len(rows), f"{a.shape[0]} grammar rows for {len(rows)} positions"
                parts.append(a)
        allowed = torch.cat(parts)
    return replace(
        meta,
        allowed=allowed,
        allowed_per_position=None,
        temperature=meta.temperature.repeat_interleave(reps, dim=0),
        top_k=rep(meta.top_k),
        top_p=rep(meta.top_p),
        min_p=rep(meta.min_p),
        presence_penalty=rep(meta.presence_penalty),
        frequency_penalty=rep(meta.frequency_penalty),
        repetition_penalty=rep(meta.repetition_penalty),
        output_counts=counts,
        prompt_mask=rep(meta.prompt_mask),
        min_tokens_mask=ban,
        generators=gens,
    )


def draw_randomness(
    num_draft_tokens: list[int],
    generators: list[torch.Generator | None],
    device: torch.device,
    global_gen: torch.Generator | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Acceptance uniforms [num_draft] and one sampling uniform per request [N]. A seeded request draws its k
    acceptance uniforms and then its sampling uniform from its own generator, so its outcome does not depend on
    the rest of the batch (as in the plain sampler)."""
    n = len(num_draft_tokens)
    uniforms = torch.rand(sum(num_draft_tokens), generator=global_gen, device=device)
    sample_u = torch.rand(n, generator=global_gen, dtype=torch.float64, device=device)
    d0 = 0
    for i, (ki, g) in enumerate(zip(num_draft_tokens, generators)):
        if g is not None:
            if ki:
                uniforms[d0 : d0 + ki] = torch.rand(ki, generator=g, device=device)
            sample_u[i] = torch.rand((), generator=g, dtype=torch.float64, device=device)
        d0 += ki
    return uniforms, sample_u


# ------------------------------------------------------------------------------------- module


class RejectionSampler:
    """Verifies a step's drafts: applies each request's sampling parameters to every row, runs
    `rejection_sample`, gathers logprobs, and counts acceptances."""

    def __init__(self, stats: SpecDecodeStats) -> None:
        self.stats = stats

    def __call__(
        self,
        logits: torch.Tensor,
        sampling: list[StepTokens],
        reqs: Sequence[SamplingRow],
        meta: SamplingMetadata,
        draft_probs: dict[str, torch.Tensor],
        global_gen: torch.Generator | None,
    ) -> dict[str, SamplerResult]:
        """logits: [sum(k_i + 1), V] raw target logits, rows ordered as `sampling`; reqs[i]: the runner's row
        of sampling[i]."""
        ks = [s.num_spec_tokens if s.is_sampling else 0 for s in sampling]
        drafts = [s.token_ids[len(s.token_ids) - k :] if k else [] for s, k in zip(sampling, ks)]
        emeta = expand_sampling_metadata(
            meta, drafts, [r.num_output_tokens for r in reqs], [r.sampling_params.min_tokens for r in reqs]
        )
        dev = logits.device
        logits = apply_penalties(logits.float(), emeta)
        raw_logprobs = logits.log_softmax(-1) if meta.max_num_logprobs is not None else None
        processed = apply_temperature_and_masks(logits, emeta)
        is_greedy = meta.temperature == 0  # [N]
        flat = torch.tensor([t for d in drafts for t in d], dtype=torch.long, device=dev)
        q = None
        if not meta.all_greedy and any(ks):
            rows = [draft_probs.get(r.request_id) for r, k in zip(reqs, ks) if k]
            present = [x for x in rows if x is not None]
            if len(present) == len(rows):
                q = torch.cat([x[:k] for x, k in zip(present, [k for k in ks if k])]).to(dev)
        uniforms = sample_u = None
        if not meta.all_greedy:
            uniforms, sample_u = draw_randomness(ks, meta.generators, dev, global_gen)
        res = rejection_sample(processed, flat, q, ks, is_greedy, uniforms, sample_u)
        lps: list | None = None
        if raw_logprobs is not None:
            rows_: list[int] = []
            toks: list[int] = []
            row0 = 0
            for k, toks_i in zip(ks, res.output_token_ids):
                rows_.extend(range(row0, row0 + len(toks_i)))
                toks.extend(toks_i)
                row0 += k + 1
            per_row_n = [r.sampling_params.logprobs for r, t in zip(reqs, res.output_token_ids) for _ in t]
            flat_lps = (
                gather_logprobs(
                    raw_logprobs[torch.tensor(rows_, device=dev)], torch.tensor(toks, device=dev), per_row_n
                )
                if any(x is not None for x in per_row_n)
                else [None] * len(toks)
            )
            lps = flat_lps
        out: dict[str, SamplerResult] = {}
        t0 = 0
        for r, k, toks_i, a in zip(reqs, ks, res.output_token_ids, res.num_accepted):
            self.stats.observe(k, a)
            lp = None
            if lps is not None and r.sampling_params.logprobs is not None:
                lp = lps[t0 : t0 + len(toks_i)]
            t0 += len(toks_i)
            out[r.request_id] = SamplerResult(toks_i, lp)
        return out
