"""The onnxruntime-genai folder export (`python -m export CKPT -o DIR`): what the folder holds, onnxruntime-genai
loading it unchanged and generating what PyTorch generates (with the fused library and with the function
bodies), the cache written in place, the byte tokenizer as tokenizer.json, and bad input."""

from __future__ import annotations

import ctypes
import json
from pathlib import Path

import numpy as np
import pytest
import torch

from export.cli import main
from export.genai_folder import CONFIG_FILE, LIBRARY_FILE, MODEL_FILE, REPORT_FILE, TOKENIZER_FILES
from export.genai_validate import genai_greedy, without_library
from models.checkpoint import Checkpoint, save_checkpoint
from models.generate import generate
from models.gpt import GPT, GPTConfig, set_paper_params
from models.loading import load_exact
from models.tokenizer import ByteTokenizer
from plugins import ort_ops
from tests.paths import ROOT

og = pytest.importorskip("onnxruntime_genai")
DEMO_TEXT = ROOT / "models" / "demo" / "text_multimax.pt"
DEMO_VISION = ROOT / "models" / "demo" / "digits_multimax.pt"


def export(args: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    code = main([*args, "--quiet"])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


@pytest.fixture(scope="module")
def demo_folder(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    folder = tmp_path_factory.mktemp("genai") / "text_multimax"
    import io
    from contextlib import redirect_stdout

    buf = io.StringIO()
    with redirect_stdout(buf):
        code = main([str(DEMO_TEXT), "-o", str(folder), "--samples", "12", "--quiet"])
    assert code == 0, buf.getvalue()
    return folder, buf.getvalue()


def demo_model() -> GPT:
    ckpt = torch.load(DEMO_TEXT, weights_only=True)
    model = GPT(GPTConfig.from_dict(ckpt["config"]))
    load_exact(model, ckpt["state_dict"], "demo")
    return model.eval()


def test_folder_holds_model_config_tokenizer_and_library(demo_folder: tuple[Path, str]) -> None:
    folder, out = demo_folder
    expected = {MODEL_FILE, CONFIG_FILE, REPORT_FILE, *TOKENIZER_FILES}
    if ort_ops.library().available:
        expected.add(LIBRARY_FILE)
    assert {p.name for p in folder.iterdir()} == expected
    config = json.loads((folder / CONFIG_FILE).read_text())
    decoder = config["model"]["decoder"]
    assert config["search"]["past_present_share_buffer"] is True
    assert decoder["session_options"].get("custom_ops_library") == (
        LIBRARY_FILE if LIBRARY_FILE in expected else None)
    assert (decoder["num_hidden_layers"], decoder["num_attention_heads"], decoder["head_size"]) == (4, 4, 32)
    assert config["model"]["context_length"] == 128 and config["model"]["eos_token_id"] == 257
    report = json.loads((folder / REPORT_FILE).read_text())
    assert report["passed"] and report["genai_folder"] == str(folder)
    assert report["graph"]["custom_nodes"] == ["multimax::MultiMaxAttention", "multimax::MultiMaxSigma"]
    genai = report["validation"]["genai"]
    assert genai["function_bodies"]["identical"] == genai["prompts"] == 5
    if LIBRARY_FILE in expected:
        assert genai["library"]["identical"] == 5
        assert report["validation"]["fused_ops"]["in_use"]
    assert genai["tokenizer"]["identical"] == genai["tokenizer"]["texts"]
    assert report["validation"]["ORT_ENABLE_ALL"]["buffer_tail_untouched"]
    assert out.splitlines()[0].startswith(f"wrote the onnxruntime-genai folder {folder}")
    assert "onnxruntime-genai: greedy == PyTorch (library 5/5" in out or LIBRARY_FILE not in expected
    assert out.splitlines()[-2] == "passed" and genai["version"].startswith("0.18")


def test_genai_greedy_equals_pytorch_with_and_without_the_library(demo_folder: tuple[Path, str],
                                                                   tmp_path: Path) -> None:
    folder, _ = demo_folder
    model = demo_model()
    tok = ByteTokenizer()
    prompts = [tok.encode("The MultiMax "), tok.encode("日本"), [256, 72, 105]]
    refs = [generate(model, p, 24, temperature=0)[0] for p in prompts]
    assert genai_greedy(without_library(folder, tmp_path), prompts, 24) == refs
    if not (folder / LIBRARY_FILE).is_file():
        pytest.skip(f"fused library unavailable: {ort_ops.library().reason}")
    lib = ctypes.CDLL(str(folder / LIBRARY_FILE))  # the handle onnxruntime-genai loads: same counters
    runs, in_place = ctypes.c_uint64(), ctypes.c_uint64()
    lib.MultiMaxRunCounts(ctypes.byref(runs), ctypes.byref(in_place))
    before = in_place.value
    assert genai_greedy(folder, prompts, 24) == refs
    lib.MultiMaxRunCounts(ctypes.byref(runs), ctypes.byref(in_place))
    # every attention node of every call (prefill + 23 decode steps, 4 layers) wrote into the shared buffer
    assert in_place.value - before == len(prompts) * 24 * 4


def genai_batch(folder: Path, texts: list[str], tokens: int) -> list[list[int]]:
    """Greedy new tokens for prompts of different lengths in one onnxruntime-genai batch (it pads them)."""
    model = og.Model(str(folder))
    batch = og.Tokenizer(model).encode_batch(texts)
    params = og.GeneratorParams(model)
    params.set_search_options(max_length=batch.shape()[1] + tokens, do_sample=False, batch_size=len(texts))
    generator = og.Generator(model, params)
    generator.append_tokens(batch)
    while not generator.is_done():
        generator.generate_next_token()
    return [[int(t) for t in generator.get_sequence(i)[-tokens:]] for i in range(len(texts))]


BATCH_TEXTS = ["The quick brown fox", "abc", "hello there"]


def test_genai_batch_of_different_lengths_equals_pytorch(demo_folder: tuple[Path, str]) -> None:
    prompts = [ByteTokenizer().encode(t) for t in BATCH_TEXTS]
    assert genai_batch(demo_folder[0], BATCH_TEXTS, 16) == generate(demo_model(), prompts, 16, temperature=0)


TEXTS = ["", "a", "hello world", " leading and trailing ", "tabs\tand\nnewlines\r\n", "Grüße aus Köln", "ça va? où?",
         "Ελληνικά", "русский текст", "עברית", "العربية", "हिन्दी", "中文字符", "日本語とカタカナ", "한국어",
         "emoji 🎉👍🏽 👨‍👩‍👧", "combining e\u0301 and \u00e9", "zero\u200bwidth", "controls \x01\x1b and DEL \x7f",
         "<|bos|> as text", "ĠĊ (GPT-2's byte characters as text)", "x" * 300]


def test_tokenizer_json_encodes_and_decodes_like_the_byte_tokenizer(demo_folder: tuple[Path, str]) -> None:
    folder, _ = demo_folder
    gtok = og.Tokenizer(og.Model(str(folder)))
    tok = ByteTokenizer()
    for text in TEXTS:
        ids = tok.encode(text)
        if "<|bos|>" not in text:  # a special token's text is that token in every Hugging Face tokenizer
            assert list(gtok.encode(text)) == ids, text
        assert gtok.decode(np.array(ids, dtype=np.int32)) == tok.decode(ids) == text
    assert list(gtok.encode("<|bos|> as text")) == [256, *tok.encode(" as text")]
    # special tokens are dropped when decoding
    assert gtok.decode(np.array([256, 104, 105, 257], dtype=np.int32)) == tok.decode([256, 104, 105, 257]) == "hi"
    # bytes that are not UTF-8: U+FFFD in both, but onnxruntime-genai's decoder drops the rest (README says so)
    assert tok.decode([0x41, 0xFF, 0x42]) == "A\ufffdB"
    assert gtok.decode(np.array([0x41, 0xFF, 0x42], dtype=np.int32)) == "A\ufffd"
    # onnxruntime-genai passes text as C strings: it ends at a NUL both ways (README says so)
    assert tok.decode([65, 0, 66]) == "A\x00B"
    assert gtok.decode(np.array([65, 0, 66], dtype=np.int32)) == "A"
    assert list(gtok.encode("A\x00B")) == [65]


def test_softmax_model_uses_group_query_attention_and_no_library(tmp_path: Path,
                                                                 capsys: pytest.CaptureFixture[str]) -> None:
    torch.manual_seed(0)
    config = GPTConfig.from_preset("gpt-nano", multimax_attention=False, multimax_output=False)
    model = GPT(config).eval()
    ckpt = save_checkpoint(Checkpoint("gpt", config.to_dict(), model.state_dict(),
                                      tokenizer=ByteTokenizer().to_dict()), tmp_path / "soft.pt")
    code, out, err = export([str(ckpt), "-o", str(tmp_path / "soft"), "--samples", "12"], capsys)
    assert code == 0, out + err
    assert not (tmp_path / "soft" / LIBRARY_FILE).exists()
    import onnx

    proto = onnx.load(str(tmp_path / "soft" / MODEL_FILE))
    assert {n.op_type for n in proto.graph.node if n.domain} == {"GroupQueryAttention"}
    prompt = ByteTokenizer().encode("softmax")
    assert genai_greedy(tmp_path / "soft", [prompt], 20) == [generate(model, prompt, 20, temperature=0)[0]]
    prompts = [ByteTokenizer().encode(t) for t in BATCH_TEXTS]
    assert genai_batch(tmp_path / "soft", BATCH_TEXTS, 16) == generate(model, prompts, 16, temperature=0)


def test_v2_multimax_folds_into_the_attention_node(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    torch.manual_seed(1)
    config = GPTConfig.from_preset("gpt-nano", variant="v2")
    model = GPT(config).eval()
    set_paper_params(model)
    with torch.no_grad():
        for block in model.block_list():
            assert block.attn.multimax is not None
            block.attn.multimax.t.fill_(1.7)
            block.attn.multimax.b.fill_(-0.4)
    ckpt = save_checkpoint(Checkpoint("gpt", config.to_dict(), model.state_dict(),
                                      tokenizer=ByteTokenizer().to_dict()), tmp_path / "v2.pt")
    code, out, err = export([str(ckpt), "-o", str(tmp_path / "v2"), "--samples", "12"], capsys)
    assert code == 0, out + err


def test_re_export_replaces_an_earlier_folder(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    folder = tmp_path / "again"
    for _ in range(2):
        code, out, err = export([str(DEMO_TEXT), "-o", str(folder), "--no-validate"], capsys)
        assert code == 0, out + err
    assert (folder / CONFIG_FILE).is_file() and json.loads((folder / REPORT_FILE).read_text())["verdict"].startswith(
        "not validated")
    assert [p.name for p in tmp_path.iterdir()] == ["again"]  # no staging folder left behind


@pytest.mark.parametrize("case", ["existing file", "foreign folder", "missing parent", "vision", "int8", "inline"])
def test_bad_folder_targets_exit_2_and_write_nothing(case: str, tmp_path: Path,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    ckpt, target, extra = DEMO_TEXT, tmp_path / "out", []
    if case == "existing file":
        target.write_text("keep me")
    elif case == "foreign folder":
        target.mkdir()
        (target / "notes.txt").write_text("keep me")
    elif case == "missing parent":
        target = tmp_path / "nowhere" / "out"
    elif case == "vision":
        ckpt = DEMO_VISION
    else:
        extra = [f"--{case}"]
    before = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*"))
    code, out, err = export([str(ckpt), "-o", str(target), *extra], capsys)
    assert code == 2, out + err
    assert err.startswith("error: ") and len(err.strip().splitlines()) == 1 and "Traceback" not in err
    assert sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*")) == before
    if case in ("existing file", "foreign folder"):
        kept = target if case == "existing file" else target / "notes.txt"
        assert kept.read_text() == "keep me"


def test_fused_attention_refuses_a_cache_that_is_neither_the_past_nor_a_buffer(demo_folder: tuple[Path, str]) -> None:
    if not ort_ops.library().available:
        pytest.skip(f"fused library unavailable: {ort_ops.library().reason}")
    import onnxruntime as ort

    from export.fused_check import cpu_session
    from models.onnx_contract import text_feeds

    session = cpu_session(demo_folder[0] / MODEL_FILE)
    past = np.zeros((1, 4, 7, 32), np.float32)  # 5 cached + 4 new = 9: 7 positions fit neither way
    feed = text_feeds(np.zeros((1, 4), np.int64), np.ones((1, 9), np.int64), np.arange(5, 9)[None], [(past, past)] * 4)
    with pytest.raises(ort.capi.onnxruntime_pybind11_state.InvalidArgument,
                       match="past_key holds 7 positions: either the past \\(5\\) or a buffer of at least the total"):
        session.run(None, feed)


@pytest.mark.parametrize("function", [{"attention_function": "sparsemax"}, {"output_function": "entmax15"}])
def test_other_reweighting_functions_are_refused_for_the_folder(function: dict, tmp_path: Path,
                                                                capsys: pytest.CaptureFixture[str]) -> None:
    config = GPTConfig.from_preset("gpt-nano", **function)
    ckpt = save_checkpoint(Checkpoint("gpt", config.to_dict(), GPT(config).state_dict(),
                                      tokenizer=ByteTokenizer().to_dict()), tmp_path / "f.pt")
    code, _, err = export([str(ckpt), "-o", str(tmp_path / "f")], capsys)
    assert code == 2 and "single .onnx file" in err and not (tmp_path / "f").exists()
