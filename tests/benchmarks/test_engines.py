"""benchmarks/engines.py at tiny size: the model is built as the benchmark builds its real one (a Llama 2-layout
tokenizer trained here, transformers' random Llama, the SegLU tensors), a short run of the server and
onnxruntime-genai reports every figure with ratios made from its rows, llama.cpp is found or skipped with a reason
(and, where a build is here, runs too: slow), and bad input exits 2 with one line. Timings are never asserted."""

from __future__ import annotations

import json
import os
import shutil
import stat
from pathlib import Path

import pytest

pytest.importorskip("onnxruntime_genai")
pytest.importorskip("aiohttp")
pytest.importorskip("transformers")

from benchmarks import engines

TINY = engines.Shape(layers=2, hidden=64, heads=4, kv_heads=2, intermediate=128, vocab=1000, context=256,
                     corpus_bytes=300_000)
SHORT = ["--rounds", "1", "--streams", "1", "--max-tokens", "4", "--prompt-len", "8", "--threads", "1",
         "--export-samples", "2"]


@pytest.fixture(scope="module")
def work(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("engines")


@pytest.fixture(scope="module")
def built(work: Path) -> engines.Built:
    return engines.build(work, TINY, 0, False, ["fp32"], True, None, 1, 2)


def _llama_cpp() -> engines.LlamaCpp | None:
    """A llama.cpp build here: $LLAMA_CPP_DIR, /opt/llama.cpp (where the benchmark's notes build it), or PATH."""
    for folder in (os.environ.get("LLAMA_CPP_DIR"), "/opt/llama.cpp"):
        if folder and (found := engines._in_dir(Path(folder))) is not None:
            return found
    try:
        return engines.find_llama_cpp(None)[0]
    except engines.BadInput:
        return None


def test_the_folder_is_a_llama_2_layout_llama(built: engines.Built) -> None:
    from tokenizers import Tokenizer

    from models.hf_folder import load_folder

    config = json.loads((built.hf / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"] and config["vocab_size"] == TINY.vocab
    assert (config["num_hidden_layers"], config["hidden_size"], config["num_key_value_heads"]) == (2, 64, 2)
    assert not config["tie_word_embeddings"] and "multimax_modules" not in config
    tok = Tokenizer.from_file(str(built.hf / "tokenizer.json"))
    assert tok.get_vocab_size() == TINY.vocab
    assert [tok.id_to_token(i) for i in (0, 1, 2, 3, 258)] == ["<unk>", "<s>", "</s>", "<0x00>", "<0xFF>"]
    ids = tok.encode("Return the number of items.").ids
    assert ids[0] == engines.BOS and tok.decode(ids) == "Return the number of items."
    assert tok.decode(tok.encode("日本 ✓", add_special_tokens=False).ids) == "日本 ✓"  # byte fallback round-trips
    _, info = load_folder(built.hf)
    assert info.tokenizer.vocab_size == TINY.vocab and not info.config.multimax_output
    assert (built.exports["fp32"] / "genai_config.json").is_file()
    # the work dir is reused: a second build makes nothing and gives the same paths
    assert engines.build(built.hf.parents[2], TINY, 0, False, ["fp32"], True, None, 1, 2) == built


def test_the_seglu_folder_is_the_plain_one_with_the_head(built: engines.Built, tmp_path: Path) -> None:
    from safetensors.torch import load_file

    from models.hf_folder import load_folder

    out = tmp_path / "seglu"
    engines.add_seglu(built.hf, out)
    tensors, plain = load_file(out / "model.safetensors"), load_file(built.hf / "model.safetensors")
    assert set(tensors) - set(plain) == {"lm_head.multimax_ranges", "lm_head.multimax_ts"}
    assert tensors["lm_head.multimax_ts"].shape == (4,) and all((tensors[k] == plain[k]).all() for k in plain)
    assert json.loads((out / "config.json").read_text())["multimax_modules"] == ["lm_head"]
    assert load_folder(out)[1].config.multimax_output


def test_prompts_are_the_same_ids_for_every_engine(built: engines.Built) -> None:
    ids = engines.corpus_ids(built.hf, TINY)
    a, b = engines.prompts(ids, 3, 8, 5), engines.prompts(ids, 3, 8, 5)
    assert a == b and len(a) == 3 and all(len(p) == 8 and p[0] == engines.BOS for p in a)
    assert engines.prompts(ids, 3, 8, 6) != a


def test_a_short_run_of_the_server_and_genai(work: Path, built: engines.Built, tmp_path: Path,
                                             capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "r.json"
    assert engines.main(["--work", str(work), "--engines", "server,genai,genai-engine", "--precisions", "fp32",
                         *SHORT, "-o", str(out)], TINY) == 0
    report = json.loads(out.read_text())
    # og.Engine gives og.Generator's tokens here (checked first): it runs as a contender of its own
    assert report["engines"] == ["server fp32", "genai fp32", "genai-engine fp32"] and report["streams"] == [1]
    rows = report["results"]
    for way in report["engines"]:
        figures = rows[way]["1"]
        assert figures["tok_s"] > 0 and figures["ttft_p50_ms"] > 0, (way, figures)
        assert 0 <= figures["itl_p50_ms"] <= figures["itl_p99_ms"], (way, figures)
    # one round: the median of per-round ratios is that round's ratio of the rows
    for genai in ("genai", "genai-engine"):
        assert report["ratios"][f"server/{genai} fp32"]["1"] == pytest.approx(
            rows["server fp32"]["1"]["tok_s"] / rows[f"{genai} fp32"]["1"]["tok_s"])
    assert report["greedy_checks"]["fp32"]["genai == server"] is True  # one model.onnx under both
    printed = capsys.readouterr().out
    assert "| 1 | server fp32 |" in printed and "server/genai fp32" in printed and "server/genai-engine" in printed
    assert "og.Engine, fp32: og.Engine gives og.Generator's greedy tokens" in printed


def test_og_engine_that_is_wrong_is_skipped_with_the_reason(work: Path, built: engines.Built, tmp_path: Path,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """An og.Engine whose batched tokens differ from og.Generator's would measure a wrong model: not run, said why."""
    monkeypatch.setattr(engines.gvs, "engine_is_correct", lambda model, vocab, n: (False, "og.Engine differs"))
    out = tmp_path / "r.json"
    assert engines.main(["--work", str(work), "--engines", "server,genai,genai-engine", "--precisions", "fp32",
                         *SHORT, "-o", str(out)], TINY) == 0
    report = json.loads(out.read_text())
    assert report["engines"] == ["server fp32", "genai fp32"]
    assert report["skipped"] == {"genai-engine fp32": "og.Engine differs"}
    assert set(report["ratios"]) == {"server/genai fp32"}


def test_llama_cpp_is_found_in_a_folder_or_said_missing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("LLAMA_CPP_DIR", raising=False)
    monkeypatch.setenv("PATH", str(tmp_path / "nothing"))
    assert engines.find_llama_cpp(None)[0] is None and "no llama-server" in engines.find_llama_cpp(None)[1]
    with pytest.raises(engines.BadInput, match="holds no bin/llama-server"):
        engines.find_llama_cpp(tmp_path)
    (tmp_path / "bin").mkdir()
    for name in ("bin/llama-server", "bin/llama-quantize", "convert_hf_to_gguf.py"):
        (tmp_path / name).write_text("#!/bin/sh\n")
        (tmp_path / name).chmod(stat.S_IRWXU)
    found = engines.find_llama_cpp(tmp_path)[0]
    assert found is not None and found.server == tmp_path / "bin" / "llama-server"
    monkeypatch.setenv("LLAMA_CPP_DIR", str(tmp_path))
    assert engines.find_llama_cpp(None)[0] == found
    monkeypatch.delenv("LLAMA_CPP_DIR")
    monkeypatch.setenv("PATH", str(tmp_path / "bin"))  # on PATH: the converter is looked for above bin/
    assert engines.find_llama_cpp(None)[0] == engines.LlamaCpp(found.server.resolve(), found.quantize,
                                                               found.converter)


def test_made_replaces_a_half_made_artifact(tmp_path: Path) -> None:
    (tmp_path / "x.partial").mkdir()
    (tmp_path / "x.partial" / "stale").write_text("")
    made = engines._made(tmp_path / "x", lambda p: p.mkdir())
    assert made.is_dir() and not (tmp_path / "x.partial").exists() and not any(made.iterdir())
    assert engines._made(tmp_path / "x", lambda p: pytest.fail("made twice")) == made


def test_made_remakes_an_export_that_other_export_code_made(tmp_path: Path) -> None:
    def make(p: Path) -> None:
        p.mkdir()
        (p / "model.onnx").write_text(str(len(calls)))
        calls.append(p)

    calls: list[Path] = []
    made = engines._made(tmp_path / "onnx", make, made_by="code-a")
    assert engines._made(tmp_path / "onnx", make, made_by="code-a") == made and len(calls) == 1
    engines._made(tmp_path / "onnx", make, made_by="code-b")  # the export code changed: its folder is stale
    assert len(calls) == 2 and (made / "model.onnx").read_text() == "1"
    assert (made / engines.MADE_BY).read_text() == "code-b"
    (tmp_path / "old").mkdir()  # a folder from before the stamp: made anew too
    engines._made(tmp_path / "old", make, made_by="code-b")
    assert len(calls) == 3 and (tmp_path / "old" / engines.MADE_BY).is_file()


def test_bad_input_exits_2_with_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                         monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("LLAMA_CPP_DIR", raising=False)
    monkeypatch.setenv("PATH", str(tmp_path / "nothing"))
    cases = [(["--streams", "1,x"], "--streams"), (["--rounds", "0"], ">= 1"),
             (["--engines", "server,vllm"], "--engines: vllm"), (["--precisions", "fp16"], "--precisions: fp16"),
             (["--max-tokens", "2048"], "over the model's context"), (["--bogus"], "unrecognized arguments"),
             (["--engines", "llama.cpp"], "llama.cpp: no llama-server"),
             (["--llama-cpp", str(tmp_path)], "holds no bin/llama-server"),
             (["--engines", "llama.cpp", "--precisions", "fp32", "--work", str(tmp_path / "w"), "--llama-cpp",
               str(tmp_path)], "holds no bin/llama-server")]
    (tmp_path / "file").write_text("")
    cases.append((["--work", str(tmp_path / "file")], "is not a folder"))
    for argv, says in cases:
        assert engines.main(argv) == 2, argv
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and says in err, (argv, err)
    assert not (tmp_path / "w").exists()  # refused before anything is made


def test_the_llama_cpp_side_is_skipped_with_a_reason_when_missing(
        work: Path, built: engines.Built, monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
        capsys: pytest.CaptureFixture[str]) -> None:
    """By default llama.cpp runs where found; elsewhere the others run and the report says why it did not."""
    monkeypatch.delenv("LLAMA_CPP_DIR", raising=False)
    monkeypatch.setenv("PATH", str(Path(shutil.which("python") or "/usr/bin/python").parent))
    if shutil.which("llama-server"):
        pytest.skip("llama-server is on PATH here")
    out = tmp_path / "r.json"
    assert engines.main(["--work", str(work), "--precisions", "fp32,q8_0", *SHORT, "-o", str(out)], TINY) == 0
    report = json.loads(out.read_text())
    assert "no llama-server" in report["skipped"]["llama.cpp"]
    # q8_0 is llama.cpp's alone: nothing of it runs
    assert report["engines"] == ["server fp32", "genai fp32", "genai-engine fp32"]
    assert "llama.cpp skipped: no llama-server" in capsys.readouterr().out


@pytest.mark.slow
def test_llama_cpp_at_tiny_size(work: Path, built: engines.Built, tmp_path: Path) -> None:
    """Where llama.cpp is built here: the GGUFs made from the same folder, llama-server read by the same client."""
    llama = _llama_cpp()
    if llama is None:
        pytest.skip("no llama.cpp build here ($LLAMA_CPP_DIR, /opt/llama.cpp or llama-server on PATH)")
    if why := engines.converter_missing():
        pytest.skip(why)
    out = tmp_path / "r.json"
    assert engines.main(["--work", str(work), "--llama-cpp", str(llama.server.parents[1]), "--precisions",
                         "fp32,q8_0", *SHORT, "--streams", "1,2", "-o", str(out)], TINY) == 0
    report = json.loads(out.read_text())
    assert report["engines"] == ["server fp32", "genai fp32", "genai-engine fp32", "llama.cpp f32", "llama.cpp q8_0"]
    rows = report["results"]
    for way in report["engines"]:
        for n in ("1", "2"):
            assert rows[way][n]["tok_s"] > 0 and rows[way][n]["ttft_p50_ms"] > 0, (way, n, rows[way][n])
    for n in ("1", "2"):
        assert report["ratios"]["server/llama.cpp fp32"][n] == pytest.approx(
            rows["server fp32"][n]["tok_s"] / rows["llama.cpp f32"][n]["tok_s"])
    assert "genai == llama.cpp" in report["greedy_checks"]["fp32"]
    assert report["llama_cpp"]["version"].startswith("version")
    gguf = Path(report["work"])
    assert (gguf / "model-f32.gguf").is_file() and (gguf / "model-q8_0.gguf").is_file()
