"""Adaptive γ from the cost model, with measured acceptance α and draft cost c.

With per-token acceptance α (i.i.d. model), a draft of γ tokens yields on average

    E[T] = (1 - α^(γ+1)) / (1 - α)          tokens per target pass (γ + 1 when α = 1).

One speculative step costs a target pass over 1 + γ tokens per request plus γ draft steps. At
batch B, with T(n) the target's time for a step of n tokens and c = (draft step time) / T(B):

    speedup(γ) = E[T] / (T(B (1 + γ)) / T(B) + γ c)

When the target is memory-bound (T flat in n, single stream) this is the seeds' E[T] / (γ c + 1);
at large batch the verification tokens are no longer free and the ratio T(B(1+γ)) / T(B)
grows, which is what lowers γ or switches speculation off. T(n) is the running mean of the
decode/verification steps measured at exactly n tokens where there are some, else a + b n fitted
by least squares through those per-count means (one point per count; with a single count, the
slope of a calibration prior). The step time is not linear in n on CPU: up to 8 tokens the
few-row kernels keep a step near one token's cost, above 8 oneDNN and the Python layer loop take
over. Fitting the raw recent steps instead let 60 plain steps at n = 8 outvote one probe at
n = 13, kept the prior's shallow slope, and priced batch-8 verification too low (0.77x measured). α and c are
exponentially weighted running estimates. Speculation stays off unless the predicted gain is at least 5 %; while
off, a γ = 1 probe re-measures α after 16 steps, then 32, 64, ... (up to 256) while probes keep failing.

A probe drafts for at most `probe_rows` requests of the batch (the caller picks which, in turn): α is a property
of the proposer and the text, not of the batch, and a probe of the whole batch at batch 32 costs a verification
of 64 rows and a draft pass over 32 requests, about one step lost each time, for an estimate four rows give as
well. Its draft time does not join c (`observe_draft`): c stays what drafting for every request costs. Until one
such pass has been timed, a probe's own c stands in for it: a pass over part of the batch costs no more than one
over all of it, so it is a floor. (Before, c was 0 until then; a drafter good enough to pass the gain test with a
free draft switched itself on at batch 8 and ran there at 0.66x before c was measured and switched it off.)
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch


def expected_tokens(alpha: float, gamma: int) -> float:
    """E[T] = (1 - α^(γ+1)) / (1 - α): tokens emitted per verification of a γ-token draft."""
    if alpha >= 1.0:
        return float(gamma + 1)
    return (1.0 - alpha ** (gamma + 1)) / (1.0 - alpha)


def predicted_speedup(
    alpha: float, gamma: int, c: float, verify_cost_ratio: float = 1.0, one_pass: bool = False
) -> float:
    """E[T] / (verify_cost_ratio + γ c); verify_cost_ratio = T(B (1 + γ)) / T(B), 1 when the
    target is memory-bound, which gives the seeds' E[T] / (γ c + 1). one_pass: the proposer drafts any γ in one
    pass (a block drafter), so the draft costs c, not γ c."""
    if gamma == 0:
        return 1.0
    return expected_tokens(alpha, gamma) / (verify_cost_ratio + (c if one_pass else gamma * c))


def best_gamma(
    alpha: float,
    c: float,
    gamma_max: int,
    verify_cost_ratio=lambda g: 1.0,
    min_gain: float = 1.02,
    one_pass: bool = False,
) -> int:
    """argmax over γ in 1..gamma_max of the predicted speedup; 0 (off) unless it beats min_gain."""
    best, best_s = 0, min_gain
    for g in range(1, gamma_max + 1):
        s = predicted_speedup(alpha, g, c, verify_cost_ratio(g), one_pass)
        if s > best_s:
            best, best_s = g, s
    return best


@dataclass
class LinearCost:
    """T(n) = a + b n seconds."""

    a: float
    b: float

    def __call__(self, n: float) -> float:
        return self.a + self.b * n


def fit_linear_cost(samples: list[tuple[int, float]], prior: LinearCost) -> LinearCost:
    """Least squares over (num_tokens, seconds); slope from the prior when n does not vary."""
    if not samples:
        return prior
    ns = torch.tensor([s[0] for s in samples], dtype=torch.float64)
    ts = torch.tensor([s[1] for s in samples], dtype=torch.float64)
    if len(ns) < 2 or float(ns.std(unbiased=False)) < 1.0:
        b = prior.b
        return LinearCost(max(float((ts - b * ns).median()), 1e-6), b)
    nm, tm = ns.mean(), ts.mean()
    b = float(((ns - nm) * (ts - tm)).sum() / ((ns - nm) ** 2).sum())
    b = max(b, 0.0)
    a = max(float(tm - b * nm), 1e-6)
    return LinearCost(a, b)


class AdaptiveGamma:
    """Chooses γ each step. Pinned (adaptive=False) it always answers gamma_max."""

    def __init__(
        self,
        gamma_max: int,
        adaptive: bool = True,
        alpha_prior: float = 0.6,
        prior_weight: float = 4.0,
        decay: float = 0.97,
        probe_interval: int = 16,
        min_gain: float = 1.05,
        tree_nodes: int | None = None,
        one_pass: bool = False,
        probe_rows: int = 4,
    ) -> None:
        self.gamma_max = gamma_max
        self.probe_rows = probe_rows
        """Requests a probe drafts for, at most."""
        self.probing = False
        """The last `choose` answered a probe: the caller drafts for `probe_rows` requests only (`probe_budgets`)."""
        self.next_probe = 0
        """Where in the batch the next probe's requests start (each probe takes the ones after the last's)."""
        self.num_probe_rows = 0
        """Requests that drafted in probes (tests and benchmarks read it)."""
        self.one_pass = one_pass
        """The proposer drafts any γ in one pass (a block drafter): c is its cost per call, not per draft token."""
        self.tree_nodes = tree_nodes
        """Token trees: γ is a depth, and a draft of depth γ gets `num_draft_tokens(γ)` nodes, up to this many
        (the verification cost is priced at that node count; α is the per-depth acceptance the trees show)."""
        self.adaptive = adaptive
        self.alpha_prior = alpha_prior
        self.prior_weight = prior_weight
        self.decay = decay
        self.probe_interval = probe_interval
        self._interval = probe_interval
        self.min_gain = min_gain
        """Predicted speedup γ > 0 must reach; margin for the model's error (off below it)."""
        self._by_n: dict[int, float] = {}
        """Exponentially weighted step seconds per exact token count."""
        self.prior_cost = LinearCost(1e-2, 0.0)
        self._acc = 0.0
        self._judged = 0.0
        self._c: float | None = None
        self._c_floor: float | None = None
        """c of the latest probe (a pass over part of the batch): c until a pass over the whole batch is timed."""
        self._steps_off = 0
        self.gamma = gamma_max
        self._cost: LinearCost | None = None

    # ------------------------------------------------------------- measurements
    def calibrate(self, forward, sizes: tuple[int, ...] = (1, 16, 64), repeats: int = 3) -> None:
        """Prior for T(n) from timing forward(n) (a dense target pass over n tokens)."""
        pts = []
        for n in sizes:
            forward(n)  # warm-up
            best = min(_timed(forward, n) for _ in range(repeats))
            pts.append((n, best))
        self.prior_cost = fit_linear_cost(pts, LinearCost(pts[0][1], 0.0))
        self._cost = None

    def observe_acceptance(self, num_judged: int, num_accepted: int) -> None:
        self._acc = self.decay * self._acc + num_accepted
        self._judged = self.decay * self._judged + num_judged

    def observe_target_step(self, num_tokens: int, seconds: float) -> None:
        if num_tokens > 0:
            prev = self._by_n.get(num_tokens)
            self._by_n[num_tokens] = seconds if prev is None else 0.8 * prev + 0.2 * seconds
            self._cost = None

    def observe_draft(
        self, num_draft_steps: int, batch_size: int, seconds: float, num_drafted: int | None = None
    ) -> None:
        """seconds spent proposing num_draft_steps tokens per request for num_drafted of batch_size requests (all
        when None). A probe's pass over part of the batch is left out: c is what drafting for all of it costs, and
        a pass's fixed costs (the drafter's layers at any row count) make the part no measure of the whole; it is
        kept as c's floor until a whole pass is timed."""
        if num_draft_steps <= 0 or batch_size <= 0:
            return
        per = seconds if self.one_pass else seconds / num_draft_steps
        c = per / max(self.cost(batch_size), 1e-9)
        if num_drafted is not None and num_drafted < batch_size:
            self._c_floor = c
            return
        self._c = c if self._c is None else 0.8 * self._c + 0.2 * c

    # ---------------------------------------------------------------- estimates
    @property
    def alpha(self) -> float:
        return (self._acc + self.alpha_prior * self.prior_weight) / (self._judged + self.prior_weight)

    @property
    def c(self) -> float:
        if self._c is not None:
            return self._c
        return 0.0 if self._c_floor is None else self._c_floor

    def cost(self, num_tokens: int) -> float:
        measured = self._by_n.get(num_tokens)
        if measured is not None:
            return measured
        if self._cost is None:
            # One point per measured token count (its running mean), so a count the controller
            # has only probed a few times weighs as much as the plain steps it takes every time.
            self._cost = fit_linear_cost(sorted(self._by_n.items()), self.prior_cost)
        return self._cost(num_tokens)

    def verify_cost_ratio(self, batch_size: int, gamma: int) -> float:
        return self.cost(batch_size * (1 + self.num_draft_tokens(gamma))) / max(self.cost(batch_size), 1e-9)

    def num_draft_tokens(self, gamma: int) -> int:
        """Draft tokens per request for depth γ: γ for chains; for trees the node budget scaled by γ / γ_max
        (the full tree at full depth), never fewer than γ."""
        if self.tree_nodes is None or gamma == 0:
            return gamma
        return max(gamma, round(self.tree_nodes * gamma / self.gamma_max))

    # ------------------------------------------------------------------- choice
    def choose(self, batch_size: int) -> int:
        self.probing = False
        if not self.adaptive or batch_size == 0:
            self.gamma = self.gamma_max
            return self.gamma
        g = best_gamma(
            self.alpha,
            self.c,
            self.gamma_max,
            lambda g: self.verify_cost_ratio(batch_size, g),
            self.min_gain,
            self.one_pass,
        )
        if g == 0:
            self._steps_off += 1
            if self._steps_off >= self._interval:  # re-measure α now and then, less often each time
                self._steps_off = 0
                self._interval = min(2 * self._interval, 16 * self.probe_interval)
                g = 1
                self.probing = True
        else:
            self._steps_off = 0
            self._interval = self.probe_interval
        self.gamma = g
        return g

    def probe_budgets(self, ks: list[int]) -> list[int]:
        """A probe's draft budgets: ks kept for `probe_rows` of the requests that may draft (ks[i] > 0), taken in
        turn from where the last probe stopped, 0 for the others.

            ks [1, 1, 0, 1, 1, 1], probe_rows 2:
            [1, 1, 0, 0, 0, 0]  then  [0, 0, 0, 1, 1, 0]  then  [1, 0, 0, 0, 0, 1]
        """
        eligible = [i for i, k in enumerate(ks) if k]
        if len(eligible) <= self.probe_rows:
            self.num_probe_rows += len(eligible)
            return ks
        first = self.next_probe % len(eligible)
        chosen = set((eligible[first:] + eligible[:first])[: self.probe_rows])
        self.next_probe = first + self.probe_rows
        self.num_probe_rows += self.probe_rows
        return [k if i in chosen else 0 for i, k in enumerate(ks)]

    def as_dict(self) -> dict[str, float]:
        return {"gamma": self.gamma, "alpha_estimate": self.alpha, "draft_cost_ratio": self.c}


def _timed(forward, n: int) -> float:
    t0 = time.perf_counter()
    forward(n)
    return time.perf_counter() - t0
