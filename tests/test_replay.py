"""Recorded traces, latency profiles, the replay environment and the oracle (issue 10), on tiny random
models; one slow test on the real default pair."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import gymnasium as gym
import numpy as np
import pytest
import torch
from conftest import tiny_llama
from gymnasium.utils.env_checker import check_env
from helpers_loop import drafter_for, noisy_copy

from envs import CONTINUE, REPLAY_ENV_ID, STOP, SpecDecodeEnv, SpecDecodeReplayEnv
from envs.replay import measure_steps_per_second, replay_controller
from eval.oracle import evaluate_policy, oracle_prompt, oracle_report
from learn2draft import FixedDepthController, SpeculativeDecoder, build_features
from learn2draft.control import DraftController
from learn2draft.drafters import make_drafter
from learn2draft.models import make_pair
from learn2draft.replay.backend import ReplayDecoder
from learn2draft.replay.latency import SHIPPED_PROFILES_DIR, DrafterCost, LatencyProfile, load_profile
from learn2draft.replay.traces import TraceSet, load_traces
from learn2draft.sampling import SamplingConfig
from learn2draft.traces import record_traces
from policies.rules import ConfidenceThresholdController, MatchLengthController

REPO = Path(__file__).resolve().parent.parent
PROMPTS = ["w1 w2 w3 w4", "w5 w6 w5 w6 w5", "w7 w8 w9 w10 w11", "w12", "w13 w14 w15 w13 w14"]
N, D = 16, 4  # max_new_tokens, max_depth of the tiny traces

# Costs linear in tokens and context (so interpolation is exact) and distinct per part, in seconds.
V1, V_TOK, V_CTX, STEP, STEP_OV, CYCLE_OV = 0.010, 0.002, 1e-5, 0.003, 0.0002, 0.001


def linear_profile(step: float = STEP) -> LatencyProfile:
    tokens, contexts = [1, 2, 4, 8], [0.0, 64.0]
    table = [[V1 + V_TOK * (n - 1) + V_CTX * c for n in tokens] for c in contexts]
    costs = {d: DrafterCost([0.0], [step], STEP_OV, CYCLE_OV) for d in ("model", "head", "lookup")}
    return LatencyProfile("linear-test", tokens, contexts, table, costs, machine={"cpu": "test"}, source="tests")


def direct_seconds(d: int, context: int) -> float:
    """The profile's cycle formula, computed by hand."""
    return d * (STEP + STEP_OV) + (V1 + V_TOK * d + V_CTX * context) + CYCLE_OV


@pytest.fixture(scope="module")
def noisy_pair64(tiny_tok):
    """The noisy pair in float64: forwards batched differently round alike, so observations compare exactly."""
    target = tiny_llama(len(tiny_tok), 0).double()
    return make_pair(target, noisy_copy(target, 0.3, seed=5), tiny_tok, tiny_tok)


@pytest.fixture(scope="module")
def pairs(noisy_pair, noisy_pair64, tiny_pair, tiny_self_pair):
    return {"noisy": noisy_pair, "noisy64": noisy_pair64, "random": tiny_pair, "self": tiny_self_pair}


_TRACES: dict = {}


def traces_for(pairs, pair_name: str, drafter: str, temperature: float = 0.0) -> TraceSet:
    key = (pair_name, drafter, temperature)
    if key not in _TRACES:
        pair = pairs[pair_name]
        _TRACES[key] = record_traces(pair, drafter_for(drafter, pair), PROMPTS, SamplingConfig(temperature=temperature),
                                     max_new_tokens=N, max_depth=D, seed=3, progress=False)
    return _TRACES[key]


# ------------------------------------------------------------------ recorded accepted lengths = a real run
@pytest.mark.parametrize("pair_name,drafter", [("noisy", "model"), ("noisy", "lookup"), ("noisy", "head"),
                                               ("random", "model"), ("self", "model")])
def test_recorded_accepted_lengths_match_a_real_run(pairs, pair_name, drafter):
    """At T=0 the committed sequence is the greedy output whatever the depths; the trace predicts, for every
    cycle of a real fixed-depth run, its depth (chain availability, depth limit) and its accepted length."""
    pair, tr = pairs[pair_name], traces_for(pairs, pair_name, drafter)
    assert tr.header["greedy_inconsistencies"] == 0
    checked = 0
    for d in (0, 1, 2, 4):
        dec = SpeculativeDecoder(pair, max_new_tokens=N, max_depth=D, drafter=drafter_for(drafter, pair))
        for i, pt in enumerate(tr.prompts):
            g = dec.generate(torch.as_tensor(pt.prompt_ids), FixedDepthController(d), seed=i)
            assert g.tokens == pt.output.tolist()
            t, run = 1, pt.accepted_run()
            for c in g.cycles:
                depth = min(int(pt.chain_len[t]), d, N - t - 1)
                assert (c.depth, c.num_accepted) == (depth, min(depth, int(run[t]), pt.n - t)), (d, i, t)
                t += len(c.tokens)
                checked += depth > 0
            assert t == pt.n
    assert checked > 20


@pytest.mark.slow
def test_recorded_accepted_lengths_match_a_real_run_on_the_default_pair(default_pair):
    pair = default_pair
    tr = record_traces(pair, make_drafter("model", pair), ["Name three fruits.", "What is 2+2?"], SamplingConfig(),
                       max_new_tokens=20, max_depth=5, progress=False)
    assert tr.header["greedy_inconsistencies"] == 0
    for d in (1, 3, 5):
        dec = SpeculativeDecoder(pair, max_new_tokens=20, max_depth=5, drafter=make_drafter("model", pair))
        for i, pt in enumerate(tr.prompts):
            g = dec.generate(torch.as_tensor(pt.prompt_ids), FixedDepthController(d), seed=i)
            assert g.tokens == pt.output.tolist()
            t, run = 1, pt.accepted_run()
            for c in g.cycles:
                depth = min(int(pt.chain_len[t]), d, 20 - t - 1)
                assert (c.depth, c.num_accepted) == (depth, min(depth, int(run[t]), pt.n - t))
                t += len(c.tokens)


# ------------------------------------------------------------------ the replay env = the real env
@pytest.mark.parametrize("drafter", ["model", "lookup", "head"])
def test_replay_observations_and_outcomes_match_the_real_env(pairs, drafter):
    """Same actions, same observations, outcomes and termination. In float64 the vectors are identical; in
    float32 the confidences differ by rounding (the recorder feeds the draft other chunks than the loop; up to
    1.4e-5 seen with the tiny head, whose norm is scaled up 20×), so the models here are float64."""
    pair_name = "noisy64"
    pair, tr = pairs[pair_name], traces_for(pairs, pair_name, drafter)
    real = SpecDecodeEnv(pair, PROMPTS, max_new_tokens=N, max_depth=D, drafter=drafter_for(drafter, pair))
    rep = SpecDecodeReplayEnv(tr, linear_profile())
    rng = np.random.default_rng(0)
    steps = 0
    for i in range(len(PROMPTS)):
        o1, _ = real.reset(seed=1, options={"prompt_index": i})
        o2, _ = rep.reset(seed=1, options={"prompt_index": i})
        np.testing.assert_array_equal(o1, o2)
        while True:
            a = int(rng.random() < 0.7)
            o1, _, te1, tr1, i1 = real.step(a)
            o2, _, te2, tr2, i2 = rep.step(a)
            steps += 1
            np.testing.assert_array_equal(o1, o2)
            assert (te1, tr1) == (te2, tr2)
            for k in ("depth", "verified", "generated", "tokens", "accepted", "forced", "generation_finished"):
                assert i1.get(k) == i2.get(k), (k, i1, i2)
            if te1 or tr1:
                break
    assert steps > 30


def test_fast_observation_equals_build_features(pairs):
    """The per-step fill of the history entries gives build_features' vector in every visited state."""
    tr = traces_for(pairs, "noisy", "lookup")
    env = SpecDecodeReplayEnv(tr, linear_profile(), max_depth=3, max_new_tokens=12)
    rng = np.random.default_rng(1)
    for i in range(len(PROMPTS)):
        obs, _ = env.reset(options={"prompt_index": i})
        pt, hist, laf = tr.prompts[i], [], 1.0
        while True:
            t, j = env.decoder.generated, env.depth
            ref = build_features(pt.prompt_len + t + j, j, 3, hist, pt.confidence[t, :j].tolist(),
                                 pt.entropy[t, j - 1] if j else 0.0, int(tr.header["vocab_size"]), laf, t, 12,
                                 pt.drafter_features[t, j])
            np.testing.assert_array_equal(obs, ref)
            obs, _, term, trunc, info = env.step(int(rng.random() < 0.6))
            if info["verified"]:
                hist.append(info["accepted"])
                laf = info["accepted"] / info["depth"] if info["depth"] else 1.0
            if term or trunc:
                break


class _Recorded(DraftController):
    """A controller that asks ``inner`` and records every decision: (depth, confidences, drafter features,
    observation, action)."""

    def __init__(self, inner):
        self.inner, self.max_depth, self.log = inner, inner.max_depth, []
        self.depth_feature_scale = inner.depth_feature_scale

    def reset(self):
        self.inner.reset()

    def decide(self, state):
        action = self.inner.decide(state)
        self.log.append((state.depth, state.confidences, tuple(state.drafter_features.tolist()),
                         state.features().tolist(), bool(action)))
        return action


@pytest.mark.parametrize("drafter,make", [
    ("model", lambda: ConfidenceThresholdController(threshold=0.3, max_depth=D, min_depth=1)),
    ("head", lambda: ConfidenceThresholdController(threshold=0.99, max_depth=D, min_depth=1)),
    ("lookup", lambda: MatchLengthController(max_depth=D)),
], ids=["confidence-model", "confidence-head", "match-length-lookup"])
def test_a_rule_decides_in_replay_as_on_the_real_loop(pairs, drafter, make):
    """replay_controller hands a rule the replay env's DraftState: at every decision of every prompt the rule sees
    the same integer depth, confidences and drafter features as on the real decoder (float64 models: the recorder's
    and the loop's confidences are equal), the same observation vector, and decides the same."""
    pair, tr = pairs["noisy64"], traces_for(pairs, "noisy64", drafter)
    env = SpecDecodeReplayEnv(tr, linear_profile())
    actions = set()
    for i, pt in enumerate(tr.prompts):
        if i not in env._usable:
            continue
        real, rep = _Recorded(make()), _Recorded(make())
        dec = SpeculativeDecoder(pair, max_new_tokens=N, max_depth=D, drafter=drafter_for(drafter, pair))
        g = dec.generate(torch.as_tensor(pt.prompt_ids), real, seed=i)
        assert g.tokens == pt.output.tolist()
        replay_controller(env, rep, prompt_indices=[i])
        assert rep.log == real.log, i
        actions |= {a for *_, a in real.log}
    assert actions == {True, False}  # the rule both continued and stopped


# ------------------------------------------------------------------ the replay backend = the real decoder's API
@pytest.mark.parametrize("drafter,make,accepts", [
    ("model", lambda: FixedDepthController(3), True),
    ("lookup", lambda: MatchLengthController(max_depth=D), True),
    ("head", lambda: ConfidenceThresholdController(threshold=0.6, max_depth=D, min_depth=1), False),
], ids=["fixed-model", "match-length-lookup", "confidence-head"])
def test_the_replay_backend_generates_as_the_real_decoder(pairs, drafter, make, accepts):
    """Two backends of one interface: the same ``generate(prompt_ids, controller)`` call on the real decoder and on
    the replay backend (float64 models, T = 0) commits the same tokens in the same cycles — each cycle's depth, τ,
    tokens and finished flag equal — and the replay's wall seconds are its cycles' profile seconds (the profile's
    formula by hand, to 1e-12; its TTFT is 0: the replay has no prefill)."""
    pair, tr = pairs["noisy64"], traces_for(pairs, "noisy64", drafter)
    rep = ReplayDecoder(tr, linear_profile())
    cycles = accepted = drafted = 0
    for i, pt in enumerate(tr.prompts):
        if i not in rep.usable():
            continue
        dec = SpeculativeDecoder(pair, max_new_tokens=N, max_depth=D, drafter=drafter_for(drafter, pair))
        real = dec.generate(torch.as_tensor(pt.prompt_ids), make(), seed=i)
        replayed = rep.generate(torch.as_tensor(pt.prompt_ids), make(), seed=i)
        assert replayed.tokens == real.tokens == pt.output.tolist()
        assert replayed.prompt_ids == real.prompt_ids
        shape = [[(c.depth, c.num_accepted, c.tokens, c.finished) for c in g.cycles] for g in (real, replayed)]
        assert shape[0] == shape[1], i
        t, by_hand = 1, 0.0
        for c in replayed.cycles:
            by_hand += direct_seconds(c.depth, pt.prompt_len + t)
            t += len(c.tokens)
        assert replayed.wall_seconds == pytest.approx(by_hand, rel=1e-12) and replayed.ttft_seconds == 0.0
        cycles += len(real.cycles)
        accepted += sum(c.num_accepted for c in real.cycles)
        drafted += sum(c.depth for c in real.cycles)
    assert cycles > 10 and drafted > 0 and (accepted > 0 or not accepts)  # the tiny random head: rarely accepted


def test_the_replay_backend_refuses_what_it_cannot_replay(pairs):
    """A prompt that is not among the traces', an index or profile out of range, drafting past the recorded chain,
    a chain's verify_size other than its depth, and calls before start or after the end are one clear error each."""
    tr = traces_for(pairs, "noisy", "model")
    rep = ReplayDecoder(tr, linear_profile())
    for call in (rep.verify, rep.features, rep.state, lambda: rep.ids, lambda: rep.run_cycle(FixedDepthController(2))):
        with pytest.raises(RuntimeError, match="Call start"):
            call()
    with pytest.raises(ValueError, match="prompt_ids must be token ids"):
        rep.start("w1 w2")
    assert ReplayDecoder(tr, linear_profile(), max_depth=np.int64(3)).max_depth == 3
    with pytest.raises(ValueError, match="max_depth must be an integer in \\[0, 4\\]"):
        ReplayDecoder(tr, linear_profile(), max_depth=True)
    with pytest.raises(ValueError, match="not among the traces' 5 prompts"):
        rep.start(torch.tensor([1, 2, 3, 4, 5, 6, 7]))
    with pytest.raises(ValueError, match="prompt index must be in \\[0, 5\\)"):
        rep.start(5)
    with pytest.raises(ValueError, match="profile_index must be an integer in \\[0, 1\\)"):
        rep.start(0, profile_index=1)
    i = next(i for i in rep.usable() if rep.replay_data(i).avail[1] >= 1)
    rep.start(tr.prompts[i].prompt_ids)
    assert rep.prompt_index == i and rep.generated == 1 and rep.ids.tolist() == (
        tr.prompts[i].prompt_ids.tolist() + tr.prompts[i].output[:1].tolist())
    while rep.can_draft():
        rep.draft_step()
    with pytest.raises(RuntimeError, match="No further draft"):
        rep.draft_step()
    with pytest.raises(ValueError, match="verify_size must be"):
        rep.verify(rep.depth + 1)
    while not rep.finished:
        rep.verify()
    with pytest.raises(RuntimeError, match="finished"):
        rep.verify()
    with pytest.raises(ValueError, match="max_depth must be an integer in \\[0, 4\\]"):
        ReplayDecoder(tr, linear_profile(), max_depth=5)


# ------------------------------------------------------------------ rewards
@pytest.mark.parametrize("depth", [0, 2, 4])
def test_replay_rewards_match_a_direct_computation(pairs, depth):
    tr = traces_for(pairs, "noisy", "model")
    scale = 7.0
    env = SpecDecodeReplayEnv(tr, linear_profile(), reward_scale=scale, episode="cycle")
    for i, pt in enumerate(tr.prompts):
        env.reset(options={"prompt_index": i})
        t, run = 1, pt.accepted_run()
        while t < pt.n:
            d = min(depth, int(pt.chain_len[t]), N - t - 1)
            info = {"verified": False}
            for _ in range(d):  # CONTINUE up to the depth (the last one verifies when it hits the limit)
                _, r, term, _, info = env.step(CONTINUE)
                if info["verified"]:
                    break
                assert r == 0.0 and not term
            if not info["verified"]:
                _, r, term, _, info = env.step(STOP)
            emitted = min(min(d, int(run[t])) + 1, pt.n - t)
            seconds = direct_seconds(d, pt.prompt_len + t)
            assert info["depth"] == d and info["tokens"] == emitted and term
            assert info["seconds"] == pytest.approx(seconds, rel=1e-12)
            assert r == pytest.approx(emitted / seconds / scale, rel=1e-12)
            t += emitted
            if t < pt.n:
                env.reset()  # cycle mode: the next cycle of the same generation


def test_autoregressive_rate_is_the_depth_zero_rate(pairs):
    tr = traces_for(pairs, "noisy", "model")
    env = SpecDecodeReplayEnv(tr, linear_profile())
    tokens = sum(pt.n for pt in tr.prompts)
    seconds = sum(direct_seconds(0, pt.prompt_len + t) for pt in tr.prompts for t in range(1, pt.n))
    assert env.autoregressive_rate() == pytest.approx(tokens / seconds, rel=1e-12)
    res = replay_controller(env, FixedDepthController(0))
    assert res["tokens_per_s"] == pytest.approx(tokens / seconds, rel=1e-12)


def test_t_positive_accepted_lengths_follow_the_recorded_law(pairs):
    """At T>0 the replay draws τ from the recorded acceptance probabilities: the frequency of τ at one position
    matches Π a_i (1 − a_τ). 6000 seeded draws; tolerance 0.03 is > 4 standard errors (≤ 0.0065)."""
    tr = traces_for(pairs, "noisy", "model", temperature=1.0)
    assert "approximation" in tr.header
    acc = np.concatenate([pt.accept_prob[1:pt.n][~np.isnan(pt.accept_prob[1:pt.n])] for pt in tr.prompts])
    assert acc.size and np.all((acc >= 0) & (acc <= 1)) and 0.05 < acc.mean() < 0.95
    env = SpecDecodeReplayEnv(tr, linear_profile(), episode="cycle")
    i = max(range(len(PROMPTS)), key=lambda k: tr.prompts[k].chain_len[1])
    a = tr.prompts[i].accept_prob[1, :2]
    law = [1 - a[0], a[0] * (1 - a[1]), a[0] * a[1]]
    counts = np.zeros(3)
    for s in range(6000):
        env.reset(seed=s, options={"prompt_index": i})
        env.step(CONTINUE)
        _, _, _, _, info = env.step(CONTINUE)
        if not info["verified"]:
            _, _, _, _, info = env.step(STOP)
        assert info["depth"] == 2
        counts[info["accepted"]] += 1
    np.testing.assert_allclose(counts / counts.sum(), law, atol=0.03)


def test_the_outcome_models_draws_follow_its_stated_law(pairs):
    """ChainReplay.cycle (what the env steps with) and ChainReplay.outcomes (what the oracle takes expectations
    over) are one model: at T=0 the single outcome is the cycle's, everywhere; at T>0 the frequencies of 4000 seeded
    draws of (τ, emitted) match the stated probabilities (tolerance 0.035 > 4 standard errors ≤ 0.008)."""
    from learn2draft.replay.outcome import chain_replay

    prof = linear_profile()
    for pt in traces_for(pairs, "noisy", "model").prompts:
        r = chain_replay(pt, prof, "model", D, N)
        for t in range(1, r.n):
            for d in range(int(r.avail[t]) + 1):
                (p, tau, e), = r.outcomes(t, d, True)
                assert p == 1.0 and r.cycle(t, d) == (tau, e, float(r.total[t, d]))
    tr = traces_for(pairs, "noisy", "model", temperature=1.0)
    pt = max(tr.prompts, key=lambda q: q.chain_len[1])
    r = chain_replay(pt, prof, "model", D, N)
    d = int(r.avail[1])
    law = r.outcomes(1, d, False)
    assert d >= 2 and len(law) == d + 1 and sum(p for p, _, _ in law) == pytest.approx(1.0, abs=1e-12)
    rng = np.random.default_rng(0)
    draws = [r.cycle(1, d, rng)[:2] for _ in range(4000)]
    for p, tau, e in law:
        assert draws.count((tau, e)) / len(draws) == pytest.approx(p, abs=0.035)


def test_a_draft_equal_to_the_target_is_always_accepted_at_t_positive(pairs):
    tr = traces_for(pairs, "self", "model", temperature=1.0)
    acc = np.concatenate([pt.accept_prob[pt.chain_len > 0][:, 0] for pt in tr.prompts])
    np.testing.assert_allclose(acc, 1.0, atol=1e-4)  # p = q up to differently batched float forwards


# ------------------------------------------------------------------ gymnasium conformance, speed
@pytest.mark.parametrize("episode", ["generation", "cycle"])
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_check_env_passes(pairs, tmp_path, episode, temperature):
    path = traces_for(pairs, "noisy", "model", temperature).save(tmp_path / "t.npz")
    prof = linear_profile().save(tmp_path / "p.json")
    env = gym.make(REPLAY_ENV_ID, traces=str(path), profile=str(prof), episode=episode)
    assert not env.spec.nondeterministic
    check_env(env.unwrapped)
    env.close()


def test_spaces_equal_the_real_envs(pairs):
    real = SpecDecodeEnv(pairs["noisy"], PROMPTS, max_new_tokens=N, max_depth=D)
    rep = SpecDecodeReplayEnv(traces_for(pairs, "noisy", "model"), linear_profile())
    assert rep.observation_space == real.observation_space and rep.action_space == real.action_space
    with pytest.raises(ValueError, match="Invalid action"):
        rep.reset(seed=0)
        rep.step(2)


def test_steps_per_second_is_measured(pairs, monkeypatch):
    """Steps over the seconds between the two clock readings around the stepping loop (a fake clock: no
    speed assertion), every step an env step with a random action."""
    import time

    env = SpecDecodeReplayEnv(traces_for(pairs, "noisy", "lookup"), linear_profile())
    ticks = iter(range(4, 10))
    monkeypatch.setattr(time, "perf_counter", lambda: 2.5 * next(ticks))
    actions, step = [], env.step
    monkeypatch.setattr(env, "step", lambda a: (actions.append(a), step(a))[1])
    assert measure_steps_per_second(env, steps=2000) == 2000 / 2.5
    assert len(actions) == 2000 and set(actions) == {0, 1}


# ------------------------------------------------------------------ the oracle
def brute_force_seconds(env: SpecDecodeReplayEnv, index: int) -> float:
    """The least total seconds over every depth sequence, each run through the replay env."""
    best = np.inf
    r = env.replay_data(index)

    def run(depths):
        env.reset(options={"prompt_index": index})
        total, k, done = 0.0, 0, False
        while not done:
            if k >= len(depths):
                return None, env.decoder.generated  # needs a longer sequence
            info = {"verified": False}
            for _ in range(depths[k]):
                _, _, _, _, info = env.step(CONTINUE)
                if info["verified"]:
                    break
            if not info["verified"]:
                _, _, _, _, info = env.step(STOP)
            total += info["seconds"]
            done = info["generation_finished"]
            k += 1
        return total, None

    stack = [[]]
    while stack:
        seq = stack.pop()
        total, t = run(seq)
        if total is None:
            stack.extend(seq + [d] for d in range(int(r.avail[t]) + 1))
        else:
            best = min(best, total)
    return best


@pytest.mark.parametrize("drafter", ["model", "lookup"])
def test_oracle_beats_every_fixed_depth_and_equals_brute_force(pairs, drafter):
    tr = traces_for(pairs, "noisy", drafter)
    env = SpecDecodeReplayEnv(tr, linear_profile(step=0.0005), max_new_tokens=8, max_depth=3)
    assert any(env.replay_data(i).run[1:].max() > 0 for i in env._usable)  # some drafts are accepted
    for i in env._usable:
        r = env.replay_data(i)
        best, depths = oracle_prompt(r, True)
        assert best == pytest.approx(brute_force_seconds(env, i), rel=1e-12)
        assert best == pytest.approx(evaluate_policy(r, lambda t, depths=depths: depths[t], True), rel=1e-12)
        for d in range(4):
            assert best <= evaluate_policy(r, lambda t, d=d: d, True) + 1e-12
    rep = oracle_report(env, {"γ=2": FixedDepthController(2)})
    o = rep["methods"]["oracle (hindsight DP)"]["tokens_per_s"]
    assert all(m["tokens_per_s"] <= o * (1 + 1e-12) for m in rep["methods"].values())
    assert rep["methods"]["γ=2"]["tokens_per_s"] == pytest.approx(rep["methods"]["fixed γ=2"]["tokens_per_s"])


def test_oracle_at_t_positive_is_the_expected_time_optimum(pairs):
    tr = traces_for(pairs, "noisy", "model", temperature=1.0)
    env = SpecDecodeReplayEnv(tr, linear_profile(step=0.0005))
    for i in env._usable:
        r = env.replay_data(i)
        best, _ = oracle_prompt(r, False)
        assert all(best <= evaluate_policy(r, lambda t, d=d: d, False) + 1e-12 for d in range(D + 1))
    # A fixed depth's expected seconds (exact) agree with its Monte Carlo replay: 400 generations per prompt,
    # tolerance 3% (the replayed totals' relative standard error is below 0.5%).
    mc = replay_controller(env, FixedDepthController(3), repeats=400)
    exact = sum(evaluate_policy(env.replay_data(i), lambda t: 3, False) for i in env._usable)
    assert mc["seconds"] / 400 == pytest.approx(exact, rel=0.03)


# ------------------------------------------------------------------ files
def test_trace_file_round_trip_and_version_check(pairs, tmp_path):
    tr = traces_for(pairs, "noisy", "head")
    path = tr.save(tmp_path / "traces")
    assert path.suffix == ".npz" and path.with_suffix(".json").is_file()
    back = TraceSet.load(path)
    assert back.header["format_version"] == 1 and back.header["structure"] == "chain"
    for a, b in zip(tr.prompts, back.prompts):
        for k in ("prompt_ids", "output", "chain_len", "draft_tokens", "confidence", "entropy", "drafter_features",
                  "accept_prob"):
            np.testing.assert_array_equal(getattr(a, k), getattr(b, k))
    both = load_traces(f"{path},{path}")
    assert len(both) == 2 * len(tr)
    data = dict(np.load(path))
    header = json.loads(str(data["header"]))
    for change, match in (({"format_version": 99}, "format version 99"), ({"structure": "tree"}, "needs chain traces: record them without --tree"),
                          ({"feature_version": 1}, "feature version 1")):
        data["header"] = np.array(json.dumps({**header, **change}))
        np.savez(tmp_path / "bad.npz", **data)
        with pytest.raises(ValueError, match=match):
            TraceSet.load(tmp_path / "bad.npz")
    with pytest.raises(FileNotFoundError, match="eval.record"):
        TraceSet.load(tmp_path / "missing.npz")
    # damaged files: one clear error, never a zipfile / EOF traceback; impossible values are refused
    (tmp_path / "trunc.npz").write_bytes(path.read_bytes()[:500])
    (tmp_path / "empty.npz").write_bytes(b"")
    for bad in ("trunc.npz", "empty.npz"):
        with pytest.raises(ValueError, match="not a learn2draft trace file"):
            TraceSet.load(tmp_path / bad)
    data["header"] = np.array(json.dumps(header))
    data["accept_prob"] = data["accept_prob"] * 2 + 1
    np.savez(tmp_path / "edited.npz", **data)
    with pytest.raises(ValueError, match="outside \\[0, 1\\]"):
        TraceSet.load(tmp_path / "edited.npz")


def test_profiles_validate_and_the_shipped_ones_load(tmp_path):
    p = linear_profile()
    back = load_profile(p.save(tmp_path / "p.json"))
    assert back.verify(3, 32.0) == pytest.approx(V1 + 2 * V_TOK + 32 * V_CTX)
    assert back.verify(2, 100.0) == pytest.approx(V1 + V_TOK + 100 * V_CTX)  # linear above the last context
    with pytest.raises(ValueError, match="1..8 tokens"):
        back.verify(9, 0)
    with pytest.raises(ValueError, match="no costs for the 'lookup'"):
        LatencyProfile("x", [1], [0.0], [[0.01]], {"model": DrafterCost([0.0], [0.001])}).cost("lookup")
    with pytest.raises(ValueError, match="start at 1"):
        LatencyProfile("x", [2, 4], [0.0], [[0.01, 0.02]], {"model": DrafterCost([0.0], [0.001])})
    for name in ("cpu-2core", "gpu-like"):
        prof = load_profile(name)
        assert set(prof.drafters) == {"model", "head", "lookup"} and prof.source and prof.machine
    gpu = load_profile("gpu-like").relative_verify_cost()
    assert gpu[64] == pytest.approx(1.05, abs=0.01)


def test_a_damaged_profile_file_is_a_clear_error(tmp_path):
    import json

    good = json.loads((SHIPPED_PROFILES_DIR / "gpu-like.json").read_text())
    cases = {
        "missing-cost": (lambda d: d["drafters"]["lookup"].pop("cycle_overhead_seconds"), "cycle_overhead_seconds"),
        "ragged": (lambda d: d["verify"]["seconds"].__setitem__(0, d["verify"]["seconds"][0][:3]), "one value per token"),
        "negative": (lambda d: d["verify"]["seconds"][1].__setitem__(2, -0.5), "-0.5"),
    }
    for name, (damage, match) in cases.items():
        d = json.loads(json.dumps(good))
        damage(d)
        (tmp_path / f"{name}.json").write_text(json.dumps(d))
        with pytest.raises(ValueError, match=match):
            load_profile(tmp_path / f"{name}.json")


# ------------------------------------------------------------------ training on replay, commands
def test_train_replay_runs_end_to_end_and_exports(pairs, tmp_path, capsys):
    import train
    from policies.load import load_policy, policy_drafter
    from train.config import TrainConfig

    path = traces_for(pairs, "noisy", "lookup").save(tmp_path / "t.npz")
    prof = linear_profile().save(tmp_path / "p.json")
    cfg = TrainConfig(out=str(tmp_path / "run"), timesteps=128, n_steps=64, batch_size=32, n_epochs=2, net_arch=(16, 16),
                      wandb_mode="disabled", progress_bar=False, checkpoint_every=64, replay=str(path), profile=str(prof),
                      eval_gammas=(0, 2))
    m = train.run(None, cfg)
    out = tmp_path / "run"
    assert m["timesteps"] == 128 and m["export_check"]["agreement"] == 1.0
    assert m["reward_scale"] == pytest.approx(SpecDecodeReplayEnv(str(path), str(prof)).autoregressive_rate())
    ev = m["evaluation"]
    assert ev["policy"]["ratio_to_oracle"] <= 1 + 1e-9 and ev["best_fixed"]["ratio_to_oracle"] <= 1 + 1e-9
    saved = json.loads((out / "config.json").read_text())
    assert saved["env_id"] == REPLAY_ENV_ID and saved["drafter"] == "lookup" and saved["max_depth"] == D
    pcfg = json.loads((out / "policy/policy_config.json").read_text())
    assert pcfg["trained_on"]["env"] == REPLAY_ENV_ID and pcfg["trained_on"]["profile_name"] == "linear-test"
    assert pcfg["trained_on"]["traces"] == [str(path.resolve())] and pcfg["max_new_tokens"] == N
    assert policy_drafter(out) == "lookup"
    ctrl = load_policy(out)  # the same export path as a real-loop policy: it drives the real decoder
    dec = SpeculativeDecoder(pairs["noisy"], max_new_tokens=N, max_depth=ctrl.max_depth, drafter=make_drafter("lookup", pairs["noisy"]))
    pt = load_traces(path).prompts[0]
    assert dec.generate(torch.as_tensor(pt.prompt_ids), ctrl).tokens == pt.output.tolist()  # greedy: the recorded text
    from eval.oracle import main as oracle_main

    assert oracle_main([str(path), "--profile", str(prof), "--policy", str(out)]) == 0
    assert "run / oracle = " in capsys.readouterr().out
    with pytest.raises(ValueError, match="--drafter 'head', but the traces"):
        train.run(None, TrainConfig(out=str(tmp_path / "r2"), drafter="head", replay=str(path), profile=str(prof),
                                    wandb_mode="disabled"))


def test_train_cli_replay(pairs, tmp_path, capsys):
    from train.__main__ import main

    path = traces_for(pairs, "noisy", "model").save(tmp_path / "t.npz")
    prof = linear_profile().save(tmp_path / "p.json")
    args = ["--replay", str(path), "--profile", str(prof), "--timesteps", "64", "--n-steps", "32", "--batch-size", "32",
            "--n-epochs", "1", "--net-arch", "8", "--wandb-mode", "disabled", "--no-progress-bar", "--checkpoint-every",
            "0", "--out", str(tmp_path / "run")]
    assert main(args) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["onnx_agreement"] == 1.0 and "oracle" in summary["evaluation"]
    with pytest.raises(SystemExit) as e:
        main(["--replay", str(path), "--out", str(tmp_path / "r2")])
    assert e.value.code == 2 and "--profile" in capsys.readouterr().err


def test_record_profile_and_oracle_commands(tiny_model_dirs, tmp_path, capsys):
    from eval.oracle import main as oracle_main
    from eval.profile import main as profile_main
    from eval.record import main as record_main

    target, draft = tiny_model_dirs
    trace = tmp_path / "tr.npz"
    assert record_main(["--target", target, "--draft", draft, "--drafter", "lookup", "--num-prompts", "2",
                        "--max-new-tokens", "8", "--max-depth", "3", "--out", str(trace)]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["prompts"] == 2 and TraceSet.load(trace).header["prompt_source"] == "train"
    prof = tmp_path / "prof.json"
    assert profile_main(["--target", target, "--draft", draft, "--drafter", "lookup,model", "--contexts", "8,16",
                         "--tokens", "1,2,4", "--repeats", "1", "--draft-steps", "2", "--overhead-prompts", "1",
                         "--overhead-tokens", "6", "--device", "cpu", "--out", str(prof)]) == 0
    p = load_profile(prof)
    assert set(p.drafters) == {"lookup", "model"} and p.machine["cores"] and "measured by python -m eval.profile" in p.source
    capsys.readouterr()
    assert oracle_main([str(trace), "--profile", str(prof)]) == 0
    text = capsys.readouterr().out
    assert "oracle (hindsight DP)" in text and "best fixed / oracle" in text
    assert record_main(["--drafter", "lookup", "--max-depth", "-1"]) == 2
    assert "--max-depth" in capsys.readouterr().err
    from eval.simreal import main as simreal_main

    assert simreal_main([str(trace), "--profile", str(prof), "--gammas", "0,2", "--device", "cpu"]) == 0
    text = capsys.readouterr().out
    assert "| fixed γ=2 |" in text and "differing from the recorded greedy output: 0" in text


def test_sim_vs_real_reproduces_the_cycle_structure(pairs):
    """At T=0 the replay predicts every cycle of the real run: same outputs, mean depth and τ; only the seconds
    differ (profile vs clock)."""
    from eval.simreal import format_table, sim_vs_real

    tr = traces_for(pairs, "noisy", "model")
    ctrls = {"γ=0": FixedDepthController(0), "γ=3": FixedDepthController(3)}
    rep = sim_vs_real(pairs["noisy"], tr, linear_profile(), ctrls, drafter=lambda: make_drafter("model", pairs["noisy"]))
    assert rep["token_mismatches"] == 0 and rep["prompts"] == len(PROMPTS)
    for m in rep["methods"].values():
        assert m["predicted_mean_accepted"] == pytest.approx(m["measured_mean_accepted"], abs=1e-12)
        assert m["predicted_mean_depth"] == pytest.approx(m["measured_mean_depth"], abs=1e-12)
        assert m["measured_tokens_per_s"] > 0 and m["error"] is not None
    assert rep["methods"]["γ=3"]["measured_mean_accepted"] > 0
    assert "| γ=3 |" in format_table(rep)


def test_simreal_names_a_profile_measured_in_another_precision_or_thread_count(pairs):
    """A profile measured in bf16 with 1 thread beside float32 traces run on 2 threads is named in one note (both
    differences); the same profile without a machine says nothing."""
    from eval.simreal import profile_mismatch

    tr = traces_for(pairs, "noisy", "model")
    prof = linear_profile()
    assert profile_mismatch(prof, tr, 2) is None
    prof.machine = {"dtype": "bfloat16", "torch_threads": 1}
    note = profile_mismatch(prof, tr, 2)
    assert "precision bfloat16 (profile) against float32 (traces)" in note and "torch threads 1 (profile) against 2" in note


@pytest.mark.parametrize("command", ["eval.record", "eval.profile", "eval.oracle", "eval.simreal", "eval.acceptance"])
def test_help_has_a_line_per_option_and_needs_no_torch(command):
    import importlib

    parser = importlib.import_module(command).build_parser()
    fmt = parser._get_formatter()
    for action in parser._actions:
        if action.option_strings and action.help != "show this help message and exit":
            assert action.help and action.help.strip(), action.option_strings
            assert len(re.findall(r"\(default[: ]", fmt._get_help_string(action))) <= 1
    assert not re.search(r"``|:(class|func|mod|meth|data|attr):`", parser.format_help())
    code = (f"import runpy, sys\nsys.argv = ['x', '--help']\ntry:\n    runpy.run_module({command!r}, run_name='__main__')\n"
            "except SystemExit:\n    pass\nprint('TORCH' if 'torch' in sys.modules else 'NO-TORCH', file=sys.stderr)")
    r = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert "usage:" in r.stdout and r.stderr.strip().endswith("NO-TORCH"), r.stderr


def test_the_replay_package_needs_numpy_only():
    """learn2draft.replay (trace format, latency profiles and their shipped data, the outcome model) imports neither
    torch nor transformers nor anything above the engine."""
    code = ("import sys, pkgutil, importlib, learn2draft.replay as r\n"
            "mods = [importlib.import_module('learn2draft.replay.' + m.name) for m in pkgutil.iter_modules(r.__path__)]\n"
            "from learn2draft.replay.latency import load_profile\n"
            "assert load_profile('gpu-like').name == 'gpu-like'\n"
            "bad = [m for m in ('torch', 'transformers', 'gymnasium', 'envs', 'policies', 'train', 'eval') if m in sys.modules]\n"
            "print(len(mods), bad)")
    r = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr[-2000:]
    count, bad = r.stdout.split(" ", 1)
    assert int(count) >= 2 and bad.strip() == "[]", r.stdout


def test_bad_replay_settings_are_clear_errors(pairs):
    tr = traces_for(pairs, "noisy", "model")
    with pytest.raises(ValueError, match="max_depth must be an integer in \\[0, 4\\]"):
        SpecDecodeReplayEnv(tr, linear_profile(), max_depth=5)
    with pytest.raises(ValueError, match="max_new_tokens must be an integer in \\[2, 16\\]"):
        SpecDecodeReplayEnv(tr, linear_profile(), max_new_tokens=17)
    small = LatencyProfile("small", [1, 2], [0.0], [[0.01, 0.02]], {"model": DrafterCost([0.0], [0.001])})
    with pytest.raises(ValueError, match="1..2 tokens"):
        SpecDecodeReplayEnv(tr, small)
    with pytest.raises(ValueError, match="python -m eval.profile --drafter lookup"):
        SpecDecodeReplayEnv(traces_for(pairs, "noisy", "lookup"), small)
    with pytest.raises(FileNotFoundError, match="eval.profile"):
        load_profile("no-such-profile")
    env = SpecDecodeReplayEnv(tr, linear_profile())
    with pytest.raises(RuntimeError, match="reset"):
        env.step(STOP)
    env.reset(seed=0)
    with pytest.raises(ValueError, match="prompt_index"):
        env.reset(options={"prompt_index": 99})


# ------------------------------------------------------------------ several profiles, profile features (item 6)
def scaled_profile(name: str, v1: float, v_tok: float, step: float) -> LatencyProfile:
    """A profile linear in tokens and context (exact interpolation), with a verify table up to 16 tokens."""
    tokens, contexts = [1, 2, 4, 8, 16], [0.0, 1024.0]
    table = [[v1 + v_tok * (n - 1) + V_CTX * c for n in tokens] for c in contexts]
    costs = {d: DrafterCost([0.0], [step], STEP_OV, CYCLE_OV) for d in ("model", "head", "lookup")}
    return LatencyProfile(name, tokens, contexts, table, costs, source="tests")


SLOW = dict(v1=0.010, v_tok=0.004, step=0.003)  # verifying more costs a lot (CPU-like)
FAST = dict(v1=0.002, v_tok=0.00001, step=0.0005)  # verifying more is almost free (GPU-like)


def test_profile_features_are_the_documented_cost_ratios():
    from learn2draft.features import PROFILE_FEATURE_NAMES, PROFILE_REFERENCE_CONTEXT, profile_features

    p = scaled_profile("slow", **SLOW)
    c = PROFILE_REFERENCE_CONTEXT
    one = SLOW["v1"] + V_CTX * c
    s = (SLOW["step"] + STEP_OV) / one
    o = CYCLE_OV / one
    want = [1 - one / (one + SLOW["v_tok"] * (n - 1)) for n in (2, 4, 8, 16)] + [s / (1 + s), o / (1 + o)]
    f = profile_features(p, "model")
    assert f.dtype == np.float32 and f.shape == (len(PROFILE_FEATURE_NAMES),)
    np.testing.assert_allclose(f, want, rtol=1e-6)
    cpu, gpu = profile_features(load_profile("cpu-2core"), "model"), profile_features(load_profile("gpu-like"), "model")
    assert np.all(cpu[:4] > 5 * gpu[:4])  # the shipped CPU's verification grows with tokens, the GPU-like's barely
    with pytest.raises(ValueError, match="up to 8 tokens.*eval.profile"):
        profile_features(linear_profile(), "model")


def test_single_profile_list_replays_exactly_as_before(pairs):
    """A one-profile list draws nothing more from the env's random stream: the same seeds give the same episodes."""
    tr = traces_for(pairs, "noisy", "model", 1.0)
    a = SpecDecodeReplayEnv(tr, linear_profile(), episode="cycle")
    b = SpecDecodeReplayEnv(tr, [linear_profile()], episode="cycle")
    rng = np.random.default_rng(0)
    oa, _ = a.reset(seed=4)
    ob, _ = b.reset(seed=4)
    for _ in range(300):
        act = int(rng.integers(2))
        oa, ra, ta, _, ia = a.step(act)
        ob, rb, tb, _, ib = b.step(act)
        assert np.array_equal(oa, ob) and ra == rb and ia == ib
        if ta:
            oa, _ = a.reset()
            ob, _ = b.reset()


def test_several_profiles_costs_rewards_and_features(pairs):
    from learn2draft.features import FEATURE_NAMES, profile_features

    tr = traces_for(pairs, "noisy", "model")
    slow, fast = scaled_profile("slow", **SLOW), scaled_profile("fast", **FAST)
    env = SpecDecodeReplayEnv(tr, [slow, fast], reward_scale=3.0, episode="cycle", profile_features=True)
    n = len(FEATURE_NAMES)
    assert env.observation_space.shape == (n + 6,)
    ar = [SpecDecodeReplayEnv(tr, p).autoregressive_rate() for p in (slow, fast)]
    assert env.autoregressive_rate(1) == pytest.approx(ar[1], rel=1e-12) and ar[1] > 3 * ar[0]
    for k, prof in enumerate((slow, fast)):
        obs, info = env.reset(options={"prompt_index": 0, "profile_index": k})
        assert info["profile_index"] == k and env.profile is prof
        np.testing.assert_array_equal(obs[n:], profile_features(prof, "model"))
        single = SpecDecodeReplayEnv(tr, prof, episode="cycle")
        np.testing.assert_array_equal(obs[:n], single.reset(options={"prompt_index": 0})[0])
        env.step(CONTINUE)
        single.step(CONTINUE)
        _, r, _, _, i = env.step(STOP)
        _, r1, _, _, i1 = single.step(STOP)
        assert i["seconds"] == pytest.approx(i1["seconds"], rel=1e-12) and i["profile_index"] == k
        cfg = SLOW if k == 0 else FAST
        want = cfg["step"] + STEP_OV + cfg["v1"] + cfg["v_tok"] + V_CTX * (tr.prompts[0].prompt_len + 1) + CYCLE_OV
        assert i["seconds"] == pytest.approx(want, rel=1e-12)
        # each profile's reward is relative to its own plain decoding: rate / (scale · ar_k / ar_0)
        assert r == pytest.approx(i["tokens_per_second"] / (3.0 * ar[k] / ar[0]), rel=1e-9)
        assert r1 == pytest.approx(i["tokens_per_second"], rel=1e-12)
    drawn = set()
    env.reset(seed=0)
    for _ in range(40):
        drawn.add(env.reset(options={"new_generation": True})[1]["profile_index"])
    assert drawn == {0, 1}  # drawn uniformly when not named
    with pytest.raises(ValueError, match="profile_index must be an integer in \\[0, 2\\)"):
        env.reset(options={"profile_index": 2})
    with pytest.raises(ValueError, match="repeat a name"):
        SpecDecodeReplayEnv(tr, [slow, scaled_profile("slow", **FAST)])
    with pytest.raises(ValueError, match="profile is required"):
        SpecDecodeReplayEnv(tr)
    with pytest.raises(ValueError, match="not a comma-separated list"):
        load_profile("cpu-2core,gpu-like")


@pytest.mark.parametrize("episode", ["generation", "cycle"])
def test_check_env_passes_with_several_profiles(pairs, tmp_path, episode):
    path = traces_for(pairs, "noisy", "model", 1.0).save(tmp_path / "t.npz")
    a = scaled_profile("slow", **SLOW).save(tmp_path / "a.json")
    b = scaled_profile("fast", **FAST).save(tmp_path / "b.json")
    env = gym.make(REPLAY_ENV_ID, traces=str(path), profile=f"{a},{b}", episode=episode, profile_features=True)
    check_env(env.unwrapped)
    env.close()


def test_train_a_profile_conditioned_policy_export_and_load(pairs, tiny_model_dirs, tmp_path, capsys):
    """train --features profile over two profiles: the export reads 20 features, load_policy needs a profile and
    then decides on the loop's features followed by that profile's, as onnxruntime does on the env's observation."""
    import train
    from learn2draft.features import FEATURE_NAMES, profile_features
    from policies.check import main as check_main
    from policies.load import load_policy
    from train.config import TrainConfig

    path = traces_for(pairs, "noisy", "model").save(tmp_path / "t.npz")
    a = scaled_profile("slow", **SLOW).save(tmp_path / "slow.json")
    b = scaled_profile("fast", **FAST).save(tmp_path / "fast.json")
    cfg = TrainConfig(out=str(tmp_path / "run"), timesteps=128, n_steps=64, batch_size=32, n_epochs=2, net_arch=(16, 16),
                      wandb_mode="disabled", progress_bar=False, checkpoint_every=0, replay=str(path),
                      profile=f"{a},{b}", features="profile", eval_gammas=(0, 2))
    m = train.run(None, cfg)
    out = tmp_path / "run"
    assert m["export_check"]["agreement"] == 1.0
    assert {"slow/policy", "fast/policy", "slow/oracle", "fast/best_fixed"} <= set(m["evaluation"])
    spec = json.loads((out / "policy/feature_spec.json").read_text())
    assert spec["kind"] == "profile" and spec["shape"] == [len(FEATURE_NAMES) + 6]
    pcfg = json.loads((out / "policy/policy_config.json").read_text())
    assert pcfg["features"] == "profile" and pcfg["trained_on"]["profile_name"] == "slow,fast"
    assert check_main([str(out / "policy")]) == 0
    capsys.readouterr()
    with pytest.raises(ValueError, match="profile-conditioned.*--profile P on the command line.*eval.profile"):
        load_policy(out)
    assert "profile=fast" in repr(load_policy(out, profile=b))
    with pytest.raises(FileNotFoundError, match="No latency profile"):  # checked even where it is not read
        load_policy(REPO / "policies/defaults/model", profile="no-such-profile")
    env = SpecDecodeReplayEnv(str(path), [str(a), str(b)], profile_features=True)
    for k, prof in enumerate((a, b)):
        ctrl = load_policy(out, profile=prof)
        obs, _ = env.reset(options={"prompt_index": 1, "profile_index": k})
        np.testing.assert_array_equal(ctrl.profile_features, profile_features(load_profile(prof), "model"))
        graph_actions, seen = ctrl.actions, []
        ctrl.actions = lambda x, seen=seen, g=graph_actions: (seen.append(np.asarray(x).copy()), g(x))[1]
        for act in (1, 1, 0, 1, 0, 1, 1, 1):
            assert ctrl.decide(env.state(obs[: len(FEATURE_NAMES)])) == bool(graph_actions(obs)[0])
            np.testing.assert_array_equal(seen[-1].reshape(-1), obs)  # the graph got the env's full observation
            obs, _, term, trunc, _ = env.step(act)
            if term or trunc:
                break
    ctrl = load_policy(out, profile=b)  # on the real loop: the decoder's features, completed by the profile's
    dec = SpeculativeDecoder(pairs["noisy"], max_new_tokens=N, max_depth=ctrl.max_depth)
    pt = load_traces(path).prompts[0]
    assert dec.generate(torch.as_tensor(pt.prompt_ids), ctrl).tokens == pt.output.tolist()  # greedy: the recorded text
    from eval.oracle import main as oracle_main

    assert oracle_main([str(path), "--profile", str(b), "--policy", str(out)]) == 0
    assert "run / oracle = " in capsys.readouterr().out
    with pytest.raises(ValueError, match="--features profile trains in replay"):
        TrainConfig(features="profile").validate()
    one = train.run(None, TrainConfig(out=str(tmp_path / "one"), timesteps=64, n_steps=32, batch_size=32, n_epochs=1,
                                      net_arch=(8,), wandb_mode="disabled", progress_bar=False, checkpoint_every=0,
                                      replay=str(path), profile=str(b), features="profile", eval_gammas=(0,)))
    assert one["evaluation"]["policy"]["ratio_to_oracle"] <= 1 + 1e-9  # one profile, with its features
    from policies.generate import main as generate_main

    target, draft = tiny_model_dirs  # the command line: one error line without --profile, a generation with it
    argv = ["w1 w2 w3", "--target", target, "--draft", draft, "--drafter", "model", "--no-chat", "--max-new-tokens",
            "6", "--policy", str(out)]
    assert generate_main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("error:") and "profile-conditioned" in err and "Traceback" not in err
    assert generate_main(argv + ["--profile", str(b)]) == 0
    assert capsys.readouterr().out.strip()


@pytest.mark.parametrize("damage, match", [
    (lambda d: d["verify"]["seconds"][0].__setitem__(0, str(d["verify"]["seconds"][0][0])), "number"),
    (lambda d: d["verify"].__setitem__("tokens", [str(x) for x in d["verify"]["tokens"]]), "number"),
    (lambda d: d["drafters"]["lookup"].__setitem__("step_overhead_seconds", "0.001"), "number"),
    (lambda d: d["drafters"]["head"]["step_seconds"]["seconds"].__setitem__(0, "0.002"), "number"),
    (lambda d: d.__setitem__("format_version", "1"), "format_version must be the integer 1, got '1'"),
])
def test_a_profile_with_numbers_as_strings_is_refused(tmp_path, damage, match):
    good = json.loads((SHIPPED_PROFILES_DIR / "gpu-like.json").read_text())
    damage(good)
    (tmp_path / "p.json").write_text(json.dumps(good))
    with pytest.raises(ValueError, match=match):
        load_profile(tmp_path / "p.json")


def _edited_trace(data, header, path, change=None, **arrays):
    np.savez(path, **{**data, "header": np.array(json.dumps({**header, **(change or {})})), **arrays})
    return path


def test_a_trace_with_impossible_values_is_refused_at_load(pairs, tmp_path):
    """NaN acceptance inside a chain, shifted offsets, a wrong vocab_size and out-of-vocabulary ids were accepted
    silently (NaN changed the oracle's result, a shifted offset dropped tokens)."""
    import os

    tr = traces_for(pairs, "noisy", "model")
    path = tr.save(tmp_path / "t")
    assert os.stat(path).st_mode & 0o777 == os.stat(path.with_suffix(".json")).st_mode & 0o777  # same permissions
    data = dict(np.load(path))
    header = json.loads(str(data["header"]))
    ap = data["accept_prob"].copy()
    row = int(np.argmax(data["chain_len"] > 0))
    ap[row, 0] = np.nan
    ids = data["output_tokens"].copy()
    ids[3] = header["vocab_size"]
    for change, arrays, match in (
            (None, {"accept_prob": ap}, "NaN"),
            (None, {"output_offsets": data["output_offsets"] + 5}, "output_offsets"),
            ({"vocab_size": "big"}, {}, "vocab_size"),
            ({"vocab_size": int(data["output_tokens"].max())}, {}, "vocabulary"),
            (None, {"output_tokens": ids}, "vocabulary")):
        bad = _edited_trace(data, header, tmp_path / "bad.npz", change, **arrays)
        with pytest.raises(ValueError, match=match):
            TraceSet.load(bad)
    assert len(TraceSet.load(_edited_trace(data, header, tmp_path / "ok.npz"))) == len(tr)


def test_simreal_checks_its_profile_before_loading_the_models(pairs, tmp_path, monkeypatch, capsys):
    """eval.simreal loaded the models (28 s on the default pair) before refusing a profile: now the replay side is
    built, and the profile checked against the traces as eval.oracle checks it, first."""
    from eval.simreal import main as simreal_main

    trace = traces_for(pairs, "noisy", "model").save(tmp_path / "tr")
    lookup_only = LatencyProfile("lookup-only", [1, 2, 4, 8], [0.0, 64.0], [[0.01] * 4, [0.02] * 4],
                                 {"lookup": DrafterCost([0.0], [1e-5])}).save(tmp_path / "p.json")

    def loading(*a, **k):
        raise AssertionError("the models were loaded before the profile was checked")

    monkeypatch.setattr("learn2draft.cli.load_models", loading)
    assert simreal_main([str(trace), "--profile", str(lookup_only), "--gammas", "0,2", "--device", "cpu"]) == 2
    assert "no costs for the 'model' drafter" in capsys.readouterr().err


def test_the_shipped_profiles_hold_no_path_of_the_machine_they_were_measured_on():
    def strings(x):
        if isinstance(x, dict):
            return [s for v in x.values() for s in strings(v)]
        if isinstance(x, list):
            return [s for v in x for s in strings(v)]
        return [x] if isinstance(x, str) else []

    for f in SHIPPED_PROFILES_DIR.glob("*.json"):
        found = [s for s in strings(json.loads(f.read_text())) if re.search(r"(^|\s)(/[\w.-]+){2,}", s)]
        assert not found, (f.name, found)


def test_a_measured_profile_is_never_named_like_a_shipped_one():
    from eval.profile import default_name
    from learn2draft.replay.latency import SHIPPED_PROFILES_DIR

    shipped = {p.stem for p in SHIPPED_PROFILES_DIR.glob("*.json")}
    assert "cpu-2core" in shipped
    for machine in ({"cores": 2}, {"cores": 2, "dtype": "float32"}, {"cores": 2, "dtype": "bfloat16"}):
        name = default_name(machine)
        assert name not in shipped and name.startswith("cpu-2core")
    assert default_name({"cores": 2, "dtype": "bfloat16"}) == "cpu-2core-bfloat16-measured"
    assert default_name({"cores": 16, "gpu": "NVIDIA H200", "dtype": "bfloat16"}) == "h200"


def test_every_shipped_profile_loads_by_its_bare_name():
    """A shipped name with dots (``h200-llama-3.1-8b``) is a name, not a file with a suffix."""
    names = sorted(p.stem for p in SHIPPED_PROFILES_DIR.glob("*.json"))
    assert "h200-llama-3.1-8b" in names and "h200-llama-3.2-1b" in names
    for name in names:
        assert load_profile(name).name, name
    with pytest.raises(FileNotFoundError, match="shipped: cpu-2core"):
        load_profile("h200-llama-9.9-1b")


def test_the_verification_profile_times_the_cache_the_chain_decoder_keeps(tiny_tok, monkeypatch):
    """eval.profile's verification seconds come from the forward the chain decoder runs: a batch-cache row's ragged
    forward for a target it supports (a Llama: one prefill and one forward per timed size, every one counted here),
    a DynamicCache forward for one it does not (a Mistral with a sliding window: no ragged forward at all); both give
    a (contexts × tokens) table of positive seconds."""
    from transformers import MistralConfig, MistralForCausalLM

    from eval.profile import measure_verify
    from learn2draft.batch_cache import BatchCache
    from learn2draft.decoding import SpeculativeDecoder
    from learn2draft.models import make_pair
    from learn2draft.sampling import SamplingConfig

    calls = []
    forward = BatchCache.forward
    monkeypatch.setattr(BatchCache, "forward", lambda self, *a, **k: calls.append(1) or forward(self, *a, **k))
    V = len(tiny_tok)
    seq = torch.arange(3, 43) % (V - 3) + 3
    llama = make_pair(tiny_llama(V, 0), None, tiny_tok)
    table = measure_verify(llama, SamplingConfig(), seq, [8, 16], [1, 3], repeats=2)
    assert len(table) == 2 and all(len(row) == 2 and min(row) > 0 for row in table)
    assert len(calls) == 2 * (1 + 3 * 2)  # per context: the prefill, then (repeats + 1 warm-up) × 2 sizes
    torch.manual_seed(0)
    mistral = MistralForCausalLM(MistralConfig(vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                               num_attention_heads=4, num_key_value_heads=2, sliding_window=8)).eval()
    windowed = make_pair(mistral, None, tiny_tok)
    calls.clear()
    table = measure_verify(windowed, SamplingConfig(), seq, [8], [1, 3], repeats=2)
    assert len(calls) == 0 and len(table) == 1 and min(table[0]) > 0
    # and the decoder on that target keeps a DynamicCache (what the profile timed)
    from learn2draft.drafters import make_drafter

    dec = SpeculativeDecoder(windowed, max_new_tokens=2, drafter=make_drafter("lookup", windowed))
    dec.start(seq[:8])
    assert type(dec.target_cache).__name__ == "DynamicCache" and not calls
