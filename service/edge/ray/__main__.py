"""`python -m service.ray`: deploy the service on Ray Serve and keep it up until SIGTERM or Ctrl-C.

Without --address it starts a local Ray cluster in this process (and stops it on exit); with one it deploys
onto that cluster and deletes the application on exit. Either way the exit drains: Ray stops routing to the
replicas, lets in-flight requests and streams finish (up to --graceful-timeout-s), then each replica's
lifespan shutdown drains its batchers and decode loops.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading

from models.console import run
from service.base.config import Settings
from service.base.logs import configure_logging
from service.edge.ray.options import PROG, parse
from service.engine.registry import RegistryError, scan

log = logging.getLogger("service.edge.ray.__main__")  # its module (__name__ is "__main__" under -m)


def main(argv: list[str] | None = None) -> int:
    settings, scale = parse(argv)
    configure_logging(settings.log_format, settings.log_level)
    if scale.address is None:  # local cluster: the model directory is this machine's; check it before Ray starts
        try:
            found = scan(settings.model_dir)
            missing = [m for m in settings.models if m not in found]
            if not found or missing:
                raise RegistryError(f"no model {', '.join(missing)} in {settings.model_dir}" if missing
                                    else f"no model file in {settings.model_dir}")
        except RegistryError as exc:
            print(f"{PROG}: error: {exc}", file=sys.stderr)
            return 2

    if scale.address is None:
        for key, value in scale.ray_environment().items():
            os.environ.setdefault(key, value)  # an explicit environment wins
    elif scale.proxy != "python":
        log.warning("--proxy applies to a local cluster; %s uses the proxy its nodes were started with", scale.address)
    import ray
    from ray import serve

    from service.edge.ray.app import build_app

    try:
        ray.init(address=scale.address, namespace="multimax", log_to_driver=settings.log_level == "debug",
                 configure_logging=False)
    except Exception as exc:  # no cluster at --address, or a local one that cannot start
        print(f"{PROG}: error: cannot start or reach Ray ({scale.address or 'local'}): {exc}", file=sys.stderr)
        return 1
    # After ray.init, which installs its own fatal-signal handler for SIGTERM: ours drains instead.
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    try:
        serve.start(http_options={"host": settings.host, "port": settings.port, **tls_options(settings)})
        try:
            serve.run(build_app(settings, scale), name=scale.app_name, route_prefix="/", blocking=False)
        except Exception as exc:  # e.g. every replica failed to load its models
            print(f"{PROG}: error: deployment failed: {exc}", file=sys.stderr)
            return 1
        scheme = "https" if settings.ssl_certfile else "http"
        log.info("serving on %s://%s:%d (%s)", scheme, settings.host, settings.port,
                 f"{scale.min_replicas or 1}..{scale.max_replicas} replicas, autoscaling" if scale.autoscaling
                 else f"{scale.replicas or 1} replica(s)")
        print(f"ready: {scheme}://{settings.host}:{settings.port}", flush=True)
        stop.wait()
        log.info("stopping: draining in-flight requests (up to %g s)", settings.graceful_timeout_s)
        serve.delete(scale.app_name)  # blocks until the replicas drained and stopped
        log.info("stopped")
        return 0
    finally:
        if scale.address is None:
            serve.shutdown()
        ray.shutdown()


def tls_options(settings: Settings) -> dict[str, str]:
    """Ray Serve's proxy terminates TLS itself (HTTPOptions ssl_*), with the service's certificate options."""
    if not settings.ssl_certfile:
        return {}
    options = {"ssl_certfile": settings.ssl_certfile, "ssl_keyfile": settings.ssl_keyfile}
    if settings.ssl_keyfile_password:
        options["ssl_keyfile_password"] = settings.ssl_keyfile_password
    return options


if __name__ == "__main__":
    sys.exit(run(main))
