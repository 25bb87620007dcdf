"""Load testing for the inference server: `python -m benchmarks.loadtest --help`, or from Python:

    from benchmarks.loadtest import LoadConfig, run, run_sweep
    result = run(LoadConfig(url="http://127.0.0.1:8000", workload="classify", concurrency=8, duration_s=10))
    print(result.throughput_rps, result.latency_ms["p99"])

docs/LOADTEST.md describes the options, the output and how to read it.
"""

from benchmarks.loadtest.config import ConfigError, IntRange, LoadConfig
from benchmarks.loadtest.runner import run, run_async
from benchmarks.loadtest.stats import Result
from benchmarks.loadtest.sweep import SweepResult, find_knee, run_sweep

__all__ = ["ConfigError", "IntRange", "LoadConfig", "Result", "SweepResult", "find_knee", "run", "run_async",
           "run_sweep"]
