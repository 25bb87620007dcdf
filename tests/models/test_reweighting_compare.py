"""`python -m models.training compare` and `plot-simplex` on a tiny budget."""

from __future__ import annotations

import json
import statistics
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("sklearn")  # the train extra

from models.checkpoint import load
from models.training.cli import main
from tests.paths import ROOT


def test_compare_writes_resumable_results_and_a_table(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    results, ckpts = tmp_path / "results.json", tmp_path / "ckpts"
    args = ["compare", "--epochs", "1", "--functions", "softmax,sparsemax,topk_softmax", "-o", str(results), "--quiet"]
    assert main([*args, "--checkpoints", str(ckpts)]) == 0
    data = json.loads(results.read_text())
    assert data["recipe"] == {"epochs": 1, "seed": 0, "drawn_per_batch": 24, "threads": 1}
    assert list(data["results"]) == ["softmax", "sparsemax", "topk_softmax"]
    soft, sparse, topk = (data["results"][n] for n in ("softmax", "sparsemax", "topk_softmax"))
    # another budget than the shipped twin's: the softmax run is trained here too, not read from the demo
    assert soft["trained"] == sparse["trained"] == "here" and soft["epochs"] == sparse["epochs"] == 1
    assert topk["options"] == {"k": 4} and soft["cpu_seconds"] > 0 and sparse["cpu_seconds"] > 0
    for r in (soft, sparse, topk):
        assert 0 <= r["multimodality"] <= 1 and 0 <= r["sparsity"] <= 1 and 0 <= r["zero_share"] <= 1
    assert soft["zero_share"] == 0 and topk["zero_share"] == pytest.approx(0.75)  # 16 tokens, k = 4 kept
    _, ckpt, _ = load(ckpts / "digits_sparsemax.pt")
    assert ckpt.config["attention_function"] == "sparsemax"
    out = capsys.readouterr().out
    assert "| sparsemax |" in out and "| entmax15 | | not run yet |" in out and "| 1 seed |" in out

    # resumed: nothing is redone, and a new function is added to the same file
    before = results.read_text()
    assert main([*args[:4], "softmax,sparsemax", *args[5:]]) == 0
    assert results.read_text() == before and "done before" in capsys.readouterr().out
    assert main(["compare", "--table", "-o", str(results)]) == 0
    assert "| topk_softmax | k=4 |" in capsys.readouterr().out


def test_the_shipped_twin_stands_in_for_its_own_recipe_only(tmp_path: Path) -> None:
    results = tmp_path / "results.json"
    assert main(["compare", "--functions", "softmax", "-o", str(results), "--quiet"]) == 0  # 120 epochs, seed 0
    soft = json.loads(results.read_text())["results"]["softmax"]
    assert soft["trained"] == "shipped (models/demo/digits_softmax.pt)" and soft["heldout_accuracy"] > 0.95
    assert "cpu_seconds" not in soft  # the shipped twin's CPU time is unknown


def test_results_of_the_recipe_before_drawn_digits_are_not_mixed_with_the_current_one() -> None:
    """The tracked results predate the drawn digits (drawn_per_batch 0); the shipped twins were retrained with them,
    so neither may stand in for the other, and a run of the current recipe never resumes into that file."""
    from models.training import compare as cmp

    tracked = json.loads((ROOT / "docs/reweighting_results.json").read_text())
    assert tracked["recipe"]["drawn_per_batch"] == 0
    now = cmp._recipe(None, 0)
    assert now["drawn_per_batch"] == 24 and not cmp._same_budget(tracked, now)
    assert not cmp._same_budget({"recipe": {"epochs": 120, "seed": 0}}, now)  # written before the field existed
    assert cmp._shipped_recipe("softmax") == {"epochs": 120, "seed": 0, "drawn_per_batch": 24}


def test_extra_seeds_train_every_function_again_and_the_table_gives_their_spread(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    results, ckpts = tmp_path / "results.json", tmp_path / "ckpts"
    args = ["compare", "--epochs", "1", "--functions", "sparsemax", "-o", str(results), "--quiet"]
    assert main([*args, "--seeds", "1,2", "--checkpoints", str(ckpts)]) == 0
    data = json.loads(results.read_text())
    assert sorted(data["seeds"]) == ["1", "2"] and all(list(data["seeds"][s]) == ["sparsemax"] for s in "12")
    for s in (1, 2):
        _, ckpt, _ = load(ckpts / f"digits_sparsemax_seed{s}.pt")
        assert ckpt.config["attention_function"] == "sparsemax"
    accs = [data["results"]["sparsemax"]["heldout_accuracy"]] + [data["seeds"][s]["sparsemax"]["heldout_accuracy"]
                                                                 for s in "12"]  # fmt: skip
    want = f"{statistics.mean(accs):.2%} ± {statistics.stdev(accs):.2%} (3)"
    assert f"| {want} |" in capsys.readouterr().out
    before = results.read_text()
    assert main([*args, "--seeds", "2,1"]) == 0  # resumed: all three seeds are done
    assert results.read_text() == before and capsys.readouterr().out.count("done before") == 3
    # the main seed twice, or a seed given twice, is refused before anything runs
    for bad in ("0", "1,1"):
        assert main([*args, "--seeds", bad]) == 2 and "each seed once" in capsys.readouterr().err
    for bad in ("-1", "x", ","):
        with pytest.raises(SystemExit) as exc:
            main([*args, "--seeds", bad])
        assert exc.value.code == 2
    assert results.read_text() == before


def test_the_table_takes_accuracy_spread_paired_differences_and_median_time_over_seeds() -> None:
    from models.training.compare import paired_to_softmax, table

    def run(acc: float, seconds: float | None) -> dict[str, Any]:
        metrics = {"multimodality": 0.5, "sparsity": 0.1, "zero_share": 0.0, "entropy": 1.0}
        return {"heldout_accuracy": acc, "seconds": seconds, "options": {}, **metrics}

    data = {
        "recipe": {"epochs": 120, "seed": 0},
        "results": {"softmax": run(0.99, 900.0), "sparsemax": run(0.97, None), "gaussian": run(0.99, 1.0)},
        "seeds": {"2": {"softmax": run(0.97, 100.0), "sparsemax": run(0.98, 5.0)}, "10": {"softmax": run(0.98, 120.0)}},
    }
    rows = {line.split(" | ")[0][2:]: line for line in table(data).splitlines()[2:]}
    assert "| 99.00% | 98.00% ± 1.00% (3) | (base) | 120 |" in rows["softmax"]  # the median time: one slow run aside
    # paired by seed (0 and 2; seed 10 has no sparsemax run): -7.2 and +3.6 images, mean -1.8, standard error 5.4
    assert paired_to_softmax(data, "sparsemax") == pytest.approx([-7.2, 3.6])
    assert "| 97.00% | 97.50% ± 0.71% (2) | -1.8 ± 5.4 (2) | 5 |" in rows["sparsemax"]
    assert "| 99.00% | 1 seed | ? | 1 |" in rows["gaussian"]  # one pair gives no spread


def update_many(path: str, key: str) -> None:
    from models.training.compare import update_results

    for i in range(25):
        update_results(Path(path), lambda data, i=i: data.__setitem__(f"{key}{i}", i))


def test_concurrent_writers_lose_no_result(tmp_path: Path) -> None:
    """Two compare runs (other seeds) and the step benchmark may write one results file side by side."""
    import multiprocessing

    results = tmp_path / "results.json"
    ctx = multiprocessing.get_context("fork")
    workers = [ctx.Process(target=update_many, args=(str(results), key)) for key in "abc"]
    for w in workers:
        w.start()
    for w in workers:
        w.join(60)
        assert w.exitcode == 0
    assert len(json.loads(results.read_text())) == 75
    assert [p.name for p in tmp_path.iterdir()] == ["results.json"]  # no staging or lock files left


def test_a_run_stops_when_another_changes_the_recipe_under_it(tmp_path: Path) -> None:
    from models.training import compare as cmp

    results = tmp_path / "results.json"

    def other_budget(*args: Any, **kwargs: Any) -> dict[str, Any]:
        cmp.update_results(results, lambda data: data.__setitem__("recipe", {"epochs": 5, "seed": 0}))
        return {"heldout_accuracy": 0.5}

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(cmp, "_trained", other_budget)
        with pytest.raises(RuntimeError, match="another run changed the results' recipe"):
            cmp.compare(["sparsemax"], results, epochs=1, progress=False)
    assert json.loads(results.read_text())["recipe"]["epochs"] == 5  # its results are not mixed into the other


def test_compare_refuses_unknown_functions_and_missing_results(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    assert main(["compare", "--functions", "nope", "-o", str(tmp_path / "r.json")]) == 2
    assert "unknown function(s) nope" in capsys.readouterr().err
    assert main(["compare", "--table", "-o", str(tmp_path / "r.json")]) == 2
    assert not (tmp_path / "r.json").exists()


def test_plot_simplex_writes_a_png(tmp_path: Path) -> None:
    assert main(["plot-simplex", "-o", str(tmp_path / "s.png")]) == 0
    assert (tmp_path / "s.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_train_step_ratios_go_into_the_results_and_their_table(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    from benchmarks import reweighting_train_cost

    results = tmp_path / "results.json"
    results.write_text(json.dumps({"recipe": {"epochs": 1}, "results": {}}))
    args = ["--rounds", "1", "--steps", "1", "--only", "sparsemax", "--into", str(results), "-o", str(tmp_path / "o")]
    assert reweighting_train_cost.main(args) == 0
    data = json.loads(results.read_text())
    assert data["recipe"] == {"epochs": 1}  # the rest kept
    ratios = data["train_step"]["ratio_to_softmax"]
    assert list(ratios) == ["softmax", "sparsemax"] and ratios["softmax"] == 1.0 and ratios["sparsemax"] > 0
    assert "| sparsemax | " in capsys.readouterr().out
    with pytest.raises(SystemExit) as exc:
        reweighting_train_cost.main(["--steps", "0"])
    assert exc.value.code == 2


def test_the_docs_tables_are_the_shipped_results() -> None:
    """README's and docs/REWEIGHTING.md's results tables are `compare --table` of docs/reweighting_results.json."""
    import re

    from models.training.compare import RESULTS, table

    want = table(json.loads(RESULTS.read_text()))
    for doc in ("README.md", "docs/REWEIGHTING.md"):
        found = re.search(r"<!-- results-table -->\n(.*?)\n<!-- /results-table -->", Path(doc).read_text(), re.S)
        assert found is not None and found.group(1) == want, f"{doc}: run `python -m models.training compare --table`"


def test_the_seed_plot_is_drawn_from_the_results(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from models.training.compare import RESULTS
    from models.training.compare_plot import plot_seed_accuracies

    png = tmp_path / "plots" / "acc.png"
    assert main(["compare", "--table", "-o", str(RESULTS), "--plot", str(png)]) == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and f"wrote {png}" in capsys.readouterr().out
    assert [f.name for f in png.parent.iterdir()] == ["acc.png"]  # written staged and renamed: nothing else left
    with pytest.raises(ValueError, match="no results to plot"):
        plot_seed_accuracies({"results": {}}, tmp_path / "empty.png")
    assert not (tmp_path / "empty.png").exists()
