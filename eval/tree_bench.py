"""Micro-benchmarks of draft trees: ``python -m eval.tree_bench [--vocab-size V] [--nodes N] [--overhead]``.

Prints the median and 90th-percentile milliseconds of one
:func:`learn2draft.sampling.tree_speculative_sample` call (issue 8's goal: ≤ 1 ms at V = 49,152
and 64 nodes on CPU); with ``--overhead``, also the share of tree cycle time spent in the tree's
own work (selection and mask, sampling, cache gather; goal ≤ 5 %) on the default pair. Timings on
a shared machine are noisy: run it under ``nice`` and report the machine.
"""

from __future__ import annotations

import argparse
import time

from learn2draft.cli import HelpFormatter, add_device_args, run_cli


def tree_sampler_microbenchmark(vocab_size: int = 49152, num_nodes: int = 64, width: int = 4, iters: int = 200,
                                seed: int = 0) -> dict:
    """Median seconds of one tree-sampler call on a CPU, float32 rows.

    The tree is EAGLE-2 shaped (the root's ``width`` best children, then each level's ``width``
    best nodes expanded with ``width`` children, until ``num_nodes``), and every node's children
    are the top tokens of the target's own row (softmax of 8 · N(0, 1) logits: peaked), so walks go deep
    and read several rows: a case near the worst for the sampler.

    Returns:
        dict: ``vocab_size``, ``num_nodes``, ``median_seconds``, ``p90_seconds``,
        ``mean_accepted`` (τ per call).

    Raises:
        ValueError: ``num_nodes`` < 1 or ``width`` < 1.
    """
    import numpy as np
    import torch

    from learn2draft.sampling import tree_speculative_sample

    if num_nodes < 1 or width < 1:
        raise ValueError(f"num_nodes and width must be ≥ 1, got {num_nodes} and {width}.")
    g = torch.Generator().manual_seed(seed)
    probs = torch.softmax(torch.randn(num_nodes + 1, vocab_size, generator=g) * 8, -1)
    top = probs.topk(width, dim=-1).indices
    parents, tokens, level = [-1], [-1], [0]
    while len(parents) <= num_nodes:
        nxt = []
        for node in level[:width]:
            for j in range(width):
                if len(parents) > num_nodes:
                    break
                parents.append(node)
                tokens.append(int(top[node, j]))
                nxt.append(len(parents) - 1)
        level = nxt
    par, tok = torch.tensor(parents), torch.tensor(tokens)
    ts, taus = [], []
    for _ in range(iters):
        t0 = time.perf_counter()
        acc, _ = tree_speculative_sample(par, tok, probs, g)
        ts.append(time.perf_counter() - t0)
        taus.append(len(acc))
    return {"vocab_size": vocab_size, "num_nodes": num_nodes, "median_seconds": float(np.median(ts)),
            "p90_seconds": float(np.percentile(ts, 90)), "mean_accepted": float(np.mean(taus))}


def tree_cycle_overhead(pair, drafter: str = "head", depth: int = 4, verify_size: int = 8, width: int = 4,
                        top_k: int = 4, prompts: tuple[str, ...] = ("Write a haiku about the sea.",
                                                                     "Explain what a hash table is."),
                        max_new_tokens: int = 48) -> dict:
    """Share of tree cycle time spent outside the models' forwards, greedy, on ``pair``.

    Runs :class:`learn2draft.tree.TreeSpeculativeDecoder` with a fixed (depth, V) once per prompt
    (after one warm-up generation) and sums its per-cycle :attr:`~learn2draft.tree.TreeSpeculativeDecoder.tree_timings`.

    Returns:
        dict: seconds per part (``draft``, ``forward`` (target forward + processing p),
        ``select_mask``, ``sample``, ``gather`` (cache gather + drafter rollback), ``cycle``),
        ``tree_overhead_fraction`` = (select_mask + sample + gather) / cycle, ``cycles``,
        ``mean_accepted``, ``tokens``.
    """
    from learn2draft.drafters import make_drafter
    from learn2draft.tree import FixedTreeController, TreeSpeculativeDecoder

    dec = TreeSpeculativeDecoder(pair, max_new_tokens=max_new_tokens, width=width, top_k=top_k,
                                 drafter=make_drafter(drafter, pair))
    ctrl = FixedTreeController(depth, verify_size)
    dec.generate(pair.encode_prompt(prompts[0]), ctrl)  # warm-up
    dec.tree_timings.clear()
    acc, toks = [], 0
    for pr in prompts:
        res = dec.generate(pair.encode_prompt(pr), ctrl)
        acc += [c.num_accepted for c in res.cycles]
        toks += len(res.tokens)
    keys = ("draft", "forward", "select_mask", "sample", "gather", "cycle")
    tot = {k: sum(t[k] for t in dec.tree_timings) for k in keys}
    tot["tree_overhead_fraction"] = (tot["select_mask"] + tot["sample"] + tot["gather"]) / tot["cycle"]
    tot.update(cycles=len(dec.tree_timings), mean_accepted=sum(acc) / max(len(acc), 1), tokens=toks)
    return tot


def main(argv: list[str] | None = None) -> int:
    """Entry point; bad input is one error line and exit code 2 (:func:`learn2draft.cli.run_cli`)."""
    return run_cli(build_parser(), _run, argv)


def _run(args) -> int:
    from learn2draft.cli import load_models, resolve_device, set_threads, stderr_line

    resolve_device(args.device, check=args.overhead)  # a bad --device is an error before anything runs
    threads = set_threads(args)
    r = tree_sampler_microbenchmark(args.vocab_size, args.nodes, iters=args.iters)
    print(f"tree_speculative_sample: V={r['vocab_size']}, {r['num_nodes']} nodes, {threads} thread(s): "
          f"median {r['median_seconds'] * 1e3:.3f} ms, p90 {r['p90_seconds'] * 1e3:.3f} ms, "
          f"mean accepted {r['mean_accepted']:.2f}")
    if args.overhead:
        from learn2draft.settings import RunSettings

        # the default pair (this command has no model flags), at the default widths
        settings = RunSettings.resolve(device=args.device, dtype=args.dtype, threads=threads)
        o = tree_cycle_overhead(load_models(settings, "head", progress=stderr_line))
        parts = ", ".join(f"{k} {o[k]:.3f} s" for k in ("draft", "forward", "select_mask", "sample", "gather", "cycle"))
        print(f"tree cycle (head, depth 4, V 8): {o['cycles']} cycles, {o['tokens']} tokens, "
              f"τ̄ = {o['mean_accepted']:.2f}; {parts}; tree overhead {100 * o['tree_overhead_fraction']:.2f} % "
              "of cycle time")
    return 0


def build_parser() -> argparse.ArgumentParser:
    """The command line of ``python -m eval.tree_bench`` (the sampler runs on the CPU; ``--device`` and
    ``--dtype`` are for ``--overhead``)."""
    ap = argparse.ArgumentParser(prog="python -m eval.tree_bench", description=__doc__.splitlines()[0],
                                 formatter_class=HelpFormatter)
    ap.add_argument("--vocab-size", type=int, default=49152, help="vocabulary size V (default 49152)")
    ap.add_argument("--nodes", type=int, default=64, help="drafted nodes N in the tree (default 64)")
    ap.add_argument("--iters", type=int, default=200, help="calls timed (default 200)")
    ap.add_argument("--overhead", action="store_true",
                    help="also measure the tree's share of cycle time on the default pair (greedy, head drafter, "
                         "depth 4, V 8, W = k = 4; loads the target and the shipped head on --device, no draft model)")
    add_device_args(ap)
    return ap


if __name__ == "__main__":
    raise SystemExit(main())
