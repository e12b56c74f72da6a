"""``python -m eval.simreal``: the replay's predicted tokens/s next to the real loop's measured tokens/s.

For every method — fixed depths (--gammas) and each --policy (a replay-trained one, a real-loop-trained
one, …) — on the prompts of the traces:

* predicted: the method run on the replay backend (learn2draft.replay.backend.ReplayDecoder: the
  traces and the latency profile through the replay outcome model, no model);
* measured: the method run on the real decoder (the traces' target, draft and drafter), interleaved
  prompt by prompt, with the decoder's device-synchronised clocks.

Both are the same call on two backends of one interface: eval.runner's DecoderMethod runs
``decoder.generate(prompt, controller)`` on each, through the one measurement loop
(eval.runner.run_interleaved), and both sides' numbers are read from its records the same way.

Both rates are all generated tokens over summed cycle seconds (the quantity the environments reward;
prefill excluded). The measured rate includes the controller's decision time (the loop charges it to
the cycle), the replay's does not; the wall-clock rate with prefill is reported beside it. For the
prediction to mean anything, the profile and the traces must come from this machine and these models
(python -m eval.profile, python -m eval.record on held-out prompts), measured on a quiet machine.

Example::

    python -m eval.simreal runs/traces/model-heldout.npz --profile runs/profiles/cpu-2core.json \\
        --policy runs/replay-model --policy runs/real-model --gammas 0,2,4
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from learn2draft.cli import HelpFormatter, add_device_args, add_profile_arg, comma_items, plain_doc, run_cli


def replay_backends(traces, profile, controllers: dict) -> dict:
    """The replay backends :func:`sim_vs_real` predicts with, one per ``max_depth`` (a controller's depth-feature
    scale, else the traces'): the profile is checked against the traces there (costs for their drafter, a verify
    table deep enough), without any model.

    Returns:
        ``{max_depth: learn2draft.replay.backend.ReplayDecoder}``.

    Raises:
        ValueError: the profile lacks the traces' drafter, its verify table is too small, or a ``max_depth`` exceeds
            the traces'.
    """
    from learn2draft.replay.backend import ReplayDecoder

    backends = {}
    for ctrl in controllers.values():
        md = ctrl.depth_feature_scale or traces.max_depth
        if md not in backends:
            backends[md] = ReplayDecoder(traces, profile, max_depth=md)
    return backends


def profile_mismatch(profile, traces, threads: int | None = None) -> str | None:
    """What differs between where ``profile`` was measured (its ``machine``: precision, torch threads, CPU) and where
    the traces were recorded or the real loop runs now (``threads``), as one sentence; None when nothing known
    differs. A replay priced on another machine or precision predicts that machine's tokens/s, not this run's."""
    m, h = profile.machine or {}, traces.header
    hm = h.get("machine") or {}
    diffs = []
    for what, a, b in (("precision", m.get("dtype"), h.get("dtype")), ("CPU", m.get("cpu"), hm.get("cpu")),
                       ("torch threads", m.get("torch_threads"), threads)):
        if a is not None and b is not None and a != b:
            diffs.append(f"{what} {a} (profile) against {b} ({'this run' if what == 'torch threads' else 'traces'})")
    if not diffs:
        return None
    return (f"the profile {profile.name!r} was measured with another setting: {'; '.join(diffs)}. Its predictions "
            "describe the profile's machine and precision: measure one here (python -m eval.profile) to compare.")


def sim_vs_real(pair, traces, profile, controllers: dict, drafter=None, repeats: int = 1, seed: int = 0,
                progress=None, backends: dict | None = None) -> dict:
    """Predicted (replay) and measured (real loop) tokens/s of each controller on the traces' prompts.

    Args:
        pair: the loaded models the traces were recorded with.
        traces: a :class:`learn2draft.replay.traces.TraceSet`; profile: a :class:`learn2draft.replay.latency.LatencyProfile`.
        controllers: name → ``DraftController``; each runs with its own ``max_depth`` when it declares a
            depth-feature scale (a policy), else with the traces' ``max_depth``.
        drafter: a factory ``() -> Drafter`` for the real runs (default: ``make_drafter`` of the traces' drafter).
        repeats: real generations per prompt (the replay at T > 0 uses 20 per prompt).
        seed: the sampling seed of the i-th replayed prompt in repeat k is ``seed + 1000·k + i``; the real runs go
            through :func:`eval.runner.run_interleaved` (the one measurement loop: rotated method order).
        backends: the replay backends of :func:`replay_backends` (built here when None).

    Returns:
        ``{"methods": {name: {"predicted_tokens_per_s", "measured_tokens_per_s", "error", "measured_wall_tokens_per_s",
        "predicted_mean_accepted", "measured_mean_accepted", "predicted_mean_depth", "measured_mean_depth"}},
        "prompts": P, "token_mismatches": count (T = 0: real outputs that differ from the recorded greedy output)}``;
        ``error`` = predicted / measured − 1.
    """
    import torch

    from eval.runner import DecoderMethod, run_interleaved
    from learn2draft.drafters import make_drafter
    from learn2draft.replay.outcome import tokens_per_second
    from learn2draft.sampling import SamplingConfig

    h = traces.header
    sampling = SamplingConfig(**h["sampling"])
    if drafter is None:
        head = (h.get("drafter") or {}).get("head") or None
        min_ngram = (h.get("drafter") or {}).get("min_ngram")  # the lookup traces' n-gram setting

        def drafter():
            return make_drafter(traces.drafter, pair, head=head, min_ngram=min_ngram)

    backends = replay_backends(traces, profile, controllers) if backends is None else backends
    methods, runners, replays = {}, [], []
    for name, ctrl in controllers.items():
        md = ctrl.depth_feature_scale or traces.max_depth
        methods[name] = {"max_depth": md}
        replays.append(DecoderMethod(name, None, ctrl, sampling, traces.max_new_tokens, decoder=backends[md]))
        runners.append(DecoderMethod(name, pair, ctrl, sampling, traces.max_new_tokens, drafter=drafter()))
    idx = next(iter(backends.values())).usable()
    prompts = [torch.as_tensor(traces.prompts[i].prompt_ids) for i in idx]
    # predicted: the same runs on the replay backend (T > 0: 20 acceptance draws per prompt)
    predicted = run_interleaved(replays, prompts, 1 if traces.deterministic else 20, seed=seed, progress=False)
    runners[0].run(prompts[0], seed=seed)  # warm-up: the first forwards allocate
    records = run_interleaved(runners, prompts, repeats, seed=seed, desc="sim vs real", progress=progress is not None)

    def rates(rs, key: str) -> dict:
        cycles = sum(r.cycles for r in rs)
        return {f"{key}_tokens_per_s": tokens_per_second(sum(r.new_tokens for r in rs), sum(r.cycle_seconds for r in rs)),
                f"{key}_mean_depth": sum(r.drafted for r in rs) / cycles if cycles else 0.0,
                f"{key}_mean_accepted": sum(r.accepted for r in rs) / cycles if cycles else 0.0}

    mismatches = 0
    for n, m in methods.items():
        rs = [r for r in records if r.method == n]
        m.update(rates([r for r in predicted if r.method == n], "predicted"))
        m.update(rates(rs, "measured"))
        m["measured_wall_tokens_per_s"] = tokens_per_second(sum(r.new_tokens for r in rs),
                                                            sum(r.wall_seconds for r in rs))
        m["error"] = m["predicted_tokens_per_s"] / m["measured_tokens_per_s"] - 1 if m["measured_tokens_per_s"] else None
        if traces.deterministic:
            mismatches += sum(r.tokens != traces.prompts[idx[r.prompt_index]].output[: traces.max_new_tokens].tolist()
                              for r in rs)
    return {"methods": methods, "prompts": len(idx), "repeats": repeats, "token_mismatches": mismatches,
            "profile": profile.name, "drafter": traces.drafter, "deterministic": traces.deterministic,
            "rate": "all generated tokens / summed cycle seconds (prefill excluded); wall: with prefill"}


def format_table(rep: dict) -> str:
    """Markdown table of :func:`sim_vs_real`."""
    lines = [f"Sim vs real: {rep['prompts']} prompts × {rep['repeats']}, drafter {rep['drafter']}, profile {rep['profile']}",
             "", "| method | predicted tok/s | measured tok/s | error | measured wall tok/s | τ pred / meas | depth pred / meas |",
             "|---|---|---|---|---|---|---|"]
    for n, m in rep["methods"].items():
        err = "–" if m["error"] is None else f"{100 * m['error']:+.1f}%"
        lines.append(f"| {n} | {m['predicted_tokens_per_s']:.2f} | {m['measured_tokens_per_s']:.2f} | {err} | "
                     f"{m['measured_wall_tokens_per_s']:.2f} | {m['predicted_mean_accepted']:.2f} / "
                     f"{m['measured_mean_accepted']:.2f} | {m['predicted_mean_depth']:.2f} / {m['measured_mean_depth']:.2f} |")
    if rep["deterministic"]:
        lines.append(f"\nreal outputs differing from the recorded greedy output: {rep['token_mismatches']}")
    lines.append(f"rates: {rep['rate']}")
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m eval.simreal", description=plain_doc(__doc__), formatter_class=HelpFormatter)
    p.add_argument("traces", help="trace file(s) recorded on this machine (held-out prompts), several joined by commas")
    add_profile_arg(p, required=True)
    p.add_argument("--policy", action="append", default=[],
                   help="a training run or policy export; repeat the flag to compare several")
    p.add_argument("--gammas", default="0,2,4", help="fixed depths measured beside the policies ('' for none)")
    p.add_argument("--num-prompts", type=int, default=None, help="only the first N prompts of the traces")
    p.add_argument("--repeats", type=int, default=1, help="real generations per prompt and method")
    p.add_argument("--seed", type=int, default=0, help="sampling seeds")
    p.add_argument("--json", default=None, help="also write the report to this JSON file")
    add_device_args(p)  # use the traces' dtype and the profile's threads
    return p


def main(argv: list[str] | None = None) -> int:
    return run_cli(build_parser(), _run, argv)


def _run(args) -> int:
    from learn2draft.cli import (
        check_out_file,
        check_seed,
        load_models,
        model_names,
        resolve_device,
        set_threads,
        stderr_line,
        threads_of,
    )
    from learn2draft.decoding import FixedDepthController
    from learn2draft.replay.latency import load_profile
    from learn2draft.replay.traces import TraceSet, load_traces
    from learn2draft.settings import RunSettings
    from policies.layout import resolve_export_dir
    from policies.load import load_policy, policy_drafter

    check_seed(args.seed, nonnegative=True)
    if args.json:
        check_out_file(args.json, "--json")  # before the models load and the measurement: its result must be writable
    comma_items(args.traces, "traces", "join the trace files with single commas, e.g. a.npz,b.npz")
    try:
        gammas = [int(x) for x in comma_items(args.gammas)]
    except ValueError:
        raise ValueError(f"--gammas {args.gammas!r}: expected comma-separated integers.") from None
    traces = load_traces(args.traces)
    if args.num_prompts is not None:
        if args.num_prompts < 1:
            raise ValueError(f"--num-prompts must be ≥ 1, got {args.num_prompts}.")
        traces = TraceSet(traces.header, traces.prompts[: args.num_prompts])
    profile = load_profile(args.profile)
    if args.repeats < 1:
        raise ValueError("--repeats must be ≥ 1.")
    threads_of(args)  # checked before loading
    if any(not 0 <= g <= traces.max_depth for g in gammas):
        raise ValueError(f"--gammas must be in [0, {traces.max_depth}] (the traces' max_depth), got {gammas}.")
    controllers = {f"fixed γ={g}": FixedDepthController(g) for g in gammas}
    for p in args.policy:
        export = resolve_export_dir(p)
        if policy_drafter(export) != traces.drafter:
            raise ValueError(f"{p} was trained with the {policy_drafter(export)!r} drafter, the traces use {traces.drafter!r}.")
        controllers[Path(p).name or str(p)] = load_policy(export, profile=profile)
    if not controllers:
        raise ValueError("Nothing to measure: pass --policy and/or --gammas.")
    backends = replay_backends(traces, profile, controllers)  # the profile checked against the traces before the models load
    threads = set_threads(args)
    device = resolve_device(args.device)
    note = profile_mismatch(profile, traces, threads)
    if note:
        stderr_line(f"note: {note}")
    t0 = time.perf_counter()
    target, draft = model_names(settings=traces.header)  # the traces' models
    settings = RunSettings.resolve(device=device, dtype=args.dtype, threads=threads, depths=(args.gammas,),
                                   target=target, draft=draft, drafter=traces.drafter)
    pair = load_models(settings, traces.drafter, progress=stderr_line)
    rep = sim_vs_real(pair, traces, profile, controllers, repeats=args.repeats, seed=args.seed,
                      progress=lambda m: print(m, file=sys.stderr), backends=backends)
    rep["seconds"] = round(time.perf_counter() - t0, 1)
    print(format_table(rep))
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(rep, indent=2, default=str))
    return 0


__all__ = ["build_parser", "format_table", "main", "profile_mismatch", "replay_backends", "sim_vs_real"]


if __name__ == "__main__":
    sys.exit(main())
