"""Workload specs: presets validate, files load, and mistakes get clear messages."""

from __future__ import annotations

import numpy as np
import pytest

from servelab.bench.workloads.presets import PRESETS
from servelab.bench.workloads.spec import Dist, load_workload, parse_workload
from servelab.units import SLO


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_presets_validate_and_fit_a_small_cpu(name):
    spec = load_workload(name)
    for c in spec.classes:
        longest = c.input.max or c.input.approx_mean()
        longest += sum(p.tokens.max or p.tokens.approx_mean() for p in c.prefix)
        assert longest <= 2048 + 96, (name, c.name, longest)
        assert spec.class_slos()[c.name] != SLO()


def test_yaml_and_toml_files_load(tmp_path):
    (tmp_path / "lens.txt").write_text("10\n20\n30\n")
    (tmp_path / "w.yaml").write_text(
        "name: w\nslo: 'ttft=2s,itl=250ms'\nclasses:\n"
        "  - name: a\n    input: {dist: empirical, file: lens.txt}\n    output: 8\n"
        "    slo: {ttft: 500ms}\n"
    )
    spec = load_workload(str(tmp_path / "w.yaml"))
    assert spec.classes[0].input.values == [10.0, 20.0, 30.0]
    assert spec.class_slos()["a"] == SLO(ttft=0.5, itl=0.25)
    assert spec.class_slos(SLO(e2e=9.0))["a"] == SLO(ttft=0.5, itl=0.25, e2e=9.0)
    (tmp_path / "w.toml").write_text(
        'name = "t"\n[[classes]]\nname = "b"\ninput = {dist = "uniform", min = 5, max = 9}\n'
        "output = 3\nstream = false\n"
    )
    spec = load_workload(str(tmp_path / "w.toml"))
    assert spec.classes[0].stream is False


@pytest.mark.parametrize(
    ("data", "message"),
    [
        ({}, "classes: Field required"),
        ({"classes": []}, "classes: List should have at least 1 item"),
        (
            {"classes": [{"name": "a", "input": 5}]},
            "classes.0: a class needs input and output lengths",
        ),
        (
            {"classes": [{"name": "a", "input": 5, "output": 5, "wieght": 2}]},
            "classes.0.wieght: unknown field",
        ),
        (
            {"classes": [{"name": "a", "input": {"dist": "normal", "mean": 5}, "output": 1}]},
            "classes.0.input: a normal distribution needs std",
        ),
        (
            {"classes": [{"name": "a", "input": {"dist": "zipf"}, "output": 1}]},
            "classes.0.input.dist",
        ),
        (
            {
                "classes": [
                    {"name": "a", "input": {"dist": "uniform", "min": 9, "max": 2}, "output": 1}
                ]
            },
            "min (9.0) is larger than max (2.0)",
        ),
        ({"classes": [{"name": "a", "input": 5, "output": 5, "slo": "ttft=2"}]}, "unit"),
        ({"classes": [{"name": "a", "input": 5, "output": 5, "weight": 0}]}, "classes.0.weight"),
        (
            {
                "classes": [
                    {"name": "a", "input": 5, "output": 5},
                    {"name": "a", "input": 1, "output": 1},
                ]
            },
            "repeated: ['a']",
        ),
        (
            {
                "classes": [
                    {"name": "a", "input": 5, "output": 5, "prefix": [{"tokens": 10, "reuse": 1.5}]}
                ]
            },
            "classes.0.prefix.0.reuse",
        ),
    ],
)
def test_spec_errors_name_the_field(data, message):
    with pytest.raises(ValueError, match="invalid workload spec") as e:
        parse_workload(data, "test.yaml")
    assert message in str(e.value)


def test_file_errors(tmp_path):
    with pytest.raises(ValueError, match="neither a preset"):
        load_workload("nope")
    bad = tmp_path / "bad.yaml"
    bad.write_text("classes: [\n")
    with pytest.raises(ValueError, match="cannot parse workload file"):
        load_workload(str(bad))
    (tmp_path / "e.yaml").write_text(
        "classes:\n  - name: a\n    input: {dist: empirical, file: missing.txt}\n    output: 1\n"
    )
    with pytest.raises(ValueError, match="does not exist"):
        load_workload(str(tmp_path / "e.yaml"))


def test_distributions_sample_what_they_say():
    rng = np.random.default_rng(0)
    x = Dist(dist="lognormal", mean=300, sigma=0.6).sample(rng, 50000)
    assert x.mean() == pytest.approx(300, rel=0.03)
    x = Dist(dist="normal", mean=100, std=10, min=95).sample(rng, 1000)
    assert x.min() == 95
    assert set(Dist(dist="empirical", values=[3, 7]).sample_int(rng, 200).tolist()) == {3, 7}
    assert Dist.model_validate("250ms").value == 0.25
    assert Dist.model_validate(12).sample_int(rng, 3, scale=0.5).tolist() == [6, 6, 6]
