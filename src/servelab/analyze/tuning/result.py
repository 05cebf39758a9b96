"""What `servelab tune` found for one run: the record the workflow fills and the report reads.

``server`` is whose flags the run's server takes; ``twin`` (another server's run) the twin
calibrated on it that the replay and the predictions ran on, each setting with its source.
``refused`` says why no quantitative prediction was made (a run that cannot be replayed, or
a replay that strays from the run); the findings, the self-check and the candidates'
predictions are kept as far as they got.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from servelab.analyze.diagnosis.findings import Finding
from servelab.analyze.tuning.decision import Decision, Judged
from servelab.analyze.tuning.prediction import FigureSet, Prediction, SelfCheck
from servelab.analyze.tuning.verification import Verification


@dataclass
class Tuning:
    run: str
    refused: str | None = None
    findings: list[Finding] = field(default_factory=list)
    measured: FigureSet | None = None
    check: SelfCheck | None = None
    baseline: Prediction | None = None
    judged: list[Judged] = field(default_factory=list)
    decision: Decision | None = None
    seeds: int = 0
    timings: dict[str, float] = field(default_factory=dict)  # seconds per phase
    notes: list[str] = field(default_factory=list)
    verification: Verification | None = None
    server: str = (
        "servelab"  # whose flags the run's server takes (analyze.server_side.serversettings)
    )
    twin: dict[str, Any] | None = None  # another server's run: the twin it replays on
    probe: dict[str, Any] | None = None  # the speculation probe of the run's traffic, if run
    gated: bool = False  # refused by the gates before the run was diagnosed: no findings read
    # The simulator's replica the predictions ran on (``workflows.tuning_loop``), kept for
    # the verification to predict its own requests on; not serialised.
    replica: Any = field(default=None, repr=False, compare=False)

    @property
    def predicted(self) -> bool:
        return self.refused is None and self.decision is not None

    def to_dict(self) -> dict[str, Any]:
        return {
            "run": self.run,
            "refused": self.refused,
            "gated": self.gated,
            "findings": [f.to_dict() for f in self.findings],
            "measured": self.measured.values if self.measured else None,
            "self_check": self.check.to_dict() if self.check else None,
            "as_run_replay": self.baseline.to_dict() if self.baseline else None,
            "candidates": [
                j.to_dict() | {"prediction": j.prediction.to_dict()} for j in self.judged
            ],
            "decision": self.decision.to_dict() if self.decision else None,
            "seeds": self.seeds,
            "timings_s": self.timings,
            "notes": self.notes,
            "verification": self.verification.to_dict() if self.verification else None,
            "server": self.server,
            "twin": self.twin,
            "speculation_probe": self.probe,
        }
