"""``python -m eval.acceptance``: which features predict that a drafted token is accepted, on held-out traces.

For every drafted token j of every position of the chain traces (``python -m eval.record``) that is *reached*
(tokens 0..j−1 accepted), the label is "token j is accepted"; its features are those known once token j is drafted,
before its verification (learn2draft.features.ACCEPTANCE_FEATURE_DOCS) — what a depth policy has when deciding
whether to draft token j + 1, which pays only if token j is accepted. For each named feature set
(learn2draft.features.ACCEPTANCE_FEATURE_SETS: draft, draft+margin, target, lookup, all) a logistic regression is
fitted on the training traces — one global logistic, and, as vLLM's online acceptance estimator (PR #52228, top-2
margin, AUC 0.884), one logistic per drafted position j — and its ROC AUC is reported on the held-out traces with the
number of examples and the base rate.

Labels. At temperature 0 the acceptance probabilities are 0 or 1: an example is reached or not and its label is
exact. At T > 0 the tool uses soft labels, without sampling: token j counts with the probability it is reached
(w = product of the acceptance probabilities of tokens 0..j−1), as a positive of weight w·a_j and a negative of
weight w·(1 − a_j), a_j = min(1, p(x)/q(x)) its recorded acceptance probability. The fit minimises the weighted log
loss and the AUC is the weighted Mann–Whitney statistic (ties count one half), the expectation over the acceptance
draws of the counts a sampled label would give; at T = 0 both reduce to the hard labels.

Fit: numpy / scipy only (L-BFGS on the L2-regularised weighted log loss of standardised features, λ = --l2). A
position whose training examples hold fewer than --min-examples or a single class keeps the global logistic's
scores (the report lists the positions fitted on their own).

Training and held-out traces must come from the same target, draft model and drafter (else the fit describes
another pair: refused, unless --allow-mismatch, which prints a warning); other sampling settings or depths only warn.
Traces recorded before the acceptance features (no target_stats / draft_margin arrays) still run the feature sets
that do not read them; the others are reported as skipped, naming the file.

Example::

    python -m eval.acceptance --traces runs/traces/head-train.npz --heldout runs/traces/head-heldout.npz \\
        --out runs/acceptance-head.json
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from learn2draft.cli import HelpFormatter, add_out_arg, comma_items, plain_doc, run_cli
from learn2draft.features import (
    ACCEPTANCE_ARRAY_FEATURES,
    ACCEPTANCE_FEATURE_NAMES,
    ACCEPTANCE_FEATURE_SETS,
    ACCEPTANCE_FEATURE_VERSION,
    acceptance_features,
)

#: Header entries training and held-out traces must share (refused otherwise, unless --allow-mismatch).
MUST_MATCH = ("target", "draft", "drafter")
#: Header entries that only warn when they differ.
SHOULD_MATCH = ("sampling", "max_depth", "dtype")


@dataclass
class Examples:
    """The labelled examples of a trace set: one row per reached drafted token (weight > 0), or two at T > 0.

    Attributes:
        X: float64 (N, len(ACCEPTANCE_FEATURE_NAMES)), every feature (NaN where a trace lacks its arrays).
        y: float64 (N,), 1 accepted / 0 rejected.
        w: float64 (N,), the example's probability weight (reached · accepted, or reached · rejected).
        position: int64 (N,), the drafted position j.
        tokens: the distinct drafted tokens behind the rows (those reached with a probability > 0).
        prompt: int64 (N,), the index of the prompt (in the trace set) each row comes from.
    """

    X: np.ndarray
    y: np.ndarray
    w: np.ndarray
    position: np.ndarray
    tokens: int
    prompt: np.ndarray | None = None

    def columns(self, names: Sequence[str]) -> np.ndarray:
        """float64 (N, len(names)): the features ``names`` of :data:`ACCEPTANCE_FEATURE_NAMES`."""
        return self.X[:, [ACCEPTANCE_FEATURE_NAMES.index(n) for n in names]]

    @property
    def reached(self) -> float:
        """Σ w: the expected number of reached drafted tokens (their count at T = 0)."""
        return float(self.w.sum())

    @property
    def base_rate(self) -> float:
        """The weighted share of accepted examples (NaN without examples)."""
        return float((self.w * self.y).sum() / self.w.sum()) if self.w.sum() > 0 else float("nan")


def examples(traces) -> Examples:
    """The reached drafted tokens of a :class:`learn2draft.replay.traces.TraceSet` with their labels and weights
    (see the module docstring: hard labels at T = 0, soft ones at T > 0), features from
    :func:`learn2draft.features.acceptance_features`.

    Raises:
        ValueError: the traces hold no drafted token.
    """
    D, V, n_new = traces.max_depth, int(traces.header["vocab_size"]), traces.max_new_tokens
    parts = []
    for i, pt in enumerate(traces.prompts):
        X, rows, pos = acceptance_features(pt, D, V, n_new)
        a = np.asarray(pt.accept_prob, dtype=np.float64)[rows, pos]
        ap = np.nan_to_num(np.asarray(pt.accept_prob, dtype=np.float64), nan=0.0)
        before = np.concatenate([np.ones((ap.shape[0], 1)), np.cumprod(ap, axis=1)[:, :-1]], axis=1)
        parts.append((X, a, before[rows, pos], pos, np.full(len(pos), i)))
    if not parts or sum(p[0].shape[0] for p in parts) == 0:
        raise ValueError("The traces hold no drafted token (every chain is empty): record them with --max-depth ≥ 1 "
                         "and a drafter that proposes (lookup needs repeated text).")
    X, a, reach, pos, prompt = (np.concatenate(z) for z in zip(*parts))
    X2, y2 = np.concatenate([X, X]), np.concatenate([np.ones_like(a), np.zeros_like(a)])
    w2, p2 = np.concatenate([reach * a, reach * (1 - a)]), np.concatenate([pos, pos])
    keep = w2 > 0
    return Examples(X2[keep], y2[keep], w2[keep], p2[keep].astype(np.int64), int(np.count_nonzero(reach > 0)),
                    np.concatenate([prompt, prompt])[keep].astype(np.int64))


def roc_auc(scores: np.ndarray, labels: np.ndarray, weights: np.ndarray | None = None) -> float:
    """Weighted ROC AUC: the probability that a random positive scores above a random negative, ties counting one
    half (the Mann–Whitney statistic), each example counted with its weight.

    Args:
        scores: float (N,); labels: (N,) 1 positive / 0 negative; weights: float (N,) ≥ 0 (default all 1).

    Returns:
        the AUC in [0, 1]; NaN when either class has zero weight.
    """
    s = np.asarray(scores, dtype=np.float64)
    pos = np.asarray(labels) == 1
    w = np.ones_like(s) if weights is None else np.asarray(weights, dtype=np.float64)
    P, N = float(w[pos].sum()), float(w[~pos].sum())
    if P <= 0 or N <= 0:
        return float("nan")
    uniq, inv = np.unique(s, return_inverse=True)  # tie groups, increasing score
    wp = np.bincount(inv, weights=np.where(pos, w, 0.0), minlength=uniq.size)
    wn = np.bincount(inv, weights=np.where(pos, 0.0, w), minlength=uniq.size)
    below = np.concatenate([[0.0], np.cumsum(wn)[:-1]])
    return float((wp * (below + 0.5 * wn)).sum() / (P * N))


@dataclass
class Logistic:
    """A logistic regression on standardised features: P(accepted | x) = σ(((x − mean) / scale) · coef + intercept).

    Attributes:
        coef: float64 (F,); intercept: float; mean, scale: float64 (F,), the training features' weighted mean and
            standard deviation (scale 1 for a constant feature).
    """

    coef: np.ndarray
    intercept: float
    mean: np.ndarray
    scale: np.ndarray

    def decision(self, X: np.ndarray) -> np.ndarray:
        """float64 (N,): the log-odds of acceptance for features float (N, F)."""
        return ((X - self.mean) / self.scale) @ self.coef + self.intercept


def fit_logistic(X: np.ndarray, y: np.ndarray, w: np.ndarray, l2: float = 1e-3) -> Logistic:
    """Fit :class:`Logistic` by L-BFGS (scipy) on the weighted log loss Σ w·logloss / Σ w + ``l2``·|coef|² / 2 (the
    intercept unpenalised).

    Args:
        X: float (N, F), finite; y: (N,) in {0, 1}; w: float (N,) ≥ 0 with Σ w > 0; l2: ≥ 0.

    Raises:
        ValueError: non-finite features or no weight.
    """
    from scipy.optimize import minimize
    from scipy.special import expit, log_expit

    X = np.asarray(X, dtype=np.float64)
    if not np.isfinite(X).all():
        raise ValueError("Non-finite acceptance features: a trace without the acceptance arrays?")
    total = float(w.sum())
    if total <= 0:
        raise ValueError("No training example has weight.")
    wn = w / total
    mean = wn @ X
    scale = np.sqrt(wn @ (X - mean) ** 2)
    scale = np.where(scale > 1e-12, scale, 1.0)
    Z = (X - mean) / scale

    def loss(theta):
        z = Z @ theta[:-1] + theta[-1]
        value = -(wn * (y * log_expit(z) + (1 - y) * log_expit(-z))).sum() + 0.5 * l2 * theta[:-1] @ theta[:-1]
        r = wn * (expit(z) - y)
        return value, np.concatenate([Z.T @ r + l2 * theta[:-1], [r.sum()]])

    res = minimize(loss, np.zeros(Z.shape[1] + 1), jac=True, method="L-BFGS-B", options={"maxiter": 500})
    return Logistic(res.x[:-1], float(res.x[-1]), mean, scale)


def feature_set_report(train: Examples, heldout: Examples, names: Sequence[str], max_depth: int, l2: float = 1e-3,
                       min_examples: int = 20, groups: dict[str, Sequence[int]] | None = None) -> dict:
    """Fit the global and the per-position logistics of one feature set on ``train`` and score ``heldout``.

    Args:
        groups: optional group name (e.g. a prompt category) → indices of held-out prompts; the report then also
            holds the per-position AUC within each group.

    Returns:
        dict: ``features``, ``auc_global`` and ``auc_per_position`` (held-out AUC of the pooled scores),
        ``auc_by_position`` (held-out AUC of the per-position scores within each position j; None where a class
        is missing), ``positions_fitted`` (positions with their own logistic), ``coef_global`` (standardised) and,
        with ``groups``, ``auc_by_group`` (group → ``{"auc": per-position AUC or None where a class is missing,
        "examples": labelled rows}``).
    """
    Xt, Xh = train.columns(names), heldout.columns(names)
    glob = fit_logistic(Xt, train.y, train.w, l2)
    scores = glob.decision(Xh)
    per = scores.copy()
    fitted, by_pos = [], []
    for j in range(max_depth):
        tr, he = train.position == j, heldout.position == j
        ok = (np.count_nonzero(tr) >= min_examples and (train.w[tr] * train.y[tr]).sum() > 0
              and (train.w[tr] * (1 - train.y[tr])).sum() > 0)
        if ok:
            fitted.append(j)
            if he.any():
                per[he] = fit_logistic(Xt[tr], train.y[tr], train.w[tr], l2).decision(Xh[he])
        auc = roc_auc(per[he], heldout.y[he], heldout.w[he]) if he.any() else float("nan")
        by_pos.append(None if np.isnan(auc) else round(auc, 4))
    return {
        "features": list(names),
        "auc_global": _r(roc_auc(scores, heldout.y, heldout.w)),
        "auc_per_position": _r(roc_auc(per, heldout.y, heldout.w)),
        "auc_by_position": by_pos,
        "positions_fitted": fitted,
        "coef_global": {n: round(float(c), 4) for n, c in zip(names, glob.coef)},
        **({"auc_by_group": {g: _group_auc(per, heldout, idx) for g, idx in groups.items()}} if groups else {}),
    }


def _group_auc(scores: np.ndarray, heldout: Examples, prompts: Sequence[int]) -> dict:
    rows = np.isin(heldout.prompt, np.asarray(list(prompts), dtype=np.int64))
    return {"auc": _r(roc_auc(scores[rows], heldout.y[rows], heldout.w[rows])) if rows.any() else None,
            "examples": int(np.count_nonzero(rows))}


def prompt_categories(traces) -> dict[str, list[int]] | None:
    """Category → indices of the prompts of a trace set recorded from shipped splits (its header's
    ``prompt_source``, e.g. ``corpus_test``, and ``num_prompts``: the first prompts of those splits, in order); None
    when they came from a user's file or the split is unknown."""
    from learn2draft.prompts import SPLITS, load_prompt_records

    source = str(traces.header.get("prompt_source", ""))
    splits = source.split(",")
    if not source or any(s not in SPLITS for s in splits):
        return None
    records = [p for s in splits for p in load_prompt_records(s)][: len(traces.prompts)]
    out: dict[str, list[int]] = {}
    for i, p in enumerate(records):
        out.setdefault(p.category, []).append(i)
    return out


def _r(x: float) -> float | None:
    return None if np.isnan(x) else round(float(x), 4)


def _same_model(value):
    """A header value compared across checkouts: a path to a model folder or file (the embedded draft's absolute path
    differs between clones) compares by its last component; dicts are compared entry by entry."""
    if isinstance(value, dict):
        return {k: _same_model(v) for k, v in value.items()}
    if isinstance(value, str) and ("/" in value or "\\" in value):
        return Path(value).name
    return value


def check_compatible(train, heldout, train_paths: Sequence[str], heldout_paths: Sequence[str],
                     allow_mismatch: bool = False) -> list[str]:
    """Refuse training and held-out traces of different models or drafters; the warnings for other differences.

    Returns:
        the warning lines (printed by the command).

    Raises:
        ValueError: a path in both lists, or headers differing in :data:`MUST_MATCH` (unless ``allow_mismatch``).
    """
    both = sorted({str(Path(p).resolve()) for p in train_paths} & {str(Path(p).resolve()) for p in heldout_paths})
    if both:
        raise ValueError(f"{both[0]} is given as training and as held-out traces: hold out other prompts "
                         "(record them with --prompt-split heldout).")
    warnings = []
    hard = [k for k in MUST_MATCH if _same_model(train.header.get(k)) != _same_model(heldout.header.get(k))]
    if hard:
        msg = (f"training traces ({train_paths[0]}) and held-out traces ({heldout_paths[0]}) differ in "
               f"{', '.join(hard)}: " + "; ".join(f"{k} {train.header.get(k)!r} vs {heldout.header.get(k)!r}"
                                                  for k in hard))
        if not allow_mismatch:
            raise ValueError(msg + " — a fit on one pair says nothing about another; pass --allow-mismatch to run it "
                                   "anyway.")
        warnings.append("warning: " + msg)
    soft = [k for k in SHOULD_MATCH if train.header.get(k) != heldout.header.get(k)]
    if soft:
        warnings.append(f"warning: training and held-out traces differ in {', '.join(soft)} (the report still runs).")
    return warnings


def acceptance_report(train, heldout, sets: Sequence[str] | None = None, l2: float = 1e-3, min_examples: int = 20,
                      train_name: str = "training traces", heldout_name: str = "held-out traces",
                      groups: dict[str, Sequence[int]] | None = None) -> dict:
    """The held-out AUC of every feature set (see the module docstring).

    Args:
        train, heldout: :class:`learn2draft.replay.traces.TraceSet` (chain traces).
        sets: names of :data:`learn2draft.features.ACCEPTANCE_FEATURE_SETS` (default all of them).
        l2, min_examples: as :func:`fit_logistic` and :func:`feature_set_report`.
        train_name, heldout_name: how the report names a trace set that lacks the acceptance arrays.
        groups: held-out prompt groups (e.g. :func:`prompt_categories`): each set's report adds ``auc_by_group``.

    Returns:
        dict with ``label`` (how labels are defined), ``feature_version``, ``drafter``, ``max_depth``, ``train`` / ``heldout`` (``tokens``: reached drafted tokens
        with a label, ``reached``: Σ weights, ``base_rate``), ``sets`` (per set: :func:`feature_set_report`, or
        ``skipped`` with the reason) and ``best`` (the set with the highest per-position AUC).

    Raises:
        ValueError: an unknown feature set, traces without drafted tokens, or held-out examples of one class.
    """
    sets = list(ACCEPTANCE_FEATURE_SETS) if sets is None else list(sets)
    unknown = [s for s in sets if s not in ACCEPTANCE_FEATURE_SETS]
    if unknown:
        raise ValueError(f"Unknown feature sets {unknown}; known: {', '.join(ACCEPTANCE_FEATURE_SETS)}.")
    tr, he = examples(train), examples(heldout)
    if np.isnan(roc_auc(np.zeros_like(he.y), he.y, he.w)):
        raise ValueError(f"The {heldout_name} hold only {'accepted' if he.base_rate == 1 else 'rejected'} drafted "
                         "tokens: no AUC to report; hold out more prompts.")
    lacking = [name for name, s in ((train_name, train), (heldout_name, heldout)) if not s.has_acceptance_features]
    out_sets = {}
    for s in sets:
        names = ACCEPTANCE_FEATURE_SETS[s]
        if lacking and ACCEPTANCE_ARRAY_FEATURES.intersection(names):
            out_sets[s] = {"skipped": f"{' and '.join(lacking)} lack the acceptance features (target_stats, "
                                      "draft_margin: recorded before issue 16); re-record them with "
                                      "`python -m eval.record`"}
            continue
        out_sets[s] = feature_set_report(tr, he, names, train.max_depth, l2, min_examples, groups)
    scored = {k: v["auc_per_position"] for k, v in out_sets.items() if v.get("auc_per_position") is not None}
    return {
        "label": ("drafted token j accepted, over the tokens reached (0..j-1 accepted); "
                  + ("hard labels (T = 0)" if train.deterministic and heldout.deterministic else
                     "soft labels at T > 0: weight P(reached)*a_j as accepted and P(reached)*(1-a_j) as rejected")),
        "feature_version": ACCEPTANCE_FEATURE_VERSION,
        "drafter": train.drafter,
        "max_depth": train.max_depth,
        "train": _summary(tr),
        "heldout": _summary(he),
        "sets": out_sets,
        "best": max(scored, key=scored.get) if scored else None,
    }


def _summary(ex: Examples) -> dict:
    return {"tokens": ex.tokens, "reached": round(ex.reached, 2), "base_rate": _r(ex.base_rate)}


def format_report(rep: dict) -> str:
    """The report as a markdown table, one row per feature set."""
    tr, he = rep["train"], rep["heldout"]
    lines = [f"acceptance AUC, drafter {rep['drafter']}, max_depth {rep['max_depth']}: {rep['label']}",
             f"train: {tr['tokens']} drafted tokens reached (Σ weight {tr['reached']}), base rate {tr['base_rate']}; "
             f"held-out: {he['tokens']} (Σ weight {he['reached']}), base rate {he['base_rate']}",
             "", "| feature set | AUC global logistic | AUC per-position logistics | positions fitted |",
             "|---|---|---|---|"]
    for name, s in rep["sets"].items():
        if "skipped" in s:
            lines.append(f"| {name} | skipped: {s['skipped']} | | |")
        else:
            lines.append(f"| {name} | {s['auc_global']} | {s['auc_per_position']} | "
                         f"{','.join(map(str, s['positions_fitted'])) or '-'} |")
    lines.append(f"best feature set (per-position AUC): {rep['best']}")
    best = rep["sets"].get(rep["best"] or "", {})
    if best.get("auc_by_group"):
        lines += ["", f"per category, feature set {rep['best']} (per-position logistics):", "",
                  "| category | AUC | examples |", "|---|---|---|"]
        lines += [f"| {g} | {v['auc'] if v['auc'] is not None else '– (one class)'} | {v['examples']} |"
                  for g, v in best["auc_by_group"].items()]
    return "\n".join(lines)


# --------------------------------------------------------------------------- CLI
def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m eval.acceptance", description=plain_doc(__doc__),
                                formatter_class=HelpFormatter)
    p.add_argument("--traces", nargs="+", required=True,
                   help="training chain trace file(s) from python -m eval.record (same models and drafter), "
                        "comma- or space-separated")
    p.add_argument("--heldout", nargs="+", required=True,
                   help="held-out chain trace file(s): other prompts, comma- or space-separated")
    p.add_argument("--sets", default=",".join(ACCEPTANCE_FEATURE_SETS),
                   help="feature sets to report, comma-separated (default: all)")
    p.add_argument("--l2", type=float, default=1e-3, help="L2 penalty of the logistic regressions")
    p.add_argument("--min-examples", type=int, default=20,
                   help="training examples a position needs for its own logistic (else the global one's scores)")
    p.add_argument("--allow-mismatch", action="store_true",
                   help="run even when training and held-out traces differ in target, draft or drafter (warns)")
    add_out_arg(p, "also write the report to this JSON file (default: print only)")
    return p


def main(argv: list[str] | None = None) -> int:
    return run_cli(build_parser(), _run, argv)


def _trace_files(words: list[str], flag: str) -> list[str]:
    """The trace files of ``flag``'s shell words, each comma-separated (a comma ending a word before the next one
    separates them too: ``--traces a.npz, b.npz``).

    Raises:
        ValueError: an empty item (``a.npz,,b.npz``, a trailing comma), naming ``flag``.
    """
    text = ",".join(w[:-1] if w.endswith(",") and i < len(words) - 1 else w for i, w in enumerate(words))
    return comma_items(text, flag, "join the trace files with single commas or spaces, e.g. a.npz,b.npz")


def _run(args) -> int:
    from learn2draft.replay.traces import load_traces

    if args.l2 < 0 or args.min_examples < 1:
        raise ValueError(f"Need --l2 ≥ 0 and --min-examples ≥ 1, got {args.l2} and {args.min_examples}.")
    if args.out:
        from learn2draft.cli import check_out_file

        check_out_file(args.out, "--out")  # before the work: a folder or an unwritable place fails first
    # comma-separated as the other tools take them, or space-separated
    train_files, heldout_files = _trace_files(args.traces, "--traces"), _trace_files(args.heldout, "--heldout")
    sets = comma_items(args.sets, "--sets", f"use one or more of {', '.join(ACCEPTANCE_FEATURE_SETS)} joined by commas")
    train, heldout = load_traces(train_files), load_traces(heldout_files)
    for w in check_compatible(train, heldout, train_files, heldout_files, args.allow_mismatch):
        print(w, file=sys.stderr)
    rep = acceptance_report(train, heldout, sets, args.l2, args.min_examples,
                            train_name=", ".join(train_files), heldout_name=", ".join(heldout_files),
                            groups=prompt_categories(heldout))
    rep["traces"], rep["heldout_traces"] = list(train_files), list(heldout_files)
    print(format_report(rep))
    if args.out:
        out = Path(args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(rep, indent=2) + "\n")
        print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
