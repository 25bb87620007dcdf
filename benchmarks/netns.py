"""A loopback-only network namespace for running Ray on a machine whose other interfaces must not be used.

Ray binds its services to the machine's network address; inside a namespace that has only `lo`, that address
is 127.0.0.1 and nothing can leave the machine. `loopback_namespace()` moves the calling thread into a new one
(setns), so the processes it starts and the sockets it opens live there, and on exit moves it back, kills
whatever still runs in the namespace (only what this thread started can) and deletes it. Needs root and `ip`
(iproute2); Linux only. Used by the Ray tests and `python -m benchmarks.ray_serving --netns`.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import shutil
import signal
import subprocess
import uuid
from collections.abc import Iterator

CLONE_NEWNET = 0x40000000


class NamespaceUnavailable(RuntimeError):
    """No network namespace can be made here (not root, no `ip`, no kernel support)."""


def _setns(fd: int) -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.setns(fd, CLONE_NEWNET) != 0:
        raise OSError(ctypes.get_errno(), "setns(CLONE_NEWNET) failed")


@contextlib.contextmanager
def loopback_namespace(prefix: str = "multimax") -> Iterator[str]:
    if shutil.which("ip") is None:
        raise NamespaceUnavailable("the `ip` command (iproute2) is missing")
    name = f"{prefix}-{uuid.uuid4().hex[:8]}"
    made = subprocess.run(["ip", "netns", "add", name], capture_output=True, text=True)
    if made.returncode != 0:
        raise NamespaceUnavailable(f"`ip netns add` failed (it needs root): {made.stderr.strip()}")
    original = os.open("/proc/thread-self/ns/net", os.O_RDONLY)
    try:
        subprocess.run(["ip", "netns", "exec", name, "ip", "link", "set", "lo", "up"], check=True)
        target = os.open(f"/run/netns/{name}", os.O_RDONLY)
        try:
            _setns(target)
        finally:
            os.close(target)
        try:
            yield name
        finally:
            _setns(original)
    finally:
        os.close(original)
        pids = subprocess.run(["ip", "netns", "pids", name], capture_output=True, text=True).stdout.split()
        for pid in pids:  # Ray's agents can outlive a driver that was killed
            with contextlib.suppress(ProcessLookupError, ValueError):
                os.kill(int(pid), signal.SIGKILL)
        subprocess.run(["ip", "netns", "delete", name], capture_output=True)
