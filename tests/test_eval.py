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


@pytest.mark.parametrize("drafter", ["model", "lookup", "head"])
def test_a_trained_policy_ships_for_every_drafter(drafter):
    from policies.export import default_policy_dir, load_policy, policy_drafter

    d = default_policy_dir(drafter)
    assert policy_drafter(d) == drafter
    policy = load_policy(d)  # checks the feature spec against this version's
    assert policy.max_depth >= 1
    check = json.loads((d / "export_check.json").read_text())
    assert check["agreement"] == 1.0


def test_eval_refuses_a_policy_trained_with_another_drafter(capsys):
    from policies.export import default_policy_dir

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
    from eval.benchmark import build_parser as bench_parser
    from eval.__main__ import build_parser as eval_parser
    from train.__main__ import build_parser as train_parser

    for parser in (bench_parser(), eval_parser(), train_parser()):
        assert parser.parse_args(["--head", "some/dir"]).head == "some/dir"
