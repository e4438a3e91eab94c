"""The tokenmill source files one streaming chat request runs code in, counted rather than guessed: the
real app (build_app) and engine thread in this process, a profiler on every thread recording which
tokenmill files' functions are entered between the request's start and its [DONE] (a warm-up request
first, so model loading and first-call imports do not count).

    .venv/bin/python benchmarks/files_crossed.py [--model smollm2-135m] [--list]
"""

from __future__ import annotations

import argparse
import sys
import threading
import time
from pathlib import Path

import tokenmill

ROOT = Path(tokenmill.__file__).resolve().parent


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--list", action="store_true", help="print the files")
    args = ap.parse_args()
    from fastapi.testclient import TestClient

    from tokenmill.config import EngineConfig, ModelConfig
    from tokenmill.engine.async_engine import AsyncEngine
    from tokenmill.entrypoints.openai.server import ServerSettings, build_app

    engine = AsyncEngine(EngineConfig(model=ModelConfig(model=args.model)))
    app = build_app(engine, ServerSettings(served_model_names=[args.model], log_stats_interval_s=None))
    seen: set[str] = set()
    recording = [False]
    root = str(ROOT)

    def prof(frame, event, arg):
        if recording[0] and event == "call":
            f = frame.f_code.co_filename
            if f.startswith(root):
                seen.add(f)

    def body(question: str) -> dict:
        return {
            "model": args.model,
            "messages": [{"role": "user", "content": question}],
            "max_tokens": 16,
            "temperature": 0.0,
            "stream": True,
        }

    threading.setprofile(prof)  # the engine thread starts inside the app's lifespan, after this
    sys.setprofile(prof)
    with TestClient(app) as client:
        while client.get("/health").status_code != 200:
            time.sleep(0.5)
        # the measured prompt differs from the warm-up's: it is computed, not served from the prefix cache
        for warm, question in ((True, "Name three rivers."), (False, "Why is the sky blue? Explain briefly.")):
            recording[0] = not warm
            with client.stream("POST", "/v1/chat/completions", json=body(question)) as r:
                lines = [line for line in r.iter_lines() if line]
            assert lines[-1] == "data: [DONE]", lines[-3:]
        recording[0] = False
    sys.setprofile(None)
    threading.setprofile(None)
    files = sorted(str(Path(f).relative_to(ROOT.parent)) for f in seen)
    print(f"{len(files)} tokenmill files run code for one streaming chat request")
    if args.list:
        print("\n".join(files))


if __name__ == "__main__":
    main()
