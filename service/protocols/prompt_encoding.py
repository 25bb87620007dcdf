"""A request's text as token ids, in a way that lets the event loop run meanwhile.

Long text is encoded (and a chat rendered) on a worker thread; a thread frees the event loop because the
tokenizers release the GIL while they work (models.hf_tokenizer.HFTokenizer.encode: a 1 MB one-word message
held every other request 0.6 s on the loop, issue 38). Short text stays on the event loop, where it costs less
than the hop to a thread.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any, TypeVar

T = TypeVar("T")
INLINE_CHARS = 8192  # text up to this long is encoded on the event loop (well under a millisecond)


async def run(chars: int, fn: Callable[..., T], *args: Any) -> T:
    """fn(*args) for a request with `chars` characters of text: on a thread beyond INLINE_CHARS."""
    if chars <= INLINE_CHARS:
        return fn(*args)
    return await asyncio.to_thread(fn, *args)
