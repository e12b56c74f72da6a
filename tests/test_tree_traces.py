"""Draft-tree traces (issue 10, item 1 for trees) and the tree oracle.

* At temperature 0 the recorded accepted length τ(d, V) of every position equals what a real
  :class:`TreeSpeculativeDecoder` run with ``FixedTreeController(d, V)`` accepts, cycle by cycle
  (also its depth and verified node count), for the model and the head drafter.
* Files: save/load round trip; a tree file is refused by the chain loader and a chain file by the
  tree loader; T > 0 and the lookup drafter are refused with a clear message.
* Tree costs in latency profiles: ``tree_level_seconds`` round trip, fallback to the chain step,
  extrapolated verification past the table.
* The tree oracle: its dynamic program equals a brute-force search over every action sequence, and
  the rate of a fixed (d, V) equals a direct hand computation from τ and the profile.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from helpers_loop import drafter_for

from eval.oracle import format_tree_report, tree_evaluate, tree_oracle_prompt, tree_oracle_report
from learn2draft.drafters import make_drafter
from learn2draft.replay.latency import DrafterCost, LatencyProfile, load_profile
from learn2draft.replay.outcome import tree_replay_data
from learn2draft.replay.traces import TraceSet, TreeTraceSet, load_tree_traces, trace_structure
from learn2draft.sampling import SamplingConfig
from learn2draft.traces import record_traces, record_tree_traces
from learn2draft.tree import FixedTreeController, TreeSpeculativeDecoder

PROMPTS = ["w1 w2 w3 w4", "w5 w6 w5 w6 w5", "w7 w8 w9 w10 w11", "w12", "w13 w14 w15 w13 w14"]
N, D, W, K = 14, 3, 2, 3  # max_new_tokens, max_depth, tree width, top-k of the tiny traces
VS = (1, 2, 4, 8, 64)  # verification sizes (64 > every tree here: "all nodes")

# Linear costs (interpolation exact), distinct per part, in seconds.
V1, V_TOK, V_CTX, STEP, TREE_LEVEL, STEP_OV, CYCLE_OV = 0.010, 0.0005, 1e-5, 0.003, 0.004, 0.0002, 0.001


def linear_profile(tree_level: bool = True) -> LatencyProfile:
    tokens, contexts = [1, 2, 4, 8], [0.0, 64.0]
    table = [[V1 + V_TOK * (n - 1) + V_CTX * c for n in tokens] for c in contexts]
    tl = {"contexts": [0.0], "seconds": [TREE_LEVEL], "width": W, "top_k": K} if tree_level else None
    costs = {d: DrafterCost([0.0], [STEP], STEP_OV, CYCLE_OV, {}, tl) for d in ("model", "head")}
    return LatencyProfile("linear-tree-test", tokens, contexts, table, costs, machine={"cpu": "test"}, source="tests")


_TRACES: dict = {}


def tree_traces(pair, drafter: str) -> TreeTraceSet:
    if drafter not in _TRACES:
        _TRACES[drafter] = record_tree_traces(pair, drafter_for(drafter, pair), PROMPTS, SamplingConfig(),
                                              max_new_tokens=N, max_depth=D, verify_sizes=VS, width=W, top_k=K,
                                              seed=3, progress=False)
    return _TRACES[drafter]


# ------------------------------------------------------------------ recorded τ(d, V) = a real run
@pytest.mark.parametrize("drafter", ["model", "head"])
def test_recorded_tree_accepted_lengths_match_a_real_run(noisy_pair, drafter):
    """At T=0 the committed text is the greedy output whatever (d, V); the trace predicts, for every cycle of a real
    fixed-tree run, its depth, its verified node count and its accepted length."""
    pair, tr = noisy_pair, tree_traces(noisy_pair, drafter)
    assert tr.header["greedy_inconsistencies"] == 0
    assert tr.header["structure"] == tr.header["kind"] == "tree"
    taus = np.concatenate([pt.tau[1:pt.n, 1:] for pt in tr.prompts])
    assert taus.max() >= (2 if drafter == "model" else 1) and (taus == 0).any()  # acceptances and rejections
    if drafter == "model":  # (the untrained tiny head rarely agrees with the target)
        assert (taus[:, :, 0] != taus[:, :, -1]).any()  # V matters: a wider verification accepts more somewhere
    checked = 0
    for d, V in [(0, 4), (1, 1), (1, 64), (2, 2), (2, 4), (3, 1), (3, 4), (3, 8), (3, 64)]:
        s = VS.index(V)
        dec = TreeSpeculativeDecoder(pair, max_new_tokens=N, max_depth=D, drafter=drafter_for(drafter, pair), width=W,
                                     top_k=K)
        for i, pt in enumerate(tr.prompts):
            g = dec.generate(torch.as_tensor(pt.prompt_ids), FixedTreeController(d, V), seed=i)
            assert g.tokens == pt.output.tolist()
            nodes = pt.nodes_up_to()
            t = 1
            for c in g.cycles:
                de = min(d, int(pt.tree_depth[t]))
                expected = (de, min(V, int(nodes[t, de])), min(int(pt.tau[t, d, s]), pt.n - t))
                assert (c.depth, c.verify_size, c.num_accepted) == expected, (d, V, i, t)
                t += len(c.tokens)
                checked += de > 0
            assert t == pt.n
    assert checked > 100


def test_tree_trace_structure(noisy_pair):
    tr = tree_traces(noisy_pair, "model")
    for pt in tr.prompts:
        assert pt.tree_depth[0] == pt.tree_depth[pt.n] == 0
        t = np.arange(pt.n + 1)
        assert np.array_equal(pt.tree_depth[1:pt.n], np.minimum(D, N - t[1:pt.n] - 1))
        assert (pt.level_nodes[1:pt.n, 0][pt.tree_depth[1:pt.n] > 0] == K).all()  # level 1: the root's k children
        assert (pt.level_nodes <= W * K).all() and (pt.tau[:, 0] == 0).all()
        # τ never exceeds the depth drafted, and a larger V never verifies fewer nodes of the same tree
        assert (pt.tau[1:pt.n, 1:] <= np.arange(1, D + 1)[None, :, None]).all()


# ------------------------------------------------------------------ files and refusals
def test_tree_trace_round_trip_and_kind_refusals(noisy_pair, tmp_path):
    tr = tree_traces(noisy_pair, "head")
    path = tr.save(tmp_path / "tree")
    assert path.suffix == ".npz" and path.with_suffix(".json").is_file() and trace_structure(path) == "tree"
    back = TreeTraceSet.load(path)
    assert back.verify_sizes == list(VS) and (back.width, back.top_k, back.max_depth) == (W, K, D)
    assert back.drafter == "head" and back.header["format_version"] == 1
    for a, b in zip(tr.prompts, back.prompts):
        for k in ("prompt_ids", "output", "tree_depth", "level_nodes", "tau"):
            np.testing.assert_array_equal(getattr(a, k), getattr(b, k))
        assert a.ended_by_eos == b.ended_by_eos
    assert len(load_tree_traces(f"{path},{path}")) == 2 * len(tr)
    with pytest.raises(ValueError, match="draft-tree traces.*record them without --tree.*TreeTraceSet.load"):
        TraceSet.load(path)
    from envs.replay import SpecDecodeReplayEnv

    with pytest.raises(ValueError, match="replays chain traces"):
        SpecDecodeReplayEnv(back, "gpu-like")
    chain = record_traces(noisy_pair, make_drafter("model", noisy_pair), PROMPTS[:1], SamplingConfig(),
                          max_new_tokens=4, max_depth=2, progress=False).save(tmp_path / "chain")
    assert trace_structure(chain) == "chain"
    with pytest.raises(ValueError, match="not draft-tree traces"):
        TreeTraceSet.load(chain)
    data = dict(np.load(path))
    header = json.loads(str(data["header"]))
    data["header"] = np.array(json.dumps({**header, "format_version": 7}))
    np.savez(tmp_path / "bad.npz", **data)
    with pytest.raises(ValueError, match="tree trace format version 7"):
        TreeTraceSet.load(tmp_path / "bad.npz")
    data["header"] = np.array(json.dumps(header))
    tau = data["tau"]
    data["tau"] = tau[:, :2]
    np.savez(tmp_path / "bad.npz", **data)
    with pytest.raises(ValueError, match="inconsistent array shapes"):
        TreeTraceSet.load(tmp_path / "bad.npz")
    data["tau"] = -tau - 1  # impossible accepted lengths (replaying them would never advance): refused
    np.savez(tmp_path / "bad.npz", **data)
    with pytest.raises(ValueError, match="accepted lengths outside"):
        TreeTraceSet.load(tmp_path / "bad.npz")
    data["tau"] = tau
    data["header"] = np.array(json.dumps({**header, "verify_sizes": header["verify_sizes"][::-1]}))
    np.savez(tmp_path / "bad.npz", **data)
    with pytest.raises(ValueError, match="increasing"):
        TreeTraceSet.load(tmp_path / "bad.npz")
    (tmp_path / "trunc.npz").write_bytes(path.read_bytes()[:300])
    with pytest.raises(ValueError, match="not a learn2draft trace file"):
        TreeTraceSet.load(tmp_path / "trunc.npz")


def test_t_positive_and_lookup_are_refused(noisy_pair, capsys):
    from eval.record import main as record_main

    with pytest.raises(ValueError, match="temperature 0 only.*residual law"):
        record_tree_traces(noisy_pair, make_drafter("model", noisy_pair), PROMPTS[:1], SamplingConfig(temperature=0.7),
                           max_new_tokens=4, max_depth=2)
    with pytest.raises(ValueError, match="drafts no trees"):
        record_tree_traces(noisy_pair, make_drafter("lookup", noisy_pair), PROMPTS[:1], SamplingConfig(),
                           max_new_tokens=4, max_depth=2)
    with pytest.raises(ValueError, match="verify_sizes"):
        record_tree_traces(noisy_pair, make_drafter("model", noisy_pair), PROMPTS[:1], SamplingConfig(),
                           max_new_tokens=4, max_depth=2, verify_sizes=(4, 2))
    # The command refuses before loading any model.
    for argv, match in ((["--tree", "--temperature", "0.7"], "residual law"), (["--tree", "--drafter", "lookup"],
                        "drafts no trees"), (["--tree", "--verify-sizes", "0,4"], "--verify-sizes"),
                        (["--tree-width", "2"], "only apply to draft trees: add --tree"),
                        (["--tree", "--out", "/proc/no/x.npz"], "cannot write there")):
        assert record_main(argv) == 2
        assert match in capsys.readouterr().err


# ------------------------------------------------------------------ tree costs in profiles
def test_profile_tree_level_round_trip_and_fallback(tmp_path):
    p = linear_profile()
    back = load_profile(p.save(tmp_path / "p.json"))
    assert back.has_tree_level("head") and back.tree_level("head", 30.0) == pytest.approx(TREE_LEVEL)
    assert back.cost("head").tree_level["width"] == W
    # d·(tree_level + step overhead) + verify(V + 1) + cycle overhead, by hand
    assert back.tree_cycle_seconds("head", 20.0, 3, 5) == pytest.approx(
        3 * (TREE_LEVEL + STEP_OV) + V1 + V_TOK * 5 + V_CTX * 20 + CYCLE_OV)
    # past the table (8 tokens): linear with the slope of its upper half
    assert back.verify(12, 0.0, extrapolate=True) == pytest.approx(V1 + V_TOK * 11)
    with pytest.raises(ValueError, match="tabulates verification"):
        back.verify(12, 0.0)
    plain = linear_profile(tree_level=False)
    assert not plain.has_tree_level("model") and plain.tree_level("model", 10.0) == pytest.approx(STEP)
    assert "tree_level_seconds" not in load_profile(plain.save(tmp_path / "q.json")).to_dict()["drafters"]["model"]
    data = json.loads((tmp_path / "p.json").read_text())
    data["drafters"]["head"]["tree_level_seconds"] = {"contexts": [0.0, 1.0], "seconds": [0.1]}
    (tmp_path / "bad.json").write_text(json.dumps(data))
    with pytest.raises(ValueError, match="tree_level_seconds"):
        load_profile(tmp_path / "bad.json")
    gpu, cpu = load_profile("gpu-like"), load_profile("cpu-2core")
    for d in ("model", "head"):
        assert gpu.has_tree_level(d) and gpu.tree_level(d, 500.0) == pytest.approx(gpu.draft_step(d, 500.0))
        assert not cpu.has_tree_level(d)  # measured profile left as it was: falls back to the step cost


# ------------------------------------------------------------------ the tree oracle
def hand_cycle(pt, t: int, d: int, V: int, n: int, max_new: int = N) -> tuple[float, int]:
    """(seconds, tokens emitted) of a cycle at t with FixedTreeController(d, V), from the trace and the linear
    profile's formula, written out by hand."""
    de = min(d, int(pt.tree_depth[t]), max(max_new - t - 1, 0))
    verified = min(V, int(pt.level_nodes[t, :de].sum()))
    tau = int(pt.tau[t, de, VS.index(V)]) if de else 0
    seconds = de * (TREE_LEVEL + STEP_OV) + (V1 + V_TOK * verified + V_CTX * (pt.prompt_len + t)) + CYCLE_OV
    return seconds, min(tau + 1, n - t)


def brute_force_seconds(pt, actions, n: int, max_new: int) -> float:
    """The least total seconds over every sequence of actions (exhaustive search, no memo)."""
    best, stack = np.inf, [(1, 0.0)]
    while stack:
        t, total = stack.pop()
        if t >= n:
            best = min(best, total)
            continue
        for d, V in actions:
            sec, e = hand_cycle(pt, t, d, V, n, max_new)
            stack.append((t + e, total + sec))
    return best


def test_tree_oracle_equals_brute_force_and_beats_every_fixed_tree(noisy_pair):
    tr = tree_traces(noisy_pair, "model")
    prof = linear_profile()
    sizes = [1, 4]
    actions = [(0, 1)] + [(d, v) for d in (1, 2) for v in sizes]
    found_tree_cycle = False
    for pt in tr.prompts:
        n = min(pt.n, 7)
        r = tree_replay_data(pt, prof, "model", VS, max_depth=2, max_new_tokens=7, recorded_max_new_tokens=N)
        sub = [a for a, (d, v) in enumerate(r.actions) if d == 0 or v in sizes]
        r.seconds, r.emitted = r.seconds[:, sub], r.emitted[:, sub]  # restrict the DP to the brute force's actions
        r.actions = [r.actions[a] for a in sub]
        best, choice = tree_oracle_prompt(r)
        assert best == pytest.approx(brute_force_seconds(pt, actions, n, 7), rel=1e-12)
        assert best == pytest.approx(tree_evaluate(r, lambda t, choice=choice: choice[t]), rel=1e-12)
        for a in range(len(r.actions)):
            assert best <= tree_evaluate(r, lambda t, a=a: a) + 1e-12
        found_tree_cycle |= bool(any(r.actions[choice[t]][0] > 0 for t in range(1, r.n)))
    assert found_tree_cycle  # the oracle does use trees here (cheap levels, some acceptances)


@pytest.mark.parametrize("d,V", [(1, 2), (2, 4), (3, 64)])
def test_fixed_tree_rate_equals_a_hand_computation(noisy_pair, d, V):
    tr = tree_traces(noisy_pair, "head")
    prof = linear_profile()
    rep = tree_oracle_report(tr, prof)
    tokens = seconds = 0.0
    for pt in tr.prompts:
        t = 1
        while t < pt.n:
            sec, e = hand_cycle(pt, t, d, V, pt.n)
            seconds += sec
            t += e
        tokens += pt.n
    m = rep["methods"][f"fixed tree d={d}, V={V}"]
    assert m["tokens_per_s"] == pytest.approx(tokens / seconds, rel=1e-12)
    ar = sum(pt.n for pt in tr.prompts) / sum(V1 + V_CTX * (pt.prompt_len + t) + CYCLE_OV
                                              for pt in tr.prompts for t in range(1, pt.n))
    assert rep["methods"]["autoregressive (d=0)"]["tokens_per_s"] == pytest.approx(ar, rel=1e-12)
    o = rep["methods"]["oracle (hindsight DP)"]["tokens_per_s"]
    assert all(x["tokens_per_s"] <= o * (1 + 1e-12) for x in rep["methods"].values())
    assert rep["grid"][d][V] == pytest.approx(m["tokens_per_s"])
    text = format_tree_report(rep)
    assert "| oracle (hindsight DP) |" in text and "V=64" in text and "measured at the traces' shape" in text
    fallback = tree_oracle_report(tr, linear_profile(tree_level=False))
    assert any("no tree_level_seconds" in note for note in fallback["notes"])


# ------------------------------------------------------------------ commands
def test_record_tree_profile_tree_level_and_oracle_commands(tiny_model_dirs, tmp_path, capsys):
    from eval.oracle import main as oracle_main
    from eval.profile import main as profile_main
    from eval.record import main as record_main

    target, draft = tiny_model_dirs
    trace = tmp_path / "tree.npz"
    assert record_main(["--target", target, "--draft", draft, "--drafter", "model", "--tree", "--num-prompts", "2",
                        "--max-new-tokens", "8", "--max-depth", "2", "--verify-sizes", "1,4,64", "--tree-width", "2",
                        "--tree-top-k", "2", "--device", "cpu", "--out", str(trace)]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["prompts"] == 2 and summary["greedy_inconsistencies"] == 0
    tr = TreeTraceSet.load(trace)
    assert tr.verify_sizes == [1, 4, 64] and tr.header["machine"]["cores"] and tr.header["prompt_source"] == "train"
    prof = tmp_path / "prof.json"
    assert profile_main(["--target", target, "--draft", draft, "--drafter", "model", "--contexts", "8,16",
                         "--tokens", "1,2,4,8", "--repeats", "1", "--draft-steps", "2", "--overhead-prompts", "1",
                         "--overhead-tokens", "6", "--tree-width", "2", "--tree-top-k", "2", "--device", "cpu",
                         "--out", str(prof)]) == 0
    p = load_profile(prof)
    tl = p.cost("model").tree_level
    assert tl["width"] == 2 and tl["top_k"] == 2 and len(tl["seconds"]) == 2 and min(tl["seconds"]) > 0
    capsys.readouterr()
    assert oracle_main([str(trace), "--profile", str(prof), "--json", str(tmp_path / "rep.json")]) == 0
    text = capsys.readouterr().out
    assert "Tree replay" in text and "autoregressive (d=0)" in text and "(best fixed tree)" in text
    assert json.loads((tmp_path / "rep.json").read_text())["structure"] == "tree"
    assert oracle_main([str(trace), "--profile", str(prof), "--policy", str(tmp_path)]) == 2
    assert "not built" in capsys.readouterr().err


def test_profile_tree_flags_are_checked_before_measuring(capsys):
    from eval.profile import main as profile_main

    for argv, match in ((["--tree-top-k", "2"], "add --tree-width"),
                        (["--drafter", "lookup", "--tree-width", "4"], "draft no trees")):
        assert profile_main(argv) == 2
        assert match in capsys.readouterr().err


def test_ctrl_c_in_a_command_is_one_line_and_exit_130(capsys):
    import argparse

    from learn2draft.cli import run_cli

    def interrupted(args):
        raise KeyboardInterrupt

    assert run_cli(argparse.ArgumentParser(prog="python -m eval.record"), interrupted, []) == 130
    err = capsys.readouterr().err
    assert err.startswith("python -m eval.record: interrupted") and "Traceback" not in err
