"""The tokenizer.json a fairseq word-level dictionary gets in an onnxruntime-genai folder
(export.hf_tokenizer.word_level_for_genai, a BPE form that onnxruntime-genai's tokenizer reads) encodes with the
`tokenizers` library exactly as fairseq's dictionary does, and as the checkpoint's WordLevel tokenizer does: words
split on whitespace, an unknown word (punctuation attached, a word made of known single characters, any script) one
`<unk>`, `</s>` first. onnxruntime-genai's side is checked on exported folders in
tests/export/test_genai_llm_export.py."""

from __future__ import annotations

import json
import random
import string

from tokenizers import Tokenizer

from export.hf_tokenizer import SPM_SPACE, word_level_for_genai
from models.fairseq_dict import SPECIALS, word_tokenizer


def fairseq_encode(symbols: list[str], text: str) -> list[int]:
    """fairseq's LM input: </s>, then each whitespace-split word's index (<unk> = 3 for the rest)."""
    index = {s: i for i, s in enumerate(symbols)}
    return [2, *(index.get(w, 3) for w in text.split())]


def dictionary(size: int, rng: random.Random) -> list[str]:
    symbols = list(SPECIALS) + list(string.ascii_letters + string.digits + ",.;:()'\"-@!?") + ["é", "日", "@-@", "a,b"]
    seen = set(symbols)
    while len(symbols) < size:
        word = "".join(rng.choice(string.ascii_letters + "éü") for _ in range(rng.randint(2, 9)))
        if word not in seen:
            symbols.append(word)
            seen.add(word)
    return symbols


def test_genai_form_encodes_as_fairseq_and_the_word_level_tokenizer() -> None:
    rng = random.Random(0)
    symbols = dictionary(5000, rng)
    word_level = word_tokenizer(symbols)
    folder = Tokenizer.from_str(json.dumps(word_level_for_genai(json.loads(word_level.to_str()))))
    unknown = ["zzqx", "ab", "Grüße,", "日本", "€", "~~", "the,", "<0x41>", "<0x00><0x00>"]
    spaces = [" ", "  ", "\n", "\t", " \r\n "]
    texts = ["", " ", "\n", "a", " a b ", "a\nb\tc", "  ".join(symbols[4:40])]
    for _ in range(300):
        words = [rng.choice(symbols[4:] + unknown) for _ in range(rng.randint(1, 15))]
        text = "".join(w + rng.choice(spaces) for w in words)
        texts.append(text if rng.random() < 0.5 else text.strip())
    for text in texts:
        expected = fairseq_encode(symbols, text)
        assert folder.encode(text).ids == expected, repr(text)
        assert word_level.encode(text).ids == expected, repr(text)
    # each word decodes as " word"; <unk> is shown, as fairseq shows it
    assert folder.decode([2, 4, 30, 3, 5]) == f" {symbols[4]} {symbols[30]}<unk> {symbols[5]}"
    # the fallback aliases are all <unk>: no id outside fairseq's dictionary exists
    assert max(folder.get_vocab().values()) == len(symbols) - 1
    # U+2581 stands for whitespace in this form: a dictionary with a word holding it keeps its WordLevel file
    assert word_level_for_genai(json.loads(word_tokenizer([*symbols, f"a{SPM_SPACE}b"]).to_str())) is None
