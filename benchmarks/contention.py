"""Single-stream decode under CPU contention: tokenmill (bf16) beside llama.cpp's llama-server (F16 GGUF of
the same weights), quiet, with two busy processes, and beside a second tokenmill server under load. Every
measurement is a fresh process (thread-pool settings are read when the OpenMP runtime loads), and the
conditions run one after the other in one invocation, so the ratios compare like with like.

    bash scripts/build_llama_server.sh /tmp/llama-server        # llama-server and llama-quantize
    .venv/bin/python benchmarks/contention.py --llama-server /tmp/llama-server/llama-server \
        --variants default GOMP_SPINCOUNT=0 OMP_WAIT_POLICY=PASSIVE

A variant is `default` (tokenmill's own settings) or NAME=VALUE[,NAME=VALUE] environment for the tokenmill
process. Decode speed is (tokens - 1) / (last token time - first token time), the prompt excluded; for
llama-server its own `timings.predicted_per_second`.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from tokenmill.bench.common import stop_process
from tokenmill.bench.peers import LlamaServerPeer
from tokenmill.bench.serve import LaunchedServer, load_tokenizer

REPO = Path(__file__).resolve().parents[1]
PROMPT = "Write a short story about a lighthouse keeper who finds a message in a bottle."

CHILD = r"""
import json, sys
from tokenmill import LLM, SamplingParams
llm = LLM(model="smollm2-135m", dtype="bfloat16", max_model_len=1024, enable_prefix_caching=False)
params = SamplingParams(temperature=0.0, max_tokens=int(sys.argv[2]), ignore_eos=True)
llm.generate([sys.argv[1]], SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True), use_tqdm=False)
m = llm.generate([sys.argv[1]], params, use_tqdm=False)[0].metrics
print(json.dumps({"tok_s": (m.num_generation_tokens - 1) / (m.last_token_time - m.first_token_time)}))
"""


class Condition:
    """Background load that runs while measurements are taken: none, two busy loops, or a second tokenmill
    server kept busy by a client process with `streams` concurrent requests."""

    def __init__(self, name: str, streams: int = 4) -> None:
        self.name, self.streams, self.procs = name, streams, []
        self.server: LaunchedServer | None = None

    def __enter__(self) -> Condition:
        if self.name == "busy2":
            for _ in range(2):
                self.procs.append(subprocess.Popen([sys.executable, "-c", "while True: pass"]))
        elif self.name == "tokenmill-server":
            self.server = LaunchedServer(["--dtype", "bfloat16"])
            client = (
                "import httpx, concurrent.futures as f, time\n"
                f"url = '{self.server.base_url}/v1/completions'\n"
                "body = {'model': 'smollm2-135m', 'prompt': 'Tell me about rivers.',"
                " 'max_tokens': 64, 'ignore_eos': True}\n"
                "def loop():\n"
                "    end = time.time() + 3600\n"
                "    while time.time() < end:\n"
                "        httpx.post(url, json=body, timeout=600)\n"
                f"with f.ThreadPoolExecutor({self.streams}) as ex:\n"
                f"    [ex.submit(loop) for _ in range({self.streams})]\n"
            )
            self.procs.append(subprocess.Popen([sys.executable, "-c", client]))
            time.sleep(3)
        return self

    def __exit__(self, *exc) -> None:
        for p in reversed(self.procs):
            stop_process(p, 20)
        if self.server is not None:
            self.server.stop()


def tokenmill_tok_s(variant: str, tokens: int) -> float:
    env = dict(os.environ)
    if variant != "default":
        env.update(kv.split("=", 1) for kv in variant.split(","))
    out = subprocess.run(
        [str(REPO / ".venv/bin/python"), "-c", CHILD, PROMPT, str(tokens)],
        env=env,
        capture_output=True,
        text=True,
        timeout=1800,
        check=True,
    )
    return json.loads(out.stdout.strip().splitlines()[-1])["tok_s"]


def llama_tok_s(binary: Path, gguf: Path, threads: int, tokens: int, prompt_ids: list[int]) -> float:
    """llama-server's own decode speed (timings.predicted_per_second) for one greedy request, one slot."""
    with LlamaServerPeer(str(gguf), threads, slots=1, binary=binary) as peer:
        peer.complete(prompt_ids, 8)  # warm-up
        return float(peer.complete(prompt_ids, tokens)["timings"]["predicted_per_second"])


def f16_gguf(binary: Path, out_dir: Path) -> Path:
    """The default model's weights as an F16 GGUF, written by llama.cpp's llama-quantize from the shipped Q4_1."""
    from tokenmill.models.loader import resolve_model_path

    src = Path(resolve_model_path("smollm2-135m"))
    dst = out_dir / "smollm2-135m-F16.gguf"
    if not dst.exists():
        out_dir.mkdir(parents=True, exist_ok=True)
        subprocess.run(
            [str(binary.with_name("llama-quantize")), "--allow-requantize", str(src), str(dst), "F16"],
            env=dict(os.environ, LD_LIBRARY_PATH=str(binary.parent)),
            check=True,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
    return dst


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--llama-server", type=Path, default=None, help="llama-server binary (llama-quantize beside it)")
    ap.add_argument("--gguf-dir", type=Path, default=Path("/tmp/tokenmill-contention"))
    ap.add_argument("--variants", nargs="+", default=["default"])
    ap.add_argument("--conditions", nargs="+", default=["quiet", "busy2", "tokenmill-server"])
    ap.add_argument("--tokens", type=int, default=96)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    gguf = f16_gguf(args.llama_server, args.gguf_dir) if args.llama_server else None
    prompt_ids = load_tokenizer("smollm2-135m").encode(PROMPT) if gguf is not None else []
    rows = []
    for cond in args.conditions:
        with Condition(cond):
            row = {"condition": cond}
            for _ in range(args.repeats):  # interleaved: every variant and the peer once per round
                for v in args.variants:
                    row.setdefault(v, []).append(tokenmill_tok_s(v, args.tokens))
                if gguf is not None:
                    row.setdefault("llama.cpp", []).append(
                        llama_tok_s(args.llama_server, gguf, args.threads, args.tokens, prompt_ids)
                    )
            rows.append(row)
            print(json.dumps(row), flush=True)
    names = args.variants + (["llama.cpp"] if gguf is not None else [])
    print(f"\n{'condition':18}" + "".join(f"{n:>28}" for n in names) + "   (tok/s, median)")
    for row in rows:
        med = {n: statistics.median(row[n]) for n in names}
        cells = [
            f"{med[n]:8.1f}" + (f" ({med[n] / med['llama.cpp']:.2f}x)" if gguf is not None and n != "llama.cpp" else "")
            for n in names
        ]
        print(f"{row['condition']:18}" + "".join(f"{c:>28}" for c in cells))
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
