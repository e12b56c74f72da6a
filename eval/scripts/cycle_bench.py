"""Decoder speed before/after a refactor: the chain and tree decoders with fixed controllers,
interleaved, on the same held-out prompts and seeds, T = 0 (greedy). Prints tokens/s per method
(median over repeats of total tokens / total wall seconds), the mean seconds of each part of a cycle
(draft, select_mask, forward, sample, gather: SpeculativeDecoder.last_timing) and a hash of the tokens so
that two runs can be compared token for token. Run alone on the machine:

    .venv/bin/python eval/scripts/cycle_bench.py --out runs/cycle-bench-before.json

It uses only the public API (load_pair, make_drafter, the decoders and the fixed controllers).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import time

import numpy as np
import torch


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--num-prompts", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--max-new-tokens", type=int, default=48)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    from learn2draft import FixedDepthController, SpeculativeDecoder, load_pair
    from learn2draft.drafters import make_drafter
    from learn2draft.prompts import load_prompts
    from learn2draft.tree import FixedTreeController, TreeSpeculativeDecoder

    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[a.dtype]
    pair = load_pair(dtype=dtype)
    prompts = [pair.encode_prompt(p) for p in load_prompts("heldout")[: a.num_prompts]]
    N = a.max_new_tokens
    head = make_drafter("head", pair)
    methods = {
        "autoregressive": (SpeculativeDecoder(pair, max_new_tokens=N, drafter=make_drafter("lookup", pair)),
                           FixedDepthController(0)),
        "chain lookup γ=4": (SpeculativeDecoder(pair, max_new_tokens=N, drafter=make_drafter("lookup", pair)),
                             FixedDepthController(4)),
        "chain model γ=2": (SpeculativeDecoder(pair, max_new_tokens=N, drafter=make_drafter("model", pair)),
                            FixedDepthController(2)),
        "chain head γ=2": (SpeculativeDecoder(pair, max_new_tokens=N, drafter=head), FixedDepthController(2)),
        "tree head d=2 V=4": (TreeSpeculativeDecoder(pair, max_new_tokens=N, drafter=head, width=4, top_k=4),
                              FixedTreeController(2, 4)),
    }
    for dec, ctrl in methods.values():  # warm-up
        dec.generate(prompts[0], ctrl)
    rates = {m: [] for m in methods}
    parts = {m: [] for m in methods}  # per cycle: draft, select_mask, forward, sample, gather, cycle seconds
    tokens = {m: [] for m in methods}
    for r in range(a.repeats):
        for m, (dec, ctrl) in methods.items():
            tok = sec = 0.0
            for i, p in enumerate(prompts):
                res = dec.generate(p, ctrl, seed=i, on_tokens=lambda toks, cyc, dec=dec, m=m: cyc is not None and
                                   parts[m].append(dict(dec.last_timing)) and False)
                tok += len(res.tokens)
                sec += res.wall_seconds
                if r == 0:
                    tokens[m].append(res.tokens)
            rates[m].append(tok / sec)
    report = {
        "machine": platform.processor() or platform.machine(), "uptime": os.popen("uptime").read().strip(),
        "threads": torch.get_num_threads(), "dtype": a.dtype, "max_new_tokens": N, "prompts": a.num_prompts,
        "repeats": a.repeats, "torch": torch.__version__,
        "methods": {m: {"tokens_per_s_median": float(np.median(v)), "tokens_per_s": v,
                        "cycle_parts_ms": {k: 1000 * float(np.mean([c[k] for c in parts[m]])) for k in parts[m][0]},
                        "tokens_sha1": hashlib.sha1(json.dumps(tokens[m]).encode()).hexdigest()[:12]}
                    for m, v in rates.items()},
    }
    print(f"{report['uptime']}  threads={report['threads']} dtype={a.dtype}")
    for m, v in report["methods"].items():
        print(f"{m:22s} {v['tokens_per_s_median']:7.2f} tok/s  {[round(x, 2) for x in v['tokens_per_s']]}  "
              f"tokens {v['tokens_sha1']}")
        print(" " * 23 + "ms per cycle: " + ", ".join(f"{k} {x:.2f}" for k, x in v["cycle_parts_ms"].items()))
    if a.out:
        os.makedirs(os.path.dirname(a.out) or ".", exist_ok=True)
        with open(a.out, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    t0 = time.perf_counter()
    main()
    print(f"{time.perf_counter() - t0:.0f} s")
