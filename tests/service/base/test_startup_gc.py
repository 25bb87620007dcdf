"""After its start a server freezes what the start made (service.base.startup_gc): a full collection no longer
walks the loaded models, and the start's garbage is collected first, not frozen."""

from __future__ import annotations

import gc
import weakref
from collections.abc import Iterator
from typing import Any

import pytest

import service.__main__ as cli
from service.base.startup_gc import freeze_startup_objects


@pytest.fixture(autouse=True)
def unfrozen() -> Iterator[None]:
    gc.unfreeze()
    yield
    gc.unfreeze()  # the test process's objects go back to the collector


class Node:
    def __init__(self) -> None:
        self.other: Any = None


def test_live_objects_are_frozen_and_dead_cycles_collected_first() -> None:
    live = Node()
    dead_a, dead_b = Node(), Node()
    dead_a.other, dead_b.other = dead_b, dead_a  # a cycle only the collector frees
    gone = weakref.ref(dead_a)
    del dead_a, dead_b
    assert gone() is not None
    frozen = freeze_startup_objects()
    assert gone() is None  # collected, not frozen
    assert frozen == gc.get_freeze_count() > 0
    assert not any(o is live for o in gc.get_objects(2))  # out of the collector's generations
    garbage = Node()  # made after the freeze: collected as always
    garbage.other = garbage
    later = weakref.ref(garbage)
    del garbage
    gc.collect()
    assert later() is None


def test_the_cli_freezes_after_loading_the_models(monkeypatch: pytest.MonkeyPatch) -> None:
    seen: dict[str, int] = {}

    def create_app(settings: Any) -> object:
        seen["at_load"] = gc.get_freeze_count()
        return object()

    def serve(app: object, **kwargs: Any) -> None:
        seen["at_serve"] = gc.get_freeze_count()

    monkeypatch.setattr("service.edge.app.create_app", create_app)
    monkeypatch.setattr(cli.uvicorn, "run", serve)
    # the rest of main's process-wide settings stay as the test process has them
    monkeypatch.setattr(cli, "configure_logging", lambda *a: None)
    monkeypatch.setattr(cli, "raise_file_limit", lambda n: None)
    monkeypatch.setattr(cli.sys, "setswitchinterval", lambda s: None)
    assert cli.main(["--port", "8999"]) == 0
    assert seen["at_load"] == 0 and seen["at_serve"] > 0
