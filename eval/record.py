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
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from learn2draft.cli import HelpFormatter, plain_doc, run_cli
from learn2draft.names import DEFAULT_DRAFT, DEFAULT_TARGET


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m eval.record", description=plain_doc(__doc__), formatter_class=HelpFormatter)
    p.add_argument("--drafter", default="model", choices=["model", "head", "lookup"], help="what drafts")
    p.add_argument("--head", default=None, help="with --drafter head: a head directory (default: the shipped head)")
    p.add_argument("--target", default=DEFAULT_TARGET, help="target model: alias, hub id, local dir or .gguf file")
    p.add_argument("--draft", default=DEFAULT_DRAFT, help="draft model (must share the target's tokenizer)")
    p.add_argument("--prompt-split", default="train",
                   help="shipped prompts: train, heldout, copy_train or copy_heldout, or several joined by commas")
    p.add_argument("--prompts", default=None,
                   help="prompts from a file instead (.jsonl with a 'prompt' field per line, or a JSON list of strings)")
    p.add_argument("--num-prompts", type=int, default=None, help="record only the first N prompts (default: all)")
    p.add_argument("--max-depth", type=int, default=8,
                   help="longest chain recorded per position (replay and training may use any max_depth up to it)")
    p.add_argument("--max-new-tokens", type=int, default=64, help="tokens generated per prompt")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (exact replay); > 0 see the docs")
    p.add_argument("--top-k", type=int, default=0, help="0 = off")
    p.add_argument("--top-p", type=float, default=1.0, help="1.0 = off")
    p.add_argument("--seed", type=int, default=0, help="prompt i is recorded with sampling seed seed + i")
    p.add_argument("--device", default=None, help="cpu, cuda, cuda:1, … (default: cuda if available, else cpu)")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"], help="model dtype")
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    p.add_argument("--out", default=None, help="output .npz (default runs/traces/<drafter>-<split>.npz); "
                                               "the header is also written beside it as .json")
    return p


def main(argv: list[str] | None = None) -> int:
    return run_cli(build_parser(), _run, argv)


def _run(args) -> int:
    import torch

    from learn2draft.drafters import make_drafter
    from learn2draft.latency import machine_info
    from learn2draft.models import check_device, default_device, load_pair, parse_dtype
    from learn2draft.prompts import SPLITS, load_prompt_file, load_prompts
    from learn2draft.sampling import SamplingConfig
    from learn2draft.traces import record_traces

    if args.max_depth < 0 or args.max_new_tokens < 2:
        raise ValueError(f"--max-depth must be ≥ 0 and --max-new-tokens ≥ 2, got {args.max_depth} and {args.max_new_tokens}.")
    if args.num_prompts is not None and args.num_prompts < 1:
        raise ValueError(f"--num-prompts must be ≥ 1, got {args.num_prompts}.")
    if args.threads < 1:
        raise ValueError(f"--threads must be ≥ 1, got {args.threads}.")
    sampling = SamplingConfig(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p)
    if args.prompts:
        prompts, source = load_prompt_file(args.prompts), str(Path(args.prompts).resolve())
    else:
        splits = [s.strip() for s in args.prompt_split.split(",") if s.strip()]
        bad = [s for s in splits if s not in SPLITS]
        if not splits or bad:
            raise ValueError(f"--prompt-split {args.prompt_split!r}: use one or more of {', '.join(SPLITS)} joined by commas.")
        prompts, source = [p for s in splits for p in load_prompts(s)], ",".join(splits)
    prompts = prompts[: args.num_prompts] if args.num_prompts else prompts
    out = Path(args.out) if args.out else Path("runs") / "traces" / f"{args.drafter}-{Path(source).stem if args.prompts else source.replace(',', '+')}.npz"
    torch.set_num_threads(args.threads)
    device = args.device or default_device()
    check_device(device)
    print(f"Loading target={args.target} draft={args.draft} on {device} ({args.dtype}) …", file=sys.stderr)
    pair = load_pair(args.target, args.draft, device=device, dtype=parse_dtype(args.dtype))
    drafter = make_drafter(args.drafter, pair, head=args.head)
    traces = record_traces(pair, drafter, prompts, sampling, max_new_tokens=args.max_new_tokens,
                           max_depth=args.max_depth, seed=args.seed,
                           header={"prompt_source": source, "num_prompts": len(prompts), "chat": True,
                                   "machine": machine_info(device), "command": "python -m eval.record " + " ".join(sys.argv[1:])})
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


if __name__ == "__main__":
    sys.exit(main())
