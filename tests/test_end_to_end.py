"""End to end on the real embedded default pair: `python -m train` then `python -m eval`, tiny settings."""

import json

import pytest

from eval.__main__ import main as eval_main
from eval.runner import verdict
from train.__main__ import main as train_main


@pytest.mark.slow
def test_train_then_eval_on_the_default_pair(tmp_path, capsys):
    """Loads SmolLM2-135M and the shipped draft twice (train, eval); ~2 minutes on 2 CPU cores."""
    out = tmp_path / "run"
    args = ["--timesteps", "64", "--n-steps", "32", "--batch-size", "16", "--n-epochs", "1", "--max-new-tokens", "16",
            "--wandb-mode", "disabled", "--no-progress-bar", "--checkpoint-every", "0", "--eval-prompts", "1",
            "--warmup-prompts", "1", "--out", str(out)]
    assert train_main(args) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["onnx_agreement"] == 1.0
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["autoregressive_warmup"]["tokens_per_s"] > 0 and metrics["cycles"]["cycles"] > 0

    assert eval_main(["--policy", str(out), "--num-train-prompts", "1", "--num-heldout-prompts", "2", "--repeats", "2",
                      "--gammas", "1,3", "--law-check", "--law-samples", "20", "--law-tokens", "1"]) == 0
    res = json.loads((out / "eval" / "results.json").read_text())
    speed = res["speed"]
    for key, grid in (("gamma_train", "grid_train"), ("gamma_hindsight", "grid_heldout")):
        tps = {int(g): v for g, v in speed[grid]["tokens_per_second"].items()}
        assert set(tps) == {1, 3} and speed[key] == max(tps, key=tps.get)  # the grid's fastest γ
    assert "autoregressive" in speed["methods"] and "learned policy" in speed["methods"]
    for m in speed["methods"].values():
        assert m["tokens_per_second_mean"] > 0 and len(m["tokens_per_second_per_repeat"]) == 2
    learned = speed["methods"]["learned policy"]["tokens_per_second_per_repeat"]
    for name, v in speed["verdicts"].items():  # ratios from the measured per-repeat rates, verdicts from them
        other = speed["methods"][name]["tokens_per_second_per_repeat"]
        assert v["ratio"]["per_repeat"] == pytest.approx([a / b for a, b in zip(learned, other)])
        assert v["verdict"] == verdict(v["ratio"])
    law = res["law_check"]
    assert law["num_tests"] > 0 and not any(t["flagged"] for t in law["tests"])  # the exact sampler is not flagged
    assert law["verdict"].split(":")[0] in ("PASS", "INCONCLUSIVE") and law["passed"] == law["conclusive"]
    assert (out / "eval" / "results.png").stat().st_size > 0
    md = (out / "eval" / "results.md").read_text()
    assert "learned policy vs autoregressive" in md and "Output-law check" in md
