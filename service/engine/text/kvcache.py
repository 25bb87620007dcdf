"""Row and column surgery on a batched KV cache, for numpy (ONNX Runtime) and torch (PyTorch) alike.

Rows are sequences, the cache's axis 2 (the mask's axis 1) is time. The mask is always right-aligned: a
newcomer with a shorter history is padded on the left (its mask 0 there), and columns that are padding for
every row are trimmed from the left again, so the cache is never longer than the longest live sequence.
The cache itself is laid out as the backend's graph reads it (`TextBackend.cache_layout`):
- "left-padded" (the default): as the mask, each row's real positions at the end;
- "right-padded": each row's real positions first, padding after (onnxruntime's GroupQueryAttention reads a
  row's cache from the start of its buffer, and how many positions are real from the mask's row sums), so the
  backend never realigns the cache around a call.
Either cache may be longer than the mask: a backend that writes each step's keys in place keeps room at the end
of its buffers (past and present one buffer); merging pads the shorter buffer at its end, and trimming a
right-padded cache leaves the buffer as it is (the freed columns become room).

A numpy cache (onnxruntime's buffers) also keeps room for rows: `remove_rows` moves the last rows into the holes
the leaving ones left and views the first rows of the same buffer, and `merge` writes newcomers into the rows
behind such a view (a new buffer with a quarter more rows, at least 4, when there are none), so a sequence
joining or leaving a running batch copies its own rows, not the whole cache (measured on the paper-size LM with
16 streams: 8 ms a join and up to 36 ms a leave before). Both write into the buffer they are given: the caller
replaces its cache by what they return.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from service.engine.backends.base import Past


def _is_numpy(x: Any) -> bool:
    return isinstance(x, np.ndarray)


def cat_rows(parts: list[Any]) -> Any:
    if len(parts) == 1:
        return parts[0]
    if _is_numpy(parts[0]):
        return np.concatenate(parts, axis=0)
    import torch

    return torch.cat(parts, dim=0)


def take_rows(x: Any, rows: list[int]) -> Any:
    if _is_numpy(x):
        return x[rows]
    import torch

    return x.index_select(0, torch.tensor(rows, device=x.device))


Layout = str  # "left-padded" | "right-padded"
LEFT, RIGHT = "left-padded", "right-padded"


def pad(x: Any, n: int, axis: int, at_end: bool = False) -> Any:
    """`n` zero columns before the first along `axis` (after the last with `at_end`); the mask marks them as
    padding."""
    if n == 0:
        return x
    shape = list(x.shape)
    shape[axis] = n
    if _is_numpy(x):  # zeros, then x copied in: the room never written stays untouched (lazily zeroed) memory
        out = np.zeros([*x.shape[:axis], x.shape[axis] + n, *x.shape[axis + 1:]], x.dtype)
        index = [slice(None)] * x.ndim
        index[axis] = slice(0, x.shape[axis]) if at_end else slice(n, None)
        out[tuple(index)] = x
        return out
    import torch

    zeros_t = x.new_zeros(shape)
    return torch.cat([x, zeros_t] if at_end else [zeros_t, x], dim=axis)


def drop_left(x: Any, n: int, axis: int) -> Any:
    if n == 0:
        return x
    index = [slice(None)] * x.ndim
    index[axis] = slice(n, None)
    out = x[tuple(index)]
    # numpy views keep the whole buffer alive and are not contiguous; ORT wants contiguous inputs anyway.
    return np.ascontiguousarray(out) if _is_numpy(out) else out.contiguous()


def map_past(past: Past, fn: Any) -> Past:
    return [(fn(k), fn(v)) for k, v in past]


def _row_room(t: np.ndarray) -> np.ndarray | None:
    """The buffer whose first rows `t` is, where it has rows beyond t's (room left by rows that left), else
    None."""
    base = t.base
    if (isinstance(base, np.ndarray) and base.ndim == t.ndim and base.shape[0] > t.shape[0]
            and base.shape[1:] == t.shape[1:] and base.dtype == t.dtype and base.flags.c_contiguous
            and t.flags.c_contiguous and base.ctypes.data == t.ctypes.data):
        return base
    return None


def _with_spare_rows(rows: int) -> int:
    """Rows a new merged buffer gets for `rows` rows: a quarter more (at least 4), room for the next joins."""
    return rows + max(4, rows // 4)


def _merge_in_room(past_a: Past, mask_a: np.ndarray, past_b: Past, mask_b: np.ndarray,
                   layout: Layout) -> Past | None:
    """`merge` for numpy caches whose newcomers (b) fit a's columns: b's rows written below a's into a's buffer
    (rows of room), or into a new buffer with a quarter more rows (at least 4) when it has too few; None where
    b's history is longer than a's (every row of a needs padding: the general path)."""
    la, lb = mask_a.shape[1], mask_b.shape[1]
    if not (past_a and _is_numpy(past_a[0][0]) and _is_numpy(past_b[0][0])) or lb > la \
            or past_b[0][0].shape[2] > past_a[0][0].shape[2]:
        return None
    rows_a, rows = len(mask_a), len(mask_a) + len(mask_b)
    # a's real columns are [0, la) of its buffer; b's new rows hold theirs at the end (left) or start (right)
    start = la - lb if layout != RIGHT else 0
    out: Past = []
    for pair_a, pair_b in zip(past_a, past_b, strict=True):
        merged = []
        for a, b in zip(pair_a, pair_b, strict=True):
            base = _row_room(a)
            if base is None or base.shape[0] < rows:
                base = np.zeros((_with_spare_rows(rows), *a.shape[1:]), a.dtype)
                base[:rows_a] = a
            new = base[rows_a:rows]
            new[:, :, :la] = 0  # the previous occupant's positions (room beyond la is written before it is read)
            new[:, :, start:start + lb] = b[:, :, :lb]
            merged.append(base[:rows])
        out.append((merged[0], merged[1]))
    return out


def remove_rows(past: Past, mask: np.ndarray, keep: list[int],
                layout: Layout = LEFT) -> tuple[Past, np.ndarray, list[int]]:
    """Only the rows `keep` (ascending) stay, and the columns that became padding for all of them are trimmed;
    returns the cache, its mask and which old row each new row is. A numpy cache keeps its buffer: the last kept
    rows move into the holes (row copies) and the cache becomes a view of its first rows, whose rows behind stay
    room for `merge`; any other cache is `select`ed (copied, in `keep`'s order)."""
    if not (past and _is_numpy(past[0][0]) and past[0][0].flags.writeable) or len(keep) == len(mask):
        past, mask = select(past, mask, keep, layout)
        return past, mask, keep
    n = len(keep)
    holes = sorted(set(range(n)) - set(keep))  # rows that leave in the part that stays
    movers = [i for i in keep if i >= n]  # rows that stay in the part that goes
    order = list(range(n))
    kept = mask[:n].copy()
    for hole, mover in zip(holes, movers, strict=True):
        for k, v in past:
            k[hole], v[hole] = k[mover], v[mover]
        kept[hole] = mask[mover]
        order[hole] = mover
    return (*trim([(k[:n], v[:n]) for k, v in past], kept, layout), order)


def merge(past_a: Past, mask_a: np.ndarray, past_b: Past, mask_b: np.ndarray,
          layout: Layout = LEFT) -> tuple[Past, np.ndarray]:
    """Rows of b appended below rows of a, the shorter history padded to the longer (the mask on the left, the
    cache as its layout says). A numpy cache may be written in place (module docstring)."""
    la, lb = mask_a.shape[1], mask_b.shape[1]
    fast = _merge_in_room(past_a, mask_a, past_b, mask_b, layout)
    if fast is not None:
        return fast, np.concatenate([mask_a, pad(mask_b, la - lb, 1)], axis=0)
    length = max(la, lb)
    mask = np.concatenate([pad(mask_a, length - la, 1), pad(mask_b, length - lb, 1)], axis=0)
    if past_a and past_b and _is_numpy(past_a[0][0]) and _is_numpy(past_b[0][0]):
        return _merge_numpy(past_a, la, past_b, lb, layout), mask
    if layout != RIGHT:  # the shorter history padded on the left, as its mask
        past_a = map_past(past_a, lambda t: pad(t, length - la, 2))
        past_b = map_past(past_b, lambda t: pad(t, length - lb, 2))
    # buffers with room at their end (a backend writing steps in place): the shorter padded at its end
    room = max(past_a[0][0].shape[2], past_b[0][0].shape[2]) if past_a and past_b else 0
    past_a = map_past(past_a, lambda t: pad(t, room - t.shape[2], 2, at_end=True))
    past_b = map_past(past_b, lambda t: pad(t, room - t.shape[2], 2, at_end=True))
    past = [(cat_rows([ka, kb]), cat_rows([va, vb])) for (ka, va), (kb, vb) in zip(past_a, past_b, strict=True)]
    return past, mask


def _merge_numpy(past_a: Past, la: int, past_b: Past, lb: int, layout: Layout) -> Past:
    """`merge` of numpy caches where b's history is longer than a's: one new buffer a layer (rows of room as
    `_merge_in_room` gives, each side's room at its end kept), whose columns up to the mask's are zeroed and into
    which only each side's real columns are copied, once; the room after them is left unwritten (written before
    it is read). Padding a on the left, then both at their end, then concatenating copied whole buffers three
    times: 408 ms for a 480-token prompt joining 8 rows of the paper-size LM."""
    length = max(la, lb)
    shift_a, shift_b = (0, 0) if layout == RIGHT else (length - la, length - lb)
    cols = max(past_a[0][0].shape[2] + shift_a, past_b[0][0].shape[2] + shift_b)
    rows_a = len(past_a[0][0])
    rows = rows_a + len(past_b[0][0])
    out: Past = []
    for pair_a, pair_b in zip(past_a, past_b, strict=True):
        merged = []
        for a, b in zip(pair_a, pair_b, strict=True):
            base = np.empty((_with_spare_rows(rows), a.shape[1], cols, a.shape[3]), a.dtype)
            base[:rows, :, :length] = 0  # padding must be finite (masked, but 0 x NaN is NaN); room is not read
            base[:rows_a, :, shift_a:shift_a + la] = a[:, :, :la]
            base[rows_a:rows, :, shift_b:shift_b + lb] = b[:, :, :lb]
            merged.append(base[:rows])
        out.append((merged[0], merged[1]))
    return out


def select(past: Past, mask: np.ndarray, rows: list[int], layout: Layout = LEFT) -> tuple[Past, np.ndarray]:
    """Keep only `rows`, then trim the columns that became padding for every remaining row."""
    if rows != list(range(mask.shape[0])):
        past = map_past(past, lambda t: take_rows(t, rows))
        mask = mask[rows]
    return trim(past, mask, layout)


def trim(past: Past, mask: np.ndarray, layout: Layout = LEFT) -> tuple[Past, np.ndarray]:
    used = mask.any(axis=0)
    first = int(np.argmax(used)) if used.any() else mask.shape[1]
    if first == 0:
        return past, mask
    if layout == RIGHT:  # the rows' positions stay at the start; the freed columns become room
        return past, np.ascontiguousarray(mask[:, first:])
    return map_past(past, lambda t: drop_left(t, first, 2)), np.ascontiguousarray(mask[:, first:])
