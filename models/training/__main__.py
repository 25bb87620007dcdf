import sys

from models.training.cli import main

sys.exit(main())
