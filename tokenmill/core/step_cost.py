"""A step-time model the scheduler sizes prompt chunks with (SchedulerConfig.target_step_ms). Torch-free.

Each engine step reports its decode tokens d, its prefill tokens p and the attention work k (keys read, summed over
the step's tokens, in thousands), and how long it took:

    t = a + b * d + c * p + e * k          (seconds; least squares over the last `window` steps)

A step's decode tokens are one per request plus its drafts; its prefill tokens are the rest of a prompt chunk. The
attention term matters for long prompts: token i of a chunk starting at position s reads s + i + 1 keys, so the
last chunks of a 2,000-token prompt cost more per token than the first. Given the decodes that will run and where
the next chunk starts, the chunk that keeps a step under the target is the largest p with

    a + b d + e k_decodes + (c + e s / 1000) p + (e / 2000) p^2  <=  target

Worked example: a = 8 ms, b = 1 ms, c = 0.5 ms, e = 0, 16 decodes, target 40 ms -> (40 - 8 - 16) / 0.5 = 32.
"""

from __future__ import annotations

import math
from collections import Counter, deque
from dataclasses import dataclass


@dataclass(frozen=True)
class StepCost:
    a: float
    """Seconds per step, whatever it computes."""
    b: float
    """Seconds per decode token."""
    c: float
    """Seconds per prefill token."""
    e: float = 0.0
    """Seconds per thousand keys read by attention."""

    def predict(self, num_decode_tokens: int, num_prefill_tokens: int, kilo_keys: float = 0.0) -> float:
        return self.a + self.b * num_decode_tokens + self.c * num_prefill_tokens + self.e * kilo_keys

    def decode_room(self, num_decode_tokens: int, target_s: float, decode_kilo_keys: float = 0.0) -> float:
        """Seconds of a target_s step left for prompt chunks once these decodes are in it (negative: none)."""
        return target_s - self.a - self.b * num_decode_tokens - self.e * decode_kilo_keys

    def chunk_cost(self, start: int, n: int) -> float:
        """Seconds that n prompt tokens from position start add to a step: c n + e (the keys they read)."""
        return self.c * n + self.e * chunk_kilo_keys(start, n)

    def chunk_tokens(self, room_s: float, start: int) -> int:
        """The most prompt tokens from position start whose chunk_cost fits in room_s (0 if none): the root of
        (c + e start / 1000) n + (e / 2000) n^2 = room_s, the keys' n / 2 term left out."""
        if room_s <= 0:
            return 0
        lin = self.c + self.e * start / 1000.0
        quad = max(self.e, 0.0) / 2000.0
        if quad > 0:
            p = (-lin + math.sqrt(lin * lin + 4 * quad * room_s)) / (2 * quad)
        elif lin > 0:
            p = room_s / lin
        else:
            return 0
        return max(0, int(p))

    def prefill_budget(
        self, num_decode_tokens: int, target_s: float, decode_kilo_keys: float = 0.0, chunk_start: int = 0
    ) -> int:
        """Prefill tokens that fit in a step of target_s next to these decodes, for a chunk starting at
        chunk_start (0 if none fit)."""
        return self.chunk_tokens(self.decode_room(num_decode_tokens, target_s, decode_kilo_keys), chunk_start)


def chunk_kilo_keys(start: int, n: int) -> float:
    """Keys read by the tokens start .. start + n - 1 of a request (token i reads i + 1 keys), in thousands."""
    return (n * start + n * (n + 1) / 2) / 1000.0


def _solve(m: list[list[float]], v: list[float]) -> list[float] | None:
    """Gaussian elimination with partial pivoting; None if singular."""
    n = len(v)
    a = [row[:] + [x] for row, x in zip(m, v)]
    for i in range(n):
        p = max(range(i, n), key=lambda r: abs(a[r][i]))
        if abs(a[p][i]) < 1e-12:
            return None
        a[i], a[p] = a[p], a[i]
        for r in range(n):
            if r != i:
                f = a[r][i] / a[i][i]
                a[r] = [x - f * y for x, y in zip(a[r], a[i])]
    return [a[i][n] / a[i][i] for i in range(n)]


RIDGE = 1e-3
"""Ridge weight on the (centred) decode and attention slopes, per sample."""


class StepCostModel:
    """The fit of `t = a + b d + c p + e k` over recent steps; `cost` is None until a few steps with prompt
    chunks of different sizes have been seen.

    The window's sums of products (x x^T and x t for x = (1, d, p, k)) are kept up to date as steps enter and
    leave it, so observing a step and refitting cost O(1), not a pass over the window: the model runs on every
    engine step of a server."""

    MIN_SAMPLES = 8

    def __init__(self, window: int = 256) -> None:
        self.window = window
        self.samples: deque[tuple[float, float, float, float]] = deque()
        self.cost: StepCost | None = None
        self._since_fit = 0
        self._xx = [[0.0] * 4 for _ in range(4)]
        self._xt = [0.0] * 4
        self._prefill_sizes: Counter[float] = Counter()

    def _add(self, sample: tuple[float, float, float, float], sign: float) -> None:
        d, p, k, t = sample
        x = (1.0, d, p, k)
        for i in range(4):
            self._xt[i] += sign * x[i] * t
            row = self._xx[i]
            for j in range(4):
                row[j] += sign * x[i] * x[j]
        self._prefill_sizes[p] += int(sign)
        if not self._prefill_sizes[p]:
            del self._prefill_sizes[p]

    def observe(self, num_decode_tokens: int, num_prefill_tokens: int, seconds: float, kilo_keys: float = 0.0) -> None:
        if num_decode_tokens + num_prefill_tokens == 0:
            return
        sample = (float(num_decode_tokens), float(num_prefill_tokens), kilo_keys, seconds)
        self.samples.append(sample)
        self._add(sample, 1.0)
        if len(self.samples) > self.window:
            self._add(self.samples.popleft(), -1.0)
        self._since_fit += 1
        if self._since_fit >= 4 or self.cost is None:  # refit every few steps: tracks a drifting host
            self._since_fit = 0
            self.cost = self.fit()

    def fit(self) -> StepCost | None:
        n = len(self.samples)
        sizes = self._prefill_sizes
        if n < self.MIN_SAMPLES or n - sizes.get(0.0, 0) < 3 or len(sizes) < 2:
            return None
        # NOTE: d and k are centred and their slopes get a small ridge. A busy server decodes about the same batch
        # every step, so d hardly varies; centred, the intercept is the time at the usual batch whatever the
        # slope, and the ridge keeps an unidentified slope near 0 instead of swinging on noise. Nothing is
        # clamped: a clamp would break the combination the data do determine.
        # Centring from the raw sums: sum((d - dm) y) = sum(d y) - dm sum(y), and so on.
        S, St = self._xx, self._xt
        dm, km = S[0][1] / n, S[0][3] / n
        shift = (0.0, dm, 0.0, km)
        xtx = [
            [S[i][j] - shift[i] * S[0][j] - shift[j] * S[0][i] + shift[i] * shift[j] * n for j in range(4)]
            for i in range(4)
        ]
        xtt = [St[i] - shift[i] * St[0] for i in range(4)]
        xtx[1][1] += RIDGE * n
        xtx[3][3] += RIDGE * n
        w = _solve(xtx, xtt)
        if w is None or w[2] + max(w[3], 0.0) <= 0:
            return None
        return StepCost(w[0] - w[1] * dm - w[3] * km, w[1], w[2], w[3])
