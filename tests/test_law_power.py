"""A law check without power is INCONCLUSIVE, never a PASS (tiny models, no downloads)."""

from __future__ import annotations

import numpy as np
import torch

from eval.law import format_law_table, goodness_of_fit_test, law_check, two_sample_test
from learn2draft.decoding import FixedDepthController
from learn2draft.sampling import SamplingConfig

PROMPT = torch.tensor([1, 5, 9, 12, 20])


def test_tests_report_their_reach():
    assert two_sample_test([7] * 50, [7] * 50)["p_min"] == 1.0  # 0 degrees of freedom: cannot reject anything
    p = np.array([0.4, 0.3, 0.2, 0.1, 0.0])
    few = goodness_of_fit_test([0, 1, 0, 2, 1, 0, 3, 0, 1, 2], p)
    assert few["dof"] == 0 and few["p_min"] == 1.0
    many = goodness_of_fit_test(list(np.random.default_rng(0).choice(5, 2000, p=p)), p)
    assert many["dof"] >= 2 and many["p_min"] < 1e-100 and many["p_value"] >= many["p_min"]


def test_a_check_without_power_is_inconclusive_not_pass(tiny_pair):
    cfg = SamplingConfig(temperature=1.0)
    res = law_check(tiny_pair, {"γ=2": FixedDepthController(2)}, [PROMPT], sampling=cfg, num_tokens=2,
                    num_samples=10, seed=0)
    assert not any(t["can_reject"] for t in res["tests"] if t["controller"] == "γ=2"), format_law_table(res)
    assert res["verdict"].startswith("INCONCLUSIVE") and not res["passed"] and not res["conclusive"]
    assert "INCONCLUSIVE" in format_law_table(res) and "PASS" not in format_law_table(res)
    enough = law_check(tiny_pair, {"γ=2": FixedDepthController(2)}, [PROMPT], sampling=cfg, num_tokens=2,
                       num_samples=300, seed=0)
    assert enough["conclusive"] and enough["passed"], format_law_table(enough)
