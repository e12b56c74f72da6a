"""Exact output law of *tree* speculative decoding by enumeration (float64, no sampling).

One cycle, after a committed prefix:

1. the draft tree is built EAGLE-2 style with :class:`learn2draft.tree.DraftTree` (the engine's
   own :meth:`~DraftTree.frontier` / :meth:`~DraftTree.expand`): before each depth a *depth
   policy* says CONTINUE or STOP; the W best nodes of the deepest level get their top-k children
   under the draft table q (deterministic: ties by token id);
2. a *size policy* picks V, and :func:`learn2draft.tree.select_top_nodes` keeps the top-V nodes;
3. an acceptance rule is enumerated branch by branch. For the engine's rule, the enumeration
   runs the engine's own walk (``learn2draft.sampling._tree_walk``, the decision code of
   :func:`~learn2draft.sampling.tree_speculative_sample`) with an *oracle* in place of its
   uniforms: every acceptance test is answered both ways, each answer weighted by its
   probability, and the emitted token's law is the node's row with the rejected tokens zeroed —
   as the sampler draws it.

Both policies read only draft-side information (the tree: scores, depths, tokens), which is what
keeps the law; :func:`tree_speculative_law` then chains cycles to the first ``length`` tokens and
compares with ``helpers_law.target_law``.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable
from functools import cache

import numpy as np
import torch

from learn2draft.sampling import _inverse_cdf, _tree_walk
from learn2draft.tree import DraftTree, select_top_nodes

Dist = Callable[[tuple], np.ndarray]
#: ``depth_policy(tree) -> bool``: expand one more level? ``size_policy(tree) -> int``: V.
DepthPolicy = Callable[[DraftTree], bool]
SizePolicy = Callable[[DraftTree], int]
#: ``rule(tree, p_rows, q_rows) -> [(probability, accepted nodes, law of the emitted token)]``.
TreeRule = Callable[[DraftTree, list, list], list]


def enumerate_bernoulli(run: Callable[[Callable[[int, float, float], bool]], object]) -> list[tuple[float, object]]:
    """Every outcome of ``run(bernoulli)`` with its probability, where ``bernoulli(i, num, den)`` is
    True with probability min(1, num / den) (1 when den ≤ 0 < num, 0 when num ≤ 0), the answers
    being independent. ``run`` is re-run once per branch (depth-first over the answers)."""
    out, stack = [], [[]]
    while stack:
        script = stack.pop()
        answers: list[bool] = []
        weight = [1.0]

        def bern(i, num, den, script=script, answers=answers, weight=weight):
            a = (1.0 if num > 0 else 0.0) if den <= 0 else min(1.0, max(num, 0.0) / den)
            k = len(answers)
            if k < len(script):
                ans = script[k]
            elif a == 0.0 or a == 1.0:
                ans = a == 1.0
            else:
                ans = True
                stack.append(answers + [False])
            answers.append(ans)
            weight[0] *= a if ans else 1.0 - a
            return ans

        res = run(bern)
        if weight[0] > 0:
            out.append((weight[0], res))
    return out


def exact_rule(tree: DraftTree, p_rows: list, q_rows: list) -> list:
    """The engine's rule (point-mass recursive rejection), enumerated through its own walk."""
    children, toks = tree.children(), tree.tokens.tolist()
    par = tree.parents.tolist()
    px = [0.0] + [float(p_rows[par[c]][toks[c]]) for c in range(1, len(toks))]

    def run(bern):
        return _tree_walk(children, toks, px, lambda i: float(p_rows[i].sum()), bern)

    out = []
    for w, (accepted, node, rejected, last_positive) in enumerate_bernoulli(run):
        r = p_rows[node].copy()
        r[rejected] = 0.0
        if r.sum() <= 0:  # the sampler's Z = 0 rule
            r = np.zeros_like(r)
            r[last_positive] = 1.0
        out.append((w, accepted, r / r.sum()))
    return out


def q_ratio_rule(tree: DraftTree, p_rows: list, q_rows: list) -> list:
    """NEGATIVE CONTROL — SpecInfer's multi-candidate rule (Miao et al. 2024) applied to
    deterministic top-k children: accept child x with min(1, p_res(x) / q(x)); on rejection
    p_res ← norm(max(p_res − q, 0)). Exact only for children sampled i.i.d. from q; biased here."""
    children, toks = tree.children(), tree.tokens.tolist()

    def run(bern):
        node, accepted = 0, []
        while True:
            res = p_rows[node] / p_rows[node].sum()
            for c in children[node]:
                x = toks[c]
                if bern(c, float(res[x]), float(q_rows[node][x])):
                    accepted.append(c)
                    node = c
                    break
                r = np.maximum(res - q_rows[node], 0.0)
                res = r / r.sum() if r.sum() > 0 else res
            else:
                return accepted, res

    return [(w, acc, dist) for w, (acc, dist) in enumerate_bernoulli(run)]


def build_tree(q: Dist, prefix: tuple, width: int, k: int, depth_policy: DepthPolicy) -> DraftTree:
    """EAGLE-2 drafting over the draft table q: expand the ``width`` best deepest nodes with their
    top-``k`` children (ties by token id) while ``depth_policy`` says CONTINUE."""
    tree = DraftTree.root(prefix[-1] if prefix else -1)
    while depth_policy(tree):
        fr = tree.frontier(width)
        toks, lps = [], []
        for i in fr.tolist():
            row = q(prefix + tuple(tree.path_tokens(i)))
            top = np.argsort(-row, kind="stable")[:k]
            toks.append(top)
            with np.errstate(divide="ignore"):
                lps.append(np.log(row[top]))
        tree = tree.expand(fr, np.array(toks), np.array(lps))
    return tree


def tree_cycle_law(rule: TreeRule, p: Dist, q: Dist, width: int, k: int, depth_policy: DepthPolicy,
                   size_policy: SizePolicy, prefix: tuple = ()) -> dict[tuple, float]:
    """Exact law of the tokens one tree cycle emits after ``prefix`` (accepted path + next token)."""
    tree = build_tree(q, prefix, width, k, depth_policy)
    sub = tree.subtree(select_top_nodes(tree, size_policy(tree)))
    paths = [prefix + tuple(sub.path_tokens(i)) for i in range(sub.num_nodes + 1)]
    p_rows, q_rows = [p(s) for s in paths], [q(s) for s in paths]
    toks = sub.tokens.tolist()
    out: dict[tuple, float] = defaultdict(float)
    for w, accepted, dist in rule(sub, p_rows, q_rows):
        emitted = tuple(toks[a] for a in accepted)
        for y in np.flatnonzero(dist > 0):
            out[emitted + (int(y),)] += w * float(dist[y])
    return dict(out)


def tree_speculative_law(rule: TreeRule, p: Dist, q: Dist, width: int, k: int, depth_policy: DepthPolicy,
                         size_policy: SizePolicy, length: int) -> dict[tuple, float]:
    """Exact law of the first ``length`` emitted tokens over repeated tree cycles (excess cut)."""

    @cache
    def law_from(prefix: tuple) -> tuple[tuple[tuple, float], ...]:
        acc: dict[tuple, float] = defaultdict(float)
        for emitted, pe in tree_cycle_law(rule, p, q, width, k, depth_policy, size_policy, prefix).items():
            seq = prefix + emitted
            if len(seq) >= length:
                acc[seq[:length]] += pe
            else:
                for full, pf in law_from(seq):
                    acc[full] += pe * pf
        return tuple(acc.items())

    return dict(law_from(()))


def unnormalised_tree_sampler(parents, tokens, probs, g):
    """WRONG (negative control): accepts child x with p(x), not p(x) / (1 − the rejected siblings' mass)."""
    par, tok = parents.tolist(), tokens.tolist()
    children = [[] for _ in par]
    for i in range(1, len(par)):
        children[par[i]].append(i)
    px = [0.0] + [float(probs[par[i], tok[i]]) for i in range(1, len(par))]
    u = torch.rand(len(par), generator=g, dtype=torch.float64).tolist()
    acc, node, rej, _ = _tree_walk(children, tok, px, lambda i: 1.0, lambda i, num, den: u[i] < num)
    r = probs[node].clone()
    r[rej] = 0
    return acc, _inverse_cdf(r, u[0])
