"""Running a command-line entry point: a closed output pipe ends it quietly.

`python -m models info --json X | head -1` closes the pipe after one line; the command's next write (or the
flush at exit) then raises BrokenPipeError. Every `__main__.py` of the project runs its `main` through `run`,
which does what the Python documentation recommends (https://docs.python.org/3/library/signal.html#note-on-sigpipe):
point stdout at devnull, so the interpreter's own final flush cannot fail again, and exit with 1, without a
traceback. Standard library only: the bottom layer, importable by every package and by benchmarks/.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable

BROKEN_PIPE_EXIT = 1  # as the Python documentation's recipe: the output did not all arrive


def run(main: Callable[[], int | None]) -> int:
    """`main()`'s exit code (None: 0), its output flushed; BROKEN_PIPE_EXIT, silently, if stdout's reader left."""
    try:
        try:
            code = main()
        except SystemExit:  # argparse's --help and errors: what they printed is flushed here too
            sys.stdout.flush()
            raise
        sys.stdout.flush()  # inside the try: buffered output fails here, not in the interpreter's teardown
    except BrokenPipeError:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())  # what is still buffered goes nowhere at exit
        os.close(devnull)
        return BROKEN_PIPE_EXIT
    return code or 0
