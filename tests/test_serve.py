"""``python -m eval.serve`` on the tiny random models (no downloads): end to end in seconds, consistent numbers, and
bad input refused before any model loads."""

from __future__ import annotations

import json

import numpy as np
import pytest

from eval.serve import main as serve_main
from eval.serve import poisson_arrivals


def _prompts(tmp_path):
    path = tmp_path / "prompts.jsonl"
    rows = [{"prompt": "w1 w2 w3 w1 w2 w3", "category": "copy"}, {"prompt": "w4 w5 w6"},
            {"prompt": "w7 w8 w7 w8 w7"}]
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return path


def _tiny(tiny_model_dirs, tmp_path, *extra):
    return ["--target", tiny_model_dirs[0], "--draft", tiny_model_dirs[1], "--prompts", str(_prompts(tmp_path)),
            "--device", "cpu", "--dtype", "float32", "--max-new-tokens", "6", "--num-requests", "4",
            "--num-train-requests", "2", "--gammas", "1,2", "--cost-repeats", "1", "--refit-every", "2", *extra]


def test_serve_runs_end_to_end_with_consistent_numbers(tiny_model_dirs, tmp_path):
    from test_serve_replay import synthetic_traces

    out = tmp_path / "serve"
    tr = synthetic_traces(drafter="lookup")  # any chain traces run the sim-vs-real path (their numbers are not the run's)
    tr.header.update(format="learn2draft-trace", format_version=1, structure="chain", feature_version=2,
                     sampling={"temperature": 0.0, "top_k": 0, "top_p": 1.0})
    traces = tr.save(tmp_path / "sim.npz")
    argv = _tiny(tiny_model_dirs, tmp_path, "--concurrency", "1,2", "--calibration-concurrency", "2",
                 "--arrival-rates", "50", "--sim-traces", str(traces), "--requests-per-slot", "3", "--out", str(out))
    assert serve_main(argv) == 0
    assert not (out / "serve-partial.json").exists()  # written after each level, removed once the run completes
    rep = json.loads((out / "serve.json").read_text())
    # at concurrency c at least 3 × c requests (c = 2: 6 > --num-requests 4); Poisson: --num-requests
    assert [lv["num_requests"] for lv in rep["levels"]] == [4, 6, 4]
    assert all(len(m["requests"]) == lv["num_requests"] for lv in rep["levels"] for m in lv["methods"].values())
    assert list(rep["sim_vs_real"]) == ["concurrency 1", "concurrency 2"]
    assert "replay against the measurement" in (out / "serve.md").read_text()
    assert [(lv["kind"], lv["value"]) for lv in rep["levels"]] == [("concurrency", 1), ("concurrency", 2),
                                                                   ("arrival_rate", 50.0)]
    cal = rep["calibration"]
    assert cal["best_fixed_gamma"] in (1, 2) and set(cal["grid"]) == {"1", "2"}
    assert cal["table"][0][:2] == [1, 1] and cal["table"][1][:2] == [2, 2]  # one range per level, no gap
    assert cal["best_fixed_gamma"] == max((1, 2), key=lambda g: cal["grid"]["2"][str(g)])  # chosen at c = 2
    for lv in rep["levels"]:
        names = set(lv["methods"])
        expect = {"no speculation (γ=0)", f"fixed γ={cal['best_fixed_gamma']} (best at c=2)", "per-batch-size table",
                  "adaptive verification (vLLM)"} | ({"hf generate (batched)"} if lv["kind"] == "concurrency" else set())
        assert names == expect and sorted(lv["order"]) == sorted(names)
        prompts = None
        for name, m in lv["methods"].items():
            reqs = m["requests"]
            assert m["aggregate_tokens"] == sum(r["tokens"] for r in reqs) > 0
            assert m["aggregate_tokens_per_second"] == pytest.approx(m["aggregate_tokens"] / m["makespan_seconds"])
            assert all(1 <= r["tokens"] <= 6 for r in reqs)
            assert max(r["admitted"] + r["latency_seconds"] for r in reqs) == pytest.approx(m["makespan_seconds"])
            assert all(r["admitted"] >= r["arrival"] - 1e-9 for r in reqs)  # float rounding of clock - start
            ran = [(r["prompt_index"], r["seed"], r["arrival"]) for r in reqs]
            assert prompts is None or ran == prompts, name  # every method ran the same prompts, seeds, arrivals
            prompts = ran
            assert m["ttft_seconds"]["p50"] <= m["latency_seconds"]["p50"]
            assert m["alpha"] is None or 0 <= m["alpha"] <= 1
        nospec = lv["methods"]["no speculation (γ=0)"]
        assert nospec["drafted"] == 0 and nospec["ratio_to_no_spec"]["tokens_per_second"] == pytest.approx(1.0)
    c2 = rep["levels"][1]["methods"]
    # greedy: the batched no-spec decoder and batched HF generate emit the same number of tokens per request
    assert [r["tokens"] for r in c2["no speculation (γ=0)"]["requests"]] == \
        [r["tokens"] for r in c2["hf generate (batched)"]["requests"]]
    arrivals = [r["arrival"] for r in rep["levels"][2]["methods"]["no speculation (γ=0)"]["requests"]]
    assert arrivals[0] == 0 and all(np.diff(arrivals) > 0)
    assert rep["adaptive"]["refits"] >= 1  # refit every 2 steps: the estimator learned while serving
    cost = rep["costs"]["profile"]["verify_batch"]  # measured at start-up: the batch axis of a latency profile
    assert cost["batch_sizes"] == [1, 2] and cost["tokens"] == [1, 2, 3]
    assert rep["header"]["precision"] == "float32" and rep["header"]["sampling"]["temperature"] == 0
    verdicts = {v["claim"]: v["verdict"] for v in rep["verdicts"]}
    assert verdicts["learned ≥ 1.10× best fixed γ (geomean over concurrency)"] == "not measured"  # no --policy
    sb = rep["same_batch"]  # the goal's own setting, measured whatever the levels
    assert sb["batch"] == 8 and len(sb["no_spec_tokens_per_second"]) == len(sb["hf_tokens_per_second"]) == 3
    assert verdicts["no speculation at B=8 ≥ 1.00× hf generate (batched)"] in ("PASS", "FAIL")
    md = (out / "serve.md").read_text()
    assert md.startswith("## Run") and "### concurrency 2" in md and "## Verdicts" in md
    assert (out / "serve.png").stat().st_size > 0


def test_serve_with_a_learned_policy(tiny_model_dirs, tmp_path):
    """--policy (the shipped lookup policy) adds the learned row, and its verdicts are judged (PASS or FAIL)."""
    from policies.layout import default_policy_dir

    out = tmp_path / "serve"
    argv = _tiny(tiny_model_dirs, tmp_path, "--concurrency", "1", "--arrival-rates", "", "--methods", "nospec,aa,fixed",
                 "--policy", str(default_policy_dir("lookup", "float32")), "--passes", "2", "--out", str(out))
    assert serve_main(argv) == 0
    assert not (out / "serve-partial.json").exists()  # written after each level, removed once the run completes
    rep = json.loads((out / "serve.json").read_text())
    lv = rep["levels"][0]  # --passes 2: every method twice, the second pass in the first one's reverse order
    assert len(lv["passes"]) == 2 and lv["orders"][1] == lv["orders"][0][::-1]
    for name, m in lv["methods"].items():
        assert m["passes"] == 2 and m["tokens_per_second_passes"] == [p[name]["aggregate_tokens_per_second"]
                                                                      for p in lv["passes"]]
        lo, hi = m["ratio_spread"]["tokens_per_second"]
        assert lo <= m["ratio_to_no_spec"]["tokens_per_second"] <= hi
    assert "2 passes per level" in (out / "serve.md").read_text()
    names = set(rep["levels"][0]["methods"])
    assert {"learned policy", "no speculation (γ=0)", "no speculation again (A/A)"} <= names and len(names) == 4
    learned = rep["levels"][0]["methods"]["learned policy"]
    assert learned["aggregate_tokens"] == sum(r["tokens"] for r in learned["requests"])
    verdicts = {v["claim"]: v["verdict"] for v in rep["verdicts"]}
    assert verdicts["learned ≥ 1.00× no speculation at every level (tok/s, ITL p50/p99)"] in ("PASS", "FAIL")
    assert verdicts["learned ≥ 1.10× best fixed γ (geomean over concurrency)"] in ("PASS", "FAIL")
    assert verdicts["learned ≥ 1.00× adaptive verification at every level"] == "not measured"
    assert verdicts["A/A control (not a goal: the test's noise): no speculation again ≥ 1.00× no speculation at every "
                    "level (tok/s, ITL p50/p99)"] == "control"


@pytest.mark.parametrize("flags, words", [
    (["--concurrency", "0"], "--concurrency '0': need at least one concurrency ≥ 1"),
    (["--concurrency", "a,b"], "--concurrency 'a,b'"),
    (["--concurrency", "1,,2"], "--concurrency '1,,2'"),
    (["--methods", "nospec,bogus"], "unknown method 'bogus'"),
    (["--methods", "aa"], "aa needs nospec"),
    (["--methods", "policy"], "needs --policy"),
    (["--methods", "guard"], "--methods guard needs --policy"),
    (["--methods", "nospec,guard", "--policy", "policies/defaults/lookup"], "the speed guard wraps a load-aware one"),
    (["--methods", "capped"], "--methods capped needs --policy"),
    (["--methods", "nospec,capped", "--policy", "policies/defaults/lookup"], "the step-time cap runs behind"),
    (["--step-slack", "-0.1"], "--step-slack must be a finite number ≥ 0"),
    (["--arrival-rates", "0"], "--arrival-rates '0'"),
    (["--arrival-rates", "inf"], "every rate must be a finite number > 0"),
    (["--calibration-concurrency", "3"], "--calibration-concurrency 3 (the level where the fixed γ and the table are chosen) is not one of"),
    (["--num-requests", "0"], "--num-requests must be ≥ 1"),
    (["--passes", "0"], "--passes must be ≥ 1"),
    (["--requests-per-slot", "-1"], "--requests-per-slot must be ≥ 0"),
    (["--policy", "policies/defaults/lookup+model-bfloat16", "--drafter", "lookup"], "a hybrid (lookup+model) policy"),
    (["--policy", "no/such/dir"], "--policy no/such/dir: no such directory"),
    (["--policy", "tests"], "--policy tests: no policy export there"),  # a folder, but no export in it
    (["--temperature", "-1"], "--temperature must be ≥ 0"),
    (["--concurrency", "4", "--calibration-concurrency", "4", "--max-batch", "2"],
     "--max-batch 2 is below the largest --concurrency 4"),
    (["--sim-traces", "no/such.npz"], "No trace file"),
    (["--profile", "no/such.json"], "no/such.json"),
])
def test_bad_input_fails_before_any_model_loads(flags, words, tmp_path, monkeypatch, capsys):
    import learn2draft.models

    monkeypatch.setattr(learn2draft.models, "load_pair", lambda *a, **k: pytest.fail("models loaded"))
    assert serve_main([*flags, "--device", "cpu", "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err
    assert words in err and "Traceback" not in err and err.count("\n") == 1


@pytest.mark.parametrize("flags, level", [(["--concurrency", "2,4"], 2), (["--concurrency", "1,8"], 1),
                                           (["--concurrency", "2,4", "--calibration-concurrency", "4"], 4)])
def test_the_fixed_gamma_is_chosen_at_the_smallest_level_unless_told(flags, level, tmp_path):
    """Without --calibration-concurrency the fixed γ and the table are chosen at the smallest --concurrency level (a
    sweep without c = 1 runs as given); a level given is used."""
    from eval.serve import build_parser, check_args

    args = build_parser().parse_args([*flags, "--methods", "nospec,fixed,table", "--device", "cpu",
                                      "--out", str(tmp_path / "o")])
    assert check_args(args).calibration == level


def test_an_earlier_run_is_not_overwritten_without_overwrite(tmp_path, monkeypatch, capsys):
    import learn2draft.models

    monkeypatch.setattr(learn2draft.models, "load_pair", lambda *a, **k: pytest.fail("models loaded"))
    for name in ("serve.json", "serve-partial.json"):  # a finished run, or an interrupted one
        out = tmp_path / name.split(".")[0]
        out.mkdir()
        (out / name).write_text("{}")
        assert serve_main(["--device", "cpu", "--out", str(out)]) == 2
        err = capsys.readouterr().err
        assert f"holds the results of an earlier run ({name})" in err and "--overwrite" in err
        assert (out / name).read_text() == "{}"  # nothing already written is lost
        monkeypatch.setattr(learn2draft.models, "load_pair", lambda *a, **k: (_ for _ in ()).throw(SystemExit(7)))
        with pytest.raises(SystemExit) as stop:  # with --overwrite the checks pass and the models load
            serve_main(["--device", "cpu", "--out", str(out), "--overwrite"])
        assert stop.value.code == 7
        monkeypatch.setattr(learn2draft.models, "load_pair", lambda *a, **k: pytest.fail("models loaded"))


def test_an_out_that_is_a_file_fails_before_any_model_loads(tmp_path, monkeypatch, capsys):
    import learn2draft.models

    monkeypatch.setattr(learn2draft.models, "load_pair", lambda *a, **k: pytest.fail("models loaded"))
    f = tmp_path / "report.json"
    f.write_text("{}")
    assert serve_main(["--device", "cpu", "--out", str(f)]) == 2
    assert "is a file: give a directory" in capsys.readouterr().err


def test_poisson_arrivals_are_seeded_with_the_right_rate():
    """10,000 gaps at 2 requests/s: mean gap within 3% of 0.5 s (its standard error is 1%)."""
    a = poisson_arrivals(2.0, 10_000, seed=3)
    assert a[0] == 0 and np.all(np.diff(a) > 0) and np.array_equal(a, poisson_arrivals(2.0, 10_000, seed=3))
    assert abs(np.mean(np.diff(a)) - 0.5) < 0.015


def test_the_baselines_drive_the_batched_decoder(tiny_pair):
    """In the real batched decoder: the table's γ follows the batch size (2 rows → its [2, 4] range's γ), and
    adaptive verification past its warm-up with verification priced out verifies nothing — the greedy tokens are
    those of no speculation (a budget cut reads the draft side only)."""
    import torch

    from learn2draft.batched import BatchedSpeculativeDecoder, Request, serve
    from learn2draft.budget import AdaptiveVerification, BatchSizeTable
    from learn2draft.control import FixedDepthController

    prompts = [torch.tensor([3, 4, 5, 3, 4, 5, 3, 4]), torch.tensor([6, 7, 6, 7, 6, 7]), torch.tensor([8, 9, 10])]
    reqs = [Request(p, seed=i) for i, p in enumerate(prompts)]
    table = lambda: BatchSizeTable([[1, 1, 0], [2, 4, 3]])  # noqa: E731
    dec = BatchedSpeculativeDecoder(tiny_pair, "model", max_new_tokens=8, max_depth=3, max_batch=2)
    serve(dec, reqs, table, concurrency=2)
    by_size = {b: [c.depth for s in dec.steps if s.batch_size == b for c in s.rows.values()] for b in (1, 2)}
    assert by_size[1] and by_size[2] and set(by_size[1]) == {0}  # the third request runs alone: γ(1) = 0
    assert max(by_size[2]) == 3 and [c.depth for c in dec.steps[0].rows.values()] == [3, 3]  # γ(2) = 3 (less only
    # where max_new_tokens ends a row)

    def run(budget):
        d = BatchedSpeculativeDecoder(tiny_pair, "model", max_new_tokens=8, max_depth=3, max_batch=2)
        res = serve(d, reqs, lambda: FixedDepthController(3 if budget else 0), concurrency=2,
                    on_step=getattr(budget, "observe", None), budget=budget)
        return [r.tokens for r in res], d

    av = AdaptiveVerification(3, cost=lambda load, longest, verified: float(load.batch_size + verified) ** 3,
                              warmup_refits=0)
    cut, d = run(av)
    assert all(c.depth == 0 for s in d.steps for c in s.rows.values()) and av.history
    assert any(drafted > 0 for _, drafted, _ in av.history) and all(kept == 0 for *_, kept in av.history)
    assert cut == run(None)[0]


def test_sim_vs_real_replays_each_closed_loop_level_beside_its_measurement():
    from types import SimpleNamespace

    from test_serve_replay import D, batched_profile, synthetic_traces

    from eval.serve import sim_vs_real

    tr = synthetic_traces(drafter="lookup")
    tr.header.update(format="learn2draft-trace", format_version=1, structure="chain", feature_version=2,
                     sampling={"temperature": 0.0, "top_k": 0, "top_p": 1.0})
    import tempfile
    from pathlib import Path

    path = tr.save(Path(tempfile.mkdtemp()) / "t.npz")
    roles = {"no_spec": "no speculation (γ=0)", "fixed": "fixed γ=2", "table": "per-batch-size table"}
    levels = [{"kind": "concurrency", "value": c, "methods": {n: {"aggregate_tokens_per_second": 100.0}
                                                           for n in roles.values()}} for c in (1, 4)]
    levels.append({"kind": "arrival_rate", "value": 2.0, "methods": {}})
    rep = {"roles": roles, "levels": levels}
    args = SimpleNamespace(drafter="lookup", num_requests=6, requests_per_slot=0, max_new_tokens=None)
    out = sim_vs_real(rep, str(path), batched_profile(), SimpleNamespace(max_depth=D), args, None,
                      [[1, 1, 2], [2, 8, 0]], 2, "lookup")
    assert list(out) == ["concurrency 1", "concurrency 4"] and set(out["concurrency 4"]) == set(roles.values())
    cell = out["concurrency 1"]["fixed γ=2"]
    assert cell["real"] == 100.0 and cell["error"] == pytest.approx(cell["sim"] / 100.0 - 1)
    # the table at c = 4 is γ = 0: it replays exactly as no speculation
    assert out["concurrency 4"]["per-batch-size table"]["sim"] == out["concurrency 4"]["no speculation (γ=0)"]["sim"]


def _method(tps: float, itl_p50: float, itl_p99: float) -> dict:
    return {"aggregate_tokens_per_second": tps, "itl_seconds": {"p50": itl_p50, "p99": itl_p99}}


def test_passes_are_read_as_paired_ratios_so_drift_between_passes_cancels():
    """Three passes where the machine slows down in pass 2 and no speculation happens to run in pass 3's fast
    minutes: the level's ratio is the median of each pass's own ratio (1.04), not the ratio of the methods' median
    tok/s (60 / 80 = 0.75), and each record is one pass's own numbers."""
    from eval.serve import NOSPEC, _ratios, combine_passes, level_ratio, pass_order, serve_verdicts

    # passes in pairs of opposite orders, the pairs rotated; the level shifts the rotation
    assert [pass_order("ABC", 0, p) for p in range(4)] == ["ABC", "CBA", "BCA", "ACB"]
    assert pass_order("ABC", 1, 0) == "BCA" and pass_order("ABC", 1, 1) == "ACB"
    for rows in ("ABC", "ABCDEFG"):
        assert len({pass_order(rows, 2, p)[0] for p in range(3)}) == 3  # three passes: no method opens two
        for pair in (0, 2):  # over each pair of passes every method's mean place is the middle (linear drift cancels)
            assert {m: pass_order(rows, 2, pair).index(m) + pass_order(rows, 2, pair + 1).index(m)
                    for m in rows} == {m: len(rows) - 1 for m in rows}
    passes = [{NOSPEC: _method(100, 0.10, 0.20), "m": _method(105, 0.095, 0.21)},
              {NOSPEC: _method(50, 0.20, 0.40), "m": _method(52, 0.19, 0.38)},
              {NOSPEC: _method(80, 0.125, 0.25), "m": _method(60, 0.16, 0.30)}]
    for res in passes:
        _ratios(res)
    methods = combine_passes(passes)
    m = methods["m"]
    assert m["aggregate_tokens_per_second"] == 60 and m["passes"] == 3  # the median pass's record (pass 3)
    assert m["tokens_per_second_passes"] == [105, 52, 60]
    assert m["ratio_to_no_spec"]["tokens_per_second"] == pytest.approx(1.04)
    assert m["ratio_spread"]["tokens_per_second"] == pytest.approx([0.75, 1.05])
    assert m["ratio_to_no_spec"]["itl_p99"] == pytest.approx(0.20 / 0.21)  # median of (0.952, 1.053, 0.833)
    assert methods[NOSPEC]["ratio_spread"]["tokens_per_second"] == [1.0, 1.0]
    level = {"kind": "concurrency", "value": 4, "methods": methods, "passes": passes}
    assert level_ratio(level, "m", NOSPEC) == pytest.approx(1.04)
    assert level_ratio({"methods": passes[2]}, "m", NOSPEC) == pytest.approx(0.75)  # one pass: that pass
    report = {"roles": {"no_spec": NOSPEC, "learned": "m"}, "levels": [level]}
    never = next(v for v in serve_verdicts(report) if v["claim"].startswith("learned ≥ 1.00× no speculation"))
    # the worst of the paired medians: tok/s 1.04, ITL p50 median(1.053, 1.053, 0.781) = 1.053, ITL p99 0.952
    assert never["measured"] == pytest.approx(0.20 / 0.21) and never["verdict"] == "FAIL"
    assert "ITL p99" in never["against"]


def test_an_unmeasured_itl_is_left_out_of_the_verdict_and_a_missing_method_is_not_an_error():
    """A method whose requests all had one token has no ITL: its verdict reads tok/s alone instead of a false 0.0
    FAIL; a method missing from the last pass of an interrupted level is combined over the passes that ran it."""
    from eval.serve import NOSPEC, _ratios, combine_passes, serve_verdicts

    one_token = {"aggregate_tokens_per_second": 110.0, "itl_seconds": {"p50": None, "p99": None}}
    passes = [{NOSPEC: _method(100, 0.10, 0.20), "m": dict(one_token)},
              {NOSPEC: _method(100, 0.10, 0.20), "m": dict(one_token)}]
    for res in passes:
        _ratios(res)
    level = {"kind": "concurrency", "value": 2, "methods": combine_passes(passes), "passes": passes}
    report = {"roles": {"no_spec": NOSPEC, "learned": "m"}, "levels": [level]}
    never = next(v for v in serve_verdicts(report) if v["claim"].startswith("learned ≥ 1.00× no speculation"))
    assert never["measured"] == pytest.approx(1.1) and never["verdict"] == "PASS" and "tok/s" in never["against"]

    partial = [{NOSPEC: _method(100, 0.1, 0.2), "m": _method(120, 0.09, 0.2)}, {NOSPEC: _method(90, 0.1, 0.2)}]
    for res in partial:
        _ratios(res)
    m = combine_passes(partial)["m"]
    assert m["passes"] == 1 and m["ratio_to_no_spec"]["tokens_per_second"] == pytest.approx(1.2)


def test_the_a_a_control_reads_the_never_slower_test_on_no_speculation_run_again():
    """The A/A row (no speculation again) gets the never-slower test's reading as a control line: its worst ratio to
    no speculation over levels and the three measures (here ITL p99 0.20 / 0.22 at c = 4), verdict "control", never
    PASS or FAIL; without the row there is no such line."""
    from eval.serve import NOSPEC, NOSPEC_AGAIN, _ratios, combine_passes, serve_verdicts

    levels = []
    for c, again in ((2, _method(101, 0.10, 0.20)), (4, _method(99, 0.10, 0.22))):
        passes = [{NOSPEC: _method(100, 0.10, 0.20), NOSPEC_AGAIN: again}]
        for res in passes:
            _ratios(res)
        levels.append({"kind": "concurrency", "value": c, "methods": combine_passes(passes), "passes": passes})
    report = {"roles": {"no_spec": NOSPEC, "aa": NOSPEC_AGAIN}, "levels": levels}
    aa = [v for v in serve_verdicts(report) if v["claim"].startswith("A/A control (not a goal")]
    assert len(aa) == 1 and aa[0]["verdict"] == "control" and aa[0]["measured"] == pytest.approx(0.20 / 0.22)
    assert "concurrency 4 (ITL p99)" in aa[0]["against"]
    report["roles"]["aa"] = None
    assert not [v for v in serve_verdicts(report) if v["claim"].startswith("A/A control")]


def test_passes_that_disagree_are_flagged_in_the_report():
    """A pass disturbed by a stall (a method at a third of its speed in one pass) is named in serve.md's level with
    its spread; passes within 1.5× of each other are not."""
    from eval.serve import NOSPEC, _ratios, combine_passes, disagreeing_passes

    passes = [{NOSPEC: _method(100, 0.1, 0.2), "m": _method(120, 0.09, 0.2)},
              {NOSPEC: _method(104, 0.1, 0.2), "m": _method(40, 0.2, 0.4)},  # m stalled in this pass
              {NOSPEC: _method(98, 0.1, 0.2), "m": _method(118, 0.09, 0.2)}]
    for res in passes:
        _ratios(res)
    level = {"kind": "concurrency", "value": 2, "methods": combine_passes(passes)}
    apart = disagreeing_passes(level)
    assert len(apart) == 1 and apart[0] == "m 0.38–1.20× no speculation (3.1× apart)"
    calm = [{NOSPEC: _method(100, 0.1, 0.2), "m": _method(120, 0.09, 0.2)},
            {NOSPEC: _method(90, 0.1, 0.2), "m": _method(100, 0.1, 0.2)}]
    for res in calm:
        _ratios(res)
    assert disagreeing_passes({"methods": combine_passes(calm)}) == []
    assert disagreeing_passes({"methods": combine_passes(calm[:1])}) == []


def test_a_ctrl_c_names_the_partial_file_it_leaves(tiny_model_dirs, tmp_path, monkeypatch, capsys):
    """A Ctrl-C during the second level: exit code 130, the first level kept in serve-partial.json, and the one
    interrupted line names that file (it said "nothing more was written"); a Ctrl-C before the first pass is written
    says nothing was."""
    import eval.serve as es

    real = es.ServeMethod.run

    def run(self, *a, **k):
        if k.get("concurrency") == stop_at:
            raise KeyboardInterrupt
        return real(self, *a, **k)

    monkeypatch.setattr(es.ServeMethod, "run", run)
    out = tmp_path / "serve"
    stop_at = 2  # level 1 (c = 1) is measured and written; level 2's first run is interrupted
    argv = _tiny(tiny_model_dirs, tmp_path, "--methods", "nospec", "--concurrency", "1,2", "--arrival-rates", "",
                 "--out", str(out))
    assert serve_main(argv) == 130
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert "interrupted (Ctrl-C)" in err and str(out / "serve-partial.json") in err
    kept = json.loads((out / "serve-partial.json").read_text())
    assert kept["partial"] and [(lv["kind"], lv["value"]) for lv in kept["levels"]] == [("concurrency", 1)]
    stop_at = 1  # the start-up's warm-up runs at concurrency 1: interrupted before any pass is written
    assert serve_main([*argv, "--overwrite"]) == 130
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert "nothing more was written" in err and "serve-partial" not in err
    # --overwrite moved the first run's partial file aside at the start: none passes for this run's, none is lost
    assert not (out / "serve-partial.json").exists()
    assert json.loads((out / "previous-run" / "serve-partial.json").read_text()) == kept
