"""`python -m service.ray`: service.edge.ray's CLI under its documented name."""

from __future__ import annotations

import sys

from models.console import run
from service.edge.ray.__main__ import main

if __name__ == "__main__":
    sys.exit(run(main))
