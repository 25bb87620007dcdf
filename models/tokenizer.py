"""Byte-level tokenizer: ids 0..255 are raw UTF-8 bytes, then three special tokens.

Bytes need no vocabulary file, cover every language and round-trip exactly, which is what a small
demo language model and a server that must never fail to tokenize want.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, Protocol

SPECIAL_TOKENS: dict[str, int] = {"<|bos|>": 256, "<|eos|>": 257, "<|pad|>": 258}


class ByteTokenizer:
    """UTF-8 bytes as ids 0..255; `<|bos|>` 256, `<|eos|>` 257, `<|pad|>` 258."""

    type = "byte"
    chat_template: str | None = None  # no chat template: chat is refused
    concatenates = True  # the bytes of ids a + b are a's then b's

    def __init__(self) -> None:
        self.special_tokens = dict(SPECIAL_TOKENS)
        self._special_names = {i: name for name, i in self.special_tokens.items()}

    @property
    def vocab_size(self) -> int:
        return 256 + len(self.special_tokens)

    @property
    def bos_id(self) -> int:
        return self.special_tokens["<|bos|>"]

    @property
    def eos_id(self) -> int:
        return self.special_tokens["<|eos|>"]

    @property
    def pad_id(self) -> int:
        return self.special_tokens["<|pad|>"]

    @property
    def eos_ids(self) -> tuple[int, ...]:
        return (self.eos_id,)

    def tokenizer_json(self) -> str | None:
        """No tokenizer.json: a grammar engine indexes the byte table (`decode_bytes` of each id) instead."""
        return None

    def encode(self, text: str, bos: bool = False) -> list[int]:
        ids = list(text.encode("utf-8"))
        return [self.bos_id, *ids] if bos else ids

    def token_bytes(self, token: int) -> bytes:
        return self.decode_bytes([token])

    def joins_next(self, token: int) -> bool:
        return False

    def special_texts(self) -> dict[str, str]:
        return {}

    def decode_bytes(self, ids: Iterable[int]) -> bytes:
        """The raw bytes of `ids`, special tokens dropped (stop-sequence matching works on these)."""
        out = bytearray()
        for i in ids:
            i = int(i)
            if 0 <= i < 256:
                out.append(i)
            elif i not in self._special_names:
                raise ValueError(f"token id {i} is outside the byte vocabulary (0..{self.vocab_size - 1})")
        return bytes(out)

    def decode(self, ids: Iterable[int], skip_special: bool = True) -> str:
        # A model can emit a byte sequence that is not valid UTF-8; replace rather than fail.
        parts: list[str] = []
        chunk = bytearray()
        for i in ids:
            i = int(i)
            if 0 <= i < 256:
                chunk.append(i)
            elif i in self._special_names:
                if not skip_special:
                    parts.append(chunk.decode("utf-8", errors="replace"))
                    parts.append(self._special_names[i])
                    chunk = bytearray()
            else:
                raise ValueError(f"token id {i} is outside the byte vocabulary (0..{self.vocab_size - 1})")
        parts.append(chunk.decode("utf-8", errors="replace"))
        return "".join(parts)

    def to_dict(self) -> dict[str, Any]:
        return {"type": self.type, "special_tokens": dict(self.special_tokens), "vocab_size": self.vocab_size}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ByteTokenizer:
        kind = d.get("type")
        if kind != cls.type:
            raise ValueError(f"unknown tokenizer type {kind!r}; only {cls.type!r} is supported")
        tok = cls()
        specials = d.get("special_tokens", tok.special_tokens)
        if dict(specials) != tok.special_tokens:
            raise ValueError(f"byte tokenizer special tokens {dict(specials)} differ from {tok.special_tokens}")
        if d.get("vocab_size", tok.vocab_size) != tok.vocab_size:
            raise ValueError(f"byte tokenizer vocab_size {d.get('vocab_size')} differs from {tok.vocab_size}")
        return tok

    def __repr__(self) -> str:
        return f"ByteTokenizer(vocab_size={self.vocab_size})"


class TextTokenizer(Protocol):
    """What serving and generation use of a tokenizer: the byte one, or a fairseq dictionary's
    (`models.fairseq_dict.FairseqTokenizer`). Text is the concatenation of the tokens' bytes."""

    type: str
    chat_template: str | None  # the Jinja chat template, or None (chat is refused)
    # whether the bytes of ids a + b are a's then b's (models.generate.stop_match decodes only the tail)
    concatenates: bool

    @property
    def vocab_size(self) -> int: ...

    @property
    def bos_id(self) -> int: ...

    @property
    def eos_id(self) -> int: ...

    @property
    def pad_id(self) -> int: ...

    @property
    def eos_ids(self) -> tuple[int, ...]:
        """Every id that ends a sequence (a Hugging Face generation_config.json may name several)."""
        ...

    def tokenizer_json(self) -> str | None:
        """The tokenizer.json text a grammar engine can index itself (byte-level BPE, metaspace, added tokens),
        or None: then each id's `decode_bytes` is its text."""
        ...

    def encode(self, text: str, bos: bool = False) -> list[int]: ...

    def decode_bytes(self, ids: Iterable[int]) -> bytes: ...

    def token_bytes(self, token: int) -> bytes:
        """One token's own bytes (a special token: none), as logprobs and echo name it: what it adds to a text,
        its leading space and a byte that is part of a character included."""
        ...

    def special_texts(self) -> dict[str, str]:
        """The special tokens' texts by role (`bos`, `eos`, ...), as a chat template reads them (`bos_token`)."""
        ...

    def joins_next(self, token: int) -> bool:
        """Whether the text decoded up to this token may still change with the next one (SentencePiece's byte
        fallback decodes a run of byte pieces together): a stream waits before sending it."""
        ...

    def decode(self, ids: Iterable[int], skip_special: bool = True) -> str: ...

    def to_dict(self) -> dict[str, Any]: ...


def tokenizer_from_dict(d: dict[str, Any]) -> TextTokenizer:
    """The tokenizer a checkpoint's or an ONNX file's `tokenizer` entry describes (ValueError if none fits)."""
    if d.get("type") == "hf-tokenizers":
        from models.fairseq_dict import FairseqTokenizer  # tokenizers is imported only for such models

        return FairseqTokenizer.from_dict(d)
    if d.get("type") == "hf":  # a Hugging Face folder's, carried whole by its export
        from models.hf_text import HFTextTokenizer
        from models.hf_tokenizer import HFTokenizer

        return HFTextTokenizer(HFTokenizer.from_entry(d))
    return ByteTokenizer.from_dict(d)
