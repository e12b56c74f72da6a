"""``python -m eval.benchmark``: this project against plain and assisted Hugging Face generation, in one run.

On the same held-out prompts and seeds, interleaved, at temperature 0 and 0.7 (``--temperatures``):

* ``hf generate``: plain ``target.generate()``;
* ``hf assisted (default)``: ``generate(assistant_model=draft)`` with transformers' default schedule;
* ``hf assisted (heuristic)``: the same with ``num_assistant_tokens_schedule="heuristic"``, its
  state reset before every call;
* this project's autoregressive loop, its best fixed γ (grid-searched on the *training* prompts),
  and the learned policy (``--policy DIR``, skipped with a notice if absent).

Also micro-benchmarks the exact sampler at V = 49,152, γ = 12 and the draft/target forward
cost ratio. Ratios are measured side by side in one process (never asserted in tests).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np
import torch

PLAIN = "hf generate"


def sampler_microbenchmark(vocab_size: int = 49152, gamma: int = 12, iters: int = 200, seed: int = 0) -> dict:
    """Median seconds of one :func:`speculative_sample` call on random (γ+1, V) / (γ, V) float32 inputs (CPU)."""
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
    p = argparse.ArgumentParser(prog="python -m eval.benchmark", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", default="smollm2-135m-instruct")
    p.add_argument("--draft", default="smollm2-135m-draft")
    p.add_argument("--policy", default=None,
                   help="trained run or export dir (default: runs/default if it exists, else the row is skipped)")
    p.add_argument("--device", default=None)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--temperatures", default="0,0.7", help="comma-separated")
    p.add_argument("--num-prompts", type=int, default=6, help="held-out prompts")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--num-draft-tokens", type=int, default=None,
                   help="fixed γ (num_draft_tokens); default: the best of --gammas on the training prompts")
    p.add_argument("--gammas", default="2,3,4,5,6,8", help="grid for the fixed γ when --gamma is not given")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="runs/benchmark")
    return p


def main(argv: list[str] | None = None) -> int:
    from eval.__main__ import run_cli

    return run_cli(build_parser(), _run, argv)


def _run(args) -> int:
    from eval.__main__ import _machine, make_out_dir, parse_gammas
    from eval.compare import grid_search
    from eval.runner import DecoderMethod, HFGenerateMethod, encode_all, run_interleaved, summarize
    from learn2draft.decoding import FixedDepthController
    from learn2draft.models import check_device, load_pair, parse_dtype
    from learn2draft.prompts import load_prompts
    from learn2draft.sampling import SamplingConfig

    # Check every setting before the (slow) model loading.
    try:
        temps = [float(t) for t in args.temperatures.split(",")]
    except ValueError:
        raise ValueError(f"--temperatures {args.temperatures!r}: use comma-separated numbers, e.g. 0,0.7.") from None
    samplings = {T: SamplingConfig(temperature=T) for T in temps}
    if args.num_prompts < 1 or args.repeats < 1 or args.max_new_tokens < 1:
        raise ValueError("--num-prompts, --repeats and --max-new-tokens must be ≥ 1.")
    if args.num_draft_tokens is not None and args.num_draft_tokens < 1:
        raise ValueError(f"--num-draft-tokens must be ≥ 1, got {args.num_draft_tokens}.")
    gammas = parse_gammas(args.gammas)
    dtype = parse_dtype(args.dtype)
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    check_device(device)
    policy = None
    policy_dir = Path(args.policy or "runs/default")
    if policy_dir.is_dir():
        from policies.export import load_policy

        policy = load_policy(policy_dir)
    elif args.policy:
        raise FileNotFoundError(f"--policy {args.policy}: no such directory (run `python -m train` first).")
    else:
        print("note: no policy at runs/default; the learned-policy row is skipped (run `python -m train`).")
    out = make_out_dir(Path(args.out))
    print(f"Loading target={args.target} draft={args.draft} on {device} …", flush=True)
    pair = load_pair(args.target, args.draft, device=device, dtype=dtype)
    held = encode_all(pair, load_prompts("heldout")[: args.num_prompts], args.max_new_tokens)
    train = encode_all(pair, load_prompts("train")[: args.num_prompts], args.max_new_tokens)
    report = {"machine": _machine(device), "target": args.target, "draft": args.draft,
              "max_new_tokens": args.max_new_tokens, "repeats": args.repeats, "num_prompts": args.num_prompts,
              "sampler": sampler_microbenchmark(), "forward_cost": forward_cost_ratio(pair), "runs": {}}
    md = [f"Machine: {report['machine']}", "",
          f"Exact sampler, V=49,152, γ=12: median {1e3 * report['sampler']['median_seconds']:.3f} ms per cycle.",
          f"One-token forward at context 128: draft {1e3 * report['forward_cost']['draft_seconds']:.2f} ms, target "
          f"{1e3 * report['forward_cost']['target_seconds']:.2f} ms, ratio {report['forward_cost']['ratio']:.3f}.", ""]
    for T in temps:
        sampling = samplings[T]
        gamma = args.num_draft_tokens or grid_search(pair, train, gammas, sampling, args.max_new_tokens,
                                                     seed=args.seed, desc=f"γ grid T={T}")["best_gamma"]
        methods = [
            HFGenerateMethod(PLAIN, pair, sampling, args.max_new_tokens),
            HFGenerateMethod("hf assisted (default)", pair, sampling, args.max_new_tokens, assistant=True),
            HFGenerateMethod("hf assisted (heuristic)", pair, sampling, args.max_new_tokens, assistant=True,
                             assistant_config={"num_assistant_tokens_schedule": "heuristic"}),
            DecoderMethod("learn2draft autoregressive", pair, FixedDepthController(0), sampling, args.max_new_tokens),
            DecoderMethod(f"learn2draft fixed γ={gamma}", pair, FixedDepthController(gamma), sampling,
                          args.max_new_tokens),
        ]
        if policy is not None:
            methods.append(DecoderMethod("learn2draft learned policy", pair, policy, sampling, args.max_new_tokens))
        summary = summarize(run_interleaved(methods, held, args.repeats, args.seed, desc=f"benchmark T={T}"),
                            reference=PLAIN)
        report["runs"][str(T)] = {"fixed_gamma": gamma, "methods": summary}
        md += [f"### Temperature {T}", "",
               "| method | tokens/s (mean ± std) | × hf generate (min–max) | τ | TTFT ms | inter-token ms | loop overhead |",
               "|---|---|---|---|---|---|---|"]
        for name, m in summary.items():
            r = m[f"ratio_to_{PLAIN}"]
            tau = "–" if m["tau_mean"] is None else f"{m['tau_mean']:.2f}"
            ovh = "–" if m["overhead_fraction_mean"] is None else f"{100 * m['overhead_fraction_mean']:.1f}%"
            md.append(f"| {name} | {m['tokens_per_second_mean']:.1f} ± {m['tokens_per_second_std']:.1f} | "
                      f"{r['mean']:.2f} ({r['min']:.2f}–{r['max']:.2f}) | {tau} | {1e3 * m['ttft_seconds_mean']:.0f} | "
                      f"{1e3 * m['inter_token_seconds_mean']:.1f} | {ovh} |")
        md.append("")
    text = "\n".join(md)
    (out / "benchmark.md").write_text(text + "\n")
    (out / "benchmark.json").write_text(json.dumps(report, indent=2))
    print("\n" + text)
    print(f"Wrote {out / 'benchmark.md'} and {out / 'benchmark.json'}.")
    return 0


if __name__ == "__main__":
    sys.exit(main())
