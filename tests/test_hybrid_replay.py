"""The hybrid-drafter replay (envs.hybrid, learn2draft.replay.hybrid): outcomes equal the real decoder's for the same
per-token actions (lookup + draft model, exact at T = 0), the oracle is an upper bound, the env passes gymnasium's
checks, and bad trace sets are clear errors."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import tiny_llama
from gymnasium.utils.env_checker import check_env
from helpers_loop import noisy_copy
from test_replay import PROMPTS, linear_profile

from envs.hybrid import HybridReplayEnv, replay_hybrid_controller, split_hybrid_traces
from learn2draft.control import FixedDepthController
from learn2draft.decoding import SpeculativeDecoder
from learn2draft.drafters import make_drafter
from learn2draft.features import FEATURE_NAMES, HYBRID_FEATURE_NAMES
from learn2draft.models import make_pair
from learn2draft.replay.hybrid import hybrid_oracle_seconds
from learn2draft.sampling import SamplingConfig
from learn2draft.traces import record_traces
from policies.rules import LookupFirstController, SuffixScoreController

N, D = 16, 4
PROMPTS_REPEATING = PROMPTS + ["w20 w21 w22 w20 w21 w22 w20 w21"]


@pytest.fixture(scope="module")
def pair64(tiny_tok):
    target = tiny_llama(len(tiny_tok), 0).double()
    return make_pair(target, noisy_copy(target, 0.3, seed=5), tiny_tok, tiny_tok)


@pytest.fixture(scope="module")
def trace_pair(pair64, tmp_path_factory):
    root = tmp_path_factory.mktemp("hyb")
    paths = []
    for name, depth in (("lookup", D), ("model", 1)):
        tr = record_traces(pair64, make_drafter(name, pair64), PROMPTS_REPEATING, SamplingConfig(), max_new_tokens=N,
                           max_depth=depth, seed=3, progress=False)
        paths.append(str(tr.save(root / f"{name}.npz")))
    return paths


def test_replayed_outcomes_equal_the_real_decoders(pair64, trace_pair):
    env = HybridReplayEnv(trace_pair, linear_profile(), episode="generation")
    dec = SpeculativeDecoder(pair64, SamplingConfig(), max_new_tokens=N, max_depth=D,
                             drafter=make_drafter("lookup+model", pair64))
    rng = np.random.default_rng(0)
    n = len(FEATURE_NAMES)
    cycles = neural = mixed = 0
    for i in env._usable:
        obs, _ = env.reset(options={"prompt_index": i})
        dec.start(torch.as_tensor(env.lookup_traces.prompts[i].prompt_ids))
        while True:
            if dec.depth == 0:  # at a cycle start the replayed observation is exact (target features aside)
                real = dec.features()
                np.testing.assert_allclose(obs[:n], real[:n], atol=1e-6)
                np.testing.assert_allclose(obs[n:n + 4], real[n:n + 4], atol=1e-6)
            a = int(rng.choice([0, 1, 1, 2, 2]))
            obs, _, term, trunc, info = env.step(a)
            res = dec.step(a)
            assert info["verified"] == (res is not None)
            if res is None:
                continue
            cycles += 1
            neural += res.neural_drafted
            mixed += 0 < res.neural_drafted < res.depth
            assert (info["depth"], info["accepted"], info["tokens"]) == (res.depth, res.num_accepted, len(res.tokens))
            if res.num_accepted >= res.depth - 1:  # every token drafted on the greedy prefix: sources exact too
                assert info["neural_drafted"] == res.neural_drafted
            assert info["generated"] == dec.generated
            if info["generation_finished"]:
                assert dec.finished and (term or trunc)
                break
    assert cycles > 20 and neural > 0 and mixed > 0


def test_oracle_bounds_every_rule_and_fixed_depth(trace_pair):
    env = HybridReplayEnv(trace_pair, linear_profile())
    oracle = env.oracle_rate()
    rates = {repr(c): replay_hybrid_controller(env, c)["tokens_per_s"]
             for c in (FixedDepthController(0), FixedDepthController(2), FixedDepthController(4),
                       LookupFirstController(2, D), SuffixScoreController(1, D))}
    assert all(r <= oracle * (1 + 1e-9) for r in rates.values()), (oracle, rates)
    assert oracle > rates["FixedDepthController(num_draft_tokens=0)"]
    assert env.autoregressive_rate() == pytest.approx(rates["FixedDepthController(num_draft_tokens=0)"], rel=1e-9)
    secs, choice = hybrid_oracle_seconds(env.replay_data(env._usable[0]))
    assert secs > 0 and (choice >= 0).all()


@pytest.mark.parametrize("episode", ["cycle", "generation"])
def test_check_env_passes(trace_pair, episode):
    env = HybridReplayEnv(trace_pair, linear_profile(), episode=episode)
    check_env(env, skip_render_check=True)
    obs, _ = env.reset(seed=0)
    assert obs.shape == (len(FEATURE_NAMES) + len(HYBRID_FEATURE_NAMES),) and env.action_space.n == 3
    with pytest.raises(ValueError, match="Invalid action"):
        env.step(3)


def test_bad_trace_sets_are_clear_errors(trace_pair, pair64, tmp_path):
    with pytest.raises(ValueError, match="ONE neural drafter"):
        split_hybrid_traces([trace_pair[0]])
    other = record_traces(pair64, make_drafter("model", pair64), PROMPTS[:2], SamplingConfig(), max_new_tokens=N,
                          max_depth=1, seed=3, progress=False).save(tmp_path / "m.npz")
    with pytest.raises(ValueError, match="same prompts"):
        split_hybrid_traces([trace_pair[0], str(other)])
    hot = record_traces(pair64, make_drafter("model", pair64), PROMPTS_REPEATING, SamplingConfig(temperature=1.0),
                        max_new_tokens=N, max_depth=1, seed=3, progress=False).save(tmp_path / "hot.npz")
    with pytest.raises(ValueError, match="temperature-0"):
        split_hybrid_traces(f"{trace_pair[0]},{hot}")


def test_train_a_hybrid_policy_in_replay_and_run_it_on_the_real_loop(pair64, trace_pair, tmp_path):
    import json

    import train
    from policies.load import load_policy
    from train.config import TrainConfig

    prof = linear_profile().save(tmp_path / "p.json")
    cfg = TrainConfig(out=str(tmp_path / "run"), timesteps=128, n_steps=64, batch_size=32, n_epochs=2,
                      net_arch=(16, 16), wandb_mode="disabled", progress_bar=False, checkpoint_every=0,
                      replay=",".join(trace_pair), profile=str(prof), eval_gammas=(0, 2))
    m = train.run(None, cfg)
    assert m["export_check"]["agreement"] == 1.0 and cfg.drafter == "lookup+model"
    ev = m["evaluation"]
    assert ev["policy"]["ratio_to_oracle"] <= 1 + 1e-9 and ev["best_fixed"]["ratio_to_oracle"] <= 1 + 1e-9
    assert {"vLLM lookup-first γ=2", "Arctic score rule k=2", "lookup γ=2", "neural γ=2"} <= set(ev)
    spec = json.loads((tmp_path / "run/policy/feature_spec.json").read_text())
    assert spec["kind"] == "hybrid" and spec["shape"] == [len(FEATURE_NAMES) + len(HYBRID_FEATURE_NAMES)]
    ctrl = load_policy(tmp_path / "run")
    assert ctrl.drafter == "lookup+model" and ctrl.n_actions == 3
    dec = SpeculativeDecoder(pair64, max_new_tokens=N, max_depth=ctrl.max_depth, drafter=make_drafter("lookup+model",
                                                                                                       pair64))
    look = split_hybrid_traces(trace_pair)[0]
    for pt in look.prompts[:3]:  # greedy: the recorded text, whatever the learned choices
        assert dec.generate(torch.as_tensor(pt.prompt_ids), ctrl).tokens == pt.output.tolist()
    with pytest.raises(ValueError, match="trains in replay"):
        TrainConfig(out=str(tmp_path / "r2"), drafter="lookup+head", wandb_mode="disabled").validate()


def test_hybrid_traces_recorded_with_other_settings_are_refused(pair64, trace_pair, tmp_path):
    short = record_traces(pair64, make_drafter("model", pair64), PROMPTS_REPEATING, SamplingConfig(),
                          max_new_tokens=N // 2, max_depth=1, seed=3, progress=False).save(tmp_path / "short.npz")
    with pytest.raises(ValueError, match="different max_new_tokens"):
        split_hybrid_traces([trace_pair[0], str(short)])
    env = HybridReplayEnv(trace_pair, linear_profile())
    cov = env.coverage
    assert cov["tokens_replayed"] <= cov["tokens_recorded"] and cov["prompts"] == len(PROMPTS_REPEATING)


def test_the_hybrid_backend_checks_its_traces_and_profile(trace_pair):
    """The hybrid replay backend takes the trace files or a checked (lookup, neural) pair: the pair in the wrong order,
    no profile, several profiles and calls before start are one clear error each."""
    from learn2draft.replay.backend import HybridReplayDecoder
    from learn2draft.replay.traces import load_traces

    look, neural = (load_traces(p) for p in trace_pair)
    by_files = HybridReplayDecoder(trace_pair, linear_profile())
    by_pair = HybridReplayDecoder((look, neural), linear_profile())
    assert by_files.autoregressive_rate() == pytest.approx(by_pair.autoregressive_rate(), rel=1e-12)
    with pytest.raises(ValueError, match="takes \\(lookup traces, model or head traces\\)"):
        HybridReplayDecoder((neural, look), linear_profile())
    with pytest.raises(ValueError, match="profile is required"):
        HybridReplayDecoder(trace_pair, None)
    with pytest.raises(ValueError, match="one latency profile, got 2"):
        HybridReplayDecoder(trace_pair, [linear_profile(), "gpu-like"])
    with pytest.raises(RuntimeError, match="Call start"):
        by_files.features()
    with pytest.raises(ValueError, match="max_depth must be an integer in \\[1, 4\\]"):
        HybridReplayDecoder(trace_pair, linear_profile(), max_depth=0)
