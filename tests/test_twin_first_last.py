"""A twin fitted to runs that keep each request's first and last token times alone (GuideLLM,
vLLM's spans): per-request decode windows and idle prefills priced in the twin's terms
(``sim.fit.first_last``), and the fit of a run with every token's time unchanged."""

from __future__ import annotations

import dataclasses
import io
import json
import shutil
from pathlib import Path

import pytest
import rundirs
from rich.console import Console
from test_twin import PLAN, _cli, _planted_run

from servelab.report.twin_tables import calibration_table
from servelab.rundir import LACKS_TOKEN_TIMES, load_run
from servelab.sim.fit.first_last import FIRST_AND_LAST
from servelab.sim.fit.twin import TwinCalibration, calibrate_runs

GOLDEN = Path(__file__).parent / "data" / "twin" / "calm-vllm-twin.json"


def first_and_last(src: Path, out: Path) -> Path:
    """``src`` as a GuideLLM import leaves it: each record's first token time and its end
    alone, the run marked as lacking every token's time."""
    out = Path(shutil.copytree(src, out))
    rows = [json.loads(line) for line in (out / "requests.jsonl").read_text().splitlines()]
    for r in rows:
        r["chunk_times"], r["chunk_tokens"] = r["chunk_times"][:1], r["chunk_tokens"][:1]
    (out / "requests.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    man = json.loads((out / "manifest.json").read_text())
    man["imported"] = {"tool": "test", "lacks": [LACKS_TOKEN_TIMES]}
    (out / "manifest.json").write_text(json.dumps(man))
    return out


def _rounded(doc):
    """``doc`` with every float to 9 significant digits (a platform's last bits aside)."""
    if isinstance(doc, dict):
        return {k: _rounded(v) for k, v in doc.items()}
    if isinstance(doc, list):
        return [_rounded(v) for v in doc]
    return float(f"{doc:.9g}") if isinstance(doc, float) else doc


def test_a_run_with_every_token_time_is_fitted_as_before(tmp_path):
    # the twin of this deterministic run as the step-inference fit wrote it before the
    # first-and-last fit existed (tests/data/twin/calm-vllm-twin.json)
    run = rundirs.as_other_target(rundirs.calm(tmp_path / "calm"), figures=True)
    cal = dataclasses.asdict(calibrate_runs([load_run(run)], "vllm serve m", "cpu"))
    cal.pop("run")
    assert "token_times" not in cal["fit"]
    assert _rounded(json.loads(json.dumps(cal))) == _rounded(json.loads(GOLDEN.read_text()))


def test_a_synthetic_run_without_token_times_gives_back_its_step_prices(tmp_path):
    # calm's engine: 4 ms a step + 1 ms a decode + 0.1 ms a prefill token, with step noise
    run = rundirs.as_other_target(rundirs.calm(tmp_path / "calm"), figures=True)
    cal = calibrate_runs([load_run(first_and_last(run, tmp_path / "fl"))], "vllm serve m")
    assert cal.fit["token_times"] == FIRST_AND_LAST and cal.noise is None
    assert cal.intervals is None and "batch" not in cal.domain
    assert not cal.fit["inference"]["narrow_batch"]  # Poisson arrivals vary the batch
    for decodes in (1, 3):
        priced = cal.cost["step"] + cal.cost["decode_seqs"] * decodes
        assert priced == pytest.approx(0.004 + 0.001 * decodes, rel=0.1)
    assert cal.cost["prefill_tokens"] == pytest.approx(0.0001, rel=0.35)


@pytest.fixture(scope="module")
def planted(tmp_path_factory):
    full, _ = _planted_run(tmp_path_factory.mktemp("fl") / "full", budget=0)
    return full, first_and_last(full, tmp_path_factory.mktemp("fl") / "stripped")


def test_calibrate_fits_a_live_run_stripped_to_first_and_last_token_times(planted, tmp_path):
    full, stripped = planted
    cal_path = tmp_path / "twin.json"
    res = _cli("calibrate", str(stripped), "--out", str(cal_path))
    assert res.returncode == 0, res.stderr
    printed = " ".join(res.stdout.split())
    assert "first and last only" in printed and "every request decoded" not in printed
    cal = TwinCalibration.load(cal_path)
    assert cal.fit["token_times"] == FIRST_AND_LAST
    # a decode step of one stream and of the closed loop's four, against the planted prices
    for decodes in (1, 4):
        priced = cal.cost["step"] + cal.cost["decode_seqs"] * decodes
        assert priced == pytest.approx(PLAN["base"] + PLAN["per_decode"] * decodes, rel=0.2)
    out = tmp_path / "sim"
    res = _cli("sim", "--calibration", str(cal_path), "--workload", "chat", "--concurrency",
               "4", "--requests", "8", "--length-scale", "0.3", "--seed", "1", "--out",
               str(out))  # fmt: skip
    assert res.returncode == 0, res.stderr
    measured = json.loads((full / "metrics.json").read_text())["overall"]["latency"]
    predicted = json.loads((out / "metrics.json").read_text())["overall"]["latency"]
    assert predicted["tpot"]["p50"] == pytest.approx(measured["tpot"]["p50"], rel=0.15)
    assert predicted["e2e"]["mean"] == pytest.approx(measured["e2e"]["mean"], rel=0.2)


def _waves(path: Path, streams: int) -> Path:
    """A stripped run at one fixed concurrency: ten waves of ``streams`` requests of equal
    lengths, each wave sent at once and done before the next."""
    reqs = [
        rundirs.Req(f"w{w}-{k}", "chat", 1.0 * w, 200, 30)
        for w in range(10)
        for k in range(streams)
    ]
    run = rundirs.as_other_target(rundirs.write_run(path, reqs), figures=True)
    return first_and_last(run, path.with_name(path.name + "-fl"))


def _printed(cal: TwinCalibration) -> str:
    console = Console(file=io.StringIO(), width=400)  # wide: each row on one line
    console.print(calibration_table(dataclasses.asdict(cal)))
    return " ".join(console.file.getvalue().split())


def test_a_run_at_one_concurrency_says_its_fit_cannot_split_step_from_sequence(tmp_path):
    cal = calibrate_runs([load_run(_waves(tmp_path / "c4", 4))], "vllm serve m")
    inf = cal.fit["inference"]
    assert inf["narrow_batch"] and inf["batch_span"] == pytest.approx(1.0, abs=0.1)
    printed = _printed(cal)
    assert "every request decoded beside about 3 others" in printed
    assert "calibrate on runs at two or more concurrencies" in printed


def test_runs_at_two_concurrencies_calibrated_together_are_not_warned(tmp_path):
    runs = [load_run(_waves(tmp_path / f"c{n}", n)) for n in (2, 6)]
    alone = [calibrate_runs([run], "vllm serve m").fit["inference"] for run in runs]
    assert all(inf["narrow_batch"] for inf in alone)
    cal = calibrate_runs(runs, "vllm serve m")
    assert not cal.fit["inference"]["narrow_batch"]
    assert cal.fit["inference"]["batch_span"] > 2.0
    assert "every request decoded" not in _printed(cal)
