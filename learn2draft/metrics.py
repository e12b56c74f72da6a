"""The one place a rate or a distribution of measurements is computed: tokens/s, percentiles, the τ histogram.

Every report reads its numbers through these functions (the real loop's and the request streams' reports in
:mod:`eval.runner` and :mod:`eval.serve`, the replay's in :mod:`learn2draft.replay.serve`, the environments' and
training's rates), so that "tokens/s" or "p99" means one thing everywhere. numpy only: the replay imports it.
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np

#: The percentiles every latency report gives.
PERCENTILES = (50, 90, 99)


def tokens_per_second(tokens: float, seconds: float) -> float:
    """Tokens over seconds; 0.0 when no second was spent.

    Args:
        tokens: tokens generated (summed over generations or requests); ``seconds``: the seconds they took (a wall
            clock, the summed cycle seconds, or a stream's makespan — the caller names which).
    """
    return tokens / seconds if seconds > 0 else 0.0


def percentiles(values: Iterable[float], empty: float | None = None) -> dict[str, float | None]:
    """``{"mean", "p50", "p90", "p99"}`` of ``values`` (numpy's linear interpolation between order statistics), each
    ``empty`` when there are no values.

    Args:
        values: numbers (e.g. seconds); ``empty``: what every entry is for no values (None in reports, 0.0 where a
            number is needed).
    """
    x = np.asarray(list(values), dtype=np.float64)
    if not x.size:
        return {"mean": empty, **{f"p{q}": empty for q in PERCENTILES}}
    q = np.percentile(x, PERCENTILES)
    return {"mean": float(x.mean()), **{f"p{p}": float(v) for p, v in zip(PERCENTILES, q)}}


def tau_histogram(taus: Iterable[int]) -> list[int]:
    """The accepted-length histogram: entry k = cycles that accepted k drafted tokens (τ = k); [] for no cycle.

    Raises:
        ValueError: a negative τ.
    """
    t = np.asarray(list(taus), dtype=np.int64)
    if t.size and t.min() < 0:
        raise ValueError(f"An accepted length τ is ≥ 0, got {int(t.min())}.")
    return np.bincount(t).tolist() if t.size else []


__all__ = ["PERCENTILES", "percentiles", "tau_histogram", "tokens_per_second"]
