"""Does a speed guard's plain step cost what no speculation's step does? Side by side and interleaved, on the same
held-out requests (prompt lookup, bf16, 2 threads, greedy): at concurrency 8, 24 requests of 48 new tokens,

* ``nospec`` — no speculation (a decoder with ``max_depth`` 0);
* ``guard-zero`` — :class:`policies.rules.SpeculationGuard` over a step policy that always answers γ = 0: every step
  is plain, with the guard's machinery (load states, per-row step controllers, its checks) on;
* ``guard`` — the guard over the shipped load-aware policy.

Prints each run's tokens/s and the mean seconds of its steps at 8 rows that drafted nothing and prefilled nothing,
3 repeats in alternating order. Run alone on the machine, from the repository root:

    .venv/bin/python eval/scripts/guard_plain_step_bench.py
"""

from __future__ import annotations

import os
import time

import numpy as np
import torch


class AlwaysPlain:
    """A step policy that always answers γ = 0."""

    max_depth = 8

    def gamma(self, load) -> int:
        return 0


def main() -> None:
    torch.set_num_threads(2)
    from eval.runner import encode_all
    from learn2draft import FixedDepthController, load_pair
    from learn2draft.batched import BatchedSpeculativeDecoder, Request, serve
    from learn2draft.prompts import load_prompts
    from policies.load import load_serve_policy
    from policies.rules import SpeculationGuard

    pair = load_pair(dtype=torch.bfloat16)
    prompts = encode_all(pair, load_prompts("mixed_heldout"), 48)
    reqs = [Request(prompts[i % len(prompts)], 0.0, i) for i in range(24)]
    policy = load_serve_policy("policies/defaults/lookup-serve-bfloat16")

    def run(kind: str):
        depth = 0 if kind == "nospec" else 8
        dec = BatchedSpeculativeDecoder(pair, "lookup", max_new_tokens=48, max_depth=depth, max_batch=8)
        ctrl = ((lambda: FixedDepthController(0)) if kind == "nospec"
                else SpeculationGuard(AlwaysPlain() if kind == "guard-zero" else policy))
        t = time.perf_counter()
        res = serve(dec, reqs, ctrl, concurrency=8)
        wall = time.perf_counter() - t
        plain = [s.seconds for s in dec.steps if s.batch_size == 8 and s.prefill_tokens == 0
                 and all(c.depth == 0 for c in s.rows.values())]
        spec = sum(1 for s in dec.steps if any(c.depth > 0 for c in s.rows.values()))
        return sum(len(r.tokens) for r in res) / wall, 1e3 * float(np.mean(plain)), len(plain), spec, len(dec.steps)

    print(f"load average {os.getloadavg()[0]:.2f}, 2 torch threads, bfloat16, concurrency 8, 24 requests")
    for rep in range(3):
        for kind in ["nospec", "guard-zero", "guard"][:: 1 if rep % 2 == 0 else -1]:
            tps, ms, n, spec, steps = run(kind)
            print(f"repeat {rep} {kind:10s} {tps:6.1f} tok/s; plain steps at 8 rows {ms:5.1f} ms (of {n}); "
                  f"speculating steps {spec} of {steps}", flush=True)
    print(f"load average {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
