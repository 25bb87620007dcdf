"""Hugging Face model folders served by `python -m service --model-dir REPO`, used through the official `openai`
client over a real socket: /v1/models describes them, /v1/chat/completions renders the folder's chat template and
generates what the model itself generates, and /v1/completions speaks the folder's own tokenizer.

The folders are made here (tests/models/hf_folder/reference.py's builders: a random Qwen3 config with SegLU tensors
and a byte-level BPE tokenizer trained with `tokenizers`, with a chat template). Scripted and faulty runs use the
app in this process behind uvicorn (still a real socket): a wrapper over the model forces the tokens it generates
(multi-byte text, one event per step) or gives one sequence NaN logits (a failure stays in its stream).
"""

from __future__ import annotations

import http.client
import json
import shutil
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

transformers = pytest.importorskip("transformers")
openai = pytest.importorskip("openai")

from benchmarks.server import in_thread, running  # noqa: E402
from models.demo import DEMO_DIR  # noqa: E402
from models.generate import generate  # noqa: E402
from models.hf_folder import load_folder  # noqa: E402
from service.base.config import Settings  # noqa: E402
from service.edge.app import create_app  # noqa: E402
from tests.service.support import Steered  # noqa: E402

CHAT = "qwen3-chat"
STRICT = "strict-chat"  # its template refuses roles that do not alternate (raise_exception)
PLAIN = "text_multimax"  # the byte-level demo: no chat template
ALTERNATING = ("{{ bos_token }}{% for m in messages %}{% if (m['role'] == 'user') != (loop.index0 % 2 == 0) %}"
               "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}"
               "{% endif %}[{{ m['role'] }}] {{ m['content'] }}{{ eos_token }}{% endfor %}"
               "{% if add_generation_prompt %}[assistant] {% endif %}")
MESSAGES = [{"role": "system", "content": "You are brief."},
            {"role": "user", "content": [{"type": "text", "text": "What is"}, {"type": "text", "text": "MultiMax?"}]}]


@pytest.fixture(scope="module")
def repo(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from tests.models.hf_folder.reference import arch_configs, make_folder, train_tokenizer

    root = tmp_path_factory.mktemp("chat")
    train_tokenizer(root / "tokenizer")
    out = root / "repo"
    out.mkdir()
    config, how = arch_configs()["qwen3"]
    make_folder(out / CHAT, root / "tokenizer", config, **how)
    strict = shutil.copytree(out / CHAT, out / STRICT)
    (strict / "chat_template.jinja").unlink(missing_ok=True)  # the template in tokenizer_config.json instead
    cfg = json.loads((strict / "tokenizer_config.json").read_text())
    (strict / "tokenizer_config.json").write_text(json.dumps(cfg | {"chat_template": ALTERNATING}))
    shutil.copy(DEMO_DIR / f"{PLAIN}.pt", out / f"{PLAIN}.pt")
    broken = out / "broken-folder"  # a folder without its weights: listed with the reason, the others served
    broken.mkdir()
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        shutil.copy(out / CHAT / name, broken / name)
    return out


@pytest.fixture(scope="module")
def url(repo: Path) -> Iterator[str]:
    # the folders themselves on PyTorch (their parameters in the card, the steered model below), not their exports
    with running("--model-dir", str(repo), "--backend", "torch", "--intra-op-threads", "1",
                 "--max-running-sequences", "8") as base:
        yield base


@pytest.fixture(scope="module")
def client(url: str) -> Any:
    return openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def reference(repo: Path) -> tuple[Any, Any, Any]:
    model, info = load_folder(repo / CHAT)
    theirs = transformers.AutoTokenizer.from_pretrained(repo / CHAT)
    return model, info, theirs


def _flat(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [m | {"content": m["content"] if isinstance(m["content"], str) else
                 "\n".join(p["text"] for p in m["content"])} for m in messages]


# ---- /v1/models -------------------------------------------------------------------------------------------------


def test_models_describe_the_folder(url: str, client: Any, repo: Path) -> None:
    cards = {m.id: m.model_dump() for m in client.models.list()}
    assert set(cards) == {CHAT, STRICT, PLAIN}
    card = cards[CHAT]
    assert card["architecture"] == "Qwen3ForCausalLM" and card["format"] == "huggingface-folder"
    assert card["context_length"] == 256 and card["backend"] == "torch"
    assert card["multimax"]["output"] is True and card["multimax"]["attention_layers"] == [1]
    assert len(card["multimax"]["parameters"]["lm_head"]["ranges"]) == 4
    assert card["tokenizer"] == {"type": "hf-tokenizers", "vocab_size": 300, "bos": "<s>", "eos": "</s>",
                                 "eos_ids": [1], "chat_template": True, "byte_level": True}
    assert cards[PLAIN]["tokenizer"]["type"] == "byte"
    conn = http.client.HTTPConnection(url.removeprefix("http://"))
    for path in ("/v1/models", f"/v2/models/{CHAT}"):
        conn.request("GET", path)
        text = conn.getresponse().read().decode()
        assert str(repo) not in text and "/tmp" not in text  # no absolute paths on open routes
    assert json.loads(text)["model_info"]["architecture"] == "Qwen3ForCausalLM"
    conn.request("POST", "/v2/repository/index", "{}", {"Content-Type": "application/json"})
    index = {m["name"]: m for m in json.loads(conn.getresponse().read())}
    assert index["broken-folder"]["state"] == "UNAVAILABLE" and "safetensors" in index["broken-folder"]["reason"]
    assert str(repo) not in index["broken-folder"]["reason"]


# ---- /v1/chat/completions ---------------------------------------------------------------------------------------


def test_greedy_chat_is_the_models_own_text(client: Any, reference: tuple[Any, Any, Any]) -> None:
    model, info, theirs = reference
    ids = theirs.apply_chat_template(_flat(MESSAGES), add_generation_prompt=True, tokenize=True)
    ids = list(ids["input_ids"] if hasattr(ids, "keys") else ids)
    want = generate(model, ids, 12, temperature=0.0, eos_id=info.tokenizer.eos_ids, tokenizer=info.tokenizer)[0]
    r = client.chat.completions.create(model=CHAT, messages=MESSAGES, max_tokens=12, temperature=0)
    choice = r.choices[0]
    assert r.object == "chat.completion" and choice.message.role == "assistant"
    assert choice.message.content == info.tokenizer.decode(want)
    assert r.usage.prompt_tokens == len(ids) and r.usage.completion_tokens == len(want) + (len(want) < 12)
    assert choice.finish_reason == ("length" if len(want) == 12 else "stop")


def test_stream_sends_role_then_content_then_finish_then_usage(client: Any) -> None:
    whole = client.chat.completions.create(model=CHAT, messages=MESSAGES, max_completion_tokens=20, seed=11,
                                           extra_body={"ignore_eos": True})
    chunks = list(client.chat.completions.create(model=CHAT, messages=MESSAGES, max_completion_tokens=20, seed=11,
                                                 stream=True, stream_options={"include_usage": True},
                                                 extra_body={"ignore_eos": True}))
    assert chunks[0].choices[0].delta.role == "assistant" and not chunks[0].choices[0].delta.content
    body = [c for c in chunks if c.choices]
    assert all(c.choices[0].delta.role is None for c in body[1:])
    assert body[-1].choices[0].finish_reason == "length" and not body[-1].choices[0].delta.content
    assert all(c.choices[0].finish_reason is None for c in body[:-1])
    assert "".join(c.choices[0].delta.content or "" for c in body) == whole.choices[0].message.content
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 20
    assert chunks[-1].usage.prompt_tokens == whole.usage.prompt_tokens
    assert all(c.object == "chat.completion.chunk" and c.id == chunks[0].id for c in chunks)


def test_n_and_seeds(client: Any) -> None:
    def run() -> list[str]:
        r = client.chat.completions.create(model=CHAT, messages=MESSAGES, max_tokens=10, n=3, seed=7,
                                           extra_body={"ignore_eos": True})
        assert [c.index for c in r.choices] == [0, 1, 2] and r.usage.completion_tokens == 30
        return [c.message.content for c in r.choices]

    first = run()
    assert run() == first  # a seed reproduces every choice
    assert len(set(first)) > 1  # and the choices differ from each other
    unseeded = client.chat.completions.create(model=CHAT, messages=MESSAGES, max_tokens=10, n=2,
                                              extra_body={"ignore_eos": True})
    assert len(unseeded.choices) == 2


def test_logprobs_and_top_logprobs(client: Any) -> None:
    r = client.chat.completions.create(model=CHAT, messages=MESSAGES, max_tokens=8, logprobs=True, top_logprobs=3,
                                       temperature=0, extra_body={"ignore_eos": True})
    content = r.choices[0].logprobs.content
    assert len(content) == 8
    for entry in content:
        assert entry.logprob <= 0 and len(entry.top_logprobs) == 3
        best = entry.top_logprobs[0]
        assert best.logprob >= entry.top_logprobs[1].logprob >= entry.top_logprobs[2].logprob
        assert best.token == entry.token and best.logprob == pytest.approx(entry.logprob)  # greedy: the best one
    text = bytes(b for e in content for b in e.bytes).decode("utf-8", errors="replace")
    assert text == r.choices[0].message.content
    streamed = client.chat.completions.create(model=CHAT, messages=MESSAGES, max_tokens=8, logprobs=True,
                                              top_logprobs=1, temperature=0, stream=True,
                                              extra_body={"ignore_eos": True})
    entries = [e for c in streamed if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content]
    assert [e.token for e in entries] == [e.token for e in content]


def test_min_tokens_and_max_tokens(client: Any) -> None:
    r = client.chat.completions.create(model=CHAT, messages=MESSAGES, max_tokens=50, max_completion_tokens=6,
                                       extra_body={"min_tokens": 6})
    assert r.usage.completion_tokens == 6 and r.choices[0].finish_reason == "length"


TOO_LONG = [{"role": "user", "content": "MultiMax " * 200}]


@pytest.mark.parametrize("body, param, needle", [
    ({"messages": [{"role": "robot", "content": "x"}]}, "messages.0.role", "'system', 'user', 'assistant' or 'tool'"),
    ({"messages": [{"role": "tool", "content": "x"}]}, "messages.0.tool_call_id", "needs the id"),
    ({"messages": [{"role": "user", "content": 3}]}, "messages.0.content", "valid string"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
     "messages.0.content", "text"),
    ({"messages": []}, "messages", "at least 1"),
    ({"messages": MESSAGES, "temprature": 0.5}, "temprature", "unknown field"),
    ({"messages": MESSAGES, "temperature": "0.5"}, "temperature", "valid number"),
    ({"messages": MESSAGES, "tools": [{"type": "code_interpreter"}]}, "tools.0.type", "only function tools"),
    ({"messages": MESSAGES, "tool_choice": "auto"}, "tool_choice", "needs tools"),
    ({"messages": MESSAGES, "functions": [{"name": "f"}]}, "functions", "use tools"),
    ({"messages": MESSAGES, "response_format": {"type": "json_schema"}}, "response_format.json_schema", "schema"),
    ({"messages": MESSAGES, "guided_regex": "[0-9"}, "guided_regex", "regex"),
    ({"messages": MESSAGES, "guided_choice": ["a"], "guided_regex": "a"}, "guided_regex", "combined"),
    ({"messages": MESSAGES, "guided_choice": ["a"], "ignore_eos": True}, "ignore_eos", "combined"),
    ({"messages": MESSAGES, "repetition_penalty": 0}, "repetition_penalty", "greater than 0"),
    ({"messages": MESSAGES, "logit_bias": {"99999": 5}}, "logit_bias", "not a token id"),
    ({"messages": MESSAGES, "reasoning_effort": "high"}, "reasoning_effort", "not supported"),
    ({"messages": MESSAGES, "modalities": ["text", "audio"]}, "modalities", "not supported"),
    ({"messages": MESSAGES, "presence_penalty": 3}, "presence_penalty", "less than or equal to 2"),
    ({"messages": MESSAGES, "min_p": 0.1}, "min_p", "not supported"),
    ({"messages": MESSAGES, "top_logprobs": 2}, "top_logprobs", "needs logprobs"),
    ({"messages": TOO_LONG}, "messages", "maximum context length is 256 tokens, and the prompt alone has"),
    ({"messages": MESSAGES, "max_tokens": 1000}, "max_tokens", "maximum context length is 256 tokens"),
    ({"model": STRICT, "messages": [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]},
     "messages", "Conversation roles must alternate"),
    ({"model": PLAIN, "messages": MESSAGES}, "model", "no chat template"),
])
def test_bad_requests_are_400_in_openais_shape(client: Any, body: dict[str, Any], param: str, needle: str) -> None:
    args = {"model": CHAT} | body
    known = {"model", "messages", "temperature", "tools", "response_format", "top_logprobs", "max_tokens"}
    extra = {k: v for k, v in args.items() if k not in known}
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(**{k: v for k, v in args.items() if k in known}, extra_body=extra or None)
    error = caught.value.body
    assert caught.value.status_code == 400 and needle in error["message"], error
    assert error["param"].startswith(param) and error["type"] == "invalid_request_error"
    if "prompt alone" in needle:  # both lengths named
        assert int(error["message"].rsplit(" ", 1)[1]) > 256


def test_bad_field_codes_match_completions(url: str) -> None:
    """The field audit is /v1/completions': unimplemented fields are unsupported_parameter, typos unknown_parameter,
    and fields that change nothing (or ask for the default) pass."""
    def post(body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
        host, port = url.removeprefix("http://").split(":")
        conn = http.client.HTTPConnection(host, int(port), timeout=60)
        conn.request("POST", "/v1/chat/completions", json.dumps({"model": CHAT, "messages": MESSAGES,
                                                                 "max_tokens": 2} | body),
                     {"Content-Type": "application/json"})
        r = conn.getresponse()
        return r.status, json.loads(r.read())

    for body, code in (({"functions": [{"name": "f"}]}, "unsupported_parameter"),
                       ({"min_p": 0.1}, "unsupported_parameter"), ({"frobnicate": 1}, "unknown_parameter")):
        status, error = post(body)
        assert status == 400 and error["error"]["code"] == code, error
    for body in ({"user": "u", "metadata": {"k": "v"}, "request_id": "r", "priority": 0},
                 {"tool_choice": "none", "tools": []}, {"modalities": ["text"], "response_format": {"type": "text"}},
                 {"min_p": None, "guided_decoding_backend": "xgrammar"}):
        status, answer = post(body)
        assert status == 200 and answer["choices"][0]["finish_reason"] in ("length", "stop"), (body, answer)


SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}, "tag": {"enum": ["red", "green", "blue"]},
                                           "n": {"type": "integer", "minimum": 0, "maximum": 99}},
          "required": ["ok", "tag", "n"], "additionalProperties": False}


@pytest.mark.parametrize("seed", [1, 2])
def test_json_schema_chat_is_schema_valid(client: Any, seed: int) -> None:
    jsonschema = pytest.importorskip("jsonschema")
    fmt = {"type": "json_schema", "json_schema": {"name": "answer", "schema": SCHEMA}}
    r = client.chat.completions.create(model=CHAT, messages=MESSAGES, max_tokens=80, seed=seed, n=2,
                                       response_format=fmt, extra_body={"guided_whitespace_pattern": ""})
    for choice in r.choices:
        assert choice.finish_reason == "stop", choice
        jsonschema.validate(json.loads(choice.message.content), SCHEMA)
    # The same stream: role, content deltas that join to schema-valid JSON, finish_reason stop.
    stream = client.chat.completions.create(model=CHAT, messages=MESSAGES, max_tokens=80, seed=seed, stream=True,
                                            response_format=fmt, extra_body={"guided_whitespace_pattern": ""})
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert len([c for c in chunks if c.choices and c.choices[0].delta.content]) > 1  # streamed, not one lump
    assert chunks[-1].choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(text), SCHEMA)


def test_penalties_and_logit_bias_change_the_chat(client: Any, repo: Path) -> None:
    """As on /v1/completions: logit_bias +100 on one token makes greedy content that token only; a repetition
    penalty changes a greedy answer that repeats."""
    tok = transformers.AutoTokenizer.from_pretrained(str(repo / CHAT))
    token = tok.convert_tokens_to_ids(tok.tokenize("a")[0])
    r = client.chat.completions.create(model=CHAT, messages=MESSAGES, max_tokens=6, temperature=0,
                                       logit_bias={str(token): 100}, extra_body={"ignore_eos": True})
    assert r.choices[0].message.content == "a" * 6
    plain = client.chat.completions.create(model=CHAT, messages=MESSAGES, max_tokens=24, temperature=0)
    penalised = client.chat.completions.create(model=CHAT, messages=MESSAGES, max_tokens=24, temperature=0,
                                               frequency_penalty=2.0, extra_body={"repetition_penalty": 2.0})
    assert penalised.choices[0].message.content != plain.choices[0].message.content


def test_json_object_and_guided_choice_chat(client: Any) -> None:
    r = client.chat.completions.create(model=CHAT, messages=MESSAGES, max_tokens=60, seed=3,
                                       response_format={"type": "json_object"},
                                       extra_body={"guided_whitespace_pattern": ""})
    choice = r.choices[0]
    if choice.finish_reason == "stop":  # a random model may write a long object; cut by length is not JSON
        assert isinstance(json.loads(choice.message.content), dict)
    else:
        assert choice.message.content.startswith("{")
    r = client.chat.completions.create(model=CHAT, messages=MESSAGES, max_tokens=10, seed=4, n=3,
                                       extra_body={"guided_choice": ["yes", "no", "maybe"]})
    assert all(c.message.content in ("yes", "no", "maybe") and c.finish_reason == "stop" for c in r.choices)


def test_a_template_that_accepts_the_conversation_answers(client: Any) -> None:
    r = client.chat.completions.create(model=STRICT, messages=[{"role": "user", "content": "a"}], max_tokens=3)
    assert r.choices[0].finish_reason in ("length", "stop")


# ---- /v1/completions with the folder's tokenizer -----------------------------------------------------------------


def test_completions_use_the_folders_tokenizer(client: Any, reference: tuple[Any, Any, Any]) -> None:
    _, info, theirs = reference
    prompt = "MultiMax reweights wörds ✓"
    ids = theirs(prompt)["input_ids"]
    assert ids[0] == info.tokenizer.bos_id  # the tokenizer's own template adds <s>
    r = client.completions.create(model=CHAT, prompt=prompt, max_tokens=0, echo=True, logprobs=2)
    assert r.usage.prompt_tokens == len(ids)
    lp = r.choices[0].logprobs
    assert r.choices[0].text == theirs.decode(ids, skip_special_tokens=True) == prompt
    assert len(lp.tokens) == len(ids) and lp.token_logprobs[0] is None
    assert "".join(lp.tokens[1:]).startswith("MultiMax")  # token strings, the special <s> first
    by_ids = client.completions.create(model=CHAT, prompt=ids, max_tokens=6, temperature=0)
    by_text = client.completions.create(model=CHAT, prompt=prompt, max_tokens=6, temperature=0)
    assert by_ids.choices[0].text == by_text.choices[0].text and by_ids.usage.prompt_tokens == len(ids)


# ---- scripted and faulty models in this process (uvicorn on a real socket) ------------------------------------


@pytest.fixture(scope="module")
def steered(repo: Path) -> Iterator[tuple[str, Steered, Any]]:
    app = create_app(Settings(model_dir=repo, models=(CHAT,), backend="torch", intra_op_threads=1, warmup_calls=0))
    rt = app.state.runtimes.models[CHAT]
    wrapper = Steered(rt.scheduler.backend)
    rt.scheduler.backend = wrapper
    with in_thread(app) as url:
        yield url, wrapper, rt.tokenizer


def _sse_events(base: str, body: dict[str, Any]) -> list[dict[str, Any]]:
    conn = http.client.HTTPConnection(base.removeprefix("http://"), timeout=60)
    conn.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
    response = conn.getresponse()
    assert response.status == 200
    raw = response.read().decode()
    return [json.loads(e[len("data: "):]) for e in raw.split("\n\n") if e.startswith("data: {")]


PROMPT = [0, 40, 41, 42]  # token ids: <s> and three more, so the script's positions are known


def test_stream_sends_one_event_per_step(steered: tuple[str, Steered, Any]) -> None:
    base, wrapper, tok = steered
    target = tok.encode(" the dog sleeps in the warm afternoon sun and the fox jumps over it again", bos=False)
    assert all(tok.decode([t]).isascii() for t in target)
    wrapper.script = {len(PROMPT) - 1 + k: t for k, t in enumerate(target)}
    try:
        events = _sse_events(base, {"model": CHAT, "prompt": PROMPT, "max_tokens": len(target), "temperature": 0,
                                    "stream": True, "ignore_eos": True})
    finally:
        wrapper.script = {}
    texts = [e["choices"][0]["text"] for e in events]
    assert len(events) == len(target)  # one event per decode step, none bunched
    assert texts == [tok.decode(target[:k + 1])[len(tok.decode(target[:k])):] for k in range(len(target))]


def test_multibyte_text_streams_whole_characters_as_soon_as_complete(steered: tuple[str, Steered, Any]) -> None:
    base, wrapper, tok = steered
    text = " wörld ✓ 日本語 😀 Straße"
    target = tok.encode(text, bos=False)
    assert len(target) > len(text.encode()) // 2  # byte-level pieces: characters split over tokens
    wrapper.script = {len(PROMPT) - 1 + k: t for k, t in enumerate(target)}
    try:
        events = _sse_events(base, {"model": CHAT, "prompt": PROMPT, "max_tokens": len(target), "temperature": 0,
                                    "stream": True, "ignore_eos": True, "logprobs": 0})
    finally:
        wrapper.script = {}
    texts = [e["choices"][0]["text"] for e in events]
    assert "".join(texts) == text and all("\ufffd" not in t for t in texts)
    # one event for each step that completes text (plus the finish), exactly that step's complete characters
    complete = [tok.decode_bytes(target[:k]).decode("utf-8", errors="ignore") for k in range(len(target) + 1)]
    growing = [complete[k + 1][len(complete[k]):] for k in range(len(target)) if complete[k + 1] != complete[k]]
    assert [t for t in texts if t] == growing
    tokens = [t for e in events for t in e["choices"][0]["logprobs"]["tokens"]]
    assert len(tokens) == len(target)  # each token's logprob goes out with the event that completes its text


def test_stop_strings_end_the_message(steered: tuple[str, Steered, Any]) -> None:
    base, wrapper, tok = steered
    client = openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0)
    start = client.chat.completions.create(model=CHAT, messages=MESSAGES, max_tokens=1).usage.prompt_tokens
    text = " the dog sleeps in the warm afternoon sun"
    wrapper.script = {start - 1 + k: t for k, t in enumerate(tok.encode(text, bos=False))}
    try:
        plain = client.chat.completions.create(model=CHAT, messages=MESSAGES, max_tokens=20, temperature=0,
                                               extra_body={"ignore_eos": True})
        r = client.chat.completions.create(model=CHAT, messages=MESSAGES, max_tokens=20, temperature=0,
                                           stop=["zzz", "warm"], extra_body={"ignore_eos": True})
        streamed = list(client.chat.completions.create(model=CHAT, messages=MESSAGES, max_tokens=20, temperature=0,
                                                       stop="warm", stream=True, extra_body={"ignore_eos": True}))
    finally:
        wrapper.script = {}
    assert plain.choices[0].message.content.startswith(" the dog sleeps in the warm")
    # the text ends exactly before the stop string (a token " w" holding its start keeps its space), as vLLM's
    assert r.choices[0].message.content == " the dog sleeps in the " and r.choices[0].finish_reason == "stop"
    texts = [c.choices[0].delta.content or "" for c in streamed if c.choices]
    assert "".join(texts) == " the dog sleeps in the " and streamed[-1].choices[0].finish_reason == "stop"


def test_a_failure_in_one_chat_stream_stays_in_it(steered: tuple[str, Steered, Any]) -> None:
    base, wrapper, _ = steered
    client = openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0)
    short = [{"role": "user", "content": "Hello"}]
    poisoned = [{"role": "user", "content": "MultiMax reweights the attention scores " * 4}]
    alone = [client.chat.completions.create(model=CHAT, messages=short, max_tokens=10, seed=s,
                                            extra_body={"ignore_eos": True}).choices[0].message.content
             for s in (1, 2)]
    long_len = client.chat.completions.create(model=CHAT, messages=poisoned, max_tokens=1).usage.prompt_tokens
    short_len = client.chat.completions.create(model=CHAT, messages=short, max_tokens=1).usage.prompt_tokens
    assert long_len > short_len + 12  # the poisoned position is beyond what the short streams reach
    wrapper.nan_at = {long_len + 1}  # the long stream's third token
    results: dict[str, Any] = {}
    start = threading.Barrier(3)

    def stream(key: str, messages: list[dict[str, str]], seed: int, max_tokens: int) -> None:
        start.wait()
        parts: list[str] = []
        try:
            for c in client.chat.completions.create(model=CHAT, messages=messages, max_tokens=max_tokens, seed=seed,
                                                    stream=True, extra_body={"ignore_eos": True}):
                parts.extend(ch.delta.content or "" for ch in c.choices)
            results[key] = "".join(parts)
        except openai.APIError as exc:
            results[key] = exc

    threads = [threading.Thread(target=stream, args=args) for args in
               (("bad", poisoned, 3, 30), ("one", short, 1, 10), ("two", short, 2, 10))]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
    finally:
        wrapper.nan_at = set()
    assert isinstance(results["bad"], openai.APIError) and "non-finite" in str(results["bad"])
    assert [results["one"], results["two"]] == alone  # the other streams went on, as if alone
    after = client.chat.completions.create(model=CHAT, messages=short, max_tokens=10, seed=1,
                                           extra_body={"ignore_eos": True})
    assert after.choices[0].message.content == alone[0]  # and the model serves on
