"""The base layer: what every layer shares (settings, metrics, request context, logs, tracing, health, the
request-error vocabulary, the wire formats). It imports no other layer (tests/service/test_layers.py)."""
