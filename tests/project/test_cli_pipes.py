"""Every command that prints ends quietly when its output pipe closes early (`python -m models info --json X |
head -1`): no BrokenPipeError traceback on stderr. Each `__main__.py` runs its `main` through `models.console.run`
(the Python documentation's recipe: stdout to devnull, exit 1).

The commands' outputs are small and written in one go at the end, so a reader that closes after the first line
has usually received everything already and nothing fails; `| head -1` breaks only when the rest comes later.
The tests make that case certain: the command's stdout is a pipe whose reader is gone before it writes.
"""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks.server import free_port, start, stop
from models.console import BROKEN_PIPE_EXIT, run
from models.demo import DEMO_DIR, VISION_MULTIMAX
from tests.paths import ROOT

# every package whose __main__.py files are entry points the project documents
ENTRY_PACKAGES = ("models", "export", "plugins", "service", "benchmarks/loadtest")


def run_into_closed_pipe(args: list[str], cwd: Path = ROOT) -> subprocess.CompletedProcess[str]:
    """`python -m ARGS` with stdout a pipe nobody reads any more (as `| head -1` leaves it after one line)."""
    read, write = os.pipe()
    os.close(read)
    try:
        return subprocess.run([sys.executable, "-m", *args], stdout=write, stderr=subprocess.PIPE, text=True,
                              cwd=cwd, timeout=300)
    finally:
        os.close(write)


def assert_quiet(done: subprocess.CompletedProcess[str]) -> None:
    assert "Traceback" not in done.stderr and "Error" not in done.stderr, done.stderr[-3000:]
    assert done.returncode == BROKEN_PIPE_EXIT, (done.returncode, done.stderr[-3000:])


@pytest.mark.parametrize("args", [
    ["models", "info", "--json", str(DEMO_DIR / VISION_MULTIMAX)],
    ["plugins.ort_ops", "--json"],  # prints its JSON whether or not the library is available
], ids=["models info", "plugins.ort_ops"])
def test_a_closed_pipe_ends_the_command_quietly(args: list[str]) -> None:
    assert_quiet(run_into_closed_pipe(args))


def test_export_ends_quietly_into_a_closed_pipe(tmp_path: Path) -> None:
    """The export writes its files, then its summary into the closed pipe (and flushes before its fast exit)."""
    done = run_into_closed_pipe(["export", str(DEMO_DIR / VISION_MULTIMAX), "-o", str(tmp_path / "d.onnx"),
                                 "--no-validate", "--quiet"], cwd=tmp_path)
    assert_quiet(done)
    assert (tmp_path / "d.onnx").is_file() and (tmp_path / "d.validation.json").is_file()


def test_the_load_tester_ends_quietly_into_a_closed_pipe() -> None:
    """From the checkout, where the tools run (benchmarks/ is not installed)."""
    port = free_port()
    server, url = start(command=[sys.executable, "-m", "benchmarks.loadtest.trivial_server", "--duration", "60"],
                        port=port, ready_path=None, ready_timeout=30)
    try:
        done = run_into_closed_pipe(["benchmarks.loadtest", "--url", url, "--requests", "5", "--concurrency", "1",
                                     "--quiet", "--no-metrics"])
    finally:
        stop(server)
    assert_quiet(done)


def test_a_real_head_pipeline_prints_the_first_line_and_nothing_on_stderr(tmp_path: Path) -> None:
    """The documented pipeline as a shell runs it."""
    cmd = f"{sys.executable} -m models info --json {DEMO_DIR / VISION_MULTIMAX} | head -1"
    done = subprocess.run(["sh", "-c", cmd], capture_output=True, text=True, cwd=tmp_path, timeout=300)
    assert done.stdout == "{\n" and done.stderr == "", done.stderr[-3000:]


def test_run_passes_exit_codes_through_and_flushes(capsys: pytest.CaptureFixture[str]) -> None:
    def prints() -> int:
        print("hello")
        return 3

    assert run(prints) == 3 and capsys.readouterr().out == "hello\n"
    assert run(lambda: None) == 0
    with pytest.raises(SystemExit):  # argparse's exits pass through
        run(lambda: sys.exit(2))


def _main_files() -> list[Path]:
    return sorted(p for package in ENTRY_PACKAGES for p in (ROOT / package).rglob("__main__.py"))


@pytest.mark.parametrize("path", _main_files(), ids=lambda p: str(p.relative_to(ROOT)))
def test_every_entry_point_runs_its_main_through_the_helper(path: Path) -> None:
    """Also the ones a test cannot cheaply make print (the server's, Ray's `ready:` line, the trainers')."""
    tree = ast.parse(path.read_text())
    imports_run = any(isinstance(node, ast.ImportFrom) and node.module == "models.console"
                      and any(alias.name == "run" for alias in node.names) for node in ast.walk(tree))
    calls = [(node.func.id, [a.id for a in node.args if isinstance(a, ast.Name)]) for node in ast.walk(tree)
             if isinstance(node, ast.Call) and isinstance(node.func, ast.Name)]
    bare_main = [name for name, _ in calls if name == "main"]
    through_run = [name for name, args in calls if name == "run" and args[:1] == ["main"]]
    assert imports_run and through_run and not bare_main, f"{path}: call main through models.console.run"
