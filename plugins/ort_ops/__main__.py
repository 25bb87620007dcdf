"""`python -m plugins.ort_ops`: build (if needed) and check the fused MultiMax library; exit 2 if unavailable."""

from __future__ import annotations

import argparse
import json
import logging
import sys

import onnxruntime as ort

from models.console import run
from plugins.ort_ops import ATTENTION_OPS, MULTIMAX_OPS, OPS, library


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m plugins.ort_ops", description=__doc__)
    parser.add_argument("--json", action="store_true", help="print a JSON object instead of text")
    args = parser.parse_args(argv)
    logging.getLogger("plugins.ort_ops").addHandler(logging.NullHandler())  # the reason is printed below
    lib = library()
    info = {
        "available": lib.available,
        "source": lib.source,
        "path": str(lib.path) if lib.path else None,
        "reason": lib.reason or None,
        "domain": "multimax",
        "ops": list(OPS) if lib.available else [],
        "attention_ops": list(ATTENTION_OPS) if lib.available else [],
        "kernel_paths": list(lib.kernel_paths),
        "compiled_paths": list(lib.compiled_paths),
        "onnxruntime": ort.__version__,
    }
    if args.json:
        print(json.dumps(info, indent=2))
    elif lib.available:
        print(f"library ({lib.source}): {lib.path}")
        print(f"ops: multimax::{', multimax::'.join(MULTIMAX_OPS)} (float32, CPUExecutionProvider)")
        others = [op for op in OPS if op not in MULTIMAX_OPS and not op.endswith("NoMask")]
        print(f"reweighting ops: multimax::{'(NoMask), multimax::'.join(others)}(NoMask)")
        print(f"attention op: multimax::{', multimax::'.join(ATTENTION_OPS)} (the onnxruntime-genai folder export's "
              "decoder attention, writing into a shared cache)")
        print(
            f"kernel paths on this CPU: {', '.join(lib.kernel_paths)} (default: {lib.kernel_paths[0]}; "
            f"built: {', '.join(lib.compiled_paths)})"
        )
        print(f"loads in onnxruntime {ort.__version__}")
    else:
        print(f"fused MultiMax ops unavailable: {lib.reason}", file=sys.stderr)
    return 0 if lib.available else 2


if __name__ == "__main__":
    sys.exit(run(main))
