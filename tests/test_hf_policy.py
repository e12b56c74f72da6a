"""policies.hf: a learned depth policy inside Hugging Face ``generate(assistant_model=...)``, tested
against transformers itself (the real default pair for output and decisions, tiny random models for
the hook's mechanics and bad inputs)."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch

from learn2draft.decoding import DraftController
from learn2draft.features import FEATURE_NAMES, build_features, feature_spec
from policies.controllers import CONTINUE, STOP, OnnxController
from policies.hf import UnsupportedTransformersError, check_transformers_version, remove_policy, use_policy
from policies.layout import DEFAULT_POLICIES_DIR
from policies.rules import ConfidenceThresholdController, MatchLengthController

PROMPTS = ["Write a haiku about the sea.", "List three uses of a paperclip.", "What is a prime number?"]
NEW = 24
DEPTH = FEATURE_NAMES.index("depth")


class PlannedDepths(DraftController):
    """Draft ``plan[k % len(plan)]`` tokens in cycle k (decisions vary from cycle to cycle)."""

    def __init__(self, plan, max_depth=6):
        self.plan, self.max_depth, self.depth_feature_scale = list(plan), max_depth, max_depth
        self.reset()

    def reset(self):
        self.cycle = -1

    def decide(self, state):
        if state.depth == 0:
            self.cycle += 1
        return state.depth < self.plan[self.cycle % len(self.plan)]


def greedy(model, ids, n=NEW, **kw):
    with torch.inference_mode():
        return model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, do_sample=False,
                              temperature=None, top_k=None, top_p=None, **kw)


def check_cycles(cycles, out_len, prompt_len, max_depth):
    """Every cycle proposed exactly the candidates the policy decided, transformers verified that
    many, and the committed length grew by τ + 1 (as transformers reported τ)."""
    for k, c in enumerate(cycles):
        n_continue = c.actions.count(CONTINUE)
        assert c.proposed == n_continue == c.verified == len(c.candidates), (k, c)
        assert c.proposed <= min(c.limit, max_depth)
        # decisions: CONTINUE … then STOP, unless the limit (no decision) or a drafted EOS ended the cycle
        assert c.actions == [CONTINUE] * n_continue + ([STOP] if c.stopped_by == "policy" else [])
        assert [round(float(f[DEPTH]) * max_depth) for f in c.features] == list(range(len(c.actions)))
        end = cycles[k + 1].start if k + 1 < len(cycles) else out_len
        assert end - c.start == c.accepted + 1, (k, c)
    assert cycles[0].start == prompt_len


# ------------------------------------------------------------------ the real default pair
@pytest.fixture(scope="module")
def real(default_pair):
    """(pair, prompt ids (1, L) each, plain greedy generate() outputs)."""
    ids = [default_pair.encode_prompt(p)[None] for p in PROMPTS]
    return default_pair, ids, [greedy(default_pair.target, x) for x in ids]


def test_shipped_policy_stops_at_depth_zero_and_keeps_greedy_output(real):
    pair, prompts, plain = real
    with use_policy(pair.target) as hook:  # policies/defaults/model
        for ids, ref in zip(prompts[:1], plain):  # the varying policy below runs every prompt
            out = greedy(pair.target, ids, assistant_model=pair.draft)
            assert torch.equal(out, ref)
            cycles = hook.last_cycles
            # zero candidates each cycle: transformers does one plain target step per token
            assert len(cycles) == ref.shape[1] - ids.shape[1]
            assert all(c.proposed == c.verified == 0 for c in cycles)
            assert all(c.actions == [STOP] for c in cycles if c.limit > 0)
            check_cycles(cycles, ref.shape[1], ids.shape[1], 8)
    assert "_get_candidate_generator" not in vars(pair.target)


def test_candidates_per_cycle_equal_the_policys_decisions(real):
    pair, prompts, plain = real
    plan = [0, 3, 1, 5, 2, 0, 6]  # starts with a depth-0 stop: the assistant runs first in cycle 2
    ctrl = PlannedDepths(plan, max_depth=6)
    with use_policy(pair.target, ctrl) as hook:
        for ids, ref in zip(prompts, plain):
            out = greedy(pair.target, ids, assistant_model=pair.draft)
            assert torch.equal(out, ref)
            cycles = hook.last_cycles
            check_cycles(cycles, ref.shape[1], ids.shape[1], 6)
            for k, c in enumerate(cycles):
                if c.stopped_by != "eos":
                    assert c.proposed == min(plan[k % len(plan)], c.limit), (k, c)
            assert len({c.proposed for c in cycles}) >= 3
            # the history features carry transformers' num_matches of the cycles before
            for k in range(1, len(cycles)):
                hist = cycles[k].features[0][FEATURE_NAMES.index("accepted_len_t-1")]
                assert hist == pytest.approx(min(cycles[k - 1].accepted / 6, 1.0))


def test_features_are_the_loops_under_sampling(real):
    """Each decision's features, rebuilt from the outside: confidences and entropies from a fresh
    forward of the draft (raw logits, not the temperature/top-k scores the assistant samples from),
    context and progress from the committed length, history from τ. Tolerance 1e-4: fp32 cached vs
    uncached forwards."""
    pair, prompts, _ = real
    ids, n, max_depth = prompts[0], 16, 6
    with use_policy(pair.target, ConfidenceThresholdController(0.3, max_depth, min_depth=1)) as hook:
        torch.manual_seed(0)
        with torch.inference_mode():
            out = pair.target.generate(ids, attention_mask=torch.ones_like(ids), assistant_model=pair.draft,
                                       max_new_tokens=n, do_sample=True, temperature=0.7, top_k=20, top_p=None)
    cycles, seq = hook.last_cycles, out[0].tolist()
    check_cycles(cycles, len(seq), ids.shape[1], max_depth)
    assert sum(c.proposed for c in cycles) >= 3
    hist, frac, checked = [], 1.0, 0
    for c in cycles:
        if c.candidates:
            with torch.inference_mode():
                logits = pair.draft(torch.tensor([seq[: c.start] + c.candidates])).logits[0, c.start - 1:].float()
        confs, ent = [], 0.0
        for d, f in enumerate(c.features):
            if d:
                p = torch.softmax(logits[d - 1], -1)
                confs.append(float(p.max()))
                ent = float(-(p * torch.log(p.clamp_min(1e-30))).sum())
            want = build_features(c.start + d, d, max_depth, hist, confs, ent, logits.shape[-1] if c.candidates else 2,
                                  frac, c.start - ids.shape[1], n)
            np.testing.assert_allclose(f, want, atol=1e-4, err_msg=f"cycle at {c.start}, depth {d}")
            checked += d > 0
        hist.append(c.accepted)
        frac = c.accepted / c.verified if c.verified else 1.0
    assert checked >= 3


# ------------------------------------------------------------------ tiny models: mechanics and errors
def write_linear_policy(directory, max_depth=4, drafter="model"):
    """An exported policy (policy.onnx + feature_spec.json + policy_config.json) whose CONTINUE logit
    minus STOP logit is 0.5 + 2·last_confidence − 4·depth: always drafts the first token, the second
    if confidence > 0.25, the third if > 0.75."""
    import onnx
    from onnx import TensorProto, helper

    n = len(FEATURE_NAMES)
    w = np.zeros((n, 2), np.float32)
    w[FEATURE_NAMES.index("last_confidence"), 1] = 2.0
    w[DEPTH, 1] = -4.0
    b = np.array([0.0, 0.5], np.float32)
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["obs", "W"], ["xw"]), helper.make_node("Add", ["xw", "B"], ["logits"]),
         helper.make_node("ArgMax", ["logits"], ["action"], axis=1, keepdims=0)],
        "linear_policy",
        [helper.make_tensor_value_info("obs", TensorProto.FLOAT, ["batch", n])],
        [helper.make_tensor_value_info("action", TensorProto.INT64, ["batch"]),
         helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["batch", 2])],
        [helper.make_tensor("W", TensorProto.FLOAT, w.shape, w.flatten()),
         helper.make_tensor("B", TensorProto.FLOAT, b.shape, b)],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.checker.check_model(model)
    directory.mkdir(parents=True, exist_ok=True)
    onnx.save(model, str(directory / "policy.onnx"))
    (directory / "feature_spec.json").write_text(json.dumps(feature_spec(max_depth)))
    (directory / "policy_config.json").write_text(json.dumps({"max_depth": max_depth, "drafter": drafter}))
    return directory


TINY_IDS = torch.tensor([[1, 5, 9, 12, 7]])


def test_exported_onnx_policy_drives_the_candidates(tiny_pair, tmp_path):
    t, d = tiny_pair.target, tiny_pair.draft
    ref = greedy(t, TINY_IDS, 20, pad_token_id=0)
    with use_policy(t, write_linear_policy(tmp_path / "p")) as hook:
        assert isinstance(hook.controller, OnnxController) and hook.controller.max_depth == 4
        out = greedy(t, TINY_IDS, 20, assistant_model=d, pad_token_id=0)
    assert torch.equal(out, ref)
    cycles = hook.last_cycles
    check_cycles(cycles, out.shape[1], TINY_IDS.shape[1], 4)
    assert len({c.proposed for c in cycles}) >= 2  # the decisions vary
    feats = np.stack([f for c in cycles for f in c.features])
    assert np.array_equal(hook.controller.actions(feats), [a for c in cycles for a in c.actions])


def test_generate_keeps_working_with_the_hook_and_after_removal(tiny_pair):
    t, d = tiny_pair.target, tiny_pair.draft
    kw = dict(max_new_tokens=8, pad_token_id=0)

    def runs():
        torch.manual_seed(3)
        sampled = t.generate(TINY_IDS, do_sample=True, temperature=0.9, top_k=None, top_p=None, **kw)
        return {"greedy": greedy(t, TINY_IDS, 8, pad_token_id=0), "sampled": sampled,
                "lookup": greedy(t, TINY_IDS, 8, prompt_lookup_num_tokens=3, pad_token_id=0),
                "assisted": greedy(t, TINY_IDS, 8, assistant_model=d, pad_token_id=0)}

    before = runs()
    hook = use_policy(t, ConfidenceThresholdController(0.2, 3, min_depth=1))
    try:
        during = runs()
        calls = hook.calls
    finally:
        hook.remove()
    after = runs()
    assert calls == 1  # only the assisted call went through the policy; prompt lookup kept its own generator
    for name in before:
        assert torch.equal(before[name], during[name]), name
        assert torch.equal(before[name], after[name]), name
    assert "_get_candidate_generator" not in vars(t)
    assert remove_policy(t) is False
    hook.remove()  # idempotent
    with use_policy(t, ConfidenceThresholdController(0.2, 3)) as again:
        assert again.installed
        assert remove_policy(t) is True
        assert not again.installed
    assert "_get_candidate_generator" not in vars(t)


def test_bad_inputs_give_clear_errors(tiny_pair, tmp_path):
    t, d = tiny_pair.target, tiny_pair.draft
    with use_policy(t, ConfidenceThresholdController(0.2, 3)):
        with pytest.raises(ValueError, match="one sequence at a time, got a batch of 2"):
            greedy(t, TINY_IDS.repeat(2, 1), 4, assistant_model=d, pad_token_id=0)
        with pytest.raises(ValueError, match="remove_policy"):
            use_policy(t, ConfidenceThresholdController(0.2, 3))
    with pytest.raises(FileNotFoundError, match="No policy export at"):
        use_policy(t, tmp_path / "nowhere")
    for drafter in ("head", "lookup"):
        with pytest.raises(ValueError, match=f"trained for the '{drafter}' drafter"):
            use_policy(t, DEFAULT_POLICIES_DIR / drafter)
        with pytest.raises(ValueError, match=f"trained for the '{drafter}' drafter"):
            use_policy(t, write_linear_policy(tmp_path / drafter, drafter=drafter))
    with pytest.raises(ValueError, match="prompt-lookup match length"):
        use_policy(t, MatchLengthController(4))
    with pytest.raises(ValueError, match="has no transformers assisted generation"):
        use_policy(object(), ConfidenceThresholdController(0.2, 3))
    with pytest.raises(ValueError, match="export directory"):
        use_policy(t, 3)
    assert "_get_candidate_generator" not in vars(t)  # nothing left behind by the failures


@pytest.mark.parametrize("version", ["4.46.0", "5.23.0", "6.0.0"])
def test_untested_transformers_versions_are_refused(version):
    with pytest.raises(UnsupportedTransformersError, match=f"transformers {version} is installed"):
        check_transformers_version(version)
    assert check_transformers_version("5.24.0") == "5.24.0"


def chi_square_p(counts, law, n):
    """p-value of Pearson's chi-square of ``counts`` against ``law`` (cells with expected count < 5 pooled)."""
    from scipy.stats import chi2

    expected = law * n
    big = expected >= 5
    obs = np.append(counts[big], counts[~big].sum())
    exp = np.append(expected[big], max(expected[~big].sum(), 1e-12))
    return float(chi2.sf(float(((obs - exp) ** 2 / exp).sum()), len(obs) - 1))


def two_token_law(model, ids):
    """float64 (V·V,): the exact law of the first two tokens sampled from ``model`` at temperature 1."""
    with torch.inference_mode():
        p1 = torch.softmax(model(ids).logits[0, -1].double(), -1)
        seqs = torch.cat([ids.repeat(p1.numel(), 1), torch.arange(p1.numel())[:, None]], 1)
        p2 = torch.softmax(model(seqs).logits[:, -1].double(), -1)
    return (p1[:, None] * p2).reshape(-1).numpy()


@pytest.mark.slow
def test_sampling_law_is_the_targets(tiny_pair):
    """Monte-Carlo, fixed seed: the first two tokens of assisted sampling under a confidence policy
    (which drafts 1-3 candidates from the draft's values) follow the target's exact law. 1500 draws,
    Pearson chi-square, rejected at p < 1e-3. Power control: the same counts reject the draft's law
    (roughly what accepting every candidate would give) at p < 1e-6."""
    t, d = tiny_pair.target, tiny_pair.draft
    ids, n_draws = TINY_IDS, 1500
    target_law, draft_law = two_token_law(t, ids), two_token_law(d, ids)
    V = int(math.isqrt(target_law.size))
    counts = np.zeros_like(target_law)
    torch.manual_seed(0)
    drafted = 0
    with use_policy(t, ConfidenceThresholdController(0.5, 3, min_depth=1)) as hook, torch.inference_mode():
        for _ in range(n_draws):
            out = t.generate(ids, assistant_model=d, max_new_tokens=3, do_sample=True, temperature=1.0, top_k=None,
                             top_p=None, pad_token_id=0, eos_token_id=None)
            x1, x2 = out[0, ids.shape[1]: ids.shape[1] + 2].tolist()
            counts[x1 * V + x2] += 1
            drafted += sum(c.proposed for c in hook.last_cycles)
    assert drafted > n_draws  # the policy did draft
    assert chi_square_p(counts, target_law, n_draws) > 1e-3
    assert chi_square_p(counts, draft_law, n_draws) < 1e-6


def test_benchmark_row_runs_hf_generate_with_the_policy(tiny_pair):
    """eval.benchmark's ``hf generate + learned policy`` row: HF's assisted call with the policy
    installed only during the run, τ and α filled from the policy's cycle records."""
    from eval.benchmark import HF_POLICY, HFPolicyMethod
    from eval.runner import HFGenerateMethod
    from learn2draft.sampling import SamplingConfig

    method = HFPolicyMethod(HFGenerateMethod(HF_POLICY, tiny_pair, SamplingConfig(), 8, assistant=True),
                            ConfidenceThresholdController(0.2, 3, min_depth=1))
    rec = method.run(TINY_IDS[0], seed=0)
    assert "_get_candidate_generator" not in vars(tiny_pair.target)
    assert rec.method == HF_POLICY and rec.tokens == greedy(tiny_pair.target, TINY_IDS, 8)[0, 5:].tolist()
    with use_policy(tiny_pair.target, ConfidenceThresholdController(0.2, 3, min_depth=1)) as hook:  # the same run
        greedy(tiny_pair.target, TINY_IDS, 8, assistant_model=tiny_pair.draft, pad_token_id=0)
    cycles = [c for c in hook.last_cycles if c.verified]
    assert rec.drafted == sum(c.verified for c in cycles) > len(cycles)
    assert rec.accepted == sum(c.accepted for c in cycles)
    assert rec.tau == pytest.approx(rec.accepted / len(cycles))  # (0 here: the random tiny draft is always rejected)
