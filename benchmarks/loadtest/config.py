"""What one load-test run does: `LoadConfig`, and the checks that refuse a run that could not end by itself."""

from __future__ import annotations

import random
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal
from urllib.parse import urlsplit

Workload = Literal["classify", "infer", "generate", "chat"]
WORKLOADS: tuple[str, ...] = ("classify", "infer", "generate", "chat")
TEXT_WORKLOADS = ("generate", "chat")  # token-streaming workloads: TTFT, inter-token latency, tokens/s
DEFAULT_MODELS = {"classify": "digits_multimax", "infer": "digits_multimax", "generate": "text_multimax",
                  "chat": "text_multimax"}


class ConfigError(ValueError):
    """A run that cannot start: bad options, or a server that cannot be reached. The CLI exits 2 on it."""


@dataclass(frozen=True)
class IntRange:
    """Integers drawn uniformly from [lo, hi]; written `8:32`, or `16` for a fixed value."""

    lo: int
    hi: int

    @classmethod
    def parse(cls, text: str) -> IntRange:
        parts = text.split(":")
        try:
            lo, hi = (int(parts[0]), int(parts[0])) if len(parts) == 1 else (int(parts[0]), int(parts[1]))
        except (ValueError, IndexError):
            raise ConfigError(f"expected N or LO:HI (integers), got {text!r}") from None
        if len(parts) > 2 or lo < 1 or hi < lo:
            raise ConfigError(f"expected N or LO:HI with 1 <= LO <= HI, got {text!r}")
        return cls(lo, hi)

    def sample(self, rng: random.Random) -> int:
        return self.lo if self.lo == self.hi else rng.randint(self.lo, self.hi)

    def __str__(self) -> str:
        return str(self.lo) if self.lo == self.hi else f"{self.lo}:{self.hi}"


@dataclass
class LoadConfig:
    url: str = "http://127.0.0.1:8000"
    workload: Workload = "classify"
    model: str | None = None  # None: the demo model of the workload (DEFAULT_MODELS)
    # Load model: exactly one of concurrency (closed loop) and rate (open loop, requests/s).
    concurrency: int | None = None
    rate: float | None = None
    poisson: bool = False  # open loop: exponential gaps (Poisson arrivals) instead of constant spacing
    # Bounds: at least one; with both, whichever comes first ends the run.
    duration_s: float | None = None
    requests: int | None = None
    warmup_s: float = 0.0
    timeout_s: float = 30.0  # per request; also bounds the drain at the end of a run
    max_in_flight: int = 1024  # open loop: cap on outstanding requests (hits are counted and reported)
    seed: int = 0
    api_key: str | None = None  # sent as `Authorization: Bearer KEY` on every request (never written to files)
    # classify / infer
    images: Path | None = None  # directory of .png/.jpg; None: generated digit-like images
    batch: int = 1  # images per classify request (>1 sends JSON base64), rows of the V2 tensor
    top_k: int = 5
    # generate
    prompt_len: IntRange = field(default_factory=lambda: IntRange(8, 32))  # tokens (of `tokenizer`; bytes without)
    max_tokens: IntRange = field(default_factory=lambda: IntRange(16, 64))
    stream: bool = True
    temperature: float = 1.0
    ignore_eos: bool = False  # send ignore_eos (vLLM's name): every completion is exactly max_tokens long
    prompts_file: Path | None = None  # one prompt per line, used in turn (then prompt_len is ignored)
    tokenizer: Path | None = None  # tokenizer.json (or its folder): prompt lengths and output counts in its tokens
    system_prompt: str | None = None  # chat: a system message before each user message
    extra_body: dict[str, Any] | None = None  # generate / chat: fields merged into every request body
    # SLO (goodput): a request is good if it succeeded within slo_ms (and its first token within slo_ttft_ms)
    slo_ms: float | None = None
    slo_ttft_ms: float | None = None
    scrape_metrics: bool = True  # GET /metrics before and after the measured phase
    progress: bool = False  # live progress on stderr
    event_loop: Literal["auto", "asyncio", "uvloop"] = "auto"  # auto: uvloop when installed (keeps schedules better)
    keep_samples: bool = False  # keep every request's record on Result.samples (memory: ~250 bytes each)

    @property
    def model_name(self) -> str:
        return self.model or DEFAULT_MODELS[self.workload]

    @property
    def mode(self) -> str:
        return "closed" if self.concurrency is not None else "open"

    @property
    def load(self) -> float:
        return float(self.concurrency if self.concurrency is not None else self.rate)  # type: ignore[arg-type]

    def validate(self) -> LoadConfig:
        parts = urlsplit(self.url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ConfigError(f"--url must be http(s)://host[:port], got {self.url!r}")
        if self.workload not in WORKLOADS:
            raise ConfigError(f"workload must be one of {', '.join(WORKLOADS)}, got {self.workload!r}")
        if (self.concurrency is None) == (self.rate is None):
            raise ConfigError("give exactly one of concurrency (closed loop) and rate (open loop)")
        if self.concurrency is not None and self.concurrency < 1:
            raise ConfigError(f"concurrency must be >= 1, got {self.concurrency}")
        if self.rate is not None and not self.rate > 0:
            raise ConfigError(f"rate must be > 0 requests/s, got {self.rate}")
        if self.duration_s is None and self.requests is None:
            raise ConfigError("refusing to run unbounded: give a duration or a request count")
        if self.duration_s is not None and not 0 < self.duration_s <= 24 * 3600:
            raise ConfigError(f"duration must be in (0, 86400] s, got {self.duration_s}")
        if self.requests is not None and self.requests < 1:
            raise ConfigError(f"request count must be >= 1, got {self.requests}")
        if not 0 <= self.warmup_s <= 3600:
            raise ConfigError(f"warm-up must be in [0, 3600] s, got {self.warmup_s}")
        if not self.timeout_s > 0:
            raise ConfigError(f"timeout must be > 0 s, got {self.timeout_s}")
        if self.max_in_flight < 1:
            raise ConfigError(f"max in flight must be >= 1, got {self.max_in_flight}")
        if self.event_loop not in ("auto", "asyncio", "uvloop"):
            raise ConfigError(f"event loop must be auto, asyncio or uvloop, got {self.event_loop!r}")
        if self.batch < 1 or self.top_k < 1:
            raise ConfigError("batch and top_k must be >= 1")
        if self.images is not None and not Path(self.images).is_dir():
            raise ConfigError(f"--images: {self.images} is not a directory")
        if self.tokenizer is not None and not Path(self.tokenizer).exists():
            raise ConfigError(f"--tokenizer: {self.tokenizer} does not exist")
        if self.api_key is not None and (not self.api_key or any(c in self.api_key for c in "\r\n")):
            raise ConfigError("--api-key must be non-empty and on one line")
        if self.prompts_file is not None and not Path(self.prompts_file).is_file():
            raise ConfigError(f"--prompts: {self.prompts_file} is not a file")
        for name in ("slo_ms", "slo_ttft_ms"):
            value = getattr(self, name)
            if value is not None and not value > 0:
                raise ConfigError(f"{name} must be > 0, got {value}")
        return self

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["api_key"] = None if self.api_key is None else "(set)"  # a secret: never into results.json
        for key in ("images", "prompts_file", "tokenizer"):
            d[key] = None if d[key] is None else str(d[key])
        d["prompt_len"], d["max_tokens"] = str(self.prompt_len), str(self.max_tokens)
        d["model"] = self.model_name
        d["mode"] = self.mode
        return d
