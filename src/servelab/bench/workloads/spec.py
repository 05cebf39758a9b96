"""The declarative workload spec (YAML or TOML), validated with pydantic.

A workload is a weighted set of request classes. Each class says how long its inputs
and outputs are (a distribution), whether its prompts start with shared prefixes
(system prompts, documents), whether requests come in multi-turn sessions, whether
responses stream, and the SLOs its requests must meet::

    name: my-chat
    slo: {ttft: 2s, itl: 250ms}          # default for every class
    classes:
      - name: chat
        weight: 3
        input: {dist: lognormal, mean: 300, sigma: 0.6, max: 2048}
        output: {dist: uniform, min: 32, max: 256}
        prefix:
          - {name: system, count: 1, tokens: 120, reuse: 1.0}
        session: {turns: {dist: uniform, min: 1, max: 3}, think_time: {dist: exponential, mean: 2s}}
      - name: batch
        weight: 1
        input: 1024                       # a bare number is a fixed length
        output: 128
        stream: false
        slo: {e2e: 60s}

``load_workload(name_or_file)`` accepts a preset name (``rag``, ``agent``, ``codegen``,
``chat``, ``mixed``, ``batch``) or a path; errors name the field and say what to write.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Annotated, Any, Literal

import numpy as np
import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from servelab.units import SLO, parse_duration

_STRICT = ConfigDict(extra="forbid")


def _seconds(v: Any) -> Any:
    """Durations in a spec: a number of seconds, or a string with a unit ("250ms")."""
    return parse_duration(v) if isinstance(v, str) else v


def _slo_dict(v: Any) -> Any:
    """SLOs in a spec: ``"ttft=2s,itl=250ms"`` or ``{ttft: 2s, itl: 0.25}`` -> seconds."""
    if isinstance(v, str):
        return SLO.parse(v).to_dict()
    if isinstance(v, dict):
        return SLO.from_dict(v).to_dict()
    return v


def _given(v: float | None) -> float:
    """A parameter the distribution's validator has already required."""
    assert v is not None, "Dist validation requires this parameter for its dist"
    return float(v)


class Dist(BaseModel):
    """A distribution of non-negative numbers (token lengths or seconds).

    ``dist``: ``fixed`` (``value``), ``uniform`` (``min``..``max``), ``normal`` (``mean``,
    ``std``), ``lognormal`` (``mean`` of the samples and ``sigma`` of their log),
    ``exponential`` (``mean``), ``empirical`` (``values`` or a ``file`` with one number per
    line or a CSV ``column``). ``min``/``max`` clip every kind.
    """

    model_config = _STRICT

    dist: Literal["fixed", "uniform", "normal", "lognormal", "exponential", "empirical"] = "fixed"
    value: float | None = None
    min: float | None = None
    max: float | None = None
    mean: float | None = None
    std: float | None = None
    sigma: float | None = None
    values: list[float] | None = None
    file: str | None = None
    column: str | None = None

    @field_validator("value", "min", "max", "mean", "std", mode="before")
    @classmethod
    def _durations(cls, v: Any) -> Any:
        return _seconds(v)

    @model_validator(mode="before")
    @classmethod
    def _bare_number(cls, data: Any) -> Any:
        if isinstance(data, (int, float, str)) and not isinstance(data, bool):
            return {"dist": "fixed", "value": _seconds(data)}
        return data

    @model_validator(mode="after")
    def _check(self) -> Dist:
        need = {
            "fixed": ("value",),
            "uniform": ("min", "max"),
            "normal": ("mean", "std"),
            "lognormal": ("mean", "sigma"),
            "exponential": ("mean",),
            "empirical": (),
        }[self.dist]
        missing = [k for k in need if getattr(self, k) is None]
        if missing:
            raise ValueError(f"a {self.dist} distribution needs {' and '.join(missing)}")
        for k in ("value", "min", "max", "mean", "std", "sigma"):
            v = getattr(self, k)
            if v is not None and (v < 0 or not math.isfinite(v)):
                raise ValueError(f"{k} must be a finite number >= 0, got {v}")
        if self.min is not None and self.max is not None and self.min > self.max:
            raise ValueError(f"min ({self.min}) is larger than max ({self.max})")
        if self.dist == "empirical":
            if (self.values is None) == (self.file is None):
                raise ValueError(
                    "an empirical distribution needs either values: [...] or file: PATH"
                )
            if self.values is not None and not self.values:
                raise ValueError("empirical values must not be empty")
        return self

    def resolve(self, base: Path | None) -> Dist:
        """Load an empirical ``file`` (relative to ``base``) into ``values``."""
        if self.dist != "empirical" or self.file is None:
            return self
        path = Path(self.file)
        if not path.is_absolute() and base is not None:
            path = base / path
        return self.model_copy(update={"values": read_numbers(path, self.column), "file": None})

    def sample(self, rng: np.random.Generator, n: int) -> np.ndarray:
        """``n`` samples as floats, clipped to ``[min, max]``."""
        if self.dist == "fixed":
            x = np.full(n, _given(self.value))
        elif self.dist == "uniform":
            x = rng.uniform(_given(self.min), _given(self.max), n)
        elif self.dist == "normal":
            x = rng.normal(_given(self.mean), _given(self.std), n)
        elif self.dist == "lognormal":
            sigma = _given(self.sigma)
            mu = math.log(max(_given(self.mean), 1e-12)) - sigma**2 / 2.0  # so E[x] == mean
            x = rng.lognormal(mu, sigma, n)
        elif self.dist == "exponential":
            mean = _given(self.mean)
            x = rng.exponential(mean, n) if mean > 0 else np.zeros(n)
        else:
            if self.values is None:
                raise ValueError(f"empirical distribution file {self.file} was not loaded")
            x = rng.choice(np.asarray(self.values, dtype=float), n)
        lo = self.min if self.min is not None else 0.0
        hi = self.max if self.max is not None else np.inf
        return np.clip(x, lo, hi)

    def sample_int(self, rng: np.random.Generator, n: int, scale: float = 1.0) -> np.ndarray:
        """Token lengths: samples times ``scale``, rounded, at least 1."""
        return np.maximum(1, np.rint(self.sample(rng, n) * scale)).astype(np.int64)

    def approx_mean(self) -> float:
        """A mean good enough for sizing (not used for sampling)."""
        if self.dist == "fixed":
            return _given(self.value)
        if self.dist == "uniform":
            return (_given(self.min) + _given(self.max)) / 2.0
        if self.dist in ("normal", "lognormal", "exponential"):
            return _given(self.mean)
        return float(np.mean(self.values)) if self.values else 0.0


def read_numbers(path: Path, column: str | None = None) -> list[float]:
    """Numbers from a file: one per line, or one CSV column (by header name)."""
    if not path.is_file():
        raise ValueError(f"empirical distribution file {path} does not exist")
    lines = [ln.strip() for ln in path.read_text().splitlines() if ln.strip()]
    if column is not None:
        header = [h.strip() for h in lines[0].split(",")]
        if column not in header:
            raise ValueError(f"{path} has no column {column!r}; its columns are {header}")
        idx = header.index(column)
        lines = [ln.split(",")[idx] for ln in lines[1:]]
    try:
        values = [float(x) for x in lines]
    except ValueError as e:
        raise ValueError(
            f"{path}: every line must be a number (or give column: NAME for a CSV): {e}"
        ) from None
    if not values:
        raise ValueError(f"{path} holds no numbers")
    return values


class PrefixLayer(BaseModel):
    """One layer of shared prompt prefix (a system prompt, a set of documents).

    Each request that reaches this layer uses one of ``count`` variants with probability
    ``reuse`` (chosen uniformly); otherwise its prompt is unique from this point on.
    Layers stack in order: a document layer after a system layer shares only behind it.
    """

    model_config = _STRICT

    name: str = "prefix"
    count: int = Field(1, ge=1)
    tokens: Dist
    reuse: float = Field(1.0, ge=0.0, le=1.0)
    text: Literal["prose", "code"] = "prose"


class SessionSpec(BaseModel):
    """Multi-turn sessions: ``turns`` per session, ``think_time`` between a response and the
    next turn, and whether the conversation so far is sent again with each turn."""

    model_config = _STRICT

    turns: Dist = Field(default_factory=lambda: Dist(dist="fixed", value=1))
    think_time: Dist = Field(default_factory=lambda: Dist(dist="fixed", value=0))
    carry_history: bool = True


class DatasetSource(BaseModel):
    """A class whose text comes from a dataset (``bench.datasets``) instead of the corpus.

    ``conversation: multi-turn`` replays each conversation as a session (its own turns;
    the class's ``session.think_time`` between them), sending the recorded replies as history
    unless ``history: generated``. ``output_len``: ``dataset`` (the recorded reply's length,
    forced), ``natural`` (not forced) or a number of tokens.
    """

    model_config = _STRICT

    dataset: str
    format: str | None = None
    field: str | None = None
    conversation: Literal["single-turn", "multi-turn"] = "single-turn"
    history: Literal["recorded", "generated"] = "recorded"
    output_len: Literal["dataset", "natural"] | Annotated[int, Field(ge=1)] = "dataset"
    min_input_len: int | None = Field(None, ge=1)
    max_input_len: int | None = Field(None, ge=1)

    def key(self) -> tuple[str, str | None, str | None]:
        """What identifies the file read: classes with one key share one parse."""
        return (self.dataset, self.format, self.field)


class ClassSpec(BaseModel):
    """One request class of a workload. A class with a ``source`` needs no ``input``
    length (its prompts are the dataset's) and uses ``output`` only for records that
    give no output length."""

    model_config = _STRICT

    name: str
    weight: float = Field(1.0, gt=0)
    input: Dist | None = None
    output: Dist | None = None
    source: DatasetSource | None = None
    prefix: list[PrefixLayer] = Field(default_factory=list)
    session: SessionSpec | None = None
    stream: bool = True
    text: Literal["prose", "code", "question"] = "prose"
    priority: int = 0
    # Sent as the request's ``temperature`` (a class of code edits at 0 beside sampled chat);
    # None leaves it to the run's --sampling, then to the server's default.
    temperature: float | None = Field(None, ge=0)
    slo: dict[str, Annotated[float, Field(gt=0)]] = Field(default_factory=dict)

    _slo = field_validator("slo", mode="before")(_slo_dict)

    @model_validator(mode="after")
    def _lengths(self) -> ClassSpec:
        if self.source is None and (self.input is None or self.output is None):
            raise ValueError("a class needs input and output lengths, or a source: {dataset: ...}")
        return self


class WorkloadSpec(BaseModel):
    """A weighted blend of request classes, with default SLOs."""

    model_config = _STRICT

    name: str = "custom"
    description: str = ""
    slo: dict[str, Annotated[float, Field(gt=0)]] = Field(default_factory=dict)
    classes: list[ClassSpec] = Field(min_length=1)

    _slo = field_validator("slo", mode="before")(_slo_dict)

    @model_validator(mode="after")
    def _unique_names(self) -> WorkloadSpec:
        names = [c.name for c in self.classes]
        dupes = sorted({n for n in names if names.count(n) > 1})
        if dupes:
            raise ValueError(f"class names must be unique; repeated: {dupes}")
        return self

    def with_dataset(self, source: DatasetSource) -> WorkloadSpec:
        """Every class without a source of its own takes its text from ``source``."""
        classes = [c if c.source else c.model_copy(update={"source": source}) for c in self.classes]
        return self.model_copy(update={"classes": classes})

    def class_slos(self, override: SLO | None = None) -> dict[str, SLO]:
        """Each class's SLO: the workload default, then the class's own, then ``override``."""
        base = SLO.from_dict(self.slo)
        out = {}
        for c in self.classes:
            s = base.merged(SLO.from_dict(c.slo))
            out[c.name] = s.merged(override) if override is not None else s
        return out

    def resolve_files(self, base: Path | None) -> WorkloadSpec:
        """Load every empirical distribution file (paths relative to ``base``)."""
        classes = []
        for c in self.classes:
            upd: dict[str, Any] = {
                "input": c.input.resolve(base) if c.input else None,
                "output": c.output.resolve(base) if c.output else None,
            }
            if (
                c.source is not None
                and base is not None
                and not Path(c.source.dataset).is_absolute()
            ):
                local = base / c.source.dataset
                if local.exists():  # a file beside the spec; otherwise a name or a cwd path
                    upd["source"] = c.source.model_copy(update={"dataset": str(local)})
            upd["prefix"] = [
                p.model_copy(update={"tokens": p.tokens.resolve(base)}) for p in c.prefix
            ]
            classes.append(c.model_copy(update=upd))
        return self.model_copy(update={"classes": classes})


def format_validation_error(e: ValidationError, source: str) -> str:
    """One line per problem: where in the spec, and what is wrong."""
    lines = [f"invalid workload spec {source}:"]
    for err in e.errors():
        loc = ".".join(str(p) for p in err["loc"] if not str(p).startswith("function-after"))
        msg = err["msg"].removeprefix("Value error, ")
        if err["type"] == "extra_forbidden":
            msg = "unknown field (check the spelling; see docs/design/bench.md for the fields)"
        lines.append(f"  {loc or '(top level)'}: {msg}")
    return "\n".join(lines)


def parse_workload(data: Any, source: str = "<dict>", base: Path | None = None) -> WorkloadSpec:
    """Validate a spec dict; ``ValueError`` with field-by-field messages when it is wrong."""
    try:
        spec = WorkloadSpec.model_validate(data)
    except ValidationError as e:
        raise ValueError(format_validation_error(e, source)) from None
    return spec.resolve_files(base)


def load_workload(name_or_file: str) -> WorkloadSpec:
    """A preset by name, or a ``.yaml``/``.yml``/``.toml``/``.json`` spec file."""
    from servelab.bench.workloads.presets import PRESETS

    if name_or_file in PRESETS:
        return parse_workload(PRESETS[name_or_file], f"preset {name_or_file!r}")
    path = Path(name_or_file)
    if not path.is_file():
        raise ValueError(
            f"workload {name_or_file!r} is neither a preset ({', '.join(PRESETS)}) "
            "nor an existing YAML/TOML file"
        )
    text = path.read_text()
    if path.suffix == ".toml":
        try:
            import tomllib  # Python >= 3.11
        except ImportError:
            raise ValueError(f"{path}: TOML specs need Python 3.11+; write it as YAML") from None
        try:
            data = tomllib.loads(text)
        except tomllib.TOMLDecodeError as e:
            raise ValueError(f"cannot parse workload file {path}: {e}") from None
    else:
        try:
            data = yaml.safe_load(text)
        except yaml.YAMLError as e:
            raise ValueError(f"cannot parse workload file {path}: {e}") from None
    return parse_workload(data, str(path), base=path.parent)
