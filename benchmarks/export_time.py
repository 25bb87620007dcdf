"""`python -m benchmarks.export_time`: export and inference speed of MultiMax models, measured side by side.

Every comparison runs its contenders interleaved, round after round, in one process, and reports the
median of per-round ratios, so a busy shared machine slows both sides alike. Sections:

1. DeiT-small (paper parameters) export + validation time, through `python -m export` itself.
2. MultiMax overhead: DeiT-small MultiMax ONNX vs its softmax twin in onnxruntime (CPU), batch 1 and 8,
   and the same pair under torch.compile (whose inductor fuses the modulation into the softmax).
3. The same MultiMax model in onnxruntime vs PyTorch eager vs torch.compile.
4. Attention fusion: onnxruntime's transformer optimizer fuses the softmax twin's attention; the
   MultiMax graph cannot be fused. What that costs.
5. int8 / fp16 variants of the digits demo: held-out accuracy against fp32 (real data, 360 images).

Results: a JSON file (default runs/bench_export.json) and a markdown summary on stdout.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from datetime import date
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import onnxruntime as ort
import torch
from tqdm import tqdm

from export.fused_check import cpu_session
from export.pipeline import ExportOptions, export_checkpoint
from models.checkpoint import load
from models.cli import main as models_main
from models.demo import DEMO_DIR, VISION_MULTIMAX


def interleaved(contenders: dict[str, Callable[[], object]], rounds: int, calls: int, desc: str) -> dict[str, Any]:
    """Median seconds per call of each contender, and each one's median per-round ratio to the first."""
    names = list(contenders)
    for fn in contenders.values():  # warm-up: allocations, lazy init, compilation
        fn()
    per_round: dict[str, list[float]] = {n: [] for n in names}
    for r in tqdm(range(rounds), desc=desc, leave=False):
        order = names if r % 2 == 0 else names[::-1]  # alternate who goes first
        for name in order:
            start = time.perf_counter()
            for _ in range(calls):
                contenders[name]()
            per_round[name].append((time.perf_counter() - start) / calls)
    base = names[0]
    return {
        name: {
            "median_ms": 1e3 * statistics.median(times),
            "ratio_to_" + base: statistics.median(t / b for t, b in zip(times, per_round[base], strict=True)),
        }
        for name, times in per_round.items()
    }


def session(path: Path) -> ort.InferenceSession:
    # Idle ORT threads spin for a while after each run; side by side with PyTorch that steals its cores.
    return cpu_session(path, spinning=False)


def make_checkpoints(tmp: Path) -> tuple[Path, Path]:
    mm, sm = tmp / "deit_small_multimax.pt", tmp / "deit_small_softmax.pt"
    with contextlib.redirect_stdout(io.StringIO()):
        codes = [
            models_main(["init", "deit_small", "--params", "paper", "-o", str(mm)]),
            models_main(["init", "deit_small", "--multimax", "none", "-o", str(sm)]),
        ]
    if any(codes):
        raise RuntimeError("could not create the DeiT-small checkpoints")
    return mm, sm


def bench_export(ckpt: Path) -> dict[str, Any]:
    start = time.perf_counter()
    result = export_checkpoint(ckpt, ExportOptions(output=ckpt.with_suffix(".onnx"), progress=False))
    wall = time.perf_counter() - start
    report = result.data
    v = report["validation"]
    return {
        "exit_code": result.exit_code,
        "wall_seconds": wall,
        "export_seconds": report["export_seconds"],
        "validation_seconds": report["validation_seconds"],
        "max_abs_diff": max(v[level]["max_abs"] for level in ("ORT_ENABLE_ALL", "ORT_ENABLE_BASIC")),
        "top1_agreement": min(v[level]["top1_agreement"] for level in ("ORT_ENABLE_ALL", "ORT_ENABLE_BASIC")),
        "samples": v["samples"],
    }


def bench_overhead(mm: Path, sm: Path, rounds: int) -> dict[str, Any]:
    out = {}
    s_mm, s_sm = session(mm), session(sm)
    for batch, calls in ((1, 8), (8, 2)):
        x = np.random.default_rng(0).standard_normal((batch, 3, 224, 224), dtype=np.float32)
        out[f"batch_{batch}"] = interleaved(
            {
                "softmax": lambda s=s_sm, x=x: s.run(None, {"pixel_values": x}),
                "multimax": lambda s=s_mm, x=x: s.run(None, {"pixel_values": x}),
            },
            rounds, calls, f"overhead b{batch}",
        )
    return out


def bench_runtimes(mm_ckpt: Path, mm_onnx: Path, rounds: int) -> dict[str, Any]:
    model, _, _ = load(mm_ckpt)
    model.eval()
    compiled = torch.compile(model)
    s = session(mm_onnx)
    out = {}
    for batch, calls in ((1, 8), (8, 2)):
        x = torch.randn(batch, 3, 224, 224, generator=torch.Generator().manual_seed(0))
        xn = x.numpy()
        with torch.inference_mode():
            start = time.perf_counter()
            compiled(x)  # compile for this shape outside the timed rounds
            compile_s = time.perf_counter() - start
            out[f"batch_{batch}"] = interleaved(
                {
                    "onnxruntime": lambda xn=xn: s.run(None, {"pixel_values": xn}),
                    "torch_eager": lambda x=x: model(x),
                    "torch_compile": lambda x=x: compiled(x),
                },
                rounds, calls, f"runtimes b{batch}",
            )
        out[f"batch_{batch}"]["torch_compile"]["compile_seconds"] = compile_s
    return out


def bench_compiled_overhead(mm_ckpt: Path, sm_ckpt: Path, rounds: int) -> dict[str, Any]:
    """MultiMax vs softmax twin under torch.compile: inductor fuses the modulation into the softmax."""
    models = {}
    for name, ckpt in (("softmax", sm_ckpt), ("multimax", mm_ckpt)):
        model, _, _ = load(ckpt)
        models[name] = torch.compile(model.eval())
    out = {}
    for batch, calls in ((1, 8), (8, 2)):
        x = torch.randn(batch, 3, 224, 224, generator=torch.Generator().manual_seed(0))
        with torch.inference_mode():
            out[f"batch_{batch}"] = interleaved(
                {name: lambda m=m, x=x: m(x) for name, m in models.items()}, rounds, calls, f"compiled b{batch}"
            )
    return out


def bench_fusion(mm: Path, sm: Path, tmp: Path, rounds: int) -> dict[str, Any]:
    """onnxruntime's transformer optimizer (model_type vit) on both graphs, then all four side by side."""
    from onnxruntime.transformers.optimizer import optimize_model

    out: dict[str, Any] = {}
    paths = {}
    for name, src in (("softmax", sm), ("multimax", mm)):
        fused_path = tmp / f"{name}_fused.onnx"
        with contextlib.redirect_stdout(io.StringIO()):
            optimized = optimize_model(str(src), model_type="vit", num_heads=6, hidden_size=384)
        optimized.save_model_to_file(str(fused_path))
        ops = [n.op_type for n in onnx.load(str(fused_path)).graph.node]
        out[name] = {
            "fusions": {k: v for k, v in optimized.get_fused_operator_statistics().items() if v},
            "fused_attention_nodes": sum(op in ("Attention", "MultiHeadAttention") for op in ops),
        }
        paths[name], paths[f"{name}_fused"] = src, fused_path
    x = np.random.default_rng(0).standard_normal((8, 3, 224, 224), dtype=np.float32)
    sessions = {name: session(path) for name, path in paths.items()}
    order = ["softmax_fused", "multimax_fused", "softmax", "multimax"]
    out["batch_8"] = interleaved(
        {name: lambda s=sessions[name]: s.run(None, {"pixel_values": x}) for name in order}, rounds, 2, "fusion b8"
    )
    return out


def bench_precision(tmp: Path) -> dict[str, Any]:
    """Held-out digits accuracy of the fp32 / fp16 / int8 exports of the MultiMax demo model."""
    from models.training.vision import digits_split, normalize

    _, _, images, labels = digits_split()
    x = normalize(images).numpy()
    model, _, _ = load(DEMO_DIR / VISION_MULTIMAX)
    with torch.no_grad():
        torch_acc = float((model(torch.from_numpy(x)).argmax(-1) == labels).float().mean())
    out: dict[str, Any] = {"heldout_images": len(labels), "pytorch_fp32_accuracy": torch_acc}
    ckpt = tmp / "digits.pt"
    ckpt.write_bytes((DEMO_DIR / VISION_MULTIMAX).read_bytes())
    for precision in ("fp32", "fp16", "int8"):
        path = tmp / f"digits_{precision}.onnx"
        export_checkpoint(ckpt, ExportOptions(output=path, precision=precision, validate=False, progress=False))
        preds = session(path).run(None, {"pixel_values": x})[0].argmax(-1)
        out[precision] = {
            "accuracy": float((preds == labels.numpy()).mean()),
            "size_bytes": path.stat().st_size,
        }
    return out


def timing_tables(results: dict[str, Any], titles: dict[str, str]) -> list[str]:
    """Markdown tables of `interleaved` results ({"batch_N": {contender: timing}}), one per section present."""
    lines: list[str] = []
    for key, title in titles.items():
        if key not in results:
            continue
        lines += [f"| {title} | batch | median ms/call | ratio |", "|---|---|---|---|"]
        for batch, timing in results[key].items():
            if not batch.startswith("batch_"):
                continue
            for name, t in timing.items():
                ratio = next(v for k, v in t.items() if k.startswith("ratio_to_"))
                lines.append(f"| {name} | {batch.split('_')[1]} | {t['median_ms']:.1f} | {ratio:.3f} |")
        lines.append("")
    return lines


def markdown(results: dict[str, Any]) -> str:
    lines = [f"Measured {results['date']} with `{results['command']}` ({results['machine']})", ""]
    e = results.get("export")
    if e:
        lines += [
            "| DeiT-small export | wall (s) | export (s) | validation (s) | max abs diff | top-1 agreement |",
            "|---|---|---|---|---|---|",
        ]
        for name, r in e.items():
            lines.append(
                f"| {name} | {r['wall_seconds']:.1f} | {r['export_seconds']:.1f} | {r['validation_seconds']:.1f} "
                f"| {r['max_abs_diff']:.2e} | {r['top1_agreement']:.0%} |"
            )
        lines.append("")
    lines += timing_tables(results, {"overhead": "MultiMax vs softmax twin (onnxruntime CPU)",
                                     "compiled_overhead": "MultiMax vs softmax twin (torch.compile, CPU)",
                                     "runtimes": "onnxruntime vs PyTorch eager vs torch.compile (MultiMax DeiT-small)"})
    f = results.get("fusion")
    if f:
        for name in ("softmax", "multimax"):
            lines.append(f"Optimizer on the {name} graph: {f[name]['fused_attention_nodes']} fused attention nodes; "
                         f"fusions {f[name]['fusions']}")
        lines += ["", "| transformer optimizer, batch 8 | median ms/call | ratio to fused softmax |", "|---|---|---|"]
        for name, t in f["batch_8"].items():
            lines.append(f"| {name} | {t['median_ms']:.1f} | {t['ratio_to_softmax_fused']:.3f} |")
        lines.append("")
    p = results.get("precision")
    if p:
        lines += [f"| digits demo, {p['heldout_images']} held-out images | accuracy | file size |", "|---|---|---|",
                  f"| PyTorch fp32 | {p['pytorch_fp32_accuracy']:.2%} | |"]
        for precision in ("fp32", "fp16", "int8"):
            r = p[precision]
            lines.append(f"| ONNX {precision} | {r['accuracy']:.2%} | {r['size_bytes'] / 1e3:.0f} kB |")
    return "\n".join(lines)


SECTIONS = ("export", "overhead", "compiled_overhead", "runtimes", "fusion", "precision")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.export_time", description=__doc__.split("\n")[0])
    p.add_argument("--rounds", type=int, default=9, help="interleaved rounds per comparison")
    p.add_argument("--only", nargs="+", choices=SECTIONS, default=list(SECTIONS))
    p.add_argument("-o", "--output", default="runs/bench_export.json")
    args = p.parse_args(argv)
    torch.manual_seed(0)
    results: dict[str, Any] = {
        "date": date.today().isoformat(),
        "command": "python -m benchmarks.export_time " + " ".join(sys.argv[1:] if argv is None else argv),
        "machine": f"{torch.get_num_threads()} threads, onnxruntime {ort.__version__}, torch {torch.__version__}",
    }
    with tempfile.TemporaryDirectory(prefix="multimax-bench.") as tmp_name:
        tmp = Path(tmp_name)
        mm_ckpt, sm_ckpt = make_checkpoints(tmp)
        mm, sm = mm_ckpt.with_suffix(".onnx"), sm_ckpt.with_suffix(".onnx")
        steps = tqdm(args.only, desc="sections")
        for section in steps:
            steps.set_postfix_str(section)
            if section == "export" or (section in ("overhead", "runtimes", "fusion") and not mm.exists()):
                results.setdefault("export", {})
                for name, ckpt in (("multimax", mm_ckpt), ("softmax twin", sm_ckpt)):
                    results["export"][name] = bench_export(ckpt)
                if section == "export":
                    continue
            if section == "overhead":
                results["overhead"] = bench_overhead(mm, sm, args.rounds)
            elif section == "compiled_overhead":
                results["compiled_overhead"] = bench_compiled_overhead(mm_ckpt, sm_ckpt, args.rounds)
            elif section == "runtimes":
                results["runtimes"] = bench_runtimes(mm_ckpt, mm, args.rounds)
            elif section == "fusion":
                results["fusion"] = bench_fusion(mm, sm, tmp, args.rounds)
            elif section == "precision":
                results["precision"] = bench_precision(tmp)
    return write_results(results, Path(args.output), markdown(results))


def write_results(results: dict[str, Any], out: Path, summary: str) -> int:
    """The JSON file and the markdown summary on stdout (shared by the benchmark commands)."""
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=2) + "\n")
    print(summary)
    print(f"\nresults: {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
