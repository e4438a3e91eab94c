"""Beam search on the engine's copy-on-write block sharing.

Each live beam is one of the engine's raw sequences (`EngineCore.add_sequence` and its siblings:
token-level control, no text, no outputs). A round:

  1. every live beam computes its newest token and reports the top-2W next-token logprobs
     (greedy sampling with logprobs = 2W; W = beam_width);
  2. the sampled token is taken back off the beam ("held": num_computed_tokens == num_tokens,
     so the scheduler has nothing to run for it) until every live beam of the prompt has
     reported; a held beam that gets preempted simply reports again later;
  3. candidates (beam, token, cumulative logprob) are ranked; the best W that are not EOS stay
     alive; an EOS among the top W ranks completes a hypothesis;
  4. a parent's first surviving candidate continues in place (its held token is replaced: its
     K/V was never written); further candidates fork the parent (`EngineCore.fork_sequence`:
     block table by reference, the partly filled last block copied on first write); parents
     without survivors are freed.

    round r:   A [p p p a1 | a2 .]      B [p p p b1 | b2 .]        (| = block boundary)
    survivors: A+x, A+y, B+z      ->    A  [p p p a1 | a2 x]  in place
                                        A' [p p p a1 | a2 y]  fork: block 0 shared, block 1 copied
                                        B  [p p p b1 | b2 z]  in place

Scores: cumulative logprob / (generated tokens ** length_penalty), as in Hugging Face; beams run
until max_tokens or until no beam is alive.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from tokenmill.sampling_params import SamplingParams

if TYPE_CHECKING:
    from tokenmill.engine.core import EngineCore


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
    seq_id: str
    tokens: list[int]
    cum_logprob: float = 0.0
    pending: dict[int, float] | None = None
    """Next-token logprobs reported this round (top 2W), or None while computing."""


@dataclass
class _Group:
    prompt: list[int]
    live: list[_Beam]
    completed: list[BeamSearchSequence] = field(default_factory=list)

    @property
    def is_done(self) -> bool:
        return not self.live


class BeamSearchRunner:
    """Drives beams through the engine's raw-sequence API; beams are not engine-level (detokenized) requests."""

    def __init__(self, engine: EngineCore, params: BeamSearchParams, cache_salt: str | None = None) -> None:
        self.engine = engine
        self.params = params
        self.cache_salt = cache_salt
        self.eos = engine.eos_token_id
        num_logprobs = min(2 * params.beam_width, engine.arch.vocab_size)
        self.sampling = SamplingParams(
            temperature=0.0, logprobs=num_logprobs, ignore_eos=True, max_tokens=params.max_tokens + 1
        )
        self._ids = itertools.count()

    def run(self, prompts: list[list[int]]) -> list[BeamSearchOutput]:
        p = self.params
        max_seqs = self.engine.config.scheduler.max_num_seqs
        if p.beam_width > max_seqs:
            raise ValueError(f"beam_width ({p.beam_width}) exceeds max_num_seqs ({max_seqs})")
        for ids in prompts:
            if not ids:
                raise ValueError("prompt is empty: at least one token is required")
            if any(not isinstance(t, int) or not 0 <= t < self.engine.arch.vocab_size for t in ids):
                raise ValueError(f"prompt token ids must be integers in [0, {self.engine.arch.vocab_size})")
            if len(ids) + p.max_tokens > self.engine.max_model_len:
                raise ValueError(
                    f"prompt ({len(ids)} tokens) + max_tokens ({p.max_tokens}) exceeds "
                    f"max_model_len ({self.engine.max_model_len})"
                )
        groups_per_wave = max(1, max_seqs // p.beam_width)
        outputs: list[BeamSearchOutput] = []
        for start in range(0, len(prompts), groups_per_wave):
            outputs.extend(self._run_wave(prompts[start : start + groups_per_wave]))
        return outputs

    # ----------------------------------------------------------------------------------------
    def _new_id(self) -> str:
        return f"beam-{next(self._ids)}"

    def _run_wave(self, prompts: list[list[int]]) -> list[BeamSearchOutput]:
        groups = []
        for ids in prompts:
            sid = self._new_id()
            self.engine.add_sequence(sid, list(ids), self.sampling, cache_salt=self.cache_salt)
            groups.append(_Group(list(ids), [_Beam(sid, [])]))
        try:
            while not all(g.is_done for g in groups):
                self.engine.step()
                for g in groups:
                    if g.is_done:
                        continue
                    for b in g.live:
                        self._collect(b)
                    if all(b.pending is not None for b in g.live):
                        self._select(g)
        except BaseException:
            for g in groups:
                for b in g.live:
                    self.engine.finish_sequence(b.seq_id, aborted=True)
            raise
        tok = self.engine.tokenizer
        out = []
        for g in groups:
            seqs = sorted(g.completed, key=lambda s: -s.score)[: self.params.beam_width]
            if tok is not None:
                for s in seqs:
                    s.text = tok.decode(s.tokens)
            out.append(BeamSearchOutput(g.prompt, seqs))
        return out

    def _collect(self, b: _Beam) -> None:
        """Take a freshly sampled token back off the beam and keep its logprobs (see 2. above)."""
        n = self.engine.num_sequence_tokens(b.seq_id)
        if n <= len(b.tokens):
            return
        assert n == len(b.tokens) + 1, b
        b.pending = self.engine.take_sampled(b.seq_id)

    def _select(self, g: _Group) -> None:
        p = self.params
        W = p.beam_width
        cands: list[tuple[float, int, int]] = []
        for i, b in enumerate(g.live):
            assert b.pending is not None  # run() selects once every live beam has sampled
            cands.extend((b.cum_logprob + lp, i, t) for t, lp in b.pending.items())
        cands.sort(key=lambda c: (-c[0], c[1], c[2]))
        survivors: list[tuple[float, int, int]] = []
        for rank, (cum, i, t) in enumerate(cands):
            if t == self.eos and not p.ignore_eos:
                if rank < W:
                    toks = g.live[i].tokens + [t]
                    g.completed.append(
                        BeamSearchSequence(toks, cum, beam_score(cum, len(toks), p.length_penalty), "stop")
                    )
                continue
            survivors.append((cum, i, t))
            if len(survivors) == W:
                break
        num_generated = len(g.live[0].tokens) + 1
        if num_generated >= p.max_tokens:  # last round: every survivor is a finished hypothesis
            for cum, i, t in survivors:
                toks = g.live[i].tokens + [t]
                g.completed.append(
                    BeamSearchSequence(toks, cum, beam_score(cum, len(toks), p.length_penalty), "length")
                )
            survivors = []
        parents = {i for _, i, _ in survivors}
        for i, b in enumerate(g.live):  # free the dead first: their blocks may serve the forks
            if i not in parents:
                self.engine.finish_sequence(b.seq_id)
        new_live: list[_Beam] = []
        appends: list[tuple[_Beam, int]] = []
        continued: set[int] = set()
        for cum, i, t in survivors:
            parent = g.live[i]
            if i not in continued:
                continued.add(i)
                beam = parent
            else:
                child = self._new_id()
                self.engine.fork_sequence(parent.seq_id, child)
                beam = _Beam(child, list(parent.tokens))
            beam.cum_logprob = cum
            beam.pending = None
            appends.append((beam, t))
            new_live.append(beam)
        for beam, t in appends:  # after all forks: they share the parent's committed tokens only
            self.engine.extend_sequence(beam.seq_id, t)
            beam.tokens.append(t)
        g.live = new_live
