"""The request plan: every request of a run, planned up front from a seed.

``build_plan(spec, load, seed, tokenizer=...)`` returns a ``Plan`` (a list of
``PlannedRequest``) that fixes each request's class, prompt text, exact token
lengths, intended send time, shared prefix and session. Execution (``bench.runner``)
only sends what the plan says, so a plan can be partitioned among worker processes
(keep a session's turns together: they depend on each other's responses).

Determinism: the same spec, load, seed, tokenizer, endpoint and ``max_model_len``
give the same plan. Independent random streams drive arrivals, class choice, lengths
and text, so changing e.g. the rate does not change the prompts.
"""

from __future__ import annotations

import itertools
import math
import random
from collections.abc import Callable, Iterator, Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from servelab.bench.datasets import Dataset, load_dataset
from servelab.bench.datasets.select import Selection, SessionSampler
from servelab.bench.datasets.tracetext import TraceText
from servelab.bench.workloads.arrivals import ARRIVALS, arrival_times
from servelab.bench.workloads.prompts import PromptFactory, TokenizerLike, lead_number, lead_word
from servelab.bench.workloads.spec import ClassSpec, DatasetSource, WorkloadSpec
from servelab.bench.workloads.traces import TraceRow, load_trace, scale_trace
from servelab.vocab import RequestTags

ENDPOINTS = ("completions", "chat")
TRACE_CLASS = "trace"


@dataclass
class LoadSpec:
    """How requests arrive and when the run stops.

    Closed loop: ``concurrency`` workers each send the next request when the previous
    one finishes (no send times). Open loop: ``rate`` requests/s with ``arrival`` in
    ``bench.workloads.arrivals.ARRIVALS`` (``burstiness`` for gamma; ``on``/``off`` seconds for
    onoff; ``ramp_to``/``ramp_over`` for ramp). ``trace`` replays a file's send times
    and lengths (``time_scale``, ``length_scale``; ``rate`` then sets the mean rate).
    Stops after ``requests`` sessions, or sends nothing later than ``duration`` seconds.
    ``length_scale`` also scales a workload's token lengths.
    """

    concurrency: int | None = None
    rate: float | None = None
    arrival: str = "poisson"
    burstiness: float = 1.0
    on: float | None = None
    off: float | None = None
    ramp_to: float | None = None
    ramp_over: float | None = None
    requests: int | None = None
    duration: float | None = None
    trace: str | None = None
    time_scale: float = 1.0
    length_scale: float = 1.0

    @classmethod
    def from_flags(
        cls,
        *,
        concurrency: int | None = None,
        rate: float | None = None,
        arrival: str = "poisson",
        burstiness: float = 1.0,
        on: float | None = None,
        off: float | None = None,
        ramp_to: float | None = None,
        ramp_over: float | None = None,
        requests: int | None = None,
        duration: float | None = None,
        trace: str | None = None,
        time_scale: float = 1.0,
        length_scale: float = 1.0,
        sweep: tuple[str, list[float]] | None = None,
        search: bool = False,
    ) -> LoadSpec:
        """The load a command line asks for, validated, after the rules every caller shares:

        - ON/OFF times imply onoff arrivals, and a ramp target ramp arrivals, unless
          ``arrival`` names another process than the default poisson;
        - a ``sweep`` (``("rate" | "concurrency", values)``) starts from its first value
          where the flags set none; a rate ``search`` starts from 1 request/s, open loop;
        - with no rate, concurrency or trace: one request at a time;
        - with no request count, duration or trace: 20 requests (10 for each stage of a
          sweep or a search).

        Raises ValueError naming the flag, as ``validate`` does.
        """
        if search and sweep is not None:
            raise ValueError("choose --sweep or --find-max-rate, not both")
        if search and concurrency is not None:
            raise ValueError("--find-max-rate searches over --rate (open loop); drop --concurrency")
        if arrival == "poisson" and on is not None:
            arrival = "onoff"
        if arrival == "poisson" and ramp_to is not None:
            arrival = "ramp"
        if sweep is not None and sweep[0] == "rate" and rate is None:
            rate = sweep[1][0]
        if sweep is not None and sweep[0] == "concurrency" and concurrency is None:
            concurrency = int(sweep[1][0])
        if search and rate is None:
            rate = 1.0
        if concurrency is None and rate is None and trace is None:
            concurrency = 1
        if requests is None and duration is None and trace is None:
            requests = 10 if sweep is not None or search else 20
        if rate is not None and math.isinf(rate) and (sweep is not None or search):
            raise ValueError("--rate inf cannot be swept or searched")
        load = cls(
            concurrency=concurrency,
            rate=rate,
            arrival=arrival,
            burstiness=burstiness,
            on=on,
            off=off,
            ramp_to=ramp_to,
            ramp_over=ramp_over,
            requests=requests,
            duration=duration,
            trace=trace,
            time_scale=time_scale,
            length_scale=length_scale,
        )
        load.validate()
        return load

    @property
    def closed(self) -> bool:
        return self.concurrency is not None

    def validate(self) -> None:
        """Raise ValueError saying which flag is wrong and what to do."""
        if self.concurrency is not None and self.rate is not None and self.trace is None:
            raise ValueError(
                "give either --concurrency (closed loop) or --rate (open loop), not both"
            )
        if self.concurrency is None and self.rate is None and self.trace is None:
            raise ValueError("say how requests arrive: --concurrency N, --rate R or --trace FILE")
        if self.concurrency is not None and self.concurrency < 1:
            raise ValueError(f"--concurrency must be >= 1, got {self.concurrency}")
        if self.rate is not None and not self.rate > 0:
            raise ValueError(f"--rate must be > 0 requests/s (or inf), got {self.rate}")
        if self.arrival not in ARRIVALS:
            raise ValueError(
                f"unknown --arrival {self.arrival!r}; use one of {', '.join(ARRIVALS)}"
            )
        if self.burstiness <= 0:
            raise ValueError(f"--burstiness must be > 0, got {self.burstiness}")
        if self.requests is not None and self.requests < 1:
            raise ValueError(f"--requests must be >= 1, got {self.requests}")
        if self.duration is not None and not self.duration > 0:
            raise ValueError(f"--duration must be > 0, got {self.duration}")
        if self.requests is None and self.duration is None and self.trace is None:
            raise ValueError("say when to stop: --requests N or --duration 60s")
        if not self.length_scale > 0:
            raise ValueError(f"--length-scale must be > 0, got {self.length_scale}")

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(kw_only=True)
class PlannedRequest:
    """One request of the plan.

    ``tags`` say what the request is (class, session and turn, prefix group, stream,
    priority); they reach its ClientRecord unchanged. ``prompt`` is the text to send: the whole prompt of a first turn (completions), or
    the user message (chat); for a later turn, only that turn's new text (the runner
    puts the conversation so far in front). ``prompt_tokens`` is exact: what the server
    will count for a first turn (chat template included), or the new text's own tokens
    for a later turn. ``max_tokens`` is sent as ``max_tokens`` = ``min_tokens`` with
    ``ignore_eos`` so the output length is exact where the server honours them.
    ``send_time`` is the intended send, in seconds from the start of the run (open
    loop, first turns); ``None`` in a closed loop and for later turns, which go
    ``think_time`` seconds after the previous turn's response. Requests with the same
    ``tags.prefix_group`` share their first ``prefix_tokens`` tokens exactly; every other
    prompt starts with a unique lead.
    """

    request_id: str
    index: int
    tags: RequestTags
    prompt: str
    prompt_tokens: int
    max_tokens: int
    send_time: float | None = None
    prefix_tokens: int = 0
    num_turns: int = 1
    think_time: float = 0.0
    carry_history: bool = True
    force_length: bool = True  # send min_tokens/ignore_eos (False: the model stops itself)
    reply: str | None = None  # a dataset's recorded reply: the next turn's history

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def compose_prompt(
    prompt: str, history: list[tuple[str, str]], endpoint: str
) -> str | list[dict[str, str]]:
    """What a turn sends: the conversation so far (``(user, answer)`` pairs), then
    ``prompt``; chat messages for the chat endpoint, one text for completions."""
    if endpoint == "chat":
        msgs: list[dict[str, str]] = []
        for user, answer in history:
            msgs += [
                {"role": "user", "content": user},
                {"role": "assistant", "content": answer},
            ]
        return msgs + [{"role": "user", "content": prompt}]
    return "".join(f"{user}{answer}\n\n" for user, answer in history) + prompt


class Plan(list[PlannedRequest]):
    """A list of planned requests plus ``info``: what the planner decided or changed
    (trace scaling, clipping to the context), for the run's manifest."""

    def __init__(
        self, items: list[PlannedRequest] | None = None, info: dict[str, Any] | None = None
    ):
        super().__init__(items or [])
        self.info: dict[str, Any] = info or {}


@dataclass(kw_only=True)
class _Streams:
    """Independent random streams, so one knob does not reshuffle the others."""

    arrivals: np.random.Generator
    classes: np.random.Generator
    lengths: np.random.Generator
    text: random.Random
    salt: int

    @classmethod
    def from_seed(cls, seed: int) -> _Streams:
        a, c, ln, t = np.random.SeedSequence(seed).spawn(4)
        text_seed = int(t.generate_state(1)[0])
        return cls(
            arrivals=np.random.default_rng(a),
            classes=np.random.default_rng(c),
            lengths=np.random.default_rng(ln),
            text=random.Random(text_seed),
            salt=text_seed % 900_000,
        )


@dataclass(kw_only=True)
class _Context:
    factory: PromptFactory
    endpoint: str
    wrap: Callable[[str], str]
    overhead: int  # tokens the wrap adds (chat template), 0 for completions
    max_model_len: int | None
    seed: int
    clipped: dict[str, int] = field(default_factory=lambda: {"inputs": 0, "outputs": 0})
    prefix_cache: dict[tuple[str, int, int], tuple[str, int]] = field(default_factory=dict)
    samplers: dict[str, SessionSampler] = field(default_factory=dict)


def _chat_wrap(tokenizer: TokenizerLike) -> Callable[[str], str]:
    apply = getattr(tokenizer, "apply_chat_template", None)
    if apply is None:
        raise ValueError(
            "--endpoint chat needs a tokenizer with a chat template (give --tokenizer)"
        )

    def wrap(content: str) -> str:
        return apply([{"role": "user", "content": content}], add_generation_prompt=True)

    return wrap


def iter_plan(
    spec: WorkloadSpec | None,
    load: LoadSpec,
    seed: int,
    *,
    tokenizer: TokenizerLike,
    endpoint: str = "completions",
    max_model_len: int | None = None,
    info: dict[str, Any] | None = None,
    datasets: Mapping[tuple[str, str | None, str | None], Dataset] | None = None,
) -> Iterator[PlannedRequest]:
    """Planned requests in order, lazily; stops at ``load.requests``/``load.duration``
    (counted in sessions) or the end of a trace, and never otherwise.

    ``info`` (a dict) receives what the planner changed: trace report, clipping counts,
    and per dataset class what was read and filtered. ``datasets`` holds files already read
    (by ``DatasetSource.key()``); a class's source not in it is read here.
    """
    load.validate()
    if endpoint not in ENDPOINTS:
        raise ValueError(f"unknown --endpoint {endpoint!r}; use completions or chat")
    if spec is None and load.trace is None:
        raise ValueError("give a workload (--workload NAME|FILE) or a trace (--trace FILE)")
    text_source = _trace_text_source(spec) if load.trace is not None else None
    if spec is not None and load.trace is not None and text_source is None:
        raise ValueError("--trace sets arrivals and lengths itself; drop --workload")
    info = info if info is not None else {}
    factory = PromptFactory(tokenizer)
    wrap = _chat_wrap(tokenizer) if endpoint == "chat" else (lambda s: s)
    overhead = factory.count(wrap("x")) - factory.count("x") if endpoint == "chat" else 0
    ctx = _Context(
        factory=factory,
        endpoint=endpoint,
        wrap=wrap,
        overhead=overhead,
        max_model_len=max_model_len,
        seed=seed,
    )
    info["clipped_to_context"] = ctx.clipped
    info["chat_template_tokens"] = overhead
    streams = _Streams.from_seed(seed)
    if load.trace is not None:
        text = None
        if text_source is not None:
            ds = (datasets or {}).get(text_source.key()) or load_dataset(
                text_source.dataset, text_source.format, text_source.field
            )
            text = (ds, TraceText(ds, factory.count))
        yield from _trace_plan(load, ctx, streams, info, text)
    else:
        assert spec is not None
        _samplers(spec, ctx, streams, load.length_scale, datasets or {})
        try:
            yield from _workload_plan(spec, load, ctx, streams)
        finally:
            if ctx.samplers:
                info["datasets"] = {k: v.report() for k, v in ctx.samplers.items()}


def _samplers(
    spec: WorkloadSpec,
    ctx: _Context,
    streams: _Streams,
    length_scale: float,
    datasets: Mapping[tuple[str, str | None, str | None], Dataset],
) -> None:
    """A seeded sampler per dataset class (each with its own order, from the seed and its name)."""
    for cls in spec.classes:
        src = cls.source
        if src is None:
            continue
        ds = datasets.get(src.key()) or load_dataset(src.dataset, src.format, src.field)
        out = cls.output

        def default_output(out: Any = out) -> int:
            return int(out.sample_int(streams.lengths, 1, length_scale)[0])

        ctx.samplers[cls.name] = SessionSampler(
            ds,
            Selection(
                multi_turn=src.conversation == "multi-turn",
                history=src.history,
                output_len=src.output_len,
                min_input_len=src.min_input_len,
                max_input_len=src.max_input_len,
            ),
            seed=int(
                np.random.SeedSequence([ctx.seed, _stable_hash(cls.name)]).generate_state(1)[0]
            ),
            count=lambda text: ctx.factory.count(ctx.wrap(text)),
            count_raw=ctx.factory.count,
            max_model_len=ctx.max_model_len,
            default_output=default_output if out is not None else None,
        )


def build_plan(
    spec: WorkloadSpec | None,
    load: LoadSpec,
    seed: int,
    *,
    tokenizer: TokenizerLike,
    endpoint: str = "completions",
    max_model_len: int | None = None,
    datasets: Mapping[tuple[str, str | None, str | None], Dataset] | None = None,
) -> Plan:
    """The whole plan as a list. Needs a finite run: ``--requests``, an open-loop
    ``--duration``, or a trace (a closed loop bounded only by time uses ``iter_plan``)."""
    if load.closed and load.requests is None and load.trace is None:
        raise ValueError(
            "a closed loop with only --duration has no fixed number of requests; "
            "use iter_plan, or give --requests"
        )
    plan = Plan()
    plan.extend(
        iter_plan(
            spec,
            load,
            seed,
            tokenizer=tokenizer,
            endpoint=endpoint,
            max_model_len=max_model_len,
            info=plan.info,
            datasets=datasets,
        )
    )
    return plan


# --------------------------------------------------------------------------- workloads


def _send_times(load: LoadSpec, streams: _Streams) -> Iterator[float | None]:
    if load.closed:
        return itertools.repeat(None)
    assert load.rate is not None
    kind = "gamma" if load.arrival == "poisson" and load.burstiness != 1.0 else load.arrival
    return arrival_times(
        kind,
        load.rate,
        streams.arrivals,
        burstiness=load.burstiness,
        on=load.on,
        off=load.off,
        ramp_to=load.ramp_to,
        ramp_over=load.ramp_over or load.duration,
    )


def _workload_plan(
    spec: WorkloadSpec, load: LoadSpec, ctx: _Context, streams: _Streams
) -> Iterator[PlannedRequest]:
    weights = np.array([c.weight for c in spec.classes], dtype=float)
    weights /= weights.sum()
    index = 0
    for n_session, t in enumerate(_send_times(load, streams)):
        if load.requests is not None and n_session >= load.requests:
            return
        if t is not None and load.duration is not None and t > load.duration:
            return
        cls = spec.classes[int(streams.classes.choice(len(weights), p=weights))]
        if cls.name in ctx.samplers:
            for req in _dataset_session(cls, n_session, index, t, ctx, streams):
                yield req
                index += 1
            continue
        turns = 1
        think: list[float] = []
        if cls.session is not None:
            turns = max(1, int(cls.session.turns.sample_int(streams.lengths, 1)[0]))
            think = cls.session.think_time.sample(streams.lengths, turns).tolist()
        session_id = f"s{n_session:06d}" if cls.session is not None else None
        for turn in range(turns):
            yield _class_request(
                cls,
                index,
                turn,
                turns,
                session_id,
                t if turn == 0 else None,
                think[turn] if turn else 0.0,
                load.length_scale,
                ctx,
                streams,
            )
            index += 1


def _dataset_session(
    cls: ClassSpec,
    n_session: int,
    index: int,
    send_time: float | None,
    ctx: _Context,
    streams: _Streams,
) -> Iterator[PlannedRequest]:
    """One conversation of a dataset class: its turns as the sampler selected them."""
    turns = ctx.samplers[cls.name].next()
    think = [0.0] * len(turns)
    if cls.session is not None and len(turns) > 1:
        think = cls.session.think_time.sample(streams.lengths, len(turns)).tolist()
    session_id = f"s{n_session:06d}" if len(turns) > 1 else None
    for k, turn in enumerate(turns):
        yield PlannedRequest(
            request_id=f"r{index + k:06d}",
            index=index + k,
            tags=RequestTags(
                workload_class=cls.name,
                session_id=session_id,
                turn=k,
                stream=cls.stream,
                priority=cls.priority,
                temperature=cls.temperature,
            ),
            prompt=turn.prompt,
            prompt_tokens=turn.prompt_tokens,
            max_tokens=turn.max_tokens,
            send_time=send_time if k == 0 else None,
            num_turns=len(turns),
            think_time=think[k] if k else 0.0,
            force_length=turn.force,
            reply=turn.reply,
        )


def _prefix_variant(
    cls: ClassSpec, layer_no: int, variant: int, ctx: _Context, length_scale: float
) -> tuple[str, int]:
    """The text and token count of one variant of a shared prefix layer (cached)."""
    key = (cls.name, layer_no, variant)
    if key not in ctx.prefix_cache:
        layer = cls.prefix[layer_no]
        rng = np.random.default_rng([ctx.seed, layer_no, variant, _stable_hash(cls.name)])
        n = int(layer.tokens.sample_int(rng, 1, length_scale)[0])
        lead = ctx.factory.lead(
            layer.name.capitalize(), lead_number(variant, _stable_hash(cls.name))
        )
        text = ctx.factory.fixed_text(
            n,
            f"{ctx.seed}/{cls.name}/{layer_no}/{variant}",
            layer.text,
            lead,
            at_start=layer_no == 0,
        )
        ctx.prefix_cache[key] = (text, n)
    return ctx.prefix_cache[key]


def _stable_hash(s: str) -> int:
    # Python's hash() is salted per process; plans must not be.
    h = 0
    for ch in s.encode():
        h = (h * 131 + ch) % 1_000_003
    return h


def _class_request(
    cls: ClassSpec,
    index: int,
    turn: int,
    turns: int,
    session_id: str | None,
    send_time: float | None,
    think_time: float,
    length_scale: float,
    ctx: _Context,
    streams: _Streams,
) -> PlannedRequest:
    assert cls.input is not None and cls.output is not None  # the spec checks this
    n_in = int(cls.input.sample_int(streams.lengths, 1, length_scale)[0])
    n_out = int(cls.output.sample_int(streams.lengths, 1, length_scale)[0])
    head, head_tokens, groups = "", 0, []
    if turn == 0:
        for layer_no, layer in enumerate(cls.prefix):
            variant = int(streams.classes.integers(layer.count))
            if streams.classes.random() >= layer.reuse:
                break  # from here on the prompt is the request's own
            text, n = _prefix_variant(cls, layer_no, variant, ctx, length_scale)
            head, head_tokens = head + text, head_tokens + n
            groups.append(f"{layer.name}{variant}")
        # Layers not shared become part of the request's own text, keeping the length.
        n_in += sum(
            int(layer.tokens.sample_int(streams.lengths, 1, length_scale)[0])
            for layer in cls.prefix[len(groups) :]
        )
    n_in, n_out = _clip(n_in, n_out, head_tokens + (ctx.overhead if turn == 0 else 0), ctx)
    lead = ctx.factory.lead(lead_word(index), lead_number(index, streams.salt))
    if turn == 0:
        target = ctx.overhead + head_tokens + n_in
        own = ctx.factory.segment(
            n_in, streams.text, cls.text, lead, head=head, wrap=ctx.wrap, target=target
        )
        prompt, prompt_tokens = head + own, target
    else:
        # A later turn follows the previous response and a blank line: build it standalone.
        prompt = ctx.factory.segment(n_in, streams.text, cls.text, lead, target=n_in)
        prompt_tokens = n_in
    return PlannedRequest(
        request_id=f"r{index:06d}",
        index=index,
        tags=RequestTags(
            workload_class=cls.name,
            session_id=session_id,
            turn=turn,
            prefix_group=f"{cls.name}:" + "/".join(groups) if groups else None,
            stream=cls.stream,
            priority=cls.priority,
            temperature=cls.temperature,
        ),
        prompt=prompt,
        prompt_tokens=prompt_tokens,
        max_tokens=n_out,
        send_time=send_time,
        prefix_tokens=head_tokens + (ctx.overhead if groups else 0),
        num_turns=turns,
        think_time=think_time,
        carry_history=cls.session.carry_history if cls.session is not None else True,
    )


def _clip(n_in: int, n_out: int, fixed: int, ctx: _Context) -> tuple[int, int]:
    """Fit ``fixed + n_in + n_out`` into the context: cap the output at a quarter of the
    context, then shorten the request's own input; count what was changed."""
    limit = ctx.max_model_len
    if limit is None or fixed + n_in + n_out <= limit:
        return n_in, n_out
    if fixed + 2 > limit:
        raise ValueError(
            f"shared prefixes of {fixed} tokens do not fit the context of {limit}; "
            "use a smaller --length-scale"
        )
    if n_out > max(1, limit // 4):
        n_out = max(1, limit // 4)
        ctx.clipped["outputs"] += 1
    if fixed + n_in + n_out > limit:
        n_in = max(1, limit - fixed - n_out)
        ctx.clipped["inputs"] += 1
    return n_in, n_out


# --------------------------------------------------------------------------- traces


def _trace_text_source(spec: WorkloadSpec | None) -> DatasetSource | None:
    """The dataset a trace takes its text from: a workload of one dataset class (what
    ``--dataset`` alone builds); None for no workload."""
    if spec is None or len(spec.classes) != 1:
        return None
    return spec.classes[0].source


def _trace_plan(
    load: LoadSpec,
    ctx: _Context,
    streams: _Streams,
    info: dict[str, Any],
    text: tuple[Dataset, TraceText] | None = None,
) -> Iterator[PlannedRequest]:
    assert load.trace is not None
    rows, fmt = load_trace(load.trace)
    if text is not None and any(r.hash_ids for r in rows[:1]):
        raise ValueError(
            "a Mooncake trace's shared prefix blocks need synthetic text; replay it without "
            "--dataset, or use a trace of lengths only (azure-2023-conv)"
        )
    rows, report = scale_trace(
        rows,
        time_scale=load.time_scale,
        length_scale=load.length_scale,
        max_model_len=(ctx.max_model_len - ctx.overhead) if ctx.max_model_len else None,
        max_requests=load.requests,
        max_duration=load.duration,
        target_rate=load.rate if not load.closed else None,
    )
    info["trace"] = {"file": str(load.trace), "format": fmt, **report}
    for index, row in enumerate(rows):
        if text is None:
            prompt = _trace_prompt(row, index, ctx, streams)
        else:
            prompt = _dataset_trace_prompt(row, text[1], ctx, streams)
            info["trace"]["text"] = text[1].report(text[0])
        yield PlannedRequest(
            request_id=f"r{index:06d}",
            index=index,
            tags=RequestTags(
                workload_class=TRACE_CLASS,
                prefix_group=f"{TRACE_CLASS}:{row.hash_ids[0]}" if row.hash_ids else None,
            ),
            prompt=prompt,
            prompt_tokens=ctx.overhead + row.input_tokens,
            max_tokens=row.output_tokens,
            send_time=None if load.closed else row.time,
            prefix_tokens=0,
        )


def _dataset_trace_prompt(row: TraceRow, text: TraceText, ctx: _Context, streams: _Streams) -> str:
    """The row's dataset text (``TraceText``) at exactly the row's prompt length."""
    target = ctx.overhead + row.input_tokens
    _, raw = text.pick(row.input_tokens)
    tok = ctx.factory.tokenizer
    ids = tok.encode(raw, add_special_tokens=False)[: row.input_tokens]
    while True:  # decoding may merge across the cut: shorten until it fits
        cut = tok.decode(ids).rstrip()
        got = ctx.factory.count(ctx.wrap(cut)) if cut else ctx.overhead
        if got <= target or not ids:
            break
        ids = ids[: len(ids) - (got - target)]
    if got == target:
        return cut
    # Shorter than the row: pad with corpus text, checked exact on the wrapped prompt.
    pad = ctx.factory.segment(
        target - got, streams.text, "prose", head=cut, wrap=ctx.wrap, target=target
    )
    return cut + pad


def _trace_prompt(row: TraceRow, index: int, ctx: _Context, streams: _Streams) -> str:
    """Azure rows get a unique prompt; Mooncake rows are built block by block from their
    ``hash_ids``, so equal ids give identical text (and tokens) at the same positions."""
    target = ctx.overhead + row.input_tokens
    if not row.hash_ids:
        lead = ctx.factory.lead(lead_word(index), lead_number(index, streams.salt))
        return ctx.factory.segment(
            row.input_tokens, streams.text, "prose", lead, wrap=ctx.wrap, target=target
        )
    b = row.block_tokens
    parts, used = [], 0
    for i, hid in enumerate(row.hash_ids):
        n = min(round((i + 1) * b), row.input_tokens) - used
        if n <= 0:
            break
        parts.append(
            ctx.factory.fixed_text(
                n,
                f"{ctx.seed}/block/{hid}/{n}",
                "prose",
                ctx.factory.lead("Section", hid),
                at_start=i == 0,
            )
        )
        used += n
    if used < row.input_tokens:  # more tokens than blocks: the tail is the request's own
        lead = ctx.factory.lead(lead_word(index), lead_number(index, streams.salt))
        parts.append(
            ctx.factory.fixed_text(
                row.input_tokens - used,
                f"{ctx.seed}/tail/{index}",
                "prose",
                lead,
                at_start=not parts,
            )
        )
    prompt = "".join(parts)
    got = ctx.factory.count(ctx.wrap(prompt))
    if got != target:
        raise ValueError(
            f"trace request {index}: built {got} tokens instead of {target}; this tokenizer "
            "merges across block boundaries, so Mooncake prefixes cannot be made exact with it"
        )
    return prompt
