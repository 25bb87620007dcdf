"""Class names for a vision model from a file (`--labels FILE` of `python -m models init` and `python -m export`).

Three formats, told apart by the first character: one label a line; a JSON list of strings; or an ImageNet
class index, the JSON object `{"0": ["n01440764", "tench"], ...}` that Keras and torchvision publish (an
object of `"index": "name"` is read too). The count must equal the model's classes: a list one short would
label every class after the gap wrongly. Every failure is a `CheckpointError` with one line.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from models.loading import CheckpointError


def index_labels(num_classes: int) -> list[str]:
    """The names a model without labels is served with: its class indices."""
    return [str(i) for i in range(num_classes)]


def read_labels(path: str | os.PathLike[str], num_classes: int | None = None) -> list[str]:
    """The labels in `path`, checked against `num_classes` when given."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise CheckpointError(f"--labels {path}: no such file") from None
    except IsADirectoryError:
        raise CheckpointError(f"--labels {path}: is a directory, not a labels file") from None
    except UnicodeDecodeError:
        raise CheckpointError(f"--labels {path}: not UTF-8 text") from None
    except OSError as exc:
        raise CheckpointError(f"--labels {path}: cannot read: {exc.strerror or exc}") from None
    body = text.lstrip("\ufeff").strip()
    if not body:
        raise CheckpointError(f"--labels {path}: empty file")
    labels = _from_json(path, body) if body[0] in "[{" else _from_lines(path, body)
    if num_classes is not None and len(labels) != num_classes:
        raise CheckpointError(f"--labels {path}: {len(labels)} labels for a model of {num_classes} classes")
    return labels


def _from_lines(path: Path, body: str) -> list[str]:
    labels = [line.strip() for line in body.splitlines()]
    if "" in labels:
        # A blank line inside the list would silently shift every later class by one.
        raise CheckpointError(f"--labels {path}: line {labels.index('') + 1} is blank; one label a line, none empty")
    return labels


def _from_json(path: Path, body: str) -> list[str]:
    try:
        data = json.loads(body)
    except json.JSONDecodeError as exc:
        raise CheckpointError(f"--labels {path}: invalid JSON ({exc.msg} at line {exc.lineno})") from None
    if isinstance(data, list):
        return [_name(path, f"entry {i}", item, allow_pair=False) for i, item in enumerate(data)]
    assert isinstance(data, dict)  # the body starts with "{"
    indices: dict[int, str] = {}
    for key, value in data.items():
        if not (isinstance(key, str) and key.isascii() and key.isdigit()):
            raise CheckpointError(f"--labels {path}: key {key!r} is not a class index; expected "
                                  '{"0": ["n01440764", "tench"], ...}')
        indices[int(key)] = _name(path, f"class {key}", value, allow_pair=True)
    missing = sorted(set(range(len(indices))) - set(indices))
    if missing:
        raise CheckpointError(f"--labels {path}: class indices must be 0-{len(indices) - 1}; {missing[0]} is missing")
    return [indices[i] for i in range(len(indices))]


def _name(path: Path, where: str, value: Any, allow_pair: bool) -> str:
    """A label: a non-empty string, or (in a class index) the name of a [wordnet id, name] pair."""
    if allow_pair and isinstance(value, list) and len(value) == 2 and all(isinstance(v, str) for v in value):
        value = value[1]
    if not isinstance(value, str) or not value.strip():
        shape = '["n01440764", "tench"] or "tench"' if allow_pair else "a non-empty string"
        raise CheckpointError(f"--labels {path}: {where} is {json.dumps(value)[:60]}; expected {shape}")
    return value.strip()
