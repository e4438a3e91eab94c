"""The engine core: owns the scheduler and the model runner and runs one step at a time.

    step(): scheduler.schedule() -> runner.execute(sched.step) -> scheduler.update(results)
            -> detokenize, stop strings -> RequestOutputs

A request asking for n samples becomes n child requests ("<id>#<i>"); child i of a seeded
request uses seed + i, so it equals a separate request with that seed.
"""
from __future__ import annotations

import dataclasses
import logging
import os
import time
from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from tokenmill.attention.backend import TorchPagedAttention

from tokenmill.config import EngineConfig, ModelArchConfig, plan_kv_groups
from tokenmill.core.kv_cache_manager import BlockMap
from tokenmill.core.scheduler import Scheduler, StepTokens
from tokenmill.distributed.kv_connector import HoldForDecode, KVConnectorScheduler, KVTransferRequest, PullFromPrefill

if TYPE_CHECKING:
    from tokenmill.distributed.kv_transfer import KVTransport
from tokenmill.engine.detokenizer import IncrementalDetokenizer
from tokenmill.errors import InvalidRequest
from tokenmill.models.loader import load_model
from tokenmill.outputs import CompletionOutput, RequestMetrics, RequestOutput
from tokenmill.request import Request, RequestStatus
from tokenmill.sampling_params import SamplingParams
from tokenmill.structured.manager import StructuredOutputManager
from tokenmill.worker.model_runner import KVCacheSpec, ModelRunner

logger = logging.getLogger("tokenmill")


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
    tokens: StepTokens
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


@dataclass
class _Emitted:
    """What one sample's outputs have carried so far (for delta outputs)."""

    num_tokens: int = 0
    num_chars: int = 0
    cumulative_logprob: float = 0.0
    finished: bool = False


@dataclass
class _Parent:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    children: list[Request]
    detoks: list[IncrementalDetokenizer]
    arrival_time: float
    emitted: list[_Emitted] = field(default_factory=list)


def available_memory_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return free
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 4 << 30


class EngineCore:
    def __init__(self, config: EngineConfig, kv_transport: KVTransport | None = None) -> None:
        """kv_transport: the KV connector's transport (distributed/kv_transfer.py) when config.kv_transfer is set;
        None builds the torch.distributed one from the config."""
        self.config = config
        mc = config.model
        self.device = torch.device(mc.device)
        torch.manual_seed(mc.seed)
        if os.environ.get("TOKENMILL_NUM_THREADS"):
            torch.set_num_threads(int(os.environ["TOKENMILL_NUM_THREADS"]))
        t0 = time.time()
        loaded = load_model(mc.model, dtype=mc.torch_dtype, device=mc.device, quantize_lm_head=mc.quantize_lm_head,
                            backend=TorchPagedAttention(tiled_prefill=not mc.attends_prompts_per_token))
        if mc.batch_invariant and mc.bf16_linears_vary_with_batch:
            logger.warning("batch_invariant: prompts are attended per token, but this CPU's bf16 linears are not "
                           "batch-invariant, so outputs still depend on batching")
        self.model = loaded.model
        self.arch: ModelArchConfig = loaded.config
        self.tokenizer = loaded.tokenizer
        self.vocab_size = self.arch.vocab_size
        """Largest token id + 1 that the model accepts (its embedding rows; the tokenizer may count fewer)."""
        self.max_model_len = min(mc.max_model_len or self.arch.max_position_embeddings,
                                 self.arch.max_position_embeddings)
        if mc.max_model_len and mc.max_model_len > self.arch.max_position_embeddings:
            raise ValueError(f"max_model_len {mc.max_model_len} exceeds the model's context length "
                             f"{self.arch.max_position_embeddings}")
        tp = mc.tensor_parallel_size
        if tp > 1:
            from tokenmill.distributed.tensor_parallel import check_tensor_parallel
            check_tensor_parallel(self.arch, tp)
            if config.speculative is not None or config.kv_transfer is not None or self.device.type != "cpu":
                raise ValueError("tensor_parallel_size > 1 runs on CPU without speculative decoding or KV transfer here")
        cc = config.cache
        kv_dtype = torch.int8 if cc.kv_cache_dtype == "int8" else mc.torch_dtype
        groups = plan_kv_groups(self.arch.layer_windows())
        if len(groups) > 1 and (tp > 1 or config.kv_transfer is not None):
            raise ValueError("models with sliding-window layers (several KV-cache groups) run without tensor "
                             "parallelism or KV transfer here")
        # A block holds one group's layers (all of them for a one-group model).
        spec = KVCacheSpec(0, cc.block_size, len(groups[0].layers), self.arch.num_key_value_heads // tp,
                           self.arch.head_dim, kv_dtype, tuple(groups) if len(groups) > 1 else ())
        if cc.num_gpu_blocks_override is not None:
            num_blocks = cc.num_gpu_blocks_override
        else:
            budget = cc.kv_cache_memory_bytes or int(available_memory_bytes(self.device) * cc.kv_cache_memory_fraction)
            num_blocks = budget // spec.bytes_per_block
            # No point holding more than max_num_seqs full-length sequences (in every group).
            useful = config.scheduler.max_num_seqs * -(-self.max_model_len // cc.block_size)
            num_blocks = min(num_blocks, useful * len(groups))
        if num_blocks < 1:
            raise ValueError("the KV-cache budget holds no block; raise kv_cache_memory_bytes")
        self.kv_spec = dataclasses.replace(spec, num_blocks=num_blocks)
        kvt = config.kv_transfer
        self.kv_connector = KVConnectorScheduler(kvt.kv_role, kvt.hold_timeout_s) if kvt is not None else None
        self.scheduler = Scheduler(config.scheduler, cc, num_blocks, self.max_model_len, self.kv_connector,
                                   groups if len(groups) > 1 else None)
        self.spec = None
        if config.speculative is not None:  # lazy import: engines without speculation never load it
            from tokenmill.spec_decode.decoder import SpeculativeDecoder
            from tokenmill.spec_decode.proposer import ProposerContext
            ctx = ProposerContext(self.model, self.arch, mc.model, mc.torch_dtype, self.device, self.kv_spec,
                                  self.scheduler.kv.get_block_ids, config.scheduler.max_num_seqs, self.max_model_len,
                                  mc.seed)
            self.spec = SpeculativeDecoder(config.speculative, ctx)
        self.tp_executor = None
        """The other ranks' processes when the model is split (tensor_parallel_size > 1)."""
        if tp > 1:  # rank 0 of a model split over tp processes; the others are spawned by the executor
            from tokenmill.worker.tp_executor import TPExecutor
            self.runner = self.tp_executor = TPExecutor(
                self.model, mc.model, mc.torch_dtype, self.kv_spec, mc.seed, tp, cc.kv_cache_dtype,
                torch.get_num_threads(), max_num_tokens=None if mc.tensor_parallel_gloo_only
                else config.scheduler.max_num_batched_tokens)
        else:
            self.runner = ModelRunner(self.model, self.arch, self.kv_spec, self.device, seed=mc.seed,
                                      verifier=self.spec.verify if self.spec else None,
                                      feature_sink=self.spec.proposer.feature_sink if self.spec else None,
                                      prompts_per_token=mc.attends_prompts_per_token)
        self.kv_worker = None
        if kvt is not None:  # lazy import: colocated engines never load torch.distributed
            from tokenmill.distributed.kv_transfer import GlooTransport, KVConnectorWorker
            if kv_transport is None:
                kv_transport = GlooTransport(kvt.kv_host, kvt.kv_port, serve=kvt.serves_kv,
                                             timeout_s=kvt.transfer_timeout_s)
            self.kv_worker = KVConnectorWorker(self.runner.kv_caches, kv_transport, self.kv_connector.stats,
                                               kvt.transfer_timeout_s)
            if kv_transport.address is not None:
                logger.info("KV endpoint (role %s) at %s:%d", kvt.kv_role, *kv_transport.address)
        self.parents: dict[str, _Parent] = {}
        self.child_to_parent: dict[str, str] = {}
        self.sequences: dict[str, Request] = {}
        """Raw sequences (beam search): scheduled like requests, never detokenized or emitted."""
        self.num_prompt_tokens = 0
        self.num_generation_tokens = 0
        self.num_steps = 0
        self.step_seconds = 0.0
        self.forward_seconds = 0.0
        self.recent_steps: deque[StepRecord] = deque(maxlen=STEP_LOG_LEN)
        self.eos_token_id = self.tokenizer.eos_token_id if self.tokenizer else (self.arch.eos_token_ids or (None,))[0]
        self.structured = StructuredOutputManager(self.tokenizer, self.arch.vocab_size,
                                                  [self.eos_token_id] if self.eos_token_id is not None else []) \
            if self.tokenizer is not None else None
        """Grammar matchers of requests with structured_outputs (tokenmill.structured); None without a tokenizer."""
        logger.info("loaded %s in %.1fs: %d KV blocks of %d tokens (%.1f MiB)", loaded.path.name, time.time() - t0,
                    num_blocks, cc.block_size, num_blocks * self.kv_spec.bytes_per_block / 2**20)

    # ------------------------------------------------------------------ intake
    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                    prompt: str | None = None, arrival_time: float | None = None,
                    cache_salt: str | None = None, kv_transfer: KVTransferRequest | None = None) -> None:
        """kv_transfer (disaggregation): HoldForDecode on a prefill worker, PullFromPrefill on a decode worker."""
        if request_id in self.parents:
            raise InvalidRequest(f"request_id {request_id!r} is already in use", "request_id")
        if not prompt_token_ids:
            raise InvalidRequest("prompt is empty: at least one token is required", "prompt")
        if any((not isinstance(t, int)) or t < 0 or t >= self.arch.vocab_size for t in prompt_token_ids):
            raise InvalidRequest(f"prompt token ids must be integers in [0, {self.arch.vocab_size})", "prompt")
        n_prompt = len(prompt_token_ids)
        if n_prompt >= self.max_model_len:
            raise InvalidRequest(f"prompt has {n_prompt} tokens, but max_model_len is {self.max_model_len}; "
                                 f"shorten the prompt", "prompt", "context_length_exceeded")
        max_tokens = params.max_tokens if params.max_tokens is not None else self.max_model_len - n_prompt
        if n_prompt + max_tokens > self.max_model_len:
            raise InvalidRequest(f"max_tokens: prompt ({n_prompt} tokens) + max_tokens ({max_tokens}) exceeds "
                                 f"max_model_len ({self.max_model_len})", "max_tokens", "context_length_exceeded")
        blocks_needed = self.scheduler.kv.min_blocks_for(n_prompt + max_tokens)
        if blocks_needed > self.kv_spec.num_blocks:
            raise InvalidRequest(f"request needs {blocks_needed} KV blocks but the whole pool has "
                                 f"{self.kv_spec.num_blocks}; raise the KV-cache budget or lower max_tokens",
                                 "max_tokens")
        sc = self.config.scheduler
        if not sc.enable_chunked_prefill and n_prompt + max_tokens > sc.max_num_batched_tokens:
            # without chunking a prompt (or a preempted request's prompt + output) runs in one step
            raise InvalidRequest(f"prompt ({n_prompt} tokens) + max_tokens ({max_tokens}) exceeds "
                                 f"max_num_batched_tokens ({sc.max_num_batched_tokens}) and chunked prefill is off: "
                                 f"it could never be scheduled", "max_tokens")
        if params.n > self.config.scheduler.max_num_seqs:
            raise InvalidRequest(f"n ({params.n}) exceeds max_num_seqs ({self.config.scheduler.max_num_seqs})", "n")
        if cache_salt is not None:  # hashed as UTF-8 with the blocks: checked here, not in the step loop
            if not isinstance(cache_salt, str) or not cache_salt:
                raise InvalidRequest("cache_salt must be a non-empty string", "cache_salt")
            try:
                cache_salt.encode()
            except UnicodeEncodeError:
                raise InvalidRequest("cache_salt is not valid Unicode text (a lone surrogate?)", "cache_salt") from None
        if kv_transfer is not None:
            self._check_kv_transfer(kv_transfer, n_prompt, params)
        grammar = None
        if params.structured_outputs is not None:
            if self.structured is None:
                raise InvalidRequest("structured_outputs need the model's tokenizer, and this model has none",
                                     "structured_outputs")
            grammar = self.structured.compile(params.structured_outputs)
        arrival = arrival_time if arrival_time is not None else time.time()
        children, detoks = [], []
        for i in range(params.n):
            child_params = params
            if params.n > 1 and params.seed is not None:
                child_params = params.clone(seed=params.seed + i)
            cid = request_id if params.n == 1 else f"{request_id}#{i}"
            req = Request(cid, prompt_token_ids, child_params, self.eos_token_id, max_tokens, arrival,
                          cache_salt=cache_salt, sample_index=i, parent_id=request_id, kv_transfer=kv_transfer)
            children.append(req)
            detoks.append(IncrementalDetokenizer(self.tokenizer, prompt_token_ids, params.stop,
                                                 params.skip_special_tokens, params.include_stop_str_in_output))
            self.child_to_parent[cid] = request_id
        self.parents[request_id] = _Parent(request_id, prompt, list(prompt_token_ids), children, detoks, arrival,
                                           [_Emitted() for _ in children])
        if grammar is not None:
            self.structured.add([c.request_id for c in children], grammar)
        # Samples 2..n fork from the first once its prompt is computed (shared blocks, CoW).
        self.scheduler.add_request(children[0], forks=children[1:])
        self.num_prompt_tokens += n_prompt * params.n

    def _check_kv_transfer(self, kvt: KVTransferRequest, n_prompt: int, params: SamplingParams) -> None:
        cfg = self.config.kv_transfer
        if cfg is None:
            raise InvalidRequest("kv_transfer_params: this server is not a prefill or decode worker "
                                 "(start it with --kv-role)", "kv_transfer_params")
        if params.n != 1:
            raise InvalidRequest("kv_transfer_params: disaggregated requests take n = 1", "n")
        if isinstance(kvt, HoldForDecode) and not cfg.serves_kv:
            raise InvalidRequest(f"kv_transfer_params: a {cfg.kv_role} worker does not hold K/V for others "
                                 f"(do_remote_decode needs kv_role prefill or both)", "kv_transfer_params")
        if isinstance(kvt, PullFromPrefill):
            if cfg.kv_role == "prefill":
                raise InvalidRequest("kv_transfer_params: a prefill worker does not pull K/V", "kv_transfer_params")
            if kvt.num_tokens != n_prompt:
                raise InvalidRequest(f"kv_transfer_params: {kvt.num_tokens} prompt tokens held, but this prompt has "
                                     f"{n_prompt} (the same prompt must reach both workers)", "kv_transfer_params")

    def num_cached_prompt_tokens(self, prompt_token_ids: list[int], cache_salt: str | None = None) -> int:
        """Tokens of this prompt the prefix cache would serve now (a pure lookup)."""
        if not prompt_token_ids:
            return 0
        probe = Request("\0kv-plan", prompt_token_ids, SamplingParams(max_tokens=1), None, 1, cache_salt=cache_salt)
        try:
            return self.scheduler.kv.get_computed_blocks(probe).num_tokens
        finally:
            self.scheduler.kv.forget(probe.request_id)

    def abort_request(self, request_id: str) -> None:
        parent = self.parents.pop(request_id, None)
        if parent is None:
            return
        for req in parent.children:
            self.child_to_parent.pop(req.request_id, None)
            if not req.is_finished:
                self.scheduler.finish_request(req.request_id, RequestStatus.FINISHED_ABORTED)

    def has_unfinished_requests(self) -> bool:
        """Requests to step, or (disaggregation) held K/V or transfers still to serve."""
        if self.kv_worker is not None and (self.kv_connector.has_pending_work or self.kv_worker.has_pending_io):
            return True
        return bool(self.parents or self.sequences)

    # ------------------------------------------------------- raw sequences
    # Beam search (engine/beam_search.py) drives these: token-level control over sequences that
    # share blocks, with no text and no RequestOutputs.
    def add_sequence(self, seq_id: str, prompt_token_ids: list[int], params: SamplingParams,
                     output_token_ids: list[int] = (), cache_salt: str | None = None) -> None:
        """Schedule a sequence that continues `prompt_token_ids + output_token_ids`."""
        if seq_id in self.sequences or seq_id in self.parents:
            raise InvalidRequest(f"sequence id {seq_id!r} is already in use", "request_id")
        req = self._new_sequence(seq_id, prompt_token_ids, output_token_ids, params,
                                 params.max_tokens or self.max_model_len, cache_salt)
        self.scheduler.add_request(req)

    def fork_sequence(self, parent_id: str, child_id: str) -> None:
        """A new sequence equal to `parent_id` so far, sharing its KV blocks (copied on first write)."""
        parent = self.sequences[parent_id]
        child = self._new_sequence(child_id, parent.prompt_token_ids, parent.output_token_ids, parent.sampling_params,
                                   parent.max_tokens, parent.cache_salt)
        self.scheduler.fork_request(parent, child, num_shared_tokens=child.num_tokens)

    def _new_sequence(self, seq_id: str, prompt_token_ids: list[int], output_token_ids, params: SamplingParams,
                      max_tokens: int, cache_salt: str | None) -> Request:
        req = Request(seq_id, prompt_token_ids, params, self.eos_token_id, max_tokens, cache_salt=cache_salt)
        for t in output_token_ids:
            req.append_output_token(t)
        self.sequences[seq_id] = req
        return req

    def num_sequence_tokens(self, seq_id: str) -> int:
        """Generated tokens of a sequence (a sampled one included until take_sampled)."""
        return self.sequences[seq_id].num_output_tokens

    def take_sampled(self, seq_id: str) -> dict[int, float]:
        """Take the token sampled last off the sequence (its K/V was never written) and return the
        logprobs reported with it: token id -> logprob (the sampled one and the top-N)."""
        r = self.sequences[seq_id]
        assert r.logprobs and r.num_output_tokens, f"{seq_id} has no sampled token to take"
        lps = {t: lp.logprob for t, lp in r.logprobs[-1].items()}
        r.output_token_ids.pop()
        r.all_token_ids.pop()
        r.logprobs.clear()
        r.clear_drafts()
        r.num_computed_tokens = min(r.num_computed_tokens, r.num_tokens)
        return lps

    def extend_sequence(self, seq_id: str, token_id: int) -> None:
        self.sequences[seq_id].append_output_token(token_id)

    def finish_sequence(self, seq_id: str, aborted: bool = False) -> None:
        req = self.sequences.pop(seq_id)
        if not req.is_finished:
            status = RequestStatus.FINISHED_ABORTED if aborted else RequestStatus.FINISHED_STOPPED
            self.scheduler.finish_request(seq_id, status)

    # -------------------------------------------------------------------- step
    def step(self) -> list[RequestOutput]:
        t_step = time.perf_counter()
        if self.kv_worker is not None:  # transfers that ended since the last step
            self.kv_worker.collect()
            self.scheduler.apply_kv_events(self.kv_worker.take_events())
        sched = self.scheduler.schedule()
        if self.kv_worker is not None:
            self.kv_worker.start_step(sched.kv)
            if sched.is_empty and not sched.finished_ids:  # only transfers in flight: wait for one, do not spin
                self.kv_worker.wait(0.005)
        if self.structured is not None and self.structured.matchers:
            self.structured.forget(sched.finished_ids)
            masks = self.structured.step_masks(sched)
            if masks:
                sched.step = dataclasses.replace(sched.step, token_masks=masks)
        t0 = time.perf_counter()
        results = self.runner.execute(sched.step) if self.spec is None else self.spec.execute(self.runner, sched)
        if not sched.is_empty:
            forward_s = time.perf_counter() - t0
            self.scheduler.observe_step(sched, forward_s)
            self.num_steps += 1
            self.forward_seconds += forward_s
            self.recent_steps.append(StepRecord(self.num_steps, time.time(), sched.token_split(),
                                                len(self.scheduler.running), len(self.scheduler.waiting),
                                                len(sched.preempted_ids), forward_s * 1000.0))
        changed = self.scheduler.update(sched, results)
        if self.structured is not None and self.structured.matchers:
            for rid in self.structured.consume(changed):  # a complete grammar ends its sample, as EOS would
                self.scheduler.finish_request(rid, RequestStatus.FINISHED_STOPPED)
        touched: dict[str, None] = {}
        for req in changed:
            pid = self.child_to_parent.get(req.request_id)
            if pid is None:
                if req.request_id in self.sequences:
                    continue  # a raw sequence: its owner reads its tokens
                raise AssertionError(f"step changed {req.request_id!r}, which the engine does not know")
            parent = self.parents[pid]
            detok = parent.detoks[req.sample_index]
            new = req.output_token_ids[detok.num_decoded:]
            self.num_generation_tokens += len(new)
            if req.status == RequestStatus.FINISHED_STOPPED and new and (
                    new[-1] == req.eos_token_id or new[-1] in req.sampling_params.stop_token_ids):
                new = new[:-1]  # a stop token ends the text without appearing in it
            stop = detok.update(new)
            if stop is not None and not req.is_finished:
                self.scheduler.finish_request(req.request_id, RequestStatus.FINISHED_STOPPED)
                req.stop_reason = stop
            elif stop is not None:
                req.status, req.stop_reason = RequestStatus.FINISHED_STOPPED, stop
            touched[pid] = None
        if self.spec is not None:  # drafts for the next step, once this step's stops are applied
            self.spec.propose(self.scheduler)
        outputs = []
        for pid in touched:
            parent = self.parents[pid]
            finished = all(r.is_finished for r in parent.children)
            kind = parent.children[0].sampling_params.output_kind
            if kind == "final" and not finished:
                continue
            out = self._make_delta(parent, finished) if kind == "delta" else self._make_output(parent, finished)
            outputs.append(out)
            if finished:
                del self.parents[pid]
                for req in parent.children:
                    self.child_to_parent.pop(req.request_id, None)
        if not sched.is_empty:
            self.step_seconds += time.perf_counter() - t_step
        return outputs

    def _decoded_logprobs(self, lps: list) -> list:
        for d in lps:
            for tok, lp in d.items():
                if lp.decoded_token is None:
                    lp.decoded_token = self.tokenizer.decode([tok], skip_special_tokens=False)
        return lps

    def _metrics(self, parent: _Parent, finished: bool) -> RequestMetrics:
        first = [r.first_token_time for r in parent.children if r.first_token_time]
        sched = [r.first_scheduled_time for r in parent.children if r.first_scheduled_time]
        last = [r.last_token_time for r in parent.children if r.last_token_time]
        return RequestMetrics(arrival_time=parent.arrival_time, first_scheduled_time=min(sched, default=None),
                              first_token_time=min(first, default=None), last_token_time=max(last, default=None),
                              finished_time=time.time() if finished else None,
                              num_generation_tokens=max(r.num_output_tokens for r in parent.children))

    def _make_output(self, parent: _Parent, finished: bool) -> RequestOutput:
        """Everything so far (output_kind "cumulative" or "final")."""
        comps = []
        for req, detok in zip(parent.children, parent.detoks):
            lps = None
            if req.sampling_params.logprobs is not None:
                lps = self._decoded_logprobs(req.logprobs[:len(req.output_token_ids)])
            comps.append(CompletionOutput(
                index=req.sample_index, text=detok.visible_text(req.is_finished), token_ids=list(req.output_token_ids),
                finish_reason=req.status.finish_reason, stop_reason=req.stop_reason, logprobs=lps,
                cumulative_logprob=sum(d[t].logprob for d, t in zip(lps, req.output_token_ids)) if lps else None))
        return RequestOutput(parent.request_id, parent.prompt, parent.prompt_token_ids, comps, finished,
                             self._metrics(parent, finished), num_cached_tokens=parent.children[0].num_cached_tokens,
                             kv_transfer_params=self._held_params(parent, finished))

    def _held_params(self, parent: _Parent, finished: bool) -> dict | None:
        """A finished prefill-side request whose K/V are held: where a decode worker pulls them from."""
        req = parent.children[0]
        if not finished or not isinstance(req.kv_transfer, HoldForDecode) or \
                req.request_id not in self.kv_connector.held:
            return None
        host, port = self.kv_worker.transport.address
        return PullFromPrefill(host, port, req.request_id, len(req.prompt_token_ids)).to_params()

    def _make_delta(self, parent: _Parent, finished: bool) -> RequestOutput:
        """Only what is new since the last output (output_kind "delta"): work in proportion to the new
        tokens and text, not to the length so far."""
        comps = []
        for req, detok, sent in zip(parent.children, parent.detoks, parent.emitted):
            n = req.num_output_tokens
            new_ids = req.output_token_ids[sent.num_tokens:n]
            visible = detok.visible_len(req.is_finished)
            text = detok.text[sent.num_chars:visible] if visible > sent.num_chars else ""
            if not new_ids and not text and (sent.finished or not req.is_finished):
                continue
            lps = None
            cum = None
            if req.sampling_params.logprobs is not None:
                lps = self._decoded_logprobs(req.logprobs[sent.num_tokens:n])
                sent.cumulative_logprob += sum(d[t].logprob for d, t in zip(lps, new_ids))
                cum = sent.cumulative_logprob
            sent.num_tokens, sent.num_chars, sent.finished = n, max(visible, sent.num_chars), req.is_finished
            comps.append(CompletionOutput(req.sample_index, text, list(new_ids), req.status.finish_reason,
                                          req.stop_reason, lps, cum, n))
        return RequestOutput(parent.request_id, parent.prompt, parent.prompt_token_ids, comps, finished,
                             self._metrics(parent, finished), num_cached_tokens=parent.children[0].num_cached_tokens,
                             is_delta=True, kv_transfer_params=self._held_params(parent, finished))

    # ------------------------------------------------------------ accounting
    def stats(self) -> EngineStats:
        kv = self.scheduler.kv
        mem = kv.memory_usage({r.request_id: min(r.num_computed_tokens, r.num_tokens) for r in self.scheduler.running})
        spec = self.kv_spec
        return EngineStats(
            num_running=len(self.scheduler.running), num_waiting=len(self.scheduler.waiting),
            kv_cache_usage=mem.num_blocks_used / mem.num_blocks_total, num_blocks_total=mem.num_blocks_total,
            num_blocks_free=mem.num_blocks_free, num_blocks_cached_free=mem.num_blocks_cached_free,
            block_size=kv.block_size, kv_bytes_per_token=spec.bytes_per_block * len(kv.groups) / spec.block_size,
            num_allocated_slots=mem.num_allocated_slots, num_filled_slots=mem.num_filled_slots,
            prefix_cache_queries=kv.stats.queries, prefix_cache_hits=kv.stats.hits,
            num_preemptions=self.scheduler.num_preemptions, num_prompt_tokens=self.num_prompt_tokens,
            num_generation_tokens=self.num_generation_tokens,
            spec_decode=self.spec.metrics() if self.spec is not None else {},
            num_blocks_used=mem.num_blocks_used, num_blocks_shared=mem.num_blocks_shared,
            num_blocks_used_by_kind=mem.num_blocks_used_by_kind, num_blocks_slid_out=kv.num_blocks_slid_out,
            num_unfilled_slots=mem.num_unfilled_slots, kv_pool_tokens=mem.num_blocks_total * spec.block_size,
            kv_pool_bytes=mem.num_blocks_total * spec.bytes_per_block, kv_cache_dtype=str(spec.dtype).removeprefix("torch."),
            kv_transfer=dataclasses.asdict(self.kv_connector.stats) if self.kv_connector is not None else {},
            num_steps=self.num_steps, step_seconds=self.step_seconds, forward_seconds=self.forward_seconds,
            num_grammar_masks=self.structured.num_masks if self.structured else 0,
            num_grammar_violations=self.structured.num_rejected_tokens if self.structured else 0)

    def snapshot(self, since_step: int = 0) -> EngineSnapshot:
        """Stats, the block pool's map, the steps after `since_step` and every live request (the dashboard)."""
        sched = self.scheduler
        live = [*sched.running, *sched.waiting, *sched.loading.values()]
        views = [RequestView(r.request_id, r.status.name, r.num_prompt_tokens, r.num_output_tokens,
                             r.num_computed_tokens, r.num_cached_tokens) for r in live]
        steps = [s for s in self.recent_steps if s.index > since_step]
        sc = self.config.scheduler
        return EngineSnapshot(self.stats(), sched.kv.block_map(), steps, views, sc.max_num_batched_tokens,
                              sc.max_num_seqs)

    def close(self) -> None:
        """Stop the processes this engine started (tensor-parallel ranks, the KV transport's threads)."""
        if self.tp_executor is not None:
            self.tp_executor.close()
        if self.kv_worker is not None:
            self.kv_worker.transport.close()

    def check_integrity(self) -> None:
        """Asserts allocator invariants; when idle, every block must be free."""
        self.scheduler.check_integrity()
        if not self.has_unfinished_requests():
            pool = self.scheduler.kv.pool
            assert pool.num_free_blocks == pool.num_blocks, \
                f"KV leak: {pool.num_blocks - pool.num_free_blocks} blocks held while idle"
            assert not self.scheduler.requests and not self.scheduler.kv.req_blocks
