import sys

from models.cli import main
from models.console import run

sys.exit(run(main))
