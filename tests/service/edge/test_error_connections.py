"""A 500 leaves its keep-alive connection usable (issue 37, item 5): the openai SDK at max_retries=0, LangChain and
instructor reuse pooled connections, and a 500 after which uvicorn silently dropped the connection made their
next request fail with a connection error. Over a real socket, with the server's own uvicorn protocol."""

from __future__ import annotations

import http.client
import json
from collections.abc import Iterator

import pytest
from fastapi.responses import StreamingResponse

from benchmarks.server import in_thread
from service.base.config import Settings
from service.edge.app import create_app
from service.edge.slowclient import header_timeout_protocol


@pytest.fixture(scope="module")
def server() -> Iterator[int]:
    settings = Settings(models=("text_multimax",))
    app = create_app(settings)

    @app.get("/boom")
    async def boom() -> None:
        raise RuntimeError("unexpected")

    @app.get("/boom-mid-stream")
    async def boom_mid_stream() -> StreamingResponse:
        async def body() -> Iterator[bytes]:  # type: ignore[misc]
            yield b"data: first\n\n"
            raise RuntimeError("unexpected mid-stream")
        return StreamingResponse(body(), media_type="text/event-stream")

    with in_thread(app, http=header_timeout_protocol(settings.header_timeout_s, settings.idle_timeout_s,
                                                     settings.max_connections)) as url:
        yield int(url.rsplit(":", 1)[1])


def test_a_500_keeps_the_connection_usable(server: int) -> None:
    conn = http.client.HTTPConnection("127.0.0.1", server, timeout=30)
    conn.request("GET", "/boom")
    r = conn.getresponse()
    body = json.loads(r.read())
    assert r.status == 500 and body["error"]["code"] == "internal_error"
    assert (r.getheader("connection") or "").lower() != "close"
    sock = conn.sock
    conn.request("GET", "/v2/health/live")  # the same connection, not a new one
    r = conn.getresponse()
    assert r.status == 200 and conn.sock is sock
    r.read()
    conn.request("POST", "/v1/completions", body=json.dumps({"model": "text_multimax", "prompt": "Return the",
                                                              "max_tokens": 4, "temperature": 0}),
                 headers={"content-type": "application/json"})
    r = conn.getresponse()
    assert r.status == 200 and len(json.loads(r.read())["choices"][0]["text"]) > 0 and conn.sock is sock
    conn.close()


def test_an_error_mid_stream_ends_the_connection_and_the_server_serves_on(server: int) -> None:
    conn = http.client.HTTPConnection("127.0.0.1", server, timeout=30)
    conn.request("GET", "/boom-mid-stream")
    r = conn.getresponse()
    assert r.status == 200
    with pytest.raises(http.client.IncompleteRead):  # the body was cut: the client must not take it as whole
        r.read()
    conn.close()
    fresh = http.client.HTTPConnection("127.0.0.1", server, timeout=30)
    fresh.request("GET", "/v2/health/live")
    assert fresh.getresponse().status == 200
    fresh.close()
