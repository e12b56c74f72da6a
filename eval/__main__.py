"""``python -m eval``: compare a learned drafting policy with the best fixed γ, and check the output law.

Example::

    python -m eval --policy runs/default            # speed comparison (greedy), table + JSON + plot
    python -m eval --policy runs/default --law-check  # also the real-model law check at T=0.8, top-p 0.95
    python -m eval --drafter head --tree            # also draft trees: a fixed (depth, V) grid and the best one
    python -m eval --drafter head --tree --tree-policy runs/tree  # … and a learned tree policy
    python -m eval --drafter head --tree --law-check --skip-speed  # the law check with tree arms too
    python -m eval --prompt-set mixed --num-heldout-prompts 24  # also per category (8 tasks)
    python -m eval --prompts questions.jsonl        # MT-bench / Spec-Bench questions: per category and language

results.md opens with the run's header (eval.header: models and revisions, libraries, precision, sampling,
hardware, threads, load, prompt distribution), as results.json's "header".
"""

from __future__ import annotations

import argparse
import atexit
import json
import os
import shutil
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, NamedTuple

from learn2draft import cli
from learn2draft.cli import HelpFormatter, plain_doc, run_cli
from learn2draft.prompts import PROMPT_SETS
from learn2draft.settings import RunSettings

if TYPE_CHECKING:
    from eval.runner import TreeShape
    from learn2draft.decoding import DraftController

#: What ``python -m eval`` writes in its ``--out`` (an earlier run's are kept unless ``--overwrite``).
RESULT_FILES = ("results.md", "results.json", "results.png")


def parse_ints(text: str, flag: str = "--gammas", what: str = "γ") -> list[int]:
    """``"1-12"`` or ``"1,2,4,8"`` → sorted list of positive ints. Raises ValueError naming ``flag`` otherwise."""
    try:
        if "-" in text:
            a, b = (int(x) for x in text.split("-"))
            out = list(range(a, b + 1))
        else:
            out = [int(x) for x in cli.comma_items(text)]
    except ValueError:
        raise ValueError(f"{flag} {text!r}: use a range like 1-12 or a list like 1,2,4,8.") from None
    if not out or min(out) < 1:
        raise ValueError(f"{flag} {text!r}: need at least one {what} ≥ 1.")
    return sorted(set(out))


def parse_gammas(text: str) -> list[int]:
    """``"1-12"`` or ``"1,2,4,8"`` → sorted list of positive ints. Raises ValueError otherwise."""
    return parse_ints(text, "--gammas", "γ")


def add_tree_arguments(p: argparse.ArgumentParser) -> None:
    """The tree flags shared by ``python -m eval`` and ``python -m eval.benchmark``."""
    p.add_argument("--tree", action="store_true",
                   help="also draft trees (EAGLE-2 drafting, top-V verification; model or head drafter): a fixed "
                        "(depth, V) grid on the training prompts, the best fixed tree and, when there is one, "
                        "the learned tree policy")
    p.add_argument("--tree-policy", default=None,
                   help="with --tree: a learned tree policy (depth and verification size), loaded with "
                        "policies.load.load_tree_policy (default: the one shipped in policies/defaults/"
                        "<drafter>-tree, if any; else no learned-tree row)")
    p.add_argument("--tree-depths", default="2,4,6", help="with --tree: depths of the fixed-tree grid, e.g. 1-6")
    p.add_argument("--verify-sizes", default="4,8,16",
                   help="with --tree: verification sizes V of the fixed-tree grid, e.g. 1,2,4,8,16,32 (clipped "
                        "to the nodes a tree of that depth holds)")
    cli.add_tree_shape_args(p)


def check_tree_arguments(args, drafter: str) -> None:
    """Refuse tree flags without ``--tree`` and trees with the lookup drafter, before any model loads.

    Raises:
        ValueError: naming the flag and what to do.
    """
    given = [f for f, v in (("--tree-policy", args.tree_policy), ("--tree-width", args.tree_width),
                            ("--tree-top-k", args.tree_top_k)) if v is not None]
    if not args.tree:
        if given:
            raise ValueError(f"{', '.join(given)} only apply to trees: add --tree.")
        return
    if drafter == "lookup":
        raise ValueError("--tree needs a drafter with a draft distribution (the lookup drafter drafts no trees): "
                         "pass --drafter model or --drafter head.")
    for flag, v in (("--tree-width", args.tree_width), ("--tree-top-k", args.tree_top_k)):
        if v is not None and v < 1:
            raise ValueError(f"{flag} must be ≥ 1, got {v}.")


def earlier_results(out: Path, results: tuple[str, ...], overwrite: bool) -> list[str]:
    """The names of ``results`` (the files a command writes in ``--out``) that an earlier run left in ``out``.

    Raises:
        ValueError: naming ``--out``: it is a file, or it holds earlier results and not ``overwrite``
            (``--overwrite``), so that no earlier result is lost.
    """
    if out.exists() and not out.is_dir():
        raise ValueError(f"--out {out} is a file: give a directory (the results are written there).")
    earlier = [name for name in results if (out / name).exists()]
    if earlier and not overwrite:
        raise ValueError(f"--out {out} holds the results of an earlier run ({', '.join(earlier)}): pass --overwrite to "
                         "replace them, or choose another --out.")
    return earlier


def add_overwrite_argument(p: argparse.ArgumentParser) -> None:
    """``--overwrite`` of ``python -m eval``, ``python -m eval.benchmark`` and ``python -m eval.serve`` (see
    :func:`make_out_dir`)."""
    p.add_argument("--overwrite", action="store_true",
                   help="replace the results of an earlier run in --out: they move to --out/previous-run/ when the "
                        "run starts and are deleted once this run has written its own (an interrupted run leaves them "
                        "there); without it such a folder is refused")


def make_out_dir(out: Path, results: tuple[str, ...] = (), overwrite: bool = False,
                 partial: tuple[str, ...] = ()) -> Path:
    """Create the output directory (before the slow work, so that a bad ``--out`` fails first). A directory created
    here that is still empty when the process exits (the run failed before writing anything) is removed again.

    Args:
        results: the file names the command writes there; when one of them exists already (an earlier run) the
            directory is refused unless ``overwrite`` (``--overwrite``), so that no earlier result is lost; with
            ``overwrite`` they are moved into ``OUT/previous-run/`` here, so that none of them is read as this run's,
            and that folder is removed when the process exits after writing every result anew; a run that is
            interrupted or fails first leaves them there (the message on standard error says so).
        partial: files a run writes while it runs and removes when it ends (``eval.serve``'s passes so far): an
            earlier run's are refused and moved like ``results``, so that none passes for this run's, but this run
            is not required to leave them. Moving only partial files keeps what ``previous-run/`` holds (the
            complete results an interrupted run had moved there); moving results replaces it. With ``overwrite``
            a ``previous-run/`` left by an interrupted run is removed once this run has written every result.

    Raises:
        ValueError: naming ``--out``: it is a file, cannot be created, or holds an earlier run's ``results``
            without ``overwrite``.
    """
    earlier = earlier_results(out, tuple(results) + tuple(partial), overwrite)
    keep = out / PREVIOUS_RUN_DIR
    if earlier:  # --overwrite: none may pass for this run's (a plot, say), and none is lost before this run's are written
        if any(name in results for name in earlier):  # a newer run's results: they replace what previous-run/ kept
            shutil.rmtree(keep, ignore_errors=True)
        keep.mkdir(exist_ok=True)  # only an interrupted run's partial files: kept beside the results kept there
        for name in earlier:
            os.replace(out / name, keep / name)
    if overwrite and keep.is_dir():  # removed once this run has written every result (an earlier one's too)
        atexit.register(_settle_previous_run, out, tuple(results))
    created = not out.exists()
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ValueError(f"--out {out}: cannot create this directory ({e.strerror or e}); choose another path.") from None
    if created:
        atexit.register(_remove_if_empty, out)
    return out


#: Where ``--overwrite`` keeps an earlier run's results until this run has written its own (:func:`make_out_dir`).
PREVIOUS_RUN_DIR = "previous-run"


def _settle_previous_run(out: Path, results: tuple[str, ...]) -> None:
    """At exit: drop ``OUT/previous-run/`` when every result was written anew, else say where the earlier ones are."""
    keep = out / PREVIOUS_RUN_DIR
    if not keep.is_dir():
        return
    if all((out / name).is_file() for name in results):
        shutil.rmtree(keep, ignore_errors=True)
    else:
        print(f"note: this run did not write all of {', '.join(results)}; the earlier run's results are kept in "
              f"{keep}/", file=sys.stderr)


def _remove_if_empty(path: Path) -> None:
    try:
        if path.is_dir() and not any(path.iterdir()):
            path.rmdir()
    except OSError:
        pass


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m eval", description=plain_doc(__doc__), formatter_class=HelpFormatter)
    p.add_argument("--policy", default=None,
                   help="directory written by `python -m train` or a policy export (default: the policy shipped "
                        "for --drafter, trained on the embedded default pair)")
    cli.add_profile_arg(p)
    cli.add_drafter_arg(p, None)
    p.add_argument("--prompts", default=None,
                   help="held-out prompts from a file (.jsonl with a 'prompt' field per line, a JSON list of "
                        "strings, or MT-bench / Spec-Bench questions with 'question_id', 'category', 'turns' and an "
                        "optional 'language': the first turn is the prompt) instead of the shipped held-out set (its "
                        "first --num-heldout-prompts); reported per category and language when they vary; the γ grid "
                        "still runs on the --prompt-set training prompts")
    p.add_argument("--num-train-prompts", type=int, default=6, help="training prompts for the γ grid search")
    p.add_argument("--num-heldout-prompts", type=int, default=6, help="held-out prompts for the comparison")
    p.add_argument("--prompt-set", default="open", choices=list(PROMPT_SETS),
                   help="shipped prompt sets: open chat prompts (train/heldout), copy-heavy ones "
                        "(copy_train/copy_heldout: code edits, extraction, QA over a text, reformatting), mixed "
                        "(mixed_train/mixed_heldout: 8 categories, 24 held-out prompts) or multilingual "
                        "(multilingual_train/multilingual_heldout: 6 tasks in en, es, it, zh, 24 held-out prompts); "
                        "mixed and multilingual are reported per category (and language)")
    p.add_argument("--repeats", type=int, default=3, help="repeats of the held-out comparison (for the spread)")
    p.add_argument("--max-new-tokens", type=int, default=None, help="default: the policy's training setting")
    p.add_argument("--gammas", default="1-12", help="fixed γ grid, e.g. 1-12 or 1,2,4,8")
    p.add_argument("--seed", type=int, default=0, help="seeds the sampling of every method alike")
    cli.add_out_arg(p, "the results directory (default: <policy>/eval; runs/eval-<drafter> for a shipped policy): "
                       f"{', '.join(RESULT_FILES)}")
    add_overwrite_argument(p)
    p.add_argument("--law-check", action="store_true",
                   help="also run the output-law check on the real models (with --tree: tree arms too, the fixed "
                        "tree chosen on train — or the grid's largest with --skip-speed — and the learned tree)")
    p.add_argument("--law-samples", type=int, default=150, help="samples per arm for the law check")
    p.add_argument("--law-tokens", type=int, default=3, help="first k tokens compared by the law check")
    p.add_argument("--law-prompt", default="Name a color.",
                   help="prompt of the law check: one whose first tokens are uncertain, so a biased rule shows")
    p.add_argument("--skip-speed", action="store_true", help="only the law check (needs --law-check)")
    add_tree_arguments(p)
    cli.add_model_args(p)
    cli.add_sampling_args(p)
    cli.add_device_args(p)
    return p


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``python -m eval`` and ``learn2draft eval``; returns the exit status (2 with one ``error:``
    line on bad input, or when a file of the current folder shadows a package it needs)."""
    cli.exit_if_shadowed("eval", "learn2draft eval", ("learn2draft", "envs", "policies", "eval"))
    return run_cli(build_parser(), _run, argv)


def _run(args) -> int:
    from learn2draft.cli import load_models, stderr_line

    policy_dir, policy, head, drafter, dtype, min_ngram = _resolve_policy(args)
    trees = _resolve_trees(args, drafter)
    user_prompts, cfg, sampling, gammas, max_new, device, threads = _check_settings(args, policy_dir)
    out = make_out_dir(_out_path(args, policy_dir, drafter), RESULT_FILES, args.overwrite)

    t0 = time.perf_counter()
    target, draft = cli.model_names(args.target, args.draft, cfg)
    # auto's widths: the deepest of the policy's depth, the γ grid and (with --tree) the verification sizes
    run = RunSettings.resolve(device=device, dtype=dtype, threads=threads,
                              depths=(getattr(policy, "max_depth", 0) or 0, *gammas, *_tree_depths(args)),
                              target=target, draft=draft, drafter=drafter, lookup_min_ngram=min_ngram)
    pair = load_models(run, drafter, progress=stderr_line, head=args.head)
    results = _results_header(args, run, device, policy_dir, policy, trees)
    if not args.skip_speed:
        _measure_speed(args, run, pair, policy, head, trees, user_prompts, sampling, gammas, max_new, results, out)
    if args.law_check:
        _check_law(args, run, pair, policy, head, trees, results, out)
    _write_results(results, out, t0)
    return 0


class _Trees(NamedTuple):
    """The tree arms of a run: their shape, the learned tree controller and its directory, the fixed (depth, V) grid."""

    shape: TreeShape | None = None
    controller: DraftController | None = None
    directory: str | Path | None = None
    grid: list = []


def _tree_depths(args) -> tuple:
    """The depths ``--verify-sizes`` adds to the forward widths: the flag's value with ``--tree``, else none (the
    default sizes are not a width a chain-only run computes)."""
    return (args.verify_sizes,) if args.tree else ()


def _resolve_policy(args) -> tuple:
    """Resolve the policy, its head, its drafter, the run's precision (pinned with a shipped policy, else
    ``--dtype``) and prompt lookup's n-gram: ``(policy_dir, policy, head, drafter, dtype, lookup_min_ngram)``."""
    from policies.layout import resolve_export_dir
    from policies.load import default_policy_for, load_policy, policy_drafter, policy_head, policy_lookup_min_ngram

    if args.skip_speed and not args.law_check:
        raise ValueError("--skip-speed skips the speed comparison, and without --law-check nothing is left to run: "
                         "add --law-check, or drop --skip-speed.")
    dtype = args.dtype
    if args.policy is None:  # the precision pinned with it
        policy_dir, dtype = default_policy_for(args.drafter or "model", args.dtype, args.device, args.threads,
                                               depths=(args.gammas, *_tree_depths(args)))
    else:
        policy_dir = Path(args.policy)
        if not policy_dir.is_dir():
            raise FileNotFoundError(f"No policy directory at {policy_dir}: run `python -m train` first or pass --policy DIR.")
    export_dir = resolve_export_dir(policy_dir)
    policy = load_policy(export_dir, profile=args.profile)
    head = args.head or policy_head(export_dir)
    trained_with = policy_drafter(export_dir)
    drafter = args.drafter or trained_with
    if drafter != trained_with:
        raise ValueError(f"The policy in {export_dir} was trained with the {trained_with!r} drafter, not {drafter!r}: "
                         f"its features mean other things. Pass --drafter {trained_with}, or a policy trained with "
                         f"`python -m train --drafter {drafter}`.")
    # the n-gram setting every lookup row runs with: the policy's unless --lookup-min-ngram says otherwise
    min_ngram = cli.lookup_min_ngram(args, drafter, policy_lookup_min_ngram(export_dir), f"the policy in {export_dir}")
    return policy_dir, policy, head, drafter, dtype, min_ngram


def _resolve_trees(args, drafter: str) -> _Trees:
    """Check the tree flags, then load the learned tree (if any), its shape and the fixed-tree grid."""
    check_tree_arguments(args, drafter)
    if not args.tree:
        return _Trees(grid=[])
    from eval.compare import load_learned_tree, shipped_tree_policy_dir, tree_configs, tree_shape_from

    tree_ctrl = None
    tree_dir = args.tree_policy or shipped_tree_policy_dir(drafter)
    tree_settings: dict = {}
    if tree_dir is not None:
        tree_ctrl, tree_settings = load_learned_tree(tree_dir, drafter)
    tree = tree_shape_from(tree_settings, args.tree_width, args.tree_top_k)
    tree_grid = tree_configs(parse_ints(args.tree_depths, "--tree-depths", "depth"),
                             parse_ints(args.verify_sizes, "--verify-sizes", "verification size"), tree)
    return _Trees(tree, tree_ctrl, tree_dir, tree_grid)


def _check_settings(args, policy_dir: Path) -> tuple:
    """Read the prompts and the run's settings, and check every setting before the (slow) model loading."""
    from learn2draft.cli import resolve_device, sampling_config, set_threads
    from learn2draft.prompts import load_prompt_file_records
    from policies.load import run_settings

    user_prompts = load_prompt_file_records(args.prompts) if args.prompts else None
    cfg = run_settings(policy_dir)  # the training run's settings (its config.json, else the export's)
    for name in ("num_train_prompts", "num_heldout_prompts", "repeats"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be ≥ 1.")
    if args.law_check and (args.law_samples < 10 or args.law_tokens < 1 or not args.law_prompt.strip()):
        raise ValueError("--law-samples must be ≥ 10, --law-tokens ≥ 1 and --law-prompt non-empty.")
    sampling = sampling_config(args)
    threads = set_threads(args, cfg.get("threads"))
    gammas = parse_gammas(args.gammas)
    max_new = args.max_new_tokens if args.max_new_tokens is not None else cfg.get("max_new_tokens", 64)
    if max_new <= 0:
        raise ValueError(f"--max-new-tokens must be > 0, got {max_new}.")
    device = resolve_device(args.device)
    return user_prompts, cfg, sampling, gammas, max_new, device, threads


def _out_path(args, policy_dir: Path, drafter: str) -> Path:
    """The results directory: ``--out``, else ``runs/eval-<drafter>`` for a shipped policy, else ``<policy>/eval``."""
    from policies.layout import DEFAULT_POLICIES_DIR

    if args.out:
        return Path(args.out)
    if args.policy is None or DEFAULT_POLICIES_DIR in policy_dir.resolve().parents:  # inside the installed package
        return Path("runs") / f"eval-{drafter}"
    return policy_dir / "eval"


def _results_header(args, run: RunSettings, device: str, policy_dir: Path, policy, trees: _Trees) -> dict:
    """The results' header: machine, models, drafter and policies."""
    machine = _machine(device)
    results: dict = {"machine": machine, "target": run.target, "draft": run.draft, "drafter": run.drafter,
                     "dtype": run.dtype,  # the precision every method ran in
                     "policy_dir": str(policy_dir), "policy_profile": policy.profile_name}
    if run.lookup_min_ngram is not None:
        results["lookup_min_ngram"] = run.lookup_min_ngram
    if args.tree:
        results["tree_policy_dir"] = str(trees.directory) if trees.directory is not None else None
    return results


def _measure_speed(args, run: RunSettings, pair, policy, head, trees: _Trees, user_prompts, sampling,
                   gammas: list[int], max_new: int, results: dict, out: Path) -> None:
    """Measure speed: the γ grid on the training prompts, the comparison on the held-out ones; write the results."""
    from eval.compare import compare, format_markdown, plot
    from eval.header import finish_header, header_lines, run_header
    from eval.runner import encode_all, prompt_groupings
    from learn2draft.prompts import load_prompt_records, load_prompts, prompt_set_splits

    train_split, held_split = prompt_set_splits(args.prompt_set)
    train_ids = encode_all(pair, load_prompts(train_split)[: args.num_train_prompts], max_new)
    held = (user_prompts if user_prompts is not None else load_prompt_records(held_split))[: args.num_heldout_prompts]
    held_ids = encode_all(pair, [p.text for p in held], max_new)
    header = run_header(results["target"], results["draft"] if pair.has_draft else None, pair, results["dtype"],
                        sampling.to_dict(), str(pair.device), held, args.prompts or held_split,
                        run.forward_rows)
    res = compare(pair, policy, train_ids, held_ids, sampling, max_new, gammas, args.repeats, args.seed,
                  drafter=run.drafter, head=head, tree=trees.shape, tree_grid=trees.grid, tree_policy=trees.controller,
                  groups=prompt_groupings(held), min_ngram=run.lookup_min_ngram)
    results["header"] = finish_header(header)
    results["speed"] = res
    md = format_markdown(res)
    profile_line = f"Policy's latency profile: {policy.profile_name}\n\n" if policy.profile_name else ""
    (out / "results.md").write_text("\n".join(header_lines(header)) + f"\nMachine: {results['machine']}\n\n"
                                    f"{profile_line}{md}\n")
    plot(res, out / "results.png")
    (out / "results.json").write_text(json.dumps(results, indent=2, default=str))  # kept if the law check fails
    print("\n" + md + "\n")


def _check_law(args, run: RunSettings, pair, policy, head, trees: _Trees, results: dict, out: Path) -> None:
    """Check the output law of every arm at T=0.8, top-p 0.95, and append its table to results.md."""
    from eval.law import format_law_table, law_check
    from learn2draft.decoding import FixedDepthController
    from learn2draft.sampling import SamplingConfig

    law_sampling = SamplingConfig(temperature=0.8, top_p=0.95)
    g = results.get("speed", {}).get("gamma_train", 4)
    arms = {"learned policy": policy, f"fixed γ={g}": FixedDepthController(g)}
    tree_arms = {}
    if args.tree:  # tree arms beside the chain arms: one reference arm, one Bonferroni correction
        from learn2draft.tree import FixedTreeController

        d, v = results.get("speed", {}).get("tree_train") or max(trees.grid, key=lambda dv: (dv[1], dv[0]))
        tree_arms[f"fixed tree depth={d}, V={v}"] = trees.shape
        arms[f"fixed tree depth={d}, V={v}"] = FixedTreeController(d, v)
        if trees.controller is not None:
            tree_arms["learned tree"] = trees.shape
            arms["learned tree"] = trees.controller
    law = law_check(pair, arms, [args.law_prompt], sampling=law_sampling, num_tokens=args.law_tokens,
                    num_samples=args.law_samples, seed=args.seed, drafter=run.drafter, head=head,
                    tree=tree_arms or None, min_ngram=run.lookup_min_ngram)
    results["law_check"] = law
    table = format_law_table(law)
    with open(out / "results.md", "w" if args.skip_speed else "a") as f:
        if args.skip_speed:
            f.write(f"Machine: {results['machine']}\n")
        f.write("\n## Output-law check\n\n" + table + "\n")
    print("Output-law check\n" + table + "\n")


def _write_results(results: dict, out: Path, t0: float) -> None:
    """Write the report: results.json with the wall time, and say which files were written."""
    results["wall_seconds"] = time.perf_counter() - t0
    (out / "results.json").write_text(json.dumps(results, indent=2, default=str))
    written = [str(out / name) for name in ("results.md", "results.json", "results.png") if (out / name).is_file()]
    print(f"Wrote {', '.join(written)} in {results['wall_seconds']:.0f} s.")


def _machine(device: str) -> str:
    """One line naming the machine: CPU model and cores, or the GPU (from :func:`eval.profile.machine_info`)."""
    from eval.profile import machine_info

    m = machine_info(device)
    if "gpu" in m:
        return f"{m['gpu']}, torch {m['torch']}"
    return f"{m['cpu']}, {m['cores']} cores, torch {m['torch']} (threads={m['torch_threads']})"

if __name__ == "__main__":
    sys.exit(main())
