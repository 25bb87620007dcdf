"""The byte tokenizer (models.tokenizer) as Hugging Face `tokenizers` files, for runtimes that load a folder
(onnxruntime-genai's tokenizer reads tokenizer.json and tokenizer_config.json).

A byte-level BPE with no merges: every UTF-8 byte is one token whose id is the byte's value (GPT-2's
byte-to-character table names the 256 bytes), then the special tokens at their ids. Splitting words first
(GPT-2's pre-tokenizer) cannot change the result when nothing merges, so encoding gives exactly the bytes.
"""

from __future__ import annotations

from typing import Any

from models.tokenizer import ByteTokenizer


def byte_to_char() -> dict[int, str]:
    """GPT-2's printable character for each byte (bytes that print as themselves keep their character)."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table = {b: chr(b) for b in keep}
    shift = 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + shift)
            shift += 1
    return table


def tokenizer_json(tok: ByteTokenizer) -> dict[str, Any]:
    chars = byte_to_char()
    byte_level = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False, "use_regex": True}
    return {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": [
            {"id": i, "content": name, "single_word": False, "lstrip": False, "rstrip": False, "normalized": False,
             "special": True}
            for name, i in tok.special_tokens.items()
        ],
        "normalizer": None,
        "pre_tokenizer": byte_level,
        "post_processor": None,
        "decoder": byte_level,
        "model": {
            "type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": None,
            "end_of_word_suffix": None, "fuse_unk": False, "byte_fallback": False, "ignore_merges": False,
            "vocab": {chars[b]: b for b in range(256)},
            "merges": [],
        },
    }


def tokenizer_config(tok: ByteTokenizer, context: int) -> dict[str, Any]:
    names = {i: name for name, i in tok.special_tokens.items()}
    return {
        "tokenizer_class": "GPT2Tokenizer",  # byte-level BPE; adds no bos (models.generate does not either)
        "add_bos_token": False,
        "add_prefix_space": False,
        "bos_token": names[tok.bos_id],
        "eos_token": names[tok.eos_id],
        "pad_token": names[tok.pad_id],
        "model_max_length": context,
        "clean_up_tokenization_spaces": False,
        "added_tokens_decoder": {
            str(i): {"content": name, "lstrip": False, "normalized": False, "rstrip": False, "single_word": False,
                     "special": True}
            for i, name in sorted(names.items())
        },
    }


def special_tokens_map(tok: ByteTokenizer) -> dict[str, str]:
    names = {i: name for name, i in tok.special_tokens.items()}
    return {"bos_token": names[tok.bos_id], "eos_token": names[tok.eos_id], "pad_token": names[tok.pad_id]}
