"""How logprobs and echo name a Hugging Face tokenizer's tokens: each token by what it adds to a text. A
SentencePiece-style tokenizer.json (Llama 2, Mistral: U+2581 for a space, <0xNN> byte fallback) decoded one token
at a time strips a piece's leading space and turns a byte of a character into U+FFFD, so its pieces are read
instead; special tokens go by their names (two top_logprobs entries of one name would collide in OpenAI's dict)."""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("transformers")

from models.hf_text import HFTextTokenizer
from models.hf_tokenizer import HFTokenizer
from service.protocols.choices import token_text
from tests.conformance.builders import _tokenizer


@pytest.mark.parametrize("spm", [True, False])
def test_each_token_is_named_by_what_it_adds(tmp_path: Path, spm: bool) -> None:
    _tokenizer(tmp_path, bos=True, chat=None, spm=spm)
    tok = HFTextTokenizer(HFTokenizer.from_folder(tmp_path))
    assert tok.spm_pieces is spm and tok.byte_level is not spm
    text = "Return the é 日本 ✓ Ω"  # Ω is in no training text: bytes of no piece of its own
    ids = tok.encode(text, bos=False)
    names = [token_text(tok, i) for i in ids]
    # concatenated, the names spell the text (the space a SentencePiece tokenizer prepends included)
    raw = b"".join(tok.token_bytes(i) for i in ids)
    assert raw.decode("utf-8") == (" " + text if spm else text)
    assert len(set(names)) == len(set(ids))  # one name per distinct token
    assert any(n.startswith("bytes:") for n in names)
    eos = tok.eos_id
    assert token_text(tok, eos) == "</s>" and tok.token_bytes(eos) == b""
    if spm:
        space = tok.hf.tokenizer.token_to_id("\u2581")
        assert token_text(tok, space) == " "


def test_a_stream_of_byte_pieces_is_the_whole_text(tmp_path: Path) -> None:
    """`tokenizers` decodes a run of SentencePiece byte pieces together: <0x7F> alone is DEL, but <0x7F><0xE6>
    (not UTF-8 as a run) is two U+FFFD. A stream waits for a run to end, so what it sent is the whole text's."""
    from service.engine.text.detokenizer import IncrementalDetokenizer

    _tokenizer(tmp_path, bos=True, chat=None, spm=True)
    tok = HFTextTokenizer(HFTokenizer.from_folder(tmp_path))
    piece = tok.hf.tokenizer.token_to_id
    words = [tok.encode(w, bos=False)[-1] for w in ("num", "the")]
    runs = [[piece("<0x7F>"), piece("<0xE6>")], [piece("<0xC3>"), piece("<0xA9>")], [piece("<0xE6>")]]
    for seq in ([words[0], *runs[0], words[1]], [*runs[1], words[0], *runs[2]], [*runs[0], *runs[2], words[1]]):
        detok = IncrementalDetokenizer(tok.decode, [], (), tok.joins_next)
        sent = "".join(detok.step(seq[:n], final=n == len(seq)) for n in range(1, len(seq) + 1))
        assert sent == tok.decode(seq), seq
        without = IncrementalDetokenizer(tok.decode, [], ())
        unaware = "".join(without.step(seq[:n], final=n == len(seq)) for n in range(1, len(seq) + 1))
        if seq[1:3] == runs[0]:
            assert unaware != tok.decode(seq)  # what the stream sent before: DEL, then one U+FFFD


@pytest.mark.parametrize("template", [False, 3, {"default": "x"}])
def test_a_chat_template_that_is_no_template_is_refused_by_name(tmp_path: Path, template: object) -> None:
    import json

    from models.loading import CheckpointError

    _tokenizer(tmp_path, bos=True, chat=None)
    path = tmp_path / "tokenizer_config.json"
    path.write_text(json.dumps(json.loads(path.read_text()) | {"chat_template": template}))
    with pytest.raises(CheckpointError, match="chat_template must be a template string"):
        HFTokenizer.from_folder(tmp_path)


@pytest.mark.parametrize("spm", [True, False])
def test_one_token_decodes_are_kept_and_equal_the_tokenizers_own(tmp_path: Path, spm: bool,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """A stream decodes each new token alone once a step (the detokenizer's prefix window); HFTokenizer keeps
    those texts by id. Kept or not, every id decodes as `tokenizers` decodes it, specials skipped; with specials
    kept, nothing is read from (or written to) what is kept; the store stops growing at its bound."""
    import models.hf_tokenizer as hf_tokenizer
    from service.engine.text.detokenizer import IncrementalDetokenizer

    _tokenizer(tmp_path, bos=True, chat=None, spm=spm)
    hf = HFTokenizer.from_folder(tmp_path)
    raw = hf.tokenizer
    vocab = raw.get_vocab_size()
    for _ in range(2):  # the first pass fills the store, the second reads it
        assert [hf.decode([i]) for i in range(vocab)] == [raw.decode([i], skip_special_tokens=True)
                                                         for i in range(vocab)]
    assert len(hf._one) == vocab
    eos = hf.eos_ids[0]
    assert hf.decode([eos]) == "" and hf.decode([eos], skip_special=False) == "</s>"
    # a stream's text is the same through the store as through tokenizers alone
    tok = HFTextTokenizer(hf)
    ids = tok.encode("Return the é 日本 ✓ Ω of the num", bos=False) * 3
    streamed = IncrementalDetokenizer(tok.decode, [], (), tok.joins_next)
    text = "".join(streamed.step(ids[:n], final=n == len(ids)) for n in range(1, len(ids) + 1))
    assert text == raw.decode(ids, skip_special_tokens=True)
    monkeypatch.setattr(hf_tokenizer, "ONE_TOKEN_CACHE", 3)
    bounded = HFTokenizer.from_folder(tmp_path)
    assert [bounded.decode([i]) for i in range(10)] == [raw.decode([i], skip_special_tokens=True)
                                                        for i in range(10)]
    assert len(bounded._one) == 3
