"""benchmarks/compare_revisions.py: two trees side by side (issue 23's "nothing got slower")."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks.compare_revisions import ROOT, materialise, summarise, supported


def test_options_an_older_tree_lacks_are_left_out_with_their_values_and_noted() -> None:
    notes: list[str] = []
    args = ["--only", "batching", "--seconds", "3", "--quiet", "-o", "x.json"]
    assert supported(args, {"--only", "--seconds"}, notes, "base") == ["--only", "batching", "--seconds", "3",
                                                                       "-o", "x.json"]
    assert notes == ["base: does not know --quiet; left out"]


def test_the_summary_is_ratios_of_medians_and_medians_of_ratios() -> None:
    rounds = [{"base": {"export_s": 10.0, "classification_images_per_s": 100.0},
               "head": {"export_s": 12.0, "classification_images_per_s": 90.0}},
              {"base": {"export_s": 20.0, "classification_images_per_s": 300.0},
               "head": {"export_s": 20.0, "classification_images_per_s": 330.0}},
              {"base": {"export_s": 30.0, "classification_images_per_s": 200.0},
               "head": {"export_s": 27.0, "classification_images_per_s": 200.0}}]
    s = summarise(rounds)
    assert s["export_s"]["ratio_of_medians"] == 1.0 and s["export_s"]["median_of_ratios"] == 1.0
    assert s["classification_images_per_s"]["ratio_of_medians"] == 1.0
    assert s["classification_images_per_s"]["median_of_ratios"] == 1.0
    rounds[1]["head"]["export_s"] = 30.0
    s = summarise(rounds)
    assert s["export_s"]["ratio_of_medians"] == pytest.approx(27 / 20, abs=1e-4)
    assert s["export_s"]["head_slower"] and not s["classification_images_per_s"]["head_slower"]
    assert "generation_tokens_per_s" not in s  # not measured: not reported


def test_a_revision_becomes_a_temporary_worktree_and_goes_away() -> None:
    with materialise("HEAD", ROOT) as (tree, described):
        assert (tree / "benchmarks" / "serving.py").is_file() and tree != ROOT
        assert "HEAD" in described
    assert not tree.exists()
    with materialise(str(ROOT), ROOT) as (same, _):
        assert same == ROOT
    with pytest.raises(SystemExit, match="neither a directory nor a revision"), materialise("no-such-rev", ROOT):
        pass


@pytest.mark.slow
def test_head_against_head_in_the_smallest_mode(tmp_path: Path) -> None:
    """One round, the smallest export (gpt-nano) and half-second load points: every figure comes back for both
    trees, and the JSON holds the rounds and the ratios (no timing is asserted)."""
    out = tmp_path / "compare.json"
    proc = subprocess.run([sys.executable, "-m", "benchmarks.compare_revisions", "--base", "HEAD", "--head", "HEAD",
                           "--rounds", "1", "--seconds", "0.5", "--max-tokens", "8", "--export-preset", "gpt-nano",
                           "-o", str(out)], cwd=ROOT, capture_output=True, text=True, timeout=1500)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(out.read_text())
    assert len(result["rounds"]) == 1
    for side in ("base", "head"):
        figures = result["rounds"][0][side]
        assert figures["export_s"] > 0 and figures["classification_images_per_s"] > 0
        assert figures["generation_tokens_per_s"] > 0
    assert set(result["summary"]) == {"export_s", "classification_images_per_s", "generation_tokens_per_s"}
    assert "head/base" in proc.stdout and "round 1 base" in proc.stderr
