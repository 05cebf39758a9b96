"""What is simulated: a cost model plus the engine settings and model facts around it.

A :class:`SimTarget` builds replicas for :class:`~servelab.sim.loop.simulation.Simulation`: each is
the engine's own ``LLMEngine`` over a :class:`SimExecutor` on a virtual clock.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from servelab.engine.engine_config import EngineConfig
from servelab.sim.costs.dtypes import Precision
from servelab.sim.costs.executor import CostModel, PacedExecutor, SimExecutor, VirtualClock
from servelab.sim.costs.hardware import Hardware, get_hardware
from servelab.sim.costs.model_shapes import ModelSpec, load_model_spec
from servelab.sim.costs.noise import StepNoise
from servelab.sim.costs.profiled import ProfiledCostModel, ProfileTable
from servelab.sim.costs.roofline import Efficiency, RooflineCostModel
from servelab.sim.costs.serving_path import ServingPath
from servelab.sim.engine_defaults import engine_defaults, sglang_max_running
from servelab.sim.loop.history import Resend


@dataclass
class SimTarget:
    """One replica's cost model, engine config and model facts.

    ``kv_bytes_per_token`` is per device: it sizes the KV pool (through the engine's own
    ``kv_cache_memory_gb`` rule) and the disaggregated KV transfer. ``step_noise``, when
    measured, varies each step's time as real steps vary (one seeded series per replica).
    ``resend``: where a multi-turn client's resent history first differs from the generated
    tokens (:mod:`servelab.sim.loop.history`; the default: never). ``spec_acceptance`` is each
    draft's chance to be accepted, in order, and ``spec_proposal_rate`` the share of a
    sequence's steps that get drafts (:mod:`servelab.sim.loop.sampled_proposals`).
    """

    cost_model: CostModel
    engine_config: EngineConfig
    max_model_len: int
    kv_bytes_per_token: float
    label: str
    eos_token_ids: list[int] = field(default_factory=list)
    placeholder_ids: list[int] = field(default_factory=lambda: [1000])
    spec_acceptance: float = 0.7
    spec_proposal_rate: float = 1.0
    step_noise: StepNoise | None = None
    resend: Resend = field(default_factory=Resend)
    info: dict[str, Any] = field(default_factory=dict)
    serving_path: ServingPath | None = None

    def make_executor(self, clock: VirtualClock | None = None, seed: int = 0) -> SimExecutor:
        """A virtual-time executor on ``clock``, or with no clock a :class:`PacedExecutor`
        that sleeps each predicted step on the wall clock."""
        kwargs: dict[str, Any] = {
            "max_model_len": self.max_model_len,
            "kv_bytes_per_token": self.kv_bytes_per_token,
            "eos_token_ids": self.eos_token_ids,
            "placeholder_ids": self.placeholder_ids,
            "spec_acceptance": self.spec_acceptance,
            "seed": seed,
            "step_noise": self.step_noise.sampler(seed) if self.step_noise else None,
            "serving_path": self.serving_path,
        }
        if clock is None:
            return PacedExecutor(self.cost_model, **kwargs)
        return SimExecutor(self.cost_model, clock, **kwargs)

    def factory(self, clock: VirtualClock, seed: int) -> tuple[Any, SimExecutor]:
        """An engine replica on ``clock`` (the ``EngineFactory`` of the simulation loop)."""
        from servelab.engine.engine import LLMEngine

        ex = self.make_executor(clock, seed)
        # history=0: the loop takes step records and timelines from each step's result; the
        # engine's own deques (for /v1/timelines) would only keep 10,000 dead steps alive.
        engine = LLMEngine(ex, self.engine_config, tokenizer=None, clock=clock, history=0)
        if engine.spec is not None and self.spec_proposal_rate < 1.0:
            from servelab.sim.loop.sampled_proposals import SampledProposals

            engine.spec.proposer = SampledProposals(
                engine.spec.proposer, self.spec_proposal_rate, seed
            )
        return engine, ex

    def with_engine_args(self, **kwargs: Any) -> SimTarget:
        """The same target with some EngineConfig fields changed (a sweep point)."""
        return dataclasses.replace(
            self, engine_config=dataclasses.replace(self.engine_config, **kwargs)
        )

    def describe(self) -> dict[str, Any]:
        return {
            "label": self.label,
            "cost_model": self.cost_model.describe(),
            "engine_config": dataclasses.asdict(self.engine_config),
            "max_model_len": self.max_model_len,
            "kv_bytes_per_token": self.kv_bytes_per_token,
            **self.info,
        }


def roofline_target(
    hardware: str | Hardware,
    model: str | ModelSpec,
    tp: int = 1,
    efficiency: Efficiency | None = None,
    engine_config: EngineConfig | None = None,
    gpu_memory_utilization: float | None = None,
    dtype: str | None = None,
    kv_dtype: str | None = None,
    engine: str | None = None,
    engine_args: dict[str, Any] | None = None,
    offline: bool = False,
) -> SimTarget:
    """A roofline replica of ``model`` on ``tp`` devices of ``hardware``.

    The engine settings are ``engine_config`` when given (this engine's defaults
    otherwise, the memory fraction 0.9); with ``engine`` named, that engine's defaults for
    the hardware (:mod:`servelab.sim.engine_defaults`; ``offline``: vLLM's offline class).
    ``engine_args`` then override fields of either. Unless the config fixes
    ``num_kv_blocks``, the KV pool is what the memory leaves after the weights
    (:meth:`RooflineCostModel.kv_memory_bytes`, which says so when the weights do not fit);
    on hardware without a fixed memory size (this CPU) the config's ``kv_cache_memory_gb``
    decides, as in the real engine.
    """
    hw = get_hardware(hardware) if isinstance(hardware, str) else hardware
    spec = load_model_spec(model) if isinstance(model, str) else model
    precision = Precision.parse(dtype, kv_dtype, hw.dtype)
    overrides = dict(engine_args or {})
    info: dict[str, Any] = {"hardware": hw.name, "model": spec.name, "tp": tp}
    path: ServingPath | None = None
    if engine is None and engine_config is not None:
        rm = RooflineCostModel(spec, hw, tp=tp, efficiency=efficiency, precision=precision)
        cfg = dataclasses.replace(engine_config, **overrides)
        util = 0.9 if gpu_memory_utilization is None else gpu_memory_utilization
    else:
        defaults = engine_defaults(engine or "servelab", hw, tp, offline)
        # An engine's preset prices its steps and its server unless efficiencies are given.
        eff = efficiency or defaults.efficiency
        rm = RooflineCostModel(spec, hw, tp=tp, efficiency=eff, precision=precision)
        path = defaults.serving_path
        cfg = EngineConfig(**{**defaults.config, **overrides})
        util = defaults.gpu_memory_utilization
        if gpu_memory_utilization is not None:
            util = gpu_memory_utilization
        info["engine_defaults"] = {**defaults.to_dict(), "overridden": sorted(overrides)}
    if cfg.num_kv_blocks is None and hw.memory_bytes is not None:
        cfg.kv_cache_memory_gb = rm.kv_memory_bytes(util) / 1e9
        if info.get("engine_defaults", {}).get("engine") == "sglang" and (
            "max_num_seqs" not in overrides
        ):
            kv_tokens = rm.kv_capacity_tokens(util)
            cfg.max_num_seqs = sglang_max_running(kv_tokens, spec.max_model_len)
            info["engine_defaults"]["config"]["max_num_seqs"] = cfg.max_num_seqs
    info["gpu_memory_utilization"] = util
    info["precision"] = precision.describe()
    return SimTarget(
        cost_model=rm,
        engine_config=cfg,
        max_model_len=spec.max_model_len,
        kv_bytes_per_token=rm.kv_bytes_per_token_per_device,
        label=f"{hw.name}:{spec.name}" + (f":tp{tp}" if tp > 1 else ""),
        info=info,
        serving_path=path,
    )


def profile_target(
    table: str | ProfileTable, engine_config: EngineConfig | None = None
) -> SimTarget:
    """A replica that replays a measured profile (``servelab profile``) of this machine.

    The KV bytes per token, context length and EOS ids are those the real runner reported
    when the profile was taken, so the engine sizes its pool exactly as the real one did.
    """
    t = ProfileTable.load(table) if isinstance(table, str) else table
    meta = t.meta
    if "kv_bytes_per_token" in meta:
        kv = float(meta["kv_bytes_per_token"])
        max_len = int(meta["max_model_len"])
    else:
        spec = load_model_spec(t.model)
        kv, max_len = spec.kv_bytes_per_token(4), spec.max_model_len
    cfg = engine_config or EngineConfig(**meta.get("engine_config", {}))
    noise = meta.get("step_noise")
    return SimTarget(
        cost_model=ProfiledCostModel(t),
        engine_config=cfg,
        max_model_len=max_len,
        kv_bytes_per_token=kv,
        label=f"profile:{t.device}:{t.model}",
        eos_token_ids=list(meta.get("eos_token_ids", [])),
        step_noise=StepNoise.from_dict(noise) if noise else None,
        resend=Resend.from_dict(meta.get("resend_divergence")),
        info={
            "profile_device": t.device,
            "model": t.model,
            # profiles made before the mode was recorded were all fp32
            "quantization": meta.get("quantization", "none"),
        },
    )
