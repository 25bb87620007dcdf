"""Server settings: one table of options, each settable on the command line or by environment variable.

The command line wins over the environment (`MULTIMAX_SERVE_<OPTION>`), which wins over the default,
so a container can be configured by environment alone and a person can still override one option.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from service.base.access_config import check_access

ENV_PREFIX = "MULTIMAX_SERVE_"
MAX_STREAM_INTERVAL_MS = 100.0  # longer would show as a stalled stream
SECRET_OPTIONS = ("api_key", "ssl_keyfile_password")  # --help shows no default, errors never show the value
BACKENDS = ("auto", "onnxruntime", "tensorrt", "torch")
DEVICES = ("auto", "cpu", "cuda")
LOG_FORMATS = ("text", "json")
MODEL_CONTROL = ("none", "explicit")  # Triton's --model-control-mode, without "poll"
# a Hugging Face folder: served on PyTorch at once and from its export once made in the background (auto), from its
# export made before it answers (wait), or as it is (off)
FOLDER_EXPORT = ("auto", "wait", "off")


def _default_model_dir() -> Path:
    import models  # not models.demo (DEMO_DIR): that imports torch, which `--help` should not wait for

    return Path(models.__file__).resolve().parent / "demo"


def default_export_cache() -> Path:
    """Where Hugging Face folders' exports are kept (service.engine.folder_export): the environment variable (read by
    Settings made in code too, as the tests' shared cache is), else $XDG_CACHE_HOME/multimax-serve/exports, else
    ~/.cache/multimax-serve/exports (beside the fused ops' build cache, plugins.ort_ops.build)."""
    given = os.environ.get(ENV_PREFIX + "EXPORT_CACHE", "").strip()
    if given:
        return Path(given)
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "multimax-serve" / "exports"


def default_folder_export() -> str:
    """--folder-export's default: the environment variable where it names a mode (read by Settings made in code too,
    as the export cache's is: the tests' session sets wait), else auto. A bad value is load_settings' error."""
    given = os.environ.get(ENV_PREFIX + "FOLDER_EXPORT", "").strip()
    return given if given in FOLDER_EXPORT else "auto"


def _bool(text: str) -> bool:
    value = text.strip().lower()
    if value in ("1", "true", "yes", "on"):
        return True
    if value in ("0", "false", "no", "off", ""):
        return False
    raise ValueError(f"expected a boolean (1/0, true/false, yes/no, on/off), got {text!r}")


SPINNING = ("off", "run", "always")


def _spinning(text: str) -> str:
    """`--ort-spinning`: off, run (threads spin inside a model call and stop when it returns) or always; the
    booleans it took before keep their meaning (true: always, false: off)."""
    value = text.strip().lower()
    if value in SPINNING:
        return value
    try:
        return "always" if _bool(value) else "off"
    except ValueError:
        raise ValueError(f"expected one of {', '.join(SPINNING)} (or a boolean), got {text!r}") from None


def _number_or_auto(expected: str) -> Callable[[str], float | None]:
    """A parser of a number, or auto (None: the setting's own choice): `--stream-interval-ms` (chosen by the cores
    the model leaves free, service.engine.text.delivery), `--folder-export-timeout-s` (by the folder's size,
    service.engine.folder_export.timeout_for)."""
    def parse(text: str) -> float | None:
        value = text.strip().lower()
        if value == "auto":
            return None
        try:
            return float(value)
        except ValueError:
            raise ValueError(f"expected {expected} or auto, got {text!r}") from None
    parse.__name__ = f"{expected} or auto"  # argparse: "invalid milliseconds or auto value: 'soon'"
    return parse


_interval = _number_or_auto("milliseconds")
_export_timeout = _number_or_auto("seconds (0: no limit)")


def _names(text: str) -> tuple[str, ...]:
    return tuple(n.strip() for n in text.split(",") if n.strip())


class BlankValue(ValueError, argparse.ArgumentTypeError):
    """A protection option given with an empty or blank value (argparse shows the message as it is)."""


def _nonblank(parse: Callable[[str], Any]) -> Callable[[str], Any]:
    """`parse` for an option whose empty value would turn a protection off (no API key, no TLS, CORS with
    nothing in it): such a value is a mistake (an unset shell variable, a stray comma), never "off"."""
    def parse_nonblank(text: str) -> Any:
        value = parse(text) if text.strip() else None
        if value is None or value == ():
            raise BlankValue("empty or blank value: it would turn a protection off; leave the option out "
                             "(or give a real value)")
        return value
    return parse_nonblank


@dataclass(frozen=True)
class Settings:
    """Everything `create_app` needs; the defaults serve the shipped demo models on localhost."""

    host: str = "127.0.0.1"
    port: int = 8000
    model_dir: Path = field(default_factory=_default_model_dir)
    models: tuple[str, ...] = ()  # empty: every model found in model_dir
    backend: str = "auto"
    # A Hugging Face folder under --backend auto/onnxruntime: exported once (validated) into export_cache and served
    # from there on ONNX Runtime (service.engine.folder_export), in the background while PyTorch serves it (auto) or
    # before it answers (wait); "off", or --backend torch: served as it is, on PyTorch
    folder_export: str = field(default_factory=default_folder_export)
    export_cache: Path = field(default_factory=default_export_cache)
    folder_export_timeout_s: float | None = None  # None: by the folder's size; 0: no limit
    device: str = "auto"
    torch_compile: bool = False
    intra_op_threads: int = 0  # 0: the runtime's default (one per physical core)
    inter_op_threads: int = 0
    ort_providers: tuple[str, ...] = ()  # empty: probe the machine (TensorRT, CUDA, CPU)
    # ORT's pool threads busy-wait for work inside a model call, and stop when it returns ("run"): the call gets
    # spinning's speed, the event loop its core between calls ("always": spin between calls too; "off": never)
    ort_spinning: str = "run"
    trt_plugin_lib: str = ""
    # Classification: dynamic batching and admission control.
    max_batch_size: int = 16
    max_queue_delay_ms: float = 0.0  # 0: no waiting; batches still form from what arrives during a model call
    max_queue_size: int = 256
    request_timeout_s: float = 30.0
    max_body_bytes: int = 16 * 1024 * 1024
    max_json_bytes: int = 1024 * 1024  # JSON is parsed on the event loop: this bounds how long one parse takes
    # None: follows each model's input size (service.engine.tasks.vision.image_pixel_limit); the request budget:
    # 4 images'
    max_image_pixels: int | None = None
    max_request_pixels: int | None = None
    decode_threads: int = field(default_factory=lambda: max(1, min(4, os.cpu_count() or 1)))
    min_image_side: int = 8
    max_images_per_request: int = 64
    # Generation: continuous batching.
    max_running_sequences: int = 16
    max_waiting_sequences: int = 256
    default_max_tokens: int = 16
    max_prompts_per_request: int = 16
    max_choices_per_request: int = 16  # sequences one completion request generates: prompts x best_of (or n)
    # The decode loop hands its tokens to the event loop at most this often (each stream still sends one event per
    # step, several steps' events in one write): fewer wake-ups and socket writes a token, tokens later by up to this
    # (a sequence's first token and its end never wait); None: auto, by the cores the model's threads leave free
    # (service.engine.text.delivery)
    stream_interval_ms: float | None = None
    # A prompt longer than this that arrives while other sequences decode is prefilled this many tokens a step,
    # between their decode steps (chunked prefill), so it holds each of their steps up for one chunk's time instead
    # of the whole prompt's; 0: prompts are prefilled whole
    prefill_chunk_tokens: int = 512
    # KV cache kept per text model for prompts that start as recent ones did (a chat's system prompt, its earlier
    # turns), which are then prefilled from where that part ends; least recently used first out; 0: off
    prefix_cache_mb: float = 256.0
    # Slow clients: a connection must deliver its request headers, and then its body, within these.
    header_timeout_s: float = 10.0
    body_timeout_s: float = 60.0
    idle_timeout_s: float = 10.0  # a connection that sends nothing is closed after this
    max_connections: int = 1000  # open connections; beyond, requests other than health probes get 503
    max_model_bytes: int = 16 * 1024**3  # a model file larger than this is not loaded (its reason says so)
    # Process.
    graceful_timeout_s: float = 30.0
    log_level: str = "info"
    access_log: bool = False
    # Tracing and access control (service.edge.access, service.edge.auth, service.base.tracing; docs/SERVICE.md).
    log_format: str = "text"
    otlp_endpoint: str = ""  # empty: no tracing
    api_key: tuple[str, ...] = field(default=(), repr=False)  # never shown, never logged
    api_key_file: str = ""
    auth_health: bool = False  # health and readiness need the key too
    auth_metrics: bool = False
    cors_allow_origins: tuple[str, ...] = ()  # empty: no CORS headers (browsers keep cross-origin pages out)
    cors_allow_methods: tuple[str, ...] = ("GET", "POST")
    cors_allow_headers: tuple[str, ...] = ("Authorization", "Content-Type", "X-Request-Id")
    cors_allow_credentials: bool = False
    ssl_certfile: str = ""
    ssl_keyfile: str = ""
    ssl_keyfile_password: str = field(default="", repr=False)
    # api_key and api_key_file's keys together, read once here (a missing file is an error at start, exit 2)
    api_keys: tuple[str, ...] = field(default=(), init=False, repr=False, compare=False)
    # Hostile input on the LLM routes (docs/SERVICE.md, "Hostile input"). A structured-output grammar is measured
    # before anything compiles it (service.protocols.grammar_limits): its text, its nesting counted through its
    # $refs (or a grammar's longest chain of rules), a guided_choice list, a regex's counted repetitions; then it is
    # compiled in worker processes (service.protocols.grammar_guard), so that one that crashes llguidance's native
    # compiler or runs too long costs only its own request.
    max_grammar_bytes: int = 64 * 1024
    max_grammar_depth: int = 128  # llguidance's compiler overflowed its 8 MiB stack from ~2,200 such levels
    max_guided_choices: int = 1000  # llguidance's parser refuses more than 2,000 alternatives at one position
    max_regex_repeat: int = 10_000  # a{200000}'s first token mask alone took 0.5 s; a{1000000} fails at token 2
    grammar_timeout_s: float = 10.0
    grammar_workers: int = 2
    # KServe infer: a text model's logits as JSON (a float takes up to 25 bytes there); more needs binary_data
    max_kserve_json_output_bytes: int = 64 * 1024**2
    # Models that change while the server runs (warm-up, versions, the repository API).
    warmup_calls: int = 1  # each representative warm-up call runs this often at load; 0: no warm-up
    warmup_budget_s: float = 10.0  # a model's warm-up stops starting calls past this (0: no limit)
    model_control: str = "none"  # "explicit": POST /v2/repository/models/{m}/load and /unload are allowed

    def __post_init__(self) -> None:
        if self.backend not in BACKENDS:
            raise ValueError(f"backend must be one of {', '.join(BACKENDS)}, got {self.backend!r}")
        if self.ort_spinning not in SPINNING:
            raise ValueError(f"ort_spinning must be one of {', '.join(SPINNING)}, got {self.ort_spinning!r}")
        if self.folder_export not in FOLDER_EXPORT:
            raise ValueError(f"folder_export must be one of {', '.join(FOLDER_EXPORT)}, got {self.folder_export!r}")
        if self.model_control not in MODEL_CONTROL:
            raise ValueError(f"model_control must be one of {', '.join(MODEL_CONTROL)}, got {self.model_control!r}")
        if self.device not in DEVICES:
            raise ValueError(f"device must be one of {', '.join(DEVICES)}, got {self.device!r}")
        if not 0 < self.port < 65536:
            raise ValueError(f"port must be in 1..65535, got {self.port}")
        positive = ("max_batch_size", "max_queue_size", "max_body_bytes", "max_json_bytes", "max_image_pixels",
                    "max_request_pixels", "decode_threads",
                    "min_image_side", "max_images_per_request", "max_running_sequences", "max_waiting_sequences",
                    "max_prompts_per_request", "max_choices_per_request", "max_connections", "max_model_bytes",
                    "max_grammar_bytes", "max_grammar_depth", "max_guided_choices", "max_regex_repeat",
                    "grammar_workers", "max_kserve_json_output_bytes")
        values = vars(self)  # the fields by name
        for name in positive:
            if values[name] is not None and int(values[name]) < 1:
                raise ValueError(f"{name} must be at least 1, got {values[name]}")
        for name in ("max_queue_delay_ms", "intra_op_threads", "inter_op_threads", "default_max_tokens",
                     "warmup_calls", "prefill_chunk_tokens", "prefix_cache_mb"):
            if values[name] < 0:
                raise ValueError(f"{name} must not be negative, got {values[name]}")
        if not 0 <= self.warmup_budget_s < math.inf:
            raise ValueError(f"warmup_budget_s must be 0 (no limit) or positive seconds, got {self.warmup_budget_s}")
        if self.folder_export_timeout_s is not None and not 0 <= self.folder_export_timeout_s < math.inf:
            raise ValueError(f"folder_export_timeout_s must be 0 (no limit) or positive seconds, got "
                             f"{self.folder_export_timeout_s}")
        if self.stream_interval_ms is not None and not 0 <= self.stream_interval_ms <= MAX_STREAM_INTERVAL_MS:
            raise ValueError(f"stream_interval_ms must be in 0..{MAX_STREAM_INTERVAL_MS:g}, got "
                             f"{self.stream_interval_ms}")
        for name in ("request_timeout_s", "graceful_timeout_s", "header_timeout_s", "body_timeout_s",
                     "idle_timeout_s", "grammar_timeout_s"):
            if values[name] <= 0:
                raise ValueError(f"{name} must be positive, got {values[name]}")
        if self.log_format not in LOG_FORMATS:
            raise ValueError(f"log_format must be one of {', '.join(LOG_FORMATS)}, got {self.log_format!r}")
        object.__setattr__(self, "api_keys", check_access(self))  # TLS, key file and tracing checks

    def replace(self, **changes: Any) -> Settings:
        return dataclasses.replace(self, **changes)


@dataclass(frozen=True)
class _Option:
    name: str  # Settings field
    parse: Callable[[str], Any]
    help: str
    metavar: str | None = None
    choices: Sequence[str] | None = None
    repeat: bool = False  # may be given several times on the command line (each a comma list); values add up


OPTIONS: tuple[_Option, ...] = (
    _Option("host", str, "interface to bind", "HOST"),
    _Option("port", int, "TCP port", "PORT"),
    _Option("model_dir", Path, "directory of models to serve: .onnx (ONNX Runtime), .engine/.plan (TensorRT), "
            ".pt (PyTorch); the name of a model is its file name without the suffix", "DIR"),
    _Option("models", _names, "comma-separated model names to serve (default: all in the directory)", "NAMES"),
    _Option("backend", str, "backend for models with several files: auto prefers .onnx, then .pt, then an engine",
            choices=BACKENDS),
    _Option("folder_export", str, "a Hugging Face model folder, with --backend auto or onnxruntime: auto serves it on "
            "PyTorch at once and exports it in the background (validated against PyTorch, kept in --export-cache), "
            "then serves the export on ONNX Runtime (in-flight requests finish on PyTorch); wait exports it before "
            "the model answers; off serves the folder itself on PyTorch (as --backend torch does)",
            choices=FOLDER_EXPORT),
    _Option("export_cache", Path, "directory of the Hugging Face folders' exports, keyed by the folders' content "
            "(safe to delete: an entry is made again on the next load)", "DIR"),
    _Option("folder_export_timeout_s", _export_timeout, "the longest a folder's export on first load may run before "
            "it is stopped and the folder served on PyTorch (recorded: a later load with a longer limit tries again); "
            "auto: 600 s plus 1 s per MB of the folder; 0: no limit", "S"),
    _Option("device", str, "device for the PyTorch backend", choices=DEVICES),
    _Option("torch_compile", _bool, "run PyTorch models through torch.compile", "BOOL"),
    _Option("intra_op_threads", int, "threads inside one operator (0: runtime default)", "N"),
    _Option("inter_op_threads", int, "threads across operators (0: runtime default)", "N"),
    _Option("ort_providers", _names, "ONNX Runtime execution providers in order (default: probe the machine)",
            "NAMES"),
    _Option("ort_spinning", _spinning, "ONNX Runtime's pool threads busy-wait for work: inside a model call only "
            "(run), also between calls (always: takes CPU from the event loop), or never (off)", "MODE"),
    _Option("trt_plugin_lib", str, "shared library with the MultiMax TensorRT plugin", "PATH"),
    _Option("max_batch_size", int, "classification: largest batch one model call takes", "N"),
    _Option("max_queue_delay_ms", float, "classification: how long a batch may wait to fill once the model is idle "
            "(0: start at once; requests arriving during a model call form the next batch)",
            "MS"),
    _Option("max_queue_size", int, "requests waiting per model before new ones get 429", "N"),
    _Option("request_timeout_s", float, "per-request deadline (a request still queued then gets 504)", "S"),
    _Option("max_body_bytes", int, "largest request body (413 beyond)", "BYTES"),
    _Option("max_json_bytes", int, "largest JSON body (or KServe JSON header); bounds the time one parse takes "
            "(413 beyond)", "BYTES"),
    _Option("max_image_pixels", int, "largest image (width x height) that is decoded (default: 256 x the model's "
            "resize side squared, within 4,000,000..40,000,000)", "PIXELS"),
    _Option("max_request_pixels", int, "pixels of all the images of one request, counted from their headers "
            "before any is decoded (default: 4 x max_image_pixels)", "PIXELS"),
    _Option("decode_threads", int, "threads that decode images, shared fairly between requests", "N"),
    _Option("min_image_side", int, "smallest image side accepted", "PIXELS"),
    _Option("max_images_per_request", int, "images in one classification request", "N"),
    _Option("max_running_sequences", int, "generation: sequences decoded together (continuous batch size)", "N"),
    _Option("max_waiting_sequences", int, "generation: sequences waiting for a slot before new ones get 429", "N"),
    _Option("default_max_tokens", int, "generation: max_tokens when a request gives none (OpenAI: 16)", "N"),
    _Option("max_prompts_per_request", int, "generation: prompts in one /v1/completions request", "N"),
    _Option("max_choices_per_request", int, "generation: sequences one /v1/completions request generates "
            "(prompts x best_of, or x n)", "N"),
    _Option("stream_interval_ms", _interval, "generation: the decode loop hands its tokens to the streams at most "
            "this often; each stream still gets one event per step, several steps' events in one write (fewer "
            "wake-ups and socket writes a token, each token later by up to this; a sequence's first token and its "
            "end go at once); auto: 20 where the model's threads take every core, else 1", "MS"),
    _Option("prefill_chunk_tokens", int, "generation: a prompt longer than this arriving while other sequences "
            "decode is prefilled this many tokens a step, between their steps (0: whole prompts)", "N"),
    _Option("prefix_cache_mb", float, "generation: MiB of KV cache kept per model for prompts' shared starts (a "
            "system prompt, earlier turns), reused by prompts that start the same way; LRU; 0: off", "MB"),
    _Option("header_timeout_s", float, "a connection must send a request's headers within this (else closed)", "S"),
    _Option("body_timeout_s", float, "a request's body must arrive within this (else 408)", "S"),
    _Option("idle_timeout_s", float, "a connection that sends nothing is closed after this", "S"),
    _Option("max_connections", int, "open connections; beyond, every request but a health probe gets 503 and the "
            "connection is closed", "N"),
    _Option("graceful_timeout_s", float, "on SIGTERM/SIGINT: how long in-flight work may take to finish", "S"),
    _Option("log_level", str, "logging level", choices=("critical", "error", "warning", "info", "debug")),
    _Option("access_log", _bool, "log every request (method, path, status, durations, model, request id)", "BOOL"),
    # Tracing and access control.
    _Option("log_format", str, "log lines as text, or one JSON object per line", choices=LOG_FORMATS),
    _Option("otlp_endpoint", str, "send OpenTelemetry traces (one span per request) to this OTLP/HTTP endpoint, "
            "e.g. http://127.0.0.1:4318/v1/traces; needs the otel extra (empty: off)", "URL"),
    _Option("api_key", _nonblank(_names), "require `Authorization: Bearer KEY` with one of these keys (repeatable; "
            "the "
            "environment variable takes a comma list); never logged", "KEY", repeat=True),
    _Option("api_key_file", _nonblank(str), "file of API keys, one per line (# comments and blank lines ignored)",
            "PATH"),
    _Option("auth_health", _nonblank(_bool), "with API keys: health and readiness need a key too", "BOOL"),
    _Option("auth_metrics", _nonblank(_bool), "with API keys: /metrics needs a key too", "BOOL"),
    _Option("cors_allow_origins", _nonblank(_names), "CORS: comma-separated origins allowed to call from a browser, "
            "or * (not given: CORS off)", "ORIGINS"),
    _Option("cors_allow_methods", _nonblank(_names), "CORS: allowed methods", "METHODS"),
    _Option("cors_allow_headers", _nonblank(_names), "CORS: allowed request headers", "HEADERS"),
    _Option("cors_allow_credentials", _bool, "CORS: allow credentialed requests (cookies; not needed for "
            "bearer keys; not with origin *)", "BOOL"),
    _Option("ssl_certfile", _nonblank(str), "TLS: certificate file (PEM, chain first) -- serve HTTPS", "PATH"),
    _Option("ssl_keyfile", _nonblank(str), "TLS: private key file (PEM)", "PATH"),
    _Option("ssl_keyfile_password", _nonblank(str), "TLS: password of an encrypted key file (prefer the environment "
            "variable: the command line is visible to other users)", "PASSWORD"),
    _Option("max_model_bytes", int, "a model file larger than this is not loaded (listed with the reason)",
            "BYTES"),
    _Option("max_grammar_bytes", int, "structured output: largest JSON schema (as JSON text), regex, grammar or "
            "guided_choice list (all choices together); 400 beyond, before anything compiles it", "BYTES"),
    _Option("max_grammar_depth", int, "structured output: deepest JSON schema nesting, counting each $ref as the "
            "levels it leads to, and longest chain of rules a Lark/GBNF grammar calls through; 400 beyond", "N"),
    _Option("max_guided_choices", int, "structured output: strings in one guided_choice list (400 beyond)", "N"),
    _Option("max_regex_repeat", int, "structured output: largest counted repetition in a regex (guided_regex, a "
            "schema's pattern, a grammar's regexes), nested counts multiplied: (a{100}){100} counts 10,000 (400 "
            "beyond)", "N"),
    _Option("grammar_timeout_s", float, "structured output: how long a grammar may take to compile and to give its "
            "first tokens in a worker process (400 beyond; the worker is replaced)", "S"),
    _Option("grammar_workers", int, "structured output: worker processes that compile grammars first, so that a "
            "grammar that crashes or stalls the compiler costs only its own request", "N"),
    _Option("max_kserve_json_output_bytes", int, "KServe infer on a text model: largest JSON output, counted as 25 "
            "bytes a value before the model runs (400 beyond; binary_data output has no such limit)", "BYTES"),
    _Option("warmup_calls", int, "at load, run each representative warm-up call (every batch size bucket; prefill and "
            "decode steps) this many times before the model is ready (0: no warm-up)", "N"),
    _Option("warmup_budget_s", float, "at load, start no more warm-up calls once a model's warm-up has run this long "
            "(0: no limit; prompts are at most 256 tokens and, on a CPU, batches at most 2 rows)", "S"),
    _Option("model_control", str, "explicit: POST /v2/repository/models/{m}/load and /unload (re)load and unload "
            "models while serving (Triton's --model-control-mode); none: the models of startup, fixed",
            choices=MODEL_CONTROL),
)


def env_name(option: str) -> str:
    return ENV_PREFIX + option.upper()


def build_parser() -> argparse.ArgumentParser:
    defaults = Settings()
    parser = argparse.ArgumentParser(
        prog="python -m service",
        description="Serve every model in a directory: image classification and text generation over HTTP "
        "(OpenAI completions, KServe V2 / Triton protocol, Prometheus metrics).",
        epilog=f"Every option can also be set by environment variable {ENV_PREFIX}<OPTION> "
        f"(e.g. {env_name('port')}=9000); the command line wins.",
    )
    default_values = vars(defaults)
    for opt in OPTIONS:
        default = default_values[opt.name]
        shown = ",".join(default) if isinstance(default, tuple) else "auto" if default is None else default
        kwargs: dict[str, Any] = {"dest": opt.name, "help": f"{opt.help} [env {env_name(opt.name)}; default {shown!s}]"}
        if opt.choices:
            kwargs["choices"] = opt.choices
        else:
            kwargs["metavar"] = opt.metavar
        if opt.repeat:
            kwargs["action"] = "append"
        if opt.name in SECRET_OPTIONS:
            kwargs["help"] = f"{opt.help} [env {env_name(opt.name)}]"
        parser.add_argument("--" + opt.name.replace("_", "-"), type=opt.parse, **kwargs)
    return parser


def load_settings(argv: Sequence[str] | None = None, environ: Mapping[str, str] | None = None,
                  parser: argparse.ArgumentParser | None = None) -> Settings:
    """Settings from defaults, then environment, then command line; exits 2 with one line on bad values.
    `parser`: build_parser()'s parser with more options added (another entry point, e.g. service.ray)."""
    environ = os.environ if environ is None else environ
    parser = parser or build_parser()
    given = vars(parser.parse_args(argv))  # the parsed options by name
    values: dict[str, Any] = {}
    for opt in OPTIONS:
        cli = given[opt.name]
        if cli is not None and opt.repeat:
            cli = tuple(v for part in cli for v in part)  # --api-key a --api-key b,c: (a, b, c)
        if cli is not None:
            values[opt.name] = cli
        elif env_name(opt.name) in environ:
            raw = environ[env_name(opt.name)]
            try:
                values[opt.name] = opt.parse(raw)
            except ValueError as exc:
                shown = "" if opt.name in SECRET_OPTIONS else f"={raw!r}"  # a secret is never echoed
                parser.error(f"{env_name(opt.name)}{shown}: {exc}")
            if opt.choices and values[opt.name] not in opt.choices:
                parser.error(f"{env_name(opt.name)}={raw!r}: choose from {', '.join(opt.choices)}")
    try:
        return Settings(**values)
    except ValueError as exc:
        parser.error(str(exc))
        raise  # unreachable: parser.error exits
