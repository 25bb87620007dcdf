"""A Hugging Face tokenizer (models.hf_tokenizer.HFTokenizer) as the server's text tokenizer.

The server's endpoints and decode loop speak `models.tokenizer.TextTokenizer` (the byte tokenizer's interface):
encode, decode, `decode_bytes` (stop strings, logprob token strings, text offsets) and the special ids. Here the
same for a model folder's tokenizer.json:
- `encode` adds the tokenizer's own special tokens (its bos) as vLLM does for completions; a chat prompt, whose
  template writes them itself, is encoded without (`bos=False`), as transformers' apply_chat_template does;
- a byte-level BPE token (GPT-2, Llama 3, Qwen) is its exact bytes, half a UTF-8 character included, so
  logprobs name partial characters as `bytes:\\xNN` as for the byte tokenizer; other tokenizers
  (SentencePiece-style) fall back to the decoded text;
- several end-of-sequence ids (generation_config.json's list) end a sequence.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable
from functools import lru_cache
from typing import Any

from .hf_tokenizer import HFTokenizer


@lru_cache(maxsize=1)
def _byte_level_alphabet() -> dict[str, int]:
    """GPT-2's byte <-> printable character map (what a ByteLevel pre-tokenizer writes tokens in), reversed."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars = list(printable)
    extra = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + extra)
            extra += 1
    return {chr(c): b for b, c in zip(printable, chars, strict=True)}


def _decoder_kinds(hf: HFTokenizer) -> list[str | None]:
    decoder = json.loads(hf.tokenizer.to_str()).get("decoder") or {}
    return [decoder.get("type")] + [d.get("type") for d in decoder.get("decoders") or []]


_BYTE_PIECE = re.compile(r"<0x([0-9A-Fa-f]{2})>")  # SentencePiece's byte fallback: one byte a token
SPM_SPACE = "\u2581"


class HFTextTokenizer:
    """`HFTokenizer` with the byte tokenizer's interface (models.tokenizer.TextTokenizer), for serving."""

    type = "hf"

    def __init__(self, hf: HFTokenizer) -> None:
        self.hf = hf
        self.chat_template = hf.chat_template
        kinds = _decoder_kinds(hf)
        self.byte_level = "ByteLevel" in kinds
        # SentencePiece's layout (Llama 2, Mistral, Gemma): U+2581 for a space, <0xNN> for a byte it has no piece for
        self.spm_pieces = not self.byte_level and ("ByteFallback" in kinds or "Metaspace" in kinds)
        self.concatenates = self.byte_level  # decode_bytes joins each token's own bytes (stop_match's tail)
        added = hf.tokenizer.get_added_tokens_decoder()
        self.special_ids = frozenset(i for i, t in added.items() if t.special)
        self._alphabet = _byte_level_alphabet() if self.byte_level else {}
        self._bytes: dict[int, bytes] = {}
        vocab = hf.tokenizer.get_vocab(with_added_tokens=False) if self.spm_pieces else {}
        self._byte_pieces = frozenset(i for piece, i in vocab.items() if _BYTE_PIECE.fullmatch(piece))

    @property
    def vocab_size(self) -> int:
        return self.hf.vocab_size

    @property
    def bos_id(self) -> int:
        """-1 when the tokenizer has none."""
        return -1 if self.hf.bos_id is None else int(self.hf.bos_id)

    @property
    def eos_id(self) -> int:
        """-1 when the tokenizer has none."""
        return -1 if self.hf.eos_id is None else int(self.hf.eos_id)

    @property
    def eos_ids(self) -> tuple[int, ...]:
        return self.hf.eos_ids

    @property
    def pad_id(self) -> int:
        """-1 when the tokenizer has none."""
        return -1 if self.hf.pad_id is None else int(self.hf.pad_id)

    def tokenizer_json(self) -> str | None:
        """The tokenizer.json, unless it names an id more than once (the genai form of a fairseq dictionary):
        a grammar engine indexes pieces, so such a tokenizer goes by each id's decoded bytes instead."""
        pieces = self.hf.tokenizer.get_vocab_size(with_added_tokens=True)
        return str(self.hf.tokenizer.to_str()) if pieces == self.vocab_size else None

    def encode(self, text: str, bos: bool = True) -> list[int]:
        return self.hf.encode(text, add_special_tokens=bos)

    def decode(self, ids: Iterable[int], skip_special: bool = True) -> str:
        return self.hf.decode(ids, skip_special)

    def special_texts(self) -> dict[str, str]:
        return {k: v for k, v in self.hf.special.items() if v is not None}

    def joins_next(self, token: int) -> bool:
        """A byte-fallback piece: `tokenizers` decodes a run of them together (a run that is not valid UTF-8 as a
        whole becomes one U+FFFD a byte, even a byte that would be a character alone), so the text so far is final
        only once the run ends."""
        return token in self._byte_pieces

    def token_bytes(self, token: int) -> bytes:
        """One token's own bytes (special tokens: none)."""
        cached = self._bytes.get(token)
        if cached is not None:
            return cached
        if token in self.special_ids:
            data = b""
        elif self.byte_level:
            piece = self.hf.tokenizer.id_to_token(token) or ""
            alphabet = self._alphabet
            data = bytes(alphabet[c] for c in piece) if all(c in alphabet for c in piece) else piece.encode()
        elif self.spm_pieces:  # the piece itself: decoding one token alone strips its leading space, or its byte
            piece = self.hf.tokenizer.id_to_token(token) or ""
            byte = _BYTE_PIECE.fullmatch(piece)
            data = bytes([int(byte.group(1), 16)]) if byte else piece.replace(SPM_SPACE, " ").encode("utf-8")
        else:
            data = self.hf.decode([token]).encode("utf-8")
        self._bytes[token] = data
        return data

    def decode_bytes(self, ids: Iterable[int]) -> bytes:
        """The bytes of the decoded text, special tokens dropped (stop strings are matched against these)."""
        ids = [int(i) for i in ids]
        if self.byte_level:
            return b"".join(self.token_bytes(i) for i in ids)
        return self.decode(ids).encode("utf-8")

    def to_dict(self) -> dict[str, Any]:
        return self.hf.to_dict()

    def describe(self) -> dict[str, Any]:
        """What /v1/models says about the tokenizer: no paths, no vocabulary."""
        d = self.hf.to_dict()
        return {"type": "hf-tokenizers", "vocab_size": d["vocab_size"], "bos": d["bos"], "eos": d["eos"],
                "eos_ids": d["eos_ids"], "chat_template": d["chat_template"],
                "byte_level": self.byte_level}
