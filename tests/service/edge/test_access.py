"""Access control (issue 14): API keys, CORS, TLS, and bad keys or hostile ids staying inside their own requests.
In-process through TestClient, plus one HTTPS server subprocess."""

from __future__ import annotations

import asyncio
import datetime
import io
import json
import logging
import socket
import ssl
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import uvicorn
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID
from fastapi.testclient import TestClient

from benchmarks.server import free_port, start, stop, wait_ready
from service.base.config import Settings, build_parser, load_settings
from service.edge.app import create_app
from tests.paths import ROOT
from tests.service.edge.support import MODEL, TEXT, png

KEY = "sk-test-0123456789abcdef"
OTHER_KEY = "sk-other-key-42"
AUTH = {"Authorization": f"Bearer {KEY}"}


@pytest.fixture(scope="module")
def keyed_client() -> Iterator[TestClient]:
    settings = Settings(api_key=(KEY, OTHER_KEY), access_log=True, cors_allow_origins=("https://app.example",))
    with TestClient(create_app(settings), raise_server_exceptions=False) as client:
        yield client


# ---- API keys -----------------------------------------------------------------------------------------------


def test_requests_without_a_valid_key_get_401_in_their_protocols_shape(keyed_client: TestClient) -> None:
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}, {"Authorization": "Basic " + KEY},
                    {"Authorization": f"Bearer {KEY}x"}, {"Authorization": f"Bearer {KEY[:-1]}"}):
        r = keyed_client.get("/v1/models", headers=headers)
        assert r.status_code == 401, headers
        assert r.headers["www-authenticate"].startswith("Bearer")
        error = r.json()["error"]
        assert error["code"] == "invalid_api_key" and error["type"] == "invalid_request_error"
        assert error["request_id"] == r.headers["x-request-id"]
        assert KEY not in r.text
        r = keyed_client.post(f"/v2/models/{MODEL}/infer", headers=headers, json={})
        assert r.status_code == 401 and isinstance(r.json()["error"], str) and "request_id" in r.json()
    r = keyed_client.get("/v1/models", headers={"Authorization": "Bearer wrong"})
    assert 'error="invalid_token"' in r.headers["www-authenticate"]


def test_the_openai_client_sends_its_key_and_sees_the_401(keyed_client: TestClient) -> None:
    import openai

    good = openai.OpenAI(base_url="http://testserver/v1", api_key=KEY, http_client=keyed_client, max_retries=0)
    done = good.completions.create(model=TEXT, prompt="ab", max_tokens=2)
    assert done.usage is not None and done.usage.completion_tokens == 2 and done._request_id
    bad = openai.OpenAI(base_url="http://testserver/v1", api_key="sk-wrong", http_client=keyed_client, max_retries=0)
    with pytest.raises(openai.AuthenticationError) as exc:
        bad.models.list()
    assert exc.value.code == "invalid_api_key" and exc.value.request_id
    assert isinstance(exc.value.body, dict) and exc.value.body["request_id"] == exc.value.request_id


def test_every_route_needs_the_key_except_the_open_ones(keyed_client: TestClient) -> None:
    protected = [("GET", "/v1/models"), ("GET", f"/v1/models/{MODEL}"), ("POST", "/v1/completions"),
                 ("POST", f"/v1/models/{MODEL}/classify"), ("GET", "/v2"), ("GET", f"/v2/models/{MODEL}"),
                 ("GET", f"/v2/models/{MODEL}/config"), ("POST", "/v2/repository/index"),
                 ("POST", "/v2/repository/models/x/load"), ("GET", "/no/such/route"), ("GET", "/metrics/"),
                 ("GET", "//metrics")]
    for method, path in protected:
        assert keyed_client.request(method, path).status_code == 401, path
    for path in ("/v2/health/live", "/v2/health/ready", f"/v2/models/{MODEL}/ready", "/metrics", "/openapi.json",
                 "/docs"):
        assert keyed_client.get(path).status_code == 200, path
    for key in (KEY, OTHER_KEY):  # every configured key works
        assert keyed_client.get("/v1/models", headers={"Authorization": f"bearer {key}"}).status_code == 200
    r = keyed_client.post("/v1/completions", headers=AUTH, json={"model": TEXT, "prompt": "ab", "max_tokens": 2})
    assert r.status_code == 200


def test_health_and_metrics_can_need_the_key_too() -> None:
    with TestClient(create_app(Settings(models=(MODEL,), api_key=(KEY,), auth_health=True,
                                        auth_metrics=True))) as client:
        for path in ("/v2/health/live", "/v2/health/ready", f"/v2/models/{MODEL}/ready", "/metrics"):
            assert client.get(path).status_code == 401, path
            assert client.get(path, headers=AUTH).status_code == 200, path


def test_keys_never_reach_the_logs(keyed_client: TestClient, log_lines: io.StringIO) -> None:
    keyed_client.get("/v1/models", headers=AUTH)
    keyed_client.get("/v1/models", headers={"Authorization": f"Bearer {KEY}-wrong"})
    keyed_client.get(f"/v1/models?api_key={KEY}", headers=AUTH)  # keys in a query string are not logged either
    logging.getLogger("service.test").info("settings %s", keyed_client.app.state.settings)  # type: ignore[attr-defined]
    server_lines = [x for x in log_lines.getvalue().splitlines() if not json.loads(x)["logger"].startswith("httpx")]
    text = "\n".join(server_lines)  # (the test's own HTTP client logs the URLs it asks for)
    assert text.count('"service.access"') == 3 and KEY not in text and OTHER_KEY not in text


def test_key_options_cli_env_and_file(tmp_path: Path) -> None:
    s = load_settings(["--api-key", "a1", "--api-key", "b2,c3"], {})
    assert s.api_keys == ("a1", "b2", "c3") and "a1" not in repr(s)
    keys = tmp_path / "keys"
    keys.write_text("# operators' keys\n\n  k-one  \nk-two\n# k-old\n")
    s = load_settings(["--api-key-file", str(keys)], {"MULTIMAX_SERVE_API_KEY": "e1,e2"})
    assert s.api_keys == ("e1", "e2", "k-one", "k-two")
    assert load_settings([], {"MULTIMAX_SERVE_API_KEY_FILE": str(keys)}).api_keys == ("k-one", "k-two")
    assert "a1" not in build_parser().format_help()


@pytest.mark.parametrize("content", [None, "", "# only a comment\n\n", "two words\n"])
def test_a_bad_key_file_stops_the_server_with_exit_2(tmp_path: Path, content: str | None,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "keys"
    if content is not None:
        path.write_text(content)
    with pytest.raises(SystemExit) as exc:
        load_settings(["--api-key-file", str(path)], {})
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "api_key_file" in err and "two words" not in err and "Traceback" not in err


# ---- CORS ---------------------------------------------------------------------------------------------------


def test_cors_is_off_by_default(open_client: TestClient) -> None:
    r = open_client.get("/v1/models", headers={"Origin": "https://app.example"})
    assert "access-control-allow-origin" not in r.headers


def test_cors_preflight_allowed_and_refused_origins(keyed_client: TestClient) -> None:
    preflight = {"Access-Control-Request-Method": "POST",
                 "Access-Control-Request-Headers": "authorization,content-type,x-request-id"}
    r = keyed_client.options("/v1/completions", headers={"Origin": "https://app.example", **preflight})
    assert r.status_code == 200  # no key needed: browsers send none with a preflight
    assert r.headers["access-control-allow-origin"] == "https://app.example"
    assert "POST" in r.headers["access-control-allow-methods"]
    assert "authorization" in r.headers["access-control-allow-headers"].lower()
    r = keyed_client.options("/v1/completions", headers={"Origin": "https://evil.example", **preflight})
    assert r.status_code == 400 and "access-control-allow-origin" not in r.headers
    r = keyed_client.get("/v1/models", headers={"Origin": "https://evil.example", **AUTH})
    assert r.status_code == 200 and "access-control-allow-origin" not in r.headers
    # An allowed page can read the answer, its 401s and the request id.
    r = keyed_client.get("/v1/models", headers={"Origin": "https://app.example"})
    assert r.status_code == 401 and r.headers["access-control-allow-origin"] == "https://app.example"
    assert "x-request-id" in r.headers["access-control-expose-headers"].lower()


def test_cors_credentials_with_any_origin_is_refused_at_start(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        load_settings(["--cors-allow-origins", "*", "--cors-allow-credentials", "true"], {})
    assert exc.value.code == 2


# ---- TLS ----------------------------------------------------------------------------------------------------


def self_signed(directory: Path, password: bytes | None = None) -> tuple[Path, Path]:
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "127.0.0.1")])
    now = datetime.datetime.now(datetime.timezone.utc)
    import ipaddress

    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
            .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
                           critical=False)
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .sign(key, hashes.SHA256()))
    cert_path, key_path = directory / "cert.pem", directory / "key.pem"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    encryption = (serialization.BestAvailableEncryption(password) if password
                  else serialization.NoEncryption())
    key_path.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                           encryption))
    return cert_path, key_path


def test_https_server_with_keys_and_json_logs(tmp_path: Path) -> None:
    """`python -m service` over TLS (a certificate made now, with an encrypted key), API keys from the
    environment, JSON logs: an HTTPS request verified against that certificate succeeds; plain HTTP does not;
    every log line is JSON and none holds the key."""
    cert, key = self_signed(tmp_path, b"pw-1234")
    env = {**__import__("os").environ, "MULTIMAX_SERVE_API_KEY": f"{KEY},{OTHER_KEY}",
           "MULTIMAX_SERVE_SSL_KEYFILE_PASSWORD": "pw-1234"}
    proc, url = start("--models", MODEL, "--log-format", "json", "--log-level", "info", "--access-log", "true",
                      "--ssl-certfile", str(cert), "--ssl-keyfile", str(key), env=env, ready_path=None)
    https = url.replace("http://", "https://")
    try:
        context = ssl.create_default_context(cafile=str(cert))
        with httpx.Client(verify=context, trust_env=False) as client:
            r = client.post(f"{https}/v1/models/{MODEL}/classify", content=png(),
                            headers={**AUTH, "content-type": "image/png", "X-Request-Id": "tls-1"})
            assert r.status_code == 200 and r.headers["x-request-id"] == "tls-1"
            assert client.get(f"{https}/v1/models").status_code == 401
        with httpx.Client(verify=True, trust_env=False) as client, pytest.raises(httpx.ConnectError):
            client.get(f"{https}/v2/health/live")  # the system's CAs do not know this certificate
        with httpx.Client(trust_env=False) as client, pytest.raises(httpx.HTTPError):
            client.get(f"{url}/v2/health/live")
    finally:
        stop(proc)
    out = proc.stdout.read() if proc.stdout else ""
    records = [json.loads(line) for line in out.splitlines() if line.strip()]
    assert any(r.get("request_id") == "tls-1" and r.get("status") == 200 for r in records)
    assert any(r["logger"].startswith("uvicorn") for r in records)  # uvicorn's own lines are JSON too
    assert KEY not in out and OTHER_KEY not in out and "pw-1234" not in out


@pytest.mark.parametrize("case", ["missing_cert", "missing_key", "only_cert", "garbage", "wrong_key",
                                  "wrong_password"])
def test_bad_tls_files_exit_2(tmp_path: Path, case: str, capsys: pytest.CaptureFixture[str]) -> None:
    cert, key = self_signed(tmp_path, b"right" if case == "wrong_password" else None)
    (tmp_path / "other").mkdir()
    _, other_key = self_signed(tmp_path / "other")
    args = {"missing_cert": ["--ssl-certfile", str(tmp_path / "nope.pem"), "--ssl-keyfile", str(key)],
            "missing_key": ["--ssl-certfile", str(cert), "--ssl-keyfile", str(tmp_path / "nope.pem")],
            "only_cert": ["--ssl-certfile", str(cert)],
            "garbage": ["--ssl-certfile", str(cert), "--ssl-keyfile", str(cert)],
            "wrong_key": ["--ssl-certfile", str(cert), "--ssl-keyfile", str(other_key)],
            "wrong_password": ["--ssl-certfile", str(cert), "--ssl-keyfile", str(key),
                               "--ssl-keyfile-password", "wrong"]}[case]
    with pytest.raises(SystemExit) as exc:
        load_settings(args, {})
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert ("ssl" in err.lower() or "certificate" in err) and "Traceback" not in err


def test_bad_tls_file_from_the_command_line_exits_2_before_binding(tmp_path: Path) -> None:
    r = subprocess.run([sys.executable, "-m", "service", "--ssl-certfile", str(tmp_path / "no.pem"),
                        "--ssl-keyfile", str(tmp_path / "no.key")], capture_output=True, text=True, timeout=60,
                       cwd=ROOT)
    assert r.returncode == 2 and "no such file" in r.stderr and "Traceback" not in r.stderr


# ---- isolation ----------------------------------------------------------------------------------------------


def _raw(port: int, request: bytes) -> bytes:
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        s.sendall(request)
        data = b""
        while chunk := s.recv(65536):
            data += chunk
        return data


def test_bad_keys_and_hostile_ids_stay_inside_their_requests() -> None:
    """Over a real socket: while good requests run, requests with a wrong key, a huge id, control characters or
    an attempted header injection get their 4xx (or a closed connection), and every good request succeeds."""
    app = create_app(Settings(models=(MODEL, TEXT), api_key=(KEY,)))
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{port}"
    try:
        wait_ready(url)
        image = png()
        hostile = [
            {"X-Request-Id": "x" * 100_000, **AUTH},
            {"X-Request-Id": "a\x01b", **AUTH},
            {"X-Request-Id": "ok", "Authorization": "Bearer wrong"},
            {"X-Request-Id": "ok"},
        ]

        async def run() -> tuple[list[int], list[int], list[bytes]]:
            async with httpx.AsyncClient(base_url=url, trust_env=False, timeout=30) as client:
                async def good(i: int) -> int:
                    r = await client.post(f"/v1/models/{MODEL}/classify", content=image,
                                          headers={**AUTH, "content-type": "image/png", "X-Request-Id": f"good-{i}"})
                    assert r.headers["x-request-id"] == f"good-{i}"
                    return r.status_code

                async def bad(headers: dict[str, str]) -> int:
                    try:
                        r = await client.post(f"/v1/models/{MODEL}/classify", content=image,
                                              headers={"content-type": "image/png", **headers})
                    except httpx.HTTPError:
                        return 0  # closed by the server's HTTP parser: fine, as long as others go on
                    return r.status_code

                injections = [
                    b"GET /v1/models HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer " + KEY.encode()
                    + b"\r\nX-Request-Id: a\r\nSet-Cookie: pwned=1\r\nConnection: close\r\n\r\n",
                    b"GET /v1/models HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer " + KEY.encode()
                    + b"\r\nX-Request-Id: a\rSet-Cookie: pwned=1\r\nConnection: close\r\n\r\n",
                ]
                raw = [asyncio.to_thread(_raw, port, req) for req in injections]
                results = await asyncio.gather(*(good(i) for i in range(12)), *(bad(h) for h in hostile), *raw)
                return list(results[:12]), list(results[12:12 + len(hostile)]), list(results[12 + len(hostile):])

        goods, bads, raws = asyncio.run(run())
        assert goods == [200] * 12
        assert bads[0] in (0, 400, 431) and bads[1:] == [400, 401, 401]  # (a 100 kB header: 400 from us, or the parser)
        # The first injection is just another header (X-Request-Id "a" is valid): no header is injected into the
        # response. The second (a bare CR) is refused by the HTTP parser or answered 400.
        first = raws[0].split(b"\r\n\r\n")[0]
        assert b"x-request-id: a\r\n" in first.lower() and b"set-cookie" not in first.lower()
        assert raws[1] == b"" or raws[1].startswith(b"HTTP/1.1 400")
        with httpx.Client(trust_env=False) as client:
            assert client.get(f"{url}/v1/models", headers=AUTH).status_code == 200
    finally:
        server.should_exit = True
        thread.join(timeout=30)
