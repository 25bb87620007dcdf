"""A `GenerationRequest` (service.protocols.generation_request) run and answered, the same way for every text
endpoint: its sequences submitted to the model's scheduler and awaited (`respond`), then either one JSON body or
one Server-Sent Events stream (`stream_events`, the one stream writer). What differs per protocol is only how a
choice, and in a stream each choice's chunk, is shaped: the endpoint's `ResponseFormat`.

A stream sends each choice's new text as its tokens arrive, whole UTF-8 characters only and no bytes that may still
begin a stop string, one event per applied decode step (service.protocols.stream_steps), each wake-up's events in
one write; then its finish reason, the usage when asked for, then `data: [DONE]`. The endpoint waits for the first
token before it answers (a failure until then is still an HTTP error); an engine error after the first event ends
the stream with an error event in OpenAI's shape. However the answer ends (the client gone included), the
sequences are cancelled and the request's tracker finished.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from abc import ABC, abstractmethod
from collections.abc import AsyncIterator, Callable
from typing import Any, ClassVar

import orjson
from starlette.responses import Response, StreamingResponse
from starlette.types import Receive, Scope, Send

from models.tokenizer import TextTokenizer
from service.base.errors import ServiceError, openai_body
from service.base.tracing import phase
from service.engine.runtime import TextRuntime
from service.engine.text import GenSequence
from service.protocols import choices
from service.protocols.endpoint import ModelCall
from service.protocols.engine_status import http_error
from service.protocols.generation_request import GenerationRequest
from service.protocols.lifecycle import Tracker
from service.protocols.stream_steps import StepReader, step_reader

DONE = b"data: [DONE]\n\n"


class ResponseFormat(ABC):
    """How one protocol shapes a generation's answer: the objects' names, one whole choice, and in a stream the
    entries ("choices" items) of each choice's chunks. One per request: a stream's entries may keep state."""

    object: ClassVar[str]  # the answer's "object"
    chunk_object: ClassVar[str]  # a stream chunk's
    id_prefix: ClassVar[str]  # of the answer's id
    # The usage rides on the chunk that finishes the last choice when the client did not ask for a usage chunk
    # (/v1/completions: usage counts even for clients that did not ask)
    usage_on_last_chunk: ClassVar[bool] = False

    @abstractmethod
    def choice(self, index: int, seq: GenSequence) -> dict[str, Any]:
        """One whole (not streamed) choice."""

    def opening(self, index: int) -> list[dict[str, Any]]:
        """The entries a stream sends first for choice `index`, before any text."""
        return []

    def reader(self, tokenizer: TextTokenizer, seq: GenSequence) -> StepReader:
        """How a stream reads a sequence's text step by step (a format that decodes otherwise gives its own)."""
        return step_reader(tokenizer, seq)

    @abstractmethod
    def entries(self, index: int, seq: GenSequence, texts: list[tuple[str, int]],
                finished: bool) -> list[dict[str, Any]]:
        """The entries of choice `index`'s chunks for its new step texts ((text, generated tokens it completes),
        service.protocols.stream_steps); when `finished`, the last one carries its finish reason."""

    # Hooks for a protocol whose answer is not a list of choices (/v1/responses); the defaults are the
    # chat-completions shape every other text endpoint answers in.
    done: ClassVar[bytes] = DONE  # what ends a stream

    def start(self, meta: dict[str, Any]) -> None:  # noqa: B027 (a hook; most formats need nothing)
        """Before anything is answered: the answer's `meta` (id, created, model, system_fingerprint)."""

    def answer(self, meta: dict[str, Any], returned: list[tuple[int, GenSequence]],
               usage: dict[str, int]) -> dict[str, Any]:
        """The whole (not streamed) answer: `returned` (choice index, sequence) and the usage."""
        return {**meta, "object": self.object, "choices": [self.choice(i, s) for i, s in returned], "usage": usage}

    def chunk(self, base: dict[str, Any], entry: dict[str, Any], usage: dict[str, int] | None) -> bytes:
        """One stream event carrying `entry` (`base`: the chunks' id, object, created, model), with the usage
        when given."""
        body = {**base, "choices": [entry]}
        if usage is not None:
            body["usage"] = usage
        return sse(body)

    def failure(self, exc: ServiceError) -> list[bytes]:
        """The events that end a stream an engine error broke after its first event."""
        return [sse(openai_body(exc.status, exc.message, exc.code)), self.done]


class Generation:
    """A request's sequences (best_of per prompt, one group each) on the model's scheduler."""

    def __init__(self, rt: TextRuntime, request: GenerationRequest) -> None:
        self.rt, self.request = rt, request
        self.changed = asyncio.Event()  # set by the scheduler whenever a sequence advanced
        self.groups = choices.expand(request.prompts, request.params, request.best_of, self.changed)
        self.seqs = [s for g in self.groups for s in g]

    def submit(self) -> None:
        self.rt.scheduler.submit(self.seqs)

    def cancel(self) -> None:
        """Free the sequences' slots now (a no-op for finished ones)."""
        for s in self.seqs:
            self.rt.scheduler.cancel(s)

    def returned(self) -> list[tuple[int, GenSequence]]:
        """(choice index, sequence) of every choice returned: choice j of prompt i is i * n + j."""
        n = self.request.n
        return [(i * n + j, s) for i, g in enumerate(self.groups) for j, s in enumerate(choices.ranked(g, n))]

    def usage(self) -> dict[str, int]:
        return choices.usage(self.groups)

    def raise_errors(self) -> None:
        for s in self.seqs:
            if s.error is not None:
                raise http_error(s.error)

    async def first_update(self) -> None:
        while not any(s.generated or s.done for s in self.seqs):
            await self.changed.wait()
            self.changed.clear()
        self.raise_errors()

    async def all_done(self) -> None:
        while not all(s.done for s in self.seqs):
            await self.changed.wait()
            self.changed.clear()
        self.raise_errors()

    def timing(self, until: Callable[[GenSequence], float | None]) -> tuple[float, float]:
        """(queue, compute) seconds for Server-Timing: compute runs until `until` (now if it has not come)."""
        now = time.perf_counter()
        queue = max((s.started or now) - s.arrival for s in self.seqs)
        compute = max((until(s) or now) - (s.started or now) for s in self.seqs)
        return queue, compute


async def respond(call: ModelCall, rt: TextRuntime, request: GenerationRequest, fmt: ResponseFormat) -> Response:
    """Submit `request` and answer it in `fmt`'s shape: wait for every sequence and send one JSON body, or, for a
    stream, wait for the first token and send Server-Sent Events. However the wait ends early, the sequences are
    cancelled."""
    generation = Generation(rt, request)
    meta = {"id": f"{fmt.id_prefix}-{uuid.uuid4().hex}", "created": int(time.time()), "model": rt.name,
            "system_fingerprint": f"{rt.name}:{rt.version}"}  # the model version that answers
    fmt.start(meta)
    generation.submit()
    try:
        if request.stream:
            await call.wait(generation.first_update())
            call.timing(*generation.timing(lambda s: s.first_token))
            return _SSEResponse(stream_events(generation, fmt, {**meta, "object": fmt.chunk_object}, call.tracker),
                                generation, call.tracker)
        await call.wait(generation.all_done())
    except BaseException:
        generation.cancel()
        raise
    call.timing(*generation.timing(lambda s: s.finished))
    body = fmt.answer(meta, generation.returned(), generation.usage())
    call.tracker.finish("success")
    with phase("encode"):
        content = json.dumps(body)
    return Response(content, media_type="application/json")


def event_json(obj: dict[str, Any]) -> bytes:
    """A stream event's JSON: compact, in UTF-8 (SSE's encoding). A stream writes one a token, so orjson writes it
    (a chunk in 0.3 us against json.dumps' 6); what orjson refuses (a lone surrogate in a string the client sent)
    is written by json, escaped."""
    try:
        return orjson.dumps(obj)
    except TypeError:  # orjson.JSONEncodeError
        return json.dumps(obj, separators=(",", ":")).encode()


def sse(obj: dict[str, Any]) -> bytes:
    """One Server-Sent Event."""
    return b"data: " + event_json(obj) + b"\n\n"


async def stream_events(generation: Generation, fmt: ResponseFormat, base: dict[str, Any],
                        tracker: Tracker) -> AsyncIterator[bytes]:
    """The stream's events: each choice's opening entries, then its entries as its text grows, every choice
    interleaved (each entry names its choice's index; no best_of in a stream: every sequence is a choice); then the
    usage chunk when asked for, then [DONE]."""
    request, seqs = generation.request, generation.seqs
    readers = [fmt.reader(generation.rt.tokenizer, s) for s in seqs]
    finished = [False] * len(seqs)
    usage_on_last = fmt.usage_on_last_chunk and not request.include_usage

    def chunk(entry: dict[str, Any], finishes_all: bool = False) -> bytes:
        usage = generation.usage() if request.continuous_usage or (finishes_all and usage_on_last) else None
        return fmt.chunk(base, entry, usage)

    outcome = "cancelled"  # unless the loop below runs to its end
    try:
        opening = [chunk(entry) for i in range(len(seqs)) for entry in fmt.opening(i)]
        if opening:
            yield b"".join(opening)
        while True:
            generation.raise_errors()
            events: list[bytes] = []  # this wake-up's events (one per step and choice), sent in one write
            for i, (s, reader) in enumerate(zip(seqs, readers, strict=True)):
                if finished[i]:
                    continue
                texts, finished[i] = reader.pieces()
                entries = fmt.entries(i, s, texts, finished[i])
                last = len(entries) - 1 if all(finished) else -1
                events.extend(chunk(entry, k == last) for k, entry in enumerate(entries))
            if all(finished):
                if request.include_usage:
                    events.append(sse({**base, "choices": [], "usage": generation.usage()}))
                yield b"".join([*events, fmt.done])
                break
            if events:
                yield b"".join(events)
            await generation.changed.wait()
            generation.changed.clear()
        outcome = "success"
    except ServiceError as exc:
        outcome = exc.outcome
        for event in fmt.failure(exc):
            yield event
    finally:
        generation.cancel()  # a closed stream frees its slots now
        tracker.finish(outcome)


class _SSEResponse(StreamingResponse):
    """A stream that releases its sequences however it ends, even when the client left before the first byte
    (then the body generator never starts, and its own `finally` never runs)."""

    def __init__(self, content: AsyncIterator[bytes], generation: Generation, tracker: Tracker) -> None:
        super().__init__(content, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self._generation, self._tracker = generation, tracker

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._generation.cancel()
            self._tracker.finish("cancelled")  # a no-op if the stream ended normally
