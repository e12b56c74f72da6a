"""Learned policy vs. the best fixed γ: grid search, held-out comparison, report.

Protocol (issue #2):
1. grid-search a fixed γ over ``gammas`` on the *training* prompts → γ_train;
2. grid-search again on the *held-out* prompts → γ_hindsight, the strongest fixed baseline
   (chosen on the very prompts it is scored on, so it is optimistic by construction);
3. on the held-out prompts, with the same seeds and interleaved order, run autoregressive,
   fixed γ_train, fixed γ_hindsight and the learned policy, ``repeats`` times;
4. report tokens/s (mean ± std over repeats), speed ratios per repeat, τ, and a plain verdict.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from eval.runner import DecoderMethod, RunRecord, methods_table, ratio_stats, run_interleaved, summarize, verdict
from learn2draft.decoding import DraftController, FixedDepthController
from learn2draft.models import ModelPair
from learn2draft.sampling import SamplingConfig

AR = "autoregressive"


def grid_search(pair: ModelPair, prompts: Sequence[torch.Tensor], gammas: Sequence[int], sampling: SamplingConfig,
                max_new_tokens: int, repeats: int = 1, seed: int = 0, desc: str = "γ grid",
                drafter: str = "model", head: str | None = None) -> dict:
    """Measure tokens/s of every fixed γ on ``prompts`` (interleaved) with ``drafter``; return
    ``{"best_gamma": int, "tokens_per_second": {γ: mean tokens/s}, "tau": {γ: mean τ}}``."""
    methods = [DecoderMethod(f"gamma={g}", pair, FixedDepthController(g), sampling, max_new_tokens, drafter, head)
               for g in gammas]
    summary = summarize(run_interleaved(methods, prompts, repeats, seed, desc=desc))
    tps = {g: summary[f"gamma={g}"]["tokens_per_second_mean"] for g in gammas}
    return {"best_gamma": max(tps, key=tps.get), "tokens_per_second": tps,
            "tau": {g: summary[f"gamma={g}"]["tau_mean"] for g in gammas}}


def compare(pair: ModelPair, policy: DraftController, train_prompts: Sequence[torch.Tensor],
            heldout_prompts: Sequence[torch.Tensor], sampling: SamplingConfig, max_new_tokens: int,
            gammas: Sequence[int] = tuple(range(1, 13)), repeats: int = 3, seed: int = 0,
            policy_name: str = "learned policy", drafter: str = "model", head: str | None = None) -> dict:
    """Run the whole protocol of this module with ``drafter`` (``"model" | "head" | "lookup"``) for
    every drafting method; returns a JSON-serialisable dict (see :func:`format_markdown`)."""
    grid_train = grid_search(pair, train_prompts, gammas, sampling, max_new_tokens, seed=seed, desc="γ grid (train)",
                             drafter=drafter, head=head)
    grid_held = grid_search(pair, heldout_prompts, gammas, sampling, max_new_tokens, seed=seed + 7,
                            desc="γ grid (held-out)", drafter=drafter, head=head)
    g_train, g_hind = grid_train["best_gamma"], grid_held["best_gamma"]
    names = {"train": f"fixed γ={g_train} (chosen on train)", "hind": f"fixed γ={g_hind} (best in hindsight)"}
    if g_train == g_hind:
        names["hind"] = names["train"] = f"fixed γ={g_train} (chosen on train = best in hindsight)"
    methods = [DecoderMethod(AR, pair, FixedDepthController(0), sampling, max_new_tokens)]
    methods.append(DecoderMethod(names["train"], pair, FixedDepthController(g_train), sampling, max_new_tokens, drafter,
                                 head))
    if g_hind != g_train:
        methods.append(DecoderMethod(names["hind"], pair, FixedDepthController(g_hind), sampling, max_new_tokens,
                                     drafter, head))
    methods.append(DecoderMethod(policy_name, pair, policy, sampling, max_new_tokens, drafter, head))
    records: list[RunRecord] = run_interleaved(methods, heldout_prompts, repeats, seed + 100, desc="comparison")
    summary = summarize(records, reference=AR)
    learned = summary[policy_name]
    verdicts = {}
    for key in ("train", "hind"):
        r = ratio_stats(learned, summary[names[key]])
        learned[f"ratio_to_{names[key]}"] = r
        verdicts[names[key]] = {"ratio": r, "verdict": verdict(r)}
    verdicts[AR] = {"ratio": learned[f"ratio_to_{AR}"], "verdict": verdict(learned[f"ratio_to_{AR}"])}
    return {
        "sampling": sampling.to_dict(), "max_new_tokens": max_new_tokens, "repeats": repeats, "seed": seed,
        "num_train_prompts": len(train_prompts), "num_heldout_prompts": len(heldout_prompts),
        "grid_train": grid_train, "grid_heldout": grid_held, "gamma_train": g_train, "gamma_hindsight": g_hind,
        "methods": summary, "policy": policy_name, "verdicts": verdicts, "drafter": drafter,
    }


def format_markdown(res: dict) -> str:
    """The comparison as a markdown table plus one plain sentence per fixed baseline."""
    lines = [
        f"Held-out prompts: {res['num_heldout_prompts']}, repeats: {res['repeats']}, max_new_tokens: "
        f"{res['max_new_tokens']}, sampling: {_sampling_str(res['sampling'])}, drafter: {res.get('drafter', 'model')}",
        "",
        *methods_table(res["methods"], AR),
    ]
    lines += ["", "γ grid on train prompts (tokens/s): " + ", ".join(
        f"{g}: {v:.1f}" for g, v in res["grid_train"]["tokens_per_second"].items()),
        "γ grid on held-out prompts (tokens/s): " + ", ".join(
        f"{g}: {v:.1f}" for g, v in res["grid_heldout"]["tokens_per_second"].items()), ""]
    for base, v in res["verdicts"].items():
        r = v["ratio"]
        lines.append(f"- {res['policy']} vs {base}: ×{r['mean']:.3f} (per-repeat {r['min']:.3f}–{r['max']:.3f}) → "
                     f"{v['verdict']}.")
    return "\n".join(lines)


def _sampling_str(s: dict) -> str:
    if s["temperature"] == 0:
        return "greedy (temperature 0)"
    return ", ".join(f"{k}={v}" for k, v in s.items())


def plot(res: dict, path) -> None:
    """Bar chart of tokens/s with std error bars, and the two γ grids, saved as PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(12, 4.5))
    names = list(res["methods"])
    means = [res["methods"][n]["tokens_per_second_mean"] for n in names]
    stds = [res["methods"][n]["tokens_per_second_std"] for n in names]
    a.bar(range(len(names)), means, yerr=stds, capsize=4, color=["#888"] + ["#4a7"] * (len(names) - 2) + ["#c52"])
    a.set_xticks(range(len(names)), [n.replace(" (", "\n(") for n in names], fontsize=8)
    a.set_ylabel("tokens/s (held-out, mean ± std over repeats)")
    a.set_title("Held-out comparison")
    for key, label in (("grid_train", "train prompts"), ("grid_heldout", "held-out prompts")):
        g = res[key]["tokens_per_second"]
        b.plot([int(k) for k in g], list(g.values()), marker="o", label=label)
    b.axhline(res["methods"][AR]["tokens_per_second_mean"], color="#888", ls="--", label="autoregressive")
    b.axhline(res["methods"][res["policy"]]["tokens_per_second_mean"], color="#c52", ls=":", label=res["policy"])
    b.set_xlabel("fixed γ (num_draft_tokens)")
    b.set_ylabel("tokens/s")
    b.set_title("Fixed-γ grid search")
    b.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
