"""Kept responses (`store`): the last MAX_STORED of them, within MAX_STORED_CHARS of conversation, in this
server process's memory (lost on restart; each replica has its own), for previous_response_id and GET."""

from __future__ import annotations

import json
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

from service.base.errors import ServiceError, shown

MAX_STORED = 1000  # responses kept for previous_response_id and GET
MAX_STORED_CHARS = 64 * 1024 * 1024  # their conversations (as JSON), together


@dataclass
class Kept:
    response: dict[str, Any]  # the response object, as answered
    conversation: list[dict[str, Any]]  # its input and output as chat messages, without its instructions
    chars: int


class ResponseStore:
    """The last responses answered with store on, for previous_response_id and GET: at most `max_responses`,
    their conversations (as JSON) within `max_chars` (least recently used first out)."""

    def __init__(self, max_responses: int = MAX_STORED, max_chars: int = MAX_STORED_CHARS) -> None:
        self.max_responses, self.max_chars = max_responses, max_chars
        self._kept: OrderedDict[str, Kept] = OrderedDict()
        self.chars = 0

    def __len__(self) -> int:
        return len(self._kept)

    def put(self, response: dict[str, Any], conversation: list[dict[str, Any]]) -> None:
        chars = len(json.dumps(conversation))
        if chars > self.max_chars:
            return
        self.delete(response["id"])
        self._kept[response["id"]] = Kept(response, conversation, chars)
        self.chars += chars
        while len(self._kept) > self.max_responses or self.chars > self.max_chars:
            _, old = self._kept.popitem(last=False)
            self.chars -= old.chars

    def get(self, response_id: str) -> Kept | None:
        kept = self._kept.get(response_id)
        if kept is not None:
            self._kept.move_to_end(response_id)
        return kept

    def delete(self, response_id: str) -> bool:
        kept = self._kept.pop(response_id, None)
        if kept is not None:
            self.chars -= kept.chars
        return kept is not None


def store_of(app: Any) -> ResponseStore:
    """The app's store of kept responses (service.edge.app.create_app makes it)."""
    store: ResponseStore = app.state.responses
    return store


def find(store: ResponseStore, response_id: str, param: str | None) -> Kept:
    kept = store.get(response_id)
    if kept is None:
        raise ServiceError(404, f"response {shown(response_id)} not found: this server keeps the last "
                                f"{store.max_responses} responses answered with store on, in its memory",
                           code="response_not_found", param=param)
    return kept
