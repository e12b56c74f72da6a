"""The draft state: everything a drafting policy may see at a decision, in one typed object.

:meth:`learn2draft.decoding.SpeculativeDecoder.state` returns a :class:`DraftState` before every
decision (chain or tree), and the controller protocol passes it as it is
(:meth:`learn2draft.control.DraftController.decide`). A hand rule (:mod:`policies.rules`) reads the
raw values — the integer ``state.depth``, ``state.confidences``, ``state.drafter_features`` — with no
trip through a scaled float vector. A learned policy reads the observation vectors, built here and
nowhere else: :meth:`DraftState.features` (:func:`learn2draft.features.build_features`, the depth
decision; what an exported ONNX policy reads) and :meth:`DraftState.size_features`
(:func:`learn2draft.features.build_size_features`, a tree's verification-size decision);
``max_depth`` is the declared scale of the depth features. A replay environment (:mod:`envs.replay`)
that precomputes its observations hands them in as :attr:`DraftState.observation` beside the same
raw values, so a rule decides in replay exactly as on the decoder and a policy sees the same vector.

Every field is known before the decision it informs (no drafted token's value is read before it
is drawn), which is what keeps the output law exact whatever a policy does with it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from learn2draft.features import build_features, build_size_features


@dataclass(frozen=True)
class DraftState:
    """One decision's view of the cycle.

    Attributes:
        depth: tokens (chain) or tree levels (tree) drafted so far this cycle.
        max_depth: the decoder's ``max_depth``: the most per cycle, and the scale of the depth features.
        committed_len: committed tokens (prompt + generated). The depth features' ``context_len`` is
            ``committed_len + depth`` (chain and tree alike, as traces record it); the size features'
            is ``committed_len``.
        generated: tokens generated so far (prompt excluded); ``max_new_tokens``: the budget.
        accepted_history: accepted length τ of every past cycle of this generation, oldest first.
        last_accept_fraction: τ / depth of the previous cycle (1 if it drafted nothing or before any).
        confidences: the max raw draft probability of each drafted token (tree: of the best
            frontier node's children, per level), in drafting order.
        entropies: the draft's raw-softmax entropy in nats at each drafted token (same order).
        vocab_size: V, the target's vocabulary (the entropy feature is divided by ln V).
        drafter_features: float32 (NUM_DRAFTER_FEATURES,) from :meth:`Drafter.features` for the next
            proposal (``match_len``, ``match_count`` of prompt lookup; zeros for the others).
        tree_scores: float64 (N,) the drafted tree nodes' cumulative draft log-probabilities (root
            excluded), empty for a chain.
        extra_features: float32 (k,) appended to the depth observation: a hybrid drafter's
            :data:`learn2draft.features.HYBRID_FEATURE_NAMES` (the lookup's lookahead score, the last token's source,
            the target's view of the last committed token); empty for a single drafter.
        observation: float32 (n,) the depth observation already built for this state (a replay environment's
            precomputed vector, equal to what :meth:`features` would build from the other fields, possibly followed
            by what that environment appends, e.g. profile features), returned by :meth:`features`; None (the
            decoder's): :meth:`features` builds it.
    """

    depth: int
    max_depth: int
    committed_len: int
    generated: int
    max_new_tokens: int
    accepted_history: tuple[int, ...]
    last_accept_fraction: float
    confidences: tuple[float, ...]
    entropies: tuple[float, ...]
    vocab_size: int
    drafter_features: np.ndarray = field(repr=False)
    tree_scores: np.ndarray = field(repr=False, default_factory=lambda: np.zeros(0))
    extra_features: np.ndarray = field(repr=False, default_factory=lambda: np.zeros(0, dtype=np.float32))
    observation: np.ndarray | None = field(repr=False, default=None, compare=False)

    @property
    def tree_nodes(self) -> int:
        """N, the drafted tree nodes (0 for a chain)."""
        return int(self.tree_scores.size)

    @property
    def last_confidence(self) -> float:
        """The max raw draft probability of the last drafted token, 0 at depth 0 (the ``last_confidence``
        feature before its float32 cast)."""
        return self.confidences[-1] if self.confidences else 0.0

    @property
    def last_entropy(self) -> float:
        """Entropy (nats) at the last drafted token, 0 at depth 0."""
        return self.entropies[-1] if self.entropies else 0.0

    def features(self) -> np.ndarray:
        """The depth decision's observation, float32 (len(FEATURE_NAMES) + len(extra_features),) in [0, 1]
        (:func:`learn2draft.features.build_features`, then :attr:`extra_features`); :attr:`observation` as it is
        when set. The one builder of this vector: the decoder, the replay environments' precomputation and every
        learned-policy adapter read it from here."""
        if self.observation is not None:
            return self.observation
        base = build_features(
            context_len=self.committed_len + self.depth, depth=self.depth, max_depth=max(self.max_depth, 1),
            accepted_history=self.accepted_history, confidences=self.confidences, last_entropy=self.last_entropy,
            vocab_size=self.vocab_size, last_accept_fraction=self.last_accept_fraction, generated=self.generated,
            max_new_tokens=self.max_new_tokens, drafter_features=self.drafter_features,
        )
        return np.concatenate((base, self.extra_features)) if self.extra_features.size else base

    def size_features(self) -> np.ndarray:
        """A tree's verification-size observation, float32 (len(SIZE_FEATURE_NAMES),) in [0, 1]
        (:func:`learn2draft.features.build_size_features`)."""
        return build_size_features(self.tree_scores, self.depth, max(self.max_depth, 1), self.committed_len,
                                   self.accepted_history, self.last_accept_fraction)


@dataclass(frozen=True)
class LoadState:
    """The load a batched step runs under, known before any row drafts
    (:class:`learn2draft.batched.BatchedSpeculativeDecoder` hands it to every row's controller,
    :meth:`learn2draft.control.DraftController.observe_load`, and to a verification budget).

    Attributes:
        batch_size: rows running this step (B ≥ 1).
        max_batch: the decoder's most rows at once (the scale of ``batch_size``).
        context_lens: int (B,) committed tokens of each row (prompt + generated).
        waiting: requests that arrived and wait for a free row (0 for a closed loop).
        last_taus, last_depths: per row, the previous cycle's accepted length τ and depth (0 before the first).
        draftable: per row, the tokens its drafter can propose now, at most its depth limit (prompt lookup: the chain
            its n-gram match continues; a neural drafter: the depth limit). The batched decoder computes it on first
            read: read it during the step it was built for (a row that left may have handed its token buffer to a
            later request).
        tokens_left: per row, the tokens it may still generate.
        max_depth, max_new_tokens: the decoder's.
        last_step_batch, last_step_tokens, last_step_seconds: the previous batched step's rows, the tokens all its
            rows committed and its wall-clock seconds (drafting + the one forward + acceptance; a join's prefill is
            not in it); 0 before the first step. What an online check of measured tokens/s reads
            (:class:`policies.rules.SpeculationGuard`).
        last_step_prefill_tokens: prompt tokens of requests that joined inside the previous step's forward (a mixed
            prefill; its seconds include their prefill), 0 when none did.
        last_step_row_ids, last_step_row_tokens: the previous step's rows (request ids) and the tokens each committed,
            in the same order (empty before the first step): what the check reads for each request's own tokens/s,
            the inverse of its inter-token latency.
        last_step_row_drafted: the drafted tokens each of those rows verified in the previous step (0: the row
            decoded plainly in it, its one token certain; empty when not measured).
        row_ids: the request ids of the rows running this step, in batch order (empty when not given): a check of
            measured requests tests those still running.
    """

    batch_size: int
    max_batch: int
    context_lens: tuple[int, ...]
    waiting: int = 0
    last_taus: tuple[int, ...] = ()
    last_depths: tuple[int, ...] = ()
    draftable: Sequence[int] = ()
    tokens_left: tuple[int, ...] = ()
    max_depth: int = 0
    max_new_tokens: int = 0
    last_step_batch: int = 0
    last_step_tokens: int = 0
    last_step_seconds: float = 0.0
    last_step_prefill_tokens: int = 0
    last_step_row_ids: tuple[int, ...] = ()
    last_step_row_tokens: tuple[int, ...] = ()
    last_step_row_drafted: tuple[int, ...] = ()
    row_ids: tuple[int, ...] = ()

    @property
    def tokens_in_flight(self) -> int:
        """Σ context lengths: the KV entries every verification forward attends over."""
        return int(sum(self.context_lens))

    @property
    def mean_context(self) -> float:
        return float(np.mean(self.context_lens)) if self.context_lens else 0.0

    @property
    def max_context(self) -> int:
        return int(max(self.context_lens)) if self.context_lens else 0


__all__ = ["DraftState", "LoadState"]
