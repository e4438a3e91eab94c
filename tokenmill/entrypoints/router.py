"""`tokenmill router`: an OpenAI-compatible front for disaggregated serving.

    client -> router -> POST /kv/plan on a decode worker: prompt length, local prefix hit
                     -> uncached part < --min-prefill-tokens: the decode worker serves it alone (colocated)
                     -> else: prefill worker, max_tokens 1, kv_transfer_params {"do_remote_decode": true}
                              <- kv_transfer_params {remote_host, remote_port, transfer_id, num_tokens}
                        then the decode worker, the client's body + {"do_remote_prefill": true, ...}; its
                        answer (streamed or not) goes back to the client as it comes

Faults: a prefill worker that cannot be reached or fails is skipped for --cooldown seconds and the request is
prefilled where it decodes; a decode worker that cannot be reached is skipped the same way and the request goes
to the next one (which can pull the same held K/V). Only when no decode worker answers does the client get a
503, in OpenAI's error format. A decode worker whose pull fails recomputes the prompt itself (the client sees
nothing but the latency).
"""

from __future__ import annotations

import argparse
import itertools
import json
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from fastapi import FastAPI, Request  # NOTE: module level: FastAPI resolves the handlers' string annotations here
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse

logger = logging.getLogger("tokenmill.router")


@dataclass
class Worker:
    url: str
    down_until: float = 0.0

    @property
    def is_up(self) -> bool:
        return time.monotonic() >= self.down_until


@dataclass
class RouterStats:
    num_requests: int = 0
    num_disaggregated: int = 0
    num_colocated: int = 0
    """Requests a decode worker served alone: short (or cached) prompts, and fallbacks."""
    num_prefill_failures: int = 0
    """Prefill hops that failed; those requests were prefilled on their decode worker."""
    num_decode_retries: int = 0
    """Decode workers that could not be reached; the request went to the next one."""
    num_unavailable: int = 0
    """Requests no decode worker took (503)."""
    prefill_seconds: float = 0.0
    """Sum of prefill-hop times (the router's view of what disaggregation adds before the decode worker starts)."""


@dataclass
class Pool:
    workers: list[Worker]
    _turn: itertools.count = field(default_factory=itertools.count)

    def candidates(self) -> list[Worker]:
        """Workers to try in order: the live ones round-robin, then (if none is live) every one."""
        n = len(self.workers)
        start = next(self._turn) % n
        order = [self.workers[(start + i) % n] for i in range(n)]
        live = [w for w in order if w.is_up]
        return live or order


def _error(status: int, message: str, kind: str = "service_unavailable") -> dict[str, Any]:
    return {"error": {"message": message, "type": kind, "param": None, "code": status}}


class Router:
    def __init__(
        self,
        prefill: list[str],
        decode: list[str],
        min_prefill_tokens: int = 256,
        cooldown_s: float = 5.0,
        timeout_s: float = 600.0,
    ) -> None:
        import httpx

        if not decode:
            raise ValueError("the router needs at least one --decode worker")
        self.prefill = Pool([Worker(u.rstrip("/")) for u in prefill])
        self.decode = Pool([Worker(u.rstrip("/")) for u in decode])
        self.min_prefill_tokens = min_prefill_tokens
        self.cooldown_s = cooldown_s
        self.client = httpx.AsyncClient(timeout=httpx.Timeout(timeout_s, connect=5.0))
        self.stats = RouterStats()

    def mark_down(self, w: Worker, why: Exception | str) -> None:
        w.down_until = time.monotonic() + self.cooldown_s
        logger.warning("worker %s unavailable (%s); skipping it for %.0f s", w.url, why, self.cooldown_s)

    async def _uncached_tokens(self, decode: Worker, body: dict[str, Any], chat: bool) -> int | None:
        """Prompt tokens the decode worker would have to compute itself, or None if the router cannot tell."""
        if chat:
            probe = {"messages": body.get("messages"), "model": body.get("model")}
        else:
            prompt = body.get("prompt")
            if isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
                return len(prompt)  # token ids: no text to look up; count them all
            if not isinstance(prompt, str):
                return None  # several prompts: served colocated
            probe = {"prompt": prompt, "model": body.get("model")}
        r = await self.client.post(f"{decode.url}/kv/plan", json=probe)
        if r.status_code != 200:
            return None
        plan = r.json()
        return plan["num_prompt_tokens"] - plan["num_cached_tokens"]

    async def _prefill(self, body: dict[str, Any], path: str) -> dict[str, Any] | None:
        """Run the prompt on a prefill worker; its kv_transfer_params, or None (the decode worker prefills)."""
        hop = {k: v for k, v in body.items() if k not in ("stream", "stream_options", "max_completion_tokens")}
        hop.update(max_tokens=1, n=1, kv_transfer_params={"do_remote_decode": True})
        for w in self.prefill.candidates():
            t0 = time.perf_counter()
            try:
                r = await self.client.post(f"{w.url}{path}", json=hop)
            except Exception as e:  # noqa: BLE001 - connection refused, reset, timeout
                self.mark_down(w, e)
                continue
            self.stats.prefill_seconds += time.perf_counter() - t0
            if r.status_code >= 500:
                self.mark_down(w, f"HTTP {r.status_code}")
                continue
            if r.status_code != 200:
                return None  # the request itself is refused: the decode worker gives the client the error
            return r.json().get("kv_transfer_params")
        return None

    async def handle(
        self, body: dict[str, Any], path: str
    ) -> tuple[int, dict[str, Any] | None, AsyncIterator[bytes] | None]:
        """(status, JSON body, None) or (200, None, SSE byte stream) for a completion or chat request."""
        self.stats.num_requests += 1
        chat = path.endswith("chat/completions")
        decode_order = self.decode.candidates()
        params = None
        if self.prefill.workers and body.get("n", 1) == 1:
            try:
                uncached = await self._uncached_tokens(decode_order[0], body, chat)
            except Exception:  # noqa: BLE001 - the decode worker is down; the loop below handles it
                uncached = None
            if uncached is not None and uncached >= self.min_prefill_tokens:
                params = await self._prefill(body, path)
                if params is None:
                    self.stats.num_prefill_failures += 1
        send = dict(body)
        if params is not None:
            send["kv_transfer_params"] = {"do_remote_prefill": True, **params}
            self.stats.num_disaggregated += 1
        else:
            self.stats.num_colocated += 1
        for i, w in enumerate(decode_order):
            if i:
                self.stats.num_decode_retries += 1
            try:
                if body.get("stream"):
                    req = self.client.build_request("POST", f"{w.url}{path}", json=send)
                    resp = await self.client.send(req, stream=True)
                    if resp.status_code != 200:
                        data = await resp.aread()
                        await resp.aclose()
                        if resp.status_code >= 500:
                            self.mark_down(w, f"HTTP {resp.status_code}")
                            continue
                        return resp.status_code, json.loads(data), None
                    return 200, None, self._relay(resp)
                r = await self.client.post(f"{w.url}{path}", json=send)
            except Exception as e:  # noqa: BLE001 - connection refused, reset, timeout
                self.mark_down(w, e)
                continue
            if r.status_code >= 500:
                self.mark_down(w, f"HTTP {r.status_code}")
                continue
            out = r.json()
            if isinstance(out, dict):
                out.pop("kv_transfer_params", None)
            return r.status_code, out, None
        self.stats.num_unavailable += 1
        return 503, _error(503, "no decode worker is reachable; retry later"), None

    async def _relay(self, resp) -> AsyncIterator[bytes]:
        try:
            async for chunk in resp.aiter_raw():
                yield chunk
        finally:
            await resp.aclose()

    async def close(self) -> None:
        await self.client.aclose()


def build_app(router: Router) -> FastAPI:
    app = FastAPI(title="tokenmill router")

    async def relay(request: Request, path: str):
        try:
            body = await request.json()
        except json.JSONDecodeError as e:
            return JSONResponse(_error(400, f"request body is not valid JSON: {e}", "invalid_request_error"), 400)
        if not isinstance(body, dict):
            return JSONResponse(_error(400, "request body must be a JSON object", "invalid_request_error"), 400)
        status, data, stream = await router.handle(body, path)
        if stream is not None:
            return StreamingResponse(stream, media_type="text/event-stream")
        return JSONResponse(data, status)

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await relay(request, "/v1/completions")

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        return await relay(request, "/v1/chat/completions")

    @app.get("/v1/models")
    async def models():
        for w in router.decode.candidates():
            try:
                r = await router.client.get(f"{w.url}/v1/models")
                return JSONResponse(r.json(), r.status_code)
            except Exception as e:  # noqa: BLE001
                router.mark_down(w, e)
        return JSONResponse(_error(503, "no decode worker is reachable"), 503)

    @app.get("/health")
    async def health():
        up = [w.url for w in router.decode.workers if w.is_up]
        return JSONResponse(
            {
                "status": "ok" if up else "degraded",
                "decode_up": up,
                "prefill_up": [w.url for w in router.prefill.workers if w.is_up],
            },
            200 if up else 503,
        )

    @app.get("/metrics", response_class=PlainTextResponse)
    async def metrics():
        lines = []
        for name, value in vars(router.stats).items():  # every RouterStats field is a counter
            lines += [f"# TYPE tokenmill:router_{name} counter", f"tokenmill:router_{name}_total {float(value)}"]
        return PlainTextResponse("\n".join(lines) + "\n")

    @app.on_event("shutdown")
    async def _close() -> None:
        await router.close()

    return app


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--prefill", nargs="*", default=[], metavar="URL", help="prefill workers (tokenmill serve --kv-role prefill)"
    )
    p.add_argument("--decode", nargs="+", required=True, metavar="URL", help="decode workers (--kv-role decode)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument(
        "--min-prefill-tokens",
        type=int,
        default=256,
        help="prompts whose uncached part is shorter are prefilled where they decode (default: 256)",
    )
    p.add_argument("--cooldown", type=float, default=5.0, help="seconds a failed worker is skipped (default: 5)")


def run(args: argparse.Namespace) -> int:
    import uvicorn

    router = Router(args.prefill, args.decode, args.min_prefill_tokens, args.cooldown)
    logging.getLogger("tokenmill").setLevel(logging.INFO)
    uvicorn.run(build_app(router), host=args.host, port=args.port, log_level="warning")
    return 0
