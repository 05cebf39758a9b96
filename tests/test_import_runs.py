"""`servelab import` on small real files of each tool (tests/data/imports/README.md says which
tool and server made each): the run it writes says where it came from, loads, matches the
run-directory schemas, and `diagnose` and `report` read it; bad input is one line."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from servelab import schemas
from servelab.cli import app
from servelab.rundir import LACKS_TOKEN_TIMES, load_run

DATA = Path(__file__).parent / "data" / "imports"
SAMPLES = {
    "guidellm": (DATA / "guidellm.json", "guidellm", "0.8.1"),
    "aiperf": (DATA / "aiperf", "aiperf", "0.13.0"),
    "vllm": (DATA / "vllm-bench.json", "vllm bench serve", None),
    "otel": (DATA / "vllm-otel.jsonl", "vllm otel spans", None),
}
NO_TOKEN_TIMES = {"guidellm", "otel"}


def import_sample(tmp_path: Path, name: str, *flags: str) -> Path:
    """The sample ``name`` imported into a run directory under ``tmp_path``."""
    out = tmp_path / name
    r = CliRunner().invoke(app, ["import", str(SAMPLES[name][0]), "--out", str(out), *flags])
    assert r.exit_code == 0, r.output
    return out


@pytest.mark.parametrize("name", SAMPLES)
def test_an_imported_run_says_where_it_came_from_and_loads(tmp_path, name):
    source, tool, version = SAMPLES[name]
    run = load_run(import_sample(tmp_path, name))
    imported = run.manifest["imported"]
    assert (imported["tool"], imported["version"]) == (tool, version)
    expected_file = "profile_export.jsonl" if source.is_dir() else source.name
    assert imported["file"] == expected_file
    assert run.target_kind == "other" and not run.timelines and not run.steps
    assert run.records and all(r.actual_send <= (r.done or r.actual_send) for r in run.records)
    assert (LACKS_TOKEN_TIMES in run.lacks) == (name in NO_TOKEN_TIMES)
    jsonschema = pytest.importorskip("jsonschema")
    for doc, schema in ((run.manifest, "manifest"), (run.metrics, "metrics")):
        jsonschema.Draft202012Validator(schemas.schema(schema)).validate(doc)
    line = (run.path / "requests.jsonl").read_text().splitlines()[0]
    jsonschema.Draft202012Validator(schemas.schema("request")).validate(json.loads(line))


@pytest.mark.parametrize("name", SAMPLES)
def test_diagnose_and_report_read_an_imported_run(tmp_path, name):
    run_dir = import_sample(tmp_path, name)
    r = CliRunner().invoke(app, ["diagnose", str(run_dir)])
    assert r.exit_code == 0, r.output
    flat = " ".join(r.output.split())
    assert f"Imported from {SAMPLES[name][1]}" in flat
    assert ("ITL, its stalls and the engine's steps cannot be seen" in flat) == (
        name in NO_TOKEN_TIMES
    )
    html = tmp_path / "report.html"
    r = CliRunner().invoke(app, ["report", str(run_dir), "--html", str(html)])
    assert r.exit_code == 0, r.output
    assert html.stat().st_size > 0


def test_the_server_config_is_recorded_for_calibrate_and_tune(tmp_path):
    run = load_run(
        import_sample(tmp_path, "aiperf", "--server-config", "vllm serve M --api-key s3")
    )
    assert run.server["stated_command"] == ["vllm", "serve", "M", "--api-key", "***"]


def test_a_file_of_no_known_format_is_one_line(tmp_path):
    other = tmp_path / "other.json"
    other.write_text('{"hello": 1}')
    r = CliRunner().invoke(app, ["import", str(other), "--out", str(tmp_path / "run")])
    assert r.exit_code == 2
    assert "none of the formats servelab imports" in r.output
    assert "Traceback" not in r.output and not (tmp_path / "run").exists()


def test_an_unknown_format_name_and_an_existing_run_are_refused(tmp_path):
    src = str(SAMPLES["aiperf"][0])
    r = CliRunner().invoke(app, ["import", src, "--out", str(tmp_path / "a"), "--format", "x"])
    assert r.exit_code == 2 and "--format 'x'" in r.output
    import_sample(tmp_path, "aiperf")
    r = CliRunner().invoke(app, ["import", src, "--out", str(tmp_path / "aiperf")])
    assert r.exit_code == 2 and "already holds a run" in r.output


def test_aiperf_s_records_file_and_a_named_format_import_alike(tmp_path):
    records = SAMPLES["aiperf"][0] / "profile_export.jsonl"
    out = tmp_path / "named"
    r = CliRunner().invoke(app, ["import", str(records), "--out", str(out), "--format", "aiperf"])
    assert r.exit_code == 0, r.output
    assert load_run(out).records == load_run(import_sample(tmp_path, "aiperf")).records
