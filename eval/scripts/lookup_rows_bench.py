"""Prompt lookup's chains for B rows, searched row by row against one array search over the rows, side by side.

Row by row is each row's own ``LookupDrafter.lookahead`` (what the batched decoder ran before, one n-gram search per
row and chain position); over the rows is ``LookupDrafter.lookahead_rows`` (``learn2draft.drafters.lookup.find_rows``;
what the batched step runs at ``MIN_ROWS_SEARCHED_TOGETHER`` or more prompt-lookup rows). The rows are a prompt
split's prompts through the embedded tokenizer's chat template (no model weights), cycled to B rows; the two ways
run one after the other in every repeat, and the chains are checked equal. Below ``MIN_ROWS_SEARCHED_TOGETHER`` rows
``lookahead_rows`` searches row by row itself (it is cheaper there), so its column at B < 4 is that fallback, not the
array search. Prints per B the median milliseconds of each way and their ratio. Run alone on the machine (record
``uptime``), on traces (``make demo`` records ``runs/demo-data/lookup.npz``)::

    .venv/bin/python eval/scripts/lookup_rows_bench.py --traces runs/demo-data/lookup.npz --batch-sizes 1,2,4,8,16,64

Host work only (numpy); the ratio is what the search costs a step's host, not a step's speed (a step also runs the
target's forward: ``docs/results/2026-12-07-batch-lookup.md``). A prompt alone ends in the chat template's
assistant tag, which rarely recurs, so its rows find few chains; ``--traces`` (a file of ``python -m eval.record``)
gives each row its prompt and the first half of the recorded output instead, the context a step searches mid-answer.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import time


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompt-split", default="copy_heldout", help="a prompt split (learn2draft.prompts)")
    ap.add_argument("--batch-sizes", default="1,2,4,8,16,64", help="rows B, comma-separated")
    ap.add_argument("--depth", type=int, default=8, help="each row's chain limit (γ)")
    ap.add_argument("--repeats", type=int, default=50, help="timed repeats per B (the median is printed)")
    ap.add_argument("--traces", default=None, help="a trace file (.npz of python -m eval.record): rows are its prompts "
                    "and the first half of their recorded outputs (instead of --prompt-split's prompts)")
    a = ap.parse_args()
    from learn2draft.cli import comma_items

    try:
        sizes = [int(x) for x in comma_items(a.batch_sizes)]
    except ValueError:
        ap.error(f"--batch-sizes {a.batch_sizes!r}: use integers ≥ 1 joined by commas, e.g. 1,4,16")
    for flag, bad in (("--batch-sizes", any(b < 1 for b in sizes)), ("--depth", a.depth < 1), ("--repeats", a.repeats < 1)):
        if bad:
            ap.error(f"{flag} must be ≥ 1")

    import torch

    from learn2draft.drafters.lookup import LookupDrafter
    from learn2draft.models import encode_text, load_tokenizer
    from learn2draft.names import DEFAULT_TARGET
    from learn2draft.prompts import load_prompts

    if a.traces:
        import numpy as np

        try:
            tr = np.load(a.traces)
            po, pt, oo, ot = (tr[k] for k in ("prompt_offsets", "prompt_tokens", "output_offsets", "output_tokens"))
        except (OSError, ValueError, KeyError) as e:
            ap.error(f"--traces {a.traces}: not a trace file of python -m eval.record ({e})")
        seqs = [torch.tensor(np.concatenate([pt[po[i] : po[i + 1]], ot[oo[i] : oo[i] + (oo[i + 1] - oo[i]) // 2]]))
                for i in range(len(po) - 1)]
        source = f"{len(seqs)} traces of {a.traces} (prompt + half the output)"
    else:
        try:
            texts = load_prompts(a.prompt_split)
        except ValueError as e:
            ap.error(f"--prompt-split: {e}")
        tok = load_tokenizer(DEFAULT_TARGET)
        seqs = [torch.tensor(encode_text(tok, t, chat=True), dtype=torch.long) for t in texts]
        source = f"{len(seqs)} prompts of {a.prompt_split}"
    print(f"# {platform.processor() or platform.machine()}, {os.cpu_count()} CPUs; uptime: "
          f"{os.getloadavg()[0]:.2f} (1 min load); {source}, "
          f"{min(map(len, seqs))}–{max(map(len, seqs))} tokens; depth {a.depth}; median of {a.repeats}")
    print("| B | row by row (ms) | over the rows (ms) | ratio | chain tokens |")
    print("|---|---|---|---|---|")
    for b in sizes:
        rows = [seqs[i % len(seqs)] for i in range(b)]
        own, batch = [LookupDrafter() for _ in rows], [LookupDrafter() for _ in rows]
        for d, s in zip(own + batch, rows + rows):
            d.start(s)
        t_own, t_rows = [], []
        for _ in range(a.repeats):
            t0 = time.perf_counter()
            chains = [d.lookahead(s, a.depth) for d, s in zip(own, rows)]
            t1 = time.perf_counter()
            got = LookupDrafter.lookahead_rows(batch, rows, [a.depth] * b)
            t2 = time.perf_counter()
            t_own.append(t1 - t0)
            t_rows.append(t2 - t1)
            if got != chains:
                raise SystemExit(f"B = {b}: the search over the rows found other chains than row by row")
        m_own, m_rows = statistics.median(t_own), statistics.median(t_rows)
        print(f"| {b} | {1e3 * m_own:.3f} | {1e3 * m_rows:.3f} | {m_own / m_rows:.2f} | "
              f"{sum(len(c[0]) for c in chains)} |")


if __name__ == "__main__":
    main()
