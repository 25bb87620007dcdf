"""Compiling a request's grammar with llguidance, and the worker process that does it first.

`check(job, tokenizer)` is the whole judgement of a grammar: llguidance turns the request's schema, regex, Lark /
GBNF grammar or choice list into its grammar (`compile_grammar`), builds a matcher over the model's tokenizer, and
`probe` takes its first steps (the first token mask must allow a token, and the grammar must survive the first
tokens: a{1000000} or 20,000 choices compile, then fail at the second token). A grammar that fails any of it is
`GrammarRefused`, a 400 naming the field.

The server runs `check` here first, in a process of its own (`python -m service.protocols.grammar_worker`, driven
by service.protocols.grammar_guard): a grammar that overflows llguidance's native stack kills only this process,
one that runs too long is killed with it. Jobs arrive pickled over a pipe, answers go back as JSON; it imports only
llguidance and the standard library, and builds each model's tokenizer once from a `TokenizerSpec` (an
LLTokenizer cannot be pickled). Compilation runs on a thread with WORKER_STACK bytes of stack: the server compiles
the same grammar again on a thread with twice that (grammar_guard.BUILD_STACK), so what passed here passes there.
"""

from __future__ import annotations

import json
import signal
import sys
import threading
from collections import OrderedDict
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any, NamedTuple

import llguidance
from llguidance.gbnf_to_lark import gbnf_to_lark

WORKER_STACK = 8 * 1024 * 1024  # a thread's default on Linux; the compiler overflowed it at ~2,200 schema levels
PROBE_TOKENS = 2  # tokens the probe takes after the first mask (each followed by the next mask)
TOKENIZER_CACHE = 8  # tokenizers a worker keeps (one per served model)
# A grammar that needs more than this to build, or per step, is refused or fails its sequence (llguidance's
# defaults; they bound a hostile schema's cost). verbose_errors off: no grammar internals in error messages.
LIMITS = llguidance.LLParserLimits(verbose_errors=False)


class GrammarRefused(ValueError):
    """The grammar cannot be used; `reason` follows the field's name in the 400's message."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


class GrammarJob(NamedTuple):
    """One request's grammar: the field it came from, its kind ("json_schema", "regex", "lark", "grammar" for
    Lark or GBNF) and text, and for a JSON schema the whitespace pattern between its tokens."""

    field: str
    kind: str
    source: str
    whitespace: str | None = None


@dataclass(frozen=True)
class TokenizerSpec:
    """What an LLTokenizer is built from, as picklable data: a tokenizer.json's text, or each id's bytes.
    `key` names it in a worker's cache (the text goes over the pipe only to a worker without it)."""

    key: str
    n_vocab: int
    eos: tuple[int, ...]
    json: str | None = None
    tokens: tuple[bytes, ...] = ()
    special_ids: tuple[int, ...] = ()
    bos: int | None = None


class _SpecTable:
    """A byte table as llguidance's TokenizerWrapper wants it. Encoding (used by the compiler for literals, never
    for a mask) is greedy longest-match over the table: the worker has no model tokenizer to ask."""

    def __init__(self, spec: TokenizerSpec) -> None:
        self.tokens = list(spec.tokens)
        self.special_token_ids = list(spec.special_ids)
        self.eos_token_id = spec.eos[0]
        self.bos_token_id = spec.bos
        specials = set(spec.special_ids)
        self._ids = {t: i for i, t in enumerate(self.tokens) if i not in specials and t}
        self._longest = max((len(t) for t in self._ids), default=1)

    def __call__(self, text: str) -> list[int]:
        data, out, i = text.encode("utf-8", "surrogatepass"), [], 0
        while i < len(data):
            for size in range(min(self._longest, len(data) - i), 0, -1):
                found = self._ids.get(data[i:i + size])
                if found is not None:
                    out.append(found)
                    i += size
                    break
            else:
                i += 1  # a byte no token holds alone: skipped
        return out


def build_lltokenizer(spec: TokenizerSpec) -> llguidance.LLTokenizer:
    if spec.json is not None:
        return llguidance.LLTokenizer(spec.json, n_vocab=spec.n_vocab, eos_token=list(spec.eos))
    return llguidance.LLTokenizer(llguidance.TokenizerWrapper(_SpecTable(spec)))


def first_line(text: str) -> str:
    """An engine error on one line, bounded (regex errors span several lines: the message, the caret)."""
    return " ".join(line.strip() for line in text.strip().splitlines() if line.strip())[:300] or "invalid"


# ---- the judgement of a grammar -----------------------------------------------------------------------------


def compile_grammar(job: GrammarJob) -> str:
    """llguidance's grammar for the job's text (no tokenizer yet); GrammarRefused for text it cannot read."""
    if job.kind == "json_schema":
        options: Any = None if job.whitespace is None else {"whitespace_pattern": job.whitespace}
        try:
            return str(llguidance.LLMatcher.grammar_from_json_schema(job.source, overrides=options))
        except ValueError as exc:
            raise GrammarRefused(f"is not a usable JSON schema: {exc}") from None
    if job.kind == "lark":
        return str(llguidance.LLMatcher.grammar_from_lark(job.source))
    if job.kind == "regex":
        return str(llguidance.LLMatcher.grammar_from_regex(job.source))
    if job.kind == "grammar":
        try:  # what llguidance.grammar_from("grammar", ...) does, with a linear test for Lark (is_lark)
            lark = job.source if is_lark(job.source) else gbnf_to_lark(job.source)
        except Exception as exc:  # the converter's own parse errors
            raise GrammarRefused(f"is not a usable grammar: Failed to convert the grammar from GBNF to Lark: "
                                 f"{exc}") from None
        return str(llguidance.LLMatcher.grammar_from_lark(lark))
    raise AssertionError(job.kind)


def is_lark(text: str) -> bool:
    """llguidance's own test (a line starting `start:` or `%llguidance`: Lark; otherwise GBNF), line by line:
    its regex, `(?m)^\\s*(...)`, is quadratic in blank lines (64 KiB of newlines: about 30 s)."""
    for line in text.splitlines():
        stripped = line.lstrip()
        if stripped.startswith("%llguidance") and not (stripped[11:12].isalnum() or stripped[11:12] == "_"):
            return True
        if stripped.startswith("start") and stripped[5:].lstrip(" \t\f\v").startswith(":"):
            return True
    return False


def matcher(tokenizer: llguidance.LLTokenizer, grammar: str) -> llguidance.LLMatcher:
    """The grammar's matcher over the tokenizer (its compilation); GrammarRefused for a grammar error."""
    try:
        made = llguidance.LLMatcher(tokenizer, grammar, log_level=0, limits=LIMITS)
    except Exception as exc:  # llguidance reports grammar errors through is_error(); anything else is still the input's
        raise GrammarRefused(f"cannot be used: {first_line(str(exc))}") from None
    if made.is_error():
        raise GrammarRefused(f"cannot be used: {first_line(made.get_error())}")
    return made


def _allowed(mask: bytes, skip: frozenset[int], n_vocab: int) -> int | None:
    """The lowest token id the mask allows that is not in `skip` (bit j of byte i: token 8 i + j)."""
    start = 0
    while True:
        rest = mask[start:].lstrip(b"\0")
        if not rest:
            return None
        byte = len(mask) - len(rest)
        for bit in range(8):
            token = 8 * byte + bit
            if rest[0] >> bit & 1 and token < n_vocab and token not in skip:
                return token
        start = byte + 1


def probe(made: llguidance.LLMatcher, tokenizer: llguidance.LLTokenizer, steps: int = PROBE_TOKENS) -> None:
    """The grammar's first steps on `made` (a matcher to use up): the first mask allows some token, and taking
    the lowest allowed token that is not an end `steps` times leaves it working. GrammarRefused otherwise."""
    ends = frozenset(tokenizer.eos_tokens)
    for step in range(steps + 1):
        mask = bytes(made.compute_bitmask())
        if made.is_error():
            raise GrammarRefused(f"cannot be used: {first_line(made.get_error())}")
        token = _allowed(mask, ends, tokenizer.vocab_size)
        if token is None:
            if step == 0 and _allowed(mask, frozenset(), tokenizer.vocab_size) is None:
                raise GrammarRefused("cannot be used with this model: no token of its vocabulary can start the "
                                     "output")
            return  # only an end is allowed: the output may be complete
        if step == steps:
            return
        if not made.consume_token(token) or made.is_error():
            raise GrammarRefused(f"cannot be used: {first_line(made.get_error() or 'token refused')}")


def check(job: GrammarJob, tokenizer: llguidance.LLTokenizer) -> str:
    """The job's grammar once it compiled over `tokenizer` and took its first steps; GrammarRefused otherwise."""
    grammar = compile_grammar(job)
    probe(matcher(tokenizer, grammar), tokenizer)
    return grammar


# ---- the worker process -------------------------------------------------------------------------------------


def _answer(answers: Connection, *answer: str) -> None:
    # JSON, not pickle: the server never unpickles what the process that handles hostile input wrote
    answers.send_bytes(json.dumps(answer).encode())


def _serve(jobs: Connection, answers: Connection) -> None:
    """Answer each pickled (key, spec or None, job) from the server with ["ok", grammar], ["refused", reason] or
    ["need_tokenizer"]."""
    tokenizers: OrderedDict[str, llguidance.LLTokenizer] = OrderedDict()
    while True:
        try:
            key, spec, job = jobs.recv()
        except EOFError:  # the server closed the pipe (or exited): so does the worker
            return
        tok = tokenizers.get(key)
        if tok is None and spec is None:
            _answer(answers, "need_tokenizer")
            continue
        try:
            if tok is None:
                tok = tokenizers[key] = build_lltokenizer(spec)
                while len(tokenizers) > TOKENIZER_CACHE:
                    tokenizers.popitem(last=False)
            tokenizers.move_to_end(key)
            _answer(answers, "ok", check(GrammarJob(*job), tok))
        except GrammarRefused as exc:
            _answer(answers, "refused", exc.reason)
        except Exception as exc:  # whatever else llguidance raises on this input: still the input's
            _answer(answers, "refused", f"cannot be used: {first_line(str(exc))}")


def main(argv: list[str]) -> int:
    """`python -m service.protocols.grammar_worker JOBS_FD ANSWERS_FD`."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the whole process group: the server decides
    jobs = Connection(int(argv[1]), writable=False)
    answers = Connection(int(argv[2]), readable=False)
    threading.stack_size(WORKER_STACK)
    worker = threading.Thread(target=_serve, args=(jobs, answers), name="grammar-worker")
    worker.start()
    worker.join()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
