"""Prefill/decode disaggregation inside one process (the in-process transport): greedy tokens equal a colocated
engine's, with prefix hits and preemption on the decode side, int8 KV, and every failure ending in a local
recompute with no block leaked on either side. The torch.distributed transport across real processes is
tests/distributed/test_disagg_processes.py."""

from __future__ import annotations

import pytest
import torch

from tokenmill import SamplingParams
from tokenmill.config import EngineConfig
from tokenmill.distributed.kv_connector import HoldForDecode, PullFromPrefill
from tokenmill.distributed.kv_transfer import InProcessHub
from tokenmill.engine.core import EngineCore
from tokenmill.errors import InvalidRequest

GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


def engine(path, role=None, transport=None, **kw):
    hold = kw.pop("hold", 60.0)
    args = dict(
        model=str(path),
        dtype="float32",
        block_size=4,
        num_gpu_blocks_override=kw.pop("num_blocks", 64),
        max_num_batched_tokens=kw.pop("budget", 64),
        **kw,
    )
    if role is not None:
        args["kv_transfer_config"] = {"kv_role": role, "hold_timeout_s": hold}
    return EngineCore(EngineConfig.from_kwargs(**args), kv_transport=transport)


def drain(*engines, until=None, max_steps=2000):
    """Step every engine until each has nothing left (or `until()`): returns request id -> last output."""
    outs = {}
    for _ in range(max_steps):
        busy = False
        for e in engines:
            if e.has_unfinished_requests():
                busy = True
                for o in e.step():
                    outs[o.request_id] = o
        if until is not None and until(outs):
            return outs
        if not busy:
            return outs
    raise AssertionError("engines did not finish")


def prompts(n, seed=0, lo=5, hi=40):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 2000, (int(k),), generator=g).tolist() for k in torch.randint(lo, hi, (n,), generator=g)]


def colocated(path, ps, params=GREEDY):
    e = engine(path)
    for i, p in enumerate(ps):
        e.add_request(f"r{i}", p, params)
    return {k: o.outputs[0].token_ids for k, o in drain(e).items()}


def prefill_then_decode(prefill, decode, ps, params=GREEDY, tag="r"):
    """The router's two hops for each prompt: prefill (max_tokens 1, hold), then decode with the returned params."""
    for i, p in enumerate(ps):
        prefill.add_request(f"{tag}{i}", p, params.clone(max_tokens=1), kv_transfer=HoldForDecode())
    held = drain(prefill, until=lambda o: len(o) == len(ps))
    for i, p in enumerate(ps):
        kv = held[f"{tag}{i}"].kv_transfer_params
        assert kv is not None and kv["num_tokens"] == len(p)
        decode.add_request(f"{tag}{i}", p, params, kv_transfer=PullFromPrefill.from_params(kv))
    return {k: o.outputs[0].token_ids for k, o in drain(prefill, decode).items() if k in held}


@pytest.fixture
def pair(tiny_llama):
    hub = InProcessHub()
    return (engine(tiny_llama, "prefill", hub.endpoint(1)), engine(tiny_llama, "decode", hub.endpoint(2)))


def idle_and_whole(*engines):
    for e in engines:
        assert not e.has_unfinished_requests()
        e.check_integrity()


def test_disaggregated_greedy_equals_colocated(tiny_llama, pair):
    ps = prompts(6)
    prefill, decode = pair
    got = prefill_then_decode(prefill, decode, ps)
    assert got == colocated(tiny_llama, ps)
    st = decode.stats().kv_transfer
    assert st["num_loads"] == 6 and st["num_loads_failed"] == 0
    assert st["num_blocks_loaded"] == sum(-(-(len(p) - 1) // 4) for p in ps)
    assert prefill.stats().kv_transfer["num_sends"] == 6
    idle_and_whole(prefill, decode)


def test_a_speculative_decode_worker_equals_colocated(tiny_llama):
    """Speculation lives in the decode worker's runner: its n-gram drafts are made and verified on the pulled K/V,
    and the greedy tokens are the colocated plain engine's."""
    hub = InProcessHub()
    spec = {"method": "ngram", "num_speculative_tokens": 3, "adaptive": False, "prompt_lookup_min": 1}
    prefill = engine(tiny_llama, "prefill", hub.endpoint(1))
    decode = engine(tiny_llama, "decode", hub.endpoint(2), speculative_config=spec)
    ps = [[9] * 6, [1, 5, 6, 7, 8, 5, 6, 7] * 3, prompts(1, seed=3)[0]]  # the tiny model repeats itself on these
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    got = prefill_then_decode(prefill, decode, ps, params)
    assert got == colocated(tiny_llama, ps, params)
    sd = decode.stats().spec_decode
    assert sd["num_draft_tokens"] > 0 and sd["num_accepted_tokens"] > 0
    assert decode.stats().kv_transfer["num_loads"] == 3
    idle_and_whole(prefill, decode)


def test_decode_side_prefix_hit_pulls_only_missing_blocks(tiny_llama, pair):
    prefill, decode = pair
    shared = prompts(1, seed=1, lo=20, hi=21)[0]  # 20 tokens: 5 full blocks
    ps = [shared + [7, 8, 9], shared + [11, 12, 13, 14, 15]]
    first = prefill_then_decode(prefill, decode, ps[:1], tag="a")
    loaded = decode.stats().kv_transfer["num_blocks_loaded"]
    second = prefill_then_decode(prefill, decode, ps[1:], tag="b")
    st = decode.stats().kv_transfer
    assert st["num_blocks_skipped"] == 5  # the shared 20 tokens hit the decode side's cache
    assert st["num_blocks_loaded"] - loaded == 1  # tokens 20..23 of the second prompt: one block
    ref = colocated(tiny_llama, ps)
    assert first["a0"] == ref["r0"] and second["b0"] == ref["r1"]
    idle_and_whole(prefill, decode)


def test_preemption_on_the_decode_side(tiny_llama):
    hub = InProcessHub()
    prefill = engine(tiny_llama, "prefill", hub.endpoint(1))
    decode = engine(tiny_llama, "decode", hub.endpoint(2), num_blocks=24)  # too few blocks for all 6 at once
    ps = prompts(6, seed=2, lo=20, hi=30)
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    assert prefill_then_decode(prefill, decode, ps, params) == colocated(tiny_llama, ps, params)
    assert decode.scheduler.num_preemptions > 0
    idle_and_whole(prefill, decode)


def test_int8_kv_travels_with_its_scales(tiny_llama):
    hub = InProcessHub()
    prefill = engine(tiny_llama, "prefill", hub.endpoint(1), kv_cache_dtype="int8")
    decode = engine(tiny_llama, "decode", hub.endpoint(2), kv_cache_dtype="int8")
    ps = prompts(3, seed=3)
    ref = engine(tiny_llama, kv_cache_dtype="int8")
    for i, p in enumerate(ps):
        ref.add_request(f"r{i}", p, GREEDY)
    want = {k: o.outputs[0].token_ids for k, o in drain(ref).items()}
    assert prefill_then_decode(prefill, decode, ps) == want
    idle_and_whole(prefill, decode)


def test_expired_hold_means_local_recompute(tiny_llama):
    hub = InProcessHub()
    prefill = engine(tiny_llama, "prefill", hub.endpoint(1), hold=0.01)
    decode = engine(tiny_llama, "decode", hub.endpoint(2))
    ps = prompts(2, seed=4)
    for i, p in enumerate(ps):
        prefill.add_request(f"r{i}", p, GREEDY.clone(max_tokens=1), kv_transfer=HoldForDecode())
    held = drain(prefill, until=lambda o: len(o) == 2)
    import time

    time.sleep(0.05)
    drain(prefill)  # the holds expire: blocks back to the pool
    assert prefill.stats().kv_transfer["num_holds_expired"] == 2
    idle_and_whole(prefill)
    for i, p in enumerate(ps):
        decode.add_request(
            f"r{i}", p, GREEDY, kv_transfer=PullFromPrefill.from_params(held[f"r{i}"].kv_transfer_params)
        )
    got = {k: o.outputs[0].token_ids for k, o in drain(prefill, decode).items()}
    assert got == colocated(tiny_llama, ps)
    assert decode.stats().kv_transfer["num_loads_failed"] == 2
    idle_and_whole(prefill, decode)


def test_a_pull_that_arrives_after_the_deadline_is_refused(tiny_llama):
    """A prefill worker that stalls (no step) past a hold's deadline and then finds a pull waiting refuses it: the
    hold has expired even though the scheduler has not released it yet."""
    hub = InProcessHub()
    prefill = engine(tiny_llama, "prefill", hub.endpoint(1), hold=0.2)
    decode = engine(tiny_llama, "decode", hub.endpoint(2))
    p = prompts(1, seed=7)[0]
    prefill.add_request("r0", p, GREEDY.clone(max_tokens=1), kv_transfer=HoldForDecode())
    held = drain(prefill, until=lambda o: "r0" in o)["r0"].kv_transfer_params
    prefill.step()  # the hold reaches the worker half
    import time

    time.sleep(0.3)  # then the prefill worker stalls past the deadline
    decode.add_request("r0", p, GREEDY, kv_transfer=PullFromPrefill.from_params(held))
    decode.step()  # the pull is on its way
    got = drain(prefill, decode)["r0"].outputs[0].token_ids
    assert got == colocated(tiny_llama, [p])["r0"]
    assert prefill.stats().kv_transfer["num_sends"] == 0
    assert prefill.stats().kv_transfer["num_holds_expired"] == 1
    assert decode.stats().kv_transfer["num_loads_failed"] == 1
    idle_and_whole(prefill, decode)


def test_unreachable_prefill_worker_means_local_recompute(tiny_llama):
    hub = InProcessHub()
    decode = engine(tiny_llama, "decode", hub.endpoint(2))
    p = prompts(1, seed=5)[0]
    decode.add_request("r0", p, GREEDY, kv_transfer=PullFromPrefill("inprocess", 9, "gone", len(p)))
    assert drain(decode)["r0"].outputs[0].token_ids == colocated(tiny_llama, [p])["r0"]
    assert decode.stats().kv_transfer["num_loads_failed"] == 1
    idle_and_whole(decode)


def test_abort_while_loading_leaks_nothing(tiny_llama, pair):
    prefill, decode = pair
    p = prompts(1, seed=6)[0]
    prefill.add_request("r0", p, GREEDY.clone(max_tokens=1), kv_transfer=HoldForDecode())
    held = drain(prefill, until=lambda o: "r0" in o)["r0"].kv_transfer_params
    decode.add_request("r0", p, GREEDY, kv_transfer=PullFromPrefill.from_params(held))
    decode.step()  # admitted: waiting for its K/V
    assert "r0" in decode.scheduler.loading
    decode.abort_request("r0")
    drain(prefill, decode)
    idle_and_whole(prefill, decode)


def test_bad_transfer_requests_are_refused(tiny_llama, pair):
    prefill, decode = pair
    plain = engine(tiny_llama)
    p = [5, 6, 7, 8]
    with pytest.raises(InvalidRequest, match="not a prefill or decode worker"):
        plain.add_request("x", p, GREEDY, kv_transfer=HoldForDecode())
    with pytest.raises(InvalidRequest, match="does not hold"):
        decode.add_request("x", p, GREEDY, kv_transfer=HoldForDecode())
    with pytest.raises(InvalidRequest, match="does not pull"):
        prefill.add_request("x", p, GREEDY, kv_transfer=PullFromPrefill("inprocess", 1, "t", 4))
    with pytest.raises(InvalidRequest, match="5 prompt tokens held"):
        decode.add_request("x", p, GREEDY, kv_transfer=PullFromPrefill("inprocess", 1, "t", 5))
    with pytest.raises(InvalidRequest, match="n = 1"):
        prefill.add_request("x", p, GREEDY.clone(n=2), kv_transfer=HoldForDecode())
    with pytest.raises(ValueError, match="missing"):
        PullFromPrefill.from_params({"remote_host": "h"})
    idle_and_whole(prefill, decode, plain)
