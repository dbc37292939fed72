"""The battery of malformed requests (``course_utils.serving.probe``): what it builds for a server's limits, how it
reads raw answers, how it compares an answer with the course server's documented one. Sending it to the course
engine's server is ``test_server_soak.py``."""
from __future__ import annotations

import json
import re

import pytest

from course_utils.serving.probe import Answer, Probe, ServerLimits, answers_table, malformed_requests, parse_raw_answer

LIMITS = ServerLimits("m", vocab_size=1000, context_tokens=64, max_body_bytes=8 << 20, head_timeout_s=3.0)


def _by_name(probes, start):
    [probe] = [p for p in probes if p.name.startswith(start)]
    return probe


def _body(probe) -> bytes:
    return probe.request["content"] if "content" in probe.request else json.dumps(probe.request["json"]).encode()


def test_the_battery_follows_the_servers_limits():
    probes = malformed_requests(LIMITS)
    assert len({p.name for p in probes}) == len(probes)
    assert all((p.request is None) != (p.raw is None) for p in probes)
    assert _by_name(probes, "id beyond").request["json"]["prompt"] == [1000]           # the first id outside
    assert _by_name(probes, "prompt of 65 tokens").request["json"]["prompt"] == [5] * 65
    assert len(_by_name(probes, "body of").request["content"]) == (8 << 20) + 1
    assert _by_name(probes, "request head never").wait_s > LIMITS.head_timeout_s        # waits past the server's timeout
    wider = malformed_requests(ServerLimits("m", 50, 2048, 8 << 20))
    assert _by_name(wider, "id beyond").request["json"]["prompt"] == [50]
    assert len(_by_name(wider, "prompt of 2049").request["json"]["prompt"]) == 2049


def test_well_framed_probes_name_the_served_model_except_the_unknown_one():
    for model in ("m", "other"):
        probes = malformed_requests(ServerLimits(model, 1000, 64, 8 << 20))
        named = [p.request["json"]["model"] for p in probes if p.request and "json" in p.request
                 and "model" in p.request["json"]]
        unknown = _by_name(probes, "unknown model").request["json"]["model"]
        assert unknown != model and named.count(unknown) == 1 and named.count(model) == len(named) - 1


def test_only_the_oversized_body_is_over_the_body_limit():
    probes = malformed_requests(LIMITS)
    for p in probes:
        size = len(_body(p)) if p.request else len(p.raw)
        assert (size > LIMITS.max_body_bytes) == p.name.startswith("body of"), p.name
    with pytest.raises(ValueError, match="max_body_bytes must exceed"):
        malformed_requests(ServerLimits("m", 1000, 64, 512 << 10))   # the long text prompt would be refused for its size


def test_the_raw_probes_are_framed_as_they_claim():
    probes = malformed_requests(LIMITS)
    smuggle = _by_name(probes, "Content-Length and Transfer").raw
    head, _, body = smuggle.partition(b"\r\n\r\n")
    assert b"Transfer-Encoding: chunked" in head and int(re.search(rb"Content-Length: (\d+)", head)[1]) == len(body)
    assert body.startswith(b"0\r\n\r\nPOST /v1/completions")                      # a second request behind the chunks
    short = _by_name(probes, "body shorter").raw
    head, _, body = short.partition(b"\r\n\r\n")
    assert int(re.search(rb"Content-Length: (\d+)", head)[1]) == len(body) + 5
    assert b"\r\n\r\n" not in _by_name(probes, "request head never").raw


@pytest.mark.parametrize("limits, match", [
    (ServerLimits("", 10, 10, 8 << 20), "model"), (ServerLimits("m", 0, 10, 8 << 20), "vocab_size"),
    (ServerLimits("m", 10, 1.5, 8 << 20), "context_tokens"), (ServerLimits("m", 10, 10, 8 << 20, 0), "head_timeout"),
    ({"model": "m"}, "ServerLimits"),
])
def test_bad_limits_are_refused_by_name(limits, match):
    with pytest.raises(ValueError, match=match):
        malformed_requests(limits)


def test_raw_answers_are_read_as_the_server_wrote_them():
    body = b'{"error": {"message": "a request may not carry both", "code": 400}}'
    one = parse_raw_answer(b"HTTP/1.1 400 Bad Request\r\ncontent-length: %d\r\n\r\n%s" % (len(body), body), True, 5)
    assert (one.status, one.message, one.closed, one.responses) == (400, "a request may not carry both", True, 1)
    chunked = b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n4\r\nabcd\r\n2\r\nef\r\n0\r\n\r\n"
    assert parse_raw_answer(chunked, False, 5).message == "abcdef"
    two = parse_raw_answer(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nokHTTP/1.1 200 OK\r\n"
                           b"content-length: 2\r\n\r\nok", False, 5)
    assert two.responses == 2
    silent = parse_raw_answer(b"", False, 2)
    assert silent.status is None and "stayed open" in silent.message and silent.raw_bytes == 0
    assert parse_raw_answer(b"junk", True, 2).raw_bytes == 4


def test_mismatch_names_what_differs_from_the_documented_answer():
    probe = Probe("x", 400, "max_tokens", raw=b"", closed=True)
    assert probe.mismatch(Answer(400, "max_tokens: bad", True)) is None
    assert "status 200" in probe.mismatch(Answer(200, "max_tokens", True))
    assert "lacks" in probe.mismatch(Answer(400, "something else", True))
    assert "not closed" in probe.mismatch(Answer(400, "max_tokens", False))
    assert "2 responses" in probe.mismatch(Answer(400, "max_tokens", True, responses=2))
    silent = Probe("y", None, "", raw=b"", closed=False)
    assert silent.mismatch(Answer(None, "no answer", False, 0, 0)) is None
    assert "bytes" in silent.mismatch(Answer(None, "no answer", False, 0, 3))


def test_the_table_has_a_row_per_probe_and_escapes_cells():
    probes = [Probe("a", 400, "", raw=b""), Probe("b", None, "", raw=b"")]
    table = answers_table(probes, {"one": [Answer(400, "x | y " + "z" * 200, True), Answer(None, "no answer", False)],
                                   "two": [Answer(200, "", False), Answer(404, "gone", False)]})
    lines = table.splitlines()
    assert len(lines) == 4 and lines[0] == "| request | one | two |"
    assert lines[2].startswith("| a | **400** (connection closed): x \\| y z") and "…" in lines[2]
    assert lines[3] == "| b | no answer | **404**: gone |"
    with pytest.raises(ValueError, match="1 answers for 2 probes"):
        answers_table(probes, {"one": [Answer(200, "", False)]})


def test_a_completion_is_summed_up_and_error_bodies_read_in_each_shape():
    from course_utils.serving.probe import _message
    done = {"id": "c", "choices": [{"text": "long text"}], "usage": {"completion_tokens": 16}}
    assert _message(json.dumps(done).encode()) == "a completion of 16 tokens"
    assert _message(b'{"error": {"message": "bad"}}') == "bad"
    assert _message(b'{"detail": "Not Found"}') == "Not Found"
    assert _message(b"Invalid HTTP request received.") == "Invalid HTTP request received."
