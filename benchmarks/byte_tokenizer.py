"""`python -m benchmarks.byte_tokenizer DIR`: the demo models' byte tokenizer as a Hugging Face tokenizer folder,
for tools that take a tokenizer path (AIPerf's --tokenizer, the load tester's --tokenizer)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from benchmarks.loadtest.tokens import write_byte_folder


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.byte_tokenizer", description=__doc__)
    p.add_argument("out", type=Path, help="folder to write (created)")
    p.add_argument("--context", type=int, default=128, help="model_max_length (default: the demo's 128)")
    args = p.parse_args(argv)
    try:
        print(write_byte_folder(args.out, args.context))
    except OSError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
