"""The draft-depth environment replayed from recorded traces and a latency profile — no model runs.

:class:`SpecDecodeReplayEnv` (registered as ``learn2draft/SpecDecodeReplay-v0``) is the one depth environment
(:class:`envs.spec_decode.DepthEnv`, whose step, reward and termination the real-loop
:class:`envs.spec_decode.SpecDecodeEnv` runs too) over the replay backend,
:class:`learn2draft.replay.backend.ReplayDecoder` (the real decoder's API, no model): the same observation and
action spaces, step semantics and reward formula; only where the numbers come from differs:

* what the drafter and the target agree on comes from a trace (:mod:`learn2draft.replay.traces`): the
  drafted chain at every position, its draft-side features, and the acceptance probability of each
  drafted token;
* what each cycle costs comes from a latency profile (:mod:`learn2draft.replay.latency`):
  ``seconds(d, c) = d · (draft_step(c) + step_overhead) + verify(d + 1, c) + cycle_overhead`` at
  context length c, for the trace's drafter.

Replay state per generation: the position t (tokens generated), the depth j drafted in the current
cycle, the accepted lengths of the cycles so far and the last cycle's τ / depth. The observation at
(t, j) is the vector :func:`learn2draft.features.build_features` builds from the trace's chain at t
(the confidences and entropies of its first j tokens, the drafter features before step j) and the
replay state — the same vector the real environment would show in that state. For speed the parts
that depend on (t, j) only are built once per prompt with ``build_features`` and the history
entries are filled in per step (the backend's :meth:`~learn2draft.replay.backend.ReplayDecoder.static_observations`;
tests check the result against ``build_features``).
:meth:`SpecDecodeReplayEnv.state` is the :class:`learn2draft.state.DraftState` at (t, j) — the
integer depth j, the trace's confidences, entropies and drafter features, the history — carrying
that precomputed vector as its ``observation``: what :func:`replay_controller` hands a controller's
:meth:`~learn2draft.control.DraftController.decide`, so a rule reads the same integers and floats
as on the real decoder and a learned policy the same vector.

A cycle that starts at t and verifies at depth j (0 ≤ j ≤ the chain available at t, capped by
``max_depth`` and the tokens left, as :attr:`SpeculativeDecoder.depth_limit` caps it) has the outcome
of the one outcome model, :meth:`learn2draft.replay.outcome.ChainReplay.cycle`: τ accepted tokens
(at temperature 0 ``τ = min(j, accepted_run[t])``; at T > 0 drawn with ``self.np_random`` from the
recorded acceptance probabilities), τ + 1 emitted (fewer at EOS / ``max_new_tokens``, τ then counting
only emitted tokens, as :meth:`SpeculativeDecoder.verify` counts it) and its profile seconds; the next
cycle starts at t + emitted. The reward at a verifying step is :func:`envs.reward.cycle_reward` of
``emitted / seconds(j, c)``, 0 at drafting steps — as :attr:`CycleResult.tokens_per_second` is in the
real environment.
T > 0 replays follow the recorded trajectory after each cycle: see :mod:`learn2draft.replay.traces` for what
that approximates.

Rewards are deterministic for a seed (no clock), so the environment is registered as deterministic
and passes every check of gymnasium's ``check_env``.

Several profiles (one policy for several machines, issue 10 item 6): with ``profile=[p1, p2, …]`` each
generation is replayed on one of them, drawn uniformly at reset (or named with
``options={"profile_index": k}``), and its reward is measured against that profile's own plain
decoding: ``tokens_per_second / (reward_scale · ar_k / ar_1)`` with ``ar_k`` the
:meth:`autoregressive_rate` of profile k, so that a fast machine's rates do not drown a slow one's.
With ``profile_features=True`` the observation ends with the profile's
:func:`learn2draft.features.profile_features` (:data:`PROFILE_FEATURE_NAMES`), constant within a
generation: the policy can tell the machines apart. Without them it is one profile-blind policy for
all the machines.

Throughput: a few µs per step on one core (measure with :func:`measure_steps_per_second`).
"""

from __future__ import annotations

import numbers
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
from gymnasium import spaces

from envs.reward import check_reward_scale, cycle_reward, relative_speeds
from envs.spec_decode import EPISODE_MODES, DepthEnv
from learn2draft.control import check_depth_feature_scale
from learn2draft.features import FEATURE_NAMES, PROFILE_FEATURE_NAMES
from learn2draft.features import profile_features as profile_feature_vector
from learn2draft.metrics import CycleResult
from learn2draft.names import run_seed
from learn2draft.replay.backend import ReplayDecoder
from learn2draft.replay.latency import LatencyProfile
from learn2draft.replay.outcome import ChainReplay, tokens_per_second
from learn2draft.replay.traces import TraceSet
from learn2draft.state import DraftState

REPLAY_ENV_ID = "learn2draft/SpecDecodeReplay-v0"


class SpecDecodeReplayEnv(DepthEnv):
    """Draft-depth control replayed from traces and a latency profile.

    Args:
        traces: a :class:`learn2draft.replay.traces.TraceSet`, a trace file, or several (a list, or paths joined by
            commas) recorded with the same settings (``python -m eval.record``).
        profile: a :class:`learn2draft.replay.latency.LatencyProfile`, a profile file, or a shipped profile's name
            (``"cpu-2core"``, ``"gpu-like"``); or several (a list, or names / files joined by commas): each
            generation then runs on one of them (see the module docstring). Each must hold costs for the
            trace's drafter.
        max_new_tokens: tokens per generation, ≤ the trace's (None: the trace's).
        max_depth: the most tokens drafted per cycle and the scale of the depth features, ≤ the trace's
            (None: the trace's).
        reward_scale: rewards are ``tokens_per_second / reward_scale`` (> 0), as in ``SpecDecodeEnv``;
            :meth:`autoregressive_rate` is the scale ``python -m train`` uses.
        episode: ``"generation"`` or ``"cycle"`` (see :mod:`envs.spec_decode`).
        prompt_indices: replay only these prompts of the traces (default all).
        profile_features: append the generation's :func:`learn2draft.features.profile_features` to every
            observation (a profile-conditioned policy; ``python -m train --features profile``).

    Observation: float32 ``(len(FEATURE_NAMES),)`` as :class:`envs.spec_decode.SpecDecodeEnv`'s, or
    ``(len(FEATURE_NAMES) + len(PROFILE_FEATURE_NAMES),)`` with ``profile_features``. Action, info: as
    :class:`envs.spec_decode.SpecDecodeEnv` (``seconds``, ``draft_seconds``, ``verify_seconds``,
    ``other_seconds`` come from the profile; ``profile_index`` says which one).

    Raises:
        ValueError: bad settings (the message says which), a profile without the drafter's costs or
            too small a verify table for ``max_depth`` (or, with ``profile_features``, below 16 tokens),
            or traces in which every generation ends at its first token.
        FileNotFoundError: a trace or profile file is missing.
    """

    def __init__(
        self,
        traces: TraceSet | str | Path | Sequence[str | Path],
        profile: LatencyProfile | str | Path | Sequence[LatencyProfile | str | Path] | None = None,
        max_new_tokens: int | None = None,
        max_depth: int | None = None,
        reward_scale: float = 1.0,
        episode: str = "generation",
        prompt_indices: Sequence[int] | None = None,
        profile_features: bool = False,
    ):
        super().__init__()
        reward_scale = check_reward_scale(reward_scale)
        if episode not in EPISODE_MODES:
            raise ValueError(f"episode must be one of {EPISODE_MODES}, got {episode!r}.")
        #: the backend: the replay decoder (the traces, the profiles, the outcome model and the observations)
        self.decoder = ReplayDecoder(traces, profile, max_new_tokens=max_new_tokens, max_depth=max_depth)
        d = self.decoder
        self.traces, self.profiles = d.traces, d.profiles
        self.profile = self.profiles[0]  # the profile of the current generation
        self.profile_index = 0
        self.max_depth, self.max_new_tokens = d.max_depth, d.max_new_tokens
        self.drafter = d.drafter_name
        self.profile_features = bool(profile_features)
        self._profile_obs = [profile_feature_vector(prof, self.drafter) if self.profile_features else None
                             for prof in self.profiles]
        self.vocab_size = d.vocab_size
        self.deterministic = d.deterministic
        self.reward_scale = reward_scale
        self.episode = episode
        tr = self.traces
        self.prompt_indices = list(range(len(tr))) if prompt_indices is None else [int(i) for i in prompt_indices]
        if not self.prompt_indices or not all(0 <= i < len(tr) for i in self.prompt_indices):
            raise ValueError(f"prompt_indices must be a non-empty list of indices in [0, {len(tr)}).")
        self._usable = d.usable(self.prompt_indices)
        if not self._usable:
            raise ValueError("Every traced generation ends at its first token (EOS): no drafting decision to make.")
        # Per-profile reward normalisation: rewards are relative to each profile's plain decoding.
        self._relative_speed = (relative_speeds([self.autoregressive_rate(k) for k in range(len(self.profiles))])
                                if len(self.profiles) > 1 else [1.0])

        width = len(FEATURE_NAMES) + (len(PROFILE_FEATURE_NAMES) if self.profile_features else 0)
        self.observation_space = spaces.Box(0.0, 1.0, shape=(width,), dtype=np.float32)
        self.action_space = spaces.Discrete(2)
        self.prompt_index: int | None = None
        self.last_cycle = None
        self._needs_reset = True
        self._in_generation = False

    # ------------------------------------------------------------------ the replay backend's tables
    def replay_data(self, index: int, profile_index: int | None = None) -> ChainReplay:
        """The outcome model of trace prompt ``index`` with profile ``profile_index`` (default: the current
        generation's): :meth:`learn2draft.replay.backend.ReplayDecoder.replay_data`."""
        return self.decoder.replay_data(index, self.profile_index if profile_index is None else profile_index)

    @property
    def _r(self) -> ChainReplay:
        """The current generation's outcome model."""
        return self.decoder.replay

    def autoregressive_rate(self, profile_index: int = 0) -> float:
        """tokens/s of plain decoding (depth 0 every cycle) over the replayed prompts with profile
        ``profile_index``: all generated tokens (the prefill's first one included) over the summed cycle
        seconds — the ``cycle_tokens_per_s`` that ``python -m train`` measures on the real loop for its
        reward scale."""
        return self.decoder.autoregressive_rate(profile_index, indices=self._usable)

    # ------------------------------------------------------------------ the env's hooks
    _NEW_GENERATION_OPTIONS = ("prompt_index", "profile_index")

    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None) -> tuple[np.ndarray, dict]:
        """Start a generation (or, in ``episode="cycle"`` mode, continue the current one); as
        :meth:`envs.spec_decode.DepthEnv.reset`.

        Args:
            seed: seeds ``self.np_random``: the prompt draw and, at T > 0, the acceptance draws.
            options: ``{"prompt_index": i}`` (an index into the traces) forces that prompt;
                ``{"profile_index": k}`` that profile (with several; default: drawn uniformly);
                ``{"new_generation": True}`` forces a new generation in cycle mode.

        Raises:
            ValueError: ``prompt_index`` out of range, not among ``prompt_indices``, or a prompt whose
                generation ends at its first token; ``profile_index`` out of range.
        """
        return super().reset(seed=seed, options=options)

    def _start_generation(self, options: dict[str, Any]) -> None:
        k = options.get("profile_index")
        if k is None:  # a draw only with several profiles: one profile keeps the single-profile random stream
            k = int(self.np_random.integers(len(self.profiles))) if len(self.profiles) > 1 else 0
        elif not (isinstance(k, numbers.Integral) and 0 <= k < len(self.profiles)):
            raise ValueError(f"profile_index must be an integer in [0, {len(self.profiles)}) (the env's profiles: "
                             f"{', '.join(p.name for p in self.profiles)}), got {k!r}.")
        self.profile_index, self.profile = int(k), self.profiles[int(k)]
        idx = options.get("prompt_index")
        if idx is None:
            for _ in range(100):  # as the real env: redraw prompts whose generation ends at the first token
                idx = self.prompt_indices[int(self.np_random.integers(len(self.prompt_indices)))]
                if idx in self._usable:
                    break
            else:
                idx = self._usable[0]
        else:
            idx = int(idx)
            if idx not in self.prompt_indices:
                raise ValueError(f"prompt_index must be one of the replayed prompts (0..{len(self.traces) - 1}"
                                 f"{'' if len(self.prompt_indices) == len(self.traces) else ', restricted'}), got {idx}.")
            if idx not in self._usable:
                raise ValueError(f"Prompt {idx} ends at its first token (EOS): no drafting decision to make.")
        self.prompt_index = idx
        self.decoder.start(idx, profile_index=self.profile_index, rng=self.np_random)
        self.decoder.observation_suffix = self._profile_obs[self.profile_index]  # None without profile features

    def _reward(self, res: CycleResult) -> float:
        return cycle_reward(res.tokens_per_second, self.reward_scale, self._relative_speed[self.profile_index])

    def _ended_by_eos(self, res: CycleResult) -> bool:
        return self.decoder.ended_by_eos

    def _info_extra(self) -> dict[str, Any]:
        return {"profile_index": self.profile_index}

    def _obs(self) -> np.ndarray:
        """The current observation (the backend's features, and the profile's when the env appends them)."""
        return self._observation(self.decoder.features())

    def state(self, observation: np.ndarray | None = None) -> DraftState:
        """The :class:`learn2draft.state.DraftState` of the current decision (as
        :meth:`SpeculativeDecoder.state` for the same position): the backend's
        (:meth:`learn2draft.replay.backend.ReplayDecoder.state`), with ``observation`` the env's.

        Args:
            observation: the current observation when the caller holds it (what :meth:`reset` or :meth:`step`
                returned), float32 (observation_space.shape); None: built again.
        """
        return self.decoder.state(self._obs() if observation is None else observation)

    def can_draft(self) -> bool:
        """Whether drafting one more token is possible now (as :meth:`SpeculativeDecoder.can_draft`)."""
        return self.decoder.can_draft()

    @property
    def depth(self) -> int:
        """Tokens drafted in the current cycle."""
        return self.decoder.depth


# --------------------------------------------------------------------------- scoring
def replay_controller(env: SpecDecodeReplayEnv, controller, prompt_indices: Sequence[int] | None = None,
                      repeats: int = 1, seed: int = 0, profile_index: int = 0) -> dict:
    """Score any :class:`learn2draft.DraftController` (fixed γ, heuristics, an exported policy) in replay.

    Each generation is driven by the replay backend's own cycle, :meth:`learn2draft.control.CycleDriver.run_cycle`
    (what :meth:`SpeculativeDecoder.run_cycle` runs on the real loop): before each draft step, if the depth is below
    the controller's ``max_depth`` and drafting is possible, the controller is asked
    :meth:`~learn2draft.control.DraftController.decide` on the backend's state (its observation the env's vector, a
    profile's features appended when the env appends them) and says CONTINUE or STOP; otherwise the cycle verifies. ``controller.reset()`` starts each
    generation. The env's episode mode does not matter (generations are followed across cycle episodes).

    Args:
        env: the replay environment (its traces, profile, ``max_depth`` and ``max_new_tokens``).
        controller: a ``DraftController``; one that reads depth features on another ``max_depth`` scale
            (``depth_feature_scale``) is refused, as :meth:`SpeculativeDecoder.generate` refuses it.
        prompt_indices: trace prompts to run (default: the env's usable ones).
        repeats: generations per prompt (T > 0: different acceptance draws; at T = 0 all repeats are equal).
        seed: the acceptance draws of repeat k of prompt i use seed ``seed + 1000·k + i``.
        profile_index: which of the env's profiles every generation runs on. A profile-conditioned policy
            sees the observations it was trained on either from an env built with ``profile_features=True``
            or, from a plain env, as ``load_policy(dir, profile=...)`` loads it (appending the features).

    Returns:
        ``tokens_per_s`` (all generated tokens / summed cycle seconds, the measure of
        :meth:`SpecDecodeReplayEnv.autoregressive_rate`), ``tokens``, ``seconds``, ``cycles``, ``mean_depth``,
        ``mean_accepted`` (τ per cycle), ``neural_share`` (a hybrid env's: drafted tokens its neural drafter drafted;
        0 otherwise) and ``per_prompt``: per prompt index the mean tokens and seconds.

    Raises:
        ValueError: a depth-feature scale mismatch, or ``repeats`` < 1.
    """
    check_depth_feature_scale(controller, env.max_depth, holder="the replay env", rebuild="it")
    if repeats < 1:
        raise ValueError(f"repeats must be ≥ 1, got {repeats}.")
    idx = env._usable if prompt_indices is None else list(prompt_indices)
    tokens = seconds = 0.0
    depths = taus = cycles = neural = 0
    per = {}
    for k in range(repeats):
        for i in idx:
            controller.reset()
            env.reset(seed=run_seed(seed, k, i), options={"prompt_index": i, "profile_index": profile_index})
            d, sec = env.decoder, 0.0
            while not d.finished:  # the backend's own cycle, as generate() runs it (CycleDriver.run_cycle)
                res = d.run_cycle(controller)
                sec += res.seconds
                depths += res.depth
                taus += res.num_accepted
                neural += res.neural_drafted
                cycles += 1
            tok = d.generated
            env._needs_reset, env._in_generation = True, False  # the env's episode ended with the generation
            tokens += tok
            seconds += sec
            row = per.setdefault(i, [0.0, 0.0])
            row[0] += tok / repeats
            row[1] += sec / repeats
    return {"tokens_per_s": tokens_per_second(tokens, seconds), "tokens": tokens, "seconds": seconds,
            "cycles": cycles, "mean_depth": depths / cycles if cycles else 0.0,
            "mean_accepted": taus / cycles if cycles else 0.0, "neural_share": neural / depths if depths else 0.0,
            "per_prompt": {i: {"tokens": v[0], "seconds": v[1]} for i, v in per.items()}}


def measure_steps_per_second(env: SpecDecodeReplayEnv, steps: int = 200_000, seed: int = 0) -> float:
    """Environment steps per second under uniformly random actions (reset time included): the replay's
    throughput on this core. A measurement, not a test."""
    rng = np.random.default_rng(seed)
    actions = rng.integers(0, 2, size=steps).tolist()
    env.reset(seed=seed)
    for i in env._usable:  # build every prompt's tables before timing
        env.decoder.static_observations(i)
    t0 = time.perf_counter()
    for a in actions:
        _, _, term, trunc, _ = env.step(a)
        if term or trunc:
            env.reset()
    return steps / (time.perf_counter() - t0)


__all__ = ["EPISODE_MODES", "REPLAY_ENV_ID", "SpecDecodeReplayEnv", "measure_steps_per_second", "replay_controller"]
