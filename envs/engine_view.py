"""The real-loop environment as an inference engine sees it: :class:`EngineViewWrapper`.

vLLM's draft-length policy protocol (``vllm/v1/spec_decode/draft_length_policy.py``) gives a
policy only the draft step and the draft's top-1 probabilities, and asks it nothing before the
second drafted token. A policy trained on this wrapper reads exactly that
(:data:`learn2draft.features.ENGINE_FEATURE_NAMES`), so that :class:`policies.vllm.LearnedDraftLengthPolicy`
can run it inside the engine.
"""

from __future__ import annotations

from typing import Any

import gymnasium as gym
import numpy as np
from gymnasium import spaces

from envs.spec_decode import CONTINUE, SpecDecodeEnv
from learn2draft.features import ENGINE_FEATURE_NAMES, ENGINE_MIN_DEPTH, build_engine_features


class EngineViewWrapper(gym.Wrapper):
    """Wrap :class:`envs.SpecDecodeEnv` so that observations are the engine-visible features and
    the decisions an engine never asks for are taken as it takes them.

    * Observation: float32 ``(len(ENGINE_FEATURE_NAMES),)`` from :func:`build_engine_features`
      (depth with the seed, top-1 draft probabilities of the tokens after the seed).
    * Before :data:`ENGINE_MIN_DEPTH` tokens are drafted the wrapper answers CONTINUE itself (vLLM
      always drafts the seed and the first token after it), in :meth:`reset` and, for whole-generation
      episodes, after each verification; rewards earned on forced steps are added to the returned
      step's reward.
    * Actions, rewards, termination and ``info``: as :class:`SpecDecodeEnv`.

    Args:
        env: a :class:`SpecDecodeEnv` (or a wrapper around one).
    """

    def __init__(self, env: gym.Env):
        super().__init__(env)
        if not isinstance(env.unwrapped, SpecDecodeEnv):
            raise TypeError(f"EngineViewWrapper wraps a SpecDecodeEnv, got {type(env.unwrapped).__name__}.")
        self.observation_space = spaces.Box(0.0, 1.0, shape=(len(ENGINE_FEATURE_NAMES),), dtype=np.float32)

    def _obs(self) -> np.ndarray:
        d = self.env.unwrapped.decoder
        return build_engine_features(d.depth, max(d.max_depth, 1), d.confidences[1:])

    def _skip_forced(self, reward: float = 0.0) -> tuple[np.ndarray, float, bool, bool, dict]:
        """CONTINUE while the engine would not ask (depth < ENGINE_MIN_DEPTH and a draft is possible)."""
        d = self.env.unwrapped.decoder
        terminated = truncated = False
        info: dict[str, Any] = {}
        while d.depth < ENGINE_MIN_DEPTH and d.can_draft():
            _, r, terminated, truncated, info = self.env.step(CONTINUE)
            reward += r
            if terminated or truncated:
                break
        return self._obs(), reward, terminated, truncated, info

    def reset(self, **kwargs) -> tuple[np.ndarray, dict]:
        """Reset the wrapped env, then take the forced CONTINUEs so that the first observation is
        the engine's first question. A cycle that ends during them (no proposal after the seed, or
        the generation ends) asked nothing: the wrapped env is reset again (up to 1,000 times)."""
        for _ in range(1000):
            _, info = self.env.reset(**kwargs)
            obs, _, terminated, truncated, _ = self._skip_forced()
            if not (terminated or truncated):
                return obs, info
            kwargs.pop("seed", None)  # seed once; later resets continue the seeded stream
            kwargs.pop("options", None)
        raise RuntimeError("1,000 cycles in a row ended before a second draft token: this drafter rarely proposes "
                           "two tokens, so an engine would never consult a draft-length policy.")

    def step(self, action) -> tuple[np.ndarray, float, bool, bool, dict]:
        _, reward, terminated, truncated, info = self.env.step(action)
        if not (terminated or truncated):  # generation episodes: the next cycle's forced steps
            obs, reward, terminated, truncated, info2 = self._skip_forced(reward)
            return obs, reward, terminated, truncated, {**info, **info2}
        return self._obs(), reward, terminated, truncated, info

__all__ = ["EngineViewWrapper"]
