"""The engine core: owns the scheduler, an executor (worker/executor.py) and the output processor, and runs one
step at a time:

    step(): scheduler.schedule() -> executor.execute(sched.step) -> scheduler.update(output)
            -> output_processor.process(changed): detokenize, stop strings -> RequestOutputs

Speculation lives in the runner behind the executor: drafts come back in the StepOutput and the scheduler stores
them on their requests. A request asking for n samples becomes n child requests ("<id>#<i>"); child i of a
seeded request uses seed + i, so it equals a separate request with that seed.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import time
from collections import deque
from typing import TYPE_CHECKING

import torch

from tokenmill.config import EngineConfig, ModelArchConfig
from tokenmill.core.scheduler import Scheduler, SchedulerOutput
from tokenmill.core.step_io import StepInput
from tokenmill.distributed.kv_connector import HoldForDecode, KVConnectorScheduler, KVTransferRequest, PullFromPrefill
from tokenmill.engine.detokenizer import IncrementalDetokenizer
from tokenmill.engine.output_processor import Emitted, OutputProcessor, ParentRequest
from tokenmill.engine.stats import STEP_LOG_LEN, EngineSnapshot, EngineStats, RequestView, StepRecord
from tokenmill.errors import InvalidRequest
from tokenmill.models.loader import ModelInfo, read_model_info
from tokenmill.outputs import RequestOutput
from tokenmill.request import Request, RequestStatus
from tokenmill.sampling_params import SamplingParams
from tokenmill.structured.manager import StructuredOutputManager
from tokenmill.worker.executor import RunnerOptions, available_memory_bytes, build_executor, load_target, plan_kv_cache

if TYPE_CHECKING:
    from tokenmill.distributed.kv_transfer import KVTransport
    from tokenmill.models.causal_lm import CausalLM

logger = logging.getLogger("tokenmill")


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
        self._check_layout(config)
        t0 = time.time()
        model: CausalLM | None = None
        if mc.distributed_executor_backend == "mp" and mc.tensor_parallel_size == 1:
            info = read_model_info(mc.model)  # the runner process loads the weights; this one reads the config
        else:
            loaded = load_target(mc)
            model, info = loaded.model, ModelInfo(loaded.config, loaded.tokenizer, loaded.path)
        if mc.batch_invariant and mc.bf16_linears_vary_with_batch:
            logger.warning(
                "batch_invariant: prompts are attended per token, but this CPU's bf16 linears are not "
                "batch-invariant, so outputs still depend on batching"
            )
        self.model = model
        """The target in this process (split in place under tensor parallelism); None with a runner process."""
        self.arch: ModelArchConfig = info.config
        self.tokenizer = info.tokenizer
        self.vocab_size = self.arch.vocab_size
        """Largest token id + 1 that the model accepts (its embedding rows; the tokenizer may count fewer)."""
        self.hidden_size = self.arch.hidden_size
        """The size of the final hidden states: what an embedding (SamplingParams.pooling) holds."""
        self.max_model_len = min(
            mc.max_model_len or self.arch.max_position_embeddings, self.arch.max_position_embeddings
        )
        if mc.max_model_len and mc.max_model_len > self.arch.max_position_embeddings:
            raise ValueError(
                f"max_model_len {mc.max_model_len} exceeds the model's context length "
                f"{self.arch.max_position_embeddings}"
            )
        if mc.tensor_parallel_size > 1:
            from tokenmill.distributed.tensor_parallel import check_tensor_parallel

            check_tensor_parallel(self.arch, mc.tensor_parallel_size)
        self.kv_spec = plan_kv_cache(self.arch, config, self.max_model_len, available_memory_bytes(self.device))
        groups = list(self.kv_spec.groups)
        if groups and (mc.tensor_parallel_size > 1 or config.kv_transfer is not None):
            raise ValueError(
                "models with sliding-window layers (several KV-cache groups) run without tensor "
                "parallelism or KV transfer here"
            )
        kvt = config.kv_transfer
        self.kv_connector = KVConnectorScheduler(kvt.kv_role, kvt.hold_timeout_s) if kvt is not None else None
        self.scheduler = Scheduler(
            config.scheduler,
            config.cache,
            self.kv_spec.num_blocks,
            self.max_model_len,
            self.kv_connector,
            groups or None,
        )
        self.executor = build_executor(
            config, model, self.arch, RunnerOptions.from_config(config, self.kv_spec, self.max_model_len)
        )
        # An empty step: the runner answers (a spawned one is up) and reports its speculation counters.
        self.spec_metrics: dict[str, float] = self.executor.execute(StepInput()).spec_metrics or {}
        """The runner's speculative-decoding counters as of the last step (empty without speculation)."""
        self.kv_worker = None
        if kvt is not None:  # lazy import: colocated engines never load torch.distributed
            from tokenmill.distributed.kv_transfer import GlooTransport, KVConnectorWorker

            caches = self.executor.local_kv_caches()
            if caches is None:
                raise ValueError(
                    "KV transfer needs the KV cache in the engine's process "
                    "(distributed_executor_backend uni, tensor_parallel_size 1)"
                )
            if kv_transport is None:
                kv_transport = GlooTransport(
                    kvt.kv_host, kvt.kv_port, serve=kvt.serves_kv, timeout_s=kvt.transfer_timeout_s
                )
            assert self.kv_connector is not None  # made above from the same kvt
            self.kv_worker = KVConnectorWorker(caches, kv_transport, self.kv_connector.stats, kvt.transfer_timeout_s)
            if kv_transport.address is not None:
                logger.info("KV endpoint (role %s) at %s:%d", kvt.kv_role, *kv_transport.address)
        self.outputs = OutputProcessor(self.tokenizer, self.scheduler)
        self.num_prompt_tokens = 0
        self.num_steps = 0
        self.step_seconds = 0.0
        self.forward_seconds = 0.0
        self.recent_steps: deque[StepRecord] = deque(maxlen=STEP_LOG_LEN)
        self.eos_token_id = self.tokenizer.eos_token_id if self.tokenizer else (self.arch.eos_token_ids or (None,))[0]
        self.structured = (
            StructuredOutputManager(
                self.tokenizer, self.arch.vocab_size, [self.eos_token_id] if self.eos_token_id is not None else []
            )
            if self.tokenizer is not None
            else None
        )
        """Grammar matchers of requests with structured_outputs (tokenmill.structured); None without a tokenizer."""
        nb = self.kv_spec.num_blocks
        logger.info(
            "loaded %s in %.1fs: %d KV blocks of %d tokens (%.1f MiB)",
            info.path.name,
            time.time() - t0,
            nb,
            self.kv_spec.block_size,
            nb * self.kv_spec.bytes_per_block / 2**20,
        )

    @staticmethod
    def _check_layout(config: EngineConfig) -> None:
        """What the executors cannot combine, refused before anything is started."""
        mc = config.model
        tp = mc.tensor_parallel_size
        if tp > 1 and mc.device != "cpu":
            raise ValueError("tensor_parallel_size > 1 runs on CPU here")
        if tp > 1 and config.kv_transfer is not None:
            raise ValueError("tensor_parallel_size > 1 runs without KV transfer here")

    # ------------------------------------------------------------------ intake
    def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        prompt: str | None = None,
        arrival_time: float | None = None,
        cache_salt: str | None = None,
        kv_transfer: KVTransferRequest | None = None,
    ) -> None:
        """kv_transfer (disaggregation): HoldForDecode on a prefill worker, PullFromPrefill on a decode worker."""
        if self.outputs.knows(request_id):
            raise InvalidRequest(f"request_id {request_id!r} is already in use", "request_id")
        if not prompt_token_ids:
            raise InvalidRequest("prompt is empty: at least one token is required", "prompt")
        if any((not isinstance(t, int)) or t < 0 or t >= self.arch.vocab_size for t in prompt_token_ids):
            raise InvalidRequest(f"prompt token ids must be integers in [0, {self.arch.vocab_size})", "prompt")
        n_prompt = len(prompt_token_ids)
        if n_prompt >= self.max_model_len:
            raise InvalidRequest(
                f"prompt has {n_prompt} tokens, but max_model_len is {self.max_model_len}; shorten the prompt",
                "prompt",
                "context_length_exceeded",
            )
        max_tokens = params.max_tokens if params.max_tokens is not None else self.max_model_len - n_prompt
        if n_prompt + max_tokens > self.max_model_len:
            raise InvalidRequest(
                f"max_tokens: prompt ({n_prompt} tokens) + max_tokens ({max_tokens}) exceeds "
                f"max_model_len ({self.max_model_len})",
                "max_tokens",
                "context_length_exceeded",
            )
        blocks_needed = self.scheduler.kv.min_blocks_for(n_prompt + max_tokens)
        if blocks_needed > self.kv_spec.num_blocks:
            raise InvalidRequest(
                f"request needs {blocks_needed} KV blocks but the whole pool has "
                f"{self.kv_spec.num_blocks}; raise the KV-cache budget or lower max_tokens",
                "max_tokens",
            )
        sc = self.config.scheduler
        if not sc.enable_chunked_prefill and n_prompt + max_tokens > sc.max_num_batched_tokens:
            # without chunking a prompt (or a preempted request's prompt + output) runs in one step
            raise InvalidRequest(
                f"prompt ({n_prompt} tokens) + max_tokens ({max_tokens}) exceeds "
                f"max_num_batched_tokens ({sc.max_num_batched_tokens}) and chunked prefill is off: "
                f"it could never be scheduled",
                "max_tokens",
            )
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
                raise InvalidRequest(
                    "structured_outputs need the model's tokenizer, and this model has none", "structured_outputs"
                )
            grammar = self.structured.compile(params.structured_outputs)
        arrival = arrival_time if arrival_time is not None else time.time()
        children, detoks = [], []
        for i in range(params.n):
            child_params = params
            if params.n > 1 and params.seed is not None:
                child_params = params.clone(seed=params.seed + i)
            if i > 0 and params.prompt_logprobs is not None:  # the first sample's prompt logprobs are the request's
                child_params = child_params.clone(prompt_logprobs=None)
            cid = request_id if params.n == 1 else f"{request_id}#{i}"
            req = Request(
                cid,
                prompt_token_ids,
                child_params,
                self.eos_token_id,
                max_tokens,
                arrival,
                cache_salt=cache_salt,
                sample_index=i,
                parent_id=request_id,
                kv_transfer=kv_transfer,
            )
            children.append(req)
            detoks.append(
                IncrementalDetokenizer(
                    self.tokenizer,
                    prompt_token_ids,
                    params.stop,
                    params.skip_special_tokens,
                    params.include_stop_str_in_output,
                )
            )
        self.outputs.add(
            ParentRequest(
                request_id, prompt, list(prompt_token_ids), children, detoks, arrival, [Emitted() for _ in children]
            )
        )
        if grammar is not None:
            self.structured.add([c.request_id for c in children], grammar)
        # Samples 2..n fork from the first once its prompt is computed (shared blocks, CoW). Prompt-only samples
        # never sample, so there is nothing to fork from: each computes the prompt (later ones from the cache).
        if params.is_prompt_only:
            for child in children:
                self.scheduler.add_request(child)
        else:
            self.scheduler.add_request(children[0], forks=children[1:])
        self.num_prompt_tokens += n_prompt * params.n

    def _check_kv_transfer(self, kvt: KVTransferRequest, n_prompt: int, params: SamplingParams) -> None:
        cfg = self.config.kv_transfer
        if cfg is None:
            raise InvalidRequest(
                "kv_transfer_params: this server is not a prefill or decode worker (start it with --kv-role)",
                "kv_transfer_params",
            )
        if params.n != 1:
            raise InvalidRequest("kv_transfer_params: disaggregated requests take n = 1", "n")
        if params.prompt_logprobs is not None or params.is_prompt_only:
            raise InvalidRequest(
                "kv_transfer_params: prompt logprobs, embeddings and max_tokens 0 need the prompt computed on one "
                "worker; send them without kv_transfer_params",
                "kv_transfer_params",
            )
        if isinstance(kvt, HoldForDecode) and not cfg.serves_kv:
            raise InvalidRequest(
                f"kv_transfer_params: a {cfg.kv_role} worker does not hold K/V for others "
                f"(do_remote_decode needs kv_role prefill or both)",
                "kv_transfer_params",
            )
        if isinstance(kvt, PullFromPrefill):
            if cfg.kv_role == "prefill":
                raise InvalidRequest("kv_transfer_params: a prefill worker does not pull K/V", "kv_transfer_params")
            if kvt.num_tokens != n_prompt:
                raise InvalidRequest(
                    f"kv_transfer_params: {kvt.num_tokens} prompt tokens held, but this prompt has "
                    f"{n_prompt} (the same prompt must reach both workers)",
                    "kv_transfer_params",
                )

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
        self.outputs.abort(request_id)

    def has_unfinished_requests(self) -> bool:
        """Requests to step, or (disaggregation) held K/V or transfers still to serve."""
        if self.kv_worker is not None:
            assert self.kv_connector is not None  # both exist exactly when config.kv_transfer is set
            if self.kv_connector.has_pending_work or self.kv_worker.has_pending_io:
                return True
        return self.outputs.has_unfinished

    # -------------------------------------------------------------------- step
    def step(self) -> list[RequestOutput]:
        t_step = time.perf_counter()
        if self.kv_worker is not None:  # transfers that ended since the last step
            self.kv_worker.collect()
            self.scheduler.apply_kv_events(self.kv_worker.take_events())
        sched = self.scheduler.schedule()
        if self.kv_worker is not None:
            assert sched.kv is not None  # the scheduler has a connector (the same kv_transfer config)
            self.kv_worker.start_step(sched.kv)
            if sched.is_empty and not sched.finished_ids:  # only transfers in flight: wait for one, do not spin
                self.kv_worker.wait(0.005)
        if self.structured is not None and self.structured.matchers:
            sched = self.structured.constrain(sched)
        t0 = time.perf_counter()
        output = self.executor.execute(sched.step)
        if not sched.is_empty:
            self._record_step(sched, time.perf_counter() - t0)
        if output.spec_metrics is not None:
            self.spec_metrics = output.spec_metrics
        changed = self.scheduler.update(sched, output)
        if self.structured is not None and self.structured.matchers:
            for rid in self.structured.consume(changed):  # a complete grammar ends its sample, as EOS would
                self.scheduler.finish_request(rid, RequestStatus.FINISHED_STOPPED)
        outputs = self.outputs.process(changed, self._held_kv if self.kv_worker is not None else None)
        if not sched.is_empty:
            self.step_seconds += time.perf_counter() - t_step
        return outputs

    def _record_step(self, sched: SchedulerOutput, forward_s: float) -> None:
        self.scheduler.observe_step(sched, forward_s)
        self.num_steps += 1
        self.forward_seconds += forward_s
        self.recent_steps.append(
            StepRecord(
                self.num_steps,
                time.time(),
                sched.token_split(),
                len(self.scheduler.running),
                len(self.scheduler.waiting),
                len(sched.preempted_ids),
                forward_s * 1000.0,
            )
        )

    def _held_kv(self, req: Request) -> dict | None:
        """A finished prefill-side request whose K/V are held: where a decode worker pulls them from."""
        assert self.kv_connector is not None and self.kv_worker is not None  # step passes this only with them
        if not isinstance(req.kv_transfer, HoldForDecode) or req.request_id not in self.kv_connector.held:
            return None
        address = self.kv_worker.transport.address
        assert address is not None, "a prefill worker's transport serves K/V (only it accepts HoldForDecode)"
        host, port = address
        return PullFromPrefill(host, port, req.request_id, len(req.prompt_token_ids)).to_params()

    # ------------------------------------------------------------ accounting
    def stats(self) -> EngineStats:
        kv = self.scheduler.kv
        mem = kv.memory_usage({r.request_id: min(r.num_computed_tokens, r.num_tokens) for r in self.scheduler.running})
        spec = self.kv_spec
        return EngineStats(
            num_running=len(self.scheduler.running),
            num_waiting=len(self.scheduler.waiting),
            kv_cache_usage=mem.num_blocks_used / mem.num_blocks_total,
            num_blocks_total=mem.num_blocks_total,
            num_blocks_free=mem.num_blocks_free,
            num_blocks_cached_free=mem.num_blocks_cached_free,
            block_size=kv.block_size,
            kv_bytes_per_token=spec.bytes_per_block * len(kv.groups) / spec.block_size,
            num_allocated_slots=mem.num_allocated_slots,
            num_filled_slots=mem.num_filled_slots,
            prefix_cache_queries=kv.stats.queries,
            prefix_cache_hits=kv.stats.hits,
            num_preemptions=self.scheduler.num_preemptions,
            num_prompt_tokens=self.num_prompt_tokens,
            num_generation_tokens=self.outputs.num_generation_tokens,
            spec_decode=dict(self.spec_metrics),
            num_blocks_used=mem.num_blocks_used,
            num_blocks_shared=mem.num_blocks_shared,
            num_blocks_used_by_kind=mem.num_blocks_used_by_kind,
            num_blocks_slid_out=kv.num_blocks_slid_out,
            num_unfilled_slots=mem.num_unfilled_slots,
            kv_pool_tokens=mem.num_blocks_total * spec.block_size,
            kv_pool_bytes=mem.num_blocks_total * spec.bytes_per_block,
            kv_cache_dtype=str(spec.dtype).removeprefix("torch."),
            kv_transfer=dataclasses.asdict(self.kv_connector.stats) if self.kv_connector is not None else {},
            num_steps=self.num_steps,
            step_seconds=self.step_seconds,
            forward_seconds=self.forward_seconds,
            num_grammar_masks=self.structured.num_masks if self.structured else 0,
            num_grammar_violations=self.structured.num_rejected_tokens if self.structured else 0,
        )

    def snapshot(self, since_step: int = 0) -> EngineSnapshot:
        """Stats, the block pool's map, the steps after `since_step` and every live request (the dashboard)."""
        sched = self.scheduler
        live = [*sched.running, *sched.waiting, *sched.loading.values()]
        views = [
            RequestView(
                r.request_id,
                r.status.name,
                r.num_prompt_tokens,
                r.num_output_tokens,
                r.num_computed_tokens,
                r.num_cached_tokens,
            )
            for r in live
        ]
        steps = [s for s in self.recent_steps if s.index > since_step]
        sc = self.config.scheduler
        return EngineSnapshot(
            self.stats(), sched.kv.block_map(), steps, views, sc.max_num_batched_tokens, sc.max_num_seqs
        )

    def close(self) -> None:
        """Stop the processes this engine started (tensor-parallel ranks, the KV transport's threads)."""
        self.executor.shutdown()
        if self.kv_worker is not None:
            self.kv_worker.transport.close()

    def check_integrity(self) -> None:
        """Asserts allocator invariants; when idle, every block must be free."""
        self.scheduler.check_integrity()
        if not self.has_unfinished_requests():
            pool = self.scheduler.kv.pool
            assert pool.num_free_blocks == pool.num_blocks, (
                f"KV leak: {pool.num_blocks - pool.num_free_blocks} blocks held while idle"
            )
            assert not self.scheduler.requests and not self.scheduler.kv.req_blocks
