"""Monte Carlo test of the real exact sampler against the exact law.

Each scenario runs 200,000 independent cycles of the real function, as the decoders run it: 20,000 cycles at a time
as the rows of one :func:`learn2draft.sampling.speculative_sample_rows` call (what a batched step runs;
:func:`~learn2draft.sampling.speculative_sample` is its one-row call, drawing the same, ``tests/test_sampling.py``).
Draft tokens are drawn from q (position-indexed tables, so they can be drawn up front, vectorised, from a separate
generator), then the sampler accepts a prefix and emits one token; a point-mass scenario also runs with q None (prompt
lookup's form). The emitted tuple
(x_1..x_τ, y) is compared with its exact law, enumerated in float64 by ``helpers_law.cycle_law``
from the exact rule applied to the very same float32 probabilities, by a chi-square
goodness-of-fit test (scipy.stats.chisquare).

Tolerance, and why: the test fails when the p-value is below 1e-3. Seeds are fixed, so the
outcome is deterministic: a correct sampler passes unless this particular seed was unlucky (a
1-in-1,000 event per scenario, which would show the first time the test runs, not intermittently).
Power: outcomes with expected count < 5 are merged into one bin, leaving K bins. A sampler whose
law is at total-variation distance TV from the exact one shifts the statistic by a noncentrality
λ = n Σ (f − f₀)² / f₀ ≥ n (2 TV)² (Cauchy–Schwarz), i.e. λ ≥ 80 for TV = 0.01 and n = 200,000;
``test_power_of_the_chi_square_test`` checks with the noncentral chi-square that this gives a
failure probability above 0.99 for the bin counts used here. The wrong rule (resample from p after a
rejection, from ``eval.law``) is run through the same test and must fail it.
"""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest
import torch
from helpers_law import EXAMPLE_P, EXAMPLE_Q, cycle_law, fixed_depth
from scipy.stats import chi2, chisquare, ncx2

from eval.law import LEVIATHAN_RULE, resample_from_target_rule, rule_sampler
from learn2draft.sampling import speculative_sample_rows

N_TRIALS = 200_000
P_MIN = 1e-3  # p-value threshold, see the module docstring
MIN_EXPECTED = 5.0


def example_tables(gamma: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    p = torch.tensor(np.tile(EXAMPLE_P, (gamma + 1, 1)), dtype=torch.float32)
    q = torch.tensor(np.tile(EXAMPLE_Q, (gamma, 1)), dtype=torch.float32)
    return p, q


def random_tables(V: int, gamma: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Random float32 p (γ+1, V) and q (γ, V) with some exact zeros (both kinds of edge case)."""
    rng = np.random.default_rng(seed)

    def rows(n):
        w = rng.dirichlet(np.full(V, 0.8), size=n)
        w[rng.random((n, V)) < 0.25] = 0.0
        w[np.arange(n), rng.integers(V, size=n)] += 0.05  # every row keeps some mass
        return torch.tensor(w / w.sum(1, keepdims=True), dtype=torch.float32)

    return rows(gamma + 1), rows(gamma)


def exact_cycle_law(p: torch.Tensor, q: torch.Tensor) -> dict[tuple, float]:
    """Exact law of one cycle's emitted tuple for position-indexed tables (the float32 values, in float64)."""
    P, Q = p.double().numpy(), q.double().numpy()
    P, Q = P / P.sum(1, keepdims=True), Q / Q.sum(1, keepdims=True)
    gamma = Q.shape[0]
    return cycle_law(LEVIATHAN_RULE, lambda s: P[len(s)], lambda s: Q[len(s)], fixed_depth(gamma))


def run_trials_rows(p: torch.Tensor, q: torch.Tensor, n: int, seed: int, point_mass: bool = False,
                    chunk: int = 20_000) -> Counter:
    """n cycles of :func:`speculative_sample_rows`, ``chunk`` cycles as the rows of one call (each row its own
    uniforms from one generator); draft tokens drawn from q with their own generator, as :func:`run_trials`.
    ``point_mass``: q is passed as None (its rows must be one-hot). Returns emitted-tuple counts."""
    gamma = q.shape[0]
    g_draft = torch.Generator().manual_seed(10_000 + seed)
    drafts = torch.stack([torch.multinomial(q[i], n, replacement=True, generator=g_draft) for i in range(gamma)], 1) \
        if gamma else torch.zeros(n, 0, dtype=torch.long)
    lists = drafts.tolist()
    g = torch.Generator().manual_seed(seed)
    counts: Counter = Counter()
    for a in range(0, n, chunk):
        k = min(chunk, n - a)
        u = torch.rand(k * (gamma + 1), generator=g, dtype=torch.float64)
        taus, ys = speculative_sample_rows(p.repeat(k, 1), None if point_mass else q.repeat(k, 1),
                                           drafts[a : a + k].reshape(-1), [gamma] * k, u)
        for t, (tau, y) in enumerate(zip(taus, ys)):
            counts[(*lists[a + t][:tau], y)] += 1
    return counts


def run_trials(sampler, p: torch.Tensor, q: torch.Tensor, n: int, seed: int) -> Counter:
    """n cycles of ``sampler``; draft tokens drawn from q with their own generator. Returns emitted-tuple counts."""
    gamma = q.shape[0]
    g_draft = torch.Generator().manual_seed(10_000 + seed)
    drafts = torch.stack([torch.multinomial(q[i], n, replacement=True, generator=g_draft) for i in range(gamma)], 1) \
        if gamma else torch.zeros(n, 0, dtype=torch.long)
    rows, lists = drafts.contiguous().unbind(0), drafts.tolist()
    g = torch.Generator().manual_seed(seed)
    counts: Counter = Counter()
    for t in range(n):
        tau, y = sampler(p, q, rows[t], g)
        counts[(*lists[t][:tau], y)] += 1
    return counts


def goodness_of_fit(counts: Counter, law: dict[tuple, float]) -> tuple[float, int, int]:
    """Chi-square GOF of observed emitted tuples against the exact law, outcomes with expected
    count < 5 merged into one bin (itself merged into the smallest bin if still < 5).

    Returns:
        (p-value, bins, observations of outcomes the exact law gives probability 0).
    """
    n = sum(counts.values())
    impossible = sum(c for k, c in counts.items() if law.get(k, 0.0) == 0.0)
    obs, exp = [], []
    rare_o = rare_e = 0.0
    for k, pr in law.items():
        if pr * n >= MIN_EXPECTED:
            obs.append(counts.get(k, 0))
            exp.append(pr * n)
        else:
            rare_o += counts.get(k, 0)
            rare_e += pr * n
    if rare_e >= MIN_EXPECTED or (rare_e > 0 and not obs):
        obs.append(rare_o)
        exp.append(rare_e)
    elif rare_e > 0:  # too small on its own: into the smallest bin (Cochran's rule)
        j = int(np.argmin(exp))
        obs[j] += rare_o
        exp[j] += rare_e
    obs, exp = np.array(obs, float), np.array(exp)
    exp *= obs.sum() / exp.sum()  # same total (differs only if impossible outcomes were observed)
    return float(chisquare(obs, exp).pvalue), len(obs), impossible


def point_mass_tables(V: int, gamma: int, seed: int, zero_first: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """A deterministic drafter's q (prompt lookup): one-hot rows; with ``zero_first`` the first proposal has p = 0
    (always rejected), else it is p's most likely token (often accepted, and the residual after its rejection must
    drop it)."""
    p, _ = random_tables(V, gamma, seed)
    q = torch.zeros(gamma, V)
    for i in range(gamma):
        zero = (p[i] == 0).nonzero()
        if i == 0 and zero_first and zero.numel():
            tok = int(zero[0, 0])
        else:
            tok = int(p[i].argmax()) if i % 2 or not zero_first else (i * 3) % V
        q[i, tok] = 1.0
    return p, q


def draft_vocab_tables(V: int, gamma: int, seed: int, keep: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A head's q: zero outside a draft vocabulary (tokens 0..keep−1), where p has mass."""
    p, q = random_tables(V, gamma, seed)
    q[:, keep:] = 0.0
    q[:, 0] += 0.05
    q /= q.sum(1, keepdim=True)
    assert (p[:, keep:].sum(1) > 0).all()
    return p, q


SCENARIOS = {
    "example γ=1": lambda: example_tables(1),
    "point mass V=6 γ=3": lambda: point_mass_tables(6, 3, seed=3),
    "point mass accepted V=6 γ=3": lambda: point_mass_tables(6, 3, seed=5, zero_first=False),
    "draft vocabulary V=6 γ=2": lambda: draft_vocab_tables(6, 2, seed=4, keep=3),
    "random V=6 γ=1": lambda: random_tables(6, 1, seed=1),
    "random V=5 γ=4": lambda: random_tables(5, 4, seed=2),
}


@pytest.mark.parametrize("name,point_mass", [(n, False) for n in SCENARIOS] + [("point mass V=6 γ=3", True),
                                                                                  ("point mass accepted V=6 γ=3", True)])
def test_speculative_sample_matches_exact_law(name, point_mass):
    p, q = SCENARIOS[name]()
    law = exact_cycle_law(p, q)
    counts = run_trials_rows(p, q, N_TRIALS, seed=123, point_mass=point_mass)
    pval, bins, impossible = goodness_of_fit(counts, law)
    assert impossible == 0, "emitted an outcome of exact probability 0 (e.g. a token with p(x) = 0)"
    assert pval >= P_MIN, f"{name}: chi-square p = {pval:.2e} over {bins} bins"
    # and the marginal law of the first emitted token is the target's p_0, exactly what the loop relies on
    first = np.zeros(p.shape[1])
    for k, c in counts.items():
        first[k[0]] += c
    exp = p[0].double().numpy() / float(p[0].double().sum()) * N_TRIALS
    keep = exp > 0
    assert first[~keep].sum() == 0
    assert chisquare(first[keep], exp[keep]).pvalue >= P_MIN


@pytest.mark.parametrize("name", ["example γ=1", "random V=5 γ=4"])
def test_wrong_rule_fails_the_same_test(name):
    p, q = SCENARIOS[name]()
    counts = run_trials(resample_from_target_rule, p, q, N_TRIALS, seed=123)
    pval, _, _ = goodness_of_fit(counts, exact_cycle_law(p, q))
    assert pval < P_MIN
    if name == "example γ=1":  # the first emitted token follows (0.35, 0.39, 0.26), not p
        first = np.zeros(3)
        for k, c in counts.items():
            first[k[0]] += c
        # σ ≤ 0.0011 per entry at n = 200,000, so 0.005 is > 4.5 σ; p itself is 0.15 away
        np.testing.assert_allclose(first / N_TRIALS, [0.35, 0.39, 0.26], atol=0.005)


def test_rule_sampler_of_the_exact_rule_passes():
    """The machinery that builds the wrong sampler is itself sound: built from the exact rule it
    passes, so the failure above is the rule's, not the harness's."""
    p, q = example_tables(1)
    counts = run_trials(rule_sampler(LEVIATHAN_RULE), p, q, N_TRIALS, seed=7)
    pval, _, impossible = goodness_of_fit(counts, exact_cycle_law(p, q))
    assert impossible == 0 and pval >= P_MIN


def test_power_of_the_chi_square_test():
    """A law at TV = 0.01 from the exact one is rejected with probability > 0.99 by the test above
    (noncentral chi-square with λ = n (2 TV)², the smallest noncentrality such a law can have),
    for every bin count the scenarios produce."""
    lam = N_TRIALS * (2 * 0.01) ** 2
    for name, make in SCENARIOS.items():
        law = exact_cycle_law(*make())
        bins = sum(pr * N_TRIALS >= MIN_EXPECTED for pr in law.values()) + 1  # at most: rare bin kept
        crit = chi2.isf(P_MIN, bins - 1)
        assert ncx2.sf(crit, bins - 1, lam) > 0.99, (name, bins)
