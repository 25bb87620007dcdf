"""The service on Ray Serve: replicas, autoscaling, one /metrics for the deployment (docs/DEPLOY.md).

    python -m service.ray --replicas 2                  # a local Ray cluster, started and stopped by the command
    serve run service.ray:build replicas=2              # Ray's own CLI, on a running cluster or a local one

Ray is imported only here (install with `pip install -e ".[ray]"`), and only when the application is built:
`--help` and option errors answer without it.
"""

from __future__ import annotations

from typing import Any


def __getattr__(name: str) -> Any:
    if name in ("build", "build_app"):
        from service.edge.ray import app

        return getattr(app, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
