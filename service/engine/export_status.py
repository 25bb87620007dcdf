"""Which backend serves a Hugging Face folder now, and why (`ExportStatus`, on its entry): PyTorch while its export
runs in the background (service.engine.background_export) or after it failed, its onnxruntime-genai export once that
passed. The model's cards (`serving`) and `multimax_folder_export_state` read it."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from service.base.errors import without_paths

PENDING, RUNNING, PASSED, FAILED, OFF = "pending", "running", "passed", "failed", "off"
STATES = (PENDING, RUNNING, PASSED, FAILED, OFF)
PYTORCH, GENAI = "pytorch", "onnxruntime-genai"


def utc_now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


@dataclass
class ExportStatus:
    """One model version's export: its state, since when (UTC), why it failed or is off, and, while it is pending,
    what makes the exported entry (`make(stop)`: the entry loaded, validated and warmed up, or why not; set by
    service.engine.registry). Written by the export's thread, read by the cards: each field is one assignment."""

    state: str
    since: str = field(default_factory=utc_now)
    reason: str | None = None
    reused: bool = False  # PASSED: served from an export made before this load
    switched_after_s: float | None = None  # PASSED in the background: from the export's start to the switch
    make: Callable[[threading.Event], Any] | None = field(default=None, repr=False, compare=False)
    started: float = 0.0  # time.monotonic() of the export's start

    @classmethod
    def passed(cls, reused: bool) -> ExportStatus:
        return cls(PASSED, reused=reused)

    @classmethod
    def failed(cls, reason: str) -> ExportStatus:
        return cls(FAILED, reason=reason)

    def begin(self) -> None:
        self.started = time.monotonic()
        self.since, self.state = utc_now(), RUNNING

    def fail(self, reason: str) -> None:
        self.reason, self.since, self.state = reason, utc_now(), FAILED

    def switched(self) -> None:
        self.switched_after_s = round(time.monotonic() - self.started, 1)
        self.since, self.state = utc_now(), PASSED

    @property
    def backend(self) -> str:
        return GENAI if self.state == PASSED else PYTORCH

    def why(self) -> str:
        """One line: the backend serving now, and why."""
        if self.state == PASSED:
            return f"{GENAI}: export passed" + (" (made before this load, from the cache)" if self.reused else "")
        if self.state == RUNNING:
            return f"{PYTORCH}: export running since {self.since}"
        if self.state == PENDING:
            return f"{PYTORCH}: export starts with the server"
        if self.state == FAILED:
            return f"{PYTORCH}: export failed: {without_paths(self.reason or '')}"
        return f"{PYTORCH}: {self.reason or 'not exported'}"

    def card(self) -> dict[str, Any]:
        """The cards' `serving` field."""
        out: dict[str, Any] = {"backend": self.backend, "why": self.why(), "export": self.state, "since": self.since}
        if self.reason is not None:
            out["reason"] = without_paths(self.reason)  # an exporter's error line may name the folder
        if self.switched_after_s is not None:
            out["switched_after_s"] = self.switched_after_s
        return out
