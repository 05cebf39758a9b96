"""The run directory's writers keep one JSON object per line, whatever a server sent."""

from __future__ import annotations

import json

from servelab.bench.collect import _decode_reply
from servelab.bench.recorder import RunDir


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
