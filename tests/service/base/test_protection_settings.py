"""Issue 27, hardening: a setting that would silently turn a protection off (a blank API key, CORS origin, limit of
zero) is refused at startup with exit 2, naming it."""

from __future__ import annotations

import subprocess
import sys

import pytest

from service.base.config import load_settings

BLANK_PROTECTIONS = [
    (["--api-key", ""], {}, "--api-key"),
    (["--api-key", " "], {}, "--api-key"),
    (["--api-key", " , "], {}, "--api-key"),
    ([], {"MULTIMAX_SERVE_API_KEY": ""}, "MULTIMAX_SERVE_API_KEY"),
    ([], {"MULTIMAX_SERVE_API_KEY": " , "}, "MULTIMAX_SERVE_API_KEY"),
    (["--api-key-file", " "], {}, "--api-key-file"),
    ([], {"MULTIMAX_SERVE_AUTH_HEALTH": ""}, "MULTIMAX_SERVE_AUTH_HEALTH"),
    (["--auth-metrics", " "], {}, "--auth-metrics"),
    (["--cors-allow-origins", ","], {}, "--cors-allow-origins"),
    ([], {"MULTIMAX_SERVE_CORS_ALLOW_METHODS": " "}, "MULTIMAX_SERVE_CORS_ALLOW_METHODS"),
    (["--cors-allow-headers", ""], {}, "--cors-allow-headers"),
    (["--ssl-certfile", ""], {}, "--ssl-certfile"),
    ([], {"MULTIMAX_SERVE_SSL_KEYFILE": " "}, "MULTIMAX_SERVE_SSL_KEYFILE"),
    ([], {"MULTIMAX_SERVE_SSL_KEYFILE_PASSWORD": ""}, "MULTIMAX_SERVE_SSL_KEYFILE_PASSWORD"),
]


@pytest.mark.parametrize(("argv", "env", "named"), BLANK_PROTECTIONS)
def test_a_blank_protection_option_exits_2_naming_it(argv: list[str], env: dict[str, str], named: str,
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        load_settings(argv, env)
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert named in err and "protection" in err and "Traceback" not in err


def test_a_blank_key_stops_the_real_server_before_it_binds() -> None:
    run = subprocess.run([sys.executable, "-m", "service", "--port", "1", "--api-key", " , "], capture_output=True,
                         text=True, timeout=60, env={"PATH": "/usr/bin:/bin", "MULTIMAX_SERVE_API_KEY": "ignored"})
    assert run.returncode == 2 and "--api-key" in run.stderr and "Traceback" not in run.stderr


@pytest.mark.parametrize("limit", ["--max-body-bytes", "--max-json-bytes", "--max-image-pixels",
                                   "--max-queue-size", "--max-images-per-request", "--header-timeout-s",
                                   "--body-timeout-s", "--request-timeout-s"])
def test_a_limit_of_zero_is_refused_not_unlimited(limit: str) -> None:
    with pytest.raises(SystemExit) as exc:
        load_settings([limit, "0"], {})
    assert exc.value.code == 2


def test_real_values_still_work() -> None:
    s = load_settings(["--api-key", "k1,k2", "--cors-allow-origins", "https://app.example"],
                      {"MULTIMAX_SERVE_AUTH_HEALTH": "true"})
    assert s.api_keys == ("k1", "k2") and s.auth_health and s.cors_allow_origins == ("https://app.example",)
