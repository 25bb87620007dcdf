"""benchmarks/server.py, the one helper the tests and benchmarks start and stop servers with: a server that dies
says why, one that ignores SIGTERM is killed, one that hangs is given up on."""

from __future__ import annotations

import signal
import subprocess
import sys
import tempfile
import time

import pytest

from benchmarks.server import ServerError, free_port, running, start, stop, wait_ready

PY = sys.executable


def test_a_server_that_exits_says_why_in_the_error() -> None:
    crash = [PY, "-c", "import sys; print('cannot load model x'); sys.exit(3)"]  # `--port P` lands in sys.argv
    with pytest.raises(ServerError, match=r"exited with 3: cannot load model x"):
        start(command=crash, ready_timeout=30)
    with tempfile.TemporaryFile("w+") as log, pytest.raises(ServerError, match="cannot load model x"):
        start(command=crash, ready_timeout=30, output=log)  # the output read back from a file too


def test_a_server_that_never_gets_ready_is_killed() -> None:
    t0 = time.monotonic()
    with pytest.raises(ServerError, match="not ready after 1 s"):
        start(command=[PY, "-c", "import time; time.sleep(60)"], ready_timeout=1)
    assert time.monotonic() - t0 < 20


def test_stop_drains_then_kills() -> None:
    stubborn = subprocess.Popen([PY, "-c", "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
                                           "print('up', flush=True); time.sleep(60)"], stdout=subprocess.PIPE)
    assert stubborn.stdout is not None and stubborn.stdout.readline() == b"up\n"
    stop(stubborn, timeout=0.5)
    assert stubborn.returncode == -signal.SIGKILL
    polite = subprocess.Popen([PY, "-c", "import time; time.sleep(60)"])
    stop(polite, timeout=30)
    assert polite.returncode == -signal.SIGTERM
    stop(polite)  # stopping a stopped server is a no-op


def test_running_yields_a_ready_url_and_stops_the_server() -> None:
    # A stand-in server: the trivial HTTP server of the load tester's self-benchmark (answers every path 200).
    cmd = [PY, "-m", "benchmarks.loadtest.trivial_server", "--duration", "60"]
    with running(command=cmd, ready_timeout=30) as url:
        wait_ready(url, timeout=5)  # the readiness path answers
        wait_ready(url, timeout=5, path=None)  # and the port accepts connections
    with pytest.raises(ServerError, match="not ready"):
        wait_ready(url, timeout=0.5, path=None)  # stopped: nothing listens any more
    assert 1024 <= free_port() < 65536
