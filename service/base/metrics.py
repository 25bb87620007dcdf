"""Prometheus metrics, one registry per app (so several apps in one process, as in tests, never clash).

Durations are histograms in seconds, labelled by model. docs/SERVICE.md says what each one measures.
"""

from __future__ import annotations

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest

# 0.25 ms .. 60 s: covers a tiny model's batch on CPU up to a long generation.
LATENCY_BUCKETS = (0.00025, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
                   30.0, 60.0)
TOKEN_BUCKETS = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.5)
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
OUTCOMES = ("success", "invalid_input", "rejected", "cancelled", "timeout", "error")
UNKNOWN_MODEL = "_unknown"  # requests for models that do not exist share one label: no unbounded cardinality


class Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        m = ("model",)
        self.request_duration = Histogram(
            "multimax_request_duration_seconds", "Time from a request's arrival to its complete response",
            ("model", "endpoint"), buckets=LATENCY_BUCKETS, registry=r)
        self.queue_time = Histogram(
            "multimax_queue_seconds", "Time a request waited before its model started computing on it",
            m, buckets=LATENCY_BUCKETS, registry=r)
        self.compute_time = Histogram(
            "multimax_compute_seconds", "Time of one model call (a classification batch, a prefill or decode step)",
            ("model", "kind"), buckets=LATENCY_BUCKETS, registry=r)
        self.batch_size = Histogram(
            "multimax_batch_size", "Rows in one model call", ("model", "kind"), buckets=BATCH_BUCKETS, registry=r)
        self.requests = Counter(
            "multimax_requests", "Finished requests by outcome", ("model", "endpoint", "outcome"), registry=r)
        self.pending = Gauge(
            "multimax_pending_requests", "Requests admitted to a model and not yet answered", m, registry=r)
        self.model_ready = Gauge(
            "multimax_model_ready", "1 if the model serves requests; 0 if it failed to load, its worker died or "
            "its recent model calls all failed (see POST /v2/repository/index for why)", m, registry=r)
        self.version_ready = Gauge(
            "multimax_model_version_ready", "1 for each loaded version of a model that serves requests (the "
            "latest one also serves the routes that name no version)", ("model", "version"), registry=r)
        # Hugging Face folders exported while they serve (service.engine.background_export)
        self.folder_export_state = Gauge(
            "multimax_folder_export_state", "A Hugging Face folder's export: 1 for the state it is in (pending, "
            "running, passed: the export serves, failed: PyTorch serves, see the card's serving.why; off), 0 for "
            "the others", ("model", "state"), registry=r)
        self.folder_exports = Counter(
            "multimax_folder_exports", "Background exports of Hugging Face folders that ended, by outcome (passed: "
            "switched to the export; failed: kept on PyTorch)", ("model", "outcome"), registry=r)
        self.folder_export_switch = Gauge(
            "multimax_folder_export_switch_seconds", "Seconds from a folder's background export starting to its "
            "export serving (export, load, validation and warm-up)", m, registry=r)
        # generation
        self.ttft = Histogram(
            "multimax_time_to_first_token_seconds", "Time from arrival to the first generated token",
            m, buckets=LATENCY_BUCKETS, registry=r)
        self.itl = Histogram(
            "multimax_inter_token_latency_seconds", "Time between consecutive tokens of one sequence",
            m, buckets=TOKEN_BUCKETS, registry=r)
        self.e2e = Histogram(
            "multimax_e2e_request_latency_seconds", "Time from arrival to the last token of a sequence",
            m, buckets=LATENCY_BUCKETS, registry=r)
        self.prompt_tokens = Counter(
            "multimax_prompt_tokens", "Prompt tokens prefilled", m, registry=r)
        self.prefix_cache_queries = Counter(
            "multimax_prefix_cache_queries", "Prompts looked up in the prefix cache", m, registry=r)
        self.prefix_cache_hits = Counter(
            "multimax_prefix_cache_hits", "Prompts whose start the prefix cache held", m, registry=r)
        self.prefix_cache_hit_tokens = Counter(
            "multimax_prefix_cache_hit_tokens", "Prompt tokens not prefilled: their cache came from the prefix cache",
            m, registry=r)
        self.prefix_cache_bytes = Gauge(
            "multimax_prefix_cache_bytes", "Bytes of KV cache held by the prefix cache", m, registry=r)
        self.generation_tokens = Counter(
            "multimax_generation_tokens", "Tokens generated", m, registry=r)
        self.running = Gauge(
            "multimax_running_sequences", "Sequences in the decode batch", m, registry=r)
        self.waiting = Gauge(
            "multimax_waiting_sequences", "Sequences waiting for a slot in the decode batch", m, registry=r)

    def init_model(self, model: str, endpoints: tuple[str, ...]) -> None:
        """Create every labelled series up front so dashboards show zeros instead of gaps."""
        for endpoint in endpoints:
            for outcome in OUTCOMES:
                self.requests.labels(model, endpoint, outcome)
        self.pending.labels(model)

    def render(self) -> tuple[bytes, str]:
        return generate_latest(self.registry), CONTENT_TYPE_LATEST
