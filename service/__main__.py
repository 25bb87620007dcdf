"""`python -m service`: serve every model of a directory (default: the shipped demo models) on uvicorn."""

from __future__ import annotations

import logging
import os
import sys

import uvicorn

from models.console import run
from service.base.config import load_settings
from service.base.logs import configure_logging
from service.base.startup_gc import freeze_startup_objects
from service.edge.slowclient import header_timeout_protocol
from service.engine.registry import RegistryError

SWITCH_INTERVAL_S = float(os.environ.get("MULTIMAX_SERVE_SWITCH_INTERVAL_S", "0.0005"))


def raise_file_limit(connections: int) -> None:
    """Let the process hold `connections` sockets and its model files: raise the soft open-file limit (often
    1,024) towards the hard one; a limit that cannot be raised is said once, not found out under load."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    # + the models, the log, and room for the sockets over the limit while they are refused (a flood)
    wanted = max(connections + 256, 4 * connections, 65536)
    if soft != resource.RLIM_INFINITY and soft < wanted:
        target = wanted if hard == resource.RLIM_INFINITY else min(wanted, hard)
        resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
        if target < connections + 256:
            logging.getLogger(__name__).warning("open-file limit %d is below --max-connections %d + 256: new "
                                                "connections may fail before the limit refuses them", target,
                                                connections)


def main(argv: list[str] | None = None) -> int:
    settings = load_settings(argv)
    configure_logging(settings.log_format, settings.log_level)
    from service.edge.app import create_app

    # The model threads need the GIL back between (and, for PyTorch, inside) their steps; with the default 5 ms
    # switch interval an event loop kept busy by a flood of requests (even ones refused with 429) makes every
    # decode step wait several intervals. A shorter interval bounds that wait (see the starvation benchmark).
    sys.setswitchinterval(SWITCH_INTERVAL_S)

    raise_file_limit(settings.max_connections)
    try:
        app = create_app(settings)
    except RegistryError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    freeze_startup_objects()  # the loaded models never walked by a full collection (service.base.startup_gc)
    # uvicorn handles SIGINT/SIGTERM: it stops accepting, lets in-flight requests and streams finish (up to
    # graceful_timeout_s), then runs the app's lifespan shutdown, which drains the batchers and decode loops.
    uvicorn.run(app, host=settings.host, port=settings.port, log_level=settings.log_level,
                # Logging is configured above (text or JSON, with request ids); the access log line comes from
                # service.edge.access, which knows the model, endpoint and durations uvicorn's does not.
                log_config=None, access_log=False,
                ssl_certfile=settings.ssl_certfile or None, ssl_keyfile=settings.ssl_keyfile or None,
                ssl_keyfile_password=settings.ssl_keyfile_password or None,
                # uvicorn annotates int, but takes any number of seconds (it is an asyncio timeout)
                timeout_graceful_shutdown=settings.graceful_timeout_s,  # type: ignore[arg-type]
                http=header_timeout_protocol(settings.header_timeout_s, settings.idle_timeout_s,
                                             settings.max_connections))
    return 0


if __name__ == "__main__":
    sys.exit(run(main))
