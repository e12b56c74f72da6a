"""Exact output law of speculative decoding by enumeration (float64, no sampling).

For tiny vocabularies (3–8 tokens), depths up to 3 and prefix-dependent random target/draft
tables, the harness in ``helpers_law`` enumerates every draft chain and every accept/reject branch
and computes the exact law of the first N emitted tokens. With the exact rule it must equal the
target's autoregressive law within 1e-12 (the sums have at most a few thousand float64 terms of
size ≤ 1, so rounding error is ~1e-16; 1e-12 leaves four orders of margin, while the wrong rule is
off by ≥ 1e-2 on every case here). The negative control — the wrong rule, taken from
``eval.law`` — must fail the same check.
"""

from __future__ import annotations

import numpy as np
import pytest
from helpers_law import (
    EXAMPLE_P,
    EXAMPLE_Q,
    EXAMPLE_WRONG_LAW,
    RandomChain,
    check_law,
    cycle_law,
    fixed_depth,
    speculative_law,
    stop_after_token,
    target_law,
)

from eval.law import LEVIATHAN_RULE, RESAMPLE_FROM_TARGET_RULE

TOL = 1e-12


def const(row: np.ndarray):
    return lambda prefix: row


def first_token_law(law: dict[tuple, float], V: int) -> np.ndarray:
    out = np.zeros(V)
    for seq, pr in law.items():
        out[seq[0]] += pr
    return out


# ---------------------------------------------------------------- the three-symbol example
def test_example_exact_rule_gives_p():
    law = speculative_law(LEVIATHAN_RULE, const(EXAMPLE_P), const(EXAMPLE_Q), fixed_depth(1), length=1)
    np.testing.assert_allclose(first_token_law(law, 3), EXAMPLE_P, rtol=0, atol=TOL)
    ok, err = check_law(LEVIATHAN_RULE, const(EXAMPLE_P), const(EXAMPLE_Q), fixed_depth(1), V=3, length=1)
    assert ok and err <= TOL


def test_example_wrong_rule_gives_035_039_026_and_fails_the_check():
    law = speculative_law(RESAMPLE_FROM_TARGET_RULE, const(EXAMPLE_P), const(EXAMPLE_Q), fixed_depth(1), length=1)
    np.testing.assert_allclose(first_token_law(law, 3), [0.35, 0.39, 0.26], rtol=0, atol=TOL)
    np.testing.assert_allclose(first_token_law(law, 3), EXAMPLE_WRONG_LAW, rtol=0, atol=TOL)  # the helpers' constant
    ok, err = check_law(RESAMPLE_FROM_TARGET_RULE, const(EXAMPLE_P), const(EXAMPLE_Q), fixed_depth(1), V=3, length=1)
    assert not ok
    assert err == pytest.approx(0.15, abs=TOL)  # |0.35 − 0.5|


def test_example_branch_probabilities():
    """One cycle at γ = 1: accepted x then a bonus from p, or a rejection then the residual (1, 0, 0)."""
    law = cycle_law(LEVIATHAN_RULE, const(EXAMPLE_P), const(EXAMPLE_Q), fixed_depth(1))
    # Rejection happens with probability 1 − Σ min(p, q) = 0.3 and the residual is all on token 0.
    assert law[(0,)] == pytest.approx(0.3, abs=TOL)
    assert (1,) not in law and (2,) not in law
    # Accepted x with probability min(p, q)(x) = (0.2, 0.3, 0.2), then the bonus y ~ p.
    for x, m in enumerate([0.2, 0.3, 0.2]):
        for y in range(3):
            assert law[(x, y)] == pytest.approx(m * EXAMPLE_P[y], abs=TOL)
    assert sum(law.values()) == pytest.approx(1.0, abs=TOL)


# ------------------------------------------------------------- prefix-dependent random chains
CASES = [  # (V, max depth γ, emitted length N, seed)
    (3, 1, 4, 0),
    (3, 2, 4, 1),
    (3, 3, 4, 2),
    (4, 3, 4, 3),
    (5, 2, 3, 4),
    (6, 3, 3, 5),
    (8, 1, 3, 6),
    (8, 3, 2, 7),
]


@pytest.mark.parametrize("V,gamma,N,seed", CASES)
@pytest.mark.parametrize("policy_name", ["fixed", "stop_after_0"])
def test_exact_rule_emits_target_law(V, gamma, N, seed, policy_name):
    chain = RandomChain(V, seed)
    policy = fixed_depth(gamma) if policy_name == "fixed" else stop_after_token(0, gamma)
    law = speculative_law(LEVIATHAN_RULE, chain.p, chain.q, policy, N)
    assert sum(law.values()) == pytest.approx(1.0, abs=TOL)
    assert all(len(s) == N for s in law)
    ok, err = check_law(LEVIATHAN_RULE, chain.p, chain.q, policy, V, N)
    assert ok, f"max |speculative − target| = {err:.3g} > {TOL}"


@pytest.mark.parametrize("V,gamma,N,seed", CASES)
def test_wrong_rule_is_caught(V, gamma, N, seed):
    chain = RandomChain(V, seed)
    ok, err = check_law(RESAMPLE_FROM_TARGET_RULE, chain.p, chain.q, stop_after_token(0, gamma), V, N)
    assert not ok and err > 1e-3


def test_chains_exercise_the_edge_cases():
    """The random tables do contain q(x) = 0 < p(x) and p(x) = 0 < q(x) (otherwise the cases above
    would not test the residual's reach or the forced rejections)."""
    chain = RandomChain(5, 4)
    prefixes = [(), (0,), (1,), (2, 3), (4, 4)]
    assert any(((chain.q(s) == 0) & (chain.p(s) > 0)).any() for s in prefixes)
    assert any(((chain.p(s) == 0) & (chain.q(s) > 0)).any() for s in prefixes)


def test_token_with_zero_draft_probability_is_reached_through_the_residual():
    p, q = np.array([0.6, 0.4, 0.0]), np.array([0.0, 0.5, 0.5])
    law = cycle_law(LEVIATHAN_RULE, const(p), const(q), fixed_depth(1))
    # token 0 is never proposed (q = 0) but is emitted first with probability p(0) = 0.6
    assert first_token_law(law, 3)[0] == pytest.approx(0.6, abs=TOL)
    # token 2 has p = 0 < q: proposed half the time, always rejected, never emitted
    assert first_token_law(law, 3)[2] == 0.0


def test_identical_draft_accepts_everything():
    chain = RandomChain(4, 9)
    law = cycle_law(LEVIATHAN_RULE, chain.p, chain.p, fixed_depth(3))
    assert all(len(s) == 4 for s in law)  # γ accepted + bonus, no rejection branch has mass
    assert max(abs(a - b) for a, b in zip(
        sorted(law.values()), sorted(target_law(chain.p, 4, 4).values()))) <= TOL


def test_peeking_policy_breaks_the_law():
    """Negative control for the second way to break the law: dropping a drawn token from
    verification after looking at its value (here: never verify a drafted 0) biases the output
    even with the exact rule — and the harness sees it."""
    chain = RandomChain(4, 11)
    ok, err = check_law(LEVIATHAN_RULE, chain.p, chain.q, fixed_depth(3), V=4, length=3,
                        peek=lambda prefix, drafted: drafted[-1] == 0)
    assert not ok and err > 1e-3


# ------------------------------------------------- the q shapes of the new drafters (lookup, head)
class PointMassDraft:
    """A deterministic drafter (prompt lookup): the proposal is a function of the prefix, q a point
    mass on it. Some proposals have p = 0 (always rejected), some the target's most likely token."""

    def __init__(self, chain: RandomChain):
        self.chain = chain

    def token(self, prefix: tuple) -> int:
        rng = np.random.default_rng([99, len(prefix), *prefix])
        return int(rng.integers(self.chain.V))

    def q(self, prefix: tuple) -> np.ndarray:
        row = np.zeros(self.chain.V)
        row[self.token(prefix)] = 1.0
        return row


def draft_vocab_q(chain: RandomChain, keep: int):
    """A head's q: the draft's law restricted to a draft vocabulary (tokens 0..keep−1), renormalised;
    zero outside it, where the target may well put mass."""

    def q(prefix: tuple) -> np.ndarray:
        row = chain.q(prefix).copy()
        row[keep:] = 0.0
        if row.sum() == 0:
            row[:keep] = 1.0
        return row / row.sum()

    return q


@pytest.mark.parametrize("V,gamma,N,seed", CASES[:6])
def test_point_mass_draft_keeps_the_target_law(V, gamma, N, seed):
    chain = RandomChain(V, seed)
    draft = PointMassDraft(chain)
    # A deterministic proposal may be looked at before deciding (nothing random is drawn): stop
    # before proposing token 0, as a lookup policy reading its match would.
    looking = lambda prefix, drafted: len(drafted) < gamma and draft.token(prefix + drafted) != 0  # noqa: E731
    for policy in (fixed_depth(gamma), looking):
        ok, err = check_law(LEVIATHAN_RULE, chain.p, draft.q, policy, V, N)
        assert ok, f"max |speculative − target| = {err:.3g} > {TOL}"
    ok, err = check_law(RESAMPLE_FROM_TARGET_RULE, chain.p, draft.q, fixed_depth(gamma), V, N)
    assert not ok and err > 1e-3


@pytest.mark.parametrize("V,gamma,N,seed", [c for c in CASES if c[0] >= 4])
def test_draft_vocabulary_q_keeps_the_target_law(V, gamma, N, seed):
    chain = RandomChain(V, seed)
    q = draft_vocab_q(chain, keep=V // 2)
    assert any(q(s)[V // 2:].sum() == 0 and chain.p(s)[V // 2:].sum() > 0 for s in [(), (0,), (1,)])
    for policy in (fixed_depth(gamma), stop_after_token(0, gamma)):
        ok, err = check_law(LEVIATHAN_RULE, chain.p, q, policy, V, N)
        assert ok, f"max |speculative − target| = {err:.3g} > {TOL}"
    ok, err = check_law(RESAMPLE_FROM_TARGET_RULE, chain.p, q, stop_after_token(0, gamma), V, N)
    assert not ok and err > 1e-3
