import sys

from benchmarks.loadtest.cli import main
from models.console import run

sys.exit(run(main))
