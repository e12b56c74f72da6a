"""The evaluation machinery: γ parsing, interleaving, aggregation, verdicts, HF methods on tiny models."""

import json

import pytest
import torch

from eval.__main__ import main as eval_main
from eval.__main__ import parse_gammas
from eval.compare import AR, format_markdown, grid_search
from eval.runner import DecoderMethod, HFGenerateMethod, RunRecord, run_interleaved, summarize, verdict
from learn2draft.decoding import FixedDepthController
from learn2draft.sampling import SamplingConfig


def test_parse_gammas():
    assert parse_gammas("1-4") == [1, 2, 3, 4]
    assert parse_gammas("8,2,2") == [2, 8]
    for bad in ("0-3", "a", ""):
        with pytest.raises(ValueError, match="--gammas"):
            parse_gammas(bad)


def test_summarize_ratios_are_per_repeat():
    recs = []
    for rep, (a, b) in enumerate([(1.0, 2.0), (1.0, 4.0)]):  # seconds for 10 tokens
        recs.append(RunRecord("a", 0, rep, 10, a, 0.1, 0.01))
        recs.append(RunRecord("b", 0, rep, 10, b, 0.1, 0.01))
    s = summarize(recs, reference="a")
    assert s["a"]["tokens_per_second_per_repeat"] == [10.0, 10.0]
    assert s["b"]["ratio_to_a"]["per_repeat"] == [0.5, 0.25]
    assert verdict(s["b"]["ratio_to_a"]) == "slower in every repeat"
    assert verdict({"min": 0.9, "max": 1.1}) == "no clear difference (repeats disagree)"
    assert verdict({"min": 1.01, "max": 1.3}) == "faster in every repeat"


class _Recorder:
    def __init__(self, name, log):
        self.name, self.log = name, log

    def run(self, ids, seed):
        self.log.append((self.name, seed))
        return RunRecord(self.name, -1, -1, 1, 1.0, 0.5, 0.0)


def test_interleaving_rotates_order_and_shares_seeds():
    log = []
    methods = [_Recorder(n, log) for n in "abc"]
    recs = run_interleaved(methods, [torch.tensor([1]), torch.tensor([2])], repeats=2, progress=False)
    assert len(recs) == 12
    firsts = [log[i][0] for i in range(0, 12, 3)]
    assert firsts == ["a", "b", "c", "a"]  # rotated each (repeat, prompt)
    for i in range(0, 12, 3):
        assert len({s for _, s in log[i:i + 3]}) == 1  # same seed for all methods on a prompt


def test_a_warm_up_runs_every_method_once_untimed_before_the_measured_runs():
    log = []
    methods = [_Recorder(n, log) for n in "ab"]
    recs = run_interleaved(methods, [torch.tensor([1]), torch.tensor([2])], repeats=1, progress=False, warmup=True)
    assert len(recs) == 4 and [n for n, _ in log[:2]] == ["a", "b"] and len(log) == 6  # 2 warm-up runs, not recorded
    assert log[0][1] == log[2][1]  # the warm-up ran the first prompt with its seed


def test_decoder_and_hf_greedy_agree_on_tiny_models(tiny_pair):
    ids = torch.tensor([1, 5, 9, 12])
    g = SamplingConfig()
    ours = DecoderMethod("ar", tiny_pair, FixedDepthController(0), g, 12).run(ids, 0)
    spec = DecoderMethod("g3", tiny_pair, FixedDepthController(3), g, 12).run(ids, 0)
    hf = HFGenerateMethod("hf", tiny_pair, g, 12).run(ids, 0)
    assisted = HFGenerateMethod("hfa", tiny_pair, g, 12, assistant=True,
                                assistant_config={"num_assistant_tokens_schedule": "heuristic"}).run(ids, 0)
    assert ours.tokens == spec.tokens == hf.tokens == assisted.tokens
    assert spec.tau is not None and ours.tau is None
    assert hf.ttft_seconds <= hf.wall_seconds
    # one accepted length per cycle that drafted, averaging to τ; none for plain decoding
    assert ours.accepted_lengths == [] and 0 < len(spec.accepted_lengths) <= spec.cycles
    assert sum(spec.accepted_lengths) / len(spec.accepted_lengths) == pytest.approx(spec.tau)


def test_grid_picks_the_fastest_gamma_by_measured_rate(tiny_pair, monkeypatch):
    """The grid's choice follows the measured rates: γ=2 made fastest (not the first, not the largest)."""
    import eval.compare

    seconds = {1: 2.0, 2: 0.5, 3: 1.0}  # per 10 tokens

    def fake_runs(methods, prompts, repeats=1, seed=0, **kw):
        return [RunRecord(m.name, i, r, 10, seconds[int(m.name.split("=")[1])], 0.1, 0.01, tau=0.5)
                for r in range(repeats) for i in range(len(prompts)) for m in methods]

    monkeypatch.setattr(eval.compare, "run_interleaved", fake_runs)
    grid = grid_search(tiny_pair, [torch.tensor([1, 5, 9])], [1, 2, 3], SamplingConfig(), 8, seed=0)
    assert grid["best_gamma"] == 2 and grid["tokens_per_second"] == {1: 5.0, 2: 20.0, 3: 10.0}
    seconds.update({1: 0.1})
    assert grid_search(tiny_pair, [torch.tensor([1, 5, 9])], [1, 2, 3], SamplingConfig(), 8)["best_gamma"] == 1


def test_compare_and_markdown_on_tiny_models(tiny_pair):
    ids = [torch.tensor([1, 5, 9]), torch.tensor([1, 7])]
    from eval.compare import compare

    res = compare(tiny_pair, FixedDepthController(2), ids, ids, SamplingConfig(), 8, gammas=[1, 2], repeats=2,
                  policy_name="policy")
    grid = res["grid_train"]["tokens_per_second"]
    assert res["gamma_train"] == max(grid, key=grid.get)  # the fixed γ compared is the grid's fastest
    assert set(res["methods"]) >= {AR, "policy"} and all(
        len(m["tokens_per_second_per_repeat"]) == 2 and m["tokens_per_second_mean"] > 0 for m in res["methods"].values())
    md = format_markdown(res)
    assert AR in md and "policy vs" in md and f"γ={res['gamma_train']}" in md
    json.dumps(res)  # serialisable


def test_eval_cli_missing_policy_is_clear(tmp_path, capsys):
    assert eval_main(["--policy", str(tmp_path / "nope")]) == 2
    assert "python -m train" in capsys.readouterr().err


def test_decoder_method_uses_the_controllers_max_depth(tiny_pair):
    """Depth features are scaled by the decoder's max_depth: a policy must run at the depth scale it was trained on."""
    m = DecoderMethod("p", tiny_pair, FixedDepthController(5), SamplingConfig(), 8)
    assert m.decoder.max_depth == 5


def test_hf_prompt_lookup_and_our_lookup_agree_with_greedy_on_tiny_models(tiny_pair):
    ids = torch.tensor([1, 5, 9, 12, 5, 9, 12, 5])
    g = SamplingConfig()
    hf = HFGenerateMethod("hf", tiny_pair, g, 12).run(ids, 0)
    hf_lookup = HFGenerateMethod("hfl", tiny_pair, g, 12, prompt_lookup_num_tokens=3).run(ids, 0)
    ours = DecoderMethod("lookup", tiny_pair, FixedDepthController(3), g, 12, drafter="lookup").run(ids, 0)
    assert hf.tokens == hf_lookup.tokens == ours.tokens
    s = summarize([ours])
    assert s["lookup"]["alpha"] is not None and 0 <= s["lookup"]["alpha"] <= 1


@pytest.mark.parametrize("drafter,dtype", [("model", None), ("lookup", None), ("head", None),
                                           ("lookup+head", "float32"), ("lookup+head", "bfloat16")])
def test_a_trained_policy_ships_for_every_drafter(drafter, dtype):
    """Every drafter has a shipped policy, and the lookup+head hybrid one for each precision (``auto`` picks float32
    on CPUs where bf16 measures slower): each loads, reproduces its trained logits and agrees with its export."""
    from policies.layout import default_policy_dir
    from policies.load import load_policy, policy_drafter

    d = default_policy_dir(drafter, dtype)
    assert d.name == (f"{drafter}-{dtype}" if dtype == "bfloat16" else drafter)
    assert policy_drafter(d) == drafter
    policy = load_policy(d)  # checks the feature spec against this version's
    assert policy.max_depth == json.loads((d / "policy_config.json").read_text())["max_depth"]
    parity = json.loads((d / "parity.json").read_text())  # the trained PyTorch policy's logits
    logits = policy.logits(torch.tensor(parity["observations"]).numpy())
    assert torch.allclose(torch.from_numpy(logits), torch.tensor(parity["logits"]), atol=1e-5)
    check = json.loads((d / "export_check.json").read_text())
    assert check["agreement"] == 1.0


def test_eval_refuses_a_policy_trained_with_another_drafter(capsys):
    from policies.layout import default_policy_dir

    assert eval_main(["--policy", str(default_policy_dir("lookup")), "--drafter", "model"]) == 2
    err = capsys.readouterr().err
    assert "trained with the 'lookup' drafter" in err and "--drafter lookup" in err


def test_a_users_head_directory_reaches_the_drafter(tiny_pair, tmp_path):
    """--head DIR on train / eval / benchmark ends up in make_drafter; a head that does not fit the
    target is refused with the head drafter's clear error."""
    from learn2draft.models import ModelLoadError

    with pytest.raises(ModelLoadError):
        DecoderMethod("h", tiny_pair, FixedDepthController(2), SamplingConfig(), 8, drafter="head",
                      head=str(tmp_path / "no-head"))
    from eval.__main__ import build_parser as eval_parser
    from eval.benchmark import build_parser as bench_parser
    from train.__main__ import build_parser as train_parser

    for parser in (bench_parser(), eval_parser(), train_parser()):
        assert parser.parse_args(["--head", "some/dir"]).head == "some/dir"


# ------------------------------------------------------------------------------------ trees
def test_tree_configs_clip_v_to_the_tree_and_refuse_empty_grids():
    from eval.compare import tree_configs
    from eval.runner import TreeShape

    shape = TreeShape(width=2, top_k=3)  # depth 1: 3 nodes; depth 2: 3 + 6 = 9
    assert shape.max_nodes(1) == 3 and shape.max_nodes(2) == 9
    assert tree_configs([1, 2], [2, 4, 16], shape) == [(1, 2), (1, 3), (2, 2), (2, 4), (2, 9)]
    for depths, sizes in (([], [1]), ([1], []), ([0], [1]), ([1], [0])):
        with pytest.raises(ValueError, match="--tree-depths"):
            tree_configs(depths, sizes, shape)
    for bad in ({"width": 0}, {"top_k": -1}, {"width": True}, {"top_k": 2.0}):
        with pytest.raises(ValueError, match="--(width|top-k)"):
            TreeShape(**bad)


def test_tree_method_runs_a_tree_decoder_and_matches_greedy(tiny_pair):
    """A tree method drafts trees (verify sizes > depth show it) and, greedy, emits the autoregressive tokens."""
    from eval.runner import TreeShape
    from learn2draft.tree import FixedTreeController, TreeSpeculativeDecoder

    ids = torch.tensor([1, 5, 9, 12])
    g = SamplingConfig()
    ar = DecoderMethod("ar", tiny_pair, FixedDepthController(0), g, 12).run(ids, 0)
    m = DecoderMethod("tree", tiny_pair, FixedTreeController(3, 8), g, 12, tree=TreeShape(2, 3))
    assert isinstance(m.decoder, TreeSpeculativeDecoder) and (m.decoder.width, m.decoder.top_k) == (2, 3)
    assert m.decoder.max_depth == 3
    rec = m.run(ids, 0)
    assert rec.tokens == ar.tokens
    assert rec.cycles > 0 and rec.verified > rec.drafted  # 8 nodes verified for 3 levels drafted (per full cycle)
    s = summarize([rec])["tree"]
    assert s["verify_size_mean"] == rec.verified / rec.cycles and s["verify_size_mean"] > 3
    with pytest.raises(ValueError, match="lookup drafter does not draft trees"):
        DecoderMethod("t", tiny_pair, FixedTreeController(2, 4), g, 8, drafter="lookup", tree=TreeShape())


def test_tree_grid_picks_the_fastest_tree_by_measured_rate(tiny_pair, monkeypatch):
    import eval.compare
    from eval.compare import tree_grid_search
    from eval.runner import TreeShape

    seconds = {"depth=1,V=2": 2.0, "depth=2,V=4": 0.5, "depth=3,V=8": 1.0}
    seen = []

    def fake_runs(methods, prompts, repeats=1, seed=0, **kw):
        seen.extend((m.name, m.tree, m.controller.verify_size) for m in methods)
        return [RunRecord(m.name, i, r, 10, seconds[m.name], 0.1, 0.01, tau=0.5)
                for r in range(repeats) for i in range(len(prompts)) for m in methods]

    monkeypatch.setattr(eval.compare, "run_interleaved", fake_runs)
    shape = TreeShape(2, 2)
    grid = tree_grid_search(tiny_pair, [torch.tensor([1, 5, 9])], [(1, 2), (2, 4), (3, 8)], SamplingConfig(), 8,
                            shape)
    assert grid["best"] == [2, 4] and grid["best_key"] == "depth=2,V=4"
    assert grid["tokens_per_second"] == {"depth=1,V=2": 5.0, "depth=2,V=4": 20.0, "depth=3,V=8": 10.0}
    assert {t for _, t, _ in seen} == {shape} and sorted(v for *_, v in seen) == [2, 4, 8]
    with pytest.raises(ValueError, match="empty"):
        tree_grid_search(tiny_pair, [torch.tensor([1])], [], SamplingConfig(), 8)


def test_compare_with_tree_rows_on_tiny_models(tiny_pair, tmp_path):
    """The held-out comparison gains the best fixed tree (the grid's fastest) and the learned tree
    (here a FixedTreeController standing in), with verdicts of the learned tree against every row."""
    from eval.compare import compare, plot, tree_configs
    from eval.runner import TreeShape
    from learn2draft.tree import FixedTreeController

    ids = [torch.tensor([1, 5, 9]), torch.tensor([1, 7])]
    shape = TreeShape(2, 2)
    res = compare(tiny_pair, FixedDepthController(2), ids, ids, SamplingConfig(), 8, gammas=[1, 2], repeats=2,
                  policy_name="policy", tree=shape, tree_grid=tree_configs([1, 2], [2, 4], shape),
                  tree_policy=FixedTreeController(2, 3), tree_policy_name="tree policy")
    grid = res["grid_tree_train"]["tokens_per_second"]
    assert set(grid) == {"depth=1,V=2", "depth=2,V=2", "depth=2,V=4"}
    d, v = res["tree_train"]
    assert f"depth={d},V={v}" == max(grid, key=grid.get)
    fixed = res["tree_fixed"]
    assert fixed == f"fixed tree depth={d}, V={v} (chosen on train)"
    assert {AR, "policy", fixed, "tree policy"} <= set(res["methods"])
    assert res["methods"][fixed]["verify_size_mean"] is not None
    assert set(res["tree_verdicts"]) == {fixed, "policy", AR} | {k for k in res["verdicts"]}
    assert res["methods"]["tree policy"][f"ratio_to_{fixed}"]["per_repeat"]  # per-repeat ratios stored
    md = format_markdown(res)
    assert "tree policy vs " + fixed in md and "Tree grid (W=2, top-k=2)" in md and "| tree policy |" in md
    json.dumps(res)
    plot(res, tmp_path / "r.png")
    assert (tmp_path / "r.png").stat().st_size > 0
    # without a learned tree: the fixed-tree row only, no tree verdicts
    res2 = compare(tiny_pair, FixedDepthController(1), ids[:1], ids[:1], SamplingConfig(), 6, gammas=[1],
                   repeats=1, tree=shape, tree_grid=[(1, 2)])
    assert res2["tree_policy"] is None and res2["tree_verdicts"] == {} and res2["tree_fixed"] in res2["methods"]
    with pytest.raises(ValueError, match="tree_grid"):
        compare(tiny_pair, FixedDepthController(1), ids, ids, SamplingConfig(), 6, tree=shape)
    with pytest.raises(ValueError, match="TreeShape"):
        compare(tiny_pair, FixedDepthController(1), ids, ids, SamplingConfig(), 6,
                tree_policy=FixedTreeController(1, 1))


def test_tree_shape_comes_from_the_command_line_then_the_tree_policy(tmp_path):
    from eval.compare import load_learned_tree, tree_shape_from
    from eval.runner import TreeShape

    assert tree_shape_from({}) == TreeShape()
    assert tree_shape_from({"width": 8, "top_k": 10}) == TreeShape(8, 10)
    assert tree_shape_from({"tree": {"width": 3, "top_k": 5}}, top_k=2) == TreeShape(3, 2)
    with pytest.raises(FileNotFoundError, match="--tree-policy"):
        load_learned_tree(tmp_path / "none", "head")


def test_learned_tree_loading_checks_the_controller_and_drafter(tmp_path, monkeypatch):
    """load_learned_tree goes through policies.load.load_tree_policy (replaced here by a fixed
    controller) and refuses a chain controller or a policy trained with another drafter."""
    import policies.load
    from eval.compare import load_learned_tree
    from learn2draft.tree import FixedTreeController

    d = tmp_path / "tree"
    d.mkdir()
    (d / "config.json").write_text(json.dumps({"drafter": "head", "width": 5, "top_k": 6}))
    monkeypatch.setattr(policies.load, "load_tree_policy", lambda path: FixedTreeController(3, 8))
    ctrl, settings = load_learned_tree(d, "head")
    assert ctrl.verification_size(None, 3) == 8 and settings["width"] == 5
    with pytest.raises(ValueError, match="--drafter head"):
        load_learned_tree(d, "model")
    monkeypatch.setattr(policies.load, "load_tree_policy", lambda path: FixedDepthController(3))
    with pytest.raises(ValueError, match="does not decide the verification size"):
        load_learned_tree(d, "head")


def test_a_tree_policys_decoder_uses_its_depth_feature_scale(tiny_pair):
    """A learned tree policy with a fixed depth drafts fewer levels than the max_depth its features are
    scaled by (policies.tree.TreePolicyController.depth_feature_scale): the decoder gets the scale."""
    from eval.runner import TreeShape, decoder_max_depth
    from learn2draft.tree import FixedTreeController

    class FixedDepthTreePolicy(FixedTreeController):
        depth_feature_scale = 6

    ctrl = FixedDepthTreePolicy(2, 4)
    assert decoder_max_depth(ctrl) == 6 and decoder_max_depth(FixedDepthController(3)) == 3
    m = DecoderMethod("t", tiny_pair, ctrl, SamplingConfig(), 8, tree=TreeShape(2, 2))
    assert m.decoder.max_depth == 6
    rec = m.run(torch.tensor([1, 5, 9]), 0)
    assert 0 < rec.drafted <= 2 * rec.cycles  # the controller still stops at its own depth (2)


def test_a_log_file_gets_a_plain_progress_line_per_method_and_prompt(capsys, monkeypatch):
    """Off a terminal (a log file) the measurement loop prints plain progress lines, without tqdm's
    carriage-return frames; `make demo > log` used to show nothing for the whole eval."""
    monkeypatch.setattr("learn2draft.cli.PROGRESS_INTERVAL_SECONDS", 0.0)
    log = []
    run_interleaved([_Recorder(n, log) for n in "ab"], [torch.tensor([1]), torch.tensor([2])], repeats=1,
                    desc="comparison")
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith("comparison")]
    assert "\r" not in err and len(lines) == 4, err
    assert lines[0].startswith("comparison: 1/4") and "method a" in lines[0] and "prompt 1" in lines[0]
    assert lines[-1].startswith("comparison: 4/4")


def test_summarize_reports_request_percentiles_the_accepted_length_histogram_and_memory():
    """summarize gives, per method, p50/p90/p99 of TTFT, inter-token and request seconds over its requests
    (numpy's linear interpolation), the histogram of accepted lengths over its drafting cycles and the
    largest peak memory recorded; methods without cycles get an empty histogram."""
    from eval.runner import RunRecord, summarize

    recs = [RunRecord("a", i, 0, 10, wall_seconds=1.0 + i, ttft_seconds=0.1 * (i + 1), inter_token_seconds=0.01 * (i + 1),
                      accepted_lengths=[0, 2, 2, 5][: i + 1], peak_memory_bytes=100 * (i + 1)) for i in range(4)]
    recs.append(RunRecord("hf", 0, 0, 10, 2.0, 0.2, 0.02))
    s = summarize(recs)
    a = s["a"]
    assert a["request_seconds_percentiles"] == {"mean": 2.5, "p50": 2.5, "p90": pytest.approx(3.7),
                                                "p99": pytest.approx(3.97)}
    assert a["ttft_seconds_percentiles"]["p50"] == pytest.approx(0.25)
    assert a["inter_token_seconds_percentiles"]["p99"] == pytest.approx(0.0397)
    # cycles: [0], [0, 2], [0, 2, 2], [0, 2, 2, 5] → τ 0 ×4, 2 ×5, 5 ×1
    assert a["accepted_length_histogram"] == [4, 0, 5, 0, 0, 1]
    assert a["peak_memory_bytes"] == 400
    assert s["hf"]["accepted_length_histogram"] == [] and s["hf"]["peak_memory_bytes"] is None


def test_requests_table_shows_percentiles_histogram_and_memory():
    """The per-request table renders summarize's percentiles (ms for TTFT and inter-token, s for requests),
    the non-empty bins of the accepted-length histogram and the peak memory in MiB; missing values are –."""
    from eval.runner import RunRecord, requests_table, summarize

    recs = [RunRecord("a", i, 0, 10, 1.0 + i, 0.1 * (i + 1), 0.01 * (i + 1), accepted_lengths=[0, 2, 2, 5][: i + 1],
                      peak_memory_bytes=3 * 2**20) for i in range(4)]
    recs.append(RunRecord("hf", 0, 0, 10, 2.0, 0.2, 0.02))
    lines = requests_table(summarize(recs))
    assert lines[0].startswith("| requests of method |") and len(lines) == 4
    assert lines[2] == "| a | 250/370/397 | 25.0/37.0/39.7 | 2.50/3.70/3.97 | 0: 4, 2: 5, 5: 1 | 3 |"
    assert lines[3] == "| hf | 200/200/200 | 20.0/20.0/20.0 | 2.00/2.00/2.00 | – | – |"
