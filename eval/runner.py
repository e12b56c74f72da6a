"""Running decoding methods side by side, interleaved, on the same prompts and seeds.

A *method* is anything that turns a prompt into tokens: this project's loop under a
:class:`~learn2draft.decoding.DraftController` (autoregressive, fixed γ, a learned policy; with a
:class:`TreeShape`, a draft tree under a fixed (depth, V) or a learned tree policy), or
Hugging Face ``generate()`` with or without ``assistant_model=``. Every run is timed with the same
device-synchronised clock; methods are interleaved (a rotated order per prompt and repeat) so a
noisy, shared machine slows them all alike.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch
from transformers.generation.streamers import BaseStreamer

from learn2draft.cli import progress as cli_progress
from learn2draft.control import CycleDriver
from learn2draft.decoding import DraftController, Sampler, SpeculativeDecoder
from learn2draft.drafters import Drafter, make_drafter
from learn2draft.metrics import percentiles, tau_histogram
from learn2draft.models import ModelPair
from learn2draft.names import run_seed
from learn2draft.sampling import SamplingConfig
from learn2draft.timing import DeviceClock


@dataclass
class RunRecord:
    """One generation. Seconds are wall-clock, device-synchronised; ``tau`` is the mean accepted
    length (None where the method does not expose it); ``overhead_fraction`` is the share of
    cycle time outside the two models' forwards (None for Hugging Face methods)."""

    method: str
    prompt_index: int
    repeat: int
    new_tokens: int
    wall_seconds: float
    ttft_seconds: float
    inter_token_seconds: float
    tau: float | None = None
    overhead_fraction: float | None = None
    tokens: list[int] = field(default_factory=list, repr=False)
    drafted: int = 0  # draft tokens proposed (tree levels for a tree; this project's loop only)
    accepted: int = 0  # of which accepted
    cycles: int = 0  # draft/verify cycles (this project's loop only)
    verified: int = 0  # tokens sent to the target for verification, summed over cycles
    cycle_seconds: float = 0.0  # seconds inside draft/verify cycles (prefill excluded; this project's loop only)
    accepted_lengths: list[int] = field(default_factory=list, repr=False)  # τ of each cycle that drafted
    peak_memory_bytes: int | None = None  # the process's peak so far (RSS on a CPU, allocated on CUDA)

    @property
    def tokens_per_second(self) -> float:
        return self.new_tokens / self.wall_seconds if self.wall_seconds > 0 else 0.0


class Method:
    """A named way of generating; subclasses implement :meth:`run`."""

    name: str

    def run(self, prompt_ids: torch.Tensor, seed: int) -> RunRecord:  # pragma: no cover - interface
        raise NotImplementedError


@dataclass(frozen=True)
class TreeShape:
    """The shape of an EAGLE-2 draft tree (Li et al. 2024, arXiv 2406.16858): at each depth the
    ``width`` best frontier nodes (by cumulative draft log-probability) get their ``top_k``
    children (:class:`learn2draft.tree.TreeSpeculativeDecoder`'s ``width`` and ``top_k``).

    Raises:
        ValueError: ``width`` or ``top_k`` not an integer ≥ 1.
    """

    width: int = 4
    top_k: int = 4

    def __post_init__(self):
        for name in ("width", "top_k"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"Tree {name} must be an integer ≥ 1, got {v!r} (--{name.replace('_', '-')}).")

    def max_nodes(self, depth: int) -> int:
        """The most drafted nodes a tree of ``depth`` levels holds: k at depth 1, then W·k per level
        (an upper bound: the frontier may hold fewer than W nodes)."""
        return 0 if depth <= 0 else self.top_k + (depth - 1) * self.width * self.top_k


def decoder_max_depth(controller: DraftController) -> int:
    """The ``max_depth`` to build a controller's decoder with: the scale its depth features were
    trained on — ``controller.depth_feature_scale`` when it has one (a learned tree policy with a fixed
    depth drafts fewer levels than that scale, :class:`policies.tree.TreePolicyController`), else
    ``controller.max_depth``."""
    scale = controller.depth_feature_scale
    return int(controller.max_depth if scale is None else scale)


def make_decoder(pair: ModelPair, sampling: SamplingConfig, max_new_tokens: int, max_depth: int,
                 drafter: str | Drafter = "model", head: str | None = None, tree: TreeShape | None = None,
                 sampler: Sampler | None = None, min_ngram: int | None = None) -> SpeculativeDecoder:
    """The one place eval builds a decoder: a chain (:class:`SpeculativeDecoder`) or, with ``tree``,
    a :class:`learn2draft.tree.TreeSpeculativeDecoder` of that shape.

    Args:
        max_depth: the controller's ``max_depth`` (policies' depth features are scaled by it).
        drafter: ``"model" | "head" | "lookup"`` or a :class:`learn2draft.drafters.Drafter` (a new
            one per decoder: drafters hold per-generation state). An autoregressive decoder (``max_depth``
            0, the reference arms) on a pair without a draft model gets the model-free lookup drafter
            instead of ``"model"``: it never drafts.
        head: head directory for ``"head"`` (default: the shipped head of the embedded target).
        sampler: the acceptance rule (chain: :func:`~learn2draft.sampling.speculative_sample`'s
            signature; tree: :func:`~learn2draft.sampling.tree_speculative_sample`'s); None = the exact one.
        min_ngram: prompt lookup's shortest n-gram match for a lookup or hybrid drafter given by name
            (:func:`learn2draft.drafters.make_drafter`); None: the drafter's default.

    Raises:
        ValueError: a tree with the lookup drafter (it drafts no trees), or bad settings.
    """
    if isinstance(drafter, str):
        if tree is not None and drafter == "lookup":
            raise ValueError("The lookup drafter does not draft trees (no draft distribution to take the top-k "
                             "from): use --drafter model or head for trees.")
        if drafter == "model" and max_depth == 0 and tree is None and not pair.has_draft:
            drafter = "lookup"  # a depth-0 decoder never drafts: on a pair without a draft model it needs none
        drafter = make_drafter(drafter, pair, head=head, min_ngram=min_ngram)
    if tree is None:
        kw = {} if sampler is None else {"sampler": sampler}
        return SpeculativeDecoder(pair, sampling, max_new_tokens=max_new_tokens, max_depth=max_depth, drafter=drafter,
                                  **kw)
    from learn2draft.tree import TreeSpeculativeDecoder

    kw = {} if sampler is None else {"tree_sampler": sampler}
    return TreeSpeculativeDecoder(pair, sampling, max_new_tokens=max_new_tokens, max_depth=max_depth, drafter=drafter,
                                  width=tree.width, top_k=tree.top_k, **kw)


class DecoderMethod(Method):
    """This project's draft/verify loop under a controller (γ = 0 is the autoregressive baseline).

    ``drafter``: ``"model" | "head" | "lookup"`` or a :class:`learn2draft.drafters.Drafter`
    (each method gets its own: drafters hold per-generation state); ``head``: the head directory
    for ``"head"`` (default: the shipped head of the embedded target); ``tree``: draft a tree of
    this shape (:func:`make_decoder`) under ``controller`` — a
    :class:`learn2draft.tree.FixedTreeController` (depth, V) or a learned tree policy (depth and
    verification size); a controller that does not decide V verifies every drafted node; ``min_ngram``: prompt
    lookup's shortest n-gram match (:func:`make_decoder`); ``decoder``: run on this backend instead of building one
    from ``pair`` (any :class:`learn2draft.control.CycleDriver`, e.g. the replay backend
    :class:`learn2draft.replay.backend.ReplayDecoder`: :mod:`eval.simreal` predicts with the same method on it;
    ``pair``, ``sampling``, ``max_new_tokens`` and the drafter arguments are then unused).

    Raises:
        ValueError: as :func:`make_decoder`."""

    def __init__(self, name: str, pair: ModelPair | None, controller: DraftController, sampling: SamplingConfig,
                 max_new_tokens: int, drafter: str | Drafter = "model", head: str | None = None,
                 tree: TreeShape | None = None, min_ngram: int | None = None, decoder: CycleDriver | None = None):
        # The decoder's max_depth is the controller's (decoder_max_depth): the depth features are
        # scaled by it, so a policy must see the scale it was trained with.
        self.name, self.controller, self.tree = name, controller, tree
        self.decoder = decoder if decoder is not None else make_decoder(
            pair, sampling, max_new_tokens, decoder_max_depth(controller), drafter, head, tree, min_ngram=min_ngram)

    def run(self, prompt_ids: torch.Tensor, seed: int) -> RunRecord:
        r = self.decoder.generate(prompt_ids, self.controller, seed=seed)
        drafted = sum(c.depth for c in r.cycles)
        return RunRecord(self.name, -1, -1, len(r.tokens), r.wall_seconds, r.ttft_seconds,
                         r.mean_inter_token_seconds, r.mean_accepted if drafted else None,
                         r.overhead_fraction, r.tokens, drafted, sum(c.num_accepted for c in r.cycles),
                         len(r.cycles), sum(c.verify_size for c in r.cycles), sum(c.seconds for c in r.cycles),
                         [c.num_accepted for c in r.cycles if c.depth > 0])


class _TimingStreamer(BaseStreamer):
    """Records when ``generate()`` pushes tokens; the first push is the prompt itself."""

    def __init__(self, clock: DeviceClock):
        self.clock, self.times, self.first = clock, [], True

    def put(self, value):
        if self.first:
            self.first = False
            return
        self.times.append(self.clock.now())

    def end(self):
        pass


class HFGenerateMethod(Method):
    """Hugging Face ``generate()`` with the target, optionally with ``assistant_model=`` (assisted generation).

    Args:
        assistant_config: attributes set on a *copy* of the draft's ``generation_config`` before every
            call (``num_assistant_tokens``, ``num_assistant_tokens_schedule``,
            ``assistant_confidence_threshold``): transformers reads them from the draft and the
            heuristic schedule writes back into it, so each call starts from the same state.
        prompt_lookup_num_tokens: Hugging Face prompt lookup decoding (n-gram candidates from the
            prompt, always this many; no draft model), what a user picks instead of our lookup drafter.
    """

    def __init__(self, name: str, pair: ModelPair, sampling: SamplingConfig, max_new_tokens: int,
                 assistant: bool = False, assistant_config: dict | None = None,
                 prompt_lookup_num_tokens: int | None = None):
        if sampling.prefix_dependent or sampling.min_p:
            raise ValueError("The Hugging Face comparison supports temperature/top-k/top-p only.")
        self.name, self.pair, self.max_new_tokens = name, pair, max_new_tokens
        self.assistant = assistant
        self._base_gc = copy.deepcopy(pair.draft.generation_config)
        self.assistant_config = assistant_config or {}
        self.kwargs = dict(max_new_tokens=max_new_tokens, do_sample=not sampling.greedy,
                           eos_token_id=list(pair.eos_token_ids), pad_token_id=pair.eos_token_ids[0])
        if not sampling.greedy:
            self.kwargs.update(temperature=sampling.temperature, top_k=sampling.top_k or None, top_p=sampling.top_p)
        else:
            self.kwargs.update(temperature=None, top_k=None, top_p=None)
        if prompt_lookup_num_tokens:
            self.kwargs["prompt_lookup_num_tokens"] = int(prompt_lookup_num_tokens)
        self.clock = DeviceClock(pair.device)

    def run(self, prompt_ids: torch.Tensor, seed: int) -> RunRecord:
        kwargs = dict(self.kwargs)
        if self.assistant:
            gc = copy.deepcopy(self._base_gc)
            for k, v in self.assistant_config.items():
                setattr(gc, k, v)
            self.pair.draft.generation_config = gc
            kwargs["assistant_model"] = self.pair.draft
        torch.manual_seed(seed)
        streamer = _TimingStreamer(self.clock)
        t0 = self.clock.now()
        with torch.inference_mode():
            out = self.pair.target.generate(prompt_ids.unsqueeze(0), attention_mask=torch.ones_like(prompt_ids).unsqueeze(0),
                                            streamer=streamer, **kwargs)
        wall = self.clock.now() - t0
        self.pair.draft.generation_config = self._base_gc
        new = out[0, prompt_ids.numel():].tolist()
        ttft = (streamer.times[0] - t0) if streamer.times else wall
        itl = (wall - ttft) / (len(new) - 1) if len(new) > 1 else 0.0
        return RunRecord(self.name, -1, -1, len(new), wall, ttft, itl, None, None, new)


def peak_memory_bytes() -> int:
    """The process's peak memory so far, in bytes: allocated CUDA memory when CUDA is in use
    (``torch.cuda.max_memory_allocated``), else the peak resident set size (``getrusage`` ``ru_maxrss``, KiB on
    Linux). A peak over the process's life, not per run: read it as "memory this comparison needed at most"."""
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        return int(torch.cuda.max_memory_allocated())
    import resource
    import sys

    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(rss if sys.platform == "darwin" else rss * 1024)


def run_interleaved(methods: Sequence[Method], prompts: Sequence[torch.Tensor], repeats: int, seed: int = 0,
                    desc: str = "runs", progress: bool = True, warmup: bool = False) -> list[RunRecord]:
    """Run every method on every prompt ``repeats`` times, rotating the method order per (repeat, prompt).

    All methods get the same seed for a given (repeat, prompt). Returns one :class:`RunRecord` each. With
    ``progress``: a bar on a terminal, one plain line per method and prompt (at most every
    :data:`learn2draft.cli.PROGRESS_INTERVAL_SECONDS`) in a log file (:func:`learn2draft.cli.progress`). With
    ``warmup``: every method first runs once on the first prompt, untimed and unrecorded, so that no method pays
    a one-time cost (first-call kernel selection, lazy imports, allocator growth) inside the measurement.
    """
    if warmup and prompts:
        for m in methods:
            m.run(prompts[0], seed=run_seed(seed, 0, 0))
    records = []
    total = len(methods) * len(prompts) * repeats
    # a bar on a terminal; a log file gets plain lines (learn2draft.cli.progress), never carriage-return frames
    with cli_progress(total=total, desc=desc, unit="runs", enabled=progress) as bar:
        for rep in range(repeats):
            for pi, ids in enumerate(prompts):
                k = (rep * len(prompts) + pi) % len(methods)
                for m in list(methods[k:]) + list(methods[:k]):
                    r = m.run(ids, seed=run_seed(seed, rep, pi))
                    r.prompt_index, r.repeat = pi, rep
                    r.peak_memory_bytes = peak_memory_bytes()
                    records.append(r)
                    bar.set_postfix_str(f"method {m.name}, prompt {pi + 1}/{len(prompts)}"
                                        + (f", repeat {rep + 1}/{repeats}" if repeats > 1 else ""))
                    bar.update(1)
    return records


def summarize(records: Sequence[RunRecord], reference: str | None = None) -> dict[str, dict]:
    """Aggregate per method. tokens/s of a repeat = its new tokens / its wall seconds over all prompts;
    reported as mean and standard deviation over repeats. Ratios to ``reference`` are computed per
    repeat (same prompts and seeds) and reported likewise, with their min and max. Also, over requests
    (generations): TTFT, inter-token and request seconds at p50 / p90 / p99; the histogram of accepted
    lengths τ (entry k = cycles that accepted k drafted tokens; this project's loop only); the peak memory."""
    by = {}
    for r in records:
        by.setdefault(r.method, []).append(r)
    out = {}
    for name, rs in by.items():
        reps = sorted({r.repeat for r in rs})
        tps = np.array([sum(r.new_tokens for r in rs if r.repeat == k) / sum(r.wall_seconds for r in rs if r.repeat == k)
                        for k in reps])
        taus = [r.tau for r in rs if r.tau is not None]
        drafted = sum(r.drafted for r in rs)
        ovh = [r.overhead_fraction for r in rs if r.overhead_fraction is not None]
        out[name] = {
            "tokens_per_second_mean": float(tps.mean()),
            "tokens_per_second_std": float(tps.std(ddof=1)) if len(tps) > 1 else 0.0,
            "tokens_per_second_per_repeat": tps.tolist(),
            "tau_mean": float(np.mean(taus)) if taus else None,
            "alpha": sum(r.accepted for r in rs) / drafted if drafted else None,
            "verify_size_mean": (sum(r.verified for r in rs) / sum(r.cycles for r in rs)
                                 if drafted and sum(r.cycles for r in rs) else None),
            "ttft_seconds_mean": float(np.mean([r.ttft_seconds for r in rs])),
            "inter_token_seconds_mean": float(np.mean([r.inter_token_seconds for r in rs])),
            "overhead_fraction_mean": float(np.mean(ovh)) if ovh else None,
            "new_tokens_total": int(sum(r.new_tokens for r in rs)),
            "runs": len(rs),
            # Percentiles over requests (one generation = one request) and the accepted-length distribution:
            # two workloads with the same mean τ can differ in it.
            "ttft_seconds_percentiles": percentiles([r.ttft_seconds for r in rs]),
            "inter_token_seconds_percentiles": percentiles([r.inter_token_seconds for r in rs]),
            "request_seconds_percentiles": percentiles([r.wall_seconds for r in rs]),
            "accepted_length_histogram": (tau_histogram(t for r in rs for t in r.accepted_lengths)
                                          if any(r.accepted_lengths for r in rs) else []),
            "peak_memory_bytes": max((r.peak_memory_bytes for r in rs if r.peak_memory_bytes is not None),
                                     default=None),
        }
    if reference is not None and reference in out:
        for name in out:
            out[name][f"ratio_to_{reference}"] = ratio_stats(out[name], out[reference])
    return out


def ratio_stats(a: dict, b: dict) -> dict:
    """Per-repeat ratio of tokens/s a / b: mean, std, min, max, and the repeats."""
    ra = np.array(a["tokens_per_second_per_repeat"]) / np.array(b["tokens_per_second_per_repeat"])
    return {"mean": float(ra.mean()), "std": float(ra.std(ddof=1)) if len(ra) > 1 else 0.0,
            "min": float(ra.min()), "max": float(ra.max()), "per_repeat": ra.tolist()}


#: The convention of τ in every table, stated once (:attr:`learn2draft.metrics.CycleResult.num_accepted`).
TAU_NOTE = ("τ: mean accepted length per drafting cycle — draft tokens accepted, the corrected or bonus token "
            "excluded; α: accepted / drafted tokens (for a tree: accepted / drafted levels).")


def _method_cells(m: dict, reference: str) -> str:
    """The cells of one :func:`summarize` entry that :func:`methods_table` and :func:`groups_table` share:
    tokens/s (mean ± std), the ratio to ``reference`` (mean, min–max), τ, α."""
    r = m.get(f"ratio_to_{reference}")
    ratio = "–" if r is None else f"{r['mean']:.2f} ({r['min']:.2f}–{r['max']:.2f})"
    tau = "–" if m["tau_mean"] is None else f"{m['tau_mean']:.2f}"
    alpha = "–" if m.get("alpha") is None else f"{m['alpha']:.2f}"
    return f"{m['tokens_per_second_mean']:.1f} ± {m['tokens_per_second_std']:.1f} | {ratio} | {tau} | {alpha}"


def _request_cells(m: dict) -> str:
    """The per-request cells that :func:`requests_table` and :func:`groups_table` share: TTFT, inter-token and
    request latency at p50/p90/p99 and the accepted-length histogram ("τ: cycles")."""

    def pct(p: dict | None, scale: float, fmt: str) -> str:  # None: a summary written before percentiles existed
        return "–" if not p or p["p50"] is None else "/".join(format(scale * p[k], fmt) for k in ("p50", "p90", "p99"))

    hist = m.get("accepted_length_histogram") or []
    h = ", ".join(f"{k}: {c}" for k, c in enumerate(hist) if c) or "–"
    return (f"{pct(m.get('ttft_seconds_percentiles'), 1e3, '.0f')} | "
            f"{pct(m.get('inter_token_seconds_percentiles'), 1e3, '.1f')} | "
            f"{pct(m.get('request_seconds_percentiles'), 1.0, '.2f')} | {h}")


def methods_table(summary: dict, reference: str) -> list[str]:
    """The markdown table of :func:`summarize` output that eval and eval.benchmark both print: per
    method tokens/s (mean ± std), the per-repeat ratio to ``reference`` (mean, min–max), τ, α, TTFT,
    inter-token latency and loop overhead, followed by :data:`TAU_NOTE`. Returns its lines."""
    lines = [f"| method | tokens/s (mean ± std) | × {reference} (min–max) | τ | α | TTFT ms | inter-token ms | "
             "loop overhead |",
             "|---|---|---|---|---|---|---|---|"]
    for name, m in summary.items():
        ovh = "–" if m["overhead_fraction_mean"] is None else f"{100 * m['overhead_fraction_mean']:.1f}%"
        lines.append(f"| {name} | {_method_cells(m, reference)} | "
                     f"{1e3 * m['ttft_seconds_mean']:.0f} | {1e3 * m['inter_token_seconds_mean']:.1f} | {ovh} |")
    return [*lines, "", TAU_NOTE]


def requests_table(summary: dict) -> list[str]:
    """The per-request markdown table that follows :func:`methods_table` in eval and eval.benchmark: TTFT,
    inter-token latency and request latency at p50 / p90 / p99 over the method's generations, the
    accepted-length histogram ("τ=k: cycles") and the peak memory. Returns its lines."""
    lines = ["| requests of method | TTFT ms p50/p90/p99 | inter-token ms p50/p90/p99 | request s p50/p90/p99 | "
             "τ histogram (τ: cycles) | peak memory MiB |",
             "|---|---|---|---|---|---|"]
    for name, m in summary.items():
        mem = "–" if m.get("peak_memory_bytes") is None else f"{m['peak_memory_bytes'] / 2**20:.0f}"
        lines.append(f"| {name} | {_request_cells(m)} | {mem} |")
    return lines


def prompt_groupings(prompts: Sequence) -> dict[str, dict[str, list[int]]]:
    """The groupings of a prompt list to report separately: ``{"category": {category: [prompt index, …]},
    "language": {language: […]}}`` from :class:`learn2draft.prompts.Prompt` records, each grouping kept only
    when the prompts hold at least two distinct values of it (one value: the whole mix says it all)."""
    out: dict[str, dict[str, list[int]]] = {}
    for key in ("category", "language"):
        groups: dict[str, list[int]] = {}
        for i, p in enumerate(prompts):
            groups.setdefault(getattr(p, key), []).append(i)
        if len(groups) > 1:
            out[key] = groups
    return out


def summarize_groups(records: Sequence[RunRecord], groups: dict[str, Sequence[int]],
                     reference: str | None = None) -> dict[str, dict[str, dict]]:
    """:func:`summarize` over the records of each group of prompts: ``{group: {method: summary}}``; ``groups``
    maps a group name to prompt indices (:attr:`RunRecord.prompt_index`, e.g. one grouping of
    :func:`prompt_groupings`). Ratios to ``reference`` are per repeat within the group; methods keep the order of
    their first record; a group whose prompts have no record is left out."""
    order = list(dict.fromkeys(r.method for r in records))  # the whole run's method order, in every group
    out = {}
    for name, idx in groups.items():
        keep = set(idx)
        rs = [r for r in records if r.prompt_index in keep]
        if rs:
            s = summarize(rs, reference)
            out[name] = {m: s[m] for m in order if m in s}
    return out


def groups_table(by_group: dict[str, dict[str, dict]], reference: str, key: str = "category") -> list[str]:
    """The markdown table of :func:`summarize_groups` output: one row per (group, method) with tokens/s, the
    ratio to ``reference``, τ, α, TTFT / inter-token / request latency at p50/p90/p99 and the accepted-length
    histogram; ``key`` names the grouping in the header (``"category"``, ``"language"``). Returns its lines."""
    lines = [f"| {key} | method | tokens/s (mean ± std) | × {reference} (min–max) | τ | α | TTFT ms p50/p90/p99 | "
             "inter-token ms p50/p90/p99 | request s p50/p90/p99 | τ histogram (τ: cycles) |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for group, summary in by_group.items():
        for name, m in summary.items():
            lines.append(f"| {group} | {name} | {_method_cells(m, reference)} | {_request_cells(m)} |")
    return lines


def verdict(r: dict) -> str:
    """Plain words for a ratio: 'faster' only when every repeat was faster, 'slower' only when
    every repeat was slower, else 'no clear difference'."""
    if r["min"] > 1.0:
        return "faster in every repeat"
    if r["max"] < 1.0:
        return "slower in every repeat"
    return "no clear difference (repeats disagree)"


def encode_all(pair: ModelPair, prompts: Sequence[str], max_new_tokens: int) -> list[torch.Tensor]:
    """Tokenise prompts with the chat template.

    Raises:
        ValueError: an empty or too long prompt (the message says which prompt, by number and opening words).
    """
    out = []
    for i, p in enumerate(prompts):
        try:
            out.append(pair.encode_prompt(p, max_new_tokens=max_new_tokens))
        except ValueError as e:
            raise ValueError(f"prompt {i + 1} of {len(prompts)} ({p[:40]!r}…): {e}") from None
    return out
