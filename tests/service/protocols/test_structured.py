"""Structured output (service.protocols.structured) and honest request fields (service.protocols.fields).

The grammar forces validity whatever the weights: randomly initialised models, driven only through the logits
processors, must produce valid JSON, one of the choices, a regex match; then the same through /v1/completions
(the demo model, text never trained on JSON), and the 400s naming the field."""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import pytest
import torch
from fastapi.testclient import TestClient
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from models.gpt import GPT, GPTConfig
from models.hf_text import HFTextTokenizer
from models.hf_tokenizer import HFTokenizer
from models.tokenizer import ByteTokenizer
from service.base.config import Settings
from service.edge.app import create_app
from service.protocols.structured import GrammarProcessor, StructuredOutputError, processors_for

SCHEMA = {"type": "object", "properties": {"n": {"type": "integer"}, "ok": {"type": "boolean"},
                                           "tag": {"enum": ["a", "b\"c"]}},
          "required": ["n", "ok", "tag"], "additionalProperties": False}


@pytest.fixture(scope="module")
def hf_tok(tmp_path_factory: pytest.TempPathFactory) -> HFTextTokenizer:
    """A tiny byte-level BPE tokenizer.json (multi-byte tokens: a grammar must cross token boundaries), as the
    server holds it (HFTextTokenizer: the same wrapper every Hugging Face folder is served through)."""
    folder = tmp_path_factory.mktemp("tok")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=["<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(['{"n": 12, "ok": true, "tag": "a"}', "red green blue", "the quick brown fox"] * 50,
                            trainer)
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<s>", "eos_token": "</s>"}))
    return HFTextTokenizer(HFTokenizer.from_folder(folder))


def random_model(vocab: int, seed: int) -> Callable[[list[int]], torch.Tensor]:
    """Last-position logits of a randomly initialised GPT (no training: nothing but the grammar shapes it)."""
    torch.manual_seed(seed)
    model = GPT(GPTConfig(vocab_size=vocab, block_size=512, n_layer=1, n_head=2, n_embd=32)).eval()

    @torch.no_grad()
    def last_logits(ids: list[int]) -> torch.Tensor:
        return model(torch.tensor([ids[-500:]]))[0][0, -1]

    return last_logits


def random_logits(vocab: int, seed: int) -> Callable[[list[int]], torch.Tensor]:
    """Fresh random logits every step (cheaper than a model, and no more helpful to the grammar)."""
    gen = torch.Generator().manual_seed(seed)
    return lambda ids: torch.randn(vocab, generator=gen) * 3


def generate(proc: Any, model: Callable[[list[int]], torch.Tensor], eos: Sequence[int], prompt: list[int],
             max_tokens: int, seed: int) -> tuple[list[int], str]:
    """Sample (temperature 1) through the processor; (tokens, finish reason)."""
    gen = torch.Generator().manual_seed(seed)
    out: list[int] = []
    for _ in range(max_tokens):
        logits = proc(out, model(prompt + out))
        token = int(torch.multinomial(logits.softmax(-1), 1, generator=gen))
        if token in eos:
            return out, "stop"
        out.append(token)
    return out, "length"


@pytest.mark.parametrize("kind", ["byte", "hf"])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_random_model_is_driven_to_schema_valid_json(kind: str, seed: int, hf_tok: HFTextTokenizer) -> None:
    tok: Any = ByteTokenizer() if kind == "byte" else hf_tok
    eos = [tok.eos_id] if kind == "byte" else list(tok.eos_ids)
    (proc,) = processors_for({"response_format": {"type": "json_schema", "json_schema": {
        "name": "t", "schema": SCHEMA}}, "guided_whitespace_pattern": r"[ ]?"}, tok)
    tokens, finish = generate(proc, random_model(tok.vocab_size, seed), eos, tok.encode("Answer: ")[-4:], 300, seed)
    assert finish == "stop"
    value = json.loads(tok.decode(tokens))
    assert set(value) == {"n", "ok", "tag"} and isinstance(value["n"], int) and isinstance(value["ok"], bool)
    assert value["tag"] in ("a", 'b"c')


@pytest.mark.parametrize("kind", ["byte", "hf"])
def test_json_object_choice_and_regex(kind: str, hf_tok: HFTextTokenizer) -> None:
    tok: Any = ByteTokenizer() if kind == "byte" else hf_tok
    eos = [tok.eos_id] if kind == "byte" else list(tok.eos_ids)
    model = random_logits(tok.vocab_size, 5)
    choices = ["red", "green", "blue", 'say "hi" \\ é']
    for seed in range(4):
        (proc,) = processors_for({"guided_choice": choices}, tok)
        tokens, finish = generate(proc, model, eos, [65], 50, seed)
        assert finish == "stop" and tok.decode(tokens) in choices
        (proc,) = processors_for({"guided_regex": "[0-9]{2,4}-[a-z]{1,3}"}, tok)
        tokens, finish = generate(proc, model, eos, [65], 50, seed)
        assert finish == "stop" and re.fullmatch("[0-9]{2,4}-[a-z]{1,3}", tok.decode(tokens))
    # json_object: any object; whitespace held to compact so that a random model ends within the bound
    (proc,) = processors_for({"response_format": {"type": "json_object"}, "guided_whitespace_pattern": ""}, tok)
    ends = 0
    for seed in range(6):
        tokens, finish = generate(proc, model, eos, [65], 200, seed)
        text = tok.decode(tokens)
        if finish == "stop":
            ends += 1
            assert isinstance(json.loads(text), dict)
        else:
            assert text.startswith("{")
    assert ends >= 3


def test_one_processor_serves_interleaved_rows() -> None:
    """n / best_of rows share the request's processor: each row's mask follows its own tokens."""
    tok = ByteTokenizer()
    (proc,) = processors_for({"guided_choice": ["abc", "abd", "xyz"]}, tok)
    assert isinstance(proc, GrammarProcessor)
    logits = torch.zeros(tok.vocab_size)

    def allowed(generated: list[int]) -> set[int]:
        return set(torch.isfinite(proc(generated, logits)).nonzero().flatten().tolist())

    assert allowed([]) == {ord("a"), ord("x")}
    assert allowed([ord("x")]) == {ord("y")}
    assert allowed([ord("a"), ord("b")]) == {ord("c"), ord("d")}
    assert allowed([ord("x"), ord("y")]) == {ord("z")}
    assert allowed([ord("a"), ord("b"), ord("d")]) == {tok.eos_id}  # complete: only the end
    assert allowed([ord("a")]) == {ord("b")}  # a shorter row after longer ones
    with pytest.raises(StructuredOutputError, match="guided_choice"):
        proc([ord("q")], logits)  # a token the grammar refuses fails that row


def test_padded_vocabulary_is_masked_beyond_the_tokenizer() -> None:
    tok = ByteTokenizer()
    (proc,) = processors_for({"guided_regex": "a+"}, tok)
    out = proc([], torch.zeros(tok.vocab_size + 13))
    assert torch.isfinite(out).nonzero().flatten().tolist() == [ord("a")]


# ---- through /v1/completions ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def client() -> Iterator[TestClient]:
    with TestClient(create_app(Settings()), raise_server_exceptions=False) as c:
        yield c


def complete(client: TestClient, **fields: Any) -> tuple[int, dict[str, Any]]:
    r = client.post("/v1/completions", json={"model": "text_multimax", "prompt": "The answer is", **fields})
    return r.status_code, r.json()


def test_completions_json_schema_choice_regex(client: TestClient) -> None:
    status, body = complete(client, max_tokens=80, seed=3, n=2, response_format={
        "type": "json_schema", "json_schema": {"name": "t", "schema": SCHEMA}}, guided_whitespace_pattern="")
    assert status == 200
    for choice in body["choices"]:
        assert choice["finish_reason"] == "stop"
        assert set(json.loads(choice["text"])) == {"n", "ok", "tag"}
    status, body = complete(client, max_tokens=10, seed=1, n=4, guided_choice=["red", "green", "blue"])
    assert status == 200 and all(c["text"] in ("red", "green", "blue") for c in body["choices"])
    status, body = complete(client, max_tokens=20, temperature=0, guided_regex="[0-9]{3}-[a-z]{2,4}")
    assert status == 200 and re.fullmatch("[0-9]{3}-[a-z]{2,4}", body["choices"][0]["text"])
    status, body = complete(client, max_tokens=30, seed=2, guided_json=json.dumps({"type": "array", "items": {
        "type": "integer"}, "maxItems": 3}), guided_whitespace_pattern="")
    assert status == 200 and isinstance(json.loads(body["choices"][0]["text"]), list)
    for grammar in ('root ::= ("yes" | "no") [0-9]', 'start: ("yes" | "no") DIGIT\nDIGIT: /[0-9]/'):  # GBNF, Lark
        status, body = complete(client, max_tokens=10, seed=5, n=3, guided_grammar=grammar)
        assert status == 200 and all(re.fullmatch("(yes|no)[0-9]", c["text"]) for c in body["choices"]), body


def test_completions_cut_by_max_tokens_is_length(client: TestClient) -> None:
    status, body = complete(client, max_tokens=4, guided_regex="[0-9]{30}")
    choice = body["choices"][0]
    assert status == 200 and choice["finish_reason"] == "length" and re.fullmatch("[0-9]{4}", choice["text"])


def test_completions_stream_guided(client: TestClient) -> None:
    r = client.post("/v1/completions", json={"model": "text_multimax", "prompt": "x", "stream": True, "seed": 4,
                                             "max_tokens": 40, "guided_choice": ["alpha", "beta"]})
    events = [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: {")]
    assert r.status_code == 200
    assert "".join(c["text"] for e in events for c in e["choices"]) in ("alpha", "beta")
    assert events[-1]["choices"][-1]["finish_reason"] == "stop"


@pytest.mark.parametrize(("fields", "param", "words"), [
    ({"guided_json": {"type": "frobnicate"}}, "guided_json", "frobnicate"),
    ({"guided_json": "{not json"}, "guided_json", "not valid JSON"),
    ({"guided_json": [1]}, "guided_json", "valid"),
    ({"guided_regex": "[0-9"}, "guided_regex", "regex"),
    ({"guided_choice": []}, "guided_choice", "non-empty"),
    ({"guided_grammar": "start: undefined_rule"}, "guided_grammar", "undefined_rule"),
    ({"response_format": {"type": "xml"}}, "response_format.type", "xml"),
    ({"response_format": {"type": "json_schema"}}, "response_format.json_schema", "schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
     "response_format.json_schema.schema", "missing"),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": {"type": "nope"}}}},
     "response_format.json_schema.schema", "nope"),
    ({"guided_regex": "a", "guided_choice": ["a"]}, "guided_regex", "cannot be combined with guided_choice"),
    ({"response_format": {"type": "json_object"}, "guided_json": {}}, "guided_json", "cannot be combined"),
    ({"guided_regex": "a", "ignore_eos": True}, "ignore_eos", "cannot be combined"),
    ({"guided_regex": "a", "min_tokens": 2}, "min_tokens", "cannot be combined"),
    ({"guided_whitespace_pattern": " "}, "guided_whitespace_pattern", "applies only"),
    ({"guided_choice": ["a"], "guided_whitespace_pattern": " "}, "guided_whitespace_pattern", "does not apply"),
    ({"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools", "not supported"),
    ({"tool_choice": "auto"}, "tool_choice", "not supported"),
    ({"functions": [{"name": "f"}]}, "functions", "not supported"),
    ({"function_call": "auto"}, "function_call", "not supported"),
    ({"parallel_tool_calls": True}, "parallel_tool_calls", "not supported"),
    ({"repetition_penalty": 0}, "repetition_penalty", "greater than 0"),
    ({"min_p": 0.1}, "min_p", "not supported"),
    ({"use_beam_search": True}, "use_beam_search", "not supported"),
    ({"frobnicate": 1}, "frobnicate", "unknown field"),
])
def test_refused_with_400_naming_the_field(client: TestClient, fields: dict[str, Any], param: str,
                                           words: str) -> None:
    status, body = complete(client, max_tokens=3, **fields)
    assert status == 400, body
    assert body["error"]["param"].startswith(param) and words in body["error"]["message"], body


def test_fields_that_change_nothing_pass(client: TestClient) -> None:
    status, body = complete(client, max_tokens=3, user="u-1", tool_choice="none", tools=[],
                            response_format={"type": "text"}, guided_decoding_backend="xgrammar")
    assert status == 200 and body["choices"][0]["finish_reason"] == "length"


def test_tokenizer_without_eos_is_a_400(hf_tok: HFTextTokenizer) -> None:
    from service.base.errors import ServiceError

    # a tokenizer.json whose config names no end token
    no_eos = HFTextTokenizer(HFTokenizer(hf_tok.hf.tokenizer, {}, None))
    with pytest.raises(ServiceError) as info:
        processors_for({"guided_regex": "a+"}, no_eos)
    assert info.value.status == 400 and info.value.param == "guided_regex"
    assert "no end-of-sequence token" in info.value.message


def test_a_processor_that_raises_fails_only_its_sequence() -> None:
    """In one decode batch: a guided row, a plain row and a row whose processor raises at its 4th token."""
    import asyncio
    from concurrent.futures import ThreadPoolExecutor

    from models.demo import DEMO_DIR
    from service.base.metrics import Metrics
    from service.engine.backends.onnxruntime import OnnxRuntimeBackend
    from service.engine.text import GenSequence, SamplingParams, TextScheduler
    from service.protocols.engine_status import http_error

    tok = ByteTokenizer()

    def breaks(generated: Sequence[int], logits: torch.Tensor) -> torch.Tensor:
        if len(generated) == 3:
            raise RuntimeError("processor bug")
        return logits

    guided = GenSequence(tok.encode("Return the"), SamplingParams(
        max_tokens=30, temperature=0.0, processors=processors_for({"guided_regex": "[0-9]{5}"}, tok)))
    plain = GenSequence(tok.encode("If the file"), SamplingParams(max_tokens=12, temperature=0.0))
    victim = GenSequence(tok.encode("The"), SamplingParams(max_tokens=12, temperature=0.0, processors=(breaks,)))

    async def main() -> None:
        sched = TextScheduler("text", OnnxRuntimeBackend(DEMO_DIR / "text_multimax.onnx"), tok, 128,
                              ThreadPoolExecutor(1), Metrics(), 8, 64)
        sched.start()
        sched.submit([guided, plain, victim])
        for s in (guided, plain, victim):
            while not s.done:
                await s.changed.wait()
                s.changed.clear()
        await sched.close()

    asyncio.run(main())
    assert victim.error is not None and http_error(victim.error).status == 500 and victim.generated == 3
    assert plain.error is None and plain.finish_reason == "length" and len(plain.tokens) == 12
    assert guided.error is None and guided.finish_reason == "stop"
    assert re.fullmatch("[0-9]{5}", tok.decode(guided.tokens))
