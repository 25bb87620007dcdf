"""benchmarks.cpu_runtimes's operator section: the node alone against onnxruntime's Softmax, graph timings and
profiler node times side by side, and a second build of the library compared beside the current one."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from benchmarks import cpu_runtimes
from plugins import ort_ops


def test_op_section_times_profiles_and_compares_a_baseline_build(tmp_path: Path) -> None:
    lib = ort_ops.library()
    if not lib.available:
        if os.environ.get("MULTIMAX_REQUIRE_ORT_OPS") == "1":
            pytest.fail(f"fused MultiMax ops required but unavailable: {lib.reason}")
        pytest.skip(f"fused MultiMax ops unavailable: {lib.reason}")
    op = cpu_runtimes.bench_op(rounds=1, runs=2, tmp=tmp_path, baseline=lib.path)
    assert op["fused_runs_in_place"] is True  # the node wrote over its input, as in a model
    for batch in ("batch_1", "batch_8"):
        r = op[batch]
        assert set(r) == {"softmax", "multimax_fused", "multimax_baseline_lib", "profiler"}
        assert r["softmax"]["ratio_to_softmax"] == 1.0 and r["multimax_fused"]["median_ms"] > 0
        prof = r["profiler"]
        assert prof["runs"] == 2 and prof["softmax_nodes_us"] > 0
        for name in ("multimax_fused", "multimax_baseline_lib"):
            p = prof[name]
            assert p["nodes_us"] > 0 and p["node_ratio"] > 0 and p["ns_per_element"] > 0
            assert p["typical_nodes_us"] > 0 and p["typical_node_ratio"] > 0
    table = cpu_runtimes.markdown({"date": "d", "command": "c", "machine": "m", "op": op})
    assert "| multimax_baseline_lib | 8 |" in table and "| Softmax | 1 |" in table
