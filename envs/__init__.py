"""Gymnasium environments around the learn2draft engine.

``learn2draft/SpecDecode-v0`` (:class:`envs.spec_decode.SpecDecodeEnv`) is registered on import;
``gymnasium.make("learn2draft/SpecDecode-v0", pair=..., prompts=...)`` builds it. It is marked
``nondeterministic`` because its rewards are wall-clock measurements.
"""

from gymnasium.envs.registration import register, registry

from envs.spec_decode import ACTION_MEANINGS, CONTINUE, EPISODE_MODES, STOP, SpecDecodeEnv

ENV_ID = "learn2draft/SpecDecode-v0"

if ENV_ID not in registry:
    register(id=ENV_ID, entry_point="envs.spec_decode:SpecDecodeEnv", nondeterministic=True)

__all__ = ["ACTION_MEANINGS", "CONTINUE", "ENV_ID", "EPISODE_MODES", "STOP", "SpecDecodeEnv"]
