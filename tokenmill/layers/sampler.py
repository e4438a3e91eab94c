"""Vectorized sampling over a batch of logits rows.

Order of operations per row (the rejection sampler reuses `process_logits` so draft and target
distributions get identical treatment):
  1. penalties: repetition (prompt + output), presence and frequency (output);
  2. min_tokens: EOS and stop_token_ids masked until enough tokens were generated; a grammar's banned
     tokens masked (structured outputs);
  3. logprobs are taken here (after penalties, before temperature), as vLLM returns them;
  4. temperature, then top-k, top-p and min-p masks (masked logits = -inf);
  5. greedy rows take the argmax; random rows draw one uniform u and take the first token whose
     cumulative probability exceeds u (`sample_inverse_cdf`), which samples i with probability p_i.
     Rows with a seed draw u from their own generator, so their samples do not depend on the rest of
     the batch. (Until 2026-12-07 an exponential race, argmax(p_i / E_i), drew one Exp(1) per
     vocabulary entry: 0.9 ms per row of 49,152 on this CPU build of torch, a seventh of a decode step.)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from tokenmill import native
from tokenmill.outputs import Logprob

if TYPE_CHECKING:
    from collections.abc import Sequence

    from tokenmill.core.step_io import SamplingRow


def argmax_rows(logits: torch.Tensor) -> torch.Tensor:
    """logits [N, V] -> int64 [N], the same indices as logits.argmax(-1) (first maximum; NaN counts
    as the maximum); a C++ kernel (csrc/argmax.cpp) for float32 on CPU, torch otherwise."""
    if logits.dim() == 2 and logits.device.type == "cpu" and logits.dtype == torch.float32 and logits.shape[1] > 0:
        ops = native.ops()
        if ops is not None:
            return ops.argmax_rows(logits.contiguous())
    return logits.argmax(-1)


def unpack_token_bitmask(words: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """int32 [R, ceil(V / 32)] -> bool [R, V], True = allowed: token t is bit t % 32 of word t // 32.
    E.g. V = 40, words [[0b101, 0b10]] -> tokens 0, 2 and 33 allowed."""
    shifts = torch.arange(32, dtype=torch.int32, device=words.device)
    bits = (words.unsqueeze(-1) >> shifts) & 1
    return bits.reshape(words.shape[0], -1)[:, :vocab_size].bool()


def masks_from_bytes(data: bytes, num_words: int, vocab_size: int) -> torch.Tensor:
    """A request's bitmask rows as sent in StepInput.token_masks -> bool [rows, V]."""
    words = torch.frombuffer(bytearray(data), dtype=torch.int32).reshape(-1, num_words)
    return unpack_token_bitmask(words, vocab_size)


@dataclass
class SamplingMetadata:
    temperature: torch.Tensor  # [N] float32; 0 for greedy rows
    top_k: torch.Tensor | None  # [N] int64; 0 = off (None if no row uses it)
    top_p: torch.Tensor | None  # [N] float32 (None if no row uses it)
    min_p: torch.Tensor | None  # [N] float32 (None if no row uses it)
    presence_penalty: torch.Tensor | None  # [N]
    frequency_penalty: torch.Tensor | None  # [N]
    repetition_penalty: torch.Tensor | None  # [N]
    output_counts: torch.Tensor | None  # [N, V] float32 counts of output tokens
    prompt_mask: torch.Tensor | None  # [N, V] bool, token occurs in the prompt
    min_tokens_mask: torch.Tensor | None  # [N, V] bool, True = banned this step
    generators: list[torch.Generator | None]
    all_greedy: bool
    max_num_logprobs: int | None
    allowed: torch.Tensor | None = None  # [N, V] bool, False = banned by the row's grammar (None: no grammar)
    allowed_per_position: list[torch.Tensor | None] | None = None
    """Per request, [1 + k, V] bool: its grammar's allowed tokens at the next position and after each of its
    k drafts (paths, for a tree); what the verifier's rows get (spec_decode.rejection_sampler.expand_rows)."""


def apply_penalties(logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
    if meta.repetition_penalty is not None:
        seen = meta.prompt_mask | (meta.output_counts > 0)
        rp = meta.repetition_penalty[:, None]
        penalized = torch.where(logits > 0, logits / rp, logits * rp)
        logits = torch.where(seen, penalized, logits)
    if meta.frequency_penalty is not None:
        logits = logits - meta.frequency_penalty[:, None] * meta.output_counts
    if meta.presence_penalty is not None:
        logits = logits - meta.presence_penalty[:, None] * (meta.output_counts > 0).float()
    if meta.min_tokens_mask is not None:
        logits = logits.masked_fill(meta.min_tokens_mask, float("-inf"))
    if (
        meta.allowed is not None
    ):  # structured outputs: before logprobs, temperature, top-k/p (docs/structured_outputs.md)
        logits = logits.masked_fill(~meta.allowed, float("-inf"))
    return logits


def apply_temperature_and_masks(logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
    """Scaled, masked logits; greedy rows are left unscaled (temperature treated as 1)."""
    temp = torch.where(meta.temperature > 0, meta.temperature, torch.ones_like(meta.temperature))
    logits = logits / temp[:, None]
    if meta.top_k is not None:
        k = meta.top_k.clamp(min=0)
        vocab = logits.shape[-1]
        k = torch.where(k == 0, torch.full_like(k, vocab), k).clamp(max=vocab)
        kth = logits.sort(dim=-1, descending=True).values.gather(1, (k - 1)[:, None])
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if meta.top_p is not None:
        sorted_logits, idx = logits.sort(dim=-1, descending=True)
        probs = sorted_logits.softmax(-1)
        cum = probs.cumsum(-1)
        # Drop a token if the mass before it already reaches top_p (always keep the first).
        drop_sorted = (cum - probs) >= meta.top_p[:, None]
        drop_sorted[:, 0] = False
        drop = torch.zeros_like(drop_sorted).scatter(1, idx, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    if meta.min_p is not None:
        probs = logits.softmax(-1)
        thresh = meta.min_p[:, None] * probs.max(-1, keepdim=True).values
        logits = logits.masked_fill(probs < thresh, float("-inf"))
    return logits


def process_logits(logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
    """Penalties, temperature and masks: the distribution a row samples from (as logits)."""
    return apply_temperature_and_masks(apply_penalties(logits, meta), meta)


def uniform_draws(
    generators: list[torch.Generator | None],
    device: torch.device,
    global_gen: torch.Generator | None = None,
) -> torch.Tensor:
    """One U(0, 1) per row [N] (float64): a seeded row's from its own generator, the others' from global_gen."""
    u = torch.rand(len(generators), generator=global_gen, dtype=torch.float64, device=device)
    for i, g in enumerate(generators):
        if g is not None:
            u[i] = torch.rand((), generator=g, dtype=torch.float64, device=device)
    return u


def sample_inverse_cdf(weights: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """weights [N, V] >= 0 (a row need not sum to 1), u [N] in [0, 1) -> int64 [N]: row i's first index whose
    cumulative weight exceeds u_i times the row's total, so index j comes with probability w_ij / sum_j w_ij. The
    sums are float64; a zero weight adds exactly nothing, so it is never picked.

        w = [0.2, 0, 0.5, 0.3], u = 0.6  ->  cumulative [0.2, 0.2, 0.7, 1.0], 0.6 x 1.0 falls below 0.7: index 2
    """
    cum = weights.to(torch.float64).cumsum(-1)
    total = cum[:, -1]
    t = torch.minimum(u.to(torch.float64) * total, torch.nextafter(total, torch.zeros_like(total)))  # below total
    picked = torch.searchsorted(cum, t.unsqueeze(-1), right=True).squeeze(-1)
    # A row with no usable mass (all zero, NaN or inf, from extreme sampling parameters) gets its argmax, as
    # argmax(p / E) gave it: always a token id, never V.
    usable = (total > 0) & torch.isfinite(total)
    return torch.where(usable, picked, weights.argmax(-1)).clamp_(max=weights.shape[-1] - 1)


def sample_from_logits(
    logits: torch.Tensor, meta: SamplingMetadata, global_gen: torch.Generator | None = None
) -> torch.Tensor:
    """logits [N, V] already processed -> token ids [N]."""
    greedy = argmax_rows(logits)
    if meta.all_greedy:
        return greedy
    probs = logits.softmax(-1)
    sampled = sample_inverse_cdf(probs, uniform_draws(meta.generators, probs.device, global_gen))
    return torch.where(meta.temperature > 0, sampled, greedy)


@dataclass
class SamplerOutput:
    token_ids: torch.Tensor  # [N]
    logprobs: list[dict[int, Logprob]] | None  # per row, if any row asked


class Sampler:
    def __init__(self, global_seed: int = 0, device: str = "cpu") -> None:
        self.global_gen = torch.Generator(device=device)
        self.global_gen.manual_seed(global_seed)

    def __call__(self, logits: torch.Tensor, meta: SamplingMetadata, num_logprobs: list[int | None]) -> SamplerOutput:
        logits = apply_penalties(logits.float(), meta)
        raw_logprobs = logits.log_softmax(-1) if any(n is not None for n in num_logprobs) else None
        if meta.all_greedy:
            tokens = argmax_rows(logits)
        else:
            tokens = sample_from_logits(apply_temperature_and_masks(logits, meta), meta, self.global_gen)
        lps = None
        if raw_logprobs is not None:
            lps = gather_logprobs(raw_logprobs, tokens, num_logprobs)
        return SamplerOutput(tokens, lps)


def gather_logprobs(logprobs: torch.Tensor, tokens: torch.Tensor, num_logprobs: list[int | None]) -> list:
    """Per row: {token: Logprob} for the sampled token and the top-N (N = num_logprobs[i])."""
    k = max(n for n in num_logprobs if n is not None)
    top_v, top_i = logprobs.topk(max(k, 1), dim=-1)
    chosen = logprobs.gather(1, tokens[:, None])[:, 0]
    ranks = (logprobs > chosen[:, None]).sum(-1) + 1
    out: list = []
    top_v, top_i, chosen, ranks, toks = top_v.tolist(), top_i.tolist(), chosen.tolist(), ranks.tolist(), tokens.tolist()
    for r, n in enumerate(num_logprobs):
        if n is None:
            out.append(None)
            continue
        d = {toks[r]: Logprob(chosen[r], ranks[r])}
        for j in range(n):
            t = top_i[r][j]
            if t not in d:
                d[t] = Logprob(top_v[r][j], j + 1)
        out.append(d)
    return out


TARGET_STREAM = 0
"""A seeded request's random stream for the tokens the engine samples (and the verifier's draws)."""
DRAFT_STREAM = 1
"""Its stream for a proposer's sampled drafts: seeded apart from the target's (`stream_seed`). A draft drawn with
the numbers the target sampled with would depend on the target's earlier tokens beyond their values (the same
uniform that chose t1 would choose the draft after it), and the rejection sampler's output would no longer be
the target's distribution."""


def stream_seed(seed: int, stream: int) -> int:
    """The generator seed of a request's `stream`: its own seed for the target's, a splitmix64 mix of (seed,
    stream) for the others, so no two streams of one request (or of requests with nearby seeds) coincide."""
    if stream == TARGET_STREAM:
        return seed
    mask = (1 << 64) - 1
    x = (seed + stream * 0x9E3779B97F4A7C15) & mask
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & mask
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & mask
    return x ^ (x >> 31)


def sampling_metadata(
    reqs: Sequence[SamplingRow],
    vocab_size: int,
    device: torch.device,
    generators: dict[str, torch.Generator],
    stream: int = TARGET_STREAM,
) -> SamplingMetadata:
    """Per-row sampling tensors for `reqs`: penalty counts from their outputs, min_tokens bans, and the seeded
    requests' own generators, kept in `generators` (request id -> generator, created on first use, seeded for
    `stream`: TARGET_STREAM in the target's runner, DRAFT_STREAM in a proposer's)."""
    dev = device
    params = [r.sampling_params for r in reqs]
    n, V = len(reqs), vocab_size
    temps = torch.tensor([0.0 if p.is_greedy else p.temperature for p in params], device=dev)
    all_greedy = all(p.is_greedy for p in params)

    def opt(values: list[float], neutral: float, dtype=torch.float32) -> torch.Tensor | None:
        if all(v == neutral for v in values):
            return None
        return torch.tensor(values, dtype=dtype, device=dev)

    top_k = opt([p.top_k for p in params], 0, torch.long)
    top_p = opt([p.top_p for p in params], 1.0)
    min_p = opt([p.min_p for p in params], 0.0)
    pres = opt([p.presence_penalty for p in params], 0.0)
    freq = opt([p.frequency_penalty for p in params], 0.0)
    rep = opt([p.repetition_penalty for p in params], 1.0)
    counts = prompt_mask = None
    if pres is not None or freq is not None or rep is not None:
        counts = torch.zeros(n, V, device=dev)
        for i, r in enumerate(reqs):
            if r.output_token_ids:
                ids = torch.tensor(r.output_token_ids, device=dev)
                counts[i].scatter_add_(0, ids, torch.ones_like(ids, dtype=torch.float32))
        if rep is not None:
            prompt_mask = torch.zeros(n, V, dtype=torch.bool, device=dev)
            for i, r in enumerate(reqs):
                prompt_mask[i, torch.tensor(r.prompt_token_ids, device=dev)] = True
    ban = None
    for i, r in enumerate(reqs):
        p = r.sampling_params
        if r.num_output_tokens < p.min_tokens:
            if ban is None:
                ban = torch.zeros(n, V, dtype=torch.bool, device=dev)
            banned = list(p.stop_token_ids) + (
                [r.eos_token_id] if r.eos_token_id is not None and not p.ignore_eos else []
            )
            if banned:
                ban[i, torch.tensor(banned, device=dev)] = True
    gens: list[torch.Generator | None] = []
    for r in reqs:
        seed = r.sampling_params.seed
        if seed is None or r.sampling_params.is_greedy:
            gens.append(None)
            continue
        g = generators.get(r.request_id)
        if g is None:
            g = torch.Generator(device=dev)
            g.manual_seed(stream_seed(seed, stream))
            generators[r.request_id] = g
        gens.append(g)
    nlp = [p.logprobs for p in params if p.logprobs is not None]
    return SamplingMetadata(
        temps,
        top_k,
        top_p,
        min_p,
        pres,
        freq,
        rep,
        counts,
        prompt_mask,
        ban,
        gens,
        all_greedy,
        max(nlp) if nlp else None,
    )
