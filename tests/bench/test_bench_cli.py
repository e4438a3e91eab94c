"""`tokenmill bench ...` end to end on a tiny random model (peers off): the plumbing, not the numbers."""

from __future__ import annotations

import json

import pytest

from tokenmill.entrypoints.cli import main

ENGINE = ["--max-model-len", "256", "--num-gpu-blocks-override", "128"]


def run_json(tmp_path, argv: list[str]) -> dict:
    out = tmp_path / "r.json"
    assert main(argv + ["--output-json", str(out)]) == 0
    return json.loads(out.read_text())


def test_latency(tiny_llama, tmp_path, capsys):
    r = run_json(
        tmp_path,
        [
            "bench",
            "latency",
            "--model",
            str(tiny_llama),
            *ENGINE,
            "--input-len",
            "8",
            "--output-len",
            "6",
            "--num-iters",
            "2",
            "--peers",
            "hf,llamacpp",
        ],
    )
    ours = r["tokenmill"]
    assert ours["num_tokens"] == 6 and ours["decode_tok_s"] > 0 and len(ours["decode_tok_s_runs"]) == 2
    assert r["hf"]["num_tokens"] == 6 and r["ratio_vs_hf"] > 0
    assert r["hf"]["greedy_prefix_match"] == 6  # fp32 tiny model: same greedy tokens as HF
    if r["llamacpp"].get("available") is False:
        # absent because the wheel is missing, or (when installed) because this model is not a GGUF file
        assert "llama-cpp-python" in r["llamacpp"]["reason"] or "GGUF files only" in r["llamacpp"]["reason"]
    assert "decode tok/s" in capsys.readouterr().out


def test_throughput_random(tiny_llama, tmp_path):
    r = run_json(
        tmp_path,
        [
            "bench",
            "throughput",
            "--model",
            str(tiny_llama),
            *ENGINE,
            "--dataset-name",
            "random",
            "--num-prompts",
            "5",
            "--input-len",
            "12",
            "--output-len",
            "7",
            "--range-ratio",
            "0.5",
            "--peers",
            "hf",
            "--hf-max-batch-size",
            "2",
        ],
    )
    assert r["tokenmill"]["num_requests"] == 5 and r["tokenmill"]["output_tok_s"] > 0
    assert r["hf"]["num_batches"] == 3 and r["hf"]["output_tokens"] == r["tokenmill"]["output_tokens"]


def test_roofline_bound_only(tiny_llama, tmp_path):
    r = run_json(
        tmp_path,
        ["bench", "roofline", "--model", str(tiny_llama), *ENGINE, "--buffer-mib", "64", "--no-measure-engine"],
    )
    assert r["bandwidth"]["read_gb_s"] > 0 and r["model"]["weight_bytes_per_step"] > 0
    assert r["single_stream_bound_tok_s"] > 0 and r["model"]["flops_per_token"] > 0
    # the engine's own linears, timed at each batch above 1; batch 1 is bandwidth bound
    assert set(r["linear_tflop_s"]) == {"B=4", "B=16", "B=64"} and min(r["linear_tflop_s"].values()) > 0
    b1 = r["batch_bounds"]["B=1,ctx=512"]
    assert b1["binding"] == "memory" and b1["compute_tok_s"] is None
    assert all(b["compute_tok_s"] > 0 for k, b in r["batch_bounds"].items() if k != "B=1,ctx=512")


def test_ablation_rows(tiny_llama, tmp_path):
    r = run_json(
        tmp_path,
        [
            "bench",
            "ablation",
            "--model",
            str(tiny_llama),
            *ENGINE,
            "--dataset-name",
            "random",
            "--num-prompts",
            "4",
            "--input-len",
            "10",
            "--output-len",
            "5",
            "--range-ratio",
            "0.5",
            "--only",
            "batching,chunked_prefill,prefix_caching",
            "--static-batch-size",
            "2",
            "--num-streams",
            "2",
            "--long-prompt-len",
            "100",
            "--chunk-budget",
            "32",
            "--stream-tokens",
            "12",
            "--shared-prefix-len",
            "48",
            "--plot-dir",
            str(tmp_path / "plots"),
        ],
    )
    assert r["batching"]["speedup"] > 0
    png = tmp_path / "plots" / "ablation.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"  # one bar per row that ran
    assert r["chunked_prefill"]["on"]["max_num_batched_tokens"] == 32
    assert r["prefix_caching"]["on"]["cached_prompt_tokens"] > 0 == r["prefix_caching"]["off"]["cached_prompt_tokens"]


def test_ablation_speculation_methods_on_held_out_chats(tiny_llama, tmp_path):
    methods = {f"ngram{k}": {"method": "ngram", "num_speculative_tokens": k} for k in (4, 2)}
    r = run_json(
        tmp_path,
        ["bench", "ablation", "--model", str(tiny_llama), *ENGINE, "--only", "speculation", "--plot-dir", ""]
        + ["--spec-workload", "chat", "--spec-num-prompts", "2", "--spec-output-len", "6"]
        + ["--spec-methods", json.dumps(methods)],
    )
    s = r["speculation"]
    assert s["methods"] == ["ngram4", "ngram2"] and s["off"]["decode_tok_s"] > 0
    for name in s["methods"]:  # each method against the one plain run of the same process
        assert s[name]["speedup"] == pytest.approx(s[name]["decode_tok_s"] / s["off"]["decode_tok_s"])
        assert s[name]["config"] == methods[name]
    assert s["speedup"] == s["ngram4"]["speedup"] and "2 held-out ShareGPT chats" in s["workload"]


def test_bad_dataset_path_is_a_clear_error(tiny_llama, capsys):
    assert (
        main(
            [
                "bench",
                "throughput",
                "--model",
                str(tiny_llama),
                *ENGINE,
                "--dataset",
                "/nonexistent.jsonl",
                "--peers",
                "none",
            ]
        )
        == 2
    )
    assert "--dataset" in capsys.readouterr().err


@pytest.mark.parametrize("sub", ["latency", "throughput", "serve", "roofline", "ablation", "suite"])
def test_help(sub, capsys):
    with pytest.raises(SystemExit) as e:
        main(["bench", sub, "--help"])
    assert e.value.code == 0
