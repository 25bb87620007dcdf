"""Structured output: the request fields that constrain generation to a grammar, as logits processors.

OpenAI's `response_format` (`json_object`, `json_schema`) and vLLM's `guided_json`, `guided_choice`,
`guided_regex` and `guided_grammar` (Lark or GBNF) each become one `GrammarProcessor`: before every sampling
step it masks the logits to the tokens the grammar allows after what the row has generated (eos only once the
grammar is complete, so the model can stop exactly when the output is whole). The grammar engine is llguidance
(Rust, CPU; it computes the allowed-token set over the tokenizer's token trie); this module only adapts the
project's tokenizers to it and maps request fields, and their errors, to OpenAI's 400 shape naming the field.

`processors_for(fields, tokenizer)` is what an endpoint calls (completions and chat alike).
"""

from __future__ import annotations

import json
import weakref
from collections.abc import Mapping, Sequence
from typing import Any

import llguidance
import numpy as np
import torch

from models.tokenizer import TextTokenizer
from service.base.errors import bad_request
from service.engine.sampler import LogitsProcessor

# The request fields that ask for structured output; at most one of them per request.
GUIDED_FIELDS = ("response_format", "guided_json", "guided_choice", "guided_regex", "guided_grammar")
# A grammar that needs more than this to build, or per step, is refused or fails its sequence (llguidance's
# defaults; they bound a hostile schema's cost).
LIMITS = llguidance.LLParserLimits(verbose_errors=False)


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


def _lltokenizer(tokenizer: TextTokenizer) -> llguidance.LLTokenizer:
    eos = [i for i in tokenizer.eos_ids if i is not None and i >= 0]
    if not eos:
        raise ValueError("the model's tokenizer has no end-of-sequence token, so a grammar cannot end the output")
    text = tokenizer.tokenizer_json()
    if text is not None:
        # A tokenizer.json: llguidance reads it itself (byte-level BPE, metaspace, added tokens).
        from tokenizers import Tokenizer

        copy = Tokenizer.from_str(text)
        copy.no_padding()
        copy.no_truncation()
        return llguidance.LLTokenizer(copy.to_str(), n_vocab=int(tokenizer.vocab_size), eos_token=eos)
    # The byte tokenizer (and a fairseq dictionary's): every id's bytes are known.
    return llguidance.LLTokenizer(llguidance.TokenizerWrapper(_TokenTable(tokenizer)))


_TOKENIZERS: weakref.WeakKeyDictionary[Any, llguidance.LLTokenizer | ValueError] = weakref.WeakKeyDictionary()


def lltokenizer(tokenizer: Any) -> llguidance.LLTokenizer:
    """The llguidance tokenizer of a served tokenizer, built once (it indexes the whole vocabulary); a tokenizer
    that cannot have one raises the same ValueError every time without indexing it again."""
    found = _TOKENIZERS.get(tokenizer)
    if found is None:
        try:
            found = _lltokenizer(tokenizer)
        except ValueError as exc:
            found = exc
        _TOKENIZERS[tokenizer] = found
    if isinstance(found, ValueError):
        raise found
    return found


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


# ---- request fields -------------------------------------------------------------------------------------


def _json_text(value: Any, field: str) -> str:
    """A JSON schema given as an object (or, as vLLM allows for guided_json, as its JSON text)."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as exc:
            raise bad_request(f"{field} is not valid JSON ({exc.msg})", field) from None
    if not isinstance(value, dict):
        raise bad_request(f"{field} must be a JSON schema object, not {type(value).__name__}", field)
    return json.dumps(value)


def _schema_grammar(schema: str, field: str, whitespace: str | None) -> str:
    options: Any = None if whitespace is None else {"whitespace_pattern": whitespace}
    try:
        return str(llguidance.LLMatcher.grammar_from_json_schema(schema, overrides=options))
    except ValueError as exc:
        raise bad_request(f"{field} is not a usable JSON schema: {exc}", field) from None


def _response_format(value: Any, whitespace: str | None) -> tuple[str, str] | None:
    """(grammar, field) of OpenAI's response_format, None for {"type": "text"}."""
    if not isinstance(value, Mapping):
        raise bad_request("response_format must be an object", "response_format")
    kind = value.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return _schema_grammar(json.dumps({"type": "object"}), "response_format", whitespace), "response_format"
    if kind == "json_schema":
        spec = value.get("json_schema")
        if not isinstance(spec, Mapping):
            raise bad_request("response_format.json_schema must be an object with a schema",
                              "response_format.json_schema")
        field = "response_format.json_schema.schema"
        if "schema" not in spec:
            raise bad_request(f"{field} is missing", field)
        return _schema_grammar(_json_text(spec["schema"], field), field, whitespace), field
    raise bad_request(f"response_format.type must be 'text', 'json_object' or 'json_schema', not {kind!r}",
                      "response_format.type")


def _grammar_of(name: str, value: Any, whitespace: str | None) -> tuple[str, str] | None:
    if name == "response_format":
        return _response_format(value, whitespace)
    if name == "guided_json":
        return _schema_grammar(_json_text(value, name), name, whitespace), name
    if name == "guided_choice":
        if not isinstance(value, list) or not value or not all(isinstance(c, str) and c for c in value):
            raise bad_request("guided_choice must be a non-empty list of non-empty strings", name)
        lark = "start: " + " | ".join(json.dumps(c, ensure_ascii=False) for c in value)
        return str(llguidance.LLMatcher.grammar_from_lark(lark)), name
    if name == "guided_regex":
        if not isinstance(value, str) or not value:
            raise bad_request("guided_regex must be a non-empty string", name)
        return str(llguidance.LLMatcher.grammar_from_regex(value)), name
    if name == "guided_grammar":
        if not isinstance(value, str) or not value.strip():
            raise bad_request("guided_grammar must be a non-empty Lark or GBNF grammar", name)
        try:
            return str(llguidance.grammar_from("grammar", value)), name
        except ValueError as exc:
            raise bad_request(f"guided_grammar is not a usable grammar: {exc}", name) from None
    raise AssertionError(name)


def requested(fields: Mapping[str, Any]) -> list[str]:
    """The structured-output fields a request uses (response_format {"type": "text"} is no constraint)."""
    used = [f for f in GUIDED_FIELDS if fields.get(f) is not None]
    rf = fields.get("response_format")
    if isinstance(rf, Mapping) and rf.get("type") == "text":
        used.remove("response_format")
    return used


def processors_for(fields: Mapping[str, Any], tokenizer: Any) -> tuple[LogitsProcessor, ...]:
    """The logits processors a request's fields ask for (none, or one GrammarProcessor), or a 400 naming the
    field: a bad schema, regex, grammar or choice list, two structured-output fields at once, or a field that
    cannot go with one (ignore_eos, min_tokens: the grammar decides where the output ends)."""
    used = requested(fields)
    whitespace = fields.get("guided_whitespace_pattern")
    if whitespace is not None and not isinstance(whitespace, str):
        raise bad_request("guided_whitespace_pattern must be a string", "guided_whitespace_pattern")
    if not used:
        if whitespace is not None:
            raise bad_request("guided_whitespace_pattern applies only with guided_json or response_format",
                              "guided_whitespace_pattern")
        return ()
    if len(used) > 1:
        raise bad_request(f"{used[1]} cannot be combined with {used[0]}: give one structured-output field",
                          used[1], code="conflicting_parameters")
    if whitespace is not None and used[0] not in ("guided_json", "response_format"):
        raise bad_request(f"guided_whitespace_pattern does not apply to {used[0]}", "guided_whitespace_pattern")
    for other in ("ignore_eos", "min_tokens"):
        if fields.get(other):
            raise bad_request(f"{other} cannot be combined with {used[0]}: the grammar decides where the output "
                              "ends", other, code="conflicting_parameters")
    made = _grammar_of(used[0], fields[used[0]], whitespace)
    if made is None:
        return ()
    grammar, field = made
    try:
        tok = lltokenizer(tokenizer)
    except ValueError as exc:
        raise bad_request(f"{field} cannot be used with this model: {exc}", field,
                          code="unsupported_parameter") from None
    try:
        matcher = llguidance.LLMatcher(tok, grammar, log_level=0, limits=LIMITS)
    except Exception as exc:  # llguidance reports grammar errors through is_error(); anything else is still the input's
        raise bad_request(f"{field} cannot be used: {_first_line(str(exc))}", field) from None
    if matcher.is_error():
        raise bad_request(f"{field} cannot be used: {_first_line(matcher.get_error())}", field)
    return (GrammarProcessor(matcher, int(tokenizer.vocab_size), field),)


def _first_line(text: str) -> str:
    """An engine error on one line, bounded (regex errors span several lines: the message, the caret)."""
    return " ".join(line.strip() for line in text.strip().splitlines() if line.strip())[:300] or "invalid"
