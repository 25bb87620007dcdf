"""The matrix's models, artifacts and one server over all of them, built once per session (tests/conformance)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from tests.conformance import builders
from tests.conformance.matrix import ARTIFACTS, FOLDER_ARTIFACTS, KINDS, Kind, artifacts_of, export_refusal
from tests.conformance.references import Reference

pytest.importorskip("transformers")


def model_name(kind: Kind, artifact: str) -> str:
    return f"{kind.name}--{artifact}"


def _place_source(kind: Kind, source: Path, serve: Path) -> None:
    """The source as the server finds it: a folder as it is; a checkpoint as version 1 (fairseq: dict.txt beside)."""
    target = serve / model_name(kind, "source")
    if source.is_dir():
        target.symlink_to(source, target_is_directory=True)
        return
    version = target / "1"
    version.mkdir(parents=True)
    (version / "model.pt").symlink_to(source)
    for extra in ("dict.txt", "encoder.json", "vocab.bpe"):
        if (source.parent / extra).is_file():
            (version / extra).symlink_to(source.parent / extra)


EXPORTS_AT_ONCE = 2
# The exports are made in the setup of the first cell that needs them, which pytest-timeout counts against that
# cell: about 4 minutes on two quiet cores, over 11 on two shared ones (the suite's 600 s per test is for the cells).
BUILD_TIMEOUT_S = 3600


@pytest.hookimpl(trylast=True)  # after -k / -m have deselected: the first cell that runs builds
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    here = Path(__file__).resolve().parent
    first = next((item for item in items if "built" in getattr(item, "fixturenames", ())
                  and here in item.path.resolve().parents), None)
    if first is not None:
        first.add_marker(pytest.mark.timeout(BUILD_TIMEOUT_S))


def _export(args: list[str]) -> tuple[int, str]:
    """`python -m export ARGS`: its exit code and what it printed."""
    run = subprocess.run([sys.executable, "-m", "export", *args], capture_output=True, text=True, timeout=600,
                         cwd=Path(__file__).resolve().parents[2])
    return run.returncode, run.stdout + run.stderr


def _source_path(kind: Kind, root: Path) -> Path:
    if kind.builder in ("fairseq", "deit"):
        return root / kind.name / "checkpoint.pt"
    if kind.builder == "demo":
        from models.demo import DEMO_DIR

        return DEMO_DIR / kind.options["file"]
    return root / kind.name


@pytest.fixture(scope="session")
def built(tmp_path_factory: pytest.TempPathFactory) -> dict[str, object]:
    """Every kind made, every artifact exported with `python -m export` (its exit code kept), one model dir."""
    # CONFORMANCE_CACHE=DIR keeps what was built between local runs (a developer's loop; CI builds afresh)
    cached = os.environ.get("CONFORMANCE_CACHE")
    root = Path(cached) if cached else tmp_path_factory.mktemp("conformance")
    if cached and (root / "built.json").is_file():
        done = json.loads((root / "built.json").read_text())
        return {"root": root, "serve": root / "serve", "exits": {tuple(k.split("|")): v for k, v in done.items()},
                "sources": {k.name: _source_path(k, root / "sources") for k in KINDS}}
    serve = root / "serve"
    serve.mkdir(parents=True)
    sources = {kind.name: builders.source(kind, root / "sources") for kind in KINDS}
    jobs: dict[tuple[str, str], list[str]] = {}
    for kind in KINDS:
        for artifact in artifacts_of(kind):
            args = ARTIFACTS[artifact][1]
            if args is None:
                _place_source(kind, sources[kind.name], serve)
                continue
            name = model_name(kind, artifact)
            out = serve / name if artifact in FOLDER_ARTIFACTS else serve / f"{name}.onnx"
            # text: 8 random cases (each greedy text is checked too); vision: the default 100 images, since an fp16
            # graph is held to 99% top-1 agreement and one near-tie among 8 images would be 87.5%
            samples = ["--samples", "8"] if kind.task == "text" else []
            jobs[kind.name, artifact] = [str(sources[kind.name]), "-o", str(out), "--quiet", *samples,
                                         "--batch-sizes", "1,2", "--threads", "1", *args]
    # `python -m export` as a user runs it, two at a time: tracing is one core's Python, and this machine has two
    with ThreadPoolExecutor(EXPORTS_AT_ONCE) as pool:
        done = dict(zip(jobs, pool.map(_export, jobs.values()), strict=True))
    exits = {key: code for key, (code, _) in done.items()}
    for (kind_name, artifact), (code, output) in done.items():
        refusal = export_refusal(next(k for k in KINDS if k.name == kind_name), artifact)
        assert code == (refusal.exit_code if refusal else 0), (kind_name, artifact, code, output[-2000:])
        verdict = output.split("\nreport:")[0].rsplit("\n", 1)[-1]  # `passed`, or an int8 graph's reported deltas
        held = verdict == "passed" or (": deltas reported, not enforced" in verdict and "skipped" not in verdict)
        assert refusal is not None or held, (kind_name, artifact, output[-2000:])  # validated, no check skipped
    if cached:
        (root / "built.json").write_text(json.dumps({"|".join(k): v for k, v in exits.items()}))
    return {"root": root, "serve": serve, "sources": sources, "exits": exits}


@pytest.fixture(scope="session")
def client(built: dict[str, object]) -> Iterator[TestClient]:
    from service.base.config import Settings
    from service.edge.app import create_app

    serve = built["serve"]
    assert isinstance(serve, Path)
    # the "source" column is a folder or checkpoint served as it is, on PyTorch: folders are not exported on load
    # (their export is the "genai" column; service.engine.folder_export is tested in test_folder_export_cache.py)
    settings = Settings(model_dir=serve, warmup_calls=0, max_running_sequences=8, intra_op_threads=1,
                        folder_export="off")
    with TestClient(create_app(settings), raise_server_exceptions=False) as c:
        yield c


@pytest.fixture(scope="session")
def references(built: dict[str, object]) -> dict[str, Reference]:
    sources = built["sources"]
    assert isinstance(sources, dict)
    return {k.name: Reference(k, sources[k.name]) for k in KINDS if k.task == "text"}

