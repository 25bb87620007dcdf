"""Over real sockets (uvicorn in a thread): slow clients are cut off, a client that leaves while uploading is
counted as cancelled, and when the shutdown grace period runs out every open request still gets JSON."""

from __future__ import annotations

import json
import logging
import socket
import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
import uvicorn

from benchmarks.loadtest.prom import sample_value
from benchmarks.server import free_port
from service.base.config import Settings
from service.edge.app import create_app
from service.edge.slowclient import header_timeout_protocol


class Server:
    def __init__(self, app: Any, header_timeout_s: float = 0.5, grace_s: float = 30.0) -> None:
        self.port = free_port()
        config = uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning",
                                http=header_timeout_protocol(header_timeout_s), timeout_graceful_shutdown=grace_s)
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.url = f"http://127.0.0.1:{self.port}"

    def __enter__(self) -> Server:
        self.thread.start()
        end = time.monotonic() + 60
        while time.monotonic() < end:
            try:
                if httpx.get(f"{self.url}/v2/health/ready", timeout=1).status_code == 200:
                    return self
            except httpx.HTTPError:
                time.sleep(0.05)
        raise RuntimeError("server did not start")

    def __exit__(self, *exc: object) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=60)


def _read_all(sock: socket.socket, timeout: float = 10) -> bytes:
    sock.settimeout(timeout)
    out = b""
    while True:
        try:
            chunk = sock.recv(65536)
        except (TimeoutError, ConnectionResetError):
            return out
        if not chunk:
            return out
        out += chunk


@pytest.fixture(scope="module")
def server() -> Iterator[Server]:
    with Server(create_app(Settings(models=("digits_multimax",), body_timeout_s=0.5))) as s:
        yield s


def test_headers_sent_too_slowly_get_408_and_the_connection_closes(server: Server) -> None:
    with socket.create_connection(("127.0.0.1", server.port)) as sock:
        sock.sendall(b"GET /v2/health/live HTTP/1.1\r\nHost: x\r\n")  # and then nothing: a slowloris
        start = time.monotonic()
        reply = _read_all(sock)
    assert reply.startswith(b"HTTP/1.1 408") and b"header_timeout" in reply
    assert time.monotonic() - start < 9  # closed by the server, not by the test's own timeout
    assert httpx.get(f"{server.url}/v2/health/live").status_code == 200  # and the server goes on


def test_a_connection_that_sends_headers_in_time_is_served(server: Server) -> None:
    with socket.create_connection(("127.0.0.1", server.port)) as sock:
        for part in (b"GET /v2/health/live HTTP/1.1\r\n", b"Host: x\r\n", b"Connection: close\r\n\r\n"):
            sock.sendall(part)
            time.sleep(0.1)
        assert _read_all(sock).startswith(b"HTTP/1.1 200")


@pytest.mark.parametrize("chunks", [1, 40], ids=["at-once", "in-pieces"])
def test_headers_over_the_bound_get_431_and_the_connection_closes(server: Server, chunks: int) -> None:
    """The HTTP parser (httptools) has no bound of its own on a request's headers: the protocol's is 64 KiB."""
    from service.edge.slowclient import MAX_HEADER_BYTES

    header = b"X-Filler: " + b"a" * (MAX_HEADER_BYTES + 100) + b"\r\n"
    request = b"GET /v2/health/live HTTP/1.1\r\nHost: x\r\n" + header + b"\r\n"
    with socket.create_connection(("127.0.0.1", server.port)) as sock:
        size = len(request) // chunks + 1
        try:
            for i in range(0, len(request), size):
                sock.sendall(request[i:i + size])
        except (BrokenPipeError, ConnectionResetError):
            pass  # closed by the server while the rest was still being sent
        reply = _read_all(sock)
    head, _, body = reply.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 431"), reply[:200]
    assert json.loads(body)["error"]["code"] == "headers_too_large"
    # headers under the bound (32 KiB of them) are served, and the server goes on
    big = {"X-Filler": "a" * (32 * 1024)}
    assert httpx.get(f"{server.url}/v2/health/live", headers=big).status_code == 200
    # a body is not a header: 200 kB of JSON sent with its headers reach the endpoint (which judges them)
    r = httpx.post(f"{server.url}/v2/models/digits_multimax/infer", content=b"[" + b"0," * 100_000 + b"0]",
                   headers={"content-type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]


def test_a_body_sent_too_slowly_gets_408_json(server: Server) -> None:
    with socket.create_connection(("127.0.0.1", server.port)) as sock:
        sock.sendall(b"POST /v2/models/digits_multimax/infer HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: 1000\r\n\r\n{\"inputs\": ")
        reply = _read_all(sock)
    head, _, body = reply.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 408"), reply
    assert "not received within" in json.loads(body)["error"]


def _count(url: str, endpoint: str, outcome: str) -> float:
    return sample_value(httpx.get(f"{url}/metrics").text, "multimax_requests_total", endpoint=endpoint,
                        model="digits_multimax", outcome=outcome)


def test_a_client_leaving_while_uploading_is_cancelled_not_an_error(server: Server,
                                                                   caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO)
    before = {o: _count(server.url, "classify", o) for o in ("cancelled", "error")}
    with socket.create_connection(("127.0.0.1", server.port)) as sock:
        sock.sendall(b"POST /v1/models/digits_multimax/classify HTTP/1.1\r\nHost: x\r\nContent-Type: image/png\r\n"
                     b"Content-Length: 100000\r\n\r\n" + b"\x89PNG" + b"\0" * 1000)
        time.sleep(0.1)
    end = time.monotonic() + 5
    while _count(server.url, "classify", "cancelled") == before["cancelled"] and time.monotonic() < end:
        time.sleep(0.05)
    assert _count(server.url, "classify", "cancelled") == before["cancelled"] + 1
    assert _count(server.url, "classify", "error") == before["error"]
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR or r.exc_info]


def test_when_the_grace_period_runs_out_queued_requests_get_json_503_and_streams_an_error_event() -> None:
    app = create_app(Settings(models=("text_multimax",), max_running_sequences=1))
    backend = app.state.runtimes.models["text_multimax"].entry.backend
    original = backend.run_text

    def slow(*args: Any) -> Any:
        time.sleep(0.05)  # 100 tokens: 5 s, far past the 1 s grace period
        return original(*args)

    backend.run_text = slow
    results: dict[str, Any] = {}
    server = Server(app, grace_s=1.0)
    body = {"model": "text_multimax", "prompt": "The", "max_tokens": 100, "temperature": 0}

    def stream() -> None:
        with httpx.stream("POST", f"{server.url}/v1/completions", json=body | {"stream": True}, timeout=60) as r:
            results["stream"] = [line for line in r.iter_lines() if line.startswith("data: ")]

    def queued() -> None:
        r = httpx.post(f"{server.url}/v1/completions", json=body, timeout=60)
        results["queued"] = (r.status_code, r.headers.get("content-type"), r.text)

    with server:
        threads = [threading.Thread(target=stream), threading.Thread(target=queued)]
        threads[0].start()
        time.sleep(0.5)
        threads[1].start()
        time.sleep(0.5)
    for t in threads:
        t.join(timeout=60)
    status, content_type, text = results["queued"]
    assert status == 503 and content_type == "application/json", text
    assert json.loads(text)["error"]["code"] == "shutting_down"
    events = results["stream"]
    assert events[-1] == "data: [DONE]"
    assert json.loads(events[-2].removeprefix("data: "))["error"]["code"] == "shutting_down"
    assert len(events) > 3  # some tokens went out before the grace period ended
