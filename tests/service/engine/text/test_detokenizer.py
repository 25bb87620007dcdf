"""The byte tokenizer's incremental detokenizer (service.engine.text.detokenizer): possible stop prefixes and
partial UTF-8 are held back."""

from __future__ import annotations

from service.engine.text import IncrementalDetokenizer
from tests.service.support import TOK


def test_the_byte_tokenizers_stream_holds_back_possible_stop_prefixes_and_partial_utf8() -> None:
    stream = IncrementalDetokenizer(TOK.decode, TOK.encode("hi"), ["END"], TOK.joins_next)
    ids = TOK.encode("ab")
    assert stream.step(ids) == "ab"
    ids += TOK.encode("EN")
    assert stream.step(ids) == ""  # might become END
    ids += TOK.encode("x")
    assert stream.step(ids) == "ENx"
    ids += list("é".encode())[:1]
    assert stream.step(ids) == ""  # half a character
    ids += list("é".encode())[1:]
    assert stream.step(ids, final=True) == "é"
