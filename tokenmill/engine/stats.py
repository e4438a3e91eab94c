"""What the engine reports about itself: counters (EngineStats, read by /metrics and the log line) and the
dashboard's snapshot types. Plain data; the engine core fills them between two steps."""

from __future__ import annotations

from dataclasses import dataclass, field

from tokenmill.core.kv_cache_manager import BlockMap
from tokenmill.core.scheduler import TokenSplit


@dataclass
class EngineStats:
    num_running: int
    num_waiting: int
    kv_cache_usage: float
    """Fraction of blocks referenced by requests (cached-but-free blocks count as free)."""
    num_blocks_total: int
    num_blocks_free: int
    """Allocatable blocks (never used, evicted, or cached but unreferenced); used + free = total."""
    num_blocks_cached_free: int
    """Free blocks that still serve prefix-cache hits until evicted."""
    block_size: int
    kv_bytes_per_token: float
    """KV-cache bytes one token occupies in all layers (int8: values + packed scales)."""
    num_allocated_slots: int
    """Slots in blocks held by requests; a shared block counts once."""
    num_filled_slots: int
    """Distinct slots holding a computed token; allocated - filled = slots not holding a token."""
    prefix_cache_queries: int
    prefix_cache_hits: int
    num_preemptions: int
    num_prompt_tokens: int
    num_generation_tokens: int
    spec_decode: dict[str, float] = field(default_factory=dict)
    num_blocks_used: int = 0
    """Blocks referenced by at least one request."""
    num_blocks_shared: int = 0
    """Used blocks held by more than one request (prefix hits, n > 1 samples, beams)."""
    num_blocks_used_by_kind: dict[str, int] = field(default_factory=dict)
    """Used blocks per kind of KV-cache group: "global", "window W" (sliding-window models)."""
    num_blocks_slid_out: int = 0
    """Blocks windowed groups returned to the pool because no later query could see them."""
    num_unfilled_slots: int = 0
    """Allocated slots not holding a token (internal fragmentation)."""
    kv_pool_tokens: int = 0
    """Pool size in tokens: num_blocks_total * block_size."""
    kv_pool_bytes: int = 0
    kv_cache_dtype: str = ""
    kv_transfer: dict[str, float] = field(default_factory=dict)
    """Disaggregation counters (distributed/kv_connector.ConnectorStats), empty for a colocated engine."""
    num_steps: int = 0
    """Engine steps that ran the model."""
    step_seconds: float = 0.0
    """Wall seconds inside those steps (scheduling, the forward, sampling, detokenizing, outputs)."""
    forward_seconds: float = 0.0
    """Of step_seconds, the model runner's part (inputs, the forward, the LM head, sampling)."""
    num_grammar_masks: int = 0
    """Structured outputs: allowed-token masks computed (one per sampled position under a grammar, drafts too)."""
    num_grammar_violations: int = 0
    """Tokens kept that their grammar did not allow: 0 unless a mask failed to apply (a bug)."""


STEP_LOG_LEN = 512
"""Steps EngineCore.recent_steps remembers (the dashboard reads them a few times a second)."""


@dataclass(frozen=True)
class StepRecord:
    """One step that ran the model, as the dashboard's step chart draws it."""

    index: int
    """EngineStats.num_steps after this step (1 for the first)."""
    time: float
    """Wall clock (time.time()) when its forward ended."""
    tokens: TokenSplit
    num_running: int
    num_waiting: int
    num_preempted: int
    """Requests preempted while scheduling this step."""
    forward_ms: float


@dataclass(frozen=True)
class RequestView:
    """A request in the scheduler, for a person looking at the engine."""

    request_id: str
    status: str
    """RequestStatus name: WAITING, RUNNING, PREEMPTED, WAITING_FOR_REMOTE_KV."""
    num_prompt_tokens: int
    num_output_tokens: int
    num_computed_tokens: int
    num_cached_tokens: int
    """Prompt tokens found in the prefix cache when it was admitted."""


@dataclass(frozen=True)
class EngineSnapshot:
    """Everything the dashboard draws, taken between two steps so the parts agree."""

    stats: EngineStats
    blocks: BlockMap
    steps: list[StepRecord]
    """Remembered steps with index > the caller's since_step, oldest first."""
    requests: list[RequestView]
    max_num_batched_tokens: int
    max_num_seqs: int
