"""``python -m eval.benchmark``: this project against plain and assisted Hugging Face generation, in one run.

On the same held-out prompts and seeds, interleaved, at temperature 0 and 0.7 (``--temperatures``):

* ``hf generate``: plain ``target.generate()``;
* ``hf assisted (default)``: ``generate(assistant_model=draft)`` with transformers' default schedule;
* ``hf assisted (heuristic)``: the same with ``num_assistant_tokens_schedule="heuristic"``, its
  state reset before every call;
* ``hf prompt lookup (10)``: ``generate(prompt_lookup_num_tokens=10)`` (model-free n-gram drafting,
  always 10 candidates), what a user would pick instead of the lookup drafter;
* ``hf generate + learned policy``: ``generate(assistant_model=draft)`` with the learned policy choosing
  the candidates per cycle (:func:`policies.hf.use_policy`); with the model drafter's policy only;
* this project's autoregressive loop and, with ``--drafter`` (model, head or lookup): its best
  fixed γ (grid-searched on the *training* prompts), a heuristic rule (the draft's confidence ≥ 0.4,
  as vLLM and Hugging Face use, for model and head; the match-length rule for lookup), and the
  learned policy (``--policy DIR``, default the one shipped for the drafter);
* with ``--tree`` (model or head drafter): the best fixed tree (depth, V) (grid-searched on the
  *training* prompts over ``--tree-depths`` × ``--verify-sizes``) and the learned tree policy
  (``--tree-policy DIR``, default the one shipped in ``policies/defaults/<drafter>-tree`` if any).

``benchmark.json`` holds, per temperature and method: tokens/s (mean and per repeat), the ratio
to plain ``generate()`` per repeat, τ, α (accepted / drafted tokens), TTFT and inter-token latency, and over
requests their p50 / p90 / p99 and the accepted-length histogram; when the prompts carry categories or
languages (``--prompt-set mixed`` / ``multilingual``, an MT-bench ``--prompts`` file) the same per category and
per language (``runs[T]["groups"]``) and over the copy-heavy prompts (``copy_summary``). ``benchmark.png`` plots
the ratios (and the learned policy's accepted lengths per category). The report opens with a header
(:mod:`eval.header`: models and revisions, library versions, precision, sampling, hardware, threads, load
before and after, prompt distribution; ``header`` in the JSON) and ends with the verdict lines of issue 16's
goals (:mod:`eval.verdicts`; ``verdicts`` in the JSON).

Also micro-benchmarks the exact sampler at V = 49,152, γ = 12 and the draft/target forward
cost ratio. Ratios are measured side by side in one process (never asserted in tests).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from learn2draft import cli
from learn2draft.cli import HelpFormatter, plain_doc, run_cli
from learn2draft.prompts import PROMPT_SETS

PLAIN = "hf generate"
DEFAULT_OUT = "runs/benchmark"
#: What the benchmark writes in its ``--out`` (an earlier run's are kept unless ``--overwrite``).
RESULT_FILES = ("benchmark.md", "benchmark.json", "benchmark.png")
HF_POLICY = "hf generate + learned policy"


class HFPolicyMethod:
    """A benchmark method: an assisted Hugging Face method (``eval.runner.HFGenerateMethod`` with
    ``assistant=True``) run with a learned policy installed on the target (:func:`policies.hf.use_policy`,
    outside the timed call); τ, drafted and accepted tokens come from the policy's cycle records."""

    def __init__(self, inner, controller):
        self.inner, self.controller, self.name = inner, controller, inner.name

    def run(self, prompt_ids, seed: int):
        from policies.hf import use_policy

        with use_policy(self.inner.pair.target, self.controller) as hook:
            rec = self.inner.run(prompt_ids, seed)
        verified = [c for c in hook.last_cycles if c.verified]
        rec.drafted, rec.accepted = sum(c.verified for c in verified), sum(c.accepted for c in verified)
        rec.tau = sum(c.accepted for c in verified) / len(verified) if verified else None
        return rec


def sampler_microbenchmark(vocab_size: int = 49152, gamma: int = 12, iters: int = 200, seed: int = 0) -> dict:
    """Median seconds of one :func:`speculative_sample` call on random (γ+1, V) / (γ, V) float32 inputs (CPU)."""
    import numpy as np
    import torch

    from learn2draft.sampling import speculative_sample

    g = torch.Generator().manual_seed(seed)
    p = torch.softmax(torch.randn(gamma + 1, vocab_size, generator=g) * 3, -1)
    q = torch.softmax(torch.randn(gamma, vocab_size, generator=g) * 3, -1)
    toks = torch.multinomial(q, 1, generator=g).reshape(-1)
    ts = []
    for _ in range(iters):
        t0 = time.perf_counter()
        speculative_sample(p, q, toks, g)
        ts.append(time.perf_counter() - t0)
    return {"vocab_size": vocab_size, "gamma": gamma, "median_seconds": float(np.median(ts)),
            "p90_seconds": float(np.percentile(ts, 90))}


def forward_cost_ratio(pair, context_len: int = 128, iters: int = 30) -> dict:
    """Median seconds of a one-token forward with a KV cache of ``context_len`` tokens, draft and target
    interleaved; returns both and their ratio (draft / target)."""
    import numpy as np
    import torch
    from transformers import DynamicCache

    from learn2draft.timing import DeviceClock

    clock = DeviceClock(pair.device)
    ctx = torch.randint(0, pair.vocab_size, (1, context_len), device=pair.device)
    x = torch.randint(0, pair.vocab_size, (1, 1), device=pair.device)
    caches = {}
    times = {"draft": [], "target": []}
    with torch.inference_mode():
        for role in times:
            m = getattr(pair, role)
            caches[role] = DynamicCache()
            m(input_ids=ctx, cache=caches[role], use_cache=True)
        for _ in range(iters):
            for role in times:
                m = getattr(pair, role)
                t0 = clock.now()
                m(input_ids=x, cache=caches[role], use_cache=True)
                times[role].append(clock.now() - t0)
                caches[role].crop(-1)
    d, t = float(np.median(times["draft"])), float(np.median(times["target"]))
    return {"context_len": context_len, "draft_seconds": d, "target_seconds": t, "ratio": d / t}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m eval.benchmark", description=plain_doc(__doc__),
                                formatter_class=HelpFormatter)
    cli.add_drafter_arg(p, None)
    p.add_argument("--policy", default=None,
                   help="trained run or export dir (default: the policy shipped for --drafter)")
    cli.add_profile_arg(p)
    p.add_argument("--temperatures", default="0,0.7",
                   help="the temperatures measured, comma-separated; the other sampling flags apply to each "
                        "(default: 0,0.7)")
    p.add_argument("--prompt-set", default="open", choices=list(PROMPT_SETS),
                   help="shipped prompts: open chat (train/heldout), copy-heavy (copy_train/copy_heldout), mixed "
                        "(mixed_train/mixed_heldout: 8 categories, 24 held-out prompts) or multilingual "
                        "(multilingual_train/multilingual_heldout: 6 tasks in en, es, it, zh, 24 held-out prompts); "
                        "default open")
    p.add_argument("--prompts", default=None,
                   help="measure on these prompts instead (.jsonl with a 'prompt' field per line, a JSON list of "
                        "strings, or MT-bench / Spec-Bench questions with 'question_id', 'category', 'turns' and an "
                        "optional 'language'; its first --num-prompts); the fixed γ is still chosen on the "
                        "--prompt-set training prompts")
    p.add_argument("--num-prompts", type=int, default=6, help="prompts measured (default: 6)")
    p.add_argument("--repeats", type=int, default=3, help="repeats of every (method, prompt) (default: 3)")
    p.add_argument("--max-new-tokens", type=int, default=64, help="default: 64")
    p.add_argument("--num-draft-tokens", type=int, default=None,
                   help="fixed γ (num_draft_tokens); default: the best of --gammas on the training prompts")
    p.add_argument("--gammas", default="1,2,3,4,6,8",
                   help="grid for the fixed γ when --num-draft-tokens is not given (default: 1,2,3,4,6,8)")
    p.add_argument("--prompt-lookup-num-tokens", type=int, default=10,
                   help="candidates per step of HF prompt lookup decoding (default: 10, the documented example)")
    p.add_argument("--seed", type=int, default=0, help="default: 0")
    cli.add_out_arg(p, f"the results directory (default: {DEFAULT_OUT}): {', '.join(RESULT_FILES)}")
    from eval.__main__ import add_overwrite_argument, add_tree_arguments

    add_overwrite_argument(p)
    add_tree_arguments(p)
    cli.add_model_args(p)
    cli.add_sampling_args(p, temperature=False)
    cli.add_device_args(p)
    return p


def main(argv: list[str] | None = None) -> int:
    return run_cli(build_parser(), _run, argv)


def _run(args) -> int:
    from eval.__main__ import _resolve_trees, make_out_dir
    from eval.header import finish_header, header_lines, run_header
    from eval.runner import encode_all, prompt_groupings
    from learn2draft.cli import load_models, model_names, set_threads, stderr_line
    from learn2draft.prompts import (
        COPY_CATEGORIES,
        load_prompt_file_records,
        load_prompt_records,
        load_prompts,
        prompt_set_splits,
    )
    from policies.load import run_settings

    temps, samplings, gammas, device = _check_settings(args)
    policy_dir, policy, head = _resolve_policy(args)
    trees = _resolve_trees(args, args.drafter)
    cfg = run_settings(policy_dir)  # the pair the policy was trained on, unless named here
    set_threads(args, cfg.get("threads"))
    args.target, args.draft = model_names(args, cfg)
    user_prompts = load_prompt_file_records(args.prompts) if args.prompts else None
    out = make_out_dir(Path(args.out or DEFAULT_OUT), RESULT_FILES, args.overwrite)
    # The Hugging Face assisted-generation rows and the forward-cost ratio need the draft model, whatever drafts here.
    pair = load_models(args, args.drafter, need_draft=True, device=device, progress=stderr_line,
                       max_depth=getattr(policy, "max_depth", None))  # auto's widths: the policy's depth too
    train_split, held_split = prompt_set_splits(args.prompt_set)
    held_records = (user_prompts if user_prompts is not None else load_prompt_records(held_split))[: args.num_prompts]
    held = encode_all(pair, [p.text for p in held_records], args.max_new_tokens)
    train = encode_all(pair, load_prompts(train_split)[: args.num_prompts], args.max_new_tokens)
    header = run_header(args.target, args.draft, pair, args.dtype, {str(T): samplings[T].to_dict() for T in temps},
                        str(pair.device), held_records, args.prompts or held_split, args.forward_rows)
    report, md = _report_header(args, pair, device, policy_dir, policy, held, trees)
    report["header"] = header
    groups = prompt_groupings(held_records)
    copy_idx = [i for i, p in enumerate(held_records) if p.category in COPY_CATEGORIES]
    for T in temps:
        md += _measure_temperature(args, pair, T, samplings[T], train, held, gammas, policy, head, trees, report,
                                   groups, copy_idx)
    finish_header(report["header"])
    md = header_lines(report["header"]) + md + _verdicts(report)
    _write_report(report, md, out)
    return 0


def _check_settings(args) -> tuple:
    """Check every setting before the (slow) model loading: ``(temperatures, samplings, gammas, device)``."""
    from eval.__main__ import parse_gammas
    from learn2draft.cli import resolve_device, sampling_config

    try:
        temps = [float(t) for t in cli.comma_items(args.temperatures)]
    except ValueError:
        temps = []
    if not temps:
        raise ValueError(f"--temperatures {args.temperatures!r}: use comma-separated numbers, e.g. 0,0.7.")
    samplings = {T: sampling_config(args, temperature=T) for T in temps}
    if any(s.prefix_dependent or s.min_p for s in samplings.values()):
        raise ValueError("--min-p, --repetition-penalty and --presence-penalty: the Hugging Face baselines of the "
                         "benchmark support temperature, top-k and top-p only; drop them.")
    if args.num_prompts < 1 or args.repeats < 1 or args.max_new_tokens < 1:
        raise ValueError("--num-prompts, --repeats and --max-new-tokens must be ≥ 1.")
    if args.num_draft_tokens is not None and args.num_draft_tokens < 1:
        raise ValueError(f"--num-draft-tokens must be ≥ 1, got {args.num_draft_tokens}.")
    if args.prompt_lookup_num_tokens < 1:
        raise ValueError(f"--prompt-lookup-num-tokens must be ≥ 1, got {args.prompt_lookup_num_tokens}.")
    gammas = parse_gammas(args.gammas)
    device = resolve_device(args.device)
    return temps, samplings, gammas, device


def _resolve_policy(args) -> tuple:
    """Resolve the policy and its head, and set ``args.drafter`` to its drafter: ``(policy_dir, policy, head)``."""
    from learn2draft.cli import lookup_min_ngram
    from policies.load import default_policy_for, load_policy, policy_drafter, policy_head, policy_lookup_min_ngram

    # without --policy: the shipped one of the run's precision, --dtype pinned to it
    policy_dir = Path(args.policy) if args.policy else default_policy_for(args, args.drafter or "model")
    if not policy_dir.is_dir():
        raise FileNotFoundError(f"--policy {args.policy}: no such directory (run `python -m train` first).")
    policy = load_policy(policy_dir, profile=args.profile)
    trained_with = policy_drafter(policy_dir)
    head = args.head or policy_head(policy_dir)
    args.drafter = args.drafter or trained_with
    if trained_with != args.drafter:
        raise ValueError(f"The policy in {policy_dir} was trained with the {trained_with!r} drafter, not "
                         f"{args.drafter!r}: pass --drafter {trained_with} or a matching --policy.")
    # every lookup row (fixed γ, rules, learned) runs the policy's n-gram setting unless --lookup-min-ngram is given
    args.lookup_min_ngram = lookup_min_ngram(args, args.drafter, policy_lookup_min_ngram(policy_dir),
                                             f"the policy in {policy_dir}")
    return policy_dir, policy, head


def _report_header(args, pair, device: str, policy_dir: Path, policy, held: list, trees) -> tuple[dict, list[str]]:
    """Measure the exact sampler and the forward-cost ratio; the report's header and its Markdown lines."""
    from eval.__main__ import _machine

    tree, tree_dir = trees.shape, trees.directory
    from learn2draft.cli import resolved_dtype

    report = {"machine": _machine(device), "dtype": resolved_dtype(args), "target": args.target, "draft": args.draft,
              "drafter": args.drafter, "lookup_min_ngram": args.lookup_min_ngram,
              "policy": str(policy_dir), "policy_profile": policy.profile_name,
              "prompts": args.prompts or args.prompt_set,
              "max_new_tokens": args.max_new_tokens, "repeats": args.repeats, "num_prompts": len(held),
              "tree": None if tree is None else {"width": tree.width, "top_k": tree.top_k,
                                                 "tree_policy": None if tree_dir is None else str(tree_dir)},
              "sampler": sampler_microbenchmark(), "forward_cost": forward_cost_ratio(pair), "runs": {}}
    tree_line = [] if tree is None else [
        f"Trees: W={tree.width}, top-k={tree.top_k}; fixed (depth, V) chosen on the training prompts from "
        f"{', '.join(f'({d}, {v})' for d, v in trees.grid)}; learned tree: {tree_dir or 'none shipped or given'}.", ""]
    md = [f"Machine: {report['machine']}; precision: {report['dtype']} (every method)", "",
          f"Drafter: {args.drafter}"
          + (f" (lookup min n-gram {args.lookup_min_ngram})" if args.lookup_min_ngram is not None else "")
          + f"; policy: {policy_dir}; prompts: {report['prompts']} ({len(held)}), "
          f"{args.max_new_tokens} new tokens, {args.repeats} repeats.", "", *tree_line,
          f"Exact sampler, V=49,152, γ=12: median {1e3 * report['sampler']['median_seconds']:.3f} ms per cycle.",
          f"One-token forward at context 128: draft {1e3 * report['forward_cost']['draft_seconds']:.2f} ms, target "
          f"{1e3 * report['forward_cost']['target_seconds']:.2f} ms, ratio {report['forward_cost']['ratio']:.3f}.", ""]
    return report, md


def _measure_temperature(args, pair, T: float, sampling, train: list, held: list, gammas: list[int], policy, head,
                         trees, report: dict, groups: dict | None = None, copy_idx: list[int] = ()) -> list[str]:
    """Measure one temperature: fixed γ (and tree) chosen on the training prompts, every method interleaved;
    summarised over the whole mix, per grouping of ``groups`` (:func:`eval.runner.prompt_groupings`) and, when
    there are any, over the copy-heavy prompts ``copy_idx`` (for the verdicts)."""
    from eval.compare import grid_search, tree_grid_search
    from eval.runner import (
        DecoderMethod,
        groups_table,
        methods_table,
        requests_table,
        run_interleaved,
        summarize,
        summarize_groups,
    )

    if "+" in args.drafter:  # a hybrid: each source alone at its own best γ, the hand rules, the learned policy
        best = {src: args.num_draft_tokens or grid_search(pair, train, gammas, sampling, args.max_new_tokens,
                                                          seed=args.seed, desc=f"{src} γ grid T={T}", drafter=src,
                                                          head=head, min_ngram=args.lookup_min_ngram)["best_gamma"]
                for src in args.drafter.split("+")}
        methods = _hybrid_methods(args, pair, sampling, best, policy, head)
        run = {"fixed_gamma": best}
    else:
        gamma = args.num_draft_tokens or grid_search(pair, train, gammas, sampling, args.max_new_tokens,
                                                     seed=args.seed, desc=f"γ grid T={T}",
                                                     drafter=args.drafter, head=head,
                                                     min_ngram=args.lookup_min_ngram)["best_gamma"]
        methods = _chain_methods(args, pair, sampling, gamma, policy, head)
        run = {"fixed_gamma": gamma}
    tree = trees.shape
    if tree is not None:
        from learn2draft.tree import FixedTreeController

        grid = tree_grid_search(pair, train, trees.grid, sampling, args.max_new_tokens, tree, seed=args.seed,
                                desc=f"tree grid T={T}", drafter=args.drafter, head=head)
        d, v = grid["best"]
        run.update(fixed_tree=grid["best"], tree_grid=grid)
        methods.append(DecoderMethod(f"{args.drafter}: fixed tree depth={d}, V={v}", pair,
                                     FixedTreeController(d, v), sampling, args.max_new_tokens, args.drafter, head,
                                     tree=tree))
        if trees.controller is not None:
            methods.append(DecoderMethod(f"{args.drafter}: learned tree", pair, trees.controller, sampling,
                                         args.max_new_tokens, args.drafter, head, tree=tree))
    records = run_interleaved(methods, held, args.repeats, args.seed, desc=f"benchmark T={T}")
    summary = summarize(records, reference=PLAIN)
    by = {key: summarize_groups(records, g, reference=PLAIN) for key, g in (groups or {}).items()}
    copy = summarize_groups(records, {"copy": copy_idx}, reference=PLAIN).get("copy") if copy_idx else None
    fixed = [m.name for m in methods if ": fixed " in m.name]
    report["runs"][str(T)] = {**run, "methods": summary, "groups": by, "copy_prompts": len(copy_idx),
                              "copy_summary": copy, "roles": _roles(args, fixed)}
    md = [f"### Temperature {T}", "", *methods_table(summary, PLAIN), "", *requests_table(summary), ""]
    for key, by_group in by.items():
        md += [f"Per {key} (ratios to {PLAIN} within the {key}):", "", *groups_table(by_group, PLAIN, key), ""]
    return md


def _roles(args, fixed: list[str]) -> dict:
    """The methods that play the roles of :mod:`eval.verdicts`' claims in this benchmark."""
    return {"learned": f"{args.drafter}: learned policy", "generate": PLAIN, "autoregressive": "learn2draft autoregressive",
            "prompt_lookup": f"hf prompt lookup ({args.prompt_lookup_num_tokens})", "best_fixed": fixed}


def _verdicts(report: dict) -> list[str]:
    """Judge :data:`eval.verdicts.DEFAULT_CLAIMS` on every temperature: store them in ``report["verdicts"]``,
    return the report's lines."""
    from eval.verdicts import evaluate_claims, verdict_lines

    runs = {T: {"methods": r["methods"], "categories": r["groups"].get("category"), "copy": r["copy_summary"],
                "roles": r["roles"]} for T, r in report["runs"].items()}
    report["verdicts"] = evaluate_claims(runs)
    return ["## Verdicts (issue 16's goals; ratios of tokens/s, per-repeat mean)", "", "```",
            *verdict_lines(report["verdicts"]), "```", ""]


def _chain_methods(args, pair, sampling, gamma: int, policy, head) -> list:
    """The Hugging Face rows and this project's chain rows: autoregressive, fixed γ, heuristic rule, learned policy."""
    from eval.runner import DecoderMethod, HFGenerateMethod
    from learn2draft.decoding import FixedDepthController
    from policies.controllers import ConfidenceThresholdController, MatchLengthController

    depth = policy.max_depth
    methods = [
        HFGenerateMethod(PLAIN, pair, sampling, args.max_new_tokens),
        HFGenerateMethod("hf assisted (default)", pair, sampling, args.max_new_tokens, assistant=True),
        HFGenerateMethod("hf assisted (heuristic)", pair, sampling, args.max_new_tokens, assistant=True,
                         assistant_config={"num_assistant_tokens_schedule": "heuristic"}),
        HFGenerateMethod(f"hf prompt lookup ({args.prompt_lookup_num_tokens})", pair, sampling,
                         args.max_new_tokens, prompt_lookup_num_tokens=args.prompt_lookup_num_tokens),
        *([HFPolicyMethod(HFGenerateMethod(HF_POLICY, pair, sampling, args.max_new_tokens, assistant=True),
                          policy)] if args.drafter == "model" else []),
        DecoderMethod("learn2draft autoregressive", pair, FixedDepthController(0), sampling, args.max_new_tokens),
        DecoderMethod(f"{args.drafter}: fixed γ={gamma}", pair, FixedDepthController(gamma), sampling,
                      args.max_new_tokens, args.drafter, head, min_ngram=args.lookup_min_ngram),
    ]
    if args.drafter == "lookup":
        methods.append(DecoderMethod("lookup: match-length rule", pair, MatchLengthController(depth), sampling,
                                     args.max_new_tokens, args.drafter, head, min_ngram=args.lookup_min_ngram))
    else:
        methods.append(DecoderMethod(f"{args.drafter}: confidence ≥ 0.4 rule", pair,
                                     ConfidenceThresholdController(0.4, depth), sampling, args.max_new_tokens,
                                     args.drafter, head, min_ngram=args.lookup_min_ngram))
    methods.append(DecoderMethod(f"{args.drafter}: learned policy", pair, policy, sampling, args.max_new_tokens,
                                 args.drafter, head, min_ngram=args.lookup_min_ngram))
    return methods


def _hybrid_methods(args, pair, sampling, best: dict[str, int], policy, head) -> list:
    """A hybrid drafter's rows: plain ``generate()``, HF prompt lookup, this project's autoregressive loop, each source
    alone at its best fixed γ (chosen on the training prompts), vLLM's lookup-first rule and ArcticInference's score
    rule (k = the neural drafter's best γ) and the learned hybrid policy."""
    from eval.runner import DecoderMethod, HFGenerateMethod
    from learn2draft.decoding import FixedDepthController
    from policies.controllers import LookupFirstController, SuffixScoreController

    neural = args.drafter.split("+")[1]
    k, depth = best[neural], policy.max_depth
    methods = [
        HFGenerateMethod(PLAIN, pair, sampling, args.max_new_tokens),
        HFGenerateMethod(f"hf prompt lookup ({args.prompt_lookup_num_tokens})", pair, sampling,
                         args.max_new_tokens, prompt_lookup_num_tokens=args.prompt_lookup_num_tokens),
        DecoderMethod("learn2draft autoregressive", pair, FixedDepthController(0), sampling, args.max_new_tokens),
        *(DecoderMethod(f"{src}: fixed γ={g}", pair, FixedDepthController(g), sampling, args.max_new_tokens, src, head,
                      min_ngram=args.lookup_min_ngram)
          for src, g in best.items()),
    ]
    if k <= depth:
        methods += [
            DecoderMethod(f"{args.drafter}: vLLM lookup-first k={k}", pair, LookupFirstController(k, depth), sampling,
                          args.max_new_tokens, args.drafter, head, min_ngram=args.lookup_min_ngram),
            DecoderMethod(f"{args.drafter}: Arctic score rule k={k}", pair, SuffixScoreController(k, depth), sampling,
                          args.max_new_tokens, args.drafter, head, min_ngram=args.lookup_min_ngram),
        ]
    methods.append(DecoderMethod(f"{args.drafter}: learned policy", pair, policy, sampling, args.max_new_tokens,
                                 args.drafter, head, min_ngram=args.lookup_min_ngram))
    return methods


def _write_report(report: dict, md: list[str], out: Path) -> None:
    """Write the report (benchmark.md, benchmark.json, benchmark.png) and print it (:func:`eval.header.write_report`)."""
    from eval.header import write_report

    write_report(out, "benchmark", report, md, plot_benchmark)


def plot_benchmark(report: dict, path: Path) -> None:
    """Bars of tokens/s relative to plain ``generate()`` (mean, min–max over repeats), one panel
    per temperature and, when the prompts have categories, below each the learned policy's accepted-length
    distribution per category (:func:`eval.compare.plot_accepted_lengths`); saved as PNG."""
    import matplotlib
    import numpy as np

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from eval.compare import plot_accepted_lengths

    runs = report["runs"]
    with_cats = any((run.get("groups") or {}).get("category") for run in runs.values())
    fig, axes = plt.subplots(1 + with_cats, len(runs), figsize=(6 * len(runs), 4.8 * (1 + with_cats)), squeeze=False)
    for col, (T, run) in enumerate(runs.items()):
        ax = axes[0][col]
        names = list(run["methods"])
        r = [run["methods"][n][f"ratio_to_{PLAIN}"] for n in names]
        means = np.array([x["mean"] for x in r])
        err = np.array([[m - x["min"] for m, x in zip(means, r)], [x["max"] - m for m, x in zip(means, r)]])
        colors = ["#888" if n.startswith("hf") else "#c52" if "learned" in n else "#4a7" for n in names]
        ax.barh(range(len(names)), means, xerr=err, color=colors, capsize=3)
        ax.set_yticks(range(len(names)), names, fontsize=8)
        ax.invert_yaxis()
        ax.axvline(1.0, color="k", lw=0.8, ls="--")
        ax.set_xlabel("tokens/s × plain generate() (min–max over repeats)")
        ax.set_title(f"temperature {T}, drafter {report['drafter']}")
        if with_cats:
            by_cat = (run.get("groups") or {}).get("category") or {}
            plot_accepted_lengths(axes[1][col], by_cat, (run.get("roles") or {}).get("learned", ""))
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    sys.exit(main())
