"""`servelab tune`: candidates, the reconciled decision, the replay's self-check, --verify.

Inputs are simulated runs (`servelab sim ... --out DIR`: steps, timelines and a manifest
like a real run's), so the whole loop runs in seconds without loading a model.
"""

from __future__ import annotations

import io
import json
import shlex
import shutil
from dataclasses import dataclass
from pathlib import Path

import pytest
from rich.console import Console
from typer.testing import CliRunner

from servelab.analyze.diagnosis.findings import Finding
from servelab.analyze.tuning.candidates import RunFacts, budget_grid, generate
from servelab.analyze.tuning.decision import Objective, decide, judge
from servelab.analyze.tuning.prediction import Prediction
from servelab.analyze.tuning.verification import AS_RUN, TUNED
from servelab.cli import app
from servelab.rundir import load_run
from servelab.sim.fit.asrun import NotReplayable, requests_as_run
from servelab.testing.testserver import Schedule, TestServer
from servelab.workflows.relaunch import NotRelaunchable, embedded_relaunch
from servelab.workflows.tuning_loop import TuneSpec, predict, verify_choice

runner = CliRunner()


def _sim(out: Path, *args: str) -> Path:
    r = runner.invoke(app, ["sim", "--hardware", "cpu", *args, "--out", str(out)])
    assert r.exit_code == 0, r.output
    return out


@pytest.fixture(scope="module")
def mixed_run(tmp_path_factory) -> Path:
    """Open-loop mixed traffic that over-fills a 2048-token budget: findings fire."""
    d = tmp_path_factory.mktemp("tune") / "mixed"
    return _sim(d, "--workload", "mixed", "--rate", "0.5", "--duration", "40s", "--seed", "3")


def _finding(fid: str, levers: list[str]) -> Finding:
    return Finding(
        id=fid, title=fid, summary="", evidence={}, confidence=0.9, exact=True, levers=levers
    )


def _prediction(label: str, **figs: list[float]) -> Prediction:
    """Seeds of overall figures: ``ttft_p95=[...]`` gives one value per seed."""
    n = len(next(iter(figs.values())))
    return Prediction(label, [{"overall": {k: v[i] for k, v in figs.items()}} for i in range(n)])


FACTS = RunFacts(
    config={"enable_chunked_prefill": True, "max_num_batched_tokens": 512, "max_num_seqs": 64},
    prompt_tokens=[300, 600, 900, 1200],
    priorities={"chat": 0},
    peak_seqs=8,
)


def test_two_opposing_findings_yield_one_setting_of_their_knob():
    findings = [
        _finding("itl_prefill_interference", ["batch_budget_down"]),
        _finding("prefill_bound", ["batch_budget_up"]),
    ]
    cands, _ = generate(findings, FACTS, ("overall", "goodput"))
    by_id = {c.id: c for c in cands}
    assert by_id["chunk-256"].lever == "batch_budget_down"
    assert by_id["chunk-1024"].lever == "batch_budget_up"
    assert by_id["chunk-256"].target == ("overall", "max_itl_mean")
    assert by_id["chunk-1024"].target == ("overall", "ttft_p95")
    base = _prediction(
        "as-run", goodput=[1.0, 1.0, 1.0], max_itl_mean=[2.0] * 3, ttft_p95=[5.0] * 3
    )
    # Both directions pay on the objective and on their own targets; the lower pays more.
    lower = _prediction("256", goodput=[1.3, 1.3, 1.3], max_itl_mean=[1.0] * 3, ttft_p95=[5.0] * 3)
    higher = _prediction(
        "1024", goodput=[1.1, 1.1, 1.1], max_itl_mean=[2.0] * 3, ttft_p95=[4.0] * 3
    )
    obj = Objective.parse(None, has_slos=True)
    judged = [
        judge(base, by_id["chunk-256"], lower, obj),
        judge(base, by_id["chunk-1024"], higher, obj),
    ]
    assert all(j.recommendable for j in judged)
    d = decide(judged, obj)
    chunking = [j for j in d.ranked if j.candidate.knob == "chunking"]
    assert [j.candidate.id for j in chunking] == ["chunk-256"]
    assert d.chosen is not None and d.chosen.candidate.id == "chunk-256"
    (loser,) = [r for r in d.rejected if r.candidate.id == "chunk-1024"]
    assert "same knob" in loser.reason
    # Each figure is written as it moves: goodput up 30%, the longest ITL mean down 50%.
    assert d.chosen.reason.endswith("+30.0%; longest ITL mean -50.0%"), d.chosen.reason


def test_a_candidate_predicted_worse_is_never_recommended():
    findings = [_finding("itl_prefill_interference", ["batch_budget_down"])]
    cands, _ = generate(findings, FACTS, ("overall", "goodput"))
    c = next(c for c in cands if c.id == "chunk-256")
    obj = Objective.parse(None, has_slos=True)
    base = _prediction("as-run", goodput=[1.0] * 4, max_itl_mean=[2.0] * 4)
    worse = judge(base, c, _prediction("w", goodput=[0.8] * 4, max_itl_mean=[1.0] * 4), obj)
    assert not worse.recommendable and worse.reason.startswith("predicted worse")
    assert worse.reason.endswith("-20.0%")  # goodput went down
    ttft = Objective.parse("ttft_p95", has_slos=True)
    figs = {"goodput": [1.0] * 4, "max_itl_mean": [2.0] * 4}
    later = judge(
        _prediction("as-run", **figs, ttft_p95=[5.0] * 4),
        c,
        _prediction("l", **figs, ttft_p95=[6.0] * 4),
        ttft,
    )
    assert later.reason.startswith("predicted worse") and later.reason.endswith("+20.0%")
    # Better on the objective but not on its own target: not recommended either.
    off_target = judge(base, c, _prediction("t", goodput=[1.5] * 4, max_itl_mean=[2.1] * 4), obj)
    assert not off_target.recommendable and "target" in off_target.reason
    # Mixed seeds (a gain in half of them) are no predicted gain.
    mixed = judge(
        base, c, _prediction("m", goodput=[1.3, 0.9, 1.3, 0.9], max_itl_mean=[1.0] * 4), obj
    )
    assert not mixed.recommendable
    d = decide([worse, off_target, mixed], obj)
    assert d.chosen is None and d.ranked == []
    assert {r.candidate.id for r in d.rejected} == {"chunk-256"}


def test_levers_the_simulator_cannot_replay_say_why():
    findings = [
        _finding("decode_bound", ["speculative_decoding"]),
        _finding("itl_prefill_interference", ["batch_budget_down", "disaggregation"]),
    ]
    cands, skipped = generate(findings, FACTS, ("overall", "e2e_p95"))
    reasons = {u.lever: u.reason for u in skipped}
    assert "did not speculate" in reasons["speculative_decoding"]
    assert "disaggregated" in reasons["disaggregation"]
    assert not any(c.knob == "speculation" for c in cands)
    assert budget_grid([700, 750, 800], 2048) == [64, 128, 256, 512, 736, 752, 800, 1024]


def test_objective_parsing():
    assert Objective.parse(None, has_slos=False).figure == "e2e_p95"
    o = Objective.parse("ttft_p95@chat", has_slos=False)
    assert (o.figure, o.scope, o.higher_is_better) == ("ttft_p95", "chat", False)
    assert Objective.parse("throughput", has_slos=False).higher_is_better
    with pytest.raises(ValueError, match="no SLOs"):
        Objective.parse("goodput", has_slos=False)
    with pytest.raises(ValueError, match="unknown figure"):
        Objective.parse("latency", has_slos=True)


def test_the_run_is_rebuilt_as_it_ran_and_replays_within_the_tolerance(mixed_run):
    run = load_run(mixed_run)
    asrun = requests_as_run(run)
    recs = {r.request_id: r for r in run.records}
    assert {r.request_id for r in asrun.requests} == set(recs)
    for r in asrun.requests:
        assert r.max_tokens == recs[r.request_id].requested_output_tokens
        if r.tags.turn == 0:
            assert r.send_time == pytest.approx(recs[r.request_id].actual_send - 1000.0)
    # a small run (20 requests): what its held-out halves cannot pin down is too small
    t = predict(run, TuneSpec(mixed_run, seeds=2, jobs=1, ignore_gates=True))
    assert t.refused is None, t.refused
    assert t.check is not None and t.check.ok and t.check.parts == 2
    verdicts = {(r.scope, r.name): r.verdict for r in t.check.rows}
    assert verdicts[("overall", "ttft_p50")] == "ok"
    assert verdicts[("overall", "ttft_p95")] == "too_small"  # 15 requests in a half
    assert "thin" not in verdicts.values()
    assert {f.id for f in t.findings} >= {"itl_prefill_interference"}
    d = t.decision
    assert d is not None and d.chosen is not None
    # One value per knob, and every recommended setting improves its own target.
    knobs = [j.candidate.knob for j in d.ranked]
    assert len(knobs) == len(set(knobs))
    assert all(j.recommendable and (j.target_gain or 0) > 0 for j in d.ranked)


def test_the_self_check_refuses_a_replay_that_does_not_match(mixed_run, tmp_path):
    planted = tmp_path / "planted"
    planted.mkdir()
    for f in mixed_run.iterdir():
        (planted / f.name).write_bytes(f.read_bytes())
    # The recorded steps claim to have taken half their time: a cost model fitted to them
    # replays a server twice as fast as the one the requests measured.
    lines = []
    for line in (planted / "steps.jsonl").read_text().splitlines():
        s = json.loads(line)
        s["end"] = s["start"] + (s["end"] - s["start"]) * 0.5
        lines.append(json.dumps(s))
    (planted / "steps.jsonl").write_text("\n".join(lines) + "\n")
    t = predict(load_run(planted), TuneSpec(planted, seeds=2, jobs=1))
    assert t.refused is not None and "strays" in t.refused
    assert t.decision is None and t.judged == []
    assert t.check is not None and t.check.strayed
    assert all(r.scope + " " + r.name in t.refused for r in t.check.strayed[:1])


def test_a_run_without_step_records_replays_on_its_twin_if_it_streamed(mixed_run, tmp_path):
    bare = tmp_path / "bare"
    bare.mkdir()
    for name in ("manifest.json", "requests.jsonl", "metrics.json"):
        (bare / name).write_bytes((mixed_run / name).read_bytes())
    # a small run, to be quick: past the gate that asks for more requests
    r = runner.invoke(app, ["tune", str(bare), "--seeds", "2", "--jobs", "1", "--ignore-gates"])
    assert r.exit_code == 0, r.output
    assert "replayed on the twin of this servelab server" in " ".join(r.output.split())
    # Without streams there are no chunk arrivals to infer its steps from.
    lines = []
    for line in (bare / "requests.jsonl").read_text().splitlines():
        rec = json.loads(line)
        rec.update(stream=False, chunk_times=[], chunk_tokens=[])
        lines.append(json.dumps(rec))
    (bare / "requests.jsonl").write_text("\n".join(lines) + "\n")
    with pytest.raises(NotReplayable, match="no streamed requests"):
        requests_as_run(load_run(bare))


def test_cli_tune_prints_the_decision_and_writes_json_and_html(mixed_run, tmp_path):
    html = tmp_path / "tune.html"
    r = runner.invoke(
        app,
        ["tune", str(mixed_run), "--seeds", "2", "--jobs", "2", "--html", str(html),
         "--ignore-gates"],  # a small run, to be quick
    )  # fmt: skip
    assert r.exit_code == 0, r.output
    said = " ".join(r.output.split())
    assert "self-check" in said and "apply:" in said and "predicted before -> after" in said
    page = html.read_text()
    assert 'data-section="tune-check"' in page and 'data-section="tune-decision"' in page
    r = runner.invoke(
        app, ["tune", str(mixed_run), "--seeds", "2", "--jobs", "1", "--json", "--ignore-gates"]
    )
    assert r.exit_code == 0, r.output
    doc = json.loads(r.output)
    assert doc["self_check"]["ok"] and doc["decision"]["chosen"] is not None
    r = runner.invoke(app, ["tune", str(mixed_run), "--objective", "nonsense"])
    assert r.exit_code == 2 and "unknown figure" in r.output


@dataclass
class StandIn:
    """A running stand-in server as the matrix sees a launched one."""

    url: str
    engine_args: str
    command: list[str]


def test_verify_against_stand_in_servers_reports_measured_vs_predicted(tmp_path):
    run_dir = _sim(
        tmp_path / "closed", "--workload", "rag", "--concurrency", "2", "--requests", "6",
        "--length-scale", "0.3", "--seed", "1",
    )  # fmt: skip
    run = load_run(run_dir)
    spec = TuneSpec(
        run_dir, seeds=2, jobs=1, verify=True, repeats=1, out=tmp_path / "verify",
        ignore_gates=True,  # 6 requests: too small to check
    )  # fmt: skip
    t = predict(run, spec)
    assert t.refused is None, t.refused
    # Whatever was decided for this small run, verify one setting of the chunk budget.
    cands, _ = generate(
        [_finding("itl_prefill_interference", ["batch_budget_down"])],
        RunFacts(
            config={"max_num_batched_tokens": 2048}, prompt_tokens=[400], priorities={}, peak_seqs=2
        ),
        ("overall", "goodput"),
    )
    cand = next(c for c in cands if c.id == "chunk-256")
    assert t.baseline is not None
    obj = Objective.parse(None, has_slos=True)
    chosen = judge(t.baseline, cand, t.baseline, obj)
    t.decision = decide([], obj)
    t.decision.chosen = chosen
    fast, slow = Schedule(ttft=0.02, itl=0.004), Schedule(ttft=0.06, itl=0.008)
    console = Console(record=True, width=120)
    with TestServer(slow).running() as url_a, TestServer(fast).running() as url_b:
        servers = {
            AS_RUN: StandIn(url_a, "", ["stand-in"]),
            TUNED: StandIn(url_b, "", ["stand-in"]),
        }
        v = verify_choice(run, t, spec, console, servers)
    said = console.export_text()
    assert "verify:" in said and "this takes about" in said
    assert v.repeats == 1
    rows = {(r.config, r.scope, r.name): r for r in v.rows}
    for cfg in (AS_RUN, TUNED):
        r = rows[(cfg, "overall", "ttft_p50")]
        assert r.measured is not None and r.predicted is not None and r.error is not None
    # The stand-ins' schedules: as run 60 ms to the first token, tuned 20 ms.
    assert rows[(AS_RUN, "overall", "ttft_p50")].measured == pytest.approx(0.06, abs=0.03)
    assert rows[(TUNED, "overall", "ttft_p50")].measured == pytest.approx(0.02, abs=0.03)
    (tuned,) = v.arms
    assert tuned.name == TUNED and tuned.objective.p_value is not None
    assert "predicted" in v.sentence and v.answer in ("apply", "keep")


def test_the_cost_model_of_one_run_has_a_non_decreasing_token_term(mixed_run):
    from servelab.sim.fit.asrun import target_from_run

    model = target_from_run(load_run(mixed_run)).cost_model
    g = model.g  # type: ignore[attr-defined]
    assert all(b >= a for a, b in zip(g, g[1:]))
    assert model.table.meta["monotone"] is True  # type: ignore[attr-defined]


def test_the_html_report_keeps_the_notes():
    from servelab.analyze.tuning.result import Tuning
    from servelab.report.tuning_view import tuning_html

    page = tuning_html(Tuning("run", notes=["speculation probe: 5 requests <sampled>"]))
    assert 'data-section="tune-notes"' in page and "5 requests &lt;sampled&gt;" in page
    assert "tune-notes" not in tuning_html(Tuning("run"))


def test_values_of_one_knob_that_tie_on_the_objective_are_decided_by_their_target():
    findings = [_finding("itl_prefill_interference", ["batch_budget_down"])]
    cands, _ = generate(findings, FACTS, ("overall", "goodput"))
    by_id = {c.id: c for c in cands}
    obj = Objective.parse(None, has_slos=True)
    base = _prediction("as-run", goodput=[1.0] * 4, max_itl_mean=[2.0] * 4)

    def judged(goodput: float, itl: float, cid: str):
        pred = _prediction(cid, goodput=[goodput] * 4, max_itl_mean=[itl] * 4)
        return judge(base, by_id[cid], pred, obj)

    # +30.0% and +30.5%: a tie, so the longer gap cut (-75% against -50%) decides
    d = decide([judged(1.300, 0.5, "chunk-64"), judged(1.305, 1.0, "chunk-256")], obj)
    assert d.chosen is not None and d.chosen.candidate.id == "chunk-64"
    (why,) = [r.reason for r in d.rejected if r.candidate.id == "chunk-256"]
    assert why.startswith("ties on the objective") and "-75.0% vs -50.0%" in why
    # +30% against +35%: no tie, the objective decides whatever the targets say
    d = decide([judged(1.30, 0.5, "chunk-64"), judged(1.35, 1.0, "chunk-256")], obj)
    assert d.chosen is not None and d.chosen.candidate.id == "chunk-256"


def _served(run_dir: Path, dst: Path, **server: object) -> Path:
    """``run_dir`` as if `servelab bench` had launched `servelab serve` for it with
    ``server`` recorded (a simulated run has no server to relaunch)."""
    shutil.copytree(run_dir, dst)
    man = json.loads((dst / "manifest.json").read_text())
    man["simulated"] = False
    man["server"].update(server)
    (dst / "manifest.json").write_text(json.dumps(man))
    return dst


def _chunk_256_chosen(run, spec):
    t = predict(run, spec)
    assert t.refused is None and t.baseline is not None, t.refused
    cands, _ = generate(
        [_finding("itl_prefill_interference", ["batch_budget_down"])],
        RunFacts(
            config={"max_num_batched_tokens": 2048}, prompt_tokens=[400], priorities={}, peak_seqs=2
        ),
        ("overall", "goodput"),
    )
    obj = Objective.parse(None, has_slos=True)
    t.decision = decide([], obj)
    t.decision.chosen = judge(
        t.baseline, next(c for c in cands if c.id == "chunk-256"), t.baseline, obj
    )
    return t


def test_verify_relaunches_the_embedded_server_as_it_served_the_run(tmp_path, monkeypatch):
    from rundirs import StandIn

    from servelab.workflows import matrix

    sim = _sim(
        tmp_path / "sim", "--workload", "rag", "--concurrency", "2", "--requests", "6",
        "--length-scale", "0.3", "--seed", "1",
    )  # fmt: skip
    model = "smollm2-360m"  # not the default model
    served = _served(
        sim, tmp_path / "served", launched=True,
        command=["servelab", "serve", "--model", model, "--host", "127.0.0.1", "--port", "1"],
        engine_args="--max-num-seqs 8 --kv-cache-memory 1G",
        version={"engine": {"model": model, "quantization": "q4_1", "torch_threads": 3,
                            "device": "cpu"}},
    )  # fmt: skip
    StandIn.started, StandIn.models = [], []
    monkeypatch.setattr(matrix, "LaunchedServer", StandIn)
    run = load_run(served)
    spec = TuneSpec(
        served, seeds=2, jobs=1, verify=True, repeats=1, out=tmp_path / "v", ignore_gates=True
    )
    verify_choice(run, _chunk_256_chosen(run, spec), spec, Console(file=io.StringIO()))
    assert StandIn.models == [model, model]
    as_run, tuned = StandIn.started
    said = shlex.split(as_run)
    # every recorded flag, then what the core ran with: the last flag wins
    assert said[:4] == ["--max-num-seqs", "8", "--kv-cache-memory", "1G"]
    assert said[-6:] == ["--quantization", "q4_1", "--threads", "3", "--device", "cpu"]
    assert "--num-gpu-blocks-override" in said  # the resolved config between them
    assert tuned.startswith(as_run) and tuned.endswith("--max-num-batched-tokens 256")
    # what the manifest does not record is named, and nothing is predicted or launched
    bare = _served(sim, tmp_path / "bare", launched=True, command=None, version=None)
    with pytest.raises(NotRelaunchable) as e:
        embedded_relaunch(load_run(bare))
    for what in ("the model", "quantization", "threads"):
        assert what in str(e.value)
    r = runner.invoke(app, ["tune", str(bare), "--verify", "--seeds", "2", "--jobs", "1"])
    assert r.exit_code == 2 and "does not record" in r.output
    r = runner.invoke(app, ["tune", str(sim), "--verify", "--seeds", "2", "--jobs", "1"])
    assert r.exit_code == 2 and "ran in the simulator" in " ".join(r.output.split())


def test_a_server_that_chose_its_own_device_relaunches_with_flags_serve_takes(
    tmp_path, monkeypatch
):
    # `servelab serve` without --device records the core's device as "auto", which serve's
    # own parser refuses: the relaunch leaves the choice to the relaunched server

    sim = _sim(tmp_path / "sim", "--workload", "chat", "--requests", "4", "--seed", "1")
    served = _served(
        sim, tmp_path / "served", launched=True,
        command=["servelab", "serve", "--host", "127.0.0.1", "--port", "1"],
        version={"engine": {"model": "smollm2-135m", "quantization": "none",
                            "torch_threads": 1, "device": "auto"}},
    )  # fmt: skip
    relaunch = embedded_relaunch(load_run(served))
    assert "--device" not in shlex.split(relaunch.flags)
    served_args: list = []
    monkeypatch.setattr("servelab.server.main.run_server", lambda a: served_args.append(a) or 0)
    argv = ["serve", "--model", relaunch.model, *shlex.split(relaunch.flags)]
    r = runner.invoke(app, argv, env={"SERVELAB_API_KEY": "", "OPENAI_API_KEY": ""})
    assert r.exit_code == 0, r.output
    assert served_args[0].threads == 1 and served_args[0].device is None
