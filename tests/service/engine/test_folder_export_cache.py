"""A Hugging Face folder in the model directory is served from its onnxruntime-genai export, made on its first load,
validated, cached under a key of its content and reused (service.engine.folder_export, issue 40).

One real export (a tiny Llama with the SegLU head, made by transformers' save_pretrained: tests/conformance/builders)
is shared by the module; the tests that only need an export to happen put that one in place with a stand-in
exporter, a child process as the real one is."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("transformers")

from fastapi.testclient import TestClient

from service.base.config import Settings, load_settings
from service.edge.app import create_app
from service.engine import folder_export
from service.engine.folder_export import MANIFEST, cached_export, export_key
from service.engine.registry import load_models
from tests.conformance.builders import hf_folder
from tests.conformance.matrix import Kind

NAME = "tiny-seglu"
PROMPTS = ["The quick brown fox", "def load(path):", "If the file is missing,"]
SEGLU = Kind(NAME, "text", "hf", "a tiny Llama with the SegLU head and a chat template",
             {"family": "llama", "seglu": True, "bos": True, "tied": False, "chat": True})


@pytest.fixture(scope="module")
def repo(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A model directory holding one Hugging Face folder (Llama, SegLU head, chat template)."""
    root = tmp_path_factory.mktemp("repo")
    hf_folder(SEGLU, root / NAME)
    return root


@pytest.fixture(scope="module")
def exported(repo: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A cache holding the folder's real export, made by the first load through the registry."""
    cache = tmp_path_factory.mktemp("cache")
    loaded, failed = load_models(settings(repo, cache))
    assert not failed
    loaded[NAME][1].backend.close()
    return cache


def settings(repo: Path, cache: Path, **changes: Any) -> Settings:
    """The cache's own tests export before the model answers (wait); test_background_export.py tests auto's
    background export."""
    return Settings(model_dir=repo, export_cache=cache, warmup_calls=0, intra_op_threads=1,
                    **{"folder_export": "wait", **changes})


def entries(cache: Path) -> list[Path]:
    return sorted(p for p in cache.iterdir() if p.is_dir() and not p.name.startswith("."))


@pytest.fixture
def no_export(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(*args: Any) -> Any:
        raise AssertionError("exported again")
    monkeypatch.setattr(folder_export, "run_export", refuse)


@pytest.fixture
def stand_in(monkeypatch: pytest.MonkeyPatch, exported: Path) -> list[Path]:
    """`python -m export` replaced by a child process that copies the module's real export into place; returns
    the sources it was run for."""
    made = entries(exported)[0]
    calls: list[Path] = []

    def command(source: Path, out: Path, _: Settings) -> list[str]:
        calls.append(source)
        keep = {"genai_config.json", "model.onnx", "tokenizer.json", "tokenizer_config.json", "generation_config.json",
                "libmultimax_ort_ops.so", "validation.json"}
        script = ("import shutil, sys, time; time.sleep(0.5); "
                  f"shutil.copytree(sys.argv[1], sys.argv[2], ignore=lambda d, names: [n for n in names if n not in "
                  f"{keep!r}])")
        return [sys.executable, "-c", script, str(made), str(out)]
    monkeypatch.setattr(folder_export, "export_command", command)
    return calls


def fail_with(monkeypatch: pytest.MonkeyPatch, script: str) -> None:
    """The export replaced by a child process running `script` (argv[1]: the output folder)."""
    monkeypatch.setattr(folder_export, "export_command",
                        lambda source, out, _: [sys.executable, "-c", script, str(out)])


def greedy(client: TestClient) -> tuple[list[str], str]:
    """Each prompt's greedy completion, and a greedy chat answer (the chat template renders it)."""
    texts = []
    for prompt in PROMPTS:
        r = client.post("/v1/completions", json={"model": NAME, "prompt": prompt, "max_tokens": 12,
                                                 "temperature": 0, "ignore_eos": True})
        assert r.status_code == 200, r.text
        texts.append(r.json()["choices"][0]["text"])
    r = client.post("/v1/chat/completions", json={"model": NAME, "max_tokens": 12, "temperature": 0,
                                                  "messages": [{"role": "user", "content": "Return the number"}]})
    assert r.status_code == 200, r.text
    return texts, r.json()["choices"][0]["message"]["content"]


@pytest.fixture(scope="module")
def on_torch(repo: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[TestClient]:
    with TestClient(create_app(settings(repo, tmp_path_factory.mktemp("unused"), backend="torch"))) as client:
        yield client


# ---- the first load exports, later loads reuse ------------------------------------------------------------------


def test_first_load_exports_and_serves_the_export_as_pytorch_serves_the_folder(
        repo: Path, exported: Path, on_torch: TestClient, no_export: None) -> None:
    [entry] = entries(exported)
    manifest = json.loads((entry / MANIFEST).read_text())
    assert manifest["passed"] is True and manifest["source"] == NAME and manifest["verdict"].startswith("passed")
    assert json.loads((entry / "validation.json").read_text())["passed"] is True
    # the SegLU head is in the graph (one MultiMaxSigma node on the logits), the chat template beside the tokenizer
    assert b"MultiMaxSigma" in (entry / "model.onnx").read_bytes()
    assert (entry / "chat_template.jinja").read_bytes() == (repo / NAME / "chat_template.jinja").read_bytes()
    with TestClient(create_app(settings(repo, exported))) as client:
        card = client.get(f"/v1/models/{NAME}").json()
        assert card["backend"] == "onnxruntime" and card["format"] == "onnxruntime-genai-folder"
        assert card["architecture"] == "LlamaForCausalLM" and card["multimax"]["output"] is True
        assert card["tokenizer"]["chat_template"] is True
        served = card["served_from"]
        assert served["source"] == NAME and served["source_format"] == "huggingface-folder"
        assert served["key"] == entry.name and served["reused"] is True and served["validation"].startswith("passed")
        assert str(exported) not in json.dumps(card)  # a card names no path
        torch_card = on_torch.get(f"/v1/models/{NAME}").json()
        assert torch_card["backend"] == "torch" and torch_card["format"] == "huggingface-folder"
        assert torch_card["served_from"] is None
        assert card["tokenizer"] == torch_card["tokenizer"]
        assert card["context_length"] == torch_card["context_length"]
        # the SegLU head's parameters, read from the exported graph's node, are the folder's own
        assert card["multimax"]["parameters"]["lm_head"] is not None
        assert card["multimax"] == torch_card["multimax"]
        assert greedy(client) == greedy(on_torch)


def test_second_load_reuses_the_export_without_reading_the_weights(
        repo: Path, exported: Path, no_export: None, monkeypatch: pytest.MonkeyPatch) -> None:
    def unread(path: Path) -> str:
        raise AssertionError(f"{path} hashed again")
    monkeypatch.setattr(folder_export, "_sha256", unread)  # the files' digests come from file-hashes.json
    loaded, _ = load_models(settings(repo, exported, backend="onnxruntime"))
    entry = loaded[NAME][1]
    assert entry.backend.kind == "onnxruntime" and entry.details["served_from"]["reused"] is True
    assert entry.source == repo / NAME  # a model-control reload compares the folder's own files
    entry.backend.close()


def test_a_changed_weight_file_or_export_version_gives_a_new_key(repo: Path, tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    folder = tmp_path / NAME
    shutil.copytree(repo / NAME, folder)
    key, inputs = export_key(folder, tmp_path, NAME)
    assert set(inputs["files"]) >= {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"}
    (folder / "README.md").write_text("docs change nothing")
    assert export_key(folder, tmp_path, NAME)[0] == key
    weights = folder / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-1] ^= 1  # one bit of the last tensor
    weights.write_bytes(bytes(data))
    changed = export_key(folder, tmp_path, NAME)[0]
    assert changed != key
    monkeypatch.setattr(folder_export, "MANIFEST_FORMAT", folder_export.MANIFEST_FORMAT + 1)
    assert export_key(folder, tmp_path, NAME)[0] not in (key, changed)


def test_a_damaged_entry_or_a_crashed_export_is_never_used_and_is_made_again(
        repo: Path, exported: Path, tmp_path: Path, stand_in: list[Path]) -> None:
    cache = tmp_path / "cache"
    shutil.copytree(exported, cache)
    [entry] = entries(cache)
    with open(entry / "model.onnx", "r+b") as fh:  # a copy cut short
        fh.truncate(1000)
    crashed = cache / f".tmp-{entry.name}-crashed"
    (crashed / "export").mkdir(parents=True)
    (crashed / "export" / "model.onnx").write_bytes(b"half")
    made = cached_export(NAME, repo / NAME, settings(repo, cache))
    assert made is not None and made.made and made.folder == entry and stand_in == [repo / NAME]
    assert (entry / "model.onnx").stat().st_size > 1000 and not crashed.exists()
    assert not [p for p in cache.iterdir() if p.name.startswith(".tmp-") and p.is_dir()]
    # an entry without its manifest (renamed in by hand, half copied) is no export either
    (entry / MANIFEST).unlink()
    assert cached_export(NAME, repo / NAME, settings(repo, cache)).made  # type: ignore[union-attr]


def test_an_entry_onnxruntime_cannot_load_is_exported_again(repo: Path, exported: Path, tmp_path: Path,
                                                            stand_in: list[Path]) -> None:
    cache = tmp_path / "cache"
    shutil.copytree(exported, cache)
    [entry] = entries(cache)
    model = entry / "model.onnx"
    model.write_bytes(b"\0" * model.stat().st_size)  # same size, not a graph
    loaded, failed = load_models(settings(repo, cache))
    assert not failed and loaded[NAME][1].backend.kind == "onnxruntime" and len(stand_in) == 1
    loaded[NAME][1].backend.close()


def test_two_loads_at_once_export_once(repo: Path, tmp_path: Path, stand_in: list[Path]) -> None:
    """Three loads start together (the flock is per open file, so threads contend for it as processes do): one
    exports, in the stand-in's half second, the others wait for it and reuse its entry."""
    results: list[Any] = []
    config = settings(repo, tmp_path / "cache")
    together = threading.Barrier(3)

    def load() -> None:
        together.wait()
        results.append(cached_export(NAME, repo / NAME, config))
    threads = [threading.Thread(target=load) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert len(stand_in) == 1 and len(results) == 3
    assert len({r.folder for r in results}) == 1 and sorted(r.made for r in results) == [False, False, True]


# ---- a failed export: the folder is served on PyTorch, and the failure is kept --------------------------------


def test_a_failing_export_falls_back_to_pytorch_and_is_not_retried(
        repo: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    fail_with(monkeypatch, "import json, os, sys; os.makedirs(sys.argv[1]); open(os.path.join(sys.argv[1], "
                           "'validation.json'), 'w').write(json.dumps({'passed': False, 'verdict': 'FAILED', "
                           "'problems': ['greedy text differs from PyTorch']})); sys.exit(1)")
    cache = tmp_path / "cache"
    with TestClient(create_app(settings(repo, cache))) as client:
        card = client.get(f"/v1/models/{NAME}").json()
        assert card["backend"] == "torch" and card["served_from"] is None
        r = client.post("/v1/completions", json={"model": NAME, "prompt": "The", "max_tokens": 4})
        assert r.status_code == 200
    assert "greedy text differs from PyTorch" in caplog.text and "serving the folder on PyTorch" in caplog.text
    [marker] = cache.glob("*.failed.json")
    failure = json.loads(marker.read_text())
    assert failure["exit_code"] == 1 and "greedy text differs" in failure["reason"] and failure["source"] == NAME
    assert not entries(cache)
    caplog.clear()

    def refuse(*args: Any) -> Any:
        raise AssertionError("a recorded failure was tried again")
    monkeypatch.setattr(folder_export, "run_export", refuse)
    loaded, failed = load_models(settings(repo, cache))
    assert not failed and loaded[NAME][1].backend.kind == "torch"
    assert f"Delete {marker} to try again" in caplog.text


def test_an_export_killed_by_a_signal_is_not_recorded(repo: Path, tmp_path: Path,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    fail_with(monkeypatch, "import os, signal; os.kill(os.getpid(), signal.SIGKILL)")
    cache = tmp_path / "cache"
    assert cached_export(NAME, repo / NAME, settings(repo, cache)) is None
    assert not list(cache.glob("*.failed.json"))  # an out-of-memory kill or a ^C: tried again next time


SLEEPER = ("import os, subprocess, sys, time; out = sys.argv[1]; os.makedirs(out); "
           "kid = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(120)']); "
           "open(os.path.join(out, '..', 'pids'), 'w').write(f'{os.getpid()} {kid.pid}'); time.sleep(120)")


def _alive(pid: int) -> bool:
    """A process that exists and is not a zombie waiting for its parent."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(") ")[1][0] != "Z"
    except (OSError, IndexError):
        return False


def _pids(cache: Path) -> list[int]:
    for _ in range(200):
        found = list(cache.glob(".tmp-*/pids"))
        if found and found[0].read_text().strip():
            return [int(p) for p in found[0].read_text().split()]
        time.sleep(0.05)
    raise AssertionError("the stand-in export never started")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_an_export_past_its_limit_is_stopped_with_what_it_started_and_recorded(
        repo: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger=folder_export.__name__)
    fail_with(monkeypatch, SLEEPER)
    cache = tmp_path / "cache"
    seen: list[int] = []
    watcher = threading.Thread(target=lambda: seen.extend(_pids(cache)), daemon=True)
    watcher.start()
    start = time.monotonic()
    assert cached_export(NAME, repo / NAME, settings(repo, cache, folder_export_timeout_s=1.5)) is None
    assert time.monotonic() - start < 60  # not the stand-in's 120 s
    watcher.join(5)
    export, grandchild = seen
    # its whole process group went (SIGKILLed: a process on a busy machine may take a moment to be scheduled to die)
    for _ in range(100):
        if not _alive(export) and not _alive(grandchild):
            break
        time.sleep(0.05)
    assert not _alive(export) and not _alive(grandchild)
    [marker] = cache.glob("*.failed.json")
    failure = json.loads(marker.read_text())
    assert failure["timeout_s"] == 1.5 and "ran past its limit of 2 s" in failure["reason"]
    assert not list(cache.glob(".tmp-*")) and not entries(cache)
    assert "--folder-export-timeout-s" in failure["reason"]

    def refuse(*args: Any) -> Any:
        raise AssertionError("tried again")
    monkeypatch.setattr(folder_export, "run_export", refuse)
    assert cached_export(NAME, repo / NAME, settings(repo, cache, folder_export_timeout_s=1.0)) is None
    # a longer limit, or none, tries again
    calls: list[float | None] = []

    def interrupted(*args: Any) -> folder_export.ExportRun:
        calls.append(args[4])  # the limit (then the stop event)
        return folder_export.ExportRun(-2, None, 0.1)  # a ^C: not recorded, the marker stays
    monkeypatch.setattr(folder_export, "run_export", interrupted)
    for limit in (3.0, 0.0):
        assert cached_export(NAME, repo / NAME, settings(repo, cache, folder_export_timeout_s=limit)) is None
    assert calls == [3.0, None]
    assert "trying again with no limit" in caplog.text


def test_the_automatic_limit_grows_with_the_folder(repo: Path, tmp_path: Path) -> None:
    size = sum(p.stat().st_size for p in folder_export.content_files(repo / NAME))
    auto = folder_export.timeout_for(settings(repo, tmp_path), size)
    assert auto == pytest.approx(folder_export.TIMEOUT_FLOOR_S + size / 1e6 * folder_export.TIMEOUT_S_PER_MB)
    assert folder_export.timeout_for(settings(repo, tmp_path, folder_export_timeout_s=0.0), size) is None
    assert folder_export.timeout_for(settings(repo, tmp_path, folder_export_timeout_s=5.0), size) == 5.0


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="prctl(PR_SET_PDEATHSIG) is Linux's")
def test_an_export_dies_with_a_server_killed_by_sigkill(repo: Path, tmp_path: Path) -> None:
    """The server (here a Python process running run_export) killed with SIGKILL: its export does not run on."""
    cache = tmp_path / "cache"
    (cache / ".tmp-x").mkdir(parents=True)
    server = subprocess.Popen([sys.executable, "-c", f"""
import sys
from pathlib import Path
from service.base.config import Settings
from service.engine import folder_export
folder_export.export_command = lambda source, out, _: [sys.executable, "-c", {SLEEPER!r}, str(out)]
folder_export.run_export("x", Path({str(repo / NAME)!r}), Path({str(cache / ".tmp-x" / "export")!r}), Settings())
"""], cwd=Path(__file__).resolve().parents[3])
    started: list[int] = []
    try:
        started += _pids(cache)
        export = started[0]
        assert _alive(export)
        server.kill()
        server.wait()
        for _ in range(100):
            if not _alive(export):
                break
            time.sleep(0.05)
        assert not _alive(export)
    finally:
        server.kill()
        for pid in started:  # what is left (the grandchild, not in the kernel's care) is cleaned up here
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


def test_an_export_that_refuses_the_folder_is_recorded_with_its_error(repo: Path, tmp_path: Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    fail_with(monkeypatch, "import sys; print('error: unsupported rope scaling', file=sys.stderr); sys.exit(2)")
    cache = tmp_path / "cache"
    assert cached_export(NAME, repo / NAME, settings(repo, cache)) is None
    [marker] = cache.glob("*.failed.json")
    assert "error: unsupported rope scaling" in json.loads(marker.read_text())["reason"]


def test_an_unusable_cache_falls_back_to_pytorch(repo: Path, tmp_path: Path, no_export: None) -> None:
    blocked = tmp_path / "file"
    blocked.write_text("not a directory")
    loaded, failed = load_models(settings(repo, blocked / "cache"))
    assert not failed and loaded[NAME][1].backend.kind == "torch"


# ---- who asks for the folder itself ----------------------------------------------------------------------------


@pytest.mark.parametrize("changes", [{"backend": "torch"}, {"folder_export": "off"}], ids=["backend-torch", "off"])
def test_the_folder_itself_is_served_when_asked(repo: Path, tmp_path: Path, no_export: None,
                                                changes: dict[str, str]) -> None:
    loaded, failed = load_models(settings(repo, tmp_path / "cache", **changes))
    entry = loaded[NAME][1]
    assert not failed and entry.backend.kind == "torch" and entry.details["format"] == "huggingface-folder"
    assert not (tmp_path / "cache").exists()


def test_options_on_the_command_line_and_in_the_environment(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    s = load_settings(["--folder-export", "off", "--export-cache", str(tmp_path)], {})
    assert (s.folder_export, s.export_cache) == ("off", tmp_path)
    s = load_settings([], {"MULTIMAX_SERVE_FOLDER_EXPORT": "auto", "MULTIMAX_SERVE_EXPORT_CACHE": str(tmp_path)})
    assert (s.folder_export, s.export_cache) == ("auto", tmp_path)
    monkeypatch.delenv("MULTIMAX_SERVE_EXPORT_CACHE", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert Settings().export_cache == tmp_path / "xdg" / "multimax-serve" / "exports"
    with pytest.raises(SystemExit):
        load_settings(["--folder-export", "always"], {})
    assert load_settings([], {}).folder_export_timeout_s is None  # auto
    assert load_settings(["--folder-export-timeout-s", "0"], {}).folder_export_timeout_s == 0
    assert load_settings([], {"MULTIMAX_SERVE_FOLDER_EXPORT_TIMEOUT_S": "90.5"}).folder_export_timeout_s == 90.5
    assert load_settings(["--folder-export-timeout-s", "auto"], {}).folder_export_timeout_s is None
    for bad in ("-1", "soon", "nan", "inf"):
        with pytest.raises(SystemExit):
            load_settings(["--folder-export-timeout-s", bad], {})
