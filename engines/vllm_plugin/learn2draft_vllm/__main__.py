"""``python -m learn2draft_vllm export-acceptance --traces T.npz [--heldout H.npz] --out DIR``: fit an acceptance
model for vLLM's adaptive verification on this project's traces (:mod:`learn2draft_vllm.export`). Exit 0 written,
2 bad input."""

from __future__ import annotations

import argparse
import json
import sys


def build_parser() -> argparse.ArgumentParser:
    from learn2draft.cli import HelpFormatter

    p = argparse.ArgumentParser(prog="python -m learn2draft_vllm", formatter_class=HelpFormatter,
                                description="learn2draft's vLLM plugin: export a learned acceptance model.")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")
    e = sub.add_parser("export-acceptance", formatter_class=HelpFormatter,
                       help="fit an acceptance model on chain traces and write it for the plugin",
                       description="Fit the learned acceptance estimate (a logistic regression on six features of the "
                                   "draft's distribution and chain) on chain traces of a model or head drafter "
                                   "(python -m eval.record), and write acceptance.onnx, acceptance_spec.json and "
                                   "parity.json to --out. Serve it with LEARN2DRAFT_VLLM_ACCEPTANCE_MODEL=DIR.")
    e.add_argument("--traces", nargs="+", required=True, metavar="T.npz",
                   help="training chain traces (files joined by commas or spaces)")
    e.add_argument("--heldout", nargs="+", default=None, metavar="H.npz",
                   help="held-out chain traces of the same pair: their AUC goes into the spec (default: none)")
    e.add_argument("--out", required=True, metavar="DIR", help="the acceptance model folder to write")
    e.add_argument("--l2", type=float, default=1e-3, help="L2 penalty of the logistic regression")
    e.add_argument("--overwrite", action="store_true", help="replace an existing acceptance model in --out")
    return p


def _files(words: list[str], flag: str) -> list[str]:
    from learn2draft.cli import comma_items

    return comma_items(",".join(w.rstrip(",") for w in words), flag, "join the trace files with commas or spaces")


def _run(args) -> int:
    from pathlib import Path

    from learn2draft.replay.traces import load_traces
    from learn2draft_vllm import ENV_MODEL, MODEL_FILE
    from learn2draft_vllm.export import export_acceptance

    if args.l2 < 0:
        raise ValueError(f"--l2 must be ≥ 0, got {args.l2}.")
    out = Path(args.out)
    if out.exists() and not out.is_dir():
        raise ValueError(f"--out {out} is a file: give a folder.")
    if (out / MODEL_FILE).exists() and not args.overwrite:
        raise ValueError(f"--out {out} already holds an acceptance model: pass --overwrite to replace it.")
    train_files = _files(args.traces, "--traces")
    train = load_traces(train_files)
    sources = {"traces": train_files}
    heldout = None
    if args.heldout:
        from eval.acceptance import check_compatible

        held_files = _files(args.heldout, "--heldout")
        heldout = load_traces(held_files)
        for w in check_compatible(train, heldout, train_files, held_files, False):
            print(w, file=sys.stderr)
        sources["heldout"] = held_files
    spec = export_acceptance(train, out, args.l2, heldout, sources)
    print(json.dumps({"out": str(out), "examples": spec["fit"]["examples"], "base_rate": spec["fit"]["base_rate"],
                      "heldout_auc": (spec.get("heldout") or {}).get("auc")}))
    print(f"wrote {out}: serve with {ENV_MODEL}={out} (docs/guides/vllm.md)", file=sys.stderr)
    return 0


def main(argv: list[str] | None = None) -> int:
    from learn2draft.cli import run_cli

    return run_cli(build_parser(), _run, argv)


if __name__ == "__main__":
    sys.exit(main())
