"""One request: send it, read the whole response (timing each SSE token), and classify how it ended."""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass

import aiohttp

from benchmarks.loadtest.servertiming import parse_server_timing
from benchmarks.loadtest.sse import SSEParser, StreamStats
from benchmarks.loadtest.workloads import RequestSpec

# How a request ended. "stream": the status was 200 but the SSE stream broke (an error event, or no [DONE]).
OUTCOMES = ("ok", "4xx", "429", "5xx", "timeout", "connection", "stream", "other")
ERROR_CLASSES = OUTCOMES[1:]


def outcome_of_status(status: int) -> str:
    if 200 <= status < 300:
        return "ok"
    if status == 429:
        return "429"
    if 400 <= status < 500:
        return "4xx"
    if status >= 500:
        return "5xx"
    return "other"  # 1xx/3xx: redirects are not followed (the tester only talks to the URL it was given)


@dataclass(slots=True)
class Sample:
    """One request's record. Times are time.perf_counter() seconds; `scheduled` is when the load model meant
    to send it (open loop: the schedule; closed loop: the same as `sent`)."""

    index: int
    scheduled: float
    sent: float
    done: float
    status: int  # 0 when no response came
    outcome: str
    timing_header: str | None = None  # raw Server-Timing; parsed after the run (see `server_timing`)
    ttft: float | None = None  # s, from `scheduled`
    itls: list[float] | None = None  # s, gaps between token chunks
    tpot: float | None = None  # s per output token after the first
    output_tokens: int = 0
    prompt_tokens: int = 0
    error: str | None = None

    @property
    def server_timing(self) -> dict[str, float]:
        """Server-Timing durations in ms by name (queue, compute, ...)."""
        return parse_server_timing(self.timing_header)

    @property
    def latency(self) -> float:
        """From the scheduled send time: what a user arriving on schedule waited (no coordinated omission)."""
        return self.done - self.scheduled

    @property
    def service_time(self) -> float:
        """From the actual send: what a closed-loop tester would report."""
        return self.done - self.sent


async def execute(session: aiohttp.ClientSession, base_url: str, spec: RequestSpec, index: int,
                  scheduled: float | None = None) -> Sample:
    sent = time.perf_counter()
    sample = Sample(index, sent if scheduled is None else scheduled, sent, sent, 0, "other",
                    prompt_tokens=spec.prompt_tokens)
    try:
        async with session.request(spec.method, base_url + spec.path, data=spec.body, headers=spec.headers,
                                   allow_redirects=False) as resp:
            sample.status = resp.status
            sample.outcome = outcome_of_status(resp.status)
            timing = resp.headers.getall("Server-Timing", ())
            if timing:  # parsed later: the hot path only keeps the string
                sample.timing_header = timing[0] if len(timing) == 1 else ", ".join(timing)
            if spec.stream and sample.outcome == "ok":
                await _read_stream(resp, sample, spec)
            else:
                body = await resp.read()
                if spec.max_tokens and sample.outcome == "ok":
                    _count_whole(body, sample, spec)
    except (TimeoutError, asyncio.TimeoutError):  # one class on 3.11+, two on 3.10; aiohttp's subclass them
        sample.outcome, sample.error = "timeout", "timeout"
    except (aiohttp.ClientError, OSError) as exc:
        sample.outcome, sample.error = "connection", f"{type(exc).__name__}: {exc}"[:200]
    sample.done = time.perf_counter()
    return sample


async def _read_stream(resp: aiohttp.ClientResponse, sample: Sample, spec: RequestSpec) -> None:
    parser, stats = SSEParser(), StreamStats()
    async for line in resp.content:
        data = parser.feed_line(line)
        if data is not None:
            stats.on_event(data, time.perf_counter())
    tail = parser.flush()
    if tail is not None:
        stats.on_event(tail, time.perf_counter())
    sample.ttft = stats.ttft(sample.scheduled)
    sample.itls = stats.itls()
    sample.tpot = stats.tpot()
    sample.output_tokens = stats.count(spec.count_tokens)
    if stats.usage_prompt_tokens is not None:  # the server's count (a chat template's tokens included)
        sample.prompt_tokens = stats.usage_prompt_tokens
    if stats.error is not None or not stats.done:
        sample.outcome = "stream"
        sample.error = stats.error or "stream ended without [DONE]"


def _count_whole(body: bytes, sample: Sample, spec: RequestSpec) -> None:
    """Token counts of a whole (unstreamed) completion: the server's usage, else its text counted with the
    model's tokenizer."""
    try:
        obj = json.loads(body)
        usage = obj.get("usage") or {}
        if isinstance(usage.get("completion_tokens"), int):
            sample.output_tokens = usage["completion_tokens"]
            if isinstance(usage.get("prompt_tokens"), int):
                sample.prompt_tokens = usage["prompt_tokens"]
        elif spec.count_tokens is not None:
            texts = [c.get("text") or (c.get("message") or {}).get("content") or "" for c in obj.get("choices") or ()]
            sample.output_tokens = spec.count_tokens("".join(texts))
    except (ValueError, AttributeError, TypeError):
        return


def make_session(connections: int, timeout_s: float, api_key: str | None = None) -> aiohttp.ClientSession:
    """One session for the whole run: connections are reused (keep-alive), as a real client pool would. With an
    API key every request carries it (OpenAI's `Authorization: Bearer`)."""
    connector = aiohttp.TCPConnector(limit=connections, limit_per_host=0, ttl_dns_cache=300)
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else None
    return aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=timeout_s),
                                 auto_decompress=False, skip_auto_headers=("User-Agent",), headers=headers)


async def wait_all(tasks: set[asyncio.Task[Sample]]) -> None:
    if tasks:
        await asyncio.gather(*tasks, return_exceptions=True)
