"""What the batched decoder's packed forward gains, side by side and interleaved (rotated order), on the same held-out
prompts, a closed loop at each concurrency c (``--requests-per-slot`` × c requests), a fixed γ, greedy.

``--compare verification`` (default): each row's verification feeds only its own γ_i + 1 tokens, packed
(``BatchedSpeculativeDecoder(verification="ragged")``, the default), against every row padded to the longest,
B × max (γ_i + 1) tokens (``verification="padded"``). ``--compare prefill``: a joining request's prompt packed into the
next step's forward (``serve(..., mixed_prefill=True)``, the default) against a prefill forward of its own.

Prints aggregate tokens/s, the tokens the target fed per step, the step time, the ratio of the two, and whether both
gave the same tokens. Run alone on the machine:

    .venv/bin/python eval/scripts/ragged_bench.py --concurrency 1,2,4,8,16 --dtype bfloat16 --threads 2
    .venv/bin/python eval/scripts/ragged_bench.py --compare prefill --gamma 0 --concurrency 4,16
"""

from __future__ import annotations

import argparse
import os
import time

import torch

#: per comparison: its two modes, each (decoder keyword arguments, serve keyword arguments)
COMPARISONS = {
    "verification": {"ragged": ({"verification": "ragged"}, {}), "padded": ({"verification": "padded"}, {})},
    "prefill": {"mixed": ({}, {"mixed_prefill": True}), "separate": ({}, {"mixed_prefill": False})},
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--compare", default="verification", choices=list(COMPARISONS))
    ap.add_argument("--drafter", default="lookup", help="a drafter name (lookup, model, head, a hybrid)")
    ap.add_argument("--gamma", type=int, default=4, help="the fixed depth every row drafts up to")
    ap.add_argument("--concurrency", default="1,2,4,8,16", help="closed-loop concurrency levels c, comma-separated")
    ap.add_argument("--requests-per-slot", type=int, default=2, help="requests per run: this × c")
    ap.add_argument("--repeats", type=int, default=2, help="runs per mode and level (alternating order)")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--prompt-set", default="mixed_heldout", help="shipped prompts (learn2draft.prompts), cycled")
    ap.add_argument("--threads", type=int, default=2, help="torch intra-op threads")
    ap.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    a = ap.parse_args()
    from learn2draft.cli import comma_items

    try:
        levels = [int(c) for c in comma_items(a.concurrency)]
    except ValueError:
        ap.error(f"--concurrency {a.concurrency!r}: comma-separated integers, e.g. 1,4,16")
    torch.set_num_threads(a.threads)
    from eval.runner import encode_all
    from learn2draft import FixedDepthController, load_pair
    from learn2draft.batched import BatchedSpeculativeDecoder, Request, serve
    from learn2draft.prompts import load_prompts

    modes = COMPARISONS[a.compare]
    first, second = list(modes)
    pair = load_pair(dtype=getattr(torch, a.dtype))
    prompts = encode_all(pair, load_prompts(a.prompt_set), a.max_new_tokens)
    print(f"load average {os.getloadavg()[0]:.2f}, {a.threads} torch threads, {a.dtype}, {a.compare}: {first} against "
          f"{second}, drafter {a.drafter}, "
          f"γ = {a.gamma}, {a.max_new_tokens} new tokens, {a.requests_per_slot} × c requests per run, "
          f"{len(prompts)} prompts of {a.prompt_set}")

    def run(c: int, mode: str) -> tuple[float, float, float, list]:
        dec_kw, serve_kw = modes[mode]
        dec = BatchedSpeculativeDecoder(pair, a.drafter, max_new_tokens=a.max_new_tokens, max_depth=a.gamma,
                                        max_batch=c, **dec_kw)
        reqs = [Request(prompts[i % len(prompts)], 0.0, i) for i in range(a.requests_per_slot * c)]
        t0 = time.perf_counter()
        res = serve(dec, reqs, lambda: FixedDepthController(a.gamma), concurrency=c, **serve_kw)
        wall = time.perf_counter() - t0
        n = len(dec.steps)
        return (sum(len(r.tokens) for r in res) / wall, sum(s.tokens_fed for s in dec.steps) / n,
                sum(s.seconds for s in dec.steps) / n, [r.tokens for r in res])

    print(f"| c | {first} tok/s | {second} tok/s | {first} / {second} | fed per step ({first}, {second}) | step ms "
          f"({first}, {second}) | same tokens |")
    print("|---|---|---|---|---|---|---|")
    for c in levels:
        run(c, first)  # warm-up
        r: dict[str, list] = {m: [] for m in modes}
        for rep in range(a.repeats):
            for mode in ((first, second) if rep % 2 == 0 else (second, first)):
                r[mode].append(run(c, mode))
        same = all(x[3] == y[3] for x, y in zip(r[first], r[second]))

        def mean(mode: str, i: int, r: dict[str, list] = r) -> float:
            return sum(x[i] for x in r[mode]) / len(r[mode])

        print(f"| {c} | {mean(first, 0):.1f} | {mean(second, 0):.1f} | {mean(first, 0) / mean(second, 0):.2f}"
              f" | {mean(first, 1):.1f}, {mean(second, 1):.1f} | {1e3 * mean(first, 2):.0f}, "
              f"{1e3 * mean(second, 2):.0f} | {same} |", flush=True)


if __name__ == "__main__":
    main()
