"""``python -m train``: the training function on tiny models, the CLI, and its error handling."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest
import torch
from conftest import tiny_llama

import train
from train.__main__ import build_parser, config_from_args, main
from train.training import TrainConfig, make_wandb_output_format, prepare_out_dir

PROMPTS = ["w1 w2 w3 w4", "w5 w6", "w7 w8 w9 w10 w11", "w12"]




def tiny_config(out: Path, **kw) -> TrainConfig:
    base = dict(out=str(out), timesteps=128, n_steps=64, batch_size=32, n_epochs=2, max_new_tokens=10, max_depth=3,
                net_arch=(16, 16), wandb_mode="disabled", progress_bar=False, checkpoint_every=64, eval_prompts=1,
                eval_gammas=(0, 2), warmup_prompts=1)
    base.update(kw)
    return TrainConfig(**base)


TINY_ARGS = ["--timesteps", "128", "--n-steps", "64", "--batch-size", "32", "--n-epochs", "2", "--max-new-tokens", "10",
             "--max-depth", "3", "--net-arch", "16,16", "--wandb-mode", "disabled", "--no-progress-bar",
             "--checkpoint-every", "64", "--eval-prompts", "1", "--warmup-prompts", "1"]


def test_run_on_tiny_pair_writes_everything(tiny_pair, tmp_path):
    out = tmp_path / "run"
    m = train.run(tiny_pair, tiny_config(out), prompts=PROMPTS, eval_prompts=["w20 w21"])
    for name in ("model.zip", "config.json", "feature_spec.json", "metrics.json", "logs/progress.csv",
                 "policy/policy.onnx", "policy/feature_spec.json", "policy/policy_config.json", "policy/export_check.json"):
        assert (out / name).is_file(), name
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["ppo_128_steps.zip", "ppo_64_steps.zip"]
    assert m["timesteps"] == 128 and m["export_check"]["agreement"] == 1.0
    assert m["reward_scale"] == pytest.approx(m["autoregressive_warmup"]["cycle_tokens_per_s"])
    assert m["cycles"]["cycles"] > 0 and 0 <= m["cycles"]["cycle_depth_mean"] <= 3
    assert set(m["evaluation"]) == {"fixed_gamma_0", "fixed_gamma_2", "policy", "prompts"}
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["max_depth"] == 3 and cfg["timesteps"] == 128 and cfg["sampling"]["temperature"] == 0.0
    assert cfg["reward_scale_used"] == m["reward_scale"]
    pcfg = json.loads((out / "policy/policy_config.json").read_text())
    assert pcfg["max_depth"] == 3 and pcfg["training"]["n_steps"] == 64
    with open(out / "logs/progress.csv") as f:
        header = next(csv.reader(f))
    for key in ("rollout/ep_rew_mean", "train/value_loss", "cycle/tokens_per_s", "cycle/depth", "cycle/accepted"):
        assert key in header
    # the exported policy drives the decoder
    from learn2draft import SpeculativeDecoder
    from policies import load_policy

    ctrl = load_policy(out / "policy")
    g = SpeculativeDecoder(tiny_pair, max_new_tokens=6, max_depth=ctrl.max_depth).generate(
        tiny_pair.encode_prompt("w1 w2"), ctrl)
    assert len(g.tokens) >= 1


def test_seeded_runs_learn_the_same_policy(tiny_pair, tmp_path):
    """Same seed → same prompts and actions; only timing noise differs, so rewards (and weights) may not."""
    a = train.run(tiny_pair, tiny_config(tmp_path / "a", timesteps=64, eval_prompts=0, checkpoint_every=0), prompts=PROMPTS)
    b = train.run(tiny_pair, tiny_config(tmp_path / "b", timesteps=64, eval_prompts=0, checkpoint_every=0), prompts=PROMPTS)
    assert a["cycles"]["cycles"] == b["cycles"]["cycles"]  # the first rollout's actions are seeded


def test_run_refuses_to_overwrite_results(tiny_pair, tmp_path):
    out = tmp_path / "run"
    out.mkdir()
    (out / "model.zip").write_text("old")
    with pytest.raises(FileExistsError, match="--overwrite"):
        train.run(tiny_pair, tiny_config(out), prompts=PROMPTS)
    assert (out / "model.zip").read_text() == "old"


@pytest.mark.parametrize("kw, match", [
    ({"timesteps": 0}, "timesteps"), ({"timesteps": -5}, "timesteps"), ({"batch_size": 1000}, "batch_size"),
    ({"wandb_mode": "sometimes"}, "wandb_mode"), ({"reward_scale": 0.0}, "reward_scale"),
    ({"episode": "forever"}, "episode"), ({"temperature": -1.0}, "temperature"), ({"max_depth": 0}, "max_depth"),
])
def test_bad_settings_raise_value_error(tiny_pair, tmp_path, kw, match):
    with pytest.raises(ValueError, match=match):
        train.run(tiny_pair, tiny_config(tmp_path / "run", **kw), prompts=PROMPTS)
    assert not (tmp_path / "run").exists()


def test_prepare_out_dir(tmp_path):
    assert prepare_out_dir(tmp_path / "a" / "b").is_dir()
    (tmp_path / "file").write_text("x")
    with pytest.raises(FileExistsError):
        prepare_out_dir(tmp_path / "file")
    with pytest.raises(PermissionError, match="Cannot write"):
        prepare_out_dir(tmp_path / "file" / "sub")


def test_wandb_output_format_forwards_sb3_metrics():
    from stable_baselines3.common.logger import Logger

    class FakeRun:
        def __init__(self):
            self.logged = []

        def log(self, data):
            self.logged.append(data)

    run = FakeRun()
    fmt = make_wandb_output_format(run)
    logger = Logger(None, [fmt])
    logger.record("rollout/ep_rew_mean", 1.5)
    logger.record("train/value_loss", torch.tensor(0.25))
    logger.record("time/name", "text")  # not numeric: skipped
    logger.record("train/hidden", 3.0, exclude="wandb")
    logger.dump(step=7)
    assert run.logged == [{"rollout/ep_rew_mean": 1.5, "train/value_loss": 0.25, "global_step": 7}]
    assert fmt.last_values == {"rollout/ep_rew_mean": 1.5, "train/value_loss": 0.25}


# ------------------------------------------------------------------ CLI
def test_help(capsys):
    with pytest.raises(SystemExit) as e:
        main(["--help"])
    assert e.value.code == 0
    text = capsys.readouterr().out
    for flag in ("--timesteps", "--max-new-tokens", "--target", "--draft", "--device", "--dtype", "--temperature",
                 "--wandb-mode", "--out", "--overwrite", "--seed"):
        assert flag in text


def test_cli_defaults_map_to_train_config(monkeypatch):
    monkeypatch.delenv("WANDB_MODE", raising=False)
    cfg = config_from_args(build_parser().parse_args([]))
    d = TrainConfig()
    assert cfg.wandb_mode == "offline" and cfg.timesteps == d.timesteps and cfg.max_depth == d.max_depth
    assert cfg.out == "runs/default"  # where python -m eval looks by default
    monkeypatch.setenv("WANDB_MODE", "disabled")
    assert config_from_args(build_parser().parse_args([])).wandb_mode == "disabled"


@pytest.mark.parametrize("args, match", [
    (["--timesteps", "0"], "timesteps must be > 0"),
    (["--target", "/nonexistent/model-dir"], "not found"),
    (["--wandb-mode", "sometimes"], "wandb_mode"),
    (["--net-arch", "a,b"], "net-arch"),
])
def test_cli_bad_input_is_a_clear_error(args, match, tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        main([*args, "--out", str(tmp_path / "run")])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert match in err and "Traceback" not in err
    assert not (tmp_path / "run").exists()


def test_cli_refuses_existing_run_dir_and_unwritable_out(tmp_path, capsys):
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "config.json").write_text("{}")
    (tmp_path / "blocker").write_text("x")
    for out, match in ((tmp_path / "run", "--overwrite"), (tmp_path / "blocker" / "run", "Cannot write")):
        with pytest.raises(SystemExit) as e:
            main(["--out", str(out), "--target", str(tmp_path / "run"), "--draft", str(tmp_path / "run")])
        assert e.value.code == 2
        assert match in capsys.readouterr().err


@pytest.fixture(scope="module")
def tiny_model_dirs(tmp_path_factory, tiny_tok):
    """The tiny target and draft saved as local model directories ("bring your own models")."""
    root = tmp_path_factory.mktemp("models")
    V = len(tiny_tok)
    dirs = []
    for name, model in (("target", tiny_llama(V, 0)), ("draft", tiny_llama(V, 1, layers=1))):
        model.save_pretrained(root / name)
        tiny_tok.save_pretrained(root / name)
        dirs.append(str(root / name))
    return dirs


def test_cli_end_to_end_with_local_model_dirs(tiny_model_dirs, tmp_path, capsys):
    target, draft = tiny_model_dirs
    out = tmp_path / "run"
    assert main([*TINY_ARGS, "--target", target, "--draft", draft, "--out", str(out)]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["onnx_agreement"] == 1.0 and summary["timesteps"] == 128
    assert (out / "policy" / "policy.onnx").is_file()
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["target"] == target and cfg["draft"] == draft
    # a second run into the same directory needs --overwrite
    with pytest.raises(SystemExit) as e:
        main([*TINY_ARGS, "--target", target, "--draft", draft, "--out", str(out)])
    assert e.value.code == 2
    assert main([*TINY_ARGS, "--target", target, "--draft", draft, "--out", str(out), "--overwrite",
                 "--eval-prompts", "0"]) == 0



def test_overwrite_removes_stale_results_of_the_earlier_run(tmp_path):
    out = tmp_path / "run"
    (out / "checkpoints").mkdir(parents=True)
    (out / "checkpoints" / "ppo_64_steps.zip").write_text("old")
    (out / "eval").mkdir()
    (out / "config.json").write_text("{}")
    (out / "notes.txt").write_text("user file")
    prepare_out_dir(out, overwrite=True)
    assert not (out / "checkpoints").exists() and not (out / "eval").exists() and not (out / "config.json").exists()
    assert (out / "notes.txt").read_text() == "user file"  # only this tool's results are removed
