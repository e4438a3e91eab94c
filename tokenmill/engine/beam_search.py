"""Beam search through the engine's public request API.

A round submits every live beam as an ordinary request, prompt + the beam's tokens, for one greedy
token with logprobs = 2W (W = beam_width), and steps the engine until all of them are done:

  1. each beam reports its top-2W next-token logprobs;
  2. candidates (beam, token, cumulative logprob) are ranked; the best W that are not EOS stay
     alive; an EOS among the top W ranks completes a hypothesis;
  3. the survivors are the next round's beams.

The prefix cache shares every full block between a beam, its earlier rounds and its siblings, and
its tails (core/kv_cache_manager.py) hand each new request its parent's partly filled last block by
copy, so a round computes one token per beam:

    round r:     request A+x   [p p p a1 | a2 x]         computes x; A+x's block 1 becomes a tail on finish
    round r+1:   request A+x+y [p p p a1 | a2 x y]       block 0 hit, tail copied (a2 x), computes y

This is vLLM's beam search; the engine core has no second, token-level request API for it
(benchmarks/beam_before_after.py compares it with the engine-internal forks it replaced). Without
prefix caching every round recomputes whole prompts.

Scores: cumulative logprob / (generated tokens ** length_penalty), as in Hugging Face; beams run
until max_tokens or until no beam is alive.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from tokenmill.sampling_params import SamplingParams

if TYPE_CHECKING:
    from tokenmill.engine.llm import LLM


@dataclass(frozen=True)
class BeamSearchParams:
    beam_width: int
    """Beams kept per prompt (W); each round ranks the top 2W continuations of every beam."""
    max_tokens: int
    """Generated tokens per beam at most."""
    ignore_eos: bool = False
    """Treat EOS as an ordinary token instead of completing a hypothesis."""
    length_penalty: float = 1.0
    """Score = cumulative logprob / (generated tokens ** length_penalty); > 0 favours longer."""

    def __post_init__(self) -> None:
        if self.beam_width < 1:
            raise ValueError(f"beam_width must be >= 1, got {self.beam_width}")
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")


@dataclass
class BeamSearchSequence:
    tokens: list[int]
    """Generated token ids (EOS included when it ended the beam)."""
    cum_logprob: float
    score: float
    """cum_logprob / len(tokens) ** length_penalty."""
    finish_reason: str
    """'stop' (EOS) or 'length'."""
    text: str | None = None


@dataclass
class BeamSearchOutput:
    prompt_token_ids: list[int]
    sequences: list[BeamSearchSequence]
    """Up to beam_width hypotheses, best score first."""


def beam_score(cum_logprob: float, num_tokens: int, length_penalty: float) -> float:
    return cum_logprob / (max(num_tokens, 1) ** length_penalty)


@dataclass
class _Beam:
    tokens: list[int]
    cum_logprob: float = 0.0


@dataclass
class _Group:
    prompt: list[int]
    live: list[_Beam]
    completed: list[BeamSearchSequence] = field(default_factory=list)


@dataclass(frozen=True)
class _Candidate:
    cum_logprob: float
    beam: int
    """Index of the parent beam in its group's live list."""
    token: int


class BeamSearchRunner:
    """Runs beam search for a list of prompts on an idle engine, as ordinary requests."""

    def __init__(self, llm: LLM, params: BeamSearchParams, cache_salt: str | None = None) -> None:
        self.llm = llm
        self.engine = llm.engine
        self.params = params
        self.cache_salt = cache_salt
        self.eos = self.engine.eos_token_id
        num_logprobs = min(2 * params.beam_width, self.engine.arch.vocab_size)
        self.sampling = SamplingParams(temperature=0.0, logprobs=num_logprobs, ignore_eos=True, max_tokens=1)

    def run(self, prompts: list[list[int]]) -> list[BeamSearchOutput]:
        p = self.params
        for ids in prompts:
            if not ids:
                raise ValueError("prompt is empty: at least one token is required")
            if len(ids) + p.max_tokens > self.engine.max_model_len:
                raise ValueError(
                    f"prompt ({len(ids)} tokens) + max_tokens ({p.max_tokens}) exceeds "
                    f"max_model_len ({self.engine.max_model_len})"
                )
        groups = [_Group(list(ids), [_Beam([])]) for ids in prompts]
        while any(g.live for g in groups):
            live = [g for g in groups if g.live]
            reported = self._round([g.prompt + b.tokens for g in live for b in g.live])
            for g in live:
                n = len(g.live)
                self._select(g, reported[:n])
                reported = reported[n:]
        tok = self.engine.tokenizer
        out = []
        for g in groups:
            seqs = sorted(g.completed, key=lambda s: -s.score)[: p.beam_width]
            if tok is not None:
                for s in seqs:
                    s.text = tok.decode(s.tokens)
            out.append(BeamSearchOutput(g.prompt, seqs))
        return out

    def _round(self, prompts: list[list[int]]) -> list[dict[int, float]]:
        """One greedy token for each prompt (LLM.generate: ordinary requests); per prompt its next-token
        logprobs (token id -> logprob: the sampled token and the top 2W), in order."""
        outs = self.llm.generate(
            [{"prompt_token_ids": p} for p in prompts], self.sampling, use_tqdm=False, cache_salt=self.cache_salt
        )
        reported = []
        for out in outs:
            lps = out.outputs[0].logprobs
            assert lps, f"{out.request_id} finished without logprobs"
            reported.append({t: lp.logprob for t, lp in lps[0].items()})
        return reported

    def _select(self, g: _Group, reported: list[dict[int, float]]) -> None:
        p = self.params
        W = p.beam_width
        cands = [_Candidate(b.cum_logprob + lp, i, t) for i, b in enumerate(g.live) for t, lp in reported[i].items()]
        cands.sort(key=lambda c: (-c.cum_logprob, c.beam, c.token))
        survivors: list[_Candidate] = []
        for rank, c in enumerate(cands):
            if c.token == self.eos and not p.ignore_eos:
                if rank < W:
                    self._complete(g, c, "stop")
                continue
            survivors.append(c)
            if len(survivors) == W:
                break
        if len(g.live[0].tokens) + 1 >= p.max_tokens:  # last round: every survivor is a finished hypothesis
            for c in survivors:
                self._complete(g, c, "length")
            survivors = []
        g.live = [_Beam(g.live[c.beam].tokens + [c.token], c.cum_logprob) for c in survivors]

    def _complete(self, g: _Group, c: _Candidate, finish_reason: str) -> None:
        toks = g.live[c.beam].tokens + [c.token]
        score = beam_score(c.cum_logprob, len(toks), self.params.length_penalty)
        g.completed.append(BeamSearchSequence(toks, c.cum_logprob, score, finish_reason))
