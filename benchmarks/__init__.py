"""Tools beside the product: benchmarks, self-measurements and the load tester (`benchmarks.loadtest`).

Nothing in `models/`, `export/`, `plugins/` or `service/` imports this package (tests/project/test_layout.py checks).
It runs from a checkout and needs the `loadtest` extra; docs/BENCHMARKS.md has every command and result.
"""
