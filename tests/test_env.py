"""The gymnasium environment around the real draft/verify loop, on tiny random models."""

from __future__ import annotations

import gymnasium as gym
import numpy as np
import pytest
import torch
from conftest import tiny_llama
from gymnasium.utils.env_checker import check_env

from envs import CONTINUE, ENV_ID, STOP, SpecDecodeEnv
from learn2draft import FEATURE_NAMES, FixedDepthController, SpeculativeDecoder
from learn2draft.models import make_pair

PROMPTS = ["w1 w2 w3 w4", "w5 w6", "w7 w8 w9 w10 w11", "w12", "w13 w14 w15"]




class StepClock:
    """A fake clock: every reading advances it by ``tick`` seconds; tests may also jump it.

    The default tick is a power of two so that differences of readings are exact floats.
    """

    def __init__(self, tick: float = 2.0**-10):
        self.t = 0.0
        self.tick = tick

    def now(self) -> float:
        self.t += self.tick
        return self.t


def make_env(pair, **kw) -> SpecDecodeEnv:
    kw.setdefault("max_new_tokens", 10)
    kw.setdefault("max_depth", 3)
    return SpecDecodeEnv(pair, PROMPTS, **kw)


def run_episode(env, policy, seed=0, options=None):
    obs, info = env.reset(seed=seed, options=options)
    steps = []
    while True:
        a = policy(obs)
        obs, r, term, trunc, info = env.step(a)
        steps.append((a, r, term, trunc, info))
        if term or trunc:
            return steps


# ------------------------------------------------------------------ API conformance
@pytest.mark.parametrize("episode", ["generation", "cycle"])
def test_gymnasium_make_and_check_env(tiny_pair, episode):
    env = gym.make(ENV_ID, pair=tiny_pair, prompts=PROMPTS, max_new_tokens=10, max_depth=3, episode=episode)
    assert env.spec.nondeterministic  # wall-clock rewards
    check_env(env.unwrapped)
    env.close()


@pytest.mark.parametrize("episode", ["generation", "cycle"])
def test_check_env_full_determinism_with_fake_clock(tiny_pair, episode):
    """With a deterministic clock even the reward determinism checks of check_env apply."""
    env = make_env(tiny_pair, episode=episode)
    env.decoder.clock = StepClock()
    check_env(env, skip_render_check=True, skip_close_check=True)


def test_spaces(tiny_pair):
    env = make_env(tiny_pair)
    assert env.action_space == gym.spaces.Discrete(2)
    assert env.observation_space.shape == (len(FEATURE_NAMES),)
    assert env.observation_space.dtype == np.float32
    obs, info = env.reset(seed=3)
    assert obs.dtype == np.float32 and obs.shape == (len(FEATURE_NAMES),)
    assert env.observation_space.contains(obs)
    np.testing.assert_array_equal(obs, env.decoder.features())
    obs, *_ = env.step(CONTINUE)
    assert obs[FEATURE_NAMES.index("depth")] == pytest.approx(1 / 3)
    assert obs[FEATURE_NAMES.index("last_confidence")] > 0


# ------------------------------------------------------------------ reward and timing
def test_reward_is_cycle_tokens_over_seconds(tiny_pair):
    env = make_env(tiny_pair, reward_scale=7.0)
    rng = np.random.default_rng(0)
    verified = 0
    for seed in range(3):
        for a, r, term, trunc, info in run_episode(env, lambda o: int(rng.integers(2)), seed=seed):
            if info["verified"]:
                verified += 1
                assert info["seconds"] > 0
                assert info["seconds"] == pytest.approx(
                    info["draft_seconds"] + info["verify_seconds"] + info["other_seconds"])
                assert r == pytest.approx(info["tokens"] / info["seconds"] / 7.0, rel=1e-12)
                assert info["tokens_per_second"] == pytest.approx(info["tokens"] / info["seconds"], rel=1e-12)
                assert 0 <= info["accepted"] <= info["depth"]
            else:
                assert r == 0.0
                assert not (term or trunc)
    assert verified > 3


def test_time_between_steps_is_not_counted(tiny_pair):
    """Whatever happens between step() calls (the learner's work) must not enter a cycle's seconds."""
    env = make_env(tiny_pair)
    clock = env.decoder.clock = StepClock()
    env.reset(seed=0)
    done = False
    seen = 0
    while not done:
        clock.t += 1000.0  # "PPO update" between steps
        _, r, term, trunc, info = env.step(CONTINUE)
        clock.t += 1000.0
        done = term or trunc
        if info["verified"]:
            seen += 1
            assert info["seconds"] < 1.0, info
            assert r > 1.0  # ≥ 1 token in well under a fake second
    assert seen >= 1


# ------------------------------------------------------------------ dynamics
def test_stop_at_depth_zero_is_a_plain_target_step(tiny_pair):
    env = make_env(tiny_pair)
    env.reset(seed=0, options={"prompt_index": 2})
    ids = env.prompt_ids[2]
    with torch.no_grad():
        first = int(tiny_pair.target(input_ids=ids.unsqueeze(0)).logits[0, -1, : tiny_pair.vocab_size].argmax())
    assert env.generated_tokens() == [first]  # the prefill emits the first token, as generate() does
    _, r, term, trunc, info = env.step(STOP)
    assert info["verified"] and info["depth"] == 0 and info["accepted"] == 0 and info["tokens"] == 1
    assert info["draft_seconds"] == 0.0
    ids = torch.cat([ids, torch.tensor([first])])
    with torch.no_grad():
        logits = tiny_pair.target(input_ids=ids.unsqueeze(0)).logits[0, -1, : tiny_pair.vocab_size]
    assert env.generated_tokens() == [first, int(logits.argmax())]


def test_all_stop_equals_autoregressive_decoding(tiny_pair):
    env = make_env(tiny_pair, max_new_tokens=8)
    steps = run_episode(env, lambda o: STOP, options={"prompt_index": 0})
    assert all(s[4]["depth"] == 0 and s[4]["tokens"] == 1 for s in steps)
    ref = SpeculativeDecoder(tiny_pair, max_new_tokens=8, max_depth=3).generate(env.prompt_ids[0], FixedDepthController(0))
    assert env.generated_tokens() == ref.tokens


def test_depth_limit_forces_verification(tiny_pair):
    env = make_env(tiny_pair, max_depth=3, max_new_tokens=20)
    env.reset(seed=0)
    for expected_depth in (1, 2):
        _, r, *_, info = env.step(CONTINUE)
        assert not info["verified"] and info["depth"] == expected_depth and r == 0.0
    _, r, *_, info = env.step(CONTINUE)
    assert info["verified"] and info["forced"] and info["depth"] == 3 and r > 0


def test_all_continue_matches_fixed_depth_and_respects_token_budget(tiny_pair):
    env = make_env(tiny_pair, max_depth=3, max_new_tokens=11)
    steps = run_episode(env, lambda o: CONTINUE, options={"prompt_index": 4})
    cycles = [s[4] for s in steps if s[4]["verified"]]
    ref = SpeculativeDecoder(tiny_pair, max_new_tokens=11, max_depth=3).generate(env.prompt_ids[4], FixedDepthController(3))
    assert [c["depth"] for c in cycles] == [c.depth for c in ref.cycles]
    assert env.generated_tokens() == ref.tokens
    assert 1 + sum(c["tokens"] for c in cycles) == len(ref.tokens) <= 11  # + the prefill's token


def test_max_depth_zero_verifies_every_step(tiny_pair):
    env = make_env(tiny_pair, max_depth=0, max_new_tokens=4)
    for a, r, term, trunc, info in run_episode(env, lambda o: CONTINUE):
        assert info["verified"] and info["forced"] and info["depth"] == 0


def test_truncated_at_max_new_tokens(tiny_pair):
    env = make_env(tiny_pair, max_new_tokens=6)
    for seed in range(4):
        *_, (a, r, term, trunc, info) = run_episode(env, lambda o: CONTINUE, seed=seed)
        toks = env.generated_tokens()
        if term:  # the random model emitted EOS
            assert not trunc and toks[-1] in tiny_pair.eos_token_ids
        else:
            assert trunc and len(toks) == 6 and info["generation_finished"]


def test_terminated_at_eos(tiny_tok):
    """A target that prefers EOS after its first token ends the episode with terminated=True; one
    that emits EOS at the prefill leaves no decision, and reset says so."""
    V = len(tiny_tok)
    target = tiny_llama(V, 5)
    boost = torch.zeros(target.lm_head.weight.shape[0])
    boost[tiny_tok.eos_token_id] = 1e4
    hook = target.lm_head.register_forward_hook(lambda m, i, o: o + boost)
    pair = make_pair(target, tiny_llama(V, 6, layers=1), tiny_tok, tiny_tok)
    env = SpecDecodeEnv(pair, PROMPTS, max_new_tokens=10, max_depth=3)
    with pytest.raises(ValueError, match="first token"):
        env.reset(seed=0)
    hook.remove()
    # EOS from every forward but the prefill (which feeds the whole prompt, more than one token; it computes the
    # last position's logits alone, so the forward's input, not its logits, tells it apart).
    fed = {}
    target.register_forward_pre_hook(lambda m, a, kw: fed.update(n=kw["input_ids"].shape[1]), with_kwargs=True)
    target.lm_head.register_forward_hook(lambda m, i, o: o + boost if fed["n"] == 1 else o)
    env.reset(seed=0)
    _, _, term, trunc, info = env.step(STOP)
    assert term and not trunc and info["generation_finished"]
    assert len(env.generated_tokens()) == 2 and env.generated_tokens()[-1] == tiny_tok.eos_token_id
    with pytest.raises(RuntimeError, match="reset"):
        env.step(STOP)


# ------------------------------------------------------------------ errors and seeding
@pytest.mark.parametrize("bad", [2, -1, 0.5, "stop", None, np.array([0, 1])])
def test_invalid_action_raises_value_error(tiny_pair, bad):
    env = make_env(tiny_pair)
    env.reset(seed=0)
    with pytest.raises(ValueError, match=r"valid actions are 0 = STOP .* 1 = CONTINUE"):
        env.step(bad)


def test_numpy_actions_accepted(tiny_pair):
    env = make_env(tiny_pair)
    env.reset(seed=0)
    _, _, _, _, info = env.step(np.int64(1))
    assert info["depth"] == 1
    env.step(np.array(0))


def test_step_before_reset_raises(tiny_pair):
    with pytest.raises(RuntimeError, match="reset"):
        make_env(tiny_pair).step(STOP)


@pytest.mark.parametrize("kwargs", [
    {"prompts": []}, {"reward_scale": 0.0}, {"reward_scale": float("nan")}, {"episode": "bogus"},
    {"max_new_tokens": 0}, {"max_depth": -1}, {"prompts": [""]}, {"prompts": [[]]},
])
def test_bad_constructor_arguments(tiny_pair, kwargs):
    kw = {"prompts": PROMPTS, **kwargs}
    with pytest.raises(ValueError, match="(?i)prompt" if "prompts" in kwargs else next(iter(kwargs))):
        SpecDecodeEnv(tiny_pair, **kw)


def test_prompt_index_option_out_of_range(tiny_pair):
    with pytest.raises(ValueError, match="prompt_index"):
        make_env(tiny_pair).reset(options={"prompt_index": len(PROMPTS)})


def test_seeding_reproduces_prompt_choice(tiny_pair):
    env_a, env_b = make_env(tiny_pair), make_env(tiny_pair)
    firsts = []
    for seed in range(12):
        oa, ia = env_a.reset(seed=seed)
        ob, ib = env_b.reset(seed=seed)
        assert ia["prompt_index"] == ib["prompt_index"]
        np.testing.assert_array_equal(oa, ob)
        firsts.append(ia["prompt_index"])
        # the unseeded resets that follow are reproducible too
        assert [env_a.reset()[1]["prompt_index"] for _ in range(4)] == [env_b.reset()[1]["prompt_index"] for _ in range(4)]
    assert len(set(firsts)) > 1


def test_seeding_reproduces_sampled_generations(tiny_pair):
    from learn2draft import SamplingConfig

    env = make_env(tiny_pair, sampling=SamplingConfig(temperature=1.0), max_new_tokens=8)
    outs = []
    for _ in range(2):
        run_episode(env, lambda o: CONTINUE, seed=11)
        outs.append(env.generated_tokens())
    assert outs[0] == outs[1]


# ------------------------------------------------------------------ cycle episodes
def test_cycle_mode_episodes_are_cycles_of_one_generation(tiny_pair):
    env = make_env(tiny_pair, episode="cycle", max_new_tokens=9, max_depth=2)
    _, info = env.reset(seed=0)
    assert info["new_generation"]
    prompt = info["prompt_index"]
    total = 0
    while True:
        steps = []
        while True:
            _, r, term, trunc, info = env.step(CONTINUE)
            steps.append(info)
            if term or trunc:
                break
        assert term and not trunc and info["verified"] and r > 0
        assert all(not s["verified"] for s in steps[:-1])
        total += info["tokens"]
        if info["generation_finished"]:
            break
        _, rinfo = env.reset()  # continues the generation
        assert not rinfo["new_generation"] and rinfo["prompt_index"] == prompt and rinfo["generated"] == total + 1
    assert total + 1 == len(env.generated_tokens())  # + the prefill's token
    _, info = env.reset()
    assert info["new_generation"] and info["generated"] == 1
    _, info = env.reset(options={"new_generation": True})
    assert info["new_generation"]


def test_the_reward_and_its_scale():
    """envs.reward: the one cycle reward, its scale's validation and the autoregressive default scale."""
    from envs.reward import autoregressive_scale, check_reward_scale, cycle_reward, relative_speeds

    assert cycle_reward(12.0, 3.0) == 4.0 and cycle_reward(12.0, 3.0, 2.0) == 2.0
    assert relative_speeds([4.0, 8.0, 2.0]) == [1.0, 2.0, 0.5] and relative_speeds([0.0, 5.0]) == [1.0, 1.0]
    assert autoregressive_scale(None, 25.0) == 25.0 and autoregressive_scale(2.0, 25.0) == 2.0
    assert autoregressive_scale(None, 0.0) == 1.0
    assert check_reward_scale(3) == 3.0 and type(check_reward_scale(3)) is float
    for bad in (0.0, -1.0, float("inf"), float("nan"), "2", None):
        with pytest.raises(ValueError, match="reward_scale must be a finite number > 0"):
            check_reward_scale(bad)
