"""Draft trees: the structure and its helpers (:mod:`learn2draft.tree`) and the exact tree sampler
(:func:`learn2draft.sampling.tree_speculative_sample`).

Exactness, by enumeration (``helpers_tree``): trees built EAGLE-2 style (width W, top-k children)
from prefix-dependent random draft tables, a depth policy and a size policy that read the tree's
scores and depth, several cycles, targets from flat to peaked to one-hot (greedy). The law of the
first N emitted tokens must equal the target's within 1e-12: the sums have at most ~10⁵ float64
terms of size ≤ 1, so rounding is ~1e-14 at worst; 1e-12 leaves two orders of margin while the
negative control (SpecInfer's q-ratio rule on deterministic children) is off by > 1e-3 on every case.

Monte Carlo (the real function, float32, V = 49,152): fixed seeds, chi-square goodness of fit
with expected counts ≥ 5 per bin, failure when p < 1e-3 — a correct sampler fails only if this
seed is a 1-in-1,000 draw, which would show on the first run, not intermittently. Power: the same
test must reject (p < 1e-6) a sampler that forgets to renormalise after a rejection.
"""

from __future__ import annotations

import math
from collections import Counter

import numpy as np
import pytest
import torch
from helpers_law import RandomChain, max_abs_difference, target_law
from helpers_tree import (
    build_tree,
    enumerate_bernoulli,
    exact_rule,
    q_ratio_rule,
    tree_cycle_law,
    tree_speculative_law,
    unnormalised_tree_sampler,
)
from scipy.stats import chisquare

from eval.law import goodness_of_fit_test
from learn2draft.sampling import _tree_walk, tree_speculative_sample
from learn2draft.tree import (
    DraftTree,
    ancestor_matrix,
    path_cache_indices,
    select_top_nodes,
    tree_attention_mask,
    tree_position_ids,
)

TOL = 1e-12


# ------------------------------------------------------------------------------------ policies
def tempered(p, T: float):
    """Target-like tables from a base table: p^(1/T) renormalised; T = 0 is one-hot on the argmax."""

    def f(prefix):
        row = p(prefix)
        if T == 0:
            out = np.zeros_like(row)
            out[int(np.argmax(row))] = 1.0
            return out
        w = np.where(row > 0, row, 0.0) ** (1.0 / T)
        return w / w.sum()

    return f


def depth_by_score(max_depth: int, threshold: float):
    """CONTINUE while the best deepest node's score is above log(threshold) (draft-side only)."""
    return lambda tree: tree.max_depth < max_depth and (
        tree.max_depth == 0 or float(tree.scores[tree.frontier(1)][0]) > math.log(threshold))


def fixed_depth(d: int):
    return lambda tree: tree.max_depth < d


def size_by_score(cap: int, threshold: float):
    """V = number of nodes with score above log(threshold), between 1 and ``cap`` (draft-side only)."""
    return lambda tree: int(min(cap, max(1, int((tree.scores[1:] > math.log(threshold)).sum()))))


def size_by_depth(per_level: int):
    return lambda tree: per_level * max(1, tree.max_depth)


CASES = [  # (V, W, k, max depth, N emitted, seed)
    (3, 1, 2, 2, 3, 0),
    (3, 2, 2, 3, 3, 1),
    (4, 2, 2, 2, 3, 2),
    (4, 2, 3, 2, 3, 3),
    (5, 2, 2, 2, 3, 4),
    (5, 1, 3, 3, 2, 5),
]
TEMPERATURES = [0.0, 0.3, 1.0, 3.0]  # one-hot, peaked, as drawn, flat


def policies(max_depth: int):
    return {
        "fixed+all": (fixed_depth(max_depth), lambda tree: tree.num_nodes),
        "score+score": (depth_by_score(max_depth, 0.25), size_by_score(5, 0.05)),
        "fixed+depth": (fixed_depth(max_depth), size_by_depth(2)),
    }


# ------------------------------------------------------------------------------- exactness
@pytest.mark.parametrize("V,W,k,D,N,seed", CASES)
@pytest.mark.parametrize("T", TEMPERATURES)
def test_tree_rule_emits_the_target_law(V, W, k, D, N, seed, T):
    chain = RandomChain(V, seed)
    p = tempered(chain.p, T)
    want = target_law(p, V, N)
    for name, (dp, sp) in policies(D).items():
        law = tree_speculative_law(exact_rule, p, chain.q, W, k, dp, sp, N)
        assert sum(law.values()) == pytest.approx(1.0, abs=TOL)
        err = max_abs_difference(law, want)
        assert err <= TOL, f"{name}: max |tree − target| = {err:.3g}"


@pytest.mark.parametrize("V,W,k,D,N,seed", CASES)
def test_q_ratio_rule_on_deterministic_children_is_flagged(V, W, k, D, N, seed):
    chain = RandomChain(V, seed)
    dp, sp = policies(D)["fixed+all"]
    err = max_abs_difference(tree_speculative_law(q_ratio_rule, chain.p, chain.q, W, k, dp, sp, N),
                             target_law(chain.p, V, N))
    assert err > 1e-3


def test_enumeration_exercises_zero_probability_children_and_deep_acceptance():
    """The cases above do verify children the target gives probability 0 (always rejected), trees
    with siblings (k ≥ 2) and accepted paths longer than one — otherwise they would prove little."""
    chain = RandomChain(5, 4)
    zero_children, deep, siblings = 0, 0, 0
    for prefix in [(), (0,), (1,), (2, 3), (4, 4), (3,)]:
        tree = build_tree(chain.q, prefix, 2, 2, fixed_depth(2))
        siblings += sum(len(c) >= 2 for c in tree.children())
        for i in range(1, tree.num_nodes + 1):
            par = int(tree.parents[i])
            zero_children += chain.p(prefix + tuple(tree.path_tokens(par)))[int(tree.tokens[i])] == 0
        law = tree_cycle_law(exact_rule, chain.p, chain.q, 2, 2, fixed_depth(2), lambda t: t.num_nodes, prefix)
        deep += any(len(s) >= 3 for s in law)
    assert zero_children > 0 and deep > 0 and siblings > 0


def test_enumerate_bernoulli_probabilities():
    outs = enumerate_bernoulli(lambda b: (b(1, 0.3, 1.0), b(2, 1.0, 2.0)))
    got = {o: w for w, o in outs}
    assert got == pytest.approx({(True, True): 0.15, (True, False): 0.15, (False, True): 0.35, (False, False): 0.35})
    assert [o for _, o in enumerate_bernoulli(lambda b: b(1, 0.0, 1.0))] == [False]


# --------------------------------------------------------------------------- the sampler
def small_tree():
    """root ─ 1 (tok 0) ─ 3 (tok 2)        children of the root in index order: 1, 2
            └ 2 (tok 1) ─ 4 (tok 0)
                        └ 5 (tok 2)"""
    parents = torch.tensor([-1, 0, 0, 1, 2, 2])
    tokens = torch.tensor([-1, 0, 1, 2, 0, 2])
    return parents, tokens


def outcome_law(parents, tokens, probs: torch.Tensor) -> dict[tuple, float]:
    """Exact law of (accepted nodes, next token) of the engine's walk on these float values."""
    tree = DraftTree(parents, tokens, torch.zeros(parents.numel(), dtype=torch.float64),
                     torch.zeros(parents.numel(), dtype=torch.long))
    rows = list(probs.double().numpy())
    law: dict[tuple, float] = Counter()
    for w, acc, dist in exact_rule(tree, rows, rows):
        for y in np.flatnonzero(dist > 0):
            law[(tuple(acc), int(y))] += w * dist[y]
    return law


def test_sampler_matches_the_enumerated_law_monte_carlo():
    """The real function's (accepted, next) frequencies against the exact law of its walk (the law the
    enumeration tests prove exact), 8,000 draws, chi-square, p > 1e-3 (see the module docstring)."""
    parents, tokens = small_tree()
    rng = np.random.default_rng(0)
    probs = torch.tensor(rng.dirichlet(np.full(4, 0.8), size=6), dtype=torch.float32)
    probs[2, 0] = 0.0  # node 4's token has p = 0 in its parent's row: always rejected
    probs = probs / probs.sum(1, keepdim=True)
    law = outcome_law(parents, tokens, probs)
    g = torch.Generator().manual_seed(1)
    n = 8000
    counts = Counter()
    for _ in range(n):
        acc, y = tree_speculative_sample(parents, tokens, probs, g)
        counts[(tuple(acc), y)] += 1
    assert set(counts) <= {k for k, v in law.items() if v > 0}
    assert not any(4 in k[0] for k in counts)
    keys = sorted(law, key=lambda k: -law[k])
    exp = np.array([law[k] * n for k in keys])
    obs = np.array([counts[k] for k in keys], dtype=float)
    big = exp >= 5
    obs = np.append(obs[big], obs[~big].sum())
    exp = np.append(exp[big], exp[~big].sum())
    if exp[-1] < 5:
        obs, exp = obs[:-1], exp[:-1]
        exp *= obs.sum() / exp.sum()
    assert chisquare(obs, exp).pvalue > 1e-3


def big_case(V: int = 49_152, seed: int = 0):
    """A 64-node tree over a V-token vocabulary whose rows put 0.9 of their mass on 12 tokens (the
    children's tokens among them) and 0.1 on the rest of the vocabulary."""
    g = torch.Generator().manual_seed(seed)
    hot = torch.arange(12) * (V // 13) + 5
    parents = [-1] + [0] * 4 + [1 + (i % 4) for i in range(12)] + [5 + (i % 12) for i in range(48)]
    n1 = len(parents)
    probs = torch.rand(n1, V, generator=g) * (0.1 / V * 2)
    w = torch.rand(n1, 12, generator=g) ** 3 + 0.01
    probs[:, hot] += 0.9 * w / w.sum(1, keepdim=True)
    probs = probs / probs.sum(1, keepdim=True)
    tokens = [-1]
    for i in range(1, n1):  # siblings: distinct hot tokens in decreasing parent-row probability
        sib = [j for j in range(1, i) if parents[j] == parents[i]]
        row = probs[parents[i], hot]
        order = torch.argsort(row, descending=True).tolist()
        tokens.append(int(hot[order[len(sib)]]))
    return torch.tensor(parents), torch.tensor(tokens), probs


@pytest.mark.parametrize("sampler,ok", [(tree_speculative_sample, True), (unnormalised_tree_sampler, False)])
def test_monte_carlo_at_the_real_vocabulary_size(sampler, ok):
    """First emitted token ~ the root's row, and the second given an accepted first child ~ that
    child's row, at V = 49,152 with a 64-node tree; 6,000 draws (the tokens outside the 12 hot ones
    share one merged bin). The wrong sampler must be rejected."""
    parents, tokens, probs = big_case()
    g = torch.Generator().manual_seed(3)
    n = 6000
    first, second = [], {}
    for _ in range(n):
        acc, y = sampler(parents, tokens, probs, g)
        toks = [int(tokens[a]) for a in acc] + [y]
        first.append(toks[0])
        if acc:
            second.setdefault(acc[0], []).append(toks[1])
    res = goodness_of_fit_test(first, probs[0].double().numpy())
    tests = [res["p_value"]]
    child, sample = max(second.items(), key=lambda kv: len(kv[1]))
    assert len(sample) > 500
    tests.append(goodness_of_fit_test(sample, probs[child].double().numpy())["p_value"])
    if ok:
        assert min(tests) > 1e-3, tests
    else:
        assert min(tests) < 1e-6, tests


def test_one_hot_rows_accept_the_argmax_path():
    parents, tokens, probs = big_case(V=300, seed=1)
    n1 = parents.numel()
    arg = probs.argmax(1)
    onehot = torch.zeros_like(probs).scatter_(1, arg[:, None], 1.0)
    acc, y = tree_speculative_sample(parents, tokens, onehot, torch.Generator().manual_seed(0))
    node = 0
    for a in acc:  # each accepted node is the child holding its parent's argmax
        assert int(parents[a]) == node and int(tokens[a]) == int(arg[node])
        node = a
    kids = [i for i in range(1, n1) if int(parents[i]) == node]
    assert all(int(tokens[c]) != int(arg[node]) for c in kids) and y == int(arg[node])
    # force a long argmax path: make node 1 → 5 → 17 the argmax chain
    oh = onehot.clone()
    for parent, child in [(0, 1), (1, 5), (5, 17)]:
        oh[parent] = 0
        oh[parent, tokens[child]] = 1
    acc, y = tree_speculative_sample(parents, tokens, oh, torch.Generator().manual_seed(0))
    assert acc == [1, 5, 17] and y == int(oh[17].argmax())


def test_sampler_edge_cases():
    parents, tokens = small_tree()
    probs = torch.full((6, 4), 0.25)
    # root only: a bonus token from row 0
    acc, y = tree_speculative_sample(torch.tensor([-1]), torch.tensor([-1]), torch.tensor([[0.0, 1.0, 0.0]]))
    assert acc == [] and y == 1
    # every root child has p = 0: all rejected, the next token from the rest of row 0
    p = probs.clone()
    p[0] = torch.tensor([0.0, 0.0, 0.0, 1.0])
    for s in range(20):
        acc, y = tree_speculative_sample(parents, tokens, p, torch.Generator().manual_seed(s))
        assert acc == [] and y == 3
    # the root's children carry all of row 0: one of them is always accepted, never a rejected token emitted
    p[0] = torch.tensor([0.5, 0.5, 0.0, 0.0])
    firsts = set()
    for s in range(40):
        acc, y = tree_speculative_sample(parents, tokens, p, torch.Generator().manual_seed(s))
        assert acc and acc[0] in (1, 2)
        firsts.add(acc[0])
    assert firsts == {1, 2}
    # repeated sibling token: rejected once, then p_res = 0
    par2, tok2 = torch.tensor([-1, 0, 0]), torch.tensor([-1, 1, 1])
    p2 = torch.tensor([[0.5, 0.5, 0.0], [1.0, 0, 0], [0, 0, 1.0]])
    seen = Counter()
    for s in range(200):
        acc, y = tree_speculative_sample(par2, tok2, p2, torch.Generator().manual_seed(s))
        assert 2 not in acc
        seen[(tuple(acc), y)] += 1
    assert set(seen) == {((1,), 0), ((), 0)}
    # the same seed gives the same result
    g1, g2 = torch.Generator().manual_seed(5), torch.Generator().manual_seed(5)
    assert tree_speculative_sample(parents, tokens, probs, g1) == tree_speculative_sample(parents, tokens, probs, g2)


def test_zero_mass_residual_falls_back_to_the_last_positive_rejected_child():
    """Z = 0 is reachable only by rounding; the walk's fallback is the last rejected child with p > 0."""
    children = [[1, 2], [], []]
    acc, node, rej, last = _tree_walk(children, [-1, 0, 1], [0.0, 1.0, 0.0], lambda i: 1.0,
                                      lambda i, num, den: False)
    assert acc == [] and node == 0 and rej == [0, 1] and last == 0


@pytest.mark.parametrize("args,match", [
    ((torch.tensor([-1, 0]), torch.tensor([-1, 0]), torch.tensor([[0.5, 0.5]])), "shape"),
    ((torch.tensor([0, 0]), torch.tensor([-1, 0]), torch.full((2, 2), 0.5)), "parents\\[0\\]"),
    ((torch.tensor([-1, 1]), torch.tensor([-1, 0]), torch.full((2, 2), 0.5)), "precedes"),
    ((torch.tensor([-1, 0]), torch.tensor([-1, 2]), torch.full((2, 2), 0.5)), "\\[0, 2\\)"),
    ((torch.tensor([-1.0, 0.0]), torch.tensor([-1, 0]), torch.full((2, 2), 0.5)), "integer"),
    ((torch.tensor([-1, 0]), torch.tensor([-1, 0]), torch.tensor([[float("nan"), 0.5], [0.5, 0.5]])), "NaN"),
    ((torch.tensor([-1, 0]), torch.tensor([-1, 1]), torch.tensor([[0.5, float("inf")], [0.5, 0.5]])), "NaN"),
    ((torch.tensor([-1, 0]), torch.tensor([-1, 0]), torch.tensor([[0.5, -0.5], [0.5, 0.5]])), "negative"),
    ((torch.tensor([-1, 0]), torch.tensor([-1, 1]), torch.tensor([[2.0, 3.0], [0.5, 0.5]])), "sums to"),
    (([-1, 0], torch.tensor([-1, 0]), torch.full((2, 2), 0.5)), "tensors"),
    ((torch.tensor([], dtype=torch.long), torch.tensor([], dtype=torch.long), torch.zeros(0, 2)), "shape"),
])
def test_sampler_bad_inputs(args, match):
    with pytest.raises(ValueError, match=match):
        tree_speculative_sample(*args, generator=torch.Generator().manual_seed(0))


# ------------------------------------------------------------------------ tree helpers
def sample_tree() -> DraftTree:
    t = DraftTree.root(7)
    t = t.expand([0], [[3, 4, 5]], np.log([[0.2, 0.5, 0.3]]))  # sorted: 4 (0.5), 5 (0.3), 3 (0.2)
    assert t.tokens.tolist() == [7, 4, 5, 3]
    fr = t.frontier(2)
    assert fr.tolist() == [1, 2]
    t = t.expand(fr, [[8, 9], [8, 6]], [[np.log(0.9), np.log(0.1)], [np.log(0.6), -np.inf]])  # q = 0: dropped
    return t


def test_tree_building_scores_depths_and_frontier():
    t = sample_tree()
    assert t.num_nodes == 6 and t.max_depth == 2
    assert t.parents.tolist() == [-1, 0, 0, 0, 1, 1, 2]
    assert t.tokens.tolist() == [7, 4, 5, 3, 8, 9, 8]
    np.testing.assert_allclose(t.scores.numpy(), np.log([1, 0.5, 0.3, 0.2, 0.45, 0.05, 0.18]))
    assert t.depth.tolist() == [0, 1, 1, 1, 2, 2, 2]
    assert t.children() == [[1, 2, 3], [4, 5], [6], [], [], [], []]
    assert t.path(5) == [1, 5] and t.path_tokens(6) == [5, 8] and t.path(0) == []
    assert t.frontier(2).tolist() == [4, 6]
    with pytest.raises(ValueError, match="width"):
        t.frontier(0)
    with pytest.raises(ValueError, match="log-prob"):
        t.expand([0], [[1]], [[0.5]])
    with pytest.raises(ValueError, match="shape"):
        t.expand([0, 1], [[1]], [[-0.5]])
    with pytest.raises(ValueError, match="indices"):
        t.expand([9], [[1]], [[-0.5]])


def test_select_top_nodes_includes_ancestors_in_parent_first_order():
    t = sample_tree()
    # scores: 1: .5, 4: .45, 2: .3, 3: .2, 6: .18, 5: .05
    assert select_top_nodes(t, 0).tolist() == [0]
    assert select_top_nodes(t, 2).tolist() == [0, 1, 4]
    assert select_top_nodes(t, 3).tolist() == [0, 1, 2, 4]
    assert select_top_nodes(t, 5).tolist() == [0, 1, 2, 3, 4, 6]
    assert select_top_nodes(t, 99).tolist() == [0, 1, 2, 3, 4, 6, 5]
    # scores that rise along a path (not log-probs): the ancestor is added beyond the size
    odd = DraftTree(t.parents, t.tokens, torch.tensor([0, -5, -1, -2, 0, -3, -4], dtype=torch.float64), t.depth)
    assert select_top_nodes(odd, 1).tolist() == [0, 1, 4]
    sub = t.subtree(select_top_nodes(t, 5))
    assert sub.parents.tolist() == [-1, 0, 0, 0, 1, 2]
    assert sub.tokens.tolist() == [7, 4, 5, 3, 8, 8]
    for i, kids in enumerate(sub.children()):  # siblings in decreasing score
        assert all(sub.scores[a] >= sub.scores[b] for a, b in zip(kids, kids[1:]))
    with pytest.raises(ValueError, match="size"):
        select_top_nodes(t, -1)
    with pytest.raises(ValueError, match="parent"):
        t.subtree([0, 4, 1])
    with pytest.raises(ValueError, match="root"):
        t.subtree([1, 0])


def test_tree_mask_positions_and_cache_indices():
    parents = torch.tensor([-1, 0, 0, 1, 2, 2])
    anc = ancestor_matrix(parents)
    assert anc[4].tolist() == [True, False, True, False, True, False]
    m = tree_attention_mask(parents, 3)
    assert m.shape == (1, 1, 6, 9) and m.dtype == torch.bool
    assert m[0, 0, :, :3].all()
    assert m[0, 0, 5, 3:].tolist() == [True, False, True, False, False, True]
    assert m[0, 0, 0, 3:].tolist() == [True] + [False] * 5
    f = tree_attention_mask(parents, 3, dtype=torch.float32)
    assert f.dtype == torch.float32 and (f[m] == 0).all() and (f[~m] == torch.finfo(torch.float32).min).all()
    assert tree_attention_mask(parents, 0).shape == (1, 1, 6, 6)
    assert tree_position_ids(torch.tensor([0, 1, 1, 2, 2, 2]), 3).tolist() == [[3, 4, 4, 5, 5, 5]]
    assert path_cache_indices([2, 5], 3).tolist() == [0, 1, 2, 3, 5, 8]
    assert path_cache_indices([], 0).tolist() == [0]
    for bad, match in [(lambda: tree_attention_mask(parents, -1), "prefix_len"),
                       (lambda: tree_attention_mask(torch.tensor([-1, 1]), 0), "precedes"),
                       (lambda: tree_attention_mask(parents, 2, dtype=torch.int32), "dtype"),
                       (lambda: tree_position_ids(torch.tensor([0.0]), 1), "integer"),
                       (lambda: path_cache_indices([3, 2], 1), "increasing"),
                       (lambda: DraftTree(torch.tensor([0]), torch.tensor([0]), torch.zeros(1), torch.zeros(1)),
                        "root")]:
        with pytest.raises(ValueError, match=match):
            bad()
