"""`service.ray`, the documented names (`python -m service.ray`, `serve run service.ray:build`), kept for the
package that moved to service.edge.ray (the edge layer)."""

from __future__ import annotations

from typing import Any


def __getattr__(name: str) -> Any:
    # lazily, as service.edge.ray does: `--help` and option errors answer without Ray installed
    from service.edge import ray

    return getattr(ray, name)
