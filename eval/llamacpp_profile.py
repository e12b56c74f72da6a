"""The latency profile of llama.cpp (through ``llama-cpp-python``) in :mod:`learn2draft.replay.latency`'s format, so
that replay training learns llama.cpp's costs: ``learn2draft profile --engine llama.cpp`` (:mod:`eval.profile`) calls
:func:`measure_llamacpp_profile`. The benchmark and the law check through the engine are in :mod:`eval.llamacpp`.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Sequence
from typing import Any

import numpy as np


def _token_stream(llm: Any, length: int) -> list[int]:
    """``length`` token ids of real text (the shipped corpus's prompts, tokenised by the engine), for contexts."""
    from learn2draft.prompts import load_prompt_records

    out: list[int] = []
    for p in load_prompt_records("corpus_train"):
        out += llm.tokenize(p.text.encode("utf-8"), add_bos=False)
        if len(out) >= length:
            break
    return out[:length]


def measure_verify_llamacpp(llm: Any, contexts: Sequence[int], tokens: Sequence[int], repeats: int) -> list[list[float]]:
    """Median seconds of one verification step in llama.cpp: ``Llama.eval`` of n tokens after c cached ones (one
    batched decode, logits for each) and the greedy sample at each of the n positions (what ``Llama.generate``
    does per step), for n in ``tokens`` and c in ``contexts``; sizes interleaved. Returns seconds[c][n]."""
    stream = _token_stream(llm, max(contexts) + max(tokens) + 1)
    if len(stream) < max(contexts) + max(tokens):
        raise ValueError("The shipped corpus is too short for these contexts.")
    llm._sampler = llm._init_sampler(temp=0.0)  # greedy, as Llama.generate builds it at temperature 0
    out = []
    for c in contexts:
        llm.reset()
        llm.eval(stream[:c])
        times: dict[int, list[float]] = {n: [] for n in tokens}
        for _ in range(repeats):
            for n in tokens:
                llm.n_tokens = c
                t0 = time.perf_counter()
                llm.eval(stream[c: c + n])
                for i in range(n):
                    llm.sample(idx=c + i, temp=0.0)
                times[n].append(time.perf_counter() - t0)
        out.append([float(np.median(times[n])) for n in tokens])
    llm._sampler = None
    return out


def measure_draft_llamacpp(draft_factory, llm: Any, contexts: Sequence[int], repeats: int, depth: int) -> list[float]:
    """Median seconds per drafted token of the adapter's proposal (lookup chain, features, one policy call) at
    each context: one :class:`policies.llamacpp.PolicyDraftModel` call on a real history, divided by the tokens it
    drafted (fixed γ = ``depth`` on a history that repeats itself, so the chain is long)."""
    stream = _token_stream(llm, max(contexts) + 1)
    out = []
    for c in contexts:
        half = stream[: c // 2]
        hist = np.asarray((half + half)[:c] or stream[:c], dtype=np.intc)
        ts = []
        for r in range(repeats):
            d = draft_factory()
            d.start(c - 1, 1 << 20)
            t0 = time.perf_counter()
            got = d(hist)
            ts.append((time.perf_counter() - t0) / max(len(got), 1))
        out.append(float(np.median(ts)))
    return out


def measure_llamacpp_profile(model_path: str | None = None, threads: int | None = None,
                             contexts: Sequence[int] = (128, 512, 1024, 2048),
                             tokens: Sequence[int] = tuple(range(1, 18)), repeats: int = 5,
                             policy: str | None = None, name: str | None = None, note: str = "",
                             machine: dict | None = None) -> dict:
    """A latency profile of llama.cpp on this machine (:mod:`learn2draft.replay.latency`'s format, with
    ``"engine": "llama.cpp"``): the verification step at n = 1…17 tokens and several contexts
    (:func:`measure_verify_llamacpp`), the lookup adapter's step (:func:`measure_draft_llamacpp`), and the loop's
    per-cycle overhead (``Llama.generate``'s Python between decodes, the adapter's call), fitted from real greedy
    generations at fixed γ ∈ {0, 2, 4, 8} (those ≤ max(tokens) − 1) as the measured cycle time minus the tables' verification. ``machine``: the
    profile's machine entry (``eval.profile.machine_info``).

    Raises:
        ImportError: llama-cpp-python is missing; ValueError: bad sizes.
    """
    from policies.llamacpp import PolicyDraftModel, generate_tokens, load_llama

    contexts, tokens = sorted(set(int(c) for c in contexts)), sorted(set(int(n) for n in tokens))
    if not contexts or contexts[0] < 16 or not tokens or tokens[0] != 1 or repeats < 1:
        raise ValueError("Need contexts ≥ 16, token counts starting at 1 and repeats ≥ 1.")
    n_ctx = max(4096, max(contexts) + max(tokens) + 64)
    llm = load_llama(model_path, n_ctx=n_ctx, threads=threads)
    verify = measure_verify_llamacpp(llm, contexts, tokens, repeats)
    min_ngram = 1
    if policy is not None:
        from policies.load import run_settings

        min_ngram = int(run_settings(policy).get("lookup_min_ngram") or 2)
    step = measure_draft_llamacpp(lambda: PolicyDraftModel(num_pred_tokens=16, min_ngram=min_ngram), llm, contexts,
                                  repeats, 16)
    from learn2draft.replay.latency import LatencyProfile

    partial = LatencyProfile.from_dict(_profile_dict(contexts, tokens, verify, step, 0.0, 0.0, name or "llama.cpp",
                                                     "", {}, model_path))
    # overheads: real generations at fixed γ, cycle seconds − verify(d+1, c) − d·step(c)
    from learn2draft.prompts import load_prompt_records

    rows = []
    gammas = [g for g in (0, 2, 4, 8) if g + 1 <= max(tokens)]  # depths whose verification the table prices
    for prompt in load_prompt_records("corpus_train")[:3]:
        ids = llm.tokenize(prompt.text.encode("utf-8"), add_bos=False)[: max(contexts)]
        for g in gammas:
            d = PolicyDraftModel(num_pred_tokens=g, min_ngram=min_ngram)
            llm.draft_model = d
            gen = generate_tokens(llm, ids, 48, 0.0, draft_model=d)
            for c in gen.cycles[1:-1]:
                if c.seconds is None:
                    continue
                pred = float(partial.verify(c.depth + 1, c.context)) + c.depth * float(partial.draft_step("lookup", c.context))
                rows.append((c.depth, c.seconds + c.decide_seconds - pred))
    llm.draft_model = None
    A = np.array([[1.0, d] for d, _ in rows])
    y = np.array([r for _, r in rows])
    (cycle_fit, step_fit), *_ = np.linalg.lstsq(A, y, rcond=None)
    # the format's costs are ≥ 0; a negative term means the tables already hold that time (kept in the source)
    cycle_ovh, step_ovh = max(float(cycle_fit), 0.0), max(float(step_fit), 0.0)
    print(f"eval.llamacpp: verify ms at c={contexts[0]}: {[round(1e3 * x, 2) for x in verify[0]]}; step ms "
          f"{[round(1e3 * x, 3) for x in step]}; overhead fit (ms) cycle {1e3 * cycle_fit:.3f}, per token "
          f"{1e3 * step_fit:.3f} over {len(rows)} cycles", file=sys.stderr)
    machine = dict(machine or {})
    machine["threads"] = threads
    import llama_cpp

    machine["llama_cpp_python"] = getattr(llama_cpp, "__version__", "?")
    return _profile_dict(contexts, tokens, verify, step, float(cycle_ovh), float(step_ovh), name or "llama.cpp",
                         "llama.cpp through llama-cpp-python: Llama.eval of n tokens after c cached plus the greedy "
                         f"sample at each position (median of {repeats}); the lookup adapter's step; overheads fitted "
                         f"on {len(rows)} cycles of real greedy generations at fixed γ 0/2/4/8 (fit: cycle "
                         f"{1e3 * cycle_fit:.3f} ms, per token {1e3 * step_fit:.3f} ms; negative terms stored as 0). "
                         f"{note}".strip(),
                         machine, model_path)


def _profile_dict(contexts, tokens, verify, step, cycle_ovh, step_ovh, name, source, machine, model_path) -> dict:
    from learn2draft.models import SMOLLM2_GGUF

    return {"format": "learn2draft-profile", "format_version": 1, "name": name, "engine": "llama.cpp",
            "source": source, "machine": machine, "target": str(model_path or SMOLLM2_GGUF), "draft": "prompt lookup",
            "verify": {"tokens": list(tokens), "contexts": list(contexts), "seconds": verify},
            "drafters": {"lookup": {"step_seconds": {"contexts": list(contexts), "seconds": step},
                                    "step_overhead_seconds": step_ovh, "cycle_overhead_seconds": cycle_ovh}}}


__all__ = ["measure_draft_llamacpp", "measure_llamacpp_profile", "measure_verify_llamacpp"]
