"""Acceptance features (issue 16, item 3): what traces record of the target and the draft, their checks at load, the
feature builder, and the held-out AUC report (python -m eval.acceptance); tiny models and hand-made trace arrays."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from helpers_loop import drafter_for

from eval.acceptance import (
    acceptance_report,
    check_compatible,
    examples,
    feature_set_report,
    format_report,
    main,
    roc_auc,
)
from learn2draft.features import ACCEPTANCE_FEATURE_NAMES, ACCEPTANCE_FEATURE_SETS, FEATURE_VERSION, acceptance_features
from learn2draft.replay.traces import ACCEPTANCE_ARRAYS, ARRAY_DOCS, PromptTrace, TraceSet
from learn2draft.sampling import SamplingConfig
from learn2draft.traces import record_traces

PROMPTS = ["w1 w2 w3 w4", "w5 w6 w5 w6 w5"]
N, D = 10, 3


@pytest.fixture(scope="module")
def sampled(noisy_pair):
    """Model-drafter traces of the noisy pair at T = 1 (a sampled trajectory: the target statistics move)."""
    return record_traces(noisy_pair, drafter_for("model", noisy_pair), PROMPTS, SamplingConfig(temperature=1.0),
                         max_new_tokens=N, max_depth=D, seed=4, progress=False)


def _stats(probs: torch.Tensor) -> list[float]:
    top = probs.topk(2).values
    return [top[0].item(), -(probs * probs.clamp_min(1e-30).log()).sum().item(), (top[0] - top[1]).item()]


def test_recorded_acceptance_features_equal_fresh_forwards(sampled, noisy_pair):
    """Row t's target_stats are the target's raw (top-1, entropy, margin) where g_{t-1} was drawn (a fresh forward
    over prompt + g_0..g_{t-2}); draft_margin[t, j] is the draft's raw top-2 gap after prompt + g_0..g_{t-1} + the
    chain's first j tokens (tolerance 1e-4); row 0 is NaN and the set reports the features present."""
    assert sampled.has_acceptance_features
    V = noisy_pair.vocab_size
    for pt in sampled.prompts:
        assert np.isnan(pt.target_stats[0]).all()
        for t in range(1, pt.n + 1):
            ctx = torch.as_tensor(np.concatenate([pt.prompt_ids, pt.output[: t - 1]]))
            with torch.inference_mode():
                probs = torch.softmax(noisy_pair.target(input_ids=ctx[None]).logits[0, -1, :V].float(), -1)
            assert pt.target_stats[t] == pytest.approx(_stats(probs), abs=1e-4), t
            for j in range(int(pt.chain_len[t])):
                seq = torch.as_tensor(np.concatenate([pt.prompt_ids, pt.output[:t], pt.draft_tokens[t, :j]]))
                with torch.inference_mode():
                    q = torch.softmax(noisy_pair.draft(input_ids=seq[None]).logits[0, -1, :V].float(), -1)
                assert pt.draft_margin[t, j] == pytest.approx(_stats(q)[2], abs=1e-4), (t, j)
            assert not pt.draft_margin[t, int(pt.chain_len[t]):].any()
    assert sum(int(pt.chain_len.sum()) for pt in sampled.prompts) > 5


def test_lookup_traces_record_the_match_margin(noisy_pair):
    """Each drafted token's margin is the lookup's top-2 continuation share gap for its sequence, recomputed here."""
    from learn2draft.drafters import LookupDrafter

    tr = record_traces(noisy_pair, LookupDrafter(3, 1), ["w5 w6 w5 w6 w5 w7 w5"], SamplingConfig(),
                       max_new_tokens=N, max_depth=D, seed=0, progress=False)
    pt, fresh = tr.prompts[0], LookupDrafter(3, 1)
    assert tr.has_acceptance_features and pt.chain_len.sum() >= 3
    for t in range(1, pt.n):
        for j in range(int(pt.chain_len[t])):
            seq = torch.as_tensor(np.concatenate([pt.prompt_ids, pt.output[:t], pt.draft_tokens[t, :j]]))
            fresh.start(seq)
            assert pt.draft_margin[t, j] == fresh.lookup(seq)[4], (t, j)


def test_old_traces_without_the_arrays_still_load(sampled, tmp_path):
    """A file written before the acceptance arrays loads with NaN in their place; the report runs the sets that do
    not read them and names the file for the others."""
    path = sampled.save(tmp_path / "new")
    data = {k: v for k, v in np.load(path).items() if k not in ACCEPTANCE_ARRAYS}
    np.savez(tmp_path / "old.npz", **data)
    old = TraceSet.load(tmp_path / "old.npz")
    assert not old.has_acceptance_features and len(old) == len(sampled)
    for a, b in zip(old.prompts, sampled.prompts):
        assert np.isnan(a.target_stats).all() and np.isnan(a.draft_margin).all()
        np.testing.assert_array_equal(a.accept_prob, b.accept_prob)
    back = TraceSet.load(path)  # the new file round-trips its arrays
    np.testing.assert_array_equal(back.prompts[1].target_stats, sampled.prompts[1].target_stats)
    np.testing.assert_array_equal(back.prompts[1].draft_margin, sampled.prompts[1].draft_margin)
    rep = acceptance_report(old, sampled, min_examples=1, train_name=str(tmp_path / "old.npz"))
    assert "old.npz lack the acceptance features" in rep["sets"]["target"]["skipped"]
    assert "skipped" in rep["sets"]["draft+margin"] and "skipped" in rep["sets"]["all"]
    assert rep["sets"]["draft"]["auc_global"] is not None and rep["sets"]["lookup"]["auc_global"] is not None


@pytest.mark.parametrize("damage,match", [
    ("nan", "non-finite"), ("shape", "shapes"), ("alone", "without"), ("margin", "outside")])
def test_a_damaged_acceptance_array_is_refused(sampled, tmp_path, damage, match):
    path = sampled.save(tmp_path / "t")
    data = dict(np.load(path))
    row = int(np.argmax(data["chain_len"] > 0))
    if damage == "nan":
        data["target_stats"][row, 1] = np.nan
    elif damage == "shape":
        data["draft_margin"] = data["draft_margin"][:, :-1]
    elif damage == "alone":
        del data["draft_margin"]
    else:
        data["draft_margin"][row, 0] = 1.5
    np.savez(tmp_path / "bad.npz", **data)
    with pytest.raises(ValueError, match=match) as e:
        TraceSet.load(tmp_path / "bad.npz")
    assert str(tmp_path / "bad.npz") in str(e.value)


# ------------------------------------------------------------------ hand-made traces: builder and AUC
def _hand_trace(rng, n: int, accept_rule, depth: int = 2) -> PromptTrace:
    """A prompt trace of n tokens whose chains are full (depth tokens) with random features, and whose acceptances
    (0/1) are accept_rule(target_top1 (n+1,), draft_margin (n+1, depth), rng)."""
    R = n + 1
    ts = np.column_stack([rng.uniform(0.2, 1, R), rng.uniform(0, 2.5, R), np.zeros(R)])
    ts[:, 2] = ts[:, 0] * rng.uniform(0, 1, R)
    ts[0] = np.nan
    cl = np.full(R, depth)
    cl[0] = cl[-1] = 0
    drafted = np.arange(depth)[None] < cl[:, None]
    margin = np.where(drafted, rng.uniform(0, 1, (R, depth)), 0.0)
    ap = np.where(drafted, accept_rule(ts[:, 0], margin, rng).astype(float), np.nan)
    conf = np.where(drafted, rng.uniform(0, 1, (R, depth)), 0.0)
    return PromptTrace(prompt_ids=np.arange(3), output=np.arange(n) % 7, ended_by_eos=False, chain_len=cl,
                       draft_tokens=np.where(drafted, 1, -1), confidence=conf, entropy=np.where(drafted, 0.5, 0.0),
                       drafter_features=np.zeros((R, depth + 1, 2), np.float32), accept_prob=ap, target_stats=ts,
                       draft_margin=margin)


def _hand_set(seed: int, rule, prompts: int = 20, n: int = 60) -> TraceSet:
    rng = np.random.default_rng(seed)
    header = {"max_depth": 2, "max_new_tokens": n, "vocab_size": 16, "sampling": {"temperature": 0.0},
              "target": "t", "draft": "d", "drafter": {"drafter": "model"}}
    return TraceSet(header, [_hand_trace(rng, n, rule) for _ in range(prompts)])


def test_builder_gives_one_row_per_drafted_token_with_the_documented_values():
    tr = _hand_set(0, lambda top1, m, rng: m > 0.5, prompts=1, n=5)
    pt = tr.prompts[0]
    X, rows, pos = acceptance_features(pt, 2, 16, 5)
    assert X.shape == (8, len(ACCEPTANCE_FEATURE_NAMES)) and rows.tolist() == [1, 1, 2, 2, 3, 3, 4, 4]
    col = {n: X[:, i] for i, n in enumerate(ACCEPTANCE_FEATURE_NAMES)}
    np.testing.assert_allclose(col["depth"], (pos + 1) / 2)
    np.testing.assert_allclose(col["draft_margin"], pt.draft_margin[rows, pos])
    np.testing.assert_allclose(col["target_entropy"], pt.target_stats[rows, 1] / np.log(16))
    np.testing.assert_allclose(col["cum_confidence"][1], pt.confidence[1, 0] * pt.confidence[1, 1])
    ap = pt.accept_prob
    want = ap[1, 0] + ap[1, 0] * ap[1, 1]  # row 3 looks two back: the chain of row 1, its first two tokens
    np.testing.assert_allclose(col["recent_accept_2"][4], want / 2)
    assert col["recent_accept_2"][:4].tolist() == [0, 0, 0, 0]  # rows 1, 2: nothing two back
    assert set(ACCEPTANCE_FEATURE_SETS) == {"draft", "draft+margin", "target", "lookup", "all"}
    assert set(ACCEPTANCE_ARRAYS) <= set(ARRAY_DOCS)


def test_auc_of_a_separating_feature_is_one_and_of_noise_one_half():
    """Acceptance decided by the draft margin (> 0.5): the margin alone has held-out AUC 1.0 exactly, the sets
    holding it ≥ 0.999 (their other features add a little noise), the target set stays near 0.5; acceptance by a
    biased coin: every set within 0.5 ± 0.06 (seeded; ~2,000 held-out examples give a standard error of ~0.013)."""
    sep = lambda top1, m, rng: m > 0.5  # noqa: E731
    train, held = _hand_set(1, sep), _hand_set(2, sep)
    alone = feature_set_report(examples(train), examples(held), ["draft_margin"], 2)
    assert alone["auc_global"] == 1.0 and alone["auc_per_position"] == 1.0 and alone["positions_fitted"] == [0, 1]
    rep = acceptance_report(train, held)
    assert rep["sets"]["draft+margin"]["auc_global"] >= 0.999 and rep["sets"]["all"]["auc_per_position"] >= 0.999
    assert abs(rep["sets"]["target"]["auc_global"] - 0.5) < 0.1 and rep["best"] in ("draft+margin", "all")
    assert rep["heldout"]["tokens"] > 1000 and 0.3 < rep["heldout"]["base_rate"] < 0.7
    coin = lambda top1, m, rng: rng.uniform(size=m.shape) < 0.6  # noqa: E731
    rep = acceptance_report(_hand_set(3, coin), _hand_set(4, coin))
    for name, s in rep["sets"].items():
        assert abs(s["auc_global"] - 0.5) < 0.06 and abs(s["auc_per_position"] - 0.5) < 0.06, name


def test_soft_labels_weight_each_token_by_its_reach():
    """At T > 0 a token counts with P(reached) as accepted (· a_j) and rejected (· (1 − a_j)): the weights sum to
    the expected reached tokens, and the base rate is the reach-weighted mean acceptance."""
    rng = np.random.default_rng(5)
    pt = _hand_trace(rng, 4, lambda top1, m, rng: m > 2)  # all rejected, then set soft probabilities by hand
    pt.accept_prob[1:4] = [[0.5, 0.2], [1.0, 0.4], [0.0, 0.9]]
    tr = TraceSet({"max_depth": 2, "max_new_tokens": 4, "vocab_size": 16, "sampling": {"temperature": 1.0}}, [pt])
    ex = examples(tr)
    reach = np.array([1, 0.5, 1, 1.0, 1, 0.0])  # per (t, j) row-major; (3, 1) is never reached
    a = np.array([0.5, 0.2, 1.0, 0.4, 0.0, 0.9])
    assert ex.reached == pytest.approx(reach.sum()) and ex.tokens == 5
    assert ex.base_rate == pytest.approx((reach * a).sum() / reach.sum())


def test_roc_auc_is_the_pairwise_count_with_ties_one_half():
    rng = np.random.default_rng(0)
    s, y, w = rng.integers(0, 4, 50).astype(float), rng.integers(0, 2, 50), rng.uniform(0, 2, 50)
    pos, neg = np.flatnonzero(y == 1), np.flatnonzero(y == 0)
    num = sum(w[i] * w[k] * ((s[i] > s[k]) + 0.5 * (s[i] == s[k])) for i in pos for k in neg)
    assert roc_auc(s, y, w) == pytest.approx(num / (w[pos].sum() * w[neg].sum()))
    assert roc_auc([0.1, 0.9], [0, 1]) == 1.0 and np.isnan(roc_auc([1, 2], [1, 1]))


def test_the_command_writes_its_report_and_refuses_mismatched_traces(tmp_path, capsys):
    sep = lambda top1, m, rng: (top1 > 0.6)[:, None] & (m >= 0)  # noqa: E731
    train, held = _hand_set(6, sep, prompts=5), _hand_set(7, sep, prompts=5)
    for s in (train, held):
        s.header.update(format="learn2draft-trace", format_version=1, structure="chain", feature_version=FEATURE_VERSION)
    a = train.save(tmp_path / "a")
    b = held.save(tmp_path / "b")
    assert main(["--traces", str(a), "--heldout", str(b), "--out", str(tmp_path / "r.json")]) == 0
    rep = json.loads((tmp_path / "r.json").read_text())
    assert rep["sets"]["target"]["auc_global"] > 0.95 and "| target |" in capsys.readouterr().out
    c = held.save(tmp_path / "c")  # comma-separated, as the other tools take several traces
    assert main(["--traces", f"{a},{c}", "--heldout", str(b), "--out", str(tmp_path / "r2.json")]) == 0
    assert json.loads((tmp_path / "r2.json").read_text())["traces"] == [str(a), str(c)]
    capsys.readouterr()
    held.header["drafter"] = {"drafter": "lookup"}
    with pytest.raises(ValueError, match="differ in drafter"):
        check_compatible(train, held, [str(a)], [str(b)])
    assert "warning" in check_compatible(train, held, [str(a)], [str(b)], allow_mismatch=True)[0]
    assert main(["--traces", str(a), "--heldout", str(a)]) == 2
    assert "as training and as held-out" in capsys.readouterr().err
    assert main(["--traces", str(tmp_path / "missing.npz"), "--heldout", str(b)]) == 2
    assert "No trace file" in capsys.readouterr().err


def test_auc_per_category_scores_each_group_of_held_out_prompts_apart():
    """Per-category AUC: held-out prompts 0-2 accept by the draft margin (AUC 1 within them), prompts 3-5 by a
    biased coin (AUC 0.5 ± 0.1 within them; seeded); the groups come from the trace header's shipped split."""
    from eval.acceptance import prompt_categories
    from learn2draft.prompts import load_prompt_records

    sep = lambda top1, m, rng: m > 0.5  # noqa: E731
    coin = lambda top1, m, rng: rng.uniform(size=m.shape) < 0.6  # noqa: E731
    train = _hand_set(11, sep, prompts=6)
    held = _hand_set(12, sep, prompts=3)
    held.prompts += _hand_set(13, coin, prompts=3).prompts
    rep = feature_set_report(examples(train), examples(held), ["draft_margin"], 2,
                             groups={"margin": [0, 1, 2], "coin": [3, 4, 5], "none": []})
    by = rep["auc_by_group"]
    assert by["margin"]["auc"] == 1.0 and abs(by["coin"]["auc"] - 0.5) < 0.1
    assert by["none"] == {"auc": None, "examples": 0} and by["margin"]["examples"] > 0
    held.header["prompt_source"] = "corpus_test"
    cats = prompt_categories(held)
    want = [p.category for p in load_prompt_records("corpus_test")[:6]]
    assert sorted(i for idx in cats.values() for i in idx) == list(range(6))
    assert all(want[i] == c for c, idx in cats.items() for i in idx)
    rep = acceptance_report(train, held, ["draft+margin"], groups=cats)  # the command's report, per category
    text = format_report(rep)
    assert "per category, feature set draft+margin" in text and all(f"| {c} |" in text for c in cats)
    held.header["prompt_source"] = "/some/user/file.jsonl"
    assert prompt_categories(held) is None
