"""Dynamic batching (service.engine.batcher): concurrent requests grouped, a broken input failing only its own request,
a full queue answering 429 with Retry-After, deadlines and departed clients dropped before compute. In-process
(FastAPI's TestClient or straight ASGI; no network)."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import numpy as np
import pytest
from PIL import Image

from service.base.config import Settings
from service.base.metrics import Metrics
from service.edge.app import create_app
from service.engine.batcher import DynamicBatcher
from service.engine.engine_errors import EngineError
from service.protocols.engine_status import http_error
from tests.service.support import error_of, png, slow_vision, started


def _batcher(predict: Any, **kw: Any) -> DynamicBatcher:
    from concurrent.futures import ThreadPoolExecutor

    args = {"max_batch_size": 8, "max_delay_s": 0.005, "max_queue": 64} | kw
    return DynamicBatcher("m", predict, ThreadPoolExecutor(1), Metrics(), **args)


def test_batcher_groups_concurrent_requests_and_returns_each_its_rows() -> None:
    calls: list[int] = []

    def predict(x: np.ndarray) -> np.ndarray:
        calls.append(len(x))
        time.sleep(0.02)
        return x * 2

    async def main() -> None:
        b = _batcher(predict)
        b.start()
        far = time.perf_counter() + 30
        results = await asyncio.gather(*(b.submit(np.full((1, 3), i, np.float32), far) for i in range(20)))
        await b.close()
        for i, r in enumerate(results):
            assert np.array_equal(r.output, np.full((1, 3), 2 * i))
        assert sum(calls) == 20 and max(calls) > 1 and max(calls) <= 8

    asyncio.run(main())


def test_a_broken_input_fails_only_its_own_request() -> None:
    def predict(x: np.ndarray) -> np.ndarray:
        if (x < 0).any():
            raise RuntimeError("poisoned row")
        time.sleep(0.005)
        return x

    async def main() -> None:
        b = _batcher(predict, max_delay_s=0.05)
        b.start()
        far = time.perf_counter() + 30
        tasks = [b.submit(np.full((1, 2), -1.0 if i == 3 else i, np.float32), far) for i in range(6)]
        results = await asyncio.gather(*tasks, return_exceptions=True)
        await b.close()
        assert isinstance(results[3], EngineError) and http_error(results[3]).status == 500
        assert all(not isinstance(r, Exception) for i, r in enumerate(results) if i != 3)

    asyncio.run(main())


def test_full_queue_answers_429_with_retry_after() -> None:
    async def main() -> None:
        b = _batcher(lambda x: (time.sleep(0.2), x)[1], max_batch_size=1, max_queue=2)
        b.start()
        far = time.perf_counter() + 30
        tasks = [asyncio.ensure_future(b.submit(np.zeros((1, 1), np.float32), far)) for _ in range(6)]
        results = await asyncio.gather(*tasks, return_exceptions=True)
        await b.close()
        rejected = [http_error(r) for r in results if isinstance(r, EngineError)]
        assert rejected and all(r.status == 429 and int(r.headers["Retry-After"]) >= 1 for r in rejected)
        assert len(rejected) < 6

    asyncio.run(main())


def test_deadline_and_departed_clients_are_dropped_before_compute() -> None:
    seen: list[float] = []

    def predict(x: np.ndarray) -> np.ndarray:
        seen.extend(x[:, 0].tolist())
        time.sleep(0.2)
        return x

    async def main() -> None:
        b = _batcher(predict, max_batch_size=1)
        b.start()
        far = time.perf_counter() + 30
        first = asyncio.ensure_future(b.submit(np.full((1, 1), 1, np.float32), far))
        await asyncio.sleep(0.05)  # the model is busy with `first` now
        expiring = asyncio.ensure_future(b.submit(np.full((1, 1), 2, np.float32), time.perf_counter() + 0.05))
        leaving = asyncio.ensure_future(b.submit(np.full((1, 1), 3, np.float32), far))
        staying = asyncio.ensure_future(b.submit(np.full((1, 1), 4, np.float32), far))
        await asyncio.sleep(0.01)
        leaving.cancel()
        with pytest.raises(EngineError) as exc:
            await expiring
        assert http_error(exc.value).status == 504
        await first
        await staying
        await b.close()
        assert seen == [1.0, 4.0]

    asyncio.run(main())


def test_http_queue_full_gives_429_with_retry_after() -> None:
    app = create_app(Settings(models=("digits_multimax",), max_batch_size=1, max_queue_size=1))
    calls: list[int] = []
    slow_vision(app, "digits_multimax", 0.15, calls)
    image = png(Image.new("L", (32, 32), 128))

    async def main() -> None:
        async with started(app) as client:
            responses = await asyncio.gather(*(client.post("/v1/models/digits_multimax/classify", content=image,
                                                           headers={"content-type": "image/png"}) for _ in range(5)))
            codes = sorted(r.status_code for r in responses)
            assert 200 in codes and 429 in codes and set(codes) <= {200, 429}
            r429 = next(r for r in responses if r.status_code == 429)
            assert int(r429.headers["retry-after"]) >= 1 and error_of(r429)["code"] == "queue_full"
            metrics = (await client.get("/metrics")).text
            assert 'multimax_requests_total{endpoint="classify",model="digits_multimax",outcome="rejected"}' in metrics

    asyncio.run(main())


def test_http_request_deadline_gives_504() -> None:
    app = create_app(Settings(models=("digits_multimax",), max_batch_size=1))
    calls: list[int] = []
    slow_vision(app, "digits_multimax", 0.3, calls)
    image = png(Image.new("L", (32, 32), 128))

    async def main() -> None:
        async with started(app) as client:
            busy = asyncio.ensure_future(client.post("/v1/models/digits_multimax/classify", content=image,
                                                     headers={"content-type": "image/png"}))
            while not calls:  # the first request is computing (images are decoded in a thread: no fixed sleep)
                await asyncio.sleep(0.01)
            r = await client.post("/v1/models/digits_multimax/classify", params={"timeout": 0.05}, content=image,
                                  headers={"content-type": "image/png"})
            assert r.status_code == 504 and error_of(r)["code"] == "deadline_exceeded"
            assert (await busy).status_code == 200

    asyncio.run(main())


def test_request_whose_client_left_is_dropped_before_compute() -> None:
    """Straight ASGI: the second request's client disconnects while it is queued; its image never runs."""
    app = create_app(Settings(models=("digits_multimax",), max_batch_size=1))
    calls: list[int] = []
    slow_vision(app, "digits_multimax", 0.3, calls)
    body = png(Image.new("L", (32, 32), 128))

    async def request(disconnect_after: float | None) -> list[dict[str, Any]]:
        sent: list[dict[str, Any]] = []
        messages = [{"type": "http.request", "body": body, "more_body": False}]

        async def receive() -> dict[str, Any]:
            if messages:
                return messages.pop(0)
            await asyncio.sleep(disconnect_after if disconnect_after is not None else 3600)
            return {"type": "http.disconnect"}

        async def send(message: dict[str, Any]) -> None:
            sent.append(message)

        scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST",
                 "scheme": "http", "path": "/v1/models/digits_multimax/classify", "raw_path": b"",
                 "query_string": b"", "root_path": "", "headers": [(b"content-type", b"image/png"),
                                                                   (b"content-length", str(len(body)).encode())],
                 "client": ("test", 1), "server": ("test", 80), "state": {}, "app": app}
        await app(scope, receive, send)
        return sent

    async def main() -> None:
        runtimes = app.state.runtimes
        runtimes.start()
        try:
            first = asyncio.ensure_future(request(None))
            while not calls:  # `first` is computing (images are decoded in a thread: no fixed sleep)
                await asyncio.sleep(0.01)
            gone = await request(0.05)  # queued behind `first`, then the client leaves
            done = await first
        finally:
            await runtimes.stop()
        assert done[0]["status"] == 200
        assert gone[0]["status"] == 499
        assert calls == [1]  # only the first request's image reached the model
        metrics = runtimes.metrics.render()[0].decode()
        assert 'endpoint="classify",model="digits_multimax",outcome="cancelled"} 1.0' in metrics

    asyncio.run(main())
