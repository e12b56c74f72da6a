"""Draft-tree training (issue 8, item 4): the two tree environments, ``python -m train --tree`` with the
LTD alternation, the exports of both policies, :func:`policies.load.load_tree_policy`, the collapse
warning and the errors for bad settings. Tiny random models only."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from conftest import tiny_llama
from gymnasium.utils.env_checker import check_env
from helpers_loop import greedy_reference, noisy_copy
from test_env import StepClock

import train
from envs.tree import TreeDepthEnv, TreeSizeEnv
from learn2draft.decoding import DraftController, FixedDepthController
from learn2draft.features import FEATURE_NAMES, SIZE_FEATURE_NAMES
from learn2draft.models import make_pair
from learn2draft.tree import FixedTreeController, TreeSpeculativeDecoder
from train.config import TrainConfig

PROMPTS = ["w1 w2 w3 w4", "w5 w6", "w7 w8 w9 w10 w11", "w12"]
PROMPT = torch.tensor([1, 5, 9, 14, 20, 33, 8, 12])


@pytest.fixture(scope="module")
def noisy_pair(tiny_tok):
    """The tiny target with a noisy copy of itself as draft: trees see acceptances and rejections."""
    V = len(tiny_tok)
    target = tiny_llama(V, 0)
    return make_pair(target, noisy_copy(target, 0.3, 1), tiny_tok, tiny_tok)


def size_env(pair, **kw) -> TreeSizeEnv:
    env = TreeSizeEnv(pair, PROMPTS, max_new_tokens=10, max_depth=3, width=2, top_k=3, **kw)
    env.decoder.clock = StepClock()
    return env


# ---------------------------------------------------------------- environments
def test_depth_env_passes_check_env_with_the_chain_spaces(noisy_pair):
    env = TreeDepthEnv(noisy_pair, PROMPTS, max_new_tokens=10, max_depth=3, size=FixedTreeController(3, 2))
    env.decoder.clock = StepClock()
    check_env(env, skip_render_check=True, skip_close_check=True)
    assert env.observation_space.shape == (len(FEATURE_NAMES),) and env.action_space.n == 2
    env.reset(seed=0)
    for _ in range(20):  # CONTINUE to the depth limit: the size controller caps V at 2
        _, r, term, _, info = env.step(1)
        if info["verified"]:
            assert info["verify_size"] <= 2 and r > 0 and term
            break
    else:
        pytest.fail("no verification within 20 CONTINUE steps at max_depth 3")


def test_depth_env_takes_a_callable_size(noisy_pair):
    seen = []

    def size(feats):
        assert feats.shape == (len(SIZE_FEATURE_NAMES),) and feats.dtype == np.float32
        seen.append(feats)
        return 1

    env = TreeDepthEnv(noisy_pair, PROMPTS, max_new_tokens=10, max_depth=2, size=size)
    env.reset(seed=1)
    env.step(1)
    _, _, _, _, info = env.step(0)
    assert info["verified"] and info["verify_size"] == 1 and len(seen) == 1


def test_size_env_passes_check_env_and_caps_actions_beyond_the_tree(noisy_pair):
    env = size_env(noisy_pair)
    check_env(env, skip_render_check=True, skip_close_check=True)
    assert env.observation_space.shape == (len(SIZE_FEATURE_NAMES),) and env.action_space.n == 8
    obs, info = env.reset(seed=0)
    np.testing.assert_array_equal(obs, env.decoder.size_features())
    n = info["tree_nodes"]
    assert 0 < n < 64 and 1 <= info["depth"] <= 3
    _, r, term, trunc, info = env.step(7)  # V = 64 > N: every drafted node is verified
    assert term and not trunc and r > 0
    assert info["requested_size"] == 64 and info["verify_size"] == n
    obs, info = env.reset()  # the generation continues
    assert not info["new_generation"] and info["generated"] > 1
    _, _, _, _, info = env.step(0)
    assert info["verify_size"] == 1


def test_size_env_depth_controller_and_fixed_depth(noisy_pair):
    env = size_env(noisy_pair, depth=2)
    depths = {env.reset(seed=s)[1]["depth"] for s in range(4)}
    assert depths == {2}
    env.set_depth(FixedTreeController(1, 4))  # a DraftController: CONTINUE up to its max_depth
    assert env.reset(seed=0)[1]["depth"] == 1

    class AlwaysStop(DraftController):  # a collapsed depth policy: the size env still drafts one level
        max_depth = 3

        def decide(self, state):
            return False

    env.set_depth(AlwaysStop())
    assert {env.reset(seed=s)[1]["depth"] for s in range(3)} == {1}
    with pytest.raises(ValueError, match="max_depth=3"):
        env.set_depth(5)


# ---------------------------------------------------------------- training, export, loading
def tiny_tree_config(out, **kw) -> TrainConfig:
    base = dict(out=str(out), timesteps=192, size_timesteps=64, n_steps=64, batch_size=32, n_epochs=2,
                max_new_tokens=12, max_depth=3, net_arch=(16, 16), wandb_mode="disabled", progress_bar=False,
                checkpoint_every=0, eval_prompts=1, warmup_prompts=1, tree=True, rounds=1, tree_width=2, tree_top_k=3)
    base.update(kw)
    return TrainConfig(**base)


def test_tree_run_trains_both_policies_and_exports_them(noisy_pair, tmp_path):
    from policies.check import check_export
    from policies.load import load_policy, load_tree_policy
    from policies.tree import TreePolicyController

    out = tmp_path / "tree"
    m = train.run(noisy_pair, tiny_tree_config(out), prompts=PROMPTS, eval_prompts=["w20 w21"])
    assert [p["phase"] for p in m["phases"]] == ["size-round1", "depth-round1"]
    assert m["phases"][0]["timesteps"] == 64 and m["phases"][1]["timesteps"] == 192
    assert set(m["phases"][0]["action_fractions"]) == {f"V={v}" for v in (1, 2, 4, 8, 16, 32, 48, 64)}
    assert sum(m["phases"][0]["action_fractions"].values()) == pytest.approx(1.0)
    assert m["export_check"]["agreement"] == 1.0 and {"learned_tree", "autoregressive"} <= set(m["evaluation"])
    for sub in ("policy", "size_policy"):
        report = check_export(out / sub)
        assert report["passed"], report["problems"]
    spec = json.loads((out / "size_policy/feature_spec.json").read_text())
    assert [f["name"] for f in spec["features"]] == list(SIZE_FEATURE_NAMES)
    pcfg = json.loads((out / "size_policy/policy_config.json").read_text())
    assert pcfg["verify_sizes"] == [1, 2, 4, 8, 16, 32, 48, 64] and pcfg["actions"]["4"].startswith("verify V = 16")
    with open(out / "logs/size-round1/progress.csv") as f:
        header = f.readline().strip().split(",")
    assert "actions/size/V=16" in header and "actions/size/collapsed" in header
    with pytest.raises(ValueError, match="load_tree_policy"):
        load_policy(out / "size_policy")

    ctrl = load_tree_policy(out)
    assert isinstance(ctrl, TreePolicyController) and ctrl.depth_policy is not None and ctrl.size_policy is not None
    assert (ctrl.width, ctrl.top_k, ctrl.depth_feature_scale) == (2, 3, 3)
    ref = greedy_reference(noisy_pair.target, PROMPT, 20, noisy_pair.vocab_size, noisy_pair.eos_token_ids)
    dec = TreeSpeculativeDecoder(noisy_pair, max_new_tokens=20, max_depth=ctrl.depth_feature_scale, width=ctrl.width,
                                 top_k=ctrl.top_k)
    assert dec.generate(PROMPT, ctrl).tokens == ref
    # the size policy on full-depth trees (the depth policy may stop early): V from the set, capped at N
    sized = TreePolicyController(None, ctrl.size_policy, ctrl.verify_sizes, max_depth=3, width=2, top_k=3, tree_depth=3)
    res = dec.generate(PROMPT, sized)
    assert res.tokens == ref
    full = [c.verify_size for c in res.cycles if c.depth == 3]  # N = 3 + 6 + 6 nodes (W = 2, k = 3)
    assert full and all(v in (1, 2, 4, 8, 15) for v in full)
    assert load_tree_policy(out / "size_policy").verify_sizes == ctrl.verify_sizes  # a sub-folder works too


@pytest.mark.parametrize("only", ["depth", "size"])
def test_tree_run_with_one_policy(noisy_pair, tmp_path, only):
    from policies.load import load_tree_policy

    out = tmp_path / only
    m = train.run(noisy_pair, tiny_tree_config(out, policies=(only,), timesteps=64, size_timesteps=64,
                                               eval_prompts=0, verify_size=4, tree_depth=2),
                  prompts=PROMPTS)
    assert [p["policy"] for p in m["phases"]] == [only]
    assert (out / "policy").is_dir() == (only == "depth") and (out / "size_policy").is_dir() == (only == "size")
    ctrl = load_tree_policy(out)
    dec = TreeSpeculativeDecoder(noisy_pair, max_new_tokens=12, max_depth=3, width=2, top_k=3)
    res = dec.generate(PROMPT, ctrl)
    if only == "depth":
        assert all(c.verify_size <= 4 for c in res.cycles)  # the fixed V
    else:
        assert all(c.depth <= 2 for c in res.cycles)  # the fixed depth


def test_collapse_warning_fires_for_a_collapsed_policy(noisy_pair, tmp_path):
    from stable_baselines3 import PPO

    from train.callbacks import ActionDistributionCallback, PolicyCollapseWarning, action_fractions, collapse_message

    env = size_env(noisy_pair)
    model = PPO("MlpPolicy", env, n_steps=32, batch_size=32, n_epochs=1, policy_kwargs={"net_arch": [8]}, seed=0,
                device="cpu")
    with torch.no_grad():  # every action but V = 16 made (numerically) impossible
        model.policy.action_net.weight.zero_()
        model.policy.action_net.bias.fill_(-50.0)
        model.policy.action_net.bias[4] = 50.0
    cb = ActionDistributionCallback("size", {i: f"V={v}" for i, v in enumerate(env.verify_sizes)})
    with pytest.warns(PolicyCollapseWarning, match="size policy collapsed .* V=16"):
        model.learn(32, callback=cb)
    assert cb.collapses and cb.last_fractions["V=16"] == 1.0
    # and it stays quiet for a policy that spreads its actions
    fr = action_fractions(np.array([0, 1, 1, 0, 1]), 2)
    np.testing.assert_allclose(fr, [0.4, 0.6])
    assert collapse_message("depth", fr, {0: "STOP", 1: "CONTINUE"}) is None
    assert "CONTINUE" in collapse_message("depth", action_fractions(np.ones(40), 2), {0: "STOP", 1: "CONTINUE"})


# ---------------------------------------------------------------- bad input
@pytest.mark.parametrize("kw, match", [
    ({"drafter": "lookup"}, "lookup"),
    ({"policies": ("depth", "width")}, "unknown: width"),
    ({"policies": ()}, "--policies"),
    ({"verify_sizes": ()}, "empty"),
    ({"verify_sizes": (4, 2)}, "strictly increasing"),
    ({"tree_depth": 9}, "--tree-depth"),
    ({"rounds": 0}, "rounds"),
])
def test_bad_tree_settings_are_refused(kw, match, tmp_path):
    with pytest.raises(ValueError, match=match):
        tiny_tree_config(tmp_path / "x", **kw).validate()


def test_cli_refuses_lookup_trees_and_unknown_policies(capsys, tmp_path):
    from train.__main__ import main

    for args, match in ((["--drafter", "lookup"], "lookup"), (["--policies", "depth,sise"], "unknown: sise"),
                        (["--verify-sizes", ""], "empty")):
        with pytest.raises(SystemExit) as e:
            main(["--tree", "--out", str(tmp_path / "cli"), "--wandb-mode", "disabled", *args])
        assert e.value.code == 2
        assert match in capsys.readouterr().err
    assert not (tmp_path / "cli").exists()


def test_envs_refuse_bad_input(noisy_pair):
    with pytest.raises(ValueError, match="empty"):
        TreeSizeEnv(noisy_pair, PROMPTS, max_new_tokens=10, max_depth=3, verify_sizes=[])
    with pytest.raises(ValueError, match="does not draft trees"):
        TreeDepthEnv(noisy_pair, PROMPTS, max_new_tokens=10, max_depth=3, drafter="lookup")
    with pytest.raises(ValueError, match="no verification-size decision"):
        TreeDepthEnv(noisy_pair, PROMPTS, max_new_tokens=10, max_depth=3,
                     size=FixedDepthController(2))
    env = size_env(noisy_pair)
    env.reset(seed=0)
    with pytest.raises(ValueError, match="valid actions are 0..7"):
        env.step(8)


# ---------------------------------------------------------------- shipped policies
def test_shipped_head_tree_policies_load_and_pass_the_parity_check():
    from policies.check import check_export
    from policies.layout import DEPTH_DIR, SIZE_DIR, default_tree_policy_dir
    from policies.load import load_tree_policy

    d = default_tree_policy_dir("head")
    for sub in (DEPTH_DIR, SIZE_DIR):
        report = check_export(d / sub)
        assert report["passed"], report["problems"]
    ctrl = load_tree_policy(d)
    assert ctrl.depth_policy is not None and ctrl.size_policy is not None
    assert (ctrl.width, ctrl.top_k, ctrl.depth_feature_scale) == (4, 4, 8)
    assert ctrl.verify_sizes == (1, 2, 4, 8, 16, 32, 48, 64)
    v = ctrl.verification_size(np.zeros(len(SIZE_FEATURE_NAMES), np.float32), 0)
    assert v == 0  # capped at the node count the features give (an empty tree)
    with pytest.raises(FileNotFoundError, match="lookup"):
        default_tree_policy_dir("lookup")


@pytest.mark.slow
def test_shipped_head_tree_drives_the_real_pair_greedily(default_pair):
    from learn2draft.drafters import make_drafter
    from policies.layout import default_tree_policy_dir
    from policies.load import load_tree_policy

    ctrl = load_tree_policy(default_tree_policy_dir("head"))
    prompt = default_pair.encode_prompt("Name three colours.")
    ref = greedy_reference(default_pair.target, prompt, 16, default_pair.vocab_size, default_pair.eos_token_ids)
    dec = TreeSpeculativeDecoder(default_pair, max_new_tokens=16, max_depth=ctrl.depth_feature_scale, width=ctrl.width,
                                 top_k=ctrl.top_k, drafter=make_drafter("head", default_pair))
    assert dec.generate(prompt, ctrl).tokens == ref
