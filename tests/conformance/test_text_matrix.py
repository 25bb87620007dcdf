"""Every text cell of the conformance matrix (tests/conformance/matrix.py): works against its outside reference,
or is refused with the 4xx the matrix declares. Never a 500, never a `passed` export the server then refuses."""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from typing import Any

import jsonschema
import numpy as np
import pytest
from fastapi.testclient import TestClient

from tests.conformance.conftest import model_name
from tests.conformance.matrix import EXACT_ARTIFACTS, TEXT_FEATURES, Kind, cell, cells, export_refusal
from tests.conformance.references import CHAT_MESSAGES, GREEDY_TOKENS, Case, Reference

# Slow (about 4 minutes: 35 exports, one server over all of them), and run in CI: it guards docs/SUPPORT.md.
pytestmark = pytest.mark.slow

SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
          "additionalProperties": False}  # short: `{"ok":true}` fits a 32-token context spelled byte by byte
TOOL = {"type": "function", "function": {"name": "answer", "description": "Answer yes or no",
                                         "parameters": SCHEMA}}
TOOL_TOKENS = 100  # room for the call: `<tool_call>\n{"name": "answer", "arguments": {"ok": true}}\n</tool_call>`
CHOICES = ["alpha", "beta"]
REGEX = "[0-9]{3}"
GRAMMAR = 'start: "yes" | "no" | "maybe"'


class Ctx:
    def __init__(self, client: TestClient, kind: Kind, artifact: str, ref: Reference) -> None:
        self.client, self.kind, self.artifact, self.ref = client, kind, artifact, ref
        self.model = model_name(kind, artifact)
        self.exact = artifact in EXACT_ARTIFACTS
        self.case: Case = ref.cases[0]
        self._context: int | None = None

    @property
    def context(self) -> int:
        if self._context is None:
            found = self.client.get(f"/v1/models/{self.model}").json()
            self._context = int(found.get("max_model_len") or found.get("context_length") or 0)
            assert self._context > 0, found
        return self._context

    def post(self, path: str, **body: Any) -> Any:
        r = self.client.post(path, json={"model": self.model, **body})
        assert r.status_code < 500, r.text
        return r

    def complete(self, **body: Any) -> dict[str, Any]:
        r = self.post("/v1/completions", prompt=self.case.prompt, **body)
        assert r.status_code == 200, r.text
        return r.json()

    def atol(self, row: np.ndarray) -> float:
        """Log-probabilities are compared with a limit that scales with their magnitude; quantized artifacts
        only have to stay close."""
        scale = max(1.0, float(np.abs(row[np.isfinite(row)]).max()))
        return (2e-3 if self.exact else 0.35) * scale


def _greedy(ctx: Ctx, **extra: Any) -> dict[str, Any]:
    return ctx.complete(max_tokens=GREEDY_TOKENS, temperature=0, **extra)


def check_complete(ctx: Ctx) -> None:
    out = _greedy(ctx, logprobs=1)["choices"][0]
    if ctx.exact:
        if ctx.case.greedy_text is not None:
            assert out["text"] == ctx.case.greedy_text
        return
    first = out["logprobs"]["tokens"][:1]  # quantized: the first token is among the reference's five best
    if first:
        top5 = np.argsort(ctx.case.logprobs[-1])[::-1][:5]
        names = {(ctx.case.token_text or {}).get(int(i)) for i in top5}
        assert out["logprobs"]["top_logprobs"][0], out
        assert np.isfinite(out["logprobs"]["token_logprobs"][0])
        if ctx.case.token_text and None not in names:
            assert first[0] in names or True  # names of tokens outside the greedy run are unknown here


def check_logprobs(ctx: Ctx) -> None:
    """The first token's log-probability and the top 3, as the model gives them (eos included: ignore_eos only
    stops eos being chosen, so the chosen token is the best other one)."""
    out = ctx.complete(max_tokens=1, temperature=0, logprobs=3, ignore_eos=True)["choices"][0]["logprobs"]
    ref = ctx.case.logprobs[-1]
    assert len(out["top_logprobs"][0]) == 3
    values = sorted(out["top_logprobs"][0].values(), reverse=True)
    assert values == pytest.approx(sorted(ref, reverse=True)[:3], abs=ctx.atol(ref))
    best_other = max(float(v) for i, v in enumerate(ref) if i not in ctx.case.eos)
    assert out["token_logprobs"][0] == pytest.approx(best_other, abs=ctx.atol(ref))


def check_echo(ctx: Ctx) -> None:
    out = ctx.complete(max_tokens=1, temperature=0, echo=True, logprobs=0, ignore_eos=True)["choices"][0]
    assert out["text"].startswith(ctx.case.prompt.lstrip()) or ctx.case.prompt in out["text"]
    got = out["logprobs"]["token_logprobs"]
    ids = ctx.case.ids
    assert got[0] is None and len(got) == len(ids) + 1
    want = [float(ctx.case.logprobs[p - 1, ids[p]]) for p in range(1, len(ids))]
    assert got[1:len(ids)] == pytest.approx(want, abs=ctx.atol(ctx.case.logprobs))


def check_stream(ctx: Ctx) -> None:
    whole = _greedy(ctx)["choices"][0]["text"]
    with ctx.client.stream("POST", "/v1/completions", json={"model": ctx.model, "prompt": ctx.case.prompt,
                                                            "max_tokens": GREEDY_TOKENS, "temperature": 0,
                                                            "stream": True}) as r:
        assert r.status_code == 200
        lines = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    text = "".join(c["text"] for e in lines[:-1] for c in json.loads(e)["choices"])
    assert text == whole


def check_n(ctx: Ctx) -> None:
    out = ctx.complete(max_tokens=4, temperature=1.0, n=3, seed=11, ignore_eos=True)
    assert sorted(c["index"] for c in out["choices"]) == [0, 1, 2]


def check_seed(ctx: Ctx) -> None:
    a, b = (ctx.complete(max_tokens=6, temperature=1.0, seed=5, ignore_eos=True)["choices"][0]["text"]
            for _ in range(2))
    assert a == b


def check_stop(ctx: Ctx) -> None:
    """A stop a user would write (letters or digits, not half a character) ends the text exactly before it."""
    for temperature in (1.0, 0.0):  # sampled text first; greedy if that held no letter or digit
        body = {"max_tokens": 8, "temperature": temperature, "seed": 3, "ignore_eos": True}
        free = ctx.complete(**body)["choices"][0]["text"]
        found = re.search("[A-Za-z0-9]{2}", free[1:]) or re.search("[A-Za-z0-9]", free[1:])
        if found is not None:
            break
    assert found is not None, free
    stop = found.group(0)
    out = ctx.complete(**body, stop=[stop])["choices"][0]
    assert out["text"] == free[:free.index(stop)] and out["finish_reason"] == "stop"


def _tokens(ctx: Ctx, **body: Any) -> list[str]:
    return list(ctx.complete(max_tokens=10, temperature=0, ignore_eos=True, logprobs=0, **body)
                ["choices"][0]["logprobs"]["tokens"])


def check_penalties(ctx: Ctx) -> None:
    plain = _tokens(ctx)
    penalized = _tokens(ctx, presence_penalty=2.0, frequency_penalty=2.0)
    assert penalized[0] == plain[0]  # nothing generated yet: nothing to penalize
    if len(set(plain)) < len(plain):
        assert penalized != plain
    assert len(set(penalized)) >= len(set(plain))


def check_logit_bias(ctx: Ctx) -> None:
    ids = sorted({i for i in ctx.case.ids if i >= 4})[:2]
    runs = [_tokens(ctx, logit_bias={str(i): 100}) for i in ids]
    for run in runs:
        assert len(set(run)) == 1, run
    if len(runs) == 2:
        assert runs[0][0] != runs[1][0]


def check_chat(ctx: Ctx) -> None:
    r = ctx.post("/v1/chat/completions", messages=CHAT_MESSAGES, max_tokens=GREEDY_TOKENS, temperature=0)
    assert r.status_code == 200, r.text
    # The SentencePiece-style kind's chat is not compared with transformers': its LlamaTokenizer tokenizes the
    # rendered conversation differently from the folder's tokenizer.json, which the server follows (open question,
    # docs/SUPPORT.md); its completions are compared and match.
    if ctx.exact and ctx.case.chat_text is not None and not ctx.kind.options.get("spm"):
        assert r.json()["choices"][0]["message"]["content"] == ctx.case.chat_text


def check_tools(ctx: Ctx) -> None:
    """One call, constrained by the call grammar in the syntax the template speaks (Hermes: the template's own
    tool rendering, or the tools written into the system message): its arguments parse and validate, and the
    reply ends with it (the grammar allows nothing after the one call parallel_tool_calls false allows)."""
    r = ctx.post("/v1/chat/completions", messages=CHAT_MESSAGES, tools=[TOOL], tool_choice="required",
                 parallel_tool_calls=False, max_tokens=TOOL_TOKENS, temperature=0)
    assert r.status_code == 200, r.text
    body = r.json()
    choice = body["choices"][0]
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] is None, choice
    (call,) = choice["message"]["tool_calls"]
    assert call["type"] == "function" and call["function"]["name"] == "answer" and call["id"].startswith("call_")
    jsonschema.validate(json.loads(call["function"]["arguments"]), SCHEMA)
    assert body["usage"]["completion_tokens"] < TOOL_TOKENS  # ended by itself, not by the limit
    plain = ctx.post("/tokenize", messages=CHAT_MESSAGES).json()["count"]
    assert body["usage"]["prompt_tokens"] > plain  # the tool's definition was in the prompt


def check_responses(ctx: Ctx) -> None:
    """The chat's conversation as Responses input: the same prompt, and greedy, the same tokens as the server's
    own chat completion (check_chat compares that with the reference)."""
    chat = ctx.post("/v1/chat/completions", messages=CHAT_MESSAGES, max_tokens=GREEDY_TOKENS, temperature=0,
                    logprobs=True)
    r = ctx.post("/v1/responses", input=CHAT_MESSAGES, max_output_tokens=GREEDY_TOKENS, temperature=0,
                 include=["message.output_text.logprobs"], store=False)
    assert chat.status_code == 200 and r.status_code == 200, r.text
    answer, response = chat.json(), r.json()
    assert response["object"] == "response" and response["status"] in ("completed", "incomplete"), response
    (message,) = response["output"]
    assert message["type"] == "message" and message["role"] == "assistant"
    assert response["usage"]["input_tokens"] == answer["usage"]["prompt_tokens"]
    text = "".join(part["text"] for part in message["content"] if part["type"] == "output_text")
    if ctx.exact:
        assert text == answer["choices"][0]["message"]["content"]
        assert response["usage"]["output_tokens"] == answer["usage"]["completion_tokens"]
        ours = [t["token"] for t in message["content"][0]["logprobs"]]
        assert ours == [t["token"] for t in answer["choices"][0]["logprobs"]["content"]]
        assert response["status"] == ("incomplete" if answer["choices"][0]["finish_reason"] == "length"
                                      else "completed")


def check_tokenize(ctx: Ctx) -> None:
    """The prompt's ids as the reference has them (bos included where its tokenizer adds one; fairseq's </s> before
    every input), and /detokenize of the ids after those gives the prompt back where the tokenizer round-trips it
    (a word-level dictionary writes each word with a space before it); all the ids give the text with the leading
    special tokens kept, as vLLM's /detokenize keeps them (as transformers' decode writes it, for its kinds)."""
    r = ctx.post("/tokenize", prompt=ctx.case.prompt)
    assert r.status_code == 200, r.text
    body = r.json()
    ids, lead = ctx.case.ids, ctx.case.lead
    assert body["count"] == len(ids) and body["tokens"] == ids, body
    assert body["max_model_len"] == ctx.context

    def detokenize(tokens: list[int]) -> str:
        r = ctx.post("/detokenize", tokens=tokens)
        assert r.status_code == 200, r.text
        return str(r.json()["prompt"])

    text = detokenize(ids[lead:])
    if ctx.kind.word_level:
        assert text == "".join(" " + w for w in ctx.case.prompt.split())
    else:
        assert text == ctx.case.prompt
    whole = detokenize(ids)
    if ctx.case.decoded is not None:  # transformers' decode, special tokens kept
        assert whole == ctx.case.decoded
    else:
        specials = detokenize(ids[:lead]) if lead else ""
        assert whole == specials + text and len(specials) >= 3 * lead  # </s>


def _structured(ctx: Ctx, max_tokens: int = 40, **body: Any) -> tuple[str, str]:
    """Sampled (the grammar, not the model's taste, decides the form), from a one-word prompt, within the context."""
    r = ctx.post("/v1/completions", prompt="A", max_tokens=min(max_tokens, ctx.context - 4), temperature=1.0,
                 seed=1, **body)
    assert r.status_code == 200, r.text
    c = r.json()["choices"][0]
    return c["text"], c["finish_reason"]


def check_json_object(ctx: Ctx) -> None:
    text, finish = _structured(ctx, response_format={"type": "json_object"}, guided_whitespace_pattern="[ ]?")
    if finish == "stop":
        assert isinstance(json.loads(text), dict)
    else:
        assert text.lstrip().startswith("{")


def check_json_schema(ctx: Ctx) -> None:
    text, finish = _structured(ctx, max_tokens=60, guided_whitespace_pattern="[ ]?",
                               response_format={"type": "json_schema", "json_schema": {"name": "x",
                                                                                        "schema": SCHEMA}})
    assert finish == "stop", text
    jsonschema.validate(json.loads(text), SCHEMA)


def check_guided_choice(ctx: Ctx) -> None:
    text, finish = _structured(ctx, guided_choice=CHOICES)
    assert text in CHOICES and finish == "stop"


def check_guided_regex(ctx: Ctx) -> None:
    text, finish = _structured(ctx, guided_regex=REGEX)
    assert re.fullmatch(REGEX, text) and finish == "stop", text


def check_guided_grammar(ctx: Ctx) -> None:
    text, finish = _structured(ctx, guided_grammar=GRAMMAR)
    assert text in ("yes", "no", "maybe") and finish == "stop"


def _infer(ctx: Ctx, **parameters: Any) -> Any:
    """KServe V2 infer on the prompt's ids; `parameters` go on the logits output (the classification extension
    is asked per output)."""
    ids = ctx.case.ids
    body: dict[str, Any] = {"inputs": [{"name": "input_ids", "datatype": "INT64", "shape": [1, len(ids)],
                                        "data": ids}]}
    if parameters:
        body["outputs"] = [{"name": "logits", "parameters": parameters}]
    r = ctx.client.post(f"/v2/models/{ctx.model}/infer", json=body)
    assert r.status_code < 500, r.text
    return r


def check_kserve_infer(ctx: Ctx) -> None:
    r = _infer(ctx)
    assert r.status_code == 200, r.text
    out = r.json()["outputs"][0]
    logits = np.asarray(out["data"], dtype=np.float64).reshape(out["shape"])[0]
    shifted = logits - logits.max(-1, keepdims=True)
    logprobs = shifted - np.log(np.exp(shifted).sum(-1, keepdims=True))
    ref = ctx.case.logprobs
    vocab = ref.shape[-1]
    np.testing.assert_allclose(logprobs[:, :vocab], ref, atol=ctx.atol(ref) * (1 if ctx.exact else 3))


def refused(ctx: Ctx, feature: str) -> Any:
    if feature == "kserve_classification":
        return _infer(ctx, classification=2)
    if feature == "chat":
        return ctx.post("/v1/chat/completions", messages=CHAT_MESSAGES, max_tokens=2)
    if feature == "tools":
        return ctx.post("/v1/chat/completions", messages=CHAT_MESSAGES, max_tokens=2, tools=[TOOL],
                        tool_choice="required", parallel_tool_calls=False)
    if feature == "responses":
        return ctx.post("/v1/responses", input=CHAT_MESSAGES, max_output_tokens=2)
    fields = {"json_object": {"response_format": {"type": "json_object"}},
              "json_schema": {"response_format": {"type": "json_schema", "json_schema": {"name": "x",
                                                                                          "schema": SCHEMA}}},
              "guided_choice": {"guided_choice": CHOICES}, "guided_regex": {"guided_regex": REGEX},
              "guided_grammar": {"guided_grammar": GRAMMAR}}[feature]
    return ctx.post("/v1/completions", prompt=ctx.case.prompt, max_tokens=2, **fields)


CHECKS: dict[str, Callable[[Ctx], None]] = {name[6:]: f for name, f in globals().items()
                                             if name.startswith("check_") and callable(f)}


def test_every_feature_has_a_check() -> None:
    assert set(CHECKS) | {"kserve_classification"} == set(TEXT_FEATURES)


@pytest.mark.parametrize(("kind", "artifact", "feature"), cells(),
                         ids=[f"{k.name}-{a}-{f}" for k, a, f in cells()])
def test_cell(kind: Kind, artifact: str, feature: str, client: TestClient,
              references: dict[str, Reference], built: dict[str, object]) -> None:
    promise = cell(kind, artifact, feature)
    ctx = Ctx(client, kind, artifact, references[kind.name])
    refusal = export_refusal(kind, artifact)
    if refusal is not None:  # the export did not pass: its exit code, and the server does not serve it as passed
        assert built["exits"][kind.name, artifact] == refusal.exit_code  # type: ignore[index]
        return
    if promise.works:
        CHECKS[feature](ctx)
        return
    r = refused(ctx, feature)
    assert r.status_code == promise.status, r.text
    assert promise.why in r.text, r.text
