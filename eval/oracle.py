"""``python -m eval.oracle``: how far a depth policy is from the best possible one, in replay.

From traces (learn2draft.traces) and a latency profile (learn2draft.latency):

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

Example::

    python -m eval.oracle runs/traces/model-heldout.npz --profile cpu-2core --policy runs/replay-model
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

from learn2draft.cli import HelpFormatter, plain_doc, run_cli


# --------------------------------------------------------------------------- per-prompt dynamic programs
def _outcomes(r, t: int, d: int, deterministic: bool) -> list[tuple[float, int]]:
    """(probability, tokens emitted) of a cycle at position t with depth d (d ≤ available)."""
    left = r.n - t
    if deterministic:
        return [(1.0, min(min(d, int(r.run[t])) + 1, left))]
    out, reach = [], 1.0
    for i in range(d):
        a = float(r.accept[t, i])
        out.append((reach * (1.0 - a), min(i + 1, left)))
        reach *= a
    out.append((reach, min(d + 1, left)))
    return out


def evaluate_policy(r, choose, deterministic: bool) -> float:
    """Expected total cycle seconds of one replayed generation when the depth at position t is ``choose(t)``
    (capped at the available depth). ``r``: :meth:`SpecDecodeReplayEnv.replay_data`."""
    V = np.zeros(r.n + 1)
    for t in range(r.n - 1, 0, -1):
        d = min(int(choose(t)), int(r.avail[t]))
        V[t] = r.total[t, d] + sum(p * V[t + e] for p, e in _outcomes(r, t, d, deterministic) if p)
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
        vals = [r.total[t, d] + sum(p * V[t + e] for p, e in _outcomes(r, t, d, deterministic) if p)
                for d in range(int(r.avail[t]) + 1)]
        best[t] = int(np.argmin(vals))
        V[t] = vals[best[t]]
    return float(V[1]), best


def greedy_cycle_depths(r, deterministic: bool) -> np.ndarray:
    """int (n+1,): per position the depth with the best expected tokens/s of that cycle alone."""
    best = np.zeros(r.n + 1, dtype=np.int64)
    for t in range(1, r.n):
        rates = [sum(p * e for p, e in _outcomes(r, t, d, deterministic)) / r.total[t, d]
                 for d in range(int(r.avail[t]) + 1)]
        best[t] = int(np.argmax(rates))
    return best


# --------------------------------------------------------------------------- reports
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
    for m in methods.values():
        m["tokens_per_s"] = tokens / m["seconds"] if m["seconds"] > 0 else 0.0
        m["ratio_to_oracle"] = osec / m["seconds"] if m["seconds"] > 0 else 0.0
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


# --------------------------------------------------------------------------- CLI
def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m eval.oracle", description=plain_doc(__doc__), formatter_class=HelpFormatter)
    p.add_argument("traces", help="trace file(s) from python -m eval.record (several joined by commas)")
    p.add_argument("--profile", required=True,
                   help="latency profile: a JSON file or a shipped name (cpu-2core, gpu-like); a profile-conditioned "
                        "policy (train --features profile) is given its features")
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
    from learn2draft.latency import load_profile
    from learn2draft.traces import load_traces

    traces = load_traces(args.traces)
    profile = load_profile(args.profile)
    controllers, max_depth, max_new = {}, args.max_depth, args.max_new_tokens
    if args.policy:
        from policies.export import load_policy, policy_drafter, resolve_export_dir, run_settings

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
        if len(set(depths.values())) > 1:
            raise ValueError(f"The policies read depth features on different max_depth scales {depths}: score them "
                             "in separate runs.")
        pol_depth = next(iter(depths.values()))
        if max_depth is not None and max_depth != pol_depth:
            raise ValueError(f"--max-depth {max_depth} differs from the policies' {pol_depth} (their depth features' "
                             "scale): drop --max-depth.")
        max_depth = pol_depth
    env = SpecDecodeReplayEnv(traces, profile, max_new_tokens=max_new, max_depth=max_depth)
    rep = oracle_report(env, controllers, repeats=args.repeats, seed=args.seed)
    print(format_report(rep))
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(rep, indent=2, default=str))
    return 0


__all__ = ["build_parser", "evaluate_policy", "format_report", "greedy_cycle_depths", "main", "oracle_prompt",
           "oracle_report"]


if __name__ == "__main__":
    sys.exit(main())

