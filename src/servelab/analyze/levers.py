"""Recommendations: the catalogued levers, each tied to the findings that call for it.

The levers themselves -- title, knob, cost, complexity, when not worth it, each server's
spelling of each setting -- are defined once in ``analyze.lever_catalogue``, which tune's
candidates read too. Every recommendation states the action (engine arguments where servelab
has them), the expected gain (quantified from this run's step cost model and evidence when
possible), its cost, the operational complexity, and when it is NOT worth doing. Gains are
first-order estimates from the fitted step cost model, never promises: the way to
confirm one is `servelab bench --matrix` with and without it.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

from servelab.analyze.diagnosis.findings import Context, Finding
from servelab.analyze.lever_catalogue import (
    ADMISSION,
    LAUNCH,
    LEVERS,
    PRIORITY_FLAGS,
    advice_flag,
    cli_flag,
    neutral,
)
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


def _recommendation(lever: str, **fields: Any) -> Recommendation:
    """A recommendation of the catalogued ``lever`` (``analyze.lever_catalogue``): its
    title, cost, complexity and when it is not worth it, unless ``fields`` word them for
    this run."""
    lv = LEVERS[lever]
    base: dict[str, Any] = {
        "title": lv.title,
        "cost": lv.cost,
        "complexity": lv.complexity,
        "not_worth_it_when": lv.not_worth_it_when,
    }
    return Recommendation(lever=lever, **(base | fields))


def server_kind(c: Context) -> str:
    """Whose flags a recommendation names: ``servelab``, ``vllm``, ``sglang``, ``llamacpp``
    (``analyze.server_side.serversettings.server_kind``: what the server says of itself, the figures its
    responses carried, or the command it was launched with), or ``other`` (neutral wording)."""
    return run_server_kind(c.run)


def engine_flags(c: Context, **flags: Any) -> str:
    """The settings as the target takes them: servelab's ``serve`` flags (True -> --x,
    False -> --no-x), the flags of ``vllm serve``, SGLang's ``launch_server`` or
    ``llama-server``, and neutral wording for what the server has no flag for."""
    kind = server_kind(c)
    if kind == "servelab":
        parts = [cli_flag(k, v) for k, v in flags.items()]
        return f'servelab serve {" ".join(parts)} (bench: --engine-args "{" ".join(parts)}")'
    named, unnamed = [], []
    for k, v in flags.items():
        f = advice_flag(kind, k, v)
        if f is None:
            unnamed.append(neutral(k, v))
        elif f:
            named.append(f)
    text = f"{LAUNCH[kind][0]} {' '.join(named)}" if named else ""
    if unnamed:
        text += ("; " if text else "") + "on the server: " + "; ".join(unnamed)
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
    return _recommendation(
        "chunked_prefill",
        action=engine_flags(c, enable_chunked_prefill=True, max_num_batched_tokens=budget),
        expected_gain=gain,
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
    return _recommendation(
        "batch_budget_down",
        action=engine_flags(c, max_num_batched_tokens=target)
        + (
            f" (or --long-prefill-token-threshold {target}: only long prompts are cut smaller)"
            if server_kind(c) == "vllm"
            else ""
        )
        + _now(c, "max_num_batched_tokens"),
        expected_gain=gain,
    )


def batch_budget_up(c: Context, f: Finding) -> Recommendation:
    budget = _cfg(c, "max_num_batched_tokens", DEFAULT_TOKEN_BUDGET)
    return _recommendation(
        "batch_budget_up",
        action=engine_flags(
            c, max_num_batched_tokens=_scaled(c, "max_num_batched_tokens", budget, 2)
        )
        + _now(c, "max_num_batched_tokens"),
        expected_gain=(
            "long prompts finish prefill in half the steps, saving one step overhead and one "
            "co-scheduled decode batch per chunk saved"
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
    return _recommendation(
        "prefix_caching",
        title=LEVERS["prefix_caching"].title if on is False else "Make prefixes reusable",
        action=engine_flags(c, enable_prefix_caching=True)
        if on is False or (on is None and server_kind(c) != "servelab")
        else "put the shared text first and keep it byte-identical; give the cache KV room "
        "(kv_cache_memory_gb) so shared blocks are not evicted",
        expected_gain=gain,
    )


def max_num_seqs_up(c: Context, f: Finding) -> Recommendation:
    n = _cfg(c, "max_num_seqs", 64)
    cost = c.attr.cost
    extra = ""
    if cost is not None:
        extra = f"; each extra sequence adds about {cost.decode_per_seq * 1e3:.1f} ms to every step"
    return _recommendation(
        "max_num_seqs_up",
        action=engine_flags(c, max_num_seqs=_scaled(c, "max_num_seqs", n, 2))
        + _now(c, "max_num_seqs"),
        expected_gain=(
            f"queueing behind the sequence cap ({f.evidence.get('queue_ms_mean', '?')} ms mean) "
            "shrinks while the KV cache has room"
        ),
        cost=LEVERS["max_num_seqs_up"].cost + extra,
    )


def max_num_seqs_down(c: Context, f: Finding) -> Recommendation:
    n = _cfg(c, "max_num_seqs", 64)
    return _recommendation(
        "max_num_seqs_down",
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
    )


def kv_memory(c: Context, f: Finding) -> Recommendation:
    gb = _cfg(c, "kv_cache_memory_gb", 2.0)
    lost = f.evidence.get("seconds_lost_to_preemption")
    gain = "no preemption: preempted requests no longer recompute their prompt and output"
    if lost:
        gain += f" ({lost:.2f} s of request time in this run)"
    return _recommendation(
        "kv_memory",
        action=engine_flags(
            c,
            kv_cache_memory=f"{gb * 2:g}G"
            if server_kind(c) == "servelab"
            else _scaled(c, "kv_cache_memory_gb", gb, 2),
        )
        + _now(c, "kv_cache_memory_gb", " GB"),
        expected_gain=gain,
    )


def priorities(c: Context, f: Finding) -> Recommendation:
    by_class: dict[str, list[float]] = {}
    for x in c.ok:
        by_class.setdefault(x.workload_class, []).append(x.queue or 0.0)
    means = {k: statistics.fmean(v) for k, v in by_class.items() if v}
    worst = max(means, key=means.__getitem__) if means else "interactive"
    flags = PRIORITY_FLAGS.get(server_kind(c))
    return _recommendation(
        "priorities",
        action=(f"{flags}, then " if flags else "")
        + "send the interactive class with a lower `priority` value (vLLM's convention: lower "
        "is served first) and batch work with a higher one",
        expected_gain=(
            f"that class skips the queue: its queueing ({means.get(worst, 0.0) * 1e3:.0f} ms mean "
            f"for '{worst}' here) drops toward zero"
        ),
    )


def speculative_decoding(c: Context, f: Finding) -> Recommendation:
    return _recommendation(
        "speculative_decoding",
        action="enable speculation with a small draft (n-gram or draft model), 2-4 proposed tokens",
        expected_gain=(
            "at small batch (memory-bound decode) each step can emit several tokens: with 3 "
            "drafts and 60% acceptance about 1.8 tokens per step, so TPOT nearly halves"
        ),
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
    rec = _recommendation(
        "disaggregation",
        action="run prefill and decode on separate workers and hand the KV cache over",
        expected_gain=(
            "decode never waits for a prefill and prefill never shares a step (interference is "
            f"{share:.0%} of TTFT here)"
        ),
        cost=(
            f"a KV transfer per request (about {mean_in * kv_bytes / 1e6:.0f} MB for a mean "
            f"{mean_in:.0f}-token prompt), two workers' worth of hardware"
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


def capacity(c: Context, f: Finding) -> Recommendation:
    return _recommendation(
        "capacity",
        action="more replicas behind a load balancer, or admission control ("
        + ADMISSION.get(
            server_kind(c),
            "a bounded queue at the server or its load balancer that answers 429 "
            "instead of queueing without bound",
        )
        + ")",
        expected_gain="queueing falls in proportion to the capacity added; bursts are absorbed",
    )


def client(c: Context, f: Finding) -> Recommendation:
    return _recommendation(
        "client",
        action=(
            "rerun with a lower request rate or more client workers (Ray) and keep the client off "
            "the server's cores"
        ),
        expected_gain="a valid measurement: TTFT and ITL then describe the server, not the client",
    )


def api_process(c: Context, f: Finding) -> Recommendation:
    return _recommendation(
        "api_process",
        action=(
            "profile the HTTP process: tokenisation, chat template, JSON encoding per chunk; keep "
            "it on its own core"
        ),
        expected_gain=f"up to {f.evidence['network_http_ms_p50']} ms of TTFT per request",
    )


# Each catalogued lever's recommendation, worded from the finding that called for it.
BUILDERS: dict[str, Callable[[Context, Finding], Recommendation]] = {
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
            rec = BUILDERS[lever](c, f)
            rec.because.append(f.id)
            out[lever] = rec
    return list(out.values())
