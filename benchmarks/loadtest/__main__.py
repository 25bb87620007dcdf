import sys

from benchmarks.loadtest.cli import main

sys.exit(main())
