"""The running batch: its rows, their KV cache and attention mask, kept together (join, keep, select, reserve).

The mask is numpy and right-aligned (service.engine.backends.cache_ops); the cache is in the backend's array type
and moved by the operations the backend declares (`TextBackend.cache`), so nothing here asks what type it is.
"""

from __future__ import annotations

import numpy as np

from service.engine.backends.base import CachedDecoder, Past
from service.engine.text.sequence import Row


def _empty_mask() -> np.ndarray:
    return np.zeros((0, 0), np.int64)


class Batch:
    def __init__(self, backend: CachedDecoder, context_length: int) -> None:
        self.backend = backend
        self.context_length = context_length
        self.rows: list[Row] = []
        self.past: Past = []
        self.mask = _empty_mask()

    def __len__(self) -> int:
        return len(self.rows)

    @property
    def live(self) -> bool:
        return any(r.live for r in self.rows)

    def keep(self, keep: list[int]) -> None:
        """Only these rows stay (their cache rows and mask with them, in the order the cache's remove_rows leaves
        them; the columns that became padding for all of them trimmed)."""
        if len(keep) == len(self.rows):
            return
        if keep:
            self.past, self.mask, order = self.backend.cache.remove_rows(self.past, self.mask, keep)
            self.rows = [self.rows[i] for i in order]
        else:
            self.rows, self.past, self.mask = [], [], _empty_mask()

    def keep_live(self) -> None:
        self.keep([i for i, r in enumerate(self.rows) if r.live])

    def join(self, rows: list[Row], past: Past, mask: np.ndarray, source: list[int]) -> None:
        """Prefilled rows join: row i's cache is row source[i] of `past` (choices of one prompt share its row)."""
        cache = self.backend.cache
        if source != list(range(len(source))):  # a group's row copied to each of its choices
            past, mask = [(cache.take_rows(k, source), cache.take_rows(v, source)) for k, v in past], mask[source]
        if self.rows:
            self.past, self.mask = cache.merge(self.past, self.mask, past, mask)
        else:
            self.past, self.mask = past, mask
        self.rows.extend(rows)
        self.reserve()

    def decode_inputs(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """A decode step's ids (each row's last token), mask (one more column) and positions."""
        ids = np.array([[r.last] for r in self.rows], np.int64)
        positions = self.mask.sum(axis=1, keepdims=True)  # real tokens so far = the new token's position
        mask = np.concatenate([self.mask, np.ones((len(self.rows), 1), np.int64)], axis=1)
        return ids, mask, positions

    def advanced(self, past: Past, mask: np.ndarray) -> None:
        """A decode step ran: its presents and mask are the batch's."""
        self.past, self.mask = past, mask

    def row_cache(self, i: int) -> tuple[Past, np.ndarray]:
        """Row i's own cache and mask (a decode step retried row by row)."""
        return self.backend.cache.select(self.past, self.mask, [i])

    def rebuild(self, parts: list[tuple[Row, Past, np.ndarray]]) -> None:
        """The batch made anew from rows with caches of their own."""
        self.rows, self.past, self.mask = [], [], _empty_mask()
        for row, past, mask in parts:
            if self.rows:
                self.past, self.mask = self.backend.cache.merge(self.past, self.mask, past, mask)
            else:
                self.past, self.mask = past, mask
            self.rows.append(row)

    def reserve(self) -> None:
        """Tell the backend how far the batch's cache may grow: its width now plus the most tokens a row may
        still generate (its max_tokens, the context), so a buffer that grows is sized once for the batch."""
        ahead = max((min(r.params.max_tokens - r.generated, self.context_length - len(r.seq.prompt) - r.generated)
                     for r in self.rows if r.live), default=0)
        self.backend.reserve(min(self.mask.shape[1] + max(ahead, 0), self.context_length))
