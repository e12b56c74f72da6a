"""Output-law checks: does speculative decoding emit the target's distribution?

Two things live here.

1. **Acceptance rules as data** (:class:`AcceptanceRule`): the acceptance probability and the
   law a token is drawn from after a rejection. :data:`LEVIATHAN_RULE` is the exact rule of
   Leviathan, Kalman & Matias (ICML 2023, Algorithm 1): accept ``x ~ q`` with probability
   ``min(1, p(x)/q(x))``, after a rejection draw from ``norm(max(p − q, 0))``.
   :data:`RESAMPLE_FROM_TARGET_RULE` is the classic mistake, kept as the project's single
   **negative control**: after a rejection it draws from ``p`` itself. On the three-symbol example
   p = (0.5, 0.3, 0.2), q = (0.2, 0.5, 0.3) it emits (0.35, 0.39, 0.26) instead of p.
   :func:`resample_from_target_rule` is that rule as a sampler with the signature of
   :func:`learn2draft.sampling.speculative_sample`, to plug into
   ``SpeculativeDecoder(sampler=...)``. The exact enumeration test, the Monte Carlo test and the
   real-model test all take the wrong rule from here.

2. **The real-model law check** (:func:`law_check`): draw the first ``k`` tokens many times with
   plain autoregressive sampling and with speculative sampling under each controller, and compare
   the two samples position by position with a chi-square test on the contingency table of token
   counts; the first position is also tested against the target's exact first-token law. A
   Bonferroni correction covers all tests. :func:`format_law_table` renders the result as Markdown
   (``python -m eval --law-check``).
"""

from __future__ import annotations

import dataclasses
import time
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from types import SimpleNamespace

import numpy as np
import torch

from eval.runner import TreeShape, decoder_max_depth, make_decoder
from learn2draft.batch_cache import _ACTIVE  # the plan of the batch cache's forward now running
from learn2draft.decoding import DraftController, FixedDepthController, Sampler
from learn2draft.models import ModelPair
from learn2draft.sampling import SamplingConfig, speculative_sample, tree_speculative_sample

#: Label used in count tables for "generation ended (EOS) before this position".
ENDED = -1


# --------------------------------------------------------------------------------------------
# Acceptance rules
# --------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class AcceptanceRule:
    """One cycle's acceptance rule for a chain of drafted tokens, as two functions.

    Attributes:
        name: short label.
        accept_probability: ``(p_x, q_x) -> a`` in [0, 1], the probability of accepting a drafted
            token x with target probability ``p_x`` and draft probability ``q_x > 0`` (floats).
        correction: ``(p, q) -> r``, float64 (V,) arrays in, the distribution (float64 (V,),
            summing to 1) that the emitted token is drawn from after a rejection at this position.

    The bonus token (every drafted token accepted) is always drawn from the target's ``p``.
    """

    name: str
    accept_probability: Callable[[float, float], float]
    correction: Callable[[np.ndarray, np.ndarray], np.ndarray]


def _accept_min_ratio(p_x: float, q_x: float) -> float:
    return min(1.0, p_x / q_x)


def _residual(p: np.ndarray, q: np.ndarray) -> np.ndarray:
    r = np.maximum(p - q, 0.0)
    z = r.sum()
    return r / z if z > 0 else p / p.sum()  # z = 0 only when p = q, where rejection has probability 0


def _target_itself(p: np.ndarray, q: np.ndarray) -> np.ndarray:
    return p / p.sum()


#: The exact rule (Leviathan et al. 2023, Algorithm 1 / Appendix A.1).
LEVIATHAN_RULE = AcceptanceRule("leviathan (exact)", _accept_min_ratio, _residual)

#: NEGATIVE CONTROL — a wrong rule: accept with min(1, p/q) but, after a rejection, resample from
#: p instead of the residual. It over-weights tokens the draft proposes too often. Never use it to
#: decode; it exists so that every law test can show that it catches a biased sampler.
RESAMPLE_FROM_TARGET_RULE = AcceptanceRule("resample-from-target (WRONG, negative control)", _accept_min_ratio,
                                           _target_itself)


def _draw(dist: np.ndarray, u: float) -> int:
    """Inverse-CDF draw from a float64 (V,) distribution with one uniform u in [0, 1)."""
    c = np.cumsum(dist)
    i = int(np.searchsorted(c, u * c[-1], side="right"))
    return i if i < len(c) else int(np.flatnonzero(dist > 0)[-1])


def rule_sampler(rule: AcceptanceRule) -> Sampler:
    """A sampler following ``rule``, with the signature of :func:`learn2draft.sampling.speculative_sample`.

    For tests and negative controls only (it copies the probabilities to the host in float64);
    the engine decodes with :func:`~learn2draft.sampling.speculative_sample`.

    Returns:
        ``sampler(target_probs (γ+1, V), draft_probs (γ, V), draft_tokens int64 (γ,), generator)
        -> (num_accepted, next_token)``; it draws γ+1 float64 uniforms from ``generator``.
    """

    def sample(target_probs: torch.Tensor, draft_probs: torch.Tensor, draft_tokens: torch.Tensor,
               generator: torch.Generator | None = None) -> tuple[int, int]:
        gamma = int(draft_tokens.numel())
        u = torch.rand(gamma + 1, generator=generator, device=target_probs.device, dtype=torch.float64).tolist()
        p = target_probs.detach().double().cpu().numpy()
        q = draft_probs.detach().double().cpu().numpy() if gamma else None
        for i, x in enumerate(draft_tokens.reshape(-1).tolist()):
            if not u[i] < rule.accept_probability(float(p[i, x]), float(q[i, x])):
                return i, _draw(rule.correction(p[i], q[i]), u[gamma])
        return gamma, _draw(p[gamma] / p[gamma].sum(), u[gamma])

    sample.__name__ = sample.__qualname__ = f"rule_sampler[{rule.name}]"
    return sample


def resample_from_target_rule(target_probs: torch.Tensor, draft_probs: torch.Tensor, draft_tokens: torch.Tensor,
                              generator: torch.Generator | None = None) -> tuple[int, int]:
    """NEGATIVE CONTROL: the wrong rule "on rejection, resample from p" (:data:`RESAMPLE_FROM_TARGET_RULE`).

    Same signature and shapes as :func:`learn2draft.sampling.speculative_sample`; pass it as
    ``SpeculativeDecoder(..., sampler=resample_from_target_rule)`` to check that a law test flags
    a biased sampler. Its output law is ``min(p, q) + (1 − Σ min(p, q)) · p`` for one draft token,
    which differs from ``p`` whenever p ≠ q. Never use it to decode.
    """
    return _RESAMPLE_FROM_TARGET_SAMPLER(target_probs, draft_probs, draft_tokens, generator)


_RESAMPLE_FROM_TARGET_SAMPLER = rule_sampler(RESAMPLE_FROM_TARGET_RULE)


def tree_resample_from_target_rule(parents: torch.Tensor, tokens: torch.Tensor, target_probs: torch.Tensor,
                                   generator: torch.Generator | None = None) -> tuple[list[int], int]:
    """NEGATIVE CONTROL for trees: the classic mistake in the tree rule — when every child of the
    last accepted node is rejected, draw the token from the target's ``p`` at that node instead of
    the residual (``p`` with the rejected children removed, renormalised). The walk itself is the
    exact one (accept child x with probability p_res(x), EAGLE-2's
    :func:`~learn2draft.sampling.tree_speculative_sample`). It over-weights the drafted children, so
    its output law differs from the target's whenever a rejected child has p(x) > 0.

    Same signature and shapes as :func:`learn2draft.sampling.tree_speculative_sample` (``parents``,
    ``tokens`` int64 (N+1,), ``target_probs`` float (N+1, V)); pass it as ``tree_sampler=`` to see a
    law check fail. Never use it to decode (host float64 copies, slow).
    """
    par, tok = [int(x) for x in parents.tolist()], [int(x) for x in tokens.tolist()]
    children: list[list[int]] = [[] for _ in par]
    for i in range(1, len(par)):
        children[par[i]].append(i)
    p = target_probs.detach().double().cpu().numpy()

    def u() -> float:
        return float(torch.rand(1, generator=generator, dtype=torch.float64))

    accepted, node = [], 0
    while True:
        r = p[node] / p[node].sum()
        for c in children[node]:
            z = r.sum()
            if z > 0 and u() * z < r[tok[c]]:
                accepted.append(c)
                node = c
                break
            r = r.copy()
            r[tok[c]] = 0.0
        else:  # every child rejected (or a leaf: the bonus token, which is right)
            return accepted, _draw(p[node] / p[node].sum(), u())  # WRONG after rejections: should draw from r


# --------------------------------------------------------------------------------------------
# Two-sample statistics
# --------------------------------------------------------------------------------------------
def two_sample_test(a: Sequence[int], b: Sequence[int], min_expected: float = 5.0) -> dict:
    """Pearson chi-square test that two samples of categorical labels come from one law.

    The contingency table has one row per sample and one column per label. Labels whose expected
    count under the null falls below ``min_expected`` in either row are merged into one "rare"
    bin (Cochran's rule for the chi-square approximation); if that bin is itself too small it is
    merged into the smallest remaining column. No continuity correction (``correction=False``).

    Args:
        a, b: labels (ints), non-empty.
        min_expected: smallest expected cell count for a column to stay on its own.

    Returns:
        dict with ``chi2``, ``dof``, ``p_value`` (1.0 when fewer than two bins remain: nothing to
        compare), ``p_min`` (the smallest p-value any data of these sizes and bins could give: the
        test's reach, 1.0 at 0 degrees of freedom), ``tv`` (the plug-in total-variation distance ½ Σ |f_a − f_b| over unmerged labels,
        biased upwards by sampling noise: about sqrt(K/n) for K labels with n draws each),
        ``bins`` (columns tested), ``n_a``, ``n_b``, and ``counts_a``/``counts_b`` (label → count,
        labels as strings for JSON).

    Raises:
        ValueError: a sample is empty.
    """
    from scipy.stats import chi2 as chi2_dist
    from scipy.stats import chi2_contingency

    if not len(a) or not len(b):
        raise ValueError("Both samples must be non-empty.")
    ca, cb = Counter(int(x) for x in a), Counter(int(x) for x in b)
    na, nb = sum(ca.values()), sum(cb.values())
    labels = sorted(set(ca) | set(cb), key=lambda t: -(ca[t] + cb[t]))
    tv = 0.5 * sum(abs(ca[t] / na - cb[t] / nb) for t in labels)
    frac = min(na, nb) / (na + nb)  # expected count in the smaller row = column total × frac

    def ok(col):
        return (col[0] + col[1]) * frac >= min_expected

    cols, rare = [], [0, 0]
    for t in labels:
        col = [ca[t], cb[t]]
        if ok(col):
            cols.append(col)
        else:
            rare[0] += col[0]
            rare[1] += col[1]
    if sum(rare):
        if ok(rare) or not cols:
            cols.append(rare)
        else:
            smallest = min(range(len(cols)), key=lambda j: sum(cols[j]))
            cols[smallest] = [cols[smallest][0] + rare[0], cols[smallest][1] + rare[1]]
    if len(cols) < 2:
        chi2, dof, p = 0.0, 0, 1.0
    else:
        chi2, p, dof, _ = chi2_contingency(np.array(cols).T, correction=False)
    # Pearson's χ² of a 2-row table is at most its total count (complete separation).
    p_min = float(chi2_dist.sf(na + nb, dof)) if dof else 1.0
    return {
        "chi2": float(chi2), "dof": int(dof), "p_value": float(p), "p_min": p_min, "tv": float(tv),
        "bins": len(cols), "n_a": na, "n_b": nb,
        "counts_a": {str(k): v for k, v in sorted(ca.items())}, "counts_b": {str(k): v for k, v in sorted(cb.items())},
    }


def goodness_of_fit_test(sample: Sequence[int], probs: np.ndarray, min_expected: float = 5.0) -> dict:
    """Pearson chi-square test that a sample of token ids follows the exact law ``probs``.

    Tokens with expected count below ``min_expected`` are merged into one bin, itself merged into
    the smallest other bin when its expected count is still below ``min_expected`` (Cochran's
    rule). A sample containing a token of probability exactly 0 (or the :data:`ENDED` label, or an
    id outside the law) gets p-value 0: impossible under the law.

    Args:
        sample: token ids, non-empty.
        probs: float (V,), the exact law (sums to 1).

    Returns:
        dict with ``chi2``, ``dof``, ``p_value``, ``p_min`` (the smallest p-value any n draws could
        give over these bins: the test's reach, 1.0 at 0 degrees of freedom), ``tv`` (plug-in
        ½ Σ |f − p|), ``bins``, ``n`` and ``impossible`` (draws of probability-0 tokens).
    """
    from scipy.stats import chi2 as chi2_dist
    from scipy.stats import chisquare

    probs = np.asarray(probs, dtype=np.float64)
    n = len(sample)
    if not n:
        raise ValueError("The sample must be non-empty.")
    counts = Counter(int(x) for x in sample)
    impossible = sum(c for t, c in counts.items() if t < 0 or t >= len(probs) or probs[t] == 0)
    freq = np.zeros(len(probs))
    for t, c in counts.items():
        if 0 <= t < len(probs):
            freq[t] += c
    tv = 0.5 * (np.abs(freq / n - probs).sum() + sum(c for t, c in counts.items() if not 0 <= t < len(probs)) / n)
    big = probs * n >= min_expected
    obs = list(freq[big]) + [n - freq[big].sum()]
    exp = list(probs[big] * n) + [n - probs[big].sum() * n]
    if exp[-1] < min_expected and len(obs) > 1:  # the merged bin is too small on its own
        j = int(np.argmin(exp[:-1]))
        obs[j] += obs[-1]
        exp[j] += exp[-1]
        obs, exp = obs[:-1], exp[:-1]
    # the largest χ² n draws can give: all of them in the bin of smallest expected count, n²/e_min − n
    p_min = float(chi2_dist.sf(n * n / min(exp) - n, len(obs) - 1)) if len(obs) > 1 and min(exp) > 0 else 1.0
    if impossible:
        chi2, p, dof, p_min = float("inf"), 0.0, len(obs) - 1, 0.0
    elif len(obs) < 2:
        chi2, p, dof = 0.0, 1.0, 0
    else:
        exp = np.array(exp) * (sum(obs) / sum(exp))
        chi2, p = chisquare(np.array(obs), exp)
        dof = len(obs) - 1
    return {"chi2": float(chi2), "dof": int(dof), "p_value": float(p), "p_min": p_min, "tv": float(tv),
            "bins": len(obs), "n": n, "impossible": int(impossible)}


class _ForwardMemo:
    """Wraps a causal LM so that a forward seen before, on a cache built by the same forwards, is replayed
    (the same logits and hidden state; the same keys/values appended to the cache) instead of recomputed.

    The law check restarts the decoder on one prompt hundreds of times and keeps only the first few tokens, so
    the same forwards recur: the prompt's prefill in every draw, and, since a short sampled continuation takes
    few distinct values, most later forwards too (the reference arm's second-token forward, the draft's steps
    and the verification forwards along frequent drafts). Replaying a deterministic computation does not change
    what is sampled.

    A forward is identified by its input ids, its ``output_hidden_states`` flag and the *history* of the cache it
    extends: the list of forwards (their input ids) that wrote the cache's first ``cache.get_seq_length()``
    entries, with the cut inside the last one after a crop (``DynamicCache.crop``). So a hit replays exactly the
    computation a recomputation would do, on the same cache contents. A call with any other tensor argument
    (an attention mask, positions: trees, batched rows), or on a cache without ``layers[i].keys/values``, goes
    straight to the model and makes the cache's history unique, so nothing after it is replayed. So does a write
    to the cache between two calls that is not a crop: ``torch.cat`` gives new storage, and an in-place edit changes
    the sums of the first layer's keys per position; both are stamped after each call and compared at the next.

    A chain decoder feeds its target through the ragged forward of a :class:`learn2draft.batch_cache.BatchCache` (one
    row): such a forward (no ``cache=``; its plan is the batch cache's active one) is replayed the same way, its history
    kept per cache row and cut at the row's length (rolling back sets the length), its keys/values written into the
    row's slots. A ragged forward over several rows computes and leaves every row's history unique.

    Memory: each entry keeps its logits ((1, n, V) in the model's dtype), hidden state and keys/values; new
    entries stop being stored past ``max_bytes`` (the replayed ones still serve).
    """

    _HISTORY = "_law_memo_history"  # attribute on the cache: list of (ids tuple, tokens kept)
    _STAMP = "_law_memo_stamp"  # attribute on the cache: _stamp() after our last call

    def __init__(self, model, max_bytes: int = 1 << 30):
        self._wrapped = model
        self._memo: dict[tuple, tuple] = {}
        self._bytes = 0
        self._max_bytes = max_bytes
        self.hits = 0
        self.misses = 0

    def __getattr__(self, name):
        if name in ("_wrapped", "_memo"):  # not set yet (copy / unpickle): do not recurse
            raise AttributeError(name)
        return getattr(self._wrapped, name)

    @staticmethod
    def _stamp(cache):
        """The first layer's keys: their storage and each position's sum (inference tensors keep no version)."""
        layers = getattr(cache, "layers", None) or ()
        keys = getattr(layers[0], "keys", None) if layers else None
        if not isinstance(keys, torch.Tensor) or keys.numel() == 0:
            return None
        return keys.untyped_storage().data_ptr(), keys.double().sum(dim=(0, 1, 3))

    def _unseen_write(self, cache) -> bool:
        """Whether the cache changed since our last call other than by a crop (same storage, same first entries)."""
        before = getattr(cache, self._STAMP, None)
        if before is None:
            return False
        now = self._stamp(cache)
        if now is None:
            return False  # emptied: nothing left to replay on
        return self._changed(before, now)

    @staticmethod
    def _changed(before, now) -> bool:
        """Whether stamp ``now`` (storage, per-position sums) is not ``before`` cut to its length: other storage, more
        positions, or other sums (a write the memo did not see)."""
        return now[0] != before[0] or now[1].numel() > before[1].numel() or not torch.equal(
            now[1], before[1][: now[1].numel()])

    def _history(self, cache) -> list:
        """The forwards that wrote the cache's current entries, cut to its length."""
        hist = getattr(cache, self._HISTORY, None)
        if hist is None:
            hist = []
            setattr(cache, self._HISTORY, hist)
        return self._cut(hist, cache.get_seq_length(), self._unseen_write(cache))

    @staticmethod
    def _cut(hist: list, length: int, unseen: bool) -> list:
        """``hist`` (the forwards that wrote a cache, as (ids, tokens kept)) cut to the cache's ``length``, in place;
        replaced by one unique entry when the cache was written by something not seen here (``unseen``, or lengths
        that do not add up)."""
        kept = 0
        for i, (ids, n) in enumerate(hist):
            if kept + n > length:  # cut inside this forward's entries: keep its first ones
                del hist[i:]
                if length > kept:
                    hist.append((ids, length - kept))
                break
            kept += n
        if unseen or sum(n for _, n in hist) != length:  # nothing is replayed on it
            hist[:] = [(object(), length)] if length else []
        return hist

    def _store(self, key, entry) -> None:
        """Keep ``entry`` (tensors, or tuples / lists of them, or None) under ``key`` while within ``max_bytes``."""
        if self._bytes >= self._max_bytes:
            return
        self._memo[key] = entry

        def size(x):
            if isinstance(x, torch.Tensor):
                return x.numel() * x.element_size()
            return sum(size(y) for y in x) if isinstance(x, (list, tuple)) else 0

        self._bytes += size(entry)

    def _ragged(self, plan, input_ids, kwargs):
        """A ragged forward of ``plan`` (:class:`learn2draft.batch_cache.BatchCache`): replayed, or computed and
        stored, for a forward over one row with the keyword arguments the batch cache passes; else computed, every
        row's history made unique."""
        cache = plan.cache
        rows = getattr(cache, self._HISTORY, None)
        if rows is None:
            rows = {}
            setattr(cache, self._HISTORY, rows)
        if len(plan.groups) != 1 or plan.groups[0].nrows != 1 or not set(kwargs) <= {
                "position_ids", "use_cache", "output_hidden_states", "logits_to_keep"}:
            rows.clear()  # the rows' histories no longer add up to their lengths: nothing is replayed on them
            return self._wrapped(input_ids=input_ids, **kwargs)
        row, start, n = plan.groups[0].row0, cache.lengths[plan.groups[0].row0], int(input_ids.shape[-1])
        hist, before = rows.get(row, ([], None))
        now = self._row_stamp(cache, row, start)
        hist = self._cut(hist, start, before is not None and self._changed(before, now))
        hidden = bool(kwargs.get("output_hidden_states"))
        keep = kwargs.get("logits_to_keep", 0)
        ids = tuple(input_ids.reshape(-1).tolist())
        key = ("ragged", hidden, tuple(keep.tolist()) if isinstance(keep, torch.Tensor) else int(keep), tuple(hist),
               ids)
        hit = self._memo.get(key)
        slots = slice(start, start + n)
        if hit is None:
            self.misses += 1
            out = self._wrapped(input_ids=input_ids, **kwargs)
            last = out.hidden_states[-1].clone() if hidden else None
            kv = [(k[row, :, slots].clone(), v[row, :, slots].clone()) for k, v in zip(cache.keys, cache.values)]
            self._store(key, (out.logits.clone(), kv, last))
        else:
            self.hits += 1
            logits, kv, last = hit
            for (k, v), keys, values in zip(kv, cache.keys, cache.values):
                keys[row, :, slots] = k
                values[row, :, slots] = v
            out = SimpleNamespace(logits=logits.clone(), hidden_states=None if last is None else (last.clone(),))
        rows[row] = (hist + [(ids, n)], self._row_stamp(cache, row, start + n))
        return out

    @staticmethod
    def _row_stamp(cache, row: int, length: int):
        """A batch cache row's first layer's keys: their storage and the sum of each of its first ``length`` slots."""
        keys = cache.keys[0]
        return keys.untyped_storage().data_ptr(), keys[row, :, :length].double().sum(dim=(0, 2))

    def __call__(self, input_ids=None, cache=None, **kwargs):
        if cache is None and _ACTIVE and _ACTIVE[-1].cache.model is self:
            return self._ragged(_ACTIVE[-1], input_ids, kwargs)
        out = self._forward(input_ids, cache, **kwargs)
        if cache is not None and getattr(cache, "layers", None) is not None:
            setattr(cache, self._STAMP, self._stamp(cache))
        return out

    def _forward(self, input_ids, cache, **kwargs):
        layers = getattr(cache, "layers", None)
        plain = (input_ids is not None and input_ids.shape[0] == 1 and layers is not None
                 and all(hasattr(la, "keys") and hasattr(la, "values") for la in layers)
                 and set(kwargs) <= {"use_cache", "output_hidden_states"})
        if cache is None:
            return self._wrapped(input_ids=input_ids, cache=cache, **kwargs)
        hist = self._history(cache) if layers is not None else None
        if not plain or not kwargs.get("use_cache", True):
            out = self._wrapped(input_ids=input_ids, cache=cache, **kwargs)
            grown = cache.get_seq_length() - sum(n for _, n in hist) if hist is not None else 0
            if grown:
                hist.append((object(), grown))
            return out
        hidden = bool(kwargs.get("output_hidden_states"))
        ids = tuple(input_ids.reshape(-1).tolist())
        key = (hidden, tuple(hist), ids)
        hit = self._memo.get(key)
        start = cache.get_seq_length()
        if hit is None:
            self.misses += 1
            out = self._wrapped(input_ids=input_ids, cache=cache, **kwargs)
            grown = cache.get_seq_length() - start
            if grown == len(ids) and self._bytes < self._max_bytes:
                last = out.hidden_states[-1].clone() if hidden else None
                kv = [(la.keys[..., start:, :].clone(), la.values[..., start:, :].clone()) for la in cache.layers]
                self._store(key, (out.logits.clone(), kv, last))
            if grown:
                hist.append((ids if grown == len(ids) else object(), grown))
            return out
        self.hits += 1
        logits, kv, last = hit
        for i, (k, v) in enumerate(kv):
            cache.update(k.clone(), v.clone(), i)
        hist.append((ids, len(ids)))
        return SimpleNamespace(logits=logits.clone(), hidden_states=None if last is None else (last.clone(),))


def _memo_pair(pair: ModelPair) -> ModelPair:
    target = _ForwardMemo(pair.target)
    draft = pair.draft_model  # None for a pair without one (head and lookup drafters)
    if draft is not None:
        draft = target if draft is pair.target else _ForwardMemo(draft)
    return dataclasses.replace(pair, target=target, draft_model=draft)


def first_token_probs(pair: ModelPair, prompt_ids: torch.Tensor, sampling: SamplingConfig) -> np.ndarray:
    """The target's exact law of the token after ``prompt_ids`` (int64 (L,)): float64 (V,).

    Computed the way the loop's prefill computes it (one forward over the whole sequence),
    processed by ``sampling.probs``.
    """
    ids = torch.as_tensor(prompt_ids).reshape(-1).to(pair.device)
    with torch.inference_mode():
        logits = pair.target(input_ids=ids[None]).logits[0, -1:, : pair.vocab_size]
    return sampling.probs(logits, ids, source="target")[0].double().cpu().numpy()


def conditional_exact_tests(
    pair: ModelPair, prompt_ids: torch.Tensor, tokens: np.ndarray, sampling: SamplingConfig,
    memo: dict, min_count: int = 20, max_strata: int = 3,
) -> list[dict]:
    """Exact tests of the second token given the first: for each of the ``max_strata`` most frequent
    first tokens x1 with at least ``min_count`` draws, :func:`goodness_of_fit_test` of the second
    tokens of those draws against the target's exact law p(· | prompt, x1).

    The first token comes from the prefill (plain sampling), so the first token where the
    speculative rule acts is the second; conditioning on x1 keeps the test exact (draws are
    independent given x1). ``tokens``: int64 (n, ≥ 2) draws; ``memo``: x1 → law, shared between arms.

    Returns: one dict per stratum, with ``given`` = x1 and the test's fields.
    """
    if tokens.shape[1] < 2:
        return []
    first, counts = np.unique(tokens[:, 0], return_counts=True)
    out = []
    for x1 in first[np.argsort(-counts, kind="stable")][:max_strata]:
        x1 = int(x1)
        sel = tokens[tokens[:, 0] == x1, 1]
        if x1 == ENDED or x1 in pair.eos_token_ids or sel.size < min_count:
            continue
        if x1 not in memo:
            ids = torch.cat([torch.as_tensor(prompt_ids).reshape(-1).to(pair.device), torch.tensor([x1], device=pair.device)])
            memo[x1] = first_token_probs(pair, ids, sampling)
        out.append({"given": x1, **goodness_of_fit_test(sel, memo[x1])})
    return out


# --------------------------------------------------------------------------------------------
# Real-model law check
# --------------------------------------------------------------------------------------------
def _seed(*key: int) -> int:
    return int(np.random.SeedSequence([int(k) for k in key]).generate_state(1)[0])


def sample_first_tokens(
    pair: ModelPair,
    prompt_ids: torch.Tensor,
    controller: DraftController,
    sampling: SamplingConfig,
    num_tokens: int,
    seeds: Sequence[int],
    sampler: Sampler = speculative_sample,
    drafter: str = "model",
    head: str | None = None,
    tree: TreeShape | None = None,
    tree_sampler: Callable = tree_speculative_sample,
    min_ngram: int | None = None,
) -> tuple[np.ndarray, dict]:
    """Run the real draft/verify loop once per seed and keep the first ``num_tokens`` tokens.

    The decoder is driven cycle by cycle (:meth:`SpeculativeDecoder.start` /
    :meth:`~SpeculativeDecoder.run_cycle`) until at least ``num_tokens`` tokens are emitted or the
    generation ends; ``max_new_tokens`` is ``num_tokens + controller.max_depth`` so the cap never
    shortens a block that still contributes to the first ``num_tokens`` tokens.

    Args:
        prompt_ids: int64 (L,).
        controller: decides the depth (``FixedDepthController(0)`` is plain sampling).
        seeds: one per sample; the decoder's generator is seeded with it.
        sampler: the acceptance rule (:func:`speculative_sample` or a negative control).
        drafter: ``"model" | "head" | "lookup"`` (:func:`learn2draft.drafters.make_drafter`).
        tree: draft trees of this shape (:class:`learn2draft.tree.TreeSpeculativeDecoder`; the
            controller decides depth, and verification size when it overrides
            ``verification_size``, e.g. :class:`learn2draft.tree.FixedTreeController`); None: a chain.
        tree_sampler: the tree acceptance rule (:func:`tree_speculative_sample` or
            :func:`tree_resample_from_target_rule`), with ``tree`` only.
        min_ngram: prompt lookup's shortest n-gram match (lookup and hybrid drafters; None: the default).

    Returns:
        ``(tokens, stats)``: int64 array (len(seeds), num_tokens), :data:`ENDED` after an EOS;
        stats: ``seconds``, ``cycles``, ``drafted`` (draft tokens; tree levels for a tree),
        ``verified`` (tokens sent to the target), ``accepted`` totals.

    Raises:
        ValueError: a tree with the lookup drafter.
    """
    max_depth = decoder_max_depth(controller)
    dec = make_decoder(pair, sampling, num_tokens + max_depth, max_depth, drafter, head, tree,
                       sampler if tree is None else tree_sampler, min_ngram=min_ngram)
    out = np.full((len(seeds), num_tokens), ENDED, dtype=np.int64)
    stats = {"seconds": 0.0, "cycles": 0, "drafted": 0, "verified": 0, "accepted": 0}
    t0 = time.perf_counter()
    for r, s in enumerate(seeds):
        controller.reset()
        dec.start(prompt_ids, seed=int(s))
        while not dec.finished and dec.generated < num_tokens:
            c = dec.run_cycle(controller)
            stats["cycles"] += 1
            stats["drafted"] += c.depth
            stats["verified"] += c.verify_size
            stats["accepted"] += c.num_accepted
        toks = dec.ids[dec.prompt_len:][:num_tokens].tolist()
        out[r, : len(toks)] = toks
    stats["seconds"] = time.perf_counter() - t0
    return out, stats


def law_check(pair: ModelPair, controllers: dict[str, DraftController], prompts: Sequence[str | torch.Tensor],
              sampling: SamplingConfig = SamplingConfig(temperature=0.8, top_p=0.95), num_tokens: int = 3,
              num_samples: int = 200, seed: int = 0, sampler: Sampler = speculative_sample, alpha: float = 0.01,
              chat: bool = True, progress: bool = False, drafter: str = "model", head: str | None = None,
              tree: TreeShape | Mapping[str, TreeShape | None] | None = None,
              tree_sampler: Callable = tree_speculative_sample, min_ngram: int | None = None) -> dict:
    """Compare speculative sampling under each controller with plain sampling, on real models (``drafter`` drafting
    for every controller's arm; prompt lookup's shortest match ``min_ngram``, :func:`sample_first_tokens`).

    For each prompt, the first ``num_tokens`` tokens are drawn ``num_samples`` times with plain
    autoregressive sampling (``FixedDepthController(0)``, always with the exact sampler) and
    ``num_samples`` times under each controller with ``sampler``. Every draw uses its own seed, and
    the arms use disjoint seeds, so the samples are independent. Tests:

    * two-sample, for every (prompt, controller, position): the controller's and the plain arm's
      marginal token laws, by :func:`two_sample_test` (chi-square on the contingency table, rare
      tokens merged), with the estimated total-variation distance;
    * exact, at position 1 for every arm (the plain one included): the first token's law is known
      exactly (one target forward, :func:`first_token_probs`), so each arm is also tested against
      it by :func:`goodness_of_fit_test` — twice the power of the two-sample test for the same
      draws, since only one side is noisy. The first token comes from the prefill, so the
      speculative rule first acts at position 2: :func:`conditional_exact_tests` tests each
      controller's second token against its exact law given the first token (the most frequent
      first tokens, one stratum each).

    Verdict: Bonferroni over all m tests — a test is flagged when its p-value is below
    ``alpha / m``, and the check passes when none is, so a correct sampler fails it with
    probability at most ``alpha`` (up to the chi-square approximation). A check without power is
    not a pass: when, for some controller, no test could reach a p-value below ``alpha / m`` with
    these sample sizes and bins (``p_min``; e.g. 10 draws, or 0 degrees of freedom), the verdict is
    INCONCLUSIVE and ``passed`` is False.

    A forward already computed on the same cache history (the prompt's prefill in every draw, and
    the later forwards of frequent continuations) is replayed, not recomputed (:class:`_ForwardMemo`;
    it returns exactly what recomputation would), so a draw costs at most about ``num_tokens`` target
    forwards plus the draft's steps, and far less where draws repeat.

    Cost: ``num_samples × (1 + len(controllers)) × len(prompts)`` short generations.

    Args:
        pair: target/draft models.
        controllers: name → controller; each gets its own decoder with ``max_depth = controller.max_depth``.
        prompts: text (encoded with :meth:`ModelPair.encode_prompt`, through the chat template when
            ``chat``) or int64 (L,) token ids.
        sampling: applied to target and draft alike; must not be greedy.
        num_tokens: k, positions compared (≥ 1).
        num_samples: draws per arm and prompt (≥ 10).
        seed: base seed; the result is a deterministic function of it.
        sampler: acceptance rule for the controllers' arms (:func:`resample_from_target_rule` to
            see the check fail).
        alpha: family-wise false-alarm rate, in (0, 1).
        chat: encode text prompts through the tokenizer's chat template.
        progress: print one line per arm.
        drafter: ``"model" | "head" | "lookup"``, the drafter of every controller's arm.
        tree: draft trees (:class:`learn2draft.tree.TreeSpeculativeDecoder`, EAGLE-2 drafting and
            the point-mass tree rule): a :class:`~eval.runner.TreeShape` for every controller's arm,
            or controller name → shape (None or absent: that arm drafts a chain), so chain and tree
            arms share one reference arm and one Bonferroni correction. A tree arm's controller
            decides the depth and, when it overrides ``verification_size`` (a
            :class:`~learn2draft.tree.FixedTreeController`, a size policy), V; else every node is verified.
        tree_sampler: the tree arms' acceptance rule (:func:`tree_resample_from_target_rule` to see
            the check fail).

    Returns:
        JSON-serialisable dict: ``passed`` (bool: conclusive and nothing flagged), ``conclusive``
        (bool), ``verdict`` (str: PASS / FAIL / INCONCLUSIVE), ``num_tests`` m,
        ``threshold`` (alpha / m), ``min_p_value``, ``max_tv``, ``tests`` (one dict per test:
        prompt, controller, position, kind ("two-sample" or "exact"), chi2, dof, p_value,
        p_bonferroni = min(1, m·p), p_min, can_reject, tv, bins, flagged, and counts for two-sample tests), ``arms``
        (per prompt and arm: seconds, cycles, drafted, verified, accepted, mean accepted length,
        and ``tree`` ({"width", "top_k"}) for a tree arm), ``trees`` (arm → shape, tree arms only)
        and the settings.

    Raises:
        ValueError: greedy sampling (nothing random to compare), no controllers or prompts, an
            argument out of range, a ``tree`` mapping naming no controller, or trees with the lookup drafter.
    """
    _check_law_arguments(controllers, prompts, sampling, num_tokens, num_samples, alpha)
    trees = _tree_arms(tree, controllers, drafter)
    arms_meta, tests = [], []
    memo = _memo_pair(pair)
    for pi, prompt in enumerate(prompts):
        _draw_and_test(pair, memo, pi, pair.encode_prompt(prompt, chat=chat), controllers, trees, sampling,
                       num_tokens, num_samples, seed, sampler, drafter, head, tree_sampler, progress, arms_meta, tests,
                       min_ngram)
    return {**_verdict(tests, controllers, alpha, num_samples), "tests": tests, "arms": arms_meta,
            **_law_settings(sampling, sampler, tree_sampler, trees, num_tokens, num_samples, seed, prompts, drafter),
            **({"lookup_min_ngram": min_ngram} if min_ngram is not None else {})}


def _check_law_arguments(controllers, prompts, sampling: SamplingConfig, num_tokens: int, num_samples: int,
                         alpha: float) -> None:
    """Refuse greedy sampling, no controllers or prompts, and sizes or ``alpha`` out of range."""
    if sampling.greedy:
        raise ValueError("law_check needs sampling (temperature > 0): greedy output is deterministic.")
    if not controllers:
        raise ValueError("Pass at least one controller to compare with plain sampling.")
    if not prompts:
        raise ValueError("Pass at least one prompt.")
    if num_tokens < 1 or num_samples < 10:
        raise ValueError(f"Need num_tokens ≥ 1 and num_samples ≥ 10, got {num_tokens} and {num_samples}.")
    if not 0 < alpha < 1:
        raise ValueError(f"alpha must be in (0, 1), got {alpha}.")


def _tree_arms(tree, controllers, drafter: str) -> dict[str, TreeShape | None]:
    """Each controller's tree shape (None: a chain), checked against the controllers and the drafter."""
    if isinstance(tree, Mapping):
        unknown = sorted(set(tree) - set(controllers))
        if unknown:
            raise ValueError(f"tree names arms {unknown} that are not controllers ({sorted(controllers)}).")
        trees = {name: tree.get(name) for name in controllers}
    else:
        trees = {name: tree for name in controllers}
    for shape in trees.values():
        if shape is not None and not isinstance(shape, TreeShape):
            raise ValueError(f"tree must be an eval.runner.TreeShape (width, top_k), got {shape!r}.")
    if drafter == "lookup" and any(trees.values()):
        raise ValueError("The lookup drafter does not draft trees: use drafter='model' or 'head' for tree arms.")
    return trees


def _draw_and_test(pair, memo, pi, ids, controllers, trees, sampling, num_tokens, num_samples, seed, sampler, drafter,
                   head, tree_sampler, progress, arms_meta: list, tests: list, min_ngram: int | None = None) -> None:
    """Draw the plain arm and every controller's arm on prompt ``pi``; append their stats and tests."""
    seeds = lambda arm: [_seed(seed, pi, arm, s) for s in range(num_samples)]  # noqa: E731
    exact = first_token_probs(pair, ids, sampling)
    exact2: dict = {}
    ref, st = sample_first_tokens(memo, ids, FixedDepthController(0), sampling, num_tokens, seeds(0))
    arms_meta.append({"prompt": pi, "arm": "autoregressive", **st})
    tests.append({"prompt": pi, "controller": "autoregressive", "position": 1, "kind": "exact",
                  **goodness_of_fit_test(ref[:, 0], exact)})
    if progress:
        print(f"law check: prompt {pi} autoregressive {st['seconds']:.1f} s", flush=True)
    for ai, (name, ctrl) in enumerate(controllers.items(), start=1):
        got, st = sample_first_tokens(memo, ids, ctrl, sampling, num_tokens, seeds(ai), sampler, drafter, head,
                                      trees[name], tree_sampler, min_ngram)
        st["mean_accepted"] = st["accepted"] / st["cycles"] if st["cycles"] else 0.0
        if trees[name] is not None:
            st["tree"] = dataclasses.asdict(trees[name])
        arms_meta.append({"prompt": pi, "arm": name, **st})
        if progress:
            print(f"law check: prompt {pi} {name} {st['seconds']:.1f} s, τ̄ = {st['mean_accepted']:.2f}",
                  flush=True)
        tests.append({"prompt": pi, "controller": name, "position": 1, "kind": "exact",
                      **goodness_of_fit_test(got[:, 0], exact)})
        for res in conditional_exact_tests(pair, ids, got, sampling, exact2):
            tests.append({"prompt": pi, "controller": name, "position": 2, "kind": "exact", **res})
        for j in range(num_tokens):
            res = two_sample_test(ref[:, j], got[:, j])
            tests.append({"prompt": pi, "controller": name, "position": j + 1, "kind": "two-sample", **res})


def _verdict(tests: list[dict], controllers, alpha: float, num_samples: int) -> dict:
    """Bonferroni over all tests (each gets p_bonferroni, flagged, can_reject) and the verdict."""
    m = len(tests)
    threshold = alpha / m
    for t in tests:
        t["p_bonferroni"] = min(1.0, t["p_value"] * m)
        t["flagged"] = t["p_value"] < threshold
        t["can_reject"] = t["p_min"] < threshold
    flagged = sum(t["flagged"] for t in tests)
    # A controller none of whose tests could reject at this sample size was not tested at all.
    untested = [name for name in controllers
                if not any(t["can_reject"] for t in tests if t["controller"] == name)]
    conclusive = bool(flagged) or not untested
    passed = conclusive and not flagged
    min_p = min(t["p_value"] for t in tests)
    if flagged:
        verdict = f"FAIL: {flagged} of {m} tests reject the target's law"
    elif untested:
        verdict = (f"INCONCLUSIVE: no test of {', '.join(untested)} could reject the target's law with "
                   f"{num_samples} samples per arm (too few draws, or too few bins): raise the number of samples")
    else:
        verdict = "PASS: no test rejects the target's law"
    return {
        "passed": passed,
        "conclusive": conclusive,
        "verdict": verdict,
        "num_tests": m,
        "alpha": alpha,
        "threshold": threshold,
        "min_p_value": min_p,
        "max_tv": max(t["tv"] for t in tests),
    }


def _law_settings(sampling, sampler, tree_sampler, trees, num_tokens, num_samples, seed, prompts, drafter) -> dict:
    """The settings recorded with the result: sampling, acceptance rules, sizes, seed, drafter and tree shapes."""
    sampler_name = getattr(sampler, "__name__", repr(sampler))
    if any(trees.values()):
        sampler_name += f" / tree: {getattr(tree_sampler, '__name__', repr(tree_sampler))}"
    return {
        "sampling": sampling.to_dict(),
        "sampler": sampler_name,
        "num_tokens": num_tokens,
        "num_samples": num_samples,
        "seed": seed,
        "num_prompts": len(prompts),
        "drafter": drafter,
        "trees": {name: dataclasses.asdict(t) for name, t in trees.items() if t is not None},
    }


def format_law_table(result: dict) -> str:
    """Render a :func:`law_check` result as a Markdown table plus a verdict line.

    One row per (prompt, controller, position): χ², degrees of freedom, p-value, Bonferroni
    p-value, estimated TV distance, and ✗ where the test is flagged.
    """
    defaults = SamplingConfig().to_dict()
    settings = ", ".join(f"{k}={v}" for k, v in result["sampling"].items() if k == "temperature" or v != defaults[k])
    lines = [
        f"Output-law check: first {result['num_tokens']} tokens, {result['num_samples']} samples per arm, "
        f"{result['num_prompts']} prompt(s), sampling {settings}, sampler `{result['sampler']}`, "
        f"seed {result['seed']}.",
        "",
        "| prompt | controller | position | test | χ² | dof | p-value | p (Bonferroni) | TV (estimate) | flagged |",
        "|---:|---|---:|---|---:|---:|---:|---:|---:|:---:|",
    ]
    for t in result["tests"]:
        test = "vs plain sampling" if t.get("kind") != "exact" else (
            f"vs exact p given token 1 = {t['given']}" if "given" in t else "vs exact p")
        lines.append(
            f"| {t['prompt']} | {t['controller']} | {t['position']} | {test} | {t['chi2']:.2f} | {t['dof']} | "
            f"{t['p_value']:.3g} | {t['p_bonferroni']:.3g} | {t['tv']:.3f} | {'✗' if t['flagged'] else ''} |"
        )
    arms = [a for a in result.get("arms", []) if a["arm"] != "autoregressive"]
    if arms:
        lines += ["", "Mean accepted length per cycle: " + ", ".join(
            f"{a['arm']} (prompt {a['prompt']}) τ̄ = {a.get('mean_accepted', 0):.2f}" for a in arms) + "."]
    idle = sorted({a["arm"] for a in arms} - {a["arm"] for a in arms if a.get("drafted", 0) > 0})
    if idle:
        lines += ["", f"Note: {', '.join(idle)} never drafted a token in these draws: those arms sampled from the "
                      "target alone, so their PASS says nothing about the speculative rule (use a prompt or settings "
                      "where they draft)."]
    if result.get("trees"):
        lines += ["", "Tree arms (TreeSpeculativeDecoder, EAGLE-2 drafting, point-mass tree rule): " + ", ".join(
            f"{name} (W={t['width']}, top-k={t['top_k']})" for name, t in result["trees"].items()) + "."]
    lines += [
        "",
        f"**{result['verdict']}** (Bonferroni over {result['num_tests']} tests: flagged when p < "
        f"{result['alpha']:g}/{result['num_tests']} = {result['threshold']:.2g}; "
        f"smallest p = {result['min_p_value']:.3g}; "
        "the TV estimates are biased upwards by sampling noise).",
    ]
    return "\n".join(lines)


__all__ = [
    "AcceptanceRule", "ENDED", "LEVIATHAN_RULE", "RESAMPLE_FROM_TARGET_RULE", "conditional_exact_tests",
    "first_token_probs", "format_law_table",
    "goodness_of_fit_test", "law_check", "resample_from_target_rule", "rule_sampler", "sample_first_tokens",
    "tree_resample_from_target_rule", "two_sample_test",
]
