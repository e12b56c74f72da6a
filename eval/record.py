"""``python -m eval.record``: record drafting traces for the replay environment (learn2draft.traces).

For every prompt and every output position, the chain the drafter drafts (up to --max-depth
tokens), its draft-side features, and the acceptance probability of each drafted token; at
temperature 0 that determines the accepted length of every depth a policy could choose. Writes a
versioned .npz and its JSON header (models, sampling, feature version, drafter, machine).

Example::

    python -m eval.record --drafter lookup --prompt-split copy_train --out runs/traces/lookup-copy_train.npz
    python -m eval.record --drafter model --prompt-split heldout --num-prompts 8 --out runs/traces/model-heldout.npz

Cost: one target forward of up to --max-depth + 1 tokens and up to --max-depth draft steps per
generated token (about the cost of a fixed-depth speculative run that never skips a position).

With --tree (temperature 0 only; model or head drafter): per output position, the draft tree
drafted to --max-depth levels exactly as TreeSpeculativeDecoder drafts it (--tree-width frontier
nodes × --tree-top-k children per level), one target forward over all its nodes with the tree
mask, and from it the accepted length τ of every depth 0..--max-depth and every verification size
in --verify-sizes. Example::

    python -m eval.record --tree --drafter head --prompt-split heldout --max-depth 8 \
        --verify-sizes 1,2,4,8,16,32,48,64 --tree-width 4 --tree-top-k 4 --out runs/traces/head-tree-heldout.npz

Cost per generated token: one target forward over up to 1 + k + (max_depth − 1)·W·k tokens and
--max-depth drafting levels.

With --workers N the prompts are cut into N contiguous shards recorded by N Ray tasks (each loads its models
once; eval.distributed) and merged in prompt order: the same traces as one process (prompt i keeps seed + i).
Without --address a local Ray cluster starts and stops with the command; --address joins an existing one
(`ray start --head` on one machine, `ray start --address HEAD:6379` on the others). Ray is an optional extra:
pip install 'learn2draft[ray]'. Example::

    python -m eval.record --drafter model --prompt-split train --workers 4 --out runs/traces/model-train.npz
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from learn2draft.cli import (
    HelpFormatter,
    add_device_args,
    add_drafter_arg,
    add_model_args,
    add_out_arg,
    add_sampling_args,
    add_tree_shape_args,
    comma_items,
    plain_doc,
    run_cli,
)
from learn2draft.names import DEFAULT_MAX_DEPTH, DEFAULT_TREE_TOP_K, DEFAULT_TREE_WIDTH, DEFAULT_VERIFY_SIZES
from learn2draft.prompts import SPLITS
from learn2draft.settings import RunSettings

_SIZES = ",".join(str(v) for v in DEFAULT_VERIFY_SIZES)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m eval.record", description=plain_doc(__doc__), formatter_class=HelpFormatter)
    add_drafter_arg(p, "model")
    p.add_argument("--prompt-split", default="train",
                   help=f"shipped prompts: {', '.join(SPLITS)}, or several joined by commas")
    p.add_argument("--prompts", default=None,
                   help="prompts from a file instead (.jsonl with a 'prompt' field per line, a JSON list of strings, "
                        "or MT-bench / Spec-Bench questions with 'turns': the first turn is the prompt)")
    p.add_argument("--num-prompts", type=int, default=None, help="record only the first N prompts (default: all)")
    p.add_argument("--max-depth", type=int, default=DEFAULT_MAX_DEPTH,
                   help="longest chain recorded per position (replay and training may use any max_depth up to it)")
    p.add_argument("--max-new-tokens", type=int, default=64, help="tokens generated per prompt")
    p.add_argument("--seed", type=int, default=0, help="prompt i is recorded with sampling seed seed + i")
    add_out_arg(p, "the trace .npz (default runs/traces/<drafter>[-tree]-<split>.npz); its header is also written "
                   "beside it as .json")
    p.add_argument("--overwrite", action="store_true",
                   help="replace an existing trace at --out (without it an existing trace is refused, not replaced)")
    add_model_args(p)
    add_sampling_args(p)
    add_device_args(p)
    t = p.add_argument_group("draft trees")
    t.add_argument("--tree", action="store_true",
                   help="record draft-tree traces (temperature 0; model or head drafter): τ of every depth and "
                        "verification size")
    t.add_argument("--verify-sizes", default=None,
                   help=f"with --tree: verification sizes V recorded, comma-separated (default: {_SIZES})")
    add_tree_shape_args(p)
    r = p.add_argument_group("workers (Ray; pip install 'learn2draft[ray]')")
    r.add_argument("--workers", type=int, default=1,
                   help="Ray tasks recording contiguous shards of the prompts, each loading its models once; 1 = this "
                        "process, without Ray (unless --address is given)")
    r.add_argument("--address", default=None,
                   help="an existing Ray cluster to run the tasks on (auto, or HOST:PORT of `ray start --head`); "
                        "default: a local cluster of --workers CPUs, started and stopped here")
    return p


def main(argv: list[str] | None = None) -> int:
    return run_cli(build_parser(), _run, argv)


def _run(args) -> int:
    from eval.distributed import record_shard, record_with_ray
    from eval.profile import machine_info
    from learn2draft.cli import lookup_min_ngram, model_names, resolve_device, sampling_config, threads_of
    from learn2draft.prompts import load_prompt_file, load_prompts
    from learn2draft.replay.traces import check_writable

    if args.workers < 1:
        raise ValueError(f"--workers must be ≥ 1, got {args.workers}.")
    if "+" in args.drafter:
        lookup, neural = args.drafter.split("+")
        raise ValueError(f"--drafter {args.drafter}: a hybrid replays from one trace per source; record "
                         f"--drafter {lookup} and --drafter {neural} on the same prompts with --temperature 0, then train "
                         "with --replay LOOKUP.npz,NEURAL.npz.")
    if args.max_depth < 1 or args.max_new_tokens < 2:
        raise ValueError(f"--max-depth must be ≥ 1 (a trace records the chains of depth 1 .. max_depth) and "
                         f"--max-new-tokens ≥ 2, got {args.max_depth} and {args.max_new_tokens}.")
    if args.num_prompts is not None and args.num_prompts < 1:
        raise ValueError(f"--num-prompts must be ≥ 1, got {args.num_prompts}.")
    min_ngram = lookup_min_ngram(args, args.drafter)  # checked before the recording; the trace header records it
    threads = threads_of(args)
    sampling = sampling_config(args)
    given = [f for f, v in (("--verify-sizes", args.verify_sizes), ("--tree-width", args.tree_width),
                            ("--tree-top-k", args.tree_top_k)) if v is not None]
    if given and not args.tree:
        raise ValueError(f"{', '.join(given)} only apply to draft trees: add --tree (or drop them).")
    sizes = _SIZES if args.verify_sizes is None else args.verify_sizes
    width = DEFAULT_TREE_WIDTH if args.tree_width is None else args.tree_width
    top_k = DEFAULT_TREE_TOP_K if args.tree_top_k is None else args.tree_top_k
    tree = None  # (verification sizes, width, top-k) of a tree recording
    if args.tree:
        from learn2draft.names import check_verify_sizes
        from learn2draft.replay.traces import TREE_T_POSITIVE_REFUSAL

        if not sampling.greedy:
            raise ValueError(f"--tree --temperature {args.temperature}: {TREE_T_POSITIVE_REFUSAL}")
        if args.drafter == "lookup":
            raise ValueError("--tree --drafter lookup: prompt lookup drafts no trees; use --drafter model or head.")
        if args.max_depth < 1 or width < 1 or top_k < 1:
            raise ValueError(f"--tree needs --max-depth, --tree-width and --tree-top-k ≥ 1, got {args.max_depth}, "
                             f"{width} and {top_k}.")
        try:
            tree = (check_verify_sizes(sorted({int(x) for x in comma_items(sizes)})), width, top_k)
        except ValueError:
            raise ValueError(f"--verify-sizes {sizes!r}: expected comma-separated integers ≥ 1.") from None
    if args.prompts:
        prompts, source = load_prompt_file(args.prompts), str(Path(args.prompts).resolve())
    else:
        use = f"use one or more of {', '.join(SPLITS)} joined by commas"
        splits = comma_items(args.prompt_split, "--prompt-split", use)
        bad = [s for s in splits if s not in SPLITS]
        if not splits or bad:
            raise ValueError(f"--prompt-split {args.prompt_split!r}: {use}.")
        prompts, source = [p for s in splits for p in load_prompts(s)], ",".join(splits)
    prompts = prompts[: args.num_prompts] if args.num_prompts else prompts
    kind = f"{args.drafter}-tree" if args.tree else args.drafter
    name = Path(source).stem if args.prompts else source.replace(",", "+")
    out = Path(args.out) if args.out else Path("runs") / "traces" / f"{kind}-{name}.npz"
    if out.is_dir():  # not "<dir>.npz" beside it
        raise ValueError(f"--out {out} is a directory: give a file name such as {out / (kind + '-' + name + '.npz')}.")
    if out.suffix == ".json":  # the header's name: the trace is the .npz beside it
        out = out.with_suffix(".npz")
    out = check_writable(out)  # before loading models and recording: a bad --out must not cost the recording
    if (out.exists() or out.with_suffix(".json").exists()) and not args.overwrite:
        raise ValueError(f"{out} already holds a trace: pass --overwrite to replace it, or another --out.")
    device = resolve_device(args.device)
    header = {"prompt_source": source, "num_prompts": len(prompts), "chat": True, "machine": machine_info(device),
              "command": "python -m eval.record " + " ".join(sys.argv[1:])}
    target, draft = model_names(args.target, args.draft)
    # --dtype auto resolved once, here: every Ray worker records in the same precision (each resolving its own could
    # split the traces where bf16 and fp32 measure close); at the widths of the deepest chain or largest tree
    settings = RunSettings.resolve(device=device, dtype=args.dtype, threads=threads,
                                   depths=(args.max_depth, *(tree[0] if tree else ())), target=target, draft=draft,
                                   drafter=args.drafter, lookup_min_ngram=min_ngram)
    if args.workers > 1 or args.address:
        traces = record_with_ray(args, settings, sampling, prompts, header, args.workers, args.address, tree)
    else:
        traces = record_shard(args, settings, sampling, prompts, header, tree=tree)
    if tree is not None:
        return _summarize_trees(args, traces, out, len(tree[0]))
    path = traces.save(out)
    runs = [pt.accepted_run()[1:pt.n] for pt in traces.prompts]
    summary = {
        "out": str(path), "header": str(path.with_suffix(".json")), "prompts": len(traces),
        "tokens": int(sum(pt.n for pt in traces.prompts)),
        "mean_chain_len": float(sum(pt.chain_len[1:pt.n].sum() for pt in traces.prompts) /
                                max(1, sum(pt.n - 1 for pt in traces.prompts))),
        "seconds": round(traces.header["record_seconds"], 1),
    }
    if sampling.greedy:
        summary["mean_accepted_run"] = float(sum(r.sum() for r in runs) / max(1, sum(len(r) for r in runs)))
        summary["greedy_inconsistencies"] = traces.header["greedy_inconsistencies"]
    print(json.dumps(summary, indent=2))
    return 0


def _summarize_trees(args, traces, out, num_sizes: int) -> int:
    import numpy as np

    path = traces.save(out)
    rows = [pt.tau[1:pt.n] for pt in traces.prompts]
    tau = np.concatenate(rows) if rows else np.zeros((0, args.max_depth + 1, num_sizes))
    summary = {
        "out": str(path), "header": str(path.with_suffix(".json")), "prompts": len(traces),
        "tokens": int(sum(pt.n for pt in traces.prompts)),
        "mean_accepted_deepest_widest": float(tau[:, -1, -1].mean()) if len(tau) else 0.0,
        "mean_accepted_by_depth_at_largest_V": [round(float(x), 3) for x in tau[:, 1:, -1].mean(axis=0)]
        if len(tau) else [],
        "greedy_inconsistencies": traces.header["greedy_inconsistencies"],
        "seconds": round(traces.header["record_seconds"], 1),
    }
    print(json.dumps(summary, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
