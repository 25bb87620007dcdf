import sys

from service.loadtest.cli import main

sys.exit(main())
