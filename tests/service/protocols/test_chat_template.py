"""The server's chat-template rendering equals transformers' apply_chat_template, and incremental detokenization never
cuts a character and never lets a stop string out (service.protocols.chat_template, service.engine.text.detokenizer,
models.hf_text)."""

from __future__ import annotations

from pathlib import Path

import pytest

transformers = pytest.importorskip("transformers")

from models.hf_text import HFTextTokenizer  # noqa: E402
from models.hf_tokenizer import HFTokenizer  # noqa: E402
from models.tokenizer import ByteTokenizer  # noqa: E402
from service.engine.text.detokenizer import IncrementalDetokenizer  # noqa: E402
from service.protocols.chat_template import ChatTemplateError, render  # noqa: E402

CHATML = ("{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
          "{{ '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}{% endif %}"
          "{{'<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n'}}{% endfor %}"
          "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")
# Llama-2 style: a system message folded into the first user turn, roles must alternate (raise_exception)
ALTERNATING = ("{% if messages[0]['role'] == 'system' %}{% set loop_messages = messages[1:] %}"
               "{% set system_message = messages[0]['content'] %}{% else %}{% set loop_messages = messages %}"
               "{% set system_message = false %}{% endif %}"
               "{% for message in loop_messages %}"
               "{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
               "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}"
               "{% endif %}"
               "{% if loop.index0 == 0 and system_message != false %}"
               "{% set content = '<<SYS>>\\n' + system_message + '\\n<</SYS>>\\n\\n' + message['content'] %}"
               "{% else %}{% set content = message['content'] %}{% endif %}"
               "{% if message['role'] == 'user' %}{{ bos_token + '[INST] ' + content.strip() + ' [/INST]' }}"
               "{% elif message['role'] == 'assistant' %}{{ ' '  + content.strip() + ' ' + eos_token }}{% endif %}"
               "{% endfor %}")
# trim_blocks / lstrip_blocks matter here: block tags on their own indented lines
INDENTED = """{{ bos_token }}
{% for m in messages %}
    {% if m['role'] == 'user' %}
User: {{ m['content'] | trim }}
    {% else %}
{{ m['role'] | capitalize }}: {{ m['content'] }}{{ eos_token }}
    {% endif %}
{% endfor %}
{% if add_generation_prompt %}
Assistant:{% endif %}"""

CONVERSATIONS = [
    [{"role": "user", "content": "Hello there"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": " What is MultiMax? "},
     {"role": "assistant", "content": "A reweighting."}, {"role": "user", "content": "wörds ✓ 日本"}],
]


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from tests.models.hf_folder.reference import train_tokenizer

    out = tmp_path_factory.mktemp("tok")
    train_tokenizer(out)
    return out


@pytest.mark.parametrize("template", [CHATML, ALTERNATING, INDENTED], ids=["chatml", "alternating", "indented"])
def test_rendering_equals_transformers(template: str, tokenizer_dir: Path) -> None:
    theirs = transformers.AutoTokenizer.from_pretrained(tokenizer_dir)
    specials = {"bos": "<s>", "eos": "</s>", "pad": "<pad>"}
    for messages in CONVERSATIONS:
        want = theirs.apply_chat_template(messages, chat_template=template, tokenize=False, add_generation_prompt=True)
        assert render(template, messages, specials) == want
        ids = theirs.apply_chat_template(messages, chat_template=template, tokenize=True, add_generation_prompt=True)
        ids = ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids
        ours = HFTextTokenizer(HFTokenizer.from_folder(tokenizer_dir))
        assert ours.encode(render(template, messages, specials), bos=False) == list(ids)


def test_a_template_that_raises_says_why(tokenizer_dir: Path) -> None:
    theirs = transformers.AutoTokenizer.from_pretrained(tokenizer_dir)
    twice = [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]
    with pytest.raises(Exception, match="must alternate"):
        theirs.apply_chat_template(twice, chat_template=ALTERNATING, tokenize=False)
    with pytest.raises(ChatTemplateError, match="must alternate"):
        render(ALTERNATING, twice, {"bos": "<s>", "eos": "</s>"})
    with pytest.raises(ChatTemplateError, match="has no attribute 'nope'"):
        render("{{ messages[0]['nope'].x }}", twice, {})


def test_the_sandbox_keeps_templates_away_from_python() -> None:
    with pytest.raises(ChatTemplateError):
        render("{{ ''.__class__.__mro__[1].__subclasses__() }}", [], {})


# ---- incremental detokenization ---------------------------------------------------------------------------------


def _stream(tok: object, ids: list[int], prompt: list[int], stops: tuple[str, ...] = ()) -> list[str]:
    detok = IncrementalDetokenizer(tok.decode, prompt, stops)  # type: ignore[attr-defined]
    return [detok.step(ids[:k], final=k == len(ids)) for k in range(1, len(ids) + 1)]


TEXT = "Straße wörld ✓ 日本語 😀 end"


def test_byte_level_bpe_text_leaves_as_each_character_completes(tokenizer_dir: Path) -> None:
    tok = HFTextTokenizer(HFTokenizer.from_folder(tokenizer_dir))
    ids = tok.encode(TEXT, bos=False)
    prompt = tok.encode("Say:", bos=True)
    pieces = _stream(tok, ids, prompt)
    assert "".join(pieces) == TEXT == tok.decode(ids)
    assert all("\ufffd" not in p for p in pieces)
    # a token that completes no character sends nothing; one that does sends it at once (not a step later)
    for k in range(1, len(ids) + 1):  # text goes out with the token that completes it, not a step later
        assert "".join(pieces[:k]) == tok.decode_bytes(ids[:k]).decode("utf-8", errors="ignore")
    assert any(p == "" for p in pieces[:-1]), "the test text should split characters over tokens"


def test_byte_tokenizer_streams_whole_characters() -> None:
    tok = ByteTokenizer()
    ids = tok.encode(TEXT)
    pieces = _stream(tok, ids, tok.encode("x"))
    assert "".join(pieces) == TEXT and all("\ufffd" not in p for p in pieces)
    assert sum(1 for p in pieces if p) == len(TEXT)  # one character per event, as soon as it is whole


def test_stop_strings_are_held_back_and_removed(tokenizer_dir: Path) -> None:
    tok = ByteTokenizer()
    ids = tok.encode("abc STOP def")
    detok = IncrementalDetokenizer(tok.decode, [], ("STOP",))
    out = [detok.step(ids[:k]) for k in range(1, ids.index(ord("P")) + 1)]
    assert "".join(out) == "abc "  # "STO" held back: it may be the stop
    # the decode loop removes the stop's tokens and ends the sequence
    assert detok.step(ids[:4], final=True) == "" and detok.covered == 4
    detok2 = IncrementalDetokenizer(tok.decode, [], ("STOP",))
    assert "".join(detok2.step(ids[:k]) for k in range(1, 7)) == "abc "
    assert detok2.step(ids[:8]) + detok2.step(ids, final=True) == "STOP def"  # "STOX.." would be released too
