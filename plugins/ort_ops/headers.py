"""Where the onnxruntime C API headers come from, fetching Debian's `libonnxruntime-dev` when needed.

Order: `ORT_INCLUDE_DIR`; an installed libonnxruntime-dev (/usr/include/onnxruntime); a copy fetched
earlier into the cache; else fetch it now with apt-get under a private sources list and state
directory (the system's apt configuration is not touched) and unpack it with `dpkg-deb -x`.
The headers' API version is what the library asks onnxruntime for, so any recent version works.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import tempfile
from pathlib import Path

HEADER = "onnxruntime_c_api.h"
SYSTEM_DIR = Path("/usr/include/onnxruntime")
# Debian trixie ships onnxruntime 1.21's headers (API version 21), signed by the archive key every
# Debian system has.
SOURCES_LINE = (
    "deb [signed-by=/usr/share/keyrings/debian-archive-keyring.gpg] http://deb.debian.org/debian trixie main\n"
)
PACKAGE = "libonnxruntime-dev"
FETCH_TIMEOUT_S = 180


class HeadersUnavailable(RuntimeError):
    """No onnxruntime C API headers could be found or fetched; the message says why."""


def api_version(include_dir: Path) -> int:
    """ORT_API_VERSION as the headers define it."""
    match = re.search(r"#define\s+ORT_API_VERSION\s+(\d+)", (include_dir / HEADER).read_text(errors="replace"))
    if not match:
        raise HeadersUnavailable(f"{include_dir / HEADER} defines no ORT_API_VERSION")
    return int(match.group(1))


def find_headers(cache: Path, fetch: bool = True) -> Path:
    """A directory holding onnxruntime_c_api.h; fetched into `cache` if nothing local has one."""
    env = os.environ.get("ORT_INCLUDE_DIR")
    if env:
        if not (Path(env) / HEADER).is_file():
            raise HeadersUnavailable(f"ORT_INCLUDE_DIR={env} has no {HEADER}")
        return Path(env)
    fetched = cache / "headers" / "usr/include/onnxruntime"
    for candidate in (SYSTEM_DIR, fetched):
        if (candidate / HEADER).is_file():
            return candidate
    if not fetch:
        raise HeadersUnavailable(f"no {HEADER}: set ORT_INCLUDE_DIR or install {PACKAGE}")
    fetch_debian_headers(cache / "headers")
    return fetched


def _run(cmd: list[str], what: str) -> None:
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=FETCH_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        raise HeadersUnavailable(f"{what} timed out after {FETCH_TIMEOUT_S}s") from None
    if done.returncode:
        tail = (done.stderr or done.stdout).strip().splitlines()[-1:] or ["no output"]
        raise HeadersUnavailable(f"{what} failed (exit {done.returncode}): {tail[0]}")


def fetch_debian_headers(dest: Path) -> None:
    """Download libonnxruntime-dev with apt-get (private config) and unpack it into `dest` atomically."""
    for tool in ("apt-get", "dpkg-deb"):
        if shutil.which(tool) is None:
            raise HeadersUnavailable(f"no {tool} to fetch {PACKAGE}: set ORT_INCLUDE_DIR to onnxruntime's headers")
    dest.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="apt.", dir=dest.parent) as tmp:
        work = Path(tmp)
        (work / "lists/partial").mkdir(parents=True)
        (work / "cache/archives/partial").mkdir(parents=True)
        (work / "sources.list").write_text(SOURCES_LINE)
        options = [
            f"-oDir::Etc::SourceList={work / 'sources.list'}",
            "-oDir::Etc::SourceParts=/dev/null",
            f"-oDir::State::Lists={work / 'lists'}",
            f"-oDir::Cache={work / 'cache'}",
            "-oDebug::NoLocking=1",
            "-qq",
        ]
        if os.geteuid() == 0:  # the _apt sandbox user cannot write into our temporary directory
            options.append("-oAPT::Sandbox::User=root")
        _run(["apt-get", *options, "update"], "apt-get update (private sources list)")
        cmd = ["apt-get", *options, "download", PACKAGE]
        download = subprocess.run(cmd, cwd=work, capture_output=True, text=True, timeout=FETCH_TIMEOUT_S)
        debs = sorted(work.glob(f"{PACKAGE}_*.deb"))
        if download.returncode or not debs:
            tail = (download.stderr or download.stdout).strip().splitlines()[-1:] or ["no .deb"]
            raise HeadersUnavailable(f"apt-get download {PACKAGE} failed: {tail[0]}")
        unpacked = work / "root"
        _run(["dpkg-deb", "-x", str(debs[0]), str(unpacked)], f"dpkg-deb -x {debs[0].name}")
        if not (unpacked / "usr/include/onnxruntime" / HEADER).is_file():
            raise HeadersUnavailable(f"{debs[0].name} holds no {HEADER}")
        shutil.rmtree(dest, ignore_errors=True)
        unpacked.rename(dest)
