"""The target's forward in float32 and in bfloat16, side by side: B rows × n new tokens after a cached context, the
two precisions interleaved (their order alternating by round), the minimum of ``--repeats`` rounds per shape. Prints
each shape's seconds and bf16's speed relative to fp32, with what ``--dtype auto`` measures for the same widths
(:func:`learn2draft.models.bf16_forward_timing`). Run alone on the machine (``uptime`` before and after are printed):

    .venv/bin/python eval/scripts/dtype_forward_bench.py --threads 2 --shapes 1x1,1x9,16x1,16x9
"""

from __future__ import annotations

import argparse
import time

import torch


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", default="1x1,1x2,1x5,1x9,1x17,4x1,4x9,16x1,16x5,16x9",
                    help="BxN: B rows of N new tokens each, comma-separated")
    ap.add_argument("--context", type=int, default=192, help="cached tokens per row before the timed forward")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    a = ap.parse_args()
    from learn2draft.cli import comma_items

    try:
        shapes = [tuple(int(v) for v in s.lower().split("x")) for s in comma_items(a.shapes)]
    except ValueError:
        shapes = []
    if not shapes or not all(len(s) == 2 and min(s) >= 1 for s in shapes):
        ap.error(f"--shapes {a.shapes!r}: give BxN pairs of positive ints, e.g. 1x1,16x9")
    for flag, value in (("--context", a.context), ("--repeats", a.repeats), ("--threads", a.threads)):
        if value < 1:
            ap.error(f"{flag} must be ≥ 1, got {value}")
    torch.set_num_threads(a.threads)
    from transformers import DynamicCache

    from eval.header import load_average
    from learn2draft import load_pair
    from learn2draft.models import bf16_forward_timing, cpu_bf16_units

    print(f"load average before {load_average()}, {a.threads} torch threads, context {a.context}, "
          f"bf16 units {cpu_bf16_units()}", flush=True)
    dtypes = ("float32", "bfloat16")
    models = {dt: load_pair(draft=None, dtype=getattr(torch, dt)).target for dt in dtypes}
    gen = torch.Generator().manual_seed(0)

    # one cached context per (shape, precision), prefilled once (a bf16 prefill of 16 × 192 tokens takes seconds on a
    # CPU without bf16 units); each timed forward is cropped off again
    caches = {}
    with torch.inference_mode():
        for s in shapes:
            ctx = torch.randint(100, 1000, (s[0], a.context), generator=gen)
            for dt in dtypes:
                caches[(s, dt)] = DynamicCache()
                models[dt](input_ids=ctx, cache=caches[(s, dt)], use_cache=True)
    best = {(s, dt): float("inf") for s in shapes for dt in dtypes}
    with torch.inference_mode():
        for rep in range(a.repeats + 1):  # round 0 warms each shape's kernels up and is not counted
            for s in shapes:
                new = torch.randint(100, 1000, s, generator=gen)
                for dt in (dtypes if rep % 2 == 0 else dtypes[::-1]):
                    t0 = time.perf_counter()
                    models[dt](input_ids=new, cache=caches[(s, dt)], use_cache=True)
                    sec = time.perf_counter() - t0
                    caches[(s, dt)].crop(-s[1])
                    if rep:
                        best[(s, dt)] = min(best[(s, dt)], sec)
    print("| B × n | fp32 ms | bf16 ms | bf16 speed × fp32 | auto's timing at B·n tokens |")
    print("|---|---|---|---|---|")
    for s in shapes:
        f, b = best[(s, "float32")], best[(s, "bfloat16")]
        mm = bf16_forward_timing(rows=(s[0] * s[1],), threads=a.threads)["speedup"]
        print(f"| {s[0]} × {s[1]} | {f * 1e3:.1f} | {b * 1e3:.1f} | {f / b:.2f} | {mm:.2f} |")
    print(f"load average after {load_average()}")


if __name__ == "__main__":
    main()
