"""The same workloads for locust, to compare its numbers with benchmarks.loadtest's (see compare.py).

    LOADTEST_WORKLOAD=classify LOADTEST_MODEL=digits_multimax locust -f benchmarks/loadtest/locustfile.py \\
        --headless -u 8 -r 8 -t 10s --host http://127.0.0.1:8000 --csv out/locust

Each user is a closed loop with no think time (wait_time 0), so `-u N` is the counterpart of `--concurrency N`.
Requests are built by benchmarks.loadtest.workloads from the same seed, so both tools send the same bytes.
generate runs without streaming here (locust has no notion of tokens).
"""

from __future__ import annotations

import itertools
import os
import sys
from pathlib import Path

from locust import FastHttpUser, constant, task

# locust imports this file by path; make the project importable however locust was started.
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks.loadtest.config import IntRange, LoadConfig
from benchmarks.loadtest.workloads import build_workload

_env = os.environ.get
CONFIG = LoadConfig(
    workload=_env("LOADTEST_WORKLOAD", "classify"),  # type: ignore[arg-type]
    model=_env("LOADTEST_MODEL") or None,
    concurrency=1, requests=1,
    images=Path(_env("LOADTEST_IMAGES")) if _env("LOADTEST_IMAGES") else None,
    batch=int(_env("LOADTEST_BATCH", "1")),
    prompt_len=IntRange.parse(_env("LOADTEST_PROMPT_LEN", "8:32")),
    max_tokens=IntRange.parse(_env("LOADTEST_MAX_TOKENS", "16:64")),
    stream=False,
    seed=int(_env("LOADTEST_SEED", "0")),
)
WORKLOAD = build_workload(CONFIG)  # infer: the demo models' input (pixel_values, [1,1,32,32] FP32)
NAME = f"{CONFIG.workload} {CONFIG.model_name}"
_indices = itertools.count()


class InferenceUser(FastHttpUser):
    wait_time = constant(0)

    @task
    def send(self) -> None:
        spec = WORKLOAD.request(next(_indices))
        # FastHttpUser marks non-2xx responses and connection errors as failures by itself.
        self.client.request(spec.method, spec.path, data=spec.body, headers=spec.headers, name=NAME,
                            allow_redirects=False)
