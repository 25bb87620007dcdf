"""Start and stop a server subprocess on a free loopback port: one helper for the benchmarks and the tests.

`running(*args)` runs `python -m service ARGS` (or any command given as `command`) on a free port of
127.0.0.1, waits until it answers its readiness probe, yields its URL, and stops it as a deployment would:
SIGTERM, so that it drains, then a kill after `stop_timeout` seconds. Readiness is probed with the standard
library, with proxies off: traffic stays on the loopback interface whatever the environment says.
"""

from __future__ import annotations

import contextlib
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
READY_PATH = "/v2/health/ready"  # KServe V2 readiness: 200 once every model is loaded
_NO_PROXY = urllib.request.build_opener(urllib.request.ProxyHandler({}))


class ServerError(RuntimeError):
    """The server exited or did not become ready in time; the message carries its output where there is one."""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _output(proc: subprocess.Popen[Any]) -> str:
    """What the exited process wrote: from its pipe, or from the file it wrote to (`start(output=file)`)."""
    stream = proc.stdout or proc.stderr or getattr(proc, "log_file", None)
    if stream is None:
        return ""
    with contextlib.suppress(Exception):
        if stream is getattr(proc, "log_file", None):
            stream.seek(0)
        data = stream.read()
        return data.decode(errors="replace") if isinstance(data, bytes) else str(data)
    return ""


def _answers(url: str, path: str | None) -> bool:
    if path is None:  # a bare TCP server: accepting connections is all it can say
        host, _, port = url.removeprefix("http://").partition(":")
        with socket.socket() as s:
            return s.connect_ex((host, int(port))) == 0
    try:
        with _NO_PROXY.open(url + path, timeout=1) as resp:
            return bool(resp.status == 200)
    except (urllib.error.URLError, OSError):
        return False


def wait_ready(url: str, proc: subprocess.Popen[Any] | None = None, timeout: float = 120,
               path: str | None = READY_PATH) -> None:
    """Until `url + path` answers 200 (path None: until the port accepts connections); ServerError if `proc`
    exits first or `timeout` seconds pass."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if proc is not None and proc.poll() is not None:
            raise ServerError(f"server exited with {proc.returncode}: {_output(proc)[-3000:]}")
        if _answers(url, path):
            return
        time.sleep(0.1)
    raise ServerError(f"server at {url} not ready after {timeout:g} s")


def stop(proc: subprocess.Popen[Any], timeout: float = 30) -> None:
    """SIGTERM (the server drains), then kill if it has not exited within `timeout` seconds."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def start(*args: str, command: Sequence[str] | None = None, port: int | None = None, cwd: Path = ROOT,
          env: dict[str, str] | None = None, output: Any = subprocess.PIPE, ready_timeout: float = 120,
          ready_path: str | None = READY_PATH) -> tuple[subprocess.Popen[str], str]:
    """Start `python -m service --port P --log-level warning ARGS` (or `command` followed by `--port P` and
    ARGS) and wait until it is ready: (process, URL). A server that fails to come up is killed, its output in
    the ServerError. `output` receives stdout and stderr together: a pipe by default (the tests read it), or a
file (`tempfile.TemporaryFile("w+")`) for a long run whose log could fill a pipe and stall the server."""
    port = port or free_port()
    head = list(command) if command is not None else [sys.executable, "-m", "service", "--log-level", "warning"]
    proc = subprocess.Popen([*head, "--port", str(port), *args], cwd=cwd, env=env, stdout=output,
                            stderr=subprocess.STDOUT, text=True)
    if output not in (subprocess.PIPE, subprocess.DEVNULL, None) and hasattr(output, "seek"):
        proc.log_file = output  # type: ignore[attr-defined]  # read back if it fails to come up
    url = f"http://127.0.0.1:{port}"
    try:
        wait_ready(url, proc, ready_timeout, ready_path)
    except BaseException:
        if proc.poll() is None:
            proc.kill()
        proc.wait()
        raise
    return proc, url


@contextlib.contextmanager
def running(*args: str, stop_timeout: float = 30, **kwargs: Any) -> Iterator[str]:
    """`start(*args, **kwargs)` as a context: yields the URL, stops the server on exit."""
    proc, url = start(*args, **kwargs)
    try:
        yield url
    finally:
        stop(proc, stop_timeout)


@contextlib.contextmanager
def in_thread(app: Any, timeout: float = 120, **config: Any) -> Iterator[str]:
    """uvicorn serving `app` on a loopback port from a thread of this process (a test can reach into the app);
    `config`: more uvicorn.Config arguments (the server's own `http` protocol, say). Yields the URL."""
    import threading

    import uvicorn

    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", **config))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + timeout
    while not server.started:
        if time.monotonic() > deadline or not thread.is_alive():
            server.should_exit = True
            raise ServerError("the in-process server did not start")
        time.sleep(0.05)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(30)
