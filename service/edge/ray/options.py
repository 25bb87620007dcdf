"""The Ray Serve options: replicas or autoscaling, backpressure, resources per replica, cluster address.

They are added to the service's own parser (service.base.config), so `python -m service.ray` takes every option
of `python -m service` plus these, and `serve run service.ray:build key=value ...` takes the same names.
Nothing here imports Ray: the options parse and validate before a cluster starts.
"""

from __future__ import annotations

import argparse
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, fields
from typing import Any

from service.base.config import Settings, build_parser, load_settings

PROG = "python -m service.ray"
PROXIES = ("python", "haproxy")
RAY_OPTIONS = ("address", "proxy", "app_name", "replicas", "min_replicas", "max_replicas", "target_ongoing_requests",
               "max_ongoing_requests", "max_queued_requests", "retry_after_s", "replica_cpus", "replica_gpus",
               "health_check_period_s", "metrics_push_s")


@dataclass(frozen=True)
class ScaleOptions:
    """How the deployment runs on Ray; None means 'derived from the service's settings' (see `resolve`)."""

    address: str | None = None  # None: start a local Ray cluster in this process
    proxy: str = "python"  # local cluster: Ray Serve's Python proxy, or its HAProxy ingress (throughput-optimized)
    app_name: str = "multimax"
    replicas: int | None = None  # fixed count; None with neither min nor max given: 1
    min_replicas: int | None = None  # autoscaling when min or max is given
    max_replicas: int | None = None
    target_ongoing_requests: float | None = None
    max_ongoing_requests: int | None = None
    max_queued_requests: int | None = None
    retry_after_s: float = 1.0
    replica_cpus: float = 1.0
    replica_gpus: float = 0.0
    health_check_period_s: float = 10.0
    metrics_push_s: float = 1.0

    def __post_init__(self) -> None:
        if self.proxy not in PROXIES:
            raise ValueError(f"proxy must be one of {', '.join(PROXIES)}, got {self.proxy!r}")
        if self.replicas is not None and (self.min_replicas is not None or self.max_replicas is not None):
            raise ValueError("give either --replicas (a fixed count) or --min-replicas/--max-replicas (autoscaling)")
        values = vars(self)  # the fields by name
        for name in ("replicas", "max_replicas", "max_ongoing_requests"):
            if values[name] is not None and values[name] < 1:
                raise ValueError(f"{name} must be at least 1, got {values[name]}")
        if self.min_replicas is not None and self.min_replicas < 0:
            raise ValueError(f"min_replicas must not be negative, got {self.min_replicas}")
        if self.min_replicas is not None and self.max_replicas is not None and self.min_replicas > self.max_replicas:
            raise ValueError(f"min_replicas {self.min_replicas} exceeds max_replicas {self.max_replicas}")
        if self.max_queued_requests is not None and self.max_queued_requests < 0:
            raise ValueError(f"max_queued_requests must not be negative, got {self.max_queued_requests}")
        for name in ("target_ongoing_requests", "health_check_period_s", "metrics_push_s"):
            if values[name] is not None and values[name] <= 0:
                raise ValueError(f"{name} must be positive, got {values[name]}")
        for name in ("retry_after_s", "replica_cpus", "replica_gpus"):
            if values[name] < 0:
                raise ValueError(f"{name} must not be negative, got {values[name]}")

    @property
    def autoscaling(self) -> bool:
        return self.min_replicas is not None or self.max_replicas is not None

    def max_ongoing(self, settings: Settings) -> int:
        """Requests one replica takes at once. Enough for its batcher to fill a batch and its decode loop to
        fill its slots with as many waiting behind them; beyond that, requests wait in Ray's router queue."""
        if self.max_ongoing_requests is not None:
            return self.max_ongoing_requests
        return 2 * max(settings.max_batch_size, settings.max_running_sequences)

    def max_queued(self, settings: Settings) -> int:
        """Requests each proxy (or handle) holds for this deployment while every replica is at max_ongoing;
        more get 429 with Retry-After at once instead of waiting in an unbounded queue."""
        if self.max_queued_requests is not None:
            return self.max_queued_requests
        return 2 * self.max_ongoing(settings)

    def ray_environment(self) -> dict[str, str]:
        """Environment a local cluster needs before Ray is imported (Ray reads these flags at import)."""
        if self.proxy == "haproxy":
            return {"RAY_SERVE_ENABLE_HA_PROXY": "1", "RAY_SERVE_THROUGHPUT_OPTIMIZED": "1"}
        return {"RAY_SERVE_ENABLE_HA_PROXY": "0", "RAY_SERVE_THROUGHPUT_OPTIMIZED": "0"}

    def deployment_options(self, settings: Settings) -> dict[str, Any]:
        """Keyword arguments of `Deployment.options` for the service's replicas."""
        from ray.serve.config import AutoscalingConfig, BackpressureConfig

        max_ongoing = self.max_ongoing(settings)
        options: dict[str, Any] = {
            "max_ongoing_requests": max_ongoing,
            "max_queued_requests": self.max_queued(settings),
            "backpressure_config": BackpressureConfig(status_code=429, retry_after_s=self.retry_after_s),
            # Ray waits this long for in-flight requests (streams included) to finish before stopping a replica;
            # the app's lifespan shutdown (batchers and decode loops drain) runs after.
            "graceful_shutdown_timeout_s": settings.graceful_timeout_s,
            "graceful_shutdown_wait_loop_s": 0.5,
            "health_check_period_s": self.health_check_period_s,
            "health_check_timeout_s": max(10.0, 3 * self.health_check_period_s),
            "ray_actor_options": {"num_cpus": self.replica_cpus, "num_gpus": self.replica_gpus},
        }
        if self.autoscaling:
            lo = self.min_replicas if self.min_replicas is not None else 1
            hi = self.max_replicas if self.max_replicas is not None else max(lo, 1)
            target = self.target_ongoing_requests or max(1.0, max_ongoing / 2)
            options["autoscaling_config"] = AutoscalingConfig(
                min_replicas=lo, max_replicas=hi, initial_replicas=max(lo, 1), target_ongoing_requests=target)
        else:
            options["num_replicas"] = self.replicas or 1
        return options


def build_ray_parser() -> argparse.ArgumentParser:
    """`python -m service`'s parser with a Ray Serve group added."""
    parser = build_parser()
    parser.prog = PROG
    parser.description = ("Serve every model in a directory on Ray Serve: the same endpoints and options as "
                          "`python -m service`, on replicas behind Ray's HTTP proxy (--host/--port are the proxy's).")
    d = ScaleOptions()
    g = parser.add_argument_group("Ray Serve")
    g.add_argument("--address", default=None, help="Ray cluster to deploy on (e.g. auto, ray://head:10001); "
                   "default: start a local cluster in this process and stop it on exit")
    g.add_argument("--proxy", choices=PROXIES, default=d.proxy,
                   help="ingress of a local cluster: python (Ray's proxy actor) or haproxy (Ray's HAProxy ingress "
                   "and throughput-optimized mode: RAY_SERVE_ENABLE_HA_PROXY=1 RAY_SERVE_THROUGHPUT_OPTIMIZED=1; "
                   "faster, but a request can fail when a replica crashes, see docs/DEPLOY.md); on an existing "
                   "cluster the environment its nodes were started with decides (default %(default)s)")
    g.add_argument("--app-name", default=d.app_name, help="Serve application name (default %(default)s)")
    g.add_argument("--replicas", type=int, metavar="N", help="fixed number of replicas (default 1)")
    g.add_argument("--min-replicas", type=int, metavar="N", help="autoscaling: fewest replicas (0 allowed)")
    g.add_argument("--max-replicas", type=int, metavar="N", help="autoscaling: most replicas")
    g.add_argument("--target-ongoing-requests", type=float, metavar="N",
                   help="autoscaling: ongoing requests per replica to aim for (default: half of max-ongoing)")
    g.add_argument("--max-ongoing-requests", type=int, metavar="N",
                   help="requests one replica takes at once (default: 2 x max(max-batch-size, max-running-sequences))")
    g.add_argument("--max-queued-requests", type=int, metavar="N",
                   help="requests each proxy queues when every replica is full; more get 429 (default: 2 x "
                   "max-ongoing)")
    g.add_argument("--retry-after-s", type=float, default=d.retry_after_s, metavar="S",
                   help="Retry-After of the proxy's 429 (default %(default)s)")
    g.add_argument("--replica-cpus", type=float, default=d.replica_cpus, metavar="N",
                   help="CPUs Ray reserves per replica (default %(default)s)")
    g.add_argument("--replica-gpus", type=float, default=d.replica_gpus, metavar="N",
                   help="GPUs per replica, e.g. 1 for the CUDA/TensorRT backends (default %(default)s)")
    g.add_argument("--health-check-period-s", type=float, default=d.health_check_period_s, metavar="S",
                   help="how often Ray checks each replica's models (default %(default)s)")
    g.add_argument("--metrics-push-s", type=float, default=d.metrics_push_s, metavar="S",
                   help="how often each replica sends its metrics to the deployment's /metrics (default %(default)s)")
    return parser


def parse(argv: Sequence[str] | None = None,
          parser: argparse.ArgumentParser | None = None) -> tuple[Settings, ScaleOptions]:
    """Service settings (command line, then MULTIMAX_SERVE_* environment, then defaults) and Ray options;
    exits 2 with one line on a bad value."""
    parser = parser or build_ray_parser()
    settings = load_settings(argv, parser=parser)
    if settings.model_control != "none":  # each replica would load on its own, behind a proxy that picks one
        parser.error("--model-control explicit is for python -m service; under Ray Serve, change models by "
                     "redeploying (serve deploy / serve run with the new model directory)")
    args = parser.parse_args(argv)
    try:
        given = vars(args)  # the parsed options by name
        scale = ScaleOptions(**{name: given[name] for name in RAY_OPTIONS})
    except ValueError as exc:
        parser.error(str(exc))
    return settings, scale


def argv_from_mapping(args: Mapping[str, Any]) -> list[str]:
    """`serve run service.ray:build model_dir=x replicas=2` (or a config file's `args:`) as command-line
    arguments; keys use underscores or dashes, values are strings or YAML scalars."""
    argv: list[str] = []
    for key, value in args.items():
        text = ",".join(map(str, value)) if isinstance(value, list | tuple) else str(value)
        argv += ["--" + str(key).replace("_", "-"), text]
    return argv


assert set(RAY_OPTIONS) == {f.name for f in fields(ScaleOptions)}
