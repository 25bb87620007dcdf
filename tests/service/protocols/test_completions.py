"""/v1/completions in-process: greedy text equal to the model's, defaults, batches of prompts, streaming, and bad
requests as OpenAI-shaped 400s. In-process (FastAPI's TestClient or straight ASGI; no network)."""

from __future__ import annotations

import json
from typing import Any

import pytest
from fastapi.testclient import TestClient

from models.generate import generate
from tests.service.support import TOK, _complete, error_of


def test_completion_greedy_matches_the_reference_and_counts_usage(service_client: TestClient,
                                                                  service_text_model: Any) -> None:
    r = _complete(service_client, prompt="Return the", max_tokens=30, temperature=0)
    assert r.status_code == 200
    body = r.json()
    want = generate(service_text_model, TOK.encode("Return the"), 30, temperature=0.0)[0]
    assert body["object"] == "text_completion" and body["id"].startswith("cmpl-")
    assert body["choices"][0]["text"] == TOK.decode(want)
    assert body["choices"][0]["finish_reason"] == "length"
    assert body["usage"] == {"prompt_tokens": 10, "completion_tokens": 30, "total_tokens": 40}
    assert "queue;dur=" in r.headers["server-timing"]


def test_completion_defaults_and_batch_of_prompts(service_client: TestClient) -> None:
    r = _complete(service_client, prompt=["Hello", "World!"], seed=3)
    body = r.json()
    assert [c["index"] for c in body["choices"]] == [0, 1]
    assert body["usage"]["prompt_tokens"] == 11 and body["usage"]["completion_tokens"] <= 32  # 16 each by default
    r = _complete(service_client, prompt=TOK.encode("Hi"), max_tokens=0)
    assert r.json()["choices"][0] == {"index": 0, "text": "", "logprobs": None, "finish_reason": "length"}


def _sse(text: str) -> list[Any]:
    events = [line.removeprefix("data: ") for line in text.split("\n\n") if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    return [json.loads(e) for e in events[:-1]]


def test_streaming_yields_the_same_text_ends_in_done_and_reports_usage(service_client: TestClient) -> None:
    body = {"prompt": "If the file", "max_tokens": 25, "temperature": 0.8, "seed": 11}
    whole = _complete(service_client, **body).json()
    r = _complete(service_client, stream=True, **body)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    chunks = _sse(r.text)
    assert "".join(c["choices"][0]["text"] for c in chunks) == whole["choices"][0]["text"]
    assert chunks[-1]["choices"][0]["finish_reason"] == "length" and chunks[-1]["usage"] == whole["usage"]
    assert all(c["choices"][0]["finish_reason"] is None for c in chunks[:-1])
    r = _complete(service_client, stream=True, stream_options={"include_usage": True}, **body)
    chunks = _sse(r.text)
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"] == whole["usage"]


@pytest.mark.parametrize(("body", "param"), [
    ({"prompt": ""}, "prompt"),
    ({"prompt": []}, "prompt"),
    ({"prompt": [[]]}, "prompt"),
    ({"prompt": "x" * 200}, "prompt"),
    ({"prompt": "hi", "max_tokens": 200}, "max_tokens"),
    ({"prompt": "hi", "max_tokens": -1}, "max_tokens"),
    ({"prompt": [1, 2, 999]}, "prompt"),
    ({"prompt": "hi", "n": 99}, "n"),
    ({"prompt": "hi", "temperature": 5}, "temperature"),
    ({"prompt": "hi", "top_p": 1.5}, "top_p"),
    ({"prompt": "hi", "stop": ["a", "b", "c", "d", "e"]}, "stop"),
    ({"prompt": "hi", "best_of": 2, "n": 3}, "best_of"),
    ({"prompt": "hi", "logprobs": 6}, "logprobs"),
    ({"prompt": "hi", "min_tokens": 9, "max_tokens": 3}, "min_tokens"),
    ({"prompt": "hi", "best_of": 2, "stream": True}, "best_of"),
    ({"prompt": 5}, "prompt"),
    ({"prompt": "\ud800"}, "prompt"),
    ({"prompt": "hi", "stop": "\udfff"}, "stop"),
    ({}, "prompt"),
])
def test_bad_completion_requests_are_400_with_openai_errors(service_client: TestClient, body: dict[str, Any],
                                                            param: str) -> None:
    r = _complete(service_client, **body)
    assert r.status_code == 400, r.text
    err = error_of(r)
    assert err["type"] == "invalid_request_error" and err["message"] and err["param"].startswith(param)


def test_nan_temperature_unknown_model_and_wrong_task(service_client: TestClient) -> None:
    raw = b'{"model": "text_multimax", "prompt": "a", "temperature": NaN}'
    r = service_client.post("/v1/completions", content=raw, headers={"content-type": "application/json"})
    assert r.status_code == 400
    r = service_client.post("/v1/completions", json={"model": "gpt-9", "prompt": "a"})
    assert r.status_code == 404 and error_of(r)["code"] == "model_not_found"
    r = service_client.post("/v1/completions", json={"model": "digits_multimax", "prompt": "a"})
    assert r.status_code == 400 and error_of(r)["code"] == "wrong_task"
    r = service_client.post("/v1/completions", content=b"{", headers={"content-type": "application/json"})
    assert r.status_code == 400
