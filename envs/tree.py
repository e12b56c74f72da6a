"""Gymnasium environments for draft *trees* (:class:`learn2draft.tree.TreeSpeculativeDecoder`), the two
decisions of Learning to Draft (arXiv 2603.01639): how deep to draft, and how many tree nodes to verify.

* :class:`TreeDepthEnv` (``learn2draft/TreeDepth-v0``): the depth decision. Same observation and action
  spaces, rewards, episodes and info as :class:`envs.SpecDecodeEnv` (it *is* one, with a tree decoder):
  before each tree level the agent says CONTINUE (expand the ``width`` best deepest nodes with their
  top-``top_k`` children) or STOP. The verification size V comes from a given size controller (a fixed
  V, a :class:`learn2draft.tree.FixedTreeController`-like controller, a trained size policy, or a callable
  ``size_features -> V``), decided when drafting stops exactly as
  :meth:`TreeSpeculativeDecoder.run_cycle` decides it (its time charged to the cycle).
* :class:`TreeSizeEnv` (``learn2draft/TreeSize-v0``): the size decision. One episode = one cycle:
  :meth:`~TreeSizeEnv.reset` drafts the tree to a depth chosen by a depth controller (uniformly random
  in [1, ``max_depth``] by default, as in LTD's first phase), the observation is
  :meth:`TreeSpeculativeDecoder.size_features` (float32, :data:`learn2draft.features.SIZE_FEATURE_NAMES`),
  the action indexes ``verify_sizes`` (default (1, 2, 4, 8, 16, 32, 48, 64)), and :meth:`~TreeSizeEnv.step`
  verifies and ends the episode. The generation continues across episodes as in
  :class:`envs.SpecDecodeEnv`'s ``episode="cycle"``.

**An action beyond the tree**: when ``verify_sizes[a]`` exceeds the N drafted nodes, every drafted node is
verified (V is capped at N, as :meth:`TreeSpeculativeDecoder.verify` and
:func:`learn2draft.tree.select_top_nodes` cap it), with no penalty: those actions then do the same thing,
and the observation holds N (``tree_nodes``) so a policy can tell. ``info["verify_size"]`` is the V
verified and ``info["requested_size"]`` the V of the action. :class:`policies.tree.TreePolicyController`
applies the same cap at deployment.

Reward (both): the cycle's emitted tokens over its wall-clock seconds / ``reward_scale``
(:attr:`learn2draft.metrics.CycleResult.tokens_per_second`), paid at the verifying step, exactly as
:class:`envs.SpecDecodeEnv`. In :class:`TreeSizeEnv` the cycle's seconds include the drafting done in
:meth:`~TreeSizeEnv.reset` (the decoder times its own calls, so nothing the caller does between calls
counts). Wall-clock rewards are not reproducible: both are registered ``nondeterministic``.

Both environments need a drafter that drafts trees (``"model"`` or ``"head"``); prompt lookup does not.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import gymnasium as gym
import numpy as np
import torch
from gymnasium import spaces

from envs.reward import check_reward_scale, cycle_reward
from envs.spec_decode import SpecDecodeEnv
from learn2draft.control import DraftController, FixedDepthController, size_decider
from learn2draft.drafters import Drafter
from learn2draft.features import SIZE_FEATURE_NAMES
from learn2draft.models import ModelPair
from learn2draft.names import DEFAULT_MAX_DEPTH, DEFAULT_VERIFY_SIZES, check_verify_sizes  # noqa: F401 (re-exported)
from learn2draft.sampling import SamplingConfig
from learn2draft.tree import TreeSpeculativeDecoder

TREE_DEPTH_ENV_ID = "learn2draft/TreeDepth-v0"
TREE_SIZE_ENV_ID = "learn2draft/TreeSize-v0"


def _tree_decoder(pair: ModelPair, sampling: SamplingConfig, max_new_tokens: int, max_depth: int, drafter,
                  width: int, top_k: int) -> TreeSpeculativeDecoder:
    if isinstance(drafter, str):
        from learn2draft.drafters import make_drafter

        drafter = make_drafter(drafter, pair)
    return TreeSpeculativeDecoder(pair, sampling, max_new_tokens=max_new_tokens, max_depth=max_depth,
                                  drafter=drafter, width=width, top_k=top_k)


class TreeDepthEnv(SpecDecodeEnv):
    """Tree-depth control: :class:`envs.SpecDecodeEnv` on a :class:`TreeSpeculativeDecoder`.

    CONTINUE (1) drafts one more tree level, STOP (0) verifies the top-V nodes, V from ``size``.
    Observation (float32 ``(len(FEATURE_NAMES),)``, the decoder's :meth:`features`; the confidences are
    the best frontier node's), action ``Discrete(2)``, rewards, episodes and info as
    :class:`envs.SpecDecodeEnv`; a verifying step's info also has ``verify_size`` (the V verified).

    Args:
        size: the verification size: an int V, a size-deciding :class:`DraftController`, a callable
            ``size_features -> V`` (see :func:`size_decider`), or None (every drafted node). Settable
            later through :meth:`set_size`.
        width: W, frontier nodes expanded per level (≥ 1). top_k: children per expanded node (≥ 1).
        The other arguments: as :class:`envs.SpecDecodeEnv` (``drafter``: ``"model"`` or ``"head"``).

    Raises:
        ValueError: as :class:`envs.SpecDecodeEnv`, a bad ``size``, ``width`` or ``top_k``, or a drafter
            that drafts no trees (lookup).
    """

    def __init__(
        self,
        pair: ModelPair | None = None,
        prompts: Sequence[str | Sequence[int]] | None = None,
        sampling: SamplingConfig | None = None,
        max_new_tokens: int = 64,
        max_depth: int = DEFAULT_MAX_DEPTH,
        reward_scale: float = 1.0,
        episode: str = "cycle",
        chat: bool = True,
        drafter: Drafter | str = "model",
        size: int | DraftController | Callable | None = 16,
        width: int = 4,
        top_k: int = 4,
        **kwargs,
    ):
        super().__init__(pair, prompts, sampling, max_new_tokens=max_new_tokens, max_depth=max_depth,
                         reward_scale=reward_scale, episode=episode, chat=chat, drafter=drafter, **kwargs)
        self.decoder = _tree_decoder(self.pair, self.sampling, max_new_tokens, max_depth, self.drafter, width, top_k)
        self.width, self.top_k = width, top_k
        self.set_size(size)

    def set_size(self, size: int | DraftController | Callable | None) -> None:
        """Change the size controller (e.g. to the size policy trained in the previous phase); the
        decoder's step asks it when it verifies (:meth:`SpeculativeDecoder.decide_size`)."""
        self.size_decider = size_decider(size)

    def step(self, action) -> tuple[np.ndarray, float, bool, bool, dict]:
        obs, reward, terminated, truncated, info = super().step(action)
        if info["verified"]:
            info["verify_size"] = self.last_cycle.verify_size
        return obs, reward, terminated, truncated, info


class TreeSizeEnv(gym.Env):
    """Verification-size control on the real tree loop: one episode = one cycle.

    :meth:`reset` continues the generation (starting one, with a prompt drawn by ``self.np_random``,
    when none is running or ``seed`` is given) and drafts a tree: before each level the depth
    controller says CONTINUE or STOP (on the decoder's :meth:`features`, its decision time charged to
    the cycle; the first level is always drafted, since a size decision needs a tree: a depth policy
    that would STOP at depth 0 — a plain target step, no size decision — is asked from depth 1 on), or,
    without one, a target depth drawn uniformly from [1, ``max_depth``] with ``self.np_random`` is drafted
    (capped by the tokens left). A cycle whose tree has no node (one token
    left, or no proposal) offers no decision: it is verified there and the next cycle is drafted.

    Observation: float32 ``(len(SIZE_FEATURE_NAMES),)`` in [0, 1], :meth:`TreeSpeculativeDecoder.size_features`.
    Action: ``Discrete(len(verify_sizes))``; action a verifies the top ``min(verify_sizes[a], N)`` nodes.
    Step: verifies, pays the scaled tokens/s of the cycle, ``terminated=True``; info as
    :class:`envs.SpecDecodeEnv`'s verifying step plus ``verify_size``, ``requested_size``, ``tree_nodes``.

    Args:
        depth: the depth controller: None (random depths), an int (that many levels), or a
            :class:`DraftController` (e.g. a trained depth policy); settable through :meth:`set_depth`.
        verify_sizes: the V set, strictly increasing integers ≥ 1.
        width, top_k: the tree shape (≥ 1).
        pair, prompts, sampling, max_new_tokens, max_depth, reward_scale, chat, drafter: as :class:`envs.SpecDecodeEnv`.

    Raises:
        ValueError: empty or bad ``verify_sizes``, bad ``depth``, ``max_depth`` < 1, and the errors of
            :class:`envs.SpecDecodeEnv` and :class:`TreeSpeculativeDecoder` (e.g. a lookup drafter).
    """

    metadata = {"render_modes": []}

    def __init__(
        self,
        pair: ModelPair | None = None,
        prompts: Sequence[str | Sequence[int]] | None = None,
        sampling: SamplingConfig | None = None,
        max_new_tokens: int = 64,
        max_depth: int = DEFAULT_MAX_DEPTH,
        reward_scale: float = 1.0,
        chat: bool = True,
        drafter: Drafter | str = "model",
        depth: int | DraftController | None = None,
        verify_sizes: Sequence[int] = DEFAULT_VERIFY_SIZES,
        width: int = 4,
        top_k: int = 4,
        **kwargs,
    ):
        super().__init__()
        self.verify_sizes = check_verify_sizes(verify_sizes)
        if isinstance(max_depth, bool) or not isinstance(max_depth, int) or max_depth < 1:
            raise ValueError(f"max_depth must be an integer ≥ 1 (a size decision needs a drafted tree), "
                             f"got {max_depth!r}.")
        # The chain env does the prompt handling, drafter building and validation; its decoder is replaced.
        self._base = SpecDecodeEnv(pair, prompts, sampling, max_new_tokens=max_new_tokens, max_depth=max_depth,
                                   reward_scale=reward_scale, episode="cycle", chat=chat, drafter=drafter, **kwargs)
        self.pair, self.sampling, self.drafter = self._base.pair, self._base.sampling, self._base.drafter
        self.prompt_ids = self._base.prompt_ids
        self.decoder = _tree_decoder(self.pair, self.sampling, max_new_tokens, max_depth, self.drafter, width, top_k)
        self._base.decoder = self.decoder
        self.max_new_tokens, self.max_depth, self.width, self.top_k = max_new_tokens, max_depth, width, top_k
        self.reward_scale = float(reward_scale)
        self.set_depth(depth)
        self.observation_space = spaces.Box(0.0, 1.0, shape=(len(SIZE_FEATURE_NAMES),), dtype=np.float32)
        self.action_space = spaces.Discrete(len(self.verify_sizes))
        self.prompt_index: int | None = None
        self._needs_reset = True

    @property
    def reward_scale(self) -> float:
        return self._reward_scale

    @reward_scale.setter
    def reward_scale(self, value: float) -> None:
        self._reward_scale = check_reward_scale(value)

    def set_depth(self, depth: int | DraftController | None) -> None:
        """Change the depth controller (None: random depths; an int: fixed; a :class:`DraftController`).

        Raises:
            ValueError: an int outside [1, ``max_depth``] or another type.
        """
        if isinstance(depth, (int, np.integer)) and not isinstance(depth, bool):
            if not 1 <= depth <= self.max_depth:
                raise ValueError(f"A fixed tree depth must be in [1, max_depth={self.max_depth}], got {depth}.")
        elif depth is not None and not isinstance(depth, DraftController):
            raise ValueError(f"depth must be None (random depths), an int or a DraftController, got {depth!r}.")
        self.depth_controller = depth

    def encode(self, prompt) -> torch.Tensor:
        """Token ids int64 ``(L,)`` of a prompt (see :meth:`envs.SpecDecodeEnv.encode`)."""
        return self._base.encode(prompt)

    def _draft_tree(self) -> None:
        """The drafting half of the cycle (:meth:`SpeculativeDecoder.draft`): a random or fixed number of
        levels, or the depth controller's decisions after the first level (a size decision needs a tree)."""
        ctrl = self.depth_controller
        if ctrl is None or isinstance(ctrl, (int, np.integer)):
            levels = int(self.np_random.integers(1, self.max_depth + 1)) if ctrl is None else int(ctrl)
            ctrl = FixedDepthController(levels)
        self.decoder.draft(ctrl, min_depth=1)

    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None) -> tuple[np.ndarray, dict]:
        """Continue (or start) the generation and draft the next cycle's tree.

        Args:
            seed: seeds ``self.np_random`` (prompts, depths, the decoder's sampling seed) and starts a
                new generation.
            options: ``{"prompt_index": i}`` or ``{"new_generation": True}`` start a new generation.

        Returns:
            ``(observation, info)``; info: ``prompt_index``, ``generated``, ``new_generation``, ``depth``,
            ``tree_nodes``, ``skipped_cycles`` (cycles verified here because their tree had no node).

        Raises:
            ValueError: ``prompt_index`` out of range, or a prompt that ends at its first token.
            RuntimeError: 1,000 cycles in a row drafted no node.
        """
        super().reset(seed=seed)
        base = self._base
        base.np_random = self.np_random  # one RNG: a seeded reset reproduces prompts, depths and sampling seeds
        new_generation = seed is not None or bool(options) or not base._in_generation
        if new_generation:
            base.reset(options={"new_generation": True, **(options or {})})
        self.prompt_index = base.prompt_index
        d = self.decoder
        skipped = 0
        for _ in range(1000):
            self._draft_tree()
            if d.tree is not None and d.tree.num_nodes > 0:
                break
            res = d.verify()  # nothing to choose: a plain target step
            skipped += 1
            if res.finished:
                base.reset(options={"new_generation": True})
                self.prompt_index = base.prompt_index
                new_generation = True
        else:
            raise RuntimeError("1,000 cycles in a row drafted no tree node: the drafter proposes nothing.")
        self._needs_reset = False
        info = {"prompt_index": self.prompt_index, "generated": d.generated, "new_generation": new_generation,
                "depth": d.depth, "tree_nodes": d.tree.num_nodes, "skipped_cycles": skipped}
        return d.size_features(), info

    def step(self, action) -> tuple[np.ndarray, float, bool, bool, dict]:
        """Verify the top ``min(verify_sizes[action], N)`` nodes; the episode ends.

        Raises:
            ValueError: ``action`` not in the action space.
            RuntimeError: called before :meth:`reset` or after the episode ended.
        """
        if not self.action_space.contains(action):
            raise ValueError(f"Invalid action {action!r}: valid actions are 0..{len(self.verify_sizes) - 1}, "
                             f"verifying V = {list(self.verify_sizes)} tree nodes.")
        if self._needs_reset:
            raise RuntimeError("The episode has ended (or never started): call reset() first.")
        d = self.decoder
        requested = self.verify_sizes[int(action)]
        nodes, depth = d.tree.num_nodes, d.depth
        size = min(requested, nodes)
        res = d.verify(size)
        self._base._in_generation = not res.finished
        self._needs_reset = True
        info = {
            "depth": depth, "verified": True, "prompt_index": self.prompt_index, "verify_size": size,
            "requested_size": requested, "tree_nodes": nodes, "tokens": len(res.tokens), "accepted": res.num_accepted,
            "seconds": res.seconds, "draft_seconds": res.draft_seconds, "verify_seconds": res.verify_seconds,
            "other_seconds": res.other_seconds, "tokens_per_second": res.tokens_per_second, "forced": False,
            "generation_finished": res.finished, "generated": d.generated,
        }
        return d.size_features(), cycle_reward(res.tokens_per_second, self.reward_scale), True, False, info

    def action_meanings(self) -> dict[int, str]:
        """``{a: "verify V = v"}`` for the V set."""
        return {i: f"verify V = {v}" for i, v in enumerate(self.verify_sizes)}


__all__ = ["DEFAULT_VERIFY_SIZES", "TREE_DEPTH_ENV_ID", "TREE_SIZE_ENV_ID", "TreeDepthEnv", "TreeSizeEnv",
           "check_verify_sizes", "size_decider"]
