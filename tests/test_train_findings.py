"""New-user findings in ``python -m train`` / ``learn2draft train`` and ``policies.export``: an interrupt after
training keeps the trained policy, says so and ``--resume`` finishes the evaluation; a ``--resume`` to a total
already reached trains nothing and keeps ``metrics.json``; ``--timesteps`` that is no multiple of ``--n-steps`` is
named before training; SIGTERM while the models load is one line and leaves no empty ``--out``; a damaged
``model.zip`` is one error line with advice; transformers' known deprecation lines are silenced (only those)."""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
TINY_ARGS = ["--timesteps", "128", "--n-steps", "64", "--batch-size", "32", "--n-epochs", "2", "--max-new-tokens", "10",
             "--max-depth", "3", "--net-arch", "16,16", "--wandb-mode", "disabled", "--no-progress-bar",
             "--checkpoint-every", "64", "--eval-prompts", "1", "--warmup-prompts", "1"]


def _tiny(tiny_model_dirs, out: Path, *extra: str) -> list[str]:
    return [*TINY_ARGS, "--target", tiny_model_dirs[0], "--draft", tiny_model_dirs[1], "--out", str(out), *extra]


def test_an_interrupt_during_the_evaluation_keeps_the_policy_and_resume_finishes_it(tiny_model_dirs, tmp_path, capsys,
                                                                                   monkeypatch):
    import train.chain
    from train.__main__ import main

    out = tmp_path / "run"
    real_check = train.chain._chain_check

    def interrupted(*a, **k):
        raise KeyboardInterrupt("SIGTERM")

    monkeypatch.setattr(train.chain, "_chain_check", interrupted)
    with pytest.raises(SystemExit) as e:
        main(_tiny(tiny_model_dirs, out))
    err = capsys.readouterr().err
    assert e.value.code == 130 or e.value.code == 128 + signal.SIGTERM
    assert "before training began" not in err and "is as it was" not in err, err
    assert "after training" in err and "model.zip" in err and "--resume" in err and "--overwrite" not in err, err
    assert (out / "model.zip").is_file() and (out / "policy" / "policy.onnx").is_file()
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["interrupted"] and metrics["timesteps"] == 128 and metrics["evaluation"] is None
    model_bytes = (out / "model.zip").read_bytes()

    monkeypatch.setattr(train.chain, "_chain_check", real_check)
    assert main(["--out", str(out), "--resume"]) == 0, capsys.readouterr().err
    metrics = json.loads((out / "metrics.json").read_text())
    assert not metrics["interrupted"] and metrics["timesteps"] == 128 and metrics["evaluation"] is not None
    assert metrics["resumed_from_timesteps"] == 128  # nothing more was trained
    import torch
    from stable_baselines3 import PPO

    a = PPO.load(str(out / "model.zip")).policy.state_dict()
    (tmp_path / "before.zip").write_bytes(model_bytes)
    b = PPO.load(str(tmp_path / "before.zip")).policy.state_dict()
    diff = {k: float((a[k] - b[k]).abs().max()) for k in a if not torch.equal(a[k], b[k])}
    assert not diff, diff


def test_resume_to_a_total_already_reached_trains_nothing_and_keeps_the_metrics(tiny_model_dirs, tmp_path, capsys):
    from train.__main__ import main

    out = tmp_path / "run"
    assert main(_tiny(tiny_model_dirs, out, "--eval-prompts", "0")) == 0
    before = (out / "metrics.json").read_bytes()
    capsys.readouterr()
    for total in ("128", "64"):
        with pytest.raises(SystemExit) as e:
            main(["--out", str(out), "--resume", "--timesteps", total])
        err = capsys.readouterr().err
        assert e.value.code == 2 and "nothing to train" in err and "128 timesteps" in err, err
        assert len(err.strip().splitlines()) == 1
        assert (out / "metrics.json").read_bytes() == before


def test_resume_to_a_total_already_reached_is_refused_by_the_function_too(tiny_pair, tmp_path):
    import dataclasses

    import train
    from train.config import TrainConfig

    out = tmp_path / "run"
    cfg = TrainConfig(out=str(out), timesteps=64, n_steps=64, batch_size=32, n_epochs=1, max_new_tokens=10,
                      max_depth=3, net_arch=(16, 16), wandb_mode="disabled", progress_bar=False, checkpoint_every=64,
                      eval_prompts=0, warmup_prompts=1)
    train.run(tiny_pair, cfg, prompts=["w1 w2 w3", "w4 w5"])
    before = (out / "metrics.json").read_bytes()
    with pytest.raises(ValueError, match="nothing to train"):
        train.run(tiny_pair, dataclasses.replace(TrainConfig.from_run(out), timesteps=64), prompts=["w1 w2 w3"])
    assert (out / "metrics.json").read_bytes() == before


def test_timesteps_that_are_no_multiple_of_n_steps_are_named_before_training(tiny_model_dirs, tmp_path, capsys):
    from train.__main__ import main

    out = tmp_path / "run"
    assert main(_tiny(tiny_model_dirs, out, "--timesteps", "5", "--eval-prompts", "0")) == 0
    err = capsys.readouterr().err
    assert "--timesteps 5" in err and "becomes 64 timesteps" in err, err
    assert json.loads((out / "metrics.json").read_text())["timesteps"] == 64


def test_sigterm_while_the_models_load_is_one_line_and_leaves_no_empty_out(tiny_model_dirs, tmp_path):
    """The models load before the training's own SIGTERM handler exists; a SIGTERM then killed the process
    silently and left the --out folder it had created."""
    out = tmp_path / "run"
    code = ("import os, signal, sys, time\n"
            "import learn2draft.models as m\n"
            "def slow(*a, **k):\n"
            "    os.kill(os.getpid(), signal.SIGTERM)\n"
            "    time.sleep(30)\n"
            "m.load_pair = slow\n"
            "from train.__main__ import main\n"
            f"sys.exit(main({_tiny(tiny_model_dirs, out)!r}))\n")
    r = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120,
                       env={**os.environ, "WANDB_MODE": "disabled"})
    assert r.returncode == 128 + signal.SIGTERM, (r.returncode, r.stderr[-2000:])
    err = r.stderr.strip().splitlines()
    assert err and "interrupted (SIGTERM)" in err[-1] and "Traceback" not in r.stderr, r.stderr[-2000:]
    assert not out.exists()


def test_export_of_a_damaged_model_zip_is_one_error_with_advice(tmp_path, capsys):
    from policies.export import main

    run = tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True)
    (run / "config.json").write_text(json.dumps({"max_depth": 3, "vocab_size": 63}))
    (run / "model.zip").write_bytes(b"PK\x03\x04 cut short")
    (run / "checkpoints" / "ppo_64_steps.zip").write_bytes(b"PK")
    assert main([str(run)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.lower().count("error:") == 1, err
    assert "damaged" in err and "ppo_64_steps.zip" in err, err


def test_the_known_transformers_deprecation_lines_are_silenced_and_only_those(caplog):
    from learn2draft.cli import quiet_library_noise

    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")  # (pytest's settings ignore FutureWarning)
        quiet_library_noise()
        warnings.warn("`past_key_values` is deprecated and will be removed in version 5.40.0 for `forward`. Use "
                      "`cache` instead.", FutureWarning, stacklevel=1)
        warnings.warn("another deprecation", FutureWarning, stacklevel=1)
    assert [str(w.message) for w in seen] == ["another deprecation"]
    logger = logging.getLogger("transformers.generation.utils")
    with caplog.at_level(logging.WARNING):
        logger.warning("Passing `generation_config` together with generation-related arguments=({'x'}) is deprecated "
                       "and will be removed in future versions.")
        logger.warning("something else")
    assert [r.getMessage() for r in caplog.records] == ["something else"]


def test_a_run_killed_during_its_evaluation_resumes_to_its_results(tiny_pair, tmp_path):
    """SIGKILL after training (model.zip and checkpoints written, no metrics.json): --resume with the total already
    reached is not refused; it writes the results without training more."""
    import dataclasses

    import train
    from train.config import TrainConfig

    out = tmp_path / "run"
    cfg = TrainConfig(out=str(out), timesteps=64, n_steps=64, batch_size=32, n_epochs=1, max_new_tokens=10,
                      max_depth=3, net_arch=(16, 16), wandb_mode="disabled", progress_bar=False, checkpoint_every=64,
                      eval_prompts=1, eval_gammas=(0, 2), warmup_prompts=1)
    train.run(tiny_pair, cfg, prompts=["w1 w2 w3", "w4 w5"])
    (out / "metrics.json").unlink()
    m = train.run(tiny_pair, dataclasses.replace(TrainConfig.from_run(out), resume=True), prompts=["w1 w2 w3"])
    assert m["timesteps"] == 64 and m["evaluation"] is not None and (out / "metrics.json").is_file()


def test_an_interrupt_during_a_tree_runs_evaluation_keeps_its_models_and_says_so(tiny_pair, tmp_path, monkeypatch):
    import train
    import train.tree
    from train.config import TrainConfig
    from train.phases import InterruptedAfterTraining

    def interrupted(*a, **k):
        raise KeyboardInterrupt("SIGINT")

    monkeypatch.setattr(train.tree, "_tree_check", interrupted)
    out = tmp_path / "tree"
    cfg = TrainConfig(out=str(out), timesteps=64, size_timesteps=64, n_steps=64, batch_size=32, n_epochs=1,
                      max_new_tokens=12, max_depth=3, net_arch=(16, 16), wandb_mode="disabled", progress_bar=False,
                      checkpoint_every=0, eval_prompts=1, warmup_prompts=1, tree=True, rounds=1, tree_width=2,
                      tree_top_k=3)
    with pytest.raises(InterruptedAfterTraining) as e:
        train.run(tiny_pair, cfg, prompts=["w1 w2 w3 w4", "w5 w6"], eval_prompts=["w20 w21"])
    assert e.value.resumable is False and e.value.timesteps > 0
    assert (out / "model.zip").is_file() and (out / "size_model.zip").is_file()
    assert json.loads((out / "metrics.json").read_text())["interrupted"] is True


def test_an_interrupt_while_the_training_code_imports_is_one_line_not_a_traceback(tmp_path, monkeypatch, capsys):
    """Ctrl-C while stable-baselines3 imports (train.chain, after torch): 'interrupted … while starting' and 130, as
    during torch's import (a new-user review saw a 30-line KeyboardInterrupt traceback there)."""
    import types

    from train.__main__ import main as train_main

    class Importing(types.ModuleType):
        def __getattr__(self, name):
            raise KeyboardInterrupt("SIGINT")

    monkeypatch.setitem(sys.modules, "train.chain", Importing("train.chain"))
    with pytest.raises(SystemExit) as e:
        train_main(["--timesteps", "256", "--out", str(tmp_path / "r")])
    err = capsys.readouterr().err
    assert e.value.code == 130 and "interrupted (SIGINT) while starting; nothing was written" in err
    assert "Traceback" not in err and not (tmp_path / "r").exists()
