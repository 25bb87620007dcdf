"""The KV-cache operations on torch tensors (the PyTorch backend's cache, on its device): the shared algorithms of
service.engine.backends.cache_ops over torch's primitives."""

from __future__ import annotations

import torch

from service.engine.backends.cache_ops import CacheOps


class TorchCache(CacheOps):
    def take_rows(self, x: torch.Tensor, rows: list[int]) -> torch.Tensor:
        return x.index_select(0, torch.tensor(rows, device=x.device))

    def cat_rows(self, parts: list[torch.Tensor]) -> torch.Tensor:
        return parts[0] if len(parts) == 1 else torch.cat(parts, dim=0)

    def pad(self, x: torch.Tensor, n: int, axis: int, at_end: bool = False) -> torch.Tensor:
        if n == 0:
            return x
        zeros = x.new_zeros([*x.shape[:axis], n, *x.shape[axis + 1:]])
        return torch.cat([x, zeros] if at_end else [zeros, x], dim=axis)

    def drop_left(self, x: torch.Tensor, n: int, axis: int) -> torch.Tensor:
        return x if n == 0 else x.narrow(axis, n, x.shape[axis] - n).contiguous()

    def columns(self, x: torch.Tensor, row: int, start: int, stop: int) -> torch.Tensor:
        return x[row:row + 1, :, start:stop].clone(memory_format=torch.contiguous_format)

    def nbytes(self, x: torch.Tensor) -> int:
        return x.numel() * x.element_size()
