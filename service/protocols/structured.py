"""Structured output: the request fields that constrain generation to a grammar, as logits processors.

OpenAI's `response_format` (`json_object`, `json_schema`) and vLLM's `guided_json`, `guided_choice`,
`guided_regex` and `guided_grammar` (Lark or GBNF) each become one `GrammarProcessor`: before every sampling
step it masks the logits to the tokens the grammar allows after what the row has generated (eos only once the
grammar is complete, so the model can stop exactly when the output is whole). The grammar engine is llguidance
(Rust, CPU; it computes the allowed-token set over the tokenizer's token trie); this module only adapts the
project's tokenizers to it and maps request fields, and their errors, to OpenAI's 400 shape naming the field.

A request's grammar is measured before anything compiles it (service.protocols.grammar_limits), then compiled and
probed in a worker process (service.protocols.grammar_guard, service.protocols.grammar_worker): a grammar that
would crash or stall llguidance's native compiler, or that cannot run, is that request's 400 before it is
admitted, never the server's end nor a 500 mid-stream.

`processors_for_request(fields, tokenizer, settings)` is what an endpoint awaits (completions and chat alike);
`processors_for(fields, tokenizer)` does the same in-process and synchronously, for tools and tests.
`compile_job` / `compile_here` compile a grammar built elsewhere the same two ways (tool calling's,
service.protocols.tools).
"""

from __future__ import annotations

import asyncio
import json
import uuid
import weakref
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Generic, TypeVar

import llguidance
import numpy as np
import torch

from models.tokenizer import TextTokenizer
from service.base.config import Settings
from service.base.errors import ServiceError, bad_request
from service.engine.text.sampler import LogitsProcessor
from service.protocols import grammar_guard, grammar_limits, grammar_worker
from service.protocols.grammar_limits import GrammarLimits
from service.protocols.grammar_worker import GrammarJob, GrammarRefused, TokenizerSpec

# The request fields that ask for structured output; at most one of them per request.
GUIDED_FIELDS = ("response_format", "guided_json", "guided_choice", "guided_regex", "guided_grammar")
LIMITS = grammar_worker.LIMITS  # llguidance's own bounds on a grammar's size and per-step work


class StructuredOutputError(RuntimeError):
    """The grammar cannot go on (no token allowed, or the row took a token the grammar refuses)."""


# ---- tokenizers -----------------------------------------------------------------------------------------


# What a grammar's literal text needs as tokens of their own: tab, newline, carriage return and printable ASCII.
SPELLING_BYTES = (9, 10, 13, *range(32, 127))


class _TokenTable:
    """A tokenizer as llguidance's TokenizerWrapper wants it: each id's bytes, specials by name, encode."""

    def __init__(self, tokenizer: TextTokenizer) -> None:
        self._tokenizer = tokenizer
        size = int(tokenizer.vocab_size)
        self.tokens: list[bytes] = []
        self.special_token_ids: list[int] = []
        for i in range(size):
            data = tokenizer.decode_bytes([i])
            if not data:  # a special token: no text of its own
                self.special_token_ids.append(i)
                data = tokenizer.decode([i], skip_special=False).encode("utf-8") or f"<special_{i}>".encode()
            self.tokens.append(data)
        spelled = {t for t in self.tokens if len(t) == 1}
        missing = [b for b in SPELLING_BYTES if bytes([b]) not in spelled]
        if missing:  # a word-level dictionary: a grammar's literal text could not be written token by token
            raise ValueError(f"its vocabulary has no token for {len(missing)} of the {len(SPELLING_BYTES)} ASCII "
                             f"characters (e.g. {bytes([missing[0]])!r}), so it cannot spell a grammar's text "
                             "(a word-level dictionary)")
        self.eos_token_id = tokenizer.eos_id
        self.bos_token_id = tokenizer.bos_id if tokenizer.bos_id >= 0 else None  # -1: the tokenizer has none
        self._specials = set(self.special_token_ids)

    def __call__(self, text: str) -> list[int]:
        return [t for t in self._tokenizer.encode(text) if t not in self._specials]


def _end_ids(tokenizer: TextTokenizer) -> list[int]:
    eos = [i for i in tokenizer.eos_ids if i is not None and i >= 0]
    if not eos:
        raise ValueError("the model's tokenizer has no end-of-sequence token, so a grammar cannot end the output")
    return eos


def _tokenizer_json(tokenizer: TextTokenizer) -> str | None:
    """The tokenizer.json as llguidance reads it (byte-level BPE, metaspace, added tokens), or None."""
    text = tokenizer.tokenizer_json()
    if text is None:
        return None
    from tokenizers import Tokenizer

    copy = Tokenizer.from_str(text)
    copy.no_padding()
    copy.no_truncation()
    return str(copy.to_str())


def _lltokenizer(tokenizer: TextTokenizer) -> llguidance.LLTokenizer:
    eos = _end_ids(tokenizer)
    text = _tokenizer_json(tokenizer)
    if text is not None:
        return llguidance.LLTokenizer(text, n_vocab=int(tokenizer.vocab_size), eos_token=eos)
    # The byte tokenizer (and a fairseq dictionary's): every id's bytes are known.
    return llguidance.LLTokenizer(llguidance.TokenizerWrapper(_TokenTable(tokenizer)))


def _spec(tokenizer: TextTokenizer) -> TokenizerSpec:
    """The same tokenizer as picklable data, for the grammar worker (service.protocols.grammar_worker)."""
    eos, key, size = _end_ids(tokenizer), uuid.uuid4().hex, int(tokenizer.vocab_size)
    text = _tokenizer_json(tokenizer)
    if text is not None:
        return TokenizerSpec(key, size, tuple(eos), json=text)
    table = _TokenTable(tokenizer)
    return TokenizerSpec(key, size, (table.eos_token_id,), tokens=tuple(table.tokens),
                         special_ids=tuple(table.special_token_ids), bos=table.bos_token_id)


T = TypeVar("T")


class _PerTokenizer(Generic[T]):
    """What is built once per served tokenizer (it indexes the whole vocabulary): a tokenizer that cannot have
    one raises the same ValueError every time without being indexed again."""

    def __init__(self, build: Callable[[Any], T]) -> None:
        self._build = build
        self._made: weakref.WeakKeyDictionary[Any, T | ValueError] = weakref.WeakKeyDictionary()

    def __call__(self, tokenizer: Any) -> T:
        found = self._made.get(tokenizer)
        if found is None:
            try:
                found = self._build(tokenizer)
            except ValueError as exc:
                found = exc
            self._made[tokenizer] = found
        if isinstance(found, ValueError):
            raise found
        return found


# The llguidance tokenizer of a served tokenizer, and the same as the grammar worker builds it.
lltokenizer: _PerTokenizer[llguidance.LLTokenizer] = _PerTokenizer(_lltokenizer)
tokenizer_spec: _PerTokenizer[TokenizerSpec] = _PerTokenizer(_spec)


# ---- the processor --------------------------------------------------------------------------------------


class GrammarProcessor:
    """Masks a row's logits to what the grammar allows next.

    One processor serves every sequence of a request (n, best_of, several prompts): it keeps one matcher per
    distinct generated prefix and advances the one whose tokens are a prefix of the row's, so each row costs
    one token's advance a step; a row that diverged from all of them gets a fresh matcher replayed once."""

    def __init__(self, matcher: llguidance.LLMatcher, vocab_size: int, field: str) -> None:
        self._template = matcher
        self._vocab = vocab_size
        self.field = field
        self._states: list[tuple[list[int], llguidance.LLMatcher]] = []

    def _matcher_for(self, generated: Sequence[int]) -> llguidance.LLMatcher:
        n = len(generated)
        best: tuple[list[int], llguidance.LLMatcher] | None = None
        for state in self._states:
            done = state[0]
            if len(done) <= n and (not done or done[-1] == generated[len(done) - 1]) \
                    and list(generated[:len(done)]) == done and (best is None or len(done) > len(best[0])):
                best = state
        if best is None:
            best = ([], self._template.deep_copy())
            self._states.append(best)
        done, matcher = best
        new = [int(t) for t in generated[len(done):]]
        if new and not matcher.consume_tokens(new):
            raise StructuredOutputError(f"{self.field}: the sequence left the grammar "
                                        f"({matcher.get_error() or 'token refused'})")
        done.extend(new)
        return matcher

    def allowed(self, generated: Sequence[int]) -> torch.Tensor:
        """A bool mask over the tokenizer's vocabulary."""
        matcher = self._matcher_for(generated)
        if matcher.is_error():
            raise StructuredOutputError(f"{self.field}: {matcher.get_error()}")
        words = np.frombuffer(matcher.compute_bitmask(), dtype=np.uint8)
        bits = np.unpackbits(words, bitorder="little")[:self._vocab]  # bit j of word i: token 32 i + j
        return torch.from_numpy(bits.astype(np.bool_))

    def __call__(self, generated: Sequence[int], logits: torch.Tensor) -> torch.Tensor:
        allowed = self.allowed(generated)
        size = logits.shape[-1]
        keep = torch.zeros(size, dtype=torch.bool)
        m = min(size, allowed.shape[0])
        keep[:m] = allowed[:m]  # ids past the tokenizer's vocabulary (padded heads) are never allowed
        if not bool(keep.any()):
            raise StructuredOutputError(f"{self.field}: no token of this vocabulary can continue the output")
        return logits.masked_fill(~keep, float("-inf"))


# ---- request fields -> a grammar job ----------------------------------------------------------------------


def _json_text(value: Any, field: str) -> tuple[Any, str]:
    """A JSON schema given as an object (or, as vLLM allows for guided_json, as its JSON text): (schema, text)."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as exc:
            raise bad_request(f"{field} is not valid JSON ({exc.msg})", field) from None
        except RecursionError:
            raise bad_request(f"{field} is nested too deeply", field, code=grammar_limits.CODE) from None
    if not isinstance(value, dict):
        raise bad_request(f"{field} must be a JSON schema object, not {type(value).__name__}", field)
    try:
        return value, json.dumps(value)
    except RecursionError:
        raise bad_request(f"{field} is nested too deeply", field, code=grammar_limits.CODE) from None


def _schema_job(value: Any, field: str, whitespace: str | None, limits: GrammarLimits) -> GrammarJob:
    if isinstance(value, str):  # JSON text: bounded before it is parsed
        grammar_limits.check_size(value, field, limits)
    schema, text = _json_text(value, field)
    grammar_limits.check_schema(schema, text, field, limits)
    return GrammarJob(field, "json_schema", text, whitespace)


def _response_format(value: Any, whitespace: str | None, limits: GrammarLimits) -> GrammarJob | None:
    """The job of OpenAI's response_format, None for {"type": "text"}."""
    if not isinstance(value, Mapping):
        raise bad_request("response_format must be an object", "response_format")
    kind = value.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return _schema_job({"type": "object"}, "response_format", whitespace, limits)
    if kind == "json_schema":
        spec = value.get("json_schema")
        if not isinstance(spec, Mapping):
            raise bad_request("response_format.json_schema must be an object with a schema",
                              "response_format.json_schema")
        field = "response_format.json_schema.schema"
        if "schema" not in spec:
            raise bad_request(f"{field} is missing", field)
        return _schema_job(spec["schema"], field, whitespace, limits)
    raise bad_request(f"response_format.type must be 'text', 'json_object' or 'json_schema', not {kind!r}",
                      "response_format.type")


def _job_of(name: str, value: Any, whitespace: str | None, limits: GrammarLimits) -> GrammarJob | None:
    if name == "response_format":
        return _response_format(value, whitespace, limits)
    if name == "guided_json":
        return _schema_job(value, name, whitespace, limits)
    if name == "guided_choice":
        if not isinstance(value, list) or not value or not all(isinstance(c, str) and c for c in value):
            raise bad_request("guided_choice must be a non-empty list of non-empty strings", name)
        grammar_limits.check_choices(value, name, limits)
        return GrammarJob(name, "lark", "start: " + " | ".join(json.dumps(c, ensure_ascii=False) for c in value))
    if name == "guided_regex":
        if not isinstance(value, str) or not value:
            raise bad_request("guided_regex must be a non-empty string", name)
        grammar_limits.check_regex(value, name, limits)
        return GrammarJob(name, "regex", value)
    if name == "guided_grammar":
        if not isinstance(value, str) or not value.strip():
            raise bad_request("guided_grammar must be a non-empty Lark or GBNF grammar", name)
        grammar_limits.check_grammar(value, name, limits)
        return GrammarJob(name, "grammar", value)
    raise AssertionError(name)


def requested(fields: Mapping[str, Any]) -> list[str]:
    """The structured-output fields a request uses (response_format {"type": "text"} is no constraint)."""
    used = [f for f in GUIDED_FIELDS if fields.get(f) is not None]
    rf = fields.get("response_format")
    if isinstance(rf, Mapping) and rf.get("type") == "text":
        used.remove("response_format")
    return used


def grammar_job(fields: Mapping[str, Any], limits: GrammarLimits = grammar_limits.DEFAULT) -> GrammarJob | None:
    """The grammar a request's fields ask for (None: no constraint), measured against `limits`, or a 400 naming
    the field: a bad or too large schema, regex, grammar or choice list, two structured-output fields at once, or
    a field that cannot go with one (ignore_eos, min_tokens: the grammar decides where the output ends)."""
    used = requested(fields)
    whitespace = fields.get("guided_whitespace_pattern")
    if whitespace is not None and not isinstance(whitespace, str):
        raise bad_request("guided_whitespace_pattern must be a string", "guided_whitespace_pattern")
    if not used:
        if whitespace is not None:
            raise bad_request("guided_whitespace_pattern applies only with guided_json or response_format",
                              "guided_whitespace_pattern")
        return None
    if len(used) > 1:
        raise bad_request(f"{used[1]} cannot be combined with {used[0]}: give one structured-output field",
                          used[1], code="conflicting_parameters")
    if whitespace is not None and used[0] not in ("guided_json", "response_format"):
        raise bad_request(f"guided_whitespace_pattern does not apply to {used[0]}", "guided_whitespace_pattern")
    for other in ("ignore_eos", "min_tokens"):
        if fields.get(other):
            raise bad_request(f"{other} cannot be combined with {used[0]}: the grammar decides where the output "
                              "ends", other, code="conflicting_parameters")
    if whitespace is not None:
        grammar_limits.check_regex(whitespace, "guided_whitespace_pattern", limits)
    return _job_of(used[0], fields[used[0]], whitespace, limits)


def _unsupported(field: str, exc: ValueError) -> ServiceError:
    return bad_request(f"{field} cannot be used with this model: {exc}", field, code="unsupported_parameter")


def _refused(job: GrammarJob, exc: GrammarRefused) -> ServiceError:
    return bad_request(f"{job.field} {exc.reason}", job.field)


# ---- processors ---------------------------------------------------------------------------------------------


def processors_for(fields: Mapping[str, Any], tokenizer: Any,
                   limits: GrammarLimits = grammar_limits.DEFAULT) -> tuple[LogitsProcessor, ...]:
    """The logits processors a request's fields ask for (none, or one GrammarProcessor), judged and compiled in
    this process and thread (tools and tests; the server awaits `processors_for_request`), or a 400 naming the
    field (`grammar_job`'s, and a grammar llguidance refuses or that cannot take its first tokens)."""
    job = grammar_job(fields, limits)
    if job is None:
        return ()
    try:
        return (GrammarProcessor(compile_here(job, tokenizer), int(tokenizer.vocab_size), job.field),)
    except GrammarRefused as exc:
        raise _refused(job, exc) from None
    except ValueError as exc:
        raise _unsupported(job.field, exc) from None


def compile_here(job: GrammarJob, tokenizer: Any) -> llguidance.LLMatcher:
    """The job's matcher over `tokenizer`, compiled and probed in this process and thread: GrammarRefused for a
    grammar llguidance refuses or that cannot take its first tokens, ValueError for a tokenizer that cannot have
    a grammar (a word-level dictionary, no end token)."""
    tok = lltokenizer(tokenizer)
    try:
        grammar = grammar_worker.compile_grammar(job)
    except GrammarRefused:
        raise
    except Exception as exc:  # as the worker answers it: still the grammar's doing
        raise GrammarRefused(f"cannot be used: {grammar_worker.first_line(str(exc))}") from None
    made = grammar_worker.matcher(tok, grammar)
    grammar_worker.probe(made.deep_copy(), tok)
    return made


def _plan(fields: Mapping[str, Any], tokenizer: Any, limits: GrammarLimits) -> tuple[GrammarJob, TokenizerSpec] | None:
    job = grammar_job(fields, limits)
    if job is None:
        return None
    try:
        return job, tokenizer_spec(tokenizer)
    except ValueError as exc:
        raise _unsupported(job.field, exc) from None


def _server_matcher(tokenizer: Any, grammar: str) -> llguidance.LLMatcher:
    return grammar_worker.matcher(lltokenizer(tokenizer), grammar)


async def compile_job(job: GrammarJob, tokenizer: Any, settings: Settings,
                      spec: TokenizerSpec | None = None) -> llguidance.LLMatcher:
    """The job's matcher as the server compiles a grammar, never on the event loop: compiled and probed in a
    worker process first (a crash or a timeout there is GrammarRefused: grammar_guard.GrammarWorkerFailed), then
    compiled again here on the grammar build thread (its stack twice the worker's). GrammarRefused for a grammar
    that cannot be used, ValueError for a tokenizer that cannot have one (`spec`: the tokenizer's, if known)."""
    if spec is None:
        spec = await asyncio.to_thread(tokenizer_spec, tokenizer)
    guard = grammar_guard.guard_for(settings.grammar_workers, settings.grammar_timeout_s)
    grammar = await asyncio.to_thread(guard.check, job, spec)
    return await asyncio.get_running_loop().run_in_executor(grammar_guard.builder(), _server_matcher, tokenizer,
                                                            grammar)


async def processors_for_request(fields: Mapping[str, Any], tokenizer: Any,
                                 settings: Settings) -> tuple[LogitsProcessor, ...]:
    """`processors_for` as the server runs it, never on the event loop: the fields measured on a thread, the
    grammar compiled and probed in a worker process (a crash or a timeout there is this request's 400), then
    compiled again here on the grammar build thread (`compile_job`)."""
    planned = await asyncio.to_thread(_plan, fields, tokenizer, GrammarLimits.from_settings(settings))
    if planned is None:
        return ()
    job, spec = planned
    try:
        made = await compile_job(job, tokenizer, settings, spec)
    except GrammarRefused as exc:
        raise _refused(job, exc) from None
    return (GrammarProcessor(made, int(tokenizer.vocab_size), job.field),)
