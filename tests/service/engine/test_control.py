"""Models that change while the server runs: warm-up at load, versions (Triton's `name/<v>/model.onnx` layout) and
the repository API (`POST /v2/repository/index`, `.../models/{m}/load`, `.../unload`): a load swaps in a new
version while requests and streams in flight finish on the old one, a broken file never replaces a working one."""

from __future__ import annotations

import asyncio
import functools
import json
import shutil
import threading
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import onnxruntime as ort
import pytest
from fastapi import FastAPI

from models.demo import DEMO_DIR
from service.base.config import Settings, load_settings
from service.edge.app import create_app
from service.engine.registry import load_version, scan
from service.engine.warmup import DECODE_STEPS, Budget, batch_buckets, prompt_lengths, warm_up
from service.protocols import control
from tests.service.support import started

PIXELS = np.random.default_rng(0).uniform(-1, 1, (2, 1, 32, 32)).astype(np.float32)
INFER = {"inputs": [{"name": "pixel_values", "shape": list(PIXELS.shape), "datatype": "FP32",
                     "data": PIXELS.ravel().tolist()}]}


def run_async(test: Callable[..., Awaitable[None]]) -> Callable[..., None]:
    """Run an async test in its own event loop (the app's workers run in it too)."""
    @functools.wraps(test)
    def run(*args: Any, **kwargs: Any) -> None:
        asyncio.run(test(*args, **kwargs))
    return run


def _version(d: Path, name: str, version: int, source: str) -> None:
    (d / name / str(version)).mkdir(parents=True, exist_ok=True)
    shutil.copy(DEMO_DIR / source, d / name / str(version) / "model.onnx")


@pytest.fixture
def model_dir(tmp_path: Path) -> Path:
    """digits: version 1 the softmax twin, version 2 the MultiMax model; text: a plain file (version 1)."""
    _version(tmp_path, "digits", 1, "digits_softmax.onnx")
    _version(tmp_path, "digits", 2, "digits_multimax.onnx")
    shutil.copy(DEMO_DIR / "text_multimax.onnx", tmp_path / "text.onnx")
    return tmp_path


def _app(model_dir: Path, **kw: Any) -> FastAPI:
    return create_app(Settings(model_dir=model_dir, **kw))


async def _index(client: httpx.AsyncClient) -> dict[tuple[str, str], dict[str, str]]:
    r = await client.post("/v2/repository/index")
    assert r.status_code == 200
    return {(row["name"], row["version"]): row for row in r.json()}


def _logits(source: str) -> np.ndarray:
    session = ort.InferenceSession(str(DEMO_DIR / source), providers=["CPUExecutionProvider"])
    return session.run(["logits"], {"pixel_values": PIXELS})[0]


def _gate(backend: Any, method: str, after: int = 0) -> tuple[threading.Event, list[int]]:
    """Hold a backend's calls (after the first `after`) until the returned event is set."""
    gate, calls = threading.Event(), []
    original = getattr(backend, method)

    def held(*args: Any) -> Any:
        calls.append(1)
        if len(calls) > after:
            assert gate.wait(30), "the test never opened the gate"
        return original(*args)

    setattr(backend, method, held)
    return gate, calls


async def _until(check: Callable[[], bool]) -> None:
    for _ in range(1000):
        if check():
            return
        await asyncio.sleep(0.01)
    raise AssertionError("condition never became true")


# ---- layout and versions ------------------------------------------------------------------------------------


def test_scan_reads_triton_layout_beside_plain_files(model_dir: Path, caplog: pytest.LogCaptureFixture) -> None:
    (model_dir / "digits" / "notes").mkdir()  # not a version: ignored
    (model_dir / "digits" / "3").mkdir()  # a version directory without a model file: ignored
    shutil.copy(DEMO_DIR / "digits_multimax.onnx", model_dir / "digits.onnx")  # the directory wins
    found = scan(model_dir)
    assert {n: sorted(v) for n, v in found.items()} == {"digits": [1, 2], "text": [1]}
    assert found["digits"][2]["onnxruntime"] == model_dir / "digits" / "2" / "model.onnx"
    assert any("digits.onnx: ignored" in r.getMessage() for r in caplog.records)


@run_async
async def test_versions_are_served_by_the_v2_routes_and_the_latest_is_the_default(model_dir: Path) -> None:
    async with started(_app(model_dir)) as client:
        meta = (await client.get("/v2/models/digits")).json()
        assert meta["versions"] == ["1", "2"]
        for route, version, source in (("/v2/models/digits/infer", "2", "digits_multimax.onnx"),
                                       ("/v2/models/digits/versions/1/infer", "1", "digits_softmax.onnx"),
                                       ("/v2/models/digits/versions/2/infer", "2", "digits_multimax.onnx")):
            body = (await client.post(route, json=INFER)).json()
            assert body["model_version"] == version, route
            np.testing.assert_allclose(np.array(body["outputs"][0]["data"]).reshape(2, 10), _logits(source),
                                       rtol=1e-4, atol=1e-4)
        for path in ("/v2/models/digits/versions/3/infer", "/v2/models/digits/versions/x/infer",
                     "/v2/models/text/versions/2/infer"):
            r = await client.post(path, json=INFER)
            assert r.status_code == 404 and set(r.json()) == {"error", "request_id"}
            assert "has no version" in r.json()["error"]
        for path in ("/v2/models/digits/versions/1/ready", "/v2/models/digits/versions/1"):
            assert (await client.get(path)).status_code == 200
        assert (await client.get("/v2/models/digits/versions/9/ready")).status_code == 404
        cards = {c["id"]: c for c in (await client.get("/v1/models")).json()["data"]}
        assert set(cards) == {"digits", "text"}
        assert (cards["digits"]["version"], cards["digits"]["versions"]) == ("2", ["1", "2"])
        r = await client.post("/v1/completions", json={"model": "text", "prompt": "Hi", "max_tokens": 2})
        assert r.json()["system_fingerprint"] == "text:1"
        index = await _index(client)
        assert [k for k in index] == [("digits", "1"), ("digits", "2"), ("text", "1")]
        assert all(row["state"] == "READY" and row["reason"] == "" for row in index.values())
        metrics = (await client.get("/metrics")).text
        assert 'multimax_model_version_ready{model="digits",version="1"} 1.0' in metrics
        assert 'multimax_model_ready{model="digits"} 1.0' in metrics


# ---- warm-up ------------------------------------------------------------------------------------------------


def test_warm_up_runs_every_batch_bucket_and_prefill_plus_decode(model_dir: Path) -> None:
    assert batch_buckets(16) == [1, 2, 4, 8, 16] and batch_buckets(12) == [1, 2, 4, 8, 12] and batch_buckets(1) == [1]
    settings = Settings(model_dir=model_dir, warmup_calls=0, max_batch_size=12, max_running_sequences=3)
    files = scan(model_dir)
    vision = load_version("digits", 2, files["digits"][2], settings)
    seen: list[int] = []
    run = vision.backend.run_vision
    vision.backend.run_vision = lambda x: (seen.append(len(x)), run(x))[1]  # type: ignore[method-assign]
    assert warm_up(vision, settings) == 0 and seen == []  # --warmup-calls 0: off
    assert warm_up(vision, settings.replace(warmup_calls=2)) == 10
    assert seen == [1, 1, 2, 2, 4, 4, 8, 8, 12, 12]

    text = load_version("text", 1, files["text"][1], settings)
    shapes: list[tuple[int, int, int]] = []  # (batch, new tokens, mask length)
    run_text = text.backend.run_text

    def record(ids: np.ndarray, mask: np.ndarray, positions: np.ndarray, past: Any) -> Any:
        shapes.append((ids.shape[0], ids.shape[1], mask.shape[1]))
        return run_text(ids, mask, positions, past)

    text.backend.run_text = record  # type: ignore[method-assign]
    calls = warm_up(text, settings.replace(warmup_calls=1))
    lengths = prompt_lengths(128)
    assert lengths == [16, 64]
    # on a CPU a batch of at most 2 rows (3 running sequences allowed), cheapest first
    expected = [shape for b in (1, 2) for n in lengths
                for shape in [(b, n, n), *((b, 1, n + k) for k in range(1, DECODE_STEPS + 1))]]
    assert shapes == expected
    assert calls == len(shapes) == 2 * 2 * (1 + DECODE_STEPS)
    assert prompt_lengths(8192) == [16, 256]  # a long context warms up at 256 tokens, not half of it
    shapes.clear()  # a budget spent by the first prefill (which always runs): nothing more is started
    assert warm_up(text, settings.replace(warmup_calls=1, warmup_budget_s=1e-9)) == 1
    assert shapes == expected[:1]
    budget = Budget(10.0)  # a call that the last one, scaled by its size, says would end past the budget: not started
    budget.ran(3.0, 256)
    assert budget.allows(512) and not budget.allows(1024) and Budget(0).allows(10**9)


def test_warmup_and_model_control_options_come_from_cli_and_env() -> None:
    s = load_settings(["--warmup-calls", "0", "--model-control", "explicit"], {})
    assert (s.warmup_calls, s.model_control) == (0, "explicit")
    s = load_settings([], {"MULTIMAX_SERVE_WARMUP_CALLS": "3", "MULTIMAX_SERVE_MODEL_CONTROL": "explicit"})
    assert (s.warmup_calls, s.model_control) == (3, "explicit")
    assert Settings().warmup_calls == 1 and Settings().model_control == "none"
    with pytest.raises(SystemExit):
        load_settings(["--warmup-calls", "-1"], {})
    with pytest.raises(SystemExit):
        load_settings(["--model-control", "poll"], {})
    assert Settings().warmup_budget_s == 10.0
    assert load_settings(["--warmup-budget-s", "2.5"], {}).warmup_budget_s == 2.5
    assert load_settings([], {"MULTIMAX_SERVE_WARMUP_BUDGET_S": "0"}).warmup_budget_s == 0  # no limit
    for bad in ("-1", "nan", "inf", "soon"):
        with pytest.raises(SystemExit):
            load_settings(["--warmup-budget-s", bad], {})


@run_async
async def test_a_loading_model_is_not_ready_until_warmed_up(model_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    app = _app(model_dir, model_control="explicit")
    gate = threading.Event()
    real = control.load_versions

    def slow_warm(*args: Any) -> Any:
        assert gate.wait(30)
        return real(*args)

    monkeypatch.setattr(control, "load_versions", slow_warm)
    _version(model_dir, "fresh", 1, "digits_multimax.onnx")
    async with started(app) as client:
        load = asyncio.ensure_future(client.post("/v2/repository/models/fresh/load"))
        await _until(lambda: "fresh" in app.state.runtimes.loading)
        assert (await _index(client))[("fresh", "1")]["state"] == "LOADING"
        r = await client.get("/v2/models/fresh/ready")
        assert r.status_code == 400 and r.json()["ready"] is False and "loading" in r.json()["reason"]
        r = await client.get("/v2/health/ready")  # the served models are fine; the load in progress is shown
        assert r.status_code == 200 and r.json()["loading"] == {"fresh": ["1"]}
        assert (await client.post("/v2/models/fresh/infer", json=INFER)).status_code == 404
        gate.set()
        assert (await load).status_code == 200
        assert (await client.get("/v2/models/fresh/ready")).json() == {"name": "fresh", "ready": True}
        assert (await client.post("/v2/models/fresh/infer", json=INFER)).json()["model_version"] == "1"


# ---- model control --------------------------------------------------------------------------------------------


@run_async
async def test_control_is_refused_unless_enabled(model_dir: Path) -> None:
    async with started(_app(model_dir)) as client:
        for action in ("load", "unload"):
            r = await client.post(f"/v2/repository/models/digits/{action}")
            assert r.status_code == 403 and "--model-control explicit" in r.json()["error"]
        assert (await client.post("/v2/models/digits/infer", json=INFER)).status_code == 200  # untouched


@run_async
async def test_load_swaps_in_a_new_version_while_a_classification_is_in_flight(model_dir: Path) -> None:
    shutil.rmtree(model_dir / "digits" / "2")
    app = _app(model_dir, model_control="explicit")
    runtimes = app.state.runtimes
    old = runtimes.models["digits"]
    gate, calls = _gate(old.entry.backend, "run_vision")
    async with started(app) as client:
        in_flight = asyncio.ensure_future(client.post("/v2/models/digits/infer", json=INFER))
        await _until(lambda: bool(calls))  # the old version is computing it
        shutil.rmtree(model_dir / "digits" / "1")
        _version(model_dir, "digits", 2, "digits_multimax.onnx")
        r = await client.post("/v2/repository/models/digits/load")
        assert r.status_code == 200 and r.json() == {"name": "digits", "versions": ["2"], "loaded": ["2"]}
        index = await _index(client)
        assert index[("digits", "1")]["state"] == "UNLOADING" and index[("digits", "2")]["state"] == "READY"
        assert (await client.post("/v2/models/digits/infer", json=INFER)).json()["model_version"] == "2"
        assert not in_flight.done() and old.leases == 1  # the old version still holds its request
        gate.set()
        done = await in_flight
        assert done.status_code == 200 and done.json()["model_version"] == "1"
        await _until(lambda: old not in runtimes.draining)  # released after its last request
        assert not old.worker.alive
        assert ("digits", "1") not in await _index(client)
        assert (await client.post("/v2/models/digits/versions/1/infer", json=INFER)).status_code == 404


@run_async
async def test_load_swaps_a_reloaded_file_while_a_stream_is_in_flight(model_dir: Path) -> None:
    app = _app(model_dir, model_control="explicit")
    runtimes = app.state.runtimes
    old = runtimes.models["text"]
    gate, calls = _gate(old.entry.backend, "run_text", after=1)  # the prefill runs, then the decode steps wait
    async with started(app) as client:
        body = {"model": "text", "prompt": "Hello", "max_tokens": 12, "temperature": 0, "stream": True}
        stream = asyncio.ensure_future(client.post("/v1/completions", json=body))
        await _until(lambda: len(calls) > 1)
        (model_dir / "text.onnx").unlink()
        _version(model_dir, "text", 2, "text_multimax.onnx")
        r = await client.post("/v2/repository/models/text/load")
        assert r.status_code == 200 and r.json()["versions"] == ["2"]
        assert runtimes.models["text"] is not old and old in runtimes.draining
        fresh = await client.post("/v1/completions", json={**body, "stream": False})
        assert fresh.json()["system_fingerprint"] == "text:2"
        gate.set()
        r = await stream
        events = [line[len("data: "):] for line in r.text.splitlines() if line.startswith("data: ")]
        assert events[-1] == "[DONE]"
        chunks = [json.loads(e) for e in events[:-1]]
        assert {c["system_fingerprint"] for c in chunks} == {"text:1"}
        assert "".join(c["choices"][0]["text"] for c in chunks) == fresh.json()["choices"][0]["text"]  # same weights
        await _until(lambda: old not in runtimes.draining)


@run_async
async def test_unload_then_404_and_not_ready_then_load_again(model_dir: Path) -> None:
    app = _app(model_dir, model_control="explicit")
    async with started(app) as client:
        r = await client.post("/v2/repository/models/digits/unload")
        assert r.status_code == 200
        r = await client.post("/v2/models/digits/infer", json=INFER)
        assert r.status_code == 404 and "unloaded" in r.json()["error"]
        r = await client.get("/v2/models/digits/ready")
        assert r.status_code == 400 and r.json() == {"name": "digits", "ready": False, "reason": "it was unloaded"}
        assert "digits" not in {c["id"] for c in (await client.get("/v1/models")).json()["data"]}
        await _until(lambda: not app.state.runtimes.draining)
        index = await _index(client)
        assert index[("digits", "2")] == {"name": "digits", "version": "2", "state": "UNAVAILABLE",
                                          "reason": "unloaded"}
        assert (await client.get("/v2/health/ready")).status_code == 200  # an unloaded model is not a failure
        assert 'multimax_model_ready{model="digits"} 0.0' in (await client.get("/metrics")).text
        assert (await client.post("/v2/repository/models/digits/unload")).status_code == 200  # idempotent
        assert (await client.post("/v2/repository/models/nope/unload")).status_code == 404
        assert (await client.post("/v2/repository/models/nope/load")).status_code == 404
        assert (await client.post("/v2/repository/models/digits/load")).json()["versions"] == ["1", "2"]
        assert (await client.post("/v2/models/digits/infer", json=INFER)).json()["model_version"] == "2"


@run_async
async def test_a_broken_load_keeps_the_served_version(model_dir: Path) -> None:
    app = _app(model_dir, model_control="explicit")
    async with started(app) as client:
        (model_dir / "digits" / "3").mkdir()
        (model_dir / "digits" / "3" / "model.onnx").write_bytes(b"not an onnx file")
        r = await client.post("/v2/repository/models/digits/load")
        assert r.status_code == 400 and "version 3" in r.json()["error"] and "serving: 1, 2" in r.json()["error"]
        index = await _index(client)
        broken = index[("digits", "3")]
        assert broken["state"] == "UNAVAILABLE" and "protobuf" in broken["reason"].lower()
        assert index[("digits", "2")]["state"] == "READY"
        assert (await client.post("/v2/models/digits/infer", json=INFER)).json()["model_version"] == "2"
        r = await client.post("/v2/models/digits/versions/3/infer", json=INFER)
        assert r.status_code == 404 and "protobuf" in r.json()["error"].lower()

        before = app.state.runtimes.models["text"]
        (model_dir / "text.onnx").write_bytes(b"truncated")  # the plain file replaced by a broken one
        r = await client.post("/v2/repository/models/text/load")
        assert r.status_code == 400
        assert app.state.runtimes.models["text"] is before and before not in app.state.runtimes.draining
        row = (await _index(client))[("text", "1")]
        assert row["state"] == "READY" and "the last load failed" in row["reason"]
        r = await client.post("/v1/completions", json={"model": "text", "prompt": "Hi", "max_tokens": 2})
        assert r.status_code == 200

        (model_dir / "digits" / "3" / "model.onnx").unlink()  # fixed: the failure is forgotten
        assert (await client.post("/v2/repository/models/digits/load")).status_code == 200
        assert ("digits", "3") not in await _index(client)


@run_async
async def test_loads_of_one_model_run_one_at_a_time(model_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    app = _app(model_dir, model_control="explicit")
    active, most = [0], [0]
    real = control.load_versions

    def counted(*args: Any) -> Any:
        active[0] += 1
        most[0] = max(most[0], active[0])
        try:
            threading.Event().wait(0.05)
            return real(*args)
        finally:
            active[0] -= 1

    monkeypatch.setattr(control, "load_versions", counted)
    async with started(app) as client:
        (model_dir / "digits" / "2" / "model.onnx").touch()  # changed: every load reloads version 2
        shutil.copy(DEMO_DIR / "digits_multimax.onnx", model_dir / "digits" / "2" / "model.onnx")
        answers = await asyncio.gather(*(client.post(f"/v2/repository/models/digits/{a}")
                                         for a in ("load", "unload", "load", "load")))
        assert [r.status_code for r in answers] == [200] * 4
        assert most[0] == 1
        assert list(app.state.runtimes.versions["digits"]) == [1, 2]  # the last load won; nothing doubled
        await _until(lambda: not app.state.runtimes.draining)
        assert (await client.post("/v2/models/digits/infer", json=INFER)).status_code == 200


def test_a_version_whose_warm_up_fails_is_not_served(model_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from service.engine import registry

    def broken(entry: Any, settings: Settings) -> int:
        raise RuntimeError("out of memory at batch 16")

    monkeypatch.setattr(registry, "warm_up", broken)
    loaded, failed = registry.load_versions("digits", scan(model_dir)["digits"], Settings(model_dir=model_dir))
    assert loaded == {} and failed == {1: "warm-up failed: out of memory at batch 16",
                                       2: "warm-up failed: out of memory at batch 16"}


def test_ray_refuses_model_control(capsys: pytest.CaptureFixture[str]) -> None:
    from service.edge.ray.options import parse

    with pytest.raises(SystemExit) as exc:
        parse(["--model-control", "explicit"])
    assert exc.value.code == 2 and "redeploy" in capsys.readouterr().err
    assert parse(["--warmup-calls", "0"])[0].warmup_calls == 0
