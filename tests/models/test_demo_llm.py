"""The demo LLM's trainer and folder writer (models.training.llm, llm_folder): a Hugging Face Llama folder with a
SegLU head that this project loads, that transformers loads too (dropping the SegLU, as it does for PaddleFleet's
models), whose logits equal transformers' with the SegLU applied, written byte for byte reproducibly.

A short training run (seconds) stands in for the shipped recipe here: the folder's form and the equality with
transformers do not depend on how long it trained."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

transformers = pytest.importorskip("transformers")
from safetensors.torch import load_file  # noqa: E402

from models.cli import main as models_main  # noqa: E402
from models.generate import generate  # noqa: E402
from models.hf_folder import load_folder  # noqa: E402
from models.training.cli import main as training_main  # noqa: E402
from models.training.llm import SAMPLE_PROMPTS, save_llm, train_llm  # noqa: E402
from models.training.text import stdlib_docstring_list  # noqa: E402
from tests.models.hf_folder.reference import Reference  # noqa: E402

TOL = 1e-4
SHORT: dict[str, Any] = dict(steps=10, warmup=2, batch_size=4, seq_len=32, vocab_size=600, sample_tokens=4,
                             progress=False)


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("llm") / "llama_seglu"
    save_llm(train_llm(docs=stdlib_docstring_list()[:600], **SHORT), out)
    return out


@pytest.fixture(scope="module")
def loaded(folder: Path) -> tuple:
    model, info = load_folder(folder)
    tensors = load_file(folder / "model.safetensors")
    ref = Reference(folder, (tensors["lm_head.multimax_ranges"], tensors["lm_head.multimax_ts"]), {})
    return model, info, ref


def test_folder_is_a_hf_llama_with_a_seglu_head(folder: Path) -> None:
    files = sorted(p.name for p in folder.iterdir())
    assert files == ["config.json", "generation_config.json", "model.safetensors", "tokenizer.json",
                     "tokenizer_config.json"]
    config = json.loads((folder / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"] and config["multimax_modules"] == ["lm_head"]
    assert json.loads((folder / "generation_config.json").read_text())["eos_token_id"] == [0, 2]
    _, info = load_folder(folder)
    assert info.tokenizer.vocab_size == 600 and info.config.multimax_output and not info.config.multimax_attention
    assert info.config.tie_word_embeddings and info.tokenizer.eos_ids == (0, 2)
    prompt = info.tokenizer.apply_chat_template([{"role": "user", "content": "Hi"}])
    assert prompt == "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"


def test_transformers_reads_the_tokenizer_and_template_as_we_do(folder: Path) -> None:
    theirs = transformers.AutoTokenizer.from_pretrained(folder)
    _, info = load_folder(folder)
    text = "Return the value of the 'spam' attribute, or None.\n\n>>> f(1)"
    assert theirs(text)["input_ids"] == info.tokenizer.encode(text)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is os.path?"}]
    assert theirs.apply_chat_template(messages, tokenize=False, add_generation_prompt=True) == (
        info.tokenizer.apply_chat_template(messages))
    assert theirs.eos_token == "<|endoftext|>" and theirs.pad_token_id == info.tokenizer.pad_id


def test_models_info_describes_it(folder: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert models_main(["info", str(folder)]) == 0
    out = capsys.readouterr().out
    assert "LlamaForCausalLM" in out and "SegLU on lm_head" in out and "chat template yes" in out


def test_logits_equal_transformers_with_seglu_applied(loaded: tuple) -> None:
    model, info, ref = loaded
    g = torch.Generator().manual_seed(0)
    worst, seglu_effect = 0.0, 0.0
    with torch.no_grad():
        for batch, length in ((1, 1), (1, 40), (3, 17), (2, 128)):
            ids = torch.randint(0, info.config.vocab_size, (batch, length), generator=g)
            ours, _ = model(ids)
            want = ref.logits(ids)
            worst = max(worst, float((ours - want).abs().max()))
            plain = ref.model(ids).logits.float()  # what transformers alone serves: the SegLU dropped
            seglu_effect = max(seglu_effect, float((want - plain).abs().max()))
    assert worst < TOL, worst
    assert seglu_effect > 0.01  # the SegLU changes the logits: the comparison above could fail


def test_greedy_text_equals_transformers_with_seglu(loaded: tuple) -> None:
    model, info, ref = loaded
    tok = info.tokenizer
    for prompt in SAMPLE_PROMPTS:
        ids = tok.encode(prompt)
        ours = generate(model, ids, 32, temperature=0.0)[0]
        theirs = ref.greedy(torch.tensor([ids]), torch.ones(1, len(ids), dtype=torch.long), 32)[0]
        assert ours == theirs, prompt


def test_llm_training_is_reproducible_to_the_byte_and_learns(tmp_path: Path) -> None:
    docs = stdlib_docstring_list()[:600]
    a, b = train_llm(docs=docs, **SHORT), train_llm(docs=docs, **SHORT)
    save_llm(a, tmp_path / "a")
    save_llm(b, tmp_path / "b")
    for name in sorted(p.name for p in (tmp_path / "a").iterdir()):
        assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes(), name
    assert a["metrics"]["heldout_loss"] < 6.3  # ln 600 = 6.4 is chance
    model, _ = load_folder(tmp_path / "a")
    assert torch.equal(model.state_dict()["output_multimax.ts"], a["state_dict"]["output_multimax.ts"])


def test_train_llm_refuses_options_of_other_tasks(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    assert training_main(["train", "llm", "-o", str(tmp_path / "x"), "--epochs", "3"]) == 2
    assert "do not apply" in capsys.readouterr().err and not (tmp_path / "x").exists()
    assert training_main(["train", "llm"]) == 2
    assert "needs -o" in capsys.readouterr().err


# ---- the shipped demo LLM (models/demo/llama_seglu, `python -m models.training train demos --only llm`) ----------

def test_shipped_demo_llm_is_what_its_report_says() -> None:
    """Its held-out loss and greedy samples, measured now from the folder, are the ones recorded at training."""
    from tokenizers import Tokenizer

    from models.demo import DEMO_DIR, LLM_DEMO
    from models.training.llm import ENDOFTEXT, HELDOUT_FRAC, encode_corpus, heldout_loss

    folder = DEMO_DIR / LLM_DEMO
    report = json.loads((DEMO_DIR / "report.json").read_text())[LLM_DEMO]
    model, info = load_folder(folder)
    assert info.config.multimax_output and model.output_multimax is not None
    assert sum(p.numel() for p in model.parameters()) == report["parameters"]
    assert model.output_multimax.ranges.tolist() == pytest.approx(report["seglu"]["ranges"], abs=1e-6)
    assert (folder / "model.safetensors").stat().st_size < 8_000_000  # a few MB, as the issue asks
    docs = stdlib_docstring_list()
    held = docs[-max(1, int(len(docs) * HELDOUT_FRAC)):]
    tok = Tokenizer.from_file(str(folder / "tokenizer.json"))
    loss = heldout_loss(model, encode_corpus(tok, held), report["seq_len"])
    assert loss == pytest.approx(report["heldout_loss"], rel=1e-4)
    assert report["heldout_bits_per_byte"] < 2.2  # the byte-level demo GPT: 2.16 (README)
    eos = tok.token_to_id(ENDOFTEXT)
    for prompt, text in report["samples_greedy"].items():
        new = generate(model, tok.encode(prompt).ids, 48, temperature=0.0, eos_id=eos)[0]
        assert tok.decode(new) == text, prompt
