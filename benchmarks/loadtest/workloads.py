"""What each request of a workload sends: `RequestSpec`s for classify, V2 infer and text generation.

Bodies of the image workloads are built once, up front, and cycled through: the generator should spend its
CPU on HTTP, not on encoding. Generation draws each request's prompt and output lengths from a seeded RNG, so
two runs with the same seed send the same requests.
"""

from __future__ import annotations

import base64
import json
import random
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import quote

from benchmarks.loadtest.config import ConfigError, LoadConfig
from benchmarks.loadtest.images import generate_images, load_images
from benchmarks.loadtest.tokens import load_counter

JSON = {"Content-Type": "application/json"}

# Prompt text: English-like, ASCII (one byte = one token for the byte-level demo model).
_CORPUS = (
    "the quick brown fox jumps over the lazy dog while the model computes attention over every token in its "
    "context and the server batches requests from many clients to keep the processor busy and the latency low "
    "a load test measures how the latency distribution changes as the offered load grows until the queue fills "
    "and requests begin to wait longer than they compute at which point more load only adds delay "
)


@dataclass(frozen=True, slots=True)
class RequestSpec:
    method: str
    path: str  # relative to the base URL, with the query string
    body: bytes | None = None
    headers: dict[str, str] = field(default_factory=dict)
    stream: bool = False  # an SSE response to time token by token
    prompt_tokens: int = 0
    max_tokens: int = 0
    # Output tokens of a text when the server sends no usage (the served model's tokenizer; None: chunks)
    count_tokens: Callable[[str], int] | None = None


class Workload:
    name = "base"

    def request(self, i: int) -> RequestSpec:
        raise NotImplementedError


class Cycle(Workload):
    """Prebuilt requests, request i sends specs[i % len(specs)]."""

    def __init__(self, name: str, specs: list[RequestSpec]) -> None:
        self.name, self.specs = name, specs

    def request(self, i: int) -> RequestSpec:
        return self.specs[i % len(self.specs)]


def classify_workload(cfg: LoadConfig) -> Workload:
    images = load_images(cfg.images) if cfg.images is not None else generate_images(32, seed=cfg.seed)
    path = f"/v1/models/{quote(cfg.model_name, safe='')}/classify?top_k={cfg.top_k}"
    if cfg.batch == 1:
        specs = [RequestSpec("POST", path, data, {"Content-Type": ctype}) for data, ctype in images]
    else:  # several images per request: the JSON form
        specs = []
        for i in range(len(images)):
            group = [images[(i + j) % len(images)][0] for j in range(cfg.batch)]
            body = json.dumps({"images": [base64.b64encode(b).decode() for b in group]}).encode()
            specs.append(RequestSpec("POST", path, body, JSON))
    return Cycle("classify", specs)


def _tensor_data(datatype: str, count: int, rng: random.Random) -> list[Any]:
    if datatype.startswith("FP"):
        return [round(rng.random(), 4) for _ in range(count)]
    if datatype == "BOOL":
        return [rng.random() < 0.5 for _ in range(count)]
    if datatype.startswith(("INT", "UINT")):
        return [rng.randrange(0, 10) for _ in range(count)]
    raise ConfigError(f"infer: cannot generate data of type {datatype} (use FP*, INT*, UINT* or BOOL)")


def infer_workload(cfg: LoadConfig, metadata: dict[str, Any] | None, bodies: int = 8) -> Workload:
    """KServe V2 JSON requests; the input's name, type and shape come from the model's metadata
    (GET /v2/models/{m}) when the server gives it, with -1 dimensions set to 1 (the first to `batch`)."""
    name, datatype, shape = "pixel_values", "FP32", [-1, 1, 32, 32]
    if metadata and isinstance(metadata.get("inputs"), list) and metadata["inputs"]:
        first = metadata["inputs"][0]
        name, datatype, shape = first.get("name", name), first.get("datatype", datatype), first.get("shape", shape)
    dims = [cfg.batch if (i == 0 and d == -1) else (1 if d == -1 else int(d)) for i, d in enumerate(shape)]
    count = 1
    for d in dims:
        count *= d
    rng = random.Random(cfg.seed)
    path = f"/v2/models/{quote(cfg.model_name, safe='')}/infer"
    specs = []
    for _ in range(bodies):
        data = _tensor_data(datatype, count, rng)
        body = {"inputs": [{"name": name, "shape": dims, "datatype": datatype, "data": data}]}
        specs.append(RequestSpec("POST", path, json.dumps(body, separators=(",", ":")).encode(), JSON))
    return Cycle("infer", specs)


class GenerateWorkload(Workload):
    """OpenAI text completions. Prompt lengths are in the tokens of `--tokenizer` (bytes without one): a slice
    of the corpus's token ids, decoded."""

    name = "generate"
    path = "/v1/completions"

    def __init__(self, cfg: LoadConfig) -> None:
        self.cfg = cfg
        self.counter = load_counter(cfg.tokenizer)
        self.prompts: list[str] | None = None
        if cfg.prompts_file is not None:
            self.prompts = [line for line in Path(cfg.prompts_file).read_text().splitlines() if line.strip()]
            if not self.prompts:
                raise ConfigError(f"--prompts: {cfg.prompts_file} has no non-empty lines")
        self._period = max(1, len(self.counter.encode(_CORPUS)))  # token ids of one copy of the corpus
        copies = cfg.prompt_len.hi // self._period + 2
        self._ids = self.counter.encode(_CORPUS * copies)
        counter = self.counter
        self._count: Callable[[str], int] = lambda text: len(counter.encode(text))

    def prompt(self, i: int, rng: random.Random) -> str:
        if self.prompts is not None:
            return self.prompts[i % len(self.prompts)]
        length = self.cfg.prompt_len.sample(rng)
        start = rng.randrange(self._period)
        return self.counter.decode(self._ids[start:start + length])

    def body(self, prompt: str) -> dict[str, Any]:
        return {"prompt": prompt}

    def request(self, i: int) -> RequestSpec:
        cfg = self.cfg
        rng = random.Random(cfg.seed * 1_000_003 + i)  # per request: independent of the order requests are built
        prompt = self.prompt(i, rng)
        max_tokens = cfg.max_tokens.sample(rng)
        body: dict[str, Any] = {"model": cfg.model_name, **self.body(prompt), "max_tokens": max_tokens,
                                "temperature": cfg.temperature, "top_p": 1.0, "seed": i, "stream": cfg.stream}
        if cfg.ignore_eos:
            body["ignore_eos"] = True
        body.update(cfg.extra_body or {})
        if cfg.stream:
            body["stream_options"] = {"include_usage": True}  # exact token counts even if chunks coalesce
        return RequestSpec("POST", self.path, json.dumps(body).encode(), JSON, stream=cfg.stream,
                           prompt_tokens=self._count(prompt), max_tokens=max_tokens, count_tokens=self._count)


class ChatWorkload(GenerateWorkload):
    """OpenAI chat completions: the prompt as one user message (after `--system-prompt`, if given); the server's
    chat template adds its own tokens, which the server's usage counts and the prompt length here does not."""

    name = "chat"
    path = "/v1/chat/completions"

    def body(self, prompt: str) -> dict[str, Any]:
        system = [{"role": "system", "content": self.cfg.system_prompt}] if self.cfg.system_prompt else []
        return {"messages": [*system, {"role": "user", "content": prompt}]}


def build_workload(cfg: LoadConfig, metadata: dict[str, Any] | None = None) -> Workload:
    if cfg.workload == "classify":
        return classify_workload(cfg)
    if cfg.workload == "infer":
        return infer_workload(cfg, metadata)
    if cfg.workload == "chat":
        return ChatWorkload(cfg)
    return GenerateWorkload(cfg)
