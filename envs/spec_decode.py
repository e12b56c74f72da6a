"""The draft-depth environment over a decoder backend: the real draft/verify loop
(:class:`learn2draft.SpeculativeDecoder`, :class:`SpecDecodeEnv`) or the replay
(:class:`learn2draft.replay.backend.ReplayDecoder`, :class:`envs.replay.SpecDecodeReplayEnv`). :class:`DepthEnv`
holds the one step, reward and termination; the two differ only in how a generation starts and where a cycle's
numbers come from.

At every step the agent sees the features of the current cycle (:func:`learn2draft.features.build_features`,
known *before* the decision) and chooses

* ``0`` = STOP: verify the tokens drafted so far with one target forward (at depth 0 this is a
  plain autoregressive target step), or
* ``1`` = CONTINUE: draft one more token with the drafter.

Each step goes through :meth:`SpeculativeDecoder.step`, one decision of the decoder's one cycle
(the one :meth:`SpeculativeDecoder.run_cycle` runs at deployment: same drafting, size decision,
verification and timing). When
a CONTINUE reaches the cycle's depth limit (:attr:`SpeculativeDecoder.depth_limit`: ``max_depth``
capped by the tokens left) or the drafter has no further proposal (a prompt lookup without a
match), verification happens in that same step. When no token can be drafted at a decision (one
token left, ``max_depth=0``, no match), either action verifies.

Reward: the cycle's emitted tokens over its wall-clock seconds (:attr:`CycleResult.tokens_per_second`),
divided by ``reward_scale``, paid at the step that verifies; 0 at drafting steps. The seconds are
measured by the decoder around its own calls only (draft forwards, the verify forward, acceptance,
cache rollback, feature computation), so whatever the caller does between ``step`` calls (the
policy forward, PPO updates, logging) never enters a cycle's time. At deployment the policy's own
decision time *is* charged to the cycle by :meth:`SpeculativeDecoder.run_cycle`; here it is not.

Two episode structures (``episode=``):

* ``"generation"`` (default): one episode = one generation for a prompt drawn with ``self.np_random``.
  Ends ``terminated`` when EOS is emitted and ``truncated`` at ``max_new_tokens``. Note that an
  undiscounted return then *sums per-cycle rates*, which favours many short cycles over fast
  generation; use it with care (or a time-based objective) for training.
* ``"cycle"``: one episode = one draft/verify cycle, ``terminated`` at each verification; the next
  :meth:`reset` (without a seed) continues the same generation, and draws a new prompt only when
  the generation has ended. With discount 1 the return of every decision is then exactly the
  scaled tokens/s of its cycle — the per-cycle objective (the speed-up ``E/(cγ+1)`` of Leviathan et
  al. 2023 made state dependent). ``train`` uses this mode.

Wall-clock rewards are not reproducible, so the registered spec sets ``nondeterministic=True``;
observations and emitted tokens are reproducible for a given seed and action sequence.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import gymnasium as gym
import numpy as np
import torch
from gymnasium import spaces

from envs.reward import check_reward_scale, cycle_reward
from learn2draft.control import ACTION_MEANINGS, CONTINUE, STOP, SizeDecider
from learn2draft.decoding import SpeculativeDecoder
from learn2draft.drafters import Drafter
from learn2draft.features import FEATURE_NAMES
from learn2draft.metrics import CycleResult
from learn2draft.models import DEFAULT_DRAFT, DEFAULT_TARGET, ModelPair, load_pair, parse_dtype
from learn2draft.names import DEFAULT_MAX_DEPTH
from learn2draft.sampling import SamplingConfig

EPISODE_MODES = ("generation", "cycle")


class DepthEnv(gym.Env):
    """The one draft-depth environment over a backend with the decoder's API (:class:`learn2draft.control.CycleDriver`:
    ``step``, ``features``, ``depth``, ``generated``, ``clock``): :class:`SpecDecodeEnv` (the real decoder) and
    :class:`envs.replay.SpecDecodeReplayEnv` (the replay backend) build it; the step, its reward, info and
    termination are this class's (see :class:`SpecDecodeEnv` for what they are).

    A subclass sets ``decoder``, ``episode``, ``reward_scale``, ``action_space`` / ``observation_space``, and
    implements :meth:`_start_generation` (draw a prompt and start the backend on it); it may override
    :meth:`_observation` (append to the backend's features), :meth:`_reward`, :meth:`_ended_by_eos`,
    :meth:`_info_extra`, :meth:`_cycle_info` and :meth:`action_meanings` (with its ``action_space``: the hybrid
    replay's three actions, :class:`envs.hybrid.HybridReplayEnv`).
    """

    metadata = {"render_modes": []}
    #: A tree's verification-size decider, asked when a step verifies (:class:`envs.tree.TreeDepthEnv` sets it).
    size_decider: SizeDecider | None = None
    #: ``reset(options=...)`` keys that start a new generation in cycle mode.
    _NEW_GENERATION_OPTIONS = ("prompt_index",)

    # ------------------------------------------------------------------ hooks
    def _start_generation(self, options: dict[str, Any]) -> None:
        """Draw (or take from ``options``) a prompt, set ``prompt_index`` and start the backend on it."""
        raise NotImplementedError

    def _observation(self, features: np.ndarray) -> np.ndarray:
        """The observation from the backend's features (float32 (len(FEATURE_NAMES),))."""
        return features

    def _reward(self, res: CycleResult) -> float:
        """The verifying step's reward: :func:`envs.reward.cycle_reward` of the cycle's tokens/s."""
        return cycle_reward(res.tokens_per_second, self.reward_scale)

    def _ended_by_eos(self, res: CycleResult) -> bool:
        """Whether the cycle ``res`` ended the generation with EOS (else it ran to ``max_new_tokens``)."""
        raise NotImplementedError

    def _info_extra(self) -> dict[str, Any]:
        """Entries added to the reset's and every verifying step's info."""
        return {}

    def _cycle_info(self, res: CycleResult) -> dict[str, Any]:
        """Entries added to a verifying step's info about its cycle ``res``."""
        return {}

    # ------------------------------------------------------------------ gymnasium API
    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None) -> tuple[np.ndarray, dict]:
        """Start a generation (or, in ``episode="cycle"`` mode, continue the current one).

        Args:
            seed: seeds ``self.np_random`` (through ``super().reset``), which draws the prompt and the backend's
                sampling seed (real) or acceptance draws (replay at T > 0).
            options: ``{"prompt_index": i}`` forces prompt ``i``; ``{"new_generation": True}`` forces a new
                generation in cycle mode (and the subclass's own, e.g. the replay's ``profile_index``).

        Returns:
            ``(observation, info)``.

        Raises:
            ValueError: ``prompt_index`` out of range, or (see the subclass) a prompt without a decision to make.
        """
        super().reset(seed=seed)
        options = options or {}
        continuing = (self.episode == "cycle" and seed is None and not options.get("new_generation")
                      and not any(k in options for k in self._NEW_GENERATION_OPTIONS) and self._in_generation)
        if not continuing:
            self._start_generation(options)
            self._in_generation = True
        self._needs_reset = False
        info = {"prompt_index": self.prompt_index, "generated": self.decoder.generated,
                "new_generation": not continuing, **self._info_extra()}
        return self._observation(self.decoder.features()), info

    def step(self, action) -> tuple[np.ndarray, float, bool, bool, dict]:
        """Apply an action of ``action_space`` (STOP 0 or CONTINUE 1; a hybrid's CONTINUE with its neural drafter 2);
        see :class:`SpecDecodeEnv` for reward, termination and info.

        Raises:
            ValueError: an action outside ``action_space``.
            RuntimeError: called before :meth:`reset` or after the episode ended.
        """
        if type(action) is not int or not 0 <= action < self.action_space.n:  # the fast path: a Python int
            if not self.action_space.contains(action):
                raise ValueError(
                    f"Invalid action {action!r}: valid actions are "
                    + ", ".join(f"{a} = {m}" for a, m in self.action_meanings().items()) + "."
                )
            action = int(action)
        if self._needs_reset:
            raise RuntimeError("The episode has ended (or never started): call reset() first.")
        d = self.decoder
        res = d.step(action, self.size_decider)  # the one cycle's step (a hybrid's 2: CONTINUE with its neural drafter)
        if res is None:
            t0 = d.clock.now()
            obs = d.features()
            d.add_other_seconds(d.clock.now() - t0)  # as CycleDriver.decide charges the state to the cycle
            info = {"depth": d.depth, "verified": False, "prompt_index": self.prompt_index, "generated": d.generated}
            return self._observation(obs), 0.0, False, False, info
        self.last_cycle = res
        self._in_generation = not res.finished
        info: dict[str, Any] = {
            "depth": res.depth, "verified": True, "prompt_index": self.prompt_index,
            "tokens": len(res.tokens), "accepted": res.num_accepted, "seconds": res.seconds,
            "draft_seconds": res.draft_seconds, "verify_seconds": res.verify_seconds,
            "other_seconds": res.other_seconds, "tokens_per_second": res.tokens_per_second,
            "forced": action != STOP,  # a CONTINUE that verified: the depth limit or the drafter decided
            "generation_finished": res.finished, "generated": d.generated, **self._info_extra(),
            **self._cycle_info(res),
        }
        if self.episode == "cycle":
            terminated, truncated = True, False
        else:
            eos = res.finished and self._ended_by_eos(res)
            terminated, truncated = eos, res.finished and not eos
        self._needs_reset = terminated or truncated
        return self._observation(res.features.copy()), float(self._reward(res)), terminated, truncated, info

    def action_meanings(self) -> dict[int, str]:
        """``{0: "STOP (verify now)", 1: "CONTINUE (draft one more token)"}``."""
        return dict(ACTION_MEANINGS)


class SpecDecodeEnv(DepthEnv):
    """Draft-depth control as a gymnasium environment, on the real speculative decoder.

    Args:
        pair: the target/draft models; if None, loaded with :func:`learn2draft.load_pair` from
            ``target`` / ``draft`` / ``device`` / ``dtype``.
        prompts: the prompts episodes draw from: strings (tokenised once, through the chat template
            when the tokenizer has one and ``chat``) or token-id sequences (int, shape (L,)).
            Default: ``learn2draft.prompts.load_prompts("train")``.
        sampling: sampling settings for target and draft (greedy by default).
        max_new_tokens: tokens generated per prompt (> 0).
        max_depth: the most tokens drafted per cycle (≥ 0); also the scale of the depth features.
        reward_scale: rewards are ``tokens_per_second / reward_scale`` (> 0). Use e.g. the
            autoregressive tokens/s of the pair so that a reward of 1.0 means "as fast as plain
            decoding"; a fixed scale keeps exported policies free of normalisation state.
        episode: ``"generation"`` or ``"cycle"`` (see the module docstring).
        chat: apply the tokenizer's chat template to string prompts.
        drafter: a :class:`learn2draft.drafters.Drafter` or a name for
            :func:`learn2draft.drafters.make_drafter` (``"model"``, ``"head"``, ``"lookup"``).
        target, draft, device, dtype: used only when ``pair`` is None (``dtype``: a torch dtype or
            ``"float32" | "bfloat16" | "float16"``).

    Observation: float32 array of shape ``(len(FEATURE_NAMES),)`` in [0, 1] (``decoder.features()``).
    Action: ``Discrete(2)``, 0 = STOP, 1 = CONTINUE.
    Info (every step): ``depth`` (tokens drafted in the current cycle, before any verification),
    ``verified`` (bool), ``generated`` (tokens emitted so far in the generation), ``prompt_index``.
    At a verifying step additionally the :class:`CycleResult` numbers: ``tokens`` (count emitted),
    ``accepted`` (τ), ``seconds``, ``draft_seconds``, ``verify_seconds``, ``other_seconds``,
    ``tokens_per_second`` (unscaled), ``forced`` (the depth limit made the step verify) and
    ``generation_finished``.

    Raises:
        ValueError: empty prompt list, bad ``max_new_tokens`` / ``max_depth`` / ``reward_scale`` /
            ``episode``, or a prompt longer than the context window.
        learn2draft.ModelLoadError: ``pair`` is None and a model cannot be loaded.
    """

    def __init__(
        self,
        pair: ModelPair | None = None,
        prompts: Sequence[str | Sequence[int]] | None = None,
        sampling: SamplingConfig | None = None,
        max_new_tokens: int = 64,
        max_depth: int = DEFAULT_MAX_DEPTH,
        reward_scale: float = 1.0,
        episode: str = "generation",
        chat: bool = True,
        target: str = DEFAULT_TARGET,
        draft: str = DEFAULT_DRAFT,
        device: str = "cpu",
        dtype: str | torch.dtype = "float32",
        drafter: Drafter | str = "model",
    ):
        super().__init__()
        reward_scale = check_reward_scale(reward_scale)
        if episode not in EPISODE_MODES:
            raise ValueError(f"episode must be one of {EPISODE_MODES}, got {episode!r}.")
        if pair is None:
            draft = draft if drafter == "model" else None  # only the model drafter drafts with a draft model
            pair = load_pair(target, draft, device=device, dtype=parse_dtype(dtype) if isinstance(dtype, str) else dtype)
        if prompts is None:
            from learn2draft.prompts import load_prompts

            prompts = load_prompts("train")
        if len(prompts) == 0:
            raise ValueError("prompts is empty: pass at least one prompt.")
        self.pair = pair
        self.sampling = sampling or SamplingConfig()
        if isinstance(max_new_tokens, int) and max_new_tokens < 2:
            raise ValueError(f"max_new_tokens must be ≥ 2 (the prefill emits the first token), got {max_new_tokens}.")
        if isinstance(drafter, str):
            from learn2draft.drafters import make_drafter

            drafter = make_drafter(drafter, pair)
        self.drafter = drafter
        # SpeculativeDecoder validates max_new_tokens and max_depth.
        self.decoder = SpeculativeDecoder(
            pair, self.sampling, max_new_tokens=max_new_tokens, max_depth=max_depth, drafter=drafter
        )
        self.max_new_tokens = max_new_tokens
        self.max_depth = max_depth
        self.reward_scale = reward_scale
        self.episode = episode
        self.chat = chat
        self.prompt_ids = [pair.encode_prompt(p, chat=chat, max_new_tokens=max_new_tokens) for p in prompts]

        self.observation_space = spaces.Box(0.0, 1.0, shape=(len(FEATURE_NAMES),), dtype=np.float32)
        self.action_space = spaces.Discrete(2)
        self.prompt_index: int | None = None
        self.last_cycle: CycleResult | None = None  # the last verified cycle
        self._needs_reset = True
        self._in_generation = False  # a generation is started and not finished

    def encode(self, prompt: str | Sequence[int]) -> torch.Tensor:
        """Token ids int64 ``(L,)`` of a prompt given as text (chat template per ``chat``) or as ids.

        Raises:
            ValueError: empty prompt, or longer than the context window.
        """
        return self.pair.encode_prompt(prompt, chat=self.chat)

    # ------------------------------------------------------------------ the real backend
    def _start_generation(self, options: dict[str, Any]) -> None:
        """A prompt drawn with ``self.np_random`` (or ``options["prompt_index"]``) and the decoder started on it
        with a sampling seed drawn the same way; a prompt whose generation ends at its first token (EOS) has no
        decision and is drawn again.

        Raises:
            ValueError: ``prompt_index`` out of range, a forced prompt that ends at its first token, or every
                drawn prompt does.
        """
        d = self.decoder
        idx = options.get("prompt_index")
        if idx is None:
            idx = int(self.np_random.integers(len(self.prompt_ids)))
        elif not 0 <= int(idx) < len(self.prompt_ids):
            raise ValueError(f"prompt_index must be in [0, {len(self.prompt_ids)}), got {idx}.")
        for _ in range(100):  # the prefill emits the first token; a generation ended by it has no decision
            self.prompt_index = int(idx)
            d.start(self.prompt_ids[self.prompt_index], seed=int(self.np_random.integers(2**31 - 1)))
            if not d.finished:
                return
            if "prompt_index" in options:
                raise ValueError(f"Prompt {idx} ends at its first token (EOS): no drafting decision to make.")
            idx = int(self.np_random.integers(len(self.prompt_ids)))
        raise ValueError("Every drawn prompt ended at its first token (EOS): pass other prompts.")

    def _ended_by_eos(self, res: CycleResult) -> bool:
        return bool(res.tokens) and res.tokens[-1] in self.pair.eos_token_ids

    def generated_tokens(self) -> list[int]:
        """Token ids emitted so far in the current generation (prompt excluded)."""
        return self.decoder.ids[self.decoder.prompt_len :].tolist()


__all__ = ["ACTION_MEANINGS", "CONTINUE", "DepthEnv", "EPISODE_MODES", "STOP", "SpecDecodeEnv"]
