"""The live dashboard (GET /dashboard, /dashboard/stream): its pieces without a server, its API-key gate, and
the page itself in Debian's headless Chromium against a real server under load from the `openai` client, its
numbers checked against /metrics and a screenshot saved (TOKENMILL_UPDATE_SCREENSHOT=1 copies it to
docs/img/dashboard.png, the README's picture)."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import tempfile
import threading
import time

import httpx
import openai
import pytest

from tests.server.conftest import API_KEY, REPO, metric_values, start_server
from tokenmill.entrypoints.openai.dashboard import COOKIE_NAME, block_ranges, dashboard_cookie, page_html
from tokenmill.metrics import LatencyWindow

SCREENSHOT = REPO / "docs" / "img" / "dashboard.png"


def test_latency_window_percentiles_by_nearest_rank_and_forgets_old_samples():
    w = LatencyWindow(window_s=60.0)
    for i in range(1, 11):
        w.observe(float(i), now=100.0 + i)
    assert w.percentiles((50, 90, 99), now=111.0) == {"n": 10, "p50": 5.0, "p90": 9.0, "p99": 10.0}
    # at t=165 the samples observed before t=105 (values 1..4) are older than 60 s
    assert w.percentiles((50,), now=165.0) == {"n": 6, "p50": 7.0}
    assert w.percentiles((50,), now=1000.0) == {"n": 0}


def test_block_ranges_compress_a_block_table_into_runs():
    assert block_ranges([4, 5, 6, 9, 2]) == [[4, 3], [9, 1], [2, 1]]
    assert block_ranges([]) == []


def test_page_is_self_contained():
    html = page_html()
    assert "EventSource" in html and "dashboard/stream" in html
    for outside in ("http://", "https://", "<script src", "<link "):
        assert outside not in html, f"the page loads something from outside: {outside!r}"


# --- against a real server -------------------------------------------------------------------------------

# pinned: the adaptive controller may keep drafting off at this batch size, probing with a few requests only,
# and the test needs accepted drafts to compare the dashboard's speculation counters with /metrics
SPEC = json.dumps({"method": "ngram", "num_speculative_tokens": 3, "adaptive": False})
SERVER_ARGS = (
    "--max-model-len",
    "1024",
    "--max-num-seqs",
    "16",
    "--max-num-batched-tokens",
    "256",
    "--kv-cache-memory-bytes",
    str(64 << 20),
    "--speculative-config",
    SPEC,
)
SYSTEM = (
    "You are a careful assistant for a small bakery. Answer in two short sentences, name one bread "
    "and say when it is baked. The bakery opens at seven and closes at six."
)
QUESTIONS = [
    "What is good for breakfast?",
    "Do you have rye?",
    "What is baked at noon?",
    "Is there sourdough?",
    "What bread goes with soup?",
    "What is sweet?",
    "Which bread keeps longest?",
    "What do kids like?",
]


@pytest.fixture(scope="module")
def dash_server(tmp_path_factory):
    srv = start_server(tmp_path_factory.mktemp("dashboard"), *SERVER_ARGS)
    yield srv
    srv.stop()


async def _load(url: str, n_rounds: int = 2, max_tokens: int = 40) -> None:
    """Rounds of concurrent streaming chats sharing a system prompt (prefix hits after the first)."""
    async with openai.AsyncOpenAI(base_url=f"{url}/v1", api_key=API_KEY, max_retries=0) as client:

        async def chat(q: str) -> str:
            stream = await client.chat.completions.create(
                model="smollm2-135m",
                max_tokens=max_tokens,
                temperature=0,
                stream=True,
                messages=[{"role": "system", "content": SYSTEM}, {"role": "user", "content": q}],
            )
            return "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])

        for _ in range(n_rounds):
            texts = await asyncio.gather(*(chat(q) for q in QUESTIONS))
            assert all(texts)


def test_dashboard_and_its_stream_are_gated_like_the_api(dash_server):
    url = dash_server.url
    with httpx.Client(timeout=30.0) as c, httpx.Client(timeout=30.0) as with_cookie:
        for path in ("/dashboard", "/dashboard/stream", "/dashboard?api_key=wrong"):
            r = c.get(url + path)
            assert r.status_code == 401, path
            assert r.json()["error"]["code"] == "invalid_api_key"
        r = c.get(url + "/dashboard", headers=dash_server.headers)
        assert r.status_code == 200 and r.text == page_html()
        r = c.get(url + f"/dashboard?api_key={API_KEY}")
        assert r.status_code == 303 and r.headers["location"] == "/dashboard"
        cookie = r.cookies[COOKIE_NAME]
        assert cookie == dashboard_cookie(API_KEY) and API_KEY not in r.headers["set-cookie"]
        assert "httponly" in r.headers["set-cookie"].lower()
        with_cookie.cookies.set(COOKIE_NAME, "0" * 64)
        assert with_cookie.get(url + "/dashboard").status_code == 401
        with_cookie.cookies.set(COOKIE_NAME, cookie)
        assert with_cookie.get(url + "/v1/models").status_code == 401  # the API wants the key itself
        with with_cookie.stream("GET", url + "/dashboard/stream") as s:
            assert s.status_code == 200 and s.headers["content-type"].startswith("text/event-stream")
            update = None
            for line in s.iter_lines():
                if line.startswith("data: "):
                    update = json.loads(line.removeprefix("data: "))
                    break
    assert update is not None and "error" not in update, update
    g = update["gauges"]
    assert len(update["blocks"]) == g["blocks_total"]
    assert update["blocks"].count(".") + g["blocks_cached_free"] == g["blocks_free"]
    assert update["budget"] == {"max_num_batched_tokens": 256, "max_num_seqs": 16}
    assert update["spec"] is not None and update["spec"]["gamma"] == 3


def _chromium():
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    for exe in ("chromium", "chromedriver"):
        if shutil.which(exe) is None:  # NOTE: a failure, not a skip: scripts/install.sh test installs both
            pytest.fail(f"{exe} not found: install Debian's chromium and chromium-driver (scripts/install.sh test)")
    opts = webdriver.ChromeOptions()
    opts.binary_location = shutil.which("chromium")
    profile = tempfile.mkdtemp(prefix="tm-chromium-")
    for flag in (
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-quic",
        "--no-first-run",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
        "--disable-dev-shm-usage",
        "--window-size=1400,1300",
        f"--user-data-dir={profile}",
    ):
        opts.add_argument(flag)
    driver = webdriver.Chrome(service=Service(shutil.which("chromedriver")), options=opts)
    return driver, profile


def _page_values(driver) -> dict[str, str]:
    return driver.execute_script(
        "const o = {}; for (const el of document.querySelectorAll('[data-k]')) o[el.dataset.k] = el.dataset.v;"
        " o.updates = document.body.dataset.updates || '0'; return o;"
    )


def _wait(driver, pred, timeout: float, what: str) -> dict[str, str]:
    deadline = time.monotonic() + timeout
    vals = _page_values(driver)
    while time.monotonic() < deadline:
        vals = _page_values(driver)
        if pred(vals):
            return vals
        time.sleep(0.2)
    pytest.fail(f"the page never showed {what}; last values: {vals}")


def test_dashboard_in_headless_chromium_agrees_with_metrics(dash_server, tmp_path):
    url = dash_server.url
    asyncio.run(_load(url, n_rounds=1))  # some history before the page opens
    driver, profile = _chromium()
    try:
        driver.get(f"{url}/dashboard?api_key={API_KEY}")  # trades the key for the cookie, lands on /dashboard
        assert driver.current_url == f"{url}/dashboard"
        _wait(driver, lambda v: int(v["updates"]) >= 1, 30, "a first update")
        # live: load while the page is open; it must see requests running and steps with decodes
        load = threading.Thread(target=lambda: asyncio.run(_load(url, n_rounds=2, max_tokens=64)))
        load.start()
        _wait(
            driver,
            lambda v: (v["gauges.running"] or "0") != "0" and (v["x.last_decode"] or "0") != "0",
            60,
            "running requests",
        )
        time.sleep(1.5)  # a few more updates so the charts have history
        shot = tmp_path / "dashboard.png"
        driver.save_screenshot(str(shot))
        load.join(timeout=300)
        assert not load.is_alive()
        with httpx.Client(timeout=30.0) as c:
            m = metric_values(c.get(url + "/metrics").text)
        want = {
            "counters.generation_tokens": m["tokenmill:generation_tokens_total"],
            "counters.prompt_tokens": m["tokenmill:prompt_tokens_total"],
            "counters.prefix_cache_queries": m["tokenmill:prefix_cache_queries_total"],
            "counters.prefix_cache_hits": m["tokenmill:prefix_cache_hits_total"],
            "counters.requests_finished": m["tokenmill:request_success_total"],
            "gauges.running": m["tokenmill:num_requests_running"],
            "gauges.waiting": m["tokenmill:num_requests_waiting"],
            "spec.num_accepted_tokens": m["tokenmill:spec_decode_num_accepted_tokens_total"],
        }
        assert want["counters.requests_finished"] == 3 * len(QUESTIONS)
        assert want["counters.prefix_cache_hits"] > 0 and want["spec.num_accepted_tokens"] > 0

        def agrees(v: dict[str, str]) -> bool:
            return all(v[k] != "" and float(v[k]) == w for k, w in want.items())

        vals = _wait(driver, agrees, 30, f"the /metrics values {want}")
        assert float(vals["gauges.blocks_total"]) == len(driver.execute_script("return last.blocks"))
        hit_rate = want["counters.prefix_cache_hits"] / want["counters.prefix_cache_queries"]
        assert abs(float(vals["rates.prefix_hit_rate"]) - hit_rate) < 1e-9
        assert int(vals["latency.itl.n"]) > 0 and float(vals["latency.ttft.p50"]) > 0
        # the block map counts what the stats count: free = never-used + cached-free; used + free = total
        assert float(vals["x.free"]) + float(vals["gauges.blocks_cached_free"]) == float(vals["gauges.blocks_free"])
        assert float(vals["gauges.blocks_used"]) + float(vals["gauges.blocks_free"]) == float(
            vals["gauges.blocks_total"]
        )
        shown = driver.find_element("css selector", '[data-k="counters.requests_finished"]').text
        assert shown == str(3 * len(QUESTIONS))  # what a person reads, not only the data attribute
    finally:
        driver.quit()
        shutil.rmtree(profile, ignore_errors=True)
    assert shot.stat().st_size > 10_000
    if os.environ.get("TOKENMILL_UPDATE_SCREENSHOT") == "1":  # the README's picture
        SCREENSHOT.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(shot, SCREENSHOT)
