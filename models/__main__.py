import sys

from models.cli import main

sys.exit(main())
