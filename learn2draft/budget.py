"""Speculation under load: the hand-written rules engines use, one implementation for the real batched loop
(:mod:`learn2draft.batched`), the request-stream replay (:mod:`learn2draft.replay.serve`) and reports (issue 17).

* :class:`BatchSizeTable` — a fixed γ per batch-size range, read from the step's load: vLLM's
  ``num_speculative_tokens_per_batch_size`` (PR #32374: ``[[start_bs, end_bs, K], …]`` or ``{"1-16": 3, …}``; vLLM
  0.34.0 accepts the list form only: ``python -m policies.vllm export-table`` writes it),
  TensorRT-LLM's ``draft_len_schedule``. A per-row :class:`learn2draft.control.DraftController` of the batched
  decoder (it reads the load in ``observe_load``), and a policy ``(load, rows) -> depths`` of the replay simulator.
* :class:`AdaptiveVerification` — vLLM's adaptive verification (``enable_adaptive_verification``, PRs #47808 and
  #52228): every row drafts up to ``max_depth``, then the global top-B drafted slots by survival probability are
  verified, B chosen against the step's cost (:func:`choose_budget`); its acceptance model is
  :class:`OnlineAcceptanceEstimator`, an online per-position logistic on the draft's top-2 margin (as read from the
  PRs; vLLM 0.34.0's released estimator regresses on logit(max q) instead, docs/guides/vllm.md). In the real loop
  it is a verification budget of :meth:`learn2draft.batched.BatchedSpeculativeDecoder.step` priced by a latency
  profile (:func:`profile_step_cost`); the replay wraps the same object with the simulator's costs.

* :class:`StepTimeCap` — a verification budget that keeps a step within a slack of a plain step's seconds when a row
  drafted nothing (that row's request pays the step's growth and cannot gain from it).

All read only the draft side and the load (never a drafted token's verification outcome before it is verified),
so the output law is unchanged. Numpy only: no torch import.

How a user (and :mod:`eval.serve`) wires the budget::

    av = AdaptiveVerification(max_depth, cost=profile_step_cost(profile, "lookup", max_depth))
    serve(decoder, requests, lambda: FixedDepthController(max_depth), budget=av, on_step=av.observe)

``av(margins, load)`` is called by the step after drafting and remembers the margins and the counts it returned;
``av.observe(step)`` (the ``on_step`` hook) reads each row's accepted length τ from the step's
:class:`~learn2draft.metrics.CycleResult` and turns it into labels for the estimator.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from learn2draft.control import DraftController

if TYPE_CHECKING:
    from learn2draft.state import DraftState


# --------------------------------------------------------------------------------------------- per batch size
def parse_batch_size_table(table: Any) -> list[tuple[int, int, int]]:
    """A batch-size table as sorted ``(start_bs, end_bs, γ)`` ranges (both ends inclusive).

    Args:
        table: vLLM's list format ``[[start_bs, end_bs, K], …]``; or a mapping ``{(start, end): γ}``, ``{bs: γ}``
            (one batch size) or ``{"start-end": γ}`` / ``{"bs": γ}`` (string keys, as JSON writes them).

    Returns:
        the ranges sorted by ``start_bs``; they start at batch size 1 and leave no gap and no overlap.

    Raises:
        ValueError: one message naming the first bad entry: not three integers, start < 1, end < start, γ < 0, the
            first range not starting at 1, overlapping ranges, a gap between ranges, or an empty table.
    """
    hint = "write it as [[start_bs, end_bs, K], …] (both ends inclusive), e.g. [[1, 4, 4], [5, 8, 2], [9, 64, 0]]"
    if isinstance(table, Mapping):
        entries = []
        for key, k in table.items():
            if isinstance(key, str):
                parts = key.split("-")
                try:
                    rng = [int(p) for p in parts]
                except ValueError:
                    raise ValueError(f"Batch-size table key {key!r} is not a batch size or a range 'start-end': "
                                     f"{hint}.") from None
                if len(rng) not in (1, 2):
                    raise ValueError(f"Batch-size table key {key!r} is not a batch size or a range 'start-end': "
                                     f"{hint}.")
            elif isinstance(key, tuple):
                rng = list(key)
            else:
                rng = [key]
            entries.append([rng[0], rng[-1], k])
    elif isinstance(table, (list, tuple)):
        entries = [list(e) if isinstance(e, (list, tuple)) else e for e in table]
    else:
        raise ValueError(f"A batch-size table must be a list or a mapping, got {type(table).__name__}: {hint}.")
    if not entries:
        raise ValueError(f"The batch-size table is empty: {hint}.")
    ranges = []
    for e in entries:
        ok = (isinstance(e, list) and len(e) == 3
              and all(isinstance(v, (int, np.integer)) and not isinstance(v, bool) for v in e))
        if not ok:
            raise ValueError(f"Batch-size table entry {e!r} is not three integers [start_bs, end_bs, K]: {hint}.")
        s, t, k = (int(v) for v in e)
        if s < 1 or t < s or k < 0:
            raise ValueError(f"Batch-size table entry {[s, t, k]}: need 1 ≤ start_bs ≤ end_bs and K ≥ 0: {hint}.")
        ranges.append((s, t, k))
    ranges.sort()
    if ranges[0][0] != 1:
        raise ValueError(f"The batch-size table starts at batch size {ranges[0][0]}, not 1: batch sizes "
                         f"1..{ranges[0][0] - 1} have no γ; {hint}.")
    for (s0, t0, _), (s1, t1, _) in zip(ranges, ranges[1:]):
        if s1 <= t0:
            raise ValueError(f"Batch-size table ranges [{s0}, {t0}] and [{s1}, {t1}] overlap: {hint}.")
        if s1 > t0 + 1:
            raise ValueError(f"Batch-size table ranges [{s0}, {t0}] and [{s1}, {t1}] leave batch sizes "
                             f"{t0 + 1}..{s1 - 1} without a γ: {hint}.")
    return ranges


class BatchSizeTable(DraftController):
    """A fixed γ per batch-size range: vLLM's ``num_speculative_tokens_per_batch_size`` as a per-row controller.

    Before each step the batched decoder calls :meth:`observe_load` with the step's
    :class:`learn2draft.state.LoadState`; the row then drafts the γ of the range holding ``load.batch_size``
    (a batch larger than the last range's end uses the last range's γ). Before any load is seen, γ is batch size
    1's. The depth drafted so far is read from the ``depth`` feature (depth / max_depth, as the rules of
    :mod:`policies.rules` read it), so build the decoder with ``max_depth`` = this controller's.

    Args:
        table: see :func:`parse_batch_size_table` (vLLM's ``[[start_bs, end_bs, K], …]`` or a mapping).
        max_depth: the decoder's ``max_depth`` (the scale of the depth feature); default the table's largest γ.

    Raises:
        ValueError: a bad table (:func:`parse_batch_size_table`) or ``max_depth`` below the largest γ.
    """

    def __init__(self, table: Any, max_depth: int | None = None):
        self.ranges = parse_batch_size_table(table)
        top = max(k for _, _, k in self.ranges)
        if max_depth is not None and (not isinstance(max_depth, int) or max_depth < top):
            raise ValueError(f"max_depth must be an integer ≥ the table's largest γ ({top}), got {max_depth!r}.")
        self.max_depth = self.depth_feature_scale = int(top if max_depth is None else max_depth)
        self.gamma = self.gamma_for(1)

    def gamma_for(self, batch_size: int) -> int:
        """The γ of the range holding ``batch_size`` (≥ 1; beyond the last range: the last γ)."""
        for s, t, k in self.ranges:
            if s <= batch_size <= t:
                return k
        return self.ranges[-1][2]

    def to_vllm(self) -> list[list[int]]:
        """The table in vLLM's ``num_speculative_tokens_per_batch_size`` list format ``[[start_bs, end_bs, K], …]``."""
        return [[s, t, k] for s, t, k in self.ranges]

    def __call__(self, load, rows) -> np.ndarray:
        """The replay simulator's face (:data:`learn2draft.replay.serve.Policy`): this table's γ at
        ``load.running`` rows, for every row; int64 (B,)."""
        return np.full(int(load.running), self.gamma_for(int(load.running)), dtype=np.int64)

    reads_load = True

    def observe_load(self, load) -> None:
        """Read the step's :class:`~learn2draft.state.LoadState` (its ``batch_size``) before the row drafts."""
        self.gamma = self.gamma_for(int(load.batch_size))

    @property
    def step_depth(self) -> int:
        """The step's γ: the depth rule stops there without asking :meth:`decide`."""
        return self.gamma

    @classmethod
    def observe_loads(cls, controllers: Sequence[BatchSizeTable], load) -> None:
        """:meth:`observe_load` of a step's rows at once: one :meth:`gamma_for` of ``load.batch_size`` per distinct
        table (rows with equal ranges share it). A subclass with its own :meth:`observe_load` or :meth:`gamma_for`,
        or a row given its own ``observe_load``, has each row's called."""
        if (cls.observe_load is not BatchSizeTable.observe_load or cls.gamma_for is not BatchSizeTable.gamma_for
                or any(["observe_load" in c.__dict__ for c in controllers])):
            return super().observe_loads(controllers, load)
        size, decided = int(load.batch_size), {}
        for c in controllers:
            key = tuple(c.ranges)
            g = decided.get(key)
            c.gamma = g if g is not None else decided.setdefault(key, c.gamma_for(size))
        return None

    @classmethod
    def step_depths(cls, controllers: Sequence[BatchSizeTable]) -> list[int]:
        """Each row's step γ (a subclass with its own :attr:`step_depth`: each row's)."""
        if cls.step_depth is not BatchSizeTable.step_depth:
            return super().step_depths(controllers)
        return [c.gamma for c in controllers]

    reads_state = False  # CONTINUE below the step's γ, where the depth rule stops

    def decide(self, state: DraftState) -> bool:
        """CONTINUE while ``state.depth`` (the integer depth) is below the step's γ."""
        return state.depth < self.gamma

    def __repr__(self) -> str:
        return f"BatchSizeTable({self.to_vllm()})"


# --------------------------------------------------------------------------------------------- acceptance
def _sigmoid(z: np.ndarray) -> np.ndarray:
    return 1.0 / (1.0 + np.exp(-np.clip(z, -40.0, 40.0)))


def fit_logistic(x: np.ndarray, y: np.ndarray, w: float = 0.0, b: float = 0.0, l2: float = 1e-3,
                 iterations: int = 25, tol: float = 1e-8) -> tuple[float, float]:
    """Newton-IRLS fit of ``P(y = 1 | x) = sigmoid(w·x + b)`` (a ridge ``l2``·(w² + b²) on the 2×2 Hessian).

    Args:
        x: float (n,) the feature (the draft's top-2 margin); y: (n,) labels in {0, 1}.
        w, b: the starting coefficients (the previous round's fit).
        iterations: the most Newton steps; stops earlier when a step moves both coefficients by < ``tol``.

    Returns:
        ``(w, b)`` floats; the start when the Hessian is singular or a step is not finite.
    """
    x = np.asarray(x, dtype=np.float64)
    y = np.asarray(y, dtype=np.float64)
    X = np.stack([x, np.ones_like(x)], axis=1)  # design row [margin, 1], as vLLM's estimator
    theta = np.array([w, b], dtype=np.float64)
    for _ in range(iterations):
        p = _sigmoid(X @ theta)
        grad = X.T @ (y - p) - l2 * theta
        H = (X * (p * (1 - p))[:, None]).T @ X + l2 * np.eye(2)
        try:
            step = np.linalg.solve(H, grad)
        except np.linalg.LinAlgError:
            break
        if not np.all(np.isfinite(step)):
            break
        theta = theta + step
        if np.max(np.abs(step)) < tol:
            break
    return float(theta[0]), float(theta[1])


class OnlineAcceptanceEstimator:
    """Per-position acceptance probabilities p_k = sigmoid(w_k·margin + b_k), learned while serving.

    vLLM's ``OnlineAcceptanceEstimator`` (``vllm/v1/worker/gpu/spec_decode/acceptance_estimator.py``): one logistic
    per draft position k (the conditional probability that the k-th drafted token is accepted given the earlier
    ones were) on the draft's top-2 margin; labels are the accepted positions (1) and the first rejected one (0),
    later positions have none. Observations accumulate over a *round*; every ``refit_every`` steps each position
    with ≥ ``min_observations`` in the round is refitted by Newton-IRLS from its current coefficients
    (:func:`fit_logistic`; vLLM takes one damped Newton step from sufficient statistics on the GPU, here the
    round's observations are on the host and are fitted to convergence), a negative slope is rejected (a more
    decisive draft cannot be less likely accepted) and replaced by the position's mean acceptance in the round
    (w_k = 0, b_k = logit(mean)), and the round starts clean. For the first ``warmup_refits`` refits
    :attr:`needs_full_verification` is True: callers verify whole blocks so the labels are not censored by the
    budget's own trimming.

    Args:
        num_positions: K, the deepest draft position (the decoder's ``max_depth``, ≥ 1).
        refit_every: steps per round (vLLM: 100). ``warmup_refits``: vLLM: 3. ``min_observations``: vLLM: 50.
        l2: ridge of the 2×2 solve (vLLM: 1e-3). ``initial_bias``: b_k before any fit, with w_k = 0
            (vLLM: 1.5, a uniform acceptance of 0.82).

    Raises:
        ValueError: an argument out of range.
    """

    def __init__(self, num_positions: int, refit_every: int = 100, warmup_refits: int = 3,
                 min_observations: int = 50, l2: float = 1e-3, initial_bias: float = 1.5):
        for name, v, lo in (("num_positions", num_positions, 1), ("refit_every", refit_every, 1),
                            ("warmup_refits", warmup_refits, 0), ("min_observations", min_observations, 1)):
            if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < lo:
                raise ValueError(f"{name} must be an integer ≥ {lo}, got {v!r}.")
        if not l2 > 0:
            raise ValueError(f"l2 must be > 0, got {l2!r}.")
        self.num_positions, self.refit_every = int(num_positions), int(refit_every)
        self.warmup_refits, self.min_observations, self.l2 = int(warmup_refits), int(min_observations), float(l2)
        self.weights = np.zeros(self.num_positions)
        self.biases = np.full(self.num_positions, float(initial_bias))
        self.refits = 0
        self.rejected_slopes = 0  # refits of a position whose slope came out negative (the mean was used)
        self._steps_since_refit = 0
        self._x: list[list[float]] = [[] for _ in range(self.num_positions)]
        self._y: list[list[float]] = [[] for _ in range(self.num_positions)]

    @property
    def needs_full_verification(self) -> bool:
        """Whether callers must still verify whole draft blocks (the warm-up refits are not done)."""
        return self.refits < self.warmup_refits

    def predict(self, margins: np.ndarray) -> np.ndarray:
        """float64 (k,) p_0..p_{k−1} for the drafted tokens' margins float (k,), k ≤ K (deeper positions use the
        last position's coefficients)."""
        m = np.asarray(margins, dtype=np.float64)
        pos = np.minimum(np.arange(m.size), self.num_positions - 1)
        return _sigmoid(self.weights[pos] * m + self.biases[pos])

    def add(self, margins: np.ndarray, accepted: int, verified: int, censored: bool = False) -> None:
        """Record one row's outcome: of its ``verified`` drafted tokens (margins float (≥ verified,)), the first
        ``accepted`` were accepted — labels 1 at positions < accepted, 0 at position ``accepted`` if it was
        verified; later positions get none. ``censored``: the row stopped for another reason (EOS,
        ``max_new_tokens``), so the rejection is not known: only the accepted positions are labelled."""
        m = np.asarray(margins, dtype=np.float64)
        last = min(int(accepted) + (0 if censored else 1), int(verified), self.num_positions, m.size)
        for k in range(last):
            self._x[k].append(float(m[k]))
            self._y[k].append(1.0 if k < accepted else 0.0)

    def end_step(self) -> bool:
        """Count a step; refit at the end of a round. Returns whether it refitted."""
        self._steps_since_refit += 1
        if self._steps_since_refit < self.refit_every:
            return False
        self.refit()
        return True

    def refit(self) -> None:
        """Refit every position with ≥ ``min_observations`` in this round; start a new round."""
        for k in range(self.num_positions):
            if len(self._y[k]) < self.min_observations:
                continue
            x, y = np.asarray(self._x[k]), np.asarray(self._y[k])
            w, b = fit_logistic(x, y, self.weights[k], self.biases[k], self.l2)
            if not (np.isfinite(w) and np.isfinite(b)) or w < 0:
                self.rejected_slopes += int(w < 0)
                mean = float(np.clip(y.mean(), 1e-3, 1 - 1e-3))
                w, b = 0.0, float(np.log(mean / (1 - mean)))
            self.weights[k], self.biases[k] = w, b
        self._x = [[] for _ in range(self.num_positions)]
        self._y = [[] for _ in range(self.num_positions)]
        self._steps_since_refit = 0
        self.refits += 1

    def observations(self) -> list[int]:
        """Observations per position in the current round."""
        return [len(y) for y in self._y]


# --------------------------------------------------------------------------------------------- costs
def profile_step_cost(profile: Any, drafter: str, max_depth: int, batch_context: str = "max",
                      drafted_before: bool = True) -> Callable[..., float]:
    """The seconds of one batched step as a latency profile prices it, for :class:`AdaptiveVerification`.

    Args:
        profile: a :class:`learn2draft.replay.latency.LatencyProfile` with the batch axis (``python -m eval.profile
            --batch-sizes 1,2,4,8,16``).
        drafter: the drafter whose batched draft step it prices.
        max_depth: the tokens every row drafts before the budget chooses.
        batch_context: ``"max"`` (the longest row's context prices the step, as the replay) or ``"mean"``.
        drafted_before: the rows drafted ``max_depth`` tokens before the choice (the real loop: that cost is the
            same for every B); False charges drafting only up to the longest verified draft.

    Returns:
        ``cost(load, longest, verified=None) -> seconds``: ``load`` a :class:`learn2draft.state.LoadState`,
        ``longest`` the longest verified draft, ``verified`` the drafted tokens verified over all rows. The
        verification is ragged, B + ``verified`` tokens, as the batched decoder feeds them
        (:meth:`LatencyProfile.step_batched`); ``verified`` None prices it padded to the longest, B × (longest + 1).
        Plus the real loop's per-step seconds beyond the tables (:meth:`LatencyProfile.batch_overhead`, 0 for a
        profile without them).

    Raises:
        ValueError: (when called) the profile lacks the batch axis or the batch size.
    """
    def cost(load, longest: int, verified: int | None = None) -> float:
        B = int(load.batch_size)
        ctx = max(load.context_lens) if batch_context == "max" else float(np.mean(load.context_lens))
        drafted = max_depth if drafted_before else longest
        per_row = longest + 1 if verified is None else 1 + verified / B
        verify = float(profile.verify_batched(B, per_row, ctx))
        draft = drafted * float(profile.draft_step_batched(drafter, B, ctx))
        return max(draft + verify + profile.batch_overhead(drafter, B, longest), verify)  # at least its verification

    return cost


# --------------------------------------------------------------------------------------------- the budget
def choose_budget(survival: Sequence[np.ndarray],
                  step_seconds: Callable[[int, int], float]) -> tuple[list[int], int]:
    """vLLM's global top-B rule: keep the B drafted slots of highest survival across all rows,
    B* = argmax_B (N + Σ_{j<B} S_sorted[j]) / step_seconds(longest kept draft, B).

    Survival decreases along a row (a product of probabilities), so the top B slots are a prefix of every row. The
    batched forward of :mod:`learn2draft.batched` is ragged, N + B tokens as in vLLM, so the verification's cost is a
    function of B; the drafting (lockstep over the rows) and the per-step overheads are functions of the longest kept
    draft, so the cost takes both.

    Args:
        survival: per row, float (γ_i,) S(r, k) = Π_{i≤k} p_i (non-increasing).
        step_seconds: ``(longest, verified) -> seconds`` of the step when the longest verified draft is ``longest``
            and ``verified`` drafted tokens are verified over all rows (0, 0: none).

    Returns:
        ``(counts, B)``: per row the drafted tokens to verify, and their total B. Ties keep the smallest B.
    """
    N = len(survival)
    slots = [(-float(s), r, k) for r, row in enumerate(survival) for k, s in enumerate(np.asarray(row)) if s > 0]
    slots.sort()
    counts = [0] * N
    longest = 0
    expected = float(N)
    best = (expected / step_seconds(0, 0), 0)
    for B, (neg_s, r, k) in enumerate(slots, start=1):
        counts[r] = max(counts[r], k + 1)
        longest = max(longest, counts[r])
        expected -= neg_s
        value = expected / step_seconds(longest, B)
        if value > best[0]:
            best = (value, B)
    keep = [0] * N
    for _, r, k in slots[: best[1]]:
        keep[r] = max(keep[r], k + 1)
    return keep, best[1]


class AdaptiveVerification:
    """vLLM's adaptive verification: per drafted slot a survival probability, the global top-B slots verified.

    Each step: every row's drafted tokens get p_k from the :class:`OnlineAcceptanceEstimator`, their survival
    S(r, k) = Π_{i≤k} p_i, and the step verifies the global top-B slots with B from :func:`choose_budget` against the
    step's cost. While the estimator warms up, every drafted token is verified. After the step the rows' accepted
    lengths become the estimator's labels (:meth:`learn`; the real loop's :meth:`observe`).

    Faces: the real loop's verification budget (``av(margins, load)`` then ``av.observe(step)``, priced by ``cost``);
    the replay's (:class:`learn2draft.replay.serve.ServeSimulator` costs: :meth:`counts` with its step seconds, then
    :meth:`learn`).

    Args:
        max_depth: the deepest draft position (the decoder's ``max_depth``, ≥ 1).
        cost: ``(load, longest, verified) -> seconds`` of a step at that load whose longest verified draft is
            ``longest``, ``verified`` drafted tokens verified in all (:func:`profile_step_cost`); needed for the real
            loop's ``av(margins, load)`` only.
        estimator: the acceptance model (default: a new :class:`OnlineAcceptanceEstimator` of ``max_depth``
            positions with vLLM's settings; ``**estimator_kw`` are passed to it).

    Attributes:
        history: per step, ``(n_rows, drafted, verified)`` (for reports).

    Raises:
        ValueError: ``max_depth`` < 1, or the estimator's arguments (:class:`OnlineAcceptanceEstimator`).
    """

    def __init__(self, max_depth: int, cost: Callable[[Any, int], float] | None = None,
                 estimator: OnlineAcceptanceEstimator | None = None, **estimator_kw):
        if isinstance(max_depth, bool) or not isinstance(max_depth, (int, np.integer)) or max_depth < 1:
            raise ValueError(f"max_depth must be an integer ≥ 1, got {max_depth!r}.")
        self.max_depth = int(max_depth)
        self.cost = cost
        self.estimator = estimator or OnlineAcceptanceEstimator(self.max_depth, **estimator_kw)
        self.history: list[tuple[int, int, int]] = []
        self._last: tuple[list[np.ndarray], list[int]] | None = None

    @property
    def warming_up(self) -> bool:
        """Whether whole blocks are still verified (the estimator's warm-up refits are not done)."""
        return self.estimator.needs_full_verification

    def counts(self, margins: Sequence[np.ndarray], step_seconds: Callable[[int], float]) -> list[int]:
        """Per row, the drafted tokens to verify (every one while the estimator warms up).

        Args:
            margins: per row, float (γ_i,) the drafted tokens' top-2 margins (NaN: unknown, read as 0).
            step_seconds: ``(longest, verified) -> seconds`` of the step (:func:`choose_budget`).
        """
        margins = [np.nan_to_num(np.asarray(m, dtype=np.float64), nan=0.0) for m in margins]
        if self.warming_up:
            keep = [int(m.size) for m in margins]
        else:
            keep, _ = choose_budget([np.cumprod(self.estimator.predict(m)) for m in margins], step_seconds)
        self.history.append((len(margins), int(sum(m.size for m in margins)), int(sum(keep))))
        return keep

    def learn(self, margins: Sequence[np.ndarray], accepted: Sequence[int], verified: Sequence[int],
              censored: Sequence[bool] | None = None) -> None:
        """Fold one step's rows into the estimator (:meth:`OnlineAcceptanceEstimator.add` per row, then its
        ``end_step``): per row its margins, accepted length τ, verified tokens and whether it stopped for another
        reason (EOS, the token limit: no rejection label)."""
        censored = [False] * len(margins) if censored is None else censored
        for m, a, v, c in zip(margins, accepted, verified, censored):
            self.estimator.add(np.nan_to_num(np.asarray(m, dtype=np.float64), nan=0.0), int(a), int(v), bool(c))
        self.estimator.end_step()

    def __call__(self, margins: list[np.ndarray], load) -> list[int]:
        """The budget hook of :meth:`learn2draft.batched.BatchedSpeculativeDecoder.step`: ``margins`` per row
        float64 (γ_i,), ``load`` the step's :class:`~learn2draft.state.LoadState` (priced by ``cost``). Remembers the
        margins for :meth:`observe`.

        Raises:
            ValueError: no ``cost`` was given.
        """
        if self.cost is None:
            raise ValueError("AdaptiveVerification needs the step's cost in the real loop: "
                             "AdaptiveVerification(max_depth, cost=profile_step_cost(profile, drafter, max_depth)).")
        keep = self.counts(margins, lambda longest, verified: self.cost(load, longest, verified))
        self._last = ([np.asarray(m, dtype=np.float64) for m in margins], keep)
        return keep

    def observe(self, step, margins: Sequence[np.ndarray] | None = None) -> None:
        """Learn from a finished step (the ``on_step`` hook of :func:`learn2draft.batched.serve`).

        Args:
            step: the :class:`learn2draft.metrics.BatchStep`; its ``rows`` (in batch order) hold each row's
                ``num_accepted`` τ, ``verify_size`` and ``finished``.
            margins: per row, the drafted tokens' margins; default those of the last budget call.

        Raises:
            ValueError: the step has another number of rows than the margins.
        """
        rows = list(step.rows.values())
        if margins is None:
            if self._last is None:
                return
            margins = self._last[0]
        if len(margins) != len(rows):
            raise ValueError(f"observe: the step has {len(rows)} rows but {len(margins)} margin arrays were given.")
        self.learn(margins, [r.num_accepted for r in rows], [r.verify_size for r in rows], [r.finished for r in rows])
        self._last = None

    def __repr__(self) -> str:
        return f"AdaptiveVerification(max_depth={self.max_depth})"


class StepTimeCap:
    """A verification budget that bounds what a speculating step costs the requests that cannot gain from it.

    In a batched step every row waits for the one forward: a row that drafted nothing (prompt lookup has no match)
    commits one token, as in a plain step, but in a step made longer by the other rows' drafted tokens, so that
    request's inter-token latency grows by the step's growth. Measured on a 2-core AMD EPYC in bf16 (run 22 of
    ``docs/results/2026-12-07-replay-backend-run-22.md``, 8 rows): a request that never drafted took 75–81 ms a token
    under every speculating method against 53 ms without speculation, and set the inter-token latency p99 over
    requests. When at least one row drafted nothing, this budget keeps the step's predicted seconds within
    ``(1 + slack)`` × a plain step's at the same load (``cost(load, 0, 0)``), verifying the drafted tokens of highest
    survival first (the product of the drafted tokens' top-2 margins along a row — a ranking, not a calibrated
    acceptance probability as :class:`AdaptiveVerification`'s estimator gives —, shallow positions first on ties, so
    each row keeps a prefix of its draft); so each such request is at most ``slack`` slower in that step. When
    every row drafted, every drafted token is verified (each row can gain). Its decision reads only the draft side
    and the load, so the output law is unchanged; a cut draft is rolled back before the forward
    (:meth:`learn2draft.decoding.SpeculativeDecoder.truncate_draft`).

    How a user wires it (beside any controller or the speed guard)::

        cap = StepTimeCap(profile_step_cost(profile, "lookup", max_depth), slack=0.05)
        serve(decoder, requests, guard, budget=cap)

    Args:
        cost: ``(load, longest, verified) -> seconds`` of a step at ``load`` whose longest verified draft is
            ``longest`` and whose rows verify ``verified`` drafted tokens in all (:func:`profile_step_cost`).
        slack: the step's allowed growth over a plain step's seconds when a row drafted nothing (≥ 0; 0: such a
            step verifies only drafted tokens the profile prices at no cost).

    Attributes:
        history: per step, ``(rows, rows that drafted nothing, drafted tokens, verified tokens)`` (for reports).

    Raises:
        ValueError: ``slack`` is not a finite number ≥ 0, or ``cost`` is not callable.
    """

    def __init__(self, cost: Callable[[Any, int, int], float], slack: float = 0.05):
        if not callable(cost):
            raise ValueError(f"StepTimeCap needs the step's cost, a callable (load, longest, verified) -> seconds, "
                             f"e.g. profile_step_cost(profile, drafter, max_depth); got a {type(cost).__name__}.")
        if isinstance(slack, bool) or not isinstance(slack, (int, float, np.floating)) or not 0 <= slack < np.inf:
            raise ValueError(f"slack must be a finite number ≥ 0, got {slack!r}.")
        self.cost, self.slack = cost, float(slack)
        self.history: list[tuple[int, int, int, int]] = []

    def __call__(self, margins: Sequence[np.ndarray], load: Any) -> list[int]:
        """The budget hook of :meth:`learn2draft.batched.BatchedSpeculativeDecoder.step`: per row, how many of its
        drafted tokens to verify (``margins``: per row, float64 (γ_i,) the drafted tokens' top-2 margins, NaN read as
        0; ``load``: the step's :class:`~learn2draft.state.LoadState`)."""
        drafted = [int(np.asarray(m).size) for m in margins]
        idle = sum(1 for d in drafted if d == 0)
        keep = drafted
        if idle and any(drafted):
            limit = (1.0 + self.slack) * float(self.cost(load, 0, 0))
            if float(self.cost(load, max(drafted), sum(drafted))) > limit:
                keep = self._fit(margins, load, limit)
        self.history.append((len(drafted), idle, sum(drafted), sum(keep)))
        return keep

    def _fit(self, margins: Sequence[np.ndarray], load: Any, limit: float) -> list[int]:
        """The drafted slots of highest survival, taken while the step's predicted seconds stay within ``limit``."""
        slots = sorted((-float(s), k, r) for r, m in enumerate(margins)
                       for k, s in enumerate(np.cumprod(np.clip(np.nan_to_num(np.asarray(m, dtype=np.float64),
                                                                              nan=0.0), 0.0, 1.0))))
        keep = [0] * len(margins)
        longest = verified = 0
        for _, k, r in slots:  # (r, k) follows (r, k − 1): survival does not grow along a row, ties by position
            if float(self.cost(load, max(longest, k + 1), verified + 1)) > limit:
                break
            keep[r], longest, verified = k + 1, max(longest, k + 1), verified + 1
        return keep

    def summary(self) -> dict:
        """Over the steps seen: steps, those the cap bounded (a row drafted nothing while another drafted), those it
        cut, and the drafted and verified tokens in all (for reports)."""
        h = self.history
        return {"steps": len(h), "steps_bounded": sum(1 for _, i, d, _ in h if i and d),
                "steps_cut": sum(1 for _, _, d, v in h if v < d), "drafted": sum(d for _, _, d, _ in h),
                "verified": sum(v for _, _, _, v in h), "slack": self.slack}

    def __repr__(self) -> str:
        return f"StepTimeCap(slack={self.slack})"


__all__ = ["AdaptiveVerification", "BatchSizeTable", "OnlineAcceptanceEstimator", "StepTimeCap", "choose_budget",
           "fit_logistic", "parse_batch_size_table", "profile_step_cost"]
