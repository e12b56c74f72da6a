"""``python -m eval`` / ``python -m eval.benchmark`` command lines on a tiny trained run (no downloads)."""

from __future__ import annotations

import json

import pytest

import train
from eval.__main__ import main as eval_main
from learn2draft.models import load_pair
from train.config import TrainConfig


@pytest.fixture(scope="module")
def tiny_run(tiny_model_dirs, tmp_path_factory):
    """A training run of the tiny local model directories (as ``python -m train --target DIR --draft DIR``)."""
    out = tmp_path_factory.mktemp("runs") / "tiny"
    pair = load_pair(*tiny_model_dirs)
    cfg = TrainConfig(out=str(out), target=tiny_model_dirs[0], draft=tiny_model_dirs[1], timesteps=64, n_steps=64,
                      batch_size=32, n_epochs=1, max_new_tokens=8, max_depth=3, net_arch=(8,), wandb_mode="disabled",
                      progress_bar=False, checkpoint_every=0, eval_prompts=0, warmup_prompts=1)
    train.run(pair, cfg, prompts=["w1 w2 w3", "w4 w5"])
    return out


@pytest.fixture(scope="module")
def tiny_lookup_run(tiny_model_dirs, tmp_path_factory):
    """A lookup-drafter training run on the tiny target alone (a pair loaded without a draft model)."""
    out = tmp_path_factory.mktemp("runs") / "tiny-lookup"
    pair = load_pair(tiny_model_dirs[0], None)
    cfg = TrainConfig(out=str(out), target=tiny_model_dirs[0], draft=tiny_model_dirs[1], drafter="lookup", timesteps=64,
                      n_steps=64, batch_size=32, n_epochs=1, max_new_tokens=8, max_depth=3, net_arch=(8,),
                      wandb_mode="disabled", progress_bar=False, checkpoint_every=0, eval_prompts=0, warmup_prompts=1)
    train.run(pair, cfg, prompts=["w1 w2 w3 w1 w2", "w4 w5 w4 w5"])
    return out


def test_eval_of_a_lookup_policy_loads_no_draft_model(tiny_lookup_run, tmp_path, monkeypatch):
    """python -m eval with a lookup policy: the speed comparison (its autoregressive row included) and the law
    check run on the target alone."""
    import learn2draft.models

    real, drafts = learn2draft.models.load_pair, []
    monkeypatch.setattr(learn2draft.models, "load_pair", lambda t, d, **k: drafts.append(d) or real(t, d, **k))
    out = tmp_path / "eval"
    assert eval_main(["--policy", str(tiny_lookup_run), "--gammas", "1,2", "--num-train-prompts", "1",
                      "--num-heldout-prompts", "1", "--repeats", "1", "--max-new-tokens", "4", "--device", "cpu",
                      "--law-check", "--law-samples", "10", "--law-tokens", "1", "--law-prompt", "w1 w2",
                      "--out", str(out)]) == 0
    assert drafts == [None]
    res = json.loads((out / "results.json").read_text())
    assert res["drafter"] == "lookup" and "autoregressive" in res["speed"]["methods"] and res["law_check"]["arms"]


def _no_model_loading(monkeypatch):
    import learn2draft.models

    def refuse(*a, **k):
        raise AssertionError("models were loaded")

    monkeypatch.setattr(learn2draft.models, "load_pair", refuse)


def test_skip_speed_without_law_check_is_refused_before_loading(tiny_run, monkeypatch, capsys):
    _no_model_loading(monkeypatch)
    assert eval_main(["--policy", str(tiny_run), "--skip-speed", "--out", str(tiny_run / "e")]) == 2
    err = capsys.readouterr().err
    assert "--law-check" in err and len(err.strip().splitlines()) == 1
    assert not (tiny_run / "e").exists()


def test_eval_prints_only_the_files_it_wrote(tiny_run, tmp_path, capsys):
    out = tmp_path / "eval"
    assert eval_main(["--policy", str(tiny_run), "--skip-speed", "--law-check", "--law-samples", "10",
                      "--law-tokens", "1", "--law-prompt", "w1 w2", "--device", "cpu", "--out", str(out)]) == 0
    line = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("Wrote ")][-1]
    listed = [p.strip() for p in line[len("Wrote "):].rsplit(" in ", 1)[0].split(",")]
    assert listed and all(__import__("pathlib").Path(p).is_file() for p in listed), line
    assert not (out / "results.png").exists() and str(out / "results.png") not in line
    law = json.loads((out / "results.json").read_text())["law_check"]
    assert law["verdict"].startswith("INCONCLUSIVE") and not law["passed"]  # 10 samples: no power


def _capture_load_pair(monkeypatch) -> dict:
    import learn2draft.models

    seen = {}

    def fake_load_pair(target, draft, device="cpu", dtype=None):
        seen.update(target=target, draft=draft, device=device)
        raise ValueError("stop: models would load here")

    monkeypatch.setattr(learn2draft.models, "load_pair", fake_load_pair)
    monkeypatch.setattr(learn2draft.models, "default_device", lambda: "meta")
    return seen


def test_benchmark_uses_the_runs_pair_and_the_common_device_default(tiny_run, tiny_model_dirs, tmp_path,
                                                                     monkeypatch, capsys):
    from eval.benchmark import main as bench_main
    from train.__main__ import build_parser, config_from_args

    seen = _capture_load_pair(monkeypatch)
    assert bench_main(["--policy", str(tiny_run), "--out", str(tmp_path / "b")]) == 2
    assert "stop: models would load here" in capsys.readouterr().err
    assert seen == {"target": tiny_model_dirs[0], "draft": tiny_model_dirs[1], "device": "meta"}
    seen.clear()
    assert eval_main(["--policy", str(tiny_run), "--out", str(tmp_path / "e")]) == 2
    assert seen == {"target": tiny_model_dirs[0], "draft": tiny_model_dirs[1], "device": "meta"}
    assert config_from_args(build_parser().parse_args([])).device == "meta"  # train: the same rule


def test_a_run_records_its_models_as_absolute_paths(tiny_run, tiny_model_dirs):
    cfg = json.loads((tiny_run / "config.json").read_text())
    pcfg = json.loads((tiny_run / "policy" / "policy_config.json").read_text())
    assert cfg["target"] == pcfg["target"] == tiny_model_dirs[0] and cfg["draft"] == pcfg["draft"] == tiny_model_dirs[1]


def test_progress_bars_draw_only_on_a_terminal(tiny_pair, capfd):
    """A log file (stderr not a terminal) gets no carriage-return progress frames: plain lines instead."""
    import torch

    from eval.runner import DecoderMethod, run_interleaved
    from learn2draft.decoding import FixedDepthController
    from learn2draft.sampling import SamplingConfig

    methods = [DecoderMethod(f"g{g}", tiny_pair, FixedDepthController(g), SamplingConfig(), 4) for g in (0, 2)]
    run_interleaved(methods, [torch.tensor([1, 5, 9])], repeats=2, progress=True, desc="bar")
    err = capfd.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith("bar: ")]
    assert "\r" not in err and lines and lines[-1].startswith("bar: 4/4 runs (100%)"), err


def test_one_table_renderer_for_eval_and_benchmark(tiny_run, tmp_path, monkeypatch):
    """Every table of measured runs (eval.runner.summarize output: eval's comparison, the benchmark) is
    eval.runner.methods_table's, with τ's convention stated there: each report holds exactly that block
    and no other "| method |" table. (eval.oracle's replay table — modelled seconds against the hindsight
    oracle, no repeats, no latencies — has none of these columns and renders its own.)"""
    from eval.benchmark import PLAIN
    from eval.benchmark import main as bench_main
    from eval.compare import AR, format_markdown
    from eval.runner import TAU_NOTE, methods_table

    def holds_only(text: str, table: list[str]) -> bool:
        lines = text.splitlines()
        at = [i for i, ln in enumerate(lines) if ln.startswith("| method |")]
        return len(at) == 1 and lines[at[0]: at[0] + len(table)] == table

    row = {"tokens_per_second_mean": 10.0, "tokens_per_second_std": 0.5, "tau_mean": 1.5, "alpha": 0.5,
           "overhead_fraction_mean": 0.01, "ttft_seconds_mean": 0.1, "inter_token_seconds_mean": 0.04}
    methods = {AR: {**row, "tau_mean": None, "ratio_to_autoregressive": {"mean": 1.0, "min": 1.0, "max": 1.0}},
               "policy": {**row, "ratio_to_autoregressive": {"mean": 1.2, "min": 1.1, "max": 1.3}}}
    grid = {"tokens_per_second": {1: 9.0}}
    res = {"num_heldout_prompts": 1, "repeats": 2, "max_new_tokens": 4, "sampling": {"temperature": 0.0},
           "methods": methods, "grid_train": grid, "grid_heldout": grid, "policy": "policy", "verdicts": {}}
    assert holds_only(format_markdown(res), methods_table(methods, AR))  # python -m eval's results.md
    out = tmp_path / "bench"
    import learn2draft.models as M

    # auto's timing, fixed: a real one can read either side of a near-tie twice in one test (bf16 clearly faster here)
    monkeypatch.setattr(M, "bf16_forward_timing",
                        lambda threads=None, rows=(1, 9), trial=0: {"speedup": 1.3, "min_speedup": 1.1})
    argv = ["--policy", str(tiny_run), "--temperatures", "0", "--num-prompts", "1", "--repeats", "1",
            "--max-new-tokens", "4", "--gammas", "1", "--device", "cpu", "--out", str(out)]
    assert bench_main(argv) == 0
    from eval.benchmark import build_parser as bench_parser
    from learn2draft.settings import RunSettings

    report = json.loads((out / "benchmark.json").read_text())
    # --dtype auto, resolved at the run's forward widths and recorded for every method
    args = bench_parser().parse_args(argv)
    assert report["dtype"] == RunSettings.resolve(device=args.device, dtype=args.dtype).dtype == "bfloat16"
    measured = report["runs"]["0.0"]["methods"]
    assert holds_only((out / "benchmark.md").read_text(), methods_table(measured, PLAIN))
    summary = {"a": {**row, "ratio_to_ref": {"mean": 1.2, "min": 1.1, "max": 1.3}}}
    lines = methods_table(summary, "ref")
    assert lines[0].startswith("| method |") and "× ref" in lines[0] and lines[-1] == TAU_NOTE
    assert lines[2] == "| a | 10.0 ± 0.5 | 1.20 (1.10–1.30) | 1.50 | 0.50 | 100 | 40.0 | 1.0% |"
    assert "bonus token excluded" in TAU_NOTE


# --------------------------------------------------------------------------------- trees
def _fake_tree_policy_module(monkeypatch, depth: int = 2, size: int = 3):
    """Replaces policies.load.load_tree_policy (the real module stays importable) with one that returns
    a fixed (depth, V) controller, so eval's tree rows run without training tree policies."""
    import policies.load
    from learn2draft.tree import FixedTreeController

    monkeypatch.setattr(policies.load, "load_tree_policy", lambda path: FixedTreeController(depth, size))


@pytest.mark.parametrize("argv, message", [
    (["--tree-policy", "x"], "add --tree"),
    (["--width", "2"], "add --tree"),
    (["--tree", "--width", "0"], "--tree-width must be ≥ 1"),
    (["--tree", "--tree-top-k", "0"], "--tree-top-k must be ≥ 1"),
    (["--tree", "--tree-depths", "0"], "--tree-depths '0'"),
    (["--tree", "--verify-sizes", "a"], "--verify-sizes 'a'"),
    (["--tree", "--tree-policy", "/no/such/tree"], "--tree-policy /no/such/tree: no such directory"),
])
def test_bad_tree_flags_are_refused_before_loading(tiny_run, monkeypatch, capsys, argv, message):
    from eval.benchmark import main as bench_main

    _no_model_loading(monkeypatch)
    for main in (eval_main, bench_main):
        assert main(["--policy", str(tiny_run), *argv]) == 2
        err = capsys.readouterr().err
        assert message in err and len(err.strip().splitlines()) == 1, err


def test_trees_with_the_lookup_drafter_are_refused(monkeypatch, capsys):
    from eval.benchmark import main as bench_main
    from policies.layout import default_policy_dir

    _no_model_loading(monkeypatch)
    for main in (eval_main, bench_main):
        assert main(["--policy", str(default_policy_dir("lookup")), "--tree"]) == 2
        err = capsys.readouterr().err
        assert "lookup drafter drafts no trees" in err and "--drafter head" in err


def test_eval_tree_runs_the_grid_and_the_tree_rows(tiny_run, tmp_path, monkeypatch, capsys):
    """python -m eval --tree on the tiny run: the (depth, V) grid on the training prompts, the best
    fixed tree and the learned tree (a stand-in) in the held-out table, JSON and plot, and the law
    check with tree arms."""
    _fake_tree_policy_module(monkeypatch)
    (tmp_path / "tree-policy").mkdir()
    out = tmp_path / "eval"
    assert eval_main(["--policy", str(tiny_run), "--tree", "--tree-policy", str(tmp_path / "tree-policy"),
                      "--tree-depths", "1,2", "--verify-sizes", "2,3", "--width", "2", "--tree-top-k", "2",
                      "--gammas", "1,2", "--num-train-prompts", "1", "--num-heldout-prompts", "1", "--repeats", "2",
                      "--max-new-tokens", "4", "--device", "cpu", "--law-check", "--law-samples", "10",
                      "--law-tokens", "2", "--law-prompt", "w1 w2", "--out", str(out)]) == 0
    res = json.loads((out / "results.json").read_text())
    speed = res["speed"]
    assert set(speed["grid_tree_train"]["tokens_per_second"]) == {"depth=1,V=2", "depth=2,V=2", "depth=2,V=3"}
    assert speed["tree"] == {"width": 2, "top_k": 2} and speed["tree_policy"] == "learned tree"
    assert {speed["tree_fixed"], "learned tree"} <= set(speed["methods"])
    md = (out / "results.md").read_text()
    assert f"| {speed['tree_fixed']} |" in md and "| learned tree |" in md and "learned tree vs autoregressive" in md
    assert (out / "results.png").is_file()
    law = res["law_check"]
    d, v = speed["tree_train"]
    assert set(law["trees"]) == {f"fixed tree depth={d}, V={v}", "learned tree"}
    assert {a["arm"] for a in law["arms"]} >= set(law["trees"]) | {"learned policy"}
    assert "Tree arms" in md


def test_benchmark_tree_rows_on_the_tiny_run(tiny_run, tmp_path, monkeypatch):
    """python -m eval.benchmark --tree: the best fixed tree (chosen on the training prompts) and the
    learned tree are measured in the same interleaved run as the other rows."""
    from eval.benchmark import main as bench_main

    _fake_tree_policy_module(monkeypatch)
    (tmp_path / "tp").mkdir()
    out = tmp_path / "bench"
    assert bench_main(["--policy", str(tiny_run), "--tree", "--tree-policy", str(tmp_path / "tp"), "--tree-depths",
                       "1,2", "--verify-sizes", "2", "--width", "2", "--tree-top-k", "2", "--temperatures", "0",
                       "--num-prompts", "1", "--repeats", "1", "--max-new-tokens", "4", "--gammas", "1",
                       "--device", "cpu", "--out", str(out)]) == 0
    rep = json.loads((out / "benchmark.json").read_text())
    run = rep["runs"]["0.0"]
    d, v = run["fixed_tree"]
    assert (d, v) in {(1, 2), (2, 2)} and run["tree_grid"]["best"] == [d, v]
    rows = set(run["methods"])
    assert {f"model: fixed tree depth={d}, V={v}", "model: learned tree", "hf generate",
            "model: learned policy"} <= rows
    assert rep["tree"] == {"width": 2, "top_k": 2, "tree_policy": str(tmp_path / "tp")}
    assert "| model: learned tree |" in (out / "benchmark.md").read_text()


def test_record_refuses_to_replace_an_existing_trace_without_overwrite(tmp_path, capsys):
    """python -m eval.record with an --out that already holds a trace is one error line naming the file and
    --overwrite, before any model loads, and the file is left as it was."""
    from eval.record import main as record_main

    out = tmp_path / "lk.npz"
    out.write_bytes(b"an earlier trace")
    assert record_main(["--drafter", "lookup", "--num-prompts", "1", "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert str(out) in err and "--overwrite" in err and "Loading" not in err
    assert out.read_bytes() == b"an earlier trace"


def test_record_workers_refuses_an_address_where_no_ray_cluster_answers():
    """--address HOST:PORT is checked with a plain TCP connection before Ray starts (Ray itself retries for
    ever): a closed port and a malformed address are each one ValueError naming --address."""
    from eval.distributed import _check_reachable

    with pytest.raises(ValueError, match="--address 127.0.0.1:1: no Ray cluster answers there"):
        _check_reachable("127.0.0.1:1", timeout=2.0)
    with pytest.raises(ValueError, match="give HOST:PORT"):
        _check_reachable("bogus")


# --------------------------------------------------------------------------------- mixed prompts, header, verdicts
def _mt_bench_file(tmp_path):
    rows = [{"question_id": 1, "category": "code", "turns": ["w1 w2 w3", "ignored"]},
            {"question_id": 2, "category": "extraction", "language": "it", "turns": ["w4 w5"]}]
    path = tmp_path / "questions.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return path


def test_benchmark_reports_per_category_a_header_and_verdicts(tiny_run, tmp_path):
    """eval.benchmark --prompts on an MT-bench file: per-category and per-language tables, the header (models and
    revisions, libraries, hardware, load before and after, prompt distribution) and the verdict lines, in the
    report and its JSON; a claim that ran is judged (PASS or FAIL: the copy claims, on the one extraction prompt);
    the best fixed configuration in hindsight is chosen among every fixed arm measured, HF's included, and the one
    a user would pick is chosen on the validation prompts; a verdict on 2 prompts × 4 tokens says it is indicative."""
    from eval.benchmark import main as bench_main

    out = tmp_path / "bench"
    assert bench_main(["--policy", str(tiny_run), "--prompts", str(_mt_bench_file(tmp_path)), "--temperatures", "0",
                       "--num-prompts", "2", "--repeats", "1", "--max-new-tokens", "4", "--gammas", "1",
                       "--device", "cpu", "--out", str(out)]) == 0
    report = json.loads((out / "benchmark.json").read_text())
    h = report["header"]
    assert h["prompts"]["categories"] == {"code": 1, "extraction": 1} and h["prompts"]["languages"] == {"en": 1,
                                                                                                       "it": 1}
    assert h["models"]["target"]["revision"].startswith("sha256 ") and "draft" in h["models"]
    assert len(h["load_average"]["before"]) == 3 and len(h["load_average"]["after"]) == 3
    run = report["runs"]["0.0"]
    assert set(run["groups"]["category"]) == {"code", "extraction"} and set(run["groups"]["language"]) == {"en", "it"}
    assert run["copy_prompts"] == 1 and run["copy_summary"]["hf generate"]["runs"] == 1
    verdicts = {v["claim"]: v for v in report["verdicts"]}
    assert verdicts["learned ≥ 1.05× best hand rule"]["temperature"] == "0.0"  # T>0 did not run: judged at T=0 only
    assert verdicts["copy prompts: learned ≥ 1.15× HF prompt lookup"]["verdict"] in ("PASS", "FAIL")
    md = (out / "benchmark.md").read_text()
    assert md.startswith("## Run") and "Per category" in md and "| extraction |" in md and "Per language" in md
    assert "## Verdicts" in md and "Indicative only: 2 prompts × 4 new tokens" in md
    roles = run["roles"]
    assert {"hf prompt lookup (10)", "hf assisted (default)", "hf assisted (heuristic)", "model: fixed γ=1"} == set(
        roles["best_fixed"]) == set(run["test_arms"])
    assert roles["chosen_fixed"] == run["validation"]["chosen"] in run["validation"]["tokens_per_second"]
    assert run["best_fixed_in_hindsight"] in roles["best_fixed"]
    best = next(v for v in report["verdicts"] if v["claim"].startswith("learned ≥ 1.10× best fixed"))
    assert best["against"] == run["best_fixed_in_hindsight"]


def test_eval_reports_per_category_and_a_header(tiny_run, tmp_path):
    out = tmp_path / "eval"
    assert eval_main(["--policy", str(tiny_run), "--prompts", str(_mt_bench_file(tmp_path)), "--num-train-prompts",
                      "1", "--repeats", "1", "--max-new-tokens", "4", "--gammas", "1", "--device", "cpu", "--out",
                      str(out)]) == 0
    results = json.loads((out / "results.json").read_text())
    assert set(results["speed"]["groups"]["category"]) == {"code", "extraction"}
    assert results["header"]["prompts"]["total"] == 2 and results["header"]["load_average"]["after"]
    md = (out / "results.md").read_text()
    assert md.startswith("## Run") and "Per category" in md and "Per language" in md


@pytest.mark.parametrize("module", ["eval", "eval.benchmark"])
def test_a_bad_mt_bench_file_is_refused_before_the_models_load(tiny_run, tmp_path, monkeypatch, capsys, module):
    import learn2draft.models
    from eval.benchmark import main as bench_main

    monkeypatch.setattr(learn2draft.models, "load_pair", lambda *a, **k: pytest.fail("models loaded"))
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"question_id": 1, "category": "code", "turns": ["ok"]}\n{"question_id": 2, "turns": []}\n')
    main = eval_main if module == "eval" else bench_main
    assert main(["--policy", str(tiny_run), "--prompts", str(bad), "--device", "cpu", "--out",
                 str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err
    assert "bad.jsonl:2: 'turns' must be a non-empty list" in err and "Traceback" not in err


def test_benchmark_test_arms_keeps_the_fastest_on_validation_and_hf_arms(tiny_run, tmp_path):
    """--test-arms 1: on the test prompts the fastest fixed arm on validation runs (it is the chosen one and the model
    drafter's fastest), with HF's fixed arms; the other γ of the grid do not."""
    from eval.benchmark import main as bench_main

    out = tmp_path / "bench"
    assert bench_main(["--policy", str(tiny_run), "--temperatures", "0", "--num-prompts", "1", "--validation-prompts",
                       "1", "--repeats", "1", "--max-new-tokens", "4", "--gammas", "1,2,3", "--test-arms", "1",
                       "--device", "cpu", "--out", str(out)]) == 0
    run = json.loads((out / "benchmark.json").read_text())["runs"]["0.0"]
    val = run["validation"]["tokens_per_second"]
    fixed = {f"model: fixed γ={g}" for g in (1, 2, 3)}
    assert fixed <= set(val) and run["validation"]["chosen"] == max(val, key=val.get)
    fastest = max(fixed, key=val.get)
    hf = {"hf prompt lookup (10)", "hf assisted (default)", "hf assisted (heuristic)"}
    assert set(run["test_arms"]) == hf | {fastest} | {run["validation"]["chosen"]}
    assert not (fixed - {fastest}) & set(run["methods"])
    assert run["fixed_gamma"] == int(fastest.rsplit("=", 1)[1])


@pytest.mark.parametrize("argv, message", [
    (["--num-prompts", "0"], "--num-prompts must be ≥ 1, got 0"),
    (["--repeats", "0"], "--repeats must be ≥ 1, got 0"),
    (["--validation-prompts", "0"], "--validation-prompts must be ≥ 1, got 0"),
    (["--test-arms", "-1"], "--test-arms must be ≥ 0"),
    (["--heldout-split", "nosuch"], "--heldout-split 'nosuch'"),
    (["--lookup-min-ngrams", "5"], "--lookup-min-ngrams '5'"),
    (["--lookup-min-ngrams", "0"], "--lookup-min-ngrams '0'"),
])
def test_bad_benchmark_flags_are_one_line_naming_the_flag_before_loading(tiny_run, monkeypatch, capsys, argv,
                                                                          message):
    from eval.benchmark import main as bench_main

    _no_model_loading(monkeypatch)
    assert bench_main(["--policy", str(tiny_run), *argv]) == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1, err


def test_overwrite_keeps_the_earlier_results_until_the_new_ones_are_written(tmp_path):
    """--overwrite moves an earlier run's results aside; an interrupted run leaves them in previous-run/, a finished
    one removes that folder (no earlier result is lost before this run's exist)."""
    from eval.__main__ import PREVIOUS_RUN_DIR, _settle_previous_run, make_out_dir

    out = tmp_path / "bench"
    out.mkdir()
    for name in ("a.md", "a.json"):
        (out / name).write_text("earlier")
    make_out_dir(out, ("a.md", "a.json"), overwrite=True)
    assert not (out / "a.md").exists() and (out / PREVIOUS_RUN_DIR / "a.md").read_text() == "earlier"
    _settle_previous_run(out, ("a.md", "a.json"))  # interrupted: nothing new written
    assert (out / PREVIOUS_RUN_DIR / "a.json").read_text() == "earlier"
    for name in ("a.md", "a.json"):
        (out / name).write_text("new")
    _settle_previous_run(out, ("a.md", "a.json"))
    assert not (out / PREVIOUS_RUN_DIR).exists() and (out / "a.md").read_text() == "new"


def test_an_interrupted_runs_partial_file_never_replaces_the_complete_results_kept(tmp_path, monkeypatch):
    """A finished run (A), then an --overwrite run (B) interrupted after writing its partial file, then another
    --overwrite run (C) interrupted before writing anything: A's complete results stay in previous-run/ (moving B's
    partial file there deleted them), beside B's partial file; a fourth --overwrite run that writes every result
    removes previous-run/ at exit, though it found no earlier file in --out itself."""
    import atexit

    from eval.__main__ import PREVIOUS_RUN_DIR, _settle_previous_run, make_out_dir

    registered = []
    monkeypatch.setattr(atexit, "register", lambda f, *a: registered.append((f, a)))
    results, partial = ("a.json", "a.md"), ("a-partial.json",)
    out = tmp_path / "serve"
    out.mkdir()
    for name in results:
        (out / name).write_text("A")
    make_out_dir(out, results, overwrite=True, partial=partial)  # B starts: A moves aside
    (out / "a-partial.json").write_text("B")  # B is interrupted after its first pass
    make_out_dir(out, results, overwrite=True, partial=partial)  # C starts, and is interrupted at once
    keep = out / PREVIOUS_RUN_DIR
    assert sorted(p.name for p in keep.iterdir()) == ["a-partial.json", "a.json", "a.md"]
    assert (keep / "a.json").read_text() == "A" and (keep / "a-partial.json").read_text() == "B"
    assert not any((out / n).exists() for n in (*results, *partial))
    registered.clear()
    make_out_dir(out, results, overwrite=True, partial=partial)  # D: nothing earlier in --out, previous-run/ there
    assert registered and registered[-1][0] is _settle_previous_run
    for name in results:
        (out / name).write_text("D")
    _settle_previous_run(*registered[-1][1])
    assert not keep.exists() and (out / "a.json").read_text() == "D"
