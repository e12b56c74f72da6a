"""Falsifiable claims and their verdicts: one place that turns measured tokens/s ratios into lines
``CLAIM  threshold  measured  PASS/FAIL`` (issue 18, item 3), used at the end of the benchmark's report and
in its JSON. The default claims are issue 38's goals.

A claim compares two *roles* (``"learned"``, ``"best_fixed"``, ``"chosen_fixed"``, ``"best_rule"``,
``"generate"``, ``"autoregressive"``, ``"prompt_lookup"``), which the caller maps to the names of the methods that ran; the ratio is
:func:`eval.runner.ratio_stats`'s per-repeat mean of tokens/s (same prompts, seeds and interleaving). A claim
whose methods, temperature or prompts did not run says ``"not measured"`` — never PASS.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

PASS, FAIL, NOT_MEASURED = "PASS", "FAIL", "not measured"


@dataclass(frozen=True)
class Claim:
    """A claim ``method ≥ threshold × baseline`` in tokens/s.

    Attributes:
        label: the claim in words, e.g. ``"learned ≥ 1.10× best fixed"``.
        method, baseline: roles (see the module's docstring); ``"best_fixed"`` is the fastest of the fixed
            configurations that ran, on the prompts the claim is judged on.
        threshold: the ratio to reach (≥).
        temperatures: ``"zero"`` (T = 0 only), ``"positive"`` (T > 0 only) or ``"any"``.
        scope: ``"all"`` (the whole prompt mix), ``"every_category"`` (the smallest ratio over the prompt
            categories; the whole mix when it has one category) or ``"copy"`` (the copy-heavy prompts:
            :data:`learn2draft.prompts.COPY_CATEGORIES`).
    """

    label: str
    method: str
    baseline: str
    threshold: float
    temperatures: str = "any"
    scope: str = "all"


#: Issue 38's goals for the benchmark (test prompts never trained on, all methods in the same precision, side by
#: side). ``best_fixed`` is every fixed arm measured on the test prompts (the verdict takes the fastest: the best in
#: hindsight, HF prompt lookup included); ``chosen_fixed`` the arm chosen on the validation prompts; ``best_rule`` the
#: hand rules (the verdict takes the fastest).
DEFAULT_CLAIMS: tuple[Claim, ...] = (
    Claim("learned ≥ 1.10× best fixed configuration in hindsight", "learned", "best_fixed", 1.10),
    Claim("learned ≥ 1.05× best hand rule", "learned", "best_rule", 1.05),
    Claim("learned ≥ 1.00× fixed configuration chosen on validation, every category", "learned", "chosen_fixed", 1.00,
          scope="every_category"),
    Claim("learned ≥ 0.98× autoregressive on every category", "learned", "autoregressive", 0.98,
          scope="every_category"),
    Claim("copy prompts: learned ≥ 1.15× HF prompt lookup", "learned", "prompt_lookup", 1.15, scope="copy"),
)


def _ratio(summary: Mapping[str, dict], method: str | None, baselines: Sequence[str]) -> tuple[float | None, str]:
    """Per-repeat mean ratio of ``method`` to the fastest of ``baselines`` in ``summary``, and that baseline."""
    from eval.runner import ratio_stats

    present = [b for b in baselines if b in summary]
    if method is None or method not in summary or not present:
        return None, ""
    base = max(present, key=lambda b: summary[b]["tokens_per_second_mean"])
    return ratio_stats(summary[method], summary[base])["mean"], base


def evaluate_claims(runs: Mapping[str, dict], roles: Mapping[str, str | Sequence[str]] | None = None,
                    claims: Sequence[Claim] = DEFAULT_CLAIMS) -> list[dict]:
    """Judge every claim on every run whose temperature it applies to.

    Args:
        runs: temperature (a string such as ``"0.0"``) → ``{"methods": summary, "categories": {category:
            summary} or None, "copy": summary of the copy-heavy prompts or None, "roles": optional}``, each summary
            :func:`eval.runner.summarize`'s output.
        roles: role → the name of the method that plays it (``"best_fixed"``: a list of names); a run's own
            ``"roles"`` replace these (the fixed γ is chosen per temperature).
        claims: the claims (default :data:`DEFAULT_CLAIMS`).

    Returns:
        one dict per (claim, temperature): ``claim``, ``temperature``, ``threshold``, ``measured`` (the ratio, or
        None), ``verdict`` (``"PASS"``, ``"FAIL"`` or ``"not measured"``) and ``against`` (the baseline method;
        for ``"every_category"``, also the category of the smallest ratio).
        A claim that applies to no temperature of ``runs`` gets one ``"not measured"`` entry (temperature None).

    Raises:
        ValueError: a claim with an unknown ``temperatures`` or ``scope``.
    """
    out = []
    for c in claims:
        if c.temperatures not in ("zero", "positive", "any") or c.scope not in ("all", "every_category", "copy"):
            raise ValueError(f"Claim {c.label!r}: temperatures must be zero/positive/any and scope all/every_category/"
                             f"copy, got {c.temperatures!r}, {c.scope!r}.")
        temps = [t for t in runs if c.temperatures == "any" or (float(t) == 0) == (c.temperatures == "zero")]
        for t in temps:
            run = runs[t]
            r = run.get("roles") or roles or {}
            method, base = r.get(c.method), r.get(c.baseline)
            bases = [] if base is None else [base] if isinstance(base, str) else list(base)
            if c.scope == "all":
                measured, against = _ratio(run["methods"], method, bases)
            elif c.scope == "copy":
                measured, against = _ratio(run["copy"], method, bases) if run.get("copy") else (None, "")
            else:
                groups = run.get("categories") or {"the whole mix": run["methods"]}
                per = [(*_ratio(s, method, bases), g) for g, s in groups.items()]
                measured, against = None, ""
                if all(p[0] is not None for p in per):  # a category without the methods: not measured
                    measured, base_name, group = min(per, key=lambda p: p[0])
                    against = f"{base_name}, on {group}"
            verdict = NOT_MEASURED if measured is None else PASS if measured >= c.threshold else FAIL
            out.append({"claim": c.label, "temperature": t, "threshold": c.threshold, "measured": measured,
                        "verdict": verdict, "against": against})
        if not temps:
            out.append({"claim": c.label, "temperature": None, "threshold": c.threshold, "measured": None,
                        "verdict": NOT_MEASURED, "against": ""})
    return out


def _shown(measured: float, threshold: float) -> str:
    """``measured`` to 3 decimals, with more where 3 would round it onto the other side of ``threshold`` (a FAIL at
    0.9495 must not read 0.950 against ≥ 0.95)."""
    for digits in (3, 4, 5, 6):
        text = f"{measured:.{digits}f}"
        if (float(text) >= threshold) == (measured >= threshold):
            return text
    return f"{measured:.6f}"


def verdict_lines(verdicts: Sequence[dict]) -> list[str]:
    """:func:`evaluate_claims`'s verdicts as aligned lines ``CLAIM  threshold  measured  PASS/FAIL``."""
    rows = [(v["claim"] + ("" if v["temperature"] is None else f" (T={v['temperature']})"),
             f"≥ {v['threshold']:.2f}×", "–" if v["measured"] is None else f"{_shown(v['measured'], v['threshold'])}×",
             v["verdict"] + (f" (vs {v['against']})" if v["against"] else "")) for v in verdicts]
    if not rows:
        return []
    head = ("CLAIM", "threshold", "measured", "verdict")
    w = [max(len(r[i]) for r in [head, *rows]) for i in range(3)]
    return ["  ".join((r[0].ljust(w[0]), r[1].ljust(w[1]), r[2].ljust(w[2]), r[3])) for r in [head, *rows]]
