"""A generation's answer as a Responses object (`ResponsesFormat`), whole or as the Responses stream of events."""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable
from typing import Any, ClassVar

from models.tokenizer import TextTokenizer
from service.base.errors import ServiceError
from service.engine.text import GenSequence, IncrementalDetokenizer
from service.protocols import generation, tools
from service.protocols.chat_api import logprobs_content
from service.protocols.generation_request import GenerationRequest
from service.protocols.stream_steps import StepReader
from service.protocols.tool_parser import CallParser, Delta, ToolCall


def sse_event(body: dict[str, Any]) -> bytes:
    """One Server-Sent Event as OpenAI's Responses stream writes it: its type on the `event:` line."""
    return b"event: " + body["type"].encode() + b"\ndata: " + generation.event_json(body) + b"\n\n"


def _new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


class ResponsesFormat(generation.ResponseFormat):
    """A generation's answer as a Responses object: an assistant message with one output_text part, and with
    tools that may be called (`plan`) the reply split into its content (the message, when it has any) and its
    calls (`function_call` items; service.protocols.tools). A stream sends response.created and
    response.in_progress, then each output item as it begins (response.output_item.added; a message's
    content_part.added), its text one decode step at a time (response.output_text.delta) or a call's arguments
    (response.function_call_arguments.delta), then each item's ends (output_text.done, content_part.done or
    function_call_arguments.done; output_item.done) and response.completed (response.incomplete when
    max_output_tokens ended it). An engine error after the first event ends the stream with `error` and
    `response.failed`. Every event has its sequence_number."""

    object = "response"
    chunk_object = "response"
    id_prefix = "resp"
    done: ClassVar[bytes] = b""  # a Responses stream ends with its last event

    def __init__(self, tokenizer: TextTokenizer, request: GenerationRequest, echo: dict[str, Any],
                 keep: Callable[[dict[str, Any], dict[str, Any]], None] | None,
                 plan: tools.ToolPlan | None = None) -> None:
        self.tokenizer, self.top, self.echo, self.keep = tokenizer, request.logprobs, echo, keep
        self.plan = plan if plan is not None and plan.calls else None
        self.own_decode = tools.decoder(self.plan, tokenizer)  # None: the tokenizer's own decode keeps the trigger
        self.decode = self.own_decode or tokenizer.decode
        self.id = _new_id("resp")
        self.created, self.model = int(time.time()), ""
        self.sequence = 0  # the next event's sequence_number
        # a stream's output items so far, in output order: the message's text in its part, a call's arguments
        self.items: list[dict[str, Any]] = []
        self.message: int | None = None  # the message's output_index, once it began
        self.calls: dict[int, int] = {}  # the parser's call index -> its output_index
        self.parser: CallParser | None = None if self.plan is None else self.plan.parser()
        self.sent_tokens = 0  # generated tokens whose logprobs went out

    def start(self, meta: dict[str, Any]) -> None:
        self.created, self.model = meta["created"], meta["model"]

    def reader(self, tokenizer: TextTokenizer, seq: GenSequence) -> StepReader:
        if self.own_decode is None:
            return super().reader(tokenizer, seq)
        stops = [b.decode("utf-8", errors="replace") for b in seq.params.stop]
        return StepReader(seq, IncrementalDetokenizer(self.own_decode, seq.prompt, stops, tokenizer.joins_next))

    # -- objects

    def _logprobs(self, seq: GenSequence, start: int = 0, end: int | None = None) -> list[dict[str, Any]]:
        return [] if self.top is None else logprobs_content(self.tokenizer, seq.tokens, seq.logprobs, self.top,
                                                            start, end)

    @staticmethod
    def _part(text: str, logprobs: list[dict[str, Any]]) -> dict[str, Any]:
        return {"type": "output_text", "text": text, "annotations": [], "logprobs": logprobs}

    @staticmethod
    def _message_item(status: str, content: list[dict[str, Any]]) -> dict[str, Any]:
        return {"id": _new_id("msg"), "type": "message", "role": "assistant", "status": status, "content": content}

    @staticmethod
    def _call_item(call: ToolCall, status: str) -> dict[str, Any]:
        return {"id": _new_id("fc"), "type": "function_call", "status": status, "call_id": call.id,
                "name": call.name, "arguments": call.arguments}

    def response(self, status: str, output: list[dict[str, Any]], usage: dict[str, Any] | None = None,
                 incomplete: str | None = None, error: dict[str, Any] | None = None) -> dict[str, Any]:
        return {"id": self.id, "object": "response", "created_at": self.created, "status": status,
                "error": error, "incomplete_details": None if incomplete is None else {"reason": incomplete},
                "model": self.model, "output": output, **self.echo, "reasoning": None, "usage": usage}

    def finished(self, seq: GenSequence, output: list[dict[str, Any]]) -> dict[str, Any]:
        """The whole response of a finished sequence whose output items are `output` (kept when asked for)."""
        prompt = len(seq.prompt)
        usage = {"input_tokens": prompt, "input_tokens_details": {"cached_tokens": 0},
                 "output_tokens": seq.generated, "output_tokens_details": {"reasoning_tokens": 0},
                 "total_tokens": prompt + seq.generated}
        incomplete = "max_output_tokens" if seq.finish_reason == "length" else None
        body = self.response("incomplete" if incomplete else "completed", output, usage, incomplete)
        if self.keep is not None:
            content = next((i["content"][0]["text"] for i in output if i["type"] == "message"), None)
            reply: dict[str, Any] = {"role": "assistant", "content": content}
            calls = [{"id": i["call_id"], "type": "function", "function": {"name": i["name"],
                                                                            "arguments": i["arguments"]}}
                     for i in output if i["type"] == "function_call" and i["status"] == "completed"]
            if calls:
                reply["tool_calls"] = calls
            elif content is None:
                reply["content"] = ""
            self.keep(body, reply)
        return body

    def _status(self, seq: GenSequence) -> str:
        return "incomplete" if seq.finish_reason == "length" else "completed"

    # -- the whole answer

    def _output(self, seq: GenSequence) -> list[dict[str, Any]]:
        text = self.decode(seq.tokens) + seq.stop_tail.decode("utf-8", "replace")
        status = self._status(seq)
        if self.plan is None:
            return [self._message_item(status, [self._part(text, self._logprobs(seq))])]
        parsed = tools.parse(text, self.plan)
        output = [] if parsed.content is None else \
            [self._message_item(status, [self._part(parsed.content, self._logprobs(seq))])]
        return output + [self._call_item(c, "completed") for c in parsed.calls]

    def choice(self, index: int, seq: GenSequence) -> dict[str, Any]:
        return self._output(seq)[0]

    def answer(self, meta: dict[str, Any], returned: list[tuple[int, GenSequence]],
               usage: dict[str, int]) -> dict[str, Any]:
        ((_, seq),) = returned  # n is 1
        return self.finished(seq, self._output(seq))

    # -- the stream

    def opening(self, index: int) -> list[dict[str, Any]]:
        head = self.response("in_progress", [])
        out = [{"type": "response.created", "response": head}, {"type": "response.in_progress", "response": head}]
        return out if self.plan is not None else out + self._open_message()  # with tools: once it has content

    def _open_message(self) -> list[dict[str, Any]]:
        self.message = len(self.items)
        item = self._message_item("in_progress", [])
        self.items.append({**item, "content": [self._part("", [])]})
        return [{"type": "response.output_item.added", "output_index": self.message, "item": item},
                {"type": "response.content_part.added", "item_id": item["id"], "output_index": self.message,
                 "content_index": 0, "part": self._part("", [])}]

    def _news(self, delta: Delta, logprobs: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """The events of one piece of the reply: text of the message, a call that begins, a call's arguments."""
        if delta.kind == "content":
            if not delta.text:
                return []
            out = self._open_message() if self.message is None else []
            assert self.message is not None
            item = self.items[self.message]
            item["content"][0]["text"] += delta.text
            return [*out, {"type": "response.output_text.delta", "item_id": item["id"], "output_index": self.message,
                           "content_index": 0, "delta": delta.text, "logprobs": logprobs}]
        if delta.kind == "call":
            index = self.calls[delta.index] = len(self.items)
            item = self._call_item(ToolCall(delta.id, delta.name), "in_progress")
            self.items.append(item)
            return [{"type": "response.output_item.added", "output_index": index, "item": dict(item)}]
        index = self.calls[delta.index]
        self.items[index]["arguments"] += delta.text
        return [{"type": "response.function_call_arguments.delta", "item_id": self.items[index]["id"],
                 "output_index": index, "delta": delta.text}]

    def entries(self, index: int, seq: GenSequence, texts: list[tuple[str, int]],
                finished: bool) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        for k, (text, covered) in enumerate(texts):
            lps = self._logprobs(seq, self.sent_tokens, covered)
            self.sent_tokens = max(self.sent_tokens, covered)
            last = finished and k == len(texts) - 1
            deltas = [Delta("content", text)] if self.parser is None else self.parser.feed(text, final=last)
            for j, delta in enumerate(deltas):  # a step's logprobs ride on its first piece of text
                out += self._news(delta, lps if j == 0 and delta.kind == "content" else [])
        if finished:
            if self.parser is not None and not texts:
                for delta in self.parser.feed("", final=True):
                    out += self._news(delta, [])
            out += self._closing(seq)
        return out

    def _closing(self, seq: GenSequence) -> list[dict[str, Any]]:
        """The events that end every output item, then the response's."""
        out = self._open_message() if not self.items else []  # an empty reply is an empty message
        status = self._status(seq)
        complete = {self.calls[c] for c, call in enumerate(self.parser.calls) if call.complete} if self.parser \
            else set()
        for index, item in enumerate(self.items):
            if item["type"] == "message":
                part = {**item["content"][0], "logprobs": self._logprobs(seq)}
                item.update(status=status, content=[part])
                where = {"item_id": item["id"], "output_index": index, "content_index": 0}
                out += [{"type": "response.output_text.done", **where, "text": part["text"],
                         "logprobs": part["logprobs"]},
                        {"type": "response.content_part.done", **where, "part": part}]
            else:
                item["status"] = "completed" if index in complete else "incomplete"
                out.append({"type": "response.function_call_arguments.done", "item_id": item["id"],
                            "output_index": index, "arguments": item["arguments"]})
            out.append({"type": "response.output_item.done", "output_index": index, "item": item})
        body = self.finished(seq, self.items)
        out.append({"type": f"response.{body['status']}", "response": body})
        return out

    def chunk(self, base: dict[str, Any], entry: dict[str, Any], usage: dict[str, int] | None) -> bytes:
        event = {"type": entry["type"], "sequence_number": self.sequence,
                 **{k: v for k, v in entry.items() if k != "type"}}
        self.sequence += 1
        return sse_event(event)

    def failure(self, exc: ServiceError) -> list[bytes]:
        failed = self.response("failed", [], error={"code": exc.code or "server_error", "message": exc.message})
        return [self.chunk({}, {"type": "error", "code": exc.code, "message": exc.message, "param": exc.param}, None),
                self.chunk({}, {"type": "response.failed", "response": failed}, None)]
