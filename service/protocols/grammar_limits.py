"""What a structured-output grammar may be before anything compiles it.

llguidance's native compiler recurses over a grammar: a JSON schema whose `$defs` chain 1,500 anyOf/$ref links,
or 3,000 chained Lark rules, overflowed its stack and killed the whole server (issue 38); other grammars compile
but cannot run (`a{1000000}`, 20,000 choices). So a request's schema, regex, grammar or choice list is measured
here first: its size in bytes, its depth (a schema's nesting with every local `$ref` followed into what it points
at; a grammar's longest chain of rules calling rules), a choice list's length, and a regex's counted repetitions
(nested counts multiplied). Each refusal is a 400 naming the field and the Settings option that sets the limit.

Every measure here is a linear scan without recursion and without backtracking regexes: the input may be as deep
as the JSON parser allows, and this runs in the server. What a measure cannot see (a rule called inside a
repetition, a schema embedded in a grammar) is left to the worker process that compiles the grammar first
(service.protocols.grammar_guard).
"""

from __future__ import annotations

import dataclasses
import re
import urllib.parse
from collections.abc import Callable, Hashable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

from service.base.config import Settings
from service.base.errors import ServiceError, bad_request
from service.protocols.grammar_worker import is_lark

CODE = "grammar_too_complex"  # every refusal's error code
_BIG = 1 << 62  # a count too large to matter; products stop growing here
_COUNTED = re.compile(r"\{[ \t]*(\d+)[ \t]*(?:,[ \t]*(\d*)[ \t]*)?\}")  # {m}, {m,}, {m,n}: no nested quantifier
_TILDE = re.compile(r"~[ \t]*(\d+)(?:[ \t]*\.\.[ \t]*(\d+))?")  # Lark's `item ~ m` / `item ~ m..n`
_NAME_CHARS = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_-")

H = TypeVar("H", bound=Hashable)


@dataclass(frozen=True)
class GrammarLimits:
    """The Settings options that bound a grammar before it is compiled."""

    max_bytes: int = 64 * 1024
    max_depth: int = 128
    max_choices: int = 1000
    max_repeat: int = 10_000

    @classmethod
    def from_settings(cls, settings: Settings) -> GrammarLimits:
        return cls(settings.max_grammar_bytes, settings.max_grammar_depth, settings.max_guided_choices,
                   settings.max_regex_repeat)


def _defaults() -> GrammarLimits:
    fields: dict[str, Any] = {f.name: f.default for f in dataclasses.fields(Settings)}
    return GrammarLimits(fields["max_grammar_bytes"], fields["max_grammar_depth"], fields["max_guided_choices"],
                         fields["max_regex_repeat"])


DEFAULT = _defaults()  # the server's defaults, for callers without Settings (tests, benchmarks)


def _refuse(message: str, field: str) -> ServiceError:
    return bad_request(message, field, code=CODE)


# ---- size ---------------------------------------------------------------------------------------------------


def text_bytes(text: str, field: str) -> int:
    """`text`'s size in UTF-8, or a 400 for a lone surrogate (which no UTF-8, hence no grammar engine, can take)."""
    try:
        return len(text.encode("utf-8"))
    except UnicodeEncodeError:
        raise bad_request(f"{field} is not valid Unicode (lone surrogate)", field) from None


def check_size(text: str, field: str, limits: GrammarLimits) -> None:
    size = text_bytes(text, field)
    if size > limits.max_bytes:
        raise _refuse(f"{field} is {size} bytes, over the limit of {limits.max_bytes} (max_grammar_bytes)", field)


def check_choices(choices: Sequence[str], field: str, limits: GrammarLimits) -> None:
    if len(choices) > limits.max_choices:
        raise _refuse(f"{field} has {len(choices)} strings, over the limit of {limits.max_choices} "
                      "(max_guided_choices)", field)
    total = sum(text_bytes(c, field) for c in choices)
    if total > limits.max_bytes:
        raise _refuse(f"{field}'s strings are {total} bytes together, over the limit of {limits.max_bytes} "
                      "(max_grammar_bytes)", field)


# ---- depth --------------------------------------------------------------------------------------------------


def deepest(roots: Iterable[H], children: Callable[[H], Iterable[H]], limit: int) -> int:
    """The longest chain of nodes from any root through `children`, or limit + 1 as soon as one is longer than
    `limit`. A node already on the chain ends it (a recursive rule or schema adds no depth: the compiler takes a
    cycle once). Iterative: the input may be far deeper than Python's stack."""
    done: dict[H, int] = {}
    for root in roots:
        if root in done:
            continue
        best = {root: 1}  # the chains found so far below each node on the stack
        stack: list[tuple[H, Iterator[H]]] = [(root, iter(children(root)))]
        while stack:
            if len(stack) > limit:
                return limit + 1
            node, todo = stack[-1]
            for child in todo:
                if child in done:
                    best[node] = max(best[node], 1 + done[child])
                elif child not in best:  # not on the stack: descend
                    best[child] = 1
                    stack.append((child, iter(children(child))))
                    break
            else:
                stack.pop()
                done[node] = best.pop(node)
                if done[node] > limit:
                    return limit + 1
                if stack:
                    parent = stack[-1][0]
                    best[parent] = max(best[parent], 1 + done[node])
    return max(done.values(), default=0)


def _pointer(root: Any, ref: str) -> Any:
    """What a local `$ref` ("#", "#/$defs/x", "#/definitions/a~1b") points at, or None (remote refs, anchors)."""
    if not ref.startswith("#"):
        return None
    path = urllib.parse.unquote(ref[1:])
    if not path:
        return root
    if not path.startswith("/"):
        return None
    node = root
    for part in path[1:].split("/"):
        part = part.replace("~1", "/").replace("~0", "~")
        if isinstance(node, dict) and part in node:
            node = node[part]
        elif isinstance(node, list) and part.isascii() and part.isdigit() and len(part) < 10 \
                and int(part) < len(node):
            node = node[int(part)]
        else:
            return None
    return node


def schema_depth(schema: Any, limit: int) -> int:
    """How deep a JSON schema nests (objects and arrays), each local `$ref` counted as the levels of what it points
    at: the depth llguidance's compiler recurses to. limit + 1 as soon as it is deeper than `limit`."""
    nodes: dict[int, Any] = {id(schema): schema}
    targets: dict[str, Any] = {}

    def children(key: int) -> Iterator[int]:
        node = nodes[key]
        values = node.values() if isinstance(node, dict) else node
        for value in values:
            if isinstance(value, (dict, list)):
                nodes.setdefault(id(value), value)
                yield id(value)
        ref = node.get("$ref") if isinstance(node, dict) else None
        if isinstance(ref, str):
            if ref not in targets:
                targets[ref] = _pointer(schema, ref)
            target = targets[ref]
            if isinstance(target, (dict, list)):
                nodes.setdefault(id(target), target)
                yield id(target)

    return deepest([id(schema)], children, limit) if isinstance(schema, (dict, list)) else 0


def _skip_quoted(text: str, i: int, quote: str) -> int:
    """The index after the literal that opens at text[i] (a string, or a Lark /regex/), escapes honoured."""
    n = len(text)
    i += 1
    while i < n and text[i] != quote:
        if text[i] == "\n":
            return i
        i += 2 if text[i] == "\\" else 1
    return i + 1


def _skip_class(text: str, i: int) -> int:
    """The index after the character class `[...]` that opens at text[i] (nested classes, as Rust's regex)."""
    n, depth = len(text), 0
    start = i
    while i < n:
        c = text[i]
        if c == "\\":
            i += 2
            continue
        if c == "[":
            depth += 1
        elif c == "]" and i > start + 1 and not (i == start + 2 and text[start + 1] == "^"):
            depth -= 1
            if depth == 0:
                return i + 1
        i += 1
    return n


def _skip_braces(text: str, i: int) -> int:
    """The index after the balanced `{...}` (an inline JSON schema, %llguidance options) that opens at text[i]."""
    n, depth = len(text), 0
    while i < n:
        c = text[i]
        if c == '"':
            i = _skip_quoted(text, i, '"')
            continue
        depth += c == "{"
        depth -= c == "}"
        i += 1
        if depth == 0:
            return i
    return n


def grammar_rules(text: str, lark: bool) -> dict[str, list[str]]:
    """Each rule of a Lark or GBNF grammar with the names its body calls (strings, regexes, character classes,
    comments and inline JSON skipped): `name: ...`, `?name.2: ...`, `NAME: ...`, `name ::= ...`."""
    rules: dict[str, list[str]] = {}
    body: list[str] | None = None
    i, n, line_start = 0, len(text), True
    while i < n:
        c = text[i]
        if c == "\n":
            i, line_start = i + 1, True
            continue
        if c in " \t\r\f\v" or (line_start and c in "?!"):
            i += 1
            continue
        if text.startswith("//", i) or (not lark and c == "#"):
            end = text.find("\n", i)
            i = n if end < 0 else end
            continue
        first, line_start = line_start, False
        if c in "\"'" or (lark and c == "/"):
            i = _skip_quoted(text, i, c)
        elif c == "[" and not lark:
            i = _skip_class(text, i)
        elif c == "{" and not _COUNTED.match(text, i):
            i = _skip_braces(text, i)
        elif c == "%" and not text.startswith(("%json", "%llguidance"), i):
            end = text.find("\n", i)  # %import, %ignore, %declare: no rule bodies
            i = n if end < 0 else end
        elif c in _NAME_CHARS and not c.isdigit():
            j = i
            while j < n and text[j] in _NAME_CHARS:
                j += 1
            name, k = text[i:j], j
            if first:
                if k < n and text[k] == "." and lark:  # a priority: name.2 or name.-1
                    k += 1
                    while k < n and (text[k].isdigit() or text[k] == "-"):
                        k += 1
                while k < n and text[k] in " \t":
                    k += 1
            if first and (text.startswith("::=", k) or (lark and text.startswith(":", k))):
                body = rules.setdefault(name, [])
                i = k + (3 if text.startswith("::=", k) else 1)
            else:
                if body is not None:
                    body.append(name)
                i = j
        else:
            i += 1
    return rules


def grammar_depth(text: str, limit: int) -> int:
    """The longest chain of rules a Lark or GBNF grammar calls through (limit + 1 as soon as it is longer)."""
    rules = grammar_rules(text, is_lark(text))
    return deepest(rules, lambda name: (r for r in rules.get(name, ()) if r in rules), limit)


def check_schema_depth(schema: Any, field: str, limits: GrammarLimits) -> None:
    if schema_depth(schema, limits.max_depth) > limits.max_depth:
        raise _refuse(f"{field} nests more than {limits.max_depth} levels deep (objects and arrays, each $ref "
                      f"counted as the levels it leads to); the limit is {limits.max_depth} (max_grammar_depth)",
                      field)


def check_grammar(text: str, field: str, limits: GrammarLimits) -> None:
    """A Lark or GBNF grammar: its size, its longest chain of rules, its counted repetitions."""
    check_size(text, field, limits)
    if grammar_depth(text, limits.max_depth) > limits.max_depth:
        raise _refuse(f"{field} has a chain of more than {limits.max_depth} rules each calling the next; the limit "
                      f"is {limits.max_depth} (max_grammar_depth)", field)
    _check_repeat(regex_repeat(text, "lark" if is_lark(text) else "gbnf"), field, limits)


# ---- counted repetitions ------------------------------------------------------------------------------------


def _count(digits: str) -> int:
    return int(digits) if len(digits) < 16 else _BIG


def regex_repeat(text: str, dialect: str = "regex") -> int:
    """The most copies a counted repetition asks for, nested counts multiplied: a{1000} is 1,000, (a{100}){100}
    10,000, a{5,} 5 (an unbounded tail costs no more than a*). `dialect`: "regex" (Rust's syntax), or a grammar's
    ("lark": its /regexes/ too, and `item ~ m..n`; "gbnf"), whose strings and comments are skipped."""
    grammar = dialect != "regex"
    frames = [1]  # per open group: the largest count inside it so far
    last, i, n = 1, 0, len(text)  # last: the count of the atom just before i (a group's: what it holds)
    while i < n:
        c = text[i]
        atom = 1
        if c == "\\":
            if i + 2 < n and text[i + 1] in "pPxuUN" and text[i + 2] == "{":  # \p{Greek}, \x{1F600}: no count
                end = text.find("}", i + 3)
                i = n if end < 0 else end + 1
            else:
                i += 2
        elif c == "[" and dialect != "lark":
            i = _skip_class(text, i)
        elif c in "([":
            frames.append(1)
            i += 1
            last = 1
            continue
        elif c == ")" or (c == "]" and dialect == "lark"):
            atom = frames.pop() if len(frames) > 1 else 1
            frames[-1] = max(frames[-1], atom)
            i += 1
        elif c == "{" or (dialect == "lark" and c == "~"):
            found = (_COUNTED if c == "{" else _TILDE).match(text, i)
            if found is None:
                i = _skip_braces(text, i) if grammar and c == "{" else i + 1
            else:
                low, high = found.group(1), found.group(2)
                count = _count(high) if high else _count(low)
                atom = min(_BIG, last * count)
                frames[-1] = max(frames[-1], atom)
                i = found.end()
        elif grammar and (c in "\"'" or text.startswith("//", i) or (dialect == "gbnf" and c == "#")):
            if c in "\"'":
                i = _skip_quoted(text, i, c)
            else:
                end = text.find("\n", i)
                i = n if end < 0 else end
        elif dialect == "lark" and c == "/":
            end = _skip_quoted(text, i, "/")
            atom = regex_repeat(text[i + 1:end - 1])
            frames[-1] = max(frames[-1], atom)
            i = end
        else:
            i += 1
        last = atom
    return max(frames)


def _check_repeat(repeat: int, field: str, limits: GrammarLimits) -> None:
    if repeat > limits.max_repeat:
        shown = "an unbounded number of" if repeat >= _BIG else f"{repeat}"
        raise _refuse(f"{field} repeats a pattern {shown} times (counted repetitions such as {{n}}, nested ones "
                      f"multiplied), over the limit of {limits.max_repeat} (max_regex_repeat)", field)


def check_regex(text: str, field: str, limits: GrammarLimits) -> None:
    check_size(text, field, limits)
    _check_repeat(regex_repeat(text), field, limits)


def schema_patterns(schema: Any) -> Iterator[str]:
    """Every regex of a JSON schema: `pattern` values and `patternProperties` keys (walked without recursion)."""
    todo = [schema]
    while todo:
        node = todo.pop()
        if isinstance(node, Mapping):
            pattern = node.get("pattern")
            if isinstance(pattern, str):
                yield pattern
            props = node.get("patternProperties")
            if isinstance(props, Mapping):
                yield from (k for k in props if isinstance(k, str))
            todo.extend(v for v in node.values() if isinstance(v, (dict, list)))
        elif isinstance(node, list):
            todo.extend(v for v in node if isinstance(v, (dict, list)))


def check_schema(schema: Any, text: str, field: str, limits: GrammarLimits) -> None:
    """A JSON schema (parsed, and as the JSON text the compiler gets): size, depth through $refs, its regexes."""
    check_size(text, field, limits)
    check_schema_depth(schema, field, limits)
    for pattern in schema_patterns(schema):
        _check_repeat(regex_repeat(pattern), field, limits)
