"""A small fake server for the load tester's tests (raw ASGI on uvicorn, in a thread): classification and
completions, streams, errors of every class, Server-Timing and /metrics; it counts what it was sent."""

from __future__ import annotations

import asyncio
import json
import time
from collections import Counter
from typing import Any


class FakeServer:
    """The endpoints the load tester uses, with trivial compute. Model names pick behaviours:
    `fake` answers 200 at once; `errs` cycles 200, 404, 429, 500, and a hang (for timeouts); `stall` pauses the
    whole server for STALL_S once, at request STALL_AT; `hang` never answers in time; `text` streams tokens;
    `broken` streams without [DONE]. Chat: `text` streams OpenAI chat deltas with usage, `nousage` without.
    With `api_key` set, every request without `Authorization: Bearer <api_key>` is a 401."""

    STALL_AT, STALL_S = 20, 1.0

    def __init__(self) -> None:
        self.counts: Counter[str] = Counter()
        self.stall_until = 0.0
        self.api_key: str | None = None
        self.chat_bodies: list[dict[str, Any]] = []

    def reset(self) -> None:
        self.counts.clear()
        self.stall_until = 0.0
        self.api_key = None
        self.chat_bodies.clear()

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            while (await receive())["type"] != "lifespan.shutdown":
                await send({"type": "lifespan.startup.complete"})
            await send({"type": "lifespan.shutdown.complete"})
            return
        body = b""
        while True:
            msg = await receive()
            body += msg.get("body", b"")
            if not msg.get("more_body"):
                break
        path, method = scope["path"], scope["method"]
        if self.api_key is not None and dict(scope["headers"]).get(b"authorization") != \
                f"Bearer {self.api_key}".encode():
            return await self._json(send, 401, {"error": {"message": "invalid API key"}})
        if method == "POST" and path == "/v1/chat/completions":
            return await self._chat(send, json.loads(body))
        if method == "GET" and path == "/v1/models":
            data = [{"id": m, "object": "model"} for m in ("fake", "errs", "stall", "hang", "text", "broken",
                                                           "nousage")]
            return await self._json(send, 200, {"object": "list", "data": data})
        if method == "GET" and path == "/v2/models/fake":
            return await self._json(send, 200, {"name": "fake", "inputs": [
                {"name": "pixel_values", "datatype": "FP32", "shape": [-1, 1, 4, 4]}]})
        if method == "GET" and path == "/metrics":
            return await self._metrics(send)
        if method == "POST" and path == "/v1/completions":
            return await self._complete(send, json.loads(body))
        if method == "POST" and path.startswith(("/v1/models/", "/v2/models/")):
            model = path.split("/")[3]
            n = self.counts[model]
            self.counts[model] += 1
            if path.startswith("/v2/"):
                inputs = json.loads(body)["inputs"]
                assert inputs[0]["name"] == "pixel_values" and inputs[0]["shape"] == [1, 1, 4, 4]
            if model == "errs":
                kind = ("ok", "404", "429", "500", "hang")[n % 5]
                if kind == "hang":
                    await asyncio.sleep(5)  # past the client's timeout
                elif kind != "ok":
                    headers = [(b"retry-after", b"1")] if kind == "429" else []
                    return await self._json(send, int(kind), {"error": kind}, headers)
            if model == "hang":
                await asyncio.sleep(5)
            if model == "stall":
                now = time.perf_counter()
                if n == self.STALL_AT:
                    self.stall_until = now + self.STALL_S
                if now < self.stall_until:  # a server-wide pause: everything arriving now waits it out
                    await asyncio.sleep(self.stall_until - now)
            timing = [(b"server-timing", b'queue;dur=2.5, compute;dur=4;desc="fake, model", total;dur=7')]
            return await self._json(send, 200, {"predictions": [[{"label": "7", "probability": 0.9}]]}, timing)
        return await self._json(send, 404, {"error": "not found"})

    @staticmethod
    async def _json(send: Any, status: int, obj: Any, headers: list[tuple[bytes, bytes]] | None = None) -> None:
        data = json.dumps(obj).encode()
        await send({"type": "http.response.start", "status": status,
                    "headers": [(b"content-type", b"application/json"), *(headers or [])]})
        await send({"type": "http.response.body", "body": data})

    async def _metrics(self, send: Any) -> None:
        served = sum(v for k, v in self.counts.items() if k != "completions")
        text = ("# TYPE fake_requests counter\n"
                f'fake_requests_total{{endpoint="classify"}} {served}\n'
                "# TYPE fake_latency_seconds histogram\n"
                f'fake_latency_seconds_bucket{{le="0.005"}} {served}\n'
                f'fake_latency_seconds_bucket{{le="+Inf"}} {served}\n'
                f"fake_latency_seconds_count {served}\n"
                f"fake_latency_seconds_sum {served * 0.004}\n"
                "# TYPE fake_up gauge\nfake_up 1\n")
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", b"text/plain; version=0.0.4")]})
        await send({"type": "http.response.body", "body": text.encode()})

    async def _complete(self, send: Any, req: dict[str, Any]) -> None:
        self.counts["completions"] += 1
        n = int(req["max_tokens"])
        if not req.get("stream"):
            return await self._json(send, 200, {"choices": [{"text": "x" * n}],
                                                "usage": {"prompt_tokens": 3, "completion_tokens": n}})
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", b"text/event-stream"), (b"server-timing", b"queue;dur=1")]})
        for i in range(n):
            await asyncio.sleep(0.002)
            chunk = {"choices": [{"index": 0, "text": "ab"[i % 2], "finish_reason": None}]}
            await send({"type": "http.response.body", "body": f"data: {json.dumps(chunk)}\n\n".encode(),
                        "more_body": True})
        usage = {"choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": n, "total_tokens": n + 3}}
        tail = f"data: {json.dumps(usage)}\n\n" + ("" if req["model"] == "broken" else "data: [DONE]\n\n")
        await send({"type": "http.response.body", "body": tail.encode()})


    async def _chat(self, send: Any, req: dict[str, Any]) -> None:
        """OpenAI's chat stream: the role first, then content deltas ("ab cd " each: 1 chunk, several tokens),
        then the finish reason, then usage (if asked for and the model is not `nousage`)."""
        self.counts["chat"] += 1
        self.chat_bodies.append(req)
        n = int(req["max_tokens"])
        base = {"id": "chatcmpl-1", "object": "chat.completion.chunk", "model": req["model"]}
        if not req.get("stream"):
            return await self._json(send, 200, {**base, "object": "chat.completion", "choices": [
                {"index": 0, "message": {"role": "assistant", "content": "ab cd " * n}, "finish_reason": "length"}]})
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/event-stream")]})
        deltas = [{"role": "assistant", "content": ""}] + [{"content": "ab cd "}] * n
        for delta in deltas:
            await asyncio.sleep(0.001)
            chunk = {**base, "choices": [{"index": 0, "delta": delta, "finish_reason": None}]}
            await send({"type": "http.response.body", "body": f"data: {json.dumps(chunk)}\n\n".encode(),
                        "more_body": True})
        tail = {**base, "choices": [{"index": 0, "delta": {}, "finish_reason": "length"}]}
        events = [tail]
        if (req.get("stream_options") or {}).get("include_usage") and req["model"] != "nousage":
            events.append({**base, "choices": [], "usage": {"prompt_tokens": 11, "completion_tokens": 2 * n,
                                                            "total_tokens": 11 + 2 * n}})
        text = "".join(f"data: {json.dumps(e)}\n\n" for e in events) + "data: [DONE]\n\n"
        await send({"type": "http.response.body", "body": text.encode()})
