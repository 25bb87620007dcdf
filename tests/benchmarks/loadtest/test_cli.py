"""benchmarks.loadtest against a small fake server (raw ASGI on uvicorn, in a thread,
tests/benchmarks/loadtest/fake_server.py): the command line and its output files (JSON, CSV, plots), bad arguments and
unreachable servers exit 2 with one line. No assertion depends on how fast this machine is: they count requests."""

from __future__ import annotations

import csv
import json
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks.loadtest import LoadConfig, run
from benchmarks.loadtest.cli import main
from benchmarks.loadtest.config import ConfigError
from benchmarks.loadtest.report import CSV_COLUMNS
from benchmarks.server import free_port
from tests.benchmarks.loadtest.fake_server import FakeServer
from tests.paths import ROOT

pytestmark = pytest.mark.timeout(120)


def test_cli_writes_json_csv_and_plots(fake: tuple[str, FakeServer], tmp_path: Path,
                                       capsys: pytest.CaptureFixture[str]) -> None:
    url, _ = fake
    out = tmp_path / "sweep"
    rc = main(["--url", url, "--model", "fake", "--sweep-concurrency", "1,2", "--requests", "15", "--quiet",
               "--slo-p99-ms", "5000", "--out", str(out), "--save-requests"])
    assert rc == 0
    text = capsys.readouterr().out
    assert "knee" in text and "SLO" in text
    data = json.loads((out / "results.json").read_text())
    assert [r["load"] for r in data["results"]] == [1.0, 2.0] and data["sweep"]["loads"] == [1.0, 2.0]
    assert data["results"][0]["latency_ms"]["p99.9"] > 0 and data["results"][0]["histogram"].startswith("HIST")
    rows = list(csv.DictReader((out / "results.csv").open()))
    assert list(rows[0]) == list(CSV_COLUMNS) and [r["Concurrency"] for r in rows] == ["1", "2"]
    assert int(rows[1]["Request Count"]) == 15 and int(rows[0]["p99 latency"]) > 0
    for png in ("latency_vs_throughput.png", "latency_histogram.png"):
        assert (out / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert len((out / "requests_1.csv").read_text().splitlines()) == 16
    single = tmp_path / "single"
    assert main(["--url", url, "--model", "fake", "--rate", "100", "--requests", "10", "--poisson", "--quiet",
                 "--out", str(single)]) == 0
    assert "latency" in capsys.readouterr().out
    assert json.loads((single / "results.json").read_text())["sweep"] is None


@pytest.mark.parametrize(("argv", "message"), [
    (["--requests", "5"], "exactly one of"),
    (["--concurrency", "2"], "refusing to run unbounded"),
    (["--concurrency", "2", "--rate", "5", "--requests", "5"], "exactly one of"),
    (["--rate", "-5", "--duration", "1"], "must be > 0"),
    (["--concurrency", "0", "--requests", "5"], "must be >= 1"),
    (["--sweep-rate", "10,5", "--requests", "5"], "strictly increasing"),
    (["--sweep-concurrency", "1,x", "--requests", "5"], "comma-separated"),
    (["--concurrency", "1", "--requests", "5", "--prompt-len", "9:3"], "LO:HI"),
    (["--concurrency", "1", "--requests", "5", "--url", "ftp://x"], "--url"),
    (["--concurrency", "1", "--requests", "5", "--workload", "nope"], "invalid choice"),
])
def test_bad_arguments_exit_2_with_one_line(argv: list[str], message: str,
                                            capsys: pytest.CaptureFixture[str]) -> None:
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1 and "Traceback" not in err


def test_unreachable_server_or_model_exits_2(fake: tuple[str, FakeServer], capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--url", f"http://127.0.0.1:{free_port()}", "--concurrency", "1", "--requests", "1"]) == 2
    assert "cannot reach" in capsys.readouterr().err
    assert main(["--url", fake[0], "--model", "missing", "--concurrency", "1", "--requests", "1", "--quiet"]) == 2
    assert "not served" in capsys.readouterr().err


def test_python_api_refuses_unbounded_runs() -> None:
    with pytest.raises(ConfigError, match="unbounded"):
        run(LoadConfig(concurrency=1))


def test_module_entry_point_exits_2_without_traceback() -> None:
    proc = subprocess.run([sys.executable, "-m", "benchmarks.loadtest", "--rate", "10"], cwd=ROOT,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2
    assert proc.stderr.strip().startswith("python -m benchmarks.loadtest: error:") and "Traceback" not in proc.stderr
