"""benchmarks.loadtest against a small fake server (raw ASGI on uvicorn, in a thread,
tests/benchmarks/loadtest/fake_server.py): the chat workload, prompt lengths in a tokenizer's tokens, an API key sent
and never written. No assertion depends on how fast this machine is: they count requests."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks.loadtest import LoadConfig, run
from benchmarks.loadtest.cli import main
from benchmarks.loadtest.config import ConfigError, IntRange
from tests.benchmarks.loadtest.fake_server import FakeServer

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module")
def word_tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A word-level tokenizer.json: "ab cd " is two tokens, whatever chunks it arrives in."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel({"[UNK]": 0, "ab": 1, "cd": 2, "the": 3, "quick": 4}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    path = tmp_path_factory.mktemp("tok") / "tokenizer.json"
    tok.save(str(path))
    return path


def test_chat_workload_streams_and_counts(fake: tuple[str, FakeServer], word_tokenizer: Path) -> None:
    url, app = fake
    app.reset()
    res = run(LoadConfig(url=url, workload="chat", model="text", concurrency=2, requests=6, keep_samples=True,
                         max_tokens=IntRange(3, 5), system_prompt="Be brief.",
                         extra_body={"response_format": {"type": "json_object"}}))
    assert res.ok == 6 and app.counts["chat"] == 6
    body = app.chat_bodies[0]
    assert body["stream"] is True and body["stream_options"] == {"include_usage": True}
    assert [m["role"] for m in body["messages"]] == ["system", "user"] and body["messages"][1]["content"]
    assert body["response_format"] == {"type": "json_object"}  # --extra-body
    assert all(s.output_tokens == 2 * max_tokens and s.prompt_tokens == 11  # the server's usage
               for s, max_tokens in zip(sorted(res.samples, key=lambda s: s.index),
                                        [b["max_tokens"] for b in app.chat_bodies], strict=False))
    assert res.generation is not None and res.generation["ttft_ms"]["count"] == 6
    # No usage: the streamed text counted with the tokenizer (2 words a chunk), not the chunks (1 a delta)
    counted = run(LoadConfig(url=url, workload="chat", model="nousage", concurrency=1, requests=3, keep_samples=True,
                             max_tokens=IntRange(4, 4), tokenizer=word_tokenizer))
    assert [s.output_tokens for s in counted.samples] == [8, 8, 8]
    chunks = run(LoadConfig(url=url, workload="chat", model="nousage", concurrency=1, requests=1, keep_samples=True,
                            max_tokens=IntRange(4, 4)))
    assert chunks.samples[0].output_tokens == 24  # no --tokenizer: byte-level (the demo models), 6 bytes a chunk
    whole = run(LoadConfig(url=url, workload="chat", model="nousage", concurrency=1, requests=2, keep_samples=True,
                           max_tokens=IntRange(3, 3), stream=False, tokenizer=word_tokenizer))
    assert whole.ok == 2 and [s.output_tokens for s in whole.samples] == [6, 6]


def test_prompt_lengths_are_in_the_tokenizers_tokens(word_tokenizer: Path, tmp_path: Path) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    from benchmarks.loadtest.tokens import load_counter
    from benchmarks.loadtest.workloads import _CORPUS, ChatWorkload, GenerateWorkload

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    bpe.train_from_iterator([_CORPUS] * 5, trainers.BpeTrainer(vocab_size=600, show_progress=False,
                                                               initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    folder = tmp_path / "bpe"
    folder.mkdir()
    bpe.save(str(folder / "tokenizer.json"))
    cfg = LoadConfig(workload="generate", concurrency=1, requests=1, prompt_len=IntRange(3, 6),
                     tokenizer=folder)  # a folder holding tokenizer.json
    wl = GenerateWorkload(cfg)
    counter = load_counter(folder)
    assert len(counter.encode(_CORPUS)) < len(_CORPUS) / 3  # words, not bytes: lengths really are in tokens
    for i in range(20):
        spec = wl.request(i)
        prompt = json.loads(spec.body or b"")["prompt"]
        assert 3 <= spec.prompt_tokens <= 6 and spec.prompt_tokens == len(counter.encode(prompt))
    chat = ChatWorkload(LoadConfig(workload="chat", concurrency=1, requests=1))
    spec = chat.request(0)
    assert spec.path == "/v1/chat/completions"
    assert json.loads(spec.body or b"")["messages"][0]["role"] == "user"
    with pytest.raises(ConfigError, match="not a tokenizers file"):
        load_counter(Path(__file__))
    assert load_counter(word_tokenizer).encode("ab cd ab") == [1, 2, 1]


def test_api_key_is_sent_and_never_written(fake: tuple[str, FakeServer], tmp_path: Path,
                                           capsys: pytest.CaptureFixture[str]) -> None:
    url, app = fake
    app.reset()
    app.api_key = "s3cret-key"
    try:
        with pytest.raises(ConfigError, match="give --api-key"):
            run(LoadConfig(url=url, workload="chat", model="text", concurrency=1, requests=1))
        with pytest.raises(ConfigError, match="check --api-key"):
            run(LoadConfig(url=url, workload="chat", model="text", concurrency=1, requests=1, api_key="wrong"))
        out = tmp_path / "run"
        code = main(["--url", url, "--workload", "chat", "--model", "text", "--concurrency", "1", "--requests", "2",
                     "--max-tokens", "2", "--api-key", "s3cret-key", "--out", str(out), "--quiet", "--no-metrics"])
        assert code == 0 and app.counts["chat"] == 2
        written = "".join(p.read_text(errors="replace") for p in out.iterdir() if p.suffix in (".json", ".csv"))
        assert "s3cret-key" not in written and "s3cret-key" not in capsys.readouterr().out
    finally:
        app.api_key = None
