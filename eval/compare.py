"""Learned policy vs. the best fixed γ (and, with trees, the best fixed (depth, V)): grid search,
held-out comparison, report.

Protocol (issue #2; trees: issue #8, item 5):
1. grid-search a fixed γ over ``gammas`` on the *training* prompts → γ_train;
2. grid-search again on the *held-out* prompts → γ_hindsight, the strongest fixed baseline
   (chosen on the very prompts it is scored on, so it is optimistic by construction);
3. with a :class:`~eval.runner.TreeShape`: grid-search a fixed tree (depth, V) over
   ``tree_configs`` on the *training* prompts → (depth, V)_train;
4. on the held-out prompts, with the same seeds and interleaved order, run autoregressive,
   fixed γ_train, fixed γ_hindsight, the learned (chain) policy and, with trees, the fixed tree
   (depth, V)_train and the learned tree policy, ``repeats`` times;
5. report tokens/s (mean ± std over repeats), speed ratios per repeat, τ, and a plain verdict.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import torch

from eval.header import sampling_text
from eval.runner import (
    DecoderMethod,
    RunRecord,
    TreeShape,
    groups_table,
    methods_table,
    ratio_stats,
    requests_table,
    run_interleaved,
    summarize,
    summarize_groups,
    verdict,
)
from learn2draft.decoding import DraftController, FixedDepthController
from learn2draft.models import ModelPair
from learn2draft.sampling import SamplingConfig

AR = "autoregressive"


def tree_key(depth: int, verify_size: int) -> str:
    """The grid's name of a fixed tree: ``"depth=3,V=8"`` (JSON keys are strings)."""
    return f"depth={depth},V={verify_size}"


def tree_configs(depths: Sequence[int], verify_sizes: Sequence[int], tree: TreeShape) -> list[tuple[int, int]]:
    """The (depth, V) grid of fixed trees: every depth × every V, with V clipped to the most nodes
    a tree of that depth holds (:meth:`TreeShape.max_nodes`; a larger V verifies the same tree) and
    duplicates dropped, sorted.

    Raises:
        ValueError: no depth or V, or one < 1.
    """
    if not depths or not verify_sizes or min(depths) < 1 or min(verify_sizes) < 1:
        raise ValueError(f"A tree grid needs depths ≥ 1 and verification sizes ≥ 1, got {list(depths)} × "
                         f"{list(verify_sizes)} (--tree-depths, --verify-sizes).")
    return sorted({(int(d), min(int(v), tree.max_nodes(int(d)))) for d in depths for v in verify_sizes})


def shipped_tree_policy_dir(drafter: str) -> Path | None:
    """The tree policy shipped for ``drafter`` (:func:`policies.layout.default_tree_policy_dir`,
    ``policies/defaults/<drafter>-tree``), or None when none is shipped."""
    from policies.layout import default_tree_policy_dir

    try:
        return default_tree_policy_dir(drafter)
    except FileNotFoundError:
        return None


def load_learned_tree(directory: str | Path, drafter: str) -> tuple[DraftController, dict]:
    """Load a learned tree policy (depth and verification size) with
    :func:`policies.load.load_tree_policy` and read what it was trained with.

    Returns:
        ``(controller, settings)``: a controller with ``decide`` and
        ``verification_size``; settings: the policy's recorded tree settings
        (:func:`policies.load.tree_settings`, else the run's or export's settings; ``{}`` when none),
        with the controller's ``width``/``top_k`` when it has them (see :func:`tree_shape_from`).

    Raises:
        FileNotFoundError: no such directory, or no tree policy in it.
        ValueError: a controller that does not decide the verification size, or a policy trained
            with another drafter.
    """
    from learn2draft.tree import decides_verification_size

    directory = Path(directory)
    if not directory.is_dir():
        raise FileNotFoundError(f"--tree-policy {directory}: no such directory (train one with "
                                "`python -m train --tree`).")
    import policies.load as load  # looked up on the module when called (tests replace load_tree_policy)

    ctrl = load.load_tree_policy(directory)
    if not decides_verification_size(ctrl):
        raise ValueError(f"--tree-policy {directory}: the loaded controller does not decide the verification size "
                         "(no verification_size method): it is a chain policy, pass it as --policy.")
    settings: dict = {}
    for read in (load.tree_settings, load.run_settings):
        try:
            settings = dict(read(directory))
            break
        except (FileNotFoundError, ValueError):
            continue
    for name in ("width", "top_k"):
        if getattr(ctrl, name, None) is not None:
            settings[name] = int(getattr(ctrl, name))
    trained = settings.get("drafter")
    if trained and trained != drafter:
        raise ValueError(f"The tree policy in {directory} was trained with the {trained!r} drafter, not {drafter!r}: "
                         f"its features mean other things. Pass --drafter {trained} or another --tree-policy.")
    return ctrl, settings


def tree_shape_from(settings: dict, width: int | None = None, top_k: int | None = None) -> TreeShape:
    """The tree shape to draft with: ``width``/``top_k`` when given (the command line), else the
    ones a tree policy recorded (``width``/``top_k``, ``tree_width``/``tree_top_k`` or
    ``tree: {width, top_k}``), else :class:`TreeShape`'s defaults (W = k = 4).

    Raises:
        ValueError: a value < 1.
    """
    nested = settings.get("tree") if isinstance(settings.get("tree"), dict) else {}

    def pick(name, given):
        for v in (given, settings.get(name), settings.get(f"tree_{name}"), nested.get(name)):
            if v is not None:
                return int(v)
        return getattr(TreeShape, name)

    return TreeShape(pick("width", width), pick("top_k", top_k))


def _grid(pair, prompts, controllers: dict, sampling, max_new_tokens, repeats, seed, desc, drafter, head, tree,
          min_ngram: int | None = None):
    methods = [DecoderMethod(name, pair, c, sampling, max_new_tokens, drafter, head, tree=tree, min_ngram=min_ngram)
               for name, c in controllers.items()]
    summary = summarize(run_interleaved(methods, prompts, repeats, seed, desc=desc))
    return ({k: summary[k]["tokens_per_second_mean"] for k in controllers},
            {k: summary[k]["tau_mean"] for k in controllers})


def grid_search(pair: ModelPair, prompts: Sequence[torch.Tensor], gammas: Sequence[int], sampling: SamplingConfig,
                max_new_tokens: int, repeats: int = 1, seed: int = 0, desc: str = "γ grid",
                drafter: str = "model", head: str | None = None, min_ngram: int | None = None) -> dict:
    """Measure tokens/s of every fixed γ on ``prompts`` (interleaved) with ``drafter`` (prompt lookup's shortest match:
    ``min_ngram``, :func:`eval.runner.make_decoder`); return
    ``{"best_gamma": int, "tokens_per_second": {γ: mean tokens/s}, "tau": {γ: mean τ}}``."""
    tps, tau = _grid(pair, prompts, {f"gamma={g}": FixedDepthController(g) for g in gammas}, sampling, max_new_tokens,
                     repeats, seed, desc, drafter, head, None, min_ngram)
    tps = {g: tps[f"gamma={g}"] for g in gammas}
    return {"best_gamma": max(tps, key=tps.get), "tokens_per_second": tps,
            "tau": {g: tau[f"gamma={g}"] for g in gammas}}


def tree_grid_search(pair: ModelPair, prompts: Sequence[torch.Tensor], configs: Sequence[tuple[int, int]],
                     sampling: SamplingConfig, max_new_tokens: int, tree: TreeShape = TreeShape(), repeats: int = 1,
                     seed: int = 0, desc: str = "tree grid", drafter: str = "model", head: str | None = None) -> dict:
    """Measure tokens/s of every fixed tree (depth, V) in ``configs`` (:func:`tree_configs`) on
    ``prompts``, interleaved, with ``drafter`` drafting trees of shape ``tree``
    (:class:`learn2draft.tree.FixedTreeController`).

    Returns:
        ``{"best": [depth, V], "best_key": "depth=d,V=v", "tokens_per_second": {key: mean tokens/s},
        "tau": {key: mean τ}, "width": W, "top_k": k}``.

    Raises:
        ValueError: empty ``configs``, or a drafter without trees (lookup).
    """
    from learn2draft.tree import FixedTreeController

    if not configs:
        raise ValueError("The tree grid is empty: pass at least one (depth, V).")
    ctrls = {tree_key(d, v): FixedTreeController(d, v) for d, v in configs}
    tps, tau = _grid(pair, prompts, ctrls, sampling, max_new_tokens, repeats, seed, desc, drafter, head, tree)
    best = max(tps, key=tps.get)
    return {"best": [ctrls[best].max_depth, ctrls[best].verify_size], "best_key": best, "tokens_per_second": tps,
            "tau": tau, "width": tree.width, "top_k": tree.top_k}


def compare(pair: ModelPair, policy: DraftController, train_prompts: Sequence[torch.Tensor],
            heldout_prompts: Sequence[torch.Tensor], sampling: SamplingConfig, max_new_tokens: int,
            gammas: Sequence[int] = tuple(range(1, 13)), repeats: int = 3, seed: int = 0,
            policy_name: str = "learned policy", drafter: str = "model", head: str | None = None,
            tree: TreeShape | None = None, tree_grid: Sequence[tuple[int, int]] = (),
            tree_policy: DraftController | None = None, tree_policy_name: str = "learned tree",
            groups: dict[str, dict[str, Sequence[int]]] | None = None, min_ngram: int | None = None) -> dict:
    """Run the whole protocol of this module with ``drafter`` (``"model" | "head" | "lookup"``; prompt lookup's
    shortest match ``min_ngram``, :func:`eval.runner.make_decoder`) for every chain method; returns a
    JSON-serialisable dict (see :func:`format_markdown`).

    With ``tree`` (a :class:`TreeShape`): the fixed trees of ``tree_grid`` ((depth, V) pairs,
    :func:`tree_configs`) are grid-searched on ``train_prompts``, and the held-out comparison adds
    the best of them and, when given, ``tree_policy`` (a controller deciding depth and
    verification size, e.g. :func:`policies.load.load_tree_policy`), each drafting trees of that
    shape; the result gains ``grid_tree_train``, ``tree_train`` ([depth, V]), ``tree_policy`` and
    ``tree_verdicts`` (the learned tree against every other drafting row and autoregressive).

    With ``groups`` (grouping → group → held-out prompt indices, :func:`eval.runner.prompt_groupings`): the
    result gains ``groups``, the held-out comparison summarised per group (:func:`eval.runner.summarize_groups`,
    ratios to autoregressive), e.g. ``res["groups"]["category"]["code"][method]``.

    Raises:
        ValueError: ``tree`` without ``tree_grid``, ``tree_policy`` without ``tree``, or a
            drafter without trees (lookup) with ``tree``.
    """
    if tree is not None and not tree_grid:
        raise ValueError("Trees need a (depth, V) grid: pass tree_grid (eval.compare.tree_configs).")
    if tree_policy is not None and tree is None:
        raise ValueError("A tree policy drafts trees: pass tree=TreeShape(width, top_k) as well.")
    grid_tree = None
    if tree is not None:  # first: a lookup drafter fails here, before the chain grids run
        grid_tree = tree_grid_search(pair, train_prompts, tree_grid, sampling, max_new_tokens, tree, seed=seed,
                                     desc="tree grid (train)", drafter=drafter, head=head)
    grid_train = grid_search(pair, train_prompts, gammas, sampling, max_new_tokens, seed=seed, desc="γ grid (train)",
                             drafter=drafter, head=head, min_ngram=min_ngram)
    grid_held = grid_search(pair, heldout_prompts, gammas, sampling, max_new_tokens, seed=seed + 7,
                            desc="γ grid (held-out)", drafter=drafter, head=head, min_ngram=min_ngram)
    g_train, g_hind = grid_train["best_gamma"], grid_held["best_gamma"]
    names = {"train": f"fixed γ={g_train} (chosen on train)", "hind": f"fixed γ={g_hind} (best in hindsight)"}
    if g_train == g_hind:
        names["hind"] = names["train"] = f"fixed γ={g_train} (chosen on train = best in hindsight)"
    methods = [DecoderMethod(AR, pair, FixedDepthController(0), sampling, max_new_tokens)]
    methods.append(DecoderMethod(names["train"], pair, FixedDepthController(g_train), sampling, max_new_tokens, drafter,
                                 head, min_ngram=min_ngram))
    if g_hind != g_train:
        methods.append(DecoderMethod(names["hind"], pair, FixedDepthController(g_hind), sampling, max_new_tokens,
                                     drafter, head, min_ngram=min_ngram))
    methods.append(DecoderMethod(policy_name, pair, policy, sampling, max_new_tokens, drafter, head,
                                 min_ngram=min_ngram))
    tree_name = None
    if grid_tree is not None:
        from learn2draft.tree import FixedTreeController

        d, v = grid_tree["best"]
        tree_name = f"fixed tree depth={d}, V={v} (chosen on train)"
        methods.append(DecoderMethod(tree_name, pair, FixedTreeController(d, v), sampling, max_new_tokens, drafter,
                                     head, tree=tree))
        if tree_policy is not None:
            methods.append(DecoderMethod(tree_policy_name, pair, tree_policy, sampling, max_new_tokens, drafter, head,
                                         tree=tree))
    records: list[RunRecord] = run_interleaved(methods, heldout_prompts, repeats, seed + 100, desc="comparison")
    summary = summarize(records, reference=AR)
    verdicts = _verdicts(summary, policy_name, [names["train"], names["hind"], AR])
    res = {
        "sampling": sampling.to_dict(), "max_new_tokens": max_new_tokens, "repeats": repeats, "seed": seed,
        "num_train_prompts": len(train_prompts), "num_heldout_prompts": len(heldout_prompts),
        "grid_train": grid_train, "grid_heldout": grid_held, "gamma_train": g_train, "gamma_hindsight": g_hind,
        "methods": summary, "policy": policy_name, "verdicts": verdicts, "drafter": drafter,
        "groups": {key: summarize_groups(records, g, reference=AR) for key, g in (groups or {}).items()},
    }
    if grid_tree is not None:
        res.update(grid_tree_train=grid_tree, tree_train=grid_tree["best"], tree_fixed=tree_name,
                   tree={"width": tree.width, "top_k": tree.top_k}, tree_policy=None, tree_verdicts={})
        if tree_policy is not None:
            res["tree_policy"] = tree_policy_name
            res["tree_verdicts"] = _verdicts(summary, tree_policy_name,
                                             [tree_name, policy_name, names["train"], names["hind"], AR])
    return res


def _verdicts(summary: dict, learned: str, baselines: Sequence[str]) -> dict:
    """``learned`` against each baseline (duplicates once): per-repeat ratio and plain verdict; the
    ratios are also stored in ``summary[learned]`` as ``ratio_to_<baseline>``."""
    out = {}
    for base in dict.fromkeys(baselines):
        r = summary[learned][f"ratio_to_{AR}"] if base == AR else ratio_stats(summary[learned], summary[base])
        summary[learned][f"ratio_to_{base}"] = r
        out[base] = {"ratio": r, "verdict": verdict(r)}
    return out


def format_markdown(res: dict) -> str:
    """The comparison as a markdown table plus one plain sentence per fixed baseline."""
    lines = [
        f"Held-out prompts: {res['num_heldout_prompts']}, repeats: {res['repeats']}, max_new_tokens: "
        f"{res['max_new_tokens']}, sampling: {sampling_text(res['sampling'])}, drafter: {res.get('drafter', 'model')}",
        "",
        *methods_table(res["methods"], AR),
        "",
        *requests_table(res["methods"]),
    ]
    lines += ["", "γ grid on train prompts (tokens/s): " + ", ".join(
        f"{g}: {v:.1f}" for g, v in res["grid_train"]["tokens_per_second"].items()),
        "γ grid on held-out prompts (tokens/s): " + ", ".join(
        f"{g}: {v:.1f}" for g, v in res["grid_heldout"]["tokens_per_second"].items())]
    if res.get("grid_tree_train"):
        t = res["grid_tree_train"]
        lines.append(f"Tree grid (W={t['width']}, top-k={t['top_k']}) on train prompts (tokens/s): " + ", ".join(
            f"{k}: {v:.1f}" for k, v in t["tokens_per_second"].items()))
    for key, by_group in (res.get("groups") or {}).items():
        lines += ["", f"Per {key} (held-out prompts; ratios to {AR} within the {key}):", "",
                  *groups_table(by_group, AR, key)]
    lines.append("")
    for learned, verdicts in ((res["policy"], res["verdicts"]), (res.get("tree_policy"), res.get("tree_verdicts"))):
        for base, v in (verdicts or {}).items():
            r = v["ratio"]
            lines.append(f"- {learned} vs {base}: ×{r['mean']:.3f} (per-repeat {r['min']:.3f}–{r['max']:.3f}) → "
                         f"{v['verdict']}.")
    return "\n".join(lines)


def plot_accepted_lengths(ax, by_group: dict[str, dict[str, dict]], method: str, key: str = "category") -> None:
    """Draw on ``ax`` the accepted-length distribution of ``method`` in each group of
    :func:`eval.runner.summarize_groups` output (share of drafting cycles that accepted τ = 0, 1, … drafted
    tokens; one bar per group at each τ), the figure eval and the benchmark show per category."""
    import numpy as np

    hists = {g: s[method].get("accepted_length_histogram") or [] for g, s in by_group.items() if method in s}
    hists = {g: h for g, h in hists.items() if sum(h)}
    if not hists:
        ax.set_axis_off()
        ax.set_title(f"{method}: no drafting cycles")
        return
    n = max(len(h) for h in hists.values())
    w = 0.8 / len(hists)
    for i, (g, h) in enumerate(hists.items()):
        share = np.zeros(n)
        share[: len(h)] = np.asarray(h, dtype=float) / sum(h)
        ax.bar(np.arange(n) + (i - (len(hists) - 1) / 2) * w, share, width=w, label=g)
    ax.set_xticks(range(n))
    ax.set_xlabel("accepted length τ (drafted tokens accepted per cycle)")
    ax.set_ylabel("share of drafting cycles")
    ax.set_title(f"Accepted lengths per {key}: {method}")
    ax.legend(fontsize=7, ncol=2)


def plot(res: dict, path) -> None:
    """Bar chart of tokens/s with std error bars, the two γ grids, with trees the (depth, V)
    grid (tokens/s against V, one line per depth) and, with prompt categories, the learned policy's
    accepted-length distribution per category (:func:`plot_accepted_lengths`), saved as PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    tree = res.get("grid_tree_train")
    by_cat = (res.get("groups") or {}).get("category")
    n = 2 + bool(tree) + bool(by_cat)
    fig, axes = plt.subplots(1, n, figsize=(6 * n, 4.5))
    a, b = axes[0], axes[1]
    names = list(res["methods"])
    means = [res["methods"][n]["tokens_per_second_mean"] for n in names]
    stds = [res["methods"][n]["tokens_per_second_std"] for n in names]
    colors = ["#888" if n == AR else "#c52" if n in (res["policy"], res.get("tree_policy")) else
              "#47a" if n == res.get("tree_fixed") else "#4a7" for n in names]
    a.bar(range(len(names)), means, yerr=stds, capsize=4, color=colors)
    a.set_xticks(range(len(names)), [n.replace(" (", "\n(").replace(", V=", ",\nV=") for n in names], fontsize=8)
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
    if tree:
        c = axes[2]
        by_depth: dict[int, list[tuple[int, float]]] = {}
        for key, v in tree["tokens_per_second"].items():
            d, size = (int(x.split("=")[1]) for x in key.split(","))
            by_depth.setdefault(d, []).append((size, v))
        for d, pts in sorted(by_depth.items()):
            pts.sort()
            c.plot([x for x, _ in pts], [y for _, y in pts], marker="o", label=f"depth {d}")
        c.axhline(res["methods"][AR]["tokens_per_second_mean"], color="#888", ls="--", label="autoregressive")
        if res.get("tree_policy"):
            c.axhline(res["methods"][res["tree_policy"]]["tokens_per_second_mean"], color="#c52", ls=":",
                      label=res["tree_policy"])
        c.set_xscale("log", base=2)
        c.set_xlabel("verification size V (tree nodes verified)")
        c.set_ylabel("tokens/s (train prompts)")
        c.set_title(f"Fixed-tree grid (W={tree['width']}, top-k={tree['top_k']})")
        c.legend(fontsize=8)
    if by_cat:
        plot_accepted_lengths(axes[-1], by_cat, res["policy"])
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
