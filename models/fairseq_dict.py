"""A fairseq dictionary (`dict.txt`) as a Hugging Face `tokenizers` tokenizer with fairseq's ids.

fairseq numbers `<s>`=0, `<pad>`=1, `</s>`=2, `<unk>`=3, then the `dict.txt` lines ("symbol count") in order
(`fairseq-preprocess` writes its padding, `madeupword0000 0`, ..., into the file itself). An LM reads a line
as `</s>` followed by its words (split on whitespace; unknown words are `<unk>`), which the tokenizer's
post-processor reproduces. The GPT-2 BPE variant (`--bpe gpt2`) stores GPT-2 token ids as the symbols; with
GPT-2's `encoder.json` and `vocab.bpe` it becomes a byte-level BPE whose ids are fairseq's.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors

from .loading import CheckpointError

SPECIALS = ("<s>", "<pad>", "</s>", "<unk>")
BOS, PAD, EOS, UNK = range(4)
OVERWRITE = "#fairseq:overwrite"
TOKENIZER_TYPE = "hf-tokenizers"  # Checkpoint.tokenizer["type"] for a tokenizer.json carried inline


def read_dictionary(path: Path) -> list[str]:
    """fairseq's symbol table as `Dictionary.load` builds it: the four specials, then `path`'s symbols."""
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise CheckpointError(f"{path}: no such dictionary file") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise CheckpointError(f"{path}: cannot read the dictionary ({exc})") from None
    symbols = list(SPECIALS)
    seen = set(symbols)
    for number, line in enumerate(text.splitlines(), 1):
        line = line.rstrip()
        if not line:
            continue
        field, _, count = line.rpartition(" ")
        overwrite = count == OVERWRITE
        if overwrite:
            field, _, count = field.rpartition(" ")
        if not field or not count.lstrip("-").isdigit():
            raise CheckpointError(f"{path}:{number}: expected 'symbol count', got {line[:60]!r}")
        if field in seen and not overwrite:
            raise CheckpointError(f"{path}:{number}: duplicate symbol {field!r} (fairseq marks intended ones "
                                  f"with {OVERWRITE})")
        if field not in seen:
            symbols.append(field)
            seen.add(field)
    return symbols


def _finish(tok: Tokenizer) -> Tokenizer:
    tok.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in SPECIALS])
    tok.post_processor = processors.TemplateProcessing(single="</s> $A", special_tokens=[("</s>", EOS)])
    return tok


def word_tokenizer(symbols: list[str]) -> Tokenizer:
    """Word level: whitespace-split words, `<unk>` for the rest; decoding joins words with spaces."""
    tok = Tokenizer(models.WordLevel({s: i for i, s in enumerate(symbols)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return _finish(tok)


def gpt2_tokenizer(symbols: list[str], encoder_json: Path, vocab_bpe: Path) -> Tokenizer:
    """GPT-2 byte-level BPE whose token ids are the fairseq dictionary's (symbols are GPT-2 ids as text)."""
    try:
        encoder: dict[str, int] = json.loads(encoder_json.read_text(encoding="utf-8"))
        merge_lines = vocab_bpe.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CheckpointError(f"cannot read the GPT-2 BPE files ({exc})") from None
    by_id = {i: piece for piece, i in encoder.items()}
    vocab: dict[str, int] = {}
    for index, symbol in enumerate(symbols):
        if index < len(SPECIALS):
            vocab[symbol] = index
        elif symbol.isdigit() and int(symbol) in by_id:
            vocab[by_id[int(symbol)]] = index
        else:
            vocab[symbol] = index  # madeup words and specials fairseq adds
    # fairseq encodes with all of GPT-2's merges and maps ids missing from dict.txt to <unk>; a merge whose
    # pieces are missing cannot be expressed in one BPE table, so such dictionaries are refused.
    merges: list[tuple[str, str]] = []
    for line in merge_lines:
        if not line or line.startswith("#version"):
            continue
        a, _, b = line.partition(" ")
        if a not in vocab or b not in vocab or a + b not in vocab:
            raise CheckpointError(f"{vocab_bpe}: merge {line!r} uses a piece that dict.txt does not list; "
                                  "this tokenizer needs a dictionary that covers the BPE vocabulary")
        merges.append((a, b))
    bpe = models.BPE(vocab, merges, unk_token="<unk>")
    tok = Tokenizer(bpe)
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    return _finish(tok)


def tokenizer_for(
    checkpoint: Path, dictionary: str | Path | None, vocab_size: int, bpe: str | None
) -> tuple[dict[str, Any], str]:
    """The Checkpoint.tokenizer entry (tokenizer.json inline) and where the dictionary came from.

    `dictionary`: a dict.txt path, else `dict.txt` beside the checkpoint (as fairseq's from_pretrained finds it).
    `bpe` is the checkpoint's `--bpe` ("gpt2" needs encoder.json and vocab.bpe beside the dictionary).
    """
    path = Path(dictionary) if dictionary else checkpoint.parent / "dict.txt"
    if not path.is_file():
        raise CheckpointError(f"no dictionary for this fairseq model: {path} does not exist (put fairseq's dict.txt "
                              "beside the checkpoint or pass --dict PATH)")
    symbols = read_dictionary(path)
    if len(symbols) != vocab_size:
        raise CheckpointError(f"{path}: {len(symbols)} symbols (with fairseq's four specials), the model's "
                              f"embedding has {vocab_size} rows")
    if bpe == "gpt2":
        tok = gpt2_tokenizer(symbols, path.parent / "encoder.json", path.parent / "vocab.bpe")
        kind = "gpt2"
    elif bpe in (None, "", "none", "space"):
        tok = word_tokenizer(symbols)
        kind = "word"
    else:
        raise CheckpointError(f"fairseq --bpe {bpe} is not supported (supported: none, gpt2)")
    entry = {
        "type": TOKENIZER_TYPE,
        "fairseq": kind,
        "vocab_size": vocab_size,
        "bos_id": EOS,  # fairseq's LM input starts with </s>
        "eos_id": EOS,
        "pad_id": PAD,
        "tokenizer_json": json.loads(tok.to_str()),
    }
    return entry, str(path)


def load_tokenizer(entry: dict[str, Any]) -> Tokenizer:
    """The tokenizers.Tokenizer that `tokenizer_for` stored."""
    return Tokenizer.from_str(json.dumps(entry["tokenizer_json"]))


def _byte_alphabet() -> dict[str, int]:
    """GPT-2's byte-level alphabet reversed: the printable character that stands for each byte -> the byte."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in chars:
            chars[b] = chr(256 + extra)  # the bytes without a printable stand-in, numbered after 255 in order
            extra += 1
    return {c: b for b, c in chars.items()}


class FairseqTokenizer:
    """A fairseq dictionary's tokenizer behind the interface the server uses (`models.tokenizer.TextTokenizer`).

    Encoding is the tokenizer.json's (</s> first, as fairseq's LM input). Each token's text is its bytes: a word
    is " word" (words joined by spaces), a GPT-2 BPE piece its bytes; the four specials have none.
    """

    type = TOKENIZER_TYPE
    chat_template: str | None = None
    concatenates = False  # a word's text depends on its neighbours only through the spaces: decoded whole

    def __init__(self, entry: dict[str, Any]) -> None:
        self.entry = entry
        self.tokenizer = load_tokenizer(entry)
        vocab = self.tokenizer.get_vocab(with_added_tokens=True)
        by_id = {i: piece for piece, i in vocab.items()}
        size = int(entry["vocab_size"])
        if sorted(by_id) != list(range(size)):
            raise ValueError(f"fairseq tokenizer: ids are not 0..{size - 1}")
        self.names = by_id
        alphabet = _byte_alphabet() if entry.get("fairseq") == "gpt2" else None
        self.pieces: list[bytes] = []
        for i in range(size):
            piece = by_id[i]
            if i < len(SPECIALS):
                self.pieces.append(b"")
            elif alphabet is not None and all(c in alphabet for c in piece):
                self.pieces.append(bytes(alphabet[c] for c in piece))
            else:
                self.pieces.append((" " + piece).encode("utf-8"))

    @property
    def vocab_size(self) -> int:
        return len(self.pieces)

    @property
    def bos_id(self) -> int:
        return int(self.entry.get("bos_id", EOS))

    @property
    def eos_id(self) -> int:
        return int(self.entry.get("eos_id", EOS))

    @property
    def pad_id(self) -> int:
        return int(self.entry.get("pad_id", PAD))

    @property
    def eos_ids(self) -> tuple[int, ...]:
        return (self.eos_id,)

    def tokenizer_json(self) -> str | None:
        """None: a word is " word" here, not what the tokenizer.json decodes, so a grammar engine reads the
        byte table."""
        return None

    def encode(self, text: str, bos: bool = False) -> list[int]:
        # begins with </s> either way (fairseq's LM input); encode_batch releases the GIL (models.hf_tokenizer)
        return list(self.tokenizer.encode_batch([text])[0].ids)

    def token_bytes(self, token: int) -> bytes:
        return self.decode_bytes([token])

    def joins_next(self, token: int) -> bool:
        return False

    def special_texts(self) -> dict[str, str]:
        return {}

    def decode_bytes(self, ids: Iterable[int]) -> bytes:
        out = bytearray()
        for i in ids:
            i = int(i)
            if not 0 <= i < len(self.pieces):
                raise ValueError(f"token id {i} is outside the vocabulary (0..{len(self.pieces) - 1})")
            out += self.pieces[i]
        return bytes(out)

    def decode(self, ids: Iterable[int], skip_special: bool = True) -> str:
        out = bytearray()
        for i in ids:
            i = int(i)
            if 0 <= i < len(SPECIALS):
                out += b"" if skip_special else self.names[i].encode("utf-8")
            else:
                out += self.decode_bytes([i])
        return out.decode("utf-8", errors="replace")  # bytes first: a BPE piece may hold part of a character

    def to_dict(self) -> dict[str, Any]:
        return dict(self.entry)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> FairseqTokenizer:
        if d.get("type") != TOKENIZER_TYPE or not isinstance(d.get("tokenizer_json"), dict):
            raise ValueError(f"not a {TOKENIZER_TYPE} tokenizer entry")
        try:
            return cls(d)
        except Exception as exc:  # tokenizers raises its own exception types for a damaged tokenizer.json
            raise ValueError(f"unusable tokenizer.json: {exc}") from None
