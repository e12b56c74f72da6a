"""Prompt lookup with and without the unigram fallback, side by side: the chain decoder with
``LookupDrafter(min_ngram=m)`` for each m of ``--min-ngrams`` (default 2, this project's drafter, then 1: a
one-token suffix may match, as Hugging Face's prompt lookup falls back to, ``max_matching_ngram_size`` 2 → 1) at
a fixed γ, greedy, on the same prompts, the settings interleaved per repeat. Prints per setting tokens/s (total
tokens / total wall seconds, median over repeats), tokens per cycle, τ, drafted tokens per cycle and α, and the
ratio of tokens/s to the first setting. Run alone on the machine (record ``uptime``)::

    .venv/bin/python eval/scripts/lookup_ngram_bench.py --prompt-split copy_heldout --gamma 10 --dtype bfloat16

In bf16 the outputs of two settings may part at a near-tie (different verification widths round differently);
the token counts printed say so. It uses only the public API (load_pair, LookupDrafter, the chain decoder and
FixedDepthController).
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics

import torch


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompt-split", default="copy_heldout", help="a prompt split (learn2draft.prompts)")
    ap.add_argument("--num-prompts", type=int, default=12)
    ap.add_argument("--gamma", type=int, default=10, help="fixed γ (num_draft_tokens) of every setting")
    ap.add_argument("--min-ngrams", default="2,1", help="the settings: LookupDrafter min_ngram values")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    a = ap.parse_args()
    from learn2draft.cli import comma_items

    try:
        mins = [int(x) for x in comma_items(a.min_ngrams)]
    except ValueError:
        ap.error(f"--min-ngrams {a.min_ngrams!r}: comma-separated integers ≥ 1, e.g. 2,1")
    if a.gamma < 1 or a.num_prompts < 1 or a.repeats < 1 or a.threads < 1 or not mins or min(mins) < 1:
        ap.error("--gamma, --num-prompts, --repeats, --threads and every --min-ngrams value must be ≥ 1")
    from learn2draft.prompts import load_prompts

    try:
        texts = load_prompts(a.prompt_split)
    except ValueError as e:
        ap.error(f"--prompt-split: {e}")
    torch.set_num_threads(a.threads)
    from learn2draft import FixedDepthController, SpeculativeDecoder, load_pair
    from learn2draft.drafters.lookup import LookupDrafter

    pair = load_pair(draft=None, dtype=getattr(torch, a.dtype))
    prompts = [pair.encode_prompt(p) for p in texts[: a.num_prompts]]
    print(f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}, "
          f"{a.threads} threads, {a.dtype}, {a.prompt_split} × {len(prompts)}, γ = {a.gamma}, "
          f"load average {os.getloadavg()[0]:.2f}")
    ctrl = FixedDepthController(a.gamma)
    SpeculativeDecoder(pair, max_new_tokens=8, max_depth=a.gamma, drafter=LookupDrafter()).generate(prompts[0], ctrl)
    rates: dict[int, list[float]] = {m: [] for m in mins}
    stats: dict[int, tuple] = {}
    for rep in range(a.repeats):
        for m in mins[rep % len(mins):] + mins[: rep % len(mins)]:  # rotated order per repeat
            dec = SpeculativeDecoder(pair, max_new_tokens=a.max_new_tokens, max_depth=a.gamma,
                                     drafter=LookupDrafter(min_ngram=m))
            runs = [dec.generate(p, ctrl) for p in prompts]
            cycles = [c for r in runs for c in r.cycles]
            tokens = sum(len(r.tokens) for r in runs)
            rates[m].append(tokens / sum(r.wall_seconds for r in runs))
            drafted, accepted = sum(c.depth for c in cycles), sum(c.num_accepted for c in cycles)
            stats[m] = (tokens, len(cycles), accepted, drafted)
    base = statistics.median(rates[mins[0]])
    print("| min_ngram | tokens/s | × first | tokens | tokens / cycle | τ | drafted / cycle | α |")
    print("|---|---|---|---|---|---|---|---|")
    for m in mins:
        tokens, n, acc, dr = stats[m]
        r = statistics.median(rates[m])
        print(f"| {m} | {r:.1f} | {r / base:.3f} | {tokens} | {tokens / n:.2f} | {acc / n:.2f} | {dr / n:.2f} | "
              f"{acc / max(dr, 1):.2f} |")


if __name__ == "__main__":
    main()
