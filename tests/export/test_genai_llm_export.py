"""The onnxruntime-genai folder export (`python -m export MODEL -o DIR`) of Hugging Face Llama / Qwen2 / Qwen3 folders
with a SegLU head, and of the paper's fairseq language models: onnxruntime-genai loads each folder unchanged and
generates greedily what PyTorch generates (checked here independently of the export's own validation), the
tokenizer files are the model's, --fp16 / --int4 report their deltas, and bad input leaves nothing behind.

The Hugging Face folders are made with transformers as in tests/models/hf_folder/reference.py (random weights,
PaddleFleet's SegLU tensors with the paper's Table 8 values, a BPE tokenizer trained with `tokenizers`)."""

from __future__ import annotations

import io
import json
from contextlib import redirect_stderr, redirect_stdout
from pathlib import Path
from typing import Any

import onnx
import pytest
import torch

pytest.importorskip("transformers")
og = pytest.importorskip("onnxruntime_genai")

from tokenizers import Tokenizer  # noqa: E402

from export.cli import main  # noqa: E402
from export.genai_folder import CONFIG_FILE, LIBRARY_FILE, MODEL_FILE, REPORT_FILE  # noqa: E402
from export.genai_fusions import FUSIONS_KEY  # noqa: E402
from export.genai_validate import genai_greedy, without_library  # noqa: E402
from models.checkpoint import load  # noqa: E402
from models.fairseq_dict import load_tokenizer  # noqa: E402
from models.generate import generate  # noqa: E402
from models.hf_folder import load_folder  # noqa: E402
from plugins import ort_ops  # noqa: E402
from tests.models.hf_folder.reference import arch_configs, make_folder, train_tokenizer  # noqa: E402
from tests.paths import FIXTURES  # noqa: E402

FAIRSEQ = FIXTURES / "fairseq"
PROMPTS = ["The quick brown fox", "MultiMax reweights", "def add(a, b):"]


@pytest.fixture(autouse=True)
def one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def hf_folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("hf_llm")
    train_tokenizer(root / "tokenizer")
    configs = arch_configs()
    # llama: softmax attention (GroupQueryAttention, 2 key/value heads for 4 query heads) with the SegLU head;
    # llama_multimax: MultiMax attention in every layer (MultiMaxAttention with grouped key/value heads)
    config, how = configs["llama"]
    folders = {"llama": make_folder(root / "llama", root / "tokenizer", config, head_prefix="lm_head.",
                                    attention_layers=[], modules=["lm_head"]),
               "llama_multimax": make_folder(root / "llama_multimax", root / "tokenizer", config, **how)}
    for name in ("qwen2", "qwen3"):  # qwen2: q/k/v biases, sharded; qwen3: q/k norm, MultiMax in layer 1 only
        config, how = configs[name]
        folders[name] = make_folder(root / name, root / "tokenizer", config, **how)
    return folders


def export(args: list[str]) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with redirect_stdout(out), redirect_stderr(err):
        code = main([*args, "--quiet"])
    return code, out.getvalue(), err.getvalue()


def greedy_refs(model: Any, prompts: list[list[int]], eos: set[int], tokens: int = 32) -> list[list[int]]:
    """PyTorch's greedy tokens as onnxruntime-genai returns them: up to and including an end-of-sequence id."""
    refs = []
    for prompt in prompts:
        ref = generate(model, prompt, tokens, temperature=0)[0]
        cut = next((i + 1 for i, t in enumerate(ref) if t in eos), len(ref))
        refs.append(ref[:cut])
    return refs


def check_folder(folder: Path, model: Any, prompts: list[list[int]], tmp_path: Path) -> dict[str, Any]:
    """The report passed; onnxruntime-genai (with and without the library) generates PyTorch's 32 greedy tokens."""
    report = json.loads((folder / REPORT_FILE).read_text())
    assert report["passed"], report["problems"]
    genai = report["validation"]["genai"]
    for run in ("library", "function_bodies"):
        if run in genai:
            assert genai[run]["identical"] == genai["prompts"]
    config = json.loads((folder / CONFIG_FILE).read_text())
    eos = config["model"]["eos_token_id"]
    refs = greedy_refs(model, prompts, {eos} if isinstance(eos, int) else set(eos))
    (tmp_path / "bodies").mkdir()
    assert genai_greedy(without_library(folder, tmp_path / "bodies"), prompts, 32) == refs
    if (folder / LIBRARY_FILE).is_file():
        assert genai_greedy(folder, prompts, 32) == refs
    return report


@pytest.mark.slow
@pytest.mark.parametrize("name, nodes, kv_cache", [
    ("llama", {"GroupQueryAttention", "MultiMaxSigma"}, 2),
    ("llama_multimax", {"MultiMaxAttention", "MultiMaxSigma"}, 2),
    ("qwen2", {"GroupQueryAttention", "MultiMaxSigma"}, 2),
    ("qwen3", {"GroupQueryAttention", "MultiMaxAttention", "MultiMaxSigma"}, 2),
])
def test_hf_folder_exports_for_onnxruntime_genai(name: str, nodes: set[str], kv_cache: int, hf_folders: dict[str, Path],
                                                 tmp_path: Path) -> None:
    source, folder = hf_folders[name], tmp_path / f"{name}_genai"
    code, out, err = export([str(source), "-o", str(folder), "--samples", "8"])
    assert code == 0, out + err
    model, info = load_folder(source)
    tok = Tokenizer.from_file(str(source / "tokenizer.json"))
    report = check_folder(folder, model, [tok.encode(p).ids for p in PROMPTS], tmp_path)
    assert report["arch"] == "llama" and report["precision"] == "fp32"
    # the tokenizer files are the folder's own, chat template and generation config included
    for file in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json"):
        assert (folder / file).read_bytes() == (source / file).read_bytes(), file
    tokenizer = report["validation"]["genai"]["tokenizer"]
    assert tokenizer["identical"] == tokenizer["texts"]
    proto = onnx.load(str(folder / MODEL_FILE))
    # the graph's small nodes fused (export.genai_fusions), in every layer of each architecture, and the greedy
    # tokens above still PyTorch's: q/k/v and gate/up one MatMul each, RoPE one node for q and one for k, the
    # residual Add and the RMSNorm after it one node (all norms but the embeddings')
    assert {n.op_type for n in proto.graph.node if n.domain} == nodes | {"RotaryEmbedding",
                                                                         "SkipSimplifiedLayerNormalization"}
    fusions = json.loads(next(p.value for p in proto.metadata_props if p.key == FUSIONS_KEY))
    layers = info.config.n_layer
    assert (fusions["RotaryEmbedding"], fusions["SkipSimplifiedLayerNormalization"], fusions["packed MatMul"]) == (
        2 * layers, 2 * layers, 5 * layers), fusions
    assert sum(n.op_type == "MultiMaxSigma" for n in proto.graph.node) == 1  # the SegLU: one node on the logits
    past = next(i for i in proto.graph.input if i.name == "past_key_values.0.key")
    assert past.type.tensor_type.shape.dim[1].dim_value == kv_cache  # key/value heads, not the 4 query heads
    decoder = json.loads((folder / CONFIG_FILE).read_text())["model"]["decoder"]
    assert (decoder["num_attention_heads"], decoder["num_key_value_heads"]) == (4, 2)
    assert decoder["head_size"] == info.config.head_dim
    assert (folder / LIBRARY_FILE).is_file() == ort_ops.library().available
    if "MultiMaxAttention" in nodes and ort_ops.library().available:
        assert report["validation"]["fused_ops"]["in_use"]


@pytest.mark.slow
@pytest.mark.parametrize("fixture", ["postnorm_tied", "prenorm_untied"])
def test_fairseq_lm_exports_for_onnxruntime_genai(fixture: str, tmp_path: Path) -> None:
    ckpt, folder = FAIRSEQ / fixture / "checkpoint.pt", tmp_path / "lm"
    code, out, err = export([str(ckpt), "-o", str(folder), "--samples", "8"])
    assert code == 0, out + err
    model, checkpoint, _ = load(ckpt)
    # the dictionary as tokenizer.json (word level, fairseq's four specials): the LM input is </s> then the words
    tok, word_level = Tokenizer.from_file(str(folder / "tokenizer.json")), load_tokenizer(checkpoint.tokenizer)
    assert [tok.id_to_token(i) for i in range(4)] == ["<s>", "<pad>", "</s>", "<unk>"]
    words = [word_level.id_to_token(i) for i in range(4, 8)]
    ids = tok.encode(" ".join(words)).ids
    assert ids == [2, 4, 5, 6, 7]
    config = json.loads((folder / CONFIG_FILE).read_text())["model"]
    assert (config["bos_token_id"], config["eos_token_id"], config["pad_token_id"]) == (2, 2, 1)
    report = check_folder(folder, model, [ids, [2, 7, 3, 5]], tmp_path)
    # the folder's tokenizer.json (a BPE form onnxruntime-genai reads) encodes as the checkpoint's word level does;
    # each word decodes as " word"
    assert tok.decode([2, 4, 5, 3, 6]) == f" {words[0]} {words[1]}<unk> {words[2]}"
    texts = [" ".join(words), "  " + "  ".join(words) + " \n", f"{words[0]}\n{words[1]}\t{words[2]}", "zzqx , ~ €",
             f"{words[0]}, {words[1]}. Grüße {words[2]}", ""]
    for text in [*texts, f"</s> {words[3]}"]:
        assert tok.encode(text).ids == word_level.encode(text).ids, text
    # onnxruntime-genai's own tokenizer: fairseq's ids (without the leading </s>) and the same text back, on text
    # normalised as fairseq normalises it (and holding no special token's text)
    gtok = og.Tokenizer(og.Model(str(without_library(folder, tmp_path / "tok"))))
    for text in texts:
        normal = " ".join(text.split())
        expected = word_level.encode(normal, add_special_tokens=False).ids
        assert [int(i) for i in gtok.encode(normal)] == expected, normal
        assert gtok.decode(expected) == tok.decode(expected), normal
    assert [int(i) for i in gtok.encode(" ".join([*words, "zzqx"]))] == [4, 5, 6, 7, 3]
    assert gtok.decode([4, 5, 3, 6]) == f" {words[0]} {words[1]}<unk> {words[2]}"
    tokenizer = report["validation"]["genai"]["tokenizer"]
    assert tokenizer["checked"] and tokenizer["identical"] == tokenizer["texts"]
    assert 0 <= tokenizer["raw_texts_identical"] <= tokenizer["texts"]


@pytest.mark.slow
@pytest.mark.parametrize("name, cache", [("qwen2", onnx.TensorProto.FLOAT16), ("qwen3", onnx.TensorProto.FLOAT)])
def test_fp16_folder_reports_deltas(name: str, cache: int, hf_folders: dict[str, Path], tmp_path: Path) -> None:
    """qwen2 (softmax): GroupQueryAttention on an fp16 cache. qwen3 mixes both attention nodes; MultiMaxAttention is
    an fp32 kernel and onnxruntime-genai gives every layer one cache dtype, so both nodes run on an fp32 cache (the
    rest in fp16). The logits stay float32."""
    folder = tmp_path / f"{name}_fp16"
    code, out, err = export([str(hf_folders[name]), "-o", str(folder), "--fp16", "--samples", "8"])
    assert code == 0, out + err
    report = json.loads((folder / REPORT_FILE).read_text())
    assert report["precision"] == "fp16" and report["passed"], report["problems"]
    stats = report["validation"]["ORT_ENABLE_ALL"]
    logits = stats["limits"]["logits"]  # export.limits: 2e-2 x max(1, max|logits|)
    assert 0 < stats["max_abs"] <= logits["limit"] == pytest.approx(2e-2 * logits["scale"])
    assert stats["next_token_agreement"] >= 0.99
    assert 0 <= report["validation"]["genai"]["function_bodies"]["token_agreement"] <= 1
    inputs = {i.name: i.type.tensor_type.elem_type for i in onnx.load(str(folder / MODEL_FILE)).graph.input}
    assert inputs["past_key_values.0.key"] == inputs["past_key_values.1.key"] == cache
    weights = {t.data_type for t in onnx.load(str(folder / MODEL_FILE)).graph.initializer if len(t.dims) == 2}
    assert weights == {onnx.TensorProto.FLOAT16}
    proto = onnx.load(str(folder / MODEL_FILE))
    outputs = {o.name: o.type.tensor_type.elem_type for o in proto.graph.output}
    assert outputs["logits"] == onnx.TensorProto.FLOAT
    # fused in fp16 too: the norms' fp32 island between two Casts is one node, RoPE's tables are fp16
    fusions = json.loads(next(p.value for p in proto.metadata_props if p.key == FUSIONS_KEY))
    assert fusions["SkipSimplifiedLayerNormalization"] == fusions["RotaryEmbedding"] == 4, fusions


@pytest.mark.slow
def test_int4_folder_reports_deltas(hf_folders: dict[str, Path], tmp_path: Path) -> None:
    folder = tmp_path / "llama_int4"
    code, out, err = export([str(hf_folders["llama"]), "-o", str(folder), "--int4", "--samples", "8"])
    assert code == 0, out + err
    proto = onnx.load(str(folder / MODEL_FILE))
    assert sum(n.op_type == "MatMulNBits" for n in proto.graph.node) == 2 * 4 + 1  # qkv o gate+up down, lm_head
    assert not [n for n in proto.graph.node if n.op_type == "MatMul" and n.input[1] in
                {i.name for i in proto.graph.initializer}]
    report = json.loads((folder / REPORT_FILE).read_text())
    assert report["precision"] == "int4" and report["passed"]  # deltas reported, not enforced
    stats = report["validation"]["ORT_ENABLE_ALL"]
    assert stats["max_abs"] > 0 and 0 <= stats["next_token_agreement"] <= 1 and stats["nan_count"] == 0
    genai = report["validation"]["genai"]
    assert genai["prompts"] and 0 <= genai["function_bodies"]["token_agreement"] <= 1
    assert "int4: deltas reported, not enforced" in out


@pytest.mark.slow
def test_no_fuse_keeps_the_traced_graph(hf_folders: dict[str, Path], tmp_path: Path) -> None:
    """`--no-fuse`: the folder's graph as traced (for comparing and debugging), validated the same way."""
    folder = tmp_path / "plain"
    code, out, err = export([str(hf_folders["llama"]), "-o", str(folder), "--no-fuse", "--samples", "4"])
    assert code == 0, out + err
    proto = onnx.load(str(folder / MODEL_FILE))
    ops = {n.op_type for n in proto.graph.node}
    assert not ops & {"RotaryEmbedding", "SkipSimplifiedLayerNormalization", "Split"} and "Neg" in ops
    assert FUSIONS_KEY not in {p.key for p in proto.metadata_props}
    assert json.loads((folder / REPORT_FILE).read_text())["passed"]


@pytest.mark.parametrize("args, needle", [
    (["--int4"], "--int4: only for the onnxruntime-genai folder export"),
    (["-o", "{tmp}/out", "--int8"], "--int8: not available for the onnxruntime-genai folder export"),
    (["-o", "{tmp}/out", "--dict", "{tmp}/dict.txt"], "--dict apply to checkpoint files"),
    (["-o", "{tmp}/out.onnx", "--no-fuse"], "--no-fuse: only for the onnxruntime-genai folder export"),
])
def test_unsupported_options_exit_2_naming_them(args: list[str], needle: str, hf_folders: dict[str, Path],
                                                 tmp_path: Path) -> None:
    code, out, err = export([str(hf_folders["qwen2"]), *(a.format(tmp=tmp_path) for a in args)])
    assert code == 2 and needle in err, out + err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err
    assert list(tmp_path.iterdir()) == []


def test_broken_folder_exits_2_and_writes_nothing(hf_folders: dict[str, Path], tmp_path: Path) -> None:
    import shutil

    broken = tmp_path / "broken"
    shutil.copytree(hf_folders["qwen2"], broken)
    index = json.loads((broken / "model.safetensors.index.json").read_text())
    index["weight_map"]["model.norm.weight"] = "missing.safetensors"
    (broken / "model.safetensors.index.json").write_text(json.dumps(index))
    code, out, err = export([str(broken), "-o", str(tmp_path / "out")])
    assert code == 2 and "missing.safetensors" in err, out + err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["broken"]


def test_a_null_chat_template_is_left_out_of_the_genai_folder(tmp_path: Path) -> None:
    """transformers writes `"chat_template": null` for a tokenizer without one; onnxruntime-genai's tokenizer
    fails on a null string, so the folder's tokenizer_config.json leaves null entries out."""
    from export.hf_tokenizer import tokenizer_files
    from models.demo import DEMO_DIR

    folder = tmp_path / "tok"
    folder.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (folder / name).write_bytes((DEMO_DIR / "llama_seglu" / name).read_bytes())
    config = json.loads((folder / "tokenizer_config.json").read_text())
    (folder / "tokenizer_config.json").write_text(json.dumps(config | {"chat_template": None}))
    written = json.loads(tokenizer_files(None, folder, 256, 4096).files["tokenizer_config.json"])
    assert "chat_template" not in written and written["eos_token"] == config["eos_token"]
