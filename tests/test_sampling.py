"""SamplingConfig (the processing shared by p and q) and speculative_sample's edge cases."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from learn2draft.sampling import (
    SamplingConfig,
    _inverse_cdf,
    greedy_accept_rows,
    sample_from,
    sample_rows,
    speculative_sample,
    speculative_sample_rows,
)

V = 40
CONFIGS = [
    SamplingConfig(temperature=1.0),
    SamplingConfig(temperature=0.7),
    SamplingConfig(temperature=1.3, top_k=7),
    SamplingConfig(temperature=0.9, top_p=0.8),
    SamplingConfig(temperature=1.1, min_p=0.05),
    SamplingConfig(temperature=0.8, top_k=12, top_p=0.9, min_p=0.02),
    SamplingConfig(temperature=0.8, repetition_penalty=1.4),
    SamplingConfig(temperature=1.2, presence_penalty=0.9),
    SamplingConfig(temperature=0.6, top_k=10, top_p=0.95, repetition_penalty=1.3, presence_penalty=0.5),
    SamplingConfig(temperature=0.0, repetition_penalty=1.5, presence_penalty=1.0),
    SamplingConfig(temperature=0.0),
]


def case(seed: int, n: int = 5):
    """Random logits (n, V), a prefix with repeats, and n − 1 drafted tokens (some already in the prefix)."""
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(n, V, generator=g) * 3
    prefix = torch.tensor([3, 7, 7, 11, 20, 3, 5])
    new = torch.tensor([7, 30, 11, 31, 2, 9][: n - 1])
    return logits, prefix, new


def reference_probs(cfg: SamplingConfig, logits: np.ndarray, context: list[int]) -> np.ndarray:
    """Independent float64 re-implementation of the processing for one row (definitions from
    transformers' generate(): penalties, then temperature, top-k, top-p, min-p)."""
    x = logits.astype(np.float64).copy()
    seen = sorted(set(context))
    if cfg.repetition_penalty != 1.0:  # CTRL: divide positive logits, multiply negative ones
        x[seen] = np.where(x[seen] < 0, x[seen] * cfg.repetition_penalty, x[seen] / cfg.repetition_penalty)
    x[seen] -= cfg.presence_penalty
    if cfg.temperature == 0:
        out = np.zeros_like(x)
        out[np.argmax(x)] = 1.0
        return out
    x = x / cfg.temperature
    keep = np.ones_like(x, bool)
    if cfg.top_k:
        keep &= x >= np.sort(x)[-cfg.top_k]
    if cfg.top_p < 1.0:  # smallest set of most likely tokens with mass ≥ top_p (after top-k)
        xs = np.where(keep, x, -np.inf)
        pr = np.exp(xs - xs.max())
        pr /= pr.sum()
        order = np.argsort(-pr)
        mass_before = np.cumsum(pr[order]) - pr[order]
        drop = order[mass_before >= cfg.top_p]
        keep[drop] = False
    if cfg.min_p > 0:
        xs = np.where(keep, x, -np.inf)
        pr = np.exp(xs - xs.max())
        pr /= pr.sum()
        keep &= pr >= cfg.min_p * pr.max()
    x = np.where(keep, x, -np.inf)
    e = np.exp(x - x.max())
    return e / e.sum()


# ------------------------------------------------------------------------- SamplingConfig.probs
@pytest.mark.parametrize("cfg", CONFIGS, ids=lambda c: repr(c.to_dict()))
def test_probs_match_independent_reference(cfg):
    for seed in range(3):
        logits, prefix, new = case(seed)
        got = cfg.probs(logits, prefix, new)
        assert got.dtype == torch.float32 and got.shape == logits.shape
        for i in range(logits.shape[0]):
            ctx = prefix.tolist() + new[:i].tolist()
            ref = reference_probs(cfg, logits[i].numpy(), ctx)
            np.testing.assert_allclose(got[i].numpy(), ref, rtol=1e-5, atol=1e-6)  # float32 softmax vs float64
        torch.testing.assert_close(got.sum(-1), torch.ones(logits.shape[0]))


@pytest.mark.parametrize("cfg", CONFIGS, ids=lambda c: repr(c.to_dict()))
def test_row_i_equals_single_row_with_longer_prefix(cfg):
    """How the decoder computes p (one call, n rows) and q (one row per draft step) must agree."""
    logits, prefix, new = case(7)
    multi = cfg.probs(logits, prefix, new)
    for i in range(logits.shape[0]):
        single = cfg.probs(logits[i : i + 1], torch.cat([prefix, new[:i]]))
        torch.testing.assert_close(multi[i : i + 1], single, rtol=0, atol=0)


@pytest.mark.parametrize("cfg", CONFIGS, ids=lambda c: repr(c.to_dict()))
def test_probs_rows_of_a_batch_equal_each_rows_probs(cfg):
    """The batched decoder processes a whole verification (B, k, V) in one probs_rows call: each row must be exactly
    what probs gives for it; a prefix-dependent config is refused (it needs each row's prefix)."""
    rows = torch.stack([case(s)[0][:3] for s in range(4)])  # (B=4, k=3, V)
    if cfg.prefix_dependent:
        with pytest.raises(ValueError, match="prefix"):
            cfg.probs_rows(rows)
        return
    got = cfg.probs_rows(rows)
    assert got.shape == rows.shape and got.dtype == torch.float32
    for b in range(4):
        prefix, new = case(b)[1], case(b)[2]
        torch.testing.assert_close(got[b], cfg.probs(rows[b], prefix, new), rtol=0, atol=0)
    bad = rows.clone()
    bad[2, 1, 0] = float("nan")
    with pytest.raises(ValueError, match="NaN or infinite"):
        cfg.probs_rows(bad, source="target")


def test_penalties_really_depend_on_the_drafted_tokens():
    """A row after a drafted token penalises that token (the test above would pass if the
    penalty ignored ``new_tokens``, as long as it did so consistently; this one would not)."""
    cfg = SamplingConfig(temperature=1.0, presence_penalty=2.0)
    logits = torch.zeros(2, V)
    p = cfg.probs(logits, torch.tensor([1]), torch.tensor([5]))
    assert float(p[0, 5]) == pytest.approx(float(p[0, 6]))  # row 0 has not seen token 5
    assert float(p[1, 5]) == pytest.approx(float(p[1, 6]) * math.exp(-2.0), rel=1e-5)  # row 1 has


def test_greedy_is_one_hot_argmax_after_penalties():
    logits = torch.zeros(1, V)
    logits[0, 4], logits[0, 9] = 5.0, 4.0  # raw argmax 4, but 4 is in the prefix
    prefix = torch.tensor([4, 1])
    plain = SamplingConfig(temperature=0.0).probs(logits, prefix)
    assert plain[0].argmax() == 4 and plain[0].sum() == 1 and (plain[0] > 0).sum() == 1
    pen = SamplingConfig(temperature=0.0, repetition_penalty=1.5).probs(logits, prefix)
    assert pen[0, 9] == 1.0 and pen.sum() == 1.0  # 5/1.5 < 4
    pres = SamplingConfig(temperature=0.0, presence_penalty=1.5).probs(logits, prefix)
    assert pres[0, 9] == 1.0
    # top-k / top-p are irrelevant to greedy
    assert torch.equal(SamplingConfig(temperature=0.0, top_k=1, top_p=0.5).probs(logits, prefix), plain)


@pytest.mark.parametrize("cfg", CONFIGS, ids=lambda c: repr(c.to_dict()))
def test_probs_do_not_modify_the_logits(cfg):
    """The decoder reads the draft's raw logits again (confidence features) after probs()."""
    logits, prefix, new = case(3)
    before = logits.clone()
    cfg.probs(logits, prefix, new)
    assert torch.equal(logits, before)


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_nan_or_infinite_logits_raise(bad):
    logits, prefix, new = case(0)
    logits[2, 5] = bad
    for cfg in (SamplingConfig(temperature=1.0), SamplingConfig(temperature=0.0),
                SamplingConfig(temperature=0.7, repetition_penalty=1.2)):
        with pytest.raises(ValueError, match="NaN or infinite logits"):
            cfg.probs(logits, prefix, new)


def test_probs_need_the_drafted_tokens():
    logits, prefix, _ = case(0)
    with pytest.raises(ValueError, match="new_tokens"):
        SamplingConfig(temperature=1.0, repetition_penalty=1.2).probs(logits, prefix)
    with pytest.raises(ValueError, match="new_tokens"):
        SamplingConfig(temperature=1.0).probs(logits, prefix, torch.tensor([1]))


@pytest.mark.parametrize("kwargs", [dict(temperature=-1), dict(top_k=-1), dict(top_p=0.0), dict(top_p=1.5),
                                    dict(min_p=1.0), dict(min_p=-0.1), dict(repetition_penalty=0.0),
                                    dict(temperature=float("nan"))])
def test_invalid_settings_raise(kwargs):
    with pytest.raises(ValueError, match=f"^{next(iter(kwargs))} must"):  # the error names the setting
        SamplingConfig(**kwargs)


# -------------------------------------------------------------------------- speculative_sample
def rand_probs(rows, Vv, seed, zeros=0.0):
    g = torch.Generator().manual_seed(seed)
    p = torch.softmax(torch.randn(rows, Vv, generator=g) * 2, -1)
    if zeros:
        p = p * (torch.rand(rows, Vv, generator=g) >= zeros)
        p[:, 0] += 1e-3
        p = p / p.sum(-1, keepdim=True)
    return p


def test_p_equal_q_accepts_everything_and_draws_from_the_bonus_row():
    """p = q: every drafted token is accepted and the emitted token is the bonus row's inverse-CDF draw at the
    call's last uniform (replayed from a generator of the same seed), never a residual's."""
    gamma = 6
    p = rand_probs(gamma + 1, 30, 0, zeros=0.3)
    g = torch.Generator().manual_seed(0)
    for k in range(300):
        x = torch.stack([torch.multinomial(p[i], 1, generator=g)[0] for i in range(gamma)])
        tau, y = speculative_sample(p, p[:gamma].clone(), x, torch.Generator().manual_seed(k))
        u = torch.rand(gamma + 1, generator=torch.Generator().manual_seed(k), dtype=torch.float64)
        assert tau == gamma and p[gamma, y] > 0
        assert y == _inverse_cdf(p[gamma], float(u[gamma]))


def test_zero_draft_probability_token_is_reached_through_the_residual_and_p_zero_always_rejected():
    p = torch.tensor([[0.6, 0.4, 0.0], [0.2, 0.3, 0.5]])
    q = torch.tensor([[0.0, 0.5, 0.5]])
    g = torch.Generator().manual_seed(0)
    for _ in range(200):  # drafted 2 has p = 0 < q: always rejected; the residual is all on token 0
        assert speculative_sample(p, q, torch.tensor([2]), g) == (0, 0)
    firsts = []
    for _ in range(4000):  # drafted 1: accepted w.p. 0.8, else residual → 0; token 0 (q = 0) is emitted first
        x = int(torch.multinomial(q[0], 1, generator=g))
        tau, y = speculative_sample(p, q, torch.tensor([x]), g)
        firsts.append(x if tau == 1 else y)
    freq = np.bincount(firsts, minlength=3) / len(firsts)
    # exact law p = (0.6, 0.4, 0); ±0.04 is > 5 standard errors (sqrt(0.24/4000) ≈ 0.008)
    np.testing.assert_allclose(freq, [0.6, 0.4, 0.0], atol=0.04)
    assert freq[2] == 0


def test_draft_sampling_never_proposes_zero_probability_tokens():
    q = torch.tensor([0.0, 0.5, 0.0, 0.5, 0.0])
    g = torch.Generator().manual_seed(0)
    assert {sample_from(q, g) for _ in range(2000)} == {1, 3}


def test_accept_reject_accept_counts_one():
    """Pattern accept, reject, accept → τ = 1: only the accepted prefix counts."""
    q = rand_probs(3, 10, 1)
    x = torch.tensor([2, 5, 7])
    p = torch.empty(4, 10)
    p[0] = q[0]  # p = q: always accepted
    p[1] = q[1]
    p[1, 5] = 0.0  # p(x_1) = 0: always rejected
    p[1] /= p[1].sum()
    p[2] = q[2]  # would be accepted, but comes after a rejection
    p[3] = rand_probs(1, 10, 2)[0]
    g = torch.Generator().manual_seed(0)
    for _ in range(200):
        tau, y = speculative_sample(p, q, x, g)
        assert tau == 1 and y != 5 and (p[1] - q[1]).clamp_min(0)[y] > 0


def test_gamma_zero_draws_from_p():
    p = torch.zeros(1, 8)
    p[0, 6] = 1.0
    assert speculative_sample(p, torch.zeros(0, 8), torch.zeros(0, dtype=torch.long)) == (0, 6)


def test_greedy_one_hot_accepts_iff_argmax():
    p = torch.zeros(4, 6)
    p[0, 1] = p[1, 2] = p[2, 3] = p[3, 4] = 1.0
    q = torch.zeros(3, 6)
    q[0, 1] = q[1, 2] = q[2, 0] = 1.0
    assert speculative_sample(p, q, torch.tensor([1, 2, 0])) == (2, 3)  # third differs: corrected to p's argmax
    q[2] = p[2]
    assert speculative_sample(p, q, torch.tensor([1, 2, 3])) == (3, 4)  # all accepted: bonus = argmax of p_3


def test_same_generator_seed_same_result():
    p, q = rand_probs(5, 20, 3), rand_probs(4, 20, 4)
    x = torch.tensor([1, 2, 3, 4])
    a = [speculative_sample(p, q, x, torch.Generator().manual_seed(s)) for s in range(50)]
    b = [speculative_sample(p, q, x, torch.Generator().manual_seed(s)) for s in range(50)]
    assert a == b and len(set(a)) > 1


@pytest.mark.parametrize("where", ["target", "draft"])
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -0.1])
def test_bad_probabilities_raise(where, bad):
    p, q = rand_probs(3, 10, 0), rand_probs(2, 10, 1)
    (p if where == "target" else q)[1, 7] = bad  # not at a drafted token: the check must see the whole tensor
    with pytest.raises(ValueError, match=f"{where}_probs has NaN, infinite or negative"):
        speculative_sample(p, q, torch.tensor([1, 2]))


def test_shape_token_and_zero_q_errors():
    p, q = rand_probs(3, 10, 0), rand_probs(2, 10, 1)
    with pytest.raises(ValueError, match="target_probs must have shape"):
        speculative_sample(p[:2], q, torch.tensor([1, 2]))
    with pytest.raises(ValueError, match="draft_probs must have shape"):
        speculative_sample(p, q[:, :9], torch.tensor([1, 2]))
    with pytest.raises(ValueError, match="draft_tokens must be ids"):
        speculative_sample(p, q, torch.tensor([1, 10]))
    with pytest.raises(ValueError, match="draft_tokens must be ids"):
        speculative_sample(p, q, torch.tensor([-1, 2]))
    q[1, 2] = 0.0
    q[1] /= q[1].sum()
    with pytest.raises(ValueError, match="q\\(x\\) = 0"):
        speculative_sample(p, q, torch.tensor([1, 2]))
    with pytest.raises(ValueError, match="sum to 1"):  # an all-zero bonus row
        speculative_sample(torch.zeros(1, 10), q[:0], torch.zeros(0, dtype=torch.long))


def test_inverse_cdf_edges():
    w = torch.tensor([0.0, 0.3, 0.7, 0.0, 0.0])
    assert _inverse_cdf(w, 0.0) == 1  # never the leading zero
    assert _inverse_cdf(w, 0.2999) == 1 and _inverse_cdf(w, 0.3001) == 2
    assert _inverse_cdf(w, float(np.nextafter(1.0, 0.0))) == 2  # never a trailing zero
    assert _inverse_cdf(torch.zeros(4), 0.5) is None


def test_residual_that_rounds_to_zero_falls_back_to_p():
    """max(p − q, 0) = 0 after a rejection can only come from rounding; the sampler then draws from p."""
    # p ≤ q everywhere, p's row sums to 0.9996 (within the 1e-3 normalisation tolerance, as after rounding):
    # rejection has probability 1 − 0.4996/0.5 = 8e-4, so 20,000 calls give ~16 (fixed seed).
    p = torch.tensor([[0.4996, 0.5], [0.5, 0.5]], dtype=torch.float64)
    q = torch.tensor([[0.5, 0.5]], dtype=torch.float64)
    g = torch.Generator().manual_seed(0)
    out = [speculative_sample(p, q, torch.tensor([0]), g) for _ in range(20000)]
    rejected = [y for tau, y in out if tau == 0]
    assert 3 < len(rejected) < 60 and set(rejected) == {0, 1}


def test_unnormalised_or_mistyped_inputs_are_refused():
    """Rows that do not sum to 1 (e.g. logits or scaled weights) would silently change the law."""
    p, q = rand_probs(3, 10, 0), rand_probs(2, 10, 1)
    x = torch.tensor([1, 2])
    with pytest.raises(ValueError, match="sum to 1"):
        speculative_sample(p * 10, q, x)
    with pytest.raises(ValueError, match="sum to 1"):
        speculative_sample(p, q * 0.5, x)
    with pytest.raises(ValueError, match="integer token ids"):
        speculative_sample(p, q, x.float())
    with pytest.raises(ValueError, match="torch tensors"):
        speculative_sample(p, q, [1, 2])


@pytest.mark.parametrize("kw", [{"temperature": float("inf")}, {"temperature": "0.7"}, {"top_k": 2.5},
                                {"presence_penalty": float("nan")}, {"repetition_penalty": float("inf")}])
def test_sampling_config_rejects_non_finite_or_mistyped_settings(kw):
    with pytest.raises(ValueError, match=f"^{next(iter(kw))} must"):  # the error names the setting
        SamplingConfig(**kw)


@pytest.mark.parametrize("kw, name", [
    ({"temperature": 1e-38}, "temperature"), ({"temperature": 5e-5}, "temperature"),
    ({"temperature": 0.7, "presence_penalty": -3e38}, "presence_penalty"),
    ({"temperature": 0.7, "presence_penalty": 2e6}, "presence_penalty"),
    ({"temperature": 0.7, "repetition_penalty": 1e-38}, "repetition_penalty"),
    ({"temperature": 0.7, "repetition_penalty": 3e38}, "repetition_penalty"),
])
def test_settings_that_would_overflow_float32_are_refused_with_the_bound(kw, name):
    with pytest.raises(ValueError, match=rf"{name} must .*1e[-+]0\d"):
        SamplingConfig(**kw)


@pytest.mark.parametrize("kw", [
    {"temperature": 1e-4}, {"temperature": 1e-4, "presence_penalty": -1e6, "repetition_penalty": 1e-6},
    {"temperature": 1e-4, "presence_penalty": 1e6, "repetition_penalty": 1e6}, {"temperature": 1e30},
])
def test_extreme_settings_within_the_bounds_give_distributions(kw):
    """At the bounds, with logits far larger than a language model's, p is a distribution, near its limit."""
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(0)) * 1000
    prefix = torch.tensor([1, 2, 3])
    p = SamplingConfig(**kw).probs(logits, prefix, torch.tensor([4, 5]))
    assert torch.isfinite(p).all() and torch.allclose(p.sum(-1), torch.ones(3))
    if kw["temperature"] == 1e-4 and len(kw) == 1:
        assert torch.equal(p.argmax(-1), logits.argmax(-1)) and (p.max(-1).values > 0.999).all()  # ≈ greedy


def test_top_k_breaks_ties_by_lowest_id_identically_in_p_and_q():
    """``--top-k 1`` is argmax whatever the temperature: with tied logits exactly k tokens are kept, the lowest
    ids first (transformers' TopKLogitsWarper keeps every tied token, so a seed chose among them)."""
    tied = torch.zeros(3, V)
    tied[2, 5] = tied[2, 9] = tied[2, 30] = 1.0  # row 2: three tied best tokens
    prefix, new = torch.tensor([1, 2]), torch.tensor([3, 4])
    one = SamplingConfig(temperature=1.0, top_k=1)
    p = one.probs(tied, prefix, new)
    assert p[0].tolist() == [1.0] + [0.0] * (V - 1) and p[1, 0] == 1.0 and p[2, 5] == 1.0
    assert torch.equal(p, one.probs(tied.clone(), prefix, new))  # q: the same processing, the same tokens
    two = SamplingConfig(temperature=0.7, top_k=2).probs(tied, prefix, new)
    assert ((two > 0).sum(-1) == 2).all() and two[2, 5] > 0 and two[2, 9] > 0 and two[0, :2].sum() == 1.0
    # p = q one-hot: the draft token is accepted and the bonus token is the same id, whatever the seed
    for seed in range(3):
        g = torch.Generator().manual_seed(seed)
        assert speculative_sample(p[:2], p[:1], torch.tensor([0]), generator=g) == (1, 0)


def test_greedy_probs_of_bf16_logits_are_the_float32_ones_and_ties_go_to_the_first_maximum():
    """Greedy reads bf16 logits without a float32 copy: the one-hot is that of their exact float32 copy, a tie goes to
    the lowest id (torch.argmax's rule) in probs and probs_rows alike, and the result is float32."""
    g = torch.Generator().manual_seed(0)
    logits = torch.randint(0, 4, (6, 50), generator=g).to(torch.bfloat16)  # many tied maxima per row
    cfg = SamplingConfig()
    got = cfg.probs(logits, torch.arange(3), torch.arange(5))
    assert got.dtype == torch.float32
    assert torch.equal(got.argmax(-1), logits.float().argmax(-1)) and torch.equal(got.sum(-1), torch.ones(6))
    torch.testing.assert_close(got, cfg.probs(logits.float(), torch.arange(3), torch.arange(5)), rtol=0, atol=0)
    torch.testing.assert_close(cfg.probs_rows(logits.reshape(2, 3, 50)).reshape(6, 50), got, rtol=0, atol=0)
    soft = SamplingConfig(temperature=1.0)
    torch.testing.assert_close(soft.probs_rows(logits[None]), torch.softmax(logits.float(), -1)[None], rtol=0, atol=0)


# --------------------------------------------------------------------------- many rows at once
def _reference_row(p, q, x, u):
    """Leviathan et al.'s rule for one chain written out in scalar Python (float64 inputs): the accepted length and
    the token, drawn by :func:`_inverse_cdf` at the last uniform; q None is a point mass at each drafted token."""
    g = len(x)
    for i in range(g):
        qx = 1.0 if q is None else float(q[i, x[i]])
        if not float(u[i]) * qx < float(p[i, x[i]]):
            if q is None:
                w = p[i].clone()
                w[x[i]] = 0.0
            else:
                w = (p[i] - q[i]).clamp_min(0)
            return i, _inverse_cdf(w if float(w.sum()) > 0 else p[i], float(u[g]))
    return g, _inverse_cdf(p[g], float(u[g]))


def _random_rows(seed, point_mass):
    """B rows at random depths (0 included), float64, packed: (p, q or None, x, gammas)."""
    g = torch.Generator().manual_seed(seed)
    B = int(torch.randint(1, 6, (1,), generator=g))
    gammas = torch.randint(0, 5, (B,), generator=g).tolist()
    p = rand_probs(sum(gammas) + B, 12, seed, zeros=0.3).double()
    q = None if point_mass else rand_probs(sum(gammas), 12, seed + 1000, zeros=0.3).double()
    if point_mass:
        x = torch.randint(0, 12, (sum(gammas),), generator=g)
    else:
        x = torch.stack([torch.multinomial(q[k], 1, generator=g)[0] for k in range(sum(gammas))]) \
            if sum(gammas) else torch.zeros(0, dtype=torch.long)
    return p, q, x, gammas


def _split(p, q, x, gammas):
    a = b = 0
    for gam in gammas:
        yield p[a : a + gam + 1], None if q is None else q[b : b + gam], x[b : b + gam]
        a, b = a + gam + 1, b + gam


@pytest.mark.parametrize("point_mass", [False, True])
def test_rows_at_once_follow_the_rule_row_by_row(point_mass):
    """speculative_sample_rows over B packed rows (depths 0–4) gives each row what the scalar rule gives that row
    alone with its own uniforms: exact equality over 300 random batches (float64 throughout)."""
    for seed in range(300):
        p, q, x, gammas = _random_rows(seed, point_mass)
        u = torch.rand(p.shape[0], generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
        taus, toks = speculative_sample_rows(p, q, x, gammas, u)
        ref, a = [], 0
        for (pi, qi, xi), gam in zip(_split(p, q, x, gammas), gammas):
            ref.append(_reference_row(pi, qi, xi.tolist(), u[a : a + gam + 1]))
            a += gam + 1
        assert list(zip(taus, toks)) == ref, seed


def test_rows_at_once_draw_what_each_row_draws_alone():
    """Each row's uniforms from its own generator: the rows' results equal speculative_sample per row with the same
    generators (a row's draws never depend on the others')."""
    for seed in range(100):
        p, q, x, gammas = _random_rows(seed, point_mass=seed % 2 == 1)
        u = torch.cat([torch.rand(gam + 1, generator=torch.Generator().manual_seed(seed * 10 + i), dtype=torch.float64)
                       for i, gam in enumerate(gammas)])
        got = list(zip(*speculative_sample_rows(p, q, x, gammas, u)))
        alone = [speculative_sample(pi, qi, xi, torch.Generator().manual_seed(seed * 10 + i))
                 for i, (pi, qi, xi) in enumerate(_split(p, q, x, gammas))]
        assert got == alone, seed


def test_point_mass_q_none_equals_its_one_hot_rows():
    """q None (prompt lookup) gives what the dense one-hot q gives, for the same uniforms."""
    for seed in range(100):
        p, _, x, gammas = _random_rows(seed, point_mass=True)
        one_hot = torch.zeros(len(x), p.shape[1], dtype=p.dtype).scatter_(1, x[:, None], 1.0)
        u = torch.rand(p.shape[0], generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
        assert speculative_sample_rows(p, None, x, gammas, u) == speculative_sample_rows(p, one_hot, x, gammas, u)


def test_rows_at_once_refuse_bad_input_in_any_row():
    p, q = rand_probs(5, 10, 0), rand_probs(3, 10, 1)  # rows of γ = 2 and γ = 1
    x, u = torch.tensor([1, 2, 3]), torch.rand(5, dtype=torch.float64)
    assert speculative_sample_rows(p, q, x, [2, 1], u)[0][0] in (0, 1, 2)
    with pytest.raises(ValueError, match="num_draft"):
        speculative_sample_rows(p, q, x, [], u)
    with pytest.raises(ValueError, match="num_draft"):
        speculative_sample_rows(p, q, x, [4, -1], u)
    with pytest.raises(ValueError, match="target_probs must have shape"):
        speculative_sample_rows(p, q, x, [1, 1], u)
    with pytest.raises(ValueError, match="uniforms must hold"):
        speculative_sample_rows(p, q, x, [2, 1], u[:4])
    with pytest.raises(ValueError, match="draft_tokens must be ids"):  # out of range in the second row only
        speculative_sample_rows(p, q, torch.tensor([1, 2, 10]), [2, 1], u)
    bad = q.clone()
    bad[2, 3] = 0.0
    bad[2] /= bad[2].sum()
    with pytest.raises(ValueError, match="q\\(x\\) = 0"):
        speculative_sample_rows(p, bad, x, [2, 1], u)
    off = p.clone()
    off[4] *= 0.5  # the second row's bonus row
    with pytest.raises(ValueError, match="sum to 1"):
        speculative_sample_rows(off, q, x, [2, 1], u)
    with pytest.raises(ValueError, match="draft_probs has NaN"):
        speculative_sample_rows(p, q.clone().fill_(float("nan")), x, [2, 1], u)
    with pytest.raises(ValueError, match="integer token ids"):
        speculative_sample_rows(p, q, x.float(), [2, 1], u)
    with pytest.raises(ValueError, match="must be torch tensors"):
        speculative_sample_rows(p, q, x, [2, 1], u.tolist())
    with pytest.raises(ValueError, match=r"uniforms must lie in \[0, 1\)"):
        speculative_sample_rows(p, q, x, [2, 1], u + 1.0)


def test_sample_rows_is_the_inverse_cdf_per_row():
    w = rand_probs(6, 15, 3, zeros=0.4).double() * 3.0  # unnormalised weights
    for seed in range(50):
        u = torch.rand(6, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
        assert sample_rows(w, u) == [_inverse_cdf(w[i], float(u[i])) for i in range(6)]
    with pytest.raises(ValueError, match="all zero"):
        sample_rows(torch.cat([w[:1], torch.zeros(1, 15, dtype=w.dtype)]), torch.rand(2, dtype=torch.float64))
    with pytest.raises(ValueError, match="negative"):
        sample_rows(-w, torch.rand(6, dtype=torch.float64))


@pytest.mark.parametrize("dense_q", [False, True])
def test_greedy_acceptance_from_logits_is_the_sampler_on_the_greedy_one_hot_rows(dense_q):
    """greedy_accept_rows (raw logits, no uniform) returns exactly what speculative_sample_rows returns on the greedy
    SamplingConfig's probabilities (one-hot on the first maximal logit) for any q and any uniforms: 300 random
    batches at depths 0–4, bf16 logits rounded so that ties occur, drafted tokens equal to the target's argmax on
    about half the positions (so that runs of accepted tokens, rejections and bonus tokens all occur)."""
    cfg = SamplingConfig()
    seen = set()
    for seed in range(300):
        g = torch.Generator().manual_seed(seed)
        B = int(torch.randint(1, 6, (1,), generator=g))
        gammas = torch.randint(0, 5, (B,), generator=g).tolist()
        N, M = sum(gammas) + B, sum(gammas)
        logits = (torch.randn(N, 12, generator=g) * 2).round().to(torch.bfloat16)  # integer-valued: frequent ties
        top = logits.float().max(-1).indices
        t_rows = [a + j for a, gam in zip(np.cumsum([0] + [gm + 1 for gm in gammas])[:-1], gammas) for j in range(gam)]
        x = torch.where(torch.rand(M, generator=g) < 0.6, top[t_rows], torch.randint(0, 12, (M,), generator=g))
        q = None
        if dense_q and M:  # any q that could have proposed x
            q = torch.rand(M, 12, generator=g, dtype=torch.float64)
            q[torch.arange(M), x] += 1.0
            q = q / q.sum(-1, keepdim=True)
        u = torch.rand(N, generator=g, dtype=torch.float64)
        want = speculative_sample_rows(cfg.probs_rows(logits).double(), q, x, gammas, u)
        got = greedy_accept_rows(logits, x, gammas)
        assert got == want, seed
        seen.update((t == gam) for t, gam in zip(got[0], gammas) if gam)
    assert seen == {True, False}  # both full acceptance and rejections occurred


def test_greedy_acceptance_refuses_bad_input():
    logits = torch.randn(5, 10)
    with pytest.raises(ValueError, match="num_draft"):
        greedy_accept_rows(logits, torch.zeros(0, dtype=torch.long), [])
    with pytest.raises(ValueError, match="target_logits"):
        greedy_accept_rows(logits, torch.zeros(2, dtype=torch.long), [2])  # 3 rows needed, 5 given
    with pytest.raises(ValueError, match="Σ γ_i = 3"):
        greedy_accept_rows(logits, torch.zeros(2, dtype=torch.long), [2, 1])
    with pytest.raises(ValueError, match="integer counts"):
        greedy_accept_rows(torch.randn(5, 10), torch.zeros(3, dtype=torch.long), [1.5, 1.5])
    with pytest.raises(ValueError, match="torch tensors"):
        greedy_accept_rows(logits, [0, 0, 0], [2, 1])
    with pytest.raises(ValueError, match="integer token ids"):
        greedy_accept_rows(logits, torch.zeros(3), [2, 1])
    with pytest.raises(ValueError, match="floating-point"):
        greedy_accept_rows(torch.zeros(5, 10, dtype=torch.long), torch.zeros(3, dtype=torch.long), [2, 1])
    bad = logits.clone()
    bad[3, 4] = float("nan")
    with pytest.raises(ValueError, match="draft model returned NaN"):
        greedy_accept_rows(bad, torch.zeros(3, dtype=torch.long), [2, 1], source="draft model")
