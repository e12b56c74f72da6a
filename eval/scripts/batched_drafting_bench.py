"""What batched drafter forwards gain in the batched decoder: the model and head drafters with their forwards
batched over the rows of each draft position (``BatchedSpeculativeDecoder(batched_drafting=True)``, the default)
against the same rows drafted one by one (``batched_drafting=False``), side by side and interleaved (rotated
order), on the same held-out mixed prompts, a closed loop of B rows (2 × B requests), fixed γ, greedy. Prints
aggregate tokens/s, the rows' draft seconds and the step seconds per step, the ratio, and whether both gave the same
tokens. Run alone on the machine:

    .venv/bin/python eval/scripts/batched_drafting_bench.py --batch-sizes 4,16 --dtype bfloat16 --threads 2
"""

from __future__ import annotations

import argparse
import os
import time

import torch


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--drafters", default="model,head")
    ap.add_argument("--batch-sizes", default="4,16")
    ap.add_argument("--gamma", type=int, default=3)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--max-new-tokens", type=int, default=32)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    a = ap.parse_args()
    from learn2draft.cli import comma_items

    try:
        drafters = comma_items(a.drafters, "--drafters", "use drafters joined by commas, e.g. model,head")
    except ValueError as e:
        ap.error(str(e))
    try:
        sizes = [int(b) for b in comma_items(a.batch_sizes)]
    except ValueError:
        ap.error(f"--batch-sizes {a.batch_sizes!r}: comma-separated integers, e.g. 4,16")
    torch.set_num_threads(a.threads)
    from eval.runner import encode_all
    from learn2draft import FixedDepthController, load_pair
    from learn2draft.batched import BatchedSpeculativeDecoder, Request, serve
    from learn2draft.prompts import load_prompts

    pair = load_pair(dtype=getattr(torch, a.dtype))
    prompts = encode_all(pair, load_prompts("mixed_heldout"), a.max_new_tokens)
    print(f"load average {os.getloadavg()[0]:.2f}, {a.threads} torch threads, {a.dtype}, γ = {a.gamma}, "
          f"{a.max_new_tokens} new tokens, 2 × B requests per run")

    def run(drafter: str, B: int, batched: bool) -> tuple[float, float, float, list]:
        dec = BatchedSpeculativeDecoder(pair, drafter, max_new_tokens=a.max_new_tokens, max_depth=a.gamma,
                                        max_batch=B, batched_drafting=batched)
        reqs = [Request(prompts[i % len(prompts)], 0.0, i) for i in range(2 * B)]
        t0 = time.perf_counter()
        res = serve(dec, reqs, lambda: FixedDepthController(a.gamma), concurrency=B)
        wall = time.perf_counter() - t0
        draft = sum(sum(c.draft_seconds for c in s.rows.values()) for s in dec.steps)
        return (sum(len(r.tokens) for r in res) / wall, draft / len(dec.steps), wall / len(dec.steps),
                [r.tokens for r in res])

    for drafter in drafters:
        for B in sizes:
            run(drafter, B, True)  # warm-up
            r: dict[bool, list] = {True: [], False: []}
            for rep in range(a.repeats):
                for batched in ((True, False) if rep % 2 == 0 else (False, True)):
                    r[batched].append(run(drafter, B, batched))
            same = all(x[3] == y[3] for x, y in zip(r[True], r[False]))

            def mean(xs, i):
                return sum(x[i] for x in xs) / len(xs)

            print(f"{drafter} B={B}: batched {mean(r[True], 0):.1f} tok/s (draft {1e3 * mean(r[True], 1):.0f} ms/step, "
                  f"step {1e3 * mean(r[True], 2):.0f} ms) | per row {mean(r[False], 0):.1f} tok/s (draft "
                  f"{1e3 * mean(r[False], 1):.0f} ms/step, step {1e3 * mean(r[False], 2):.0f} ms) | "
                  f"× {mean(r[True], 0) / mean(r[False], 0):.2f}; same tokens: {same}", flush=True)


if __name__ == "__main__":
    main()
