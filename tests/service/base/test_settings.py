"""The service's settings (service.base.config): environment and command line, bad values exit 2 with one line,
the help."""

from __future__ import annotations

import subprocess
import sys

import pytest

from models.demo import DEMO_DIR
from service.base.config import build_parser, load_settings
from tests.paths import ROOT


def test_settings_come_from_env_and_cli_with_cli_winning() -> None:
    env = {"MULTIMAX_SERVE_PORT": "9001", "MULTIMAX_SERVE_MAX_BATCH_SIZE": "4", "MULTIMAX_SERVE_MODELS": "a,b",
           "MULTIMAX_SERVE_TORCH_COMPILE": "yes"}
    s = load_settings([], env)
    assert (s.port, s.max_batch_size, s.models, s.torch_compile) == (9001, 4, ("a", "b"), True)
    assert load_settings(["--port", "9002"], env).port == 9002
    assert load_settings([], {}).model_dir == DEMO_DIR


@pytest.mark.parametrize("env", [{"MULTIMAX_SERVE_PORT": "x"}, {"MULTIMAX_SERVE_BACKEND": "tpu"},
                                 {"MULTIMAX_SERVE_MAX_BATCH_SIZE": "0"}, {"MULTIMAX_SERVE_STREAM_INTERVAL_MS": "-1"},
                                 {"MULTIMAX_SERVE_STREAM_INTERVAL_MS": "101"},
                                 {"MULTIMAX_SERVE_STREAM_INTERVAL_MS": "soon"},
                                 {"MULTIMAX_SERVE_STREAM_INTERVAL_MS": "nan"}])
def test_bad_settings_exit_2_with_one_line(env: dict[str, str], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        load_settings([], env)
    assert exc.value.code == 2
    assert "error:" in capsys.readouterr().err


def test_help_lists_every_option_with_its_environment_variable() -> None:
    text = build_parser().format_help()
    for option in ("--host", "--port", "--model-dir", "--backend", "--max-batch-size", "--max-queue-delay-ms",
                   "--max-queue-size", "--max-body-bytes", "--max-running-sequences", "--request-timeout-s"):
        assert option in text
    assert "MULTIMAX_SERVE_PORT" in text and "MULTIMAX_SERVE_MAX_BATCH_SIZE" in text


def test_cli_help_runs() -> None:
    out = subprocess.run([sys.executable, "-m", "service", "--help"], capture_output=True, text=True, cwd=ROOT,
                         timeout=60)
    assert out.returncode == 0 and "--max-queue-delay-ms" in out.stdout


@pytest.mark.parametrize(("value", "mode"), [("run", "run"), ("ALWAYS", "always"), ("off", "off"), ("true", "always"),
                                             ("1", "always"), ("false", "off"), ("no", "off")])
def test_ort_spinning_takes_its_modes_and_the_booleans_it_took_before(value: str, mode: str) -> None:
    assert load_settings(["--ort-spinning", value], {}).ort_spinning == mode
    assert load_settings([], {"MULTIMAX_SERVE_ORT_SPINNING": value}).ort_spinning == mode


def test_ort_spinning_refuses_anything_else(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        load_settings(["--ort-spinning", "sometimes"], {})
    assert exc.value.code == 2
    assert "sometimes" in capsys.readouterr().err


@pytest.mark.parametrize(("value", "ms"), [("auto", None), (" AUTO ", None), ("0", 0.0), ("20", 20.0), ("2.5", 2.5)])
def test_stream_interval_takes_milliseconds_or_auto(value: str, ms: float | None) -> None:
    assert load_settings(["--stream-interval-ms", value], {}).stream_interval_ms == ms
    assert load_settings([], {"MULTIMAX_SERVE_STREAM_INTERVAL_MS": value}).stream_interval_ms == ms
    assert load_settings([], {}).stream_interval_ms is None  # auto unless given
