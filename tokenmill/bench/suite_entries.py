"""The headline set of `tokenmill bench suite` (issue 47): which commands each entry runs, and what it keeps.

An entry is a few steps, each a `tokenmill ...` command that the suite runs in a fresh process (the suite measures
nothing itself), and a summary: a pure function from the steps' outputs (their JSON, by step name) to the
figures the record keeps and the entry's status:

    ok        every figure measured
    absent    our figures measured; a peer (llama.cpp, vLLM) cannot run here, and `reason` says why
    failed    a step exited non-zero, or its output lacked a figure; `reason` holds the error

Each step's `est_s` is its estimated seconds at full size on 2 cores, from the slowest host kind measured so far (the
AVX2-only EPYC: bf16 decode ~70 tok/s, float32 ~48, int8 ~8, 32 chat streams ~230 out tok/s, vLLM's start 2-3
min; docs/benchmarks.md). --quick shrinks every entry to a few tokens and prompts: a test of the plumbing, never
a record.
"""

from __future__ import annotations

import json
import re
import shlex
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from tokenmill.bench.roofline import MAX_FRACTION, decode_bound

ENTRY_NAMES = (
    "decode_bf16",
    "decode_float32",
    "decode_gguf_vs_llamacpp",
    "decode_int8_rtn",
    "decode_int4_rtn",
    "roofline",
    "serve_vs_vllm",
    "prefix_cache",
    "chunked_prefill",
    "speculation",
    "perplexity",
)
"""The headline set, in the order it runs (headline_entries builds them)."""

SERVE_STREAMS = 32
SERVE_PROMPTS = 64
SERVE_OUTPUT_LEN = 256
"""The serving load: 64 ShareGPT chats x 256 tokens (ignore_eos), 32 concurrent streams, all sent at once."""

GOAL_THROUGHPUT_VS_VLLM = 1.2
GOAL_FRACTION_OF_BOUND = 0.6
GOAL_ITL_P99_OVER_MEDIAN = 2.0
"""Issue 47's serving goals on every host kind: >= 1.2x vLLM's best output tok/s, >= 60% of the load's roofline
bound, and ITL p99 <= vLLM's best and <= 2x our median."""


@dataclass(frozen=True)
class Step:
    """One `tokenmill ...` command of an entry."""

    name: str
    """The key of its output in the summary's input."""
    argv: tuple[str, ...]
    """tokenmill's arguments, without the flag that says where the output goes."""
    output: str = "json"
    """How it hands its result back: json (--output-json FILE), serve (--result-dir DIR, then DIR/serve.json),
    stdout (its last stdout line is JSON), or none (a preparation: only its exit status counts)."""
    creates: str | None = None
    """A preparation's output directory: the runner skips the step when that exists from the same commit."""
    est_s: float = 0.0
    """Estimated seconds at full size on 2 cores."""

    @property
    def command(self) -> str:
        """The command line as a user types it (OUT stands for the output path the suite picks)."""
        tail = {"json": ["--output-json", "OUT.json"], "serve": ["--result-dir", "OUT"]}.get(self.output, [])
        return shlex.join(["tokenmill", *self.argv, *tail])


@dataclass(frozen=True)
class Outcome:
    status: str
    """ok, absent or failed (module docstring)."""
    figures: dict
    reason: str | None = None


@dataclass(frozen=True)
class Entry:
    name: str
    what: str
    """One line: what it measures, on which workload."""
    steps: tuple[Step, ...]
    summarize: Callable[[dict[str, dict]], Outcome]
    """Step outputs by step name -> the entry's outcome (a KeyError counts as a failure)."""

    @property
    def est_s(self) -> float:
        return sum(s.est_s for s in self.steps)


@dataclass(frozen=True)
class SuiteOptions:
    """What the entries are built from (the suite's flags)."""

    model: str = "smollm2-135m"
    """The model every entry runs (the default: the shipped Q4_1 GGUF)."""
    num_threads: int = 2
    quick: bool = False
    """A few tokens and prompts per entry (tests)."""
    work_dir: Path = Path("bench_out/suite")
    """Quantized checkpoints and step outputs."""
    engine_args: tuple[str, ...] = ()
    """Extra engine flags for every command that takes them (latency, roofline, ablation, the server)."""
    datastore: str | None = None
    eagle: str | None = None
    medusa: str | None = None
    """Speculation artefacts (`tokenmill build-datastore`, `train-eagle`, `train-medusa`); absent without them."""
    vllm_reason: str | None = None
    """Why vLLM cannot run here (tokenmill.bench.vllm_peer.vllm_available), or None when it can."""
    vllm_venv: str | None = None
    vllm_model: str | None = None
    vllm_dtypes: tuple[str, ...] = ("bfloat16", "float32")
    vllm_bindings: tuple[str, ...] = ("all-cores", "default")
    serve_client: str = "auto"
    """auto (vLLM's own client where vLLM runs, else ours), vllm or tokenmill."""
    ppl_windows: int = 8
    """WikiText-2 windows of 2,048 tokens per perplexity run."""

    def size(self, full: int, quick: int) -> str:
        return str(quick if self.quick else full)

    @property
    def client(self) -> str:
        if self.serve_client != "auto":
            return self.serve_client
        return "tokenmill" if self.vllm_reason else "vllm"


# ---------------------------------------------------------------------------------------------- figures
def latency_figures(r: dict, engine: str = "tokenmill") -> dict:
    """`tokenmill bench latency` JSON -> one engine's batch-1 figures."""
    t = r[engine]
    return {
        "decode_tok_s": t["decode_tok_s"],
        "ttft_ms": t["ttft_ms"],
        "itl_p50_ms": t["itl_ms"]["median"],
        "itl_p99_ms": t["itl_ms"]["p99"],
    }


def summarize_decode(outputs: dict[str, dict]) -> Outcome:
    r = outputs["latency"]
    c = r["config"]
    figures = {"dtype": c["dtype"], "output_len": c["output_len"], "num_iters": c["num_iters"], **latency_figures(r)}
    lc = r.get("llamacpp")
    if lc is None:
        return Outcome("ok", figures)
    if lc.get("available") is False:
        return Outcome("absent", figures, f"llama.cpp: {lc['reason']}")
    figures["llamacpp"] = {"precision": lc.get("precision"), **latency_figures(r, "llamacpp")}
    figures["ratio_vs_llamacpp"] = r["ratio_vs_llamacpp"]
    return Outcome("ok", figures)


def summarize_roofline(outputs: dict[str, dict]) -> Outcome:
    r = outputs["roofline"]
    return Outcome(
        "ok",
        {
            "dtype": r["config"]["dtype"],
            "read_gb_s": r["bandwidth"]["read_gb_s"],
            "weight_mb_per_step": r["model"]["weight_bytes_per_step"] / 1e6,
            "measured_tok_s": r["measured_decode_tok_s"],
            "bound_tok_s": r["round_bound_tok_s"],
            "fraction": r["fraction_of_bound"],
            "round_fractions": [x["fraction"] for x in r["rounds"]],
        },
    )


def _ablation_row(outputs: dict[str, dict], row: str) -> dict:
    r = outputs["ablation"][row]
    if r.get("available") is False:
        raise RuntimeError(f"ablation row {row}: {r['reason']}")
    return r


def summarize_prefix_cache(outputs: dict[str, dict]) -> Outcome:
    p = _ablation_row(outputs, "prefix_caching")
    return Outcome(
        "ok",
        {
            "workload": p["workload"],
            "cold_ttft_ms": p["off"]["mean_ttft_ms"],
            "cached_ttft_ms": p["on"]["mean_ttft_ms"],
            "ttft_ratio": p["off"]["mean_ttft_ms"] / p["on"]["mean_ttft_ms"],
            "requests_per_s_speedup": p["speedup"],
        },
    )


def summarize_chunked_prefill(outputs: dict[str, dict]) -> Outcome:
    c = _ablation_row(outputs, "chunked_prefill")
    keys = ("itl_p50_ms", "itl_p99_ms", "itl_max_ms", "long_prompt_ttft_ms", "max_num_batched_tokens")
    return Outcome(
        "ok",
        {
            "workload": c["workload"],
            "on": {k: c["on"][k] for k in keys},
            "off": {k: c["off"][k] for k in keys},
            "itl_p99_ratio": c["off"]["itl_p99_ms"] / c["on"]["itl_p99_ms"],
            "itl_max_ratio": c["off"]["itl_max_ms"] / c["on"]["itl_max_ms"],
        },
    )


def speculation_methods(opts: SuiteOptions) -> tuple[dict[str, dict], dict[str, str]]:
    """The speculative configs that can run here (name -> config), and for each that cannot, the command that
    would build what it needs. n-gram needs nothing; the others need artefacts trained on this model."""
    methods: dict[str, dict] = {"ngram": {"method": "ngram", "num_speculative_tokens": 4}}
    absent: dict[str, str] = {}
    if opts.datastore:
        methods["ngram+datastore"] = {"method": "ngram", "num_speculative_tokens": 5, "datastore": opts.datastore}
    else:
        absent["ngram+datastore"] = (
            "no --datastore FILE; build one (~15-30 min): tokenmill build-datastore --out smollm2-datastore.npz "
            "--threads 2"
        )
    if opts.eagle:
        methods["eagle"] = {"method": "eagle", "model": opts.eagle, "num_speculative_tokens": 2}
    else:
        absent["eagle"] = "no --eagle DIR; train one (~45 min): tokenmill train-eagle --out eagle-smollm2 --threads 2"
    if opts.medusa:
        methods["medusa"] = {"method": "medusa", "model": opts.medusa, "num_speculative_tokens": 4, "tree": True}
    else:
        absent["medusa"] = (
            "no --medusa DIR; train one after the datastore: tokenmill train-medusa --out medusa-smollm2 "
            "--datastore smollm2-datastore.npz --threads 2"
        )
    return methods, absent


def summarize_speculation(outputs: dict[str, dict], absent: dict[str, str]) -> Outcome:
    s = _ablation_row(outputs, "speculation")
    methods = {}
    for name in s["methods"]:
        m = s[name]
        stats = m.get("spec_stats") or {}
        methods[name] = {
            "decode_tok_s": m["decode_tok_s"],
            "speedup": m["speedup"],
            **{k: stats[k] for k in ("mean_acceptance_length", "acceptance_rate") if k in stats},
        }
    return Outcome(
        "ok", {"workload": s["workload"], "plain_tok_s": s["off"]["decode_tok_s"], "methods": methods, "absent": absent}
    )


def summarize_perplexity(outputs: dict[str, dict]) -> Outcome:
    base = outputs["float32"]
    figures: dict = {"windows": base["num_windows"], "seqlen": base["seqlen"], "float32": base["perplexity"]}
    for name in ("rtn_int8", "rtn_int4"):
        ppl = outputs[name]["perplexity"]
        figures[name] = ppl
        figures[f"{name}_delta"] = ppl - base["perplexity"]
    return Outcome("ok", figures)


# ---------------------------------------------------------------------------------------------- serving
def load_figures(serve_json: dict) -> dict:
    """`tokenmill bench serve` JSON (one point) -> the load's figures; mean_context is the mean prompt plus half
    the mean output, the mean K/V length a decode step reads."""
    m = serve_json["runs"][0]["metrics"]
    done = max(1, m["completed"])
    return {
        "output_tok_s": m["output_throughput"],
        "ttft_p50_ms": m["ttft_ms"]["median"],
        "itl_p50_ms": m["itl_ms"]["median"],
        "itl_p99_ms": m["itl_ms"]["p99"],
        "tpot_p50_ms": m["tpot_ms"]["median"],
        "completed": m["completed"],
        "failed": m["failed"],
        "mean_context": (m["total_input_tokens"] + m["total_output_tokens"] / 2) / done,
    }


BEST = {"output_tok_s": max, "ttft_p50_ms": min, "itl_p50_ms": min, "itl_p99_ms": min}
"""vLLM's best per metric over its settings, and which way is better."""


def vllm_best(settings: dict[str, dict]) -> dict[str, dict]:
    """Per metric of BEST, the best value over the settings that ran (those with figures: not absent, not
    excluded for a fallback) and the setting that gave it; {} when none ran."""
    ran = {k: v for k, v in settings.items() if "output_tok_s" in v}
    out = {}
    for metric, pick in BEST.items():
        if ran:
            setting = pick(ran, key=lambda k: ran[k][metric])
            out[metric] = {"value": ran[setting][metric], "setting": setting}
    return out


def goal(
    key: str, text: str, value: float | None, target: float, higher_is_better: bool, missing: str | None = None
) -> dict:
    """One goal as the record keeps it: passed or missed, and `by`: value / target - 1 (+0.03: 3% above the
    target, which is a margin for a >= goal and a miss for a <= goal). value None: not measurable here."""
    out = {"key": key, "goal": text, "target": target, "higher_is_better": higher_is_better, "value": value}
    if value is None:
        return {**out, "passed": None, "reason": missing}
    passed = value >= target if higher_is_better else value <= target
    return {**out, "passed": passed, "by": value / target - 1}


def serving_goals(ours: dict, best: dict[str, dict], bound_tok_s: float | None, why_bound: str | None) -> list[dict]:
    """Issue 47's serving goals from our load figures, vLLM's best per metric ({} when vLLM did not run) and the
    load's roofline bound (tok/s): throughput_vs_vllm, fraction_of_bound, itl_p99_vs_vllm, itl_p99_over_median."""
    no_vllm = "vLLM did not run here"
    out_ratio = ours["output_tok_s"] / best["output_tok_s"]["value"] if best else None
    itl_ratio = ours["itl_p99_ms"] / best["itl_p99_ms"]["value"] if best else None
    fraction = ours["output_tok_s"] / bound_tok_s if bound_tok_s else None
    goals = [
        goal(
            "throughput_vs_vllm",
            f"output tok/s >= {GOAL_THROUGHPUT_VS_VLLM:g}x vLLM's best",
            out_ratio,
            GOAL_THROUGHPUT_VS_VLLM,
            True,
            no_vllm,
        ),
        goal(
            "fraction_of_bound",
            f"output tok/s >= {GOAL_FRACTION_OF_BOUND:.0%} of the load's roofline bound",
            fraction,
            GOAL_FRACTION_OF_BOUND,
            True,
            "no bound",
        ),
        goal("itl_p99_vs_vllm", "ITL p99 <= vLLM's best ITL p99", itl_ratio, 1.0, False, no_vllm),
        goal(
            "itl_p99_over_median",
            f"ITL p99 <= {GOAL_ITL_P99_OVER_MEDIAN:g}x our ITL median",
            ours["itl_p99_ms"] / ours["itl_p50_ms"],
            GOAL_ITL_P99_OVER_MEDIAN,
            False,
        ),
    ]
    if why_bound and goals[1]["passed"] is False:
        goals[1]["why"] = why_bound
    return goals


def load_bound(roofline: dict, mean_context: float, batch: int) -> dict:
    """The serving load's roofline bound from `tokenmill bench roofline --no-measure-engine --batches 1,B` JSON:
    B streams reading the weights once and each its K/V per step at the measured read bandwidth (memory_tok_s,
    the goal's bound), and beside it the engine's own linears' rate at B rows (compute_tok_s), which says why
    the memory bound may be out of reach. Prefill work is left out, so both only overstate what the load allows.
    """
    mb = roofline["model"]
    linear = roofline.get("linear_tflop_s", {}).get(f"B={batch}")
    b = decode_bound(
        roofline["bandwidth"]["read_gb_s"] * 1e9,
        mb["weight_bytes_per_step"],
        mb["kv_bytes_per_token"],
        batch,
        round(mean_context),
        mb["flops_per_token"],
        linear * 1e12 if linear else None,
    )
    out = {
        "dtype": roofline["config"]["dtype"],
        "read_gb_s": roofline["bandwidth"]["read_gb_s"],
        "weight_mb_per_step": mb["weight_bytes_per_step"] / 1e6,
        "kv_kb_per_token": mb["kv_bytes_per_token"] / 1e3,
        "batch": batch,
        "mean_context": mean_context,
        "memory_tok_s": b.memory_tok_s,
        "compute_tok_s": b.compute_tok_s,
    }
    if b.compute_tok_s is not None and b.compute_tok_s < b.memory_tok_s:
        out["why"] = (
            f"the engine's own {out['dtype']} linears at {batch} rows (weights in cache) run at most "
            f"{b.compute_tok_s:.0f} tok/s, {b.compute_tok_s / b.memory_tok_s:.0%} of the memory bound of "
            f"{b.memory_tok_s:.0f}: this load is compute-bound on this CPU"
        )
    return out


def summarize_serving(
    outputs: dict[str, dict], vllm_steps: tuple[str, ...], vllm_reason: str | None, batch: int
) -> Outcome:
    """Our load, vLLM's settings (each measured, absent, or excluded for a logged fallback) and the best per
    metric over them, the load's bound at `batch` streams, and the goals."""
    ours = load_figures(outputs["tokenmill"])
    settings: dict[str, dict] = {}
    for name in vllm_steps:
        r = outputs[name]
        setting = name.removeprefix("vllm ")
        if r.get("available") is False:
            settings[setting] = {"absent": r["reason"]}
        elif r["server"].get("fallback_lines"):
            settings[setting] = {"excluded": "its log reports a fallback: " + r["server"]["fallback_lines"][-1][-200:]}
            if r["runs"]:
                settings[setting]["measured_anyway"] = load_figures(r)
        else:
            settings[setting] = load_figures(r)
    best = vllm_best(settings)
    bound = load_bound(outputs["load bound"], ours["mean_context"], batch)
    compute = bound["compute_tok_s"]
    if compute is not None and ours["output_tok_s"] > compute * MAX_FRACTION:  # the timed linears explain nothing
        bound.pop("why", None)
        bound["compute_note"] = (
            f"the load ran at {ours['output_tok_s']:.0f} tok/s, above the {compute:.0f} tok/s of the linears timed "
            "one call at a time (each pays the module path's dispatch): no compute roof is claimed"
        )
    figures = {
        "client": outputs["tokenmill"].get("client", "tokenmill"),
        "tokenmill": ours,
        "vllm_settings": settings,
        "vllm_best": best,
        "bound": bound,
        "fraction_of_bound": {
            "tokenmill": ours["output_tok_s"] / bound["memory_tok_s"],
            "vllm_best": best["output_tok_s"]["value"] / bound["memory_tok_s"] if best else None,
        },
        "goals": serving_goals(ours, best, bound["memory_tok_s"], bound.get("why")),
    }
    if vllm_reason:
        return Outcome("absent", figures, f"vLLM: {vllm_reason}")
    if not best:
        return Outcome("absent", figures, "vLLM: no setting ran without a fallback: " + json.dumps(settings)[:300])
    return Outcome("ok", figures)


# ---------------------------------------------------------------------------------------------- the entries
def slugify(text: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-")


def headline_entries(opts: SuiteOptions) -> list[Entry]:
    """The headline set (ENTRY_NAMES, in order) for these options."""
    s, m, threads, eng = opts.size, opts.model, str(opts.num_threads), opts.engine_args
    work = opts.work_dir / slugify(Path(m).name)

    def latency(model: str, dtype: str, peers: str = "none", dense: bool = False) -> tuple[str, ...]:
        """dense: a GGUF model dequantized at load (the dense baseline the quantized rows compare with)."""
        return (
            *("bench", "latency", "--model", model, "--dtype", dtype, "--num-threads", threads),
            *(("--gguf-dequantize",) if dense else ()),
            *("--input-len", s(32, 8), "--output-len", s(128, 8), "--num-iters", s(3, 1), "--peers", peers, *eng),
        )

    def rtn(bits: int, group: int) -> Step:
        out = str(work / f"rtn-int{bits}")
        argv = ("quantize", "--model", m, "--method", "rtn", "--bits", str(bits), "--group-size", str(group))
        return Step(
            f"quantize int{bits}", (*argv, "--threads", threads, "--out", out), "none", out, 15 if bits == 8 else 50
        )

    def ablation(*row: str, est: float) -> Step:
        argv = ("bench", "ablation", "--model", m, "--dtype", "bfloat16", "--num-threads", threads, "--plot-dir", "")
        return Step("ablation", (*argv, *row, *eng), est_s=est)

    def ppl(name: str, model: str, est: float) -> Step:
        argv = ("eval", "perplexity", "--model", model, "--dtype", "float32", "--threads", threads, "--json")
        size = ("--max-windows", s(opts.ppl_windows, 1)) + (("--seqlen", "128") if opts.quick else ())
        return Step(name, (*argv, *size), "stdout", est_s=est)

    int8, int4 = rtn(8, -1), rtn(4, 64)
    methods, absent_methods = speculation_methods(opts)
    serve_steps, vllm_steps = serving_steps(opts)
    return [
        Entry(
            "decode_bf16",
            "single-stream decode, bf16, dense weights (a GGUF file dequantized), 32 prompt + 128 new tokens, "
            "median of 3",
            (Step("latency", latency(m, "bfloat16", dense=True), est_s=25),),
            summarize_decode,
        ),
        Entry(
            "decode_float32",
            "single-stream decode, float32, dense weights (a GGUF file dequantized), 32 prompt + 128 new tokens, "
            "median of 3",
            (Step("latency", latency(m, "float32", dense=True), est_s=30),),
            summarize_decode,
        ),
        Entry(
            "decode_gguf_vs_llamacpp",
            "single-stream decode of the model file as loaded (dtype auto) vs llama.cpp on the same file",
            (Step("latency", latency(m, "auto", "llamacpp"), est_s=45),),
            summarize_decode,
        ),
        Entry(
            "decode_int8_rtn",
            "single-stream decode, weight-only int8 (RTN, per channel), bf16 activations",
            (int8, Step("latency", latency(int8.creates or "", "bfloat16"), est_s=70)),
            summarize_decode,
        ),
        Entry(
            "decode_int4_rtn",
            "single-stream decode, weight-only int4 (RTN, group 64), bf16 activations",
            (int4, Step("latency", latency(int4.creates or "", "bfloat16"), est_s=30)),
            summarize_decode,
        ),
        Entry(
            "roofline",
            "bf16 single stream vs its roofline bound (weights + K/V per token at the measured read bandwidth)",
            (
                Step(
                    "roofline",
                    (
                        *("bench", "roofline", "--model", m, "--dtype", "bfloat16", "--num-threads", threads),
                        *("--kv-cache-memory-bytes", str(64 << 20), "--rounds", s(3, 1), "--output-len", s(128, 8)),
                        *(("--buffer-mib", "64") if opts.quick else ()),
                        *eng,
                    ),
                    est_s=90,
                ),
            ),
            summarize_roofline,
        ),
        Entry(
            "serve_vs_vllm",
            f"{s(SERVE_STREAMS, 4)}-stream serving, {s(SERVE_PROMPTS, 4)} ShareGPT chats x {s(SERVE_OUTPUT_LEN, 8)} "
            "tokens: tokenmill serve (bf16) vs vLLM's CPU build (its dtypes and bindings, best per metric), "
            "one client for both, with the load's roofline bound",
            serve_steps,
            lambda out: summarize_serving(out, vllm_steps, opts.vllm_reason, int(s(SERVE_STREAMS, 4))),
        ),
        Entry(
            "prefix_cache",
            "TTFT of requests sharing a 1,024-token prefix, prefix cache on vs off (cold)",
            (
                ablation(
                    "--only", "prefix_caching", "--shared-prefix-len", s(1024, 48), "--num-prompts", s(16, 2), est=45
                ),
            ),
            summarize_prefix_cache,
        ),
        Entry(
            "chunked_prefill",
            "ITL of 16 decode streams while a 2,000-token prompt arrives, chunked prefill (budget 32) vs not",
            (
                ablation(
                    *("--only", "chunked_prefill", "--num-streams", s(16, 2), "--long-prompt-len", s(2000, 64)),
                    *("--chunk-budget", "32", "--stream-tokens", s(160, 12)),
                    est=90,
                ),
            ),
            summarize_chunked_prefill,
        ),
        Entry(
            "speculation",
            "batch-1 decode on held-out ShareGPT chats, each speculative method vs plain decoding in the same process",
            (
                ablation(
                    *("--only", "speculation", "--spec-workload", "chat", "--spec-num-prompts", s(4, 1)),
                    *("--spec-output-len", s(128, 8), "--spec-methods", json.dumps(methods)),
                    est=45 + 25 * len(methods),
                ),
            ),
            lambda out: summarize_speculation(out, absent_methods),
        ),
        Entry(
            "perplexity",
            f"WikiText-2 perplexity, first {s(opts.ppl_windows, 1)} windows: RTN int8 / int4 vs the float32 model",
            (
                int8,
                int4,
                ppl("float32", m, 45),
                ppl("rtn_int8", int8.creates or "", 60),
                ppl("rtn_int4", int4.creates or "", 60),
            ),
            summarize_perplexity,
        ),
    ]


def serving_steps(opts: SuiteOptions) -> tuple[tuple[Step, ...], tuple[str, ...]]:
    """The serving entry's steps (the load's bound, our server, then vLLM in each dtype and binding) and the
    names of the vLLM steps. Every load is the same command but for the server it starts."""
    s = opts.size
    load = (
        *("bench", "serve", "--endpoint", "chat", "--num-prompts", s(SERVE_PROMPTS, 4)),
        *("--output-len", s(SERVE_OUTPUT_LEN, 8), "--max-concurrency", s(SERVE_STREAMS, 4)),
        *("--request-rate", "inf", "--ignore-eos", "--no-plots", "--client", opts.client, "--tokenizer", opts.model),
        *(("--vllm-venv", opts.vllm_venv) if opts.vllm_venv else ()),
        *(("--vllm-model", opts.vllm_model) if opts.vllm_model else ()),
    )
    bound = (
        *("bench", "roofline", "--model", opts.model, "--dtype", "bfloat16", "--num-threads", str(opts.num_threads)),
        *("--no-measure-engine", "--batches", f"1,{s(SERVE_STREAMS, 4)}"),
        *(("--buffer-mib", "64") if opts.quick else ()),
        *opts.engine_args,
    )
    server = shlex.join(["--model", opts.model, "--dtype", "bfloat16", *opts.engine_args])
    steps = [
        Step("load bound", bound, est_s=30),
        Step("tokenmill", (*load, "--launch-server", "--server-args", server), "serve", est_s=110),
    ]
    names = []
    for dtype in opts.vllm_dtypes if opts.vllm_reason is None else ():  # absent: summarize_serving says why
        for binding in opts.vllm_bindings:
            names.append(f"vllm {dtype} {binding}")
            flags = ("--launch-vllm", "--vllm-dtype", dtype, "--vllm-binding", binding, "--skip-load-on-fallback")
            steps.append(Step(names[-1], (*load, *flags), "serve", est_s=270))
    return tuple(steps), tuple(names)
