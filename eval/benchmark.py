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
from learn2draft.settings import RunSettings

PLAIN = "hf generate"
#: The fixed-γ grid of issue 38: every γ a user could pick.
FULL_GAMMAS = (1, 2, 3, 4, 6, 8, 10, 12, 16)
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
    cli.add_engine_args(p, "hf (default): this project's loop against Hugging Face generation; llama.cpp: plain "
                        "llama.cpp, its prompt lookup at every --gammas num_pred_tokens and the learned lookup policy "
                        "inside it (eval.llamacpp; needs llama-cpp-python: make llamacpp), tokens/s of the decode phase")
    p.add_argument("--no-hf-reference", dest="hf_reference", action="store_false",
                   help="with --engine llama.cpp: leave out the reference row of this project's Hugging Face "
                        "generate() (default: measured, so the table shows what the engine buys)")
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
                   help="measure this one fixed γ instead of the --gammas grid")
    p.add_argument("--gammas", default=",".join(map(str, FULL_GAMMAS)),
                   help="the fixed-γ grid: every drafter (each source of a hybrid) at every γ, prompt lookup at every "
                        f"--lookup-min-ngrams (default: {','.join(map(str, FULL_GAMMAS))})")
    p.add_argument("--lookup-min-ngrams", default="1,2",
                   help="prompt lookup's shortest n-gram match in the fixed grid, comma-separated (default: 1,2)")
    p.add_argument("--validation-prompts", type=int, default=None,
                   help="prompts of the validation split on which the fixed grid is measured to choose the fixed "
                        "configuration a user would pick and the hand rules' k (default: --num-prompts)")
    p.add_argument("--test-arms", type=int, default=0,
                   help="fixed arms measured on the test prompts: 0 = every arm of the grid (default); K = the K "
                        "fastest on validation, plus each drafter's fastest and HF's arms (the best in hindsight is "
                        "then the best of those)")
    p.add_argument("--heldout-split", default=None,
                   help="measure on this shipped split instead of --prompt-set's test split, e.g. corpus_loso "
                        "(the leave-one-source-out set)")
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
    temps, samplings, gammas, min_ngrams, device = _check_settings(args)  # before the imports of torch and models
    if args.engine == "llama.cpp":
        if args.drafter not in (None, "lookup") or args.tree or args.prompt_lookup_num_tokens != 10:
            raise ValueError("--engine llama.cpp measures prompt lookup only (its grid is --gammas): drop --drafter, "
                             "--tree and --prompt-lookup-num-tokens.")
        cli.check_gguf_arg(args)
        if args.policy is not None and not Path(args.policy).is_dir():
            raise ValueError(f"--policy {args.policy}: no such directory.")
        from eval.__main__ import _machine, make_out_dir
        from eval.llamacpp import run_benchmark
        from policies.llamacpp import require_llama_cpp

        require_llama_cpp()
        val_split, held_split = benchmark_splits(args.prompt_set, args.heldout_split)
        out = make_out_dir(Path(args.out or DEFAULT_OUT), RESULT_FILES, args.overwrite)
        return run_benchmark(args, temps, gammas, out, val_split, held_split, _machine("cpu"))
    if args.gguf is not None:
        raise ValueError("--gguf applies to --engine llama.cpp (for this project's loop pass --target FILE.gguf).")
    from eval.__main__ import _resolve_trees, _tree_depths, make_out_dir
    from eval.header import finish_header, header_lines, run_header
    from eval.runner import encode_all, prompt_groupings
    from learn2draft.cli import load_models, model_names, set_threads, stderr_line
    from learn2draft.prompts import COPY_CATEGORIES, load_prompt_file_records, load_prompt_records
    from policies.load import run_settings

    policy_dir, policy, head, drafter, dtype, min_ngram = _resolve_policy(args)
    trees = _resolve_trees(args, drafter)
    cfg = run_settings(policy_dir)  # the pair the policy was trained on, unless named here
    threads = set_threads(args, cfg.get("threads"))
    target, draft = model_names(args.target, args.draft, cfg)
    val_split, held_split = benchmark_splits(args.prompt_set, args.heldout_split)
    user_prompts = load_prompt_file_records(args.prompts) if args.prompts else None
    out = make_out_dir(Path(args.out or DEFAULT_OUT), RESULT_FILES, args.overwrite)
    # auto's widths: the policy's depth, the γ grid and (with --tree) the verification sizes
    settings = RunSettings.resolve(device=device, dtype=dtype, threads=threads,
                                   depths=(getattr(policy, "max_depth", None), args.gammas, *_tree_depths(args)),
                                   target=target, draft=draft, drafter=drafter, lookup_min_ngram=min_ngram)
    # The Hugging Face assisted-generation rows and the forward-cost ratio need the draft model, whatever drafts here.
    pair = load_models(settings, drafter, need_draft=True, progress=stderr_line, head=args.head)
    held_records = (user_prompts if user_prompts is not None else load_prompt_records(held_split))[: args.num_prompts]
    held = encode_all(pair, [p.text for p in held_records], args.max_new_tokens)
    n_val = args.validation_prompts or args.num_prompts
    val = encode_all(pair, [p.text for p in load_prompt_records(val_split)[:n_val]], args.max_new_tokens)
    header = run_header(settings.target, settings.draft, pair, settings.dtype,
                        {str(T): samplings[T].to_dict() for T in temps}, str(pair.device), held_records,
                        args.prompts or held_split, settings.forward_rows)
    report, md = _report_header(args, settings, pair, device, policy_dir, policy, held, trees)
    report["header"] = header
    report["validation"] = {"split": val_split, "prompts": len(val)}
    groups = prompt_groupings(held_records)
    copy_idx = [i for i, p in enumerate(held_records) if p.category in COPY_CATEGORIES]
    for T in temps:
        md += _measure_temperature(args, settings, pair, T, samplings[T], val, held, gammas, min_ngrams, policy, head, trees,
                                   report, groups, copy_idx)
    finish_header(report["header"])
    md = header_lines(report["header"]) + md + _verdicts(report)
    _write_report(report, md, out)
    return 0


def benchmark_splits(prompt_set: str, heldout_split: str | None = None) -> tuple[str, str]:
    """The (validation, test) splits of a shipped prompt set: the set's validation split where it has one
    (``corpus_validation``), else its training split; the test split is ``heldout_split`` when given (e.g.
    ``corpus_loso``), else the set's held-out split.

    Raises:
        ValueError: unknown prompt set or split (naming ``--prompt-set`` / ``--heldout-split``).
    """
    from learn2draft.prompts import SPLITS, prompt_set_splits

    train_split, held_split = prompt_set_splits(prompt_set)
    if heldout_split is not None:
        if heldout_split not in SPLITS:
            raise ValueError(f"--heldout-split {heldout_split!r}: use one of {', '.join(SPLITS)}.")
        held_split = heldout_split
    validation = f"{prompt_set}_validation"
    return (validation if validation in SPLITS else train_split), held_split


def _check_settings(args) -> tuple:
    """Check every setting before the (slow) model loading: ``(temperatures, samplings, gammas, min_ngrams,
    device)``."""
    from eval.__main__ import parse_gammas
    from learn2draft.cli import resolve_device, sampling_config
    from learn2draft.prompts import SPLITS

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
    for flag, value in (("--num-prompts", args.num_prompts), ("--repeats", args.repeats),
                        ("--max-new-tokens", args.max_new_tokens)):
        if value < 1:
            raise ValueError(f"{flag} must be ≥ 1, got {value}.")
    if args.validation_prompts is not None and args.validation_prompts < 1:
        raise ValueError(f"--validation-prompts must be ≥ 1, got {args.validation_prompts}.")
    if args.test_arms < 0:
        raise ValueError(f"--test-arms must be ≥ 0 (0 = every arm), got {args.test_arms}.")
    if args.num_draft_tokens is not None and args.num_draft_tokens < 1:
        raise ValueError(f"--num-draft-tokens must be ≥ 1, got {args.num_draft_tokens}.")
    if args.prompt_lookup_num_tokens < 1:
        raise ValueError(f"--prompt-lookup-num-tokens must be ≥ 1, got {args.prompt_lookup_num_tokens}.")
    if args.heldout_split is not None and args.heldout_split not in SPLITS:
        raise ValueError(f"--heldout-split {args.heldout_split!r}: use one of {', '.join(SPLITS)}.")
    gammas = [args.num_draft_tokens] if args.num_draft_tokens else parse_gammas(args.gammas)
    from eval.__main__ import parse_ints

    min_ngrams = parse_ints(args.lookup_min_ngrams, "--lookup-min-ngrams", "n-gram")
    if any(n > 4 for n in min_ngrams):
        raise ValueError(f"--lookup-min-ngrams {args.lookup_min_ngrams!r}: prompt lookup's n-grams are 1 to 4 tokens.")
    device = resolve_device(args.device)
    return temps, samplings, gammas, min_ngrams, device


def _resolve_policy(args) -> tuple:
    """Resolve the policy, its head, its drafter, the run's precision (pinned with a shipped policy, else
    ``--dtype``) and prompt lookup's n-gram: ``(policy_dir, policy, head, drafter, dtype, lookup_min_ngram)``."""
    from eval.__main__ import _tree_depths
    from learn2draft.cli import lookup_min_ngram
    from policies.load import default_policy_for, load_policy, policy_drafter, policy_head, policy_lookup_min_ngram

    # without --policy: the shipped one of the run's precision, --dtype pinned to it
    dtype = args.dtype
    if args.policy:
        policy_dir = Path(args.policy)
    else:
        policy_dir, dtype = default_policy_for(args.drafter or "model", args.dtype, args.device, args.threads,
                                               depths=(args.gammas, *_tree_depths(args)))
    if not policy_dir.is_dir():
        raise FileNotFoundError(f"--policy {args.policy}: no such directory (run `python -m train` first).")
    policy = load_policy(policy_dir, profile=args.profile)
    trained_with = policy_drafter(policy_dir)
    head = args.head or policy_head(policy_dir)
    drafter = args.drafter or trained_with
    if trained_with != drafter:
        raise ValueError(f"The policy in {policy_dir} was trained with the {trained_with!r} drafter, not "
                         f"{drafter!r}: pass --drafter {trained_with} or a matching --policy.")
    # every lookup row (fixed γ, rules, learned) runs the policy's n-gram setting unless --lookup-min-ngram is given
    min_ngram = lookup_min_ngram(args, drafter, policy_lookup_min_ngram(policy_dir), f"the policy in {policy_dir}")
    return policy_dir, policy, head, drafter, dtype, min_ngram


def _report_header(args, settings: RunSettings, pair, device: str, policy_dir: Path, policy, held: list, trees) -> tuple[dict, list[str]]:
    """Measure the exact sampler and the forward-cost ratio; the report's header and its Markdown lines."""
    from eval.__main__ import _machine

    tree, tree_dir = trees.shape, trees.directory
    report = {"machine": _machine(device), "dtype": settings.dtype, "target": settings.target, "draft": settings.draft,
              "drafter": settings.drafter, "lookup_min_ngram": settings.lookup_min_ngram,
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
          f"Drafter: {settings.drafter}"
          + (f" (lookup min n-gram {settings.lookup_min_ngram})" if settings.lookup_min_ngram is not None else "")
          + f"; policy: {policy_dir}; prompts: {report['prompts']} ({len(held)}), "
          f"{args.max_new_tokens} new tokens, {args.repeats} repeats.", "", *tree_line,
          f"Exact sampler, V=49,152, γ=12: median {1e3 * report['sampler']['median_seconds']:.3f} ms per cycle.",
          f"One-token forward at context 128: draft {1e3 * report['forward_cost']['draft_seconds']:.2f} ms, target "
          f"{1e3 * report['forward_cost']['target_seconds']:.2f} ms, ratio {report['forward_cost']['ratio']:.3f}.", ""]
    return report, md


def fixed_arms(args, settings: RunSettings, pair, sampling, gammas: list[int], min_ngrams: list[int], head) -> dict:
    """Every fixed configuration a user could pick, as benchmark methods (name → method): each drafter (each source
    of a hybrid) at every γ of ``gammas``, prompt lookup at every shortest n-gram of ``min_ngrams``; HF prompt lookup
    (``--prompt-lookup-num-tokens``); for the model drafter, HF assisted generation (default and heuristic
    schedules). None of them adapts to the request."""
    from eval.runner import DecoderMethod, HFGenerateMethod
    from learn2draft.decoding import FixedDepthController

    arms = {}
    name = f"hf prompt lookup ({args.prompt_lookup_num_tokens})"
    arms[name] = HFGenerateMethod(name, pair, sampling, args.max_new_tokens,
                                  prompt_lookup_num_tokens=args.prompt_lookup_num_tokens)
    if settings.drafter == "model":
        arms["hf assisted (default)"] = HFGenerateMethod("hf assisted (default)", pair, sampling, args.max_new_tokens,
                                                         assistant=True)
        arms["hf assisted (heuristic)"] = HFGenerateMethod(
            "hf assisted (heuristic)", pair, sampling, args.max_new_tokens, assistant=True,
            assistant_config={"num_assistant_tokens_schedule": "heuristic"})
    for src in settings.drafter.split("+"):
        for n in (min_ngrams if src == "lookup" else [None]):
            for g in gammas:
                label = fixed_arm_name(src, g, n)
                arms[label] = DecoderMethod(label, pair, FixedDepthController(g), sampling, args.max_new_tokens, src,
                                            head, min_ngram=n)
    return arms


def fixed_arm_name(source: str, gamma: int, min_ngram: int | None = None) -> str:
    """The benchmark's name of a fixed arm: ``"lookup (n≥2): fixed γ=8"``, ``"head: fixed γ=2"``."""
    return f"{source}{'' if min_ngram is None else f' (n≥{min_ngram})'}: fixed γ={gamma}"


def _fastest(tps: dict[str, float], names) -> str | None:
    names = [n for n in names if n in tps]
    return max(names, key=tps.get) if names else None


def _arm_source(name: str) -> str:
    """The drafter of a fixed arm named by :func:`fixed_arm_name` (``"lookup"`` of ``"lookup (n≥2): fixed γ=8"``)."""
    return name.split(":")[0].split(" (")[0]


def _measure_temperature(args, settings: RunSettings, pair, T: float, sampling, val: list, held: list, gammas: list[int],
                         min_ngrams: list[int], policy, head, trees, report: dict, groups: dict | None = None,
                         copy_idx: list[int] = ()) -> list[str]:
    """Measure one temperature in two phases.

    1. Validation: every fixed arm (:func:`fixed_arms`) on the validation prompts ``val``, interleaved; the fastest
       is the *chosen* fixed configuration (what a user tuning on their own traffic would pick), and each drafter's
       fastest γ gives the hand rules their k.
    2. Test: plain ``generate()``, the autoregressive loop, the fixed arms (all, or with ``--test-arms K`` the K
       fastest on validation plus the chosen one, each drafter's fastest and HF's arms), the hand rules and the
       learned policy, interleaved on ``held``. The best fixed configuration *in hindsight* is the fastest fixed arm
       there, HF's arms included.

    Summarised over the whole mix, per grouping of ``groups`` (:func:`eval.runner.prompt_groupings`) and over the
    copy-heavy prompts ``copy_idx``."""
    from eval.compare import tree_grid_search
    from eval.runner import (
        DecoderMethod,
        HFGenerateMethod,
        groups_table,
        methods_table,
        requests_table,
        run_interleaved,
        summarize,
        summarize_groups,
    )
    from learn2draft.decoding import FixedDepthController

    arms = fixed_arms(args, settings, pair, sampling, gammas, min_ngrams, head)
    val_summary = summarize(run_interleaved(list(arms.values()), val, 1, args.seed, desc=f"validation grid T={T}",
                                                warmup=True))
    val_tps = {n: s["tokens_per_second_mean"] for n, s in val_summary.items()}
    chosen = max(val_tps, key=val_tps.get)
    sources = settings.drafter.split("+")
    best_arm = {src: _fastest(val_tps, [n for n in arms if _arm_source(n) == src]) for src in sources}
    best_gamma = {src: int(name.rsplit("=", 1)[1]) for src, name in best_arm.items()}
    ranked = sorted(arms, key=val_tps.get, reverse=True)
    if args.test_arms:
        keep = set(ranked[: args.test_arms]) | {chosen} | {n for n in arms if n.startswith("hf ")} | set(best_arm.values())
        test_arms = [n for n in ranked if n in keep]
    else:
        test_arms = ranked
    rules = _rules(args, settings, pair, sampling, best_gamma, policy, head)
    methods = [HFGenerateMethod(PLAIN, pair, sampling, args.max_new_tokens),
               DecoderMethod("learn2draft autoregressive", pair, FixedDepthController(0), sampling,
                             args.max_new_tokens),
               *(arms[n] for n in test_arms), *rules]
    if settings.drafter == "model":
        methods.append(HFPolicyMethod(HFGenerateMethod(HF_POLICY, pair, sampling, args.max_new_tokens, assistant=True),
                                      policy))
    learned = f"{settings.drafter}: learned policy"
    methods.append(DecoderMethod(learned, pair, policy, sampling, args.max_new_tokens, settings.drafter, head,
                                 min_ngram=settings.lookup_min_ngram))
    run = {"validation": {"tokens_per_second": val_tps, "chosen": chosen, "best_gamma": best_gamma},
           "fixed_gamma": best_gamma if "+" in settings.drafter else best_gamma[settings.drafter],
           "grid": {"gammas": gammas, "lookup_min_ngrams": min_ngrams if "lookup" in sources else []},
           "test_arms": test_arms}
    tree = trees.shape
    if tree is not None:
        from learn2draft.tree import FixedTreeController

        grid = tree_grid_search(pair, val, trees.grid, sampling, args.max_new_tokens, tree, seed=args.seed,
                                desc=f"tree grid T={T}", drafter=settings.drafter, head=head)
        d, v = grid["best"]
        run.update(fixed_tree=grid["best"], tree_grid=grid)
        tree_name = f"{settings.drafter}: fixed tree depth={d}, V={v}"
        test_arms.append(tree_name)
        methods.insert(-1, DecoderMethod(tree_name, pair, FixedTreeController(d, v), sampling, args.max_new_tokens,
                                         settings.drafter, head, tree=tree))
        if trees.controller is not None:
            methods.insert(-1, DecoderMethod(f"{settings.drafter}: learned tree", pair, trees.controller, sampling,
                                             args.max_new_tokens, settings.drafter, head, tree=tree))
    records = run_interleaved(methods, held, args.repeats, args.seed, desc=f"benchmark T={T}", warmup=True)
    summary = summarize(records, reference=PLAIN)
    by = {key: summarize_groups(records, g, reference=PLAIN) for key, g in (groups or {}).items()}
    copy = summarize_groups(records, {"copy": copy_idx}, reference=PLAIN).get("copy") if copy_idx else None
    roles = _roles(args, settings, test_arms, chosen, [m.name for m in rules])
    hindsight = _fastest({n: s["tokens_per_second_mean"] for n, s in summary.items()}, test_arms)
    run.update(best_fixed_in_hindsight=hindsight)
    report["runs"][str(T)] = {**run, "methods": summary, "groups": by, "copy_prompts": len(copy_idx),
                              "copy_summary": copy, "roles": roles}
    shown = "every arm" if not args.test_arms else f"{len(test_arms)} arms (the {args.test_arms} fastest on validation, " \
                                                  "each drafter's fastest, HF's)"
    md = [f"### Temperature {T}", "",
          f"Fixed grid: {len(arms)} arms (γ ∈ {{{', '.join(map(str, gammas))}}}"
          + (f", lookup min n-gram ∈ {{{', '.join(map(str, min_ngrams))}}}" if "lookup" in sources else "")
          + f", HF's arms) measured on {len(val)} validation prompts; chosen there: **{chosen}** "
            f"({val_tps[chosen]:.1f} tok/s); on the test prompts: {shown}; best in hindsight there: **{hindsight}**.",
          "", *methods_table(summary, PLAIN), "", *requests_table(summary), ""]
    for key, by_group in by.items():
        md += [f"Per {key} (ratios to {PLAIN} within the {key}):", "", *groups_table(by_group, PLAIN, key), ""]
    return md


def _roles(args, settings: RunSettings, fixed: list[str], chosen: str, rules: list[str]) -> dict:
    """The methods that play the roles of :mod:`eval.verdicts`' claims in this benchmark: ``best_fixed`` (every fixed
    arm measured on the test prompts: the verdict takes the fastest, in hindsight), ``chosen_fixed`` (the one chosen
    on validation), ``best_rule`` (the hand rules)."""
    return {"learned": f"{settings.drafter}: learned policy", "generate": PLAIN, "autoregressive": "learn2draft autoregressive",
            "prompt_lookup": f"hf prompt lookup ({args.prompt_lookup_num_tokens})", "best_fixed": fixed,
            "chosen_fixed": chosen, "best_rule": rules}


def _verdicts(report: dict) -> list[str]:
    """Judge :data:`eval.verdicts.DEFAULT_CLAIMS` on every temperature: store them in ``report["verdicts"]``,
    return the report's lines (with a warning when the sample is too small to judge a claim by)."""
    from eval.verdicts import evaluate_claims, verdict_lines

    runs = {T: {"methods": r["methods"], "categories": r["groups"].get("category"), "copy": r["copy_summary"],
                "roles": r["roles"]} for T, r in report["runs"].items()}
    report["verdicts"] = evaluate_claims(runs)
    small = report["num_prompts"] < 24 or report["max_new_tokens"] < 32
    warn = [f"Indicative only: {report['num_prompts']} prompts × {report['max_new_tokens']} new tokens (a verdict "
            "needs ≥ 24 prompts and ≥ 32 tokens to be read as a measurement).", ""] if small else []
    return ["## Verdicts (ratios of tokens/s, per-repeat mean)", "", *warn, "```",
            *verdict_lines(report["verdicts"]), "```", ""]


def _rules(args, settings: RunSettings, pair, sampling, best_gamma: dict[str, int], policy, head) -> list:
    """The hand rules, each at its parameter: for prompt lookup the match-length rule, for a neural drafter the
    draft's confidence ≥ 0.4 (as vLLM and Hugging Face use); for a hybrid also vLLM's lookup-first rule and
    ArcticInference's score rule with k = the neural source's fastest γ on validation."""
    from eval.runner import DecoderMethod
    from policies.rules import (
        ConfidenceThresholdController,
        LookupFirstController,
        MatchLengthController,
        SuffixScoreController,
    )

    depth = policy.max_depth
    out = []
    for src in settings.drafter.split("+"):
        if src == "lookup":
            out.append(DecoderMethod("lookup: match-length rule", pair, MatchLengthController(depth), sampling,
                                     args.max_new_tokens, src, head, min_ngram=settings.lookup_min_ngram))
        else:
            out.append(DecoderMethod(f"{src}: confidence ≥ 0.4 rule", pair, ConfidenceThresholdController(0.4, depth),
                                     sampling, args.max_new_tokens, src, head))
    if "+" in settings.drafter:
        k = min(best_gamma[settings.drafter.split("+")[1]], depth)
        out += [DecoderMethod(f"{settings.drafter}: vLLM lookup-first k={k}", pair, LookupFirstController(k, depth),
                              sampling, args.max_new_tokens, settings.drafter, head, min_ngram=settings.lookup_min_ngram),
                DecoderMethod(f"{settings.drafter}: Arctic score rule k={k}", pair, SuffixScoreController(k, depth),
                              sampling, args.max_new_tokens, settings.drafter, head, min_ngram=settings.lookup_min_ngram)]
    return out


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
