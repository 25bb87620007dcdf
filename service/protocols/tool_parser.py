"""A reply's text split into its content and its tool calls, as the text arrives (`CallParser.feed`, for a stream)
or at once (`parse_calls`, the same parser over the whole text, so a stream and a whole answer agree).

The parser follows a `CallSyntax` (service.protocols.tool_grammar). Text before the syntax's trigger is content;
content never ends with what may still become the trigger, and the blanks right before a trigger are dropped. From
the trigger on, each call object `{"name": "f", "arguments": ...}` (or "parameters") gives a call as soon as its
name is whole, then its arguments' raw JSON text piece by piece as it grows (a stream's argument fragments), and
the call is complete when its object closes. The grammar writes calls in exactly that form; text the model wrote
unconstrained (the benchmark's parse-after-the-fact baseline) may order the keys otherwise: such a call is parsed
once its object is whole (json.loads), its arguments re-serialized. A call region that does not follow the
syntax ends the calls: the text from there on is content. A call still open when the reply ends (max_tokens) is
not complete: `parse_calls` returns its text as content, a stream has already sent its beginning.
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal

from service.protocols.tool_grammar import CallSyntax

BLANK = " \t\r\n"
ARGS_KEYS = ('"arguments"', '"parameters"')
_SCALAR = re.compile(r"-?(?:0|[1-9]\d*)(?:\.\d+)?(?:[eE][+-]?\d+)?|true|false|null")
_NEED, _NO = -1, -2  # what _words returns when the text ends too soon, or does not match


def new_call_id() -> str:
    """OpenAI's shape: call_ and 24 random characters."""
    return "call_" + uuid.uuid4().hex[:24]


@dataclass
class ToolCall:
    """One call: its id, the function's name and its arguments' JSON text (so far, while not `complete`)."""

    id: str
    name: str
    arguments: str = ""
    complete: bool = False
    start: int = 0  # where its call object starts in the reply's text

    def openai(self) -> dict[str, object]:
        """As OpenAI's chat API returns it in `message.tool_calls`."""
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


@dataclass(frozen=True)
class Delta:
    """A stream's news: `content` text, a new `call` (index, id, name) or `arguments` text of call `index`."""

    kind: Literal["content", "call", "arguments"]
    text: str = ""
    index: int = 0
    id: str = ""
    name: str = ""


def _skip_blank(text: str, i: int) -> int:
    while i < len(text) and text[i] in BLANK:
        i += 1
    return i


def _words(text: str, i: int, words: tuple[str, ...]) -> int:
    """Where `words` (any blanks between and before them) end when they start at i; _NEED or _NO."""
    for word in words:
        i = _skip_blank(text, i)
        rest = text[i:i + len(word)]
        if rest == word:
            i += len(word)
        elif word.startswith(rest):
            return _NEED
        else:
            return _NO
    return i


def _string_end(text: str, i: int) -> int:
    """The end of the JSON string starting at text[i] == '"', or _NEED."""
    j = i + 1
    while j < len(text):
        c = text[j]
        if c == "\\":
            j += 2
            continue
        if c == '"':
            return j + 1
        j += 1
    return _NEED


class JsonScanner:
    """Finds where one JSON value that starts at `start` ends, resuming where it left off as the text grows."""

    def __init__(self, start: int) -> None:
        self.start = start
        self.pos = start
        self.depth = 0
        self.in_string = False
        self.escaped = False
        self.end: int | None = None

    def advance(self, text: str, final: bool) -> int | None:
        """The end of the value (just past it) once it is whole, else None."""
        if self.end is not None:
            return self.end
        if self.pos == self.start:
            if self.start >= len(text):
                return None
            if text[self.start] not in "{[\"":  # a number, true, false or null: whole when followed by something
                m = _SCALAR.match(text, self.start)
                if m and (m.end() < len(text) or final):
                    self.end = m.end()
                return self.end
        i, depth, in_string, escaped = self.pos, self.depth, self.in_string, self.escaped
        while i < len(text):
            c = text[i]
            i += 1
            if in_string:
                if escaped:
                    escaped = False
                elif c == "\\":
                    escaped = True
                elif c == '"':
                    in_string = False
                    if depth == 0:
                        self.end = i
                        break
            elif c == '"':
                in_string = True
            elif c in "{[":
                depth += 1
            elif c in "}]":
                depth -= 1
                if depth == 0:
                    self.end = i
                    break
        self.pos, self.depth, self.in_string, self.escaped = i, depth, in_string, escaped
        return self.end


@dataclass
class _Region:
    """The calls after one trigger: where they start in the text, and where the scan stands."""

    base: int  # first call's index in the reply
    pos: int  # the scan's position in the text (the start of the element it waits for)
    trigger_at: int  # where the trigger (or, without one, the first call object) starts
    state: Literal["open", "head", "args", "tail", "loose", "after"] = "open"
    obj: int = 0  # the current call object's start
    scanner: JsonScanner | None = None
    calls: list[ToolCall] = field(default_factory=list)


class CallParser:
    """One reply's content and calls, fed its text as it arrives (`feed`); `content` is what has been given out."""

    def __init__(self, syntax: CallSyntax, new_id: Callable[[], str] = new_call_id) -> None:
        self.syntax, self.new_id = syntax, new_id
        self.text = ""
        self.calls: list[ToolCall] = []
        self.content = ""
        self._sent = 0  # text[:_sent] is given out (as content) or belongs to calls
        self._mode: Literal["start", "text", "calls", "plain"] = "text" if syntax.trigger else "start"
        self._region: _Region | None = None
        self._args_sent: dict[int, int] = {}

    def feed(self, text: str, final: bool = False) -> list[Delta]:
        """The news once `text` follows what came before (`final`: the reply ends with it)."""
        self.text += text
        out: list[Delta] = []
        while True:
            if self._mode == "start":  # llama3_json: calls only when the reply starts with "{"
                i = _skip_blank(self.text, 0)
                if i == len(self.text) and not final:
                    break
                if i < len(self.text) and self.text[i] == "{":
                    self._sent = i  # blanks before the calls are not content
                    self._region = _Region(len(self.calls), i, i, "head", obj=i)
                    self._mode = "calls"
                else:
                    self._mode = "plain"
                continue
            if self._mode == "calls":
                assert self._region is not None
                end = self._scan(self._region, final, out)
                if end is None:
                    break
                self._sent, self._region = end, None
                if self._mode == "calls":  # (a region that broke off left "plain": the rest is content)
                    self._mode = "text" if self.syntax.trigger else "plain"
                continue
            # text: content up to a trigger (or what may still become one)
            found = self.text.find(self.syntax.trigger, self._sent) if self._mode == "text" else -1
            if found >= 0:
                self._content(self.text[self._sent:found].rstrip(BLANK), out)
                self._sent = found + len(self.syntax.trigger)
                self._region = _Region(len(self.calls), self._sent, found)
                self._mode = "calls"
                continue
            upto = len(self.text) if final or self._mode == "plain" else self._safe_end()
            rest = self.text[self._sent:upto].strip(BLANK)
            if not (final and self.calls and (not rest or self.syntax.trigger.startswith(rest))):
                self._content(self.text[self._sent:upto], out)  # (after calls: not blanks, nor a cut-off trigger)
            self._sent = upto
            break
        return out

    def _safe_end(self) -> int:
        """How far content may go: not into a partial trigger at the end, nor the blanks before it."""
        text, trigger = self.text, self.syntax.trigger
        end = len(text)
        for k in range(min(len(trigger) - 1, end - self._sent), 0, -1):
            if text.endswith(trigger[:k]):
                end -= k
                break
        while end > self._sent and text[end - 1] in BLANK:
            end -= 1
        return end

    def _content(self, text: str, out: list[Delta]) -> None:
        if text:
            self.content += text
            out.append(Delta("content", text))

    def _scan(self, region: _Region, final: bool, out: list[Delta]) -> int | None:
        """Advance the region's scan over the text; where the calls end (None: not yet)."""
        text, syntax = self.text, self.syntax
        while True:
            if region.state in ("open", "after"):
                first = region.state == "open"
                words = syntax.open_words if first else syntax.separator_words
                at = _words(text, region.pos, words)
                if at == _NEED and not final:
                    return None
                if at >= 0 and (first or words):
                    region.obj = _skip_blank(text, at)
                    if region.obj == len(text) and not final:
                        return None
                    region.pos, region.state = region.obj, "head"
                    continue
                if first:  # the trigger, then nothing that can open a call
                    return self._broken(region, region.pos)
                at = _words(text, region.pos, syntax.close_words)
                if at == _NEED:  # (final: the reply ended inside the closing words)
                    return len(text) if final else None
                return at if at >= 0 else self._broken(region, region.pos)
            if region.state == "head":
                head = self._head(region.obj)
                if head == "need" and not final:
                    return None
                if isinstance(head, tuple):
                    name, args_at = head
                    call = ToolCall(self.new_id(), name, start=region.obj)
                    region.calls.append(call)
                    self.calls.append(call)
                    out.append(Delta("call", index=len(self.calls) - 1, id=call.id, name=name))
                    region.scanner, region.state = JsonScanner(args_at), "args"
                else:  # not the canonical form: parse the whole object once it is there
                    region.scanner, region.state = JsonScanner(region.obj), "loose"
                continue
            scanner = region.scanner
            assert scanner is not None
            if region.state == "args":
                call = region.calls[-1]
                end = scanner.advance(text, final)
                whole = end is not None or text[scanner.start:scanner.start + 1] in ("{", "[", '"')
                upto = end if end is not None else len(text)
                if whole and upto > scanner.start:
                    self._arguments(call, len(self.calls) - 1, text[scanner.start:upto], out)
                if end is None:
                    return self._unfinished(region) if final else None
                region.pos, region.state = end, "tail"
                continue
            if region.state == "tail":  # after the arguments: the call object closes (extra keys are skipped)
                at = _skip_blank(text, region.pos)
                if at == len(text) and not final:
                    return None
                if text[at:at + 1] == "}":
                    end = at + 1
                else:
                    obj = JsonScanner(region.obj)
                    found = obj.advance(text, final)
                    if found is None:
                        return self._unfinished(region) if final else None
                    end = found
                region.calls[-1].complete = True
                region.pos, region.state = end, "after"
                continue
            # loose: a call object in another form
            end = scanner.advance(text, final)
            if end is None:
                return self._broken(region, region.obj) if final else None
            call_of = _loose_call(text[region.obj:end])
            if call_of is None:
                return self._broken(region, region.obj)
            call = ToolCall(self.new_id(), call_of[0], call_of[1], complete=True, start=region.obj)
            region.calls.append(call)
            self.calls.append(call)
            out.append(Delta("call", index=len(self.calls) - 1, id=call.id, name=call.name))
            self._arguments(call, len(self.calls) - 1, call.arguments, out)
            region.pos, region.state = end, "after"

    def _head(self, i: int) -> tuple[str, int] | Literal["need", "no"]:
        """(name, where the arguments start) of a canonical call object at i: {"name": "...", "arguments": ."""
        text = self.text
        at = _words(text, i, ("{", '"name"', ":"))
        if at < 0:
            return "need" if at == _NEED else "no"
        at = _skip_blank(text, at)
        if at == len(text):
            return "need"
        if text[at] != '"':
            return "no"
        end = _string_end(text, at)
        if end < 0:
            return "need"
        try:
            name = json.loads(text[at:end])
        except json.JSONDecodeError:
            return "no"
        at = _words(text, end, (",",))
        if at < 0:
            return "need" if at == _NEED else "no"
        keys = [_words(text, at, (key, ":")) for key in ARGS_KEYS]
        if all(k == _NO for k in keys):
            return "no"
        matched = max(keys)
        if matched < 0:
            return "need"
        args = _skip_blank(text, matched)
        return ("need" if args == len(text) else (name, args))

    def _arguments(self, call: ToolCall, index: int, text: str, out: list[Delta]) -> None:
        sent = self._args_sent.get(index, 0)
        call.arguments = text
        if len(text) > sent:
            out.append(Delta("arguments", text[sent:], index=index))
            self._args_sent[index] = len(text)

    def _unfinished(self, region: _Region) -> int:
        """The reply ended inside a call: it stays incomplete; nothing follows."""
        return len(self.text)

    def _broken(self, region: _Region, at: int) -> int:
        """The calls stop following the syntax at `at`: the text from there (from the trigger if no call of the
        region was found) is content."""
        self._mode = "plain"
        return at if region.calls else region.trigger_at


def _loose_call(text: str) -> tuple[str, str] | None:
    """(name, arguments JSON) of a call object in any key order, or None."""
    try:
        obj = json.loads(text)
    except (json.JSONDecodeError, RecursionError):
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get("arguments", obj.get("parameters"))
    if args is None:
        return None
    return obj["name"], args if isinstance(args, str) else json.dumps(args, ensure_ascii=False)


@dataclass(frozen=True)
class Parsed:
    """A whole reply: its content (None when it is only calls) and its complete calls."""

    content: str | None
    calls: list[ToolCall]


def parse_calls(text: str, syntax: CallSyntax, new_id: Callable[[], str] = new_call_id) -> Parsed:
    """The whole reply's content and complete calls; a call the reply ended inside is content (its text from its
    call object on)."""
    parser = CallParser(syntax, new_id)
    parser.feed(text, final=True)
    done = [c for c in parser.calls if c.complete]
    content = parser.content
    cut = [c for c in parser.calls if not c.complete]
    if cut:
        content += text[cut[0].start:]
    if done and not content.strip(BLANK):
        return Parsed(None, done)
    return Parsed(content, done)
