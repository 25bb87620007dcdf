"""The onnxruntime session options the server sets from its settings (service.engine.backends.onnxruntime)."""

from __future__ import annotations

import onnxruntime as ort
import pytest

from service.engine.backends.onnxruntime import set_spinning

KEYS = ("session.intra_op.allow_spinning", "session.inter_op.allow_spinning", "session.force_spinning_stop")


@pytest.mark.parametrize(("mode", "entries"), [("run", ("1", "1", "1")), ("always", ("1", "1", "0")),
                                               ("off", ("0", "0", "0"))])
def test_spinning_modes_set_onnxruntimes_entries(mode: str, entries: tuple[str, ...]) -> None:
    options = ort.SessionOptions()
    set_spinning(options, mode)
    assert tuple(options.get_session_config_entry(k) for k in KEYS) == entries
