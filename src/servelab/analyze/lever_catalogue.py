"""The levers, catalogued once: what `servelab diagnose` recommends and `servelab tune` tries.

A *lever* is one direction an operator can move (``batch_budget_down``, ``priorities``, ...);
findings name the levers that answer them (``Finding.levers``). Each lever moves a *knob*
(one engine setting or one deployment choice; ``None``: nothing the engine's settings
change, such as the benchmark client). For each lever :data:`LEVERS` holds its title, its
knob, the findings that call for it, what it costs, its operational complexity (``low`` |
``medium`` | ``high``) and what the operator must run, watch and roll back, when it is not
worth doing, and why ``tune`` cannot predict it where it cannot. For each knob
:data:`KNOBS` holds the engine settings it sets and how its candidate values are derived
(the grids themselves are built in ``analyze.tuning.candidates``).

Each engine setting's spelling on each server lives here too: :func:`advice_flag` words a
setting as a recommendation for servelab, ``vllm serve``, SGLang's ``launch_server`` and
``llama-server`` (or in neutral words where the server has no flag), and :data:`LAUNCH`
names each server's command. Candidates that relaunch a server are rendered by
``analyze.server_side.serversettings.render_flags`` (the exact flags a launch template
takes, which it also parses back).

``analyze.levers`` builds diagnosis recommendations from these entries and
``analyze.tuning.candidates`` builds tune's candidates from them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from servelab.analyze.server_side.serversettings import LLAMACPP, SERVELAB, SGLANG, VLLM

# Operational complexity, least to operate first: the decision prefers the lower one
# where gains tie.
COMPLEXITY = ("low", "medium", "high")


@dataclass(frozen=True)
class Knob:
    """One engine setting or deployment choice; ``settings`` the engine-config fields it
    sets (empty: not an engine setting); ``values`` how its candidate values are derived."""

    name: str
    settings: tuple[str, ...]
    values: str


@dataclass(frozen=True)
class Lever:
    """One direction to move a knob (module doc). ``unpredicted``: why tune cannot simulate
    it at all; ``elsewhere``: why not on another server's twin (empty: it can)."""

    name: str
    title: str
    knob: str | None
    findings: tuple[str, ...]
    cost: str
    complexity: str
    operates: str
    not_worth_it_when: str
    unpredicted: str = ""
    elsewhere: str = ""

    @property
    def complexity_rank(self) -> int:
        return COMPLEXITY.index(self.complexity)


KNOBS: dict[str, Knob] = {
    k.name: k
    for k in (
        Knob(
            "chunking",
            ("enable_chunked_prefill", "max_num_batched_tokens"),
            "powers of two from 64 to the first at or above the longest prompt; the prompts' "
            "p25/p50/p90 where not within 20% of those; chunking off where it is on",
        ),
        Knob(
            "max_num_seqs",
            ("max_num_seqs",),
            "1/4, 1/2 and 3/4 of the most sequences a step ran; 2x and 4x the cap",
        ),
        Knob(
            "prefix_caching",
            ("enable_prefix_caching",),
            "on where it was off (where it was on: the KV pool's room)",
        ),
        Knob("kv_memory", ("num_kv_blocks", "kv_cache_memory_gb"), "the KV pool 1.5x, 2x, 4x"),
        Knob("priorities", (), "each class served first (priority 0, the others 1)"),
        Knob(
            "speculation",
            ("speculative_config",),
            "n-gram with k = 2, 4, 8 drafts (and off where the run speculated); only where "
            "the run speculated or a probe of its traffic measured the acceptance",
        ),
        Knob("replicas", (), "2, 3 and 4 replicas behind a round-robin router"),
    )
}

_FLAG_RESTART = "one launch flag; roll back by restarting with the old one"

LEVERS: dict[str, Lever] = {
    lv.name: lv
    for lv in (
        Lever(
            "chunked_prefill",
            "Turn chunked prefill on",
            "chunking",
            ("itl_prefill_interference",),
            cost=(
                "a long prompt takes several steps, so its own TTFT grows by one step "
                "overhead and one decode batch per extra chunk"
            ),
            complexity="low",
            operates=f"{_FLAG_RESTART}; watch the long prompts' TTFT",
            not_worth_it_when=(
                "prompts are short (they fit one chunk anyway) or no decodes run beside long "
                "prompts (offline batch jobs that only care about throughput)"
            ),
        ),
        Lever(
            "batch_budget_down",
            "Lower the chunked-prefill token budget",
            "chunking",
            ("itl_prefill_interference",),
            cost=(
                "long prompts need more steps, so their TTFT rises; throughput falls slightly "
                "as each step's fixed overhead is shared by fewer tokens"
            ),
            complexity="low",
            operates=f"{_FLAG_RESTART}; watch the long prompts' TTFT",
            not_worth_it_when=(
                "TTFT of long prompts matters more than smooth streaming, or the spikes come "
                "from preemption or the client rather than prefill"
            ),
        ),
        Lever(
            "batch_budget_up",
            "Raise the chunked-prefill token budget",
            "chunking",
            ("prefill_bound",),
            cost="bigger chunks make larger ITL spikes for the requests decoding beside them",
            complexity="low",
            operates=f"{_FLAG_RESTART}; watch ITL p99",
            not_worth_it_when=(
                "streaming smoothness (ITL p99) is the tighter SLO, or prompts already fit one "
                "chunk"
            ),
        ),
        Lever(
            "prefix_caching",
            "Use prefix caching",
            "prefix_caching",
            ("prefill_bound", "kv_pressure", "low_prefix_reuse"),
            cost=(
                "hashing per block, and cached blocks hold KV memory that running requests "
                "could use"
            ),
            complexity="low",
            operates=f"{_FLAG_RESTART}; watch the prefix hit rate and KV usage",
            not_worth_it_when="prompts share nothing, or the shared part is shorter than one KV "
            "block",
        ),
        Lever(
            "max_num_seqs_up",
            "Admit more sequences per step",
            "max_num_seqs",
            ("queue_bound",),
            cost="larger decode batches raise TPOT",
            complexity="low",
            operates=f"{_FLAG_RESTART}; watch TPOT and preemptions",
            not_worth_it_when=(
                "the KV cache is already near full (more sequences will preempt) or TPOT is "
                "the tight SLO"
            ),
        ),
        Lever(
            "max_num_seqs_down",
            "Cap the batch lower",
            "max_num_seqs",
            ("kv_pressure", "decode_bound"),
            cost="lower throughput; requests wait in the queue instead (TTFT rises under load)",
            complexity="low",
            operates=f"{_FLAG_RESTART}; watch the queue and TTFT under load",
            not_worth_it_when="throughput is the goal and TPOT already meets its SLO",
        ),
        Lever(
            "kv_memory",
            "Give the KV cache more memory",
            "kv_memory",
            ("kv_pressure",),
            cost="memory taken from the host or GPU",
            complexity="low",
            operates=f"{_FLAG_RESTART}; watch the machine's free memory",
            not_worth_it_when="the machine has no memory to spare; then cap max_num_seqs instead",
        ),
        Lever(
            "priorities",
            "Serve the latency-sensitive class first",
            "priorities",
            ("queue_bound", "kv_pressure"),
            cost=(
                "the other classes wait longer by about the same total; under preemption, "
                "low-priority requests are the ones recomputed"
            ),
            complexity="medium",
            operates=(
                "a scheduling flag on the server and a priority on every client's requests; "
                "watch the other classes' TTFT; roll back both"
            ),
            not_worth_it_when="all classes have the same SLO, or the queue is empty most of the "
            "time",
            elsewhere=(
                "class priorities are not predicted for another server: its priority "
                "scheduling (vLLM --scheduling-policy priority, SGLang "
                "--enable-priority-scheduling) is not modelled by the twin"
            ),
        ),
        Lever(
            "speculative_decoding",
            "Speculative decoding",
            "speculation",
            ("decode_bound",),
            cost=(
                "extra compute per step for drafting and verification; acceptance varies with "
                "the text"
            ),
            complexity="medium",
            operates=(
                "a speculation config (n-gram: no second model; a draft model: a second model "
                "to deploy and keep matched to the target); watch the acceptance rate"
            ),
            not_worth_it_when="batches are large (decode is compute-bound) or sampling is at "
            "high temperature (few drafts are accepted)",
        ),
        Lever(
            "disaggregation",
            "Disaggregate prefill and decode",
            None,
            ("itl_prefill_interference",),
            cost="a KV transfer per request, two workers' worth of hardware",
            complexity="high",
            operates=(
                "a second worker pool, a router and the KV hand-over between them; watch both "
                "pools' load and the transfer time"
            ),
            not_worth_it_when=(
                "contention is bursty rather than sustained, chunked prefill already bounds "
                "the spikes, or the KV transfer costs more than the interference it removes"
            ),
            unpredicted=(
                "not simulated for this engine: the simulator would price each prefill and "
                "decode worker at the whole machine's profiled speed, while the embedded "
                "disaggregated server splits this machine's cores between them"
            ),
            elsewhere=(
                "not predicted for another server: its twin is one engine fitted to this run's "
                "steps, and a disaggregated deployment's prefill and decode workers are other "
                "processes (on a CPU host, sharing its cores) whose costs no run of this one "
                "measured"
            ),
        ),
        Lever(
            "capacity",
            "Add capacity or shape the load",
            "replicas",
            ("queue_bound", "over_saturated"),
            cost="hardware, or rejected requests with admission control",
            complexity="medium",
            operates=(
                "more machines behind a load balancer; watch each replica's load; roll back by "
                "draining them"
            ),
            not_worth_it_when="the queue only forms in rare bursts that an SLO tolerates",
        ),
        Lever(
            "client",
            "Fix the client before reading the server's numbers",
            None,
            ("client_bottleneck",),
            cost="a second machine or core for the client",
            complexity="low",
            operates="the benchmark's own machine; nothing changes on the server",
            not_worth_it_when="never: a lagging client makes every server figure of this run "
            "suspect",
            unpredicted=(
                "outside the engine: the simulator replays the server, not the benchmark "
                "client's machine"
            ),
        ),
        Lever(
            "api_process",
            "Look at the API process, not the engine",
            None,
            ("network_overhead",),
            cost="engineering time",
            complexity="medium",
            operates="profiling and changing the HTTP process",
            not_worth_it_when="the overhead is a small share of TTFT",
            unpredicted=(
                "outside the engine: the simulator replays the engine core, not the HTTP "
                "process's tokenisation and streaming"
            ),
        ),
    )
}


# --------------------------------------------------------------------------- spellings

# What each engine setting is called where the target has no flag to name.
_NEUTRAL: dict[str, str | tuple[str, str]] = {
    "enable_chunked_prefill": ("turn chunked prefill on", "turn chunked prefill off"),
    "enable_prefix_caching": ("turn prefix caching on", "turn prefix caching off"),
    "max_num_batched_tokens": "set the per-step token budget (prefill chunk size) to {v}",
    "max_num_seqs": "cap the sequences run per step at {v}",
    "kv_cache_memory": "give the KV cache {v} of memory",
}


def neutral(name: str, v: Any) -> str:
    """A setting in words, for a server with no flag for it."""
    text = _NEUTRAL[name]
    return text[0 if v else 1] if isinstance(text, tuple) else text.format(v=v)


def cli_flag(name: str, v: Any) -> str:
    """True -> --x, False -> --no-x, else --x v (servelab and vLLM share this style)."""
    flag = name.replace("_", "-")
    if v is True:
        return f"--{flag}"
    if v is False:
        return f"--no-{flag}"
    return f"--{flag} {v}"


def _vllm_flag(name: str, v: Any) -> str | None:
    if name == "kv_cache_memory":
        # vLLM sizes KV by a GPU memory fraction; its CPU build reads an env variable (GiB)
        return f"--gpu-memory-utilization (raise it; CPU build: VLLM_CPU_KVCACHE_SPACE={v})"
    return cli_flag(name, v)


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


# The command a target is launched with, and each setting as that command takes it in a
# recommendation ("": implied by another flag of the same action; None: no such flag).
LAUNCH: dict[str, tuple[str, Callable[[str, Any], str | None]]] = {
    VLLM: ("vllm serve", _vllm_flag),
    SGLANG: ("python -m sglang.launch_server", _sglang_flag),
    LLAMACPP: ("llama-server", _llamacpp_flag),
}


def advice_flag(kind: str, name: str, v: Any) -> str | None:
    """Setting ``name`` to ``v`` as the ``kind`` server's launch flag, for a recommendation
    (None: it has no flag for it; "": implied by another flag)."""
    if kind == SERVELAB:
        return cli_flag(name, v)
    return LAUNCH[kind][1](name, v) if kind in LAUNCH else None


# What makes a server honour the request's `priority` the way servelab's workloads set it
# (lower first): vLLM schedules by it only under --scheduling-policy priority; SGLang serves
# the higher value first unless told otherwise.
PRIORITY_FLAGS = {
    VLLM: "vllm serve --scheduling-policy priority",
    SGLANG: "python -m sglang.launch_server --enable-priority-scheduling "
    "--schedule-low-priority-values-first",
}

# A server's own bound on its waiting queue, where it has one.
ADMISSION = {
    SERVELAB: "servelab serve --max-queue N answers 429 instead of queueing without bound",
    SGLANG: "python -m sglang.launch_server --max-queued-requests N rejects requests beyond "
    "N waiting instead of queueing without bound",
}


def lever_knob() -> dict[str, str]:
    """Each lever that moves a knob -> its knob."""
    return {lv.name: lv.knob for lv in LEVERS.values() if lv.knob is not None}
