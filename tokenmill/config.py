"""Configuration as data: frozen dataclasses, one per concern, validated in __post_init__.

Never mutate a config; derive a new one with dataclasses.replace. Each field's docstring doubles
as CLI help (see entrypoints/cli.py).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass, field, fields
from typing import Any

import torch

DEFAULT_MODEL_ALIAS = "smollm2-135m"


@dataclass(frozen=True)
class ModelArchConfig:
    """The shape of a Llama-family decoder, read from config.json or GGUF metadata."""

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    max_position_embeddings: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    """q/k/v projections carry biases (Qwen2)."""
    mlp_bias: bool = False
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    quantization_config: dict[str, Any] | None = None
    layer_types: tuple[str, ...] | None = None
    """Per layer "full_attention" or "sliding_attention" (Gemma 3); None: every layer full."""
    sliding_window: int | None = None
    """Keys a sliding-attention layer's query sees, itself included (Gemma 3 270M: 512)."""
    rope_local_theta: float | None = None
    """RoPE base of the sliding-attention layers (Gemma 3: 10,000; the full layers use rope_theta)."""
    query_pre_attn_scalar: float | None = None
    """Attention scores are scaled by query_pre_attn_scalar ** -0.5 (Gemma 3); None: head_dim ** -0.5."""
    hidden_act: str = "silu"
    """The MLP's gate activation: "silu" (Llama) or "gelu_pytorch_tanh" (Gemma 3, GeGLU)."""

    def __post_init__(self) -> None:
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_key_value_heads})"
            )

    def layer_windows(self) -> list[int | None]:
        """Per layer, its sliding window (None: a global layer): the KV-cache groups come from this."""
        if self.layer_types is None:
            return [None] * self.num_hidden_layers
        return [self.sliding_window if t == "sliding_attention" else None for t in self.layer_types]

    def kv_bytes_per_token(self, dtype_bytes: float) -> float:
        """2 (K and V) x layers x KV heads x head dim x bytes per element."""
        return 2 * self.num_hidden_layers * self.num_key_value_heads * self.head_dim * dtype_bytes


@dataclass(frozen=True)
class KVCacheGroup:
    """Layers that share one block table."""

    layers: tuple[int, ...]
    sliding_window: int | None = None
    """Keys a query sees, itself included (Gemma 3: 512); None: every earlier key (a global layer)."""


@dataclass
class KVCacheSpec:
    """The KV pool a runner allocates: blocks, their size and what one block holds (worker/executor.plan_kv_cache)."""

    num_blocks: int
    block_size: int
    num_layers: int
    """Layers one block holds: every layer, or a KV-cache group's size when the model has several groups."""
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype
    groups: tuple[KVCacheGroup, ...] = ()
    """The model's KV-cache groups (config.plan_kv_groups); () for one group of every layer."""

    @property
    def cache_head_dim(self) -> int:
        """Last dim of the cache tensor: head_dim, plus the packed scale for int8 (kv_quant.py)."""
        from tokenmill.attention.kv_quant import SCALE_BYTES  # lazy: config stays import-light

        return self.head_dim + SCALE_BYTES if self.dtype == torch.int8 else self.head_dim

    @property
    def bytes_per_block(self) -> int:
        elem = torch.empty((), dtype=self.dtype).element_size()
        return 2 * self.num_layers * self.block_size * self.num_kv_heads * self.cache_head_dim * elem


def plan_kv_groups(layer_windows: Sequence[int | None]) -> list[KVCacheGroup]:
    """Split layers into groups of one kind and equal size (the smallest kind's count), global groups first,
    so any block of the pool can serve any group. One window kind (every Llama): one group of every layer.

        Gemma 3 270M: 18 layers, every 6th global -> 3 global + 15 windowed
        -> [5 11 17] (global), [0 1 2], [3 4 6], [7 8 9], [10 12 13], [14 15 16] (window 512)
    """
    kinds: dict[int | None, list[int]] = {}
    for i, w in enumerate(layer_windows):
        kinds.setdefault(w, []).append(i)
    size = min(len(v) for v in kinds.values())
    groups = []
    for w in sorted(kinds, key=lambda w: (w is not None, w or 0)):
        layers = kinds[w]
        groups.extend(KVCacheGroup(tuple(layers[i : i + size]), w) for i in range(0, len(layers), size))
    return groups


_DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "float": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
    "half": torch.float16,
}


def auto_dtype(device: str = "cpu") -> torch.dtype:
    """What dtype "auto" means on `device`. CPU: bfloat16 where tokenmill's bf16 is batch-invariant (an
    AMX CPU with the C++ kernels: greedy output then does not depend on batching, chunking, prefix hits,
    preemption or speculation, docs/native_kernels.md), else float32. CUDA: bfloat16 where the GPU has
    it, else float16 (vLLM's choice for a float32 or float16 checkpoint)."""
    if device.startswith("cuda"):
        return torch.bfloat16 if torch.cuda.is_available() and torch.cuda.is_bf16_supported() else torch.float16
    from tokenmill import native  # lazy: loading the kernels is not needed to validate a config

    return torch.bfloat16 if native.has_amx() else torch.float32


def _gguf_file_runs_natively(model: str) -> bool:
    """ModelConfig.runs_gguf_natively for a model name: an integer kernel at the ISA level in force (asked each
    time: tests cap the level) and a file whose weight matrices are all in served block formats (read once)."""
    from tokenmill.quant.gguf import kernel_name  # lazy: config loads no kernels

    return kernel_name() != "none" and _gguf_file_all_blocks(model)


@functools.cache
def _gguf_file_all_blocks(model: str) -> bool:
    from tokenmill.models.loader import gguf_file_in_served_blocks, resolve_model_path  # lazy: config loads no models

    try:
        path = resolve_model_path(model)
    except Exception:  # noqa: BLE001 - an unknown model fails where it is loaded, with its own message
        return False
    return path.is_file() and gguf_file_in_served_blocks(path)


def parse_dtype(dtype: str | torch.dtype, device: str = "cpu") -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype == "auto":
        return auto_dtype(device)
    try:
        return _DTYPES[dtype]
    except KeyError:
        raise ValueError(f"dtype must be one of auto, {', '.join(sorted(_DTYPES))}; got {dtype!r}") from None


@dataclass(frozen=True)
class ModelConfig:
    model: str = DEFAULT_MODEL_ALIAS
    """Path to a GGUF file or Hugging Face checkpoint directory, or the alias of the default model."""
    dtype: str = "auto"
    """Weights and activations dtype: auto (bfloat16 where bf16 is batch-invariant on this CPU: a GGUF file whose
    weights all run on the integer kernels (AVX2 or better), or any model on a CPU with AMX; bfloat16 on GPUs;
    float32 otherwise), float32, bfloat16, float16."""
    max_model_len: int | None = None
    """Longest prompt + output in tokens; defaults to the model's context length."""
    device: str = "cpu"
    """Torch device: cpu or cuda."""
    seed: int = 0
    """Seed of the engine's global random stream (requests without their own seed)."""
    quantize_lm_head: str = "auto"
    """The LM head / tied embedding at load: auto (the checkpoint's own quantized head when it has one,
    from `tokenmill quantize --lm-head`; else RTN int8 for quantized checkpoints on CPU in bf16/fp16),
    int8 or int4 (RTN from the fp16 table), or none (the fp16 table as is)."""

    gguf_dequantize: bool = False
    """GGUF files: dequantize every quantized tensor to the model dtype at load, as before (llama.cpp's Q4_0 ..
    Q6_K blocks otherwise stay as the file holds them and run on integer kernels; quant/gguf.py)."""

    tensor_parallel_size: int = 1
    """Split the model over this many processes on this host (torch.distributed gloo; distributed/tensor_parallel.py):
    heads, MLP columns and the LM head's vocabulary are divided; it must divide the query and KV head counts."""
    distributed_executor_backend: str = "uni"
    """Where the model runner runs (worker/executor.py): uni (in the engine's process) or mp (a spawned process,
    driven over a pipe; the engine's process keeps the scheduler, detokenizing and the server). Tensor parallelism
    always spawns its ranks."""
    tensor_parallel_gloo_only: bool = False
    """Tensor parallelism: send every all-reduce through gloo, not the shared-memory fast path between the ranks
    (for comparison; the fast path is the default)."""
    batch_invariant: bool | None = None
    """Give each request's tokens the same bits whatever else is batched or how its prompt is chunked:
    prompt chunks attended token by token like decodes (not by the faster tiled prefill kernel). Unset:
    on where the linears are batch-invariant too (float32; bf16 on AMX or AVX2-only CPUs), off where
    they are not (bf16 on AVX-512 without AMX), since per-token attention alone does not make bf16
    invariant there and costs prefill speed (docs/native_kernels.md)."""

    def __post_init__(self) -> None:
        if self.dtype != "auto":
            parse_dtype(self.dtype)
        if self.quantize_lm_head not in ("auto", "none", "int8", "int4"):
            raise ValueError(f"quantize_lm_head must be one of auto, none, int8, int4; got {self.quantize_lm_head!r}")
        if self.max_model_len is not None and self.max_model_len < 1:
            raise ValueError(f"max_model_len must be >= 1, got {self.max_model_len}")
        if self.distributed_executor_backend not in ("uni", "mp"):
            raise ValueError(
                f"distributed_executor_backend must be uni or mp, got {self.distributed_executor_backend!r}"
            )
        if self.tensor_parallel_size < 1:
            raise ValueError(f"tensor_parallel_size must be >= 1, got {self.tensor_parallel_size}")

    @property
    def torch_dtype(self) -> torch.dtype:
        if self.dtype == "auto" and self.runs_gguf_natively:
            return torch.bfloat16  # every linear on the integer kernels: batch-invariant, and faster than float32
        return parse_dtype(self.dtype, self.device)

    @property
    def runs_gguf_natively(self) -> bool:
        """The model is a GGUF file whose every weight matrix runs in its blocks on this CPU's integer kernels
        (quant/gguf.py): not dequantized, on a CPU with AVX2 or better."""
        return not self.dequantizes_gguf and self.device == "cpu" and _gguf_file_runs_natively(self.model)

    @property
    def dequantizes_gguf(self) -> bool:
        """A GGUF file's quantized tensors are dequantized at load: asked for, or tensor parallelism (whose shards
        split dense weights)."""
        return self.gguf_dequantize or self.tensor_parallel_size > 1

    @property
    def bf16_linears_vary_with_batch(self) -> bool:
        """bf16 on a CPU whose dense bf16 linears are not batch-invariant (AVX-512 without AMX: oneDNN past the
        few-row kernel), where per-token prompt attention alone cannot make outputs independent of the batch."""
        if self.device.startswith("cuda") or self.torch_dtype != torch.bfloat16:
            return False
        from tokenmill import native  # lazy, as in auto_dtype

        return not (self.runs_gguf_natively or native.bf16_linears_batch_invariant())

    @property
    def attends_prompts_per_token(self) -> bool:
        """batch_invariant resolved: prompt chunks through the per-token decode kernel (True) or tiled. Unset:
        per token unless bf16_linears_vary_with_batch."""
        return not self.bf16_linears_vary_with_batch if self.batch_invariant is None else self.batch_invariant


DEFAULT_KV_TOKENS = 16384
"""The default KV pool's cap in tokens (CacheConfig.kv_cache_memory_fraction unset): room for 32 requests of 512
tokens, or one of 16K (llama.cpp's server defaults to 4,096). A fraction of free memory alone gave a 135M model
a 2.26 GiB pool on a 24 GiB host. A byte budget or an explicit fraction is taken as given."""


@dataclass(frozen=True)
class CacheConfig:
    block_size: int = 16
    """Tokens per KV-cache block."""
    kv_cache_memory_bytes: int | None = None
    """KV-cache budget in bytes; overrides kv_cache_memory_fraction."""
    kv_cache_memory_fraction: float | None = None
    """Fraction of free (device or host) memory given to the KV cache when no byte budget is set. Unset: the
    default rule, 0.1 of free memory but at most DEFAULT_KV_TOKENS (16,384) tokens of KV in every layer."""
    num_gpu_blocks_override: int | None = None
    """Exact number of KV blocks (tests)."""
    enable_prefix_caching: bool = True
    """Reuse KV blocks of identical prompt prefixes across requests."""
    kv_cache_dtype: str = "auto"
    """KV-cache element type: auto (model dtype) or int8."""

    def __post_init__(self) -> None:
        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a power of two >= 1, got {self.block_size}")
        if self.kv_cache_memory_fraction is not None and not 0 < self.kv_cache_memory_fraction <= 1:
            raise ValueError(f"kv_cache_memory_fraction must be in (0, 1], got {self.kv_cache_memory_fraction}")
        if self.kv_cache_memory_bytes is not None and self.kv_cache_memory_bytes <= 0:
            raise ValueError(f"kv_cache_memory_bytes must be > 0, got {self.kv_cache_memory_bytes}")
        if self.num_gpu_blocks_override is not None and self.num_gpu_blocks_override < 1:
            raise ValueError(f"num_gpu_blocks_override must be >= 1, got {self.num_gpu_blocks_override}")
        if self.kv_cache_dtype not in ("auto", "int8"):
            raise ValueError(f"kv_cache_dtype must be auto or int8, got {self.kv_cache_dtype!r}")


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = 64
    """Most requests running at once."""
    max_num_batched_tokens: int = 512
    """Token budget of one engine step (prefill chunks + decodes + draft tokens)."""
    enable_chunked_prefill: bool = True
    """Split prompts longer than the remaining budget across steps."""
    target_step_ms: float | None = None
    """Keep a step that runs prompt chunks beside decodes under this many milliseconds: its chunk is sized from
    a step-time model fitted to the steps so far (core/step_cost.py; until it has seen a few steps with prompt
    chunks, chunks are min_prefill_chunk tokens). Unset: only the token budget limits a step."""
    step_time_factor: float | None = None
    """Without target_step_ms: keep a step that runs prompt chunks beside decodes under this multiple of the
    predicted time of a decode-only step of the batch it is heading to: today's decodes plus the prompts in
    progress and waiting, up to max_num_seqs (2.0: a running stream's token takes at most about twice its
    plain decode step at full batch). A step with no decodes has no limit but the token budget; without
    chunked prefill it does nothing. Under either target the prompts with the fewest tokens left get the
    chunk first, the oldest at least min_prefill_chunk. `tokenmill serve` sets 2.0."""
    min_prefill_chunk: int = 16
    """With target_step_ms or step_time_factor: the fewest prompt tokens a step still computes, so a prompt
    progresses however busy decoding is."""

    def __post_init__(self) -> None:
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.max_num_batched_tokens < 1:
            raise ValueError(f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}")
        if self.target_step_ms is not None:
            if self.target_step_ms <= 0:
                raise ValueError(f"target_step_ms must be > 0, got {self.target_step_ms}")
            if not self.enable_chunked_prefill:
                raise ValueError("target_step_ms sizes prompt chunks: it needs chunked prefill")
        if self.step_time_factor is not None:
            if self.step_time_factor <= 1:
                raise ValueError(f"step_time_factor must be > 1, got {self.step_time_factor}")
        if self.min_prefill_chunk < 1:
            raise ValueError(f"min_prefill_chunk must be >= 1, got {self.min_prefill_chunk}")


@dataclass(frozen=True)
class TreeConfig:
    """Draft a token tree instead of a chain (spec_decode/tree.py): several guesses per position, verified
    in one target pass. In --speculative-config as `"tree": {"max_nodes": 12, ...}` (or `"tree": true`)."""

    max_nodes: int = 12
    """Most draft nodes per request per step (the step budget counts each node as one token)."""
    max_width: int = 3
    """Most children per node."""
    max_depth: int | None = None
    """Deepest node (default: num_speculative_tokens)."""

    def __post_init__(self) -> None:
        if not 1 <= self.max_nodes <= 14:
            raise ValueError(
                "speculative_config.tree.max_nodes must be in [1, 14] (a tree step of 1 + 14 tokens "
                "stays below TILED_PREFILL_MIN_TOKENS, in the per-token attention plan, "
                "attention/metadata.py)"
            )
        if self.max_width < 1:
            raise ValueError("speculative_config.tree.max_width must be >= 1")
        if self.max_depth is not None and self.max_depth < 1:
            raise ValueError("speculative_config.tree.max_depth must be >= 1")

    @classmethod
    def from_value(cls, v: Any) -> TreeConfig | None:
        if v is None or v is False:
            return None
        if v is True:
            return cls()
        if isinstance(v, TreeConfig):
            return v
        if not isinstance(v, dict):
            raise ValueError(f"speculative_config.tree must be true or an object, got {v!r}")
        known = {f.name for f in fields(cls)}
        unknown = set(v) - known
        if unknown:
            raise ValueError(f"unknown speculative_config.tree keys: {sorted(unknown)}; known: {sorted(known)}")
        return cls(**v)


@dataclass(frozen=True)
class SpeculativeConfig:
    method: str = "ngram"
    """Proposer: ngram, suffix (ngram plus an online store of what the server wrote, per cache_salt:
    spec_decode/suffix.py), draft_model, eagle (a trained EAGLE head; `tokenmill train-eagle`), medusa (trained
    Medusa heads drafting a static token tree; `tokenmill train-medusa`) or dflash (a block drafter proposing a
    whole block in one pass from several target layers' features; the default model's ships with tokenmill,
    `tokenmill train-drafter` trains others)."""
    num_speculative_tokens: int = 4
    """Largest number of draft tokens (gamma) per step."""
    model: str | None = None
    """Draft model path (draft_model), EAGLE head directory (eagle), Medusa heads directory (medusa) or block
    drafter directory (dflash; default: the one shipped for the target)."""
    prompt_lookup_max: int = 4
    """Longest n-gram matched by the n-gram proposer."""
    prompt_lookup_min: int = 1
    """Shortest n-gram matched by the n-gram proposer."""
    datastore: str | None = None
    """ngram: a suffix datastore of the target's own answers (`tokenmill build-datastore`) consulted
    when the request itself has no match of 2+ tokens (spec_decode/datastore.py). suffix: the seed, asked where
    the online store has nothing. medusa with a tree: the heads' guesses, prompt lookup and the datastore grow
    one tree."""
    datastore_min_share: float = 0.3
    """ngram with a datastore: draft a token only if it followed the context at least this often in
    the corpus (0.3 measured best of 0 / 0.3 / 0.5 on the default model, docs/spec_decode.md)."""
    adaptive: bool = True
    """Lower gamma (or switch speculation off) when measured acceptance or batch size says it does not pay."""
    draft_num_layers: int | None = None
    """Keep only this many layers of the draft model (its first N-1 and its last): a layer-truncated draft."""
    tree: TreeConfig | None = None
    """Draft token trees (ngram, suffix, medusa, eagle, dflash): several candidates per position, verified exactly
    in one pass (TreeConfig)."""
    suffix_max_tokens: int = 65536
    """suffix, and dflash's choice of source: the most tokens of served text the online store holds over all
    tenants (oldest requests evicted first; up to ~0.9 KB of memory per token); 0: dflash keeps no store."""
    choose_proposer: bool = True
    """dflash: per request and step, draft with the block drafter or with lookup (the request's own tokens, the
    online suffix store of its cache_salt, the datastore if given), whichever the measured acceptance predicts
    gives more tokens per target step (spec_decode/dflash.py); false: the block drafter only."""
    draft_weights: str = "auto"
    """dflash: the drafter's matrices when serving: q8_0 (int8 codes per 32 weights read by the GGUF integer
    kernel: about half the bytes of bf16, so a cheaper draft pass), dense (the checkpoint's values in the model
    dtype), or auto (q8_0 on a CPU whose integer kernel runs, else dense)."""

    def __post_init__(self) -> None:
        if self.draft_weights not in ("auto", "q8_0", "dense"):
            raise ValueError(
                f"speculative_config.draft_weights must be auto, q8_0 or dense, got {self.draft_weights!r}"
            )
        if self.method not in ("ngram", "suffix", "draft_model", "eagle", "medusa", "dflash"):
            raise ValueError(
                "speculative_config.method must be ngram, suffix, draft_model, eagle, medusa or dflash, "
                f"got {self.method!r}"
            )
        if self.suffix_max_tokens < 0:
            raise ValueError("speculative_config.suffix_max_tokens must be >= 0")
        if self.num_speculative_tokens < 1:
            raise ValueError("speculative_config.num_speculative_tokens must be >= 1")
        if self.method in ("draft_model", "eagle", "medusa") and not self.model:
            raise ValueError(f"speculative_config.model is required for method {self.method}")
        if self.draft_num_layers is not None and self.draft_num_layers < 1:
            raise ValueError("speculative_config.draft_num_layers must be >= 1")
        if self.datastore and self.method not in ("ngram", "suffix", "medusa", "dflash"):
            raise ValueError(
                "speculative_config.datastore backs the ngram and suffix proposers (and medusa and dflash's choice)"
            )
        if self.datastore and self.method == "medusa" and self.tree is None:
            raise ValueError("speculative_config.datastore with medusa needs a tree (the heads' guesses join it)")
        if not 0.0 <= self.datastore_min_share <= 1.0:
            raise ValueError("speculative_config.datastore_min_share must be in [0, 1]")
        if self.tree is not None and self.method not in ("ngram", "suffix", "medusa", "eagle", "dflash"):
            raise ValueError(
                f"speculative_config.tree: method {self.method} drafts chains only here "
                "(ngram, suffix, medusa, eagle and dflash draft trees)"
            )

    @property
    def tree_max_depth(self) -> int:
        return self.num_speculative_tokens if self.tree is None or self.tree.max_depth is None else self.tree.max_depth

    @property
    def reads_target_tables(self) -> bool:
        """The proposer's heads embed with the target's table and project onto its LM head (eagle, medusa,
        dflash)."""
        return self.method in ("eagle", "medusa", "dflash")

    @property
    def drafts_in_one_pass(self) -> bool:
        """The proposer drafts a whole chain or tree in one pass whatever its length (dflash): the adaptive
        controller prices a draft at c, not γ c."""
        return self.method == "dflash"

    @property
    def max_draft_tokens(self) -> int:
        """Most draft tokens a request carries in a step: gamma for chains, the node budget for trees."""
        return self.num_speculative_tokens if self.tree is None else self.tree.max_nodes

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> SpeculativeConfig:
        known = {f.name for f in fields(cls)}
        unknown = set(d) - known
        if unknown:
            raise ValueError(f"unknown speculative_config keys: {sorted(unknown)}; known: {sorted(known)}")
        if "tree" in d:
            d = {**d, "tree": TreeConfig.from_value(d["tree"])}
        return cls(**d)


@dataclass(frozen=True)
class KVTransferConfig:
    """Prefill/decode disaggregation (distributed/kv_connector.py): `--kv-role` plus `--kv-transfer-config` JSON."""

    kv_role: str = "both"
    """prefill: computes prompts and holds their K/V for decode workers; decode: pulls them and generates;
    both: either, per request."""
    kv_host: str = "127.0.0.1"
    """Address of this worker's KV endpoint (the TCP store decode workers pull from; prefill and both roles)."""
    kv_port: int = 0
    """Port of the KV endpoint (0: any free port; the worker reports it in kv_transfer_params)."""
    hold_timeout_s: float = 60.0
    """A prompt's K/V held for a decode worker go back to the pool if nobody pulled them within this."""
    transfer_timeout_s: float = 30.0
    """A pull (store wait, gloo send/recv) that takes longer fails; the decode worker then recomputes the prompt."""

    def __post_init__(self) -> None:
        if self.kv_role not in ("prefill", "decode", "both"):
            raise ValueError(f"kv_role must be prefill, decode or both, got {self.kv_role!r}")
        if not 0 <= self.kv_port < 65536:
            raise ValueError(f"kv_transfer_config.kv_port must be a port number, got {self.kv_port}")
        if self.hold_timeout_s <= 0 or self.transfer_timeout_s <= 0:
            raise ValueError("kv_transfer_config: hold_timeout_s and transfer_timeout_s must be positive")

    @property
    def serves_kv(self) -> bool:
        """Holds prompts' K/V for others to pull (hosts a KV endpoint)."""
        return self.kv_role in ("prefill", "both")

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> KVTransferConfig:
        known = {f.name for f in fields(cls)}
        unknown = set(d) - known
        if unknown:
            raise ValueError(f"unknown kv_transfer_config keys: {sorted(unknown)}; known: {sorted(known)}")
        return cls(**d)


@dataclass(frozen=True)
class EngineConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    speculative: SpeculativeConfig | None = None
    kv_transfer: KVTransferConfig | None = None
    """Disaggregation role and KV endpoint, or None (a colocated engine)."""

    @classmethod
    def from_kwargs(cls, **kwargs: Any) -> EngineConfig:
        """Build from flat vLLM-style keyword arguments (LLM(model=..., max_num_seqs=..., ...))."""
        groups: dict[str, dict[str, Any]] = {"model": {}, "cache": {}, "scheduler": {}}
        owners = {"model": ModelConfig, "cache": CacheConfig, "scheduler": SchedulerConfig}
        spec = kwargs.pop("speculative_config", None)
        kvt = kwargs.pop("kv_transfer_config", None)
        for key, value in kwargs.items():
            for group, klass in owners.items():
                if key in {f.name for f in fields(klass)}:
                    groups[group][key] = value
                    break
            else:
                raise TypeError(f"unknown engine argument {key!r}")
        if isinstance(spec, dict):
            spec = SpeculativeConfig.from_dict(spec)
        if isinstance(kvt, dict):
            kvt = KVTransferConfig.from_dict(kvt)
        return cls(
            model=ModelConfig(**groups["model"]),
            cache=CacheConfig(**groups["cache"]),
            scheduler=SchedulerConfig(**groups["scheduler"]),
            speculative=spec,
            kv_transfer=kvt,
        )
