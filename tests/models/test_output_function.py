"""The output layer's distribution when it is not softmax (models.output_function): config, losses, sampling,
logprobs, export and serving."""

from __future__ import annotations

import asyncio
import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch

from export.cli import main as export_main
from models import output_function as of
from models.checkpoint import Checkpoint, load, save_checkpoint
from models.deit import DeiT, DeiTConfig
from models.generate import sample_next
from models.gpt import GPT, GPTConfig
from models.tokenizer import ByteTokenizer
from service.engine.text.sampler import sample_token, token_logprobs


def test_config_takes_the_output_functions_and_says_why_not_the_others() -> None:
    config = DeiTConfig(output_function="sparsemax")  # multimax_output defaults on: the function replaces it
    assert config.multimax_output is False and config.to_dict()["output_function"] == "sparsemax"
    assert "output_function" not in DeiTConfig().to_dict()  # configs without it read and write as before
    assert GPTConfig.from_dict(GPTConfig(output_function="evsoftmax").to_dict()).output_function == "evsoftmax"
    for name, why in (("topk_softmax", "top_k"), ("gaussian", "no training loss"), ("length_scaled", "temperature"),
                      ("multimax", "multimax_output"), ("nope", "unknown")):
        with pytest.raises(ValueError, match=why):
            GPTConfig(output_function=name)


def test_checkpoint_round_trip_and_models_init(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from models.cli import main as models_main

    assert models_main(["init", "gpt-nano", "--output-function", "entmax15", "-o", str(tmp_path / "g.pt")]) == 0
    assert "output entmax15" in capsys.readouterr().out
    model, _, _ = load(tmp_path / "g.pt")
    assert isinstance(model, GPT) and model.config.output_function == "entmax15" and not model.config.multimax_output
    assert models_main(["info", str(tmp_path / "g.pt")]) == 0
    assert "output        entmax15" in capsys.readouterr().out
    with pytest.raises(SystemExit):  # argparse: not one of the output functions
        models_main(["init", "gpt-nano", "--output-function", "gaussian", "-o", str(tmp_path / "x.pt")])


@pytest.mark.parametrize("name", of.OUTPUT_FUNCTIONS)
def test_probabilities_are_sparse_distributions_and_minus_inf_gets_zero(name: str) -> None:
    logits = torch.randn(64, 50, dtype=torch.float64) * 3
    logits[:, :5] = -math.inf  # banned / filtered tokens
    p = of.probabilities(name, logits)
    assert torch.allclose(p.sum(-1), torch.ones(64, dtype=torch.float64)) and (p >= 0).all()
    assert (p[:, :5] == 0).all() and (p == 0).float().mean() > 0.2  # exact zeros beyond the banned ones
    assert (p.argmax(-1) == logits.argmax(-1)).all()  # greedy is unchanged by the output function
    lp = of.log_probabilities(name, logits)
    assert torch.equal(lp.isinf(), p == 0)


@pytest.mark.parametrize("name", ["sparsemax", "entmax15"])
def test_fenchel_young_losses_have_gradient_p_minus_the_target(name: str) -> None:
    """The defining property of a Fenchel-Young loss: d loss / d z = p(z) - onehot(y) (per row; mean over rows)."""
    z = (torch.randn(8, 12, dtype=torch.float64) * 2).requires_grad_()
    y = torch.randint(0, 12, (8,))
    of.loss(name, z, y).backward()
    want = (of.probabilities(name, z.detach()) - torch.nn.functional.one_hot(y, 12)) / 8
    assert z.grad is not None and torch.allclose(z.grad, want, atol=1e-10)
    with pytest.raises(ValueError, match="label smoothing must be 0"):
        of.loss(name, z, y, label_smoothing=0.1)


def test_ev_softmax_training_loss_is_its_eps_relaxation() -> None:
    z = torch.tensor([[2.0, 0.3, 1.0, -3.0]], dtype=torch.float64, requires_grad=True)  # mean 0.075
    w = torch.tensor([1.1, 1.1, 1.1, 0.1], dtype=torch.float64) * z.detach().exp()  # (1[z >= mean] + eps) e^z
    assert torch.allclose(of.ev_softmax_train_log(z, eps=0.1).exp(), w / w.sum())
    torch.autograd.gradcheck(lambda t: of.ev_softmax_train_log(t, 1e-3), (z,))  # no entry near the cut
    loss = of.loss("evsoftmax", z, torch.tensor([3]))  # a class below the mean: finite, and its logit is pushed up
    loss.backward()
    assert math.isfinite(loss.item()) and z.grad is not None and z.grad[0, 3] < 0


def test_sampling_draws_from_the_output_distribution_only() -> None:
    g = torch.Generator().manual_seed(0)
    logits = torch.tensor([3.0, 2.6, 2.0, 0.5, -1.0, -4.0], dtype=torch.float64)
    p = of.probabilities("sparsemax", logits)  # [0.7, 0.3, 0, ...]
    assert p[2:].eq(0).all()
    draws = [sample_token(logits, 1.0, None, 1.0, g, (), "sparsemax") for _ in range(2000)]
    counts = np.bincount(draws, minlength=6)
    assert counts[2:].sum() == 0 and abs(counts[0] / 2000 - float(p[0])) < 0.05
    # a banned token is masked out before the function (SparseMax of the rest: tokens 1 and 2, 2.6 - 2.0 < 1),
    # top-k acts on the distribution
    assert {sample_token(logits, 1.0, None, 1.0, g, (0,), "sparsemax") for _ in range(100)} == {1, 2}
    assert {sample_token(logits, 1.0, 1, 1.0, g, (), "sparsemax") for _ in range(50)} == {0}
    batch = sample_next(logits.float()[None].repeat(500, 1), 1.0, generator=g, output_function="entmax15")
    assert set(batch.tolist()) <= {i for i in range(6) if of.probabilities("entmax15", logits)[i] > 0}


def test_logprobs_of_zero_probability_tokens_are_minus_9999_and_valid_json() -> None:
    logits = torch.tensor([3.0, 2.6, 2.0, 0.5, -1.0, -4.0])
    chosen, top = token_logprobs(logits, 5, 5, "sparsemax")
    assert chosen == of.ZERO_LOGPROB and top[5] == of.ZERO_LOGPROB
    assert math.isclose(top[0], math.log(0.7), rel_tol=1e-6) and math.isclose(top[1], math.log(0.3), rel_tol=1e-6)
    assert sorted(top.values())[:-2] == [of.ZERO_LOGPROB] * (len(top) - 2)  # the rest are outside the support
    assert json.loads(json.dumps({"top": top}, allow_nan=False))  # no -inf/NaN reaches the JSON
    assert token_logprobs(logits, 5, 2)[0] > -10  # softmax: every token keeps a finite logprob


def test_trainers_use_the_output_loss_and_report_its_support() -> None:
    from models.training.text import train_text
    from models.training.vision import train_vision

    vision = train_vision(epochs=1, output_function="sparsemax", progress=False, multimax=())
    assert vision["config"]["output_function"] == "sparsemax"
    assert 1 <= vision["metrics"]["heldout_output_support"] <= 10
    text = train_text(steps=2, preset="gpt-nano", output_function="entmax15", max_eval_bytes=600, n_samples=1,
                      sample_tokens=4, progress=False)
    m = text["metrics"]
    assert m["heldout_bpb"] is None and m["train_bpb"] is None  # NLL is infinite where p = 0: not reported
    assert m["heldout_loss"] > 0 and 0 <= m["heldout_zero_prob_share"] <= 1 and m["heldout_output_support"] >= 1


def _spread_gpt(name: str) -> tuple[GPT, GPTConfig]:
    """gpt-nano with its output function and logits spread wide enough that the distribution has zeros."""
    torch.manual_seed(0)
    config = GPTConfig.from_preset("gpt-nano", output_function=name)
    model = GPT(config)
    with torch.no_grad():
        model.wte.weight.mul_(40.0)
    return model, config


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """An exported sparsemax-output GPT and DeiT in one model folder."""
    from models.training.vision import DIGITS_PREPROCESS

    tmp = tmp_path_factory.mktemp("output_function")
    models = tmp / "models"
    models.mkdir()
    model, config = _spread_gpt("sparsemax")
    save_checkpoint(Checkpoint("gpt", config.to_dict(), model.state_dict(), tokenizer=ByteTokenizer().to_dict()),
                    tmp / "text_sparse.pt")
    torch.manual_seed(0)
    dconfig = DeiTConfig(img_size=32, patch_size=8, in_chans=1, num_classes=10, embed_dim=32, depth=1, num_heads=2,
                         output_function="sparsemax")
    deit = DeiT(dconfig)
    with torch.no_grad():
        deit.head.weight.mul_(30.0)
    save_checkpoint(Checkpoint("deit", dconfig.to_dict(), deit.state_dict(), labels=[str(i) for i in range(10)],
                               preprocess=DIGITS_PREPROCESS), tmp / "digits_sparse.pt")
    for name in ("text_sparse", "digits_sparse"):
        out = models / f"{name}.onnx"
        assert export_main([str(tmp / f"{name}.pt"), "--quiet", "--samples", "8", "-o", str(out)]) == 0
        report = json.loads((models / f"{name}.validation.json").read_text())
        probs = report["validation"]["ORT_ENABLE_ALL"]["probabilities"]
        assert report["passed"] and probs["function"] == "sparsemax" and probs["max_abs"] <= probs["limit"]
    return models


def test_served_classifier_returns_the_sparse_distribution(served: Path) -> None:
    import io

    from fastapi.testclient import TestClient
    from PIL import Image

    from service.base.config import Settings
    from service.edge.app import create_app

    with TestClient(create_app(Settings(model_dir=served))) as client:
        card = client.get("/v1/models/digits_sparse").json()
        assert card["output_function"] == "sparsemax" and card["attention_function"] == "multimax"
        assert client.get("/v2/models/digits_sparse").json()["output_function"] == "sparsemax"
        buf = io.BytesIO()
        Image.fromarray((np.random.default_rng(0).random((32, 32)) * 255).astype(np.uint8)).save(buf, "PNG")
        image = buf.getvalue()
        r = client.post("/v1/models/digits_sparse/classify?top_k=10", content=image,
                        headers={"content-type": "image/png"})
        assert r.status_code == 200, r.text
        scores = [c["probability"] for c in r.json()["predictions"][0]]
        assert scores == sorted(scores, reverse=True) and math.isclose(sum(scores), 1.0, rel_tol=1e-5)
        assert 0.0 in scores  # exact zeros: the sparse distribution, not softmax


def test_served_generator_samples_and_reports_logprobs_of_its_distribution(served: Path) -> None:
    """Logprobs with echo over a prompt the model gives zero probability, next to a bad request (400) and a
    stream, all on one model: the bad one stays in its request."""
    import httpx

    from service.base.config import Settings
    from service.edge.app import create_app
    from tests.service.support import started

    async def main() -> tuple[httpx.Response, httpx.Response, list[str]]:
        async with started(create_app(Settings(model_dir=served))) as client:
            body = {"model": "text_sparse", "prompt": "The quick brown fox", "max_tokens": 6, "logprobs": 3,
                    "echo": True, "temperature": 1.0, "seed": 1}
            bad = {"model": "text_sparse", "prompt": "x", "max_tokens": 4, "temperature": -1}

            async def stream() -> list[str]:
                async with client.stream("POST", "/v1/completions", json={"model": "text_sparse", "prompt": "a",
                                         "max_tokens": 8, "stream": True, "seed": 2}) as r:
                    assert r.status_code == 200
                    return [line async for line in r.aiter_lines() if line.startswith("data: ")]

            ok, rejected, lines = await asyncio.gather(client.post("/v1/completions", json=body),
                                                       client.post("/v1/completions", json=bad), stream())
            return ok, rejected, lines

    ok, rejected, lines = asyncio.run(main())
    assert rejected.status_code == 400 and lines[-1] == "data: [DONE]"
    assert ok.status_code == 200, ok.text
    lp = json.loads(ok.text, parse_constant=lambda c: pytest.fail(f"{c} in the JSON"))["choices"][0]["logprobs"]
    echoed = [v for v in lp["token_logprobs"][1:len("The quick brown fox")] if v is not None]
    assert of.ZERO_LOGPROB in echoed  # the prompt has bytes the sparse distribution gives 0
    generated = lp["token_logprobs"][len("The quick brown fox"):]
    assert generated and all(of.ZERO_LOGPROB < v <= 0 for v in generated)  # sampled tokens have p > 0
    assert all(v >= of.ZERO_LOGPROB for top in lp["top_logprobs"][1:] for v in top.values())
