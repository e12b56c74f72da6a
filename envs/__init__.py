"""Gymnasium environments around the learn2draft engine.

``learn2draft/SpecDecode-v0`` (:class:`envs.spec_decode.SpecDecodeEnv`) is registered on import;
``gymnasium.make("learn2draft/SpecDecode-v0", pair=..., prompts=...)`` builds it. It is marked
``nondeterministic`` because its rewards are wall-clock measurements.

``learn2draft/SpecDecodeReplay-v0`` (:class:`envs.replay.SpecDecodeReplayEnv`) has the same spaces and
rewards, replayed from recorded traces and a latency profile without running a model:
``gymnasium.make("learn2draft/SpecDecodeReplay-v0", traces="traces.npz", profile="cpu-2core")``.
"""

from gymnasium.envs.registration import register, registry

from envs.replay import REPLAY_ENV_ID, SpecDecodeReplayEnv
from envs.spec_decode import ACTION_MEANINGS, CONTINUE, EPISODE_MODES, STOP, SpecDecodeEnv

ENV_ID = "learn2draft/SpecDecode-v0"

if ENV_ID not in registry:
    register(id=ENV_ID, entry_point="envs.spec_decode:SpecDecodeEnv", nondeterministic=True)
if REPLAY_ENV_ID not in registry:
    register(id=REPLAY_ENV_ID, entry_point="envs.replay:SpecDecodeReplayEnv")

__all__ = ["ACTION_MEANINGS", "CONTINUE", "ENV_ID", "EPISODE_MODES", "REPLAY_ENV_ID", "STOP", "SpecDecodeEnv",
           "SpecDecodeReplayEnv"]
