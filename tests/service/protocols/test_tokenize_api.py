"""/tokenize and /detokenize (vLLM's field names) in-process on the demo models: a prompt's ids are those
/v1/completions counts, a conversation's those /v1/chat/completions counts, /detokenize gives the text back;
out-of-vocabulary ids, an unknown model, a vision model and unimplemented fields are errors naming the field."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from fastapi.testclient import TestClient

from service.base.config import Settings
from service.edge.app import create_app
from service.engine.engine_errors import QueueFull

LLM, BYTES, VISION = "llama_seglu", "text_multimax", "digits_multimax"
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello there"}]


@pytest.fixture(scope="module")
def client() -> Iterator[TestClient]:
    with TestClient(create_app(Settings(models=(LLM, BYTES, VISION), warmup_calls=0, intra_op_threads=1)),
                    raise_server_exceptions=False) as c:
        yield c


def _tokenizer(client: TestClient, model: str) -> Any:
    return client.app.state.runtimes.models[model].tokenizer  # type: ignore[attr-defined]


def _error(r: Any, status: int = 400) -> dict[str, Any]:
    assert r.status_code == status, r.text
    return dict(r.json()["error"])


@pytest.mark.parametrize("model", [LLM, BYTES])
def test_a_prompts_ids_are_what_completions_feed_the_model(client: TestClient, model: str) -> None:
    prompt = "Return the value of x"
    r = client.post("/tokenize", json={"model": model, "prompt": prompt})
    assert r.status_code == 200, r.text
    body = r.json()
    tok = _tokenizer(client, model)
    assert set(body) == {"count", "max_model_len", "tokens", "token_strs"} and body["token_strs"] is None
    assert body["tokens"] == tok.encode(prompt) and body["count"] == len(body["tokens"])
    assert body["max_model_len"] == client.get(f"/v1/models/{model}").json()["context_length"]
    usage = client.post("/v1/completions", json={"model": model, "prompt": prompt, "max_tokens": 1}).json()["usage"]
    assert usage["prompt_tokens"] == body["count"]
    strs = client.post("/tokenize", json={"model": model, "prompt": prompt, "return_token_strs": True}).json()
    assert "".join(strs["token_strs"]) == prompt and len(strs["token_strs"]) == body["count"]
    plain = client.post("/tokenize", json={"model": model, "prompt": prompt, "add_special_tokens": False}).json()
    assert plain["tokens"] == tok.encode(prompt, bos=False)
    back = client.post("/detokenize", json={"model": model, "tokens": body["tokens"]})
    assert back.status_code == 200 and back.json() == {"prompt": prompt}


def test_a_conversations_ids_are_what_chat_feeds_the_model(client: TestClient) -> None:
    r = client.post("/tokenize", json={"model": LLM, "messages": MESSAGES})
    assert r.status_code == 200, r.text
    body = r.json()
    usage = client.post("/v1/chat/completions", json={"model": LLM, "messages": MESSAGES, "max_tokens": 1}).json()
    assert body["count"] == usage["usage"]["prompt_tokens"] == len(body["tokens"])
    text = client.post("/detokenize", json={"model": LLM, "tokens": body["tokens"]}).json()["prompt"]
    # the rendered template, special tokens included
    assert text == ("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHello there<|im_end|>\n"
                    "<|im_start|>assistant\n")
    bare = client.post("/tokenize", json={"model": LLM, "messages": MESSAGES, "add_generation_prompt": False}).json()
    assert client.post("/detokenize", json={"model": LLM, "tokens": bare["tokens"]}).json()["prompt"] == \
        text.removesuffix("<|im_start|>assistant\n")
    parts = [{"role": "user", "content": [{"type": "text", "text": "Hello"}, {"type": "text", "text": "there"}]}]
    joined = client.post("/tokenize", json={"model": LLM, "messages": parts}).json()["tokens"]
    assert joined == client.post("/tokenize", json={"model": LLM, "messages": [
        {"role": "user", "content": "Hello\nthere"}]}).json()["tokens"]  # text parts as chat joins them


def test_a_conversation_with_tools_counts_as_chat_does(client: Any) -> None:
    tool = {"type": "function", "function": {"name": "add", "parameters": {
        "type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}}}
    history = [{"role": "user", "content": "Add 2"},
               {"role": "assistant", "content": None, "tool_calls": [
                   {"id": "call_1", "type": "function", "function": {"name": "add", "arguments": '{"a": 2}'}}]},
               {"role": "tool", "tool_call_id": "call_1", "content": "2"}]
    body = client.post("/tokenize", json={"model": LLM, "messages": history, "tools": [tool]}).json()
    chat = client.post("/v1/chat/completions", json={"model": LLM, "messages": history, "tools": [tool],
                                                     "max_tokens": 1}).json()
    assert body["count"] == chat["usage"]["prompt_tokens"]
    bare = client.post("/tokenize", json={"model": LLM, "messages": history}).json()
    assert bare["count"] < body["count"]  # the tools are written into the prompt


def test_the_model_may_be_left_out_when_one_text_model_is_served() -> None:
    with TestClient(create_app(Settings(models=(LLM, VISION), warmup_calls=0, intra_op_threads=1))) as one:
        r = one.post("/tokenize", json={"prompt": "Hello"})
        assert r.status_code == 200 and r.json()["tokens"] == _tokenizer(one, LLM).encode("Hello")
        assert one.post("/detokenize", json={"tokens": r.json()["tokens"]}).json() == {"prompt": "Hello"}


@pytest.mark.parametrize(("path", "body", "status", "param", "code"), [
    ("/detokenize", {"model": LLM, "tokens": [1, 4096]}, 400, "tokens", "invalid_value"),
    ("/detokenize", {"model": LLM, "tokens": [-1]}, 400, "tokens", "invalid_value"),
    ("/detokenize", {"model": LLM, "tokens": ["1"]}, 400, "tokens.0", "invalid_value"),
    ("/detokenize", {"model": LLM}, 400, "tokens", "invalid_value"),
    ("/tokenize", {"model": LLM}, 400, "prompt", "invalid_value"),
    ("/tokenize", {"model": LLM, "prompt": 5}, 400, "prompt", "invalid_value"),
    ("/tokenize", {"model": LLM, "messages": []}, 400, "messages", "invalid_value"),
    ("/tokenize", {"model": LLM, "messages": [{"role": "robot", "content": "x"}]}, 400, "messages.0.role",
     "invalid_value"),
    ("/tokenize", {"model": BYTES, "messages": MESSAGES}, 400, "model", "no_chat_template"),
    ("/tokenize", {"model": VISION, "prompt": "x"}, 400, "model", "wrong_task"),
    ("/detokenize", {"model": VISION, "tokens": [1]}, 400, "model", "wrong_task"),
    ("/tokenize", {"model": "nope", "prompt": "x"}, 404, "model", "model_not_found"),
    ("/detokenize", {"model": "nope", "tokens": [1]}, 404, "model", "model_not_found"),
    ("/tokenize", {"prompt": "x"}, 400, "model", "invalid_value"),  # two text models: which?
    ("/tokenize", {"model": LLM, "messages": MESSAGES, "chat_template": "{{ x }}"}, 400, "chat_template",
     "unsupported_parameter"),
    ("/tokenize", {"model": LLM, "messages": MESSAGES, "continue_final_message": True}, 400,
     "continue_final_message", "unsupported_parameter"),
    ("/tokenize", {"model": LLM, "messages": MESSAGES, "tools": [{"type": "web_search"}]}, 400, "tools.0.type",
     "unsupported_parameter"),
    ("/tokenize", {"model": LLM, "prompt": "x", "frobnicate": 1}, 400, "frobnicate", "unknown_parameter"),
])
def test_bad_requests_name_the_field(client: TestClient, path: str, body: dict[str, Any], status: int, param: str,
                                     code: str) -> None:
    error = _error(client.post(path, json=body), status)
    assert (error["param"], error["code"]) == (param, code), error


def test_no_scheduler_room_is_needed(client: TestClient) -> None:
    """Tokenizing runs no model: it is answered even when no text model could take a sequence."""
    runtimes = client.app.state.runtimes  # type: ignore[attr-defined]
    schedulers = [rt.scheduler for rt in runtimes.models.values() if hasattr(rt, "scheduler")]
    saved = [s.check_room for s in schedulers]

    def full() -> None:
        raise QueueFull("full", 1)

    try:
        for s in schedulers:
            s.check_room = full
        assert client.post("/v1/completions", json={"model": LLM, "prompt": "x", "max_tokens": 1}).status_code == 429
        assert client.post("/tokenize", json={"model": LLM, "prompt": "x"}).status_code == 200
    finally:
        for s, check in zip(schedulers, saved, strict=True):
            s.check_room = check
