import sys

from models.console import run
from models.training.cli import main

sys.exit(run(main))
