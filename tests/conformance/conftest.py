"""The matrix's models, artifacts and one server over all of them, built once per session (tests/conformance)."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
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
    from export.cli import main as export_main

    # CONFORMANCE_CACHE=DIR keeps what was built between local runs (a developer's loop; CI builds afresh)
    cached = os.environ.get("CONFORMANCE_CACHE")
    root = Path(cached) if cached else tmp_path_factory.mktemp("conformance")
    if cached and (root / "built.json").is_file():
        done = json.loads((root / "built.json").read_text())
        return {"root": root, "serve": root / "serve", "exits": {tuple(k.split("|")): v for k, v in done.items()},
                "sources": {k.name: _source_path(k, root / "sources") for k in KINDS}}
    serve = root / "serve"
    serve.mkdir(parents=True)
    sources: dict[str, Path] = {}
    exits: dict[tuple[str, str], int] = {}
    for kind in KINDS:
        source = sources[kind.name] = builders.source(kind, root / "sources")
        for artifact in artifacts_of(kind):
            args = ARTIFACTS[artifact][1]
            if args is None:
                _place_source(kind, source, serve)
                continue
            name = model_name(kind, artifact)
            out = serve / name if artifact in FOLDER_ARTIFACTS else serve / f"{name}.onnx"
            exits[kind.name, artifact] = export_main([str(source), "-o", str(out), "--quiet", "--samples", "8",
                                                      "--batch-sizes", "1,2", *args])
            assert (exits[kind.name, artifact] == 2) == (export_refusal(kind, artifact) is not None), (kind, artifact)
    if cached:
        (root / "built.json").write_text(json.dumps({"|".join(k): v for k, v in exits.items()}))
    return {"root": root, "serve": serve, "sources": sources, "exits": exits}


@pytest.fixture(scope="session")
def client(built: dict[str, object]) -> Iterator[TestClient]:
    from service.base.config import Settings
    from service.edge.app import create_app

    serve = built["serve"]
    assert isinstance(serve, Path)
    settings = Settings(model_dir=serve, warmup_calls=0, max_running_sequences=8, intra_op_threads=1)
    with TestClient(create_app(settings), raise_server_exceptions=False) as c:
        yield c


@pytest.fixture(scope="session")
def references(built: dict[str, object]) -> dict[str, Reference]:
    sources = built["sources"]
    assert isinstance(sources, dict)
    return {k.name: Reference(k, sources[k.name]) for k in KINDS if k.task == "text"}

