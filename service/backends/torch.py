"""PyTorch backend: the reference implementation, and the fallback where no exported file exists."""

from __future__ import annotations

import logging
import threading
from pathlib import Path
from typing import Any

import numpy as np
import torch

from models.checkpoint import Checkpoint, load
from models.gpt import KVCache
from models.loading import CheckpointError
from service.backends.base import Backend, BackendUnavailable, Past
from service.backends.probe import torch_cuda_available

log = logging.getLogger("service")
_threads_lock = threading.Lock()


class TorchBackend(Backend):
    kind = "torch"
    platform = "pytorch_libtorch"

    def __init__(self, path: Path, device: str = "auto", compile: bool = False, intra_op_threads: int = 0) -> None:
        self.path = path
        if device == "cuda" and not torch_cuda_available():
            raise BackendUnavailable("device cuda asked for, but PyTorch sees no CUDA device")
        self.device = torch.device("cuda" if device in ("auto", "cuda") and torch_cuda_available() else "cpu")
        if intra_op_threads:
            with _threads_lock:  # process-wide in PyTorch: the last model loaded sets it, which is the same value
                torch.set_num_threads(intra_op_threads)
        try:
            model, ckpt, _ = load(path)
        except CheckpointError as exc:
            raise BackendUnavailable(str(exc)) from None
        self.checkpoint: Checkpoint = ckpt
        self.arch = ckpt.arch
        self.model = model.to(self.device).eval()
        self.compiled = compile
        # dynamic=True: batch size and sequence length change from call to call; one graph serves all.
        self.forward = torch.compile(self.model, dynamic=True) if compile else self.model
        self.provider = f"{self.device.type}{' (torch.compile)' if compile else ' (eager)'}"
        self.config = ckpt.config
        if compile:
            self._warm_up()

    def _warm_up(self) -> None:
        """Compile now (a first request would otherwise wait for it, or fail on a machine without a compiler)."""
        try:
            if self.arch == "deit":
                c, size = int(self.config["in_chans"]), int(self.config["img_size"])
                for batch in (1, 2):
                    self.run_vision(np.zeros((batch, c, size, size), np.float32))
            else:
                for batch, length in ((1, 3), (2, 5)):
                    ids = np.zeros((batch, length), np.int64)
                    mask = np.ones_like(ids)
                    positions = np.broadcast_to(np.arange(length), ids.shape).copy()
                    _, past = self.run_text(ids, mask, positions, self.empty_past(batch))
                    self.run_text(ids[:, :1], np.ones((batch, length + 1), np.int64), positions[:, :1] + length, past)
        except Exception as exc:  # inductor raises many types (no C++ compiler, unsupported op, ...)
            first = (str(exc).splitlines() or [type(exc).__name__])[0][:300]
            raise BackendUnavailable(f"{self.path.name}: torch.compile failed: {first}") from None

    @torch.inference_mode()
    def run_vision(self, pixel_values: np.ndarray) -> np.ndarray:
        x = torch.from_numpy(pixel_values).to(self.device)
        return self.forward(x).float().cpu().numpy()

    @torch.inference_mode()
    def run_text(
        self, input_ids: np.ndarray, attention_mask: np.ndarray, position_ids: np.ndarray, past: Past
    ) -> tuple[torch.Tensor, Past]:
        def dev(a: np.ndarray) -> torch.Tensor:
            return torch.from_numpy(a).to(self.device)

        logits, presents = self.forward(dev(input_ids), dev(position_ids), dev(attention_mask), list(past))
        return logits.float(), list(presents)

    def empty_past(self, batch: int) -> Past:
        from models.gpt import GPTConfig

        return KVCache.empty(GPTConfig.from_dict(self.config), batch, device=self.device).layers

    def describe(self) -> dict[str, Any]:
        return {"backend": self.kind, "provider": self.provider, "file": self.path.name}
