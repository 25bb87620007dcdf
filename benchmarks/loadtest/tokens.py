"""Token counts with the served model's tokenizer: prompt lengths are drawn in its tokens, and output a server
reports without `usage` is counted by tokenizing the streamed text (not by counting chunks, which a server may
coalesce or split).

`--tokenizer` names a tokenizer.json (or a model folder holding one: what `python -m service --model-dir` serves);
without it, byte-level: one UTF-8 byte is one token (the demo models).
"""

from __future__ import annotations

from pathlib import Path
from typing import Protocol

from benchmarks.loadtest.config import ConfigError


class TokenCounter(Protocol):
    name: str

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: list[int]) -> str: ...


class ByteCounter:
    name = "byte-level"

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: list[int]) -> str:
        return bytes(ids).decode("utf-8", "replace")


class TokenizersCounter:
    """A tokenizer.json through the `tokenizers` library; special tokens neither added nor counted."""

    def __init__(self, path: Path) -> None:
        from tokenizers import Tokenizer

        self.name = str(path)
        try:
            self._tok = Tokenizer.from_file(str(path))
        except Exception as exc:  # the Rust library raises its own exception type for any bad file
            first = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:160]
            raise ConfigError(f"--tokenizer: {path} is not a tokenizers file ({first})") from None
        self._tok.no_padding()
        self._tok.no_truncation()

    def encode(self, text: str) -> list[int]:
        return list(self._tok.encode(text, add_special_tokens=False).ids)

    def decode(self, ids: list[int]) -> str:
        return str(self._tok.decode(ids, skip_special_tokens=True))


def load_counter(path: Path | None) -> TokenCounter:
    if path is None:
        return ByteCounter()
    path = Path(path)
    file = path / "tokenizer.json" if path.is_dir() else path
    if not file.is_file():
        raise ConfigError(f"--tokenizer: {file} is not a file (give a tokenizer.json or a folder holding one)")
    return TokenizersCounter(file)


def write_byte_folder(out: Path, context: int = 128) -> Path:
    """The demo models' byte tokenizer as a Hugging Face tokenizer folder (tokenizer.json, tokenizer_config.json,
    special_tokens_map.json): what tools that take a tokenizer path (AIPerf's --tokenizer) load."""
    import json

    from export.hf_tokenizer import special_tokens_map, tokenizer_config, tokenizer_json
    from models.tokenizer import ByteTokenizer

    tok = ByteTokenizer()
    out.mkdir(parents=True, exist_ok=True)
    files = (("tokenizer.json", tokenizer_json(tok)), ("tokenizer_config.json", tokenizer_config(tok, context)),
             ("special_tokens_map.json", special_tokens_map(tok)))
    for name, data in files:
        (out / name).write_text(json.dumps(data, indent=2, ensure_ascii=False), encoding="utf-8")
    return out

