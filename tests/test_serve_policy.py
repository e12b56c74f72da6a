"""The load-aware policy end to end: ``python -m train --serve-loads`` in replay, its export, and the same policy in
the real batched decoder — the real loop's features equal the replay's for the same state, one γ per step for every
row, bad inputs refused before work."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from test_serve_replay import D, batched_profile, synthetic_traces

from learn2draft.features import FEATURE_VERSION, SERVE_FEATURE_NAMES
from learn2draft.state import LoadState


@pytest.fixture(scope="module")
def serve_run(tmp_path_factory):
    """A load-aware policy trained in replay on synthetic traces and a profile where verification is cheap at batch
    1 and expensive at batch 4+ (so the best γ depends on the load)."""
    import train
    from train.config import TrainConfig

    root = tmp_path_factory.mktemp("serve")
    tr = synthetic_traces(accept=0.8, drafter="lookup")
    tr.header.update(format="learn2draft-trace", format_version=1, structure="chain", feature_version=FEATURE_VERSION,
                     sampling={"temperature": 0.0, "top_k": 0, "top_p": 1.0})
    traces = tr.save(root / "t.npz")
    prof = batched_profile(verify=lambda B, n, c: 0.010 + 0.0005 * (n - 1) if B == 1 else 0.010 + 0.004 * (B * n - 1),
                           draft=lambda B: 0.0005 * B).save(root / "p.json")
    cfg = TrainConfig(out=str(root / "run"), timesteps=256, n_steps=64, batch_size=32, n_epochs=2, net_arch=(16, 16),
                      wandb_mode="disabled", progress_bar=False, checkpoint_every=0, replay=str(traces),
                      profile=str(prof), serve_loads="1,4", serve_requests=6, drafter="lookup")
    metrics = train.run(None, cfg)
    return root, metrics


def test_train_exports_a_load_aware_policy_with_its_profile_and_a_replay_check(serve_run):
    from policies.load import load_policy, load_serve_policy

    root, m = serve_run
    pol = root / "run" / "policy"
    spec = json.loads((pol / "feature_spec.json").read_text())
    assert spec["kind"] == "serve" and [f["name"] for f in spec["features"]] == list(SERVE_FEATURE_NAMES)
    assert spec["actions"] == D + 1 and spec["batch_scale"] >= 4 and (pol / "profile.json").is_file()
    assert m["export_check"]["agreement"] == 1.0 and json.loads((root / "run" / "config.json").read_text())[
        "env_id"] == "learn2draft/ServeReplay-v0"
    ev = m["evaluation"]
    assert ev["loads"] == ["c=1", "c=4"] and {"learned", "no speculation", "per-batch-size table",
                                              "adaptive verification"} <= set(ev["tokens_per_s"])
    assert all(len(v) == 2 and all(x > 0 for x in v) for v in ev["tokens_per_s"].values())
    policy = load_serve_policy(root / "run")
    assert policy.max_depth == D and policy.profile.has_batch_axis
    with pytest.raises(ValueError, match="load-aware policy"):
        load_policy(root / "run")  # a chain tool refuses it with the loader to use


def test_the_real_loop_sees_the_replays_features_for_the_same_state(serve_run):
    """LoadAwarePolicy (real loop) and ReplayServePolicy (replay) build the observation from the same numbers."""
    from envs.serve import ReplayServePolicy
    from learn2draft.replay.serve import LoadFeatures, RowFeatures
    from policies.load import load_serve_policy

    root, _ = serve_run
    real = load_serve_policy(root / "run")
    replay = ReplayServePolicy(lambda o: 0, real.profile, real.drafter, real.max_depth, real.max_new_tokens,
                               real.batch_scale, real.context_scale)
    ctx, tau, depth, avail, left = [20, 31, 25], [2, 0, 1], [3, 2, 0], [3, 0, 2], [10, 4, 7]
    load = LoadState(3, 8, tuple(ctx), 1, tuple(tau), tuple(depth), tuple(avail), tuple(left), D, real.max_new_tokens)
    a = np.asarray(ctx)
    lf = LoadFeatures(3, 1, int(a.sum()), float(a.mean()), int(a.max()), 8, D, 0, 0.0)
    rows = RowFeatures(np.arange(3), np.arange(3), a, a - 10, np.asarray(left), np.asarray(avail), np.asarray(tau),
                       np.asarray(depth), np.full((3, D), np.nan), np.zeros((3, D)))
    np.testing.assert_array_equal(real.features(load), replay.observation(lf, rows))
    assert real.features(load).shape == (len(SERVE_FEATURE_NAMES),)


def test_the_load_aware_policy_drives_the_batched_decoder(serve_run, tiny_pair):
    """One γ per step, decided once from the step's load and shared by its rows; greedy output stays the target's."""
    from helpers_loop import greedy_reference

    from learn2draft.batched import BatchedSpeculativeDecoder, Request, serve
    from policies.load import load_serve_policy

    root, _ = serve_run
    policy = load_serve_policy(root / "run")
    prompts = [torch.tensor([3, 4, 5, 3, 4, 5, 3, 4]), torch.tensor([6, 7, 6, 7, 6, 7]), torch.tensor([8, 9, 10, 8, 9])]
    dec = BatchedSpeculativeDecoder(tiny_pair, "lookup", max_new_tokens=10, max_depth=policy.max_depth, max_batch=3)
    out = serve(dec, [Request(p) for p in prompts], policy, concurrency=3)
    assert len(policy.gammas) == len(dec.steps)  # one decision per step
    for step, g in zip(dec.steps, policy.gammas):
        assert all(c.depth <= g for c in step.rows.values())
    for p, r in zip(prompts, out):
        assert r.tokens == greedy_reference(tiny_pair.target, p, 10, tiny_pair.vocab_size, eos=tiny_pair.eos_token_ids)


def test_a_killed_load_aware_run_resumes_from_its_checkpoint(tmp_path):
    """A --serve-loads run killed after a checkpoint (no model, no metrics yet) is an interrupted training run that
    --resume continues (its config.json names the ServeReplay env)."""
    import dataclasses

    import train
    from train.config import TrainConfig, read_run_config

    tr = synthetic_traces(accept=0.8, drafter="lookup")
    tr.header.update(format="learn2draft-trace", format_version=1, structure="chain", feature_version=FEATURE_VERSION,
                     sampling={"temperature": 0.0, "top_k": 0, "top_p": 1.0})
    traces = tr.save(tmp_path / "t.npz")
    prof = batched_profile().save(tmp_path / "p.json")
    out = tmp_path / "run"
    cfg = TrainConfig(out=str(out), timesteps=128, n_steps=64, batch_size=32, n_epochs=1, net_arch=(8,),
                      wandb_mode="disabled", progress_bar=False, checkpoint_every=64, replay=str(traces),
                      profile=str(prof), serve_loads="1,4", serve_requests=4, drafter="lookup")
    train.run(None, cfg)
    assert read_run_config(out)["env_id"] == "learn2draft/ServeReplay-v0"
    for name in ("model.zip", "metrics.json", "checkpoints/ppo_128_steps.zip"):  # what a kill after 64 steps leaves
        (out / name).unlink()
    with pytest.raises(FileExistsError, match="interrupted run .*64 timesteps.*--resume"):
        train.run(None, cfg)
    m = train.run(None, dataclasses.replace(TrainConfig.from_run(out), timesteps=128))
    assert m["resumed_from_timesteps"] == 64 and m["timesteps"] == 128 and not m["interrupted"]


def test_serve_loads_bad_input_is_refused_before_work():
    from train.config import TrainConfig

    for kwargs, match in (({"serve_loads": "1,4"}, "--serve-loads trains a load-aware policy in replay"),
                          ({"serve_loads": "1,x", "replay": "t.npz", "profile": "p.json"}, "concurrency levels"),
                          ({"serve_loads": "0", "replay": "t.npz", "profile": "p.json"}, "concurrency levels"),
                          ({"serve_loads": "2", "replay": "t.npz", "profile": "p.json", "serve_requests": 0},
                           "--serve-requests")):
        with pytest.raises(ValueError, match=match):
            TrainConfig(**kwargs).validate()


def test_vllms_schedule_semantics_as_documented():
    """PR #32374's example: inclusive ranges, gaps inherit the previous K, past the last range the last K, clamped to
    num_speculative_tokens."""
    from policies.vllm import vllm_schedule, vllm_scheduled_k

    doc = {"1-16": 3, "64-128": 2, "256-4096": 0}
    got = {b: vllm_scheduled_k(doc, b, 3) for b in (1, 16, 17, 63, 64, 128, 200, 256, 5000)}
    assert got == {1: 3, 16: 3, 17: 3, 63: 3, 64: 2, 128: 2, 200: 2, 256: 0, 5000: 0}
    assert vllm_scheduled_k({"1-8": 6}, 4, num_speculative_tokens=4) == 4  # clamped to the start-up maximum
    assert vllm_scheduled_k([[1, 4, 2], [5, 8, 0]], 6, 8) == 0  # vLLM's list form too
    assert vllm_schedule({1: 6, 4: 3, 16: 0}) == {"1-1": 6, "2-4": 3, "5-16": 0}
    with pytest.raises(ValueError, match="not a range"):
        vllm_scheduled_k({"4-2": 1}, 3, 4)


def test_the_run_exports_a_vllm_schedule_that_vllm_reads_back_as_the_policys_gammas(serve_run):
    from envs.serve import ServeReplayEnv, batch_gammas
    from policies.load import load_serve_policy
    from policies.vllm import vllm_scheduled_k

    root, m = serve_run
    sched = json.loads((root / "run" / "policy" / "vllm_schedule.json").read_text())
    assert sched["num_speculative_tokens"] == D and m["evaluation"]["vllm_schedule"] == sched[
        "num_speculative_tokens_per_batch_size"]
    table = sched["num_speculative_tokens_per_batch_size"]  # vLLM 0.34.0's list form: ranges from 1, contiguous
    assert isinstance(table, list) and table[0][0] == 1 and all(a[1] + 1 == b[0] for a, b in zip(table, table[1:]))
    graph = load_serve_policy(root / "run").graph
    env = ServeReplayEnv(str(root / "t.npz"), str(root / "p.json"), loads=[1, 4], num_requests=6, max_depth=D,
                         balance=True)
    gammas = batch_gammas(env, lambda o: int(graph.actions(o)[0]))
    per_b = {b: vllm_scheduled_k(sched["num_speculative_tokens_per_batch_size"], b, D) for b in range(1, 9)}
    assert per_b[1] == gammas[1] and all(per_b[b] == gammas[4] for b in range(2, 9))


def test_eval_serve_runs_a_load_aware_policy_and_replays_it(serve_run, tiny_model_dirs, tmp_path):
    from eval.serve import main as serve_main

    root, _ = serve_run
    prompts = tmp_path / "p.json"
    prompts.write_text(json.dumps(["a b c a b c a b", "d e d e d e", "f g h f g h"]))
    out = tmp_path / "serve"
    argv = ["--target", tiny_model_dirs[0], "--draft", tiny_model_dirs[1], "--prompts", str(prompts), "--device", "cpu",
            "--dtype", "float32", "--max-new-tokens", "6", "--num-requests", "3", "--num-train-requests", "2",
            "--gammas", "1,2", "--methods", "nospec,fixed", "--concurrency", "1,2", "--calibration-concurrency", "1",
            "--arrival-rates", "", "--max-depth", str(D), "--policy", str(root / "run"),
            "--sim-traces", str(root / "t.npz"), "--out", str(out)]
    assert serve_main(argv) == 0
    rep = json.loads((out / "serve.json").read_text())
    assert all("learned policy" in lv["methods"] for lv in rep["levels"])
    assert "learned policy" in rep["sim_vs_real"]["concurrency 2"]
    # with --policy both learned rows run: the policy alone and behind the speed guard, each judged by the goals
    assert all("learned + speed guard" in lv["methods"] for lv in rep["levels"])
    assert rep["roles"]["guarded"] == "learned + speed guard" and rep["guard"]["batch_sizes"]
    claims = [v["claim"] for v in rep["verdicts"]]
    assert sum(c.startswith("learned + guard ≥") for c in claims) == 4 and sum(
        c.startswith("learned ≥") for c in claims) == 4
    assert "the speed guard" in (out / "serve.md").read_text()


def test_eval_serve_runs_the_guard_with_a_step_time_cap(serve_run, tiny_model_dirs, tmp_path):
    """--methods capped: the load-aware policy behind its own speed guard, with a StepTimeCap priced by the start-up
    cost profile; its row is measured at every level and the report carries what the cap saw."""
    from eval.serve import main as serve_main

    root, _ = serve_run
    prompts = tmp_path / "p.json"
    prompts.write_text(json.dumps(["a b c a b c a b", "d e d e d e", "f g h f g h", "i j k l m n"]))
    out = tmp_path / "serve"
    argv = ["--target", tiny_model_dirs[0], "--draft", tiny_model_dirs[1], "--prompts", str(prompts), "--device", "cpu",
            "--dtype", "float32", "--max-new-tokens", "6", "--num-requests", "4", "--num-train-requests", "2",
            "--methods", "nospec,capped", "--concurrency", "2", "--arrival-rates", "", "--max-depth", str(D),
            "--cost-repeats", "1", "--step-slack", "0.02", "--policy", str(root / "run"), "--out", str(out)]
    assert serve_main(argv) == 0
    rep = json.loads((out / "serve.json").read_text())
    assert all(set(lv["methods"]) == {"no speculation (γ=0)", "learned + guard + step-time cap"}
               for lv in rep["levels"])
    cap = rep["capped"]["cap"]
    assert cap["slack"] == 0.02 and cap["steps"] > 0 and cap["verified"] <= cap["drafted"]
    assert "costs" in rep and rep["capped"]["guard"].startswith("SpeculationGuard(")
    assert rep["roles"]["capped"] == "learned + guard + step-time cap"
    assert "the step-time cap (slack 0.02)" in (out / "serve.md").read_text()
    verdicts = {v["claim"]: v["verdict"] for v in rep["verdicts"]}
    assert verdicts["learned + guard + cap ≥ 1.00× no speculation at every level (tok/s, ITL p50/p99)"] in ("PASS",
                                                                                                          "FAIL")


def test_eval_serve_methods_name_the_learned_rows(serve_run):
    from eval.serve import parse_methods

    assert parse_methods("nospec", True) == ["nospec", "policy", "guard"]
    assert parse_methods("nospec,guard", True) == ["nospec", "guard"]
    assert parse_methods("policy,nospec", True) == ["nospec", "policy"]
    with pytest.raises(ValueError, match="--methods guard needs --policy"):
        parse_methods("nospec,guard", False)
    assert parse_methods("capped,nospec", True) == ["nospec", "capped"]


def test_the_wandb_summary_of_a_serve_run_has_each_methods_rate_per_load(serve_run, monkeypatch):
    from types import SimpleNamespace

    import wandb

    from train.chain import _log_summary
    from train.config import TrainConfig

    class Run:
        def __init__(self):
            self.summary, self.artifacts = {}, []

        def log_artifact(self, art):
            self.artifacts.append(art)

    monkeypatch.setattr(wandb, "Artifact", lambda *a, **k: SimpleNamespace(add_dir=lambda d: None))
    root, m = serve_run
    run = Run()
    _log_summary(run, m, root / "run", TrainConfig(serve_loads="1,4", replay="t.npz", profile="p.json"))
    assert run.summary["eval/learned/c=4/tokens_per_s"] == m["evaluation"]["tokens_per_s"]["learned"][1]
    assert run.artifacts and run.summary["timesteps"] == m["timesteps"]
