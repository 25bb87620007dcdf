"""Atomic file output: write in a private directory next to the target, then rename into place.

A crash or an error mid-write leaves the old file (or nothing), never a truncated one.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path


@contextmanager
def staging_dir(target: Path) -> Iterator[Path]:
    """A temporary directory on the target's file system (so renames are atomic); removed afterwards."""
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
    try:
        yield staging
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def publish(staged: Path, target: Path) -> Path:
    """fsync `staged`, give it the usual file mode (mkdtemp's files are private), rename it over `target`."""
    with open(staged, "rb") as fh:
        os.fsync(fh.fileno())
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(staged, 0o666 & ~umask)
    os.replace(staged, target)
    return target
