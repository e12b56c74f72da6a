"""learn2draft.budget on synthetic data (no models): the per-batch-size table, the online acceptance logistic,
vLLM's adaptive-verification budget and its pricing by a latency profile, the step-time cap."""

from __future__ import annotations

import numpy as np
import pytest
from helpers_loop import draft_state

from learn2draft.budget import (
    AdaptiveVerification,
    BatchSizeTable,
    OnlineAcceptanceEstimator,
    StepTimeCap,
    choose_budget,
    fit_logistic,
    parse_batch_size_table,
    profile_step_cost,
)
from learn2draft.state import LoadState


def _drafted(ctrl, max_depth: int) -> int:
    """Tokens the controller drafts in one cycle of a decoder with ``max_depth`` (the decoder's depth rule)."""
    d = 0
    while d < min(ctrl.max_depth, max_depth):
        if not ctrl.decide(draft_state(d, max_depth)):
            break
        d += 1
    return d


def _load(b: int) -> LoadState:
    return LoadState(b, 64, tuple([10] * b))


def test_batch_size_table_reads_the_range_of_the_load():
    t = BatchSizeTable([[1, 2, 5], [3, 8, 3], [9, 16, 1], [17, 512, 0]])
    assert t.max_depth == t.depth_feature_scale == 5
    got = {}
    for b in (1, 2, 3, 8, 9, 16, 17, 512, 1000):
        t.observe_load(_load(b))
        got[b] = _drafted(t, t.max_depth)
    assert got == {1: 5, 2: 5, 3: 3, 8: 3, 9: 1, 16: 1, 17: 0, 512: 0, 1000: 0}
    assert t.to_vllm() == [[1, 2, 5], [3, 8, 3], [9, 16, 1], [17, 512, 0]]


def test_batch_size_table_accepts_mappings_and_a_larger_depth_scale():
    a = BatchSizeTable({"1-4": 4, "5-8": 2, "9": 0})
    b = BatchSizeTable({(1, 4): 4, (5, 8): 2, 9: 0}, max_depth=8)
    assert a.to_vllm() == b.to_vllm() == [[1, 4, 4], [5, 8, 2], [9, 9, 0]]
    b.observe_load(_load(3))
    assert b.depth_feature_scale == 8 and _drafted(b, 8) == 4
    assert BatchSizeTable([[1, 1, 3]]).gamma == 3  # before any load: batch size 1


@pytest.mark.parametrize("table, words", [
    ([[1, 4, 2], [4, 8, 1]], "overlap"),
    ([[1, 4, 2], [6, 8, 1]], "5..5 without a γ"),
    ([[2, 4, 2]], "not 1"),
    ([[1, 4, -1]], "K ≥ 0"),
    ([[4, 1, 2]], "start_bs ≤ end_bs"),
    ([[1, 4]], "not three integers"),
    ([[1, 4, 2.5]], "not three integers"),
    ([], "empty"),
    ({"a-b": 1}, "not a batch size"),
    ("1-4:2", "must be a list or a mapping"),
])
def test_bad_batch_size_tables_are_one_clear_error(table, words):
    with pytest.raises(ValueError, match="num_speculative|start_bs, end_bs, K") as e:
        parse_batch_size_table(table)
    assert words in str(e.value)


def test_a_depth_scale_below_the_table_is_refused():
    with pytest.raises(ValueError, match="largest γ"):
        BatchSizeTable([[1, 8, 4]], max_depth=3)


def test_the_logistic_recovers_known_weights():
    """Seeded sample, 4,000 observations: the fit is within 0.25 of the true slope and intercept (their
    standard errors here are ≈ 0.09 and 0.05, so 0.25 is > 2.5 σ), and a wrong fit (the start) fails the check."""
    rng = np.random.default_rng(0)
    x = rng.uniform(0, 1, 4000)
    w_true, b_true = 3.0, -1.0
    y = (rng.uniform(size=x.size) < 1 / (1 + np.exp(-(w_true * x + b_true)))).astype(float)
    w, b = fit_logistic(x, y)
    assert abs(w - w_true) < 0.25 and abs(b - b_true) < 0.25, (w, b)
    w0, b0 = fit_logistic(x, y, iterations=0)
    assert abs(w0 - w_true) > 0.25  # the tolerance can fail


def test_the_online_estimator_refits_per_position_after_its_rounds():
    """Position 0 follows sigmoid(4m − 1), position 1 a constant 0.3 with a negative-slope sample (rejected:
    the mean is used); refits every 10 steps, 3 warm-up refits; a position with too few observations is kept."""
    rng = np.random.default_rng(1)
    est = OnlineAcceptanceEstimator(3, refit_every=10, warmup_refits=3, min_observations=50)
    for step in range(40):
        assert est.needs_full_verification == (step < 30)
        for _ in range(40):
            m = rng.uniform(0, 1, 3)
            a0 = rng.uniform() < 1 / (1 + np.exp(-(4 * m[0] - 1)))
            a1 = rng.uniform() < 0.3 * (1.5 - m[1])  # accepted less often at a larger margin: a negative slope
            accepted = 0 if not a0 else 1 if not a1 else 2
            est.add(m, accepted, verified=2)  # position 2 is never verified: no labels
        est.end_step()
    assert est.refits == 4 and est.rejected_slopes >= 1
    assert abs(est.weights[0] - 4) < 1.0 and abs(est.biases[0] + 1) < 0.5
    assert est.weights[1] == 0 and 0.15 < 1 / (1 + np.exp(-est.biases[1])) < 0.45
    assert est.weights[2] == 0 and est.biases[2] == 1.5  # no observations: the initial coefficients
    assert est.observations() == [0, 0, 0]


def test_censored_rows_label_only_their_accepted_positions():
    est = OnlineAcceptanceEstimator(4)
    est.add(np.array([0.9, 0.8, 0.1, 0.5]), accepted=2, verified=4)
    est.add(np.array([0.9, 0.8, 0.1, 0.5]), accepted=1, verified=4, censored=True)
    assert est.observations() == [2, 1, 1, 0]  # row 1: 1, 1, 0 at positions 0-2; row 2: 1 at 0


def _cost(n_rows: int, per_token: float, fixed: float = 0.01):
    """``(longest, verified) -> seconds`` of a step of ``n_rows`` rows whose ragged verification feeds
    ``n_rows + verified`` tokens."""
    return lambda longest, verified: fixed + per_token * (n_rows + verified)


def test_the_budget_verifies_everything_when_verification_is_free_and_nothing_when_it_dominates():
    survival = [np.cumprod([0.9, 0.8, 0.7]), np.cumprod([0.6, 0.5]), np.array([])]
    keep, B = choose_budget(survival, _cost(3, 0.0))
    assert keep == [3, 2, 0] and B == 5
    keep, B = choose_budget(survival, _cost(3, 10.0))
    assert keep == [0, 0, 0] and B == 0


def test_the_budget_takes_global_top_slots():
    """Ragged verification prices every kept slot alike: the rule keeps, across rows, the slots whose survival pays
    for their token (at 0.02 s a token all six, down to survival 0.16: 5.91 / 1.16 = 5.09 is the best ratio; at 0.2 s
    the four of survival ≥ 0.81: 5.56 / 2.2 = 2.53). A cost in the longest kept draft (lockstep drafting) drops a
    deep tail."""
    survival = [np.cumprod([0.95, 0.95, 0.2, 0.9]), np.cumprod([0.9, 0.9])]
    keep, B = choose_budget(survival, lambda longest, verified: 1.0 + 0.02 * (2 + verified))
    assert keep == [4, 2] and B == 6
    keep, B = choose_budget(survival, lambda longest, verified: 1.0 + 0.2 * (2 + verified))
    assert keep == [2, 2] and B == 4  # 0.95, 0.90, 0.90, 0.81 pay for 0.2 s a token; 0.18 does not
    # the longest kept draft prices drafting: a deep tail that lengthens the lockstep draft is dropped
    keep, B = choose_budget(survival, lambda longest, verified: 1.0 + 0.5 * longest + 0.001 * verified)
    assert max(keep) <= 2


def test_adaptive_verification_warms_up_then_cuts_and_learns_from_steps():
    from types import SimpleNamespace

    av = AdaptiveVerification(4, cost=lambda load, longest, verified: 0.001 * load.batch_size
                              + _cost(load.batch_size, 1.0)(longest, verified),
                              refit_every=2, warmup_refits=1, min_observations=1)
    margins = [np.array([0.9, 0.9, 0.9, 0.9]), np.array([0.5, 0.5])]
    assert av(margins, _load(2)) == [4, 2]  # warm-up: whole blocks
    rows = {0: SimpleNamespace(num_accepted=4, verify_size=4, finished=False),
            1: SimpleNamespace(num_accepted=0, verify_size=2, finished=False)}
    for _ in range(2):
        av(margins, _load(2))
        av.observe(SimpleNamespace(rows=rows))
    assert not av.estimator.needs_full_verification
    assert av(margins, _load(2)) == [0, 0]  # each token costs a second: nothing pays
    with pytest.raises(ValueError, match="2 rows but 1 margin"):
        av.observe(SimpleNamespace(rows=rows), margins=[margins[0]])


def test_a_profile_prices_the_ragged_step_or_the_step_padded_to_the_longest_draft():
    from test_serve_replay import batched_profile

    prof = batched_profile(verify=lambda B, n, c: 0.01 * B * n, draft=lambda B: 0.001 * B)
    load = LoadState(2, 4, (100, 128))
    drafted_first = profile_step_cost(prof, "lookup", 4)  # the rows drafted 4 tokens before the choice
    assert drafted_first(load, 1) == pytest.approx(4 * 0.002 + 0.01 * 2 * 2)  # padded: 2 rows × 2 tokens
    assert drafted_first(load, 1, 1) == pytest.approx(4 * 0.002 + 0.01 * 3)  # ragged: 2 + 1 tokens
    assert profile_step_cost(prof, "lookup", 4, drafted_before=False)(load, 1) == pytest.approx(0.002 + 0.04)
    with pytest.raises(ValueError, match="needs the step's cost"):
        AdaptiveVerification(2)([np.zeros(1)], load)


def test_policies_rules_holds_every_hand_rule_and_re_exports_the_engines_load_rules():
    """policies.rules is the one place to find the hand rules (issue 41); the load rules the engine's replay runs
    stay defined in learn2draft.budget (the engine imports nothing from policies) and are the same objects there."""
    import learn2draft.budget as budget
    import policies.rules as rules

    for name in ("AdaptiveVerification", "BatchSizeTable", "OnlineAcceptanceEstimator", "StepTimeCap", "choose_budget",
                 "profile_step_cost"):
        assert getattr(rules, name) is getattr(budget, name)
    for name in ("ConfidenceThresholdController", "MatchLengthController", "SingleSourceController",
                 "LookupFirstController", "SuffixScoreController", "SpeculationGuard"):
        assert getattr(rules, name).__module__ == "policies.rules"
        assert name in rules.__all__


def _linear_cost(per_token: float, base: float = 1.0):
    """A step's seconds: ``base`` + ``per_token`` × the drafted tokens verified (the longest draft costs nothing)."""
    return lambda load, longest, verified: base + per_token * verified


def test_the_step_time_cap_verifies_every_draft_unless_a_row_drafted_nothing():
    """No row idle (every row can gain), or no row drafted: every drafted token is verified, whatever the cost."""
    cap = StepTimeCap(_linear_cost(1.0), slack=0.0)
    margins = [np.array([0.9, 0.8]), np.array([0.5])]
    assert cap(margins, _load(2)) == [2, 1]
    assert cap([np.zeros(0), np.zeros(0)], _load(2)) == [0, 0]
    assert cap.history == [(2, 0, 3, 3), (2, 2, 0, 0)]


def test_the_step_time_cap_keeps_the_step_within_its_slack_by_survival():
    """A row drafted nothing: the kept slots' predicted seconds stay within (1 + slack) × a plain step's, one more slot
    would exceed it, the slots kept are those of highest survival (the product of the margins along a row), each row a
    prefix of its draft. Control: a slack that covers every slot keeps them all."""
    margins = [np.array([0.9, 0.9, 0.2]), np.zeros(0), np.array([0.95, 0.1]), np.array([0.5, 0.5])]
    survival = sorted(((-float(s), k, r) for r, m in enumerate(margins) for k, s in enumerate(np.cumprod(m))))
    for slack in (0.0, 0.1, 0.25, 0.3, 0.55):
        cap = StepTimeCap(_linear_cost(0.1), slack=slack)  # a slot costs 10% of a plain step
        keep = cap(margins, _load(4))
        n = sum(keep)
        assert 1.0 + 0.1 * n <= 1.0 + slack + 1e-12 < 1.0 + 0.1 * (n + 1), (slack, keep)
        top = [0, 0, 0, 0]
        for _, k, r in survival[:n]:
            top[r] = max(top[r], k + 1)
        assert keep == top, (slack, keep)
        assert all(k <= m.size for k, m in zip(keep, margins))
    assert keep == [2, 0, 1, 2]  # slack 0.55: 5 slots, by survival 0.95, 0.9, 0.81, 0.5, 0.25
    assert StepTimeCap(_linear_cost(0.1), slack=0.75)(margins, _load(4)) == [3, 0, 2, 2]  # 7 slots fit: all


def test_the_step_time_cap_refuses_bad_settings():
    for bad in (-0.1, float("inf"), float("nan"), True, "0.1"):
        with pytest.raises(ValueError, match="slack must be a finite number"):
            StepTimeCap(_linear_cost(0.1), slack=bad)
    with pytest.raises(ValueError, match="needs the step's cost"):
        StepTimeCap(None)
