"""`python -m export.demos`: export the shipped demo checkpoints next to themselves, validated.

The server serves these ONNX files when started without a model directory; `tests/export/test_export.py`
checks they still match their checkpoints.
"""

from __future__ import annotations

import sys

from export.onnx_export import ExportError
from export.pipeline import ExportOptions, export_checkpoint
from models.demo import DEMO_DIR, DEMO_FILES
from models.loading import CheckpointError


def main() -> int:
    worst = 0
    for name in DEMO_FILES:
        onnx_path = DEMO_DIR / (name.removesuffix(".pt") + ".onnx")
        # The shipped reports name the files, not this machine's paths.
        options = ExportOptions(output=onnx_path, progress=False, report_relative_to=DEMO_DIR)
        try:
            report = export_checkpoint(DEMO_DIR / name, options)
        except (CheckpointError, ExportError) as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2
        print(report.summary)
        worst = max(worst, report.exit_code)
    return worst


if __name__ == "__main__":
    sys.exit(main())
