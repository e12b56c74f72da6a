"""The vLLM draft-length policy adapter (policies.vllm), tested against the protocol's documented
behaviour (vLLM itself cannot be installed here: its wheels need a CUDA torch): the engine-visible
training view, export and parity, tensor shapes and dtypes, k_valid frozen at the first stop,
decisions equal to the exported graph's under onnxruntime, and the protocol driven through the
real loop."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from gymnasium.utils.env_checker import check_env

from envs import SpecDecodeEnv
from envs.engine_view import EngineViewWrapper
from learn2draft import FixedDepthController, SpeculativeDecoder
from learn2draft.features import ENGINE_FEATURE_NAMES, ENGINE_MIN_DEPTH, build_engine_features
from policies.controllers import OnnxController
from policies.export import export_policy
from policies.load import load_policy
from policies.vllm import LearnedDraftLengthPolicy, ProtocolController

PROMPTS = ["w7 w8 w9 w10 w11", "w3 w3 w4 w5", "w20 w21 w22 w23 w24 w25"]
K = 4


@pytest.fixture(scope="module")
def engine_export(tiny_pair, tmp_path_factory):
    """A PPO policy trained briefly on the engine view of the tiny pair, its logits spread so that
    both actions occur, exported."""
    from stable_baselines3 import PPO

    env = EngineViewWrapper(SpecDecodeEnv(tiny_pair, PROMPTS, max_new_tokens=10, max_depth=K, episode="cycle",
                                          reward_scale=100.0))
    model = PPO("MlpPolicy", env, n_steps=64, batch_size=32, n_epochs=2, seed=0, device="cpu",
                policy_kwargs={"net_arch": [16, 16]})
    model.learn(64)
    with torch.no_grad():
        torch.manual_seed(0)
        model.policy.action_net.weight.normal_(0.0, 3.0)
        obs = torch.rand(2000, len(ENGINE_FEATURE_NAMES), generator=torch.Generator().manual_seed(0))
        logits = model.policy.get_distribution(obs).distribution.logits
        model.policy.action_net.bias[1] -= (logits[:, 1] - logits[:, 0]).median()
    d = tmp_path_factory.mktemp("engine-export")
    export_policy(model, d, max_depth=K, observations=model.rollout_buffer.observations, n_random=256)
    return d


@pytest.mark.parametrize("episode", ["cycle", "generation"])
def test_engine_view_env_passes_check_env_and_asks_only_from_depth_two(tiny_pair, episode):
    from test_env import StepClock  # a deterministic clock, so check_env's reward determinism applies

    env = EngineViewWrapper(SpecDecodeEnv(tiny_pair, PROMPTS, max_new_tokens=10, max_depth=K, episode=episode))
    env.unwrapped.decoder.clock = StepClock()
    check_env(env.unwrapped, skip_render_check=True, skip_close_check=True)  # the wrapped env itself
    check_env(env, skip_render_check=True, skip_close_check=True)
    obs, _ = env.reset(seed=0)
    dec = env.unwrapped.decoder
    for _ in range(20):
        assert obs.shape == (len(ENGINE_FEATURE_NAMES),)
        assert dec.depth >= ENGINE_MIN_DEPTH or not dec.can_draft()
        np.testing.assert_allclose(obs, build_engine_features(dec.depth, K, dec.confidences[1:]))
        obs, _, term, trunc, _ = env.step(int(np.random.default_rng(len(dec.ids)).integers(2)))
        if term or trunc:
            obs, _ = env.reset()


def test_export_of_an_engine_policy_has_its_spec_parity_and_passes_the_check(engine_export):
    from policies.check import check_export

    spec = json.loads((engine_export / "feature_spec.json").read_text())
    assert spec["kind"] == "engine" and [f["name"] for f in spec["features"]] == list(ENGINE_FEATURE_NAMES)
    assert json.loads((engine_export / "policy_config.json").read_text())["features"] == "engine"
    rep = check_export(engine_export)
    assert rep["passed"], rep
    with pytest.raises(ValueError, match="engine-visible"):
        load_policy(engine_export)  # not a loop controller


def test_adapter_features_and_decisions_equal_the_exported_graph(engine_export):
    pol = LearnedDraftLengthPolicy(engine_export)
    onnx = OnnxController(engine_export / "policy.onnx", n_features=len(ENGINE_FEATURE_NAMES))
    rng = np.random.default_rng(0)
    seen_stop = seen_go = 0
    for _ in range(40):
        pol.reset()
        probs = []
        for step in range(K - 1):
            batch = torch.tensor(rng.random(3), dtype=torch.float32)
            probs.append(float(batch.mean()))
            feats_before = pol.features  # the vector the update will evaluate
            pol.update(step, batch)
            want = build_engine_features(step + ENGINE_MIN_DEPTH, K, probs)
            got = feats_before(step).numpy()
            np.testing.assert_allclose(got, want, atol=1e-6)
            ref = onnx.logits(want)[0]
            np.testing.assert_allclose(pol.logits(torch.as_tensor(want)).numpy(), ref, atol=1e-5)
            stop = int(np.argmax(ref)) == 0
            seen_stop += stop
            seen_go += not stop
    assert seen_stop and seen_go  # both decisions were exercised


def test_adapter_follows_the_protocol(engine_export):
    pol = LearnedDraftLengthPolicy(engine_export, device="cpu", num_spec_tokens=K)
    assert pol.k_valid_gpu.dtype == torch.int32 and pol.k_valid_gpu.shape == ()
    assert int(pol.k_valid_gpu) == K  # before any update: full K
    # k_valid is K until the first step whose own decision is STOP, then frozen at that step + 2 (seed
    # included), whatever later steps decide; random probabilities give both later STOPs and CONTINUEs.
    rng = np.random.default_rng(1)
    later = set()
    for _ in range(60):
        pol.reset()
        stops, ks = [], []
        for step in range(K - 1):
            pol.update(step, torch.tensor(rng.random(2), dtype=torch.float32))
            logits = pol.logits(pol.features(step))  # this step's own decision, as the graph gives it
            stops.append(bool(logits[0] >= logits[1]))
            ks.append(int(pol.k_valid_gpu))
        first = next((i for i, s in enumerate(stops) if s), None)
        assert ks == [K if first is None or i < first else first + ENGINE_MIN_DEPTH for i in range(K - 1)], stops
        later |= set() if first is None else set(stops[first + 1:])
    assert later == {True, False}  # a STOP and a CONTINUE after the first stop both left k frozen
    pol.reset()
    assert int(pol.k_valid_gpu) == K
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        LearnedDraftLengthPolicy(engine_export, num_spec_tokens=K + 1)


def test_adapter_refuses_a_loop_policy(tmp_path):
    from policies.layout import default_policy_dir

    with pytest.raises(ValueError, match="--features engine"):
        LearnedDraftLengthPolicy(default_policy_dir("model"))


def test_protocol_driven_real_loop_keeps_greedy_output_and_stops_where_k_valid_says(tiny_pair, engine_export):
    prompt = tiny_pair.encode_prompt(PROMPTS[0])
    ref = SpeculativeDecoder(tiny_pair, max_new_tokens=16, max_depth=K).generate(prompt, FixedDepthController(0))
    dec = SpeculativeDecoder(tiny_pair, max_new_tokens=16, max_depth=K)
    ctrl = ProtocolController(LearnedDraftLengthPolicy(engine_export), dec)
    res = dec.generate(prompt, ctrl)
    assert res.tokens == ref.tokens
    depths = [c.depth for c in res.cycles]
    # Every cycle drafts the seed and one more (unless max_new_tokens leaves less room), and a cycle
    # the policy stopped has exactly k_valid tokens: the stops, in order, are the short cycles.
    assert all(d >= ENGINE_MIN_DEPTH for d in depths[:-2]), depths
    assert ctrl.k_valid and all(ENGINE_MIN_DEPTH <= k < K for k in ctrl.k_valid), ctrl.k_valid
    assert ctrl.k_valid == [d for d in depths[:-2] if d < K][: len(ctrl.k_valid)]


def test_the_shipped_engine_policy_loads_passes_its_check_and_drives_the_real_loop(default_pair):
    """policies/defaults/model-engine: trained with `python -m train --drafter model --features engine`."""
    from policies.check import check_export
    from policies.layout import DEFAULT_POLICIES_DIR

    d = DEFAULT_POLICIES_DIR / "model-engine"
    assert check_export(d)["passed"]
    pol = LearnedDraftLengthPolicy(d, num_spec_tokens=8)
    prompt = default_pair.encode_prompt("Name three colours.", max_new_tokens=12)
    ref = SpeculativeDecoder(default_pair, max_new_tokens=12, max_depth=8).generate(prompt, FixedDepthController(0))
    dec = SpeculativeDecoder(default_pair, max_new_tokens=12, max_depth=8)
    res = dec.generate(prompt, ProtocolController(pol, dec))
    assert res.tokens == ref.tokens and all(c.depth >= ENGINE_MIN_DEPTH for c in res.cycles[:-2])


def test_adapter_refuses_bad_protocol_inputs_clearly(engine_export):
    from learn2draft.models import ModelLoadError

    pol = LearnedDraftLengthPolicy(engine_export)
    with pytest.raises(TypeError, match="floating-point tensor"):
        pol.update(0, [0.5])
    with pytest.raises(TypeError, match="floating-point tensor"):
        pol.update(0, torch.tensor([1]))
    with pytest.raises(ValueError, match="empty"):
        pol.update(0, torch.tensor([]))
    with pytest.raises(ValueError, match="step"):
        pol.update(-1, torch.tensor([0.5]))
    with pytest.raises(ValueError, match="integer"):
        LearnedDraftLengthPolicy(engine_export, num_spec_tokens=2.5)
    with pytest.raises(ModelLoadError):
        LearnedDraftLengthPolicy(engine_export, device="gpu")
    if not torch.cuda.is_available():
        with pytest.raises(ModelLoadError, match="CUDA"):
            LearnedDraftLengthPolicy(engine_export, device="cuda")
    pol.update(0, torch.tensor([float("nan"), 0.5]))  # a NaN counts as no confidence
    assert torch.isfinite(pol.features(0)).all()
