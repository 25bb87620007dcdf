"""Server-Sent Events from a streamed completion: split the byte stream into events, and time the tokens.

Times are whatever clock the caller uses (the runner passes time.perf_counter()). A chunk may carry several
tokens when the server coalesces (it does when the client reads slowly), so token counts come from the final
`usage` when the server sends it and from the number of non-empty chunks otherwise; inter-token latency is
per chunk, as in vLLM's benchmark.
"""

from __future__ import annotations

import itertools
import json
from collections.abc import Callable
from dataclasses import dataclass, field


class SSEParser:
    """Feed it lines; it returns each event's data (data: lines joined with newlines) when the event ends."""

    def __init__(self) -> None:
        self._data: list[str] = []

    def feed_line(self, line: bytes | str) -> str | None:
        text = line.decode("utf-8", "replace") if isinstance(line, bytes) else line
        text = text.rstrip("\r\n")
        if not text:  # a blank line ends the event
            return self.flush()
        if text.startswith(":"):
            return None  # comment / keep-alive
        name, _, value = text.partition(":")
        if name == "data":
            self._data.append(value[1:] if value.startswith(" ") else value)
        return None  # event:, id:, retry: do not matter here

    def flush(self) -> str | None:
        """The pending event, if any: at the end of the stream, lenient toward servers that omit the last blank
        line (the spec would drop it)."""
        if not self._data:
            return None
        data, self._data = "\n".join(self._data), []
        return data


@dataclass
class StreamStats:
    token_times: list[float] = field(default_factory=list)  # arrival time of each chunk that carried text
    usage_tokens: int | None = None
    usage_prompt_tokens: int | None = None
    texts: list[str] = field(default_factory=list)  # the text of every chunk (counted when there is no usage)
    done: bool = False  # saw `data: [DONE]`
    error: str | None = None  # an error object sent inside the stream

    def on_event(self, data: str, t: float) -> None:
        if data.strip() == "[DONE]":
            self.done = True
            return
        try:
            chunk = json.loads(data)
        except ValueError:
            self.error = self.error or "malformed event"
            return
        if not isinstance(chunk, dict):
            return
        if "error" in chunk:
            err = chunk["error"]
            self.error = self.error or str(err.get("message", err) if isinstance(err, dict) else err)
            return
        usage = chunk.get("usage")
        if isinstance(usage, dict) and isinstance(usage.get("completion_tokens"), int):
            self.usage_tokens = usage["completion_tokens"]
            if isinstance(usage.get("prompt_tokens"), int):
                self.usage_prompt_tokens = usage["prompt_tokens"]
        for choice in chunk.get("choices") or ():
            text = choice.get("text")
            if text is None:  # chat format
                text = (choice.get("delta") or {}).get("content")
            if text:
                self.token_times.append(t)
                self.texts.append(text)
                break

    @property
    def tokens(self) -> int:
        return self.usage_tokens if self.usage_tokens is not None else len(self.token_times)

    def count(self, count_tokens: Callable[[str], int] | None) -> int:
        """Output tokens: the server's usage, else the streamed text counted with the model's tokenizer, else
        the chunks that carried text."""
        if self.usage_tokens is None and count_tokens is not None:
            return count_tokens("".join(self.texts))
        return self.tokens

    def ttft(self, start: float) -> float | None:
        return self.token_times[0] - start if self.token_times else None

    def itls(self) -> list[float]:
        t = self.token_times
        return [b - a for a, b in itertools.pairwise(t)]

    def tpot(self) -> float | None:
        """Mean time per output token after the first: (last - first) / (tokens - 1)."""
        if len(self.token_times) < 2 or self.tokens < 2:
            return None
        return (self.token_times[-1] - self.token_times[0]) / (self.tokens - 1)
