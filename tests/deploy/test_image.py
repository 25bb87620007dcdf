"""The container image (Dockerfile): built with podman, its filesystem exported and the server run from it.

Base images cannot be pulled here, so the test makes one: Debian bookworm (its python3 is 3.11, as the
Dockerfile's default python:3.11-slim) from Debian's packages with mmdebstrap, passed as BASE. Running a
container does not work on these machines, so the server runs from the exported filesystem with chroot, as
the image's user, with the image's environment and entry point, on loopback. The pip installs of the build reach
the package registries (podman build's chroot isolation shares the host's network).

Opt-in (MULTIMAX_IMAGE_TEST=1, and root, podman and mmdebstrap): it takes several minutes (docs/DEPLOY.md).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import tarfile
import urllib.request
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from benchmarks.server import free_port, stop, wait_ready
from tests.paths import ROOT

LOCAL_WHEELS = Path("/opt/wheels")  # this machine's CPU torch wheel (PyTorch's CPU index is not reachable here)
BASE_PACKAGES = "python3,python3-venv,python-is-python3,ca-certificates"
LOCAL_CAS, PIP_CONF = Path("/usr/local/share/ca-certificates"), Path("/etc/pip.conf")

pytestmark = [
    pytest.mark.slow,
    pytest.mark.timeout(3000),  # the image fixture (mmdebstrap, podman build) alone takes over 10 minutes
    pytest.mark.skipif(os.environ.get("MULTIMAX_IMAGE_TEST") != "1", reason="opt-in: MULTIMAX_IMAGE_TEST=1"),
    pytest.mark.skipif(not all(shutil.which(t) for t in ("podman", "mmdebstrap", "chroot")) or os.geteuid() != 0,
                       reason="needs root, podman and mmdebstrap (apt-get install podman mmdebstrap)"),
]


def run(*cmd: str, timeout: float = 1800) -> str:
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, f"{' '.join(cmd)}: exit {done.returncode}\n{(done.stdout + done.stderr)[-4000:]}"
    return done.stdout


def host_trust_hooks() -> list[str]:
    """mmdebstrap hooks giving the base this machine's extra CA certificates and pip configuration (a TLS proxy
    stands between this machine and the registries); a base on an ordinary network needs neither."""
    hooks = []
    if any(LOCAL_CAS.glob("*.crt")):
        hooks += [f"--customize-hook=copy-in {' '.join(map(str, LOCAL_CAS.glob('*.crt')))} {LOCAL_CAS}",
                  '--customize-hook=chroot "$1" update-ca-certificates']
    if PIP_CONF.is_file():
        hooks.append(f"--customize-hook=copy-in {PIP_CONF} /etc")
    return hooks


@pytest.fixture(scope="module")
def image(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    work = tmp_path_factory.mktemp("image")
    tag = f"localhost/multimax-serve-test-{uuid.uuid4().hex[:8]}"
    base = os.environ.get("MULTIMAX_IMAGE_BASE")  # a base made earlier (saves the mmdebstrap minutes)
    if not base:
        run("mmdebstrap", "--variant=minbase", f"--include={BASE_PACKAGES}", *host_trust_hooks(), "bookworm",
            str(work / "base.tar"), "http://deb.debian.org/debian")
        base = tag + "-base"
        run("podman", "import", str(work / "base.tar"), base)
        (work / "base.tar").unlink()
    extra = ["-v", f"{LOCAL_WHEELS}:{LOCAL_WHEELS}:ro", "--build-arg", f"PIP_EXTRA_ARGS=--find-links {LOCAL_WHEELS}"]
    try:
        # --layers=false: no intermediate images left behind (nor the time to commit them)
        run("podman", "build", "--isolation", "chroot", "--layers=false", "--format", "docker",
            "--build-arg", f"BASE={base}", *(extra if LOCAL_WHEELS.is_dir() else []), "-t", tag, str(ROOT))
        yield tag
    finally:
        subprocess.run(["podman", "rmi", "-f", tag], capture_output=True)
        if not os.environ.get("MULTIMAX_IMAGE_BASE"):
            subprocess.run(["podman", "rmi", "-f", base], capture_output=True)


@pytest.fixture(scope="module")
def config(image: str) -> dict[str, object]:
    (inspected,) = json.loads(run("podman", "image", "inspect", image))
    return inspected


@pytest.fixture(scope="module")
def rootfs(image: str, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The image's filesystem, exported from a container that is created but never started."""
    work = tmp_path_factory.mktemp("rootfs")
    name = f"multimax-export-{uuid.uuid4().hex[:8]}"
    run("podman", "create", "--name", name, image)
    try:
        run("podman", "export", "-o", str(work / "fs.tar"), name)
    finally:
        subprocess.run(["podman", "rm", "-f", name], capture_output=True)
    with tarfile.open(work / "fs.tar") as tar:
        tar.extractall(work / "fs", filter="tar")
    (work / "fs.tar").unlink()
    return work / "fs"


def test_the_image_is_configured_as_documented(config: dict[str, object]) -> None:
    cfg = config["Config"]
    assert isinstance(cfg, dict)
    assert cfg["User"] == "10001:10001" and cfg["Entrypoint"] == ["python3", "-m", "service"]
    env = dict(e.split("=", 1) for e in cfg["Env"])
    assert env["MULTIMAX_SERVE_MODEL_DIR"] == "/models" and env["MULTIMAX_SERVE_HOST"] == "0.0.0.0"
    assert "8000/tcp" in cfg["ExposedPorts"]
    check = config["Healthcheck"]
    assert isinstance(check, dict) and check["Test"][0] == "CMD" and "/v2/health/ready" in check["Test"][-1]
    print(f"image size: {int(config['Size']) / 1e6:.0f} MB")  # type: ignore[call-overload]


def test_the_filesystem_has_the_prebuilt_library_and_no_compiler(rootfs: Path) -> None:
    libs = list(rootfs.glob("opt/venv/lib/python3*/site-packages/plugins/ort_ops/lib/libmultimax_ort_ops.api*.so"))
    assert len(libs) == 1, libs
    assert not any((rootfs / "usr/bin" / cc).exists() for cc in ("g++", "c++", "gcc", "cc"))
    # The demo models answer at /models until a volume is mounted over it (the chart's and Compose's default)
    assert sorted(p.name for p in (rootfs / "models").iterdir()) == sorted(
        p.name for p in (ROOT / "models/demo").glob("*.onnx")
    )


@pytest.fixture
def mounted(rootfs: Path) -> Iterator[Path]:
    """The image's own /models (the demo models, as without a mount), /proc and /dev bound in for the server."""
    binds = [rootfs / "proc", rootfs / "dev"]
    try:
        for where in binds:
            run("mount", "--bind", f"/{where.name}", str(where))
        yield rootfs
    finally:
        for where in binds:
            subprocess.run(["umount", "--lazy", str(where)], capture_output=True)


def chroot_command(rootfs: Path, config: dict[str, object], *argv: str, port: int) -> tuple[list[str], dict[str, str]]:
    """The image's entry point run in `rootfs` as the image's user, with only the image's environment (on loopback)."""
    cfg = config["Config"]
    assert isinstance(cfg, dict)
    env = dict(e.split("=", 1) for e in cfg["Env"]) | {"MULTIMAX_SERVE_HOST": "127.0.0.1",
                                                       "MULTIMAX_SERVE_PORT": str(port)}
    cmd = ["chroot", f"--userspec={cfg['User']}", str(rootfs), *argv]
    return cmd, env


def test_the_server_runs_from_the_image(mounted: Path, config: dict[str, object]) -> None:
    port = free_port()
    cfg = config["Config"]
    assert isinstance(cfg, dict)
    cmd, env = chroot_command(mounted, config, *cfg["Entrypoint"], "--log-level", "info", port=port)
    proc = subprocess.Popen(cmd, env=env, cwd="/", stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_ready(url, proc, timeout=300)
        with urllib.request.urlopen(f"{url}/v1/models", timeout=30) as r:
            cards = {m["id"]: m for m in json.load(r)["data"]}
        digit = (ROOT / "docs/digit.png").read_bytes()
        req = urllib.request.Request(f"{url}/v1/models/digits_multimax/classify", data=digit,
                                     headers={"Content-Type": "image/png"})
        with urllib.request.urlopen(req, timeout=60) as r:
            classified = json.load(r)
        body = json.dumps({"model": "text_multimax", "prompt": "Return the", "max_tokens": 8}).encode()
        req = urllib.request.Request(f"{url}/v1/completions", data=body, headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=60) as r:
            completion = json.load(r)
        check = config["Healthcheck"]
        assert isinstance(check, dict)
        health = subprocess.run(chroot_command(mounted, config, *check["Test"][1:], port=port)[0], env=env,
                                capture_output=True, text=True, timeout=60)
    finally:
        stop(proc)
    assert proc.stdout is not None
    log = proc.stdout.read()
    assert set(cards) == {"digits_multimax", "digits_softmax", "text_multimax"}
    assert cards["digits_multimax"]["fused_multimax"]["source"] == "prebuilt", cards["digits_multimax"]
    assert "fused MultiMax ops: prebuilt library /opt/venv/" in log, log[-3000:]
    assert classified["predictions"][0][0]["label"] == "3"  # docs/digit.png is a drawn 3
    assert completion["choices"][0]["finish_reason"] in ("length", "stop") and completion["usage"]["completion_tokens"]
    assert health.returncode == 0, health.stderr
