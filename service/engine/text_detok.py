"""Streaming text of a byte-level tokenizer: whole UTF-8 characters only, stop sequences held back until ruled out.

(The incremental detokenizer for Hugging Face tokenizers is service.engine.text.detokenizer.)
"""

from __future__ import annotations

import codecs
from collections.abc import Sequence

from models.tokenizer import TextTokenizer


class TextStream:
    """Incremental detokenizer for streaming: whole UTF-8 characters only, and no byte that might still
    turn out to be the start of a stop sequence (it is sent once the next tokens rule the stop out)."""

    def __init__(self, tokenizer: TextTokenizer, stops: Sequence[bytes]) -> None:
        self.tokenizer = tokenizer
        self.stops = [s for s in stops if s]
        self.decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self.sent = 0  # bytes handed to the decoder

    def _held_back(self, data: bytes) -> int:
        held = 0
        for stop in self.stops:
            for k in range(min(len(stop) - 1, len(data)), held, -1):
                if data.endswith(stop[:k]):
                    held = k
                    break
        return held

    def delta(self, tokens: Sequence[int], final: bool) -> str:
        data = self.tokenizer.decode_bytes(tokens)
        upto = len(data) if final else len(data) - self._held_back(data)
        piece, self.sent = data[self.sent:max(upto, self.sent)], max(upto, self.sent)
        return self.decoder.decode(piece, final=final)
