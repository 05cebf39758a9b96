"""Recommendations: docs/design/overview.md's levers, each tied to the findings that call for it.

Every recommendation states the action (engine arguments where servelab has them), the
expected gain (quantified from this run's step cost model and evidence when possible),
its cost, the operational complexity, and when it is NOT worth doing. Gains are
first-order estimates from the fitted step cost model, never promises: the way to
confirm one is `servelab bench --matrix` with and without it.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

from servelab.analyze.diagnosis.findings import Context, Finding
from servelab.analyze.server_side.serversettings import server_kind as run_server_kind
from servelab.vocab import DEFAULT_TOKEN_BUDGET

# KV bytes per token of the default model in fp32 (docs/reference-figures.md): the transfer
# disaggregation adds per prompt token.
DEFAULT_KV_BYTES_PER_TOKEN = 46 * 1024
# Disaggregation pays only where phase contention is sustained: interference at least this
# share of TTFT and prefill stalls at least this share of decode time.
SUSTAINED_INTERFERENCE = 0.25
SUSTAINED_DECODE_LOST = 0.10


@dataclass(kw_only=True)
class Recommendation:
    lever: str
    title: str
    action: str
    expected_gain: str
    cost: str
    complexity: str  # low | medium | high
    not_worth_it_when: str
    because: list[str] = field(default_factory=list)
    # False: the lever was considered for these findings but this run's evidence says
    # it would not pay; ``why_not`` says why.
    recommended: bool = True
    why_not: str = ""

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def server_kind(c: Context) -> str:
    """Whose flags a recommendation names: ``servelab``, ``vllm``, ``sglang``, ``llamacpp``
    (``analyze.server_side.serversettings.server_kind``: what the server says of itself, the figures its
    responses carried, or the command it was launched with), or ``other`` (neutral wording)."""
    return run_server_kind(c.run)


# What each engine setting is called where the target has no flag to name.
_NEUTRAL: dict[str, str | tuple[str, str]] = {
    "enable_chunked_prefill": ("turn chunked prefill on", "turn chunked prefill off"),
    "enable_prefix_caching": ("turn prefix caching on", "turn prefix caching off"),
    "max_num_batched_tokens": "set the per-step token budget (prefill chunk size) to {v}",
    "max_num_seqs": "cap the sequences run per step at {v}",
    "kv_cache_memory": "give the KV cache {v} of memory",
}


def _neutral(name: str, v: Any) -> str:
    text = _NEUTRAL[name]
    return text[0 if v else 1] if isinstance(text, tuple) else text.format(v=v)


def _vllm_flag(name: str, v: Any) -> str | None:
    if name == "kv_cache_memory":
        # vLLM sizes KV by a GPU memory fraction; its CPU build reads an env variable (GiB)
        return f"--gpu-memory-utilization (raise it; CPU build: VLLM_CPU_KVCACHE_SPACE={v})"
    return _cli_flag(name, v)


def _sglang_flag(name: str, v: Any) -> str | None:
    """``python -m sglang.launch_server`` (sglang/srt/server_args.py). Chunked prefill is on
    by default and its chunk size is prefill-only: decodes run in their own batches unless
    --enable-mixed-chunk."""
    if name == "enable_chunked_prefill":
        return "" if v else "--chunked-prefill-size -1"
    if name == "max_num_batched_tokens":
        return f"--chunked-prefill-size {v}"
    if name == "max_num_seqs":
        return f"--max-running-requests {v}"
    if name == "enable_prefix_caching":
        if not v:
            return "--disable-radix-cache"
        return (
            "without --disable-radix-cache (the radix cache is on by default) and with "
            "--schedule-policy lpm (queued requests with the longest cached prefix run first)"
        )
    # kv_cache_memory: one fraction of GPU memory holds the weights and the KV pool
    return "--mem-fraction-static (raise it: the KV pool gets what the weights leave)"


def _llamacpp_flag(name: str, v: Any) -> str | None:
    """``llama-server`` (llama.cpp common/arg.cpp). A prompt is always cut into batches of
    --batch-size tokens, shared with the other slots' decode tokens: chunking has no switch,
    and a slot reuses the cached prefix of its last prompt unless a request sends
    ``cache_prompt: false``."""
    if name == "enable_chunked_prefill":
        return "" if v else None
    if name == "max_num_batched_tokens":
        return f"--batch-size {v}"
    if name == "max_num_seqs":
        return f"--parallel {v} (the slots share one KV cache of --ctx-size tokens)"
    if name == "enable_prefix_caching":
        return "--cache-ram <MiB> (not 0: prompt caches outlive their slot)" if v else None
    return f"--ctx-size {v} (the KV cache of all slots, in tokens)"


# The command a target is launched with, and each setting as that command takes it
# ("": implied by another flag of the same action; None: the server has no such flag).
_LAUNCH: dict[str, tuple[str, Callable[[str, Any], str | None]]] = {
    "vllm": ("vllm serve", _vllm_flag),
    "sglang": ("python -m sglang.launch_server", _sglang_flag),
    "llamacpp": ("llama-server", _llamacpp_flag),
}


def _cli_flag(name: str, v: Any) -> str:
    """True -> --x, False -> --no-x, else --x v (servelab and vLLM share this style)."""
    flag = name.replace("_", "-")
    if v is True:
        return f"--{flag}"
    if v is False:
        return f"--no-{flag}"
    return f"--{flag} {v}"


def engine_flags(c: Context, **flags: Any) -> str:
    """The settings as the target takes them: servelab's ``serve`` flags (True -> --x,
    False -> --no-x), the flags of ``vllm serve``, SGLang's ``launch_server`` or
    ``llama-server``, and neutral wording for what the server has no flag for."""
    kind = server_kind(c)
    if kind == "servelab":
        parts = [_cli_flag(k, v) for k, v in flags.items()]
        return f'servelab serve {" ".join(parts)} (bench: --engine-args "{" ".join(parts)}")'
    launch, flag = _LAUNCH.get(kind, ("", lambda *_: None))
    named, neutral = [], []
    for k, v in flags.items():
        f = flag(k, v)
        if f is None:
            neutral.append(_neutral(k, v))
        elif f:
            named.append(f)
    text = f"{launch} {' '.join(named)}" if named else ""
    if neutral:
        text += ("; " if text else "") + "on the server: " + "; ".join(neutral)
    return text


def _cfg(c: Context, key: str, default: Any) -> Any:
    v = c.config(key)
    return default if v is None else v


def _scaled(c: Context, key: str, default: float, factor: float) -> Any:
    """``factor`` x the run's setting; for another server whose setting was not recorded,
    the rule in words rather than a number built on servelab's default."""
    v = c.config(key)
    if v is None and server_kind(c) != "servelab":
        return f"<{factor:g}x the current value>"
    return (default if v is None else v) * factor


def _now(c: Context, key: str, unit: str = "") -> str:
    """ "; now X" where the run recorded the setting; nothing where it is unknown."""
    v = c.config(key)
    return "" if v is None else f"; now {v:g}{unit}" if isinstance(v, float) else f"; now {v}"


def _decode_step(c: Context) -> float | None:
    """Typical decode-only step time under this run's batch sizes."""
    cost = c.attr.cost
    batches = [s.decode_seqs for s in c.run.steps if s.decode_seqs and not s.prefill_tokens]
    if cost is None or not batches:
        return None
    return cost.predict(0, statistics.median(batches))


def _chunk_budget(step: float, per_token: float, cap: int) -> int:
    """The largest multiple of 64 tokens (at least 64, at most ``cap``) whose prefill chunk
    costs no more than one decode step, so a step that carries it stays within ~2x a decode
    step."""
    return int(max(64, min(cap, step / per_token) // 64 * 64))


def chunked_prefill(c: Context, f: Finding) -> Recommendation:
    budget = _cfg(c, "max_num_batched_tokens", DEFAULT_TOKEN_BUDGET)
    gain = "long prefills no longer stall running decodes for a whole prompt"
    cost = c.attr.cost
    step = _decode_step(c)
    why_not = ""
    if cost is not None and step is not None and cost.prefill_per_token > 0:
        budget = _chunk_budget(step, cost.prefill_per_token, budget)
        bound = step + cost.prefill_per_token * budget
        worst = f.evidence["stall_ms_max"] / 1e3
        gain = (
            f"worst ITL from {worst * 1e3:.0f} ms to about {bound * 1e3:.0f} ms "
            f"(a decode step plus one {budget}-token chunk); "
            f"{f.evidence['share_of_decode_time_lost']:.1%} of decode time recovered"
        )
        if bound >= worst:
            why_not = (
                f"a decode step plus a {budget}-token chunk (~{bound * 1e3:.0f} ms) is no "
                f"shorter than the worst stall here ({worst * 1e3:.0f} ms)"
            )
    return Recommendation(
        lever="chunked_prefill",
        title="Turn chunked prefill on",
        action=engine_flags(c, enable_chunked_prefill=True, max_num_batched_tokens=budget),
        expected_gain=gain,
        cost=(
            "a long prompt takes several steps, so its own TTFT grows by one step overhead and "
            "one decode batch per extra chunk"
        ),
        complexity="low",
        not_worth_it_when=(
            "prompts are short (they fit one chunk anyway) or no decodes run beside long prompts "
            "(offline batch jobs that only care about throughput)"
        ),
        recommended=not why_not,
        why_not=why_not,
    )


def batch_budget_down(c: Context, f: Finding) -> Recommendation:
    budget = _cfg(c, "max_num_batched_tokens", DEFAULT_TOKEN_BUDGET)
    cost = c.attr.cost
    step = _decode_step(c)
    target = max(64, budget // 4)
    gain = "shorter prefill chunks beside each decode step, so smaller ITL spikes"
    if cost is not None and step is not None and cost.prefill_per_token > 0:
        target = _chunk_budget(step, cost.prefill_per_token, budget // 2)
        gain = (
            f"worst ITL from {f.evidence['stall_ms_max']:.0f} ms to about "
            f"{(step + cost.prefill_per_token * target) * 1e3:.0f} ms"
        )
    return Recommendation(
        lever="batch_budget_down",
        title="Lower the chunked-prefill token budget",
        action=engine_flags(c, max_num_batched_tokens=target)
        + (
            f" (or --long-prefill-token-threshold {target}: only long prompts are cut smaller)"
            if server_kind(c) == "vllm"
            else ""
        )
        + _now(c, "max_num_batched_tokens"),
        expected_gain=gain,
        cost=(
            "long prompts need more steps, so their TTFT rises; throughput falls slightly as each "
            "step's fixed overhead is shared by fewer tokens"
        ),
        complexity="low",
        not_worth_it_when=(
            "TTFT of long prompts matters more than smooth streaming, or the spikes come from "
            "preemption or the client rather than prefill"
        ),
    )


def batch_budget_up(c: Context, f: Finding) -> Recommendation:
    budget = _cfg(c, "max_num_batched_tokens", DEFAULT_TOKEN_BUDGET)
    return Recommendation(
        lever="batch_budget_up",
        title="Raise the chunked-prefill token budget",
        action=engine_flags(
            c, max_num_batched_tokens=_scaled(c, "max_num_batched_tokens", budget, 2)
        )
        + _now(c, "max_num_batched_tokens"),
        expected_gain=(
            "long prompts finish prefill in half the steps, saving one step overhead and one "
            "co-scheduled decode batch per chunk saved"
        ),
        cost="bigger chunks make larger ITL spikes for the requests decoding beside them",
        complexity="low",
        not_worth_it_when=(
            "streaming smoothness (ITL p99) is the tighter SLO, or prompts already fit one chunk"
        ),
    )


def prefix_caching(c: Context, f: Finding) -> Recommendation:
    cost = c.attr.cost
    on = c.config("enable_prefix_caching")
    gain = "shared prompt prefixes are computed once instead of per request"
    if cost is not None:
        groups: dict[str, list[int]] = {}
        for r in c.run.records:
            if r.prefix_group:
                groups.setdefault(r.prefix_group, []).append(r.input_tokens)
        # Upper bound: the shared part cannot be longer than the group's shortest prompt.
        saved = [min(v) * cost.prefill_per_token for v in groups.values() if len(v) > 1]
        if saved:
            gain = (
                f"up to {statistics.fmean(saved) * 1e3:.0f} ms less prefill per request that "
                "reuses a prefix (upper bound: the shared part is at most the shortest prompt)"
            )
    return Recommendation(
        lever="prefix_caching",
        title="Use prefix caching" if on is False else "Make prefixes reusable",
        action=engine_flags(c, enable_prefix_caching=True)
        if on is False or (on is None and server_kind(c) != "servelab")
        else "put the shared text first and keep it byte-identical; give the cache KV room "
        "(kv_cache_memory_gb) so shared blocks are not evicted",
        expected_gain=gain,
        cost="hashing per block, and cached blocks hold KV memory that running requests could use",
        complexity="low",
        not_worth_it_when="prompts share nothing, or the shared part is shorter than one KV block",
    )


def max_num_seqs_up(c: Context, f: Finding) -> Recommendation:
    n = _cfg(c, "max_num_seqs", 64)
    cost = c.attr.cost
    extra = ""
    if cost is not None:
        extra = f"; each extra sequence adds about {cost.decode_per_seq * 1e3:.1f} ms to every step"
    return Recommendation(
        lever="max_num_seqs_up",
        title="Admit more sequences per step",
        action=engine_flags(c, max_num_seqs=_scaled(c, "max_num_seqs", n, 2))
        + _now(c, "max_num_seqs"),
        expected_gain=(
            f"queueing behind the sequence cap ({f.evidence.get('queue_ms_mean', '?')} ms mean) "
            "shrinks while the KV cache has room"
        ),
        cost="larger decode batches raise TPOT" + extra,
        complexity="low",
        not_worth_it_when=(
            "the KV cache is already near full (more sequences will preempt) or TPOT is the tight "
            "SLO"
        ),
    )


def max_num_seqs_down(c: Context, f: Finding) -> Recommendation:
    n = _cfg(c, "max_num_seqs", 64)
    return Recommendation(
        lever="max_num_seqs_down",
        title="Cap the batch lower",
        action=engine_flags(
            c,
            max_num_seqs=max(1, n // 2)
            if c.config("max_num_seqs") is not None or server_kind(c) == "servelab"
            else _scaled(c, "max_num_seqs", n, 0.5),
        )
        + _now(c, "max_num_seqs"),
        expected_gain=(
            "fewer sequences share each step: lower TPOT and no preemption from KV overcommit"
        ),
        cost="lower throughput; requests wait in the queue instead (TTFT rises under load)",
        complexity="low",
        not_worth_it_when="throughput is the goal and TPOT already meets its SLO",
    )


def kv_memory(c: Context, f: Finding) -> Recommendation:
    gb = _cfg(c, "kv_cache_memory_gb", 2.0)
    lost = f.evidence.get("seconds_lost_to_preemption")
    gain = "no preemption: preempted requests no longer recompute their prompt and output"
    if lost:
        gain += f" ({lost:.2f} s of request time in this run)"
    return Recommendation(
        lever="kv_memory",
        title="Give the KV cache more memory",
        action=engine_flags(
            c,
            kv_cache_memory=f"{gb * 2:g}G"
            if server_kind(c) == "servelab"
            else _scaled(c, "kv_cache_memory_gb", gb, 2),
        )
        + _now(c, "kv_cache_memory_gb", " GB"),
        expected_gain=gain,
        cost="memory taken from the host or GPU",
        complexity="low",
        not_worth_it_when="the machine has no memory to spare; then cap max_num_seqs instead",
    )


# What makes a server honour the request's `priority` the way servelab's workloads set it
# (lower first): vLLM schedules by it only under --scheduling-policy priority; SGLang serves
# the higher value first unless told otherwise.
_PRIORITY_FLAGS = {
    "vllm": "vllm serve --scheduling-policy priority, then ",
    "sglang": "python -m sglang.launch_server --enable-priority-scheduling "
    "--schedule-low-priority-values-first, then ",
}


def priorities(c: Context, f: Finding) -> Recommendation:
    by_class: dict[str, list[float]] = {}
    for x in c.ok:
        by_class.setdefault(x.workload_class, []).append(x.queue or 0.0)
    means = {k: statistics.fmean(v) for k, v in by_class.items() if v}
    worst = max(means, key=means.__getitem__) if means else "interactive"
    return Recommendation(
        lever="priorities",
        title="Serve the latency-sensitive class first",
        action=_PRIORITY_FLAGS.get(server_kind(c), "")
        + "send the interactive class with a lower `priority` value (vLLM's convention: lower "
        "is served first) and batch work with a higher one",
        expected_gain=(
            f"that class skips the queue: its queueing ({means.get(worst, 0.0) * 1e3:.0f} ms mean "
            f"for '{worst}' here) drops toward zero"
        ),
        cost=(
            "the other classes wait longer by about the same total; under preemption, "
            "low-priority requests are the ones recomputed"
        ),
        complexity="medium",
        not_worth_it_when="all classes have the same SLO, or the queue is empty most of the time",
    )


def speculative_decoding(c: Context, f: Finding) -> Recommendation:
    return Recommendation(
        lever="speculative_decoding",
        title="Speculative decoding",
        action="enable speculation with a small draft (n-gram or draft model), 2-4 proposed tokens",
        expected_gain=(
            "at small batch (memory-bound decode) each step can emit several tokens: with 3 "
            "drafts and 60% acceptance about 1.8 tokens per step, so TPOT nearly halves"
        ),
        cost=(
            "extra compute per step for drafting and verification; acceptance varies with the text"
        ),
        complexity="medium",
        not_worth_it_when=(
            "batches are large (decode is compute-bound: batch mean "
            f"{f.evidence.get('decode_batch_mean', '?')} here) or sampling is at high temperature "
            "(few drafts are accepted)"
        ),
    )


def disaggregation(c: Context, f: Finding) -> Recommendation:
    interf = sum(x.interference or 0.0 for x in c.ok)
    ttft = sum(x.ttft for x in c.ok)
    share = interf / ttft if ttft > 0 else 0.0
    lost = f.evidence.get("share_of_decode_time_lost", 0.0)
    sustained = share >= SUSTAINED_INTERFERENCE and lost >= SUSTAINED_DECODE_LOST
    sim = c.run.server.get("simulated")
    kv_bytes = (
        c.run.server.get("kv_bytes_per_token")
        or (sim.get("kv_bytes_per_token") if isinstance(sim, dict) else None)
        or DEFAULT_KV_BYTES_PER_TOKEN
    )
    inputs = [x.input_tokens for x in c.ok]
    mean_in = statistics.fmean(inputs) if inputs else 0.0
    rec = Recommendation(
        lever="disaggregation",
        title="Disaggregate prefill and decode",
        action="run prefill and decode on separate workers and hand the KV cache over",
        expected_gain=(
            "decode never waits for a prefill and prefill never shares a step (interference is "
            f"{share:.0%} of TTFT here)"
        ),
        cost=(
            f"a KV transfer per request (about {mean_in * kv_bytes / 1e6:.0f} MB for a mean "
            f"{mean_in:.0f}-token prompt), two workers' worth of hardware"
        ),
        complexity="high",
        not_worth_it_when=(
            "contention is bursty rather than sustained, chunked prefill already bounds the "
            "spikes, or the KV transfer costs more than the interference it removes"
        ),
    )
    if not sustained:
        rec.recommended = False
        rec.why_not = (
            f"phase contention is not sustained: interference is {share:.0%} of TTFT and "
            f"prefill stalls cost {f.evidence.get('share_of_decode_time_lost', 0.0):.0%} of "
            "decode time; bound the spikes with chunked prefill first"
        )
    return rec


# A server's own bound on its waiting queue, where it has one.
_ADMISSION = {
    "servelab": "servelab serve --max-queue N answers 429 instead of queueing without bound)",
    "sglang": "python -m sglang.launch_server --max-queued-requests N rejects requests beyond "
    "N waiting instead of queueing without bound)",
}


def capacity(c: Context, f: Finding) -> Recommendation:
    return Recommendation(
        lever="capacity",
        title="Add capacity or shape the load",
        action="more replicas behind a load balancer, or admission control ("
        + _ADMISSION.get(
            server_kind(c),
            "a bounded queue at the server or its load balancer that answers 429 "
            "instead of queueing without bound)",
        ),
        expected_gain="queueing falls in proportion to the capacity added; bursts are absorbed",
        cost="hardware, or rejected requests with admission control",
        complexity="medium",
        not_worth_it_when="the queue only forms in rare bursts that an SLO tolerates",
    )


def client(c: Context, f: Finding) -> Recommendation:
    return Recommendation(
        lever="client",
        title="Fix the client before reading the server's numbers",
        action=(
            "rerun with a lower request rate or more client workers (Ray) and keep the client off "
            "the server's cores"
        ),
        expected_gain="a valid measurement: TTFT and ITL then describe the server, not the client",
        cost="a second machine or core for the client",
        complexity="low",
        not_worth_it_when="never: a lagging client makes every server figure of this run suspect",
    )


def api_process(c: Context, f: Finding) -> Recommendation:
    return Recommendation(
        lever="api_process",
        title="Look at the API process, not the engine",
        action=(
            "profile the HTTP process: tokenisation, chat template, JSON encoding per chunk; keep "
            "it on its own core"
        ),
        expected_gain=f"up to {f.evidence['network_http_ms_p50']} ms of TTFT per request",
        cost="engineering time",
        complexity="medium",
        not_worth_it_when="the overhead is a small share of TTFT",
    )


LEVERS: dict[str, Callable[[Context, Finding], Recommendation]] = {
    "chunked_prefill": chunked_prefill,
    "batch_budget_down": batch_budget_down,
    "batch_budget_up": batch_budget_up,
    "prefix_caching": prefix_caching,
    "max_num_seqs_up": max_num_seqs_up,
    "max_num_seqs_down": max_num_seqs_down,
    "kv_memory": kv_memory,
    "priorities": priorities,
    "speculative_decoding": speculative_decoding,
    "disaggregation": disaggregation,
    "capacity": capacity,
    "client": client,
    "api_process": api_process,
}


def recommend(c: Context, findings: list[Finding]) -> list[Recommendation]:
    """One recommendation per lever, built from the first (most confident) finding naming it."""
    out: dict[str, Recommendation] = {}
    for f in findings:
        for lever in f.levers:
            if lever in out:
                out[lever].because.append(f.id)
                continue
            rec = LEVERS[lever](c, f)
            rec.because.append(f.id)
            out[lever] = rec
    return list(out.values())
