"""`tokenmill bench suite` (bench/suite.py, suite_entries.py, suite_readme.py): the CPU kind's name, the resume
logic around a fake runner, the goals' arithmetic, the README table from a hand-made record, README.md against
the committed records, and one quick entry end to end on the tiny model."""

from __future__ import annotations

import json

import pytest

from tokenmill.bench import suite, suite_readme
from tokenmill.bench.suite import StepFailed, cpu_kind, cpu_model_name, run_suite, select_entries
from tokenmill.bench.suite_entries import (
    ENTRY_NAMES,
    Entry,
    Outcome,
    Step,
    SuiteOptions,
    goal,
    headline_entries,
    load_bound,
    serving_goals,
    summarize_serving,
)
from tokenmill.entrypoints.cli import main

# ---------------------------------------------------------------------------------------------- the CPU kind


def test_cpu_model_name_from_cpuinfo():
    cpuinfo = "processor\t: 0\nvendor_id\t: AuthenticAMD\nmodel name\t: AMD EPYC 7B13 64-Core Processor\nflags\t: x\n"
    assert cpu_model_name(cpuinfo) == "AMD EPYC 7B13 64-Core Processor"
    assert cpu_model_name("processor : 0\n")  # no model name line: the platform's string or unknown-cpu


@pytest.mark.parametrize(
    "isa, name, kind",
    [
        ("avx512_bf16", "AMD EPYC", "avx512-bf16-amd-epyc"),
        ("avx2", "AMD EPYC 7B13 64-Core Processor", "avx2-amd-epyc-7b13"),
        ("amx", "Intel(R) Xeon(R) Platinum 8481C CPU @ 2.70GHz", "amx-intel-xeon-platinum-8481c"),
        ("avx512", "Intel(R) Xeon(R) CPU @ 2.20GHz", "avx512-intel-xeon"),
        ("none", "", "none-unknown-cpu"),
    ],
)
def test_cpu_kind(isa, name, kind):
    assert cpu_kind(isa, name) == kind


def test_entry_selection():
    assert select_entries(None, None) == list(ENTRY_NAMES)
    assert select_entries("roofline,decode_bf16", None) == ["decode_bf16", "roofline"]  # the suite's order
    assert select_entries(None, "serve_vs_vllm,perplexity") == [
        n for n in ENTRY_NAMES if n not in ("serve_vs_vllm", "perplexity")
    ]
    with pytest.raises(ValueError, match="unknown suite entries"):
        select_entries("decode_fp64", None)


def test_headline_entries_are_the_named_set():
    entries = headline_entries(SuiteOptions(vllm_reason="not installed"))
    assert [e.name for e in entries] == list(ENTRY_NAMES)
    assert all(s.command.startswith("tokenmill ") for e in entries for s in e.steps)
    # vLLM absent: the serving entry runs the bound and our server only; present: each dtype x binding
    serve = {e.name: e for e in entries}["serve_vs_vllm"]
    assert [s.name for s in serve.steps] == ["load bound", "tokenmill"]
    with_vllm = {e.name: e for e in headline_entries(SuiteOptions())}["serve_vs_vllm"]
    assert [s.name for s in with_vllm.steps][2:] == [
        "vllm bfloat16 all-cores",
        "vllm bfloat16 default",
        "vllm float32 all-cores",
        "vllm float32 default",
    ]
    assert all("--client vllm" in s.command for s in with_vllm.steps[1:])  # one client for both engines
    # a full run is sized to fit an hour on 2 cores, vLLM's four settings included
    assert sum(e.est_s for e in headline_entries(SuiteOptions())) < 3600


# ---------------------------------------------------------------------------------------------- resume
def _entry(name: str) -> Entry:
    return Entry(name, f"what {name}", (Step("s", ("bench", name)),), lambda out: Outcome("ok", {"x": out["s"]["x"]}))


class FakeRunner:
    """Stands in for the subprocess runner: returns canned outputs and records which steps ran."""

    def __init__(self, failing: set[str] = frozenset()) -> None:
        self.ran: list[str] = []
        self.failing = failing

    def __call__(self, step: Step) -> dict:
        name = step.argv[1]
        self.ran.append(name)
        if name in self.failing:
            raise StepFailed("exit 2: boom")
        return {"x": len(self.ran)}


def test_resume_skips_only_entries_ok_at_this_commit():
    record = {
        "entries": {
            "a": {"status": "ok", "commit": "c1", "figures": {"x": 0}},  # done: skipped
            "b": {"status": "ok", "commit": "c0", "figures": {"x": 0}},  # older commit: rerun
            "c": {"status": "failed", "commit": "c1", "reason": "x"},  # failed: rerun
            "d": {"status": "absent", "commit": "c1", "reason": "peer"},  # absent peer: rerun
        }
    }
    saved: list[list[str]] = []
    runner = FakeRunner()
    run_suite(
        [_entry(n) for n in "abcde"],
        record,
        commit="c1",
        dirty=False,
        runner=runner,
        save=lambda r: saved.append(sorted(r["entries"])),
        echo=lambda _: None,
    )
    assert runner.ran == ["b", "c", "d", "e"]
    assert len(saved) == 4  # the record is written after every entry that ran
    assert record["entries"]["a"]["figures"] == {"x": 0}
    assert all(record["entries"][n]["status"] == "ok" and record["entries"][n]["commit"] == "c1" for n in "bcde")
    assert record["entries"]["e"]["commands"] == ["tokenmill bench e --output-json OUT.json"]
    # --force reruns the entry already done
    runner = FakeRunner()
    run_suite([_entry("a")], record, commit="c1", dirty=False, runner=runner, force=True, echo=lambda _: None)
    assert runner.ran == ["a"]


def test_a_failed_step_is_recorded_and_the_suite_goes_on():
    record: dict = {}
    lines: list[str] = []
    bad_summary = Entry(
        "s", "summary misses a figure", (Step("s", ("bench", "s")),), lambda out: Outcome("ok", out["t"])
    )
    run_suite(
        [_entry("a"), bad_summary, _entry("b")],
        record,
        commit="c1",
        dirty=True,
        runner=FakeRunner(failing={"a"}),
        echo=lines.append,
    )
    e = record["entries"]
    assert e["a"]["status"] == "failed" and e["a"]["reason"] == "exit 2: boom" and e["a"]["dirty"] is True
    assert e["s"]["status"] == "failed" and e["s"]["reason"].startswith("summary: KeyError")
    assert e["b"]["status"] == "ok"
    assert lines[0].startswith("[1/3] a: what a") and any(line.startswith("[3/3] b: ok in") for line in lines)


# ---------------------------------------------------------------------------------------------- goals
def test_goal_arithmetic():
    g = goal("k", "output tok/s >= 1.2x vLLM's best", 226.7 / 183.5, 1.2, True)
    assert g["passed"] and g["by"] == pytest.approx(0.0295, abs=1e-3)  # 1.235x: 3% above the target
    g = goal("k", "ITL p99 <= vLLM's best", 292 / 192, 1.0, False)
    assert not g["passed"] and g["by"] == pytest.approx(0.521, abs=1e-3)  # 52% over
    g = goal("k", ">= 60% of the bound", 0.12, 0.6, True)
    assert not g["passed"] and g["by"] == pytest.approx(-0.8)  # 80% short
    assert goal("k", "x", None, 1.0, True, "vLLM absent")["passed"] is None
    assert suite_readme.goal_text(goal("itl", "ITL", 1.52, 1.0, False)) == "≤ 1x ❌ (52% over)"
    assert (
        suite_readme.goal_text(goal("fraction_of_bound", "b", 0.66, 0.6, True)) == "≥ 60% of the bound ✅ (10% margin)"
    )


# Issue 47's AVX2 trial: tokenmill bf16 226.7 out tok/s, ITL p50/p99 124/292 ms; vLLM float32 183.5, ITL 150/192.
OURS = {"output_tok_s": 226.7, "ttft_p50_ms": 219.0, "itl_p50_ms": 124.0, "itl_p99_ms": 292.0}
VLLM_FP32 = {"output_tok_s": 183.5, "ttft_p50_ms": 3900.0, "itl_p50_ms": 150.0, "itl_p99_ms": 192.0}
# bf16 SmolLM2-135M (tests/bench/test_roofline.py): 269,030,016 weight bytes, 23,040 K/V bytes per token
ROOFLINE = {
    "config": {"dtype": "bfloat16"},
    "bandwidth": {"read_gb_s": 32.7},
    "model": {"weight_bytes_per_step": 269_030_016, "kv_bytes_per_token": 23_040, "flops_per_token": 269_030_016},
    "linear_tflop_s": {"B=32": 0.061},
}


def test_serving_goals_on_issue_47s_avx2_figures():
    bound = load_bound(ROOFLINE, 400, 32)
    # 32 x 32.7e9 / (269,030,016 + 32 x 400 x 23,040) = 1,855.5 tok/s; the linears: 61e9 / 269.0e6 = 226.7
    assert bound["memory_tok_s"] == pytest.approx(32 * 32.7e9 / (269_030_016 + 32 * 400 * 23_040))
    assert bound["memory_tok_s"] == pytest.approx(1855.5, abs=0.1)
    assert bound["compute_tok_s"] == pytest.approx(226.7, abs=0.1) and "compute-bound" in bound["why"]
    best = {k: {"value": v, "setting": "float32 all-cores"} for k, v in VLLM_FP32.items()}
    goals = {g["key"]: g for g in serving_goals(OURS, best, bound["memory_tok_s"], bound["why"])}
    assert goals["throughput_vs_vllm"]["passed"] and goals["throughput_vs_vllm"]["value"] == pytest.approx(1.235, 1e-3)
    assert not goals["fraction_of_bound"]["passed"] and goals["fraction_of_bound"]["value"] == pytest.approx(
        0.122, 1e-2
    )
    assert "at most 227 tok/s, 12% of the memory bound" in goals["fraction_of_bound"]["why"]
    assert not goals["itl_p99_vs_vllm"]["passed"] and goals["itl_p99_vs_vllm"]["by"] == pytest.approx(0.521, 1e-3)
    assert not goals["itl_p99_over_median"]["passed"]  # 292 / 124 = 2.35x our median
    assert goals["itl_p99_over_median"]["by"] == pytest.approx(292 / 124 / 2 - 1)


def _serve_json(figures: dict, fallback: list[str] | None = None, runs: bool = True) -> dict:
    m = {
        "output_throughput": figures["output_tok_s"],
        "ttft_ms": {"median": figures["ttft_p50_ms"]},
        "itl_ms": {"median": figures["itl_p50_ms"], "p99": figures["itl_p99_ms"]},
        "tpot_ms": {"median": figures["itl_p50_ms"]},
        "completed": 64,
        "failed": 0,
        "total_input_tokens": 64 * 272,
        "total_output_tokens": 64 * 256,
    }
    return {"client": "vllm", "server": {"fallback_lines": fallback or []}, "runs": [{"metrics": m}] if runs else []}


def test_serving_summary_keeps_vllms_best_per_metric_and_never_a_fallback():
    bf16_fast_itl = {**VLLM_FP32, "output_tok_s": 45.7, "itl_p99_ms": 100.0}
    outputs = {
        "load bound": ROOFLINE,
        "tokenmill": _serve_json(OURS),
        "vllm bfloat16 all-cores": _serve_json(bf16_fast_itl, ["WARNING fallback to torch linear"], runs=False),
        "vllm float32 all-cores": _serve_json(VLLM_FP32),
        "vllm float32 default": _serve_json({**VLLM_FP32, "output_tok_s": 120.0, "ttft_p50_ms": 2000.0}),
    }
    steps = tuple(k for k in outputs if k.startswith("vllm"))
    out = summarize_serving(outputs, steps, None, 32)
    f = out.figures
    assert out.status == "ok"
    assert "fallback" in f["vllm_settings"]["bfloat16 all-cores"]["excluded"]
    assert f["vllm_best"]["output_tok_s"] == {"value": 183.5, "setting": "float32 all-cores"}
    assert f["vllm_best"]["ttft_p50_ms"] == {"value": 2000.0, "setting": "float32 default"}
    assert f["vllm_best"]["itl_p99_ms"]["value"] == 192.0  # not the fallback setting's 100
    assert f["tokenmill"]["mean_context"] == 272 + 128
    assert f["fraction_of_bound"]["vllm_best"] == pytest.approx(183.5 / f["bound"]["memory_tok_s"])
    # a linear rate timed below what the load reached explains nothing: no compute roof is claimed
    slow_linears = {**ROOFLINE, "linear_tflop_s": {"B=32": 0.03}}  # 30e9 / 269.0e6 = 111.5 tok/s < 226.7
    f = summarize_serving({**outputs, "load bound": slow_linears}, steps, None, 32).figures
    assert "why" not in f["bound"] and "no compute roof is claimed" in f["bound"]["compute_note"]
    assert "why" not in f["goals"][1]
    # vLLM absent here: our figures and the goals that need no peer, status absent with the reason
    absent = summarize_serving({"load bound": ROOFLINE, "tokenmill": _serve_json(OURS)}, (), "vLLM not installed", 32)
    assert absent.status == "absent" and absent.reason == "vLLM: vLLM not installed"
    assert [g["passed"] for g in absent.figures["goals"]] == [None, False, None, False]


# ---------------------------------------------------------------------------------------------- README
def hand_made_record() -> dict:
    def entry(status: str, figures: dict, reason: str | None = None, commands: tuple[str, ...] = ("tokenmill x",)):
        e = {"status": status, "figures": figures, "commands": list(commands), "what": "w: x", "commit": "c" * 40}
        return {**e, "reason": reason} if reason else e

    decode = {"dtype": "bfloat16", "output_len": 128, "decode_tok_s": 71.9}
    serve = summarize_serving(
        {"load bound": ROOFLINE, "tokenmill": _serve_json(OURS), "vllm float32 all-cores": _serve_json(VLLM_FP32)},
        ("vllm float32 all-cores",),
        None,
        32,
    )
    entries = {
        "decode_bf16": entry("ok", decode, commands=("tokenmill bench latency --dtype bfloat16",)),
        "decode_float32": entry("ok", {**decode, "dtype": "float32", "decode_tok_s": 47.9}),
        "decode_gguf_vs_llamacpp": entry(
            "ok",
            {
                **decode,
                "dtype": "float32",
                "decode_tok_s": 47.9,
                "llamacpp": {"decode_tok_s": 98.0},
                "ratio_vs_llamacpp": 0.489,
            },
        ),
        "decode_int8_rtn": entry(
            "ok", {**decode, "decode_tok_s": 7.9}, commands=("tokenmill quantize 8", "tokenmill l8")
        ),
        "decode_int4_rtn": entry("failed", {}, "exit 1: int4 kernel missing", commands=("tokenmill quantize 4",)),
        "roofline": entry("ok", {"read_gb_s": 32.7, "measured_tok_s": 71.0, "bound_tok_s": 120.6, "fraction": 0.589}),
        "serve_vs_vllm": {**entry("ok", serve.figures), "what": "32-stream serving, 64 chats: tokenmill vs vLLM"},
        "prefix_cache": entry(
            "ok", {"workload": "16 requests", "cold_ttft_ms": 11995.0, "cached_ttft_ms": 315.0, "ttft_ratio": 38.08}
        ),
        "chunked_prefill": entry(
            "ok",
            {
                "workload": "16 streams + 2,000 tokens",
                "on": {"itl_p99_ms": 52.0, "itl_max_ms": 37.0, "max_num_batched_tokens": 32},
                "off": {"itl_p99_ms": 60.0, "itl_max_ms": 937.0},
                "itl_p99_ratio": 1.15,
                "itl_max_ratio": 25.3,
            },
        ),
        "speculation": entry(
            "ok",
            {
                "workload": "batch 1, 4 chats",
                "plain_tok_s": 70.0,
                "methods": {"ngram": {"decode_tok_s": 91.0, "speedup": 1.3}},
                "absent": {"eagle": "no --eagle DIR; train one: tokenmill train-eagle ..."},
            },
        ),
        "perplexity": entry(
            "ok",
            {"windows": 8, "seqlen": 2048, "float32": 19.134, "rtn_int8": 19.1, "rtn_int4": 25.385}
            | {"rtn_int8_delta": -0.034, "rtn_int4_delta": 6.251},
        ),
    }
    return {
        "schema": 1,
        "cpu_kind": "avx2-amd-epyc",
        "host": {"isa": "avx2", "model_name": "AMD EPYC", "cores": 2, "threads": 2, "read_gb_s": 32.7},
        "date": "2026-12-06",
        "commit": "c" * 40,
        "dirty": False,
        "model": "smollm2-135m",
        "entries": entries,
    }


def test_readme_table_from_a_hand_made_record():
    text = suite_readme.render_readme_table([hand_made_record()])
    lines = text.splitlines()
    rows = [line for line in lines if line.startswith("| ") and not line.startswith("| what")]
    assert len(rows) == 12 <= suite_readme.MAX_ROWS
    assert lines[0] == "### avx2-amd-epyc"
    assert "AMD EPYC, kernels at avx2, 2 cores, 2 threads; read bandwidth 32.7 GB/s" in text
    assert "| single-stream decode, bf16, dense weights (128 new tokens) | 71.9 tok/s |  |  |  | [1] |" in rows
    assert any("llama.cpp 98.0 tok/s | 0.49x" in r for r in rows)
    assert any(r.startswith("| w: x | failed: exit 1: int4 kernel missing |") and r.endswith("[4] |") for r in rows)
    assert any("226.7 tok/s, TTFT 219 ms" in r and "1.24x" in r and "≥ 1.2x ✅ (3% margin)" in r for r in rows)
    assert any("292 (124) ms" in r and "≤ 1x ❌ (52% over); ≤ 2x ❌ (18% over)" in r for r in rows)
    assert any("12% of 1,856 tok/s" in r and "≥ 60% of the bound ❌ (80% short)" in r for r in rows)
    assert any("cached 315 ms | cold 11,995 ms | 38.08x lower" in r for r in rows)
    assert any("not run: eagle (no trained artefacts)" in r and "ngram 1.30x" in r for r in rows)
    assert any("19.100 / 25.385 | float32 19.134 | -0.034 / +6.251" in r for r in rows)
    # each row's commands as a footnote: the int8 and int4 entries share one row and one footnote
    assert "[1] `tokenmill bench latency --dtype bfloat16`" in lines
    assert "[4] `tokenmill quantize 8`; `tokenmill l8`; `tokenmill quantize 4`" in lines
    assert text.count("\n[") == 10


def test_host_line_names_each_commit_of_a_partial_rerun():
    record = hand_made_record()
    one = suite_readme.render_readme_table([record])
    assert "at commit cccccccccc;" in one and "several commits" not in one
    record["entries"]["decode_bf16"] = {
        **record["entries"]["decode_bf16"],
        "commit": "d" * 40,
        "date": "2026-12-07 03:07",
    }
    mixed = suite_readme.render_readme_table([record])
    assert "entries recorded at several commits: dddddddddd on 2026-12-07 (decode_bf16); cccccccccc on" in mixed


def test_readme_block_without_records_and_the_markers():
    block = suite_readme.readme_block([])
    assert block.startswith(suite_readme.START) and block.endswith(suite_readme.END)
    assert suite_readme.NO_RECORD in block
    readme = f"intro\n{suite_readme.START}\nold\n{suite_readme.END}\nafter\n"
    assert suite_readme.replace_block(readme, block) == f"intro\n{block}\nafter\n"
    with pytest.raises(ValueError, match="no"):
        suite_readme.replace_block("no markers", block)


def test_readme_matches_the_committed_records():
    """README.md's table is what the committed benchmarks/results/*.json give (none yet: the no-record text).
    Fix a failure with `tokenmill bench suite --write-readme`."""
    records = suite_readme.load_records(suite.RESULTS_DIR)
    readme = suite_readme.README.read_text()
    assert suite_readme.current_block(readme) == suite_readme.readme_block(records)


# ---------------------------------------------------------------------------------------------- end to end
def test_quick_entry_end_to_end_then_resumed(tiny_llama, tmp_path, capsys):
    argv = ["bench", "suite", "--quick", "--only", "decode_bf16", "--model", str(tiny_llama)]
    argv += ["--engine-args", "--max-model-len 256 --num-gpu-blocks-override 128"]
    argv += ["--results-dir", str(tmp_path / "results"), "--work-dir", str(tmp_path / "work")]
    assert main(argv) == 0
    (path,) = (tmp_path / "results").glob("*.json")
    record = json.loads(path.read_text())
    assert path.stem == record["cpu_kind"] and record["quick"] is True
    e = record["entries"]["decode_bf16"]
    assert e["status"] == "ok" and e["figures"]["decode_tok_s"] > 0 and e["figures"]["dtype"] == "bfloat16"
    assert e["commands"][0].startswith("tokenmill bench latency --model ") and "--output-len 8" in e["commands"][0]
    assert "[1/1] decode_bf16: ok in" in capsys.readouterr().out
    assert main(argv) == 0  # the second run finds it done at this commit
    assert "ok at" in capsys.readouterr().out and json.loads(path.read_text())["entries"]["decode_bf16"] == e
