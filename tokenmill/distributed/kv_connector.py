"""Prefill/decode disaggregation: the scheduler half of the KV connector, and the plain data both halves share.

A prefill worker computes a prompt and keeps its K/V blocks for a decode worker, which pulls the blocks it does
not already hold and continues the request under the one scheduling rule. Torch-free: this module is what the
scheduler sees; the worker half that moves tensors is `distributed/kv_transfer.py`.

    router            prefill worker (role prefill)                 decode worker (role decode)
    ------            -----------------------------                 ---------------------------
    request, max_tokens=1, HoldForDecode ->
                      prompt computed, 1 token sampled (discarded);
                      finished: blocks held under the request id
                      <- kv_transfer_params {host, port, transfer_id, num_tokens}
    request + PullFromPrefill(those params) ------------------------------------------------->
                                                                    admission: local prefix hit h tokens;
                                                                    blocks for the prompt; the request waits
                                                                    (WAITING_FOR_REMOTE_KV) while blocks
                                                                    [h / bs, ceil((n - 1) / bs)) are pulled
                      <------------------- pull(transfer_id, first_block, num_blocks) ----
                      gather those blocks (all layers, K and V,
                      int8 scales included) ---------- one tensor ---------------------->  scatter into its blocks
                      release the held blocks                       num_computed = n - 1: the next step
                                                                    computes the last prompt token and samples

The decode side recomputes the last prompt token itself (as a prefix-cache hit never serves it), so its first
token comes from its own logits and its own generator: greedy and seeded outputs equal a colocated engine's.
If a pull fails (the prefill worker died, the transfer timed out, the blocks were released), the request keeps
its local prefix hit and computes the rest of its prompt where it is: it is recomputed, never lost.

A whole request is one transfer, not one per layer: the pull starts after the prefill finished, so there is no
compute left to overlap a layer-wise stream with (docs/disaggregation.md).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import NamedTuple


@dataclass(frozen=True)
class HoldForDecode:
    """A prefill worker's request: when it finishes, keep its prompt's K/V for a decode worker to pull."""


@dataclass(frozen=True)
class PullFromPrefill:
    """A decode worker's request whose prompt K/V a prefill worker holds (its kv_transfer_params)."""

    host: str
    port: int
    """The prefill worker's KV endpoint (its TCP store)."""
    transfer_id: str
    """What the prefill worker holds the blocks under (its request id)."""
    num_tokens: int
    """Prompt tokens whose K/V are held; must equal this request's prompt length."""

    def to_params(self) -> dict:
        return {
            "remote_host": self.host,
            "remote_port": self.port,
            "transfer_id": self.transfer_id,
            "num_tokens": self.num_tokens,
        }

    @classmethod
    def from_params(cls, params: dict) -> PullFromPrefill:
        """From the `kv_transfer_params` a prefill worker returned; ValueError names a missing or bad field."""
        try:
            host, port, tid, n = (
                params["remote_host"],
                params["remote_port"],
                params["transfer_id"],
                params["num_tokens"],
            )
        except (KeyError, TypeError) as e:
            raise ValueError(
                f"kv_transfer_params needs remote_host, remote_port, transfer_id and num_tokens (missing {e})"
            ) from None
        if (
            not isinstance(host, str)
            or not isinstance(tid, str)
            or not isinstance(port, int)
            or not isinstance(n, int)
            or n < 1
            or not 0 < port < 65536
        ):
            raise ValueError(
                "kv_transfer_params: remote_host and transfer_id must be strings, remote_port a port "
                "number, num_tokens a positive integer"
            )
        return cls(host, port, tid, n)


KVTransferRequest = HoldForDecode | PullFromPrefill


class LoadPlan(NamedTuple):
    first_block: int
    num_blocks: int


@dataclass(frozen=True)
class KVLoad:
    """Decode side: pull `len(block_ids)` blocks, starting at the request's block `first_block`, into these blocks."""

    request_id: str
    source: PullFromPrefill
    first_block: int
    block_ids: list[int]


@dataclass(frozen=True)
class KVHold:
    """Prefill side: serve pulls of `transfer_id` from these blocks (the request's table, in order)."""

    transfer_id: str
    block_ids: list[int]
    deadline: float
    """time.monotonic() after which a pull is refused, even before the scheduler's next step releases the hold."""


@dataclass(frozen=True)
class ConnectorStep:
    """What the scheduler half tells the worker half before a step."""

    loads: list[KVLoad] = field(default_factory=list)
    holds: list[KVHold] = field(default_factory=list)
    releases: list[str] = field(default_factory=list)
    """Transfers whose blocks went back to the pool (pulled, expired): a later pull of them is refused."""
    cancelled: list[str] = field(default_factory=list)
    """Decode side: requests that left while loading; their data is dropped when it arrives."""

    @property
    def is_empty(self) -> bool:
        return not (self.loads or self.holds or self.releases or self.cancelled)


@dataclass
class ConnectorEvents:
    """What the worker half reports back: loads that ended (request id -> ok) and transfers served."""

    loads_done: dict[str, bool] = field(default_factory=dict)
    sends_done: list[str] = field(default_factory=list)
    """Transfers whose blocks were sent, or whose send failed: either way the hold is over."""


@dataclass
class ConnectorStats:
    """Counters for /metrics (tokenmill:kv_transfer_*)."""

    num_loads: int = 0
    """Pulls started (decode side)."""
    num_loads_failed: int = 0
    """Pulls that failed: the request recomputed its prompt locally."""
    num_blocks_loaded: int = 0
    num_blocks_skipped: int = 0
    """Prompt blocks a decode worker did not pull because its prefix cache held them."""
    num_holds: int = 0
    num_holds_expired: int = 0
    """Held transfers nobody pulled in time (their blocks went back to the pool)."""
    num_sends: int = 0
    num_blocks_sent: int = 0
    bytes_sent: int = 0
    bytes_loaded: int = 0
    load_seconds: float = 0.0
    """Sum over finished pulls of the time from the pull to the blocks in place."""
    send_seconds: float = 0.0


class KVConnectorScheduler:
    """The scheduler's side: which blocks a request must pull, which finished requests' blocks are held and until
    when. The scheduler calls it; it never touches tensors."""

    def __init__(self, role: str, hold_timeout_s: float) -> None:
        if role not in ("prefill", "decode", "both"):
            raise ValueError(f"kv_role must be prefill, decode or both, got {role!r}")
        self.role = role
        self.hold_timeout_s = hold_timeout_s
        self.held: dict[str, float] = {}
        """Transfer id -> deadline (time.monotonic()) of blocks held for a decode worker."""
        self.pending = ConnectorStep()
        self.stats = ConnectorStats()

    @property
    def has_pending_work(self) -> bool:
        """Held blocks still wait for a pull (the engine keeps stepping to serve it)."""
        return bool(self.held) or not self.pending.is_empty

    def plan_load(
        self, source: PullFromPrefill, num_prompt_tokens: int, num_cached_tokens: int, block_size: int
    ) -> LoadPlan:
        """Blocks to pull for a prompt of `num_prompt_tokens` whose first `num_cached_tokens` (block-aligned) hit
        the local prefix cache. The last prompt token is left to compute.

            block_size 4, prompt 11 tokens, 4 cached: tokens 4..9 are pulled -> blocks 1..2, LoadPlan(1, 2)
            block_size 4, prompt 9 tokens, 8 cached: nothing to pull (token 8 is computed) -> LoadPlan(2, 0)
        """
        if source.num_tokens != num_prompt_tokens:
            raise ValueError(
                f"kv_transfer_params: {source.num_tokens} tokens held, but the prompt has {num_prompt_tokens}"
            )
        first = num_cached_tokens // block_size
        end = -(-(num_prompt_tokens - 1) // block_size)
        return LoadPlan(first, max(0, end - first))

    def add_load(self, load: KVLoad, num_skipped_blocks: int) -> None:
        self.pending.loads.append(load)
        self.stats.num_loads += 1
        self.stats.num_blocks_skipped += num_skipped_blocks

    def add_hold(self, transfer_id: str, block_ids: list[int]) -> None:
        deadline = time.monotonic() + self.hold_timeout_s
        self.held[transfer_id] = deadline
        self.pending.holds.append(KVHold(transfer_id, block_ids, deadline))
        self.stats.num_holds += 1

    def cancel_load(self, request_id: str) -> None:
        self.pending.cancelled.append(request_id)

    def expired(self, now: float | None = None) -> list[str]:
        """Held transfers past their deadline; they are released (and the worker half told) by `release`."""
        now = time.monotonic() if now is None else now
        return [t for t, deadline in self.held.items() if deadline <= now]

    def release(self, transfer_id: str, expired: bool = False) -> None:
        if self.held.pop(transfer_id, None) is not None:
            self.pending.releases.append(transfer_id)
            self.stats.num_holds_expired += expired

    def take_step(self) -> ConnectorStep:
        out, self.pending = self.pending, ConnectorStep()
        return out
