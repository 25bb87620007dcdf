"""Logging set-up: text lines or one JSON object per line (python-json-logger), each line carrying the request
id, model and endpoint of the request it is about (from service.base.context), uvicorn's own lines included."""

from __future__ import annotations

import logging
from typing import Any

from pythonjsonlogger.json import JsonFormatter

from service.base.context import current

TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s%(request_tag)s: %(message)s"
# python-json-logger adds every `extra=` field (status, duration_ms, ...) after these.
JSON_FIELDS = "%(levelname)s %(name)s %(message)s %(request_id)s %(model)s %(endpoint)s"
JSON_RENAMES = {"levelname": "level", "name": "logger"}


class RequestFields(logging.Filter):
    """Adds request_id, model and endpoint (None outside a request) and, for text, a ` [id]` tag."""

    def filter(self, record: logging.LogRecord) -> bool:
        ctx = current()
        fields = record.__dict__  # an explicit extra= wins over the context
        fields.setdefault("request_id", ctx.request_id if ctx else None)
        fields.setdefault("model", ctx.model if ctx else None)
        fields.setdefault("endpoint", ctx.endpoint if ctx else None)
        fields["request_tag"] = f" [{fields['request_id']}]" if fields["request_id"] else ""
        return True


def formatter(log_format: str) -> logging.Formatter:
    if log_format == "json":
        return JsonFormatter(JSON_FIELDS, rename_fields=JSON_RENAMES, timestamp="time",
                             reserved_attrs=[*_RESERVED, "request_tag", "color_message"])
    return logging.Formatter(TEXT_FORMAT)


_RESERVED = [*logging.LogRecord("", 0, "", 0, "", None, None).__dict__, "message", "asctime", "taskName"]


def configure_logging(log_format: str, level: str, stream: Any = None) -> logging.Handler:
    """One handler on the root logger, replacing any; uvicorn's loggers propagate to it (uvicorn is started
    with log_config=None, so it installs no handlers of its own)."""
    handler = logging.StreamHandler(stream)
    handler.setFormatter(formatter(log_format))
    handler.addFilter(RequestFields())
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(level.upper())
    for name in ("uvicorn", "uvicorn.error", "uvicorn.access"):
        logging.getLogger(name).handlers.clear()
        logging.getLogger(name).propagate = True
    return handler
