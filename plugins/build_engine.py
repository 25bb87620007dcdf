"""`python -m plugins.build_engine MODEL.onnx`: a TensorRT engine in which every MultiMax node is the plugin.

The exported nodes carry an ONNX function body (the elementwise chain) for runtimes without the
plugin. TensorRT must not fall back to it silently: the builder registers the plugins, sets the parser
flag that lets a registered plugin win over a local function (ENABLE_PLUGIN_OVERRIDE, TensorRT >=
10.15; the nodes' `plugin_namespace` attribute does the same on parsers that look for it), drops the
multimax function bodies for older parsers, which import local functions before plugins, and then
checks that the network holds one plugin layer per MultiMax node.

Exit codes: 0 built, 1 the network lost MultiMax plugin layers, 2 bad input or no TensorRT / GPU.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import onnx

from models.atomic import publish, staging_dir
from models.onnx_contract import ONNX_DOMAIN, proto_props, read_metadata
from models.spec import ModelSpec, TextSpec
from models.spec import from_dict as spec_from_dict

DEFAULT_WORKSPACE_GIB = 4
DEFAULT_MAX_SEQ = 1024


class BuildError(RuntimeError):
    """An engine that cannot be built as asked; one line for the user (exit code 2)."""


class PluginFallbackError(AssertionError):
    """The network has fewer MultiMax plugin layers than the model has MultiMax nodes (exit code 1)."""


@dataclass(frozen=True)
class Profile:
    """One optimisation profile: (min, opt, max) for the batch axis and, for text, the sequence axes."""

    batch: tuple[int, int, int] = (1, 8, 64)
    seq: tuple[int, int, int] | None = None

    def __post_init__(self) -> None:
        for name, dims in (("batch", self.batch), ("seq", self.seq)):
            if dims is not None and not (1 <= dims[0] <= dims[1] <= dims[2]):
                raise BuildError(f"{name} profile must satisfy 1 <= min <= opt <= max, got {dims}")


def multimax_nodes(model: onnx.ModelProto) -> list[onnx.NodeProto]:
    """The MultiMax nodes TensorRT must turn into plugins: main graph and control-flow subgraphs."""

    def walk(graph: onnx.GraphProto) -> Iterable[onnx.NodeProto]:
        for node in graph.node:
            if node.domain == ONNX_DOMAIN:
                yield node
            for attr in node.attribute:
                for sub in [attr.g] if attr.HasField("g") else list(attr.graphs):
                    yield from walk(sub)

    return list(walk(model.graph))


def _load(onnx_path: Path) -> onnx.ModelProto:
    if not onnx_path.is_file():
        raise BuildError(f"{onnx_path}: no such file")
    try:
        return onnx.load(str(onnx_path), load_external_data=False)
    except Exception as exc:  # protobuf raises DecodeError and friends: all mean "not an ONNX model"
        raise BuildError(f"{onnx_path}: not an ONNX model ({type(exc).__name__})") from None


def require_tensorrt() -> Any:
    """The tensorrt module, or BuildError saying why TensorRT cannot build engines here."""
    from plugins.trt_plugin import tensorrt_unavailable

    why = tensorrt_unavailable()
    if why:
        raise BuildError(why)
    import tensorrt as trt

    return trt


def _without_plugin_functions(model: onnx.ModelProto) -> onnx.ModelProto:
    """A copy without the multimax FunctionProtos: old parsers import a local function before a plugin."""
    stripped = onnx.ModelProto()
    stripped.CopyFrom(model)
    kept = [f for f in stripped.functions if f.domain != ONNX_DOMAIN]
    del stripped.functions[:]
    stripped.functions.extend(kept)
    return stripped


def count_plugin_layers(trt: Any, network: Any) -> int:
    """PLUGIN_V3 layers of the multimax namespace (all PLUGIN_V3 layers where the namespace is unreadable)."""
    count = 0
    for i in range(network.num_layers):
        layer = network.get_layer(i)
        if layer.type != trt.LayerType.PLUGIN_V3:
            continue
        try:
            layer.__class__ = trt.IPluginV3Layer  # get_layer returns the base class
            core = layer.plugin.get_capability_interface(trt.PluginCapabilityType.CORE)
            namespace = core.plugin_namespace
        except Exception:
            namespace = ONNX_DOMAIN
        count += namespace == ONNX_DOMAIN
    return count


def _dims_profile(dims: Sequence[int], profile: Profile, default_seq: int) -> tuple[tuple[int, ...], ...]:
    """(min, opt, max) shapes for one network input: axis 0 is the batch, other dynamic axes the sequence."""
    shapes: list[list[int]] = [[], [], []]
    for axis, extent in enumerate(dims):
        if extent >= 0:
            triple: tuple[int, int, int] = (extent, extent, extent)
        elif axis == 0:
            triple = profile.batch
        else:
            triple = profile.seq or (1, min(128, default_seq), default_seq)
        for k in range(3):
            shapes[k].append(triple[k])
    return tuple(tuple(s) for s in shapes)


def _default_seq(model: onnx.ModelProto) -> int:
    """The model's context length from the exporter's metadata (its spec), else DEFAULT_MAX_SEQ."""
    try:
        meta = read_metadata(proto_props(model))
        if meta.spec is not None:  # read without torch
            spec: ModelSpec = spec_from_dict(meta.spec)
        else:  # a file from before the spec key: the compatibility reader (needs the architectures, so torch)
            from models.registry import read_spec

            spec = read_spec(meta)
    except (ValueError, TypeError, AttributeError):
        return DEFAULT_MAX_SEQ
    return spec.context_length if isinstance(spec, TextSpec) else DEFAULT_MAX_SEQ


def build_engine(
    onnx_path: str | os.PathLike[str],
    out: str | os.PathLike[str] | None = None,
    fp16: bool = False,
    profiles: Sequence[Profile] = (Profile(),),
    workspace_gib: float = DEFAULT_WORKSPACE_GIB,
    verbose: bool = False,
) -> Path:
    """Build (and write atomically) a serialised engine for `onnx_path`; returns its path.

    Raises BuildError for bad input / missing TensorRT or GPU, PluginFallbackError when a MultiMax node
    did not become a plugin layer.
    """
    onnx_path = Path(onnx_path)
    model = _load(onnx_path)
    out_path = Path(out) if out is not None else onnx_path.with_suffix(".engine")
    if not out_path.parent.is_dir():
        raise BuildError(f"cannot write {out_path}: directory {out_path.parent} does not exist")
    trt = require_tensorrt()
    expected = len(multimax_nodes(model))

    from plugins.trt_plugin import register

    try:
        register()
    except RuntimeError as exc:  # e.g. a TensorRT without ahead-of-time Python plugins
        raise BuildError(str(exc)) from None
    logger = trt.Logger(trt.Logger.VERBOSE if verbose else trt.Logger.WARNING)
    builder = trt.Builder(logger)
    flags = 0
    prefer_aot = getattr(trt.NetworkDefinitionCreationFlag, "PREFER_AOT_PYTHON_PLUGINS", None)
    if prefer_aot is not None:
        flags |= 1 << int(prefer_aot)
    network = builder.create_network(flags)
    parser = trt.OnnxParser(network, logger)
    override = getattr(trt.OnnxParserFlag, "ENABLE_PLUGIN_OVERRIDE", None)
    if override is not None:
        parser.set_flag(override)
        to_parse = model
    else:
        to_parse = _without_plugin_functions(model)
    # The path lets the parser find external weights next to the model.
    if not parser.parse(to_parse.SerializeToString(), str(onnx_path)):
        errors = [str(parser.get_error(i)) for i in range(parser.num_errors)]
        raise BuildError(f"{onnx_path}: TensorRT cannot parse the model: {errors[0] if errors else 'unknown error'}")

    found = count_plugin_layers(trt, network)
    if found != expected:
        raise PluginFallbackError(
            f"{onnx_path}: {expected} MultiMax nodes but {found} MultiMax plugin layers in the TensorRT network; "
            "the rest fell back to their elementwise function bodies"
        )

    config = builder.create_builder_config()
    config.set_memory_pool_limit(trt.MemoryPoolType.WORKSPACE, int(workspace_gib * (1 << 30)))
    if fp16:
        if not hasattr(trt.BuilderFlag, "FP16"):
            raise BuildError(
                f"TensorRT {trt.__version__} builds strongly typed networks only: for fp16, export the model in fp16"
            )
        config.set_flag(trt.BuilderFlag.FP16)
    default_seq = _default_seq(model)
    dynamic = [
        inp for inp in (network.get_input(i) for i in range(network.num_inputs)) if any(d < 0 for d in inp.shape)
    ]
    for profile in profiles if dynamic else ():
        opt_profile = builder.create_optimization_profile()
        for inp in dynamic:
            opt_profile.set_shape(inp.name, *_dims_profile(list(inp.shape), profile, default_seq))
        config.add_optimization_profile(opt_profile)
    serialized = builder.build_serialized_network(network, config)
    if serialized is None:
        raise BuildError(f"{onnx_path}: TensorRT could not build the engine (run with --verbose for its log)")
    return _write_atomic(bytes(serialized), out_path)


def _write_atomic(data: bytes, out: Path) -> Path:
    with staging_dir(out) as staging:
        (staging / out.name).write_bytes(data)
        return publish(staging / out.name, out)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m plugins.build_engine", description=__doc__.split("\n")[0])
    p.add_argument("model", help="ONNX file from `python -m export`")
    p.add_argument("-o", "--output", help="engine file (default: MODEL with suffix .engine)")
    p.add_argument("--fp16", action="store_true", help="allow fp16 kernels (the plugins run fp16 with fp32 math)")
    p.add_argument("--min-batch", type=int, default=1)
    p.add_argument("--opt-batch", type=int, default=8)
    p.add_argument("--max-batch", type=int, default=64)
    p.add_argument("--min-seq", type=int, default=1, help="text models: dynamic sequence axes")
    p.add_argument("--opt-seq", type=int, help="default: min(128, max-seq)")
    p.add_argument("--max-seq", type=int, help="default: the model's context (metadata), else 1024")
    p.add_argument("--workspace-gib", type=float, default=DEFAULT_WORKSPACE_GIB)
    p.add_argument("--verbose", action="store_true", help="TensorRT's verbose log")
    return p


def profile_from_args(args: argparse.Namespace) -> Profile:
    seq = None
    if args.max_seq is not None or args.opt_seq is not None:
        max_seq = args.max_seq or max(args.opt_seq, DEFAULT_MAX_SEQ)
        seq = (args.min_seq, args.opt_seq or min(128, max_seq), max_seq)
    return Profile(batch=(args.min_batch, args.opt_batch, args.max_batch), seq=seq)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    start = time.perf_counter()
    try:
        out = build_engine(
            args.model,
            args.output,
            fp16=args.fp16,
            profiles=[profile_from_args(args)],
            workspace_gib=args.workspace_gib,
            verbose=args.verbose,
        )
    except PluginFallbackError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    except BuildError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(f"wrote {out} in {time.perf_counter() - start:.1f} s ({'fp16' if args.fp16 else 'fp32'})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
