"""The run directory's writers keep one JSON object per line, whatever a server sent."""

from __future__ import annotations

import json

import pytest

from servelab.bench.servers.collect import _decode_reply
from servelab.rundir import (
    FORMAT_VERSION,
    RunDir,
    RunDirError,
    load_run,
    read_json,
    read_records,
    write_manifest,
)
from servelab.vocab import ClientRecord


def test_timelines_are_written_as_sent_one_per_line(tmp_path):
    compact = {"request_id": "a", "token_times": [1.5, 2.25]}
    pretty = {"request_id": "b", "token_times": [3.0]}
    body = (
        '{"timelines": [' + json.dumps(compact) + ", " + json.dumps(pretty, indent=2) + "],"
        ' "steps": [{"step_id": 7}]}'
    ).encode()
    reply = _decode_reply(body)
    rd = RunDir(tmp_path)
    for raw in reply.timelines:
        rd.add_timeline_json(raw)
    rd.close()
    lines = (tmp_path / "server.jsonl").read_bytes().splitlines()
    assert [json.loads(line) for line in lines] == [compact, pretty]
    assert lines[0] == json.dumps(compact).encode()  # as sent, not re-encoded
    assert reply.steps == [{"step_id": 7}]


def test_a_reply_without_timelines_or_steps_reads_as_empty():
    reply = _decode_reply(b"{}")
    assert reply.timelines == [] and reply.steps == []


def test_records_read_back_equal_to_what_was_written(tmp_path):
    done = ClientRecord(
        request_id="t-r000001",
        workload_class="chat",
        intended_send=10.0,
        actual_send=10.001,
        input_tokens=200,
        requested_output_tokens=3,
        stream=True,
        session_id="s1",
        turn=1,
        prefix_group="g0",
        stage="rate=2",
    )
    done.chunk_times, done.chunk_tokens = [10.1, 10.2, 10.3], [1, 1, 1]
    done.output_tokens, done.client_output_tokens, done.done = 3, 3, 10.31
    done.server_timeline = {"request_id": "t-r000001", "token_times": [10.09]}
    failed = ClientRecord(
        request_id="t-r000002",
        workload_class="chat",
        intended_send=11.0,
        actual_send=11.0,
        input_tokens=20,
        requested_output_tokens=None,
        stream=False,
        error="timeout: no complete response within 5s",
    )
    rd = RunDir(tmp_path)
    for rec in (done, failed):
        rd.add_record(rec)
    rd.close()
    assert read_records(tmp_path / "requests.jsonl") == [done, failed]


def test_a_manifest_round_trip_keeps_unknown_fields_and_stamps_the_format(tmp_path):
    rd = RunDir(tmp_path)
    rd.add_record(
        ClientRecord(request_id="r0", workload_class="chat", intended_send=1.0, actual_send=1.0)
    )
    rd.close()
    written = {"name": "x", "from_a_newer_version": {"nested": [1, 2]}, "format_version": 1}
    write_manifest(tmp_path, written)
    run = load_run(tmp_path)
    assert run.format_version == FORMAT_VERSION
    assert run.manifest["from_a_newer_version"] == {"nested": [1, 2]}
    write_manifest(tmp_path, run.manifest)  # what a later command that edits it does
    again = read_json(tmp_path, "manifest.json")
    assert again == {**written, "format_version": FORMAT_VERSION}


def test_a_cut_last_line_is_skipped_and_a_bad_middle_line_is_an_error(tmp_path):
    good = json.dumps(
        {"request_id": "a", "workload_class": "c", "intended_send": 0.0, "actual_send": 0.0}
    )
    (tmp_path / "requests.jsonl").write_text(good + "\n" + good[:20])
    run = load_run(tmp_path)
    assert len(run.records) == 1 and run.skipped_lines == 1
    (tmp_path / "requests.jsonl").write_text(good + "\n{oops\n" + good + "\n")
    with pytest.raises(RunDirError, match="requests.jsonl:2"):
        load_run(tmp_path)


def test_rows_decoded_straight_into_records_equal_from_dict_of_each_row(tmp_path):
    """Typed decoding, with every line msgspec's types refuse read through from_dict."""
    from servelab.rundir import read_jsonl, read_rows
    from servelab.vocab import RequestTimeline, StepRecord

    rows = [
        {"request_id": "a", "workload_class": "c", "intended_send": 1, "actual_send": 2.5},
        {"request_id": "b", "workload_class": None, "intended_send": 0.0, "actual_send": 0.0},
        {"request_id": "c", "workload_class": "c", "intended_send": 0.0, "actual_send": 0.0,
         "input_tokens": 12.0, "chunk_times": [1, 2.5], "server_timeline": {"x": [1]},
         "not_a_field": 3},
    ]  # fmt: skip
    (tmp_path / "requests.jsonl").write_text(
        "\n".join(json.dumps(r) for r in rows) + "\n\n" + json.dumps(rows[0])[:25]
    )
    want = [ClientRecord.from_dict(r) for r in read_jsonl(tmp_path / "requests.jsonl")[0]]
    got, cut = read_rows(tmp_path / "requests.jsonl", ClientRecord)
    assert got == want and cut == 1
    timeline = {"request_id": "a", "arrival": 1.0, "chunks": [{"step_id": 1, "start": 1.0,
                "end": 2.0, "tokens": 5}], "finish_reason": "stop", "queue_time": 0.5}  # fmt: skip
    step = {"step_id": 3, "start": 1.0, "end": 1.5, "prefill": {"a": 5}, "role": "prefill"}
    for name, row, cls in (("server.jsonl", timeline, RequestTimeline), ("steps.jsonl", step, StepRecord)):  # fmt: skip
        (tmp_path / name).write_text(json.dumps(row) + "\n")
        assert read_rows(tmp_path / name, cls) == ([cls.from_dict(row)], 0)
    # a cut line whose first values are already of the wrong type is still a cut line
    (tmp_path / "requests.jsonl").write_text(json.dumps(rows[0]) + "\n" + json.dumps(rows[1])[:60])
    assert read_rows(tmp_path / "requests.jsonl", ClientRecord) == ([want[0]], 1)


def test_loading_pauses_the_cyclic_collector_and_restores_it(tmp_path):
    import gc

    (tmp_path / "requests.jsonl").write_text("")
    for enabled in (True, False):
        (gc.enable if enabled else gc.disable)()
        with pytest.raises(RunDirError, match="holds no finished request"):
            load_run(tmp_path)
        assert gc.isenabled() is enabled
    gc.enable()
