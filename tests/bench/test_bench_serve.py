"""bench serve against a tiny stub OpenAI endpoint (no model): SSE parsing, vLLM's metric
definitions, goodput, arrivals, concurrency cap, table/JSON/plots; plus the dataset filter."""
# NOTE: no `from __future__ import annotations`: FastAPI must see the stub handler's Request type.

import argparse
import asyncio
import json
import math
import sys
import threading
import time
from pathlib import Path

import pytest

from tokenmill.bench import serve
from tokenmill.bench.common import SampleRequest, is_valid_sharegpt_pair, percentile, summarize

NUM_CHUNKS = 5
CHUNK_DELAY = 0.02


def make_stub_app(state: dict):
    from fastapi import FastAPI, Request
    from fastapi.responses import JSONResponse, StreamingResponse

    app = FastAPI()

    @app.get("/health")
    async def health():
        return JSONResponse({})

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": "stub-model", "object": "model"}]}

    @app.post("/v1/completions")
    async def completions(req: Request):
        body = await req.json()
        state["bodies"].append(body)
        state["in_flight"] += 1
        state["max_in_flight"] = max(state["max_in_flight"], state["in_flight"])
        n = min(body["max_tokens"], NUM_CHUNKS)

        async def gen():
            try:
                await asyncio.sleep(CHUNK_DELAY)
                for i in range(n):
                    chunk = {"id": "x", "object": "text_completion", "choices": [{"index": 0, "text": f"t{i} "}]}
                    yield f"data: {json.dumps(chunk)}\n\n"
                    await asyncio.sleep(CHUNK_DELAY)
                usage = {
                    "id": "x",
                    "choices": [],
                    "usage": {"prompt_tokens": 3, "completion_tokens": n, "total_tokens": n + 3},
                }
                yield f"data: {json.dumps(usage)}\n\n"
                yield "data: [DONE]\n\n"
            finally:
                state["in_flight"] -= 1

        return StreamingResponse(gen(), media_type="text/event-stream")

    return app


@pytest.fixture(scope="module")
def stub_server():
    import uvicorn

    state = {"bodies": [], "in_flight": 0, "max_in_flight": 0}
    port = serve.free_port()
    server = uvicorn.Server(uvicorn.Config(make_stub_app(state), host="127.0.0.1", port=port, log_level="error"))
    t = threading.Thread(target=server.run, daemon=True)
    t.start()
    deadline = time.time() + 30
    while not server.started and time.time() < deadline:
        time.sleep(0.05)
    assert server.started
    yield f"http://127.0.0.1:{port}", state
    server.should_exit = True
    t.join(timeout=10)


def _requests(n: int, out_len: int = NUM_CHUNKS) -> list[SampleRequest]:
    return [SampleRequest(f"prompt {i}", [1, 2, 3], out_len) for i in range(n)]


def test_streaming_metrics_follow_vllm_definitions(stub_server):
    url, state = stub_server
    results, duration = asyncio.run(
        serve.run_load(url, "stub-model", _requests(4), math.inf, "poisson", None, ignore_eos=True)
    )
    assert all(r.success for r in results), [r.error for r in results]
    for r in results:
        assert r.output_tokens == NUM_CHUNKS  # from the usage block
        assert len(r.itl) == NUM_CHUNKS - 1  # one gap per later chunk
        assert r.ttft >= CHUNK_DELAY * 0.8
        assert r.latency == pytest.approx(r.ttft + sum(r.itl), rel=1e-6)
        assert r.generated_text == "".join(f"t{i} " for i in range(NUM_CHUNKS))
    body = state["bodies"][-1]
    assert body["stream"] and body["ignore_eos"] and body["model"] == "stub-model" and body["max_tokens"] == NUM_CHUNKS
    m = serve.calculate_metrics(results, duration, {"ttft": 10_000, "tpot": 10_000})
    assert m["completed"] == 4 and m["failed"] == 0
    assert m["total_output_tokens"] == 4 * NUM_CHUNKS and m["total_input_tokens"] == 12
    assert m["request_throughput"] == pytest.approx(4 / duration)
    assert m["output_throughput"] == pytest.approx(4 * NUM_CHUNKS / duration)
    tpots = [(r.latency - r.ttft) / (r.output_tokens - 1) * 1e3 for r in results]
    assert m["tpot_ms"]["mean"] == pytest.approx(sum(tpots) / 4)
    assert m["itl_ms"]["median"] == pytest.approx(percentile([g * 1e3 for r in results for g in r.itl], 50))
    assert m["request_goodput"] == pytest.approx(4 / duration)  # loose SLOs: every request is good
    strict = serve.calculate_metrics(results, duration, {"ttft": 0.001})
    assert strict["request_goodput"] == 0.0


def test_concurrency_cap_and_rate(stub_server):
    url, state = stub_server
    state["max_in_flight"] = 0
    results, _ = asyncio.run(serve.run_load(url, "stub-model", _requests(6), math.inf, "poisson", 2))
    assert all(r.success for r in results)
    assert state["max_in_flight"] <= 2
    # fixed-rate arrivals: 5 requests at 20/s start >= 4 * 50 ms apart in total
    results, _ = asyncio.run(serve.run_load(url, "stub-model", _requests(5, 1), 20.0, "fixed", None))
    starts = sorted(r.start_time for r in results)
    assert starts[-1] - starts[0] >= 0.19


def test_http_errors_are_results_not_crashes():
    results, duration = asyncio.run(
        serve.run_load(f"http://127.0.0.1:{serve.free_port()}", "m", _requests(2), math.inf, "poisson", None, timeout=5)
    )
    assert not any(r.success for r in results) and all(r.error for r in results)
    assert serve.calculate_metrics(results, duration)["completed"] == 0


def test_sweep_table_json_and_plots(stub_server, tmp_path, capsys):
    pytest.importorskip("matplotlib")
    url, _ = stub_server
    args = argparse.Namespace(
        goodput=["ttft:1000"],
        metric_percentiles="50,99",
        endpoint="completions",
        ignore_eos=False,
        arrival="poisson",
        seed=0,
        api_key=None,
        share_prefix_cache=False,
    )
    url, state = stub_server
    state["bodies"].clear()
    serve.warm_up(url, "stub-model", _requests(1)[0], args)
    runs = serve.run_sweep(url, "stub-model", _requests(4), [50.0, math.inf], [None, 2], args)
    assert len(runs) == 4 and all(r["metrics"]["completed"] == 4 for r in runs)
    salts = [b.get("cache_salt") for b in state["bodies"][1:]]  # after the warm-up request: 4 per point
    assert len(set(salts)) == 4 and all(salts) and salts[:4] == [salts[0]] * 4  # one salt per sweep point
    serve.print_runs(runs, {"ttft": 1000})
    assert "goodput" in capsys.readouterr().out
    paths = serve.write_plots(runs, tmp_path)
    assert len(paths) == 2 and all((tmp_path / p.split("/")[-1]).stat().st_size > 1000 for p in paths)


def test_sse_parsing_and_goodput_flags():
    assert serve.parse_sse_line("data: [DONE]") == "[DONE]"
    assert serve.parse_sse_line(": keep-alive") is None
    assert serve.parse_sse_line('data: {"a": 1}') == {"a": 1}
    assert serve.parse_goodput(["ttft:500", "tpot:50"]) == {"ttft": 500.0, "tpot": 50.0}
    with pytest.raises(ValueError, match="goodput"):
        serve.parse_goodput(["latency:5"])


def test_sharegpt_filter_and_stats():
    assert is_valid_sharegpt_pair(4, 4) and is_valid_sharegpt_pair(1024, 1024)
    assert not is_valid_sharegpt_pair(3, 100) and not is_valid_sharegpt_pair(100, 3)
    assert not is_valid_sharegpt_pair(1025, 10) and not is_valid_sharegpt_pair(1000, 1049)
    s = summarize([1.0, 2.0, 3.0, 4.0])
    assert s["mean"] == 2.5 and s["median"] == 2.5 and s["p99"] == pytest.approx(3.97)
    assert math.isnan(summarize([])["mean"])


FAKE_VLLM_PYTHON = """#!{python}
# Stands in for vLLM's interpreter: answers the import probe, and as `bench serve` writes a result in vLLM's
# keys and its own arguments beside it.
import json, pathlib, sys
code, argv = sys.argv[2], sys.argv[3:]
if "vllm.__version__" in code:
    print("0.0+fake")
    sys.exit(0)
assert "from vllm.benchmarks.serve import add_cli_args, main" in code
out = pathlib.Path(argv[argv.index("--result-dir") + 1])
(out / "argv.json").write_text(json.dumps(argv))
result = dict(completed=2, duration=4.0, total_input_tokens=30, total_output_tokens=10, request_throughput=0.5,
              output_throughput=2.5, total_token_throughput=10.0, errors=["", "timeout"])
for name, base in (("ttft", 100.0), ("tpot", 10.0), ("itl", 9.0), ("e2el", 140.0)):
    result.update({{f"mean_{{name}}_ms": base, f"median_{{name}}_ms": base, f"std_{{name}}_ms": 1.0,
                   f"p90_{{name}}_ms": 2 * base, f"p99_{{name}}_ms": 3 * base}})
(out / argv[argv.index("--result-filename") + 1]).write_text(json.dumps(result))
"""


def fake_vllm(tmp_path):
    venv, model = tmp_path / "venv", tmp_path / "hf"
    (venv / "bin").mkdir(parents=True)
    model.mkdir()
    (model / "config.json").write_text("{}")
    py = venv / "bin" / "python"
    py.write_text(FAKE_VLLM_PYTHON.format(python=sys.executable))
    py.chmod(0o755)
    return venv, model


def test_vllm_client_runs_vllms_bench_serve_and_reads_its_result(stub_server, tmp_path):
    from tokenmill.entrypoints.cli import main

    url, _ = stub_server
    venv, model = fake_vllm(tmp_path)
    argv = ["bench", "serve", "--base-url", url, "--client", "vllm", "--vllm-venv", str(venv), "--vllm-model"]
    argv += [str(model), "--num-prompts", "3", "--output-len", "5", "--max-concurrency", "2", "--ignore-eos"]
    assert main([*argv, "--result-dir", str(tmp_path / "out"), "--no-plots"]) == 0
    r = json.loads((tmp_path / "out" / "serve.json").read_text())
    m = r["runs"][0]["metrics"]
    assert r["client"] == "vllm" and r["server"]["engine"] == "external"
    assert m["output_throughput"] == 2.5 and m["completed"] == 2 and m["failed"] == 1 and m["errors"] == ["timeout"]
    assert m["itl_ms"] == {"mean": 9.0, "median": 9.0, "std": 1.0, "p90": 18.0, "p99": 27.0}
    sent = json.loads((tmp_path / "out" / "argv.json").read_text())
    flag = lambda name: sent[sent.index(name) + 1]  # noqa: E731
    assert flag("--base-url") == url and flag("--served-model-name") == "stub-model" and flag("--model") == str(model)
    assert flag("--backend") == "openai" and flag("--max-concurrency") == "2" and flag("--sharegpt-output-len") == "5"
    assert flag("--request-rate") == "inf" and "--ignore-eos" in sent
    assert isinstance(json.loads(Path(flag("--dataset-path")).read_text()), list)  # vLLM reads one JSON list


def test_launch_vllm_absent_is_a_result_and_fallbacks_are_found(tmp_path):
    from tokenmill.bench.vllm_peer import FALLBACK
    from tokenmill.entrypoints.cli import main

    argv = ["bench", "serve", "--launch-vllm", "--vllm-venv", str(tmp_path / "none"), "--vllm-dtype", "float32"]
    assert main([*argv, "--result-dir", str(tmp_path)]) == 0
    r = json.loads((tmp_path / "serve.json").read_text())
    assert r["available"] is False and "vLLM not installed" in r["reason"]
    assert r["server"] == {"engine": "vllm", "dtype": "float32", "binding": "all-cores"}
    assert FALLBACK.search("WARNING [cpu.py:12] oneDNN failed, fallback to torch linear")
    assert FALLBACK.search("Falling back to the torch implementation") and not FALLBACK.search("INFO ready")
