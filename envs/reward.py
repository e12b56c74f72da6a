"""The reward of every environment and its scale, in one place.

A cycle's reward is its rate — tokens emitted over the cycle's seconds
(:attr:`learn2draft.metrics.CycleResult.tokens_per_second` on the real loop, the outcome model's
emitted / seconds in replay) — divided by ``reward_scale``, paid at the step that verifies (0 at
drafting steps):

    reward = tokens_per_second / (reward_scale · relative_speed)

``relative_speed`` is 1 except in a replay over several latency profiles, where profile k's rewards are
measured against its own plain decoding: ``relative_speed_k = ar_k / ar_0`` with ``ar_k`` the
autoregressive rate of profile k (:func:`relative_speeds`), so that a fast machine's rates do not drown a
slow one's.

The scale: a fixed number > 0 (:func:`check_reward_scale`), by default the autoregressive per-cycle
tokens/s of the pair (:func:`autoregressive_scale`), so that a reward of 1.0 means "as fast as plain
decoding"; a fixed scale keeps exported policies free of normalisation state.
"""

from __future__ import annotations

import numbers
from collections.abc import Sequence

import numpy as np


def check_reward_scale(reward_scale) -> float:
    """``reward_scale`` as a float.

    Raises:
        ValueError: not a finite real number > 0.
    """
    if not (isinstance(reward_scale, numbers.Real) and np.isfinite(reward_scale) and reward_scale > 0):
        raise ValueError(f"reward_scale must be a finite number > 0, got {reward_scale!r}.")
    return float(reward_scale)


def cycle_reward(tokens_per_second: float, reward_scale: float, relative_speed: float = 1.0) -> float:
    """The reward of a verified cycle: ``tokens_per_second / (reward_scale · relative_speed)``.

    Args:
        tokens_per_second: the cycle's emitted tokens over its seconds (tokens/s).
        reward_scale: the scale (> 0, :func:`check_reward_scale`), tokens/s.
        relative_speed: the replayed profile's autoregressive rate over the first profile's (1 on the real loop
            and with one profile; :func:`relative_speeds`).
    """
    return float(tokens_per_second / (reward_scale * relative_speed))


def gain_reward(tokens: int, seconds: float, plain_seconds: float, batch: int) -> float:
    """A batched step's reward for a load-aware policy: its tokens beyond those plain decoding emits in the same
    seconds, per row — ``(tokens − batch · seconds / plain_seconds) / batch``, i.e. the step's duration times its
    tokens/s gain over plain decoding at this batch size and context, in tokens per row (0 for plain decoding itself).

    Summed over a stream this is Σ tokens − λ·Σ seconds with λ plain decoding's rate (Dinkelbach's form of a ratio
    objective): positive exactly when the stream's aggregate tokens/s beats plain decoding's, where a mean of per-step
    tokens/s (:func:`cycle_reward`) over-weights short steps and was seen to pick speculation that loses at
    concurrency 16.

    Args:
        tokens: emitted by all rows this step; seconds: the step's (> 0); plain_seconds: the same batch's step without
            drafting (> 0); batch: rows B ≥ 1.
    """
    return float((tokens - batch * seconds / plain_seconds) / batch)


def relative_speeds(autoregressive_rates: Sequence[float]) -> list[float]:
    """Per profile k, ``ar_k / ar_0`` (1.0 for every profile when ``ar_0`` is not > 0).

    Args:
        autoregressive_rates: the autoregressive tokens/s of each profile, the first one the reference.
    """
    ar = list(autoregressive_rates)
    return [a / ar[0] if ar[0] > 0 else 1.0 for a in ar]


def autoregressive_scale(reward_scale: float | None, autoregressive_rate: float) -> float:
    """The reward scale a run uses: ``reward_scale`` when given (not None or 0), else the measured (or replayed)
    autoregressive per-cycle tokens/s, else 1.0 when that rate is 0.

    Args:
        reward_scale: the configured scale, None for "auto".
        autoregressive_rate: tokens/s of plain decoding (``cycle_tokens_per_s``) on this pair or profile.
    """
    return reward_scale or autoregressive_rate or 1.0


__all__ = ["autoregressive_scale", "check_reward_scale", "cycle_reward", "gain_reward", "relative_speeds"]
