"""The Ray Serve application: the service's replicas plus the metrics hub they report to.

`build_app(settings, scale)` is what `python -m service.ray` runs; `build(args)` is the application builder
for Ray's own tools:

    serve run service.ray:build replicas=2 model_dir=models/demo
    serve deploy config.yaml          # import_path: service.ray:build, args: {replicas: 2, ...}
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, cast

from ray import serve
from ray.serve import Application, Deployment

from service.base.config import Settings
from service.edge.ray.metrics import MetricsHub
from service.edge.ray.options import ScaleOptions, argv_from_mapping, build_ray_parser, parse
from service.edge.ray.replica import ServiceIngress

SERVICE_DEPLOYMENT = "MultimaxService"
HUB_DEPLOYMENT = "MultimaxMetrics"


def build_app(settings: Settings, scale: ScaleOptions) -> Application:
    # (mypy resolves serve.deployment's overloads to the decorator form; these calls are the class form)
    hub = cast(Deployment, serve.deployment(MetricsHub, name=HUB_DEPLOYMENT, num_replicas=1,
                                            ray_actor_options={"num_cpus": 0}, max_ongoing_requests=1000,
                                            logging_config={"enable_access_log": False}))
    service = cast(Deployment, serve.deployment(ServiceIngress, name=SERVICE_DEPLOYMENT,
                                                **scale.deployment_options(settings),
                                                logging_config={"enable_access_log": settings.access_log,
                                                                "log_level": settings.log_level.upper(),
                                                                "encoding": settings.log_format.upper()}))
    return service.bind(settings, hub.bind(expire_s=max(15.0, 10 * scale.metrics_push_s)), scale.metrics_push_s)


def build(args: Mapping[str, Any] | None = None) -> Application:
    """Application builder: `args` are the options of `python -m service.ray` by name (model_dir, replicas,
    max_batch_size, ...); MULTIMAX_SERVE_* environment variables fill in the service options not given."""
    parser = build_ray_parser()
    try:
        settings, scale = parse(argv_from_mapping(args or {}), parser)
    except SystemExit as exc:  # argparse already printed the one-line reason
        raise ValueError(f"bad arguments for service.ray:build: {dict(args or {})}") from exc
    return build_app(settings, scale)
