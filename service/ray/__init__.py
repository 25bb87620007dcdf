"""`service.ray`, the documented names (`python -m service.ray`, `serve run service.ray:build`), kept for the
package that moved to service.edge.ray (the edge layer)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from service.base.config import Settings
from service.edge import ray
from service.edge.ray.options import ScaleOptions


def build(args: Mapping[str, Any] | None = None) -> Any:
    """service.edge.ray's application builder (`serve run service.ray:build`); Ray is imported when it runs, so
    `--help` and option errors answer without Ray installed."""
    return ray.build(args)


def build_app(settings: Settings, scale: ScaleOptions) -> Any:
    return ray.build_app(settings, scale)
