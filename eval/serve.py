"""``python -m eval.serve``: speculation under load — the serving benchmark.

Many requests share one target forward per step (:class:`learn2draft.batched.BatchedSpeculativeDecoder`, continuous
batching). On the same held-out prompts and seeds, methods interleaved per level (a rotated order; with ``--passes N``
every method runs N times per level, passes in pairs of opposite orders, so that a drift linear in time cancels),
two sweeps:

* fixed concurrency ``--concurrency`` (a closed loop: c requests run at once, a finished one is replaced at once);
* Poisson arrivals ``--arrival-rates`` (requests/s; seeded exponential gaps; an open loop up to ``--max-batch`` rows).
  Below the machine's capacity every method's aggregate tokens/s is the offered load; the latencies tell them apart.

Methods (``--methods``):

* ``nospec`` — no speculation (γ = 0): batched autoregressive decoding;
* ``aa`` — no speculation again, a second arm of the same method (an A/A control): its ratios to ``nospec`` are
  what the never-slower test reads when nothing differs, the noise floor of that test on this machine and load
  (a verdict line of its own, not a goal);
* ``fixed`` — the best single fixed γ of ``--gammas``, chosen on the *training* prompts at
  ``--calibration-concurrency`` (default: the smallest ``--concurrency`` level, 1 in the default sweep: the γ a
  user tunes at batch 1);
* ``table`` — the grid-tuned per-batch-size table (vLLM's ``num_speculative_tokens_per_batch_size``,
  :class:`learn2draft.budget.BatchSizeTable`): the best γ of 0 ∪ ``--gammas`` at each concurrency level on the training
  prompts; level c_i's γ covers batch sizes c_{i−1}+1 … c_i (larger ones: the last level's);
* ``adaptive`` — vLLM's adaptive verification (:class:`learn2draft.budget.AdaptiveVerification`): rows draft up to
  ``--max-depth`` tokens, an online logistic on the top-2 margin gives each slot a survival probability and each step
  verifies the global top-B slots against this machine's costs: ``--profile`` with the batch axis, else a latency
  profile measured at start-up (median of ``--cost-repeats`` batched target forwards per (batch size, tokens per row)
  shape, as vLLM profiles at start-up). Its estimator learns while serving: it is warmed on the training prompts at every
  concurrency level (its 3 warm-up refits verify whole blocks) and keeps learning through the measured levels;
* ``policy`` — a learned policy (``--policy DIR``): a load-aware one (``python -m train --serve-loads``:
  :func:`policies.load.load_serve_policy`, one γ per step for every row from the step's load and the latency profile
  it was trained with) or any exported chain policy (:func:`policies.load.load_policy`, per row);
* ``guard`` — the load-aware policy behind :class:`policies.rules.SpeculationGuard`: per batch size, the
  measured tokens/s of the policy's speculating steps against steps without speculation, the batch's and each
  request's own (the inverse of its inter-token latency), plain decoding where speculation measures slower in either
  (probed now and then). One guard serves every level in order, learning as it serves
  (nothing is warmed on the training prompts);
* ``capped`` — ``guard`` with a step-time cap (:class:`learn2draft.budget.StepTimeCap`): in a step where a row drafted
  nothing, the drafted tokens verified are cut (highest survival first) so that the step's seconds, priced by the
  same cost profile as ``adaptive``, stay within ``--step-slack`` of a plain step's: that row's request, which cannot
  gain from the step, waits at most that much longer for its token. A guard of its own (learning from its own steps);
* ``hf`` — ``hf generate (batched)``: Hugging Face ``target.generate()`` on the same requests, c prompts at a time in
  one left-padded batch (closed loop only; a static batch waits for its slowest row).

Reported per method and level (``serve.json``, ``serve.md``): aggregate tokens/s (all requests' tokens / from the
stream's start to the last token), per-request tokens/s, TTFT, inter-token latency (ITL: each request's mean gap,
(finish − first token) / (tokens − 1), i.e. TPOT; ``itl_gaps``: the pooled gaps between the steps that emitted
tokens) and request latency at p50 / p90 / p99; the process's peak memory after the method ran; acceptance α
(accepted / drafted) and τ (accepted per row-step that drafted); ratios to no speculation (tokens/s, and ITL as
no-spec ITL / method ITL, so ≥ 1 is never slower; over several passes the median of each pass's own ratio,
with its min–max, and the method's record is its median pass). TTFT and latency count from
a request's arrival under Poisson arrivals (queueing included) and, in a closed loop, from when a free row let it in
as a closed-loop client measures them. ``serve.png`` plots throughput against concurrency (and
arrival rate) per method. The report opens with the header of
:mod:`eval.header` (machine, precision, sampling, …) and ends with verdict lines for the serving goals
(PASS / FAIL / not measured).

The full sweep (about 30 minutes on 2 CPU cores in bfloat16, alone on the machine, with ``--policy``)::

    python -m eval.serve --threads 2 --policy policies/defaults/lookup-serve-bfloat16 --out runs/serve

On a CPU where ``--dtype auto`` serves in float32 (no bf16 units), pass the policy trained in float32,
``policies/defaults/lookup-serve-float32``: a policy run in another precision than it was trained in warns.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from learn2draft import cli
from learn2draft.cli import HelpFormatter, note_on_interrupt, plain_doc, run_cli
from learn2draft.metrics import percentiles
from learn2draft.prompts import PROMPT_SETS
from learn2draft.settings import RunSettings

DEFAULT_OUT = "runs/serve"
#: Written after each measured pass of a level and removed when the run completes: what an interrupted run measured.
PARTIAL_FILE = "serve-partial.json"
#: What a finished run writes in ``--out`` (:func:`_write`).
RESULT_FILES = ("serve.json", "serve.md", "serve.png")
METHODS = ("nospec", "aa", "fixed", "table", "adaptive", "policy", "guard", "capped", "hf")
NOSPEC, HF = "no speculation (γ=0)", "hf generate (batched)"
NOSPEC_AGAIN = "no speculation again (A/A)"
TABLE, ADAPTIVE, LEARNED = "per-batch-size table", "adaptive verification (vLLM)", "learned policy"
GUARDED = "learned + speed guard"
CAPPED = "learned + guard + step-time cap"


# ----------------------------------------------------------------------------------------------- parsing
def parse_rates(text: str) -> list[float]:
    """``"0.5,1,2"`` → [0.5, 1.0, 2.0] requests/s (empty text: no Poisson sweep).

    Raises:
        ValueError: naming ``--arrival-rates``, for a non-number or a rate ≤ 0.
    """
    try:
        rates = [float(x) for x in cli.comma_items(text)]
    except ValueError:
        raise ValueError(f"--arrival-rates {text!r}: use comma-separated requests/s, e.g. 0.5,1,2.") from None
    if any(not np.isfinite(r) or r <= 0 for r in rates):
        raise ValueError(f"--arrival-rates {text!r}: every rate must be a finite number > 0 requests/s.")
    return rates


def parse_methods(text: str, has_policy: bool) -> list[str]:
    """The ``--methods`` keys in :data:`METHODS` order. With ``--policy``, the learned rows ``policy`` and ``guard``
    are both added unless ``--methods`` names one of the learned rows (then only the named ones run).

    Raises:
        ValueError: an unknown method, an empty item between commas, none, ``aa`` without ``nospec``, or
            ``policy`` / ``guard`` / ``capped`` without ``--policy``.
    """
    keys = cli.comma_items(text, "--methods", f"name one or more of {', '.join(METHODS)} joined by commas")
    bad = [m for m in keys if m not in METHODS]
    if bad or not keys:
        raise ValueError(f"--methods {text!r}: unknown method {bad[0]!r}; choose from {', '.join(METHODS)}." if bad
                         else f"--methods {text!r}: name at least one of {', '.join(METHODS)}.")
    if "aa" in keys and "nospec" not in keys:
        raise ValueError(f"--methods {text!r}: aa needs nospec (the A/A control is no speculation run again beside "
                         "it).")
    for k in ("policy", "guard", "capped"):
        if k in keys and not has_policy:
            raise ValueError(f"--methods {k} needs --policy DIR (an exported load-aware or chain policy).")
    if has_policy and not {"policy", "guard", "capped"} & set(keys):
        keys += ["policy", "guard"]
    return [m for m in METHODS if m in keys]


def build_parser() -> argparse.ArgumentParser:
    from eval.__main__ import add_overwrite_argument

    p = argparse.ArgumentParser(prog="python -m eval.serve", description=plain_doc(__doc__),
                                formatter_class=HelpFormatter)
    cli.add_drafter_arg(p, None)
    p.add_argument("--policy", default=None, help="an exported load-aware policy (python -m train --serve-loads, e.g. "
                                                  "policies/defaults/lookup-serve-bfloat16, or lookup-serve-float32 where "
                                                  "the run is in float32) or chain policy, or a "
                                                  "training run holding one, for the learned row; default: none")
    cli.add_profile_arg(p)
    p.add_argument("--methods", default="nospec,fixed,table,adaptive,hf",
                   help=f"comma-separated, of {', '.join(METHODS)} (with --policy: policy and guard are both added "
                        "unless a learned row (policy, guard, capped) is named; then only the named ones run)")
    p.add_argument("--concurrency", default="1,2,4,8,16", help="closed-loop concurrency levels")
    p.add_argument("--arrival-rates", default="0.25,0.5,1,2",
                   help="Poisson arrival rates in requests/s (seeded arrivals), comma-separated; '' for none")
    p.add_argument("--max-batch", type=int, default=None,
                   help="most rows at once under Poisson arrivals (default: the largest --concurrency)")
    p.add_argument("--num-requests", type=int, default=16,
                   help="requests per level, at least (the held-out prompts, cycled; the same prompts and seeds for "
                        "every method)")
    p.add_argument("--requests-per-slot", type=int, default=4,
                   help="a closed loop of concurrency c serves max(--num-requests, this × c) requests, so that the "
                        "batch stays full and refills (0: --num-requests at every level)")
    p.add_argument("--passes", type=int, default=1,
                   help="measured passes per level, every method in each, passes in pairs of opposite orders (A B C, "
                        "C B A, then rotated): the ratios to no speculation and the verdicts are the median over "
                        "passes of the ratio measured within each pass, reported with their min–max, so that the "
                        "machine's drift within a level is read, not charged to one method. The run takes about N "
                        "times as long; an odd N (3) makes each method's shown tok/s the median pass's own (an even N "
                        "shows the lower middle pass, while its ratio is the mean of the two middle ones)")
    p.add_argument("--num-train-requests", type=int, default=8,
                   help="training-split requests per calibration run (at concurrency c at least --requests-per-slot "
                        "× c, as the measured levels)")
    p.add_argument("--gammas", default="1,2,4,6", help="the fixed-γ grid (the table also tries γ = 0)")
    p.add_argument("--calibration-concurrency", type=int, default=None,
                   help="the concurrency level where the best single fixed γ is chosen (one of --concurrency; "
                        "default: the smallest level)")
    p.add_argument("--max-depth", type=int, default=None,
                   help="tokens every row drafts before adaptive verification cuts (default: the largest of --gammas)")
    p.add_argument("--refit-every", type=int, default=100,
                   help="steps between the acceptance estimator's refits (vLLM: 100)")
    p.add_argument("--cost-repeats", type=int, default=5, help="timed forwards per shape of the cost table (median)")
    p.add_argument("--step-slack", type=float, default=0.05,
                   help="the capped method's allowed growth of a step over a plain step's seconds when a row drafted "
                        "nothing (0.05: 5%%)")
    p.add_argument("--prompt-set", default="mixed", choices=list(PROMPT_SETS),
                   help="shipped prompts (training split for the calibration, held-out split measured)")
    p.add_argument("--sim-traces", default=None, metavar="TRACES",
                   help="chain traces of the measured prompts, in order (python -m eval.record --prompt-split "
                        "mixed_heldout …): replay every closed-loop level's methods in the request-stream simulator "
                        "with the cost profile and report sim-vs-real per level")
    p.add_argument("--prompts", default=None,
                   help="measure on these prompts instead (.jsonl / JSON, as eval.benchmark); the calibration still "
                        "uses the --prompt-set training prompts")
    p.add_argument("--max-new-tokens", type=int, default=64, help="per request")
    p.add_argument("--seed", type=int, default=0, help="seeds the requests' sampling and the arrivals")
    cli.add_out_arg(p, f"the results directory (default: {DEFAULT_OUT}): serve.json, serve.md, serve.png; "
                       "serve-partial.json after each pass of a level while it runs (kept if interrupted)")
    add_overwrite_argument(p)
    cli.add_model_args(p)
    cli.add_sampling_args(p)
    cli.add_device_args(p)
    return p


def main(argv: list[str] | None = None) -> int:
    return run_cli(build_parser(), _run, argv)


@dataclass
class Settings:
    """The checked flags (everything that can fail before a model loads)."""

    levels: list[int]
    rates: list[float]
    gammas: list[int]
    methods: list[str]
    max_batch: int
    max_depth: int
    out: Path
    device: str
    calibration: int  # the level where the fixed γ is chosen (--calibration-concurrency, default the smallest)


def check_args(args) -> Settings:
    """Validate every flag before any model loads.

    Raises:
        ValueError: one message naming the flag.
    """
    from eval.__main__ import earlier_results, parse_ints

    levels = parse_ints(args.concurrency, "--concurrency", "concurrency")
    rates = parse_rates(args.arrival_rates)
    gammas = parse_ints(args.gammas, "--gammas", "γ")
    methods = parse_methods(args.methods, args.policy is not None)
    if args.requests_per_slot < 0:
        raise ValueError(f"--requests-per-slot must be ≥ 0, got {args.requests_per_slot}.")
    for flag, v in (("--num-requests", args.num_requests), ("--num-train-requests", args.num_train_requests),
                    ("--passes", args.passes),
                    ("--max-new-tokens", args.max_new_tokens), ("--refit-every", args.refit_every),
                    ("--cost-repeats", args.cost_repeats)):
        if v < 1:
            raise ValueError(f"{flag} must be ≥ 1, got {v}.")
    if not (np.isfinite(args.step_slack) and args.step_slack >= 0):
        raise ValueError(f"--step-slack must be a finite number ≥ 0 (0.05: a step may grow 5%), got {args.step_slack}.")
    calibration = min(levels) if args.calibration_concurrency is None else args.calibration_concurrency
    if ("fixed" in methods or "table" in methods) and calibration not in levels:
        raise ValueError(f"--calibration-concurrency {args.calibration_concurrency} (the level where the fixed γ and "
                         f"the table are chosen) is not one of --concurrency {args.concurrency}: pass "
                         f"--calibration-concurrency {min(levels)}, or add {args.calibration_concurrency} to "
                         "--concurrency.")
    max_batch = max(levels) if args.max_batch is None else args.max_batch
    if max_batch < max(levels):
        raise ValueError(f"--max-batch {max_batch} is below the largest --concurrency {max(levels)}: a closed loop of "
                         "concurrency c needs c rows; raise --max-batch or drop the level.")
    if args.sim_traces:
        from learn2draft.replay.traces import load_traces

        cli.comma_items(args.sim_traces, "--sim-traces", "join the trace files with single commas, e.g. a.npz,b.npz")
        load_traces(args.sim_traces)  # a missing or damaged file fails now, not after the measurement
    if args.profile:
        from learn2draft.replay.latency import load_profile

        load_profile(args.profile)
    max_depth = max(gammas) if args.max_depth is None else args.max_depth
    if max_depth < 1:
        raise ValueError(f"--max-depth must be ≥ 1, got {max_depth}.")
    if args.policy is not None and not Path(args.policy).is_dir():
        raise FileNotFoundError(f"--policy {args.policy}: no such directory (an export or a training run).")
    out = Path(args.out or DEFAULT_OUT).expanduser()
    earlier_results(out, (*RESULT_FILES, PARTIAL_FILE), args.overwrite)  # moved aside at start (make_out_dir)
    sampling = cli.sampling_config(args)  # a bad sampling flag or --seed fails here
    if "hf" in methods and (sampling.prefix_dependent or sampling.min_p):
        raise ValueError("--min-p, --repetition-penalty and --presence-penalty: the hf generate (batched) row supports "
                         "temperature, top-k and top-p only; drop them or leave hf out of --methods.")
    device = cli.resolve_device(args.device)
    return Settings(levels, rates, gammas, methods, max_batch, max_depth, out, device, calibration)


# ----------------------------------------------------------------------------------------------- costs
def batched_costs(pair, args, s, sampling, head, context: int, sizes: Sequence[int], drafter: str):
    """The latency profile that prices adaptive verification's steps: ``--profile`` when it has the batch axis for
    ``drafter`` (the run's), else measured now on this machine (:func:`eval.profile.measure_profile` with the batch axis at
    ``context``, median of ``--cost-repeats`` per shape; as vLLM profiles its cost tables at start-up)."""
    from eval.profile import measure_profile
    from learn2draft.cli import stderr_line

    if args.profile:
        from learn2draft.replay.latency import load_profile

        prof = load_profile(args.profile)
        if prof.has_batch_axis and max(sizes) <= prof.max_batch_size:
            prof.require_batch_axis(max(sizes), drafter)
            return prof
        stderr_line(f"eval.serve: --profile {args.profile} has no batch axis up to {max(sizes)} rows: measuring one")
    return measure_profile(pair, [drafter], head=head, sampling=sampling, contexts=(context,),
                           tokens=tuple(range(1, s.max_depth + 2)), repeats=args.cost_repeats, draft_steps=4,
                           overhead_prompts=1, overhead_tokens=16, overhead_depths=(0, 2), name="eval.serve start-up",
                           progress=stderr_line, batch_sizes=sorted(set(sizes)), batch_contexts=(context,),
                           batch_overhead_depths=sorted({0, max(1, s.max_depth // 2), s.max_depth}))


# ----------------------------------------------------------------------------------------------- methods
@dataclass
class ServeMethod:
    """A method of the benchmark run through :func:`learn2draft.batched.serve`.

    Attributes:
        name: its row in the report. ``controller``: builds one controller per request. ``max_depth``: the
            decoder's (the controller's depth-feature scale). ``budget``: a verification budget with an
            ``observe(step)`` method (adaptive verification), or None.
    """

    name: str
    controller: Callable
    max_depth: int
    budget: object | None = None

    def run(self, pair, drafter: str, sampling, max_new_tokens: int, head, requests, concurrency: int | None,
            max_batch: int, min_ngram: int | None = None) -> dict:
        from eval.runner import peak_memory_bytes
        from learn2draft.batched import BatchedSpeculativeDecoder, serve

        if self.max_depth == 0 and drafter == "model" and not pair.has_draft:
            drafter = "lookup"  # never drafts: no draft model needed
        dec = BatchedSpeculativeDecoder(pair, drafter, sampling, max_new_tokens=max_new_tokens,
                                        max_depth=self.max_depth, max_batch=max_batch, head=head, min_ngram=min_ngram)
        on_step = getattr(self.budget, "observe", None)
        results = serve(dec, requests, self.controller, concurrency=concurrency, on_step=on_step, budget=self.budget)
        t0 = results[0].arrival - float(requests[0].arrival) if results else 0.0
        cycles = [c for r in results for c in r.cycles]
        drafting = [c for c in cycles if c.depth > 0]
        rows = []
        for i, (req, r, admitted) in enumerate(zip(requests, results, admissions(results, t0, concurrency))):
            latency = r.finish - t0 - admitted
            rows.append(_request_row(i, req, admitted, len(r.tokens), r.first_token - t0 - admitted, latency,
                                     len(r.tokens) / latency if latency > 0 else 0.0, r.mean_inter_token_seconds))
        gaps = [g for r in results for g in r.inter_token_seconds if g > 0]
        return _summary(rows, max(r.finish for r in results) - t0, gaps, peak_memory_bytes(),
                        drafted=sum(c.depth for c in cycles), accepted=sum(c.num_accepted for c in cycles),
                        tau=float(np.mean([c.num_accepted for c in drafting])) if drafting else None,
                        steps=len(dec.steps), mean_batch=float(np.mean([s.batch_size for s in dec.steps])))


def admissions(results, t0: float, concurrency: int | None) -> list[float]:
    """When each request of a :func:`learn2draft.batched.serve` stream started, in seconds after the stream's start
    ``t0``: in an open loop its arrival; in a closed loop of concurrency c the first c at 0 and request i ≥ c when the
    (i − c)-th request finished (serve admits the requests in order, one per freed row, at the next step boundary) —
    what a closed-loop client measures from (vLLM's ``--max-concurrency`` clients send when a slot frees), while
    serve records every closed-loop arrival at the start."""
    if concurrency is None:
        return [r.arrival - t0 for r in results]
    finishes = sorted(r.finish - t0 for r in results)
    c = min(concurrency, len(results))
    return [0.0] * c + finishes[: len(results) - c]


def _request_row(i: int, req, admitted: float, tokens: int, ttft: float, latency: float, tps: float,
                 tpot: float) -> dict:
    """One request of the report; times in seconds from its admission (:func:`admissions`)."""
    return {"request": i, "prompt_index": int(req.prompt_index), "seed": int(req.seed), "arrival": float(req.arrival),
            "admitted": float(admitted), "tokens": int(tokens), "ttft_seconds": ttft, "latency_seconds": latency,
            "tokens_per_second": tps, "itl_seconds": tpot}


def _summary(rows: list[dict], makespan: float, gaps: list[float], peak: int, drafted: int = 0, accepted: int = 0,
             tau: float | None = None, steps: int | None = None, mean_batch: float | None = None) -> dict:
    """One method at one level: totals, percentiles over requests, acceptance."""
    total = sum(r["tokens"] for r in rows)
    return {"requests": rows, "aggregate_tokens": total, "makespan_seconds": makespan,
            "aggregate_tokens_per_second": total / makespan if makespan > 0 else 0.0,
            "per_request_tokens_per_second": percentiles([r["tokens_per_second"] for r in rows]),
            "ttft_seconds": percentiles([r["ttft_seconds"] for r in rows]),
            "itl_seconds": percentiles([r["itl_seconds"] for r in rows if r["tokens"] > 1]),
            "itl_gaps_seconds": percentiles(gaps), "latency_seconds": percentiles([r["latency_seconds"] for r in rows]),
            "peak_memory_bytes": int(peak), "drafted": int(drafted), "accepted": int(accepted),
            "alpha": accepted / drafted if drafted else None, "tau": tau, "steps": steps, "mean_batch_size": mean_batch}


def run_hf_batched(pair, sampling, max_new_tokens: int, requests, concurrency: int) -> dict:
    """``target.generate()`` on the requests, ``concurrency`` at a time in one left-padded batch (attention mask
    zero on the padding), each batch after the previous; every request counts as arrived at the start (as in
    the closed loop). A row's tokens end at its first EOS (included). Per-step times from a streamer give each
    request's first and last token."""
    import torch

    from eval.runner import _TimingStreamer, peak_memory_bytes
    from learn2draft.timing import DeviceClock

    clock = DeviceClock(pair.device)
    eos = set(pair.eos_token_ids)
    kw = dict(max_new_tokens=max_new_tokens, do_sample=not sampling.greedy, eos_token_id=list(pair.eos_token_ids),
              pad_token_id=pair.eos_token_ids[0])
    kw.update(dict(temperature=sampling.temperature, top_k=sampling.top_k or None, top_p=sampling.top_p)
              if not sampling.greedy else dict(temperature=None, top_k=None, top_p=None))
    rows, gaps = [], []
    t0 = clock.now()
    for start in range(0, len(requests), concurrency):
        chunk = requests[start:start + concurrency]
        admitted = clock.now() - t0
        L = max(int(r.prompt_ids.numel()) for r in chunk)
        ids = torch.full((len(chunk), L), pair.eos_token_ids[0], dtype=torch.long, device=pair.device)
        mask = torch.zeros(len(chunk), L, dtype=torch.long, device=pair.device)
        for i, r in enumerate(chunk):
            n = int(r.prompt_ids.numel())
            ids[i, L - n:], mask[i, L - n:] = r.prompt_ids.to(pair.device), 1
        torch.manual_seed(int(chunk[0].seed))
        streamer = _TimingStreamer(clock)
        with torch.inference_mode():
            out = pair.target.generate(ids, attention_mask=mask, streamer=streamer, **kw)
        end = clock.now()
        times = streamer.times or [end]
        for i, r in enumerate(chunk):
            new = out[i, L:].tolist()
            n = next((j + 1 for j, t in enumerate(new) if t in eos), len(new))
            first, finish = times[0] - t0, times[min(n, len(times)) - 1] - t0
            latency = finish - admitted
            rows.append(_request_row(start + i, r, admitted, n, first - admitted, latency,
                                     n / latency if latency > 0 else 0.0, (finish - first) / (n - 1) if n > 1 else 0.0))
            gaps += [g for g in np.diff(times[:n]) if g > 0]
    return _summary(rows, max(r["admitted"] + r["latency_seconds"] for r in rows), gaps, peak_memory_bytes())


# ----------------------------------------------------------------------------------------------- requests
@dataclass
class _Req:
    """A :class:`learn2draft.batched.Request` plus the prompt it came from (for the report)."""

    prompt_ids: object
    arrival: float
    seed: int
    prompt_index: int


def make_requests(prompts: Sequence, n: int, seed: int, repeat: int, arrivals: Sequence[float] | None = None):
    """``n`` requests over ``prompts`` (int64 (L,) each) cycled, seeds :func:`learn2draft.names.run_seed` (seed,
    repeat, i), arrival times ``arrivals`` (seconds after the start; None: 0, a closed loop)."""
    from learn2draft.names import run_seed

    return [_Req(prompts[i % len(prompts)], 0.0 if arrivals is None else float(arrivals[i]),
                 run_seed(seed, repeat, i), i % len(prompts)) for i in range(n)]


def poisson_arrivals(rate: float, n: int, seed: int) -> np.ndarray:
    """float64 (n,) arrival times (seconds) of a Poisson process of ``rate`` requests/s: cumulative exponential
    gaps from ``numpy.random.default_rng(seed)``; the first request arrives at 0."""
    gaps = np.random.default_rng(seed).exponential(1.0 / rate, n)
    return np.concatenate([[0.0], np.cumsum(gaps[1:])])


# ----------------------------------------------------------------------------------------------- the run
def _run(args) -> int:
    from eval.__main__ import make_out_dir
    from eval.header import finish_header, header_lines, json_scalar, run_header
    from eval.runner import encode_all
    from learn2draft.cli import load_models, model_names, set_threads, stderr_line
    from learn2draft.prompts import load_prompt_file_records, load_prompt_records, load_prompts, prompt_set_splits

    s = check_args(args)
    policy, guard, cfg, head, drafter = None, None, {}, args.head, None
    capped: ServeMethod | None = None
    if args.policy:
        from policies.layout import FEATURE_SPEC_FILE, read_json, resolve_export_dir
        from policies.load import (
            load_policy,
            load_serve_policy,
            policy_drafter,
            policy_head,
            policy_lookup_min_ngram,
            run_settings,
        )

        spec_file = resolve_export_dir(args.policy) / FEATURE_SPEC_FILE
        if not spec_file.is_file():
            raise ValueError(f"--policy {args.policy}: no policy export there (no {FEATURE_SPEC_FILE}); pass an "
                             "export (policies/defaults/…, python -m policies.export) or a training run "
                             "(python -m train --out RUN).")
        spec = read_json(spec_file)
        # a load-aware policy (one γ per step from the load, --serve-loads) or a chain policy (per row)
        policy = (load_serve_policy(args.policy, profile=args.profile) if spec.get("kind") == "serve"
                  else load_policy(args.policy, profile=args.profile))
        if "guard" in s.methods and spec.get("kind") != "serve":
            if "guard" in cli.comma_items(args.methods):
                raise ValueError(f"--methods guard: the policy in {args.policy} is a chain policy (per row); the "
                                 "speed guard wraps a load-aware one (python -m train --serve-loads).")
            s.methods.remove("guard")  # added by default: a chain policy has no step γ to guard
        if "capped" in s.methods and spec.get("kind") != "serve":
            raise ValueError(f"--methods capped: the policy in {args.policy} is a chain policy (per row); the step-time "
                             "cap runs behind the speed guard of a load-aware one (python -m train --serve-loads).")
        trained = policy_drafter(args.policy)
        if "+" in trained:  # before the drafter check: no --drafter makes a hybrid policy run here
            raise ValueError(f"--policy {args.policy}: a hybrid ({trained}) policy; eval.serve runs load-aware and "
                             "chain policies (python -m eval.benchmark runs hybrid ones).")
        drafter = args.drafter or trained
        if trained != drafter:
            raise ValueError(f"The policy in {args.policy} was trained with the {trained!r} drafter, not "
                             f"{drafter!r}: pass --drafter {trained} or a matching --policy.")
        cfg, head = run_settings(args.policy), head or policy_head(args.policy)
        trained_min_ngram = policy_lookup_min_ngram(args.policy)
    drafter = drafter or args.drafter or "lookup"
    # every lookup method runs the policy's n-gram setting unless --lookup-min-ngram says otherwise
    min_ngram = cli.lookup_min_ngram(args, drafter, trained_min_ngram if args.policy else None,
                                     f"the policy in {args.policy}")
    user_prompts = load_prompt_file_records(args.prompts) if args.prompts else None
    sampling = cli.sampling_config(args)
    threads = set_threads(args, cfg.get("threads"))
    target, draft = model_names(args.target, args.draft, cfg)
    out = make_out_dir(s.out, RESULT_FILES, args.overwrite, partial=(PARTIAL_FILE,))
    # auto's widths: the largest batch this run decodes (--max-batch, else its largest concurrency) and its depth
    rs = RunSettings.resolve(device=s.device, dtype=args.dtype, threads=threads, batch=s.max_batch,
                             depths=(s.max_depth, *s.gammas), target=target, draft=draft, drafter=drafter,
                             lookup_min_ngram=min_ngram)
    pair = load_models(rs, drafter, progress=stderr_line, head=args.head)
    train_split, held_split = prompt_set_splits(args.prompt_set)
    held_records = user_prompts if user_prompts is not None else load_prompt_records(held_split)
    held = encode_all(pair, [p.text for p in held_records], args.max_new_tokens)
    train = encode_all(pair, load_prompts(train_split), args.max_new_tokens)
    header = run_header(rs.target, rs.draft if pair.has_draft else None, pair, rs.dtype, sampling.to_dict(),
                        str(pair.device), held_records, args.prompts or held_split, rs.forward_rows)
    run = {"drafter": rs.drafter, "lookup_min_ngram": rs.lookup_min_ngram, "policy": args.policy, "methods": s.methods, "concurrency": s.levels,
           "arrival_rates": s.rates, "max_batch": s.max_batch, "num_requests": args.num_requests,
           "requests_per_slot": args.requests_per_slot,
           "max_new_tokens": args.max_new_tokens, "passes": args.passes, "gammas": s.gammas, "max_depth": s.max_depth,
           "learned_max_depth": getattr(policy, "max_depth", None) if policy is not None else None,
           "calibration_concurrency": s.calibration, "seed": args.seed}
    report = {"header": header, "settings": run}
    common = dict(pair=pair, drafter=rs.drafter, sampling=sampling, max_new_tokens=args.max_new_tokens, head=head,
                  min_ngram=rs.lookup_min_ngram)

    # 1. start-up: warm the kernels, measure this machine's costs (adaptive verification's tables)
    stderr_line("eval.serve: warm-up and cost tables …")
    from learn2draft.control import FixedDepthController

    nospec = ServeMethod(NOSPEC, lambda: FixedDepthController(0), 0)
    nospec.run(requests=make_requests(train, 1, args.seed, 2), concurrency=1, max_batch=1, **common)
    # and the verification shapes of speculation (1 … max_depth + 1 tokens): a kernel's first call at a new shape
    # (oneDNN builds its primitive) is slow, and would be charged to whichever method speculates first — e.g. the
    # first measured steps of the speed guard, which compares speculating steps against plain ones
    ServeMethod("warm-up", lambda: FixedDepthController(s.max_depth), s.max_depth).run(
        requests=make_requests(train, 2, args.seed, 2), concurrency=1, max_batch=1, **common)
    av = prof = None
    if "adaptive" in s.methods or "capped" in s.methods:  # the step's cost, as this machine prices it
        sizes = sorted({1, *s.levels, s.max_batch})
        context = int(np.median([int(p.numel()) for p in held])) + args.max_new_tokens // 2
        prof = batched_costs(pair, args, s, sampling, head, context, sizes, rs.drafter)
        report["costs"] = {"profile": prof.to_dict(), "context": context}
    if "adaptive" in s.methods:
        from learn2draft.budget import AdaptiveVerification, profile_step_cost

        av = AdaptiveVerification(s.max_depth, cost=profile_step_cost(prof, rs.drafter, s.max_depth),
                                  refit_every=args.refit_every)

    # 2. calibration on the training prompts: the γ grid per level (fixed, table), the adaptive rule's warm-up
    calib = _calibrate(s, args, train, common, av)
    report["calibration"] = calib
    methods = []
    if "nospec" in s.methods:
        methods.append(nospec)
    if "aa" in s.methods:
        methods.append(ServeMethod(NOSPEC_AGAIN, lambda: FixedDepthController(0), 0))
    if "fixed" in s.methods:
        g = calib["best_fixed_gamma"]
        methods.append(ServeMethod(f"fixed γ={g} (best at c={s.calibration})",
                                   lambda g=g: FixedDepthController(g), g))
    if "table" in s.methods:
        from learn2draft.budget import BatchSizeTable

        table = calib["table"]
        depth = BatchSizeTable(table).max_depth
        methods.append(ServeMethod(TABLE, lambda: BatchSizeTable(table), depth))
    if av is not None:
        methods.append(ServeMethod(ADAPTIVE, lambda: FixedDepthController(s.max_depth), s.max_depth, av))
    if policy is not None:
        from eval.runner import decoder_max_depth
        from policies.controllers import LoadAwarePolicy

        if isinstance(policy, LoadAwarePolicy):  # one controller per request, the step's γ shared
            if "policy" in s.methods:
                methods.append(ServeMethod(LEARNED, policy, policy.max_depth))
            if "guard" in s.methods:
                from policies.rules import SpeculationGuard

                guard = SpeculationGuard(policy)
                methods.append(ServeMethod(GUARDED, guard, policy.max_depth))
            if "capped" in s.methods:
                from learn2draft.budget import StepTimeCap, profile_step_cost
                from policies.rules import SpeculationGuard

                cap = StepTimeCap(profile_step_cost(prof, rs.drafter, policy.max_depth), slack=args.step_slack)
                capped = ServeMethod(CAPPED, SpeculationGuard(policy), policy.max_depth, cap)
                methods.append(capped)
        elif "policy" in s.methods:
            methods.append(ServeMethod(LEARNED, lambda: policy, decoder_max_depth(policy)))

    # 3. the measured sweeps: per level, --passes passes of every method, in pairs of opposite orders (pass_order), so
    # that a method's place in the level's minutes averages out over passes
    levels = [("concurrency", c) for c in s.levels] + [("arrival_rate", r) for r in s.rates]
    report["levels"] = []
    wrote_partial: list[bool] = []
    note_on_interrupt(lambda: f"the passes measured so far are in {out / PARTIAL_FILE}" if wrote_partial else None)
    for li, (kind, value) in enumerate(levels):
        n = level_requests(kind, value, args)
        arrivals = None if kind == "concurrency" else poisson_arrivals(value, n, args.seed + 7919 * li)
        reqs = make_requests(held, n, args.seed, 0, arrivals)
        rows = list(methods) + ([HF] if "hf" in s.methods and kind == "concurrency" else [])
        names = [m if m == HF else m.name for m in rows]
        passes, orders = [], []
        for p in range(args.passes):
            order = pass_order(rows, li, p)
            res = {}
            for m in order:
                name = m if m == HF else m.name
                if m == HF:
                    res[HF] = run_hf_batched(pair, sampling, args.max_new_tokens, reqs, value)
                else:
                    res[name] = m.run(requests=reqs, concurrency=value if kind == "concurrency" else None,
                                      max_batch=value if kind == "concurrency" else s.max_batch, **common)
                stderr_line(f"eval.serve: {kind} {value}" + (f" pass {p + 1}/{args.passes}" if args.passes > 1 else "")
                            + f": {name}: {res[name]['aggregate_tokens_per_second']:.1f} tok/s")
            _ratios(res)
            passes.append({nm: res[nm] for nm in names})
            orders.append([m if m == HF else m.name for m in order])
            level = {"kind": kind, "value": value, "num_requests": n, "order": orders[0], "orders": orders,
                     "methods": combine_passes(passes), **({"passes": passes} if len(passes) > 1 else {})}
            # what is measured so far survives a Ctrl-C or a crash of a later pass (removed when the run completes);
            # a level with fewer passes than asked is the one that was running
            if guard is not None:  # the guard's state so far, kept with the levels
                report["guard"] = {"settings": repr(guard),
                                   "batch_sizes": {str(b): v for b, v in guard.summary().items()}}
            so_far = {**report, "levels": [*report["levels"], level], "partial": True}
            (out / PARTIAL_FILE).write_text(json.dumps(so_far, indent=1, default=json_scalar))
            wrote_partial.append(True)
        report["levels"].append(level)
        stderr_line(f"eval.serve: {len(report['levels'])}/{len(levels)} levels measured (so far in "
                    f"{out / PARTIAL_FILE})")
    if "nospec" in s.methods and "hf" in s.methods:  # the goal's own setting: the same 8 prompts in one batch
        report["same_batch"] = same_batch(nospec, pair, sampling, held, args, common)
    if av is not None:
        report["adaptive"] = {"refits": av.estimator.refits, "weights": av.estimator.weights.tolist(),
                              "biases": av.estimator.biases.tolist(),
                              "rejected_slopes": av.estimator.rejected_slopes}
    report["roles"] = {"no_spec": NOSPEC if "nospec" in s.methods else None,
                       "aa": NOSPEC_AGAIN if "aa" in s.methods else None,
                       "fixed": next((m.name for m in methods if m.name.startswith("fixed")), None),
                       "table": TABLE if "table" in s.methods else None,
                       "adaptive": ADAPTIVE if av is not None else None,
                       "learned": LEARNED if any(m.name == LEARNED for m in methods) else None,
                       "guarded": GUARDED if guard is not None else None,
                       "capped": CAPPED if capped is not None else None, "hf": HF if "hf" in s.methods else None}
    if guard is not None:
        report["guard"] = {"settings": repr(guard), "batch_sizes": {str(b): v for b, v in guard.summary().items()}}
    if capped is not None:  # its own guard, and what its cap cut
        report["capped"] = {"cap": capped.budget.summary(), "guard": repr(capped.controller),
                            "batch_sizes": {str(b): v for b, v in capped.controller.summary().items()}}
    if args.sim_traces:
        prof = prof if prof is not None else batched_costs(pair, args, s, sampling, head, int(np.median(
            [int(p.numel()) for p in held])) + args.max_new_tokens // 2, sorted({1, *s.levels, s.max_batch}), rs.drafter)
        report["sim_vs_real"] = sim_vs_real(report, args.sim_traces, prof, s, args, policy,
                                            calib.get("table"), calib.get("best_fixed_gamma"), rs.drafter)
    report["verdicts"] = serve_verdicts(report)
    finish_header(header)
    md = [*header_lines(header), *_markdown(report)]
    _write(report, md, out)
    (out / PARTIAL_FILE).unlink(missing_ok=True)
    return 0


def level_requests(kind: str, value, args) -> int:
    """Requests measured at a level: :func:`learn2draft.replay.serve.requests_for` (at concurrency c, at least
    ``--requests-per-slot`` × c; under Poisson arrivals ``--num-requests``)."""
    from learn2draft.replay.serve import Load, requests_for

    load = Load(concurrency=int(value)) if kind == "concurrency" else Load(rate=float(value))
    return requests_for(load, args.num_requests, args.requests_per_slot)


def sim_vs_real(report: dict, traces_path: str, profile, s, args, policy, table, best_gamma, drafter: str) -> dict:
    """Each closed-loop level's methods replayed in the request-stream simulator
    (:func:`learn2draft.replay.serve.simulate`: the traces of the measured prompts, the cost ``profile``, the same
    number of requests and tokens) beside their measured aggregate tokens/s: ``{level: {method: {"sim", "real",
    "error"}}}`` with error = sim / real − 1 (issue 17's goal: |error| ≤ 10% per level). Methods replayed: no
    speculation, the best fixed γ, the per-batch-size table, and a load-aware learned policy (drafting with
    ``drafter``, the run's)."""
    from envs.serve import ReplayServePolicy
    from learn2draft.budget import BatchSizeTable
    from learn2draft.control import FixedDepthController
    from learn2draft.replay.serve import Load, simulate
    from learn2draft.replay.traces import load_traces
    from policies.controllers import LoadAwarePolicy

    traces = load_traces(traces_path)
    roles = report["roles"]
    pols = {roles.get("no_spec"): FixedDepthController(0)}
    if roles.get("fixed") and best_gamma is not None:
        pols[roles["fixed"]] = FixedDepthController(int(best_gamma))
    if roles.get("table") and table:
        pols[roles["table"]] = BatchSizeTable(table)
    if roles.get("learned") and isinstance(policy, LoadAwarePolicy):
        pols[roles["learned"]] = ReplayServePolicy(lambda o: int(policy.graph.actions(o)[0]), profile, drafter,
                                                   policy.max_depth, policy.max_new_tokens, policy.batch_scale,
                                                   policy.context_scale, policy.batch_context)
    out = {}
    for lv in report["levels"]:
        if lv["kind"] != "concurrency":
            continue
        c = int(lv["value"])
        row = {}
        for name, pol in pols.items():
            if name is None or name not in lv["methods"]:
                continue
            sim = simulate(traces, profile, pol, Load(concurrency=c), level_requests("concurrency", c, args), max_batch=c,
                           max_depth=s.max_depth, max_new_tokens=args.max_new_tokens)["tokens_per_s"]
            real = lv["methods"][name]["aggregate_tokens_per_second"]
            row[name] = {"sim": sim, "real": real, "error": sim / real - 1 if real else None}
        out[f"concurrency {c}"] = row
    return out


def same_batch(nospec: ServeMethod, pair, sampling, held, args, common: dict, batch: int = 8,
               repeats: int = 3) -> dict:
    """Batched decoding without speculation against Hugging Face ``generate()`` on the same ``batch`` held-out
    prompts in one batch (ours: all rows join at once and share one prefill; generate(): one left-padded batch),
    ``repeats`` times, the two interleaved (a rotated order): the goal "plain batched decoding (γ = 0) ≥ 1.00× HF
    generate() batched on the same prompts" (padding included).

    Returns:
        ``{"batch", "repeats", "no_spec_tokens_per_second": [...], "hf_tokens_per_second": [...], "ratio": mean of
        the per-repeat ratios}``.
    """
    from learn2draft.cli import stderr_line

    reqs = make_requests(held, batch, args.seed, 0)
    ours, hf = [], []
    for rep in range(repeats):
        for which in (("ours", "hf") if rep % 2 == 0 else ("hf", "ours")):
            if which == "ours":
                ours.append(nospec.run(requests=reqs, concurrency=batch, max_batch=batch,
                                       **common)["aggregate_tokens_per_second"])
            else:
                hf.append(run_hf_batched(pair, sampling, args.max_new_tokens, reqs, batch)["aggregate_tokens_per_second"])
        stderr_line(f"eval.serve: the same {batch} prompts in one batch, repeat {rep + 1}: no speculation "
                    f"{ours[-1]:.1f} tok/s, hf generate {hf[-1]:.1f} tok/s")
    return {"batch": batch, "repeats": repeats, "no_spec_tokens_per_second": ours, "hf_tokens_per_second": hf,
            "ratio": float(np.mean([a / b for a, b in zip(ours, hf)]))}


def _calibrate(s: Settings, args, train, common: dict, av) -> dict:
    """The training-split runs: aggregate tokens/s of γ ∈ 0 ∪ ``gammas`` at every concurrency level (for the fixed
    γ and the table) and the adaptive rule's warm-up (its estimator learns; tokens/s recorded)."""
    from learn2draft.cli import stderr_line
    from learn2draft.control import FixedDepthController

    out: dict = {"grid": {}, "adaptive_tokens_per_second": {}}
    need_grid = "fixed" in s.methods or "table" in s.methods
    for c in s.levels:
        from learn2draft.replay.serve import requests_for

        # as the measured levels: at least --requests-per-slot × c, so that the grid is tuned on a full batch
        reqs = make_requests(train, requests_for(c, args.num_train_requests, args.requests_per_slot), args.seed, 1)
        row = {}
        gammas = ([0] if "table" in s.methods else []) + s.gammas if need_grid else []
        for g in gammas:
            m = ServeMethod(f"γ={g}", lambda g=g: FixedDepthController(g), g)
            row[g] = m.run(requests=reqs, concurrency=c, max_batch=c, **common)["aggregate_tokens_per_second"]
            stderr_line(f"eval.serve: calibration c={c} γ={g}: {row[g]:.1f} tok/s")
        out["grid"][str(c)] = {str(g): v for g, v in row.items()}
        if av is not None:
            m = ServeMethod(ADAPTIVE, lambda: FixedDepthController(s.max_depth), s.max_depth, av)
            v = m.run(requests=reqs, concurrency=c, max_batch=c, **common)["aggregate_tokens_per_second"]
            out["adaptive_tokens_per_second"][str(c)] = v
    if need_grid:
        cal = out["grid"][str(s.calibration)]
        out["best_fixed_gamma"] = max(s.gammas, key=lambda g: cal[str(g)])
        best = {c: max(out["grid"][str(c)], key=lambda g: out["grid"][str(c)][g]) for c in s.levels}
        out["table"] = [[prev + 1, c, int(best[c])] for prev, c in zip([0, *s.levels], s.levels)]
    if av is not None:
        out["adaptive_refits_after_warmup"] = av.estimator.refits
    return out


def pass_order(rows: list, level: int, p: int) -> list:
    """The run order of ``rows`` in pass ``p`` of level ``level``: rotated left by ``level + p // 2`` and reversed on
    odd passes, so that passes come in pairs run in opposite orders (A B C, C B A, then B C A, A C B, …): over a pair
    each method's mean place in the level's minutes is the middle, so a drift linear in time cancels."""
    k = (level + p // 2) % len(rows)
    order = rows[k:] + rows[:k]
    return order[::-1] if p % 2 else order


RATIO_KEYS = ("tokens_per_second", "itl_p50", "itl_p99")


def _ratio(m: dict, base: dict, key: str) -> float | None:
    """Method record ``m`` against ``base`` (two records of one pass) in ``key``, one of :data:`RATIO_KEYS`: tokens/s
    as m's over base's, ITL p50/p99 as base's over m's (≥ 1: not slower); None when a value is missing or 0."""
    if key == "tokens_per_second":
        return _div(m["aggregate_tokens_per_second"], base["aggregate_tokens_per_second"])
    q = key.split("_")[1]
    return _div(base["itl_seconds"][q], m["itl_seconds"][q])


def _ratios(res: dict) -> None:
    """Add ``ratio_to_no_spec`` (:func:`_ratio` for each of :data:`RATIO_KEYS`) to every method of one pass of a
    level."""
    base = res.get(NOSPEC)
    for m in res.values():
        m["ratio_to_no_spec"] = None if base is None else {k: _ratio(m, base, k) for k in RATIO_KEYS}


def _pass_ratio(passes: list[dict], name: str, base: str, key: str) -> list[float] | None:
    """Per pass, ``name``'s :func:`_ratio` to ``base`` in ``key``, both measured in that pass; None when a pass lacks
    either or a value."""
    out = []
    for res in passes:
        a, b = res.get(name), res.get(base)
        if a is None or b is None:
            return None
        r = _ratio(a, b, key)
        if r is None:
            return None
        out.append(float(r))
    return out


def combine_passes(passes: list[dict]) -> dict:
    """One level's methods over its passes (``passes``: per pass, method name → summary with ``ratio_to_no_spec``).

    Each method's record is its pass with the median aggregate tokens/s (the lower median for an even number: every
    number in it is one pass's own), with ``ratio_to_no_spec`` replaced by the median over passes of the per-pass
    ratios (each against no speculation in the same pass: paired, so drift between passes cancels) and
    ``ratio_spread``: per ratio, [min, max] over passes. One pass: that pass, spread [r, r].
    """
    out = {}
    for name in dict.fromkeys(n for res in passes for n in res):  # every method of any pass, in first-seen order
        mine = [res for res in passes if name in res]  # an interrupted level may lack a method in its last pass
        runs = sorted(mine, key=lambda res: res[name]["aggregate_tokens_per_second"])
        rec = dict(runs[(len(runs) - 1) // 2][name])
        rec["passes"] = len(mine)
        rec["tokens_per_second_passes"] = [res[name]["aggregate_tokens_per_second"] for res in mine]
        if all(NOSPEC in res for res in mine):
            per = {k: _pass_ratio(mine, name, NOSPEC, k) for k in RATIO_KEYS}
            rec["ratio_to_no_spec"] = {k: None if v is None else float(np.median(v)) for k, v in per.items()}
            rec["ratio_spread"] = {k: None if v is None else [min(v), max(v)] for k, v in per.items()}
        out[name] = rec
    return out


def level_ratio(level: dict, name: str, base: str, key: str = "tokens_per_second") -> float | None:
    """The median over a level's passes of ``name``'s per-pass ``key`` ratio to ``base`` (:func:`_pass_ratio`);
    a report without ``passes`` (one pass) reads its ``methods``."""
    r = _pass_ratio(level.get("passes") or [level["methods"]], name, base, key)
    return None if r is None else float(np.median(r))


def _div(a, b):
    return a / b if a is not None and b else None


# ----------------------------------------------------------------------------------------------- verdicts
def serve_verdicts(report: dict) -> list[dict]:
    """Issue 17's goals judged on the measured levels, as :func:`eval.verdicts.verdict_lines` entries (``claim``,
    ``temperature`` None, ``threshold``, ``measured``, ``verdict`` PASS / FAIL / not measured, ``against``).

    * learned ≥ 1.00× no speculation at every level (the smallest of the tokens/s and ITL p50 / p99 ratios);
    * learned ≥ 1.10× the best single fixed γ, geometric mean over the concurrency sweep;
    * learned ≥ 1.00× the per-batch-size table and ≥ 1.00× adaptive verification at every level (tokens/s);
    * the same four for the learned policy behind the speed guard, and behind the guard with the step-time cap, when
      those rows ran;
    * no speculation ≥ 1.00× hf generate (batched) on the same 8 prompts in one batch (:func:`same_batch`);
    * with the A/A control (``--methods aa``): the never-slower test applied to no speculation run again, verdict
      ``control`` (not a goal): the smallest ratio a method identical to no speculation measures at some level, what
      a learned row's shortfall of the same size cannot be told apart from.

    A level's ratio is the median over its passes of the ratio measured within each pass (:func:`level_ratio`).
    """
    from eval.verdicts import FAIL, NOT_MEASURED, PASS

    roles, levels = report["roles"], report["levels"]

    def ratio(level, role, base, key="tokens_per_second"):
        a, b = roles.get(role), roles.get(base)
        return level_ratio(level, a, b, key) if a and b else None

    def entry(claim, threshold, measured, against):
        verdict = NOT_MEASURED if measured is None else PASS if measured >= threshold else FAIL
        return {"claim": claim, "temperature": None, "threshold": threshold, "measured": measured,
                "verdict": verdict, "against": against if measured is not None else ""}

    def worst(role, base, with_itl=False):
        vals = []
        for lv in levels:
            r = [(ratio(lv, role, base), "tok/s")]
            if with_itl:
                r += [(ratio(lv, role, base, f"itl_{q}"), f"ITL {q}") for q in ("p50", "p99")]
            if r[0][0] is None:
                return None, ""
            # an ITL ratio that could not be measured (no request had 2 tokens) is left out, not read as 0
            v, what = min((x, w) for x, w in r if x is not None)
            vals.append((v, f"{lv['kind']} {lv['value']}" + (f" ({what})" if with_itl else "")))
        return min(vals) if vals else (None, "")

    out = []
    conc = [lv for lv in levels if lv["kind"] == "concurrency"]
    for who, label in (("learned", "learned"), ("guarded", "learned + guard"), ("capped", "learned + guard + cap")):
        if who in ("guarded", "capped") and not roles.get(who):
            continue  # a run without the row keeps the verdicts it always had
        v, at = worst(who, "no_spec", with_itl=True)
        out.append(entry(f"{label} ≥ 1.00× no speculation at every level (tok/s, ITL p50/p99)", 1.00, v,
                         f"{roles.get('no_spec')}, worst at {at}"))
        ratios = [ratio(lv, who, "fixed") for lv in conc]
        g = float(np.exp(np.mean(np.log(ratios)))) if ratios and all(ratios) else None
        out.append(entry(f"{label} ≥ 1.10× best fixed γ (geomean over concurrency)", 1.10, g, str(roles.get("fixed"))))
        for role, name in (("table", "per-batch-size table"), ("adaptive", "adaptive verification")):
            v, at = worst(who, role)
            out.append(entry(f"{label} ≥ 1.00× {name} at every level", 1.00, v, f"{roles.get(role)}, worst at {at}"))
    if roles.get("aa") and roles.get("no_spec"):
        v, at = worst("aa", "no_spec", with_itl=True)
        out.append({**entry("A/A control (not a goal: the test's noise): no speculation again ≥ 1.00× no speculation "
                            "at every level (tok/s, ITL p50/p99)", 1.00, v, f"{roles['no_spec']}, worst at {at}"),
                    **({"verdict": "control"} if v is not None else {})})
    sb = report.get("same_batch")
    out.append(entry(f"no speculation at B={sb['batch'] if sb else 8} ≥ 1.00× hf generate (batched)", 1.00,
                     sb["ratio"] if sb else None,
                     f"{HF} on the same prompts in one batch, mean of {sb['repeats']} interleaved repeats" if sb else HF))
    return out


# ----------------------------------------------------------------------------------------------- report
def _ms(x) -> str:
    return "–" if x is None else f"{1e3 * x:.0f}"


def _num(x) -> str:
    return "–" if x is None else f"{x:.2f}"


def _ratio_cell(m: dict, key: str) -> str:
    """A method's ratio to no speculation, with its [min–max] over passes when there were several."""
    r = (m.get("ratio_to_no_spec") or {}).get(key)
    if r is None:
        return "–"
    lo_hi = (m.get("ratio_spread") or {}).get(key)
    return f"{r:.2f}" + (f" [{lo_hi[0]:.2f}–{lo_hi[1]:.2f}]" if lo_hi and m.get("passes", 1) > 1 else "")


#: Per-pass readings of one method at one level further apart than this factor (largest / smallest) are flagged in
#: serve.md: a pass was likely disturbed (another process on the machine, a stall), and its median is not trusted.
PASS_DISAGREEMENT = 1.5


def disagreeing_passes(level: dict) -> list[str]:
    """The methods of ``level`` (a combined level, :func:`combine_passes`) whose passes disagree: their tokens/s ratio
    to no speculation in the same pass ranging over more than :data:`PASS_DISAGREEMENT`× from the smallest pass to
    the largest (a pass slowed as a whole moves every method's tokens/s but not these ratios, and is not flagged).
    Returns one phrase per such method (none for one pass)."""
    out = []
    for name, m in level["methods"].items():
        lo_hi = (m.get("ratio_spread") or {}).get("tokens_per_second")
        if lo_hi and lo_hi[0] and m.get("passes", 1) > 1 and lo_hi[1] / lo_hi[0] > PASS_DISAGREEMENT:
            out.append(f"{name} {lo_hi[0]:.2f}–{lo_hi[1]:.2f}× no speculation ({lo_hi[1] / lo_hi[0]:.1f}× apart)")
    return out


def _markdown(report: dict) -> list[str]:
    from eval.verdicts import verdict_lines

    st, cal, roles = report["settings"], report["calibration"], report.get("roles", {})
    per = st.get("requests_per_slot", 0)
    counts = (f"at least {st['num_requests']} requests per level ({per} × c at concurrency c)" if per
              else f"{st['num_requests']} requests per level")
    md = [f"Drafter: {st['drafter']}; {counts}, {st['max_new_tokens']} new tokens; "
          + (f"{st['passes']} passes per level, in pairs of opposite orders (rotated per pair); ratios to no "
             "speculation are the median over passes of each pass's own ratio, [min–max] beside it"
             if st.get("passes", 1) > 1 else "methods interleaved per level (rotated order)")
          + (f"; adaptive verification drafts up to {st['max_depth']}" if roles.get("adaptive") else "")
          + (f", the learned policy up to its own max_depth {st['learned_max_depth']}"
             if st.get("learned_max_depth") else "") + ".", ""]
    if "best_fixed_gamma" in cal:
        md += [f"Best single fixed γ (training prompts, concurrency {st['calibration_concurrency']}): "
               f"{cal['best_fixed_gamma']}; grid-tuned table (vLLM format): {cal['table']}.", ""]
    if "costs" in report:
        c = report["costs"]
        vb = c["profile"]["verify_batch"]
        users = " and ".join(w for w, r in (("adaptive verification", "adaptive"), ("the step-time cap", "capped"))
                             if roles.get(r))
        md += [f"The step's costs ({users}): latency profile {c['profile']['name']!r} (context {c['context']}): "
               f"batch sizes {vb['batch_sizes']}, tokens per row {vb['tokens']}.", ""]
    for lv in report["levels"]:
        md += [f"### {lv['kind'].replace('_', ' ')} {lv['value']}" + (" requests/s" if lv["kind"] == "arrival_rate"
                                                                         else "")
               + (f" ({lv['num_requests']} requests)" if lv.get("num_requests") else ""), "",
               "| method | tok/s | × no-spec tok/s | × no-spec ITL p50 | × no-spec ITL p99 | req tok/s p50 | "
               "TTFT ms p50/p90/p99 | ITL ms p50/p90/p99 | latency s p50/p99 | α | τ | peak MB |",
               "|---|---|---|---|---|---|---|---|---|---|---|---|"]
        for name, m in lv["methods"].items():
            rs = " | ".join(_ratio_cell(m, k) for k in RATIO_KEYS)
            t, i, lat = m["ttft_seconds"], m["itl_seconds"], m["latency_seconds"]
            md.append(f"| {name} | {m['aggregate_tokens_per_second']:.1f} | {rs} | "
                      f"{m['per_request_tokens_per_second']['p50']:.1f} | {_ms(t['p50'])}/{_ms(t['p90'])}/"
                      f"{_ms(t['p99'])} | {_ms(i['p50'])}/{_ms(i['p90'])}/{_ms(i['p99'])} | {lat['p50']:.2f}/"
                      f"{lat['p99']:.2f} | {_num(m['alpha'])} | {_num(m['tau'])} | "
                      f"{m['peak_memory_bytes'] / 2**20:.0f} |")
        md.append("")
        if (apart := disagreeing_passes(lv)):
            md += [f"**The passes disagree** (more than {PASS_DISAGREEMENT}× apart): {'; '.join(apart)}. A pass was "
                   "likely disturbed (another process, a stall): rerun this level alone before reading its ratios.", ""]
    if report.get("sim_vs_real"):
        md += ["### replay against the measurement (closed loop; error = sim / real − 1)", "",
               "| level | " + " | ".join(next(iter(report["sim_vs_real"].values()), {}).keys()) + " |",
               "|---|" + "---|" * len(next(iter(report["sim_vs_real"].values()), {}))]
        for level, row in report["sim_vs_real"].items():
            md.append(f"| {level} | " + " | ".join(f"{v['sim']:.1f} vs {v['real']:.1f} ({100 * v['error']:+.0f}%)"
                                                  for v in row.values()) + " |")
        md.append("")
    if report.get("guard"):
        md += [f"### the speed guard ({report['guard']['settings']}), after the last level", "",
               "Per batch-size bucket, over each arm's last window of steps (steps that prefilled joining requests "
               "excluded): an arm's tok/s is its steps' committed tokens / their seconds, not a level's aggregate; a "
               "request still running is slower under the policy when, in the steps it ran in, it committed fewer "
               "tokens than plain steps of the same seconds would have; the idle ones (they drafted nothing) are slower together when the steps they ran "
               "in measure longer than plain steps, by `confidence` standard errors "
               "(`SpeculationGuard.request_check`); a request that drafted nothing but can draft at the step being "
               "decided is tested as a drafting one. The slower/idle column is this report's view over every "
               "request in the window, without that test; idle reads are the guard's own decisions: how many found "
               "idle requests, the idle requests they found summed over those decisions (a request counts at every "
               "decision that found it), and of those, the ones that could draft then. Plain steps by reason "
               "(`SpeculationGuard.PLAIN_REASONS`): the plain arm's rate led, the request check found idle (or only "
               "drafting) requests slower, a smaller bucket's verdict before both arms were measured here, a probe, "
               "or the policy chose γ = 0; counted over the whole run, as the steps in brackets, the steps run plain and "
               "the idle reads are (the tok/s, the step-seconds ratio and the slower requests read the last window), "
               "they sum to the steps run plain by the guard plus the policy's own γ = 0 steps.", "",
               "| batch sizes | policy tok/s (steps) | plain tok/s (steps) | step seconds policy / plain | requests "
               "slower under the policy (of those tested; idle) | winner | steps run plain by the guard (of all) | "
               "idle reads: decisions, idle requests (could draft) | plain steps by reason |",
               "|---|---|---|---|---|---|---|---|---|"]
        for b, v in report["guard"]["batch_sizes"].items():
            cell = {a: (f"{x['tokens_per_second']:.1f} ({x['steps']})" if x["tokens_per_second"] else "–")
                    for a, x in v["arms"].items()}
            req = v.get("requests")
            cost = (f"{req['cost_ratio']:.2f}× ± {req['cost_ratio_error']:.2f}" if req and "cost_ratio_error" in req
                    else f"{req['cost_ratio']:.2f}×" if req else "–")
            slower = f"{req['slower']} of {req['requests']}" + (f"; {req['idle']} idle" if req and "idle" in req
                                                                 else "") if req else "–"
            md.append(f"| {v.get('batch_sizes', b)} | {cell.get('policy', '–')} | {cell.get('plain', '–')} | {cost} | "
                      f"{slower} | {v['winner']} | {v.get('plain_unasked', '–')} of {v.get('steps', '–')} | "
                      + (f"{r['decisions']}, {r['idle']} ({r['draftable_now']}) |" if (r := v.get("idle_reads"))
                         else "– |")
                      + f" {', '.join(f'{k} {n}' for k, n in v.get('plain_reasons', {}).items() if n) or '–'} |")
        md.append("")
    if report.get("capped"):
        cap = report["capped"]["cap"]
        md += [f"### the step-time cap (slack {cap['slack']}), over every level and pass", "",
               f"{cap['steps']} steps; {cap.get('steps_bounded', '–')} bounded (a row drafted nothing beside one that "
               f"drafted), {cap['steps_cut']} cut; {cap['verified']} of {cap['drafted']} drafted tokens verified. Its "
               f"guard: {report['capped']['guard']}; per batch-size bucket, steps run plain (of all) and why: "
               + "; ".join(f"{v.get('batch_sizes', b)}: {v.get('plain_unasked', '–')} of {v.get('steps', '–')} ("
                           + (", ".join(f"{k} {n}" for k, n in v.get("plain_reasons", {}).items() if n) or "–") + ")"
                           for b, v in report["capped"]["batch_sizes"].items()) + ".", ""]
    if report.get("same_batch"):
        sb = report["same_batch"]
        md += [f"### the same {sb['batch']} prompts in one batch ({sb['repeats']} interleaved repeats)", "",
               f"no speculation {np.mean(sb['no_spec_tokens_per_second']):.1f} tok/s, hf generate (batched) "
               f"{np.mean(sb['hf_tokens_per_second']):.1f} tok/s: ratio {sb['ratio']:.3f}.", ""]
    md += ["## Verdicts (the serving goals; aggregate tokens/s ratios on held-out prompts)", "", "```",
           *verdict_lines(report["verdicts"]), "```", ""]
    return md


def plot_serve(report: dict, path: Path) -> None:
    """Aggregate tokens/s against concurrency (and against the arrival rate, when measured), one line per method (the
    median pass; bars: min–max over passes); saved as PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    kinds = [k for k in ("concurrency", "arrival_rate") if any(lv["kind"] == k for lv in report["levels"])]
    fig, axes = plt.subplots(1, len(kinds), figsize=(6.5 * len(kinds), 4.5), squeeze=False)
    for ax, kind in zip(axes[0], kinds):
        lvs = [lv for lv in report["levels"] if lv["kind"] == kind]
        names = list(dict.fromkeys(n for lv in lvs for n in lv["methods"]))
        for n in names:
            ms = [(lv["value"], lv["methods"][n]) for lv in lvs if n in lv["methods"]]
            x, y = [v for v, _ in ms], [m["aggregate_tokens_per_second"] for _, m in ms]
            runs = [m.get("tokens_per_second_passes") or [m["aggregate_tokens_per_second"]] for _, m in ms]
            err = [[yi - min(r) for yi, r in zip(y, runs)], [max(r) - yi for yi, r in zip(y, runs)]]
            ax.errorbar(x, y, yerr=err, marker="o", capsize=3, label=n, ls="--" if n == HF else "-")
        if kind == "concurrency":
            ax.set_xscale("log", base=2)
            ax.set_xticks([lv["value"] for lv in lvs], [str(lv["value"]) for lv in lvs])
        ax.set_xlabel("concurrency (closed loop)" if kind == "concurrency" else "arrival rate (requests/s, Poisson)")
        ax.set_ylabel("aggregate tokens/s")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    h = report["header"]
    fig.suptitle(f"{h['models']['target']['name']}, {h['precision']}, drafter {report['settings']['drafter']}",
                 fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _write(report: dict, md: list[str], out: Path) -> None:
    """Write the report (serve.md, serve.json, serve.png) and print it (:func:`eval.header.write_report`)."""
    from eval.header import write_report

    write_report(out, "serve", report, md, plot_serve)


if __name__ == "__main__":
    sys.exit(main())
