"""Incremental detokenization for streaming, as vLLM does it: text leaves as soon as it is complete.

Decoding token by token is wrong for real tokenizers: a byte-level BPE token may hold half a UTF-8 character,
and SentencePiece-style tokenizers decide a token's leading space from its neighbours. So, like vLLM's
`detokenize_incrementally`, two offsets run over the token ids (the last few prompt tokens first, for context):
`prefix_offset` .. `read_offset` is text already sent, `read_offset` .. end is new. Each step decodes the window
from `prefix_offset` twice (without and with the new tokens); the difference is the new text, unless it ends in
U+FFFD (an incomplete character: wait for the next token). Decoding a short window keeps a step O(1) in the
length of the sequence.

On top of that the stream holds back text that might still turn out to be the start of a stop string (sent
once the next tokens rule it out), so a stop string never reaches the client, and it knows how many generated
tokens its sent text covers (a stream's logprobs go with its text).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

PROMPT_CONTEXT = 5  # prompt tokens decoded before the first generated one (as vLLM's initial offset)
REPLACEMENT = "\ufffd"

Decode = Callable[[Sequence[int]], str]


class IncrementalDetokenizer:
    """The text of one sequence's generated tokens, step by step (`step`), never cutting a character."""

    def __init__(self, decode: Decode, prompt: Sequence[int], stops: Sequence[str] = (),
                 joins_next: Callable[[int], bool] | None = None) -> None:
        self._decode = decode
        self._joins_next = joins_next  # a token whose text the next one may still change (TextTokenizer.joins_next)
        context = list(prompt[-PROMPT_CONTEXT:])
        self._ids: list[int] = context
        self._context = len(context)
        self._prefix = 0  # prefix_offset into _ids
        self._read = len(context)  # read_offset into _ids
        self._stops = [s for s in stops if s]
        self._text = ""  # decoded so far (complete characters)
        self.sent = 0  # characters of _text handed out
        # at each boundary where text was decoded: (generated tokens, characters of _text, prefix_offset)
        self._marks: list[tuple[int, int, int]] = [(0, 0, 0)]

    def _advance(self, final: bool) -> None:
        if not final and self._joins_next is not None and self._joins_next(self._ids[-1]):
            return  # wait for the token after it: until then the text decoded so far may still change
        prefix_text = self._decode(self._ids[self._prefix:self._read])
        new_text = self._decode(self._ids[self._prefix:])
        if len(new_text) > len(prefix_text) and (final or not new_text.endswith(REPLACEMENT)):
            self._text += new_text[len(prefix_text):]
            self._prefix, self._read = self._read, len(self._ids)
            self._marks.append((self._read - self._context, len(self._text), self._prefix))
        elif final:
            self._read = len(self._ids)
            self._marks.append((self._read - self._context, len(self._text), self._prefix))

    def _held_back(self) -> int:
        """Characters at the end of the text that could begin a stop string."""
        text, held = self._text[self.sent:], 0
        for stop in self._stops:
            for k in range(min(len(stop) - 1, len(text)), held, -1):
                if text.endswith(stop[:k]):
                    held = k
                    break
        return held

    def step(self, tokens: Sequence[int], final: bool = False, tail: str = "") -> str:
        """The new text once the generated tokens are `tokens` (a prefix grown by this step; tokens that a stop
        string removed at the end are simply absent). `final`: the sequence ended, flush everything; `tail`: the
        text a removed token held before the stop string (GenSequence.stop_tail). Text already sent stays sent:
        held-back text never reaches the stop string, so what was sent is a prefix of the final text."""
        generated = len(self._ids) - self._context
        if len(tokens) < generated:  # a stop match removed tokens (their text was held back): back to before them
            while self._marks[-1][0] > len(tokens):
                self._marks.pop()
            n, chars, self._prefix = self._marks[-1]
            self._text, self._read = self._text[:chars], self._context + n
            del self._ids[self._read:]
            self._ids.extend(tokens[n:])
        else:
            self._ids.extend(tokens[generated:])
        if len(self._ids) > self._read or final:
            self._advance(final)
        if final and tail:
            self._text += tail
        upto = len(self._text) if final else len(self._text) - self._held_back()
        piece = self._text[self.sent:max(upto, self.sent)]
        self.sent = max(upto, self.sent)
        return piece

    @property
    def covered(self) -> int:
        """Generated tokens whose text has been sent in full."""
        # marks grow in both tokens and characters (a stop rewind pops from the end), so the last one whose text
        # was sent is the answer: found from the end, in one step in the common case (a stream's every event)
        for n, chars, _ in reversed(self._marks):
            if chars <= self.sent:
                return n
        return 0
