"""The app's OpenAPI schema and its /docs and /redoc pages. In-process (FastAPI's TestClient or straight ASGI; no
network)."""

from __future__ import annotations

from fastapi.testclient import TestClient


def test_openapi_and_docs(service_client: TestClient) -> None:
    schema = service_client.get("/openapi.json").json()
    for path in ("/v1/models", "/v1/completions", "/v1/models/{name}/classify", "/v2/models/{name}/infer",
                 "/metrics", "/v2/health/ready"):
        assert path in schema["paths"], path
    assert service_client.get("/docs").status_code == 200
