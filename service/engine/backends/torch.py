"""PyTorch backend: the reference implementation, and the fallback where no exported file exists."""

from __future__ import annotations

import logging
import re
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any, cast

import numpy as np
import torch
from torch import nn

from models import registry as architectures
from models.cache_growth import capacity
from models.checkpoint import Checkpoint, build_model, config_of, parse, read_file
from models.generate import grows_cache_in_place, keeps_last_logits
from models.loading import CheckpointError, check_keys
from models.registry import TextModel
from models.spec import TEXT, TextSpec, VisionSpec
from plugins.cpu_sigma import use_cpu_sigma
from plugins.torch_op import use_fused_kernels
from service.engine.backends.base import (
    Backend,
    BackendUnavailable,
    Past,
    TextBackend,
    VisionBackend,
    grown_length,
)
from service.engine.backends.cache_torch import TorchCache
from service.engine.backends.probe import torch_cuda_available

log = logging.getLogger(__name__)
_threads_lock = threading.Lock()


_NUMBERED = re.compile(r"^(.*?)\.(\d+)\.")  # a module list's item: `<list>.<index>.` (the first one in a key)


def _layer_count(keys: list[str]) -> int:
    """The length of the longest numbered module list in the weights (the transformer blocks, whatever an
    architecture names them: `blocks.{i}.`, `layers.{i}.`, fairseq's `decoder.layers.{i}.`, ...)."""
    lists: dict[str, set[str]] = {}
    for key in keys:
        if m := _NUMBERED.match(key):
            lists.setdefault(m.group(1), set()).add(m.group(2))
    return max(map(len, lists.values()), default=0)


def check_sizes(ckpt: Checkpoint, source: str) -> None:
    """The config must describe exactly the weights, checked before any real memory is allocated: a config
    that claims more layers than the file holds is refused from the keys alone, then the model is built on
    torch's meta device (shapes without storage) and every weight's shape compared."""
    arch = architectures.get(ckpt.arch)
    depth_key = arch.depth_key
    layers = _layer_count(list(ckpt.state_dict))
    claimed = ckpt.config.get(depth_key)
    if not isinstance(claimed, int) or claimed != layers:
        raise CheckpointError(f"{source}: config {depth_key}={claimed!r} but the weights hold {layers} layers")
    config = config_of(ckpt)
    with torch.device("meta"):
        skeleton = arch.model(config)
    check_keys({k: tuple(v.shape) for k, v in skeleton.state_dict().items()}, ckpt.state_dict, source)


class _TorchBackend(Backend):
    """The checkpoint's model in PyTorch (eager or torch.compile); the subclasses run it for their task."""

    kind = "torch"
    platform = "pytorch_libtorch"

    def __init__(self, path: Path, ckpt: Checkpoint, model: nn.Module, device: torch.device, compile: bool) -> None:
        self.path, self.checkpoint, self.device = path, ckpt, device
        self.arch = ckpt.arch
        self.model = model.to(device).eval()
        # On a GPU every attention reweighting (MultiMax and the others) runs its Triton kernel (one custom op that
        # torch.compile keeps whole).
        self.fused_reweighting = use_fused_kernels(self.model) if device.type == "cuda" else 0
        # On a CPU the LM head's SegLU runs the fused library's kernel (one pass instead of a dozen tensor ops).
        self.fused_sigma = use_cpu_sigma(self.model) if device.type == "cpu" else False
        self.compiled = compile
        # dynamic=True: batch size and sequence length change from call to call; one graph serves all.
        self.forward: Callable[..., Any] = torch.compile(self.model, dynamic=True) if compile else self.model
        self.provider = f"{device.type}{' (torch.compile)' if compile else ' (eager)'}"
        self.config = ckpt.config
        if compile:
            try:
                self._warm_up()
            except Exception as exc:  # inductor raises many types (no C++ compiler, unsupported op, ...)
                first = (str(exc).splitlines() or [type(exc).__name__])[0][:300]
                raise BackendUnavailable(f"{path.name}: torch.compile failed: {first}") from None

    def _warm_up(self) -> None:
        """Compile now (a first request would otherwise wait for it, or fail on a machine without a compiler)."""

    def describe(self) -> dict[str, Any]:
        out: dict[str, Any] = {"backend": self.kind, "provider": self.provider, "file": self.path.name}
        if self.fused_reweighting:  # attention layers whose reweighting runs the Triton kernel
            out["fused_reweighting_layers"] = self.fused_reweighting
        if self.fused_sigma:
            out["fused_seglu"] = "cpu"
        return out


class TorchVisionBackend(_TorchBackend, VisionBackend):
    def _warm_up(self) -> None:
        spec = self.checkpoint.spec()
        if not isinstance(spec, VisionSpec):  # TorchBackend picks this class for vision checkpoints only
            raise BackendUnavailable(f"{self.path.name}: not a vision checkpoint")
        c, size = spec.channels, spec.image_size
        for batch in (1, 2):
            self.run_vision(np.zeros((batch, c, size, size), np.float32))

    @torch.inference_mode()
    def run_vision(self, pixel_values: np.ndarray) -> np.ndarray:
        x = torch.from_numpy(pixel_values).to(self.device)
        return self.forward(x).float().cpu().numpy()


class TorchTextBackend(_TorchBackend, TextBackend):
    cache = TorchCache()  # tensors on the model's device, left-padded

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.keeps_last_logits = keeps_last_logits(self.model)
        self.grows_in_place = grows_cache_in_place(self.model)  # a past with room is worth handing it
        spec = self.checkpoint.spec()
        self.context = spec.context_length if isinstance(spec, TextSpec) else 0  # 0: unknown

    def _with_room(self, past: Past, total: int) -> Past:
        """A decode step's past, where it has no room for the step's `total` positions: views of buffers sized
        to what the rows may reach (`reserve`; grown_length), so that models.cache_growth.extend writes
        this step and the next ones in place instead of doubling (64, 128, ... positions: one whole-cache copy
        each). Without a hint beyond `total`, extend's doubling as before. The room is left unwritten (extend
        writes a position before anything reads it), so it costs address space, not memory, until used."""
        if not past or self.reserved <= total or capacity(past[0][0]) >= total:
            return past
        size = grown_length(total, self.reserved, self.context)

        def grown(t: torch.Tensor) -> torch.Tensor:
            buffer = t.new_empty((*t.shape[:2], size, t.shape[3]))
            buffer[:, :, :t.shape[2]] = t
            return buffer[:, :, :t.shape[2]]

        return [(grown(k), grown(v)) for k, v in past]

    def _warm_up(self) -> None:
        for batch, length in ((1, 3), (2, 5)):
            ids = np.zeros((batch, length), np.int64)
            mask = np.ones_like(ids)
            positions = np.broadcast_to(np.arange(length), ids.shape).copy()
            _, past = self.run_text(ids, mask, positions, self.empty_past(batch))
            self.run_text(ids[:, :1], np.ones((batch, length + 1), np.int64), positions[:, :1] + length, past)

    @torch.inference_mode()
    def run_text(
        self, input_ids: np.ndarray, attention_mask: np.ndarray, position_ids: np.ndarray, past: Past,
        last_only: bool = False,
    ) -> tuple[torch.Tensor, Past]:
        def dev(a: np.ndarray) -> torch.Tensor:
            return torch.from_numpy(a).to(self.device)

        keep = {"logits_to_keep": 1} if last_only and self.keeps_last_logits else {}
        if self.grows_in_place and input_ids.shape[1] == 1:
            past = self._with_room(past, attention_mask.shape[1])
        logits, presents = self.forward(dev(input_ids), dev(position_ids), dev(attention_mask), list(past), **keep)
        return logits.float(), list(presents)

    def host_logits(self, logits: Any) -> torch.Tensor:
        return logits.float().cpu()

    def to_numpy(self, logits: Any) -> np.ndarray:
        return logits.float().cpu().numpy()

    def empty_past(self, batch: int) -> Past:
        model = cast(TextModel, self.model)
        return list(model.empty_past(batch, dtype=torch.float32, device=self.device))


def TorchBackend(
    path: Path, device: str = "auto", compile: bool = False, intra_op_threads: int = 0
) -> TorchVisionBackend | TorchTextBackend:
    """The checkpoint at `path`, checked against its config and loaded, as the backend of its task."""
    if device == "cuda" and not torch_cuda_available():
        raise BackendUnavailable("device cuda asked for, but PyTorch sees no CUDA device")
    where = torch.device("cuda" if device in ("auto", "cuda") and torch_cuda_available() else "cpu")
    if intra_op_threads:
        with _threads_lock:  # process-wide in PyTorch: the last model loaded sets it, which is the same value
            torch.set_num_threads(intra_op_threads)
    try:
        ckpt, _ = parse(read_file(path), str(path))
        check_sizes(ckpt, path.name)
        model = build_model(ckpt, str(path))
    except CheckpointError as exc:
        raise BackendUnavailable(str(exc)) from None
    cls = TorchTextBackend if ckpt.spec().TASK == TEXT else TorchVisionBackend
    return cls(path, ckpt, model, where, compile)
