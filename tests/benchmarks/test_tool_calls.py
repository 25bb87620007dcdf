"""benchmarks/tool_calls.py's model that calls tools by itself (issue 41, item 2's measurement): a 2-layer Llama
fine-tuned here on synthetic conversations in the Hermes syntax, its prompts rendered by the server's own functions
(the same ids /tokenize gives), then served over HTTP. With the call grammar every returned call parses and
validates and `required` ends with finish_reason "tool_calls"; without it the model still opens a call in most
replies (so the unconstrained rates measure something), and those rates are reported, not asserted. The
parse-after-the-fact baseline follows vLLM's Hermes parser. Timings are never asserted.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

pytest.importorskip("openai")
pytest.importorskip("jsonschema")
pytest.importorskip("transformers")

from benchmarks import tool_calls as bench
from service.protocols.tool_grammar import HERMES
from service.protocols.tool_parser import parse_calls

REQUESTS = 12  # per cell


def test_after_the_fact_parses_replies_as_vllms_hermes_parser() -> None:
    call = '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>'
    assert bench.after_the_fact(call) == [("add", '{"a": 1, "b": 2}')]
    assert bench.after_the_fact("no call here") == []
    assert bench.after_the_fact('Sure. <tool_call>{"arguments": {"a": 1}, "name": "add"}') == [("add", '{"a": 1}')]
    assert bench.after_the_fact(call + "\n" + call) == [("add", '{"a": 1, "b": 2}')] * 2
    # one region that does not parse and the reply has no calls (vLLM returns it as content)
    assert bench.after_the_fact(call + '\n<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": }}\n</tool_call>') \
        == []
    assert bench.after_the_fact('<tool_call>\n{"name": "add"}\n</tool_call>') == []  # no arguments
    # lenient as vLLM is (any name; arguments of any JSON type, re-serialized) and a little more: a raw newline
    # inside a string (json.loads(strict=False))
    assert bench.after_the_fact('<tool_call>{"name": "nope", "arguments": "x"}</tool_call>') == [("nope", '"x"')]
    assert bench.after_the_fact('<tool_call>{"name": "f", "arguments": {"q": "a\nb"}}</tool_call>') \
        == [("f", '{"q": "a\\nb"}')]


def test_the_training_calls_validate_and_the_measured_asks_are_new() -> None:
    """Every synthetic answer is one Hermes call the server's parser reads back and its schema accepts; the
    measured asks share no phrasing and no value with training."""
    import jsonschema

    rng = random.Random(0)
    trained = [bench.make_ask(rng, "train") for _ in range(300)]
    for ask in trained:
        text = bench.answer_text(ask)
        assert text.endswith("</tool_call><|im_end|>")
        parsed = parse_calls(text.removesuffix("<|im_end|>"), HERMES)
        assert parsed.content is None and [(c.name, json.loads(c.arguments)) for c in parsed.calls] \
            == [(ask.name, ask.arguments)]
        jsonschema.validate(ask.arguments, bench.TUNED_SCHEMAS[ask.name])
    measured = bench.measured_asks(50)
    assert {a.name for a in measured} == set(bench.TUNED_SCHEMAS)
    assert not {a.text for a in measured} & {a.text for a in trained}
    for kind in ("weather", "add", "search"):
        assert not set(bench.PHRASINGS["train"][kind]) & set(bench.PHRASINGS["test"][kind])
    assert not set(bench.CITIES["train"]) & set(bench.CITIES["test"])
    assert not set(bench.TOPICS["train"]) & set(bench.TOPICS["test"])


@pytest.fixture(scope="module")
def tuned(tmp_path_factory: pytest.TempPathFactory) -> Path:
    # fewer, smaller steps than the benchmark's 300 x 16 (20 to 40 s on one busy core instead of 2 minutes):
    # enough to write the syntax, not to write it well
    return bench.build_tuned(tmp_path_factory.mktemp("tool_llama"), steps=100, batch=8)


@pytest.mark.slow
def test_the_fine_tuned_model_calls_by_itself_and_the_grammar_makes_every_call_valid(tuned: Path) -> None:
    from fastapi.testclient import TestClient

    from models.hf_text import HFTextTokenizer
    from models.hf_tokenizer import HFTokenizer
    from service.base.config import Settings
    from service.edge.app import create_app

    # the prompts it was trained on are the ones the server feeds it
    tok = HFTextTokenizer(HFTokenizer.from_folder(tuned))
    ask = bench.measured_asks(1)[0]
    with TestClient(create_app(Settings(model_dir=tuned.parent, models=(tuned.name,), warmup_calls=0))) as client:
        r = client.post("/tokenize", json={"model": tuned.name, "tools": bench.TUNED_TOOLS,
                                           "messages": [{"role": "user", "content": ask.text}]})
        assert r.status_code == 200, r.text
        assert r.json()["tokens"] == bench.served_prompt(tok, bench.TUNED_TOOLS, ask.text)
        assert r.json()["max_model_len"] == bench.CONTEXT

    # parallel_tool_calls false: the grammar ends the reply after one call, so `required` always finishes with it
    rows = bench.measure_tuned(tuned, REQUESTS, 128, decodings=("sampled",), parallel=False)
    by = {(r["tool_choice"], r["setting"]): r for r in rows}
    assert set(by) == {(c, s) for c in ("required", "auto") for s in ("on", "off", "fact")}
    for choice in ("required", "auto"):
        on = by[choice, "on"]
        assert on["calls"] >= 1 and on["parse"] == on["validate"] == on["calls"], on
        assert on["requests_with_valid_call"] == on["requests_with_call"]
        # unconstrained, the model opens a call in most replies by itself: the rates below mean something
        assert by[choice, "off"]["opened"] > REQUESTS // 2, by[choice, "off"]
        for setting in ("off", "fact"):
            row = by[choice, setting]
            assert 0 <= row["validate"] <= row["parse"] <= row["calls"], row
    required = by["required", "on"]
    assert required["calls"] == required["requests_with_valid_call"] == REQUESTS
    assert required["finish_reasons"] == {"tool_calls": REQUESTS}
    # a parse-after-the-fact server returns no call whose arguments do not parse (vLLM re-serializes them)
    assert by["required", "fact"]["parse"] == by["required", "fact"]["calls"]
    print(bench.tuned_table(rows))
