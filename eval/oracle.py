"""``python -m eval.oracle``: how far a depth policy is from the best possible one, in replay.

From traces (learn2draft.replay.traces) and a latency profile (learn2draft.replay.latency), with the
replay outcome model (learn2draft.replay.outcome):

* the oracle — the best depth sequence in hindsight for each prompt: a dynamic program over output
  positions that minimises the (expected) total cycle time of the generation,
  V(t) = min over d of [seconds(t, d) + E V(t + emitted(t, d))], V(n) = 0. At temperature 0 the
  emitted count of every (t, d) is known, so this is the exact optimum over all depth policies,
  including ones that see the future; at T > 0 it is the optimum of the replay's law (a policy that
  knows the position and the acceptance probabilities, not the draws);
* the per-cycle greedy choice in hindsight (each cycle picks the depth of the best tokens/s of that
  cycle alone, the objective PPO optimises with episode=cycle): reported beside the oracle;
* every fixed depth and the best of them;
* any controller (an exported policy with --policy) scored in the replay environment.

Rates are all generated tokens over summed cycle seconds (the replay environment's measure).

Draft-tree traces (``python -m eval.record --tree``, temperature 0) are detected from their header
and get the tree report: the hindsight-optimal (depth, V) per cycle by the same dynamic program
(emitted = min(τ + 1, tokens left), cycle seconds = d·(tree_level + step overhead) + verify(V + 1)
+ cycle overhead with V = the nodes actually verified), the per-cycle greedy choice, every fixed
(d, V) of the recorded grid and the best of them, and d = 0 (autoregressive). Profiles without a
``tree_level_seconds`` entry for the drafter fall back to the chain draft step (the report says so).

Example::

    python -m eval.oracle runs/traces/model-heldout.npz --profile cpu-2core --policy runs/replay-model
    python -m eval.oracle runs/traces/head-tree-heldout.npz --profile gpu-like
    python -m eval.oracle lookup-heldout.npz,model-heldout.npz --profile cpu-amx-bf16 --policy runs/hybrid

Lookup traces and a neural drafter's traces of the same prompts (temperature 0) together are a hybrid drafter's
(``lookup+model``, ``lookup+head``): the report is then :func:`hybrid_report` — each drafter alone at every fixed γ,
lookup-first per token, vLLM's lookup-first rule, ArcticInference's score rule, the policies and the hindsight
oracle (the cheapest right source at every position).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

from learn2draft.cli import HelpFormatter, add_profile_arg, comma_items, plain_doc, run_cli
from learn2draft.replay.outcome import TreeReplay, tokens_per_second, tree_replay_data


# --------------------------------------------------------------------------- per-prompt dynamic programs
def evaluate_policy(r, choose, deterministic: bool) -> float:
    """Expected total cycle seconds of one replayed generation when the depth at position t is ``choose(t)``
    (capped at the available depth). ``r``: a :class:`learn2draft.replay.outcome.ChainReplay`
    (:meth:`SpecDecodeReplayEnv.replay_data`), whose :meth:`~ChainReplay.outcomes` give each cycle's law."""
    V = np.zeros(r.n + 1)
    for t in range(r.n - 1, 0, -1):
        d = min(int(choose(t)), int(r.avail[t]))
        V[t] = r.total[t, d] + sum(p * V[t + e] for p, _, e in r.outcomes(t, d, deterministic) if p)
    return float(V[1])


def oracle_prompt(r, deterministic: bool) -> tuple[float, np.ndarray]:
    """The hindsight-optimal depths of one replayed generation.

    Returns:
        (minimal expected total cycle seconds, int (n+1,) the optimal depth at each position; entries 0 and n
        unused). Ties go to the smaller depth.
    """
    V = np.zeros(r.n + 1)
    best = np.zeros(r.n + 1, dtype=np.int64)
    for t in range(r.n - 1, 0, -1):
        vals = [r.total[t, d] + sum(p * V[t + e] for p, _, e in r.outcomes(t, d, deterministic) if p)
                for d in range(int(r.avail[t]) + 1)]
        best[t] = int(np.argmin(vals))
        V[t] = vals[best[t]]
    return float(V[1]), best


def greedy_cycle_depths(r, deterministic: bool) -> np.ndarray:
    """int (n+1,): per position the depth with the best expected tokens/s of that cycle alone."""
    best = np.zeros(r.n + 1, dtype=np.int64)
    for t in range(1, r.n):
        rates = [sum(p * e for p, _, e in r.outcomes(t, d, deterministic)) / r.total[t, d]
                 for d in range(int(r.avail[t]) + 1)]
        best[t] = int(np.argmax(rates))
    return best


# --------------------------------------------------------------------------- reports
def _rates(methods: dict, tokens: float, oracle_seconds: float) -> None:
    """Add to each method its ``tokens_per_s`` (all generated tokens / its summed cycle seconds,
    :func:`learn2draft.replay.outcome.tokens_per_second`) and ``ratio_to_oracle`` (oracle seconds / its seconds)."""
    for m in methods.values():
        m["tokens_per_s"] = tokens_per_second(tokens, m["seconds"])
        m["ratio_to_oracle"] = oracle_seconds / m["seconds"] if m["seconds"] > 0 else 0.0


def oracle_report(env, controllers: dict | None = None, repeats: int = 1, seed: int = 0, profile_index: int = 0) -> dict:
    """Oracle, per-cycle greedy, every fixed depth 0..``env.max_depth`` and the given controllers, in replay.

    Args:
        env: a :class:`envs.replay.SpecDecodeReplayEnv` (its traces, profile, max_depth, max_new_tokens).
        controllers: name → ``DraftController``, scored with :func:`envs.replay.replay_controller`.
        repeats: generations per prompt for the controllers at T > 0 (Monte Carlo; at T = 0 one is exact).
        profile_index: which of the env's profiles (``env.profiles``) the costs come from.

    Returns:
        ``{"methods": {name: {"tokens_per_s", "seconds", "ratio_to_oracle", …}}, "best_fixed": name,
        "oracle_kind": ..., "prompts": count, "tokens": count, "deterministic": bool}``.
    """
    from envs.replay import replay_controller

    det = env.deterministic
    idx = env._usable
    data = [env.replay_data(i, profile_index) for i in idx]
    tokens = float(sum(r.n for r in data))
    methods = {}
    sec = sum(oracle_prompt(r, det)[0] for r in data)
    methods["oracle (hindsight DP)"] = {"seconds": sec}
    methods["per-cycle greedy (hindsight)"] = {
        "seconds": sum(evaluate_policy(r, lambda t, b=greedy_cycle_depths(r, det): b[t], det) for r in data)}
    fixed = {}
    for d in range(env.max_depth + 1):
        fixed[f"fixed γ={d}"] = {"seconds": sum(evaluate_policy(r, lambda t, d=d: d, det) for r in data), "depth": d}
    best = min(fixed, key=lambda k: fixed[k]["seconds"])
    methods.update(fixed)
    for name, ctrl in (controllers or {}).items():
        res = replay_controller(env, ctrl, idx, repeats=1 if det else repeats, seed=seed, profile_index=profile_index)
        methods[name] = {"seconds": res["seconds"] / (1 if det else repeats), "mean_depth": res["mean_depth"],
                         "mean_accepted": res["mean_accepted"]}
    osec = methods["oracle (hindsight DP)"]["seconds"]
    _rates(methods, tokens, osec)
    return {"methods": methods, "best_fixed": best, "prompts": len(idx), "tokens": int(tokens), "deterministic": det,
            "oracle_kind": "dynamic program over positions minimising total (expected) cycle time: exact optimum at T=0"
                           if det else "dynamic program on expected cycle time under the replay's acceptance law (T>0)",
            "rate": "all generated tokens / summed cycle seconds", "max_depth": env.max_depth,
            "max_new_tokens": env.max_new_tokens, "profile": env.profiles[profile_index].name, "drafter": env.drafter}


def format_report(rep: dict) -> str:
    """A markdown table of :func:`oracle_report`, with the two headline ratios."""
    lines = [f"Replay: {rep['prompts']} prompts, {rep['tokens']} tokens, drafter {rep['drafter']}, profile "
             f"{rep['profile']}, max_depth {rep['max_depth']}, {'T=0' if rep['deterministic'] else 'T>0'}", "",
             "| method | tokens/s | × oracle |", "|---|---|---|"]
    for name, m in rep["methods"].items():
        mark = " (best fixed)" if name == rep["best_fixed"] else ""
        lines.append(f"| {name}{mark} | {m['tokens_per_s']:.2f} | {m['ratio_to_oracle']:.3f} |")
    b = rep["methods"][rep["best_fixed"]]["ratio_to_oracle"]
    lines += ["", f"best fixed / oracle = {b:.3f} ({rep['best_fixed']})"]
    learned = [k for k in rep["methods"] if not k.startswith(("oracle", "per-cycle", "fixed γ="))]
    for k in learned:
        lines.append(f"{k} / oracle = {rep['methods'][k]['ratio_to_oracle']:.3f}")
    lines.append(f"oracle: {rep['oracle_kind']}; rates: {rep['rate']}")
    return "\n".join(lines)


# --------------------------------------------------------------------------- draft trees (T = 0)
def tree_evaluate(r: TreeReplay, choose) -> float:
    """Total cycle seconds of one replayed generation when the action at position t is ``choose(t)`` (an index
    into ``r.actions``), each cycle's outcome from :meth:`TreeReplay.cycle`."""
    total, t = 0.0, 1
    while t < r.n:
        _, emitted, seconds = r.cycle(t, int(choose(t)))
        total += seconds
        t += emitted
    return total


def tree_oracle_prompt(r: TreeReplay) -> tuple[float, np.ndarray]:
    """The hindsight-optimal tree actions of one generation: V(t) = min over a of [seconds(t, a) + V(t +
    emitted(t, a))], V(n) = 0 — the exact optimum over every (depth, V) policy at temperature 0.

    Returns:
        (minimal total cycle seconds, int (n+1,) the optimal action index at each position; ties go to the
        lower index: plain decoding, then smaller depths and sizes).
    """
    V = np.zeros(r.n + 1)
    best = np.zeros(r.n + 1, dtype=np.int64)
    for t in range(r.n - 1, 0, -1):
        vals = r.seconds[t] + V[t + r.emitted[t]]
        best[t] = int(np.argmin(vals))
        V[t] = vals[best[t]]
    return float(V[1]) if r.n > 1 else 0.0, best


def tree_greedy_actions(r: TreeReplay) -> np.ndarray:
    """int (n+1,): per position the action with the best tokens/s of that cycle alone."""
    best = np.zeros(r.n + 1, dtype=np.int64)
    for t in range(1, r.n):
        best[t] = int(np.argmax(r.emitted[t] / r.seconds[t]))
    return best


def tree_action_name(d: int, v: int) -> str:
    return "autoregressive (d=0)" if d == 0 else f"fixed tree d={d}, V={v}"


def tree_oracle_report(traces, profile, max_depth: int | None = None, max_new_tokens: int | None = None) -> dict:
    """Oracle, per-cycle greedy, autoregressive and every fixed (d, V) on tree traces, in replay.

    Args:
        traces: a :class:`learn2draft.replay.traces.TreeTraceSet`; ``profile``: a :class:`LatencyProfile`.
        max_depth, max_new_tokens: as :func:`tree_replay_data`.

    Returns:
        ``{"methods": {name: {"seconds", "tokens_per_s", "ratio_to_oracle", ("depth", "verify_size")}},
        "best_fixed": name of the best fixed tree (d ≥ 1), "grid": {d: {V: ratio_to_oracle}}, "notes": [...],
        "prompts", "tokens", …}``.

    Raises:
        ValueError: as :func:`tree_replay_data`.
    """
    drafter = traces.drafter
    data = [tree_replay_data(pt, profile, drafter, traces.verify_sizes, max_depth, max_new_tokens,
                             traces.max_new_tokens) for pt in traces.prompts]
    data = [r for r in data if r.n > 1]
    if not data:
        raise ValueError("No prompt of these tree traces has a cycle to replay (every generation has one token).")
    actions = data[0].actions
    tokens = float(sum(r.n for r in data))
    methods = {"oracle (hindsight DP)": {"seconds": sum(tree_oracle_prompt(r)[0] for r in data)},
               "per-cycle greedy (hindsight)": {
                   "seconds": sum(tree_evaluate(r, lambda t, b=tree_greedy_actions(r): b[t]) for r in data)}}
    fixed = {}
    for a, (d, v) in enumerate(actions):
        fixed[tree_action_name(d, v)] = {"seconds": sum(tree_evaluate(r, lambda t, a=a: a) for r in data),
                                         "depth": d, "verify_size": v}
    trees = {k: m for k, m in fixed.items() if m["depth"] > 0}
    best = min(trees, key=lambda k: trees[k]["seconds"]) if trees else None
    methods.update(fixed)
    osec = methods["oracle (hindsight DP)"]["seconds"]
    _rates(methods, tokens, osec)
    grid: dict = {}
    for m in trees.values():
        grid.setdefault(m["depth"], {})[m["verify_size"]] = m["tokens_per_s"]
    notes = []
    cost = profile.cost(drafter)
    if cost.tree_level is None:
        notes.append(f"profile {profile.name!r} has no tree_level_seconds for the {drafter!r} drafter: one tree level "
                     "is costed as one chain draft step (an underestimate where drafting W nodes is compute-bound, "
                     f"e.g. a CPU; measure it with `python -m eval.profile --tree-width {traces.width}`)")
    else:
        w, k = cost.tree_level.get("width"), cost.tree_level.get("top_k")
        if w is None:
            notes.append(f"tree level cost of profile {profile.name!r}: stated independent of the tree shape "
                         f"({cost.tree_level.get('note', 'see the profile source')})")
        elif int(w) != traces.width or (k is not None and int(k) != traces.top_k):
            notes.append(f"tree level cost measured at W={w}, k={k}; these traces drafted W={traces.width}, "
                         f"k={traces.top_k}: costs used as measured")
        else:
            notes.append(f"tree level cost measured at the traces' shape (W={w}, k={k})")
    most = int(max(r.verified.max() for r in data)) + 1
    if most > profile.verify_tokens[-1]:
        notes.append(f"verifications of up to {most} tokens: beyond the profile's table ({profile.verify_tokens[-1]}), "
                     "extrapolated linearly with the slope of its upper half")
    ar = methods["autoregressive (d=0)"]["tokens_per_s"]
    return {"methods": methods, "best_fixed": best, "grid": grid, "notes": notes, "prompts": len(data),
            "tokens": int(tokens), "deterministic": True, "structure": "tree",
            "oracle_kind": "dynamic program over positions and (depth, V) minimising total cycle time: exact optimum "
                           "at T=0",
            "rate": "all generated tokens / summed cycle seconds", "max_depth": max(d for d, _ in actions),
            "verify_sizes": list(traces.verify_sizes), "width": traces.width, "top_k": traces.top_k,
            "max_new_tokens": max_new_tokens or traces.max_new_tokens, "profile": profile.name, "drafter": drafter,
            "best_fixed_over_autoregressive": (methods[best]["tokens_per_s"] / ar) if best and ar else None,
            "oracle_over_autoregressive": methods["oracle (hindsight DP)"]["tokens_per_s"] / ar if ar else None}


def format_tree_report(rep: dict) -> str:
    """Markdown tables of :func:`tree_oracle_report`: the headline methods, then tokens/s of every fixed (d, V)."""
    lines = [f"Tree replay: {rep['prompts']} prompts, {rep['tokens']} tokens, drafter {rep['drafter']}, profile "
             f"{rep['profile']}, W={rep['width']}, k={rep['top_k']}, depths 1..{rep['max_depth']}, V in "
             f"{rep['verify_sizes']}, T=0", "",
             "| method | tokens/s | × oracle |", "|---|---|---|"]
    m = rep["methods"]
    for name in ("oracle (hindsight DP)", "per-cycle greedy (hindsight)", "autoregressive (d=0)", rep["best_fixed"]):
        if name in m:
            mark = " (best fixed tree)" if name == rep["best_fixed"] else ""
            lines.append(f"| {name}{mark} | {m[name]['tokens_per_s']:.2f} | {m[name]['ratio_to_oracle']:.3f} |")
    vs = rep["verify_sizes"]
    lines += ["", "Fixed trees, tokens/s (rows: depth d, columns: verification size V):", "",
              "| d | " + " | ".join(f"V={v}" for v in vs) + " |", "|---" * (len(vs) + 1) + "|"]
    for d in sorted(rep["grid"]):
        lines.append(f"| {d} | " + " | ".join(f"{rep['grid'][d][v]:.2f}" for v in vs) + " |")
    lines.append("")
    if rep["best_fixed"]:
        b = m[rep["best_fixed"]]
        lines.append(f"best fixed tree / oracle = {b['ratio_to_oracle']:.3f} ({rep['best_fixed']}); best fixed tree / "
                     f"autoregressive = {rep['best_fixed_over_autoregressive']:.3f}; oracle / autoregressive = "
                     f"{rep['oracle_over_autoregressive']:.3f}")
    for note in rep["notes"]:
        lines.append(f"note: {note}")
    lines.append(f"oracle: {rep['oracle_kind']}; rates: {rep['rate']}")
    return "\n".join(lines)


# --------------------------------------------------------------------------- hybrid drafters (temperature 0)
def hybrid_baselines(max_depth: int, gammas) -> dict:
    """The hand configurations a hybrid drafter's policy is compared with, by name: each drafter alone at each fixed γ
    (:class:`policies.rules.SingleSourceController`), lookup-first per token at each γ (a fixed γ on the hybrid
    drafter), vLLM's lookup-first rule and ArcticInference's score rule at each γ of the neural drafter, and
    autoregressive decoding."""
    from learn2draft.control import CONTINUE_LOOKUP, CONTINUE_NEURAL, FixedDepthController
    from policies.rules import LookupFirstController, SingleSourceController, SuffixScoreController

    out: dict = {"autoregressive": FixedDepthController(0)}
    for g in gammas:
        if not 1 <= g <= max_depth:
            continue
        out[f"lookup γ={g}"] = SingleSourceController(CONTINUE_LOOKUP, g, max_depth)
        out[f"neural γ={g}"] = SingleSourceController(CONTINUE_NEURAL, g, max_depth)
        out[f"lookup-first per token γ={g}"] = FixedDepthController(g)
        out[f"vLLM lookup-first γ={g}"] = LookupFirstController(g, max_depth)
        out[f"Arctic score rule k={g}"] = SuffixScoreController(g, max_depth)
    return out


def hybrid_report(env, controllers: dict, gammas=(1, 2, 3, 4, 6, 8, 12, 16), seed: int = 0) -> dict:
    """Score hybrid controllers (e.g. trained policies) in a :class:`envs.hybrid.HybridReplayEnv` beside
    :func:`hybrid_baselines` and the hindsight oracle (:func:`learn2draft.replay.hybrid.hybrid_oracle_seconds`).

    Returns:
        method name → ``tokens_per_s``, ``mean_depth``, ``mean_accepted``, ``neural_share``, ``ratio_to_oracle``;
        plus ``oracle``, ``best_fixed`` (the fastest hand configuration), ``best_single`` (the fastest drafter alone at
        a fixed γ) and ``prompts``.
    """
    from envs.hybrid import replay_hybrid_controller

    ctrls = {**hybrid_baselines(env.max_depth, gammas), **controllers}
    oracle = env.oracle_rate()
    out: dict = {}
    for name, ctrl in ctrls.items():
        r = replay_hybrid_controller(env, ctrl, seed=seed)
        out[name] = {"tokens_per_s": r["tokens_per_s"], "mean_depth": r["mean_depth"],
                     "mean_accepted": r["mean_accepted"], "neural_share": r["neural_share"],
                     "ratio_to_oracle": r["tokens_per_s"] / oracle if oracle else 0.0}
    hand = [k for k in ctrls if k not in controllers]
    single = [k for k in hand if k.startswith(("lookup γ=", "neural γ="))]
    for key, names in (("best_fixed", hand), ("best_single", single)):
        best = max(names, key=lambda k: out[k]["tokens_per_s"])
        out[key] = {"method": best, "tokens_per_s": out[best]["tokens_per_s"],
                    "ratio_to_oracle": out[best]["ratio_to_oracle"]}
    out["oracle"] = {"tokens_per_s": oracle, "kind": "hindsight DP (temperature 0)"}
    out["prompts"] = len(env._usable)
    out["coverage"] = dict(env.coverage)
    out["settings"] = {"drafter": env.drafter, "max_depth": env.max_depth, "max_new_tokens": env.max_new_tokens,
                       "profile": env.profile.name}
    return out


def format_hybrid_report(rep: dict) -> str:
    """The Markdown table of :func:`hybrid_report`, fastest first."""
    rows = sorted(((k, v) for k, v in rep.items() if isinstance(v, dict) and "mean_depth" in v),
                  key=lambda kv: -kv[1]["tokens_per_s"])
    cov = rep.get("coverage") or {}
    lines = [f"Hybrid replay, {rep['prompts']} prompts; oracle {rep['oracle']['tokens_per_s']:.2f} tok/s; best hand "
             f"configuration {rep['best_fixed']['method']}; best single drafter {rep['best_single']['method']}.",
             *([f"Replayed {cov['tokens_replayed']} of {cov['tokens_recorded']} recorded tokens: {cov['prompts_cut']} of "
                f"{cov['prompts']} prompts are cut where the two recordings' greedy outputs part (a bf16 near-tie), "
                f"{cov['prompts_dropped']} dropped; every method is scored on the same tokens, but the cut tails may "
                "be harder than the rest."] if cov and cov["tokens_replayed"] < cov["tokens_recorded"] else []), "",
             "| method | tokens/s | / oracle | / best single | depth | τ | neural share |", "|---|---|---|---|---|---|---|"]
    single = rep["best_single"]["tokens_per_s"]
    for k, v in rows:
        lines.append(f"| {k} | {v['tokens_per_s']:.2f} | {v['ratio_to_oracle']:.3f} | {v['tokens_per_s'] / single:.3f} | "
                     f"{v['mean_depth']:.2f} | {v['mean_accepted']:.2f} | {v['neural_share']:.2f} |")
    return "\n".join(lines)


# --------------------------------------------------------------------------- CLI
def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m eval.oracle", description=plain_doc(__doc__), formatter_class=HelpFormatter)
    p.add_argument("traces",
                   help="trace file(s) from python -m eval.record, chain or --tree (several joined by commas)")
    add_profile_arg(p, required=True)
    p.add_argument("--policy", action="append", default=[],
                   help="a training run or policy export to score against the oracle; repeat the flag for several "
                        "(they must share max_depth)")
    p.add_argument("--max-depth", type=int, default=None,
                   help="largest depth considered (default: the policy's, else the traces')")
    p.add_argument("--max-new-tokens", type=int, default=None,
                   help="tokens per generation (default: the policy's if shorter than the traces', else the traces')")
    p.add_argument("--repeats", type=int, default=20, help="generations per prompt for the policy at T > 0")
    p.add_argument("--seed", type=int, default=0, help="seeds the acceptance draws at T > 0")
    p.add_argument("--json", default=None, help="also write the report to this JSON file")
    return p


def main(argv: list[str] | None = None) -> int:
    return run_cli(build_parser(), _run, argv)


def _run(args) -> int:
    from envs.replay import SpecDecodeReplayEnv
    from learn2draft.replay.latency import load_profile
    from learn2draft.replay.traces import TREE, load_traces, trace_structure

    _check_args(args)
    paths = comma_items(str(args.traces), "traces", "join the trace files with single commas, e.g. a.npz,b.npz")
    if paths and trace_structure(paths[0]) == TREE:
        return _run_tree(args)
    if len({load_traces(p).drafter for p in paths}) > 1:
        return _run_hybrid(args)
    traces = load_traces(args.traces)
    profile = load_profile(args.profile)
    controllers, max_depth, max_new = {}, args.max_depth, args.max_new_tokens
    if args.policy:
        from policies.layout import resolve_export_dir
        from policies.load import load_policy, policy_drafter, run_settings

        depths = {}
        for path in args.policy:
            export = resolve_export_dir(path)
            ctrl = load_policy(export, profile=profile)  # a profile-conditioned policy reads it
            if policy_drafter(export) != traces.drafter:
                raise ValueError(f"The policy in {export} was trained with the {policy_drafter(export)!r} drafter, the "
                                 f"traces were recorded with {traces.drafter!r}: record traces with that drafter.")
            depths[path] = ctrl.max_depth
            settings = run_settings(path)
            if max_new is None and settings.get("max_new_tokens") and settings["max_new_tokens"] <= traces.max_new_tokens:
                max_new = int(settings["max_new_tokens"])
            t_pol = (settings.get("sampling") or {}).get("temperature", settings.get("temperature"))
            if t_pol is not None and float(t_pol) != float(traces.header["sampling"]["temperature"]):
                print(f"note: {path} was trained at temperature {t_pol}, the traces were recorded at "
                      f"{traces.header['sampling']['temperature']}.", file=sys.stderr)
            name = Path(path).name or str(path)
            controllers[name if name not in controllers else str(path)] = ctrl
        max_depth = _policies_depth(depths, max_depth)
    env = SpecDecodeReplayEnv(traces, profile, max_new_tokens=max_new, max_depth=max_depth)
    rep = oracle_report(env, controllers, repeats=args.repeats, seed=args.seed)
    return _emit(format_report(rep), rep, args.json)


def _run_hybrid(args) -> int:
    """Lookup traces + a neural drafter's traces: the hybrid report (:func:`hybrid_report`)."""
    from envs.hybrid import HybridReplayEnv, split_hybrid_traces
    from policies.load import load_policy, policy_drafter

    look, neural = split_hybrid_traces(args.traces)
    drafter = f"lookup+{neural.drafter}"
    controllers, depths = {}, {}
    for path in args.policy:
        ctrl = load_policy(path)
        if policy_drafter(path) != drafter:
            raise ValueError(f"--policy {path} was trained for the {policy_drafter(path)!r} drafter, these are "
                             f"{drafter} traces (lookup + {neural.drafter}): pass a {drafter} policy, or traces of its "
                             "drafters.")
        controllers[Path(path).name or str(path)] = ctrl
        depths[path] = ctrl.max_depth
    max_depth = _policies_depth(depths, args.max_depth) if depths else args.max_depth
    env = HybridReplayEnv((look, neural), args.profile, max_new_tokens=args.max_new_tokens, max_depth=max_depth)
    rep = hybrid_report(env, controllers, seed=args.seed)
    return _emit(format_hybrid_report(rep), rep, args.json)


def _check_args(args) -> None:
    """The flags that need no file: ``--repeats`` ≥ 1, ``--seed`` in range, ``--json`` writable (before the work).

    Raises:
        ValueError: names the flag.
    """
    from learn2draft.cli import check_out_file, check_seed

    if args.repeats < 1:
        raise ValueError(f"--repeats must be ≥ 1, got {args.repeats}.")
    check_seed(args.seed, nonnegative=True)
    if args.json:
        check_out_file(args.json, "--json")


def _policies_depth(depths: dict, max_depth: int | None) -> int:
    """The one ``max_depth`` the policies (path → their ``max_depth``) read their depth features on.

    Raises:
        ValueError: policies of different depths, or a ``--max-depth`` other than theirs.
    """
    if len(set(depths.values())) > 1:
        raise ValueError(f"The policies read depth features on different max_depth scales {depths}: score them "
                         "in separate runs.")
    pol_depth = next(iter(depths.values()))
    if max_depth is not None and max_depth != pol_depth:
        raise ValueError(f"--max-depth {max_depth} differs from the policies' {pol_depth} (their depth features' "
                         "scale): drop --max-depth.")
    return pol_depth


def _emit(text: str, rep: dict, json_path: str | None) -> int:
    """Print a report's table and, with ``--json``, write the report there; exit code 0."""
    print(text)
    if json_path:
        Path(json_path).parent.mkdir(parents=True, exist_ok=True)
        Path(json_path).write_text(json.dumps(rep, indent=2, default=str))
    return 0


def _run_tree(args) -> int:
    from learn2draft.replay.latency import load_profile
    from learn2draft.replay.traces import load_tree_traces

    if args.policy:
        raise ValueError("These are draft-tree traces: scoring a policy on them in replay is not built (tree replay "
                         "covers the oracle and fixed trees); drop --policy, or score tree policies on the real loop "
                         "with `python -m eval --tree --tree-policy RUN`.")
    traces = load_tree_traces(args.traces)
    profile = load_profile(args.profile)
    rep = tree_oracle_report(traces, profile, max_depth=args.max_depth, max_new_tokens=args.max_new_tokens)
    return _emit(format_tree_report(rep), rep, args.json)


__all__ = ["build_parser", "evaluate_policy", "format_report", "format_tree_report", "greedy_cycle_depths", "main",
           "oracle_prompt", "oracle_report", "tree_action_name", "tree_evaluate", "tree_greedy_actions",
           "tree_oracle_prompt", "tree_oracle_report"]


if __name__ == "__main__":
    sys.exit(main())

