"""KV cache surgery (service.engine.backends.cache_numpy / cache_torch): merging rows of different lengths,
selecting the rows that stay, both padding layouts, growing to the decode loop's hint."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch

from service.engine.backends.cache_numpy import NumpyCache, _row_room
from service.engine.backends.cache_ops import LEFT, RIGHT, CacheOps
from service.engine.backends.cache_torch import TorchCache


def _cache(kind: str, layout: str = LEFT) -> CacheOps:
    """The cache operations of the array type `kind`, as a backend declares them."""
    return NumpyCache(layout) if kind == "numpy" else TorchCache(layout)


@pytest.mark.parametrize("kind", ["numpy", "torch"])
def test_kv_merge_pads_left_and_select_trims_padding(kind: str) -> None:
    def arr(x: np.ndarray) -> Any:
        return x if kind == "numpy" else torch.from_numpy(x)

    a = np.arange(2 * 1 * 5 * 2, dtype=np.float32).reshape(2, 1, 5, 2)
    b = np.ones((1, 1, 3, 2), np.float32)
    mask_a = np.array([[1, 1, 1, 1, 1], [0, 0, 1, 1, 1]])
    mask_b = np.ones((1, 3), np.int64)
    past, mask = _cache(kind).merge([(arr(a), arr(a))], mask_a, [(arr(b), arr(b))], mask_b)
    k = np.asarray(past[0][0])
    assert k.shape == (3, 1, 5, 2) and mask.tolist()[2] == [0, 0, 1, 1, 1]
    assert np.array_equal(k[2, :, 2:], b[0]) and not k[2, :, :2].any()
    past, mask = _cache(kind).select(past, mask, [1, 2])  # row 0 (the only one using columns 0, 1) leaves
    assert mask.shape == (2, 3) and np.asarray(past[0][1]).shape == (2, 1, 3, 2)
    assert np.array_equal(np.asarray(past[0][0])[0], a[1, :, 2:])


@pytest.mark.parametrize("kind", ["numpy", "torch"])
def test_kv_right_padded_layout_pads_and_trims_at_the_end(kind: str) -> None:
    """GroupQueryAttention's layout: each row's positions first; the mask stays right-aligned as ever."""
    def arr(x: np.ndarray) -> Any:
        return x if kind == "numpy" else torch.from_numpy(x)

    a = np.arange(2 * 1 * 5 * 2, dtype=np.float32).reshape(2, 1, 5, 2)
    a[1, :, 3:] = 0  # row 1 holds 3 positions, at the start
    b = np.ones((1, 1, 3, 2), np.float32)
    mask_a = np.array([[1, 1, 1, 1, 1], [0, 0, 1, 1, 1]])
    past, mask = _cache(kind, RIGHT).merge([(arr(a), arr(a))], mask_a, [(arr(b), arr(b))],
                                          np.ones((1, 3), np.int64))
    k = np.asarray(past[0][0])
    assert k.shape == (3, 1, 5, 2) and mask.tolist()[2] == [0, 0, 1, 1, 1]
    assert np.array_equal(k[2, :, :3], b[0]) and not k[2, :, 3:].any()
    past, mask = _cache(kind, RIGHT).select(past, mask, [1, 2])  # the 5-long row leaves: 2 mask columns go
    assert mask.shape == (2, 3) and np.asarray(past[0][1]).shape == (2, 1, 5, 2)  # the buffer keeps them as room
    assert np.array_equal(np.asarray(past[0][0])[0, :, :3], a[1, :, :3])  # the row's own positions, from the start
    assert np.array_equal(np.asarray(past[0][0])[1, :, :3], b[0])
    # a buffer with room merges with a shorter one: the shorter is padded at its end
    longer = np.zeros((1, 1, 9, 2), np.float32)
    merged, mask2 = _cache(kind, RIGHT).merge(past, mask, [(arr(longer), arr(longer))], np.ones((1, 4), np.int64))
    assert np.asarray(merged[0][0]).shape == (3, 1, 9, 2) and mask2.shape == (3, 4)


@pytest.mark.parametrize("layout", [LEFT, RIGHT])
def test_a_longer_newcomer_merges_into_one_new_numpy_buffer_as_the_torch_path_does(layout: str) -> None:
    """A newcomer with a longer history than the batch (every running row needs padding) is merged into one new
    buffer a layer: its values over the mask's columns are the torch path's (the same cache as tensors), the
    padding is zeros, and the buffer keeps rows of room for the next join."""
    rng = np.random.default_rng(3)
    k = rng.normal(size=(2, 1, 8, 2)).astype(np.float32)  # 2 rows, a buffer of 8 columns, 3 of them real
    mask = np.array([[0, 1, 1], [1, 1, 1]], np.int64)
    if layout == LEFT:
        k[0, :, 0] = 0
    else:
        k[0, :, 2:] = 0
    newcomer = rng.normal(size=(1, 1, 6, 2)).astype(np.float32)
    new_mask = np.ones((1, 6), np.int64)
    merged, merged_mask = NumpyCache(layout).merge([(k, k.copy())], mask, [(newcomer, newcomer.copy())], new_mask)
    want, want_mask = TorchCache(layout).merge([(torch.from_numpy(k[:, :, :3].copy()),) * 2], mask,
                                               [(torch.from_numpy(newcomer),) * 2], new_mask)
    assert np.array_equal(merged_mask, want_mask) and merged_mask.shape == (3, 6)
    got = merged[0][0]
    assert got.shape[:2] == (3, 1) and got.shape[2] >= 6
    assert np.array_equal(got[:, :, :6], want[0][0].numpy()[:, :, :6])
    assert _row_room(got) is not None  # rows of room behind the view


def test_a_full_cache_grows_to_the_hint_within_its_bounds() -> None:
    from service.engine.backends.base import grown_length as grown

    assert grown(33, 96, 1024) == 96  # 32-token prompts asking 64 tokens: one buffer for all of it
    assert grown(33, 0, 1024) == 66 and grown(33, 33, 1024) == 66  # no hint beyond the step: doubling
    assert grown(33, 1000, 1024) == 132  # at most four times what the step must hold
    assert grown(5, 1000, 1024) == 64  # ... or the smallest buffer doubling gives
    assert grown(300, 5000, 1024) == 1024 and grown(300, 5000, 0) == 1200  # never past the context (0: unknown)
    assert grown(40, 50, 1024) == 50  # no more than the rows may reach


@pytest.mark.parametrize("layout", [LEFT, RIGHT])
def test_numpy_cache_rows_leave_and_join_inside_one_buffer(layout: str) -> None:
    """Leaving rows are filled by the last rows (row copies) and the cache becomes a view of the buffer's first
    rows; a newcomer that fits the batch's columns is written into the rows behind, not a copy of the cache."""
    rng = np.random.default_rng(0)
    k = rng.normal(size=(4, 1, 8, 2)).astype(np.float32)  # 4 rows, buffer of 8 columns (room after the mask's 5)
    rows = [k[i].copy() for i in range(4)]
    mask = np.array([[1, 1, 1, 1, 1], [0, 1, 1, 1, 1], [0, 0, 1, 1, 1], [1, 1, 1, 1, 1]])
    past, mask2, order = NumpyCache(layout).remove_rows([(k, k + 1)], mask, [1, 2])  # rows 0 and 3 leave
    assert order == [2, 1]  # row 2 moved into row 0's place
    kept = past[0][0]
    assert kept.shape == (2, 1, 8 if layout == RIGHT else 7, 2)
    if layout == RIGHT:  # no column trimmed from the buffer: a view of the same memory
        assert kept.ctypes.data == k.ctypes.data and np.array_equal(kept[0], rows[2])
        assert np.array_equal(past[0][1][1], rows[1] + 1)
    else:  # the first column is padding for rows 1 and 2 now: trimmed
        assert np.array_equal(kept[0], rows[2][:, 1:]) and np.array_equal(kept[1], rows[1][:, 1:])
    assert mask2.tolist() == [[0, 1, 1, 1], [1, 1, 1, 1]]
    # a newcomer of 2 positions joins: into the buffer's spare rows when the cache is a view with some
    new = np.full((1, 1, 2, 2), 7.0, np.float32)
    merged, mask3 = NumpyCache(layout).merge(past, mask2, [(new, new)], np.ones((1, 2), np.int64))
    km = merged[0][0]
    assert km.shape[0] == 3 and mask3.tolist()[2] == [0, 0, 1, 1]
    if layout == RIGHT:
        assert km.ctypes.data == k.ctypes.data  # written in place
        assert np.array_equal(km[2, :, :2], new[0]) and not km[2, :, 2:4].any()
    else:
        assert np.array_equal(km[2, :, 2:4], new[0]) and not km[2, :, :2].any()
    assert np.array_equal(km[0], kept[0]) and np.array_equal(km[1], kept[1])
    # a newcomer longer than the batch's history: every row is padded (the general path), same result as before
    longer = np.full((1, 1, 6, 2), 3.0, np.float32)
    merged2, mask4 = NumpyCache(layout).merge(merged, mask3, [(longer, longer)], np.ones((1, 6), np.int64))
    assert mask4.shape == (4, 6) and mask4[:3, :2].sum() == 0
    assert np.array_equal(merged2[0][0][3, :, :6], longer[0])
    # a torch cache is selected as before (copied, in keep's order)
    t = torch.from_numpy(k.copy())
    tpast, tmask, torder = TorchCache(layout).remove_rows([(t, t)], mask, [1, 2])
    assert torder == [1, 2] and tmask.tolist() == [[1, 1, 1, 1], [0, 1, 1, 1]]
    assert torch.equal(tpast[0][0][0, :, -4:], torch.from_numpy(rows[1][:, -4:]))
