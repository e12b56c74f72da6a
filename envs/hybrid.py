"""The hybrid-drafter environment replayed from two traces and a latency profile — no model runs.

:class:`HybridReplayEnv` (registered as ``learn2draft/HybridReplay-v0``) trains the policy of a hybrid drafter
(:class:`learn2draft.drafters.hybrid.HybridDrafter`): before each draft token it chooses ``0`` STOP (verify now),
``1`` CONTINUE with prompt lookup, ``2`` CONTINUE with the neural drafter (the draft model or the head) —
:data:`learn2draft.control.HYBRID_ACTION_MEANINGS`, what the real decoder executes. Lookup without a proposal falls
back to the neural drafter, as on the real loop.

It is the one depth environment (:class:`envs.spec_decode.DepthEnv`: the step, reward, info and termination of
:class:`envs.spec_decode.SpecDecodeEnv` and :class:`envs.replay.SpecDecodeReplayEnv`) over the hybrid replay backend,
:class:`learn2draft.replay.backend.HybridReplayDecoder` (the real decoder's API; outcomes and costs from
:func:`learn2draft.replay.hybrid.hybrid_replay`, temperature 0: exact for lookup + model, an approximation for the head
after lookup tokens, see there); the reward at a verifying step is :func:`envs.reward.cycle_reward` of the cycle's
tokens/s, 0 at drafting steps. A verifying step's info also has ``neural_drafted`` (the cycle's tokens the neural
drafter drafted) and ``approximate`` (its outcome used the head approximation).

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

import numpy as np
from gymnasium import spaces

from envs.replay import replay_controller
from envs.reward import check_reward_scale
from envs.spec_decode import EPISODE_MODES, DepthEnv
from learn2draft.control import HYBRID_ACTION_MEANINGS
from learn2draft.features import FEATURE_NAMES, HYBRID_FEATURE_NAMES
from learn2draft.metrics import CycleResult
from learn2draft.replay.backend import HybridReplayDecoder
from learn2draft.replay.hybrid import HybridReplay, split_hybrid_traces
from learn2draft.replay.latency import LatencyProfile
from learn2draft.state import DraftState

HYBRID_REPLAY_ENV_ID = "learn2draft/HybridReplay-v0"


class HybridReplayEnv(DepthEnv):
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

    def __init__(self, traces, profile: LatencyProfile | str | Path, max_new_tokens: int | None = None,
                 max_depth: int | None = None, reward_scale: float = 1.0, prompt_indices: Sequence[int] | None = None,
                 episode: str = "cycle"):
        super().__init__()
        #: the backend: the hybrid replay decoder (the two trace sets, the profile, the outcome model)
        self.decoder = d = HybridReplayDecoder(traces, profile, max_new_tokens=max_new_tokens, max_depth=max_depth)
        self.lookup_traces, self.neural_traces = d.lookup_traces, d.neural_traces
        self.traces = self.lookup_traces  # the trace set whose header describes the run (train reads it)
        self.neural = d.neural
        self.drafter = f"lookup+{self.neural}"
        self.profile = d.profile
        self.profiles = [self.profile]  # as SpecDecodeReplayEnv's (one profile)
        self.profile_features = False
        self.max_depth, self.max_new_tokens = d.max_depth, d.max_new_tokens
        self.reward_scale = check_reward_scale(reward_scale)
        self.vocab_size = d.vocab_size
        n_prompts = len(self.lookup_traces)
        self.prompt_indices = list(range(n_prompts)) if prompt_indices is None else [int(i) for i in prompt_indices]
        if not self.prompt_indices or not all(0 <= i < n_prompts for i in self.prompt_indices):
            raise ValueError(f"prompt_indices must be a non-empty list of indices in [0, {n_prompts}).")
        self._usable = d.usable(self.prompt_indices)
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
        if episode not in EPISODE_MODES:
            raise ValueError(f"episode must be one of {EPISODE_MODES}, got {episode!r}.")
        self.episode = episode
        self.prompt_index: int | None = None
        self.last_cycle = None
        self._needs_reset = True
        self._in_generation = False

    def replay_data(self, index: int) -> HybridReplay:
        """The :class:`HybridReplay` of prompt ``index`` (built on first use; the backend's)."""
        return self.decoder.replay_data(index)

    @property
    def _r(self) -> HybridReplay:
        """The current generation's replay."""
        return self.decoder.replay

    # ------------------------------------------------------------------ rates
    def autoregressive_rate(self, profile_index: int = 0) -> float:
        """tokens/s of plain decoding over the replayed prompts (the reward scale ``python -m train`` uses; one
        profile: ``profile_index`` must be 0)."""
        return self.decoder.autoregressive_rate(indices=self._usable)

    def oracle_rate(self) -> float:
        """tokens/s of the hindsight oracle (:func:`learn2draft.replay.hybrid.hybrid_oracle_seconds`) over the prompts."""
        return self.decoder.oracle_rate(indices=self._usable)

    # ------------------------------------------------------------------ the env's hooks
    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None) -> tuple[np.ndarray, dict]:
        """Start a generation: a prompt drawn uniformly from the usable ones, or ``options={"prompt_index": i}``
        (in ``episode="cycle"`` mode, without them, the next cycle of the same generation).

        Raises:
            ValueError: a ``prompt_index`` that is not replayed or ends at its first token.
        """
        return super().reset(seed=seed, options=options)

    def _start_generation(self, options: dict[str, Any]) -> None:
        idx = options.get("prompt_index")
        if idx is None:
            idx = self._usable[int(self.np_random.integers(len(self._usable)))]
        elif int(idx) not in self._usable:
            raise ValueError(f"prompt_index must be one of the replayed prompts whose generation is longer than one "
                             f"token ({self._usable[:10]}…), got {idx!r}.")
        self.prompt_index = int(idx)
        self.decoder.start(self.prompt_index)

    def _ended_by_eos(self, res: CycleResult) -> bool:
        return self.decoder.ended_by_eos

    def _cycle_info(self, res: CycleResult) -> dict[str, Any]:
        return {"neural_drafted": res.neural_drafted, "approximate": self.decoder.last_approximate}

    @property
    def depth(self) -> int:
        """Tokens drafted in the current cycle."""
        return self.decoder.depth

    def can_draft(self) -> bool:
        """Whether one more token may be drafted (the neural drafter always has a proposal)."""
        return self.decoder.can_draft()

    def state(self, observation: np.ndarray | None = None) -> DraftState:
        """The :class:`learn2draft.state.DraftState` of the current decision (the backend's,
        :meth:`learn2draft.replay.backend.HybridReplayDecoder.state`).

        Args:
            observation: the current observation when the caller holds it (what :meth:`reset` or :meth:`step`
                returned), float32 (len(FEATURE_NAMES) + len(HYBRID_FEATURE_NAMES),); None: built again.
        """
        return self.decoder.state(observation)

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
