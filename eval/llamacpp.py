"""llama.cpp (through ``llama-cpp-python``) measured the way the rest of ``eval`` measures this project's own loop:

* the latency profile of llama.cpp's own costs (``learn2draft profile --engine llama.cpp``) is measured by
  :mod:`eval.llamacpp_profile`;
* :class:`LlamaMethod` — a benchmark method (``eval.runner.Method``): plain llama.cpp, its
  ``LlamaPromptLookupDecoding`` at a fixed ``num_pred_tokens``, or a :class:`policies.llamacpp.PolicyDraftModel`;
* :func:`run_benchmark` — ``learn2draft benchmark --engine llama.cpp``: those side by side on the same prompts,
  interleaved, the fixed ``num_pred_tokens`` chosen on the validation prompts and the best in hindsight on the test
  prompts, per category, with the verdicts of :data:`LLAMACPP_CLAIMS` and the greedy-equality count;
* :func:`law_check_llamacpp` — the statistical law check through the engine (first k tokens, plain against
  speculative, a chi-square test per position, :func:`eval.law.two_sample_test`).

Tokens/s here is the decode phase's: tokens after the first / seconds after the first token. The prefill is timed
apart (TTFT): with a draft model the binding computes logits for every prompt token (``logits_all``), plain llama.cpp
does not, so their TTFTs differ for a reason that has nothing to do with drafting.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from eval.runner import Method, RunRecord
from eval.verdicts import Claim

PLAIN = "llama.cpp plain"
LEARNED = "llama.cpp + learned policy"
HF_GENERATE = "hf generate (this project's HF loop, for reference)"
#: llama.cpp prompt lookup's num_pred_tokens grid (its README suggests 2 for CPU-only, 10 for GPU).
PL_GRID = (1, 2, 3, 4, 6, 8, 10, 12, 16)

#: Issue 40's goals for llama.cpp.
LLAMACPP_CLAIMS: tuple[Claim, ...] = (
    Claim("learned ≥ 1.10× llama.cpp's best fixed num_pred_tokens in hindsight", "learned", "best_fixed", 1.10),
    Claim("learned ≥ 1.00× plain llama.cpp on every category", "learned", "generate", 1.00, scope="every_category"),
    Claim("learned ≥ 1.00× num_pred_tokens chosen on validation, every category", "learned", "chosen_fixed", 1.00,
          scope="every_category"),
)


def pl_arm_name(num_pred_tokens: int) -> str:
    """The benchmark's name of llama.cpp prompt lookup at a fixed ``num_pred_tokens``."""
    return f"llama.cpp prompt lookup ({num_pred_tokens})"


class RecordingDraftModel:
    """Wrap a ``LlamaDraftModel`` (e.g. the binding's ``LlamaPromptLookupDecoding``) to count its cycles: drafted
    tokens and the accepted length τ inferred from the history, as :class:`policies.llamacpp.PolicyDraftModel` does.
    The wrapper's cost (one comparison of the history per call) is charged to the arm it wraps."""

    def __init__(self, inner: Any):
        self.inner = inner
        self.cycles: list[tuple[int, int | None]] = []  # (depth, τ)
        self._last: np.ndarray | None = None
        self._proposal = np.zeros(0, dtype=np.int64)

    def start(self, prompt_len: int, max_new_tokens: int | None = None) -> None:
        self.cycles, self._last = [], None

    def _observe(self, ids: np.ndarray) -> None:
        if self._last is None or not self.cycles:
            return
        from policies.llamacpp import kept_drafts

        self.cycles[-1] = (self.cycles[-1][0], kept_drafts(ids[self._last.size:], self._proposal))

    def finish(self, history) -> None:
        self._observe(np.asarray(history, dtype=np.int64))

    def __call__(self, input_ids: np.ndarray, /, **kwargs: Any) -> np.ndarray:
        ids = np.asarray(input_ids, dtype=np.int64)
        self._observe(ids)
        out = self.inner(input_ids, **kwargs)
        self._last, self._proposal = ids.copy(), np.asarray(out, dtype=np.int64)
        self.cycles.append((int(self._proposal.size), None))
        return out


def cycle_counts(draft: Any) -> tuple[int, int, int, list[int]]:
    """``(drafted, accepted, cycles, τ of each cycle that drafted)`` of a recording draft model's last generation."""
    from policies.llamacpp import PolicyDraftModel

    if isinstance(draft, PolicyDraftModel):
        pairs = [(c.depth, c.accepted) for c in draft.cycles]
    elif isinstance(draft, RecordingDraftModel):
        pairs = list(draft.cycles)
    else:
        return 0, 0, 0, []
    done = [(d, a) for d, a in pairs if a is not None]
    return (sum(d for d, _ in done), sum(a for _, a in done), len(done), [a for d, a in done if d > 0])


class LlamaMethod(Method):
    """One benchmark arm on llama.cpp: ``llm`` (from :func:`policies.llamacpp.load_llama`) with ``draft`` installed
    as its draft model for the call (None: plain decoding; use an instance built without a draft model, so that its
    prefill does not compute every prompt token's logits).

    :class:`eval.runner.RunRecord`'s fields: ``new_tokens`` are the tokens after the first, ``wall_seconds`` the
    seconds after the first token (the decode phase), ``ttft_seconds`` the prefill and first token apart.
    """

    def __init__(self, name: str, llm: Any, draft: Any, temperature: float, max_new_tokens: int):
        self.name, self.llm, self.draft = name, llm, draft
        self.temperature, self.max_new_tokens = float(temperature), int(max_new_tokens)

    def run(self, prompt_ids, seed: int) -> RunRecord:
        from policies.llamacpp import generate_tokens

        ids = [int(t) for t in (prompt_ids.tolist() if hasattr(prompt_ids, "tolist") else prompt_ids)]
        self.llm.draft_model = self.draft
        gen = generate_tokens(self.llm, ids, self.max_new_tokens, self.temperature, seed=seed, draft_model=self.draft)
        drafted, accepted, cycles, taus = cycle_counts(self.draft)
        decode = max(gen.seconds - gen.ttft_seconds, 1e-9)
        n = max(len(gen.tokens) - 1, 0)
        return RunRecord(self.name, -1, -1, n, decode, gen.ttft_seconds, decode / n if n else 0.0,
                         (sum(taus) / len(taus)) if taus else None, None, gen.tokens, drafted, accepted, cycles,
                         drafted + cycles, decode, taus)


# ---------------------------------------------------------------------------------------------------- benchmark
class DecodePhase(Method):
    """Another method's records on llama.cpp's scale: tokens after the first over seconds after the first token
    (the reference row of this project's Hugging Face ``generate()``)."""

    def __init__(self, inner: Method, name: str):
        self.inner, self.name = inner, name

    def run(self, prompt_ids, seed: int) -> RunRecord:
        r = self.inner.run(prompt_ids, seed)
        r.method = self.name
        r.new_tokens = max(r.new_tokens - 1, 0)
        r.wall_seconds = max(r.wall_seconds - r.ttft_seconds, 1e-9)
        return r


def _greedy_equal(records: Sequence[RunRecord], method: str, reference: str = PLAIN) -> dict:
    """How many (prompt, repeat) generations of ``method`` equal ``reference``'s token for token."""
    ref = {(r.prompt_index, r.repeat): r.tokens for r in records if r.method == reference}
    mine = [(r.prompt_index, r.repeat, r.tokens) for r in records if r.method == method]
    same = sum(ref.get((p, k)) == t for p, k, t in mine)
    first = sorted(p for p, k, t in mine if ref.get((p, k)) != t)
    return {"equal": same, "of": len(mine), "differing_prompts": sorted(set(first))}


def run_benchmark(args, temps: list[float], gammas: list[int], out: Path, val_split: str, held_split: str,
                  machine: str) -> int:
    """``learn2draft benchmark --engine llama.cpp`` (settings already checked by :mod:`eval.benchmark`).

    Arms, on the same prompts and seeds, interleaved, after a warm-up: plain llama.cpp; its prompt lookup
    (``LlamaPromptLookupDecoding``, ``max_ngram_size`` 2) at every ``num_pred_tokens`` of ``gammas`` — measured on the
    validation prompts to choose one, and again on the test prompts (all, or the ``--test-arms`` fastest plus the
    chosen one) for the best in hindsight; the learned policy (:class:`policies.llamacpp.PolicyDraftModel`); and this
    project's Hugging Face ``generate()`` for reference (``--no-hf-reference`` drops it). Writes benchmark.md,
    benchmark.json and benchmark.png in ``out`` (created by the caller); ``val_split`` and ``held_split`` are the
    shipped splits measured, ``machine`` the line naming the machine.
    """
    from eval.header import load_average, write_report
    from eval.runner import (
        groups_table,
        methods_table,
        prompt_groupings,
        requests_table,
        run_interleaved,
        summarize,
        summarize_groups,
    )
    from eval.verdicts import evaluate_claims, verdict_lines
    from learn2draft.cli import engine_threads, stderr_line
    from learn2draft.models import DEFAULT_TARGET, encode_text, load_tokenizer
    from learn2draft.prompts import load_prompt_file_records, load_prompt_records
    from policies.layout import default_policy_dir
    from policies.llamacpp import PolicyDraftModel, load_llama, require_llama_cpp

    llama_cpp = require_llama_cpp()
    from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

    policy_dir = Path(args.policy) if args.policy else default_policy_dir("lookup", "llamacpp")
    if not policy_dir.is_dir():
        raise FileNotFoundError(f"--policy {policy_dir}: no such directory.")
    PolicyDraftModel(policy_dir)  # a wrong policy is refused before the models load
    threads = engine_threads(args)
    load_before = load_average()
    tok = load_tokenizer(DEFAULT_TARGET)
    held_records = (load_prompt_file_records(args.prompts) if args.prompts else
                    load_prompt_records(held_split))[: args.num_prompts]
    val_records = load_prompt_records(val_split)[: args.validation_prompts or args.num_prompts]
    import torch

    held = [torch.tensor(encode_text(tok, p.text), dtype=torch.int64) for p in held_records]
    val = [torch.tensor(encode_text(tok, p.text), dtype=torch.int64) for p in val_records]
    n_ctx = max(4096, max(x.numel() for x in held + val) + args.max_new_tokens + 32)
    plain = llama_cpp.Llama(model_path=str(args.gguf or _embedded()), n_ctx=n_ctx, n_threads=threads,
                            n_threads_batch=threads, verbose=False)
    spec = load_llama(args.gguf, n_ctx=n_ctx, threads=threads)
    hf = None
    if args.hf_reference:
        from eval.runner import HFGenerateMethod
        from learn2draft.cli import load_models, model_names, sampling_config, set_threads
        from learn2draft.settings import RunSettings

        target, draft = model_names(args.target, args.draft)
        settings = RunSettings.resolve(device="cpu", dtype=args.dtype, threads=set_threads(args),
                                       depths=(args.gammas,), target=target, draft=draft)
        pair = load_models(settings, "lookup", need_draft=True, progress=stderr_line)
        hf = (pair, HFGenerateMethod, sampling_config)
    report = {"engine": "llama.cpp", "machine": machine, "threads": threads,
              "llama_cpp_python": getattr(llama_cpp, "__version__", "?"), "gguf": str(args.gguf or _embedded()),
              "policy": str(policy_dir), "prompts": args.prompts or held_split, "num_prompts": len(held),
              "validation": {"split": val_split, "prompts": len(val)}, "max_new_tokens": args.max_new_tokens,
              "repeats": args.repeats, "load_average_before": load_before, "runs": {}}
    md = ["# llama.cpp benchmark", "",
          f"Machine: {report['machine']}; llama-cpp-python {report['llama_cpp_python']}, {threads} threads; model "
          f"{report['gguf']}; load average before {load_before}.", "",
          f"Policy: {policy_dir}; prompts: {report['prompts']} ({len(held)}), validation {val_split} ({len(val)}); "
          f"{args.max_new_tokens} new tokens, {args.repeats} repeats.", "",
          "Tokens/s over the decode phase (tokens after the first / seconds after the first token); TTFT apart: with a "
          "draft model llama-cpp-python computes logits for every prompt token (logits_all).", ""]
    groups = prompt_groupings(held_records)
    for T in temps:
        pl = {pl_arm_name(g): LlamaMethod(pl_arm_name(g), spec, RecordingDraftModel(
            LlamaPromptLookupDecoding(max_ngram_size=2, num_pred_tokens=g)), T, args.max_new_tokens) for g in gammas}
        vs = summarize(run_interleaved(list(pl.values()), val, 1, args.seed, desc=f"llama.cpp validation T={T}",
                                       warmup=True))
        val_tps = {n: v["tokens_per_second_mean"] for n, v in vs.items()}
        ranked = sorted(val_tps, key=val_tps.get, reverse=True)
        chosen = ranked[0]
        test_arms = ranked[: args.test_arms] if args.test_arms else ranked
        methods = [LlamaMethod(PLAIN, plain, None, T, args.max_new_tokens), *(pl[n] for n in test_arms),
                   LlamaMethod(LEARNED, spec, PolicyDraftModel(policy_dir, max_new_tokens=args.max_new_tokens), T,
                               args.max_new_tokens)]
        if hf is not None:
            pair, HFGenerateMethod, sampling_config = hf
            methods.append(DecodePhase(HFGenerateMethod("hf", pair, sampling_config(args, temperature=T),
                                                        args.max_new_tokens), HF_GENERATE))
        records = run_interleaved(methods, held, args.repeats, args.seed, desc=f"llama.cpp benchmark T={T}",
                                  warmup=True)
        summary = summarize(records, reference=PLAIN)
        by = {key: summarize_groups(records, g, reference=PLAIN) for key, g in groups.items()}
        hindsight = max(test_arms, key=lambda n: summary[n]["tokens_per_second_mean"])
        roles = {"learned": LEARNED, "generate": PLAIN, "autoregressive": PLAIN, "best_fixed": list(test_arms),
                 "chosen_fixed": chosen}
        greedy = {n: _greedy_equal(records, n) for n in [*test_arms, LEARNED]} if T == 0 else None
        report["runs"][str(T)] = {"validation": {"tokens_per_second": val_tps, "chosen": chosen},
                                  "test_arms": test_arms, "best_fixed_in_hindsight": hindsight, "methods": summary,
                                  "groups": by, "roles": roles, "greedy_equal_to_plain": greedy}
        md += [f"## Temperature {T}", "",
               f"num_pred_tokens grid {{{', '.join(map(str, gammas))}}} measured on {len(val)} validation prompts; "
               f"chosen there: **{chosen}** ({val_tps[chosen]:.1f} tok/s); best in hindsight on the test prompts: "
               f"**{hindsight}**.", "", *methods_table(summary, PLAIN), "", *requests_table(summary), ""]
        for key, by_group in by.items():
            md += [f"Per {key} (ratios to {PLAIN} within the {key}):", "", *groups_table(by_group, PLAIN, key), ""]
        if greedy is not None:
            md += ["Greedy output equal to plain llama.cpp's (generations, token for token): "
                   + "; ".join(f"{n} {g['equal']}/{g['of']}" for n, g in greedy.items()), ""]
    runs = {T: {"methods": r["methods"], "categories": r["groups"].get("category"), "copy": None, "roles": r["roles"]}
            for T, r in report["runs"].items()}
    report["verdicts"] = evaluate_claims(runs, claims=LLAMACPP_CLAIMS)
    report["load_average_after"] = load_average()
    md += [f"Load average after: {report['load_average_after']}.", "", "## Verdicts (ratios of tokens/s, decode phase)",
           "", "```", *verdict_lines(report["verdicts"]), "```", ""]
    write_report(out, "benchmark", report, md, plot_llamacpp)
    return 0


def _embedded() -> Path:
    from learn2draft.models import smollm2_gguf_path

    return smollm2_gguf_path()


def plot_llamacpp(report: dict, path) -> None:
    """Bars of decode tokens/s relative to plain llama.cpp (mean, min–max over repeats), one panel per temperature."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = report["runs"]
    fig, axes = plt.subplots(1, len(runs), figsize=(6 * len(runs), 4.8), squeeze=False)
    for ax, (T, run) in zip(axes[0], runs.items()):
        names = list(run["methods"])
        r = [run["methods"][n][f"ratio_to_{PLAIN}"] for n in names]
        means = np.array([x["mean"] for x in r])
        err = np.array([[m - x["min"] for m, x in zip(means, r)], [x["max"] - m for m, x in zip(means, r)]])
        ax.barh(range(len(names)), means, xerr=err, capsize=3,
                color=["#c52" if n == LEARNED else "#888" if n.startswith("hf") else "#4a7" for n in names])
        ax.set_yticks(range(len(names)), names, fontsize=8)
        ax.invert_yaxis()
        ax.axvline(1.0, color="k", lw=0.8, ls="--")
        ax.set_xlabel("decode tokens/s × plain llama.cpp")
        ax.set_title(f"llama.cpp, temperature {T}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# ---------------------------------------------------------------------------------------------------- the law
def law_check_llamacpp(draft_factory, prompts: Sequence[Sequence[int]], temperature: float = 0.7, num_tokens: int = 4,
                       num_samples: int = 400, seed: int = 0, alpha: float = 0.01, model_path: str | None = None,
                       threads: int | None = None) -> dict:
    """The output law through llama.cpp: draw the first ``num_tokens`` tokens ``num_samples`` times per prompt with
    plain llama.cpp and with llama.cpp + ``draft_factory()`` (a fresh draft model), different seeds per draw, and
    compare the two samples position by position with a chi-square test on the token counts
    (:func:`eval.law.two_sample_test`), Bonferroni-corrected over every test at level ``alpha``.

    Returns:
        ``{"pass": bool, "min_p": float, "tests": [...], "drafted": int, "accepted": int, ...}``; ``drafted`` > 0
        shows the speculative path ran (a check where nothing was drafted proves nothing).
    """
    from eval.law import ENDED, two_sample_test
    from policies.llamacpp import generate_tokens, load_llama

    n_ctx = max(256, max(len(p) for p in prompts) + num_tokens + 32)  # small: logits_all keeps n_ctx × V scores
    plain = load_llama(model_path, threads=threads, n_ctx=n_ctx)
    spec = load_llama(model_path, threads=threads, n_ctx=n_ctx)
    tests, drafted, accepted = [], 0, 0
    for pi, ids in enumerate(prompts):
        ids = [int(t) for t in ids]
        samples = {"plain": [], "spec": []}
        for s in range(num_samples):
            for arm, llm in (("plain", plain), ("spec", spec)):
                d = draft_factory() if arm == "spec" else None
                llm.draft_model = d
                gen = generate_tokens(llm, ids, num_tokens, temperature, seed=1 + seed * 1_000_003 + pi * 10_007 + s,
                                      draft_model=d, reuse_prompt_cache=True)
                toks = gen.tokens[:num_tokens]
                samples[arm].append(toks + [ENDED] * (num_tokens - len(toks)))
                if d is not None:
                    dr, ac, _, _ = cycle_counts(d)
                    drafted, accepted = drafted + dr, accepted + ac
        for k in range(num_tokens):
            t = two_sample_test([x[k] for x in samples["plain"]], [x[k] for x in samples["spec"]])
            tests.append({"prompt": pi, "position": k + 1, **t})
    ps = [t["p_value"] for t in tests if t.get("p_value") is not None]
    min_p = min(ps) if ps else 1.0
    return {"pass": bool(min_p >= alpha / max(len(ps), 1)), "min_p": float(min_p), "bonferroni_alpha": alpha,
            "tests": tests, "drafted": drafted, "accepted": accepted, "num_samples": num_samples,
            "temperature": temperature, "num_tokens": num_tokens}


__all__ = ["DecodePhase", "run_benchmark", "HF_GENERATE", "LEARNED", "LLAMACPP_CLAIMS", "LlamaMethod", "PLAIN", "PL_GRID", "RecordingDraftModel",
           "cycle_counts", "law_check_llamacpp", "pl_arm_name"]
