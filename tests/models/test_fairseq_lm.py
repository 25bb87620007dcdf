"""fairseq transformer_lm checkpoints (issue 26): read safely, built from their configuration, equal to fairseq.

The fixtures under tests/fixtures/fairseq/ were written by fairseq's own trainer with the official MultiMax files
(`tests/fixtures/fairseq/build.py`), with the paper's Table 8 parameters; `expected.npz` / `expected.json` hold
fairseq's full-forward log-probabilities and greedy words. These tests need no fairseq.
"""

from __future__ import annotations

import json
import os
import pickle
import shutil
import sys
import types
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from models import checkpoint as ckpt_io
from models.cli import main as models_main
from models.fairseq_dict import load_tokenizer, read_dictionary
from models.fairseq_lm import FairseqLM
from models.loading import CheckpointError
from tests import paths

FIXTURES = paths.FIXTURES / "fairseq"
NAMES = ("postnorm_tied", "prenorm_untied", "namespace_args", "dictconfig", "gpt2_bpe")
TOLERANCE = 1e-4


def expected(name: str) -> tuple[dict[str, Any], Any]:
    return json.loads((FIXTURES / name / "expected.json").read_text()), np.load(FIXTURES / name / "expected.npz")


@pytest.fixture(scope="module", params=NAMES)
def loaded(request: pytest.FixtureRequest) -> tuple[str, FairseqLM, ckpt_io.Checkpoint, dict[str, Any]]:
    model, ckpt, info = ckpt_io.load(FIXTURES / request.param / "checkpoint.pt")
    assert isinstance(model, FairseqLM)
    return request.param, model, ckpt, info


def full_logprobs(model: FairseqLM, ids: list[int]) -> np.ndarray:
    with torch.no_grad():
        logits, _ = model(torch.tensor([ids]))
    return torch.log_softmax(logits[0], dim=-1).numpy()


def test_full_forward_log_probs_equal_fairseq(loaded: tuple) -> None:
    name, model, _, _ = loaded
    exp, arrays = expected(name)
    for i, case in enumerate(exp["cases"]):
        diff = np.abs(full_logprobs(model, case["ids"]) - arrays[f"logprobs_{i}"]).max()
        assert diff <= TOLERANCE, f"{name} case {i}: max |log-prob diff| {diff:.2e}"


def test_greedy_words_equal_fairseq(loaded: tuple) -> None:
    name, model, ckpt, _ = loaded
    exp, _ = expected(name)
    tokenizer = load_tokenizer(ckpt.tokenizer)
    for case in exp["cases"]:
        seq = list(case["ids"])
        for _ in case["greedy_ids"]:
            seq.append(int(full_logprobs(model, seq)[-1].argmax()))
        greedy = seq[len(case["ids"]):]
        assert greedy == case["greedy_ids"]
        assert tokenizer.decode(greedy, skip_special_tokens=False) == case["greedy_words"]


def test_tokenizer_gives_fairseq_lm_input(loaded: tuple) -> None:
    """</s> then the word ids, unknown words as <unk>: what fairseq's dictionary gave for the same text."""
    name, _, ckpt, _ = loaded
    exp, _ = expected(name)
    tokenizer = load_tokenizer(ckpt.tokenizer)
    for case in exp["cases"]:
        assert tokenizer.encode(case["text"]).ids == case["ids"]
    if name == "gpt2_bpe":  # byte-level BPE: fairseq's GPT2BPE pieces as fairseq's dictionary numbers them
        assert ckpt.tokenizer["fairseq"] == "gpt2" and max(max(c["ids"]) for c in exp["cases"]) > 30
    else:
        assert 3 in exp["cases"][2]["ids"]  # the fixture's "zebra" is out of vocabulary: the test covers <unk>


def test_cached_decoding_equals_full_forward(loaded: tuple) -> None:
    """The KV-cache path (what export and serving run) keeps the attention MultiMax, unlike fairseq's own."""
    name, model, _, _ = loaded
    ids = expected(name)[0]["cases"][1]["ids"]
    full = full_logprobs(model, ids)
    with torch.no_grad():
        logits, past = model(torch.tensor([ids[:4]]))
        steps = [logits[0]]
        for t in range(4, len(ids)):
            logits, past = model(torch.tensor([[ids[t]]]), past_key_values=past)
            steps.append(logits[0])
    cached = torch.log_softmax(torch.cat(steps), dim=-1).numpy()
    assert np.abs(cached - full).max() < 1e-5


def test_architecture_read_from_the_configuration(loaded: tuple) -> None:
    name, _, ckpt, info = loaded
    c = ckpt.config
    flags = expected(name)[0]["fairseq_flags"]
    assert c["normalize_before"] == ("--decoder-normalize-before" in flags)
    assert c["final_norm"] == ("--decoder-normalize-before" in flags and "--no-decoder-final-norm" not in flags)
    assert c["tied"] == ("--share-decoder-input-output-embed" in flags)
    assert c["positions"] == ("learned" if "--decoder-learned-pos" in flags else "sinusoidal")
    assert c["scale_embedding"] == ("--no-scale-embedding" not in flags)
    assert c["layernorm_embedding"] == ("--layernorm-embedding" in flags)
    assert c["activation"] == (flags[flags.index("--activation-fn") + 1] if "--activation-fn" in flags else "relu")
    assert c["input_dim"] == int(flags[flags.index("--decoder-input-dim") + 1])
    assert c["multimax_attention"] and c["multimax_output"]
    stored = expected(name)[0]["config_stored_as"]
    assert info["config_from"].startswith({"cfg": "cfg (dict)", "namespace": "args (argparse.Namespace)",
                                           "dictconfig": "cfg (omegaconf DictConfig)"}[stored])


def test_info_command(capsys: pytest.CaptureFixture[str]) -> None:
    assert models_main(["info", str(FIXTURES / "dictconfig" / "checkpoint.pt"), "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["architecture"] == "fairseq_lm" and d["format"] == "fairseq"
    assert d["read"]["config_from"] == "cfg (omegaconf DictConfig)"
    assert d["multimax"] == {"attention_layers": 2, "total_layers": 2, "output": True, "variant": "second"}


# --- bad input: exit 2, one line, nothing run ------------------------------------------------------------------


def copy_fixture(tmp_path: Path, name: str = "postnorm_tied", dict_too: bool = True) -> Path:
    shutil.copy(FIXTURES / name / "checkpoint.pt", tmp_path / "checkpoint.pt")
    if dict_too:
        shutil.copy(FIXTURES / name / "dict.txt", tmp_path / "dict.txt")
    return tmp_path / "checkpoint.pt"


def rewrite(path: Path, change: Any) -> Path:
    state = torch.load(path, weights_only=True)
    change(state)
    torch.save(state, path)
    return path


def info_error(path: Path, capsys: pytest.CaptureFixture[str], *extra: str) -> str:
    assert models_main(["info", str(path), *extra]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "Traceback" not in err and err.count("\n") == 1
    return err


class Payload:
    """A configuration value whose unpickling would run a shell command."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, tuple[str]]:
        return os.system, (f"touch {self.marker}",)


def test_reduce_payload_in_configuration_runs_nothing(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    marker = tmp_path / "pwned"
    path = rewrite(copy_fixture(tmp_path), lambda s: s["cfg"]["model"].update(activation_fn=Payload(marker)))
    with pytest.raises(pickle.UnpicklingError):  # the payload really is in the file
        torch.load(path, weights_only=True)
    err = info_error(path, capsys)
    assert "refused" in err and "system" in err
    assert not marker.exists()


def test_payload_inside_an_allowed_stand_in_runs_nothing(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """An omegaconf name (read as an inert stand-in) does not open the door to other globals inside it."""
    marker = tmp_path / "pwned"

    class AnyNode:  # pickled under omegaconf's name, as a real DictConfig's nodes are
        pass

    AnyNode.__module__, AnyNode.__qualname__ = "omegaconf.nodes", "AnyNode"
    fake = types.ModuleType("omegaconf.nodes")
    fake.AnyNode = AnyNode  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "omegaconf", types.ModuleType("omegaconf"))
    monkeypatch.setitem(sys.modules, "omegaconf.nodes", fake)
    node = AnyNode()
    node.__dict__["_val"] = Payload(marker)
    path = rewrite(copy_fixture(tmp_path), lambda s: s["cfg"]["model"].update(activation_fn=node))
    err = info_error(path, capsys)
    assert "refused" in err and "system" in err
    assert not marker.exists()


@pytest.mark.parametrize(("key", "value", "words"), [
    ("adaptive_softmax_cutoff", "10,20", "adaptive softmax"),
    ("adaptive_input", True, "adaptive input"),
    ("quant_noise_pq", 0.1, "quant-noise"),
    ("_name", "transformer", "not supported"),
])
def test_unsupported_variants_refused_by_name(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], key: str, value: Any, words: str
) -> None:
    def change(state: dict) -> None:
        state["cfg"]["model"][key] = value
        if key == "_name":
            state["cfg"]["model"]["arch"] = value

    assert words in info_error(rewrite(copy_fixture(tmp_path), change), capsys)


def test_missing_switch_is_an_error_not_a_guess(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = rewrite(copy_fixture(tmp_path), lambda s: s["cfg"]["model"].pop("decoder_normalize_before"))
    assert "decoder_normalize_before" in info_error(path, capsys)


def test_dictionary_beside_or_given(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = copy_fixture(tmp_path, dict_too=False)
    assert "dict.txt" in info_error(path, capsys)
    assert models_main(["info", str(path), "--dict", str(FIXTURES / "postnorm_tied" / "dict.txt")]) == 0
    capsys.readouterr()
    short = tmp_path / "short.txt"
    short.write_text("the 5\ncat 3\n")
    assert "symbols" in info_error(path, capsys, "--dict", str(short))


def test_dict_for_a_deit_checkpoint_is_refused(tmp_path: Path) -> None:
    from models.deit import DeiT, DeiTConfig

    sd = DeiT(DeiTConfig(embed_dim=16, depth=1, num_heads=2, img_size=32, patch_size=16, num_classes=3)).state_dict()
    with pytest.raises(CheckpointError, match="--dict"):
        ckpt_io.parse({"model": sd}, "deit.pt", num_heads=2, dictionary="dict.txt")


def test_read_dictionary_follows_fairseq(tmp_path: Path) -> None:
    path = tmp_path / "dict.txt"
    path.write_text("hello 9\nworld 3\nhello 1 #fairseq:overwrite\n")
    symbols = read_dictionary(path)
    assert symbols == ["<s>", "<pad>", "</s>", "<unk>", "hello", "world"]  # no padding added: the file has it
    path.write_text("hello 9\nhello 3\n")
    with pytest.raises(CheckpointError, match="duplicate"):
        read_dictionary(path)
    path.write_text("hello nine\n")
    with pytest.raises(CheckpointError, match="symbol count"):
        read_dictionary(path)


@pytest.mark.slow
def test_export_cli_validates_a_fairseq_lm(tmp_path: Path) -> None:
    from export.cli import main as export_main

    out = tmp_path / "lm.onnx"
    code = export_main([str(FIXTURES / "prenorm_untied" / "checkpoint.pt"), "-o", str(out), "--samples", "8",
                        "--quiet"])
    report = json.loads(out.with_name("lm.validation.json").read_text())
    assert report["arch"] == "fairseq_lm"
    assert report["validation"]["greedy"]["identical"] == report["validation"]["greedy"]["prompts"]
    assert report["validation"]["ORT_ENABLE_BASIC"]["max_abs"] < 1e-4, report["problems"]
    assert code == 0, report["problems"]
    # the server takes the file with its fairseq tokenizer (the metadata carries the tokenizer.json)
    from service.base.config import Settings
    from service.engine.registry import load_model

    entry = load_model("lm", "onnxruntime", {"onnxruntime": out}, Settings(model_dir=tmp_path))
    try:
        assert entry.tokenizer is not None and entry.tokenizer.type == "hf-tokenizers"
        assert entry.tokenizer.encode("the cat") == [2, 7, 28]
    finally:
        entry.backend.close()


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["onnxruntime", "torch"])
def test_fairseq_lm_answers_completions_through_openai(tmp_path: Path, backend: str) -> None:
    """Issue 26 item 3, exported (ONNX Runtime) or as fairseq's own checkpoint with its dict.txt (PyTorch): words
    joined by spaces; log-probs of the prompt and of the greedy word as fairseq's."""
    import openai

    from benchmarks.server import start, stop
    from export.pipeline import ExportOptions, export_checkpoint

    models = tmp_path / "models"
    models.mkdir()
    source = FIXTURES / "prenorm_untied"
    if backend == "torch":
        shutil.copy(source / "checkpoint.pt", models / "fairseq_lm.pt")
        shutil.copy(source / "dict.txt", models / "dict.txt")
    else:
        export_checkpoint(source / "checkpoint.pt", ExportOptions(output=models / "fairseq_lm.onnx", validate=False,
                                                                  progress=False))
    exp, arrays = expected("prenorm_untied")
    case, logprobs = exp["cases"][0], arrays["logprobs_0"]
    proc, url = start("--model-dir", str(models))
    try:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
        done = client.completions.create(model="fairseq_lm", prompt=case["text"], max_tokens=6, temperature=0,
                                         logprobs=1, echo=True)
    finally:
        stop(proc)
    choice = done.choices[0]
    first_eos = case["greedy_ids"].index(2)
    words = case["greedy_words"].split()[:first_eos]
    assert choice.text == " " + case["text"] + "".join(" " + w for w in words)  # greedy up to fairseq's </s>
    assert choice.finish_reason == "stop"
    lps = choice.logprobs
    assert lps is not None and lps.tokens is not None and lps.token_logprobs is not None
    assert lps.tokens == ["</s>", *(" " + w for w in case["text"].split()), *(" " + w for w in words)]
    ids = case["ids"]
    want = [logprobs[t - 1][ids[t]] for t in range(1, len(ids))] + [logprobs[-1][case["greedy_ids"][0]]]
    got = lps.token_logprobs[1:len(ids) + 1]
    assert np.abs(np.array(got) - np.array(want)).max() < TOLERANCE
    assert done.usage is not None and done.usage.prompt_tokens == len(ids)


@pytest.mark.parametrize("name", ["gpt2_bpe", "prenorm_untied"])
def test_server_tokenizer_text_is_fairseqs(name: str) -> None:
    """The server's view of the tokenizer: a prompt's ids, and the text of generated ids (GPT-2 BPE: fairseq's
    GPT2BPE.decode; words: joined by spaces)."""
    from models.tokenizer import tokenizer_from_dict

    _, ckpt, _ = ckpt_io.load(FIXTURES / name / "checkpoint.pt")
    tok = tokenizer_from_dict(ckpt.tokenizer)
    assert tok.vocab_size == ckpt.config["vocab_size"] and tok.eos_id == 2 and tok.pad_id == 1
    for case in expected(name)[0]["cases"]:
        assert tok.encode(case["text"]) == case["ids"]
        if name == "gpt2_bpe":
            assert tok.decode(case["ids"]) == case["text"]  # byte-level BPE round-trips
            assert tok.decode(case["greedy_ids"]) == case["greedy_words"]
            assert tok.decode_bytes(case["greedy_ids"]) == case["greedy_words"].encode()
        else:
            words = [w for w in case["greedy_words"].split() if w != "</s>"]
            assert tok.decode(case["greedy_ids"]) == "".join(" " + w for w in words)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        tok.decode_bytes([tok.vocab_size])


def test_configuration_interpolations_are_resolved(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """fairseq's dataclasses write `max_target_positions: ${task.max_target_positions}`; an unresolved one in the
    saved configuration is looked up there, as omegaconf would."""
    def change(state: dict) -> None:
        state["cfg"]["model"]["max_target_positions"] = "${task.tokens_per_sample}"
        state["cfg"]["task"]["tokens_per_sample"] = 24

    path = rewrite(copy_fixture(tmp_path), change)
    assert models_main(["info", str(path), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["sizes"]["block_size"] == 24


def test_older_fairseq_sinusoidal_placeholder_is_ignored(tmp_path: Path) -> None:
    """Older fairseq saved `decoder.embed_positions._float_tensor` (an empty placeholder): read and dropped."""
    path = rewrite(copy_fixture(tmp_path),
                   lambda s: s["model"].__setitem__("decoder.embed_positions._float_tensor", torch.zeros(1)))
    model, _, _ = ckpt_io.load(path)
    exp, arrays = expected("postnorm_tied")
    assert np.abs(full_logprobs(model, exp["cases"][0]["ids"]) - arrays["logprobs_0"]).max() <= TOLERANCE
