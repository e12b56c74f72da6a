"""The load-aware speculation environment: one decision per batch step of a simulated request stream, no model runs.

:class:`ServeReplayEnv` (registered as ``learn2draft/ServeReplay-v0``) wraps the request-stream simulator
:class:`learn2draft.replay.serve.ServeSimulator` (chain traces, a batched latency profile, a load: fixed concurrency or
Poisson arrivals). An episode serves ``num_requests`` requests under one load drawn at reset from ``loads``; each
step is one batch step of the running rows.

Action design (one decision for the whole step): ``Discrete(max_depth + 1)``, the γ every running row drafts and
verifies this step (each row capped at what it can draft: its recorded chain and its tokens left). A depth per row
is a variable-length action that SB3's policies do not take; one γ per step is what the per-batch-size tables of
vLLM and TensorRT-LLM decide, and it is where the cost of load enters (the batched verification of B rows padded to
γ + 1 tokens). A per-row split of a global budget (vLLM's adaptive verification) is the baseline
:class:`learn2draft.replay.serve.ReplayAdaptiveVerification` (:class:`learn2draft.budget.AdaptiveVerification`).

Observation: float32 (len(SERVE_FEATURE_NAMES),), every entry in [0, 1]:

* the load — running rows / batch scale, waiting requests / batch scale (capped at 1), tokens in flight
  (Σ contexts) / (batch scale · context scale), mean and max row context / context scale (the batch scale: the
  profile's largest batch size, so that envs over other loads on the same profile show the same numbers; the context
  scale: the longest prompt plus max_new_tokens of the traces; capped at 1);
* the rows, averaged — the previous cycle's τ / max_depth, its accept fraction τ / depth (1 after depth 0 or before
  the first cycle), the draftable tokens / max_depth, the tokens left / max_new_tokens (draft-side or history only:
  nothing about the acceptance of this step's tokens);
* this step's costs at the current batch size and context — verification growth ``1 − v(B, 1) / v(B, D + 1)`` and
  drafting ``r / (1 + r)`` with ``r = D · draft_step(B) / v(B, 1)`` (the profile's batched costs).

Episodes (``episode``, as :mod:`envs.spec_decode`'s modes): ``"step"`` (the default, as ``train`` uses ``"cycle"``) —
one episode = one batch step, ``terminated`` after it; the next :meth:`reset` without a seed continues the same
stream and starts a new one (a new load drawn) only when it has finished, so that with any discount the return of a
decision is exactly the scaled tokens/s of its step (the per-step objective); ``"stream"`` — one episode = the whole
request stream, whose undiscounted return *sums per-step rates* and so favours many short steps (no speculation)
over fast serving: use it with care.

Reward (``reward``): ``"gain"`` (the default) — :func:`envs.reward.gain_reward`, the step's measured tokens/s gain
over plain decoding at the same batch size and context, weighted by the step's seconds, per row: the tokens it emits
beyond those plain decoding would in the same time (0 for γ = 0), which sums over a stream to the aggregate
throughput's gain (a mean of per-step tokens/s over-weights short steps: trained on it, a policy drafted at
concurrency 16 where that loses to plain decoding); ``"rate"`` — :func:`envs.reward.cycle_reward` of the step's
aggregate tokens/s over ``reward_scale`` (Learning to Draft's per-cycle reward). The prefills of joining requests are
charged to the stream's clock and report but not to the step's reward: no action changes them. The default
``reward_scale`` is the traces' plain-decoding rate at concurrency 1 (the replay's autoregressive rate).

Rewards are deterministic for a seed (Poisson arrivals and T > 0 acceptances come from the seeded simulator), so the
environment is registered as deterministic and passes gymnasium's ``check_env``.
"""

from __future__ import annotations

import numbers
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import gymnasium as gym
import numpy as np
from gymnasium import spaces

from envs.reward import check_reward_scale, cycle_reward, gain_reward
from learn2draft.control import FixedDepthController
from learn2draft.features import SERVE_FEATURE_NAMES, build_serve_features
from learn2draft.replay.latency import LatencyProfile, load_profile
from learn2draft.replay.serve import Load, ServeSimulator, as_load, simulate
from learn2draft.replay.traces import TraceSet, load_traces

SERVE_ENV_ID = "learn2draft/ServeReplay-v0"
SERVE_EPISODE_MODES = ("step", "stream")


class ReplayServePolicy:
    """A load-aware policy ``act(observation) -> γ`` as a :data:`learn2draft.replay.serve.Policy` ``(load, rows) ->
    depths``: the observation is :func:`learn2draft.features.build_serve_features` of the simulator's load and rows
    with the profile's batched costs (as the real loop's :class:`policies.controllers.LoadAwarePolicy` builds it), and
    every row gets the γ chosen.

    Args:
        act: observation float32 (len(SERVE_FEATURE_NAMES),) → γ in 0..max_depth.
        profile, drafter: the batched costs (:meth:`LatencyProfile.verify_batched`, ``draft_step_batched``).
        max_depth, max_new_tokens, batch_scale, context_scale: the features' scales; batch_context: ``"max"`` or
            ``"mean"`` (the context a step is costed at, as the simulator's).
    """

    def __init__(self, act, profile: LatencyProfile, drafter: str, max_depth: int, max_new_tokens: int,
                 batch_scale: int, context_scale: float, batch_context: str = "max"):
        self.act, self.profile, self.drafter = act, profile, drafter
        self.max_depth, self.max_new_tokens = int(max_depth), int(max_new_tokens)
        self.batch_scale, self.context_scale, self.batch_context = int(batch_scale), float(context_scale), batch_context

    def observation(self, load, rows) -> np.ndarray:
        """float32 (len(SERVE_FEATURE_NAMES),) for the simulator's ``load`` and ``rows`` before a step."""
        return build_serve_features(load.waiting, rows.context, rows.last_tau, rows.last_depth, rows.avail, rows.left,
                                    self.profile, self.drafter, self.max_depth, self.max_new_tokens, self.batch_scale,
                                    self.context_scale, self.batch_context)

    def __call__(self, load, rows) -> np.ndarray:
        return np.full(len(rows.context), int(self.act(self.observation(load, rows))), dtype=np.int64)


class ServeReplayEnv(gym.Env):
    """One γ per batch step of a simulated request stream (see the module docstring).

    Args:
        traces: a chain :class:`learn2draft.replay.traces.TraceSet` or trace file(s) (``python -m eval.record``).
        profile: a :class:`LatencyProfile`, a profile file or a shipped name; with the batch axis when more than one
            row can run (``python -m eval.profile --batch-sizes 1,2,4,8,16``).
        loads: the loads an episode is drawn from (uniformly at reset): concurrencies (ints) or
            :class:`learn2draft.replay.serve.Load` s; default 1, 2, 4, 8 up to the profile's largest batch size.
        num_requests: requests per episode (≥ 1); with ``balance``, × the concurrency of a closed-loop load.
        balance: give a closed-loop load of concurrency c a stream of ``num_requests`` × c requests, so that every load
            contributes about as many batch steps (decisions) to training: with equal streams, a stream at c = 16
            takes 1/16 of the steps of one at c = 1 and its decisions were seen too rarely to be learnt.
        max_depth, max_new_tokens: as the simulator's (default: the traces').
        max_batch: the simulator's largest batch (default: the largest concurrency of ``loads``, or the profile's
            largest batch size when a load is Poisson).
        reward_scale: rewards are step tokens/s / ``reward_scale`` (> 0); None: the traces' plain-decoding rate at
            concurrency 1.
        charge_prefill, batch_context: as :class:`ServeSimulator`.
        episode: ``"step"`` or ``"stream"`` (see the module docstring).
        reward: ``"gain"`` (default, :func:`envs.reward.gain_reward`: the step's tokens beyond plain decoding's in
            the same seconds, per row) or ``"rate"`` (:func:`envs.reward.cycle_reward` of the step's tokens/s).

    Raises:
        ValueError: as :class:`ServeSimulator` (a profile without the batch axis names its file and the flag to
            re-measure it with), an empty ``loads``, a bad ``reward_scale`` or ``episode``.
    """

    metadata = {"render_modes": []}

    def __init__(self, traces: TraceSet | str | Path | Sequence[str | Path], profile: LatencyProfile | str | Path,
                 loads: Sequence | None = None, num_requests: int = 16, max_depth: int | None = None,
                 max_new_tokens: int | None = None, max_batch: int | None = None, reward_scale: float | None = None,
                 charge_prefill: bool = True, batch_context: str = "max", episode: str = "step",
                 reward: str = "gain", balance: bool = False):
        super().__init__()
        if reward not in ("gain", "rate"):
            raise ValueError(f"reward must be 'gain' or 'rate', got {reward!r}.")
        self.reward = reward
        if episode not in SERVE_EPISODE_MODES:
            raise ValueError(f"episode must be one of {SERVE_EPISODE_MODES}, got {episode!r}.")
        self.episode = episode
        self.traces = traces if isinstance(traces, TraceSet) else load_traces(traces)
        self.profile = profile if isinstance(profile, LatencyProfile) else load_profile(profile)
        if loads is None:
            loads = [c for c in (1, 2, 4, 8) if c <= self.profile.max_batch_size]
        self.loads = [as_load(x) for x in loads]
        if not self.loads:
            raise ValueError("loads is empty: give concurrency levels or Poisson rates to draw episodes from.")
        if max_batch is None:
            if all(x.concurrency is not None for x in self.loads):
                max_batch = max(x.concurrency for x in self.loads)
            else:
                max_batch = self.profile.max_batch_size
        self._kw = {"max_depth": max_depth, "max_new_tokens": max_new_tokens, "max_batch": max_batch,
                    "charge_prefill": charge_prefill, "batch_context": batch_context}
        self.num_requests = num_requests
        # One simulator per load, built (and checked) now; each reset restarts one with a new seed.
        self._sims = [ServeSimulator(self.traces, self.profile, x,
                                     num_requests * ((x.concurrency or 1) if balance else 1), **self._kw)
                      for x in self.loads]
        sim = self._sims[0]
        self.max_depth, self.max_new_tokens, self.max_batch = sim.max_depth, sim.max_new_tokens, sim.max_batch
        self.drafter = sim.drafter
        if reward_scale is None:
            reward_scale = simulate(self.traces, self.profile, FixedDepthController(0), Load(concurrency=1),
                                    len(self.traces.prompts), max_depth=self.max_depth,
                                    max_new_tokens=self.max_new_tokens, charge_prefill=False)["tokens_per_s"] or 1.0
        self.reward_scale = check_reward_scale(reward_scale)
        self.context_scale = float(max(p.prompt_len for p in self.traces.prompts) + self.max_new_tokens)
        self.batch_scale = max(self.profile.max_batch_size, self.max_batch)
        self._observer = self.policy(lambda obs: 0)  # builds the observation (its act is never called)
        self.observation_space = spaces.Box(0.0, 1.0, shape=(len(SERVE_FEATURE_NAMES),), dtype=np.float32)
        self.action_space = spaces.Discrete(self.max_depth + 1)
        self.sim: ServeSimulator | None = None
        self._observed: tuple | None = None  # ((simulator, step), (load, rows)): one observe() per simulated step
        self.load_index = 0
        self._needs_reset = True

    @property
    def vocab_size(self) -> int:
        """The target's vocabulary size recorded in the traces (0 when they hold none)."""
        return int(self.traces.header.get("vocab_size") or 0)

    @property
    def profiles(self) -> list[LatencyProfile]:
        """``[profile]``: the one latency profile (as the other replay envs list theirs)."""
        return [self.profile]

    # ------------------------------------------------------------------ observation
    def _observe(self):
        """The simulator's (load, rows) before its next step, read once per step (the observation and the gain
        reward's plain-decoding cost both need them)."""
        key = (id(self.sim), self.sim.steps)
        if self._observed is None or self._observed[0] != key:
            self._observed = (key, self.sim.observe())
        return self._observed[1]

    def _obs(self) -> np.ndarray:
        return self._observer.observation(*self._observe())

    def policy(self, act) -> ReplayServePolicy:
        """``act(observation) -> γ`` (e.g. an exported graph's argmax) as a simulator policy on this env's profile,
        drafter and scales: what :func:`learn2draft.replay.serve.compare_baselines` takes beside the baselines."""
        return ReplayServePolicy(act, self.profile, self.drafter, self.max_depth, self.max_new_tokens,
                                 self.batch_scale, self.context_scale, self._kw["batch_context"])

    # ------------------------------------------------------------------ gymnasium API
    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None) -> tuple[np.ndarray, dict]:
        """Start a request stream under a load drawn uniformly from ``loads`` (``options={"load_index": k}`` forces
        one); the simulator's seed (arrivals, T > 0 acceptances) is drawn from ``self.np_random``. In ``"step"``
        mode a reset without a seed or options continues the current stream while it runs
        (``options={"new_stream": True}`` forces a new one).

        Raises:
            ValueError: ``load_index`` out of range.
        """
        super().reset(seed=seed)
        options = options or {}
        if (self.episode == "step" and seed is None and not options and self.sim is not None
                and not self.sim.finished):
            self._needs_reset = False
            return self._obs(), {"load": self.loads[self.load_index].label, "load_index": self.load_index,
                                 "new_stream": False}
        k = options.get("load_index")
        if k is None:
            k = int(self.np_random.integers(len(self.loads)))
        elif not (isinstance(k, numbers.Integral) and 0 <= k < len(self.loads)):
            raise ValueError(f"load_index must be an integer in [0, {len(self.loads)}), got {k!r}.")
        self.load_index = int(k)
        self.sim = self._sims[self.load_index]
        self.sim.reset(seed=int(self.np_random.integers(2**31)))
        self._observed = None  # a new stream: its step 0 is not the last one's
        self._needs_reset = False
        return self._obs(), {"load": self.loads[self.load_index].label, "load_index": self.load_index,
                             "new_stream": True}

    def step(self, action) -> tuple[np.ndarray, float, bool, bool, dict]:
        """Run one batch step in which every row drafts and verifies γ = ``action`` tokens (capped per row).

        Raises:
            ValueError: ``action`` not in 0..max_depth. RuntimeError: before :meth:`reset` or after the episode.
        """
        if not self.action_space.contains(action):
            raise ValueError(f"Invalid action {action!r}: the γ of this step, an integer in 0..{self.max_depth}.")
        if self._needs_reset:
            raise RuntimeError("The episode has ended (or never started): call reset() first.")
        load, rows = self._observe()
        plain = float(sum(self.sim.step_seconds(load.running, 0, self.sim.batch_context_of(rows.context))))
        res = self.sim.step(int(action))
        reward = (gain_reward(res.tokens, res.seconds, plain, res.batch) if self.reward == "gain"
                  else cycle_reward(res.tokens_per_second, self.reward_scale))
        finished = self.sim.finished
        terminated = finished or self.episode == "step"
        self._needs_reset = terminated
        obs = np.zeros(self.observation_space.shape, np.float32) if finished else self._obs()
        info = {"batch": res.batch, "gamma": int(action), "tokens": res.tokens, "seconds": res.seconds,
                "prefill_seconds": res.prefill_seconds, "tokens_per_second": res.tokens_per_second,
                "mean_tau": float(res.taus.mean()), "load": self.loads[self.load_index].label,
                "stream_finished": finished}
        if finished:
            info["report"] = self.sim.report()
        return obs, reward, terminated, False, info


def run_stream(env: ServeReplayEnv, act, seed: int = 0, load_index: int | None = None) -> dict:
    """Serve one whole request stream of ``env`` with ``act(observation) -> γ`` (e.g. a trained SB3 model's
    ``lambda o: model.predict(o, deterministic=True)[0]``), in either episode mode.

    Args:
        seed: the stream's reset seed; ``load_index``: which of the env's loads (default: drawn by the seed).

    Returns:
        the simulator's report (:meth:`learn2draft.replay.serve.ServeSimulator.report`) with ``actions``: the
        count of each γ chosen, int list (max_depth + 1,).
    """
    options = {} if load_index is None else {"load_index": int(load_index)}
    obs, _ = env.reset(seed=seed, options=options)
    counts = np.zeros(env.max_depth + 1, dtype=np.int64)
    while True:
        a = int(act(obs))
        counts[a] += 1
        obs, _, _, _, info = env.step(a)
        if info["stream_finished"]:
            return {**info["report"], "actions": counts.tolist()}
        if env.episode == "step":
            obs, _ = env.reset()


def batch_gammas(env: ServeReplayEnv, act, seed: int = 0) -> dict[int, int]:
    """The γ ``act`` chooses most often at each closed-loop concurrency c of ``env``'s loads, over the steps of a
    stream at c that run c rows (ties: the smaller γ): what a per-batch-size schedule keeps of a load-aware policy
    (:func:`policies.vllm.vllm_schedule`)."""
    out = {}
    for k, load in enumerate(env.loads):
        if load.concurrency is None:
            continue
        c = int(load.concurrency)
        counts = np.zeros(env.max_depth + 1, dtype=np.int64)
        obs, _ = env.reset(seed=seed, options={"load_index": k})
        while True:
            a = int(act(obs))
            obs, _, _, _, info = env.step(a)
            if info["batch"] == c:
                counts[a] += 1
            if info["stream_finished"]:
                break
            if env.episode == "step":
                obs, _ = env.reset()
        out[c] = int(np.argmax(counts)) if counts.any() else 0
    return out


__all__ = ["SERVE_ENV_ID", "batch_gammas", "SERVE_EPISODE_MODES", "SERVE_FEATURE_NAMES", "ReplayServePolicy", "ServeReplayEnv",
           "run_stream"]
