"""The executor seam: what the engine core drives, wherever the model runs.

    EngineCore ── StepInput ──▶ Executor.execute ──▶ ModelRunner(s) ──▶ StepOutput (tokens, drafts)

Three executors, one protocol:

    UniProcExecutor      the runner in the engine's own process (the default)
    MultiprocExecutor    the runner in a spawned process, driven over a pipe (`--distributed-executor-backend mp`)
    TPExecutor           the model split over N processes; rank 0 runs in the engine's process

Each builds its runner with `build_runner`, the one place a target runner (and its speculator) is made, from
`RunnerOptions`, plain data that a spawned process receives. `plan_kv_cache` is the one place the KV pool's
layout and size are decided. Only plain step data (core/step_io.py) crosses: speculation lives in the runner,
so it works in every executor.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import torch

from tokenmill.config import (
    DEFAULT_KV_TOKENS,
    EngineConfig,
    KVCacheSpec,
    ModelArchConfig,
    ModelConfig,
    SpeculativeConfig,
    plan_kv_groups,
)
from tokenmill.core.step_io import StepInput, StepOutput
from tokenmill.worker.model_runner import ModelRunner

if TYPE_CHECKING:
    from tokenmill.models.causal_lm import CausalLM
    from tokenmill.models.loader import LoadedModel
    from tokenmill.spec_decode.eagle_head import TargetTables
    from tokenmill.worker.model_runner import RunnerModel

logger = logging.getLogger("tokenmill")


def available_memory_bytes(device: torch.device) -> int:
    """Bytes the KV pool may take a fraction of: free GPU memory, or the host's MemAvailable."""
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


def plan_kv_cache(arch: ModelArchConfig, config: EngineConfig, max_model_len: int, available_bytes: int) -> KVCacheSpec:
    """The KV pool: its layout from the model (one block holds one KV-cache group's layers, each rank's share of
    the KV heads) and its size from the budget (kv_cache_memory_bytes, or the fraction of `available_bytes`;
    with neither set, 0.1 of it capped at DEFAULT_KV_TOKENS tokens in every group), never more than max_num_seqs
    full-length sequences in every group."""
    mc, cc = config.model, config.cache
    tp = mc.tensor_parallel_size
    kv_dtype = torch.int8 if cc.kv_cache_dtype == "int8" else mc.torch_dtype
    groups = plan_kv_groups(arch.layer_windows())
    spec = KVCacheSpec(
        0,
        cc.block_size,
        len(groups[0].layers),
        arch.num_key_value_heads // tp,
        arch.head_dim,
        kv_dtype,
        tuple(groups) if len(groups) > 1 else (),
    )
    if cc.num_gpu_blocks_override is not None:
        num_blocks = cc.num_gpu_blocks_override
    else:
        fraction = 0.1 if cc.kv_cache_memory_fraction is None else cc.kv_cache_memory_fraction
        budget = cc.kv_cache_memory_bytes or int(available_bytes * fraction)
        num_blocks = budget // spec.bytes_per_block
        if cc.kv_cache_memory_bytes is None and cc.kv_cache_memory_fraction is None:  # the default rule
            num_blocks = min(num_blocks, -(-DEFAULT_KV_TOKENS // cc.block_size) * len(groups))
        useful = config.scheduler.max_num_seqs * -(-max_model_len // cc.block_size)
        num_blocks = min(num_blocks, useful * len(groups))
    if num_blocks < 1:
        raise ValueError("the KV-cache budget holds no block; raise kv_cache_memory_bytes")
    return dataclasses.replace(spec, num_blocks=num_blocks)


@dataclass(frozen=True)
class RunnerOptions:
    """How any process builds the target's runner: plain data, so a spawned process receives it."""

    model: ModelConfig
    kv_spec: KVCacheSpec
    max_num_seqs: int
    max_model_len: int
    speculative: SpeculativeConfig | None = None

    @classmethod
    def from_config(cls, config: EngineConfig, kv_spec: KVCacheSpec, max_model_len: int) -> RunnerOptions:
        return cls(config.model, kv_spec, config.scheduler.max_num_seqs, max_model_len, config.speculative)


def load_target(mc: ModelConfig, load_tokenizer: bool = True) -> LoadedModel:
    """The target model as every process of an engine loads it (same dtype and LM head)."""
    from tokenmill.models.loader import load_model

    return load_model(
        mc.model,
        dtype=mc.torch_dtype,
        device=mc.device,
        quantize_lm_head=mc.quantize_lm_head,
        load_tokenizer=load_tokenizer,
        gguf_dequantize=mc.dequantizes_gguf,
    )


@dataclass(frozen=True)
class TPRank:
    """Which tensor-parallel rank a runner serves: its model is a shard whose layers all-reduce with the other
    ranks, so it never runs outside a broadcast step and the C++ layer loop (no all-reduce) does not run it."""

    rank: int
    tables: TargetTables | None = None
    """Rank 0: the target's embedding and LM-head tables, read before the model was split (a draft head's need:
    `SpeculativeConfig.reads_target_tables`); None otherwise."""


def build_runner(model: CausalLM, arch: ModelArchConfig, opts: RunnerOptions, tp: TPRank | None = None) -> ModelRunner:
    """The target's runner, with its speculator when opts.speculative is set. tp: None for a whole model; rank 0
    of a split model samples, verifies and drafts (a draft model or head runs whole, on rank 0 alone); ranks 1..
    follow rank 0's steps, drafts included, and neither sample nor draft."""
    mc = opts.model
    device = torch.device(mc.device)
    speculator = None
    spec = opts.speculative
    if spec is not None and (tp is None or tp.rank == 0):  # lazy import: plain engines never load it
        from tokenmill.layers.sampler import DRAFT_STREAM
        from tokenmill.spec_decode.decoder import SpeculativeDecoder
        from tokenmill.spec_decode.eagle_head import target_tables
        from tokenmill.spec_decode.proposer import ProposerContext

        def new_runner(draft: RunnerModel, draft_arch: ModelArchConfig, kv: KVCacheSpec, seed: int) -> ModelRunner:
            # a draft is whole: the C++ loop runs it; its seeded draws come from the requests' draft stream
            return ModelRunner(draft, draft_arch, kv, device, seed=seed, sample_stream=DRAFT_STREAM)

        def tables() -> TargetTables:
            if tp is None:
                return target_tables(model)
            if tp.tables is None:
                raise ValueError(f"speculative method {spec.method!r} got no target tables on rank 0")
            return tp.tables

        ctx = ProposerContext(
            model if tp is None else None,
            arch,
            mc.model,
            mc.torch_dtype,
            device,
            opts.kv_spec,
            opts.max_num_seqs,
            opts.max_model_len,
            mc.seed,
            new_runner,
            tables,
        )
        speculator = SpeculativeDecoder(spec, ctx)
    return ModelRunner(
        model,
        arch,
        opts.kv_spec,
        device,
        seed=mc.seed,
        speculator=speculator,
        use_decode_loop=tp is None,
        prompts_per_token=mc.attends_prompts_per_token,
        samples=tp is None or tp.rank == 0,
    )


class Executor(Protocol):
    """Runs steps wherever the model lives; the engine core sees nothing else of it."""

    def execute(self, step: StepInput) -> StepOutput:
        """One step: the runner applies the step's row deltas, runs the model, samples, proposes drafts."""
        ...

    def kv_cache_spec(self) -> KVCacheSpec:
        """The KV pool the runner holds (rank 0's share under tensor parallelism)."""
        ...

    def local_kv_caches(self) -> list[torch.Tensor] | None:
        """Per layer, the KV cache tensor when it lives in this process (the KV connector reads and writes it),
        else None."""
        ...

    def shutdown(self) -> None:
        """Stop the processes this executor started; idempotent."""
        ...


class UniProcExecutor:
    """The runner in the engine's own process."""

    def __init__(self, model: CausalLM, arch: ModelArchConfig, opts: RunnerOptions) -> None:
        self.runner = build_runner(model, arch, opts)

    def execute(self, step: StepInput) -> StepOutput:
        return self.runner.execute(step)

    def kv_cache_spec(self) -> KVCacheSpec:
        return self.runner.kv_spec

    def local_kv_caches(self) -> list[torch.Tensor] | None:
        return self.runner.kv_caches

    def shutdown(self) -> None:
        pass


def build_executor(
    config: EngineConfig, model: CausalLM | None, arch: ModelArchConfig, opts: RunnerOptions
) -> Executor:
    """The executor config.model asks for: tensor-parallel ranks, a runner process, or the runner in-process.
    model: the target loaded in this process (None for a runner process, which loads its own)."""
    mc = config.model
    if mc.distributed_executor_backend == "mp" and mc.tensor_parallel_size == 1:
        from tokenmill.worker.process import MultiprocExecutor

        return MultiprocExecutor(opts, num_threads=torch.get_num_threads())
    assert model is not None, "the in-process and tensor-parallel executors run the model loaded here"
    if mc.tensor_parallel_size > 1:
        from tokenmill.worker.tp_executor import TPExecutor

        return TPExecutor(
            model,
            opts,
            torch.get_num_threads(),
            max_num_tokens=None if mc.tensor_parallel_gloo_only else config.scheduler.max_num_batched_tokens,
        )
    return UniProcExecutor(model, arch, opts)
