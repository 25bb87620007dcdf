"""A text model's tokenizer as Hugging Face `tokenizers` files, for runtimes that load a folder
(onnxruntime-genai's tokenizer reads tokenizer.json and tokenizer_config.json): `tokenizer_files`.

- A Hugging Face model folder: its files as they are (tokenizer.json, tokenizer_config.json with the chat
  template, chat_template.jinja, special_tokens_map.json, generation_config.json).
- A fairseq dictionary (models.fairseq_dict): GPT-2's byte-level BPE with fairseq's ids as converted, or, for a
  word-level dictionary, the same words in a form onnxruntime-genai's tokenizer reads (`word_level_for_genai`);
  `</s>` first, as fairseq's LM input.
- The byte tokenizer (models.tokenizer), below.

A byte-level BPE with no merges: every UTF-8 byte is one token whose id is the byte's value (GPT-2's
byte-to-character table names the 256 bytes), then the special tokens at their ids. Splitting words first
(GPT-2's pre-tokenizer) cannot change the result when nothing merges, so encoding gives exactly the bytes.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from export.onnx_export import ExportError
from models.hf_tokenizer import HFTokenizer
from models.tokenizer import ByteTokenizer

HF_FOLDER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "special_tokens_map.json",
                   "generation_config.json")
FAIRSEQ_TYPE = "hf-tokenizers"  # models.fairseq_dict.TOKENIZER_TYPE
FAIRSEQ_WORDS = "fairseq_word_level"  # tokenizer_config.json key marking word_level_for_genai's tokenizer.json
SPM_SPACE = "\u2581"


@dataclass(frozen=True)
class TokenizerFiles:
    """The files a folder export writes for its tokenizer, and the ids genai_config.json names."""

    files: dict[str, bytes]
    bos_id: int
    eos_ids: list[int]
    pad_id: int


def _json(data: Any) -> bytes:
    return (json.dumps(data, indent=2, ensure_ascii=False) + "\n").encode("utf-8")


def tokenizer_files(entry: dict[str, Any] | None, source: Path | None, context: int,
                    vocab_size: int) -> TokenizerFiles:
    """The tokenizer files of a model: copied from its Hugging Face folder `source`, or made from the
    checkpoint's tokenizer entry (the byte tokenizer when there is none and the vocabulary is its size)."""
    if source is not None:
        tok = HFTokenizer.from_folder(source)
        files = {n: (source / n).read_bytes() for n in HF_FOLDER_FILES if (source / n).is_file()}
        if "tokenizer_config.json" in files:
            files["tokenizer_config.json"] = _json(genai_readable_config(json.loads(files["tokenizer_config.json"])))
        eos = [int(i) for i in (entry or {}).get("eos_ids") or []] or ([tok.eos_id] if tok.eos_id is not None else [])
        if not eos:
            raise ExportError(f"{source}: no end-of-sequence token (generation_config.json's eos_token_id or "
                              "tokenizer_config.json's eos_token); onnxruntime-genai needs one")
        bos = tok.bos_id if tok.bos_id is not None else eos[0]
        return TokenizerFiles(files, bos, eos, tok.pad_id if tok.pad_id is not None else eos[0])
    if entry is not None and entry.get("type") == FAIRSEQ_TYPE:
        names = {"bos": "</s>", "eos": "</s>", "pad": "<pad>", "unk": "<unk>"}  # fairseq's LM input starts with </s>
        config: dict[str, Any] = {"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": context,
                                  "clean_up_tokenization_spaces": False,
                                  **{f"{k}_token": v for k, v in names.items()}}
        tok_json = entry["tokenizer_json"]
        genai_form = word_level_for_genai(tok_json) if tok_json.get("model", {}).get("type") == "WordLevel" else None
        if genai_form is not None:
            tok_json = genai_form
            # onnxruntime-genai then starts an encoding with </s> (bos), as fairseq's LM input and tokenizer.json do
            config.update({"add_bos_token": True, "add_eos_token": False, FAIRSEQ_WORDS: True})
        files = {"tokenizer.json": _json(tok_json), "tokenizer_config.json": _json(config)}
        return TokenizerFiles(files, int(entry["bos_id"]), [int(entry["eos_id"])], int(entry["pad_id"]))
    if entry is not None and entry.get("type") != ByteTokenizer.type:
        raise ExportError(f"no tokenizer files can be made from a {entry.get('type')!r} tokenizer entry; export the "
                          "model from its Hugging Face folder or fairseq checkpoint")
    byte = ByteTokenizer.from_dict(entry) if entry else ByteTokenizer()
    if byte.vocab_size != vocab_size:
        raise ExportError(f"the checkpoint names no tokenizer and its {vocab_size}-token vocabulary is not the byte "
                          f"tokenizer's ({byte.vocab_size}); export it from its Hugging Face folder instead")
    files = {"tokenizer.json": _json(tokenizer_json(byte)),
             "tokenizer_config.json": _json(tokenizer_config(byte, context)),
             "special_tokens_map.json": _json(special_tokens_map(byte))}
    return TokenizerFiles(files, byte.bos_id, [byte.eos_id], byte.pad_id)


def genai_readable_config(config: dict[str, Any]) -> dict[str, Any]:
    """A folder's tokenizer_config.json without its null entries: transformers writes `"chat_template": null` for a
    tokenizer without one, and onnxruntime-genai's tokenizer then fails to load ("type must be string, but is
    null"), so the folder's export said `passed (1 check skipped)` and onnxruntime-genai could not tokenize."""
    return {k: v for k, v in config.items() if v is not None}


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


def word_level_for_genai(word_level: dict[str, Any]) -> dict[str, Any] | None:
    """A fairseq word-level tokenizer.json (models.fairseq_dict.word_tokenizer) in a form that both the `tokenizers`
    library and onnxruntime-genai's tokenizer (onnxruntime-extensions' BPE reader; it reads no WordLevel) load.

    For `tokenizers` it encodes exactly as fairseq (and the WordLevel file) does: the normalizer strips the text and
    turns each whitespace run into one U+2581, the Split keeps each U+2581 with its word, and a BPE whose vocabulary
    is "\u2581word" -> fairseq's id looks each word up whole (`ignore_merges`); an unknown word falls apart into
    characters that are all unknown (no key is a single character) and fuse into one `<unk>`.
    onnxruntime-extensions ignores the normalizer and `ignore_merges`, but it looks each regex match up whole first
    (spaces made U+2581; the Metaspace decoder makes it read raw UTF-8 and put a U+2581 before the text), and its
    fallback spells an unknown word in bytes: every `<0xXX>` byte token is an alias of `<unk>`,
    and one merge (`<unk>`, `<unk>`) -> `<unk>` folds them into one. Where the two differ (text not normalised as
    fairseq normalises it: leading or trailing whitespace, a word after a newline or tab) is measured by
    export.genai_validate and described in the README. U+2581 stands for whitespace in both, so a text holding it
    is not read as fairseq reads it, and a dictionary with a word holding it keeps its WordLevel file (None).

    Why those differences stay (onnxruntime-extensions 319f8d2, operators/tokenizer/): its regex pre-tokenizer
    skips the whitespace between matches but returns what follows the last match one character at a time
    (bpe_utils.hpp, GetNextToken), so trailing whitespace becomes tokens; a text (or the part after an added token)
    that starts with a space goes to its character-by-character path, which never looks a word up whole
    (bpe_kernels.cc, SpmTokenize: `special`); only a space becomes U+2581, so a word after a newline has no key.
    A second key per word (the word without U+2581) would fix the last, but a word's decoded text is whichever of
    its keys an unordered_map lists last (bpe_tokenizer_model.hpp, id2token_map_): measured, 40% of 50,000 words
    then decode without their space. A WordLevel file does not load (JsonFastTokenizer reads BPE only; Unigram's
    Viterbi splits an unknown word into a known prefix and `<unk>`), nor does WordPiece (no tokenizer class maps to
    it in tokenizer_jsconfig.hpp).
    """
    words: dict[str, int] = word_level["model"]["vocab"]
    if any(SPM_SPACE in w for w in words):
        return None
    specials = {t["content"] for t in word_level.get("added_tokens", [])}
    vocab = {w if w in specials else SPM_SPACE + w: i for w, i in words.items()}
    unk = words["<unk>"]
    for b in range(256):
        vocab.setdefault(f"<0x{b:02X}>", unk)
    vocab.setdefault("<0x00><0x00>", unk)
    spm = SPM_SPACE
    return {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        # <unk> not special: ort-extensions drops the space of the word after a special token when decoding, and
        # fairseq shows <unk> too
        "added_tokens": [{**t, "special": t["content"] != "<unk>"} for t in word_level.get("added_tokens", [])],
        "normalizer": {"type": "Sequence", "normalizers": [
            {"type": "Strip", "strip_left": True, "strip_right": True},
            {"type": "Replace", "pattern": {"Regex": r"\s+"}, "content": spm},
            {"type": "Prepend", "prepend": spm},
        ]},
        # a word with the one space or U+2581 before it; ort-extensions runs this regex (std::regex, on UTF-8 bytes)
        "pre_tokenizer": {"type": "Split", "pattern": {"Regex": f"(?:{spm}| )?(?:(?!{spm})\\S)+"},
                          "behavior": "MergedWithNext", "invert": False},
        "post_processor": word_level.get("post_processor"),
        # each word decodes as " word" in both (as models.fairseq_dict.FairseqTokenizer's pieces); `add_prefix_space`
        # (ignored by `tokenizers`, which keeps prepend_scheme) makes ort-extensions put its U+2581 before the text
        "decoder": {"type": "Sequence", "decoders": [
            {"type": "Metaspace", "replacement": spm, "prepend_scheme": "never", "split": False,
             "add_prefix_space": True},
        ]},
        "model": {
            "type": "BPE", "dropout": None, "unk_token": "<unk>", "continuing_subword_prefix": None,
            "end_of_word_suffix": None, "fuse_unk": True, "byte_fallback": False, "ignore_merges": True,
            "vocab": vocab, "merges": [["<0x00>", "<0x00>"]],
        },
    }
