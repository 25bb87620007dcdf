"""A Hugging Face folder under --folder-export auto (issue 50): it answers on PyTorch as soon as its weights are
loaded while its export runs in the background, then switches to the export without dropping a request (a stream
finishes on the backend it started on); the card, KServe's metadata and the metrics say which backend serves it and
why. The export is a stand-in child process (as in test_folder_export_cache.py) that waits for the test to let it
finish, then copies the module's real export into place; one test runs the real export of the demo LLM."""

from __future__ import annotations

import asyncio
import json
import shutil
import sys
import threading
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import httpx
import pytest

pytest.importorskip("transformers")

from models.demo import DEMO_DIR
from service.base.config import Settings
from service.edge.app import create_app
from service.engine import folder_export
from service.engine.registry import load_models
from tests.conformance.builders import hf_folder
from tests.service.engine.test_control import INFER, _until, run_async
from tests.service.engine.test_folder_export_cache import SEGLU, entries
from tests.service.support import started

NAME = SEGLU.name
BODY = {"model": NAME, "prompt": "The quick brown fox", "max_tokens": 10, "temperature": 0, "ignore_eos": True}
KEEP = {"genai_config.json", "model.onnx", "tokenizer.json", "tokenizer_config.json", "generation_config.json",
        "chat_template.jinja", "libmultimax_ort_ops.so", "validation.json"}


@pytest.fixture(scope="module")
def repo(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A Hugging Face folder (Llama, SegLU head) beside a classifier: the other model that keeps answering."""
    root = tmp_path_factory.mktemp("repo")
    hf_folder(SEGLU, root / NAME)
    shutil.copy(DEMO_DIR / "digits_multimax.onnx", root / "digits.onnx")
    return root


@pytest.fixture(scope="module")
def made(repo: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The folder's real export (made once, by a load that waits for it)."""
    cache = tmp_path_factory.mktemp("cache")
    loaded, failed = load_models(settings(repo, cache, folder_export="wait", models=[NAME]))
    assert not failed and loaded[NAME][1].export is not None and loaded[NAME][1].export.state == "passed"
    loaded[NAME][1].backend.close()
    return entries(cache)[0]


def gated(backend: Any, after: int) -> tuple[threading.Event, list[int]]:
    """Hold the backend's run_text calls after the first `after` until the returned event is set."""
    gate, calls = threading.Event(), []
    original = backend.run_text

    def held(*args: Any, **kwargs: Any) -> Any:
        calls.append(1)
        if len(calls) > after:
            assert gate.wait(60), "the test never opened the gate"
        return original(*args, **kwargs)

    backend.run_text = held
    return gate, calls


def settings(repo: Path, cache: Path, **changes: Any) -> Settings:
    """auto (the tests' session sets wait, tests/conftest.py) unless `changes` say otherwise."""
    return Settings(model_dir=repo, export_cache=cache, warmup_calls=0, intra_op_threads=1,
                    **{"folder_export": "auto", **changes})


def held_export(monkeypatch: pytest.MonkeyPatch, made: Path, gate: Path, fails: bool = False) -> None:
    """`python -m export` replaced by a child process that waits for the file `gate`, then copies the real export
    into place (or, `fails`, reports a failed validation, as the exporter does)."""
    if fails:
        finish = ("os.makedirs(out); open(os.path.join(out, 'validation.json'), 'w').write(json.dumps({'passed': "
                  "False, 'verdict': 'FAILED', 'problems': ['greedy text differs from PyTorch']})); sys.exit(1)")
    else:
        finish = f"shutil.copytree(sys.argv[1], out, ignore=lambda d, names: [n for n in names if n not in {KEEP!r}])"
    script = ("import json, os, shutil, sys, time\nout, gate = sys.argv[2], sys.argv[3]\n"
              "for _ in range(2400):\n    if os.path.exists(gate): break\n    time.sleep(0.05)\n" + finish)
    monkeypatch.setattr(folder_export, "export_command",
                        lambda source, out, _: [sys.executable, "-c", script, str(made), str(out), str(gate)])


async def card(client: httpx.AsyncClient) -> dict[str, Any]:
    r = await client.get(f"/v1/models/{NAME}")
    assert r.status_code == 200, r.text
    return dict(r.json())


async def until_async(check: Callable[[], Awaitable[bool]], tries: int = 2400) -> None:
    for _ in range(tries):
        if await check():
            return
        await asyncio.sleep(0.05)
    raise AssertionError("condition never became true")


def metric(text: str, series: str) -> float:
    return float(next(line.rsplit(" ", 1)[1] for line in text.splitlines() if line.startswith(series + " ")))


@run_async
async def test_it_answers_on_pytorch_while_exporting_then_switches_without_dropping_a_stream(
        repo: Path, made: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    gate = tmp_path / "go"
    held_export(monkeypatch, made, gate)
    app = create_app(settings(repo, tmp_path / "cache"))
    runtimes = app.state.runtimes
    old = runtimes.models[NAME]
    assert old.entry.backend.kind == "torch"  # loaded on PyTorch: nothing exported yet
    async with started(app) as client:
        assert (await client.get("/v2/health/ready")).status_code == 200  # ready on PyTorch
        first = await card(client)
        assert first["backend"] == "torch" and first["served_from"] is None
        assert first["serving"]["backend"] == "pytorch" and first["serving"]["export"] == "running"
        assert first["serving"]["why"].startswith("pytorch: export running since ")
        kserve = (await client.get(f"/v2/models/{NAME}")).json()
        assert kserve["platform"] == "pytorch_libtorch" and kserve["model_info"]["serving"]["export"] == "running"
        text = (await client.post("/v1/completions", json=BODY)).json()["choices"][0]["text"]
        # the event loop and the other model answer while the export runs (it waits for the gate file)
        for _ in range(3):
            assert (await client.post("/v2/models/digits/infer", json=INFER)).status_code == 200
        metrics = (await client.get("/metrics")).text
        assert metric(metrics, f'multimax_folder_export_state{{model="{NAME}",state="running"}}') == 1.0
        assert metric(metrics, f'multimax_folder_export_state{{model="{NAME}",state="passed"}}') == 0.0
        assert runtimes.exports.jobs[old].thread.is_alive()

        # a stream starts on PyTorch, and waits there (after its prefill and first step) across the switch
        held, calls = gated(old.entry.backend, after=2)
        stream = asyncio.ensure_future(client.post("/v1/completions", json={**BODY, "stream": True}))
        await _until(lambda: len(calls) > 2)
        gate.touch()  # the export finishes: the model switches to it
        await until_async(lambda: _switched(client))
        assert runtimes.models[NAME] is not old and old in runtimes.draining  # the stream still holds it
        now = await card(client)
        assert now["backend"] == "onnxruntime" and now["format"] == "onnxruntime-genai-folder"
        assert now["serving"]["why"] == "onnxruntime-genai: export passed" and now["served_from"]["source"] == NAME
        assert now["serving"]["switched_after_s"] > 0
        torch_calls = len(calls)
        after = (await client.post("/v1/completions", json=BODY)).json()["choices"][0]["text"]
        assert len(calls) == torch_calls  # served by the export, not by PyTorch
        assert after == text  # the export was validated: the same greedy text
        held.set()
        r = await stream
        events = [line[len("data: "):] for line in r.text.splitlines() if line.startswith("data: ")]
        assert events[-1] == "[DONE]"
        streamed = "".join(json.loads(e)["choices"][0]["text"] for e in events[:-1])
        assert streamed == text and len(calls) > torch_calls  # finished on PyTorch, with the same text
        await _until(lambda: old not in runtimes.draining)  # released after its last request
        assert not old.worker.alive
        metrics = (await client.get("/metrics")).text
        assert metric(metrics, f'multimax_folder_export_state{{model="{NAME}",state="passed"}}') == 1.0
        assert metric(metrics, f'multimax_folder_exports_total{{model="{NAME}",outcome="passed"}}') == 1.0
        assert metric(metrics, f'multimax_folder_export_switch_seconds{{model="{NAME}"}}') > 0
        assert (await client.get(f"/v2/models/{NAME}")).json()["platform"] == "onnxruntime_onnx"


async def _switched(client: httpx.AsyncClient) -> bool:
    return (await card(client))["serving"]["backend"] == "onnxruntime-genai"


@run_async
async def test_a_failed_export_shows_on_the_card_and_the_metric_and_pytorch_keeps_serving(
        repo: Path, made: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    gate = tmp_path / "go"
    gate.touch()
    held_export(monkeypatch, made, gate, fails=True)
    app = create_app(settings(repo, tmp_path / "cache", models=[NAME]))
    async with started(app) as client:
        await until_async(lambda: _export_is(client, "failed"))
        serving = (await card(client))["serving"]
        assert serving["backend"] == "pytorch"
        assert serving["why"].startswith("pytorch: export failed: validation failed: greedy text differs")
        kserve = (await client.get(f"/v2/models/{NAME}")).json()["model_info"]["serving"]
        assert kserve == serving
        assert (await client.post("/v1/completions", json=BODY)).status_code == 200
        metrics = (await client.get("/metrics")).text
        assert metric(metrics, f'multimax_folder_export_state{{model="{NAME}",state="failed"}}') == 1.0
        assert metric(metrics, f'multimax_folder_exports_total{{model="{NAME}",outcome="failed"}}') == 1.0
    # recorded: the next start serves PyTorch at once, says why, and exports nothing
    app = create_app(settings(repo, tmp_path / "cache", models=[NAME]))
    entry = app.state.runtimes.models[NAME].entry
    assert entry.export.state == "failed" and "recorded: delete" in entry.export.reason
    assert entry.export.make is None


async def _export_is(client: httpx.AsyncClient, state: str) -> bool:
    return bool((await card(client))["serving"]["export"] == state)


def test_a_cached_export_serves_at_once_and_wait_exports_before_answering(
        repo: Path, made: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    gate = tmp_path / "go"
    gate.touch()
    held_export(monkeypatch, made, gate)
    cache = tmp_path / "cache"
    loaded, _ = load_models(settings(repo, cache, folder_export="wait", models=[NAME]))
    entry = loaded[NAME][1]
    assert entry.backend.kind == "onnxruntime" and entry.export is not None
    assert entry.export.card()["why"] == "onnxruntime-genai: export passed"
    entry.backend.close()

    def refuse(*args: Any) -> Any:
        raise AssertionError("exported again")
    monkeypatch.setattr(folder_export, "run_export", refuse)
    loaded, _ = load_models(settings(repo, cache, models=[NAME]))  # auto, with the export in the cache
    entry = loaded[NAME][1]
    assert entry.backend.kind == "onnxruntime" and entry.export is not None and entry.export.reused
    assert entry.export.card()["why"] == "onnxruntime-genai: export passed (made before this load, from the cache)"
    entry.backend.close()
    loaded, _ = load_models(settings(repo, cache, models=[NAME], folder_export="off"))
    entry = loaded[NAME][1]
    assert entry.backend.kind == "torch" and entry.export is not None
    assert entry.export.card()["why"] == "pytorch: --folder-export off serves the folder itself"


@run_async
async def test_stopping_the_server_stops_a_running_export(repo: Path, made: Path, tmp_path: Path,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    held_export(monkeypatch, made, tmp_path / "never")
    app = create_app(settings(repo, tmp_path / "cache", models=[NAME]))
    runtimes = app.state.runtimes
    async with started(app) as client:
        assert await _export_is(client, "running")
        [job] = runtimes.exports.jobs.values()
    assert not job.thread.is_alive()  # the stand-in was killed: its thread ended within the stop
    assert not list((tmp_path / "cache").glob("*.failed.json"))  # a stop is not a failure: tried next time
    assert not list((tmp_path / "cache").glob(".tmp-*"))


@pytest.mark.slow
@run_async
async def test_the_demo_llm_folder_switches_to_its_real_export(tmp_path: Path) -> None:
    """The real export (python -m export) of the shipped demo LLM folder, in the background, end to end."""
    repo = tmp_path / "repo"
    repo.mkdir()
    shutil.copytree(DEMO_DIR / "llama_seglu", repo / "llama_seglu")
    app = create_app(settings(repo, tmp_path / "cache"))
    body = {**BODY, "model": "llama_seglu"}
    async with started(app) as client:
        before = (await client.post("/v1/completions", json=body)).json()
        first = (await client.get("/v1/models/llama_seglu")).json()["serving"]
        assert first["export"] == "running", first

        async def switched() -> bool:
            serving = (await client.get("/v1/models/llama_seglu")).json()["serving"]
            assert serving["export"] != "failed", serving
            return bool(serving["export"] == "passed")
        await until_async(switched, tries=12000)  # up to 10 minutes
        now = (await client.get("/v1/models/llama_seglu")).json()
        assert now["backend"] == "onnxruntime" and now["served_from"]["reused"] is False
        after = (await client.post("/v1/completions", json=body)).json()
        assert after["choices"][0]["text"] == before["choices"][0]["text"]
