"""The hybrid-drafter environment replayed from two traces and a latency profile — no model runs.

:class:`HybridReplayEnv` (registered as ``learn2draft/HybridReplay-v0``) trains the policy of a hybrid drafter
(:class:`learn2draft.drafters.hybrid.HybridDrafter`): before each draft token it chooses ``0`` STOP (verify now),
``1`` CONTINUE with prompt lookup, ``2`` CONTINUE with the neural drafter (the draft model or the head) —
:data:`learn2draft.control.HYBRID_ACTION_MEANINGS`, what the real decoder executes. Lookup without a proposal falls
back to the neural drafter, as on the real loop.

Outcomes and costs come from :func:`learn2draft.replay.hybrid.hybrid_replay` (temperature 0: exact for lookup +
model, an approximation for the head after lookup tokens, see there); the reward at a verifying step is
:func:`envs.reward.cycle_reward` of ``emitted / seconds``, 0 at drafting steps, as in
:class:`envs.replay.SpecDecodeReplayEnv`, whose episode semantics (a generation per episode) it shares.

Observation: float32 ``(len(FEATURE_NAMES) + len(HYBRID_FEATURE_NAMES),)``, the vector the real decoder builds for a
hybrid drafter (:meth:`learn2draft.decoding.SpeculativeDecoder.features`), assembled here from the traces with the
same builders: the drafted tokens' confidences and entropies from whichever source drafted them, the lookup's
match features and lookahead at the current position, the last token's source and the target's view of the last
committed token (zeros when the traces do not hold it).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import gymnasium as gym
import numpy as np
from gymnasium import spaces

from envs.replay import replay_controller
from envs.reward import check_reward_scale, cycle_reward
from learn2draft.cli import comma_items
from learn2draft.control import HYBRID_ACTION_MEANINGS, STOP
from learn2draft.features import FEATURE_NAMES, HYBRID_FEATURE_NAMES, build_features, build_hybrid_features
from learn2draft.replay.hybrid import HYBRID_T_POSITIVE_REFUSAL, HybridReplay, hybrid_oracle_seconds, hybrid_replay
from learn2draft.replay.latency import LatencyProfile, load_profiles
from learn2draft.replay.outcome import tokens_per_second
from learn2draft.replay.traces import TraceSet, load_traces
from learn2draft.state import DraftState

HYBRID_REPLAY_ENV_ID = "learn2draft/HybridReplay-v0"


def split_hybrid_traces(traces: Sequence[str | Path] | str) -> tuple[TraceSet, TraceSet]:
    """Load trace files and split them by drafter: the lookup traces and the neural (model or head) traces, each in the
    order given (several files of one drafter are concatenated, as :func:`learn2draft.replay.traces.load_traces` does).

    Raises:
        ValueError: not exactly one neural drafter besides lookup, a drafter missing, T > 0 traces, the two sets
            holding different prompts (the message names what to record), or an empty item between commas.
    """
    paths = (comma_items(traces, "trace files", "join the trace files with single commas, e.g. lookup.npz,model.npz")
             if isinstance(traces, str) else [p for p in map(str, traces) if p])
    groups: dict[str, list[str]] = {}
    for p in paths:
        groups.setdefault(load_traces(p).drafter, []).append(p)
    neural = sorted(set(groups) - {"lookup"})
    if "lookup" not in groups or len(neural) != 1:
        raise ValueError(f"A hybrid drafter replays from lookup traces and the traces of ONE neural drafter (model or "
                         f"head), got traces of {sorted(groups) or 'nothing'}: record both with python -m eval.record "
                         "--drafter lookup and --drafter model (or head) on the same prompts, then pass them joined "
                         "by commas.")
    look, neu = load_traces(groups["lookup"]), load_traces(groups[neural[0]])
    for ts in (look, neu):
        if not ts.deterministic:
            raise ValueError(HYBRID_T_POSITIVE_REFUSAL)
    for key in ("target", "dtype", "sampling", "max_new_tokens", "chat"):
        a, b = look.header.get(key), neu.header.get(key)
        if a is not None and b is not None and a != b:
            raise ValueError(f"The lookup traces and the {neural[0]} traces were recorded with different {key} ({a!r} vs "
                             f"{b!r}): record both with the same settings (python -m eval.record).")
    if len(look) != len(neu):
        raise ValueError(f"The lookup traces hold {len(look)} prompts and the {neural[0]} traces {len(neu)}: record both "
                         "on the same prompts in the same order.")
    return look, neu


class HybridReplayEnv(gym.Env):
    """Per-token source and depth control of a hybrid drafter, replayed.

    Args:
        traces: the lookup and neural trace files (a list, or paths joined by commas; see :func:`split_hybrid_traces`),
            or a ``(lookup TraceSet, neural TraceSet)`` pair.
        profile: a latency profile (object, file or shipped name) with costs for ``"lookup"`` and the neural drafter.
        max_new_tokens, max_depth: ≤ the traces' (None: theirs).
        reward_scale: rewards are ``tokens_per_second / reward_scale`` (> 0).
        prompt_indices: replay only these prompts (default all).
        episode: ``"cycle"`` (default: an episode ends at each verification and :meth:`reset` continues the
            generation, so with discount 1 a decision's return is its own cycle's scaled tokens/s, as ``python -m
            train`` trains) or ``"generation"`` (an episode is a whole generation; summing per-cycle rates then
            favours many short cycles, see :mod:`envs.spec_decode`).

    Raises:
        ValueError: bad traces (see :func:`split_hybrid_traces`), settings out of range, a profile without the costs.
    """

    metadata = {"render_modes": []}

    def __init__(self, traces, profile: LatencyProfile | str | Path, max_new_tokens: int | None = None,
                 max_depth: int | None = None, reward_scale: float = 1.0, prompt_indices: Sequence[int] | None = None,
                 episode: str = "cycle"):
        super().__init__()
        self.lookup_traces, self.neural_traces = traces if isinstance(traces, tuple) else split_hybrid_traces(traces)
        self.traces = self.lookup_traces  # the trace set whose header describes the run (train reads it)
        self.neural = self.neural_traces.drafter
        self.drafter = f"lookup+{self.neural}"
        self.profile = load_profiles(profile)[0]
        self.profiles = [self.profile]  # as SpecDecodeReplayEnv's (one profile)
        self.profile_features = False
        self.profile.cost("lookup")
        self.profile.cost(self.neural)
        rec_d = self.lookup_traces.max_depth  # a draft model needs depth-0 rows only; a short head chain is approximated
        rec_n = min(self.lookup_traces.max_new_tokens, self.neural_traces.max_new_tokens)
        self.max_depth = rec_d if max_depth is None else max_depth
        self.max_new_tokens = rec_n if max_new_tokens is None else max_new_tokens
        if not (isinstance(self.max_depth, int) and 1 <= self.max_depth <= rec_d):
            raise ValueError(f"max_depth must be an integer in [1, {rec_d}] (the traces' chains), got {max_depth!r}.")
        if not (isinstance(self.max_new_tokens, int) and 2 <= self.max_new_tokens <= rec_n):
            raise ValueError(f"max_new_tokens must be an integer in [2, {rec_n}], got {max_new_tokens!r}.")
        self.profile.verify(self.max_depth + 1, 0)
        self.reward_scale = check_reward_scale(reward_scale)
        self.vocab_size = int(self.lookup_traces.header["vocab_size"])
        n_prompts = len(self.lookup_traces)
        self.prompt_indices = list(range(n_prompts)) if prompt_indices is None else [int(i) for i in prompt_indices]
        if not self.prompt_indices or not all(0 <= i < n_prompts for i in self.prompt_indices):
            raise ValueError(f"prompt_indices must be a non-empty list of indices in [0, {n_prompts}).")
        self._replays: dict[int, HybridReplay] = {}
        self._usable = [i for i in self.prompt_indices if self.replay_data(i).n > 1]
        # What the replay covers: where the two recordings' greedy outputs part, a prompt is cut (see hybrid_replay)
        recorded = [min(self.lookup_traces.prompts[i].n, self.max_new_tokens) for i in self.prompt_indices]
        kept = [self.replay_data(i).n for i in self.prompt_indices]
        self.coverage = {"tokens_replayed": int(sum(kept)), "tokens_recorded": int(sum(recorded)),
                         "prompts_cut": int(sum(k < r for k, r in zip(kept, recorded))),
                         "prompts_dropped": len(self.prompt_indices) - len(self._usable),
                         "prompts": len(self.prompt_indices)}
        if not self._usable:
            raise ValueError("Every traced generation ends at its first token (EOS): no drafting decision to make.")
        width = len(FEATURE_NAMES) + len(HYBRID_FEATURE_NAMES)
        self.observation_space = spaces.Box(0.0, 1.0, shape=(width,), dtype=np.float32)
        self.action_space = spaces.Discrete(3)
        self.deterministic = True
        if episode not in ("cycle", "generation"):
            raise ValueError(f"episode must be 'cycle' or 'generation', got {episode!r}.")
        self.episode = episode
        self._needs_reset = True
        self._in_generation = False

    def replay_data(self, index: int) -> HybridReplay:
        """The :class:`HybridReplay` of prompt ``index`` (built on first use)."""
        r = self._replays.get(index)
        if r is None:
            r = self._replays[index] = hybrid_replay(self.lookup_traces.prompts[index], self.neural_traces.prompts[index],
                                                     self.profile, self.neural, self.max_depth, self.max_new_tokens)
        return r

    # ------------------------------------------------------------------ rates
    def autoregressive_rate(self, profile_index: int = 0) -> float:
        """tokens/s of plain decoding over the replayed prompts (the reward scale ``python -m train`` uses; one
        profile: ``profile_index`` must be 0)."""
        tokens = seconds = 0.0
        for i in self._usable:
            r = self.replay_data(i)
            tokens += r.n
            seconds += sum(r.cycle_seconds(t, 0, False, 0.0) for t in range(1, r.n))
        return tokens_per_second(tokens, seconds)

    def oracle_rate(self) -> float:
        """tokens/s of the hindsight oracle (:func:`learn2draft.replay.hybrid.hybrid_oracle_seconds`) over the prompts."""
        tokens = seconds = 0.0
        for i in self._usable:
            r = self.replay_data(i)
            tokens += r.n
            seconds += hybrid_oracle_seconds(r)[0]
        return tokens_per_second(tokens, seconds)

    # ------------------------------------------------------------------ gymnasium API
    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None) -> tuple[np.ndarray, dict]:
        """Start a generation: a prompt drawn uniformly from the usable ones, or ``options={"prompt_index": i}``.

        Raises:
            ValueError: a ``prompt_index`` that is not replayed or ends at its first token.
        """
        super().reset(seed=seed)
        options = options or {}
        if (self.episode == "cycle" and self._in_generation and seed is None and "prompt_index" not in options
                and not options.get("new_generation")):  # the next cycle of the same generation
            self._needs_reset = False
            return self._obs(), {"prompt_index": self.prompt_index, "generated": self._t, "new_generation": False}
        idx = options.get("prompt_index")
        if idx is None:
            idx = self._usable[int(self.np_random.integers(len(self._usable)))]
        elif int(idx) not in self._usable:
            raise ValueError(f"prompt_index must be one of the replayed prompts whose generation is longer than one "
                             f"token ({self._usable[:10]}…), got {idx!r}.")
        self.prompt_index = int(idx)
        self._r = self.replay_data(self.prompt_index)
        self._t = 1
        self._history: list[int] = []
        self._laf = 1.0
        self._new_cycle()
        self._needs_reset = False
        self._in_generation = True
        return self._obs(), {"prompt_index": self.prompt_index, "generated": self._t, "new_generation": True}

    def _new_cycle(self) -> None:
        self._j, self._run, self._ok = 0, 0, True
        self._confs: list[float] = []
        self._ents: list[float] = []
        self._sources: list[int] = []
        self._since, self._draft_s, self._used = 0, 0.0, False
        self._approx = False

    @property
    def depth(self) -> int:
        """Tokens drafted in the current cycle."""
        return self._j

    def can_draft(self) -> bool:
        """Whether one more token may be drafted (the neural drafter always has a proposal)."""
        return self._j < self._r.limit[self._t]

    def state(self, observation: np.ndarray | None = None) -> DraftState:
        """The :class:`learn2draft.state.DraftState` of the current decision (as the hybrid decoder's
        :meth:`SpeculativeDecoder.state` for the same position): the integer depth, this cycle's confidences and
        entropies, the lookup's drafter features, the hybrid features as ``extra_features`` and the observation
        (its ``features()``).

        Args:
            observation: the current observation when the caller holds it (what :meth:`reset` or :meth:`step`
                returned), float32 (len(FEATURE_NAMES) + len(HYBRID_FEATURE_NAMES),); None: built again.
        """
        obs = self._obs() if observation is None else observation
        t = self._t
        return DraftState(
            depth=self._j, max_depth=self.max_depth,
            committed_len=self.lookup_traces.prompts[self.prompt_index].prompt_len + t, generated=t,
            max_new_tokens=self.max_new_tokens, accepted_history=tuple(self._history),
            last_accept_fraction=self._laf, confidences=tuple(self._confs), entropies=tuple(self._ents),
            vocab_size=self.vocab_size, drafter_features=self._r.look_feats[min(t + self._j, self._r.n)],
            extra_features=obs[len(FEATURE_NAMES):], observation=obs,
        )

    def _obs(self) -> np.ndarray:
        r, t, j = self._r, self._t, self._j
        pos = t + j
        D = self.max_depth
        base = build_features(
            context_len=self.lookup_traces.prompts[self.prompt_index].prompt_len + pos, depth=j, max_depth=D,
            accepted_history=self._history, confidences=self._confs, last_entropy=self._ents[-1] if self._ents else 0.0,
            vocab_size=self.vocab_size, last_accept_fraction=self._laf, generated=t, max_new_tokens=self.max_new_tokens,
            drafter_features=r.look_feats[min(pos, r.n)],
        )
        left = int(r.limit[t]) - j
        chain = r.look_chain[min(pos, r.n)]
        confs = [float(x) for x in chain[:max(left, 0)] if not np.isnan(x)] if r.look_avail[min(pos, r.n)] else []
        hyb = build_hybrid_features(confs, D, bool(self._sources) and self._sources[-1] == 1, r.target[t], self.vocab_size)
        return np.concatenate((base, hyb))

    def step(self, action) -> tuple[np.ndarray, float, bool, bool, dict]:
        """Apply STOP (0), CONTINUE with lookup (1) or with the neural drafter (2).

        Raises:
            ValueError: another action.
            RuntimeError: before :meth:`reset` or after the episode ended.
        """
        if not self.action_space.contains(action):
            raise ValueError(f"Invalid action {action!r}: valid actions are {HYBRID_ACTION_MEANINGS}.")
        action = int(action)
        if self._needs_reset:
            raise RuntimeError("The episode has ended (or never started): call reset() first.")
        r, t, j = self._r, self._t, self._j
        if action != STOP and self.can_draft():
            src, ok = r.token(t, j, action - 1)
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
            if self.can_draft():
                return self._obs(), 0.0, False, False, {"depth": self._j, "verified": False, "generated": t,
                                                         "prompt_index": self.prompt_index}
        d = self._j
        tau = self._run
        emitted = min(tau + 1, r.n - t)
        tau = min(tau, emitted)
        seconds = r.cycle_seconds(t, d, self._used, self._draft_s)
        info = {"depth": d, "verified": True, "tokens": emitted, "accepted": tau, "seconds": seconds,
                "draft_seconds": self._draft_s, "verify_seconds": float(r.verify[t, d]),
                "neural_drafted": sum(self._sources), "approximate": self._approx, "prompt_index": self.prompt_index}
        self._history.append(tau)
        self._laf = tau / d if d else 1.0
        self._t = t + emitted
        finished = self._t >= r.n
        info.update(generated=self._t, generation_finished=finished, tokens_per_second=emitted / seconds)
        self._new_cycle()
        self._in_generation = not finished
        if self.episode == "cycle":
            terminated, truncated = True, False
        else:
            terminated, truncated = finished and r.eos, finished and not r.eos
        self._needs_reset = terminated or truncated
        reward = cycle_reward(emitted / seconds, self.reward_scale)
        obs = self._obs() if not finished else np.zeros(self.observation_space.shape, np.float32)
        return obs, reward, terminated, truncated, info

    def action_meanings(self) -> dict[int, str]:
        """:data:`learn2draft.control.HYBRID_ACTION_MEANINGS`."""
        return dict(HYBRID_ACTION_MEANINGS)


def replay_hybrid_controller(env: HybridReplayEnv, controller, prompt_indices: Sequence[int] | None = None,
                             seed: int = 0) -> dict:
    """Score a hybrid controller (a rule, a fixed γ — lookup-first per token —, a trained policy) in replay:
    :func:`envs.replay.replay_controller` on a :class:`HybridReplayEnv` (its ``neural_share`` says how many drafted
    tokens the neural drafter drafted).

    Raises:
        ValueError: a controller reading the depth features on another ``max_depth``.
    """
    return replay_controller(env, controller, prompt_indices, seed=seed)


__all__ = ["HYBRID_REPLAY_ENV_ID", "HybridReplayEnv", "replay_hybrid_controller", "split_hybrid_traces"]
