"""Exact output law of speculative decoding by enumeration (no sampling), for tiny vocabularies.

The harness takes the acceptance rule as data (:class:`eval.law.AcceptanceRule`: acceptance
probability and correction law), enumerates every draft outcome and every accept/reject branch
of every cycle with its probability in float64, and returns the exact distribution of the first
``length`` emitted tokens. The target's law is the product of the target's conditionals; for the
exact rule the two agree to rounding (≈1e-16), whatever the drafting policy, as long as the policy
decides before each draw.

Chains are given as functions ``prefix (tuple of ints) -> float64 (V,)`` for the target (p) and
the draft (q); :class:`RandomChain` builds prefix-dependent random tables with exact zeros.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable
from functools import cache

import numpy as np

from eval.law import AcceptanceRule

Dist = Callable[[tuple], np.ndarray]
#: ``policy(prefix, drafted) -> bool``: draft one more token? Sees only tokens already drawn.
Policy = Callable[[tuple, tuple], bool]

EXAMPLE_P = np.array([0.5, 0.3, 0.2])
EXAMPLE_Q = np.array([0.2, 0.5, 0.3])
#: The wrong rule's law on the example: min(p, q) + (1 − Σ min(p, q)) · p = (0.2, 0.3, 0.2) + 0.3 · p.
EXAMPLE_WRONG_LAW = np.array([0.35, 0.39, 0.26])


def fixed_depth(gamma: int) -> Policy:
    """Always draft γ tokens."""
    return lambda prefix, drafted: len(drafted) < gamma


def stop_after_token(token: int, max_depth: int) -> Policy:
    """Draft until the last drafted token is ``token`` (or ``max_depth`` tokens): a stopping rule
    that depends on the values already drawn (allowed: the decision precedes the next draw)."""
    return lambda prefix, drafted: len(drafted) < max_depth and (not drafted or drafted[-1] != token)


def cycle_law(rule: AcceptanceRule, p: Dist, q: Dist, policy: Policy, prefix: tuple = (),
              peek: Policy | None = None) -> dict[tuple, float]:
    """Exact law of the tokens one cycle emits after ``prefix``.

    Enumerates every drafted chain (x_1, …, x_d) — d chosen by ``policy`` before each draw — with
    probability Π q(x_i | prefix, x_<i), then every branch of the rule: rejection at i (probability
    Π_{j<i} a_j · (1 − a_i), emitting x_<i then y ~ correction(p_i, q_i)) or acceptance of all d
    (emitting x_1..x_d then y ~ p_{d+1}).

    ``peek`` is a deliberately *illegal* policy for negative controls: after each draw,
    ``peek(prefix, drafted)`` True means "drop the token just drawn from verification and stop" —
    a decision taken after looking at the token's value, which the law invariant forbids.

    Returns:
        emitted tuple → probability (float64), summing to 1.
    """
    out: dict[tuple, float] = defaultdict(float)
    # A draft whose law depends on the cycle (a hybrid drafter whose source is chosen per step) reads
    # (prefix, drafted) rather than the concatenated sequence.
    q_at = (lambda d: q(prefix, d)) if getattr(q, "reads_cycle", False) else (lambda d: q(prefix + d))

    def branches(drafted: tuple, prob: float) -> None:
        reach = prob
        for i, x in enumerate(drafted):
            ctx = prefix + drafted[:i]
            pi, qi = p(ctx), q_at(drafted[:i])
            a = rule.accept_probability(float(pi[x]), float(qi[x]))
            rej = reach * (1.0 - a)
            if rej > 0:
                r = rule.correction(pi, qi)
                for y in np.flatnonzero(r > 0):
                    out[drafted[:i] + (int(y),)] += rej * float(r[y])
            reach *= a
            if reach == 0:
                return
        pb = p(prefix + drafted)
        for y in np.flatnonzero(pb > 0):
            out[drafted + (int(y),)] += reach * float(pb[y])

    def draft(drafted: tuple, prob: float) -> None:
        if policy(prefix, drafted):
            qd = q_at(drafted)
            for x in np.flatnonzero(qd > 0):
                nxt = drafted + (int(x),)
                if peek is not None and peek(prefix, nxt):
                    branches(drafted, prob * float(qd[x]))
                else:
                    draft(nxt, prob * float(qd[x]))
        else:
            branches(drafted, prob)

    draft((), 1.0)
    return dict(out)


def speculative_law(rule: AcceptanceRule, p: Dist, q: Dist, policy: Policy, length: int,
                    peek: Policy | None = None) -> dict[tuple, float]:
    """Exact law of the first ``length`` tokens emitted by repeated cycles (a cycle may overshoot:
    the excess is cut, which gives the marginal of the first ``length`` tokens).

    Returns:
        sequence (tuple of ``length`` ints) → probability.
    """

    @cache
    def law_from(prefix: tuple) -> tuple[tuple[tuple, float], ...]:
        acc: dict[tuple, float] = defaultdict(float)
        for emitted, pe in cycle_law(rule, p, q, policy, prefix, peek).items():
            seq = prefix + emitted
            if len(seq) >= length:
                acc[seq[:length]] += pe
            else:
                for full, pf in law_from(seq):
                    acc[full] += pe * pf
        return tuple(acc.items())

    return dict(law_from(()))


def target_law(p: Dist, V: int, length: int) -> dict[tuple, float]:
    """Law of ``length`` tokens drawn autoregressively from p: Π p(s_t | s_<t)."""
    law = {(): 1.0}
    for _ in range(length):
        nxt: dict[tuple, float] = {}
        for s, ps in law.items():
            row = p(s)
            for y in np.flatnonzero(row > 0):
                nxt[s + (int(y),)] = ps * float(row[y])
        law = nxt
    return law


def max_abs_difference(a: dict[tuple, float], b: dict[tuple, float]) -> float:
    """max over all keys of |a − b| (missing keys count as 0)."""
    return max(abs(a.get(k, 0.0) - b.get(k, 0.0)) for k in set(a) | set(b))


def check_law(rule: AcceptanceRule, p: Dist, q: Dist, policy: Policy, V: int, length: int,
              tol: float = 1e-12, peek: Policy | None = None) -> tuple[bool, float]:
    """Does speculative decoding with ``rule`` emit the target's law of the first ``length`` tokens?

    Returns:
        ``(ok, max_abs_error)`` with ok = max_abs_error ≤ tol.
    """
    err = max_abs_difference(speculative_law(rule, p, q, policy, length, peek), target_law(p, V, length))
    return err <= tol, err


class RandomChain:
    """Prefix-dependent random next-token tables for a target and a draft over V tokens.

    ``p(prefix)`` and ``q(prefix)`` are Dirichlet(0.7) draws seeded by (seed, role, prefix) — so
    deterministic and different for every prefix — with each entry zeroed with probability
    ``zero_frac`` (at least one entry kept). The zeros make the cases q(x) = 0 < p(x) (never
    proposed, reachable through the residual) and p(x) = 0 < q(x) (always rejected) common.
    Returned arrays are float64 (V,), summing to 1; do not modify them.
    """

    def __init__(self, V: int, seed: int, zero_frac: float = 0.3):
        self.V, self.seed, self.zero_frac = V, seed, zero_frac
        self._cache: dict[tuple, np.ndarray] = {}

    def _row(self, role: int, prefix: tuple) -> np.ndarray:
        key = (role, prefix)
        if key not in self._cache:
            rng = np.random.default_rng([self.seed, role, len(prefix), *prefix])
            w = rng.dirichlet(np.full(self.V, 0.7))
            w[rng.random(self.V) < self.zero_frac] = 0.0
            if w.sum() == 0:
                w[rng.integers(self.V)] = 1.0
            self._cache[key] = w / w.sum()
        return self._cache[key]

    def p(self, prefix: tuple) -> np.ndarray:
        return self._row(0, prefix)

    def q(self, prefix: tuple) -> np.ndarray:
        return self._row(1, prefix)
