"""``python -m eval.profile``: measure a latency profile of this machine for the replay environment.

Measures, with device-synchronised clocks (learn2draft.timing.DeviceClock):

* the target's verification cost: one forward over n new tokens after c cached tokens plus the
  processing of its logits (what the decoder times as verify_seconds), for n in --tokens and c in
  --contexts, median of --repeats runs, sizes interleaved;
* each drafter's cost per draft step (Drafter.propose, what the decoder times as draft_seconds per
  token) at the same contexts;
* the per-cycle and per-draft-step overhead (the decoder's other_seconds: acceptance, rollback,
  features), fitted as other = cycle_overhead + step_overhead · depth over cycles of short real
  generations at a few fixed depths;
* with --tree-width W (model and head drafters): one draft-tree level (TreeSpeculativeDecoder's
  draft_step: the drafter's forward over the W frontier nodes and their top-k children) at the same
  contexts, median over levels 2..--draft-steps + 1 of real tree cycles (the first level, which
  also feeds the committed tokens, is not timed, as for a chain step), stored as the drafter's
  tree_level_seconds with W and k.
* with --batch-sizes 1,2,4,8,16 (issue 17, replay under load): the batch axis — one target forward over B rows of
  n new tokens each (B·n packed tokens) after c cached tokens per row, plus the processing of the rows' logits,
  for B in --batch-sizes, n in --tokens and c in --batch-contexts (default: the first of --contexts): the batched
  KV cache (the batched decoder's, kept per row by length) is one prefill of B copies of the context, each timed
  forward is rolled back before the next, median of --repeats, sizes interleaved; and one draft step of all B rows per drafter (model: one draft-model
  forward over B rows with a batched cache; lookup and head: B single-row steps, B × the median step, as they run
  per row here). Stored as verify_batch and each drafter's batch_step_seconds.

Writes a small JSON profile (learn2draft.replay.latency) with the machine it ran on. Example::

    nice -n 19 python -m eval.profile --out learn2draft/replay/profiles/cpu-2core.json --name cpu-2core --overwrite
    python -m eval.profile --device cuda --drafter model,lookup --out my-gpu.json
    python -m eval.profile --device cuda --drafter model,lookup --batch-sizes 1,2,4,8,16 --out my-gpu.json

With --random-weights SHAPE the target is a real architecture with random weights (eval.shapes: smollm2-135m,
llama-3.2-1b, llama-3.1-8b, or a config.json), built on the device: costs depend on shapes, not weights, so these
are real measurements of that architecture without its weights::

    python -m eval.profile --device cuda --dtype bfloat16 --random-weights llama-3.1-8b --drafter model,lookup \
        --out llama-8b-h200.json
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from pathlib import Path

from learn2draft.cli import (
    HelpFormatter,
    add_device_args,
    add_engine_args,
    add_model_args,
    add_out_arg,
    add_tree_shape_args,
    comma_items,
    plain_doc,
    run_cli,
)
from learn2draft.names import DRAFTERS
from learn2draft.settings import RunSettings

#: Prompt lengths (tokens) of the prefill table measured with the batch axis (replay under load charges a prefill per
#: request that joins).
PREFILL_TOKENS = (8, 32, 64, 128, 256)


def machine_info(device: str = "cpu") -> dict:
    """The machine a measurement ran on: CPU model, cores, load average, nice level, torch version and threads,
    the device (GPU name for CUDA). Imports torch."""
    import os
    import platform

    import torch

    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    info = {"cpu": cpu, "cores": os.cpu_count(), "torch": torch.__version__, "torch_threads": torch.get_num_threads(),
            "device": str(device), "python": platform.python_version(), "platform": platform.platform()}
    try:
        info["load_average_1m"] = round(os.getloadavg()[0], 2)
        info["nice"] = os.nice(0)
    except (OSError, AttributeError):
        pass
    if str(device).startswith("cuda") and torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name(torch.device(device))
    return info


def _ints(text: str, what: str) -> list[int]:
    try:
        out = sorted({int(x) for x in comma_items(text)})
    except ValueError:
        raise ValueError(f"--{what} {text!r}: expected comma-separated integers.") from None
    if not out:
        raise ValueError(f"--{what} is empty.")
    return out


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m eval.profile", description=plain_doc(__doc__), formatter_class=HelpFormatter)
    add_engine_args(p, "whose costs: this project's Hugging Face loop (default), or llama.cpp through "
                        "llama-cpp-python (its batch decode at --tokens after --contexts cached tokens, the lookup "
                        "adapter's step, the loop's overheads: eval.llamacpp_profile; --gguf names the model)")
    p.add_argument("--lookup-policy", default=None, metavar="DIR",
                   help="with --engine llama.cpp: the lookup policy whose n-gram setting the adapter's step is "
                        "measured with (default: matches down to 1 token)")
    p.add_argument("--drafter", default=",".join(DRAFTERS),
                   help=f"drafters to measure, comma-separated from {', '.join(DRAFTERS)} (only model loads the draft "
                        "model)")
    p.add_argument("--contexts", default="128,512,1024", help="context lengths (cached tokens) measured")
    p.add_argument("--tokens", default="1,2,4,8,16,32,64", help="verified token counts measured (must include 1)")
    p.add_argument("--repeats", type=int, default=5, help="timed runs per (context, tokens); the median is kept")
    p.add_argument("--draft-steps", type=int, default=8, help="draft steps timed per context and repeat")
    p.add_argument("--overhead-prompts", type=int, default=2, help="training prompts generated for the overhead fit")
    p.add_argument("--overhead-tokens", type=int, default=32, help="tokens per generation of the overhead fit")
    p.add_argument("--overhead-depths", default="0,2,4", help="fixed depths of the overhead fit")
    p.add_argument("--batch-sizes", default=None,
                   help="also measure the batch axis at these batch sizes, comma-separated (e.g. 1,2,4,8,16): "
                        "verification of B rows and a draft step of B rows, for replay under load")
    p.add_argument("--batch-contexts", default=None,
                   help="context lengths (cached tokens per row) of the batch axis (default: the first of --contexts)")
    p.add_argument("--batch-overhead-depths", default="0,4,8",
                   help="with --batch-sizes: the fixed γ of the closed loops that measure the real batched loop's "
                        "seconds beyond the tables (batch_overhead_seconds)")
    p.add_argument("--batch-overhead-tokens", type=int, default=32,
                   help="with --batch-sizes: tokens per request of those loops")
    p.add_argument("--batch-overhead-requests", type=int, default=2,
                   help="with --batch-sizes: requests per row of those loops (B × this many at batch size B); 0 skips "
                        "them (the replay then charges the tables' terms only)")
    p.add_argument("--name", default=None, help="profile name (default: the GPU's name, or cpu-<cores>core-<dtype>-measured: never a shipped profile's name)")
    p.add_argument("--note", default="", help="free text added to the profile's source, e.g. 'under nice -n 19'")
    add_out_arg(p, "the profile's JSON file (default runs/profiles/<name>.json; an existing one is kept: the "
                   "default then becomes <name>-2.json, …, and an existing --out is refused without --overwrite)")
    p.add_argument("--overwrite", action="store_true", help="replace an existing --out (or default) profile file")
    g = add_model_args(p)
    g.add_argument("--random-weights", default=None, metavar="SHAPE",
                   help="target: this architecture with random weights instead of --target (smollm2-135m, "
                        "llama-3.2-1b, llama-3.1-8b, or a config.json file), with the embedded draft's tokenizer")
    add_device_args(p)
    add_tree_shape_args(p)
    return p


def main(argv: list[str] | None = None) -> int:
    return run_cli(build_parser(), _run, argv)


# --------------------------------------------------------------------------- measurements
def token_stream(pair, length: int):
    """int64 (length,) real text ids: the training prompts (chat template applied) repeated. Lookup drafters
    find matches in it after the first pass, as they do in repetitive answers."""
    import torch

    from learn2draft.prompts import load_prompts

    parts = [pair.encode_prompt(p) for p in load_prompts("train")]
    seq = torch.cat(parts)
    reps = -(-length // seq.numel())
    return seq.repeat(reps)[:length]


def measure_verify(pair, sampling, seq, contexts: list[int], tokens: list[int], repeats: int,
                   output_hidden: bool = False) -> list[list[float]]:
    """Median seconds of one target forward over n tokens after c cached ones plus ``sampling.probs`` of its logits
    (the decoder's ``verify_seconds``), as float (len(contexts), len(tokens)), on the cache the chain decoder keeps:
    a row of :class:`learn2draft.batch_cache.BatchCache` fed by its ragged forward for a target that forward supports
    (:func:`learn2draft.batch_cache.is_supported`), else a ``DynamicCache`` (as
    :meth:`learn2draft.decoding.SpeculativeDecoder._open_target_cache` chooses). Sizes are interleaved (a rotated
    order per repeat); one unrecorded warm-up pass per context."""
    import torch
    from transformers import DynamicCache

    from learn2draft.batch_cache import BatchCache, is_supported
    from learn2draft.timing import DeviceClock

    ragged = is_supported(pair.target)
    clock = DeviceClock(pair.device)
    V = pair.vocab_size
    table = []
    with torch.inference_mode():
        for c in contexts:
            if ragged:
                cache = BatchCache(pair.target)
                cache.add_rows(1)
                cache.reserve(1, c + max(tokens))
                cache.forward(0, [seq[:c]], keep=torch.tensor([c - 1], device=seq.device))

                def forward(n, c=c, cache=cache):
                    return cache.forward(0, [seq[c:c + n]], output_hidden=output_hidden)[0]

                def rollback(n, c=c, cache=cache):
                    cache.set_length(0, c)
            else:
                cache = DynamicCache()
                pair.target(input_ids=seq[None, :c], cache=cache, use_cache=True)

                def forward(n, c=c, cache=cache):
                    return pair.target(input_ids=seq[None, c:c + n], cache=cache, use_cache=True,
                                       output_hidden_states=output_hidden).logits[0]

                def rollback(n, cache=cache):
                    cache.crop(-n)
            times = {n: [] for n in tokens}
            for rep in range(repeats + 1):
                k = rep % len(tokens)
                for n in tokens[k:] + tokens[:k]:
                    t0 = clock.now()
                    logits = forward(n)
                    sampling.probs(logits[:, :V], seq[: c + 1], seq[c + 1:c + n], source="target")
                    dt = clock.now() - t0
                    rollback(n)
                    if rep:
                        times[n].append(dt)
            table.append([statistics.median(times[n]) for n in tokens])
    return table


def measure_verify_batched(pair, sampling, seq, contexts: list[int], batch_sizes: list[int], tokens: list[int],
                           repeats: int) -> list[list[list[float]]]:
    """Median seconds of one target forward over B rows of n new tokens each after c cached tokens per row, plus
    ``sampling.probs`` of every row's logits, as float (len(contexts), len(batch_sizes), len(tokens)).

    The batched KV cache (:class:`learn2draft.batch_cache.BatchCache`, as
    :class:`learn2draft.batched.BatchedSpeculativeDecoder` keeps it) is one prefill of B copies of ``seq[:c]``; each
    timed forward feeds every row the n tokens ``seq[c:c+n]`` (a ragged forward of B × n packed tokens, the decoder's),
    then every row is rolled back to c. The probabilities are one ``probs_rows`` call when no processor reads a row's
    prefix, else one ``probs`` per row, as the decoder computes them. Token counts are interleaved (a rotated order per
    repeat); one unrecorded warm-up pass per (c, B). Timed with :class:`learn2draft.timing.DeviceClock`
    (``torch.cuda.synchronize`` on CUDA)."""
    import torch

    from learn2draft.batch_cache import BatchCache
    from learn2draft.timing import DeviceClock

    clock = DeviceClock(pair.device)
    V = pair.vocab_size
    table = []
    with torch.inference_mode():
        for c in contexts:
            per_b = []
            for B in batch_sizes:
                cache = BatchCache(pair.target)
                cache.add_rows(B)
                cache.forward(0, [seq[:c]] * B, keep=torch.tensor([c - 1], device=seq.device))
                times = {n: [] for n in tokens}
                for rep in range(repeats + 1):
                    k = rep % len(tokens)
                    for n in tokens[k:] + tokens[:k]:
                        t0 = clock.now()
                        logits, _ = cache.forward(0, [seq[c:c + n]] * B)
                        if sampling.prefix_dependent:
                            for r in range(B):
                                sampling.probs(logits[r * n:(r + 1) * n, :V], seq[: c + 1], seq[c + 1:c + n],
                                               source="target")
                        else:
                            sampling.probs_rows(logits[:, :V], source="target")
                        dt = clock.now() - t0
                        for r in range(B):
                            cache.set_length(r, c)  # back to c cached tokens per row
                        if rep:
                            times[n].append(dt)
                per_b.append([statistics.median(times[n]) for n in tokens])
                del cache
            table.append(per_b)
    return table


def measure_prefill(pair, sampling, seq, lengths: list[int], repeats: int) -> list[float]:
    """Median seconds of a prefill of n = ``lengths`` tokens (``seq[:n]``, one ragged target forward into an empty
    row of the batched decoder's cache with only the last logits kept, as
    :meth:`learn2draft.batched.BatchedSpeculativeDecoder.add_many` runs it, and the first token's probabilities), as
    float (len(lengths),); lengths interleaved (a rotated order per repeat), one unrecorded warm-up pass. Timed with
    :class:`learn2draft.timing.DeviceClock`."""
    import torch

    from learn2draft.batch_cache import BatchCache
    from learn2draft.timing import DeviceClock

    clock = DeviceClock(pair.device)
    V = pair.vocab_size
    times = {n: [] for n in lengths}
    with torch.inference_mode():
        for rep in range(repeats + 1):
            k = rep % len(lengths)
            for n in lengths[k:] + lengths[:k]:
                cache = BatchCache(pair.target)
                cache.add_rows(1)
                cache.reserve(1, n)  # allocated before the clock: the decoder's cache is allocated once
                t0 = clock.now()
                logits, _ = cache.forward(0, [seq[:n]], keep=torch.tensor([n - 1], device=seq.device))
                sampling.probs(logits[:, :V], seq[:n], None, source="target")
                dt = clock.now() - t0
                if rep:
                    times[n].append(dt)
    return [statistics.median(times[n]) for n in lengths]


def measure_draft_batched(pair, drafter_name: str, sampling, seq, contexts: list[int], batch_sizes: list[int],
                          steps: int, repeats: int, single_step: list[float]) -> list[list[float]]:
    """Seconds of one draft step of B rows together, as float (len(contexts), len(batch_sizes)).

    ``model``: median of one draft-model forward over (B, 1) tokens after c cached tokens per row (a batched cache,
    one prefill of B copies of the context, cropped back after each step) plus ``sampling.probs`` of every row, over
    ``steps`` × ``repeats`` steps. ``lookup`` and ``head`` run per row here: B × ``single_step`` (the median
    single-row :meth:`Drafter.propose` of :func:`measure_draft_step` at that context)."""
    if drafter_name != "model":
        return [[B * s for B in batch_sizes] for s in single_step]
    import torch
    from transformers import DynamicCache

    from learn2draft.timing import DeviceClock

    clock = DeviceClock(pair.device)
    V = pair.vocab_size
    table = []
    with torch.inference_mode():
        for c in contexts:
            row = []
            for B in batch_sizes:
                cache = DynamicCache()
                pair.draft(input_ids=seq[None, :c].expand(B, c).contiguous(), cache=cache, use_cache=True)
                times = []
                for rep in range(repeats + 1):
                    for k in range(steps):
                        ids = seq[None, c + k:c + k + 1].expand(B, 1).contiguous()
                        t0 = clock.now()
                        out = pair.draft(input_ids=ids, cache=cache, use_cache=True)
                        for r in range(B):
                            sampling.probs(out.logits[r, -1:, :V], seq[: c + k + 1], None, source="draft")
                        dt = clock.now() - t0
                        if rep:
                            times.append(dt)
                    cache.crop(-steps)  # back to c cached tokens per row
                row.append(statistics.median(times))
                del cache
            table.append(row)
    return table


def measure_draft_step(pair, drafter, sampling, seq, contexts: list[int], steps: int, repeats: int) -> list[float]:
    """Median seconds of one :meth:`Drafter.propose` (the decoder's draft seconds per token) after c committed
    tokens, per context; the first proposal after each rollback (which feeds the committed tokens) is not timed."""
    import torch
    from transformers import DynamicCache

    from learn2draft.timing import DeviceClock

    clock = DeviceClock(pair.device)
    gen = torch.Generator(device=pair.device).manual_seed(0)
    out = []
    with torch.inference_mode():
        for c in contexts:
            drafter.start(seq[:c])
            if drafter.needs_target_hidden:
                o = pair.target(input_ids=seq[None, :c], cache=DynamicCache(), use_cache=True, output_hidden_states=True)
                drafter.observe_target(o.hidden_states[-1][0], 0)
            times = []
            for _ in range(repeats):
                s = seq[: c + 1]
                for k in range(steps + 1):
                    if not drafter.can_propose(s):
                        break
                    t0 = clock.now()
                    prop = drafter.propose(s, sampling, gen)
                    dt = clock.now() - t0
                    if k:
                        times.append(dt)
                    s = torch.cat([s, torch.tensor([prop.token], device=s.device)])
                drafter.rollback(c)
            out.append(statistics.median(times) if times else 0.0)
    return out


def measure_tree_level(pair, drafter, sampling, seq, contexts: list[int], levels: int, repeats: int, width: int,
                       top_k: int) -> list[float]:
    """Median seconds of one draft-tree level (:meth:`learn2draft.tree.TreeSpeculativeDecoder.draft_step`: the
    drafter's forward over the ``width`` frontier nodes and their top-``top_k`` children) after c committed tokens,
    per context. Each repeat drafts ``levels`` + 1 levels of a real tree cycle and times levels 2.. (the first
    expands the root only and also feeds the committed tokens to the drafter, as the untimed first chain step),
    then verifies the root alone (:meth:`verify` with V = 0) to roll everything back.

    Raises:
        ValueError: a drafter that drafts no trees (lookup).
    """
    import torch

    from learn2draft.timing import DeviceClock
    from learn2draft.tree import TreeSpeculativeDecoder

    clock = DeviceClock(pair.device)
    out = []
    for c in contexts:
        dec = TreeSpeculativeDecoder(pair, sampling, max_new_tokens=repeats + levels + 4,
                                     max_depth=levels + 1, drafter=drafter, width=width, top_k=top_k)
        dec.start(seq[:c])
        times = []
        with torch.inference_mode():
            for rep in range(repeats + 1):  # repeat 0 warms up
                for k in range(levels + 1):
                    if not dec.can_draft():
                        break
                    t0 = clock.now()
                    dec.draft_step()
                    dt = clock.now() - t0
                    if k and rep:
                        times.append(dt)
                dec.verify(0)
                if dec.finished:
                    break
        out.append(statistics.median(times) if times else 0.0)
    return out


def measure_overheads(pair, drafter_name: str, head, sampling, prompts, max_new_tokens: int, depths: list[int]) -> dict:
    """Fit the decoder's ``other_seconds`` per cycle as ``cycle_overhead + step_overhead · depth`` (least squares,
    clamped at 0) over real generations with fixed depths; also the loop's own mean draft seconds per token and
    verify seconds per depth, to check the tables against the loop."""
    import numpy as np

    from learn2draft.decoding import FixedDepthController, SpeculativeDecoder
    from learn2draft.drafters import make_drafter

    rows = []
    dmax = max(depths)
    dec = SpeculativeDecoder(pair, sampling, max_new_tokens=max_new_tokens, max_depth=max(dmax, 1),
                             drafter=make_drafter(drafter_name, pair, head=head))
    dec.generate(prompts[0], FixedDepthController(min(2, dmax)), seed=0)  # warm-up
    for i, ids in enumerate(prompts):
        for k in range(len(depths)):
            d = depths[(i + k) % len(depths)]
            g = dec.generate(ids, FixedDepthController(d), seed=i)
            rows += [(c.depth, c.other_seconds, c.draft_seconds, c.verify_seconds) for c in g.cycles]
    arr = np.asarray(rows, dtype=np.float64)
    X = np.stack([np.ones(len(arr)), arr[:, 0]], axis=1)
    (a, b), *_ = np.linalg.lstsq(X, arr[:, 1], rcond=None)
    by_depth = {}
    for d in sorted({int(x) for x in arr[:, 0]}):
        sel = arr[arr[:, 0] == d]
        by_depth[str(d)] = {"cycles": int(len(sel)), "other_seconds": float(sel[:, 1].mean()),
                            "draft_seconds_per_token": float(sel[:, 2].sum() / (d * len(sel))) if d else 0.0,
                            "verify_seconds": float(sel[:, 3].mean())}
    return {"cycle_overhead_seconds": max(float(a), 0.0), "step_overhead_seconds": max(float(b), 0.0),
            "loop_measurements": by_depth}


def measure_batch_overheads(pair, drafter_name: str, head, sampling, prompts, profile, batch_sizes: list[int],
                            depths: list[int], max_new_tokens: int, requests_per_slot: int = 2) -> dict:
    """What the real batched loop costs beyond ``profile``'s tables: the drafter's ``batch_overhead_seconds``
    (:mod:`learn2draft.replay.latency`).

    For every batch size B ≥ 2 of ``batch_sizes`` and every fixed γ of ``depths`` (rotated order per B), a closed
    loop of concurrency B (:func:`learn2draft.batched.serve`, ``requests_per_slot`` × B requests over ``prompts``,
    seeds 0, 1, …, ``max_new_tokens`` each) runs on ``pair``. Every step of exactly b rows of a tabulated size
    (the loop's ramp-down gives the smaller ones too) with longest draft d = tokens per row − 1 gives the residual
    ``step seconds − profile.step_batched(drafter, b, d, c, verified)`` (verified: the drafted tokens the step's ragged
    verification fed; c: the rows' longest context after the step, as the
    replay's ``batch_context="max"``; the profile without this entry); per b, ``cycle_seconds + step_seconds · d`` is
    fitted to them by least squares (a constant only when every step had one d). ``join_seconds[B]``: (the loop's
    wall seconds − Σ its step seconds − Σ the prefills the replay charges, ``profile.prefill_seconds``) / requests.
    One unrecorded warm-up loop first. Timed with the decoder's :class:`learn2draft.timing.DeviceClock`.

    Returns:
        ``{"batch_sizes", "cycle_seconds", "step_seconds", "join_seconds", "steps" (fitted steps per size),
        "how"}``, or None when ``batch_sizes`` has no size ≥ 2.
    """
    import numpy as np

    from learn2draft.batched import BatchedSpeculativeDecoder, Request, serve
    from learn2draft.decoding import FixedDepthController

    sizes = [int(b) for b in batch_sizes if int(b) >= 2]
    if not sizes:
        return None
    dmax = max(max(depths), 1)
    ids = [pair.encode_prompt(p) if isinstance(p, str) else p for p in prompts]

    def run(B: int, d: int, record: bool):
        dec = BatchedSpeculativeDecoder(pair, drafter=drafter_name, sampling=sampling, max_new_tokens=max_new_tokens,
                                        max_depth=dmax, max_batch=B, head=head)
        reqs = [Request(ids[i % len(ids)], 0.0, i) for i in range(requests_per_slot * B)]
        steps = []

        def on_step(step):
            ctx = max((r.target_len for r in dec.rows), default=0)
            steps.append((step.batch_size, step.tokens_per_row - 1, step.tokens_fed - step.batch_size, step.seconds, ctx))

        t0 = dec.clock.now()
        serve(dec, reqs, lambda: FixedDepthController(d), concurrency=B, on_step=on_step if record else None)
        wall = dec.clock.now() - t0
        return steps, wall, reqs

    run(sizes[0], min(2, dmax), record=False)  # warm-up
    residuals: dict[int, list[tuple[int, float]]] = {b: [] for b in sizes}
    joins: dict[int, float] = {}
    for i, B in enumerate(sizes):
        per_join = []
        for k in range(len(depths)):
            d = depths[(i + k) % len(depths)]
            steps, wall, reqs = run(B, d, record=True)
            for b, dd, verified, secs, ctx in steps:
                if b in residuals:
                    residuals[b].append((dd, secs - sum(profile.step_batched(drafter_name, b, dd, float(ctx),
                                                                             verified))))
            prefills = sum(profile.prefill_seconds(max(int(r.prompt_ids.numel()), 1)) for r in reqs)
            per_join.append((wall - sum(s[3] for s in steps) - prefills) / len(reqs))
        joins[B] = float(np.mean(per_join))
    cycle, step, counts = [], [], []
    for b in sizes:
        arr = np.asarray(residuals[b], dtype=np.float64).reshape(-1, 2)
        counts.append(int(len(arr)))
        if len(arr) == 0:
            cycle.append(0.0)
            step.append(0.0)
        elif len(np.unique(arr[:, 0])) < 2:
            cycle.append(float(arr[:, 1].mean()))
            step.append(0.0)
        else:
            (a, bb), *_ = np.linalg.lstsq(np.stack([np.ones(len(arr)), arr[:, 0]], axis=1), arr[:, 1], rcond=None)
            cycle.append(float(a))
            step.append(float(bb))
    return {"batch_sizes": sizes, "cycle_seconds": cycle, "step_seconds": step,
            "join_seconds": [joins[b] for b in sizes], "steps": counts,
            "how": (f"learn2draft.batched.serve closed loops at fixed γ {list(depths)}, {requests_per_slot} × B requests "
                    f"of {max_new_tokens} tokens: real step seconds − the tables' step, least squares a + b·d per B; "
                    "joins: seconds outside steps − prefill_seconds(prompt_len), per request")}


def measure_profile(pair, drafters: list[str], head=None, sampling=None, contexts=(128, 512, 1024),
                    tokens=(1, 2, 4, 8, 16, 32, 64), repeats: int = 5, draft_steps: int = 8, overhead_prompts: int = 2,
                    overhead_tokens: int = 32, overhead_depths=(0, 2, 4), name: str = "", note: str = "",
                    progress=print, tree_width: int | None = None, tree_top_k: int = 4,
                    batch_sizes=None, batch_contexts=None, batch_overhead_depths=(0, 4, 8),
                    batch_overhead_tokens: int = 32, batch_overhead_requests: int = 2):
    """Measure a :class:`learn2draft.replay.latency.LatencyProfile` for ``pair`` and ``drafters`` on this machine.

    With ``batch_sizes`` (e.g. (1, 2, 4, 8, 16)) the profile also gets the batch axis (``verify_batch`` and each
    drafter's ``batch_step_seconds``; :func:`measure_verify_batched`, :func:`measure_draft_batched`) at
    ``batch_contexts`` (default: the first of ``contexts``) and the same ``tokens``, the prefill of prompts of
    :data:`PREFILL_TOKENS` tokens (:func:`measure_prefill`), and, unless
    ``batch_overhead_requests`` is 0, each drafter's ``batch_overhead_seconds``: the real batched loop's seconds beyond
    those tables (:func:`measure_batch_overheads` at fixed γ ``batch_overhead_depths``, ``batch_overhead_requests`` × B
    requests of ``batch_overhead_tokens`` tokens; γ above the tabulated tokens − 1 are dropped).

    With ``tree_width`` (W ≥ 1), the drafters that draft trees (model, head) also get ``tree_level_seconds``
    (:func:`measure_tree_level` at W and ``tree_top_k``); others (lookup) keep none.

    Raises:
        ValueError: ``tokens`` does not start at 1, a context plus the largest token count exceeds the
            pair's context window, or ``tree_width`` / ``tree_top_k`` < 1, or a batch size < 1.
    """
    from learn2draft.drafters import make_drafter
    from learn2draft.prompts import load_prompts
    from learn2draft.replay.latency import DrafterCost, LatencyProfile
    from learn2draft.sampling import SamplingConfig

    sampling = sampling or SamplingConfig()
    contexts, tokens = sorted(contexts), sorted(tokens)
    if tokens[0] != 1:
        raise ValueError(f"--tokens must include 1 (the autoregressive step), got {tokens}.")
    if pair.max_context and contexts[-1] + tokens[-1] > pair.max_context:
        raise ValueError(f"context {contexts[-1]} + {tokens[-1]} tokens exceeds the pair's window of {pair.max_context}.")
    if tree_width is not None and (tree_width < 1 or tree_top_k < 1):
        raise ValueError(f"--tree-width and --tree-top-k must be ≥ 1, got {tree_width} and {tree_top_k}.")
    if batch_sizes is not None:
        batch_sizes = sorted({int(b) for b in batch_sizes})
        batch_contexts = sorted({int(c) for c in (batch_contexts or contexts[:1])})
        if not batch_sizes or batch_sizes[0] < 1:
            raise ValueError(f"--batch-sizes must be integers ≥ 1, got {batch_sizes}.")
        if pair.max_context and batch_contexts[-1] + max(tokens[-1], draft_steps + 1) > pair.max_context:
            raise ValueError(f"--batch-contexts {batch_contexts[-1]} + {tokens[-1]} tokens exceeds the pair's window of "
                             f"{pair.max_context}.")
    longest = max(contexts[-1], batch_contexts[-1] if batch_sizes is not None else 0)
    seq = token_stream(pair, longest + tokens[-1] + draft_steps + 2)
    progress(f"verify: contexts {contexts} × tokens {tokens}, {repeats} repeats …")
    verify = measure_verify(pair, sampling, seq, contexts, tokens, repeats)
    verify_batch = None
    if batch_sizes is not None:
        progress(f"batched verify: batch sizes {batch_sizes} × tokens {tokens} at contexts {batch_contexts} …")
        verify_batch = {"batch_sizes": batch_sizes, "tokens": list(tokens), "contexts": [float(c) for c in batch_contexts],
                        "seconds": measure_verify_batched(pair, sampling, seq, batch_contexts, batch_sizes, tokens,
                                                          repeats)}
    costs = {}
    prompts = [pair.encode_prompt(p) for p in load_prompts("train")[:overhead_prompts]]
    for d in drafters:
        progress(f"drafter {d}: draft steps and overheads …")
        dr = make_drafter(d, pair, head=head)
        step = measure_draft_step(pair, dr, sampling, seq, contexts, draft_steps, repeats)
        ov = measure_overheads(pair, d, head, sampling, prompts, overhead_tokens, list(overhead_depths))
        tree_level = None
        if tree_width is not None and dr.supports_tree:
            progress(f"drafter {d}: tree levels (W={tree_width}, k={tree_top_k}) …")
            secs = measure_tree_level(pair, dr, sampling, seq, contexts, draft_steps, repeats, tree_width, tree_top_k)
            tree_level = {"contexts": [float(c) for c in contexts], "seconds": secs, "width": int(tree_width),
                          "top_k": int(tree_top_k)}
        batch_step = None
        if batch_sizes is not None:
            progress(f"drafter {d}: batched draft steps (batch sizes {batch_sizes}) …")
            single = (step if batch_contexts == list(contexts)
                      else measure_draft_step(pair, dr, sampling, seq, batch_contexts, draft_steps, repeats))
            batch_step = {"batch_sizes": batch_sizes, "contexts": [float(c) for c in batch_contexts],
                          "seconds": measure_draft_batched(pair, d, sampling, seq, batch_contexts, batch_sizes,
                                                           draft_steps, repeats, single),
                          "how": ("one draft-model forward over the B rows" if d == "model"
                                  else "B × the single-row step (this drafter runs per row)")}
        costs[d] = DrafterCost(list(contexts), step, ov["step_overhead_seconds"], ov["cycle_overhead_seconds"],
                               {"config": dr.extra_config(), "loop_measurements": ov["loop_measurements"]}, tree_level,
                               batch_step)
    machine = machine_info(str(pair.device))
    machine["dtype"] = str(next(pair.target.parameters()).dtype).replace("torch.", "")
    source = (f"measured by python -m eval.profile on {machine.get('gpu') or machine['cpu']} ({machine['cores']} cores, "
              f"torch {machine['torch']}, {machine['torch_threads']} thread(s), device {machine['device']}, "
              f"{machine['dtype']}), nice {machine.get('nice', '?')}, 1-min load average {machine.get('load_average_1m', '?')} "
              f"at the end; medians of {repeats} runs" + (f"; {note}" if note else ""))
    prof = LatencyProfile(
        name=name or default_name(machine), verify_tokens=list(tokens), verify_contexts=[float(c) for c in contexts],
        verify_seconds=verify, drafters=costs, machine=machine, source=source,
        meta={"target": pair.target_name, "draft": pair.draft_name, "sampling": sampling.to_dict(),
              "model": "seconds(d, c) = d·(draft_step(c) + step_overhead) + verify(d+1, c) + cycle_overhead"
                       + ("; tree cycle: d·(tree_level(c) + step_overhead) + verify(V+1, c) + cycle_overhead"
                          if tree_width is not None else "")
                       + ("; batched step of B rows: d·draft_step_batched(B, c) + verify_batched(B, 1 + Σd_i/B, c) + overheads"
                          if batch_sizes is not None else "")},
        verify_batch=verify_batch,
    )
    if batch_sizes is not None:
        lengths = [n for n in PREFILL_TOKENS if not pair.max_context or n <= pair.max_context]
        progress(f"prefill: prompts of {lengths} tokens …")
        prof.prefill = {"tokens": lengths, "seconds": measure_prefill(pair, sampling, token_stream(pair, lengths[-1]),
                                                                       lengths, repeats)}
        prof.validate()
    if batch_sizes is not None and batch_overhead_requests > 0 and any(b >= 2 for b in batch_sizes):
        ov_depths = sorted({int(d) for d in batch_overhead_depths if 0 <= int(d) <= tokens[-1] - 1})
        dropped = sorted({int(d) for d in batch_overhead_depths} - set(ov_depths))
        if dropped:
            progress(f"warning: the batched loops' fixed γ {dropped} exceed the {tokens[-1]}-token verification table: "
                     f"measuring γ {ov_depths or [0]} only (python -m eval.profile: --batch-overhead-depths, --tokens)")
        ov_prompts = [pair.encode_prompt(p) for p in load_prompts("mixed_train")]
        for d in drafters:
            progress(f"drafter {d}: the batched loop's overheads (closed loops at batch sizes "
                     f"{[b for b in batch_sizes if b >= 2]}, γ {ov_depths}) …")
            prof.drafters[d].batch_overhead = measure_batch_overheads(
                pair, d, head, sampling, ov_prompts, prof, batch_sizes, ov_depths or [0], batch_overhead_tokens,
                batch_overhead_requests)
        prof.validate()
    return prof


def default_name(machine: dict) -> str:
    """The GPU's name in lower case with dashes (``h200``), or ``cpu-<cores>core-<dtype>-measured`` (e.g.
    ``cpu-2core-bfloat16-measured``): never a shipped profile's name (``cpu-2core``, ``cpu-amx-bf16``), so that a
    profile measured here is not mistaken for the shipped one of that name in a policy's config or a report."""
    if machine.get("gpu"):
        return "-".join(machine["gpu"].lower().replace("nvidia", "").split())
    dtype = machine.get("dtype")
    return f"cpu-{machine.get('cores', 0)}core{'-' + dtype if dtype else ''}-measured"


def _run(args) -> int:
    import json
    import time

    from learn2draft.cli import check_out_file, load_models, resolve_device, set_threads, stderr_line, threads_of

    use = f"use one or more of {', '.join(DRAFTERS)} joined by commas"
    drafters = comma_items(args.drafter, "--drafter", use)
    bad = [d for d in drafters if d not in DRAFTERS]
    if not drafters or bad:
        raise ValueError(f"--drafter {args.drafter!r}: {use}.")
    contexts, tokens = _ints(args.contexts, "contexts"), _ints(args.tokens, "tokens")
    depths = _ints(args.overhead_depths, "overhead-depths")
    batch_sizes = _ints(args.batch_sizes, "batch-sizes") if args.batch_sizes is not None else None
    batch_contexts = _ints(args.batch_contexts, "batch-contexts") if args.batch_contexts is not None else None
    if batch_contexts is not None and batch_sizes is None:
        raise ValueError("--batch-contexts applies to the batch axis measured with --batch-sizes: add --batch-sizes.")
    if batch_sizes is not None and batch_sizes[0] < 1:
        raise ValueError(f"--batch-sizes {args.batch_sizes!r}: batch sizes must be ≥ 1.")
    if args.repeats < 1 or args.draft_steps < 1 or args.overhead_prompts < 1 or args.overhead_tokens < 2:
        raise ValueError("--repeats, --draft-steps and --overhead-prompts must be ≥ 1 and --overhead-tokens ≥ 2.")
    ov_depths = _ints(args.batch_overhead_depths, "batch-overhead-depths")
    if ov_depths[0] < 0 or args.batch_overhead_tokens < 2 or args.batch_overhead_requests < 0:
        raise ValueError("--batch-overhead-depths must be ≥ 0, --batch-overhead-tokens ≥ 2 and "
                         "--batch-overhead-requests ≥ 0.")
    threads_of(args)  # checked before measuring
    if 1 not in tokens:  # (measure_profile checks it too; here before any model is built)
        raise ValueError(f"--tokens must include 1 (the autoregressive step), got {args.tokens!r}.")
    if args.name is not None and not args.name.strip():
        raise ValueError("--name is empty: give a profile name, or leave --name out for the default.")
    if args.name:
        from learn2draft.replay.latency import SHIPPED_PROFILES_DIR

        stem = args.name[:-5] if args.name.lower().endswith(".json") else args.name
        shipped = next((f for f in SHIPPED_PROFILES_DIR.glob("*.json") if f.stem.lower() == stem.lower()),
                       SHIPPED_PROFILES_DIR / f"{stem}.json")
        if shipped.is_file() and (not args.out or Path(args.out).resolve() != shipped.resolve()):
            raise ValueError(f"--name {args.name} is a shipped profile's name ({shipped}): --profile {args.name} would "
                             "still load the shipped one. Choose another name (the default names the machine and "
                             "precision, ending in -measured); only a profile written over that file takes it.")
    if args.tree_top_k is not None and args.tree_width is None:
        raise ValueError("--tree-top-k applies to the tree level measured with --tree-width W: add --tree-width.")
    tree_top_k = 4 if args.tree_top_k is None else args.tree_top_k
    if args.tree_width is not None and not any(d in ("model", "head") for d in drafters):
        raise ValueError(f"--tree-width: the drafters {', '.join(drafters)} draft no trees (prompt lookup proposes one "
                         "chain); add --drafter model or head, or drop --tree-width.")
    if args.tree_width is not None and (args.tree_width < 1 or tree_top_k < 1):
        raise ValueError(f"--tree-width and --tree-top-k must be ≥ 1, got {args.tree_width} and {tree_top_k}.")
    if args.out:
        check_out_file(args.out)  # before the measurement: a bad --out must not cost it
        if Path(args.out).expanduser().is_file() and not args.overwrite:
            raise ValueError(f"--out {args.out} exists (an earlier profile): pass --overwrite to replace it, or choose "
                             "another --out.")
    if args.engine == "llama.cpp":
        return _run_llamacpp(args, contexts, tokens)
    if args.gguf is not None or args.lookup_policy is not None:
        raise ValueError("--gguf and --lookup-policy apply to --engine llama.cpp.")
    threads = set_threads(args)
    device = resolve_device(args.device)
    t0 = time.perf_counter()
    if args.random_weights and args.target:
        raise ValueError("--random-weights builds the target from an architecture: drop --target.")
    # auto on --device, at this run's threads and widths (its largest --batch-sizes, at the default depth of the
    # commands that use a profile), not on the CPU
    settings = RunSettings.resolve(device=device, dtype=args.dtype, threads=threads, batch=batch_sizes,
                                   target=args.target, draft=args.draft)
    if args.random_weights:
        from eval.shapes import random_pair
        from learn2draft.models import parse_dtype

        pair = random_pair(args.random_weights, drafters, device, parse_dtype(settings.dtype, device),
                           draft=settings.draft, progress=stderr_line)
    else:
        pair = load_models(settings, drafters, progress=stderr_line, head=args.head)
    prof = measure_profile(pair, drafters, head=args.head, contexts=contexts, tokens=tokens, repeats=args.repeats,
                           draft_steps=args.draft_steps, overhead_prompts=args.overhead_prompts,
                           overhead_tokens=args.overhead_tokens, overhead_depths=depths, name=args.name or "",
                           note=args.note, progress=lambda m: print(m, file=sys.stderr), tree_width=args.tree_width,
                           tree_top_k=tree_top_k, batch_sizes=batch_sizes, batch_contexts=batch_contexts,
                           batch_overhead_depths=ov_depths, batch_overhead_tokens=args.batch_overhead_tokens,
                           batch_overhead_requests=args.batch_overhead_requests)
    out = Path(args.out) if args.out else Path("runs") / "profiles" / f"{prof.name}.json"
    if not args.out and out.exists() and not args.overwrite:  # the default file of an earlier run is kept
        out = next(out.with_name(f"{prof.name}-{i}.json") for i in range(2, 10**6)
                   if not out.with_name(f"{prof.name}-{i}.json").exists())
        stderr_line(f"eval.profile: runs/profiles/{prof.name}.json exists (an earlier run): writing {out} instead "
                    "(--overwrite replaces it)")
    prof.meta["measure_seconds"] = round(time.perf_counter() - t0, 1)
    prof.save(out)
    rel = prof.relative_verify_cost()
    print(json.dumps({"profile": str(out), "name": prof.name, "verify_1_token_ms": round(1e3 * prof.verify_seconds[0][0], 2),
                      "verify_relative_to_1": {k: round(v, 2) for k, v in rel.items()},
                      "draft_step_ms": {d: round(1e3 * c.step_seconds[0], 3) for d, c in prof.drafters.items()},
                      "cycle_overhead_ms": {d: round(1e3 * c.cycle_overhead_seconds, 3) for d, c in prof.drafters.items()},
                      **({"tree_level_ms": {d: round(1e3 * c.tree_level["seconds"][0], 3)
                                            for d, c in prof.drafters.items() if c.tree_level is not None}}
                         if args.tree_width is not None else {}),
                      **({"verify_batched_ms_at_1_token": {
                          int(b): round(1e3 * float(prof.verify_batched(int(b), 1, prof.verify_batch["contexts"][0])), 3)
                          for b in prof.verify_batch["batch_sizes"]}} if prof.has_batch_axis else {}),
                      **({"batch_overhead_ms": {d: {f"B={b}": [round(1e3 * c.batch_overhead[k][i], 2) for k in
                                                               ("cycle_seconds", "step_seconds", "join_seconds")]
                                                    for i, b in enumerate(c.batch_overhead["batch_sizes"])}
                                                for d, c in prof.drafters.items() if c.batch_overhead is not None},
                          "batch_overhead_terms": "cycle, per drafted token, per join (ms)"}
                         if any(c.batch_overhead is not None for c in prof.drafters.values()) else {}),
                      **({"prefill_ms": {int(n): round(1e3 * v, 2) for n, v in zip(prof.prefill["tokens"],
                                                                             prof.prefill["seconds"])}}
                         if prof.prefill is not None else {}),
                      "seconds": prof.meta["measure_seconds"]}, indent=2))
    return 0


def _run_llamacpp(args, contexts: list[int], tokens: list[int]) -> int:
    """``--engine llama.cpp``: :func:`eval.llamacpp.measure_llamacpp_profile`, written as a profile file."""
    import json
    import time

    from learn2draft.cli import check_gguf_arg, engine_threads, stderr_line
    from learn2draft.replay.latency import LatencyProfile

    if args.random_weights or args.target or args.draft or args.batch_sizes is not None or args.tree_width is not None:
        raise ValueError("--engine llama.cpp measures a GGUF model (--gguf) at batch size 1: drop --target, --draft, "
                         "--random-weights, --batch-sizes and --tree-width.")
    check_gguf_arg(args)
    if args.lookup_policy is not None and not Path(args.lookup_policy).is_dir():
        raise ValueError(f"--lookup-policy {args.lookup_policy}: no such directory.")
    from policies.llamacpp import require_llama_cpp

    require_llama_cpp()
    threads = engine_threads(args)
    name = args.name or f"llama.cpp-cpu-{os.cpu_count()}core-measured"
    t0 = time.perf_counter()
    stderr_line(f"eval.profile: measuring llama.cpp ({args.gguf or 'the embedded Q4_1 target'}), threads {threads}")
    from eval.llamacpp_profile import measure_llamacpp_profile

    data = measure_llamacpp_profile(args.gguf, threads, contexts, tokens, args.repeats, args.lookup_policy, name,
                                    args.note, machine_info("cpu"))
    prof = LatencyProfile.from_dict(data)
    out = Path(args.out) if args.out else Path("runs") / "profiles" / f"{prof.name}.json"
    if out.exists() and not args.overwrite:
        raise ValueError(f"{out} exists (an earlier profile): pass --overwrite to replace it, or choose another --out.")
    prof.meta["measure_seconds"] = round(time.perf_counter() - t0, 1)
    prof.save(out)
    print(json.dumps({"profile": str(out), "name": prof.name, "engine": "llama.cpp",
                      "verify_1_token_ms": round(1e3 * prof.verify_seconds[0][0], 2),
                      "verify_relative_to_1": {k: round(v, 2) for k, v in prof.relative_verify_cost(
                          tuple(n for n in (2, 4, 8, 16) if n <= max(tokens))).items()},
                      "draft_step_ms": {d: round(1e3 * c.step_seconds[0], 3) for d, c in prof.drafters.items()},
                      "cycle_overhead_ms": {d: round(1e3 * c.cycle_overhead_seconds, 3) for d, c in prof.drafters.items()},
                      "seconds": prof.meta["measure_seconds"]}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
