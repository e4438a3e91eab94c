"""Shared fixtures: tiny random checkpoints (Llama-like and Qwen2-like) written as Hugging Face
directories, and the path of the real default model."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

# The suite never runs on a silent fallback: a missing or stale C++ build fails the tests that reach it.
os.environ.setdefault("TOKENMILL_REQUIRE_KERNELS", "1")

REPO = Path(__file__).resolve().parents[1]
SHARED_DATA = REPO.parent / "shared" / "data"

_HOST_ISA = {
    "none": "the C++ kernels are not loaded",
    "generic": "host has no AVX2",
    "avx2": "host has AVX2 only",
    "avx512": "host has AVX-512 without AVX512-BF16",
    "avx512_bf16": "host has AVX512-BF16, no AMX",
    "amx": "host has AMX-BF16",
}


def isa_skip_reason(what: str, needs: str) -> str:
    """The reason of a skip for a missing instruction set: what needs which ISA, and what this host has,
    e.g. "the int4 k64 kernel needs AVX512-BF16 (host has AVX2 only)", and the kernels' level where
    TOKENMILL_ISA or set_max_isa caps it below the host's."""
    from tokenmill import native

    level = native.isa()
    detected = level if level == "none" else native.module().detected_isa()
    capped = f"; kernels capped at {level}" if level != detected else ""
    return f"{what} needs {needs} ({_HOST_ISA[detected]}{capped})"


@pytest.fixture(scope="session")
def real_model_path() -> Path:
    from tokenmill.models.loader import resolve_model_path

    return resolve_model_path("smollm2-135m")


@pytest.fixture(scope="session")
def gguf_tokenizer():
    """The default model's tokenizer (real vocabulary), reused by the tiny models."""
    from tokenmill.models.loader import GGUFSource, resolve_model_path

    return GGUFSource(resolve_model_path("smollm2-135m")).tokenizer()


def write_tiny_checkpoint(path: Path, arch: str, tokenizer, seed: int = 0, **overrides) -> Path:
    """Random-weight HF checkpoint written by transformers itself (the oracle's own format)."""
    import transformers

    torch.manual_seed(seed)
    common = dict(
        vocab_size=tokenizer.vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        rms_norm_eps=1e-6,
        rope_theta=10000.0,
        bos_token_id=1,
        eos_token_id=2,
        tie_word_embeddings=False,
    )
    common.update(overrides)
    if arch == "llama":
        cfg = transformers.LlamaConfig(**common)
        model = transformers.LlamaForCausalLM(cfg)
    elif arch == "qwen2":
        cfg = transformers.Qwen2Config(**common)
        model = transformers.Qwen2ForCausalLM(cfg)
    elif arch == "qwen3":  # QK-norm, no biases, head_dim not hidden / heads
        cfg = transformers.Qwen3Config(**{"head_dim": 24, **common})
        model = transformers.Qwen3ForCausalLM(cfg)
    elif arch == "llama3":  # Llama 3.1's rope scaling, stretched so it bites within 512 positions
        cfg = transformers.LlamaConfig(
            **{
                **common,
                "rope_theta": 500000.0,
                "rope_scaling": {
                    "rope_type": "llama3",
                    "rope_theta": 500000.0,
                    "factor": 8.0,
                    "low_freq_factor": 1.0,
                    "high_freq_factor": 4.0,
                    "original_max_position_embeddings": 64,
                },
            }
        )
        model = transformers.LlamaForCausalLM(cfg)
    elif arch == "gemma3":  # 6 layers, every 6th global; an 8-token window so it bites within a short prompt
        cfg = transformers.Gemma3TextConfig(
            **{
                **common,
                "num_hidden_layers": 6,
                "head_dim": 16,
                "sliding_window": 8,
                "query_pre_attn_scalar": 16,
                "rope_theta": 1e6,
            }
        )
        model = transformers.Gemma3ForCausalLM(cfg)
    else:
        raise ValueError(arch)
    with torch.no_grad():  # larger weights than the default init so logits are far from uniform
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.8, 1.2)
            else:
                p.normal_(0, 0.15)
    model.save_pretrained(path, safe_serialization=True)
    tokenizer.hf.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "bos_token": tokenizer.special_tokens.get("bos_token"),
                "eos_token": tokenizer.special_tokens.get("eos_token"),
                "chat_template": tokenizer.chat_template,
            }
        )
    )
    return path


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory, gguf_tokenizer) -> Path:
    return write_tiny_checkpoint(tmp_path_factory.mktemp("tiny_llama"), "llama", gguf_tokenizer)


@pytest.fixture(scope="session")
def tiny_qwen2(tmp_path_factory, gguf_tokenizer) -> Path:
    return write_tiny_checkpoint(tmp_path_factory.mktemp("tiny_qwen2"), "qwen2", gguf_tokenizer, seed=1)


@pytest.fixture(scope="session")
def tiny_qwen3(tmp_path_factory, gguf_tokenizer) -> Path:
    return write_tiny_checkpoint(tmp_path_factory.mktemp("tiny_qwen3"), "qwen3", gguf_tokenizer, seed=2)


@pytest.fixture(scope="session")
def tiny_llama3(tmp_path_factory, gguf_tokenizer) -> Path:
    return write_tiny_checkpoint(tmp_path_factory.mktemp("tiny_llama3"), "llama3", gguf_tokenizer, seed=3)


@pytest.fixture(scope="session")
def tiny_gemma3(tmp_path_factory, gguf_tokenizer) -> Path:
    return write_tiny_checkpoint(tmp_path_factory.mktemp("tiny_gemma3"), "gemma3", gguf_tokenizer, seed=4)


def supported_isas() -> list[str]:
    """The instruction-set levels the C++ kernels can run at on this CPU, lowest first."""
    from tokenmill import native

    detected = native.module().detected_isa()
    return list(native.ISA_LEVELS[: native.ISA_LEVELS.index(detected) + 1])


@pytest.fixture(params=supported_isas())
def each_isa(request):
    """Runs the test once per instruction-set level this CPU supports (the kernels' generic paths too)."""
    from tokenmill import native

    previous = native.module().set_max_isa(request.param)
    yield request.param
    native.module().set_max_isa(previous)
