"""The real pretrained SmolLM2-135M-Instruct (tests/pretrained.py) served by `python -m service` over a real socket
and used through the official `openai` client: the plain folder, the folder with SegLU on its head, and the SegLU
folder's `python -m export DIR -o OUT --int4` onnxruntime-genai folder, all from one server.

The folders are served as a user's server serves them (`--folder-export auto`): on PyTorch at once, their export
made in the background and switched in when it passes validation. Which backend answers is read from the card
(`backend`, `serving`), and every check here holds on either: greedy chat text equals transformers' (the SegLU
applied from MULTIMAX.md's formula, tests/models/hf_folder/reference.py), a stream equals its non-streamed reply,
`/tokenize` gives transformers' ids, a `json_schema` reply validates against its schema and a forced tool call's
arguments against the tool's parameters (SmolLM2's template has no tools section: the server writes the tool
definitions into the system message, service.protocols.tools' fallback). A bad request (a prompt over the 8k
context, an unknown forced tool) is a 400 while a request beside it still answers what it answers alone.
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

transformers = pytest.importorskip("transformers")
openai = pytest.importorskip("openai")
jsonschema = pytest.importorskip("jsonschema")
httpx = pytest.importorskip("httpx")

from benchmarks.server import running  # noqa: E402
from tests.models.hf_folder.reference import Reference, SegLUProcessor  # noqa: E402
from tests.paths import ROOT  # noqa: E402
from tests.pretrained import seglu_tensors  # noqa: E402

pytestmark = pytest.mark.slow  # two 135M folders loaded, an int4 export made: minutes before the first test
# the module's setup (the int4 export, the server's start) is counted against its first test, as the export wait is
# against the last: 140-300 s and 318 s on two cores under a load of 10-12, where the suite's 600 s may not do
SETUP_TIMEOUT_S = 1800

PLAIN, SEGLU, INT4 = "smollm2", "smollm2-seglu", "smollm2-seglu-int4"
TOKENS = 32
ASK = [{"role": "user", "content": "What is the capital of France?"}]
CHATS = {PLAIN: ASK, SEGLU: [{"role": "system", "content": "You are a concise assistant."},
                             {"role": "user", "content": "Name three colours."}]}
SCHEMA = {"type": "object", "additionalProperties": False, "required": ["city", "country", "is_capital"],
          "properties": {"city": {"type": "string", "maxLength": 24}, "country": {"type": "string", "maxLength": 24},
                         "is_capital": {"type": "boolean"}}}
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The current weather in a city",
    "parameters": {"type": "object", "additionalProperties": False, "required": ["city", "unit"],
                   "properties": {"city": {"type": "string", "maxLength": 32},
                                  "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}}}}}


@pytest.fixture(scope="module")
def int4_folder(smollm2_seglu: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The SegLU folder exported as a user exports it for int4. --no-validate: its validation is the export's own
    tests' business (tests/export/); here the folder is only served."""
    out = tmp_path_factory.mktemp("int4") / INT4
    done = subprocess.run([sys.executable, "-m", "export", str(smollm2_seglu), "-o", str(out), "--int4",
                           "--no-validate", "--quiet"], cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    return out


@pytest.fixture(scope="module")
def repo(smollm2: Path, smollm2_seglu: Path, int4_folder: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("pretrained-repo")
    for name, folder in ((PLAIN, smollm2), (SEGLU, smollm2_seglu), (INT4, int4_folder)):
        (root / name).symlink_to(folder, target_is_directory=True)
    return root


@pytest.fixture(scope="module")
def url(repo: Path) -> Iterator[str]:
    # --folder-export auto, a user's default (the test session's is wait, tests/conftest.py): served on PyTorch
    # first, the export switched in when it passes validation
    with running("--model-dir", str(repo), "--folder-export", "auto", "--intra-op-threads", "1",
                 "--max-running-sequences", "4",
                 "--warmup-calls", "0", ready_timeout=600) as base:
        yield base


@pytest.fixture(scope="module")
def client(url: str) -> Any:
    return openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=300)


@pytest.fixture(scope="module")
def hf_tokenizer(smollm2: Path) -> Any:
    return transformers.AutoTokenizer.from_pretrained(smollm2)


@pytest.fixture(scope="module")
def expected(smollm2: Path, smollm2_seglu: Path, hf_tokenizer: Any) -> dict[str, str]:
    """transformers' greedy reply to each model's chat (SegLU applied to the SegLU folder's logits), stopping at
    <|im_end|> as the server does."""
    values = seglu_tensors()
    ranges, ts = torch.tensor(values["lm_head.multimax_ranges"]), torch.tensor(values["lm_head.multimax_ts"])
    out = {}
    eos = hf_tokenizer.convert_tokens_to_ids("<|im_end|>")
    for name, folder, head in ((PLAIN, smollm2, (ranges, ts * 0)), (SEGLU, smollm2_seglu, (ranges, ts))):
        ref = Reference(folder, head, {})
        prompt = hf_tokenizer.apply_chat_template(CHATS[name], tokenize=False, add_generation_prompt=True)
        ids = torch.tensor([hf_tokenizer(prompt)["input_ids"]])
        config = transformers.GenerationConfig(max_new_tokens=TOKENS, do_sample=False, eos_token_id=eos,
                                               pad_token_id=eos)
        with torch.no_grad():
            row = ref.model.generate(ids, attention_mask=torch.ones_like(ids), generation_config=config,
                                     logits_processor=transformers.LogitsProcessorList([SegLUProcessor(*head)]))
        new = row[0, ids.shape[1]:].tolist()
        out[name] = hf_tokenizer.decode(new[:new.index(eos)] if eos in new else new, skip_special_tokens=True)
    return out


def _chat(client: Any, model: str, messages: list[dict[str, Any]], **kwargs: Any) -> Any:
    return client.chat.completions.create(model=model, messages=messages, temperature=0, **kwargs)


def _backend(client: Any, model: str) -> str:
    return str(next(m for m in client.models.list() if m.id == model).model_dump()["backend"])


def _post(url: str, path: str, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(url + path, json=body, timeout=300, trust_env=False)


# ---- the cards -------------------------------------------------------------------------------------------------


@pytest.mark.timeout(SETUP_TIMEOUT_S)
def test_cards_say_what_serves_each_folder(client: Any) -> None:
    cards = {m.id: m.model_dump() for m in client.models.list()}
    assert set(cards) == {PLAIN, SEGLU, INT4}
    for name in (PLAIN, SEGLU):
        card = cards[name]
        assert card["architecture"] == "LlamaForCausalLM" and card["context_length"] == 8192
        # PyTorch while the export runs (or after it failed), ONNX Runtime once it is switched in
        assert (card["backend"], card["format"]) in {("torch", "huggingface-folder"),
                                                     ("onnxruntime", "onnxruntime-genai-folder")}, card
        assert card["tokenizer"]["eos_ids"] == [2] and card["tokenizer"]["chat_template"] is True
        serving = card["serving"]  # and why: the export's state
        assert serving["export"] in ("running", "passed", "failed"), serving
        assert (serving["export"] == "passed") is (card["backend"] == "onnxruntime"), card
    head = cards[SEGLU]["multimax"]["parameters"]["lm_head"]
    values = seglu_tensors()
    assert head["ranges"] == pytest.approx(values["lm_head.multimax_ranges"], abs=1e-5)
    assert head["ts"] == pytest.approx(values["lm_head.multimax_ts"], abs=1e-5)
    assert cards[PLAIN]["multimax"]["output"] is False
    int4 = cards[INT4]
    assert (int4["backend"], int4["format"]) == ("onnxruntime", "onnxruntime-genai-folder")
    assert int4["multimax"]["output"] is True  # the SegLU head, read from the exported graph's node


# ---- chat: transformers' text, streamed or not -------------------------------------------------------------------


@pytest.mark.parametrize("model", [PLAIN, SEGLU])
def test_greedy_chat_equals_transformers_streamed_or_not(client: Any, model: str, expected: dict[str, str]) -> None:
    print(f"\n{model}: served by {_backend(client, model)}")
    whole = _chat(client, model, CHATS[model], max_tokens=TOKENS)
    text = whole.choices[0].message.content
    assert text == expected[model] and len(text) > 10
    assert whole.choices[0].finish_reason == "stop"  # SmolLM2 ends these answers itself within 32 tokens
    parts, reasons = [], []
    for chunk in _chat(client, model, CHATS[model], max_tokens=TOKENS, stream=True):
        for choice in chunk.choices:
            parts.append(choice.delta.content or "")
            reasons.append(choice.finish_reason)
    assert "".join(parts) == text and [r for r in reasons if r] == ["stop"]


# ---- /tokenize: transformers' ids ---------------------------------------------------------------------------------


def test_tokenize_gives_transformers_ids(url: str, hf_tokenizer: Any) -> None:
    for model in (PLAIN, SEGLU, INT4):
        for text in ("Hello, world!", "unseen wörds ✓ 日本語 🙂", "<|im_start|>user\nhi<|im_end|>"):
            body = _post(url, "/tokenize", {"model": model, "prompt": text}).json()
            assert body["tokens"] == hf_tokenizer(text)["input_ids"], (model, text)
        chat = _post(url, "/tokenize", {"model": model, "messages": CHATS[SEGLU]}).json()
        want = hf_tokenizer.apply_chat_template(CHATS[SEGLU], tokenize=False, add_generation_prompt=True)
        assert chat["tokens"] == hf_tokenizer(want)["input_ids"] and chat["max_model_len"] == 8192, model


# ---- structured output and tools -------------------------------------------------------------------------------


def test_json_schema_reply_validates(client: Any) -> None:
    reply = _chat(client, SEGLU, [{"role": "user", "content": "Describe Paris as JSON."}], max_tokens=64,
                  response_format={"type": "json_schema",
                                   "json_schema": {"name": "place", "schema": SCHEMA, "strict": True}})
    assert reply.choices[0].finish_reason == "stop", reply.choices[0].message.content
    jsonschema.validate(json.loads(reply.choices[0].message.content), SCHEMA)


def test_forced_tool_call_on_a_template_without_tools(url: str, client: Any) -> None:
    """SmolLM2's template has no tools section: the definitions go into the system message (which replaces the
    template's default one), and the named function's arguments follow its schema."""
    asked = [{"role": "user", "content": "What is the weather in Paris?"}]
    rendered = _post(url, "/tokenize", {"model": SEGLU, "messages": asked, "tools": [WEATHER]}).json()
    prompt = _post(url, "/detokenize", {"model": SEGLU, "tokens": rendered["tokens"]}).json()["prompt"]
    assert prompt.startswith("<|im_start|>system\n") and '"name": "get_weather"' in prompt
    assert "<tool_call>" in prompt  # the call syntax the fallback asks for (Hermes)
    reply = _chat(client, SEGLU, asked, max_tokens=64, tools=[WEATHER],
                  tool_choice={"type": "function", "function": {"name": "get_weather"}})
    (call,) = reply.choices[0].message.tool_calls
    assert call.function.name == "get_weather"
    jsonschema.validate(json.loads(call.function.arguments), WEATHER["function"]["parameters"])


# ---- the int4 folder -------------------------------------------------------------------------------------------


def test_int4_folder_answers(client: Any) -> None:
    """4-bit weights change the logits (not compared with transformers): the model still answers the question."""
    reply = _chat(client, INT4, ASK, max_tokens=TOKENS)
    text = reply.choices[0].message.content
    assert reply.choices[0].finish_reason in ("stop", "length") and reply.usage.completion_tokens > 2
    assert "Paris" in text, text
    streamed = "".join(c.choices[0].delta.content or "" for c in _chat(client, INT4, ASK, max_tokens=TOKENS,
                                                                         stream=True) if c.choices)
    assert streamed == text


# ---- a bad request fails alone -----------------------------------------------------------------------------------


def _beside(client: Any, model: str, bad: dict[str, Any]) -> tuple[openai.BadRequestError, str]:
    """`bad` (a chat request that must be refused) sent while a good greedy chat streams: (its error, the good
    reply's text)."""
    good: dict[str, str] = {}
    started = threading.Event()

    def answer() -> None:
        parts = []
        for chunk in _chat(client, model, CHATS[model], max_tokens=TOKENS, stream=True):
            started.set()
            parts.extend(c.delta.content or "" for c in chunk.choices)
        good["text"] = "".join(parts)

    thread = threading.Thread(target=answer)
    thread.start()
    started.wait(120)
    with pytest.raises(openai.BadRequestError) as caught:
        _chat(client, model, **bad)
    thread.join(300)
    return caught.value, good.get("text", "<no reply>")


def test_a_prompt_over_the_context_is_a_400_and_the_request_beside_it_answers(
        client: Any, expected: dict[str, str]) -> None:
    too_long = [{"role": "user", "content": "hello " * 8300}]  # one token a word: past the 8192 context
    error, text = _beside(client, SEGLU, {"messages": too_long, "max_tokens": 4})
    assert error.status_code == 400 and "maximum context length is 8192 tokens" in error.body["message"], error.body
    assert text == expected[SEGLU]


def test_an_unknown_forced_tool_is_a_400_and_the_request_beside_it_answers(
        client: Any, expected: dict[str, str]) -> None:
    error, text = _beside(client, PLAIN, {"messages": ASK, "max_tokens": 4, "tools": [WEATHER],
                                          "tool_choice": {"type": "function", "function": {"name": "get_time"}}})
    assert error.status_code == 400 and error.body["param"].startswith("tool_choice"), error.body
    assert text == expected[PLAIN]


# ---- the export, once switched in --------------------------------------------------------------------------------

EXPORT_WAIT_S = 480  # both folders' exports (fp32, validated) passed and switched in 8 min after the server started,
# this test's wait 318 s of it, on two cores under a load of 10 (one export alone: 326 s)


@pytest.mark.timeout(SETUP_TIMEOUT_S)
def test_the_export_switched_in_answers_as_transformers(client: Any, url: str, expected: dict[str, str],
                                                        hf_tokenizer: Any) -> None:
    """Last: the SegLU folder's background export, once it passed validation, serves the same greedy text
    (its SegLU a node of the graph now), streamed or not, and the same ids."""
    deadline = time.monotonic() + EXPORT_WAIT_S
    while True:
        card = next(m for m in client.models.list() if m.id == SEGLU).model_dump()
        if card["serving"]["export"] != "running" or time.monotonic() > deadline:
            break
        time.sleep(2)
    assert card["serving"]["export"] == "passed", card["serving"]
    assert (card["backend"], card["format"]) == ("onnxruntime", "onnxruntime-genai-folder")
    assert card["served_from"]["validation"] == "passed"
    assert card["multimax"]["parameters"]["lm_head"]["ts"] == pytest.approx(
        seglu_tensors()["lm_head.multimax_ts"], abs=1e-5)
    test_greedy_chat_equals_transformers_streamed_or_not(client, SEGLU, expected)
    body = _post(url, "/tokenize", {"model": SEGLU, "messages": CHATS[SEGLU]}).json()
    want = hf_tokenizer.apply_chat_template(CHATS[SEGLU], tokenize=False, add_generation_prompt=True)
    assert body["tokens"] == hf_tokenizer(want)["input_ids"]
