"""Replay with concurrency (issue 17 item 3): the batch axis of latency profiles, the request-stream simulator
(learn2draft.replay.serve), its baselines and the load-aware environment (envs.serve)."""

from __future__ import annotations

import json

import gymnasium as gym
import numpy as np
import pytest
from gymnasium.utils.env_checker import check_env
from helpers_loop import drafter_for

from envs import SERVE_ENV_ID, ServeReplayEnv, SpecDecodeReplayEnv
from envs.replay import replay_controller
from learn2draft import FixedDepthController
from learn2draft.budget import BatchSizeTable
from learn2draft.replay.latency import DrafterCost, LatencyProfile, load_profile
from learn2draft.replay.serve import (
    Load,
    LoadFeatures,
    ReplayAdaptiveVerification,
    ServeSimulator,
    compare_baselines,
    simulate,
    sweep,
    tune_batch_size_table,
)
from learn2draft.replay.traces import PromptTrace, TraceSet
from learn2draft.sampling import SamplingConfig
from learn2draft.traces import record_traces

D, N = 4, 16  # max_depth, max_new_tokens of the traces
TOKENS, CONTEXTS, BATCHES = [1, 2, 4, 8], [0.0, 64.0], [1, 2, 4, 8, 16]


def batched_profile(verify=lambda B, n, c: 0.010 + 0.001 * (n - 1) + 1e-5 * c, draft=lambda B: 0.002,
                    name: str = "batched-test", step_ov: float = 1e-4, cycle_ov: float = 5e-4,
                    batch_axis: bool = True) -> LatencyProfile:
    """A profile whose single-sequence tables are ``verify(1, n, c)`` / ``draft(1)`` and whose batch axis is
    ``verify(B, n, c)`` / ``draft(B)`` at the same contexts (seconds)."""
    table = [[verify(1, n, c) for n in TOKENS] for c in CONTEXTS]
    costs = {d: DrafterCost([0.0], [draft(1)], step_ov, cycle_ov,
                            batch_step={"batch_sizes": BATCHES, "contexts": [0.0],
                                        "seconds": [[draft(B) for B in BATCHES]]} if batch_axis else None)
             for d in ("model", "lookup")}
    vb = {"batch_sizes": BATCHES, "tokens": TOKENS, "contexts": CONTEXTS,
          "seconds": [[[verify(B, n, c) for n in TOKENS] for B in BATCHES] for c in CONTEXTS]} if batch_axis else None
    return LatencyProfile(name, TOKENS, CONTEXTS, table, costs, machine={"cpu": "test"}, source="tests",
                          verify_batch=vb)


def synthetic_traces(num_prompts: int = 6, seed: int = 0, accept: float = 0.7, margins: bool = True,
                     drafter: str = "model") -> TraceSet:
    """Chain traces at T = 0 built in numpy: every position drafts min(D, N − t − 1) tokens, accepted runs are
    geometric (each drafted token accepted with probability ``accept``), the draft's margin is high (≈ 0.8) on tokens
    the target accepts and low (≈ 0.2) on the first it rejects."""
    rng = np.random.default_rng(seed)
    prompts = []
    for p in range(num_prompts):
        L = int(rng.integers(4, 12))
        n = N
        cl = np.zeros(n + 1, dtype=np.int64)
        cl[1:n] = np.minimum(D, N - np.arange(1, n) - 1)
        ap = np.full((n + 1, D), np.nan)
        dm = np.zeros((n + 1, D))
        for t in range(1, n):
            for j in range(cl[t]):
                ok = rng.random() < accept
                ap[t, j] = 1.0 if ok else 0.0
                dm[t, j] = np.clip((0.8 if ok else 0.2) + 0.1 * rng.standard_normal(), 0.0, 1.0)
        drafted = np.arange(D)[None, :] < cl[:, None]
        tokens = np.where(drafted, 5, -1).astype(np.int64)
        ts = np.full((n + 1, 3), 0.5)
        ts[0] = np.nan
        prompts.append(PromptTrace(
            prompt_ids=np.arange(L, dtype=np.int64), output=np.full(n, 7, dtype=np.int64), ended_by_eos=False,
            chain_len=cl, draft_tokens=tokens, confidence=np.where(drafted, 0.5, 0.0),
            entropy=np.where(drafted, 1.0, 0.0), drafter_features=np.zeros((n + 1, D + 1, 2), np.float32),
            accept_prob=ap, seed=p, target_stats=ts if margins else None, draft_margin=dm if margins else None))
    header = {"max_depth": D, "max_new_tokens": N, "drafter": {"drafter": drafter}, "sampling": {"temperature": 0.0},
              "vocab_size": 16}
    return TraceSet(header, prompts)


# ------------------------------------------------------------------ the profile's batch axis
def test_batch_axis_round_trip_interpolation_and_monotone_tokens(tmp_path):
    # A table that dips at 4 tokens (noise): the batched cost is made monotone along tokens.
    def verify(B, n, c):
        return 0.01 * B ** 0.5 + 0.001 * n * B + (-0.02 if (n == 4 and B > 1) else 0.0) + 1e-5 * c

    prof = batched_profile(verify, draft=lambda B: 0.001 * B)
    path = prof.save(tmp_path / "p.json")
    back = load_profile(path)
    assert back.has_batch_axis and back.max_batch_size == 16 and back.path == str(path)
    assert back.to_dict() == prof.to_dict()
    # B = 1 is the single-sequence table, exactly.
    for n in (1, 2, 3, 5):
        assert back.verify_batched(1, n, 30.0) == back.verify(n, 30.0)
    assert back.draft_step_batched("model", 1, 30.0) == back.draft_step("model", 30.0)
    # Tabulated points; linear in B between sizes (B = 3 halfway between 2 and 4); in context as verify.
    assert back.verify_batched(4, 8, 64.0) == pytest.approx(verify(4, 8, 64.0), rel=1e-12)
    assert back.verify_batched(3, 8, 0.0) == pytest.approx((verify(2, 8, 0.0) + verify(4, 8, 0.0)) / 2, rel=1e-12)
    assert back.verify_batched(8, 2, 32.0) == pytest.approx(verify(8, 2, 32.0), rel=1e-12)
    assert back.draft_step_batched("model", 6, 10.0) == pytest.approx(0.006, rel=1e-12)
    # Monotone in tokens: the dip at n = 4 is lifted to the value at n = 2.
    ks = np.arange(1, 9)
    for B in (2, 3, 8, 16):
        v = back.verify_batched(B, ks, 32.0)
        assert np.all(np.diff(v) >= 0), (B, v)
    assert back.verify_batched(8, 4, 0.0) == pytest.approx(verify(8, 2, 0.0), rel=1e-12)
    with pytest.raises(ValueError, match="up to 16 rows"):
        back.verify_batched(17, 1, 0.0)
    with pytest.raises(ValueError, match="1..8 tokens per row"):
        back.verify_batched(2, 9, 0.0)


def test_a_profile_without_the_batch_axis_loads_and_refuses_batches_naming_file_and_flag(tmp_path):
    path = batched_profile(batch_axis=False).save(tmp_path / "old.json")
    data = json.loads(path.read_text())
    assert "verify_batch" not in data and "batch_step_seconds" not in data["drafters"]["model"]
    old = load_profile(path)
    assert not old.has_batch_axis and old.max_batch_size == 1
    assert old.verify_batched(1, 3, 10.0) == old.verify(3, 10.0)
    for call in (lambda: old.verify_batched(2, 1, 0.0), lambda: old.draft_step_batched("model", 4, 0.0),
                 lambda: ServeSimulator(synthetic_traces(2), old, Load(concurrency=2), 4)):
        with pytest.raises(ValueError, match="has no batch axis") as e:
            call()
        assert str(path) in str(e.value) and "--batch-sizes 1,2,4,8,16" in str(e.value)
    # Concurrency 1 needs no batch axis.
    assert simulate(synthetic_traces(2), old, FixedDepthController(2), Load(concurrency=1), 2)["tokens"] == 2 * N
    for name in ("cpu-2core", "gpu-like"):  # the shipped profiles (without the axis) still load
        assert not load_profile(name).has_batch_axis


@pytest.mark.parametrize("damage,match", [
    (lambda d: d["verify_batch"].update(seconds=[[[0.1]]]), "verify_batch seconds must have shape"),
    (lambda d: d["verify_batch"].update(batch_sizes=[2, 1, 4, 8, 16]), "batch_sizes must be increasing"),
    (lambda d: d["verify_batch"].update(tokens=[2, 3, 4, 8]), "tokens must be integers starting at 1"),
    (lambda d: d["drafters"]["model"]["batch_step_seconds"].update(seconds=[["0.1"] * 5]), "JSON numbers"),
])
def test_a_damaged_batch_axis_is_a_clear_error(tmp_path, damage, match):
    data = batched_profile().to_dict()
    damage(data)
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(data))
    with pytest.raises(ValueError, match=match):
        load_profile(path)


def test_eval_profile_measures_the_batch_axis(tiny_model_dirs, tmp_path, capsys):
    from eval.profile import main as profile_main

    target, draft = tiny_model_dirs
    out = tmp_path / "prof.json"
    assert profile_main(["--target", target, "--draft", draft, "--drafter", "lookup,model", "--contexts", "8,16",
                         "--tokens", "1,2,4", "--repeats", "1", "--draft-steps", "2", "--overhead-prompts", "1",
                         "--overhead-tokens", "6", "--device", "cpu", "--batch-sizes", "1,2,4",
                         "--batch-overhead-depths", "0,2,9", "--batch-overhead-tokens", "6", "--out", str(out)]) == 0
    summary = json.loads(capsys.readouterr().out)
    p = load_profile(out)
    assert p.has_batch_axis and p.verify_batch["batch_sizes"] == [1, 2, 4] and p.verify_batch["contexts"] == [8.0]
    assert np.asarray(p.verify_batch["seconds"]).shape == (1, 3, 3)
    for d in ("lookup", "model"):
        assert np.asarray(p.cost(d).batch_step["seconds"]).shape == (1, 3)
        assert float(p.draft_step_batched(d, 4, 8.0)) > 0
    assert set(summary["verify_batched_ms_at_1_token"]) == {"1", "2", "4"}
    # The real batched loop's seconds beyond the tables: fitted per batch size ≥ 2 from real closed-loop steps
    # (γ = 9 exceeds the 4-token table and is dropped: the loops ran at γ 0 and 2).
    for d in ("lookup", "model"):
        bo = p.cost(d).batch_overhead
        assert bo["batch_sizes"] == [2, 4] and all(n > 0 for n in bo["steps"]) and "γ [0, 2]" in bo["how"]
        assert all(np.isfinite(bo[k]).all() for k in ("cycle_seconds", "step_seconds", "join_seconds"))
        assert p.batch_overhead(d, 1, 2) == 0.0 and p.join_overhead(d, 1) == 0.0
        assert p.batch_overhead(d, 4, 2) == pytest.approx(bo["cycle_seconds"][1] + 2 * bo["step_seconds"][1])
    assert set(summary["batch_overhead_ms"]["model"]) == {"B=2", "B=4"}
    assert p.prefill["tokens"][0] == 8 and len(p.prefill["seconds"]) == len(summary["prefill_ms"]) >= 2
    assert p.prefill_seconds(8) == pytest.approx(p.prefill["seconds"][0])
    assert profile_main(["--batch-contexts", "8", "--drafter", "lookup"]) == 2
    assert "--batch-sizes" in capsys.readouterr().err
    for bad in (["--batch-overhead-requests", "-1"], ["--batch-overhead-tokens", "1"],
                ["--batch-overhead-depths", "x"]):
        assert profile_main(["--drafter", "lookup", "--batch-sizes", "1,2", *bad]) == 2
        assert "--batch-overhead" in capsys.readouterr().err


def test_the_batched_loops_overheads_enter_every_batched_cost(tmp_path):
    """A drafter's batch_overhead_seconds: read back from its file, linear in B from 0 at B = 1, added to the
    simulator's step and join costs, to the adaptive-verification cost table; B = 1 untouched; bad entries refused."""
    from learn2draft.budget import profile_step_cost
    from learn2draft.state import LoadState

    plain = batched_profile()
    prof = batched_profile()
    prof.drafters["model"].batch_overhead = {"batch_sizes": [2, 4, 16], "cycle_seconds": [0.001, 0.004, 0.010],
                                             "step_seconds": [0.0005, 0.001, -0.002],
                                             "join_seconds": [0.002, 0.003, 0.008]}
    prof.validate()
    back = load_profile(prof.save(tmp_path / "p.json"))
    assert back.to_dict() == prof.to_dict() and back.cost("model").batch_overhead == prof.cost("model").batch_overhead
    assert back.batch_overhead("model", 1, 3) == 0.0 and back.batch_overhead("lookup", 4, 3) == 0.0
    assert back.batch_overhead("model", 4, 3) == pytest.approx(0.004 + 3 * 0.001)
    assert back.batch_overhead("model", 3, 2) == pytest.approx(0.0025 + 2 * 0.00075)  # halfway between 2 and 4
    assert back.join_overhead("model", 10) == pytest.approx(0.0055) and back.join_overhead("model", 1) == 0.0
    for B, d, c in ((1, 3, 10.0), (2, 0, 0.0), (4, 3, 64.0), (16, 4, 32.0)):
        base, extra = plain.step_batched("model", B, d, c), back.step_batched("model", B, d, c)
        assert extra[:2] == base[:2]
        assert extra[2] == pytest.approx(max(base[2] + back.batch_overhead("model", B, d), -base[0]))
    # A prefill past the table is priced with the upper half's slope of the monotone table: a last median below its
    # neighbour (noise) does not price a long prompt below nothing.
    dip = batched_profile(verify=lambda B, n, c: 0.05 + 0.002 * n - (0.01 if n == 8 else 0.0))
    assert dip.verify(80, 0.0, extrapolate=True) == pytest.approx(0.058 + 72 * (0.058 - 0.054) / (8 - 2))  # 2..8
    assert batched_profile().verify(80, 0.0, extrapolate=True) == pytest.approx(0.010 + 0.001 * 79)
    # A measured prefill table prices joins instead: linear between lengths, the last two's slope above them.
    pre = batched_profile()
    pre.prefill = {"tokens": [8, 32, 64], "seconds": [0.02, 0.05, 0.09]}
    pre.validate()
    again = load_profile(pre.save(tmp_path / "pre.json"))
    assert again.prefill == pre.prefill
    assert again.prefill_seconds(48) == pytest.approx(0.07) and again.prefill_seconds(96) == pytest.approx(0.13)
    assert again.prefill_seconds(3) == pytest.approx(0.02)
    one = simulate(synthetic_traces(2), again, FixedDepthController(0), Load(concurrency=1), 2)
    assert one["prefill_seconds"] == pytest.approx(sum(again.prefill_seconds(p.prompt_len)
                                                       for p in synthetic_traces(2).prompts))
    pre.prefill = {"tokens": [8, 4], "seconds": [0.1, 0.2]}
    with pytest.raises(ValueError, match="prefill tokens must be increasing"):
        pre.validate()
    # A negative overhead never makes a step cheaper than its verification.
    neg = batched_profile()
    neg.drafters["model"].batch_overhead = {"batch_sizes": [2], "cycle_seconds": [-1.0], "step_seconds": [0.0],
                                            "join_seconds": [-1.0]}
    draft, verify, other = neg.step_batched("model", 2, 3, 0.0)
    assert draft + verify + other == pytest.approx(verify)
    # The simulator charges them: the same stream costs more by exactly the overheads of its steps and joins.
    tr = synthetic_traces(4)
    steps_plain, steps_over = [], []
    r0 = simulate(tr, plain, FixedDepthController(3), Load(concurrency=4), 8, steps=steps_plain)
    r1 = simulate(tr, back, FixedDepthController(3), Load(concurrency=4), 8, steps=steps_over)
    assert [s.taus.tolist() for s in steps_plain] == [s.taus.tolist() for s in steps_over]
    extra_steps = sum(back.batch_overhead("model", s.batch, int(s.depths.max())) for s in steps_plain if s.batch > 1)
    assert r1["step_seconds"] - r0["step_seconds"] == pytest.approx(extra_steps, rel=1e-9)
    assert r1["prefill_seconds"] > r0["prefill_seconds"]
    # … and so does the adaptive-verification rule's cost table.
    load = LoadState(batch_size=4, max_batch=4, context_lens=(10, 20, 30, 40))
    assert profile_step_cost(back, "model", 4)(load, 2) == pytest.approx(
        profile_step_cost(plain, "model", 4)(load, 2) + back.batch_overhead("model", 4, 2))
    for damage, match in (({"batch_sizes": [1, 2]}, "integers ≥ 2"), ({"step_seconds": [0.0]}, "per batch size \\(3\\)"),
                          ({"join_seconds": ["0.1", 0, 0]}, "JSON numbers")):
        data = back.to_dict()
        data["drafters"]["model"]["batch_overhead_seconds"].update(damage)
        (tmp_path / "bad.json").write_text(json.dumps(data))
        with pytest.raises(ValueError, match=match) as e:
            load_profile(tmp_path / "bad.json")
        assert str(tmp_path / "bad.json") in str(e.value)
    data = back.to_dict()
    del data["drafters"]["model"]["batch_overhead_seconds"]["step_seconds"]
    (tmp_path / "bad.json").write_text(json.dumps(data))
    with pytest.raises(ValueError, match="drafter 'model' batch_overhead_seconds lacks step_seconds"):
        load_profile(tmp_path / "bad.json")
    # The cost table of adaptive verification is never below the step's verification either.
    assert profile_step_cost(neg, "model", 4)(LoadState(batch_size=2, max_batch=2, context_lens=(5, 6)), 1) == \
        pytest.approx(float(neg.verify_batched(2, 2, 6.0)))


# ------------------------------------------------------------------ the simulator
@pytest.fixture(scope="module")
def recorded(noisy_pair):
    prompts = ["w1 w2 w3 w4", "w5 w6 w5 w6 w5", "w7 w8 w9 w10 w11", "w13 w14 w15 w13 w14"]
    return record_traces(noisy_pair, drafter_for("model", noisy_pair), prompts, SamplingConfig(temperature=0.0),
                         max_new_tokens=N, max_depth=D, seed=3, progress=False)


@pytest.mark.parametrize("gamma", [0, 1, 3, 4])
def test_concurrency_one_equals_the_single_sequence_chain_replay(recorded, gamma):
    """At c = 1 (prefills uncharged, as the single-sequence replay charges none) the simulated stream is the chain
    replay of envs.replay.replay_controller with a fixed γ: same tokens, same seconds, tokens/s within 1e-6."""
    prof = batched_profile()
    env = SpecDecodeReplayEnv(recorded, prof, max_depth=D)
    assert len(env._usable) == len(recorded.prompts)  # every generation runs past its first token
    ref = replay_controller(env, FixedDepthController(gamma))
    steps = []
    rep = simulate(recorded, prof, FixedDepthController(gamma), Load(concurrency=1), len(recorded.prompts),
                   charge_prefill=False, steps=steps)
    assert rep["tokens"] == ref["tokens"]
    assert rep["tokens_per_s"] == pytest.approx(ref["tokens_per_s"], rel=1e-6, abs=0)
    assert len(steps) == ref["cycles"] and rep["mean_tau"] == pytest.approx(ref["mean_accepted"], abs=1e-12)
    assert all(s.batch == 1 for s in steps)
    # With prefills charged the stream is slower by exactly the prompts' prefill seconds.
    full = simulate(recorded, prof, FixedDepthController(gamma), Load(concurrency=1), len(recorded.prompts))
    pre = sum(float(prof.verify(p.prompt_len, 0.0, extrapolate=True)) for p in recorded.prompts)
    assert full["seconds"] == pytest.approx(ref["seconds"] + pre, rel=1e-9)


def test_no_speculation_accepts_nothing_and_emits_one_token_per_row():
    steps = []
    rep = simulate(synthetic_traces(), batched_profile(), FixedDepthController(0), Load(concurrency=4), 12, steps=steps)
    assert rep["mean_tau"] == 0 and rep["mean_depth"] == 0
    for s in steps:
        assert np.all(s.depths == 0) and np.all(s.taus == 0) and np.all(s.emitted == 1) and s.draft_seconds == 0
    assert rep["tokens"] == 12 * N and rep["requests"] == 12


def test_one_fixed_gamma_class_serves_the_real_loop_and_the_replay():
    """FixedDepthController (the real loop's fixed γ) is the replay's fixed-γ policy too (issue 41: one fixed-γ
    class): called with the load, it gives every running row γ as int64 (B,); numpy integers are taken, bools,
    negatives and non-integers refused."""
    load = LoadFeatures(running=3, waiting=1, tokens_in_flight=30, mean_context=10.0, max_context=12, max_batch=4,
                        max_depth=D, step=0, time=0.0)
    got = FixedDepthController(np.int64(2))(load, None)
    assert got.dtype == np.int64 and got.tolist() == [2, 2, 2]
    assert FixedDepthController(0)(load, None).tolist() == [0, 0, 0]
    assert FixedDepthController(np.int64(2)).max_depth == 2
    for bad in (-1, True, 1.5, "2"):
        with pytest.raises(ValueError, match="num_draft_tokens must be an integer"):
            FixedDepthController(bad)


def test_aggregate_throughput_rises_with_concurrency_when_verification_is_flat_in_batch():
    flat = batched_profile(verify=lambda B, n, c: 0.010 + 0.001 * (n - 1), draft=lambda B: 0.002)
    reps = sweep(synthetic_traces(), flat, FixedDepthController(2), [1, 2, 4, 8], 16)
    rates = [r["tokens_per_s"] for r in reps]
    assert all(b > 1.3 * a for a, b in zip(rates, rates[1:])), rates
    assert [r["load"] for r in reps] == ["c=1", "c=2", "c=4", "c=8"]
    assert reps[-1]["mean_batch"] > 4
    for r in reps:  # the percentiles are ordered
        for k in ("ttft_s", "itl_s", "latency_s", "per_request_tokens_per_s"):
            assert r[k]["p50"] <= r[k]["p90"] <= r[k]["p99"]


def test_poisson_arrivals_are_reproducible_for_a_seed():
    tr, prof = synthetic_traces(), batched_profile()
    a = simulate(tr, prof, FixedDepthController(2), Load(rate=40.0), 20, seed=7)
    b = simulate(tr, prof, FixedDepthController(2), Load(rate=40.0), 20, seed=7)
    c = simulate(tr, prof, FixedDepthController(2), Load(rate=40.0), 20, seed=8)
    assert a == b and a["seconds"] != c["seconds"]
    assert a["load"] == "λ=40/s" and a["requests"] == 20 and a["tokens"] == 20 * N
    # A rate far below the service rate leaves requests alone: TTFT is one prefill, batches stay near 1.
    slow = simulate(tr, prof, FixedDepthController(2), Load(rate=0.1), 6, seed=1)
    assert slow["mean_batch"] == pytest.approx(1.0) and slow["ttft_s"]["p99"] < 0.05


def test_bad_settings_are_clear_errors():
    tr, prof = synthetic_traces(), batched_profile()
    with pytest.raises(ValueError, match="one of them"):
        Load(concurrency=2, rate=1.0)
    with pytest.raises(ValueError, match="rate must be"):
        Load(rate=0.0)
    with pytest.raises(ValueError, match="exceeds max_batch"):
        ServeSimulator(tr, prof, Load(concurrency=4), 4, max_batch=2)
    with pytest.raises(ValueError, match="up to 16 rows"):
        ServeSimulator(tr, prof, Load(rate=1.0), 4, max_batch=32)
    with pytest.raises(ValueError, match="max_depth must be"):
        ServeSimulator(tr, prof, Load(concurrency=1), 4, max_depth=D + 1)
    sim = ServeSimulator(tr, prof, Load(concurrency=2), 2)
    with pytest.raises(ValueError, match="one per running row"):
        sim.step([1, 1, 1])


# ------------------------------------------------------------------ the baselines
def steep_profile() -> LatencyProfile:
    """Cheap verification of a few tokens at batch 1 (speculation pays), a cost proportional to the batched tokens
    B·n at B ≥ 4 (speculation cannot pay: every drafted token costs as much as a row's whole step)."""
    def verify(B, n, c):
        return 0.010 + 0.0005 * (n - 1) if B == 1 else 0.010 + 0.010 * (B * n - 1)
    return batched_profile(verify, draft=lambda B: 0.0005)


def test_the_per_batch_size_grid_picks_no_speculation_where_verification_is_expensive():
    table, rates = tune_batch_size_table(synthetic_traces(), steep_profile(), [1, 4, 8], num_requests=8)
    g = table.gamma_for
    assert g(1) > 0 and g(4) == 0 and g(8) == 0 and g(16) == 0
    assert table.to_vllm() == [[1, 3, g(1)], [4, 7, 0], [8, 16, 0]]
    assert rates[1][g(1)] == max(rates[1].values()) and rates[8][0] == max(rates[8].values())
    # The table as a policy: γ follows the running batch size.
    steps = []
    simulate(synthetic_traces(), steep_profile(), table, Load(concurrency=8), 16, steps=steps)
    assert all((s.depths == 0).all() for s in steps if s.batch >= 4)
    steps = []
    simulate(synthetic_traces(), steep_profile(), table, Load(concurrency=2), 4, steps=steps)
    assert all(s.depths.max() > 0 for s in steps if s.batch == 2 and s.depths.size and min(s.emitted) > 0)
    assert sum(int(s.depths.sum()) for s in steps) > 0
    with pytest.raises(ValueError, match="overlap"):
        BatchSizeTable([(1, 4, 2), (4, 8, 1)])  # learn2draft.budget's, the one the real loop runs


def test_adaptive_verification_verifies_no_slot_when_drafting_cannot_pay():
    tr = synthetic_traces(accept=0.9)
    costly = batched_profile(draft=lambda B: 1.0)  # one draft step costs 100 verifications
    rule = ReplayAdaptiveVerification(warmup_refits=0)
    steps = []
    rep = simulate(tr, costly, rule, Load(concurrency=4), 8, steps=steps)
    assert rule.last_budget == 0 and all((s.depths == 0).all() for s in steps) and rep["mean_tau"] == 0
    # Negative control: cheap drafting, flat verification and high acceptance: the rule verifies slots.
    cheap = batched_profile(verify=lambda B, n, c: 0.010 + 1e-5 * n, draft=lambda B: 1e-4)
    rule2 = ReplayAdaptiveVerification(warmup_refits=0)
    steps = []
    simulate(tr, cheap, rule2, Load(concurrency=4), 8, steps=steps)
    assert sum(int(s.depths.sum()) for s in steps) > 0


def test_adaptive_verification_learns_the_margin_and_warms_up_on_whole_blocks():
    tr = synthetic_traces(num_prompts=8, accept=0.6)
    prof = batched_profile()
    rule = ReplayAdaptiveVerification(refit_every=10, warmup_refits=2, min_observations=20)
    steps = []
    simulate(tr, prof, rule, Load(concurrency=4), 16, steps=steps)
    est = rule.rule.estimator
    assert est.refits >= 2 and est.weights[0] > 1.0  # margins ≈ 0.8 accepted vs ≈ 0.2 rejected: a positive slope
    # While warming up, every row verifies its whole block.
    sim = ServeSimulator(tr, prof, Load(concurrency=4), 8)
    warm = ReplayAdaptiveVerification(refit_every=10, warmup_refits=2).bind(sim)
    load, rows = sim.observe()
    assert warm.warming_up and np.array_equal(warm(load, rows), rows.avail) and rows.avail.max() == D
    # Lookup traces without margins (NaN, read as 0): each position's logistic is its mean acceptance.
    rule_lookup = ReplayAdaptiveVerification(refit_every=10, warmup_refits=1, min_observations=20)
    simulate(synthetic_traces(margins=False, drafter="lookup"), prof, rule_lookup, Load(concurrency=2), 8)
    est = rule_lookup.rule.estimator
    assert est.refits >= 1 and 0.4 < float(est.predict(np.zeros(1))[0]) < 0.9


# ------------------------------------------------------------------ the environment
@pytest.mark.parametrize("episode", ["step", "stream"])
def test_check_env_passes_and_the_env_is_registered(episode):
    env = ServeReplayEnv(synthetic_traces(), batched_profile(), loads=[1, 4, Load(rate=30.0)], num_requests=6,
                         episode=episode)
    check_env(env, skip_render_check=True)
    assert env.action_space.n == D + 1 and env.observation_space.shape == (11,)
    made = gym.make(SERVE_ENV_ID, traces=synthetic_traces(), profile=batched_profile(), loads=[2], num_requests=4,
                    episode=episode)
    obs, info = made.reset(seed=0)
    assert info["load"] == "c=2" and made.observation_space.contains(obs)
    total, steps, finished = 0.0, 0, False
    while not finished:
        obs, r, done, trunc, info = made.step(2)
        total, steps, finished = total + r, steps + 1, info["stream_finished"]
        assert done == (finished or episode == "step") and not trunc
        if done and not finished:
            obs, info = made.reset()
            assert not info["new_stream"]  # step episodes continue the stream
    assert info["report"]["requests"] == 4 and total > 0 and steps == info["report"]["steps"]
    _, info = made.reset()
    assert info["new_stream"]


def test_env_rewards_are_the_steps_aggregate_rate_over_the_plain_decoding_scale():
    tr, prof = synthetic_traces(), batched_profile()
    env = ServeReplayEnv(tr, prof, loads=[4], num_requests=8, reward="rate")
    with pytest.raises(ValueError, match="episode must be"):
        ServeReplayEnv(tr, prof, loads=[4], episode="generation")
    ar = simulate(tr, prof, FixedDepthController(0), Load(concurrency=1), len(tr.prompts), charge_prefill=False)
    assert env.reward_scale == pytest.approx(ar["tokens_per_s"])
    env.reset(seed=1)
    _, r, _, _, info = env.step(0)
    assert info["batch"] == 4 and info["tokens"] == 4
    assert r == pytest.approx(info["tokens_per_second"] / env.reward_scale)
    assert r == pytest.approx(4 / (prof.verify_batched(4, 1, info_ctx(env)) + 5e-4) / env.reward_scale, rel=1e-9)
    with pytest.raises(ValueError, match="Invalid action"):
        env.step(D + 1)
    with pytest.raises(ValueError, match="reward must be"):
        ServeReplayEnv(tr, prof, loads=[4], reward="tokens")


def test_the_gain_reward_is_tokens_beyond_plain_decoding_in_the_same_time():
    """Plain decoding scores 0; a step scores its tokens minus those plain decoding emits in its seconds, per row."""
    tr, prof = synthetic_traces(accept=0.9), batched_profile()
    env = ServeReplayEnv(tr, prof, loads=[4], num_requests=8)  # reward="gain", the default
    env.reset(seed=1)
    _, r0, _, _, info0 = env.step(0)
    assert r0 == pytest.approx(0.0, abs=1e-12)
    env.reset()  # "step" episodes: the same stream goes on
    _, r, _, _, info = env.step(3)
    plain = info0["seconds"]  # the same batch and (nearly the same) context without drafting
    expected = (info["tokens"] - info["batch"] * info["seconds"] / plain) / info["batch"]
    assert r == pytest.approx(expected, rel=1e-2) and r > 0  # high acceptance: speculation gains tokens


def info_ctx(env) -> float:
    """The batch context of the env's previous step: every row started at its prompt + 1 and emitted 1 token."""
    return float(max(p.prompt_len for p in env.traces.prompts[:4]) + 1)


def test_compare_baselines_runs_every_method_on_the_same_loads():
    tr = synthetic_traces()
    out = compare_baselines(tr, steep_profile(), [1, 8], 8, gammas=[0, 1, 2, 4], policies={"γ=1": FixedDepthController(1)})
    assert out["loads"] == ["c=1", "c=8"] and set(out["fixed"]) == {0, 1, 2, 4}
    names = list(out["methods"])
    assert names == ["no speculation", f"best fixed γ={out['best_gamma']}", "per-batch-size table",
                     "adaptive verification", "γ=1"]
    assert out["methods"]["γ=1"] == [simulate(tr, steep_profile(), FixedDepthController(1), x, n) for x, n in ((1, 8), (8, 32))]
    nospec = [r["tokens_per_s"] for r in out["methods"]["no speculation"]]
    table = [r["tokens_per_s"] for r in out["methods"]["per-batch-size table"]]
    assert table[0] > nospec[0] and table[1] >= nospec[1] * (1 - 1e-9)  # speculates at c = 1, not at c = 8
    assert out["table"][0][2] > 0 and out["table"][-1][2] == 0


def test_a_load_aware_policy_trains_in_seconds_and_never_loses_to_plain_decoding():
    """PPO (SB3, 8,192 steps, seed 0, one thread; ≈ 10 s here) on ServeReplay-v0 over concurrencies 1, 2 and 8 with
    the steep profile (speculation pays at B = 1 only) learns to speculate alone and not under load: at every level
    ≥ plain decoding (to 1e-9) and ≥ 0.95 × the best fixed γ of that level (tolerance for an 8k-step policy)."""
    import torch
    from stable_baselines3 import PPO

    from envs.serve import run_stream

    torch.set_num_threads(1)
    tr, prof = synthetic_traces(num_prompts=8), steep_profile()
    env = ServeReplayEnv(tr, prof, loads=[1, 2, 8], num_requests=8)
    model = PPO("MlpPolicy", env, n_steps=256, batch_size=64, seed=0, device="cpu")
    model.learn(8192)
    for k, c in enumerate((1, 2, 8)):
        rep = run_stream(env, lambda o: model.predict(o, deterministic=True)[0], seed=1, load_index=k)
        seed = env.sim.seed
        fixed = [simulate(tr, prof, FixedDepthController(g), Load(concurrency=c), 8, max_batch=8, seed=seed)["tokens_per_s"]
                 for g in range(D + 1)]
        assert rep["tokens_per_s"] >= fixed[0] * (1 - 1e-9), (c, rep["actions"], fixed)
        assert rep["tokens_per_s"] >= 0.95 * max(fixed), (c, rep["actions"], fixed)
    assert fixed[0] == max(fixed) and rep["actions"][0] == sum(rep["actions"])  # c = 8: never speculates


def test_a_closed_loop_serves_enough_requests_to_keep_its_batch_full():
    from learn2draft.replay.serve import requests_for

    assert requests_for(16, 12) == 64 and requests_for(2, 12) == 12  # at least 4 × c (REQUESTS_PER_SLOT)
    assert requests_for(Load(rate=2.0), 12) == 12 and requests_for(16, 12, requests_per_slot=0) == 12
    with pytest.raises(ValueError, match="requests_per_slot"):
        requests_for(4, 12, requests_per_slot=-1)
    # one wave (N ≤ c) never fills a batch of c; with 4 × c requests the batch runs full for most steps
    tr, prof = synthetic_traces(), steep_profile()
    steps: list = []
    simulate(tr, prof, FixedDepthController(0), Load(concurrency=8), requests_for(8, 4), steps=steps, max_batch=8)
    full = sum(1 for s in steps if s.batch == 8)
    assert full / len(steps) > 0.5
    reps = sweep(tr, prof, FixedDepthController(0), [1, 8], 4)
    assert [r["requests"] for r in reps] == [4, 32]
