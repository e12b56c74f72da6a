"""learn2draft.metrics, the one place a rate or a distribution is computed: values checked by hand."""

from __future__ import annotations

import numpy as np
import pytest

from learn2draft.metrics import percentiles, tau_histogram, tokens_per_second


def test_percentiles_are_numpys_linear_ones_with_the_mean():
    p = percentiles([4.0, 1.0, 3.0, 2.0])
    assert p == {"mean": 2.5, "p50": 2.5, "p90": pytest.approx(3.7), "p99": pytest.approx(3.97)}
    assert percentiles(np.array([7.0])) == {"mean": 7.0, "p50": 7.0, "p90": 7.0, "p99": 7.0}
    assert percentiles([]) == {"mean": None, "p50": None, "p90": None, "p99": None}
    assert percentiles(iter(()), empty=0.0) == {"mean": 0.0, "p50": 0.0, "p90": 0.0, "p99": 0.0}


def test_tau_histogram_counts_cycles_per_accepted_length():
    assert tau_histogram([0, 2, 2, 5]) == [1, 0, 2, 0, 0, 1]
    assert tau_histogram(t for t in (1, 1)) == [0, 2]
    assert tau_histogram([]) == []
    with pytest.raises(ValueError, match="τ is ≥ 0"):
        tau_histogram([1, -1])


def test_tokens_per_second():
    assert tokens_per_second(30, 1.5) == 20.0
    assert tokens_per_second(5, 0.0) == 0.0
