"""Issue 38: hostile input on the LLM routes never crashes the server nor holds its event loop.

Over real sockets, on the demo models (llama_seglu: a Llama with a tokenizer.json and a chat template;
text_multimax: the byte-level GPT): grammars that crashed llguidance's native compiler (a 1,500-link $defs
anyOf/$ref chain, 3,000 chained Lark rules) are a 400 and leave the server, and an innocent greedy stream running
meanwhile, untouched: refused by the limits on a server with the defaults, and, on a server started with the
limits lifted, by the worker process that compiles grammars first (it dies instead of the server). Grammars that
compile but cannot run, lone surrogates, KServe outputs too large for JSON and KServe classification on a text
model are 400s naming what to change. No wall-clock time is asserted (benchmarks/hostile_latency.py measures).
"""

from __future__ import annotations

import json
import tempfile
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import numpy as np
import pytest

from benchmarks.server import in_thread, start, stop
from models.demo import DEMO_DIR
from models.hf_text import HFTextTokenizer
from models.hf_tokenizer import HFTokenizer
from models.tokenizer import ByteTokenizer
from service.base.config import Settings, load_settings
from service.base.errors import ServiceError
from service.base.kserve_codec import encode_outputs
from service.edge.app import create_app
from service.protocols import grammar_limits, grammar_worker, request_text, structured
from service.protocols.grammar_guard import GrammarGuard, GrammarWorkerFailed
from service.protocols.grammar_worker import GrammarJob, GrammarRefused
from tests.paths import ROOT

LLAMA, GPT = "llama_seglu", "text_multimax"
MODELS = ("--models", f"{LLAMA},{GPT}", "--warmup-calls", "0")
LIFTED = ("--max-grammar-depth", "1000000", "--max-grammar-bytes", "1000000", "--max-regex-repeat", "1000000000",
          "--max-guided-choices", "1000000", "--grammar-workers", "1")


def defs_chain(links: int) -> dict[str, Any]:
    """A JSON schema whose $defs chain `links` anyOf + $ref links (1,500: 98 KB, llguidance's stack overflows)."""
    defs: dict[str, Any] = {f"d{i}": {"anyOf": [{"$ref": f"#/$defs/d{i + 1}"}, {"type": "null"}]}
                            for i in range(links)}
    defs[f"d{links}"] = {"type": "integer"}
    return {"$ref": "#/$defs/d0", "$defs": defs}


def lark_chain(rules: int) -> str:
    """A Lark grammar of `rules` rules each calling the next (3,000: 58 KB, llguidance's stack overflows)."""
    return "\n".join(["start: r0", *(f'r{i}: "a" r{i + 1} | "b"' for i in range(rules)), f'r{rules}: "c"'])


# ---- servers --------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def default_url() -> Iterator[str]:
    """The server with its default limits, in this process (uvicorn on a loopback port)."""
    with in_thread(create_app(Settings(models=(LLAMA, GPT), warmup_calls=0))) as url:
        yield url


@pytest.fixture(scope="module")
def lifted() -> Iterator[tuple[str, Any]]:
    """`python -m service` with the grammar limits lifted: a hostile grammar reaches the worker process."""
    with tempfile.TemporaryFile("w+") as log:
        proc, url = start(*MODELS, *LIFTED, output=log)
        try:
            yield url, proc
        finally:
            stop(proc)


def error_of(r: httpx.Response) -> dict[str, Any]:
    body = r.json()
    assert set(body) == {"error"}, body
    return dict(body["error"])


def chat(url: str, content: str = "hi", **fields: Any) -> httpx.Response:
    body = {"model": LLAMA, "messages": [{"role": "user", "content": content}], "max_tokens": 8, **fields}
    return httpx.post(f"{url}/v1/chat/completions", json=body, timeout=120)


def complete(url: str, **fields: Any) -> httpx.Response:
    return httpx.post(f"{url}/v1/completions", json={"model": GPT, "prompt": "The", "max_tokens": 8, **fields},
                      timeout=120)


def raw(url: str, path: str, text: str) -> httpx.Response:
    """A JSON body sent as written ("\\ud800" escapes stay lone surrogates; httpx's encoder would refuse them)."""
    return httpx.post(url + path, content=text.encode(), headers={"Content-Type": "application/json"}, timeout=120)


INNOCENT = {"model": LLAMA, "messages": [{"role": "user", "content": "Tell me about the sea."}], "max_tokens": 120,
            "temperature": 0, "ignore_eos": True, "stream": True}


def innocent_stream(url: str, meanwhile: Callable[[], Any] = lambda: None) -> tuple[str, Any]:
    """The innocent greedy chat stream's text, with `meanwhile()` run once its first token has arrived."""
    texts: list[str] = []
    result: Any = None
    with httpx.Client(timeout=120) as client, client.stream("POST", f"{url}/v1/chat/completions",
                                                            json=INNOCENT) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if not line.startswith("data: {"):
                continue
            event = json.loads(line[6:])
            assert "error" not in event, event
            texts.extend(c["delta"].get("content") or "" for c in event["choices"])
            if result is None and "".join(texts):
                result = meanwhile() or True
    return "".join(texts), result


def all_at_once(calls: list[Callable[[], httpx.Response]]) -> list[httpx.Response]:
    with ThreadPoolExecutor(len(calls)) as pool:
        return list(pool.map(lambda call: call(), calls))


def crashing_requests(url: str) -> list[Callable[[], httpx.Response]]:
    schema = {"type": "json_schema", "json_schema": {"name": "chain", "schema": defs_chain(1500)}}
    return [lambda: chat(url, response_format=schema),
            lambda: complete(url, guided_grammar=lark_chain(3000)),
            lambda: complete(url, guided_json=defs_chain(1500)),
            lambda: chat(url, guided_grammar=lark_chain(3000))]


# ---- 1. grammars that crashed the compiler ----------------------------------------------------------------------


def test_crashing_grammars_are_refused_by_the_limits_and_the_stream_goes_on(default_url: str) -> None:
    alone, _ = innocent_stream(default_url)
    text, answers = innocent_stream(default_url, lambda: all_at_once(crashing_requests(default_url)))
    assert text == alone and len(alone) > 20
    for r, param in zip(answers, ["response_format.json_schema.schema", "guided_grammar", "guided_json",
                                  "guided_grammar"], strict=True):
        assert r.status_code == 400, r.text
        err = error_of(r)
        assert err["param"] == param and err["code"] == "grammar_too_complex"
        assert "max_grammar_bytes" in err["message"], err  # 98 KB and 67 KB: over 64 KiB before anything else


@pytest.mark.parametrize(("fields", "param", "option"), [
    ({"guided_json": defs_chain(1000)}, "guided_json", "max_grammar_depth"),  # 65 KB: within the size limit
    ({"guided_grammar": lark_chain(1000)}, "guided_grammar", "max_grammar_depth"),
    ({"guided_regex": "a{1000000}"}, "guided_regex", "max_regex_repeat"),
    ({"guided_regex": "(ab{100}){1000}"}, "guided_regex", "max_regex_repeat"),
    ({"guided_choice": [f"choice {i}" for i in range(20_000)]}, "guided_choice", "max_guided_choices"),
    ({"guided_json": {"type": "string", "pattern": "[a-z]{20000}"}}, "guided_json", "max_regex_repeat"),
])
def test_grammars_over_the_limits_are_400_naming_field_and_option(default_url: str, fields: dict[str, Any],
                                                                  param: str, option: str) -> None:
    for r in (complete(default_url, **fields), chat(default_url, **fields)):
        assert r.status_code == 400, r.text
        err = error_of(r)
        assert err["param"] == param and option in err["message"], err


def test_a_crash_in_the_grammar_worker_is_that_requests_400_only(lifted: tuple[str, Any]) -> None:
    url, proc = lifted
    alone, _ = innocent_stream(url)
    text, answers = innocent_stream(url, lambda: all_at_once(crashing_requests(url)))
    assert text == alone and len(alone) > 20
    for r in answers:
        assert r.status_code == 400, r.text
        assert "crashed" in error_of(r)["message"], r.text
    assert proc.poll() is None and httpx.get(f"{url}/v2/health/live").status_code == 200
    # a fresh worker takes the next grammar
    schema = {"type": "object", "properties": {"n": {"type": "boolean"}}, "required": ["n"],
              "additionalProperties": False}
    r = complete(url, max_tokens=30, guided_json=schema, guided_whitespace_pattern="")
    assert r.status_code == 200 and set(json.loads(r.json()["choices"][0]["text"])) == {"n"}


# ---- 2. grammars that compile but cannot run: 400 before admission, never a 500 mid-stream ----------------------


@pytest.mark.parametrize("fields", [
    {"guided_regex": "a{1000000}"},
    {"guided_choice": [f"c{i}" for i in range(20_000)]},
    {"guided_json": defs_chain(1000)},
])
@pytest.mark.parametrize("stream", [False, True])
def test_grammars_that_cannot_run_are_400_before_admission(lifted: tuple[str, Any], fields: dict[str, Any],
                                                          stream: bool) -> None:
    """With the limits lifted the worker's probe finds them: the first tokens fail (llguidance's lexer or its
    parser's row limit), so the request is refused before it is admitted, streamed or not."""
    url, _ = lifted
    for r in (complete(url, stream=stream, **fields), chat(url, stream=stream, **fields)):
        assert r.status_code == 400, r.text
        err = error_of(r)
        assert err["param"] == next(iter(fields)), err
        # (a 1,000-link chain is close to where the worker's compiler overflows: it may crash there instead)
        assert "cannot be used" in err["message"] or "crashed" in err["message"], err


def test_a_grammar_whose_first_token_cannot_exist_is_refused() -> None:
    class NoToken:  # a matcher whose first mask allows nothing (the tokenizer cannot spell the grammar's start)
        def compute_bitmask(self) -> bytes:
            return bytes(8)

        def is_error(self) -> bool:
            return False

    class Tokenizer:
        eos_tokens, vocab_size = [3], 64

    with pytest.raises(GrammarRefused, match="no token of its vocabulary can start the output"):
        grammar_worker.probe(NoToken(), Tokenizer())  # type: ignore[arg-type]


# ---- 3. lone surrogates ----------------------------------------------------------------------------------------


@pytest.mark.parametrize(("path", "body", "param"), [
    ("/v1/completions", f'{{"model": "{GPT}", "prompt": "a\\ud800b"}}', "prompt"),
    ("/v1/completions", f'{{"model": "{GPT}", "prompt": ["ok", "\\udfff"]}}', "prompt.1"),
    ("/v1/completions", f'{{"model": "{GPT}", "prompt": "a", "stop": ["x", "\\ud800"]}}', "stop.1"),
    ("/v1/completions", f'{{"model": "{GPT}", "prompt": "a", "guided_choice": ["a", "\\ud800"]}}',
     "guided_choice.1"),
    ("/v1/completions", f'{{"model": "{GPT}", "prompt": "a", "guided_regex": "a\\ud800"}}', "guided_regex"),
    ("/v1/completions", f'{{"model": "{GPT}", "prompt": "a", "guided_grammar": "start: \\"\\ud800\\""}}',
     "guided_grammar"),
    ("/v1/chat/completions", f'{{"model": "{LLAMA}", "messages": [{{"role": "user", "content": "\\ud800"}}]}}',
     "messages.0.content"),
    ("/v1/chat/completions", f'{{"model": "{LLAMA}", "messages": [{{"role": "user", "content": [{{"type": "text", '
     f'"text": "x\\udc00"}}]}}]}}', "messages.0.content.0"),
    ("/v1/chat/completions", f'{{"model": "{LLAMA}", "messages": [{{"role": "user", "content": "a"}}], '
     '"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "string", '
     '"pattern": "\\ud800"}}}}', "response_format.json_schema.schema.pattern"),
    ("/v1/chat/completions", f'{{"model": "{LLAMA}", "messages": [{{"role": "user", "content": "a"}}], '
     '"guided_json": {"type": "object", "properties": {"\\ud800": {"type": "string"}}}}', "guided_json.properties"),
])
def test_lone_surrogates_are_400_naming_the_field(default_url: str, path: str, body: str, param: str) -> None:
    r = raw(default_url, path, body)
    assert r.status_code == 400, r.text
    err = error_of(r)
    assert err["code"] == "invalid_unicode" and "Unicode" in err["message"] and err["param"] == param, err


def test_a_valid_surrogate_pair_is_text() -> None:
    assert request_text.find_lone_surrogate(json.loads('{"a": ["\\ud83d\\ude00", {"b": "\\u00e9"}]}')) is None
    assert request_text.find_lone_surrogate(json.loads('{"a": [1, {"b\\ud800": "x"}]}')) == ["a", "1"]
    request_text.check_text(b'{"a": "\\\\ud800"}', {"a": "\\ud800"})  # an escaped backslash: no surrogate


# ---- 4. KServe: outputs too large for JSON, classification on a text model --------------------------------------


def infer(url: str, ids: np.ndarray, **header: Any) -> httpx.Response:
    body = {"inputs": [{"name": "input_ids", "shape": list(ids.shape), "datatype": "INT64",
                        "data": ids.ravel().tolist()}], **header}
    return httpx.post(f"{url}/v2/models/{LLAMA}/infer", json=body, timeout=120)


def binary_logits(r: httpx.Response) -> np.ndarray:
    size = int(r.headers["inference-header-content-length"])
    head = json.loads(r.content[:size])
    [out] = head["outputs"]
    return np.frombuffer(r.content[size:], dtype="<f4").reshape(out["shape"])


def test_kserve_text_logits_too_large_for_json_are_400_naming_binary_output(default_url: str) -> None:
    ids = np.arange(16 * 256).reshape(16, 256) % 4000
    r = infer(default_url, ids)
    assert r.status_code == 400, r.text[:300]
    message = r.json()["error"]
    assert "max_kserve_json_output_bytes" in message and "binary" in message
    r = infer(default_url, ids[:4], parameters={"binary_data_output": True})  # the way to get them
    assert r.status_code == 200 and binary_logits(r).shape == (4, 256, 4096)


def test_kserve_large_json_output_is_the_same_numbers_as_binary(default_url: str) -> None:
    ids = np.arange(24).reshape(3, 8) + 5  # 3 x 8 x 4,096 values: written in pieces
    as_json = infer(default_url, ids)
    as_binary = infer(default_url, ids, parameters={"binary_data_output": True})
    assert as_json.status_code == as_binary.status_code == 200
    [out] = as_json.json()["outputs"]
    assert out["shape"] == [3, 8, 4096]
    np.testing.assert_array_equal(np.asarray(out["data"], dtype=np.float32).reshape(3, 8, 4096),
                                  binary_logits(as_binary))


def test_kserve_classification_on_a_text_model_is_a_clear_400(default_url: str) -> None:
    r = infer(default_url, np.array([[5, 6, 7]]), outputs=[{"name": "logits", "parameters": {"classification": 3}}])
    assert r.status_code == 400, r.text
    assert "classification" in r.json()["error"] and "[n, T, vocab]" in r.json()["error"]
    with pytest.raises(ServiceError) as info:  # the codec itself refuses scores that are not [n, classes]
        encode_outputs("m", "1", {"outputs": [{"name": "logits", "parameters": {"classification": 2}}]},
                       {"logits": np.zeros((1, 2, 3), np.float32)}, [])
    assert info.value.status == 400


# ---- 5. tokenizing off the event loop ---------------------------------------------------------------------------


def test_a_one_megabyte_word_is_a_400_while_others_are_served(default_url: str) -> None:
    word = "x" * 1_000_000
    big, small = all_at_once([lambda: chat(default_url, word), lambda: chat(default_url, "hello")])
    assert big.status_code == 400 and error_of(big)["code"] == "context_length_exceeded", big.text[:300]
    assert small.status_code == 200


def test_encoding_that_releases_the_gil_gives_the_tokenizers_ids() -> None:
    """HFTokenizer.encode goes through encode_batch (it releases the GIL): the ids of the library's encode."""
    hf = HFTextTokenizer(HFTokenizer.from_folder(DEMO_DIR / LLAMA))
    for text in ("Hello, world!", "<|im_start|>user\nhé 💥<|im_end|>", " " * 5, "x" * 3000):
        for bos in (True, False):
            assert hf.encode(text, bos=bos) == hf.hf.tokenizer.encode(text, add_special_tokens=bos).ids


def test_the_limits_measure_depth_through_refs_and_repetitions() -> None:
    assert grammar_limits.schema_depth(defs_chain(10), 128) == 33  # 3 levels a link: anyOf, its item, the $ref
    assert grammar_limits.schema_depth(defs_chain(1500), 128) == 129  # stops as soon as it is over
    tree = {"$defs": {"node": {"type": "object", "properties": {"kids": {"type": "array",
                                                                         "items": {"$ref": "#/$defs/node"}}}}},
            "$ref": "#/$defs/node"}
    assert grammar_limits.schema_depth(tree, 128) == 6  # recursion is a cycle, not depth
    assert grammar_limits.grammar_depth(lark_chain(3000), 128) == 129
    assert grammar_limits.grammar_depth('start: ("yes" | "no") DIGIT\nDIGIT: /[0-9]/', 128) == 2
    assert grammar_limits.grammar_depth('root ::= a\na ::= b "x" # c\nb ::= [a-z] root', 128) == 3
    for regex, count in [("a{1000000}", 1_000_000), ("(a{100}){100}", 10_000), ("a{5,}", 5), (r"\p{Greek}{3}", 3),
                         ("[{]{4}", 4), ("x{a}", 1)]:
        assert grammar_limits.regex_repeat(regex) == count, regex
    assert grammar_limits.regex_repeat('start: ("a" /b{100}/){10} "c{99}"', "lark") == 1000
    assert grammar_limits.regex_repeat("start: item ~ 5..70", "lark") == 70
    nested: list[Any] = []
    node = nested
    for _ in range(100_000):  # deeper than any JSON parser allows: the measure itself does not recurse
        node.append([])
        node = node[0]
    assert grammar_limits.schema_depth(nested, 128) == 129


def test_the_options_are_settings_and_refuse_zero() -> None:
    s = load_settings(["--max-grammar-depth", "64", "--grammar-timeout-s", "2.5", "--max-kserve-json-output-bytes",
                       "1000"], {"MULTIMAX_SERVE_MAX_GUIDED_CHOICES": "50"})
    assert (s.max_grammar_depth, s.grammar_timeout_s, s.max_kserve_json_output_bytes, s.max_guided_choices) == \
        (64, 2.5, 1000, 50)
    assert grammar_limits.GrammarLimits.from_settings(Settings()) == grammar_limits.DEFAULT
    for option in ("--max-grammar-bytes", "--max-grammar-depth", "--grammar-workers", "--grammar-timeout-s"):
        with pytest.raises(SystemExit):
            load_settings([option, "0"], {})


def test_the_worker_pool_survives_a_crash_and_a_timeout() -> None:
    tok = ByteTokenizer()
    spec = structured.tokenizer_spec(tok)
    small = GrammarJob("guided_regex", "regex", "[0-9]{3}")
    guard = GrammarGuard(1, 60.0)
    try:
        assert guard.check(small, spec)  # the worker started and built the tokenizer
        with pytest.raises(GrammarWorkerFailed, match="crashed"):
            guard.check(GrammarJob("guided_json", "json_schema", json.dumps(defs_chain(1500))), spec)
        assert guard.check(small._replace(source="[a-z]{2}"), spec)  # a fresh worker
        guard.timeout_s = 0.05  # its first mask alone takes longer
        with pytest.raises(GrammarWorkerFailed, match="too long"):
            guard.check(GrammarJob("guided_regex", "regex", "a{200000}"), spec)
        guard.timeout_s = 60.0
        with pytest.raises(GrammarRefused, match="regex"):
            guard.check(GrammarJob("guided_regex", "regex", "[0-9"), spec)
        assert guard.check(small._replace(source="x+"), spec)
        [worker] = guard._all
        worker.proc.kill()  # dies while idle (from outside): the next grammar gets a new one
        worker.proc.wait()
        assert guard.check(small._replace(source="y+"), spec)
    finally:
        guard.close()


def test_grammar_text_with_many_blank_lines_is_measured_in_linear_time() -> None:
    # llguidance's own Lark-or-GBNF test is quadratic in blank lines; the worker and the limits use a linear one
    text = "\n" * 60_000 + 'root ::= "a"'
    assert not grammar_limits.is_lark(text) and grammar_limits.grammar_depth(text, 128) == 1
    assert structured.processors_for({"guided_grammar": text}, ByteTokenizer())


def test_the_worker_module_imports_no_model_code() -> None:
    import subprocess
    import sys

    code = "import sys, service.protocols.grammar_worker; print(sorted(m for m in ('torch', 'starlette', " \
           "'models', 'numpy') if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         cwd=ROOT)
    assert out.stdout.strip() == "[]"
