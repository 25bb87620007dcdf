"""The service's /metrics cover requests, batches and generation. In-process (FastAPI's TestClient or straight ASGI; no
network)."""

from __future__ import annotations

from fastapi.testclient import TestClient

from tests.service.support import _classify, _complete


def test_metrics_cover_requests_batches_and_generation(service_client: TestClient) -> None:
    _complete(service_client, prompt="abc", max_tokens=4)
    _classify(service_client, b"not an image")
    r = service_client.get("/metrics")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    text = r.text
    for name in ("multimax_request_duration_seconds_bucket", "multimax_queue_seconds_bucket",
                 "multimax_compute_seconds_bucket", "multimax_batch_size_bucket", "multimax_pending_requests",
                 "multimax_time_to_first_token_seconds_bucket", "multimax_inter_token_latency_seconds_bucket",
                 "multimax_e2e_request_latency_seconds_bucket", "multimax_prompt_tokens_total",
                 "multimax_generation_tokens_total", "multimax_running_sequences", "multimax_waiting_sequences"):
        assert name in text, name
    assert 'multimax_requests_total{endpoint="classify",model="digits_multimax",outcome="invalid_input"}' in text
    assert 'multimax_requests_total{endpoint="completions",model="text_multimax",outcome="success"}' in text
    assert "server-timing" in r.headers
