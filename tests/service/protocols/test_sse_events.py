"""A stream event (service.protocols.generation.sse) is one `data:` line of compact JSON in UTF-8, whatever its
text holds; text orjson refuses (a lone surrogate a client sent, echoed back) is written escaped instead."""

from __future__ import annotations

import json

from service.protocols.generation import sse


def _event(body: bytes) -> object:
    assert body.startswith(b"data: ") and body.endswith(b"\n\n")
    line = body[len(b"data: "):-2]
    assert b"\n" not in line and b"\r" not in line  # one event, however many lines its text has
    return json.loads(line)


def test_an_event_is_one_line_of_utf8_json() -> None:
    chunk = {"id": "cmpl-1", "object": "text_completion", "created": 1, "model": "m",
             "choices": [{"index": 0, "text": "é 日本\n\ndata: x\r\n\u2028", "logprobs": None, "finish_reason": None}],
             "usage": {"prompt_tokens": 3, "completion_tokens": 1, "total_tokens": 4}}
    body = sse(chunk)
    assert _event(body) == chunk
    # compact, UTF-8 (SSE's encoding) rather than \\u escapes
    assert body == b"data: " + json.dumps(chunk, separators=(",", ":"), ensure_ascii=False).encode() + b"\n\n"


def test_a_lone_surrogate_is_written_escaped() -> None:
    chunk = {"choices": [{"index": 0, "text": "a\ud800b"}]}
    body = sse(chunk)
    assert b"\\ud800" in body and _event(body) == chunk


def test_a_responses_event_is_written_the_same_way() -> None:
    from service.protocols.responses.answer import sse_event as _event

    body = {"type": "response.output_text.delta", "delta": "é 日本\n", "output_index": 0}
    event = _event(body)
    head, _, data = event.partition(b"\n")
    assert head == b"event: response.output_text.delta"
    assert data == sse(body)  # the data line as every other stream's
