"""The acceptance test of the model description (models.spec): an architecture that exists only in this file, a
tiny decoder whose config names nothing as GPT does (`layers`, `width`, `heads`, `ctx`, `vocab`), registered
through the registry's public API, is exported, validated and served with no change outside this file."""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import onnx
import pytest
import torch
from fastapi.testclient import TestClient
from torch import Tensor, nn

from export.pipeline import ExportOptions, export_checkpoint
from models import registry
from models.checkpoint import Checkpoint, save_checkpoint
from models.generate import generate
from models.spec import Reweighting, TextSpec
from models.tokenizer import ByteTokenizer
from service.base.config import Settings
from service.edge.app import create_app

ARCH = "tiny_decoder_under_test"


@dataclasses.dataclass
class TinyConfig:
    layers: int = 2
    width: int = 32
    heads: int = 4
    kv: int = 2  # key/value heads (grouped-query attention)
    ctx: int = 48
    vocab: int = 259  # the byte tokenizer's

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> TinyConfig:
        return cls(**d)

    @classmethod
    def from_preset(cls, name: str, **overrides: Any) -> TinyConfig:
        return cls(**overrides)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


class TinyLayer(nn.Module):
    def __init__(self, c: TinyConfig) -> None:
        super().__init__()
        self.heads, self.kv, self.size = c.heads, c.kv, c.width // c.heads
        self.norm = nn.LayerNorm(c.width)
        self.q = nn.Linear(c.width, c.width)
        self.k = nn.Linear(c.width, c.kv * self.size)
        self.v = nn.Linear(c.width, c.kv * self.size)
        self.out = nn.Linear(c.width, c.width)

    def forward(self, x: Tensor, bias: Tensor, past: tuple[Tensor, Tensor]) -> tuple[Tensor, tuple[Tensor, Tensor]]:
        B, T, _ = x.shape
        h = self.norm(x)
        q = self.q(h).view(B, T, self.heads, self.size).transpose(1, 2)
        k = torch.cat([past[0], self.k(h).view(B, T, self.kv, self.size).transpose(1, 2)], dim=2)
        v = torch.cat([past[1], self.v(h).view(B, T, self.kv, self.size).transpose(1, 2)], dim=2)
        group = self.heads // self.kv
        scores = q @ k.repeat_interleave(group, dim=1).transpose(-1, -2) / math.sqrt(self.size) + bias
        y = (scores.softmax(-1) @ v.repeat_interleave(group, dim=1)).transpose(1, 2).reshape(B, T, -1)
        return x + self.out(y), (k, v)


class TinyDecoder(nn.Module):
    keeps_last_logits = False  # the text-model capabilities (models.registry.TextModel)
    grows_cache_in_place = False

    def __init__(self, config: TinyConfig) -> None:
        super().__init__()
        self.config = config
        self.embed = nn.Embedding(config.vocab, config.width)
        self.position = nn.Embedding(config.ctx, config.width)
        self.stack = nn.ModuleList(TinyLayer(config) for _ in range(config.layers))
        self.head = nn.Linear(config.width, config.vocab)

    def empty_past(self, batch_size: int, dtype: torch.dtype | None = None,
                   device: Any = None) -> list[tuple[Tensor, Tensor]]:
        c = self.config
        shape = (batch_size, c.kv, 0, c.width // c.heads)
        dtype, device = dtype or self.head.weight.dtype, device or self.head.weight.device
        return [(torch.zeros(shape, dtype=dtype, device=device),) * 2 for _ in range(c.layers)]

    def forward(self, input_ids: Tensor, position_ids: Tensor | None = None, attention_mask: Tensor | None = None,
                past_key_values: Any = None) -> tuple[Tensor, list[tuple[Tensor, Tensor]]]:
        past = list(past_key_values) if past_key_values is not None else self.empty_past(input_ids.shape[0])
        T, cached = input_ids.shape[1], past[0][0].shape[2]
        if attention_mask is None:
            attention_mask = torch.ones(input_ids.shape[0], cached + T, dtype=torch.long, device=input_ids.device)
        if position_ids is None:
            position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)[:, -T:]
        keys = torch.arange(cached + T, device=input_ids.device)
        allowed = (keys[None, :] <= keys[-T:, None])[None, None] & attention_mask[:, None, None, :].bool()
        bias = torch.where(allowed, 0.0, -1e9)
        x = self.embed(input_ids) + self.position(position_ids)
        presents = []
        for layer, kv in zip(self.stack, past, strict=True):
            x, present = layer(x, bias, kv)
            presents.append(present)
        return self.head(x), presents


def describe(c: TinyConfig) -> TextSpec:
    return TextSpec((c.kv,) * c.layers, c.width // c.heads, c.vocab, c.ctx, Reweighting())


@pytest.fixture
def tiny_arch() -> Iterator[registry.Architecture]:
    arch = registry.register(registry.Architecture(
        ARCH, registry.TEXT, TinyConfig, TinyDecoder, {}, "layers", lambda model: None,
        new_checkpoint_fields=lambda: {"tokenizer": ByteTokenizer().to_dict()}, describe=describe))
    try:
        yield arch
    finally:
        registry.unregister(ARCH)


def _checkpoint(arch: registry.Architecture, path: Path) -> TinyDecoder:
    torch.manual_seed(0)
    config = TinyConfig()
    model = TinyDecoder(config).eval()
    save_checkpoint(Checkpoint(ARCH, config.to_dict(), model.state_dict(), **arch.new_checkpoint_fields()), path)
    return model


def test_a_new_architecture_exports_validates_and_serves(tiny_arch: registry.Architecture, tmp_path: Path) -> None:
    models_dir = tmp_path / "models"
    models_dir.mkdir()
    model = _checkpoint(tiny_arch, tmp_path / "tiny.pt")
    out = models_dir / "tiny.onnx"
    report = export_checkpoint(tmp_path / "tiny.pt", ExportOptions(output=out, samples=12, progress=False)).data
    assert report["graph"]["problems"] == [] and report["validation"]["passed"], report["validation"]["failures"]
    assert report["validation"]["greedy"]["identical"] == report["validation"]["greedy"]["prompts"]

    props = {p.key: json.loads(p.value) for p in onnx.load(str(out), load_external_data=False).metadata_props}
    assert props["multimax.arch"] == ARCH and props["multimax.config"] == TinyConfig().to_dict()
    assert props["multimax.spec"]["kv_heads"] == [2, 2] and props["multimax.spec"]["head_size"] == 8
    assert props["multimax.spec"]["context_length"] == 48 and props["multimax.spec"]["eos_id"] == 257

    (models_dir / "tiny_pt.pt").write_bytes((tmp_path / "tiny.pt").read_bytes())  # the PyTorch backend too
    tok = ByteTokenizer()
    want = tok.decode(generate(model, tok.encode("hello"), 6, temperature=0)[0])
    with TestClient(create_app(Settings(model_dir=models_dir, warmup_calls=1))) as client:
        listed = {m["id"]: m for m in client.get("/v1/models").json()["data"]}
        assert listed["tiny"]["task"] == listed["tiny_pt"]["task"] == "text-generation"
        for name in ("tiny", "tiny_pt"):
            r = client.post("/v1/completions", json={"model": name, "prompt": "hello", "max_tokens": 6,
                                                     "temperature": 0})
            assert r.status_code == 200, r.text
            assert r.json()["choices"][0]["text"] == want
        # the context comes from the spec: a prompt past it is refused as the protocol says, not a 500
        r = client.post("/v1/completions", json={"model": "tiny", "prompt": "x" * 60, "max_tokens": 2})
        assert r.status_code == 400, r.text


def test_a_file_with_the_spec_key_serves_where_its_architecture_is_not_registered(
        tiny_arch: registry.Architecture, tmp_path: Path) -> None:
    models_dir = tmp_path / "models"
    models_dir.mkdir()
    _checkpoint(tiny_arch, tmp_path / "tiny.pt")
    export_checkpoint(tmp_path / "tiny.pt", ExportOptions(output=models_dir / "tiny.onnx", validate=False,
                                                          progress=False))
    registry.unregister(ARCH)  # another process: the server knows nothing of this architecture
    assert ARCH not in registry.names()
    with TestClient(create_app(Settings(model_dir=models_dir, warmup_calls=0))) as client:
        r = client.post("/v1/completions", json={"model": "tiny", "prompt": "hi", "max_tokens": 3, "temperature": 0})
        assert r.status_code == 200, r.text
        assert len(r.json()["choices"]) == 1 and r.json()["model"] == "tiny"
        meta = client.get("/v2/models/tiny").json()
        assert meta["outputs"][0]["shape"] == [-1, -1, 259]
