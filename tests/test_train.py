"""``python -m train``: the training function on tiny models, the CLI, and its error handling."""

from __future__ import annotations

import csv
import dataclasses
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import train
from train.__main__ import build_parser, config_from_args, main
from train.callbacks import make_wandb_output_format
from train.config import TrainConfig
from train.outdir import prepare_out_dir

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
    from policies import SB3Controller, load_policy

    ctrl = load_policy(out / "policy")
    g = SpeculativeDecoder(tiny_pair, max_new_tokens=6, max_depth=ctrl.max_depth).generate(
        tiny_pair.encode_prompt("w1 w2"), ctrl)
    ref = SpeculativeDecoder(tiny_pair, max_new_tokens=6, max_depth=3).generate(
        tiny_pair.encode_prompt("w1 w2"), SB3Controller(out / "model.zip"))
    assert g.tokens == ref.tokens and len(g.tokens) == 6  # greedy: the same text whatever the depths
    assert [c.depth for c in g.cycles] == [c.depth for c in ref.cycles]  # the trained model's own decisions


def test_engine_features_train_export_and_run_through_the_vllm_protocol(tiny_pair, tmp_path):
    """--features engine: the policy sees only what vLLM's draft-length protocol passes; its export
    carries the engine spec and parity vectors, and the final check drives it through the protocol."""
    from learn2draft.features import ENGINE_FEATURE_NAMES
    from policies.check import check_export
    from policies.vllm import LearnedDraftLengthPolicy

    out = tmp_path / "engine"
    m = train.run(tiny_pair, tiny_config(out, features="engine", max_depth=4, eval_gammas=(0, 4)), prompts=PROMPTS,
                  eval_prompts=["w20 w21"])
    spec = json.loads((out / "policy/feature_spec.json").read_text())
    assert spec["kind"] == "engine" and [f["name"] for f in spec["features"]] == list(ENGINE_FEATURE_NAMES)
    assert json.loads((out / "feature_spec.json").read_text()) == spec
    assert m["export_check"]["agreement"] == 1.0 and check_export(out)["passed"]
    assert LearnedDraftLengthPolicy(out).num_spec_tokens == 4
    # the evaluation's mean depth is that of the exported policy driven through the protocol on its prompt
    from learn2draft import SpeculativeDecoder
    from policies.vllm import ProtocolController

    dec = SpeculativeDecoder(tiny_pair, max_new_tokens=10, max_depth=4)
    g = dec.generate(tiny_pair.encode_prompt("w20 w21"), ProtocolController(LearnedDraftLengthPolicy(out), dec))
    assert m["evaluation"]["policy"]["mean_depth"] == pytest.approx(sum(c.depth for c in g.cycles) / len(g.cycles))
    assert json.loads((out / "config.json").read_text())["features"] == "engine"


def test_seeded_runs_learn_the_same_policy(tiny_pair, tmp_path, monkeypatch):
    """Same seed → same prompts, actions and updates; wall-clock rewards are the only noise, so with a
    deterministic clock (1 ms per reading) two runs must end with identical weights."""
    from stable_baselines3 import PPO

    from learn2draft.timing import DeviceClock

    def fake_clock(monkeypatch):
        ticks = iter(range(10**9))
        monkeypatch.setattr(DeviceClock, "now", lambda self: next(ticks) * 1e-3)

    runs = []
    for name in ("a", "b"):
        fake_clock(monkeypatch)
        m = train.run(tiny_pair, tiny_config(tmp_path / name, timesteps=128, eval_prompts=0, checkpoint_every=0),
                      prompts=PROMPTS)
        runs.append((m, PPO.load(str(tmp_path / name / "model.zip"), device="cpu").policy.state_dict()))
    (ma, wa), (mb, wb) = runs
    assert ma["cycles"] == mb["cycles"] and ma["reward_scale"] == mb["reward_scale"]
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)
    # …and the weights moved away from the seeded initial ones: the runs learnt, identically
    from envs.spec_decode import SpecDecodeEnv

    env = SpecDecodeEnv(tiny_pair, PROMPTS, max_new_tokens=10, max_depth=3)
    init = PPO("MlpPolicy", env, seed=0, policy_kwargs={"net_arch": [16, 16]}, device="cpu").policy.state_dict()
    assert init.keys() == wa.keys() and any(not torch.equal(wa[k], init[k]) for k in wa)


def test_run_refuses_to_overwrite_results(tiny_pair, tmp_path):
    out = fake_run(tmp_path / "run")
    with pytest.raises(FileExistsError, match="--overwrite"):
        train.run(tiny_pair, tiny_config(out), prompts=PROMPTS)
    assert (out / "model.zip").read_text() == "old model"
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "model.zip").write_text("someone's")
    with pytest.raises(FileExistsError, match="did not write"):
        train.run(tiny_pair, tiny_config(tmp_path / "other"), prompts=PROMPTS)


@pytest.mark.parametrize("kw, match", [
    ({"timesteps": 0}, "timesteps"), ({"timesteps": -5}, "timesteps"), ({"batch_size": 1000}, "batch_size"),
    ({"wandb_mode": "sometimes"}, "wandb_mode"), ({"reward_scale": 0.0}, "reward_scale"),
    ({"episode": "forever"}, "episode"), ({"temperature": -1.0}, "temperature"), ({"max_depth": 0}, "max_depth"),
    ({"eval_gammas": (0, 99)}, r"eval_gammas must be in \[0, max_depth=3\]"), ({"discount": 1.5}, "discount"),
    ({"features": "some"}, "features"),
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
    assert cfg.discount == d.discount == 1.0 and not hasattr(cfg, "gamma")  # γ is the draft depth, not the discount
    assert config_from_args(build_parser().parse_args(["--max-depth", "3"])).fixed_gammas() == (0, 3)
    assert cfg.out == "runs/default"  # where python -m eval looks by default
    monkeypatch.setenv("WANDB_MODE", "disabled")
    assert config_from_args(build_parser().parse_args([])).wandb_mode == "disabled"


def test_every_sampling_flag_reaches_the_runs_sampling():
    """The shared sampling flags map onto TrainConfig and its SamplingConfig (the run samples with all of them);
    under --replay the ones the traces' header does not hand over are refused, not dropped."""
    from learn2draft.sampling import SamplingConfig

    argv = ["--temperature", "0.7", "--top-k", "3", "--top-p", "0.9", "--min-p", "0.05", "--repetition-penalty", "1.2",
            "--presence-penalty", "0.5"]
    cfg = config_from_args(build_parser().parse_args(argv))
    assert cfg.sampling() == SamplingConfig(0.7, 3, 0.9, 0.05, 1.2, 0.5)
    assert config_from_args(build_parser().parse_args([])).sampling() == SamplingConfig()
    replay = config_from_args(build_parser().parse_args(["--replay", "t.npz", "--profile", "cpu-2core", "--min-p", "0.1"]))
    with pytest.raises(ValueError, match="--min-p.*with --replay"):
        replay.validate()


@pytest.mark.parametrize("args, match", [
    (["--timesteps", "0"], "--timesteps must be > 0"),
    (["--target", "/nonexistent/model-dir"], "not found"),
    (["--wandb-mode", "sometimes"], "--wandb-mode must be one of"),
    (["--net-arch", "a,b"], "net-arch"),
    (["--tree", "--drafter", "head", "--verify-size", "8"], "--verify-size is the fixed V"),
    (["--tree", "--drafter", "head", "--tree-depth", "3"], "--tree-depth is the fixed depth"),
])
def test_cli_bad_input_is_a_clear_error(args, match, tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        main([*args, "--out", str(tmp_path / "run")])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert match in err and "Traceback" not in err
    assert not (tmp_path / "run").exists()


def test_cli_refuses_existing_run_dir_and_unwritable_out(tmp_path, capsys, tiny_model_dirs):
    fake_run(tmp_path / "run")
    (tmp_path / "blocker").write_text("x")
    for out, match in ((tmp_path / "run", "--overwrite"), (tmp_path / "blocker" / "run", "Cannot write")):
        with pytest.raises(SystemExit) as e:  # real model folders: their files are checked before --out
            main(["--out", str(out), "--target", tiny_model_dirs[0], "--draft", tiny_model_dirs[1]])
        assert e.value.code == 2
        assert match in capsys.readouterr().err


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



def fake_run(out: Path, interrupted: bool | None = False) -> Path:
    """A directory shaped like a finished (or interrupted: no / an interrupted metrics.json) training run."""
    (out / "checkpoints").mkdir(parents=True)
    import zipfile

    with zipfile.ZipFile(out / "checkpoints" / "ppo_64_steps.zip", "w") as z:  # a whole archive (truncated ones are skipped)
        z.writestr("data", "old")
    (out / "eval").mkdir()
    (out / "config.json").write_text(json.dumps({"env_id": "learn2draft/SpecDecode-v0", "timesteps": 64}))
    (out / "model.zip").write_text("old model")
    if interrupted is not None:
        (out / "metrics.json").write_text(json.dumps({"interrupted": interrupted}))
    (out / "notes.txt").write_text("user file")
    return out


def test_prepare_out_dir_deletes_nothing_and_names_the_state(tmp_path):
    out = fake_run(tmp_path / "run")
    with pytest.raises(FileExistsError, match="--overwrite"):
        prepare_out_dir(out)
    prepare_out_dir(out, overwrite=True)  # checks only: the run is replaced later, by run()
    assert (out / "model.zip").read_text() == "old model" and (out / "checkpoints" / "ppo_64_steps.zip").exists()
    killed = fake_run(tmp_path / "killed", interrupted=None)
    with pytest.raises(FileExistsError, match="interrupted run .*64 timesteps.*--resume"):
        prepare_out_dir(killed)
    with pytest.raises(FileExistsError, match="interrupted run .*--resume"):
        prepare_out_dir(fake_run(tmp_path / "stopped", interrupted=True))
    assert prepare_out_dir(killed, resume=True) == killed
    with pytest.raises(FileNotFoundError, match="no training run"):
        prepare_out_dir(tmp_path / "empty", resume=True)


def test_overwrite_refuses_a_directory_it_did_not_write(tiny_model_dirs, tmp_path, capsys):
    """A Hugging Face model directory has a config.json too: --overwrite must not delete it."""
    model_dir = Path(tiny_model_dirs[1])
    before = sorted(p.name for p in model_dir.iterdir())
    for kw in ({}, {"overwrite": True}):
        with pytest.raises(FileExistsError, match="did not write"):
            prepare_out_dir(model_dir, **kw)
    with pytest.raises(SystemExit) as e:
        main([*TINY_ARGS, "--target", tiny_model_dirs[0], "--draft", tiny_model_dirs[1], "--out", str(model_dir),
              "--overwrite"])
    assert e.value.code == 2 and "did not write" in capsys.readouterr().err
    assert sorted(p.name for p in model_dir.iterdir()) == before


def test_overwrite_keeps_the_earlier_run_when_the_device_check_fails(tiny_model_dirs, tmp_path, capsys):
    out = fake_run(tmp_path / "run")
    with pytest.raises(SystemExit) as e:
        main([*TINY_ARGS, "--target", tiny_model_dirs[0], "--draft", tiny_model_dirs[1], "--out", str(out),
              "--overwrite", "--device", "cuda:7"])
    assert e.value.code == 2 and "Traceback" not in capsys.readouterr().err
    assert (out / "model.zip").read_text() == "old model" and (out / "checkpoints" / "ppo_64_steps.zip").exists()


def test_overwrite_restores_the_earlier_run_when_the_new_one_fails(tiny_pair, tmp_path, monkeypatch):
    out = fake_run(tmp_path / "run")

    def broken_wandb(*a, **k):
        raise RuntimeError("wandb exploded")

    monkeypatch.setattr(train.callbacks, "init_wandb", broken_wandb)
    with pytest.raises(RuntimeError, match="exploded"):
        train.run(tiny_pair, tiny_config(out, overwrite=True, eval_prompts=0), prompts=PROMPTS)
    assert (out / "model.zip").read_text() == "old model" and (out / "checkpoints" / "ppo_64_steps.zip").exists()
    assert json.loads((out / "config.json").read_text())["timesteps"] == 64
    assert not (out / "feature_spec.json").exists() and not (out / ".replaced").exists()


def test_overwrite_replaces_the_earlier_run_and_keeps_user_files(tiny_pair, tmp_path):
    out = fake_run(tmp_path / "run")
    train.run(tiny_pair, tiny_config(out, overwrite=True, eval_prompts=0, timesteps=64, checkpoint_every=32),
              prompts=PROMPTS)
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["ppo_32_steps.zip", "ppo_64_steps.zip"]
    assert (out / "model.zip").read_bytes()[:2] == b"PK" and not (out / "eval").exists()
    assert (out / "notes.txt").read_text() == "user file" and not (out / ".replaced").exists()


def test_resume_continues_a_killed_run_from_its_last_checkpoint(tiny_pair, tmp_path):
    out = tmp_path / "run"
    first = train.run(tiny_pair, tiny_config(out, eval_prompts=0), prompts=PROMPTS)
    wandb_id = json.loads((out / "config.json").read_text())["wandb_run_id"]
    # what a kill after the first checkpoint leaves: config.json, checkpoints, logs — no model, no metrics
    for name in ("model.zip", "metrics.json", "checkpoints/ppo_128_steps.zip"):
        (out / name).unlink()
    with pytest.raises(FileExistsError, match="interrupted run .*--resume"):
        train.run(tiny_pair, tiny_config(out, eval_prompts=0), prompts=PROMPTS)
    m = train.run(tiny_pair, TrainConfig.from_run(out), prompts=PROMPTS)
    assert m["resumed_from_timesteps"] == 64 and m["timesteps"] == 128 and not m["interrupted"]
    assert m["reward_scale"] == first["reward_scale"]  # the saved scale, not a new measurement
    saved = json.loads((out / "config.json").read_text())
    assert saved["wandb_run_id"] == wandb_id and saved["resumed"] == [{"from_timesteps": 64}]
    assert (out / "logs" / "progress-resumed-64.csv").is_file() and (out / "logs" / "progress.csv").is_file()
    # a finished run can be extended: --timesteps is the new total
    m2 = train.run(tiny_pair, dataclasses.replace(TrainConfig.from_run(out), timesteps=192), prompts=PROMPTS)
    assert m2["resumed_from_timesteps"] == 128 and m2["timesteps"] == 192


def test_a_checkpoint_is_written_whole_or_not_at_all_and_a_truncated_one_is_passed_over(tiny_pair, tmp_path):
    """A kill while a checkpoint is written must not cost the run its resume: save_model writes beside the file and
    renames it (a save that fails half-way leaves the previous file and no .zip), and latest_checkpoint passes over a
    truncated ppo_*_steps.zip (what an in-place write killed half-way leaves) for the newest whole one."""
    from train.outdir import latest_checkpoint
    from train.phases import save_model

    out = tmp_path / "run"
    train.run(tiny_pair, tiny_config(out, eval_prompts=0), prompts=PROMPTS)
    ckpts = out / "checkpoints"
    assert latest_checkpoint(out) == (ckpts / "ppo_128_steps.zip", 128)

    class Dies:  # a model whose save is killed after writing part of the archive
        def save(self, f):
            f.write(b"PK\x03\x04 half an archive")
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        save_model(Dies(), ckpts / "ppo_192_steps.zip")
    assert not (ckpts / "ppo_192_steps.zip").exists() and latest_checkpoint(out)[1] == 128
    (ckpts / "ppo_256_steps.zip").write_bytes(b"PK\x03\x04 truncated")  # an older run's in-place write, killed
    assert latest_checkpoint(out) == (ckpts / "ppo_128_steps.zip", 128)
    (ckpts / "ppo_256_steps.zip").unlink()
    # the left-over .partial is the run's own file: --resume continues from 128
    m = train.run(tiny_pair, dataclasses.replace(TrainConfig.from_run(out), timesteps=192), prompts=PROMPTS)
    assert m["resumed_from_timesteps"] == 128 and m["timesteps"] == 192


def test_cli_resume_refuses_changed_settings(tmp_path, capsys):
    out = fake_run(tmp_path / "run", interrupted=None)
    cfg = TrainConfig(out=str(out))
    (out / "config.json").write_text(json.dumps({**dataclasses.asdict(cfg), "env_id": "learn2draft/SpecDecode-v0"}))
    with pytest.raises(SystemExit) as e:
        main(["--out", str(out), "--resume", "--max-depth", "5"])
    assert e.value.code == 2 and "max_depth is 8 there, 5 here" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:
        main(["--out", str(out), "--resume", "--overwrite"])
    assert e.value.code == 2 and "exclude each other" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:
        main(["--out", str(tmp_path / "nothing"), "--resume"])
    assert e.value.code == 2 and "no training run" in capsys.readouterr().err


def test_wandb_online_without_credentials_is_one_line_before_anything(tmp_path, monkeypatch, capsys):
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.setenv("NETRC", str(tmp_path / "no-netrc"))
    monkeypatch.setenv("WANDB_CONFIG_DIR", str(tmp_path / "wandb-config"))
    with pytest.raises(SystemExit) as e:
        main(["--wandb-mode", "online", "--out", str(tmp_path / "run")])
    err = capsys.readouterr().err
    assert e.value.code == 2 and "credentials" in err and "wandb login" in err and "Traceback" not in err
    assert len(err.strip().splitlines()) == 1
    assert not (tmp_path / "run").exists()


# ------------------------------------------------------------------ signals (subprocess)
REPO = Path(__file__).resolve().parent.parent


def _start_training(tiny_model_dirs, out: Path, *extra: str) -> subprocess.Popen:
    """``python -m train`` on the tiny model directories, for far more timesteps than the test waits."""
    args = [*TINY_ARGS, "--timesteps", "100000", "--checkpoint-every", "64", "--eval-prompts", "0",
            "--target", tiny_model_dirs[0], "--draft", tiny_model_dirs[1], "--out", str(out), *extra]
    return subprocess.Popen([sys.executable, "-m", "train", *args], cwd=REPO, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env={**os.environ, "WANDB_MODE": "disabled"})


def _wait_for_checkpoint(proc: subprocess.Popen, out: Path, timeout: float = 180.0) -> None:
    t0 = time.monotonic()
    while not list((out / "checkpoints").glob("ppo_*_steps.zip")):
        assert proc.poll() is None, proc.communicate()
        assert time.monotonic() - t0 < timeout, "no checkpoint written"
        time.sleep(0.2)


def test_sigterm_saves_says_interrupted_exits_nonzero_and_resumes(tiny_model_dirs, tmp_path):
    out = tmp_path / "run"
    proc = _start_training(tiny_model_dirs, out)
    _wait_for_checkpoint(proc, out)
    proc.send_signal(signal.SIGTERM)
    stdout, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 128 + signal.SIGTERM, stderr
    summary = json.loads(stdout)
    assert summary["interrupted"] is True and "--resume" in stderr and "Traceback" not in stderr
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["interrupted"] and metrics["interrupted_by"] == "SIGTERM"
    done = metrics["timesteps"]
    assert (out / "model.zip").is_file() and (out / "policy" / "policy.onnx").is_file()
    assert (out / "checkpoints" / f"ppo_{done}_steps.zip").is_file()  # resumable from where it stopped
    # without --resume: the state is named, not "already holds results"
    rerun = subprocess.run([sys.executable, "-m", "train", "--out", str(out), "--target", tiny_model_dirs[0],
                            "--draft", tiny_model_dirs[1]], cwd=REPO, capture_output=True, text=True)
    assert rerun.returncode == 2 and "interrupted run" in rerun.stderr and "--resume" in rerun.stderr
    # --resume with the saved settings and a new total
    resumed = subprocess.run([sys.executable, "-m", "train", "--out", str(out), "--resume", "--timesteps",
                              str(done + 64)], cwd=REPO, capture_output=True, text=True,
                             env={**os.environ, "WANDB_MODE": "disabled"})
    assert resumed.returncode == 0, resumed.stderr
    metrics = json.loads((out / "metrics.json").read_text())
    assert not metrics["interrupted"] and metrics["resumed_from_timesteps"] == done
    assert metrics["timesteps"] >= done + 64


def test_a_killed_run_resumes_from_its_last_checkpoint(tiny_model_dirs, tmp_path):
    out = tmp_path / "run"
    proc = _start_training(tiny_model_dirs, out)
    _wait_for_checkpoint(proc, out)
    proc.kill()
    proc.communicate(timeout=60)
    steps = max(int(p.name.split("_")[1]) for p in (out / "checkpoints").glob("ppo_*_steps.zip"))
    with pytest.raises(FileExistsError, match=f"interrupted run .*{steps} timesteps.*--resume"):
        prepare_out_dir(out)
    resumed = subprocess.run([sys.executable, "-m", "train", "--out", str(out), "--resume", "--timesteps",
                              str(steps + 64)], cwd=REPO, capture_output=True, text=True,
                             env={**os.environ, "WANDB_MODE": "disabled"})
    assert resumed.returncode == 0, resumed.stderr
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["resumed_from_timesteps"] == steps and metrics["timesteps"] >= steps + 64



def test_a_half_built_optimizer_state_is_dropped_before_an_interrupted_checkpoint():
    """A signal inside Adam's lazy state initialisation ('step' set, 'exp_avg' not yet) used to save a
    checkpoint whose resume failed with KeyError: 'exp_avg'."""
    import torch

    from train.callbacks import drop_partial_optimizer_state

    a, b = torch.nn.Parameter(torch.ones(2)), torch.nn.Parameter(torch.ones(2))
    opt = torch.optim.Adam([a, b])
    (a.sum() + b.sum()).backward()
    opt.step()
    opt.state[b] = {"step": torch.tensor(1.0)}  # as an interrupt inside _init_group leaves it
    assert drop_partial_optimizer_state(opt) == 1 and b not in opt.state and "exp_avg" in opt.state[a]
    opt.step()  # re-initialises b's state instead of raising KeyError
    assert "exp_avg" in opt.state[b]


def test_replay_keeps_a_max_depth_the_traces_hold_and_refuses_a_given_one_above(tiny_pair, tmp_path):
    """Under --replay, max_depth is not replaced by the traces' when they hold it (issue 15: an explicit
    --max-depth 8 was replaced by the traces' depth); the default is lowered to shallower traces' depth, and
    a max_depth given explicitly above what the traces hold is refused by name."""
    from learn2draft.drafters import make_drafter
    from learn2draft.sampling import SamplingConfig
    from learn2draft.traces import record_traces
    from train.chain import apply_replay_settings

    def traces(depth: int) -> str:
        path = tmp_path / f"d{depth}.npz"
        record_traces(tiny_pair, make_drafter("lookup", tiny_pair), PROMPTS[:2], SamplingConfig(), max_new_tokens=6,
                      max_depth=depth, progress=False).save(path)
        return str(path)

    deep, shallow = traces(10), traces(3)
    cfg = TrainConfig(replay=deep, profile="cpu-2core", max_depth=8)
    apply_replay_settings(cfg, given={"max_depth"})
    assert cfg.max_depth == 8
    cfg = TrainConfig(replay=deep, profile="cpu-2core")  # the default, held by the traces: kept too
    assert apply_replay_settings(cfg).max_depth == cfg.max_depth == 8
    cfg = TrainConfig(replay=shallow, profile="cpu-2core")  # the default, deeper than the traces: theirs
    assert apply_replay_settings(cfg).max_depth == cfg.max_depth == 3
    with pytest.raises(ValueError, match="--max-depth 8, but the traces .* max_depth=3"):
        apply_replay_settings(TrainConfig(replay=shallow, profile="cpu-2core", max_depth=8), given={"max_depth"})


def test_replay_takes_its_precision_from_the_profile_without_timing_auto(tiny_pair, tmp_path, monkeypatch, capsys):
    """Under --replay no model runs: --dtype auto (the default) is not timed before the flags are checked, and the
    policy records the precision the profile's costs were measured in (cpu-amx-bf16: bfloat16)."""
    import learn2draft.models as models
    from learn2draft.drafters import make_drafter
    from learn2draft.sampling import SamplingConfig
    from learn2draft.traces import record_traces
    from train.chain import apply_replay_settings

    def no_timing(*a, **k):
        raise AssertionError("auto was timed under --replay")

    monkeypatch.setattr(models, "fastest_dtype", no_timing)
    path = tmp_path / "t.npz"
    record_traces(tiny_pair, make_drafter("lookup", tiny_pair), PROMPTS[:2], SamplingConfig(), max_new_tokens=4,
                  max_depth=3, progress=False).save(path)
    for given in ([], ["--dtype", "auto"]):
        cfg = config_from_args(build_parser().parse_args(["--replay", str(path), "--profile", "cpu-amx-bf16", *given]))
        assert cfg.dtype == "auto"
        apply_replay_settings(cfg, given={"dtype"} if given else set())
        assert cfg.dtype == "bfloat16"
    cfg = config_from_args(build_parser().parse_args(["--replay", str(path), "--profile", "cpu-amx-bf16", "--dtype",
                                                      "fp32"]))
    assert cfg.dtype == "float32"  # a name given is kept, canonical
    apply_replay_settings(cfg, given={"dtype"})
    assert cfg.dtype == "float32"
    # the traces (float32, the tiny pair) and the profile (bfloat16) disagree: said on stderr, with what to do
    err = capsys.readouterr().err
    assert "recorded in float32" in err and "measured in bfloat16" in err and "eval.profile --dtype float32" in err
    assert err.count("warning:") == 1  # the earlier calls on these traces and this profile said it already
    apply_replay_settings(cfg, given={"dtype"})  # a command checks its settings, then builds the environment
    assert "warning" not in capsys.readouterr().err
    capsys.readouterr()
    apply_replay_settings(config_from_args(build_parser().parse_args(["--replay", str(path), "--profile",
                                                                      "cpu-2core"])), given=set())
    assert "warning" not in capsys.readouterr().err  # cpu-2core: float32, as the traces


def test_resume_keeps_the_saved_precision_and_measures_nothing(tmp_path, monkeypatch):
    """--resume continues a run in its saved precision: repeating the replay command with --dtype auto (the profile
    gave bfloat16) is not a changed setting, the short form (--out R --resume) does not time auto either, and a
    precision named otherwise is refused by name."""
    import learn2draft.models as models
    from train.__main__ import resume_config
    from train.config import REPLAY_ENV_ID

    def no_timing(*a, **k):
        raise AssertionError("auto was timed on --resume")

    monkeypatch.setattr(models, "fastest_dtype", no_timing)
    run = tmp_path / "run"
    run.mkdir()
    saved = dataclasses.asdict(TrainConfig(replay="t.npz", profile="cpu-amx-bf16", dtype="bfloat16", out=str(run)))
    (run / "config.json").write_text(json.dumps({**saved, "env_id": REPLAY_ENV_ID}))
    for argv in (["--replay", "t.npz", "--profile", "cpu-amx-bf16", "--dtype", "auto", "--out", str(run), "--resume"],
                 ["--out", str(run), "--resume"]):
        assert resume_config(build_parser().parse_args(argv), argv).dtype == "bfloat16"
    argv = ["--dtype", "float32", "--out", str(run), "--resume"]
    with pytest.raises(ValueError, match="dtype is 'bfloat16' there, 'float32' here"):
        resume_config(build_parser().parse_args(argv), argv)


def test_overwrite_refuses_user_files_inside_the_runs_folders_and_lists_them(tmp_path):
    """--overwrite replaces what a run wrote; a user's own file inside policy/, checkpoints/ or eval/ is listed
    and the overwrite refused (it used to be deleted without a word)."""
    out = fake_run(tmp_path / "run")
    (out / "policy").mkdir()
    for own in ("policy/policy.onnx", "policy/parity.json", "eval/results.md", "logs/depth-round1/progress.csv",
                "checkpoints/depth-round1/ppo_depth_64_steps.zip"):
        (out / own).parent.mkdir(parents=True, exist_ok=True)
        (out / own).write_text("the run's own")
    prepare_out_dir(out, overwrite=True)  # the run's own files only (and notes.txt beside them, never touched)
    for mine in ("policy/NOTES.md", "checkpoints/best_by_hand.zip", "eval/my-analysis.ipynb"):
        (out / mine).write_text("mine")
    with pytest.raises(FileExistsError, match="best_by_hand.zip.*eval/my-analysis.ipynb.*policy/NOTES.md"):
        prepare_out_dir(out, overwrite=True)
    assert (out / "policy" / "NOTES.md").read_text() == "mine"


def test_a_killed_overwrite_keeps_the_old_run_and_says_where(tmp_path):
    """After an --overwrite killed by SIGKILL, the replaced run waits in .replaced/: the rerun's advice names it and
    a second --overwrite refuses to delete it."""
    out = fake_run(tmp_path / "run", interrupted=None)  # the new run's config.json, no metrics: killed
    (out / ".replaced").mkdir()
    (out / ".replaced" / "model.zip").write_text("the old model")
    with pytest.raises(FileExistsError, match=r"interrupted run.*\.replaced"):
        prepare_out_dir(out)
    with pytest.raises(FileExistsError, match=r"\.replaced.*would delete"):
        prepare_out_dir(out, overwrite=True)
    assert (out / ".replaced" / "model.zip").read_text() == "the old model"


def test_a_log_file_gets_one_plain_progress_line_per_rollout(tiny_pair, tmp_path, capsys):
    """Standard error is not a terminal under capsys (as in `make demo > log`): training prints one plain line per
    rollout, without the progress bar's carriage-return frames (it printed nothing until it ended)."""
    out = tmp_path / "run"
    train.run(tiny_pair, tiny_config(out, progress_bar=True, eval_prompts=0, checkpoint_every=0), prompts=PROMPTS)
    for spec in (out / "feature_spec.json", out / "policy" / "feature_spec.json"):  # entropy is divided by ln V
        assert json.loads(spec.read_text())["vocab_size"] == tiny_pair.vocab_size, spec
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith("train: ")]
    assert "\r" not in err and [line.split()[1] for line in lines] == ["64/128", "128/128"], err
    assert "ep_rew_mean=" in lines[-1]


def test_train_prompts_file_quiet_and_verbose_flags(tmp_path, capsys):
    """`train --prompts FILE` trains on a user's prompts (as `eval --prompts` measures on them); -q hides the
    progress display, -v prints SB3's table of each PPO update on standard error."""
    from stable_baselines3.common.logger import HumanOutputFormat

    from train import phases

    f = tmp_path / "mine.jsonl"
    f.write_text('{"prompt": "Summarise: the cat sat."}\n{"prompt": "Translate: hola"}\n')
    cfg = config_from_args(build_parser().parse_args(["--prompts", str(f)]))
    cfg.validate()
    assert cfg.prompts == str(f) and phases.training_prompts(cfg, None) == ["Summarise: the cat sat.", "Translate: hola"]
    with pytest.raises(ValueError, match="--prompts.*--replay"):
        config_from_args(build_parser().parse_args(["--prompts", str(f), "--replay", "t.npz", "--profile",
                                                    "cpu-2core"])).validate()
    with pytest.raises(SystemExit) as e:  # a missing file: one error before any model loads
        main(["--prompts", str(tmp_path / "none.jsonl"), "--out", str(tmp_path / "run")])
    assert e.value.code == 2 and "No prompt file" in capsys.readouterr().err and not (tmp_path / "run").exists()
    assert not config_from_args(build_parser().parse_args(["-q"])).progress_bar
    verbose = config_from_args(build_parser().parse_args(["-v"]))
    assert verbose.verbose and verbose.progress_bar
    with pytest.raises(SystemExit):
        build_parser().parse_args(["-q", "-v"])

    class Model:
        def set_logger(self, logger):
            self.logger = logger

    m = Model()
    phases.set_logger(m, tmp_path / "logs", None, verbose=True)
    assert any(isinstance(f, HumanOutputFormat) for f in m.logger.output_formats)


def test_the_wandb_sync_hint_quotes_the_path():
    from train.__main__ import wandb_sync_hint

    assert wandb_sync_hint("runs/my run/wandb") == "wandb sync 'runs/my run/wandb'/offline-run-*"
