"""Gymnasium environments around the learn2draft engine.

``learn2draft/SpecDecode-v0`` (:class:`envs.spec_decode.SpecDecodeEnv`) is registered on import;
``gymnasium.make("learn2draft/SpecDecode-v0", pair=..., prompts=...)`` builds it. It is marked
``nondeterministic`` because its rewards are wall-clock measurements.

``learn2draft/SpecDecodeReplay-v0`` (:class:`envs.replay.SpecDecodeReplayEnv`) has the same spaces and
rewards, replayed from recorded traces and a latency profile without running a model:
``gymnasium.make("learn2draft/SpecDecodeReplay-v0", traces="traces.npz", profile="cpu-2core")``.

Draft trees (:mod:`envs.tree`): ``learn2draft/TreeDepth-v0`` (:class:`envs.tree.TreeDepthEnv`, the depth
decision, SpecDecodeEnv's spaces) and ``learn2draft/TreeSize-v0`` (:class:`envs.tree.TreeSizeEnv`, the
verification-size decision, one cycle per episode).

Hybrid drafters (:mod:`envs.hybrid`): ``learn2draft/HybridReplay-v0`` (:class:`envs.hybrid.HybridReplayEnv`), the
per-token choice STOP / CONTINUE with lookup / CONTINUE with the neural drafter, replayed from a lookup trace and a
model or head trace.

Replay under load (:mod:`envs.serve`): ``learn2draft/ServeReplay-v0`` (:class:`envs.serve.ServeReplayEnv`), one γ per
batch step of a simulated request stream (fixed concurrency or Poisson arrivals) over chain traces and a batched
latency profile.
"""

from gymnasium.envs.registration import register, registry

from envs.hybrid import HYBRID_REPLAY_ENV_ID, HybridReplayEnv
from envs.replay import REPLAY_ENV_ID, SpecDecodeReplayEnv
from envs.serve import SERVE_ENV_ID, ServeReplayEnv
from envs.spec_decode import ACTION_MEANINGS, CONTINUE, EPISODE_MODES, STOP, SpecDecodeEnv
from envs.tree import TREE_DEPTH_ENV_ID, TREE_SIZE_ENV_ID, TreeDepthEnv, TreeSizeEnv

ENV_ID = "learn2draft/SpecDecode-v0"

if ENV_ID not in registry:
    register(id=ENV_ID, entry_point="envs.spec_decode:SpecDecodeEnv", nondeterministic=True)
if REPLAY_ENV_ID not in registry:
    register(id=REPLAY_ENV_ID, entry_point="envs.replay:SpecDecodeReplayEnv")
if HYBRID_REPLAY_ENV_ID not in registry:
    register(id=HYBRID_REPLAY_ENV_ID, entry_point="envs.hybrid:HybridReplayEnv")
if SERVE_ENV_ID not in registry:
    register(id=SERVE_ENV_ID, entry_point="envs.serve:ServeReplayEnv")
if TREE_DEPTH_ENV_ID not in registry:
    register(id=TREE_DEPTH_ENV_ID, entry_point="envs.tree:TreeDepthEnv", nondeterministic=True)
if TREE_SIZE_ENV_ID not in registry:
    register(id=TREE_SIZE_ENV_ID, entry_point="envs.tree:TreeSizeEnv", nondeterministic=True)

__all__ = ["ACTION_MEANINGS", "CONTINUE", "ENV_ID", "EPISODE_MODES", "HYBRID_REPLAY_ENV_ID", "HybridReplayEnv",
           "REPLAY_ENV_ID", "SERVE_ENV_ID", "STOP", "ServeReplayEnv", "SpecDecodeEnv",
           "SpecDecodeReplayEnv", "TREE_DEPTH_ENV_ID", "TREE_SIZE_ENV_ID", "TreeDepthEnv", "TreeSizeEnv"]
