"""The one place a rate or a distribution of measurements is computed, and the records they are computed from: a
cycle's :class:`CycleResult` (the :class:`DraftAction` it executed, its tokens and seconds), a generation's
:class:`GenerationResult`, a request's :class:`RequestResult` and a batched step's :class:`BatchStep`; tokens/s,
percentiles, the τ histogram.

Every report reads its numbers through these functions (the real loop's and the request streams' reports in
:mod:`eval.runner` and :mod:`eval.serve`, the replay's in :mod:`learn2draft.replay.serve`, the environments' and
training's rates), so that "tokens/s" or "p99" means one thing everywhere. numpy only: the replay imports it.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

import numpy as np

#: The percentiles every latency report gives.
PERCENTILES = (50, 90, 99)


def tokens_per_second(tokens: float, seconds: float) -> float:
    """Tokens over seconds; 0.0 when no second was spent.

    Args:
        tokens: tokens generated (summed over generations or requests); ``seconds``: the seconds they took (a wall
            clock, the summed cycle seconds, or a stream's makespan — the caller names which).
    """
    return tokens / seconds if seconds > 0 else 0.0


def tpot_seconds(tokens: int, seconds_after_first: float) -> float:
    """The mean inter-token latency (TPOT): the seconds from the first token to the last over the ``tokens`` − 1 gaps
    between them; 0.0 for fewer than 2 tokens (vLLM's benchmark defines TPOT so)."""
    return seconds_after_first / (tokens - 1) if tokens > 1 else 0.0


def percentiles(values: Iterable[float], empty: float | None = None) -> dict[str, float | None]:
    """``{"mean", "p50", "p90", "p99"}`` of ``values`` (numpy's linear interpolation between order statistics), each
    ``empty`` when there are no values.

    Args:
        values: numbers (e.g. seconds); ``empty``: what every entry is for no values (None in reports, 0.0 where a
            number is needed).
    """
    x = np.asarray(list(values), dtype=np.float64)
    if not x.size:
        return {"mean": empty, **{f"p{q}": empty for q in PERCENTILES}}
    q = np.percentile(x, PERCENTILES)
    return {"mean": float(x.mean()), **{f"p{p}": float(v) for p, v in zip(PERCENTILES, q)}}


def tau_histogram(taus: Iterable[int]) -> list[int]:
    """The accepted-length histogram: entry k = cycles that accepted k drafted tokens (τ = k); [] for no cycle.

    Raises:
        ValueError: a negative τ.
    """
    t = np.asarray(list(taus), dtype=np.int64)
    if t.size and t.min() < 0:
        raise ValueError(f"An accepted length τ is ≥ 0, got {int(t.min())}.")
    return np.bincount(t).tolist() if t.size else []


@dataclass(frozen=True)
class DraftAction:
    """What one cycle does: draft ``depth`` tokens, verify ``verify_size`` of them (a chain
    controller decides it step by step; :attr:`CycleResult.action` records it).

    For a chain drafter ``verify_size == depth``. For a draft tree (EAGLE-2 style) ``depth`` is
    the number of sequential draft forwards and ``verify_size`` the number of tree nodes sent
    to the target.
    """

    depth: int
    verify_size: int


@dataclass
class CycleResult:
    """The outcome of one draft/verify cycle.

    Attributes:
        tokens: ids emitted this cycle (τ + 1, fewer at EOS or ``max_new_tokens``).
        depth: tokens drafted (γ); ``verify_size``: tokens verified.
        num_accepted: accepted length τ (accepted prefix only, and only tokens actually emitted:
            drafted tokens accepted after an EOS do not count).
        draft_seconds, verify_seconds: device-synchronised seconds in the draft / target forwards
            and the sampling that goes with them; ``other_seconds``: the rest of the cycle
            (acceptance, cache rollback, features, controller decisions when timed).
        finished: generation ended (EOS emitted or ``max_new_tokens`` reached).
        features: observation for the next decision (start of the next cycle).
        neural_drafted: of the ``depth`` drafted tokens, those a hybrid drafter's neural source drafted (0 for a
            single drafter).
    """

    tokens: list[int]
    depth: int
    verify_size: int
    num_accepted: int
    draft_seconds: float
    verify_seconds: float
    other_seconds: float
    finished: bool
    features: np.ndarray = field(repr=False, default=None)
    neural_drafted: int = 0

    @property
    def action(self) -> DraftAction:
        """The (depth, verification size) this cycle executed."""
        return DraftAction(self.depth, self.verify_size)

    @property
    def seconds(self) -> float:
        """Cycle seconds: draft + verify + other."""
        return self.draft_seconds + self.verify_seconds + self.other_seconds

    @property
    def tokens_per_second(self) -> float:
        return tokens_per_second(len(self.tokens), self.seconds)


@dataclass
class GenerationResult:
    """A whole generation. Times in seconds, ``tokens_per_second`` = new tokens / wall seconds
    (prefill included), ``ttft_seconds`` = time to the first emitted token."""

    prompt_ids: list[int]
    tokens: list[int]
    cycles: list[CycleResult]
    wall_seconds: float
    ttft_seconds: float

    @property
    def tokens_per_second(self) -> float:
        return tokens_per_second(len(self.tokens), self.wall_seconds)

    @property
    def mean_accepted(self) -> float:
        """Mean accepted length τ over cycles that drafted at least one token (0 if none did)."""
        t = [c.num_accepted for c in self.cycles if c.depth > 0]
        return float(np.mean(t)) if t else 0.0

    @property
    def acceptance_rate(self) -> float:
        """Accepted / drafted tokens over the generation."""
        d = sum(c.depth for c in self.cycles)
        return sum(c.num_accepted for c in self.cycles) / d if d else 0.0

    @property
    def overhead_fraction(self) -> float:
        """Share of cycle time outside the two models' forwards."""
        tot = sum(c.seconds for c in self.cycles)
        return sum(c.other_seconds for c in self.cycles) / tot if tot else 0.0

    @property
    def mean_inter_token_seconds(self) -> float:
        """(wall − TTFT) / (new tokens − 1)."""
        return tpot_seconds(len(self.tokens), self.wall_seconds - self.ttft_seconds)


@dataclass
class RequestResult:
    """One finished (or stopped) request of a batch.

    Attributes:
        request_id: as returned by :meth:`learn2draft.batched.BatchedSpeculativeDecoder.add`.
        prompt_ids, tokens: the prompt and the generated ids.
        cycles: the row's :class:`CycleResult` of every step it took part in (its
            ``verify_seconds`` is the shared batched forward).
        arrival, first_token, finish: clock readings (seconds, :class:`~learn2draft.timing.DeviceClock`) when the
            request arrived (was submitted), when its first token was committed and when it finished.
        token_times: clock reading of each committed token (tokens of one step share the step's reading).
    """

    request_id: int
    prompt_ids: list[int]
    tokens: list[int]
    cycles: list[CycleResult]
    arrival: float
    first_token: float
    finish: float
    token_times: list[float] = field(repr=False, default_factory=list)

    @property
    def ttft_seconds(self) -> float:
        """Time to first token: arrival to the first committed token (queueing + prefill)."""
        return self.first_token - self.arrival

    @property
    def latency_seconds(self) -> float:
        """Request latency: arrival to the last token."""
        return self.finish - self.arrival

    @property
    def tokens_per_second(self) -> float:
        """This request's generated tokens / its latency (queueing and prefill included)."""
        return tokens_per_second(len(self.tokens), self.latency_seconds)

    @property
    def inter_token_seconds(self) -> np.ndarray:
        """float64 (n − 1,): the gaps between consecutive committed tokens (0 within one step's tokens)."""
        return np.diff(np.asarray(self.token_times, dtype=np.float64))

    @property
    def mean_inter_token_seconds(self) -> float:
        """(finish − first token) / (tokens − 1), the mean ITL (TPOT)."""
        return tpot_seconds(len(self.tokens), self.finish - self.first_token)


@dataclass
class BatchStep:
    """One step of the batch: ``rows`` (request id → its :class:`CycleResult`), the step's clock seconds (drafting
    of every row + the one forward + every row's acceptance), the batch size, the longest row's verified tokens
    (``tokens_per_row``, k = max γ + 1), the tokens the target forward fed (``tokens_fed``: Σ (γ_i + 1) for ragged
    verification, B × k padded; joining prompts included) and of those the joining requests' prompt tokens
    (``prefill_tokens``, a mixed prefill: :meth:`learn2draft.batched.BatchedSpeculativeDecoder.add_many` with
    ``mixed=True``)."""

    rows: dict[int, CycleResult]
    seconds: float
    batch_size: int
    tokens_per_row: int
    tokens_fed: int = 0
    prefill_tokens: int = 0

    @property
    def tokens(self) -> int:
        """Tokens committed by all rows this step."""
        return sum([len(c.tokens) for c in self.rows.values()])

    @property
    def tokens_per_second(self) -> float:
        """Aggregate committed tokens / step seconds (the reward of a load-aware policy)."""
        return tokens_per_second(self.tokens, self.seconds)


__all__ = [
    "PERCENTILES", "BatchStep", "CycleResult", "DraftAction", "GenerationResult", "RequestResult",
    "percentiles", "tau_histogram", "tokens_per_second", "tpot_seconds",
]
