"""What every architecture's dataclass config shares: presets by name, and an exact round trip through a dict."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any, ClassVar, TypeVar

C = TypeVar("C", bound="ModelConfig")


class ModelConfig:
    """Base of DeiTConfig, GPTConfig, LlamaConfig, FairseqLMConfig (each a dataclass)."""

    KIND: ClassVar[str]  # the architecture's name in messages ("DeiT", "GPT", ...)

    @classmethod
    def presets(cls) -> Mapping[str, Mapping[str, Any]]:
        """Named overrides of the defaults (the module's table, defined after the class)."""
        raise NotImplementedError

    @classmethod
    def from_preset(cls: type[C], name: str, **overrides: Any) -> C:
        presets = cls.presets()
        if name not in presets:
            raise ValueError(f"unknown {cls.KIND} preset {name!r}; known presets: {', '.join(presets)}")
        return cls.from_dict({**presets[name], **overrides})

    @classmethod
    def from_dict(cls: type[C], d: Mapping[str, Any]) -> C:
        """Exactly the dataclass's fields: an unknown one is an error, not dropped."""
        known = {f.name for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
        unknown = sorted(set(d) - known)
        if unknown:
            raise ValueError(f"unknown {cls.__name__} field(s): {', '.join(unknown)}")
        return cls(**d)
