"""The service on Ray Serve: replicas, autoscaling, one /metrics for the deployment (docs/DEPLOY.md).

    python -m service.ray --replicas 2                  # a local Ray cluster, started and stopped by the command
    serve run service.ray:build replicas=2              # Ray's own CLI, on a running cluster or a local one

Ray is imported only here (install with `pip install -e ".[ray]"`), and only when the application is built:
`--help` and option errors answer without it.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from service.base.config import Settings
from service.edge.ray.options import ScaleOptions


def build(args: Mapping[str, Any] | None = None) -> Any:
    """The application builder of `serve run service.ray:build` (service.edge.ray.app.build), Ray imported now."""
    from service.edge.ray import app

    return app.build(args)


def build_app(settings: Settings, scale: ScaleOptions) -> Any:
    """The application `python -m service.ray` runs (service.edge.ray.app.build_app), Ray imported now."""
    from service.edge.ray import app

    return app.build_app(settings, scale)
