"""benchmarks/genai_vs_server.py: the four ways generate the same greedy tokens, a short run reports every figure,
and bad input exits 2 with one line (timings are never asserted)."""

from __future__ import annotations

import json
from functools import partial
from pathlib import Path

import pytest

og = pytest.importorskip("onnxruntime_genai")
pytest.importorskip("aiohttp")

from benchmarks import genai_vs_server as bench  # noqa: E402
from tests.paths import ROOT  # noqa: E402


@pytest.fixture(scope="module")
def folder(text_genai_folder: Path) -> Path:
    return text_genai_folder


@pytest.mark.slow
def test_genai_and_the_direct_loop_generate_the_same_tokens(folder: Path) -> None:
    model = bench.genai_model(folder, 1)
    backend = bench.direct_backend(folder, 1)
    batch = bench.prompts(259, 4, 12, 0)
    run, theirs = bench.genai_generator(model, batch, 10)
    direct, ours = bench.direct_loop(backend, batch, 10)
    assert theirs == ours and all(len(t) == 10 for t in ours)
    engine, scheduled = bench.engine_loop(bench.load_entry(folder, 1), backend, [(p, 10) for p in batch], 4)
    assert scheduled == ours and engine.tokens == 40 and len(engine.ttft) == 4 and len(engine.gaps) == 4 * 9
    assert run.tokens == direct.tokens == 40 and len(run.gaps) == len(direct.gaps) == 4 * 9
    ok, why = bench.engine_is_correct(model, 259, 8)
    assert isinstance(ok, bool) and ("og.Engine" in why)


@pytest.mark.slow
def test_the_varied_workload_asks_each_request_its_own_length(folder: Path) -> None:
    """Requests of different lengths: static batches (genai, direct) keep each request's own tokens, and the
    engine's closed loop of 2 streams, admitting each request when its stream sends it, gives the same tokens."""
    requests = bench.workload("varied", 259, 2, 6, 12, 3)
    assert len(requests) == 2 * bench.REQUESTS_PER_STREAM and all(3 <= m <= 12 for _, m in requests)
    assert len({m for _, m in requests}) > 1 and requests == bench.workload("varied", 259, 2, 6, 12, 3)
    model = bench.genai_model(folder, 1)
    entry = bench.load_entry(folder, 1)
    theirs_run, theirs = bench.static_batches(partial(bench.genai_generator, model), requests, 2)
    direct_run, ours = bench.static_batches(partial(bench.direct_loop, entry.backend), requests, 2)
    engine_run, scheduled = bench.engine_loop(entry, entry.backend, requests, 2)
    assert [len(t) for t in theirs] == [m for _, m in requests]
    assert theirs == ours == scheduled
    asked = sum(m for _, m in requests)
    assert theirs_run.tokens == direct_run.tokens == engine_run.tokens == asked
    assert len(engine_run.ttft) == len(requests) and len(engine_run.gaps) == asked - len(requests)


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["equal", "varied"])
def test_a_short_run_reports_every_way_and_ratio(folder: Path, tmp_path: Path, kind: str,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "r.json"
    assert bench.main([str(folder), "--threads", "1", "--streams", "1,2", "--rounds", "1", "--prompt-len", "4",
                       "--max-tokens", "4", "--json", str(out), "--base-tree", str(ROOT),
                       "--workload", kind]) == 0
    report = json.loads(out.read_text())
    assert report["workload"] == kind
    assert set(report["ratios"]["server/base"]) == {"1", "2"}
    for way in ("genai", "server", "direct", "engine", "base"):
        for n in ("1", "2"):
            figures = report["results"][way][n]
            assert figures["tok_s"] > 0 and figures["ttft_p50_ms"] > 0, (way, n, figures)
    assert set(report["ratios"]["server/genai"]) == set(report["ratios"]["engine/direct"]) == {"1", "2"}
    out = capsys.readouterr().out
    assert "greedy tokens agree (og.Generator vs the server's backend): True" in out
    assert "greedy tokens agree (the server's backend vs its decode loop): True" in out


def test_bad_input_exits_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert bench.main([str(tmp_path)]) == 2
    assert "not an onnxruntime-genai folder" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exc:
        bench.main([str(tmp_path), "--streams", "1,x"])
    assert exc.value.code == 2
    (tmp_path / "genai_config.json").write_text("{}")
    assert bench.main([str(tmp_path), "--base-tree", str(tmp_path)]) == 2
    assert "is not a source tree of this project" in capsys.readouterr().err


def test_cache_reserve_compares_the_decode_loop_with_and_without_the_hint(
        folder: Path, capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    """benchmarks.cache_reserve: both ways run every round and report; bad input exits 2 with one line."""
    from benchmarks import cache_reserve

    out = cache_reserve.compare(folder, 2, 70, 2, 1, prompt_len=8)
    assert len(out["on"]) == len(out["off"]) == 2 and min(out["on"] + out["off"]) > 0
    assert cache_reserve.main([str(folder), "--streams", "2", "--max-tokens", "10", "--rounds", "1"]) == 0
    assert "on / off" in capsys.readouterr().out
    assert cache_reserve.main([str(tmp_path)]) == 2
    assert "not an onnxruntime-genai folder" in capsys.readouterr().err
    assert cache_reserve.main([str(folder), "--rounds", "0"]) == 2


def test_chunked_prefill_reports_each_chunk_size(folder: Path, capsys: pytest.CaptureFixture[str],
                                                  tmp_path: Path) -> None:
    """benchmarks.chunked_prefill: one run gives the running streams' gaps and the long prompt's first token for
    a chunk size, main prints a row per size; a prompt past the context or bad input exits 2 with one line."""
    from benchmarks import chunked_prefill

    entry = bench.load_entry(folder, 1)
    figures = chunked_prefill.one_run(entry, 8, 2, 40)
    assert set(figures) == {"itl_p50_ms", "itl_p99_ms", "itl_max_ms", "long_ttft_ms", "tok_s"}
    assert figures["long_ttft_ms"] > 0 and figures["tok_s"] > 0
    assert 0 <= figures["itl_p50_ms"] <= figures["itl_p99_ms"] <= figures["itl_max_ms"]
    assert chunked_prefill.main([str(folder), "--streams", "2", "--long", "40", "--chunks", "0,8", "--rounds",
                                 "1"]) == 0
    out = capsys.readouterr().out
    assert "| off |" in out and "| 8 |" in out
    assert chunked_prefill.main([str(folder), "--long", "500"]) == 2
    assert "past the model's context" in capsys.readouterr().err
    assert chunked_prefill.main([str(tmp_path)]) == 2
    assert chunked_prefill.main([str(folder), "--chunks", "8,x"]) == 2
    assert "--chunks" in capsys.readouterr().err
