"""Row and column surgery on a batched KV cache, each array type's own (`NumpyCache`, `TorchCache`).

Rows are sequences, the cache's axis 2 (the mask's axis 1) is time. The mask (numpy, whatever the cache) is always
right-aligned: a newcomer with a shorter history is padded on the left (its mask 0 there), and columns that are
padding for every row are trimmed from the left again, so the cache is never longer than the longest live
sequence. The cache itself is laid out as the backend's graph reads it (`CacheOps.layout`):
- "left-padded" (the default): as the mask, each row's real positions at the end;
- "right-padded": each row's real positions first, padding after (onnxruntime's GroupQueryAttention reads a
  row's cache from the start of its buffer, and how many positions are real from the mask's row sums), so the
  backend never realigns the cache around a call.
Either cache may be longer than the mask: a backend that writes each step's keys in place keeps room at the end
of its buffers (past and present one buffer); merging pads the shorter buffer at its end, and trimming a
right-padded cache leaves the buffer as it is (the freed columns become room).

A backend declares its operations (`TextBackend.cache`), so the batch (service.engine.text.batch) never asks what
type a cache is. The algorithms here are written once over four primitives each array type implements; the
numpy cache overrides `merge` and `remove_rows` to reuse its buffers (service.engine.backends.cache_numpy).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import Any

import numpy as np

Past = list[tuple[Any, Any]]  # per layer (key, value), each (batch, n_head, length, head_dim)
Layout = str  # "left-padded" | "right-padded"
LEFT, RIGHT = "left-padded", "right-padded"


def map_past(past: Past, fn: Callable[[Any], Any]) -> Past:
    return [(fn(k), fn(v)) for k, v in past]


def pad_mask(mask: np.ndarray, n: int) -> np.ndarray:
    """`n` padding columns (0) before the mask's first."""
    return mask if n == 0 else np.concatenate([np.zeros((len(mask), n), mask.dtype), mask], axis=1)


def used_from(mask: np.ndarray) -> int:
    """The first column that is real for some row (the mask's width when none is)."""
    used = mask.any(axis=0)
    return int(np.argmax(used)) if used.any() else mask.shape[1]


class CacheOps(ABC):
    """A cache's row and column operations, for one array type and one layout."""

    def __init__(self, layout: Layout = LEFT) -> None:
        if layout not in (LEFT, RIGHT):
            raise ValueError(f"unknown cache layout {layout!r}")
        self.layout = layout

    # ---- the array type's primitives ------------------------------------------------------------------------

    @abstractmethod
    def take_rows(self, x: Any, rows: list[int]) -> Any:
        """The rows `rows` of x, in that order (a copy)."""

    @abstractmethod
    def cat_rows(self, parts: list[Any]) -> Any:
        """The parts' rows, one below the other."""

    @abstractmethod
    def pad(self, x: Any, n: int, axis: int, at_end: bool = False) -> Any:
        """`n` zero columns before the first along `axis` (after the last with `at_end`)."""

    @abstractmethod
    def drop_left(self, x: Any, n: int, axis: int) -> Any:
        """x without its first `n` columns along `axis` (contiguous)."""

    @abstractmethod
    def columns(self, x: Any, row: int, start: int, stop: int) -> Any:
        """A copy of row `row`'s time columns [start, stop): (1, heads, stop - start, head_dim), a buffer of its own
        (nothing a backend writes in place into a batch's cache reaches it, nor the reverse)."""

    @abstractmethod
    def nbytes(self, x: Any) -> int:
        """Bytes x holds."""

    # ---- the algorithms --------------------------------------------------------------------------------------

    def row_positions(self, past: Past, mask: np.ndarray, row: int, n: int) -> Past:
        """A copy of the first `n` real positions of row `row` (a prompt's cache, for the prefix cache): where the
        layout keeps them (right-aligned with the mask, or from the buffer's start)."""
        real = int(mask[row].sum())
        start = 0 if self.layout == RIGHT else mask.shape[1] - real
        return map_past(past, lambda t: self.columns(t, row, start, start + n))

    def prefix(self, past: Past, n: int) -> Past:
        """A copy of the first `n` positions of a one-row cache of its own (a cached prompt's)."""
        return map_past(past, lambda t: self.columns(t, 0, 0, n))

    def select(self, past: Past, mask: np.ndarray, rows: list[int]) -> tuple[Past, np.ndarray]:
        """Keep only `rows`, then trim the columns that became padding for every remaining row."""
        if rows != list(range(mask.shape[0])):
            past = map_past(past, lambda t: self.take_rows(t, rows))
            mask = mask[rows]
        return self.trim(past, mask)

    def trim(self, past: Past, mask: np.ndarray) -> tuple[Past, np.ndarray]:
        first = used_from(mask)
        if first == 0:
            return past, mask
        if self.layout == RIGHT:  # the rows' positions stay at the start; the freed columns become room
            return past, np.ascontiguousarray(mask[:, first:])
        return map_past(past, lambda t: self.drop_left(t, first, 2)), np.ascontiguousarray(mask[:, first:])

    def remove_rows(self, past: Past, mask: np.ndarray, keep: list[int]) -> tuple[Past, np.ndarray, list[int]]:
        """Only the rows `keep` (ascending) stay, the columns that became padding for all of them trimmed; returns
        the cache, its mask and which old row each new row is."""
        past, mask = self.select(past, mask, keep)
        return past, mask, keep

    def merge(self, past_a: Past, mask_a: np.ndarray, past_b: Past, mask_b: np.ndarray) -> tuple[Past, np.ndarray]:
        """Rows of b appended below rows of a, the shorter history padded to the longer (the mask on the left, the
        cache as its layout says)."""
        la, lb = mask_a.shape[1], mask_b.shape[1]
        length = max(la, lb)
        mask = np.concatenate([pad_mask(mask_a, length - la), pad_mask(mask_b, length - lb)], axis=0)
        if self.layout != RIGHT:  # the shorter history padded on the left, as its mask
            past_a = map_past(past_a, lambda t: self.pad(t, length - la, 2))
            past_b = map_past(past_b, lambda t: self.pad(t, length - lb, 2))
        # buffers with room at their end (a backend writing steps in place): the shorter padded at its end
        room = max(past_a[0][0].shape[2], past_b[0][0].shape[2]) if past_a and past_b else 0
        past_a = map_past(past_a, lambda t: self.pad(t, room - t.shape[2], 2, at_end=True))
        past_b = map_past(past_b, lambda t: self.pad(t, room - t.shape[2], 2, at_end=True))
        past = [(self.cat_rows([ka, kb]), self.cat_rows([va, vb]))
                for (ka, va), (kb, vb) in zip(past_a, past_b, strict=True)]
        return past, mask
