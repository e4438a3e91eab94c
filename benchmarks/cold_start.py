"""Seconds from starting `tokenmill serve` (default model) to its first 200 on /health, then for its
first chat request (32 greedy tokens). Run it right after `bash scripts/install.sh` on a fresh clone:

    .venv/bin/python benchmarks/cold_start.py
"""

from __future__ import annotations

import time

import httpx

from tokenmill.bench.serve import LaunchedServer


def main() -> None:
    t0 = time.perf_counter()
    with LaunchedServer([]) as server:
        t1 = time.perf_counter()
        r = httpx.post(
            f"{server.base_url}/v1/chat/completions",
            timeout=300,
            json={
                "model": "smollm2-135m",
                "messages": [{"role": "user", "content": "Name three rivers."}],
                "max_tokens": 32,
                "temperature": 0,
            },
        )
        t2 = time.perf_counter()
    r.raise_for_status()
    print(
        f"/health after {t1 - t0:.1f} s; first chat request {t2 - t1:.2f} s "
        f"({r.json()['usage']['completion_tokens']} tokens)"
    )


if __name__ == "__main__":
    main()
