"""The features a drafting policy sees, and their portable specification.

Every feature is known *before* the decision it informs: the depth policy decides whether to
draft the next token from the tokens drafted so far, never from the value of a token it has not
yet drawn (drawing first and then choosing whether to verify it would bias the output law).

The specification (:func:`feature_spec`) is saved next to every exported policy so that an
inference engine can rebuild the same float32 vector without this package.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

FEATURE_VERSION = 2  # 2: drafter features match_len, match_count; first token from the prefill
HISTORY = 4  # recent accepted lengths in the observation
CONTEXT_SCALE = 2048.0  # context length is divided by this, then clipped to [0, 1]

FEATURE_NAMES: tuple[str, ...] = (
    "context_len",
    "depth",
    *(f"accepted_len_t-{i + 1}" for i in range(HISTORY)),
    "last_confidence",
    "last_entropy",
    "cum_confidence",
    "mean_confidence",
    "last_accept_fraction",
    "progress",
    "match_len",
    "match_count",
)

FEATURE_DOCS: dict[str, str] = {
    "context_len": f"(committed tokens (prompt + generated) + tokens drafted so far this cycle) / {CONTEXT_SCALE:g}, "
                   "clipped to [0, 1]",
    "depth": "tokens drafted so far this cycle / max_depth",
    **{f"accepted_len_t-{i + 1}": f"accepted length τ of the cycle {i + 1} back / max_depth (0 before it exists)"
       for i in range(HISTORY)},
    "last_confidence": "max softmax probability of the draft's raw logits at the last drafted token (0 at depth 0)",
    "last_entropy": "entropy (nats) of the draft's raw softmax at the last drafted token / ln V (0 at depth 0)",
    "cum_confidence": "product of last_confidence over this cycle's drafted tokens (1 at depth 0)",
    "mean_confidence": "mean of last_confidence over this cycle's drafted tokens (0 at depth 0)",
    "last_accept_fraction": "τ / depth of the previous cycle (1 if it drafted nothing or before any cycle)",
    "progress": "tokens generated so far / max_new_tokens",
    "match_len": "prompt-lookup drafter only (0 for the others): length of the n-gram match behind the next "
                 "proposal, extended backwards, min(length, 16) / 16; 0 when nothing matches",
    "match_count": "prompt-lookup drafter only (0 for the others): earlier occurrences of the matched n-gram, "
                   "min(count, 8) / 8",
}


def feature_spec(max_depth: int) -> dict:
    """JSON-serialisable description of the observation vector (float32, shape (len(FEATURE_NAMES),))."""
    return {
        "version": FEATURE_VERSION,
        "dtype": "float32",
        "shape": [len(FEATURE_NAMES)],
        "max_depth": max_depth,
        "history": HISTORY,
        "context_scale": CONTEXT_SCALE,
        "features": [{"name": n, "index": i, "definition": FEATURE_DOCS[n]} for i, n in enumerate(FEATURE_NAMES)],
    }


def build_features(
    context_len: int,
    depth: int,
    max_depth: int,
    accepted_history: Sequence[int],
    confidences: Sequence[float],
    last_entropy: float,
    vocab_size: int,
    last_accept_fraction: float,
    generated: int,
    max_new_tokens: int,
    drafter_features: Sequence[float] | None = None,
) -> np.ndarray:
    """Assemble the observation vector described by :data:`FEATURE_NAMES`.

    ``drafter_features``: the drafter's two features (``match_len``, ``match_count``; see
    :meth:`learn2draft.drafters.Drafter.features`), zeros when None.

    Returns:
        float32 array of shape (len(FEATURE_NAMES),), every entry in [0, 1].
    """
    hist = list(accepted_history)[-HISTORY:][::-1]
    hist += [0] * (HISTORY - len(hist))
    conf = list(confidences)
    out = [
        min(context_len / CONTEXT_SCALE, 1.0),
        depth / max_depth,
        *(min(h / max_depth, 1.0) for h in hist),
        conf[-1] if conf else 0.0,
        (last_entropy / math.log(vocab_size)) if conf else 0.0,
        float(np.prod(conf)) if conf else 1.0,
        float(np.mean(conf)) if conf else 0.0,
        last_accept_fraction,
        min(generated / max_new_tokens, 1.0),
        *(drafter_features if drafter_features is not None else (0.0, 0.0)),
    ]
    return np.clip(np.asarray(out, dtype=np.float32), 0.0, 1.0)


# --------------------------------------------------------------------------------------------
# The verification-size policy of draft trees (issue 8)
# --------------------------------------------------------------------------------------------
SIZE_FEATURE_VERSION = 1
#: Ranks r at which the sorted tree node probabilities are read (LTD's size choices span 1..64).
SIZE_RANKS: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 48, 64)
#: Tree sizes are divided by this, then clipped to [0, 1].
SIZE_NODE_SCALE = 64.0

SIZE_FEATURE_NAMES: tuple[str, ...] = (
    "context_len",
    "depth",
    *(f"accepted_len_t-{i + 1}" for i in range(HISTORY)),
    "last_accept_fraction",
    "tree_nodes",
    *(f"node_prob_r{r}" for r in SIZE_RANKS),
    *(f"expected_accepted_r{r}" for r in SIZE_RANKS),
)

SIZE_FEATURE_DOCS: dict[str, str] = {
    "context_len": f"committed tokens (prompt + generated) / {CONTEXT_SCALE:g}, clipped to [0, 1]",
    "depth": "levels of the draft tree (draft forwards this cycle) / max_depth",
    **{f"accepted_len_t-{i + 1}": f"accepted length τ of the cycle {i + 1} back / max_depth (0 before it exists)"
       for i in range(HISTORY)},
    "last_accept_fraction": "τ / depth of the previous cycle (1 if it drafted nothing or before any cycle)",
    "tree_nodes": f"drafted nodes N / {SIZE_NODE_SCALE:g}, clipped to [0, 1]",
    **{f"node_prob_r{r}": f"exp(score) of the {r}-th best drafted node (its path's draft probability; the "
                          "nodes sorted by score, decreasing), 0 when the tree has fewer nodes" for r in SIZE_RANKS},
    **{f"expected_accepted_r{r}": f"sum of exp(score) over the {r} best drafted nodes / max_depth, clipped to [0, 1]: "
                                  f"the accepted length the draft expects when verifying V = {r}"
       for r in SIZE_RANKS},
}


def size_feature_spec(max_depth: int) -> dict:
    """JSON-serialisable description of the verification-size observation (float32,
    shape (len(SIZE_FEATURE_NAMES),)), saved next to an exported size policy.

    The size policy decides V once drafting stops, from draft-side information only (the tree's
    scores and depth, the context, the accepted lengths of past cycles): reading anything the
    target computes this cycle would break the law of :func:`learn2draft.sampling.tree_speculative_sample`.
    """
    return {
        "version": SIZE_FEATURE_VERSION,
        "dtype": "float32",
        "shape": [len(SIZE_FEATURE_NAMES)],
        "max_depth": max_depth,
        "history": HISTORY,
        "context_scale": CONTEXT_SCALE,
        "node_scale": SIZE_NODE_SCALE,
        "ranks": list(SIZE_RANKS),
        "features": [{"name": n, "index": i, "definition": SIZE_FEATURE_DOCS[n]}
                     for i, n in enumerate(SIZE_FEATURE_NAMES)],
    }


def build_size_features(
    scores: Sequence[float] | np.ndarray,
    depth: int,
    max_depth: int,
    context_len: int,
    accepted_history: Sequence[int],
    last_accept_fraction: float,
) -> np.ndarray:
    """Assemble the verification-size observation described by :data:`SIZE_FEATURE_NAMES`.

    Args:
        scores: the drafted nodes' scores (cumulative draft log-probabilities, ≤ 0), any order;
            the root excluded.
        depth: levels of the tree; ``max_depth``: the decoder's (> 0).
        context_len: committed tokens (prompt + generated).
        accepted_history: accepted lengths τ of the past cycles, oldest first.
        last_accept_fraction: τ / depth of the previous cycle.

    Returns:
        float32 array of shape (len(SIZE_FEATURE_NAMES),), every entry in [0, 1].
    """
    probs = np.sort(np.exp(np.asarray(scores, dtype=np.float64).reshape(-1)))[::-1]
    cum = np.cumsum(probs)
    hist = list(accepted_history)[-HISTORY:][::-1]
    hist += [0] * (HISTORY - len(hist))
    out = [
        min(context_len / CONTEXT_SCALE, 1.0),
        depth / max_depth,
        *(min(h / max_depth, 1.0) for h in hist),
        last_accept_fraction,
        min(probs.size / SIZE_NODE_SCALE, 1.0),
        *(probs[r - 1] if probs.size >= r else 0.0 for r in SIZE_RANKS),
        *((cum[min(r, cum.size) - 1] / max_depth) if cum.size else 0.0 for r in SIZE_RANKS),
    ]
    return np.clip(np.asarray(out, dtype=np.float32), 0.0, 1.0)


# --------------------------------------------------------------------------------------------
# Engine-visible features: what vLLM's draft-length policy protocol hands a policy
# --------------------------------------------------------------------------------------------
ENGINE_FEATURE_VERSION = 1
#: Top-1 draft probabilities of the last tokens, newest first, in the engine-visible observation.
ENGINE_HISTORY = 3
#: The first decision an engine asks for comes after this many drafted tokens: vLLM drafts a seed
#: token, then calls ``update(step=0, …)`` after the second, so its policy never sees the seed's
#: probability and keeps at least 2 tokens (``k_valid = step + 2`` on the first stop).
ENGINE_MIN_DEPTH = 2

ENGINE_FEATURE_NAMES: tuple[str, ...] = (
    "depth",
    *(f"top1_prob_t-{i}" for i in range(ENGINE_HISTORY)),
    "mean_top1_prob",
    "min_top1_prob",
    "cum_top1_prob",
)

ENGINE_FEATURE_DOCS: dict[str, str] = {
    "depth": "tokens drafted so far this cycle, the seed included (vLLM: step + 2) / max_depth",
    **{f"top1_prob_t-{i}": f"top-1 probability of the draft's distribution for the token drafted {i} steps before the "
                           "newest one, the seed excluded (vLLM: token_probs of update(step − " + str(i) + ")); "
                           "0 before it exists" for i in range(ENGINE_HISTORY)},
    "mean_top1_prob": "mean of the top-1 probabilities of this cycle's drafted tokens, the seed excluded",
    "min_top1_prob": "minimum of the same",
    "cum_top1_prob": "product of the same",
}


def engine_feature_spec(max_depth: int) -> dict:
    """JSON-serialisable description of the engine-visible observation (float32, shape
    (len(ENGINE_FEATURE_NAMES),)) read by policies meant for vLLM's draft-length policy protocol
    (:mod:`policies.vllm`): only the draft step and the draft's top-1 probabilities, which the
    engine computes anyway. For a batch, the engine passes one probability per sequence and the
    adapter uses their mean (as vLLM's own ``ConfidenceThresholdPolicy`` does)."""
    return {
        "version": ENGINE_FEATURE_VERSION,
        "kind": "engine",
        "dtype": "float32",
        "shape": [len(ENGINE_FEATURE_NAMES)],
        "max_depth": max_depth,
        "history": ENGINE_HISTORY,
        "min_depth": ENGINE_MIN_DEPTH,
        "features": [{"name": n, "index": i, "definition": ENGINE_FEATURE_DOCS[n]}
                     for i, n in enumerate(ENGINE_FEATURE_NAMES)],
    }


def build_engine_features(depth: int, max_depth: int, top1_probs: Sequence[float]) -> np.ndarray:
    """Assemble the engine-visible observation described by :data:`ENGINE_FEATURE_NAMES`.

    Args:
        depth: tokens drafted so far this cycle, the seed included (≥ :data:`ENGINE_MIN_DEPTH` at
            an engine's decisions).
        max_depth: the engine's ``num_speculative_tokens`` (> 0).
        top1_probs: top-1 draft probabilities of the tokens drafted after the seed, oldest first.

    Returns:
        float32 array of shape (len(ENGINE_FEATURE_NAMES),), every entry in [0, 1].
    """
    p = [float(x) for x in top1_probs]
    hist = p[::-1][:ENGINE_HISTORY]
    hist += [0.0] * (ENGINE_HISTORY - len(hist))
    out = [depth / max_depth, *hist, float(np.mean(p)) if p else 0.0, min(p) if p else 0.0,
           float(np.prod(p)) if p else 1.0]
    return np.clip(np.asarray(out, dtype=np.float32), 0.0, 1.0)


# --------------------------------------------------------------------------------------------
# Hardware-profile features: one policy for several machines (issue 10, item 6)
# --------------------------------------------------------------------------------------------
PROFILE_FEATURE_VERSION = 1
#: Verified-token counts n whose cost relative to one token is a profile feature.
PROFILE_VERIFY_TOKENS: tuple[int, ...] = (2, 4, 8, 16)
#: The context length (committed tokens) at which a profile's costs are read for its features.
PROFILE_REFERENCE_CONTEXT = 512.0

PROFILE_FEATURE_NAMES: tuple[str, ...] = (
    *(f"profile_verify_{n}" for n in PROFILE_VERIFY_TOKENS),
    "profile_draft_step",
    "profile_cycle_overhead",
)

PROFILE_FEATURE_DOCS: dict[str, str] = {
    **{f"profile_verify_{n}": f"1 − verify(1) / verify({n}) from the latency profile at context "
                              f"{PROFILE_REFERENCE_CONTEXT:g}: the share of a {n}-token verification spent on the extra "
                              "tokens (0: verifying more is free, as on a memory-bound GPU; → 1: it costs n× one token)"
       for n in PROFILE_VERIFY_TOKENS},
    "profile_draft_step": "s / (1 + s), s = (draft_step + step_overhead) / verify(1) of the policy's drafter at context "
                          f"{PROFILE_REFERENCE_CONTEXT:g}: what one draft decision costs against one target forward",
    "profile_cycle_overhead": "o / (1 + o), o = cycle_overhead / verify(1) at the same context",
}


def profile_features(profile, drafter: str) -> np.ndarray:
    """The hardware-profile features of :data:`PROFILE_FEATURE_NAMES`: a constant vector per machine and drafter
    that a profile-conditioned policy reads after the loop's features (:data:`FEATURE_NAMES`), so that one
    policy can serve machines whose verification and drafting costs differ (a CPU where verifying 8 tokens
    costs ~2× one, a GPU where it costs ~1.01×).

    Each cost ratio r ≥ 0 is mapped into [0, 1) without a cap (``1 − 1/r`` for verification growth,
    ``r / (1 + r)`` for the draft and overhead costs), so a machine outside the training range still gets
    ordered, distinct values.

    Args:
        profile: a :class:`learn2draft.replay.latency.LatencyProfile` (or anything with its ``verify``,
            ``draft_step`` and ``cost`` methods); its verify table must reach 16 tokens.
        drafter: ``"model"``, ``"head"`` or ``"lookup"``: whose draft costs are read.

    Returns:
        float32 array of shape (len(PROFILE_FEATURE_NAMES),), every entry in [0, 1].

    Raises:
        ValueError: the profile has no costs for ``drafter``, or its verify table stops below 16 tokens.
    """
    need = max(PROFILE_VERIFY_TOKENS)
    if profile.verify_tokens[-1] < need:
        raise ValueError(f"Profile {profile.name!r} tabulates verification up to {profile.verify_tokens[-1]} tokens; its "
                         f"profile features read {need}: measure it with `python -m eval.profile` (default sizes reach 64).")
    c = PROFILE_REFERENCE_CONTEXT
    one = float(profile.verify(1, c))
    cost = profile.cost(drafter)
    step = (float(profile.draft_step(drafter, c)) + cost.step_overhead_seconds) / one
    overhead = cost.cycle_overhead_seconds / one
    out = [1.0 - one / float(profile.verify(n, c)) for n in PROFILE_VERIFY_TOKENS]
    out += [step / (1.0 + step), overhead / (1.0 + overhead)]
    return np.clip(np.asarray(out, dtype=np.float32), 0.0, 1.0)


def profile_feature_spec(max_depth: int) -> dict:
    """JSON-serialisable description of a profile-conditioned policy's observation: float32, shape
    (len(FEATURE_NAMES) + len(PROFILE_FEATURE_NAMES),), the loop's features (as :func:`feature_spec`)
    followed by the hardware-profile features of :func:`profile_features`, constant for a machine."""
    spec = feature_spec(max_depth)
    n = len(FEATURE_NAMES)
    spec.update({
        "kind": "profile",
        "profile_version": PROFILE_FEATURE_VERSION,
        "shape": [n + len(PROFILE_FEATURE_NAMES)],
        "profile_reference_context": PROFILE_REFERENCE_CONTEXT,
    })
    spec["features"] += [{"name": name, "index": n + i, "definition": PROFILE_FEATURE_DOCS[name]}
                         for i, name in enumerate(PROFILE_FEATURE_NAMES)]
    return spec


# --------------------------------------------------------------------------------------------
# Hybrid drafters: the source choice (issue 16 item 2)
# --------------------------------------------------------------------------------------------
HYBRID_FEATURE_VERSION = 1

HYBRID_FEATURE_NAMES: tuple[str, ...] = (
    "lookup_available",
    "lookup_score",
    "lookup_run",
    "last_source_neural",
    "target_top1",
    "target_entropy",
    "target_margin",
)

HYBRID_FEATURE_DOCS: dict[str, str] = {
    "lookup_available": "1 when prompt lookup has a proposal for the next token, else 0",
    "lookup_score": "expected accepted length of the chain lookup would draft from here (Σ_i Π_{j≤i} confidence_j over "
                    "at most the tokens left this cycle; ArcticInference's suffix score) / max_depth, clipped to [0, 1]",
    "lookup_run": "tokens of that lookup chain / max_depth, clipped to [0, 1]",
    "last_source_neural": "1 when the last drafted token came from the neural drafter (0 at depth 0 or after lookup)",
    "target_top1": "the target's top-1 probability (raw softmax) where the last committed token was drawn — free from "
                   "the forward that verified it",
    "target_entropy": "the target's entropy there / ln V",
    "target_margin": "the target's top-1 minus top-2 probability there",
}


def hybrid_feature_spec(max_depth: int) -> dict:
    """JSON-serialisable description of a hybrid-drafter policy's observation: float32, shape
    (len(FEATURE_NAMES) + len(HYBRID_FEATURE_NAMES),), the loop's features (as :func:`feature_spec`; ``match_len`` and
    ``match_count`` are the lookup's) followed by :data:`HYBRID_FEATURE_NAMES`. Its actions are
    :data:`learn2draft.control.HYBRID_ACTION_MEANINGS` (0 STOP, 1 CONTINUE with lookup, 2 CONTINUE with the neural
    drafter)."""
    spec = feature_spec(max_depth)
    n = len(FEATURE_NAMES)
    spec.update({"kind": "hybrid", "hybrid_version": HYBRID_FEATURE_VERSION,
                 "shape": [n + len(HYBRID_FEATURE_NAMES)], "actions": 3})
    spec["features"] += [{"name": name, "index": n + i, "definition": HYBRID_FEATURE_DOCS[name]}
                         for i, name in enumerate(HYBRID_FEATURE_NAMES)]
    return spec


def build_hybrid_features(lookup_confidences: Sequence[float], max_depth: int, last_source_neural: bool,
                          target_stats: Sequence[float], vocab_size: int) -> np.ndarray:
    """Assemble :data:`HYBRID_FEATURE_NAMES`.

    Args:
        lookup_confidences: the confidences of the chain lookup would draft from here (empty: no match), at most the
            tokens left this cycle (:meth:`learn2draft.drafters.hybrid.HybridDrafter.lookahead`).
        max_depth: the scale (> 0).
        last_source_neural: the last drafted token came from the neural drafter.
        target_stats: (top-1 probability, entropy in nats, top-2 margin) of the target where the last committed token
            was drawn (:meth:`learn2draft.decoding.SpeculativeDecoder.target_stats`).
        vocab_size: V (the entropy is divided by ln V).

    Returns:
        float32 array of shape (len(HYBRID_FEATURE_NAMES),), every entry in [0, 1].
    """
    c = np.asarray(list(lookup_confidences), dtype=np.float64)
    score = float(np.cumprod(c).sum()) if c.size else 0.0
    top1, ent, margin = (float(x) for x in target_stats)
    out = [1.0 if c.size else 0.0, score / max_depth, c.size / max_depth, 1.0 if last_source_neural else 0.0,
           top1, ent / math.log(vocab_size), margin]
    return np.clip(np.asarray(out, dtype=np.float32), 0.0, 1.0)

# Acceptance features: what predicts "drafted token j is accepted" (issue 16, item 3)
# --------------------------------------------------------------------------------------------
# ----------------------------------------------------------------------------- load-aware (batched) decisions
SERVE_FEATURE_VERSION = 1

#: The observation of a load-aware policy: one decision per batched step (the γ every running row drafts), read
#: before any row drafts. The same builder serves the replay env (:class:`envs.serve.ServeReplayEnv`) and the real
#: batched loop (:class:`policies.controllers.LoadAwarePolicy`), so that a policy trained in replay sees the same numbers.
SERVE_FEATURE_NAMES: tuple[str, ...] = (
    "running_fraction", "waiting_fraction", "tokens_in_flight", "mean_context", "max_context",
    "mean_last_tau", "mean_last_accept_fraction", "mean_draftable", "mean_tokens_left",
    "verify_growth", "draft_cost",
)

SERVE_FEATURE_DOCS: dict[str, str] = {
    "running_fraction": "running rows B / batch scale (the profile's largest batch size)",
    "waiting_fraction": "queued requests / batch scale, capped at 1",
    "tokens_in_flight": "Σ running rows' context lengths / (batch scale · context scale), capped at 1",
    "mean_context": "mean context length of the running rows / context scale, capped at 1",
    "max_context": "longest context of the running rows / context scale, capped at 1",
    "mean_last_tau": "mean over rows of the previous cycle's accepted length τ / max_depth",
    "mean_last_accept_fraction": "mean over rows of the previous cycle's τ / depth (1 after depth 0 or before any)",
    "mean_draftable": "mean over rows of the tokens the drafter can propose now (at most max_depth) / max_depth",
    "mean_tokens_left": "mean over rows of the tokens left to generate / max_new_tokens",
    "verify_growth": "1 − v(B, 1) / v(B, max_depth + 1): how much verifying a full chain costs over one token at "
                     "this batch size and context (the latency profile's batched verification)",
    "draft_cost": "r / (1 + r) with r = max_depth · draft_step(B) / v(B, 1) (the profile's batched draft step)",
}


def serve_feature_spec(max_depth: int, batch_scale: int, context_scale: float) -> dict:
    """JSON-serialisable description of a load-aware policy's observation: float32 (len(SERVE_FEATURE_NAMES),) in
    [0, 1], with the scales it was trained with; its actions are γ = 0..max_depth for every running row."""
    return {"version": SERVE_FEATURE_VERSION, "kind": "serve", "dtype": "float32",
            "shape": [len(SERVE_FEATURE_NAMES)], "max_depth": int(max_depth), "actions": int(max_depth) + 1,
            "batch_scale": int(batch_scale), "context_scale": float(context_scale),
            "features": [{"name": n, "index": i, "definition": SERVE_FEATURE_DOCS[n]}
                         for i, n in enumerate(SERVE_FEATURE_NAMES)]}


def build_serve_features(waiting: int, context_lens: Sequence[int], last_taus: Sequence[int],
                         last_depths: Sequence[int], draftable: Sequence[int], tokens_left: Sequence[int],
                         profile, drafter: str, max_depth: int, max_new_tokens: int, batch_scale: int,
                         context_scale: float, batch_context: str = "max") -> np.ndarray:
    """Assemble :data:`SERVE_FEATURE_NAMES` (every entry clipped to [0, 1]); the one builder of the replay env and the
    real batched loop.

    Args:
        waiting: queued requests; the per-row sequences (B ≥ 1 rows each): context lengths (tokens), the previous
            cycle's τ and depth (0 before the first), the tokens the drafter can propose now, the tokens left.
        profile: the :class:`learn2draft.replay.latency.LatencyProfile` (with the batch axis) that prices the step:
            one batched verification of 1 and of ``max_depth`` + 1 tokens per row and one draft step of all rows of
            ``drafter``, at B rows and the rows' longest (``batch_context="max"``) or mean context.
        max_depth, max_new_tokens: the scales of depths and of tokens left (> 0); batch_scale, context_scale: of
            rows and of context lengths (> 0).

    Returns:
        float32 (len(SERVE_FEATURE_NAMES),).

    Raises:
        ValueError: the profile cannot price B rows (no batch axis, or B beyond it).
    """
    B = len(context_lens)
    c = float(max(context_lens) if batch_context == "max" else np.mean(context_lens))
    verify_one = float(profile.verify_batched(B, 1, c))
    verify_full = float(profile.verify_batched(B, int(max_depth) + 1, c))
    draft_step = float(profile.draft_step_batched(drafter, B, c))
    ctx = np.asarray(context_lens, dtype=np.float64)
    tau, depth = np.asarray(last_taus, dtype=np.float64), np.asarray(last_depths, dtype=np.float64)
    D, mb, cs = max(int(max_depth), 1), float(batch_scale), float(context_scale)
    laf = np.where(depth > 0, tau / np.maximum(depth, 1), 1.0)
    r = D * float(draft_step) / float(verify_one)
    obs = np.array([
        len(ctx) / mb, waiting / mb, ctx.sum() / (mb * cs), ctx.mean() / cs, ctx.max() / cs,
        tau.mean() / D, laf.mean(), np.mean(draftable) / D, np.mean(tokens_left) / max(int(max_new_tokens), 1),
        1.0 - float(verify_one) / float(verify_full), r / (1.0 + r),
    ], dtype=np.float32)
    return np.clip(obs, 0.0, 1.0)


ACCEPTANCE_FEATURE_VERSION = 1

ACCEPTANCE_FEATURE_NAMES: tuple[str, ...] = (
    "context_len",
    "progress",
    "depth",
    "draft_confidence",
    "draft_entropy",
    "draft_margin",
    "cum_confidence",
    "mean_confidence",
    "target_top1",
    "target_entropy",
    "target_margin",
    "match_len",
    "match_count",
    *(f"recent_accept_{k}" for k in range(1, HISTORY + 1)),
)

ACCEPTANCE_FEATURE_DOCS: dict[str, str] = {
    "context_len": f"(committed tokens + the j + 1 drafted this cycle up to token j) / {CONTEXT_SCALE:g}, clipped to "
                   "[0, 1]",
    "progress": "tokens generated so far / max_new_tokens",
    "depth": "j + 1 (token j's place in its chain, 1-based) / max_depth",
    "draft_confidence": "the draft's raw max probability at token j (lookup: share of the matches continuing with it)",
    "draft_entropy": "entropy (nats) of the draft's raw softmax at token j / ln V (lookup: 0)",
    "draft_margin": "the draft's top-2 margin at token j: max − second probability of its raw softmax (lookup: share "
                    "of the most frequent continuation minus the second's); the signal of vLLM's online acceptance "
                    "estimator (PR #52228)",
    "cum_confidence": "product of draft_confidence over tokens 0..j of the chain",
    "mean_confidence": "mean of draft_confidence over tokens 0..j of the chain",
    "target_top1": "the target's raw top-1 probability where the last committed token was drawn (free from the "
                   "verification forward that produced it: SpeculativeDecoder.target_stats)",
    "target_entropy": "entropy (nats) of the target's raw softmax there / ln V",
    "target_margin": "the target's top-2 margin there (max − second probability)",
    "match_len": "prompt lookup (0 for the other drafters): the n-gram match behind token j's proposal, extended "
                 "backwards, min(length, 16) / 16",
    "match_count": "prompt lookup (0 for the other drafters): earlier occurrences of that n-gram, min(count, 8) / 8",
    **{f"recent_accept_{k}": f"the chain drafted {k} position(s) back: its expected leading accepted tokens among its "
                             f"first {k} (the ones already verifiable: each lies on a committed token), / {k} "
                             "(0 before that position exists) — a trace has no cycles (they depend on the policy), so "
                             "this leak-free recent agreement stands in for the past cycles' accepted lengths τ"
       for k in range(1, HISTORY + 1)},
}

_DRAFT_SET = ("context_len", "progress", "depth", "draft_confidence", "draft_entropy", "cum_confidence",
              "mean_confidence", "match_len", "match_count", *(f"recent_accept_{k}" for k in range(1, HISTORY + 1)))

#: Named sets of :data:`ACCEPTANCE_FEATURE_NAMES`: ``draft`` (what today's depth policies see, mapped to token j),
#: ``draft+margin`` (adds the draft's top-2 margin), ``target`` (the target's own view of the last committed token),
#: ``lookup`` (the match statistics), ``all``. Every set holds ``depth``.
ACCEPTANCE_FEATURE_SETS: dict[str, tuple[str, ...]] = {
    "draft": _DRAFT_SET,
    "draft+margin": (*_DRAFT_SET, "draft_margin"),
    "target": ("depth", "target_top1", "target_entropy", "target_margin"),
    "lookup": ("depth", "match_len", "match_count"),
    "all": ACCEPTANCE_FEATURE_NAMES,
}

#: The features read from a trace's acceptance arrays (``target_stats``, ``draft_margin``): NaN in traces recorded
#: before them.
ACCEPTANCE_ARRAY_FEATURES: frozenset[str] = frozenset({"draft_margin", "target_top1", "target_entropy",
                                                       "target_margin"})


def acceptance_features(trace, max_depth: int, vocab_size: int, max_new_tokens: int,
                        names: Sequence[str] = ACCEPTANCE_FEATURE_NAMES) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The acceptance features of every drafted token of one prompt's chain trace: one example per drafted token j
    of every position row t (j < ``chain_len[t]``), its features known once token j is drafted and before its
    verification (:data:`ACCEPTANCE_FEATURE_DOCS`) — what a policy has when deciding whether to draft token j + 1,
    which pays only if token j is accepted.

    Args:
        trace: a :class:`learn2draft.replay.traces.PromptTrace` (or anything with its ``prompt_len``, ``n``,
            ``chain_len``, ``confidence``, ``entropy``, ``draft_margin``, ``target_stats``, ``drafter_features``
            and ``accept_prob``).
        max_depth: the trace's D (> 0); ``vocab_size``: V (≥ 2); ``max_new_tokens``: the recording's (> 0).
        names: the features to return, in this order (a set of :data:`ACCEPTANCE_FEATURE_SETS`).

    Returns:
        (X, rows, positions): X float64 (N, len(names)) — every entry in [0, 1], except NaN for the features of
        :data:`ACCEPTANCE_ARRAY_FEATURES` when the trace lacks its acceptance arrays; rows, positions int64 (N,) — the
        row t and drafted position j of each example, row-major.

    Raises:
        ValueError: an unknown feature name.
    """
    unknown = [n for n in names if n not in ACCEPTANCE_FEATURE_DOCS]
    if unknown:
        raise ValueError(f"Unknown acceptance features {unknown}; known: {', '.join(ACCEPTANCE_FEATURE_NAMES)}.")
    D = int(max_depth)
    cl = np.asarray(trace.chain_len, dtype=np.int64)
    rows, pos = np.nonzero(np.arange(D)[None, :] < cl[:, None])
    conf = np.asarray(trace.confidence, dtype=np.float64)
    nan = np.full((cl.shape[0], 3), np.nan)
    ts = nan if trace.target_stats is None else np.asarray(trace.target_stats, dtype=np.float64)
    margin = nan[:, :1].repeat(D, 1) if trace.draft_margin is None else np.asarray(trace.draft_margin, np.float64)
    ap = np.nan_to_num(np.asarray(trace.accept_prob, dtype=np.float64), nan=0.0)
    reach = np.cumprod(ap, axis=1)  # (R, D): P(tokens 0..i all accepted)

    def col(name: str) -> np.ndarray:
        if name == "context_len":
            return (trace.prompt_len + rows + pos + 1) / CONTEXT_SCALE
        if name == "progress":
            return rows / max_new_tokens
        if name == "depth":
            return (pos + 1) / D
        if name in ("draft_confidence", "draft_margin"):
            return (conf if name == "draft_confidence" else margin)[rows, pos]
        if name == "draft_entropy":
            return np.asarray(trace.entropy, dtype=np.float64)[rows, pos] / math.log(vocab_size)
        if name in ("cum_confidence", "mean_confidence"):
            upto = np.where(np.arange(D)[None, :] <= pos[:, None], conf[rows], np.nan)
            return np.nanprod(upto, axis=1) if name == "cum_confidence" else np.nanmean(upto, axis=1)
        if name.startswith("target_"):
            k = ("target_top1", "target_entropy", "target_margin").index(name)
            return ts[rows, k] / (math.log(vocab_size) if k == 1 else 1.0)
        if name in ("match_len", "match_count"):
            return np.asarray(trace.drafter_features, dtype=np.float64)[rows, pos, ("match_len", "match_count").index(name)]
        k = int(name.rsplit("_", 1)[1])  # recent_accept_k
        back = rows - k
        ok = back >= 1
        val = np.zeros(rows.shape[0])
        val[ok] = reach[back[ok], : min(k, D)].sum(axis=1) / k
        return val

    X = np.stack([col(n) for n in names], axis=1) if names else np.zeros((rows.shape[0], 0))
    X = np.where(np.isnan(X), np.nan, np.clip(X, 0.0, 1.0))
    return X.astype(np.float64), rows.astype(np.int64), pos.astype(np.int64)
