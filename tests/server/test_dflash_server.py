"""The shipped block drafter through the real server: `tokenmill serve --speculative-config '{"method": "dflash",
"adaptive": false}'` names no drafter and gets the one shipped for the default model (γ pinned: adaptive γ measures
that this drafter does not pay on this CPU and drafts only in its probes). Greedy chat answers through the `openai`
client equal the server's without speculation, drafts were made and accepted, and /metrics shows acceptance per
position."""

from __future__ import annotations

import json

import httpx
import pytest

from tests.server.conftest import DEFAULT_ARGS, MODEL, ServerProcess, metric_values, start_server

QUESTIONS = [
    "Explain what a hash map is in two sentences.",
    "List three uses of Python decorators.",
    "Write a haiku about the sea.",
]


@pytest.fixture(scope="module")
def dflash_server(tmp_path_factory) -> ServerProcess:
    srv = start_server(
        tmp_path_factory.mktemp("dflash_server"),
        *DEFAULT_ARGS,
        "--speculative-config",
        json.dumps({"method": "dflash", "adaptive": False}),  # pinned: adaptive γ switches this drafter off here
    )
    yield srv
    srv.stop()


def _answers(srv: ServerProcess) -> list[str]:
    import openai

    client = openai.OpenAI(base_url=f"{srv.url}/v1", api_key=srv.api_key)
    out = []
    for q in QUESTIONS:
        r = client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": q}], temperature=0, max_tokens=64
        )
        out.append(r.choices[0].message.content)
    return out


def test_dflash_greedy_equals_plain_and_metrics_show_positions(server, dflash_server):
    assert _answers(dflash_server) == _answers(server)
    m = metric_values(httpx.get(f"{dflash_server.url}/metrics", headers=dflash_server.headers).text)
    assert m["tokenmill:spec_decode_num_drafts_total"] > 0
    assert m["tokenmill:spec_decode_num_accepted_tokens_total"] > 0
    prefix = "tokenmill:spec_decode_num_accepted_tokens_per_pos_total{"
    per_pos = {k.split('position="')[1].rstrip('"}'): v for k, v in m.items() if k.startswith(prefix)}
    assert per_pos.get("0", 0) > 0, per_pos
    assert len(per_pos) >= 2, per_pos  # a block drafts several positions in one pass
