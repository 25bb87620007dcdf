"""A Hugging Face model folder's tokenizer: tokenizer.json (the `tokenizers` library) plus tokenizer_config.json.

What generation and serving need from it: encode (with the tokenizer's own special-token template), decode,
the bos / eos / pad ids, the bytes of a decoded sequence (stop sequences) and the chat template, rendered as
transformers renders it (Jinja in a sandbox, trim_blocks and lstrip_blocks).
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer

from .loading import CheckpointError


def _token_text(value: Any) -> str | None:
    """tokenizer_config.json writes a special token as a string or as {"content": ...}."""
    if isinstance(value, Mapping):
        value = value.get("content")
    return value if isinstance(value, str) else None


ONE_TOKEN_CACHE = 1 << 18  # ids whose text HFTokenizer.decode keeps (more than any vocabulary here)


class HFTokenizer:
    type = "hf"
    concatenates = False  # decoded whole (models.hf_text.HFTextTokenizer knows when a byte-level BPE concatenates)

    def __init__(self, tokenizer: Tokenizer, config: Mapping[str, Any], chat_template: str | None = None,
                 eos_ids: Sequence[int] = (), source: str = "tokenizer.json") -> None:
        self.tokenizer = tokenizer
        self.config = dict(config)
        self.chat_template = chat_template
        self.source = source
        self._vocab_size: int | None = None
        # one token's text (special tokens skipped), by id: a stream decodes each new token alone once a step
        # (service.engine.text.detokenizer's prefix window), so a token is decoded once, not once a step
        self._one: dict[int, str] = {}
        self.special: dict[str, str | None] = {
            name: _token_text(config.get(f"{name}_token")) for name in ("bos", "eos", "pad", "unk")
        }
        eos = self.token_id(self.special["eos"])
        # generation_config.json may name several end tokens (e.g. <|eot_id|> and <|end_of_text|>)
        self.eos_ids: tuple[int, ...] = tuple(dict.fromkeys([*([eos] if eos is not None else []), *eos_ids]))

    @classmethod
    def from_folder(cls, folder: Path, eos_ids: Sequence[int] = ()) -> HFTokenizer:
        path = folder / "tokenizer.json"
        if not path.is_file():
            raise CheckpointError(f"{path}: no such file (a model folder needs its tokenizer.json)")
        try:
            tokenizer = Tokenizer.from_file(str(path))
        except Exception as exc:  # the Rust library raises its own exception type for any bad file
            raise CheckpointError(f"{path}: not a tokenizers file ({_first_line(exc)})") from None
        config: dict[str, Any] = {}
        config_path = folder / "tokenizer_config.json"
        if config_path.is_file():
            config = read_json(config_path)
        template = config.get("chat_template")
        jinja = folder / "chat_template.jinja"  # where transformers 5 writes it
        if jinja.is_file():
            template = jinja.read_text(encoding="utf-8")
        if isinstance(template, list):  # a list of named templates: the one named "default"
            named = {t.get("name"): t.get("template") for t in template if isinstance(t, Mapping)}
            template = named.get("default")
        if template is not None and not isinstance(template, str):
            raise CheckpointError(f"{config_path}: chat_template must be a template string or a list of named "
                                  f"templates, got {type(template).__name__}")
        return cls(tokenizer, config, template, eos_ids, str(path))

    @property
    def vocab_size(self) -> int:
        """The number of ids (the largest id + 1), not of pieces: a tokenizer may name one id several times (the
        genai form of a fairseq dictionary spells unknown bytes as `<0xXX>` aliases of `<unk>`)."""
        if self._vocab_size is None:
            ids = self.tokenizer.get_vocab(with_added_tokens=True).values()
            self._vocab_size = max(ids, default=-1) + 1
        return self._vocab_size

    def token_id(self, token: str | None) -> int | None:
        return None if token is None else self.tokenizer.token_to_id(token)

    @property
    def bos_id(self) -> int | None:
        return self.token_id(self.special["bos"])

    @property
    def eos_id(self) -> int | None:
        return self.eos_ids[0] if self.eos_ids else None

    @property
    def pad_id(self) -> int | None:
        return self.token_id(self.special["pad"])

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        # encode_batch of one text: the same ids as encode, but it releases the GIL while it works (encode holds
        # it: a 1 MB one-word chat message stopped a server's event loop for 0.6 s even from a thread)
        return list(self.tokenizer.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids)

    def decode(self, ids: Iterable[int], skip_special: bool = True) -> str:
        window = [int(i) for i in ids]
        if len(window) != 1 or not skip_special:
            return str(self.tokenizer.decode(window, skip_special_tokens=skip_special))
        text = self._one.get(window[0])
        if text is None:
            text = str(self.tokenizer.decode(window, skip_special_tokens=True))
            if len(self._one) < ONE_TOKEN_CACHE:
                self._one[window[0]] = text
        return text

    def decode_bytes(self, ids: Iterable[int]) -> bytes:
        """UTF-8 of the decoded text without special tokens (what stop sequences are matched against)."""
        return self.decode(ids).encode("utf-8")

    def apply_chat_template(self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True) -> str:
        """The prompt text for a conversation, rendered as transformers renders the folder's chat template."""
        if not self.chat_template:
            raise ValueError(f"{self.source}: the tokenizer has no chat template")
        from jinja2.exceptions import TemplateError
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        def raise_exception(message: str) -> None:
            raise TemplateError(message)

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                            extensions=["jinja2.ext.loopcontrols"])
        env.globals["raise_exception"] = raise_exception
        env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
        specials = {f"{k}_token": v for k, v in self.special.items() if v is not None}
        try:
            return env.from_string(self.chat_template).render(
                messages=[dict(m) for m in messages], add_generation_prompt=add_generation_prompt, **specials)
        except TemplateError as exc:
            raise ValueError(f"{self.source}: chat template failed: {exc}") from None

    def to_entry(self) -> dict[str, Any]:
        """The whole tokenizer as a checkpoint's or an ONNX file's `tokenizer` entry (`from_entry` reads it back):
        the summary, the tokenizer.json, its config and chat template, so a single exported file serves alone."""
        return {**self.to_dict(), "tokenizer_json": json.loads(self.tokenizer.to_str()), "config": self.config,
                "chat_template_text": self.chat_template}

    @classmethod
    def from_entry(cls, entry: Mapping[str, Any]) -> HFTokenizer:
        """The tokenizer a `to_entry` entry holds (ValueError for one without its tokenizer.json: a summary)."""
        data, config = entry.get("tokenizer_json"), entry.get("config")
        if not isinstance(data, dict) or not isinstance(config, dict):
            raise ValueError("the 'hf' tokenizer entry holds no tokenizer.json (a file exported before single files "
                             "carried their tokenizer: export it again)")
        try:
            tokenizer = Tokenizer.from_str(json.dumps(data))
        except Exception as exc:  # the Rust library raises its own exception type for any bad file
            raise ValueError(f"unusable tokenizer.json in the tokenizer entry ({_first_line(exc)})") from None
        template = entry.get("chat_template_text")
        eos_ids = [int(i) for i in entry.get("eos_ids") or [] if isinstance(i, int)]
        return cls(tokenizer, config, template if isinstance(template, str) else None, eos_ids, "tokenizer entry")

    def to_dict(self) -> dict[str, Any]:
        """A summary (for `python -m models info` and metadata): the file's identity, not its vocabulary."""
        return {"type": self.type, "vocab_size": self.vocab_size, "bos": self.special["bos"], "bos_id": self.bos_id,
                "eos": self.special["eos"], "eos_ids": list(self.eos_ids), "pad": self.special["pad"],
                "pad_id": self.pad_id, "chat_template": self.chat_template is not None}

    def __repr__(self) -> str:
        return f"HFTokenizer(vocab_size={self.vocab_size}, eos_ids={list(self.eos_ids)})"


def read_json(path: Path) -> dict[str, Any]:
    """A JSON object file, or a CheckpointError naming the file."""
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError) as exc:
        raise CheckpointError(f"{path}: cannot read ({_first_line(exc)})") from None
    except json.JSONDecodeError as exc:
        raise CheckpointError(f"{path}: not valid JSON ({exc.msg} at line {exc.lineno})") from None
    if not isinstance(value, dict):
        raise CheckpointError(f"{path}: holds a JSON {type(value).__name__}, not an object")
    return value


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip() or type(exc).__name__
    return text.splitlines()[0][:160]
