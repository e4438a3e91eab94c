"""Peer engines measured in the same run: Hugging Face transformers and llama.cpp, the latter both
in-process (llama-cpp-python, one request at a time) and as llama-server with parallel slots.

All are optional. `hf_available()` / `llamacpp_available()` / `llamaserver_available()` say whether
they can run here; a benchmark reports an absent peer as {"available": false, "reason": ...} instead
of failing. llama-cpp-python is never installed by us (it compiles for a long time on small
machines); llama-server is a binary built by scripts/build_llama_server.sh.
"""

from __future__ import annotations

import http.client
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import torch

from tokenmill.bench.common import REPO_ROOT, SampleRequest, stop_process


def absent(reason: str) -> dict:
    return {"available": False, "reason": reason}


PEERS = ("hf", "llamacpp", "llamaserver")
"""Result keys of the peers, in table order; a benchmark fills in only those it ran."""


def add_peer_ratios(results: dict, metric: str) -> None:
    """results["ratio_vs_<peer>"] = ours / peer on `metric`, for each peer that ran."""
    for name in PEERS:
        if name in results and results[name].get("available", True):
            results[f"ratio_vs_{name}"] = results["tokenmill"][metric] / results[name][metric]


def engine_rows(results: dict, cells, num_cells: int) -> list[list]:
    """One table row per engine present: cells(result) for those that ran, 'absent' otherwise."""
    rows = []
    for name in ("tokenmill", *PEERS):
        r = results.get(name)
        if r is None:
            continue
        if r.get("available") is False:
            rows.append([name, "absent: " + r["reason"]] + [""] * (num_cells - 1))
        else:
            rows.append([name, *cells(r)])
    return rows


def print_peer_ratios(results: dict, what: str) -> None:
    for name in PEERS:
        if f"ratio_vs_{name}" in results:
            print(f"tokenmill / {name}: {results[f'ratio_vs_{name}']:.2f}x {what}")


def hf_available() -> str | None:
    """None if transformers (+ accelerate) can load our GGUF, else the reason why not."""
    for pkg in ("transformers", "accelerate", "gguf"):
        if importlib.util.find_spec(pkg) is None:
            return f"{pkg} is not installed (pip install 'tokenmill[bench]')"
    return None


def llamacpp_available(model: str = "smollm2-135m") -> str | None:
    if importlib.util.find_spec("llama_cpp") is None:
        return "llama-cpp-python is not installed (pip install llama-cpp-python; it compiles llama.cpp)"
    from tokenmill.models.loader import resolve_model_path

    if resolve_model_path(model).suffix != ".gguf":
        return f"llama.cpp reads GGUF files only; {model} is not one"
    return None


def llamaserver_available(model: str = "smollm2-135m", binary: str | os.PathLike | None = None) -> str | None:
    """None if llama-server can serve `model` here, else the reason why not."""
    if find_llama_server(binary) is None:
        explicit = binary or os.environ.get(LLAMA_SERVER_ENV)
        if explicit:
            return f"llama-server not found at {explicit} (from --llama-server or ${LLAMA_SERVER_ENV})"
        return (
            f"llama-server not found (pass --llama-server PATH, set ${LLAMA_SERVER_ENV}, or build it into "
            "../shared/tools/llama-server with scripts/build_llama_server.sh)"
        )
    from tokenmill.models.loader import ModelLoadError, resolve_model_path

    try:
        path = resolve_model_path(model)
    except ModelLoadError as e:
        return str(e)
    if path.suffix != ".gguf":
        return f"llama-server reads GGUF files only; {model} is not one"
    return None


@dataclass
class StreamTiming:
    """Wall-clock times of one generation: start, then one timestamp per generated token."""

    start: float
    token_times: list[float] = field(default_factory=list)

    def summary(self) -> dict:
        from tokenmill.bench.common import summarize

        n = len(self.token_times)
        ttft = self.token_times[0] - self.start if n else float("nan")
        decode_s = self.token_times[-1] - self.token_times[0] if n > 1 else float("nan")
        gaps = [b - a for a, b in zip(self.token_times, self.token_times[1:])]
        return {
            "num_tokens": n,
            "ttft_ms": ttft * 1e3,
            "decode_tok_s": (n - 1) / decode_s if n > 1 and decode_s > 0 else float("nan"),
            "e2e_ms": (self.token_times[-1] - self.start) * 1e3 if n else float("nan"),
            "itl_ms": {k: v * 1e3 for k, v in summarize(gaps).items()},
        }


# ------------------------------------------------------------------ HF peer
class HFPeer:
    """transformers `generate` on the same GGUF (dequantized by transformers), same dtype."""

    name = "hf-transformers"

    def __init__(self, model: str, dtype: torch.dtype) -> None:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        from tokenmill.models.loader import resolve_model_path

        path = Path(resolve_model_path(model))
        import transformers

        kw = {"dtype": dtype} if int(transformers.__version__.split(".")[0]) >= 5 else {"torch_dtype": dtype}
        if path.suffix != ".gguf":
            self.model = AutoModelForCausalLM.from_pretrained(path, **kw)
            self.tokenizer = AutoTokenizer.from_pretrained(path)
        else:
            # Dense weights in `dtype`, like ours: newer transformers can keep GGUF blocks packed
            # (and compute in fp32) when a kernel is around; ask for a dequantized model instead.
            if hasattr(transformers, "GgufConfig"):
                kw["quantization_config"] = transformers.GgufConfig(gguf_file=path.name, dequantize=True)
            self.model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, **kw)
            self.tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
        assert next(self.model.parameters()).dtype == dtype, "HF peer did not load in the requested dtype"
        self.model.eval()
        self.dtype = dtype
        self.pad_id = (
            self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else self.tokenizer.eos_token_id
        )

    @torch.inference_mode()
    def timed_generate(self, prompt_ids: list[int], max_new_tokens: int) -> tuple[StreamTiming, list[int]]:
        """Greedy, batch 1, EOS ignored; one timestamp per generated token."""
        from transformers import StoppingCriteria, StoppingCriteriaList

        timing = StreamTiming(time.perf_counter())

        class Stamp(StoppingCriteria):
            def __call__(self, input_ids, scores, **kwargs):
                timing.token_times.append(time.perf_counter())
                return torch.zeros(input_ids.shape[0], dtype=torch.bool)

        ids = torch.tensor([prompt_ids])
        timing.start = time.perf_counter()
        out = self.model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            do_sample=False,
            max_new_tokens=max_new_tokens,
            min_new_tokens=max_new_tokens,
            pad_token_id=self.pad_id,
            stopping_criteria=StoppingCriteriaList([Stamp()]),
        )
        return timing, out[0, ids.shape[1] :].tolist()

    @torch.inference_mode()
    def throughput(self, requests: list[SampleRequest], max_batch_size: int) -> dict:
        """Static batching as vLLM's benchmark_throughput runs HF: a batch grows while it has fewer
        than max_batch_size requests and max(prompt) + max(output) <= 2048; each batch is left-padded
        and generates max(output) tokens for every row (EOS ignored). Counts requested tokens only."""
        batches: list[list[SampleRequest]] = []
        cur: list[SampleRequest] = []
        for r in requests:
            if cur:
                max_in = max(max(x.prompt_len for x in cur), r.prompt_len)
                max_out = max(max(x.output_len for x in cur), r.output_len)
                if len(cur) >= max_batch_size or max_in + max_out > 2048:
                    batches.append(cur)
                    cur = []
            cur.append(r)
        if cur:
            batches.append(cur)
        t0 = time.perf_counter()
        for batch in batches:
            width = max(r.prompt_len for r in batch)
            ids = torch.full((len(batch), width), self.pad_id, dtype=torch.long)
            mask = torch.zeros_like(ids)
            for i, r in enumerate(batch):
                ids[i, width - r.prompt_len :] = torch.tensor(r.prompt_token_ids)
                mask[i, width - r.prompt_len :] = 1
            n_out = max(r.output_len for r in batch)
            self.model.generate(
                ids,
                attention_mask=mask,
                do_sample=False,
                max_new_tokens=n_out,
                min_new_tokens=n_out,
                pad_token_id=self.pad_id,
            )
        elapsed = time.perf_counter() - t0
        return throughput_figures(requests, elapsed) | {"num_batches": len(batches), "max_batch_size": max_batch_size}


# ------------------------------------------------------------ llama.cpp peer
class LlamaCppPeer:
    """llama.cpp through llama-cpp-python on the same GGUF file and thread count."""

    name = "llama.cpp"

    def __init__(self, model: str, num_threads: int, n_ctx: int = 2048) -> None:
        from llama_cpp import Llama

        from tokenmill.models.loader import resolve_model_path

        self.path = Path(resolve_model_path(model))
        self.llm = Llama(
            model_path=str(self.path), n_threads=num_threads, n_threads_batch=num_threads, n_ctx=n_ctx, verbose=False
        )

    def timed_generate(self, prompt_ids: list[int], max_new_tokens: int) -> tuple[StreamTiming, list[int]]:
        self.llm.reset()
        timing = StreamTiming(time.perf_counter())
        toks: list[int] = []
        for tok in self.llm.generate(prompt_ids, temp=0.0, top_k=1, reset=True):
            timing.token_times.append(time.perf_counter())
            toks.append(tok)
            if len(toks) >= max_new_tokens:
                break
        return timing, toks


# ------------------------------------------------------- llama-server peer
LLAMA_SERVER_ENV = "TOKENMILL_LLAMA_SERVER"


DEFAULT_LLAMA_SERVER = REPO_ROOT.parent / "shared" / "tools" / "llama-server" / "llama-server"
"""Where scripts/build_llama_server.sh puts the binary: ../shared/tools next to the repository."""


def _executable(p: Path) -> bool:
    return p.is_file() and os.access(p, os.X_OK)


def find_llama_server(binary: str | os.PathLike | None = None) -> Path | None:
    """The llama-server to run: `binary` if given, else $TOKENMILL_LLAMA_SERVER, else the copy next to
    the repository, else `llama-server` on PATH. An explicit choice (argument or variable) that does
    not exist gives None rather than silently measuring some other build."""
    explicit = binary or os.environ.get(LLAMA_SERVER_ENV)
    if explicit:
        p = Path(explicit).expanduser()
        if p.is_dir():
            p = p / "llama-server"
        elif not p.exists() and os.sep not in str(explicit):  # a bare command name: look it up on PATH
            found = shutil.which(str(explicit))
            p = Path(found) if found else p
        return p if _executable(p) else None
    if _executable(DEFAULT_LLAMA_SERVER):
        return DEFAULT_LLAMA_SERVER
    found = shutil.which("llama-server")
    return Path(found) if found else None


def llama_server_command(
    binary: Path, model_path: Path, port: int, num_threads: int, slots: int, ctx_per_slot: int = 2048
) -> list[str]:
    """The server's command line. In this llama.cpp (0.3.36's) the unified KV cache is off unless
    --parallel is left on auto, and then -c is split evenly: every slot gets c / N tokens (padded to
    256). So -c N * ctx_per_slot gives each slot its own ctx_per_slot-token KV stream (2048: vLLM's
    ShareGPT filter keeps prompt + reply <= 2048); --no-kv-unified says so explicitly. (With a unified
    pool, -c is shared, and each slot's attention scans the used part of the whole pool, masked.)"""
    return [
        str(binary),
        "-m",
        str(model_path),
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "-t",
        str(num_threads),
        "-tb",
        str(num_threads),
        "--parallel",
        str(slots),
        "-c",
        str(slots * ctx_per_slot),
        "--no-kv-unified",
        "--cont-batching",
        "--cache-ram",
        "0",  # no host-memory prompt cache: requests say cache_prompt: false anyway
        "--no-webui",
    ]


def _die_with_parent() -> None:
    """Runs in the child just before exec: Linux sends it SIGTERM when the benchmark process dies,
    even by SIGKILL, so a crashed run cannot leave a server holding the CPUs."""
    import ctypes
    import signal

    ctypes.CDLL(None).prctl(1, signal.SIGTERM)  # 1 = PR_SET_PDEATHSIG


class LlamaServerPeer:
    """llama.cpp's llama-server with `slots` parallel slots (continuous batching across them) on the
    same GGUF file and thread count: the multi-request llama.cpp baseline, which llama-cpp-python
    (one request at a time) is not. Use it as a context manager: the server is stopped on exit,
    also on errors."""

    name = "llama-server"

    def __init__(
        self,
        model: str,
        num_threads: int,
        slots: int = 16,
        binary: str | os.PathLike | None = None,
        ctx_per_slot: int = 2048,
        startup_timeout: float = 120.0,
    ) -> None:
        from tokenmill.bench.serve import free_port
        from tokenmill.models.loader import resolve_model_path

        found = find_llama_server(binary)
        if found is None:
            raise RuntimeError(llamaserver_available(model, binary) or "llama-server not found")
        self.binary = found
        self.path = Path(resolve_model_path(model))
        self.slots = slots
        self.ctx_per_slot = ctx_per_slot
        self.port = free_port()
        env = dict(os.environ)
        # Its .so files sit beside it (the build's RUNPATH points into the deleted build folder).
        env["LD_LIBRARY_PATH"] = os.pathsep.join(filter(None, [str(found.parent), env.get("LD_LIBRARY_PATH")]))
        self.log = tempfile.NamedTemporaryFile("w+b", prefix="llama-server-", suffix=".log", delete=False)
        cmd = llama_server_command(found, self.path, self.port, num_threads, slots, ctx_per_slot)
        self.proc = subprocess.Popen(
            cmd,
            stdout=self.log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=env,
            preexec_fn=_die_with_parent if sys.platform == "linux" else None,
        )
        try:
            self._wait_healthy(startup_timeout)
        except BaseException:
            self.stop()
            raise

    def _log_tail(self, n: int = 15) -> str:
        try:
            return "\n".join(Path(self.log.name).read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return ""

    def _wait_healthy(self, timeout: float) -> None:
        """/health answers 503 while the model loads and 200 once the slots are ready."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(
                    f"llama-server exited with code {self.proc.returncode} during startup:\n" + self._log_tail()
                )
            try:
                status, _ = self._request("GET", "/health", None, timeout=2.0)
                if status == 200:
                    return
            except OSError:  # not listening yet
                pass
            time.sleep(0.2)
        raise RuntimeError(f"llama-server did not become healthy within {timeout:.0f}s:\n" + self._log_tail())

    def _request(self, method: str, path: str, body: dict | None, timeout: float) -> tuple[int, bytes]:
        # http.client, not urllib: urllib would route 127.0.0.1 through an http_proxy from the environment.
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=timeout)
        try:
            conn.request(
                method,
                path,
                body=None if body is None else json.dumps(body),
                headers={"Content-Type": "application/json"},
            )
            resp = conn.getresponse()
            return resp.status, resp.read()
        finally:
            conn.close()

    def complete(self, prompt_ids: list[int], n_predict: int, timeout: float = 3600.0) -> dict:
        """One greedy /completion on token ids, EOS ignored, no prompt cache reuse (llama-server's
        native endpoint: it takes token ids and reports how many tokens it generated)."""
        body = {
            "prompt": prompt_ids,
            "n_predict": n_predict,
            "ignore_eos": True,
            "temperature": 0.0,
            "cache_prompt": False,
            "stream": False,
        }
        status, data = self._request("POST", "/completion", body, timeout)
        if status != 200:
            raise RuntimeError(f"/completion: HTTP {status}: {data[:300].decode(errors='replace')}")
        return json.loads(data)

    def throughput(self, requests: list[SampleRequest]) -> dict:
        """Every request sent at once, one HTTP request in flight each: the server runs `slots` of them
        at a time and queues the rest, the way vLLM's offline benchmark hands the engine the whole list.
        Counts requested tokens (like the other engines) and reports outputs of another length."""
        if not requests:
            raise ValueError("no requests")
        self.complete(requests[0].prompt_token_ids[:8], 1)  # warm-up, untimed

        def one(r: SampleRequest) -> int | str:
            try:
                return int(self.complete(r.prompt_token_ids, r.output_len)["tokens_predicted"])
            except Exception as e:  # noqa: BLE001 - reported with the results, not raised mid-run
                return f"{type(e).__name__}: {e}"

        with ThreadPoolExecutor(max_workers=len(requests)) as pool:
            t0 = time.perf_counter()
            outs = list(pool.map(one, requests))
            elapsed = time.perf_counter() - t0
        mismatched = sum(1 for r, o in zip(requests, outs) if o != r.output_len)
        errors = sorted({o for o in outs if isinstance(o, str)})
        return throughput_figures(requests, elapsed) | {
            "slots": self.slots,
            "ctx_per_slot": self.ctx_per_slot,
            "generated_tokens": sum(o for o in outs if isinstance(o, int)),
            "num_mismatched_outputs": mismatched,
            "errors": errors[:5],
        }

    def stop(self) -> None:
        """terminate, then kill if it has not exited within 10 s; removes the log file."""
        stop_process(self.proc, 10)
        self.log.close()
        Path(self.log.name).unlink(missing_ok=True)

    def __enter__(self) -> LlamaServerPeer:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def throughput_figures(requests: list[SampleRequest], elapsed: float) -> dict:
    n_in = sum(r.prompt_len for r in requests)
    n_out = sum(r.output_len for r in requests)
    return {
        "elapsed_s": elapsed,
        "num_requests": len(requests),
        "prompt_tokens": n_in,
        "output_tokens": n_out,
        "requests_per_s": len(requests) / elapsed,
        "output_tok_s": n_out / elapsed,
        "total_tok_s": (n_in + n_out) / elapsed,
    }
