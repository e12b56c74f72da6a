"""The hand rules: every hand-written decision rule of this project in one place (issue 41), beside the learned
policies of :mod:`policies.controllers`.

Per cycle (a :class:`learn2draft.control.DraftController` each: before each draft step its
:meth:`~learn2draft.control.DraftController.decide` reads the :class:`learn2draft.state.DraftState` — the integer
``state.depth``, ``state.confidences``, ``state.drafter_features``, a hybrid drafter's ``state.extra_features``; no
rule builds or decodes the float32 observation vector — and answers ``0`` = STOP or ``1`` = CONTINUE; the hybrid
rules answer ``CONTINUE_LOOKUP`` (1) or ``CONTINUE_NEURAL`` (2)):

* :class:`ConfidenceThresholdController` — draft while the draft's confidence in its last token stays high
  (Hugging Face assisted generation's ``assistant_confidence_threshold``);
* :class:`MatchLengthController` — for prompt lookup: draft as many tokens as the n-gram match is long
  (SuffixDecoding);
* the hybrid drafter's rules (:class:`learn2draft.drafters.hybrid.HybridDrafter`): :class:`SingleSourceController`
  (one source at a fixed γ), :class:`LookupFirstController` (vLLM's ngram-eagle) and :class:`SuffixScoreController`
  (ArcticInference).

Per batched step (one γ or one verification budget for the rows of a step, read from the step's
:class:`learn2draft.state.LoadState`):

* :class:`SpeculationGuard` — a step policy behind an online check of measured tokens/s per batch size;
* :class:`StepTimeCap` — a verification budget that keeps a step within a slack of a plain step's seconds when a row
  drafted nothing (defined in :mod:`learn2draft.budget` and re-exported here, like the two below);
* :class:`BatchSizeTable` (vLLM's ``num_speculative_tokens_per_batch_size``) and :class:`AdaptiveVerification`
  (vLLM's adaptive verification, with :class:`OnlineAcceptanceEstimator`, :func:`choose_budget` and
  :func:`profile_step_cost`) are defined in :mod:`learn2draft.budget` and only re-exported here, so that every
  rule is found in one place: the engine's request-stream replay runs them (:mod:`learn2draft.replay.serve`: its
  baselines, :func:`~learn2draft.replay.serve.tune_batch_size_table`,
  :class:`~learn2draft.replay.serve.ReplayAdaptiveVerification`), and the engine imports nothing from
  :mod:`policies` (``tests/test_layering.py``). ``from policies.rules import BatchSizeTable`` and
  ``from learn2draft.budget import BatchSizeTable`` give the same class.

The one fixed-γ controller, :class:`learn2draft.control.FixedDepthController` (γ = 0: no speculation), serves the
real loop and the replay alike and stays in the engine with the protocol.

Every rule decides from the draft state, the load and measured past steps, before the next token is drawn: the output
law is unchanged whatever it decides. Importing this module imports neither stable-baselines3 nor onnxruntime.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from learn2draft.budget import (
    AdaptiveVerification,
    BatchSizeTable,
    OnlineAcceptanceEstimator,
    StepTimeCap,
    choose_budget,
    profile_step_cost,
)
from learn2draft.control import CONTINUE_LOOKUP, CONTINUE_NEURAL, STOP, DraftController
from learn2draft.drafters.lookup import MATCH_LEN_SCALE
from learn2draft.features import FEATURE_NAMES, HYBRID_FEATURE_NAMES
from learn2draft.names import DEFAULT_MAX_DEPTH

if TYPE_CHECKING:
    from learn2draft.state import DraftState

_MATCH_LEN = 0  # state.drafter_features: (match_len, match_count) of prompt lookup
_LOOKUP_AVAILABLE = HYBRID_FEATURE_NAMES.index("lookup_available")  # in state.extra_features
_LOOKUP_SCORE = HYBRID_FEATURE_NAMES.index("lookup_score")


# --------------------------------------------------------------------------------------------- per cycle
class ConfidenceThresholdController(DraftController):
    """Heuristic baseline: keep drafting while the draft's confidence in its last token is high.

    Draft at least ``min_depth`` tokens; after that, STOP as soon as the last drafted token's
    max draft probability (feature ``last_confidence``) is below ``threshold``. This is the rule of
    Hugging Face assisted generation's ``assistant_confidence_threshold`` (checked after each draft
    token), except that the decision is taken before the next token is drawn, as the law requires. It reads
    ``state.depth`` and ``state.last_confidence`` (the raw probability, not its float32 feature).

    Args:
        threshold: in [0, 1]; 0 always drafts to ``max_depth``.
        max_depth: the most tokens drafted per cycle (≥ 0).
        min_depth: tokens always drafted first (0 ≤ min_depth ≤ max_depth). Build the decoder with the same
            ``max_depth`` (its ``depth_feature_scale``: a decoder with another one refuses it).

    Raises:
        ValueError: an argument is out of range.
    """

    def __init__(self, threshold: float = 0.4, max_depth: int = DEFAULT_MAX_DEPTH, min_depth: int = 1):
        if not 0.0 <= threshold <= 1.0:
            raise ValueError(f"threshold must be in [0, 1], got {threshold}.")
        if max_depth < 0 or not 0 <= min_depth <= max_depth:
            raise ValueError(f"Need 0 ≤ min_depth ≤ max_depth, got min_depth={min_depth}, max_depth={max_depth}.")
        self.threshold = float(threshold)
        self.max_depth = self.depth_feature_scale = int(max_depth)
        self.min_depth = int(min_depth)

    def decide(self, state: DraftState) -> bool:
        if state.depth < self.min_depth:
            return True
        return state.last_confidence >= self.threshold

    def __repr__(self) -> str:
        return (f"ConfidenceThresholdController(threshold={self.threshold}, max_depth={self.max_depth}, "
                f"min_depth={self.min_depth})")


class MatchLengthController(DraftController):
    """Heuristic baseline for the prompt-lookup drafter: at the start of a cycle, draft as many
    tokens as the current n-gram match is long (the ``match_len`` feature, a match length in
    tokens / 16), capped at ``max_depth`` — a long match is a long copy, so it is trusted further
    (SuffixDecoding, arXiv 2411.04975, sizes its speculation from the match the same way). The
    drafter itself stops when its match runs out.

    Args:
        max_depth: the most tokens drafted per cycle (≥ 0); build the decoder with the same.
        scale: tokens drafted per matched token (> 0).
        min_match: no drafting when the match is shorter than this many tokens (≥ 1).

    Raises:
        ValueError: an argument is out of range.
    """

    def __init__(self, max_depth: int = DEFAULT_MAX_DEPTH, scale: float = 1.0, min_match: int = 1):
        if max_depth < 0 or scale <= 0 or min_match < 1:
            raise ValueError(f"Need max_depth ≥ 0, scale > 0 and min_match ≥ 1, got {max_depth}, {scale}, {min_match}.")
        self.max_depth, self.scale, self.min_match = int(max_depth), float(scale), int(min_match)
        self.depth_feature_scale = self.max_depth  # the depth feature is read on this scale
        self._budget = 0

    def reset(self) -> None:
        self._budget = 0

    def decide(self, state: DraftState) -> bool:
        if state.depth == 0:  # the match length in tokens: the drafter's feature is min(length, 16) / 16
            match = round(float(state.drafter_features[_MATCH_LEN]) * MATCH_LEN_SCALE)
            self._budget = 0 if match < self.min_match else min(self.max_depth, max(1, round(self.scale * match)))
        return state.depth < self._budget

    def __repr__(self) -> str:
        return f"MatchLengthController(max_depth={self.max_depth}, scale={self.scale}, min_match={self.min_match})"


class _HybridRule(DraftController):
    """A hand rule for a hybrid drafter (:class:`learn2draft.drafters.hybrid.HybridDrafter`): at depth 0 it picks the
    cycle's source and budget (:meth:`_plan`), then drafts with that source up to the budget; a lookup cycle stops
    where lookup has no proposal. Reads ``state.depth`` and the hybrid drafter's ``state.extra_features``
    (:data:`learn2draft.features.HYBRID_FEATURE_NAMES`).

    Raises:
        ValueError: ``num_draft_tokens`` < 1 or ``max_depth`` < ``num_draft_tokens``.
    """

    def __init__(self, num_draft_tokens: int, max_depth: int = DEFAULT_MAX_DEPTH):
        if isinstance(num_draft_tokens, bool) or not isinstance(num_draft_tokens, int) or num_draft_tokens < 1 \
                or max_depth < num_draft_tokens:
            raise ValueError(f"Need 1 ≤ num_draft_tokens ≤ max_depth, got {num_draft_tokens!r} and {max_depth!r}.")
        self.num_draft_tokens, self.max_depth = int(num_draft_tokens), int(max_depth)
        self.depth_feature_scale = self.max_depth
        self._source, self._budget = CONTINUE_NEURAL, 0

    def reset(self) -> None:
        self._source, self._budget = CONTINUE_NEURAL, 0

    def _plan(self, hybrid: np.ndarray) -> tuple[int, int]:
        """(source, budget) of the cycle from float32 (len(HYBRID_FEATURE_NAMES),) hybrid features at depth 0."""
        raise NotImplementedError

    def decide(self, state: DraftState) -> int:
        """Raises:
            ValueError: ``state`` has no hybrid drafter's features (a single drafter's state)."""
        hybrid = state.extra_features
        if hybrid.shape[0] != len(HYBRID_FEATURE_NAMES):
            raise ValueError(f"{self!r} reads a hybrid drafter's observation ({len(FEATURE_NAMES) + len(HYBRID_FEATURE_NAMES)}"
                             f" features), got {len(FEATURE_NAMES) + hybrid.shape[0]}: run it with --drafter lookup+model "
                             "or lookup+head.")
        if state.depth == 0:
            self._source, self._budget = self._plan(hybrid)
        if state.depth >= self._budget or (self._source == CONTINUE_LOOKUP and hybrid[_LOOKUP_AVAILABLE] < 0.5):
            return STOP
        return self._source

    def __repr__(self) -> str:
        return f"{type(self).__name__}(num_draft_tokens={self.num_draft_tokens}, max_depth={self.max_depth})"


class SingleSourceController(_HybridRule):
    """One source of a hybrid drafter only: ``num_draft_tokens`` tokens with the neural drafter (``source=
    CONTINUE_NEURAL``), or with prompt lookup, stopping where lookup has no proposal (``source=CONTINUE_LOOKUP``) — each
    drafter alone at a fixed γ, scored in the same hybrid replay as the rules and the learned policy."""

    def __init__(self, source: int, num_draft_tokens: int, max_depth: int = DEFAULT_MAX_DEPTH):
        if source not in (CONTINUE_LOOKUP, CONTINUE_NEURAL):
            raise ValueError(f"source must be CONTINUE_LOOKUP (1) or CONTINUE_NEURAL (2), got {source!r}.")
        super().__init__(num_draft_tokens, max_depth)
        self.source = source

    def _plan(self, hybrid: np.ndarray) -> tuple[int, int]:
        return self.source, self.num_draft_tokens

    def __repr__(self) -> str:
        name = "lookup" if self.source == CONTINUE_LOOKUP else "neural"
        return f"SingleSourceController({name}, num_draft_tokens={self.num_draft_tokens}, max_depth={self.max_depth})"


class LookupFirstController(_HybridRule):
    """vLLM's ngram-eagle rule (PR #24344): when prompt lookup matches at the start of a cycle, draft the lookup chain
    (up to ``num_draft_tokens``, fewer where the match ends), else ``num_draft_tokens`` tokens with the neural drafter.
    """

    def _plan(self, hybrid: np.ndarray) -> tuple[int, int]:
        src = CONTINUE_LOOKUP if hybrid[_LOOKUP_AVAILABLE] >= 0.5 else CONTINUE_NEURAL
        return src, self.num_draft_tokens


class SuffixScoreController(_HybridRule):
    """ArcticInference's rule: at the start of a cycle, score the lookup chain by its expected accepted length
    (Σ_i Π_{j≤i} confidence_j, the ``lookup_score`` feature × max_depth; SuffixDecoding, arXiv 2411.04975); when the
    score exceeds the neural drafter's ``num_draft_tokens``, draft the whole lookup chain (up to ``max_depth``), else
    ``num_draft_tokens`` tokens with the neural drafter."""

    def _plan(self, hybrid: np.ndarray) -> tuple[int, int]:
        score = float(hybrid[_LOOKUP_SCORE]) * self.max_depth
        if hybrid[_LOOKUP_AVAILABLE] >= 0.5 and score > self.num_draft_tokens:
            return CONTINUE_LOOKUP, self.max_depth
        return CONTINUE_NEURAL, self.num_draft_tokens


# --------------------------------------------------------------------------------------------- per batched step
class _StepGammaController(DraftController):
    """One row of a step policy (:class:`policies.controllers.LoadAwarePolicy`, :class:`SpeculationGuard`, or any
    object with ``gamma(load)`` and ``max_depth``): the step's γ from :meth:`observe_load`, then CONTINUE while
    depth < γ. A batched step asks ``gamma(load)`` once per policy for all its rows (:meth:`observe_loads`): the
    policy decides one γ per step."""

    def __init__(self, policy: Any):
        self.policy, self.max_depth, self.gamma = policy, policy.max_depth, 0

    @property
    def depth_feature_scale(self) -> int:
        return self.max_depth

    @property
    def step_policy(self) -> Any:
        """The step policy this row follows (a precision mismatch is warned once for it, not once per row)."""
        return self.policy

    @property
    def trained_dtype(self) -> str | None:  # type: ignore[override]
        return getattr(self.policy, "trained_dtype", None)

    reads_load = True

    def observe_load(self, load: Any) -> None:
        self.gamma = self.policy.gamma(load)

    @classmethod
    def observe_loads(cls, controllers: Sequence[_StepGammaController], load: Any) -> None:
        """The step's γ for every row: a step policy decides one γ per step, so ``policy.gamma(load)`` is asked once
        per policy and step for all the rows that follow it. A subclass with its own :meth:`observe_load`, or a row
        given one on the instance, has it called per row."""
        if cls.observe_load is not _StepGammaController.observe_load or any(
                ["observe_load" in c.__dict__ for c in controllers]):
            return super().observe_loads(controllers, load)
        decided: dict[int, int] = {}
        for c in controllers:
            g = decided.get(id(c.policy))
            c.gamma = g if g is not None else decided.setdefault(id(c.policy), c.policy.gamma(load))
        return None

    @property
    def step_depth(self) -> int:
        """The step's γ, capped by ``max_depth``: the depth rule stops there without asking :meth:`decide`."""
        return min(int(self.gamma), self.max_depth)

    @classmethod
    def step_depths(cls, controllers: Sequence[_StepGammaController]) -> list[int]:
        """Each row's :attr:`step_depth` read from its fields at once (a subclass with its own :attr:`step_depth`:
        each row's property)."""
        if cls.step_depth is not _StepGammaController.step_depth:
            return super().step_depths(controllers)
        return [min(int(c.gamma), c.max_depth) for c in controllers]

    reads_state = False  # CONTINUE below the step's γ, where the depth rule stops

    def decide(self, state: DraftState) -> bool:
        return state.depth < self.gamma

    def __repr__(self) -> str:
        return f"a row of {self.policy!r}"


#: Relative differences below this are float rounding, not measurements: a tie is not a loss (winner, request_check).
_TIE = 1e-9


def batch_bucket(batch_size: int) -> int:
    """The bucket of a batch size, named by its largest size: 1, 2, 4 (3–4), 8 (5–8), 16 (9–16), … — the smallest
    power of two ≥ ``batch_size`` (the ranges of vLLM's ``num_speculative_tokens_per_batch_size`` tables)."""
    return 1 << max(int(batch_size) - 1, 0).bit_length()


def _ratio(pairs: Any) -> tuple[float, float]:
    """Σ tokens / Σ seconds over ``pairs`` of (tokens, seconds) (n ≥ 1, Σ seconds > 0), and its standard error: the
    ratio estimator's √(Σ (tokensᵢ − rate · secondsᵢ)² / (n (n − 1))) / mean seconds (Cochran, *Sampling
    Techniques*, 1977, §6.3); infinite below 2 pairs (the spread is unknown)."""
    pairs = list(pairs)
    n, tokens, seconds = len(pairs), sum(t for t, _ in pairs), sum(sec for _, sec in pairs)
    rate = tokens / seconds
    if n < 2:
        return rate, float("inf")
    return rate, (sum((t - rate * sec) ** 2 for t, sec in pairs) / (n * (n - 1))) ** 0.5 / (seconds / n)


class SpeculationGuard:
    """A step policy (one γ per batched step: a :class:`policies.controllers.LoadAwarePolicy`, or any object with
    ``gamma(load)`` and ``max_depth``) behind an online check of measured tokens/s, per batch size: it runs the
    policy's speculation only where speculation measures faster than plain decoding (γ = 0) at this batch size on
    this machine now — in the batch's tokens/s and, with ``latency`` (the default), in each request's own tokens/s,
    the inverse of its inter-token latency.

    Why (issue 17): a load-aware policy is trained in replay on a latency profile; on a machine that has slowed since,
    or where a batched step costs more than the profile holds (padding to the longest row, per-row work), it
    speculates where plain decoding is faster — measured on a 2-core CPU in bf16: 0.81–0.89× no speculation at
    concurrency 16. The check compares Learning to Draft's reward itself, measured wall-clock tokens/s.

    Batch sizes are pooled in buckets, as vLLM's per-batch-size tables are written: 1, 2, 3–4, 5–8, 9–16, … (each
    named by its largest size, :func:`batch_bucket`). Under a closed loop or arrivals the batch size moves by one or
    two rows from step to step, and per exact size the arms were measured in a few steps each (an ``eval.serve`` run
    at concurrency 16 ran steps at every size from 9 to 16, 2 to 76 of them). "At B" below means in B's bucket.

    How: for each batch size B it keeps two arms, *policy* (the steps at B where the policy's γ > 0 was run) and
    *plain* (steps at B run with γ = 0, the policy's own γ = 0 included), each the last ``window`` steps' committed
    tokens and seconds, read from the next step's :class:`learn2draft.state.LoadState` (``last_step_*``); an arm's
    rate is its summed tokens / summed seconds over that window. A step whose forward also prefilled joining requests
    (``last_step_prefill_tokens`` > 0: a mixed prefill) is not counted: its seconds are mostly the prompts', work
    every request costs once whatever the arm, and a speculating arm, finishing requests sooner, would carry more of
    it. A window, not a fast moving average: a speculating
    step's tokens vary from 1 to γ + 1 per row, and at B = 1 an average of weight 0.25 (the first design) read a
    few unlucky steps as a verdict — in a simulation of speculation 1.24× faster than plain decoding (γ = 8, α = 0.6)
    it ran plain on 65–93 % of 400 steps over 10 seeds, and in ``eval.serve`` on a Xeon (float32, concurrency 1) the
    guarded policy measured 0.98× plain decoding where the policy alone measured 1.09×; once plain led, speculation
    was only measured in short probes and its low reading stuck. The winner at B is *plain* only when plain
    decoding's rate exceeds the policy's by more than ``confidence`` standard errors of their difference
    (:meth:`rate_error`), else *policy*: the trained policy is trusted until the measurements say otherwise.
    In the simulation above, over 20 seeds of 400 steps at B = 1, the guard ran the policy on 91 % of the steps where
    it is 1.24× faster (20 % before) and on 12 % where it is 0.83× as fast (the first ``explore_every`` steps and the
    probes; 9 % before). Before both arms are measured at B the winner is *plain* when the nearest smaller batch size
    with both arms measured has plain as its winner (a batched verification feeds B × (γ + 1) tokens, so speculation's relative
    cost grows with B: the premise of vLLM's ``num_speculative_tokens_per_batch_size``), else *policy*. Each step runs
    the winner's arm — the policy's γ (the policy is asked only then; its γ = 0 is a plain step) or γ = 0 — except
    during a probe: ``probe_steps`` consecutive steps of the other arm after
    every ``interval`` steps of the winner at B; the interval starts at ``explore_every``, doubles (up to
    ``max_explore_every``) while a probe leaves the winner unchanged and falls back to ``explore_every`` when the
    winner changes, so the check follows a machine whose speed drifts and a load whose best move changes, at a
    probing cost that shrinks while nothing changes.

    Content (at most :attr:`CONTENT_ROWS` rows): a policy step whose rows cannot draft (prompt lookup has no match)
    commits one token a row in a little more than a plain step's seconds (the lookup and the policy's inference), so
    after a stretch of such content the arm's window measured below plain decoding and the guard ran plain into the
    next stretch of matches, learning of it only from probes every 16–128 steps (an ``eval.serve`` run on 2 AMD EPYC
    cores in bf16, one row: 234 steps plain for the rate while the policy arm measured 1.45× plain decoding's
    tokens/s at the end). When plain decoding leads by the rate and some rows can draft now (the load state's
    ``draftable``), the rate is read again over the policy steps in which at least that share of rows drafted
    (``last_step_row_drafted``; a window of their own, which a stretch without matches does not push out); the policy
    runs unless plain decoding's rate exceeds theirs by more than the same margin (:meth:`_drafting_steps_win`), and
    the request check then reads the same steps; so does a request check that finds requests slower on the arm's
    window while such steps exist. The decision still reads only the past and the load: the law is
    unchanged.

    Inter-token latency (``latency=True``): a speculating step lasts longer than a plain one, and a row whose drafts
    are rejected still commits one token in it, so the batch can gain tokens/s while that request's inter-token
    latency grows (measured on a 2-core CPU in bf16 at concurrency 8: the guard 1.11× plain decoding in tokens/s,
    0.82× in ITL p99). The policy arm therefore also keeps, from the load state's ``last_step_row_ids`` and
    ``last_step_row_tokens``, the tokens each request committed in each of its steps; a request is slower under the
    policy when, in the steps it ran in, it committed fewer tokens than plain steps of the same seconds would have
    (every row commits one token per plain step), by a margin that grows with its spread and with the number of
    requests tested (:meth:`request_check`); the requests that drafted nothing in their policy steps commit one
    token per step for certain, and are slower when the steps they ran in measure longer than plain ones by
    ``confidence`` standard errors. The winner is also *plain*
    when any request measures slower: speculation runs only
    where neither the batch nor any of its requests measures slower. Without
    per-row measurements (a load state that does not carry them) only the batch's tokens/s is compared.

    The decision reads only measured past steps and the load, before any row drafts: the output law is unchanged,
    whatever it decides (each row's tokens still come from the exact sampler). Keep one guard for a whole stream:
    its measurements carry over between :func:`learn2draft.batched.serve` calls (a new decoder's first step
    teaches it nothing about the last decoder's).

    Call it (or :meth:`controller`) for a new per-row controller, as a :class:`policies.controllers.LoadAwarePolicy`
    (``load_serve_policy``: :func:`policies.load.load_serve_policy`)::

        guard = SpeculationGuard(load_serve_policy("policies/defaults/lookup-serve-bfloat16"))
        serve(decoder, requests, guard, concurrency=8)

    Args:
        policy: the guarded step policy.
        explore_every, max_explore_every: the probing interval's start and cap, in steps at one batch size
            (1 ≤ explore_every ≤ max_explore_every).
        probe_steps: steps of the other arm per probe (≥ 1).
        window: the steps per arm and batch size whose tokens and seconds give the arm's rate (≥ 1).
        confidence: standard errors by which plain decoding must measure faster before it replaces the policy (≥ 0;
            0: the faster arm as measured).
        latency: also check each request's own tokens/s (above); False: the batch's tokens/s only (a throughput-only
            promise, for offline batch work where no one waits on each token).

    Attributes:
        decisions: per step decided, ``(batch_size, policy_gamma, gamma, arm)`` with arm ``"policy"`` or ``"plain"``
            (the arm the step's measurement counts for); ``policy_gamma`` is None where the guard ran plain without
            asking the policy.

    Raises:
        ValueError: a setting out of range, or a ``policy`` without ``gamma`` and ``max_depth``.
    """

    POLICY, PLAIN = "policy", "plain"
    #: Why a step ran plain (``summary()[B]["plain_reasons"]``): ``rate`` (the plain arm's tokens/s led by the
    #: margin), ``request_idle`` / ``request_drafting`` (the request check found idle requests slower, or only
    #: drafting ones), ``smaller_bucket`` (both arms not yet measured here; a smaller bucket's winner is plain),
    #: ``probe`` (a probe of the plain arm), ``policy_gamma_0`` (the policy was asked and chose γ = 0).
    PLAIN_REASONS = ("rate", "request_idle", "request_drafting", "smaller_bucket", "probe", "policy_gamma_0")
    #: The most rows whose ``draftable`` the rate check reads (:meth:`_drafting_steps_win`; a prompt-lookup
    #: lookahead per row, about 0.3 ms on a 2-core CPU, paid on the steps where plain decoding leads by the rate).
    CONTENT_ROWS = 4
    _PRIOR_STEPS = 4  # the pooled variance's weight, in steps, in a request's variance (request_check)

    def __init__(self, policy: Any, explore_every: int = 16, max_explore_every: int = 128, probe_steps: int = 2,
                 window: int = 32, confidence: float = 1.5, latency: bool = True):
        depth = getattr(policy, "max_depth", None)
        if not hasattr(policy, "gamma") or isinstance(depth, bool) or not isinstance(depth, (int, np.integer)) \
                or depth < 1:
            raise ValueError(f"SpeculationGuard needs a step policy with gamma(load) and an integer max_depth ≥ 1, got "
                             f"{policy!r}.")
        if not (all(isinstance(v, (int, np.integer)) and not isinstance(v, bool) for v in (explore_every, max_explore_every))
                and 1 <= explore_every <= max_explore_every):
            raise ValueError(f"explore_every ({explore_every!r}) and max_explore_every ({max_explore_every!r}) must be "
                             "integers with 1 ≤ explore_every ≤ max_explore_every.")
        if not isinstance(probe_steps, (int, np.integer)) or isinstance(probe_steps, bool) or probe_steps < 1:
            raise ValueError(f"probe_steps must be an integer ≥ 1, got {probe_steps!r}.")
        if not isinstance(window, (int, np.integer)) or isinstance(window, bool) or window < 1:
            raise ValueError(f"window must be an integer ≥ 1, got {window!r}.")
        if isinstance(confidence, bool) or not isinstance(confidence, (int, float)) or not 0.0 <= confidence < math.inf:
            raise ValueError(f"confidence must be a finite number ≥ 0, got {confidence!r}.")
        self.policy, self.max_depth = policy, int(policy.max_depth)
        self.explore_every, self.max_explore_every = int(explore_every), int(max_explore_every)
        if not isinstance(latency, bool):
            raise ValueError(f"latency must be True or False, got {latency!r}.")
        self.probe_steps, self.window, self.confidence = int(probe_steps), int(window), float(confidence)
        self.latency = latency
        # bucket → arm → [deque of (tokens, seconds, ((request id, tokens, drafted or None), ...)), steps measured]
        self._stats: dict[int, dict[str, list]] = {}
        self._sched: dict[int, dict[str, Any]] = {}  # bucket → its probing schedule
        self._pending: tuple[int, str] | None = None  # (B, arm) of the step decided last, awaiting its measurement
        self._decided: tuple[Any, int] = (None, 0)
        self._checked: dict = {}  # the last request_check, by bucket, steps measured and running requests
        self._sums: tuple | None = None  # (key, per-request sums) of the last policy window read (_window_sums)
        self._running: frozenset | None = None  # the request ids running now (None: the load states do not say)
        self._load: Any = None  # the load state of the step being decided (its ``draftable``: request_check)
        self._serial = 0  # load states decided: a live request_check reads the current one's ``draftable``
        # bucket → [live checks that found idle requests, idle requests found, of them draftable at the check]
        self._idle_reads: dict[int, list[int]] = {}
        self._last_check: dict | None = None  # the request check the last winner() ran (read by _choose)
        self._why: str | None = None  # why the last winner() was plain (one of PLAIN_REASONS; None: policy)
        # bucket → reason → steps run plain for it (PLAIN_REASONS)
        self._plain_reasons: dict[int, dict[str, int]] = {}
        # bucket → the policy arm's last ``window`` steps in which rows drafted: (tokens, seconds, share of rows
        # that drafted, rows); a window of their own, which a stretch of steps without matches does not push out
        self._drafting: dict[int, deque] = {}
        self.decisions: list[tuple[int, int | None, int, str]] = []

    # ------------------------------------------------------------------ measurements
    def _learn(self, load: Any) -> None:
        """Count the previous step's measured tokens and seconds (``load.last_step_*``), and each of its rows' tokens,
        for the arm it ran."""
        pending, self._pending = self._pending, None
        if pending is None or int(getattr(load, "last_step_batch", 0)) != pending[0]:
            return  # a new decoder, or a step this guard did not decide
        seconds = float(load.last_step_seconds)
        if seconds <= 0 or int(getattr(load, "last_step_prefill_tokens", 0)) > 0:
            return  # nothing measured, or a step that also prefilled joining requests
        B, arm = pending
        stat = self._stats.setdefault(batch_bucket(B), {}).setdefault(arm, [deque(maxlen=self.window), 0])
        ids, toks = getattr(load, "last_step_row_ids", ()), getattr(load, "last_step_row_tokens", ())
        drafted = getattr(load, "last_step_row_drafted", ())
        if len(drafted) != len(ids):  # not measured (or not row by row): no row is known to be idle
            drafted = (None,) * len(ids)
        rows = tuple(zip(ids, toks, drafted)) if len(toks) == len(ids) else ()
        stat[0].append((float(load.last_step_tokens), seconds, rows))
        stat[1] += 1
        share = (sum(1 for _, _, d in rows if d > 0) / len(rows)
                 if rows and all(d is not None for _, _, d in rows) else 0.0)  # 0: none drafted, or not measured
        if arm == self.POLICY and share > 0:
            self._drafting.setdefault(batch_bucket(B), deque(maxlen=self.window)).append(
                (float(load.last_step_tokens), seconds, share, rows))

    def rate(self, batch_size: int, arm: str) -> float | None:
        """The measured tokens/s of ``arm`` (``"policy"`` or ``"plain"``) at ``batch_size`` rows (None: not yet
        measured)."""
        stat = self._stats.get(batch_bucket(batch_size), {}).get(arm)
        return _ratio((t, sec) for t, sec, _ in stat[0])[0] if stat else None

    def rate_error(self, batch_size: int, arm: str) -> float:
        """The standard error of :meth:`rate` (tokens/s) at ``batch_size`` over the window's n steps (the ratio
        estimator's, :func:`_ratio`); infinite below 2 steps (the spread is unknown)."""
        stat = self._stats.get(batch_bucket(batch_size), {}).get(arm)
        return _ratio((t, sec) for t, sec, _ in stat[0])[1] if stat else float("inf")

    def request_check(self, batch_size: int, every_request: bool = False, like_now: bool = False) -> dict | None:
        """Which requests the policy's speculation makes slower than plain decoding at ``batch_size`` (its bucket).

        A step gives each row it runs its committed tokens in the step's seconds, so request r's own tokens/s under
        the policy is its tokens over the seconds of the steps it ran in; under plain decoding every row commits one
        token per step of mean seconds P̄ (the plain arm's window). Each of r's policy steps i therefore gains
        g_i = t_i − s_i / P̄ tokens over plain decoding (t_i its tokens, s_i the step's seconds: s_i / P̄ plain steps
        fit in it), and r is slower under the policy when its mean gain is below 0, measured: it is counted *slower*
        when mean g + z · SE_r < 0 over the policy arm's window, for the requests seen in at least 2 of its steps and
        still running (the load state's ``row_ids``, when it gives them: a finished request cannot be helped, and its
        steps would hold a verdict for 16 probes after it left), with

        * SE_r = √(s̃_r² / n_r), s̃_r² = (k · s² + (n_r − 1) · s_r²) / (k + n_r − 1): the request's own sample variance
          of g shrunk toward the pooled within-request variance s² of the window with k = 4 steps' weight (a request
          seen in 2 steps that committed 1 token in both is not read as certain); P̄ is taken as known (its own
          standard error, large when the plain arm holds only a probe's 2 steps, is not in SE_r);
        * z = ``confidence`` + √(2 ln R) over the R requests tested (√(2 ln R) is about the largest of R standard
          normal deviations: with requests replaced as they finish, the window holds many short ones and one unlucky
          one is expected); 0 with ``confidence`` = 0 (the point estimates alone).

        A request whose rows drafted nothing in every one of its policy steps (``last_step_row_drafted``: prompt
        lookup found no match, so the row verified nothing) committed exactly one token per step, with no spread to
        estimate: it decoded plainly inside the policy's steps. It is *idle*. The idle requests are tested together,
        once, on the steps they ran in: they are all slower when those steps' mean seconds exceed the plain arm's,
        (mean S − mean P) / √(s² (1 / n_S + 1 / n_P)) > ``confidence``, S the seconds of the policy steps that
        carried at least one idle request (each step once), P the plain arm's and s² the step seconds' variance
        pooled over both arms' windows (a probe gives the plain arm 2 steps, too few for a variance of its own).

        Why each request's own steps, not the arm's mean step seconds ρ · P̄ (the first version compared the mean
        tokens per step m_r with ρ = mean policy step seconds / P̄): a request that rarely finds a match runs in
        steps the policy keeps short (a small γ, or a row that drafts nothing), and at one row its steps are the
        batch's; against the arm's mean, which its drafting neighbours' γ = 8 steps set, it read as slower while
        it was not (an ``eval.serve`` run on 2 AMD EPYC cores in bf16: at B = 1 the guard ran plain on 27 steps for
        such requests, its policy arm measuring 2.4× plain decoding's tokens/s). ρ is still reported
        (``cost_ratio``).

        Why so for idle requests: the statistical test above would give an idle request the pooled spread of rows
        whose drafts were accepted or not, and with few steps per request it has no power (an ``eval.serve`` run on 2 CPU cores,
        9–16 rows: 56 requests in 30 policy steps, none found slower, while the cost ratio was 1.43 and the lowest
        request committed 1.0 token per step); one test per idle request needs the multiplicity margin √(2 ln R) and
        lost the same way (none of 13 idle requests found slower at a cost ratio of 1.16 ± 0.08 in 10 policy
        steps). The steps they ran in, not the arm's mean: alone in the batch (B = 1) an idle request's steps are
        plain steps but for the policy's own inference and lookup, whatever the policy's other steps cost (comparing the
        arm's mean, the guard ran plain on 333 of 509 steps at B = 1 where speculation measured 2.8× faster).

        Live (not ``every_request``), a request is idle only while its row still cannot draft: one whose row can
        draft at the step being decided (the load state's ``draftable`` > 0, when it carries one) is tested as a
        drafting request instead (``idle_draftable_now`` counts them). Why: once the guard runs plain, a request read
        as idle gets policy steps only in probes, so it stayed idle for the guard after prompt lookup had found a
        match for it, and its verdict held the whole bucket plain (an ``eval.serve`` run on 2 CPU cores in bf16: at
        3–8 rows the policy's steps measured 1.5–1.9× plain decoding's tokens/s, the guard ran plain on 876 of
        1,304 steps, and at the run's end both buckets' plain verdicts came from 1–3 idle requests alone).

        Args:
            every_request: test every request in the window, finished ones included (a report's view), instead of
                only those still running.
            like_now: read the policy steps like the one being decided instead of the arm's window: those in which
                at least the share of rows that can draft now drafted (:meth:`_like_now`; the rate check's steps
                when it was decided on them, :meth:`_drafting_steps_win`).

        Returns:
            None before both arms have a step in the window or no request has 2 policy steps; else ``{"cost_ratio":
            ρ, "cost_ratio_error": its standard error by the delta method (None below 2 steps per arm),
            "requests": R, "idle": how many are idle, "idle_draftable_now": how many drafted nothing in their
            policy steps but can draft now (live only; else 0), "slower": how many are slower (idle ones included),
            "slower_idle": how many of them are idle, "lowest_tokens_per_step": min m_r}``.
        """
        arms = self._stats.get(batch_bucket(batch_size), {})
        pol, plain = arms.get(self.POLICY), arms.get(self.PLAIN)
        if not pol or not plain or not pol[0] or not plain[0]:
            return None
        if like_now:
            pol = [self._like_now(batch_size), pol[1]]
            if not pol[0]:
                return None
        running = None if every_request else self._running
        # changes only with a measured step, the running requests or (live) the load state
        key = (batch_bucket(batch_size), pol[1], plain[1], self.confidence, running,
               None if every_request else self._serial, like_now)
        if key not in self._checked:
            live = None if every_request else self._draftable_now
            self._checked = {key: self._request_check(pol, plain, running, live)}
        found = self._checked[key]
        return None if found is None else dict(found)

    def _draftable_now(self, ids: list) -> set:
        """Of request ids ``ids``, those whose row can draft at the step being decided (its load state's
        ``draftable`` > 0; a row's lookahead runs here, once per load state, only for an idle request's row). Empty
        when the load state does not say."""
        load = self._load
        rows, can = getattr(load, "row_ids", ()), getattr(load, "draftable", ())
        if not rows or len(can) != len(rows):
            return set()
        index = {r: i for i, r in enumerate(rows)}  # only the idle rows' lookaheads run (a lazy ``draftable``)
        return {r for r in ids if r in index and can[index[r]] > 0}

    def _window_sums(self, pol: list, running: frozenset | None) -> dict:
        """What :meth:`_request_check` reads of the policy arm's window ``pol`` that does not change while no policy
        step is measured (in a stretch of plain steps it is asked every step): the steps' seconds, and per request
        seen in at least 2 of them and still running (``running``; None: all) its steps n, mean tokens, mean seconds of
        its steps, the centred sums of squares and products of its tokens t and seconds s (Σ(t − t̄)², Σ(t − t̄)(s − s̄),
        Σ(s − s̄)²), whether it drafted in any of them, and the seconds of each step. Kept for the last window seen
        (keyed by the window's steps themselves, compared by identity first and then by value, and ``running``)."""
        key = (running, tuple(pol[0]))
        cached = self._sums
        if cached is not None and cached[0] == key:
            return cached[1]
        per: dict[int, list] = {}  # request → [tokens of each of its steps], [seconds of those steps], drafted
        for step_i, (_, sec, rows) in enumerate(pol[0]):
            for rid, tokens, d in rows:
                e = per.setdefault(rid, [[], [], False, []])
                e[0].append(float(tokens))
                e[1].append(sec)
                e[2] = e[2] or d is None or d > 0
                e[3].append(step_i)
        ids = [r for r, e in per.items() if len(e[0]) >= 2 and (running is None or r in running)]
        t = [np.asarray(per[r][0]) for r in ids]
        sec = [np.asarray(per[r][1]) for r in ids]
        tm = np.asarray([x.mean() for x in t])
        sm = np.asarray([x.mean() for x in sec])
        sums = {
            "step_seconds": np.asarray([sec for _, sec, _ in pol[0]]),
            "ids": ids,
            "n": np.asarray([x.size for x in t], dtype=float),
            "t_mean": tm, "s_mean": sm,
            "tt": np.asarray([((x - m) ** 2).sum() for x, m in zip(t, tm)]),
            "ts": np.asarray([((x - a) * (y - b)).sum() for x, y, a, b in zip(t, sec, tm, sm)]),
            "ss": np.asarray([((y - b) ** 2).sum() for y, b in zip(sec, sm)]),
            "drafted": {r: per[r][2] for r in ids},
            "steps_of": {r: per[r][3] for r in ids},
        }
        self._sums = (key, sums)
        return sums

    def _request_check(self, pol: list, plain: list, running: frozenset | None,
                       draftable_now: Any = None) -> dict | None:
        w = self._window_sums(pol, running)
        a = w["step_seconds"]
        b = np.asarray([sec for _, sec, _ in plain[0]])
        bm = float(b.mean())
        rho = float(a.mean() / bm)
        rho_se = (rho * math.sqrt(a.var(ddof=1) / (a.size * a.mean() ** 2) + b.var(ddof=1) / (b.size * bm ** 2))
                  if a.size >= 2 and b.size >= 2 else float("inf"))
        ids = w["ids"]
        if not ids:
            return None
        # per request, its gain per step over plain decoding g_i = t_i − s_i / P̄: mean and centred sum of squares
        n = w["n"]
        g_mean = w["t_mean"] - w["s_mean"] / bm
        g_ss = np.maximum(w["tt"] - 2 * w["ts"] / bm + w["ss"] / bm ** 2, 0.0)
        drafted = dict(w["drafted"])
        idle = [r for r in ids if not drafted[r]]
        woke: set = set()
        if idle and draftable_now is not None:  # the live check: an idle request that can draft now is not idle
            woke = draftable_now(idle)
            for r in woke:
                drafted[r] = True
            idle = [r for r in idle if r not in woke]
        dof = float((n - 1).sum())
        pooled = float(g_ss.sum()) / dof
        z = self.confidence + math.sqrt(2 * math.log(len(ids))) if self.confidence > 0 else 0.0
        # the step seconds' variance pooled over both arms' windows (either arm alone may hold 2 steps: a probe)
        sec_var = (float(((a - a.mean()) ** 2).sum() + ((b - bm) ** 2).sum()) / (a.size + b.size - 2)
                   if a.size + b.size > 2 else float("inf"))
        slower = idle_slower = 0
        if idle:  # one token per step, certain: slower together when the steps they ran in measure longer
            steps = sorted({i for r in idle for i in w["steps_of"][r]})
            s_idle = a[steps]
            gap = float(s_idle.mean() - bm)
            margin = self.confidence * math.sqrt(sec_var * (1 / s_idle.size + 1 / b.size)) if self.confidence > 0 else 0.0
            idle_slower = len(idle) if gap > margin + _TIE * bm else 0
            slower += idle_slower
        mask = np.asarray([drafted[r] for r in ids])
        if mask.any():
            k = self._PRIOR_STEPS
            var = (k * pooled + g_ss[mask]) / (k + n[mask] - 1)  # (n − 1) · s_r² is the centred sum of squares
            slower += int(np.count_nonzero(g_mean[mask] + z * np.sqrt(var / n[mask]) < -_TIE * rho))
        return {"cost_ratio": rho, "cost_ratio_error": rho_se if math.isfinite(rho_se) else None,
                "requests": len(ids), "idle": len(idle), "idle_draftable_now": len(woke),
                "slower": slower, "slower_idle": idle_slower,
                "lowest_tokens_per_step": float(w["t_mean"].min())}

    def _like_now(self, batch_size: int) -> list:
        """The policy's last ``window`` steps in which rows drafted, of them those where at least the share of rows
        that can draft now (the load state's ``draftable``) drafted, as (tokens, seconds, rows); empty when no row can
        draft now, the batch has more than :attr:`CONTENT_ROWS` rows or the load state does not say."""
        window = self._drafting.get(batch_bucket(batch_size), ())
        if batch_size > self.CONTENT_ROWS or len(window) < 2:  # before the rows' lookaheads run
            return []
        can = getattr(self._load, "draftable", ())
        if len(can) != batch_size:
            return []
        share = sum(1 for c in can if c > 0) / batch_size
        if share == 0:
            return []
        return [(t, sec, rows) for t, sec, drafted, rows in window if drafted >= share]

    def _drafting_steps_win(self, batch_size: int, plain_rate: float) -> bool:
        """Whether the policy's last ``window`` steps in which rows drafted (each step's
        ``last_step_row_drafted``), of them those where at least the share of rows that can draft now drafted (the
        load state's ``draftable``), measure fast enough: ``plain_rate`` (tokens/s) does not lead their rate by the
        winner's margin (:meth:`_plain_leads`; the rate check read on steps like the one being decided). False when no
        row can draft now, the batch has more than :attr:`CONTENT_ROWS` rows, the load states do not say, or fewer
        than 2 such steps were measured (the check then reads the arm's window, as before)."""
        steps = [(t, sec) for t, sec, _ in self._like_now(batch_size)]
        if len(steps) < 2:
            return False
        rate, err = _ratio(steps)
        return not self._plain_leads(rate, err, plain_rate, self.rate_error(batch_size, self.PLAIN))

    def _plain_leads(self, policy_rate: float, policy_err: float, plain_rate: float, plain_err: float) -> bool:
        """Whether plain decoding's rate exceeds the policy's by more than ``confidence`` standard errors of their
        difference (tokens/s; no margin at ``confidence`` 0, even where a spread is unknown)."""
        margin = self.confidence * math.hypot(policy_err, plain_err) if self.confidence > 0 else 0.0
        return plain_rate - policy_rate > margin + _TIE * policy_rate

    def winner(self, batch_size: int) -> str:
        """The arm the guard runs at ``batch_size`` outside probes (see the class docstring)."""
        p, q = self.rate(batch_size, self.POLICY), self.rate(batch_size, self.PLAIN)
        self._last_check, self._why = None, None
        if p is not None and q is not None:
            like_now = False
            if self._plain_leads(p, self.rate_error(batch_size, self.POLICY), q, self.rate_error(batch_size, self.PLAIN)):
                if not self._drafting_steps_win(batch_size, q):
                    self._why = "rate"
                    return self.PLAIN
                like_now = True  # the request check reads the same steps
            check = self.request_check(batch_size, like_now=like_now) if self.latency else None
            if check is not None and check["slower"] > 0 and not like_now and self._like_now(batch_size):
                check = self.request_check(batch_size, like_now=True)  # the requests on steps like the next one
            self._last_check = check
            if check is not None and check["slower"] > 0:
                self._why = "request_idle" if check.get("slower_idle", 0) > 0 else "request_drafting"
                return self.PLAIN
            return self.POLICY
        below = [b for b in self._stats if b < batch_bucket(batch_size) and len(self._stats[b]) == 2]
        if not below:
            return self.POLICY
        w = self.winner(max(below))
        self._last_check, self._why = None, ("smaller_bucket" if w == self.PLAIN else None)
        return w

    # ------------------------------------------------------------------ decisions
    def _choose(self, B: int) -> str:
        s = self._sched.setdefault(batch_bucket(B), {"left": self.explore_every, "interval": self.explore_every, "probe_left": 0,
                                       "probe_arm": None, "probed": False, "last": None})
        if s["probe_left"] > 0:
            s["probe_left"] -= 1
            self._why = "probe" if s["probe_arm"] == self.PLAIN else None
            return s["probe_arm"]
        w = self.winner(B)
        if s["probed"]:  # the probe's steps are measured now: back off while it changed nothing
            s["interval"] = (self.explore_every if w != s["last"]
                             else min(2 * s["interval"], self.max_explore_every))
            s["left"], s["probed"] = s["interval"], False
        s["last"] = w
        check, self._last_check = self._last_check, None  # the request check winner() ran (None: none ran)
        if check is not None and check["idle"] + check["idle_draftable_now"] > 0:
            reads = self._idle_reads.setdefault(batch_bucket(B), [0, 0, 0])
            reads[0] += 1
            reads[1] += check["idle"] + check["idle_draftable_now"]
            reads[2] += check["idle_draftable_now"]
        if s["left"] <= 0:  # `interval` steps of the winner since the last probe: probe the other arm
            s["probe_arm"] = self.PLAIN if w == self.POLICY else self.POLICY
            s["probe_left"], s["probed"] = self.probe_steps - 1, True
            self._why = "probe" if s["probe_arm"] == self.PLAIN else None
            return s["probe_arm"]
        s["left"] -= 1
        return w

    def gamma(self, load: Any) -> int:
        """The step's γ (0..max_depth), decided once per load state (the rows of the step ask once for all of them,
        :meth:`_StepGammaController.observe_loads`; an answer kept per load serves a row that asks again)."""
        if self._decided[0] is load:
            return self._decided[1]
        self._learn(load)
        B = int(load.batch_size)
        self._running = frozenset(getattr(load, "row_ids", ())) or None
        self._load, self._serial = load, self._serial + 1
        arm = self._choose(B)
        # the policy is asked only for a step its answer can run: a plain step costs no policy inference and reads
        # the load's per-row lookaheads (``draftable``, built on first read by the batched decoder) only when a
        # request in the window is idle (request_check) or, at up to CONTENT_ROWS rows, plain leads by the rate
        # (_like_now)
        g_policy = int(self.policy.gamma(load)) if arm == self.POLICY else None
        g = g_policy if g_policy is not None and g_policy > 0 else 0
        if g == 0:
            why = self._why if arm == self.PLAIN else "policy_gamma_0"
            arm = self.PLAIN  # the policy's own γ = 0 is a plain step, measured as one
            reasons = self._plain_reasons.setdefault(batch_bucket(B), dict.fromkeys(self.PLAIN_REASONS, 0))
            reasons[why] = reasons.get(why, 0) + 1
        self._pending, self._decided = (B, arm), (load, g)
        self.decisions.append((B, g_policy, g, arm))
        return g

    def controller(self) -> DraftController:
        """A new per-row controller: it drafts while its depth is below the step's γ."""
        return _StepGammaController(self)

    __call__ = controller

    @property
    def trained_dtype(self) -> str | None:
        """The guarded policy's training precision (the guard measures speed, but the γ it runs is the policy's)."""
        return getattr(self.policy, "trained_dtype", None)

    @property
    def step_policy(self) -> Any:
        """The guarded policy (a precision mismatch is warned once for it, however many guards and rows run it)."""
        return self.policy

    def summary(self) -> dict:
        """Per batch-size bucket measured (keyed by its largest size, :func:`batch_bucket`; ``batch_sizes`` names
        its range, e.g. ``"5-8"``): each arm's tokens/s and steps counted, :meth:`request_check` over every request
        in the window, finished ones included (None: not measured), the winner, the steps decided, those the policy
        speculated in (asked, γ > 0) and those the guard ran plain without asking the policy (``plain_unasked``,
        probes included) (for reports); ``plain_reasons``: the steps run plain, by why (:attr:`PLAIN_REASONS`);
        ``idle_reads``: over the steps decided, the decisions whose request check
        found requests that drafted nothing in their policy steps, how many such requests in all, and how many of
        those could draft at the time (tested as drafting requests, not as idle)."""
        out = {}
        checks = {B: self.request_check(B, every_request=True) for B in self._stats}  # not only the last step's
        for B in sorted(self._stats):
            arms = {a: {"tokens_per_second": self.rate(B, a), "steps": int(v[1])} for a, v in self._stats[B].items()}
            decided = [d for d in self.decisions if batch_bucket(d[0]) == B]
            lo = B // 2 + 1 if B > 1 else 1
            reads = self._idle_reads.get(B, [0, 0, 0])
            out[B] = {"batch_sizes": str(B) if lo == B else f"{lo}-{B}", "arms": arms, "requests": checks[B],
                      "idle_reads": {"decisions": reads[0], "idle": reads[1], "draftable_now": reads[2]},
                      "winner": self.winner(B), "steps": len(decided),
                      "policy_speculated": sum(1 for d in decided if d[1] is not None and d[1] > 0),
                      "plain_unasked": sum(1 for d in decided if d[1] is None),
                      "plain_reasons": dict(self._plain_reasons.get(B, dict.fromkeys(self.PLAIN_REASONS, 0)))}
        return out

    def __repr__(self) -> str:
        return (f"SpeculationGuard({self.policy!r}, explore_every={self.explore_every}, "
                f"max_explore_every={self.max_explore_every}, probe_steps={self.probe_steps}, window={self.window}, "
                f"confidence={self.confidence}, latency={self.latency})")


__all__ = [
    "AdaptiveVerification", "BatchSizeTable", "ConfidenceThresholdController", "LookupFirstController",
    "MatchLengthController", "OnlineAcceptanceEstimator", "SingleSourceController", "SpeculationGuard", "StepTimeCap",
    "SuffixScoreController", "batch_bucket", "choose_budget", "profile_step_cost",
]
