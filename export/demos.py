"""`python -m export.demos`: export the shipped demo checkpoints next to themselves, validated.

The server serves these ONNX files when started without a model directory; `tests/test_export.py`
checks they still match their checkpoints.
"""

from __future__ import annotations

import os
import sys

from export.cli import main as export_main
from models.demo import DEMO_DIR, DEMO_FILES


def main() -> int:
    worst, here = 0, os.getcwd()
    os.chdir(DEMO_DIR)  # the shipped reports name the files, not this machine's paths
    try:
        for name in DEMO_FILES:
            onnx_name = name.removesuffix(".pt") + ".onnx"
            worst = max(worst, export_main([name, "-o", onnx_name, "--quiet"]))
    finally:
        os.chdir(here)
    return worst


if __name__ == "__main__":
    sys.exit(main())
