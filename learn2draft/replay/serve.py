"""Replay under load: a request stream of chain traces served with continuous batching, costed by a batched profile.

What is simulated (numpy only, no model runs). N requests, each one recorded prompt of a chain
:class:`~learn2draft.replay.traces.TraceSet` (request r replays prompt ``r mod P``), are served by one batched
decoder with at most ``max_batch`` running rows, under a load:

* **fixed concurrency** c (closed loop): c requests run from time 0; each finished request is replaced at once by
  the next one (its arrival time is the moment it joins), until N have been admitted;
* **Poisson arrivals** at rate λ requests/s: inter-arrival times drawn from a seeded ``numpy.random.Generator``
  (``exponential(1/λ)``); a request waits in a queue while ``max_batch`` rows run.

One simulated **step** of the running rows (B of them):

1. joins: every waiting request that has arrived joins while fewer than ``max_batch`` rows run; each costs one
   prefill, charged serially before the step (every row waits for it), which emits the request's first token.
   The prefill's cost is the profile's (:meth:`LatencyProfile.prefill_seconds`: its measured prefill table, or the
   verification of the whole prompt after no cached token, extrapolated past the verify table),
   plus what joining a batch of B rows costs the real loop beyond it (:meth:`LatencyProfile.join_overhead`);
   the draft model's prefill is not charged (the single-sequence replay charges none either);
2. depths: the policy returns a depth per row (``policy(load, rows) -> int (B,)``, :class:`LoadFeatures`,
   :class:`RowFeatures`), capped per row at what the row can draft (its recorded chain, ``max_depth`` and its
   tokens left, :attr:`learn2draft.replay.outcome.ChainReplay.avail`);
3. cost: drafting is lockstep (d = the largest depth) and verification ragged (each row its own d_i + 1 tokens,
   packed: :mod:`learn2draft.batch_cache`):

       seconds = d · (draft_step_batched(B, c) + step_overhead) + verify_batched(B, 1 + Σ d_i / B, c)
                 + cycle_overhead + batch_overhead(B, d)

   (:meth:`LatencyProfile.step_batched`: :meth:`LatencyProfile.draft_step_batched`,
   :meth:`LatencyProfile.verify_batched`; the overheads are the profile's single-sequence fit, charged once per step,
   not per row, and the real batched loop's per-step seconds beyond the tables, :meth:`LatencyProfile.batch_overhead`,
   0 for a profile without them) at the batch context c — by default the
   longest row's context (``batch_context="max"``, as a padded batch attends over the longest; ``"mean"`` for
   per-row positions);
4. outcome: each row advances by its own τ + 1 (:meth:`learn2draft.replay.outcome.ChainReplay.cycle`, the one
   outcome model: at T = 0 ``τ = min(depth, accepted run)``, at T > 0 drawn with the simulator's generator); its
   emitted tokens are delivered at the end of the step; finished rows leave.

At B = 1 the step is the single-sequence cycle (:meth:`LatencyProfile.cycle_table`): concurrency 1 with prefills
not charged (``charge_prefill=False``) replays exactly what :func:`envs.replay.replay_controller` replays.

Reported (:meth:`ServeSimulator.report`): aggregate tokens/s (all generated tokens, each prefill's first included,
over the simulated time from the first arrival to the last finish), per-request tokens/s (tokens / request
latency), TTFT (arrival → first token), inter-token latency (per request of n > 1 tokens, (last token − first token time) /
(n − 1)),
request latency (arrival → last token), each as mean, p50 / p90 / p99 over requests; mean τ and mean depth over
row-cycles, mean batch size over steps.

Baselines (policies): :class:`learn2draft.control.FixedDepthController` (a fixed γ; γ = 0: no speculation; the
real loop's fixed-γ controller, called as a policy), :class:`learn2draft.budget.BatchSizeTable` (a γ per range of
batch sizes, vLLM's ``num_speculative_tokens_per_batch_size``) with :func:`tune_batch_size_table` (the best γ per
batch size by grid in this replay), and :class:`ReplayAdaptiveVerification` (vLLM's adaptive-verification rule,
:class:`learn2draft.budget.AdaptiveVerification`: per-slot survival from an online per-position logistic on the
draft's top-2 margin, the global top-B slots); :func:`compare_baselines` runs them all over a set of loads.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

from learn2draft.budget import BatchSizeTable
from learn2draft.control import FixedDepthController
from learn2draft.metrics import percentiles
from learn2draft.replay.latency import LatencyProfile
from learn2draft.replay.outcome import ChainReplay, chain_replay
from learn2draft.replay.traces import TraceSet

BATCH_CONTEXTS = ("max", "mean")


# --------------------------------------------------------------------------- what a policy sees
@dataclass
class LoadFeatures:
    """The load at a step, before its decision.

    Attributes:
        running: rows B in this step (≥ 1); ``waiting``: requests arrived and queued (not yet joined).
        tokens_in_flight: Σ over the running rows of their context lengths (prompt + generated), tokens.
        mean_context, max_context: the running rows' mean and largest context length, tokens.
        max_batch: the simulator's largest batch; ``max_depth``: the largest depth a row may draft.
        step: steps simulated so far; ``time``: simulated seconds so far.
    """

    running: int
    waiting: int
    tokens_in_flight: int
    mean_context: float
    max_context: int
    max_batch: int
    max_depth: int
    step: int
    time: float


@dataclass
class RowFeatures:
    """Per running row, what is known before the step's decision (B rows, D = ``max_depth``).

    Attributes:
        request: int64 (B,), request ids; ``prompt``: int64 (B,), the trace prompt each replays.
        context: int64 (B,), context length (prompt + generated tokens); ``generated``: int64 (B,), tokens generated.
        left: int64 (B,), tokens still to generate; ``avail``: int64 (B,), the most tokens the row can draft now.
        last_tau, last_depth: int64 (B,), the row's previous cycle (0 before its first).
        draft_margin: float64 (B, D), the draft's top-2 margin of the chain's drafted tokens at this position (NaN
            past ``avail`` and for traces recorded without it); the margin of token j is known once tokens < j are
            drafted (a draft-side quantity: using it to choose which drafted tokens to verify is what vLLM's
            adaptive verification does).
        confidence: float64 (B, D), the draft's raw top-1 probability of the drafted tokens (0 past ``avail``).
    """

    request: np.ndarray
    prompt: np.ndarray
    context: np.ndarray
    generated: np.ndarray
    left: np.ndarray
    avail: np.ndarray
    last_tau: np.ndarray
    last_depth: np.ndarray
    draft_margin: np.ndarray
    confidence: np.ndarray


@dataclass
class StepResult:
    """One simulated batch step.

    Attributes:
        batch: rows B; ``depths``, ``taus``, ``emitted``: int64 (B,), per row the depth verified, τ and tokens emitted.
        seconds: the step's simulated seconds (prefills of joins excluded); ``prefill_seconds``: the joins' prefills
            charged before it; ``draft_seconds``, ``verify_seconds``, ``other_seconds``: the step's terms.
        tokens: Σ emitted; ``tokens_per_second``: tokens / seconds, the step's aggregate rate (the env's reward).
        finished: request ids that left after this step; ``joined``: request ids that joined before it.
    """

    batch: int
    depths: np.ndarray
    taus: np.ndarray
    emitted: np.ndarray
    seconds: float
    prefill_seconds: float
    draft_seconds: float
    verify_seconds: float
    other_seconds: float
    tokens: int
    tokens_per_second: float
    finished: list[int] = field(default_factory=list)
    joined: list[int] = field(default_factory=list)


Policy = Callable[[LoadFeatures, RowFeatures], np.ndarray]


# --------------------------------------------------------------------------- the load
@dataclass(frozen=True)
class Load:
    """A load: ``concurrency`` c (closed loop) or ``rate`` λ requests/s (Poisson arrivals), exactly one of them.

    Raises:
        ValueError: both or neither given, c not an integer ≥ 1, λ not a finite number > 0.
    """

    concurrency: int | None = None
    rate: float | None = None

    def __post_init__(self):
        if (self.concurrency is None) == (self.rate is None):
            raise ValueError("A load is a fixed concurrency c or a Poisson arrival rate λ (requests/s): give one of them.")
        if self.concurrency is not None and not (isinstance(self.concurrency, numbers.Integral)
                                                 and not isinstance(self.concurrency, bool) and self.concurrency >= 1):
            raise ValueError(f"concurrency must be an integer ≥ 1, got {self.concurrency!r}.")
        if self.rate is not None and not (isinstance(self.rate, numbers.Real) and math.isfinite(self.rate)
                                          and self.rate > 0):
            raise ValueError(f"rate must be a finite number of requests/s > 0, got {self.rate!r}.")

    @property
    def label(self) -> str:
        """``"c=4"`` or ``"λ=2.5/s"``."""
        return f"c={self.concurrency}" if self.concurrency is not None else f"λ={self.rate:g}/s"


def as_load(load) -> Load:
    """``load`` as a :class:`Load`: a Load, an int (a concurrency), or ``{"concurrency": c}`` / ``{"rate": λ}``."""
    if isinstance(load, Load):
        return load
    if isinstance(load, dict):
        return Load(**load)
    if isinstance(load, numbers.Integral) and not isinstance(load, bool):
        return Load(concurrency=int(load))
    raise ValueError(f"A load is a Load, a concurrency (int) or {{'concurrency': c}} / {{'rate': λ}}, got {load!r}.")


# --------------------------------------------------------------------------- the simulator
@dataclass
class _Request:
    rid: int
    prompt: int
    arrival: float
    replay: ChainReplay
    prompt_len: int
    t: int = 0  # tokens generated
    first_token: float = math.nan
    finish: float = math.nan
    last_tau: int = 0
    last_depth: int = 0


class ServeSimulator:
    """A steppable simulation of one request stream (see the module docstring).

    Args:
        traces: chain traces (:class:`learn2draft.replay.traces.TraceSet`) whose prompts the requests replay.
        profile: a :class:`LatencyProfile` with the batch axis when more than one row can run (``max_batch`` > 1).
        load: a :class:`Load` (or what :func:`as_load` accepts).
        num_requests: N requests served (≥ 1).
        drafter: whose costs (default: the traces' drafter); ``max_depth``: the most tokens a row drafts per step
            (≤ the traces'; default theirs); ``max_new_tokens``: per request (≤ the traces'; default theirs).
        max_batch: the most running rows (default: the concurrency for a closed loop, else the profile's largest
            tabulated batch size).
        seed: seeds the Poisson arrivals and, at T > 0, the acceptance draws.
        charge_prefill: charge each join's prefill (True); False leaves prefills free, as the single-sequence replay.
        batch_context: ``"max"`` (the longest row's context) or ``"mean"``: the context at which a step is costed.

    Raises:
        ValueError: bad settings (the message names them), a profile without the drafter's costs, too small a
            verify table for ``max_depth``, or without the batch axis while ``max_batch`` > 1
            (:meth:`LatencyProfile.require_batch_axis` names its file and the flag to re-measure with).
    """

    def __init__(self, traces: TraceSet, profile: LatencyProfile, load, num_requests: int, drafter: str | None = None,
                 max_depth: int | None = None, max_new_tokens: int | None = None, max_batch: int | None = None,
                 seed: int = 0, charge_prefill: bool = True, batch_context: str = "max"):
        if not isinstance(traces, TraceSet) or not traces.prompts:
            raise ValueError("traces must be a non-empty chain TraceSet (learn2draft.replay.traces.load_traces).")
        self.traces, self.profile, self.load = traces, profile, as_load(load)
        self.drafter = traces.drafter if drafter is None else drafter
        self.max_depth = traces.max_depth if max_depth is None else max_depth
        self.max_new_tokens = traces.max_new_tokens if max_new_tokens is None else max_new_tokens
        if not (isinstance(self.max_depth, numbers.Integral) and 0 <= self.max_depth <= traces.max_depth):
            raise ValueError(f"max_depth must be an integer in [0, {traces.max_depth}] (the traces'), got {max_depth!r}.")
        if not (isinstance(self.max_new_tokens, numbers.Integral) and 1 <= self.max_new_tokens <= traces.max_new_tokens):
            raise ValueError(f"max_new_tokens must be an integer in [1, {traces.max_new_tokens}] (the traces'), got "
                             f"{max_new_tokens!r}.")
        if not (isinstance(num_requests, numbers.Integral) and num_requests >= 1):
            raise ValueError(f"num_requests must be an integer ≥ 1, got {num_requests!r}.")
        if batch_context not in BATCH_CONTEXTS:
            raise ValueError(f"batch_context must be one of {BATCH_CONTEXTS}, got {batch_context!r}.")
        self.num_requests, self.seed = int(num_requests), int(seed)
        self.charge_prefill, self.batch_context = bool(charge_prefill), batch_context
        if max_batch is None:
            max_batch = self.load.concurrency if self.load.concurrency is not None else profile.max_batch_size
        if not (isinstance(max_batch, numbers.Integral) and max_batch >= 1):
            raise ValueError(f"max_batch must be an integer ≥ 1, got {max_batch!r}.")
        if self.load.concurrency is not None and self.load.concurrency > max_batch:
            raise ValueError(f"concurrency {self.load.concurrency} exceeds max_batch {max_batch}.")
        self.max_batch = int(max_batch)
        profile.cost(self.drafter)
        profile.verify(self.max_depth + 1, 0)
        profile.require_batch_axis(self.max_batch, self.drafter)
        if self.max_batch > 1:
            profile.verify_batched(self.max_batch, self.max_depth + 1, 0)
        self.deterministic = traces.deterministic
        self._replays: dict[int, ChainReplay] = {}
        self.reset()

    # ------------------------------------------------------------------ state
    def replay(self, prompt: int) -> ChainReplay:
        """The outcome model of trace prompt ``prompt`` (:func:`learn2draft.replay.outcome.chain_replay`, at B = 1
        costs; built on first use)."""
        r = self._replays.get(prompt)
        if r is None:
            r = self._replays[prompt] = chain_replay(self.traces.prompts[prompt], self.profile, self.drafter,
                                                     self.max_depth, self.max_new_tokens)
        return r

    def reset(self, seed: int | None = None) -> None:
        """Start the stream again (same requests; ``seed`` replaces the seed of the arrivals and acceptance draws)."""
        if seed is not None:
            self.seed = int(seed)
        self.rng = np.random.default_rng(self.seed)
        N = self.num_requests
        if self.load.rate is not None:
            self._arrivals = np.cumsum(self.rng.exponential(1.0 / self.load.rate, size=N))
            self._arrivals -= self._arrivals[0]  # the first request arrives at time 0
        else:
            self._arrivals = None
        self.clock = 0.0
        self.steps = 0
        self._next = 0  # next request id to admit
        self.running: list[_Request] = []
        self.done: list[_Request] = []
        self._row_tau = self._row_depth = 0
        self._row_cycles = 0
        self._batch_sum = 0
        self._step_seconds = 0.0
        self._prefill_seconds = 0.0
        self._pending_join: list[int] = []
        self._admit()

    @property
    def finished(self) -> bool:
        """Every request has been served."""
        return len(self.done) == self.num_requests

    def _new_request(self, arrival: float) -> _Request:
        rid = self._next
        self._next += 1
        p = rid % len(self.traces.prompts)
        return _Request(rid, p, arrival, self.replay(p), self.traces.prompts[p].prompt_len)

    def _prefill_cost(self, prompt_len: int) -> float:
        if not self.charge_prefill:
            return 0.0
        prefill = self.profile.prefill_seconds(max(prompt_len, 1))
        return max(prefill + self.profile.join_overhead(self.drafter, len(self.running) + 1), 0.0)

    def _join(self, req: _Request) -> None:
        """Prefill ``req`` (serially, at the current clock): it emits its first token and joins (or, with one token
        to generate, finishes)."""
        cost = self._prefill_cost(req.prompt_len)
        self.clock += cost
        self._prefill_seconds += cost
        req.t = 1
        req.first_token = self.clock
        self._pending_join.append(req.rid)
        if req.t >= req.replay.n:
            req.finish = self.clock
            self.done.append(req)
        else:
            self.running.append(req)

    def _admit(self) -> None:
        """Let in the requests that can join now (closed loop: fill up to c; Poisson: arrived ones, up to
        ``max_batch``); with no row running and none arrived, advance the clock to the next arrival."""
        N = self.num_requests
        if self.load.concurrency is not None:
            while len(self.running) < self.load.concurrency and self._next < N:
                self._join(self._new_request(self.clock))
            return
        while self._next < N:
            if len(self.running) >= self.max_batch:
                return
            arrival = float(self._arrivals[self._next])
            if arrival > self.clock:
                if self.running:
                    return
                self.clock = arrival  # idle until it arrives
            self._join(self._new_request(arrival))

    def observe(self) -> tuple[LoadFeatures, RowFeatures]:
        """The load and the running rows' features before the next step (see :class:`LoadFeatures`,
        :class:`RowFeatures`).

        Raises:
            RuntimeError: the stream is finished.
        """
        if self.finished or not self.running:
            raise RuntimeError("The stream is finished: nothing runs (reset() to start again).")
        rows, D = self.running, self.max_depth
        B = len(rows)
        ctx = np.asarray([r.prompt_len + r.t for r in rows], dtype=np.int64)
        t = np.asarray([r.t for r in rows], dtype=np.int64)
        n = np.asarray([r.replay.n for r in rows], dtype=np.int64)
        avail = np.asarray([r.replay.avail[r.t] for r in rows], dtype=np.int64)
        margin = np.full((B, D), np.nan)
        conf = np.zeros((B, D))
        for i, r in enumerate(rows):
            pt = self.traces.prompts[r.prompt]
            a = int(avail[i])
            if pt.draft_margin is not None:
                margin[i, :a] = pt.draft_margin[r.t, :a]
            conf[i, :a] = pt.confidence[r.t, :a]
        waiting = 0
        if self._arrivals is not None:
            waiting = int(np.sum(self._arrivals[self._next:] <= self.clock))
        load = LoadFeatures(B, waiting, int(ctx.sum()), float(ctx.mean()), int(ctx.max()), self.max_batch, D,
                            self.steps, self.clock)
        feats = RowFeatures(np.asarray([r.rid for r in rows], dtype=np.int64),
                            np.asarray([r.prompt for r in rows], dtype=np.int64), ctx, t, n - t, avail,
                            np.asarray([r.last_tau for r in rows], dtype=np.int64),
                            np.asarray([r.last_depth for r in rows], dtype=np.int64), margin, conf)
        return load, feats

    def step_seconds(self, batch: int, max_depth: int, context: float,
                     verified: int | None = None) -> tuple[float, float, float]:
        """(draft, verify, other) seconds of a step of ``batch`` rows whose longest draft is ``max_depth``, ``verified``
        drafted tokens over all rows (None: every row at ``max_depth``), at the batch context ``context`` (the
        formula of the module docstring)."""
        verified = batch * max_depth if verified is None else verified
        return self.profile.step_batched(self.drafter, batch, max_depth, context, verified)

    def step(self, depths) -> StepResult:
        """One batch step with per-row ``depths`` (int (B,) in the order of :meth:`observe`'s rows, or one int for
        every row), each capped at the row's ``avail``; then finished rows leave and new requests join.

        Raises:
            RuntimeError: the stream is finished. ValueError: ``depths`` of another length, or negative.
        """
        if self.finished or not self.running:
            raise RuntimeError("The stream is finished: nothing runs (reset() to start again).")
        rows = self.running
        B = len(rows)
        d = np.asarray(depths, dtype=np.int64)
        if d.ndim == 0:
            d = np.full(B, int(d), dtype=np.int64)
        if d.shape != (B,) or (d.size and d.min() < 0):
            raise ValueError(f"depths must be {B} integers ≥ 0 (one per running row), got {np.asarray(depths).tolist()}.")
        joined, self._pending_join = self._pending_join, []
        avail = np.asarray([r.replay.avail[r.t] for r in rows], dtype=np.int64)
        d = np.minimum(d, avail)
        ctx = np.asarray([r.prompt_len + r.t for r in rows], dtype=np.int64)
        dmax = int(d.max())
        if B == 1:  # the single-sequence cycle, from the precomputed table (bit-equal to the chain replay)
            r = rows[0].replay
            t0 = rows[0].t
            draft, verify, other = float(r.draft[t0, dmax]), float(r.verify[t0, dmax]), float(r.other[t0, dmax])
            seconds = float(r.total[t0, dmax])
        else:
            draft, verify, other = self.step_seconds(B, dmax, self.batch_context_of(ctx), int(d.sum()))
            seconds = draft + verify + other
        self.clock += seconds
        self._step_seconds += seconds
        rng = None if self.deterministic else self.rng
        taus = np.zeros(B, dtype=np.int64)
        emitted = np.zeros(B, dtype=np.int64)
        finished, still = [], []
        for i, req in enumerate(rows):
            tau, em, _ = req.replay.cycle(req.t, int(d[i]), rng)
            taus[i], emitted[i] = tau, em
            req.t += em
            req.last_tau, req.last_depth = tau, int(d[i])
            if req.t >= req.replay.n:
                req.finish = self.clock
                self.done.append(req)
                finished.append(req.rid)
            else:
                still.append(req)
        self.running = still
        self.steps += 1
        self._row_tau += int(taus.sum())
        self._row_depth += int(d.sum())
        self._row_cycles += B
        self._batch_sum += B
        prefill_before = self._prefill_seconds
        self._admit()
        tokens = int(emitted.sum())
        return StepResult(B, d, taus, emitted, seconds, self._prefill_seconds - prefill_before, draft, verify, other,
                          tokens, tokens / seconds if seconds > 0 else 0.0, finished, joined)

    def step_seconds_by_depth(self, rows: RowFeatures) -> np.ndarray:
        """float64 (max_depth + 1,): the seconds of the next step over ``rows`` (the running rows, as
        :meth:`observe` gives them) when every row drafts up to d = 0..max_depth tokens (each at most its ``avail``) —
        what :meth:`step` charges for one γ = d."""
        B, D = rows.context.shape[0], self.max_depth
        if B == 1:
            req = self.running[0]
            return np.asarray(req.replay.total[req.t], dtype=np.float64)
        ctx = self.batch_context_of(rows.context)
        avail = np.asarray(rows.avail, dtype=np.int64)
        return np.asarray([sum(self.step_seconds(B, int(np.minimum(avail, d).max()), ctx, int(np.minimum(avail, d).sum())))
                           for d in range(D + 1)])

    def batch_context_of(self, context: np.ndarray) -> float:
        """The context a step over rows of ``context`` (int (B,)) is costed at: their max or mean
        (``batch_context``)."""
        return float(context.max() if self.batch_context == "max" else context.mean())

    # ------------------------------------------------------------------ the report
    def report(self) -> dict:
        """The stream's numbers (see the module docstring): ``load``, ``requests``, ``tokens``, ``seconds``,
        ``tokens_per_s`` (aggregate), ``per_request_tokens_per_s``, ``ttft_s``, ``itl_s``, ``latency_s`` (each
        ``{"mean", "p50", "p90", "p99"}`` over requests, seconds or tokens/s), ``mean_tau``, ``mean_depth`` (per
        row-cycle), ``mean_batch`` (per step), ``steps``, ``prefill_seconds``, ``step_seconds``.

        Raises:
            RuntimeError: before the stream is finished.
        """
        if not self.finished:
            raise RuntimeError("The stream is not finished: run it to the end (simulate()) before the report.")
        reqs = sorted(self.done, key=lambda r: r.rid)
        n = np.asarray([r.replay.n for r in reqs], dtype=np.float64)
        arrival = np.asarray([r.arrival for r in reqs])
        first = np.asarray([r.first_token for r in reqs])
        finish = np.asarray([r.finish for r in reqs])
        latency = finish - arrival
        itl = ((finish - first) / (n - 1))[n > 1]  # requests of one token have no inter-token gap
        per_req = np.where(latency > 0, n / np.where(latency > 0, latency, 1.0), 0.0)
        span = float(finish.max() - arrival.min())
        tokens = float(n.sum())
        return {
            "load": self.load.label, "concurrency": self.load.concurrency, "rate": self.load.rate,
            "requests": len(reqs), "tokens": tokens, "seconds": span,
            "tokens_per_s": tokens / span if span > 0 else 0.0,
            "per_request_tokens_per_s": percentiles(per_req, empty=0.0),
            "ttft_s": percentiles(first - arrival, empty=0.0), "itl_s": percentiles(itl, empty=0.0),
            "latency_s": percentiles(latency, empty=0.0),
            "mean_tau": self._row_tau / self._row_cycles if self._row_cycles else 0.0,
            "mean_depth": self._row_depth / self._row_cycles if self._row_cycles else 0.0,
            "mean_batch": self._batch_sum / self.steps if self.steps else 0.0, "steps": self.steps,
            "prefill_seconds": self._prefill_seconds, "step_seconds": self._step_seconds,
        }


def _decide(policy, load: LoadFeatures, rows: RowFeatures) -> np.ndarray:
    return np.asarray(policy(load, rows), dtype=np.int64)


def simulate(traces: TraceSet, profile: LatencyProfile, policy: Policy, load, num_requests: int,
             steps: list | None = None, **kwargs) -> dict:
    """Serve ``num_requests`` requests under ``load`` with ``policy`` and return :meth:`ServeSimulator.report`.

    ``policy(load, rows)`` returns the depths (int (B,), or one int for all rows); a policy with a ``bind(simulator)``
    method is bound to the run's simulator first (:class:`ReplayAdaptiveVerification` weighs its costs), one with
    ``reset()`` is reset, and one with ``update(load, rows, result)`` is told every step's outcome
    (:class:`StepResult`) after it.

    Args:
        steps: a list to append every :class:`StepResult` to (None: not kept).
        kwargs: the other arguments of :class:`ServeSimulator` (``drafter``, ``max_depth``, ``max_new_tokens``,
            ``max_batch``, ``seed``, ``charge_prefill``, ``batch_context``).

    Raises:
        ValueError: as :class:`ServeSimulator`.
    """
    sim = ServeSimulator(traces, profile, load, num_requests, **kwargs)
    if hasattr(policy, "bind"):
        policy.bind(sim)
    if hasattr(policy, "reset"):
        policy.reset()
    update = getattr(policy, "update", None)
    while not sim.finished:
        load_f, rows = sim.observe()
        res = sim.step(_decide(policy, load_f, rows))
        if update is not None:
            update(load_f, rows, res)
        if steps is not None:
            steps.append(res)
    return sim.report()


#: A closed loop at concurrency c serves at least this many requests per row (``requests_for``): with fewer, the
#: stream is one wave that ends with its slowest request (a batch that only shrinks), not a load of c.
REQUESTS_PER_SLOT = 4


def requests_for(load, num_requests: int, requests_per_slot: int = REQUESTS_PER_SLOT) -> int:
    """The requests a stream under ``load`` serves: ``max(num_requests, requests_per_slot × c)`` for a closed loop of
    concurrency c (as vLLM's serving benchmark sends many more prompts than ``--max-concurrency``, so that the batch
    stays full and a refill follows every finished request), ``num_requests`` for Poisson arrivals.

    Raises:
        ValueError: ``num_requests`` < 1 or ``requests_per_slot`` < 0.
    """
    if int(num_requests) < 1 or int(requests_per_slot) < 0:
        raise ValueError(f"num_requests must be ≥ 1 and requests_per_slot ≥ 0, got {num_requests} and "
                         f"{requests_per_slot}.")
    c = as_load(load).concurrency
    return int(num_requests) if c is None else max(int(num_requests), int(requests_per_slot) * int(c))


def sweep(traces: TraceSet, profile: LatencyProfile, policy: Policy, loads: Sequence, num_requests: int,
          requests_per_slot: int = REQUESTS_PER_SLOT, **kwargs) -> list[dict]:
    """:func:`simulate` at every load of ``loads`` (concurrency levels as ints, or :class:`Load` s), each with
    :func:`requests_for` requests; one report each, in order."""
    return [simulate(traces, profile, policy, load, requests_for(load, num_requests, requests_per_slot), **kwargs)
            for load in loads]


# --------------------------------------------------------------------------- baseline policies
def tune_batch_size_table(traces: TraceSet, profile: LatencyProfile, batch_sizes: Sequence[int],
                          gammas: Sequence[int] | None = None, num_requests: int | None = None,
                          max_batch: int | None = None, requests_per_slot: int = REQUESTS_PER_SLOT,
                          **kwargs) -> tuple[BatchSizeTable, dict]:
    """Grid-tune a :class:`BatchSizeTable` in replay, as vLLM users tune it by hand: for every batch size b of
    ``batch_sizes``, serve a closed loop at concurrency b with every fixed γ of ``gammas`` and keep the γ of the
    highest aggregate tokens/s (ties: the smaller γ); b covers the batch sizes from b to the next one − 1 (the first
    from batch size 1, the last up to ``max_batch``, default the profile's largest batch size).

    Args:
        gammas: the grid (default 0..max_depth); ``num_requests``, ``requests_per_slot``: each run at concurrency b
            serves :func:`requests_for` requests (``num_requests`` default: the traces' prompt count);
            ``kwargs``: as :func:`simulate` (``max_depth``, ``seed``, ``charge_prefill``, …).

    Returns:
        (the table, ``{b: {γ: tokens/s}}`` the grid's rates).

    Raises:
        ValueError: an empty or non-positive ``batch_sizes``; as :class:`ServeSimulator`.
    """
    bs = sorted({int(b) for b in batch_sizes})
    if not bs or bs[0] < 1:
        raise ValueError(f"batch_sizes must be integers ≥ 1, got {list(batch_sizes)}.")
    D = traces.max_depth if kwargs.get("max_depth") is None else int(kwargs["max_depth"])
    grid = list(range(D + 1)) if gammas is None else sorted({int(g) for g in gammas})
    top = max(bs[-1], profile.max_batch_size if max_batch is None else int(max_batch))
    rates: dict[int, dict[int, float]] = {}
    table = []
    for k, b in enumerate(bs):
        n = requests_for(b, num_requests or len(traces.prompts), requests_per_slot)
        rates[b] = {g: simulate(traces, profile, FixedDepthController(g), Load(concurrency=b), n, max_batch=b,
                                **kwargs)["tokens_per_s"] for g in grid}
        best = max(grid, key=lambda g: (rates[b][g], -g))
        table.append((1 if k == 0 else b, bs[k + 1] - 1 if k + 1 < len(bs) else top, best))
    return BatchSizeTable(table), rates


class ReplayAdaptiveVerification:
    """:class:`learn2draft.budget.AdaptiveVerification` (vLLM's rule, the one the real loop runs) as a policy of the
    simulator: the drafted slots' margins come from the traces (``draft_margin``; NaN — traces recorded without it —
    reads as 0, so each position's logistic reduces to its mean acceptance), the step's cost from the simulator
    (:meth:`ServeSimulator.step_seconds`: the batched draft cost times the deepest chosen row's slots and the ragged
    verification of the chosen slots, from the profile), and every step's τ are its labels.

    Departure from vLLM, stated: vLLM drafts all K slots before choosing (the drafting of unchosen slots is charged
    here only up to the deepest chosen one, which favours the rule).

    Args:
        refit_every, warmup_refits, min_observations: the estimator's (vLLM: 100, 3, 50; a short replayed stream
            may never leave vLLM's 300-step warm-up: size them to the run).
    """

    def __init__(self, refit_every: int = 100, warmup_refits: int = 3, min_observations: int = 50):
        from learn2draft.budget import OnlineAcceptanceEstimator

        OnlineAcceptanceEstimator(1, refit_every, warmup_refits, min_observations)  # checks the arguments now
        self.kw = {"refit_every": refit_every, "warmup_refits": warmup_refits, "min_observations": min_observations}
        self.sim: ServeSimulator | None = None
        self.rule = None
        self.last_budget = 0

    def bind(self, simulator: ServeSimulator) -> ReplayAdaptiveVerification:
        """Weigh ``simulator``'s costs (a fresh rule of its ``max_depth``); returns self."""
        from learn2draft.budget import AdaptiveVerification

        self.sim = simulator
        self.rule = AdaptiveVerification(max(simulator.max_depth, 1), **self.kw)
        return self

    @property
    def warming_up(self) -> bool:
        return self.rule is None or self.rule.warming_up

    def _margins(self, rows: RowFeatures) -> list[np.ndarray]:
        return [rows.draft_margin[i, : int(a)] for i, a in enumerate(rows.avail)]

    def __call__(self, load: LoadFeatures, rows: RowFeatures) -> np.ndarray:
        if self.sim is None:
            raise ValueError("ReplayAdaptiveVerification needs the simulator whose costs it weighs: .bind(simulator) "
                             "(simulate() binds it).")
        B, ctx = rows.context.shape[0], self.sim.batch_context_of(rows.context)
        if B == 1:
            by_depth = self.sim.step_seconds_by_depth(rows)

            def seconds(longest: int, verified: int) -> float:
                return float(by_depth[longest])
        else:
            def seconds(longest: int, verified: int) -> float:
                return float(sum(self.sim.step_seconds(B, longest, ctx, verified)))
        keep = np.asarray(self.rule.counts(self._margins(rows), seconds), dtype=np.int64)
        self.last_budget = int(keep.sum())
        return keep

    def update(self, load: LoadFeatures, rows: RowFeatures, result: StepResult) -> None:
        """The step's graded slots as labels: slot j < τ accepted, slot τ rejected when τ < depth."""
        self.rule.learn(self._margins(rows), result.taus, result.depths)

    def __repr__(self) -> str:
        return f"ReplayAdaptiveVerification({self.kw})"


def compare_baselines(traces: TraceSet, profile: LatencyProfile, loads: Sequence, num_requests: int,
                      gammas: Sequence[int] | None = None, table_batch_sizes: Sequence[int] | None = None,
                      policies: dict[str, Policy] | None = None, requests_per_slot: int = REQUESTS_PER_SLOT,
                      **kwargs) -> dict:
    """Every baseline of issue 17 at every load, on the same requests and seeds (``kwargs`` as :func:`simulate`):

    * ``no speculation`` — :class:`~learn2draft.control.FixedDepthController` (0);
    * ``best fixed γ`` — the :class:`~learn2draft.control.FixedDepthController` of ``gammas`` (default 0..max_depth)
      with the highest geometric mean of aggregate tokens/s over ``loads``;
    * ``per-batch-size table`` — :func:`tune_batch_size_table` at ``table_batch_sizes`` (default: the concurrencies
      of ``loads``, else 1, 2, 4, 8, 16 up to the profile's largest batch size);
    * ``adaptive verification`` — :class:`ReplayAdaptiveVerification` (vLLM's defaults: refits every 100 steps, 3 warm-up
      refits);
    * every policy of ``policies`` (``{name: policy}``, e.g. a learned one).

    The grids are tuned on the same requests they are scored on (in-sample: the baselines' best case). A closed loop
    of concurrency c serves :func:`requests_for` requests (at least ``requests_per_slot`` × c).

    Returns:
        ``{"loads": [labels], "methods": {name: [report per load]}, "best_gamma": γ, "fixed": {γ: [tokens/s per
        load]}, "table": the table in vLLM's form}``.

    Raises:
        ValueError: an empty ``loads``; as :class:`ServeSimulator`.
    """
    loads = [as_load(x) for x in loads]
    if not loads:
        raise ValueError("loads is empty: give concurrency levels or Poisson rates.")
    D = traces.max_depth if kwargs.get("max_depth") is None else int(kwargs["max_depth"])
    grid = list(range(D + 1)) if gammas is None else sorted({int(g) for g in gammas})
    kw = dict(kwargs, requests_per_slot=requests_per_slot)
    fixed = {g: sweep(traces, profile, FixedDepthController(g), loads, num_requests, **kw) for g in grid}
    rates = {g: [r["tokens_per_s"] for r in reps] for g, reps in fixed.items()}
    best = max(grid, key=lambda g: (float(np.exp(np.mean(np.log(np.maximum(rates[g], 1e-300))))), -g))
    if table_batch_sizes is None:
        table_batch_sizes = sorted({x.concurrency for x in loads if x.concurrency is not None}) or [
            b for b in (1, 2, 4, 8, 16) if b <= profile.max_batch_size]
    tune_kw = {k: v for k, v in kw.items() if k != "max_batch"}
    table, _ = tune_batch_size_table(traces, profile, table_batch_sizes, grid, num_requests, **tune_kw)
    methods = {"no speculation": fixed[0] if 0 in fixed else sweep(traces, profile, FixedDepthController(0), loads,
                                                                    num_requests, **kw),
               f"best fixed γ={best}": fixed[best],
               "per-batch-size table": sweep(traces, profile, table, loads, num_requests, **kw),
               "adaptive verification": sweep(traces, profile, ReplayAdaptiveVerification(), loads, num_requests, **kw)}
    for name, pol in (policies or {}).items():
        methods[name] = sweep(traces, profile, pol, loads, num_requests, **kw)
    return {"loads": [x.label for x in loads], "methods": methods, "best_gamma": best, "fixed": rates,
            "table": table.to_vllm()}


__all__ = ["BATCH_CONTEXTS", "ReplayAdaptiveVerification", "Load", "LoadFeatures",
           "Policy", "REQUESTS_PER_SLOT", "RowFeatures", "ServeSimulator", "StepResult", "as_load", "compare_baselines", "requests_for", "simulate",
           "sweep", "tune_batch_size_table"]
