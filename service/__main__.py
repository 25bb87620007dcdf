"""`python -m service`: serve every model of a directory (default: the shipped demo models) on uvicorn."""

from __future__ import annotations

import logging
import sys

import uvicorn

from service.config import load_settings
from service.registry import RegistryError
from service.slowclient import header_timeout_protocol


def main(argv: list[str] | None = None) -> int:
    settings = load_settings(argv)
    logging.basicConfig(level=settings.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from service.app import create_app

    try:
        app = create_app(settings)
    except RegistryError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    # uvicorn handles SIGINT/SIGTERM: it stops accepting, lets in-flight requests and streams finish (up to
    # graceful_timeout_s), then runs the app's lifespan shutdown, which drains the batchers and decode loops.
    uvicorn.run(app, host=settings.host, port=settings.port, log_level=settings.log_level,
                access_log=settings.access_log, timeout_graceful_shutdown=settings.graceful_timeout_s,
                http=header_timeout_protocol(settings.header_timeout_s))
    return 0


if __name__ == "__main__":
    sys.exit(main())
