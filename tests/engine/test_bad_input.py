"""Bad input: clear errors that name the parameter; nothing leaks."""

from __future__ import annotations

import shutil

import pytest

from tokenmill import LLM, SamplingParams
from tokenmill.models.loader import ModelLoadError, load_model


@pytest.mark.parametrize(
    "kwargs, name",
    [
        (dict(max_tokens=-1), "max_tokens"),
        (dict(prompt_logprobs=-1), "prompt_logprobs"),
        (dict(max_tokens=0, pooling="cls"), "pooling"),
        (dict(temperature=-0.1), "temperature"),
        (dict(top_p=0.0), "top_p"),
        (dict(top_p=1.5), "top_p"),
        (dict(top_k=-3), "top_k"),
        (dict(min_p=2.0), "min_p"),
        (dict(n=0), "n"),
        (dict(presence_penalty=3.0), "presence_penalty"),
        (dict(logprobs=50), "logprobs"),
        (dict(min_tokens=10, max_tokens=5), "min_tokens"),
        (dict(stop=[""]), "stop"),
    ],
)
def test_sampling_params_errors_name_the_field(kwargs, name):
    with pytest.raises(ValueError, match=name):
        SamplingParams(**kwargs)


@pytest.fixture(scope="module")
def tiny_llm(tiny_llama):
    return LLM(model=str(tiny_llama), max_model_len=128, num_gpu_blocks_override=64)


def test_empty_prompt(tiny_llm):
    with pytest.raises(ValueError, match="prompt is empty"):
        tiny_llm.generate([[]], SamplingParams(max_tokens=4))
    tiny_llm.check_integrity()


def test_prompt_longer_than_max_model_len(tiny_llm):
    with pytest.raises(ValueError, match="max_model_len"):
        tiny_llm.generate(["word " * 200], SamplingParams(max_tokens=4))
    tiny_llm.check_integrity()


def test_prompt_plus_max_tokens_too_long(tiny_llm):
    with pytest.raises(ValueError, match="max_tokens"):
        tiny_llm.generate(["hello"], SamplingParams(max_tokens=200))
    tiny_llm.check_integrity()


def test_bad_request_in_a_batch_leaks_nothing(tiny_llm):
    with pytest.raises(ValueError):
        tiny_llm.generate(["fine prompt", [], "another"], SamplingParams(max_tokens=4))
    tiny_llm.check_integrity()
    out = tiny_llm.generate(["fine prompt"], SamplingParams(max_tokens=4, temperature=0))
    assert len(out[0].outputs[0].token_ids) == 4
    tiny_llm.check_integrity()


def test_token_ids_out_of_vocab(tiny_llm):
    with pytest.raises(ValueError, match="token ids"):
        tiny_llm.generate([[1, 10**9]], SamplingParams(max_tokens=2))
    tiny_llm.check_integrity()


def test_request_larger_than_pool(tiny_llama):
    llm = LLM(model=str(tiny_llama), max_model_len=512, num_gpu_blocks_override=2, block_size=16)
    with pytest.raises(ValueError, match="KV blocks"):
        llm.generate(["hello"], SamplingParams(max_tokens=100))
    llm.check_integrity()


def test_unknown_model_path(tmp_path):
    with pytest.raises(ModelLoadError, match="no such file"):
        LLM(model=str(tmp_path / "nope.gguf"))


def test_unsupported_architecture(tiny_llama, tmp_path):
    d = tmp_path / "gpt2"
    shutil.copytree(tiny_llama, d)
    cfg = (d / "config.json").read_text().replace("LlamaForCausalLM", "GPT2LMHeadModel")
    (d / "config.json").write_text(cfg)
    with pytest.raises(ModelLoadError, match="unsupported architecture 'GPT2LMHeadModel'.*LlamaForCausalLM"):
        load_model(str(d))


def test_missing_config(tmp_path):
    with pytest.raises(ModelLoadError, match="config.json: missing"):
        load_model(str(tmp_path))


def test_truncated_safetensors(tiny_llama, tmp_path):
    d = tmp_path / "trunc"
    shutil.copytree(tiny_llama, d)
    f = d / "model.safetensors"
    data = f.read_bytes()
    f.write_bytes(data[: len(data) // 2])
    with pytest.raises(ModelLoadError, match="model.safetensors"):
        load_model(str(d))


def test_truncated_gguf(real_model_path, tmp_path):
    f = tmp_path / "trunc.gguf"
    with open(real_model_path, "rb") as src:
        f.write_bytes(src.read(5_000_000))
    with pytest.raises(ModelLoadError, match="trunc.gguf"):
        load_model(str(f))


def test_not_a_gguf(tmp_path):
    f = tmp_path / "weights.bin"
    f.write_bytes(b"\x00" * 1000)
    with pytest.raises(ModelLoadError, match="not a GGUF"):
        load_model(str(f))


def test_unsupported_tensor_type(tmp_path):
    gguf = pytest.importorskip("gguf")
    import numpy as np

    from tokenmill.models.loader import GGUFSource

    f = tmp_path / "odd.gguf"
    w = gguf.GGUFWriter(str(f), "llama")
    w.add_block_count(1)
    # raw bytes labelled with a type the gguf package cannot dequantize in numpy
    qtype = gguf.GGMLQuantizationType.Q8_1
    block_bytes = gguf.GGML_QUANT_SIZES[qtype][1]
    w.add_tensor(
        "token_embd.weight", np.zeros((4, block_bytes), dtype=np.uint8), raw_shape=(4, block_bytes), raw_dtype=qtype
    )
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    src = GGUFSource(f)
    src.arch = "llama"
    src.config = lambda: None  # only the tensor decoding is under test here
    with pytest.raises(ModelLoadError, match="token_embd.weight.*Q8_1"):
        list(src.tensors())
