"""The replay backend: a chain decoder with the real decoder's API, whose cycles come from a trace and a profile.

:class:`ReplayDecoder` is driven by the same calls as :class:`learn2draft.decoding.SpeculativeDecoder` — ``start``,
``can_draft``, ``draft_step``, ``verify``, ``state`` / ``features``, and the controller's loop they share,
:class:`learn2draft.control.CycleDriver` (``step``, ``draft``, ``run_cycle``, ``generate``) — but runs no model:

* what the drafter and the target agree on comes from a recorded trace (:mod:`learn2draft.replay.traces`): the chain
  available at every position, its draft-side features, each drafted token's acceptance probability;
* what a cycle costs comes from a latency profile (:mod:`learn2draft.replay.latency`); a cycle at position t that
  verifies j drafted tokens has the outcome of the one outcome model, :meth:`learn2draft.replay.outcome.ChainReplay.cycle`
  (τ; τ + 1 tokens emitted, fewer at EOS or ``max_new_tokens``; the profile's seconds), and :attr:`ReplayDecoder.clock`
  advances by those seconds, so ``generate()``'s wall seconds are the replayed cycles' (the prefill and a controller's
  own decision time are not in the replay: 0).

:class:`HybridReplayDecoder` is the same for a hybrid drafter (prompt lookup + a neural drafter, the source chosen per
token: actions 0 / 1 / 2), from a lookup trace set and a neural one (:mod:`learn2draft.replay.hybrid`).

So one environment (:class:`envs.spec_decode.DepthEnv`) serves the real loop and the replays, and sim-vs-real
(:mod:`eval.simreal`) compares two backends of one interface: the same controller, the same ``generate`` call.

At temperature 0 a replayed generation commits the recorded tokens, and its cycles' depths and τ are the real
loop's for the same decisions (tested against the real decoder); at T > 0 τ is drawn from the recorded acceptance
probabilities with the generator given at :meth:`ReplayDecoder.start` and the replay follows the recorded trajectory
(see :mod:`learn2draft.replay.traces` for what that approximates).

Numpy only.
"""

from __future__ import annotations

import numbers
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from learn2draft.control import CycleDriver
from learn2draft.features import FEATURE_NAMES, HISTORY, build_features, build_hybrid_features
from learn2draft.metrics import CycleResult
from learn2draft.replay.hybrid import (
    HybridReplay,
    check_hybrid_traces,
    hybrid_oracle_seconds,
    hybrid_replay,
    split_hybrid_traces,
)
from learn2draft.replay.latency import LatencyProfile, load_profiles
from learn2draft.replay.outcome import ChainReplay, chain_replay, tokens_per_second
from learn2draft.replay.traces import TraceSet, TreeTraceSet, load_traces
from learn2draft.state import DraftState

_HIST = np.asarray([FEATURE_NAMES.index(f"accepted_len_t-{i + 1}") for i in range(HISTORY)])
_LAF = FEATURE_NAMES.index("last_accept_fraction")


class ReplayClock:
    """The replay's clock: :meth:`now` is the seconds replayed so far (every verified cycle's profile seconds), so a
    caller that times the backend as it times the real decoder reads the replayed time."""

    def __init__(self) -> None:
        self.seconds = 0.0

    def now(self) -> float:
        """The seconds replayed so far."""
        return self.seconds


class _TraceBackend(CycleDriver):
    """What the two replay backends share: a chain replayed along one recorded greedy or sampled generation per
    prompt (``_prompts``: the trace set whose prompts and outputs are replayed), the replay clock, the committed ids,
    the position and depth, and the prompt lookup of :meth:`start`."""

    shape = "chain"

    def _init_replay(self, prompts: TraceSet) -> None:
        self._prompts = prompts
        self._pt = None
        self._t, self._j = 1, 0
        self._index = {tuple(int(x) for x in pt.prompt_ids): i for i, pt in enumerate(prompts.prompts)}
        self.clock = ReplayClock()
        self._cycle_other = 0.0
        self.prompt_index: int | None = None
        self._started = False
        self.finished = False

    @staticmethod
    def _check_setting(name: str, value, default: int, low: int, high: int, why: str) -> int:
        """``value`` (None: ``default``) as an int in [low, high] (an integer type, not a bool).

        Raises:
            ValueError: anything else; the message gives the range and ``why``.
        """
        if value is None:
            return default
        if isinstance(value, bool) or not isinstance(value, numbers.Integral) or not low <= value <= high:
            raise ValueError(f"{name} must be an integer in [{low}, {high}] {why}, got {value!r}.")
        return int(value)

    def _check_started(self) -> None:
        if not self._started:
            raise RuntimeError("Call start(prompt_ids) first.")

    def _prompt_index(self, prompt_ids) -> int:
        """The trace prompt of ``prompt_ids`` (its ids, any array-like, or its index).

        Raises:
            ValueError: a prompt not among the traces', or an index out of range.
        """
        n = len(self._prompts)
        if isinstance(prompt_ids, numbers.Integral) and not isinstance(prompt_ids, bool):
            if not 0 <= int(prompt_ids) < n:
                raise ValueError(f"prompt index must be in [0, {n}) (the traces' prompts), got {int(prompt_ids)}.")
            return int(prompt_ids)
        ids = np.asarray(prompt_ids)
        if not np.issubdtype(ids.dtype, np.integer):
            raise ValueError(f"prompt_ids must be token ids (integers) or a trace prompt's index, got {prompt_ids!r:.80}.")
        key = tuple(int(x) for x in ids.reshape(-1))
        if key not in self._index:
            raise ValueError(f"This prompt ({len(key)} tokens) is not among the traces' {n} prompts: the replay can "
                             "only replay what was recorded (python -m eval.record).")
        return self._index[key]

    @property
    def ids(self) -> np.ndarray:
        """int64 (L + generated,): the committed sequence (the prompt and the recorded tokens replayed so far).

        Raises:
            RuntimeError: before :meth:`start`.
        """
        self._check_started()
        return np.concatenate([np.asarray(self._pt.prompt_ids, dtype=np.int64),
                               np.asarray(self._pt.output[: self._t], dtype=np.int64)])

    @property
    def generated(self) -> int:
        """Tokens generated so far (the prefill's first one included)."""
        return self._t

    @property
    def depth(self) -> int:
        """Tokens drafted this cycle."""
        return self._j

    @property
    def ended_by_eos(self) -> bool:
        """The generation has finished with EOS (else it is running or ended at ``max_new_tokens``)."""
        return self.finished and self.replay.eos

    @property
    def target_dtype(self) -> str | None:
        """The precision the traces were recorded in (their header's ``dtype``), which ``generate`` checks a trained
        policy against; None when the header does not say."""
        return self._prompts.header.get("dtype")

    def usable(self, indices: Sequence[int] | None = None) -> list[int]:
        """Of trace prompts ``indices`` (None: all), those whose replayed generation has a decision to make (it does
        not end at its first token)."""
        idx = range(len(self._prompts)) if indices is None else indices
        return [int(i) for i in idx if self.replay_data(int(i)).n > 1]

    def _check_verify_size(self, verify_size: int | None) -> None:
        if verify_size is not None and verify_size != self._j:
            raise ValueError(f"A chain drafter verifies all drafted tokens: verify_size must be {self._j}, got "
                             f"{verify_size}.")


class ReplayDecoder(_TraceBackend):
    """A chain decoder replayed from traces and latency profiles (see the module docstring).

    Args:
        traces: a :class:`learn2draft.replay.traces.TraceSet`, a trace file, or several (a list, or paths joined by
            commas) recorded with the same settings (``python -m eval.record``).
        profile: a :class:`learn2draft.replay.latency.LatencyProfile`, a profile file or a shipped profile's name, or
            several (a list, or names joined by commas); each generation runs on the one :meth:`start` names.
        max_new_tokens: tokens per generation, 2 ≤ it ≤ the traces' (None: the traces').
        max_depth: the most tokens drafted per cycle and the scale of the depth features, ≤ the traces' (None: the
            traces').

    Attributes:
        clock: a :class:`ReplayClock`.
        prompt_index: the trace prompt of the current generation; ``profile_index`` its profile.

    Raises:
        ValueError: draft-tree traces, no profile, bad ``max_depth`` / ``max_new_tokens`` (the message says the
            range), or a profile without the traces' drafter's costs or too small a verify table for ``max_depth``.
        FileNotFoundError: a trace or profile file is missing.
    """

    _hybrid = False

    def __init__(self, traces: TraceSet | str | Path | Sequence[str | Path],
                 profile: LatencyProfile | str | Path | Sequence[LatencyProfile | str | Path] | None,
                 max_new_tokens: int | None = None, max_depth: int | None = None):
        if isinstance(traces, TreeTraceSet):
            raise ValueError("The replay decoder replays chain traces; these are draft-tree traces (recorded with "
                             "--tree): record chain traces without --tree (python -m eval.oracle reads tree traces).")
        self.traces = tr = traces if isinstance(traces, TraceSet) else load_traces(traces)
        if profile is None:
            raise ValueError("profile is required: the latency profile(s) the replayed cycles cost (a file from "
                             "`python -m eval.profile`, a shipped name such as 'cpu-2core' or 'gpu-like', or several).")
        self.profiles = load_profiles(profile)
        self.max_depth = self._check_setting(
            "max_depth", max_depth, tr.max_depth, 0, tr.max_depth,
            f"(the traces hold chains of up to {tr.max_depth} tokens; record deeper traces for more)")
        self.max_new_tokens = self._check_setting("max_new_tokens", max_new_tokens, tr.max_new_tokens, 2,
                                                  tr.max_new_tokens, "(the traces' length)")
        self.drafter_name = tr.drafter
        for prof in self.profiles:
            prof.cost(self.drafter_name)  # raises ValueError if the profile lacks the drafter
            prof.verify(self.max_depth + 1, 0)  # raises ValueError if the verify table is too small
        self.vocab_size = int(tr.header["vocab_size"])
        self.deterministic = tr.deterministic
        self._init_replay(tr)
        self._replays: dict[tuple[int, int], ChainReplay] = {}
        self._observations: dict[int, np.ndarray] = {}
        self.profile_index = 0
        #: float32, appended to every observation (:meth:`features`): a profile's features for a profile-conditioned
        #: policy (``envs.replay.SpecDecodeReplayEnv(profile_features=True)`` sets it per generation); None: nothing
        self.observation_suffix: np.ndarray | None = None

    # ------------------------------------------------------------------ tables
    def replay_data(self, index: int, profile_index: int | None = None) -> ChainReplay:
        """The outcome model of trace prompt ``index`` with profile ``profile_index`` (default: the current
        generation's): :func:`learn2draft.replay.outcome.chain_replay` at this decoder's ``max_depth`` and
        ``max_new_tokens``, built on first use."""
        k = self.profile_index if profile_index is None else int(profile_index)
        r = self._replays.get((index, k))
        if r is None:
            r = self._replays[(index, k)] = chain_replay(self.traces.prompts[index], self.profiles[k],
                                                         self.drafter_name, self.max_depth, self.max_new_tokens)
        return r

    def static_observations(self, index: int) -> np.ndarray:
        """float32 (n+1, D+1, len(FEATURE_NAMES)): prompt ``index``'s observation at every (t, j) with an empty
        history (:func:`learn2draft.features.build_features`; the history entries are filled in per step, so a step
        costs a copy, not a feature build), built on first use."""
        obs = self._observations.get(index)
        if obs is None:
            pt, avail = self.traces.prompts[index], self.replay_data(index).avail
            D, N = self.max_depth, self.max_new_tokens
            n = avail.shape[0] - 1
            obs = np.zeros((n + 1, D + 1, len(FEATURE_NAMES)), dtype=np.float32)
            for t in range(1, n + 1):
                conf, ent = pt.confidence[t].tolist(), pt.entropy[t].tolist()
                for j in range(int(avail[t]) + 1):
                    obs[t, j] = build_features(
                        context_len=pt.prompt_len + t + j, depth=j, max_depth=max(D, 1), accepted_history=[],
                        confidences=conf[:j], last_entropy=ent[j - 1] if j else 0.0, vocab_size=self.vocab_size,
                        last_accept_fraction=1.0, generated=t, max_new_tokens=N,
                        drafter_features=pt.drafter_features[t, j])
            self._observations[index] = obs
        return obs

    def autoregressive_rate(self, profile_index: int = 0, *, indices: Sequence[int] | None = None) -> float:
        """tokens/s of plain decoding (depth 0 every cycle) over the usable prompts of ``indices`` (None: all) with
        profile ``profile_index``: all generated tokens (the prefill's first one included) over the summed cycle
        seconds — the ``cycle_tokens_per_s`` that ``python -m train`` measures on the real loop for its reward
        scale."""
        tokens = seconds = 0.0
        for i in self.usable(indices):
            r = self.replay_data(i, profile_index)
            tokens += r.n
            seconds += float(r.total[1:r.n, 0].sum())
        return tokens_per_second(tokens, seconds)

    # ------------------------------------------------------------------ state
    def start(self, prompt_ids, seed: int | None = None, *, profile_index: int | None = None,
              rng: np.random.Generator | None = None) -> None:
        """Start replaying the generation of a traced prompt: after it one token is generated (the recorded
        prefill's), as after :meth:`SpeculativeDecoder.start`.

        Args:
            prompt_ids: the prompt's ids (int (L,) or (1, L), any array-like: one of the traces' prompts), or the
                trace prompt's index (an int).
            seed: seeds the T > 0 acceptance draws (ignored when ``rng`` is given; None: fresh entropy).
            profile_index: which profile this generation runs on (None: the last one, at first 0).
            rng: the generator of the T > 0 acceptance draws (e.g. an environment's ``np_random``).

        Raises:
            ValueError: a prompt that is not among the traces', an index or ``profile_index`` out of range.
        """
        index = self._prompt_index(prompt_ids)
        if profile_index is not None:
            if not (isinstance(profile_index, numbers.Integral) and 0 <= profile_index < len(self.profiles)):
                raise ValueError(f"profile_index must be an integer in [0, {len(self.profiles)}) (the profiles: "
                                 f"{', '.join(p.name for p in self.profiles)}), got {profile_index!r}.")
            self.profile_index = int(profile_index)
        self.prompt_index = index
        self.replay = self.replay_data(index)
        self._static = self.static_observations(index)
        self._pt = self.traces.prompts[index]
        self.prompt_len = int(self._pt.prompt_len)
        self._rng = None if self.deterministic else (rng if rng is not None else np.random.default_rng(seed))
        self._t, self._j = 1, 0
        self.accepted_history: list[int] = []
        self._hist = np.zeros(HISTORY, dtype=np.float32)
        self.last_accept_fraction = 1.0
        self._cycle_other = 0.0
        self._started = True
        self.finished = self.replay.n <= 1

    @property
    def depth_limit(self) -> int:
        """The most tokens this cycle may draft: ``max_depth`` capped so that τ + 1 ≤ tokens left."""
        return max(0, min(self.max_depth, self.max_new_tokens - self._t - 1))

    def can_draft(self) -> bool:
        """Whether :meth:`draft_step` may run now: the trace's chain at this position (capped by the depth limit)
        holds one more token."""
        return self._started and not self.finished and self._j < self.replay.avail[self._t]

    def features(self) -> np.ndarray:
        """Observation for the next decision, float32 (len(FEATURE_NAMES),): the real decoder's
        :meth:`~learn2draft.decoding.SpeculativeDecoder.features` in the same state (then :attr:`observation_suffix`
        when set)."""
        self._check_started()
        obs = self._static[self._t, self._j].copy()
        obs[_HIST] = self._hist
        obs[_LAF] = np.float32(self.last_accept_fraction)
        return obs if self.observation_suffix is None else np.concatenate((obs, self.observation_suffix))

    def state(self, observation: np.ndarray | None = None) -> DraftState:
        """What a policy may see at the next decision (as :meth:`SpeculativeDecoder.state` for the same position):
        the integer depth j, the trace's confidences and entropies of the chain's first j tokens and its drafter
        features before step j, the generation's history, and as ``observation`` the precomputed vector.

        Args:
            observation: the current observation when the caller holds it (e.g. one with a profile's features
                appended); None: :meth:`features`.
        """
        self._check_started()
        t, j, pt = self._t, self._j, self._pt
        return DraftState(
            depth=j, max_depth=self.max_depth, committed_len=self.prompt_len + t, generated=t,
            max_new_tokens=self.max_new_tokens, accepted_history=tuple(self.accepted_history),
            last_accept_fraction=self.last_accept_fraction, confidences=tuple(pt.confidence[t, :j].tolist()),
            entropies=tuple(pt.entropy[t, :j].tolist()), vocab_size=self.vocab_size,
            drafter_features=pt.drafter_features[t, j],
            observation=self.features() if observation is None else observation,
        )

    # ------------------------------------------------------------------ the cycle
    def draft_step(self) -> None:
        """Draft the trace's next token at this position.

        Raises:
            RuntimeError: not started, finished, or no further token can be drafted (check :meth:`can_draft`).
        """
        self._check_running()
        if not self.can_draft():
            raise RuntimeError(f"No further draft at depth {self._j}: call verify().")
        self._j += 1

    def verify(self, verify_size: int | None = None) -> CycleResult:
        """Verify the j drafted tokens: the outcome model's τ, tokens emitted and seconds
        (:meth:`~learn2draft.replay.outcome.ChainReplay.cycle`); the clock advances by the cycle's seconds (the
        profile's, plus any :meth:`add_other_seconds`).

        Raises:
            ValueError: ``verify_size`` other than the depth (a chain verifies every drafted token).
            RuntimeError: not started or finished.
        """
        self._check_running()
        t, j, r = self._t, self._j, self.replay
        self._check_verify_size(verify_size)
        tau, emitted, _ = r.cycle(t, j, self._rng)
        self.accepted_history.append(tau)
        h = self.accepted_history[-HISTORY:][::-1]
        self._hist = np.zeros(HISTORY, dtype=np.float32)
        self._hist[: len(h)] = [min(x / max(self.max_depth, 1), 1.0) for x in h]
        self.last_accept_fraction = tau / j if j else 1.0
        other = float(r.other[t, j]) + self._cycle_other
        res_draft, res_verify = float(r.draft[t, j]), float(r.verify[t, j])
        self.clock.seconds += res_draft + res_verify + other
        self._t, self._j, self._cycle_other = t + emitted, 0, 0.0
        self.finished = self._t >= r.n
        tokens = self._pt.output[t : t + emitted].tolist()
        return CycleResult(tokens, j, j, tau, res_draft, res_verify, other, self.finished, self.features())



class HybridReplayDecoder(_TraceBackend):
    """A hybrid drafter's decoder (prompt lookup + a neural drafter, the source chosen per token) replayed from a
    lookup trace set and a neural one (:mod:`learn2draft.replay.hybrid`, temperature 0), with the real decoder's API:
    :meth:`step` takes 0 STOP, 1 CONTINUE with lookup, 2 CONTINUE with the neural drafter
    (:data:`learn2draft.control.HYBRID_ACTION_MEANINGS`, what :class:`learn2draft.drafters.hybrid.HybridDrafter`
    executes); lookup without a proposal falls back to the neural drafter, as on the real loop.

    Args:
        traces: ``(lookup TraceSet, neural TraceSet)``, or the trace files of both (a list, or paths joined by commas:
            :func:`learn2draft.replay.hybrid.split_hybrid_traces`); checked with
            :func:`~learn2draft.replay.hybrid.check_hybrid_traces`.
        profile: a latency profile (object, file or shipped name) with costs for ``"lookup"`` and the neural drafter.
        max_new_tokens, max_depth: ≤ the traces' (None: theirs; ``max_depth`` ≥ 1).

    Attributes:
        clock: a :class:`ReplayClock`; ``last_approximate``: the last verified cycle's outcome used the head
            approximation (:mod:`learn2draft.replay.hybrid`).

    Raises:
        ValueError: traces that cannot replay a hybrid together (see :func:`~learn2draft.replay.hybrid.check_hybrid_traces`),
            no profile or several, settings out of range, a profile without the two drafters' costs or a verify table
            too small.

    Note: a cycle's depth is capped at the tokens left to the recorded end of the generation (its EOS), which the real
    decoder does not know (it caps at ``max_new_tokens`` only): just before an EOS the replay drafts less than the
    real loop would (the neural trace holds no rows past the end).
    """

    _hybrid = True

    def __init__(self, traces: tuple[TraceSet, TraceSet] | str | Sequence[str | Path],
                 profile: LatencyProfile | str | Path, max_new_tokens: int | None = None,
                 max_depth: int | None = None):
        if isinstance(traces, tuple) and len(traces) == 2 and all(isinstance(t, TraceSet) for t in traces):
            self.lookup_traces, self.neural_traces = check_hybrid_traces(*traces)
        else:
            self.lookup_traces, self.neural_traces = split_hybrid_traces(traces)
        self.neural = self.neural_traces.drafter
        if profile is None:
            raise ValueError("profile is required: the latency profile the replayed cycles cost (a file from "
                             "`python -m eval.profile` or a shipped name), with lookup's and the neural drafter's costs.")
        profiles = load_profiles(profile)
        if len(profiles) != 1:
            raise ValueError(f"A hybrid drafter replays on one latency profile, got {len(profiles)}.")
        self.profile = profiles[0]
        self.profile.cost("lookup")
        self.profile.cost(self.neural)
        rec_d = self.lookup_traces.max_depth  # a draft model needs depth-0 rows only; a short head chain is approximated
        rec_n = min(self.lookup_traces.max_new_tokens, self.neural_traces.max_new_tokens)
        self.max_depth = self._check_setting("max_depth", max_depth, rec_d, 1, rec_d, "(the traces' chains)")
        self.max_new_tokens = self._check_setting("max_new_tokens", max_new_tokens, rec_n, 2, rec_n,
                                                  "(the traces' length)")
        self.profile.verify(self.max_depth + 1, 0)
        self.vocab_size = int(self.lookup_traces.header["vocab_size"])
        self._init_replay(self.lookup_traces)
        self._replays: dict[int, HybridReplay] = {}
        self._source = 0
        self.last_approximate = False

    def replay_data(self, index: int) -> HybridReplay:
        """The :class:`~learn2draft.replay.hybrid.HybridReplay` of prompt ``index`` (built on first use)."""
        r = self._replays.get(index)
        if r is None:
            r = self._replays[index] = hybrid_replay(self.lookup_traces.prompts[index], self.neural_traces.prompts[index],
                                                     self.profile, self.neural, self.max_depth, self.max_new_tokens)
        return r

    def autoregressive_rate(self, *, indices: Sequence[int] | None = None) -> float:
        """tokens/s of plain decoding over the usable prompts of ``indices`` (None: all)."""
        tokens = seconds = 0.0
        for i in self.usable(indices):
            r = self.replay_data(i)
            tokens += r.n
            seconds += sum(r.cycle_seconds(t, 0, False, 0.0) for t in range(1, r.n))
        return tokens_per_second(tokens, seconds)

    def oracle_rate(self, *, indices: Sequence[int] | None = None) -> float:
        """tokens/s of the hindsight oracle (:func:`learn2draft.replay.hybrid.hybrid_oracle_seconds`) over the usable
        prompts of ``indices`` (None: all)."""
        tokens = seconds = 0.0
        for i in self.usable(indices):
            r = self.replay_data(i)
            tokens += r.n
            seconds += hybrid_oracle_seconds(r)[0]
        return tokens_per_second(tokens, seconds)

    # ------------------------------------------------------------------ state
    def start(self, prompt_ids, seed: int | None = None) -> None:
        """Start replaying prompt ``prompt_ids`` (its ids, one of the traces' prompts, or its index); ``seed`` is
        unused (temperature 0).

        Raises:
            ValueError: a prompt not among the traces', or an index out of range.
        """
        index = self._prompt_index(prompt_ids)
        self.prompt_index = index
        self.replay = self.replay_data(index)
        self._pt = self.lookup_traces.prompts[index]
        self.prompt_len = int(self._pt.prompt_len)
        self._t = 1
        self.accepted_history: list[int] = []
        self.last_accept_fraction = 1.0
        self._source = 0
        self._new_cycle()
        self._started = True
        self.finished = self.replay.n <= 1

    def _new_cycle(self) -> None:
        self._j, self._run, self._ok = 0, 0, True
        self._confs: list[float] = []
        self._ents: list[float] = []
        self._sources: list[int] = []
        self._since, self._draft_s, self._used, self._approx = 0, 0.0, False, False
        self._cycle_other = 0.0

    def can_draft(self) -> bool:
        """Whether one more token may be drafted (the neural drafter always has a proposal)."""
        return self._started and not self.finished and self._j < self.replay.limit[self._t]

    def _choose(self, action: int) -> bool:
        """A CONTINUE's source for the next draft (1 lookup, 2 neural: :meth:`HybridDrafter.select`'s)."""
        if action:
            self._source = int(action) - 1
        return bool(action)

    def features(self) -> np.ndarray:
        """float32 (len(FEATURE_NAMES) + len(HYBRID_FEATURE_NAMES),): the vector the real decoder builds for a hybrid
        drafter, from the traces with the same builders (the drafted tokens' confidences and entropies from whichever
        source drafted them, the lookup's match features and lookahead here, the last token's source, the target's
        view of the last committed token: zeros when the traces do not hold it)."""
        self._check_started()
        r, t, j = self.replay, self._t, self._j
        pos = t + j
        D = self.max_depth
        base = build_features(
            context_len=self.prompt_len + pos, depth=j, max_depth=D, accepted_history=self.accepted_history,
            confidences=self._confs, last_entropy=self._ents[-1] if self._ents else 0.0, vocab_size=self.vocab_size,
            last_accept_fraction=self.last_accept_fraction, generated=t, max_new_tokens=self.max_new_tokens,
            drafter_features=r.look_feats[min(pos, r.n)],
        )
        left = int(r.limit[t]) - j
        chain = r.look_chain[min(pos, r.n)]
        confs = [float(x) for x in chain[:max(left, 0)] if not np.isnan(x)] if r.look_avail[min(pos, r.n)] else []
        hyb = build_hybrid_features(confs, D, bool(self._sources) and self._sources[-1] == 1, r.target[t],
                                    self.vocab_size)
        return np.concatenate((base, hyb))

    def state(self, observation: np.ndarray | None = None) -> DraftState:
        """The :class:`learn2draft.state.DraftState` of the current decision (as the hybrid decoder's): the integer
        depth, this cycle's confidences and entropies, the lookup's drafter features, the hybrid features as
        ``extra_features`` and the observation (None: :meth:`features`)."""
        self._check_started()
        obs = self.features() if observation is None else observation
        t, r = self._t, self.replay
        return DraftState(
            depth=self._j, max_depth=self.max_depth, committed_len=self.prompt_len + t, generated=t,
            max_new_tokens=self.max_new_tokens, accepted_history=tuple(self.accepted_history),
            last_accept_fraction=self.last_accept_fraction, confidences=tuple(self._confs),
            entropies=tuple(self._ents), vocab_size=self.vocab_size,
            drafter_features=r.look_feats[min(t + self._j, r.n)], extra_features=obs[len(FEATURE_NAMES):],
            observation=obs,
        )

    # ------------------------------------------------------------------ the cycle
    def draft_step(self) -> None:
        """Draft the next token with the source chosen last (lookup without a proposal: the neural drafter).

        Raises:
            RuntimeError: not started, finished, or the depth limit reached (check :meth:`can_draft`).
        """
        self._check_running()
        if not self.can_draft():
            raise RuntimeError(f"No further draft at depth {self._j}: call verify().")
        r, t, j = self.replay, self._t, self._j
        src, ok = r.token(t, j, self._source)
        self._draft_s += r.draft_seconds(t, src, self._since)
        if src == 0:
            self._since += 1
            self._confs.append(float(r.look_conf[t + j]))
            self._ents.append(0.0)
        else:
            self._since, self._used = 0, True
            self._confs.append(float(r.neural_conf[t, j]))
            self._ents.append(float(r.neural_ent[t, j]))
            self._approx |= bool(r.approx[t, j])
        self._sources.append(src)
        self._ok = self._ok and ok
        self._run += int(self._ok)
        self._j = j + 1

    def verify(self, verify_size: int | None = None) -> CycleResult:
        """Verify the drafted tokens: τ is the greedy run of the mixed chain, τ + 1 tokens emitted (fewer at the end),
        the profile's seconds (:meth:`~learn2draft.replay.hybrid.HybridReplay.cycle_seconds`); the clock advances.

        Raises:
            ValueError: ``verify_size`` other than the depth.
            RuntimeError: not started or finished.
        """
        self._check_running()
        r, t, d = self.replay, self._t, self._j
        self._check_verify_size(verify_size)
        emitted = min(self._run + 1, r.n - t)
        tau = min(self._run, emitted)
        seconds = r.cycle_seconds(t, d, self._used, self._draft_s) + self._cycle_other
        draft_s, verify_s = self._draft_s, float(r.verify[t, d])
        neural = sum(self._sources)
        self.last_approximate = self._approx
        self.accepted_history.append(tau)
        self.last_accept_fraction = tau / d if d else 1.0
        self.clock.seconds += seconds
        self._t = t + emitted
        self.finished = self._t >= r.n
        tokens = self._pt.output[t : t + emitted].tolist()
        self._new_cycle()
        return CycleResult(tokens, d, d, tau, draft_s, verify_s, seconds - draft_s - verify_s, self.finished,
                           self.features(), neural)


__all__ = ["HybridReplayDecoder", "ReplayClock", "ReplayDecoder"]
