"""Fit and export an acceptance model for the plugin from this project's traces.

``python -m learn2draft_vllm export-acceptance --traces T.npz [--heldout H.npz] --out DIR`` (run where learn2draft is
installed; no vLLM needed). The traces are chain traces of a model-based drafter (``python -m eval.record --drafter
model`` or ``head``) of the pair and sampling you serve. Every reached drafted token is an example, labelled as
``python -m eval.acceptance`` labels it (:func:`eval.acceptance.examples`: hard labels at T = 0, weighted soft labels
at T > 0: the *conditional* acceptance of token j given tokens 0..j−1 accepted, which is what vLLM's survival
product multiplies); its features are :data:`learn2draft_vllm.ACCEPTANCE_FEATURES`
(:func:`learn2draft.features.acceptance_features`). The model is :func:`eval.acceptance.fit_logistic`'s L2-regularised
logistic regression, written as one ONNX Gemm on the raw features (the standardisation folded into its weights):
input ``features`` float32 (N, 6), output ``logit`` float32 (N, 1), acceptance probability σ(logit).
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np

from learn2draft_vllm import (
    ACCEPTANCE_FEATURES,
    DRAFTERS,
    FORMAT,
    MODEL_FILE,
    PARITY_FILE,
    SPEC_FILE,
    SUPPORTED_VLLM_VERSIONS,
    VLLM_SOURCE,
)

#: Parity rows written to ``parity.json``.
PARITY_ROWS = 64


def fit_acceptance(traces, l2: float = 1e-3) -> tuple[np.ndarray, float, dict]:
    """Fit the acceptance logistic on ``traces``.

    Args:
        traces: a :class:`learn2draft.replay.traces.TraceSet` of chain traces with the acceptance arrays.
        l2: the L2 penalty on the standardised coefficients (:func:`eval.acceptance.fit_logistic`).

    Returns:
        (weight float64 (6,), bias, summary): log-odds = features · weight + bias on the raw features; ``summary``
        holds ``examples`` (reached drafted tokens), ``base_rate``, ``log_loss`` (weighted, on the traces) and
        ``parity_features`` (float64 (≤ 64, 6), rows of the training features spread over the traces).

    Raises:
        ValueError: a drafter without a draft distribution, traces without ``draft_margin`` (recorded before the
            acceptance features), no drafted token, or one class only.
    """
    from eval.acceptance import examples, fit_logistic

    if traces.drafter not in DRAFTERS:
        raise ValueError(f"The traces were recorded with --drafter {traces.drafter}; an acceptance model for vLLM "
                         f"needs a drafter with a draft distribution ({', '.join(DRAFTERS)}): vLLM's n-gram speculator "
                         "has no acceptance estimator.")
    ex = examples(traces)
    X = ex.columns(ACCEPTANCE_FEATURES)
    if not np.isfinite(X).all():
        raise ValueError("The traces lack the draft's top-2 margin (recorded before the acceptance features): re-record "
                         "them with `python -m eval.record`.")
    pos, neg = float((ex.w * ex.y).sum()), float((ex.w * (1 - ex.y)).sum())
    if pos <= 0 or neg <= 0:
        raise ValueError(f"The traces hold only {'accepted' if neg <= 0 else 'rejected'} drafted tokens: nothing to "
                         "fit; record more prompts.")
    lg = fit_logistic(X, ex.y, ex.w, l2)
    weight = lg.coef / lg.scale
    bias = float(lg.intercept - (lg.mean / lg.scale) @ lg.coef)
    z = X @ weight + bias
    logloss = float((ex.w * (np.logaddexp(0.0, -z) * ex.y + np.logaddexp(0.0, z) * (1 - ex.y))).sum() / ex.w.sum())
    return weight, bias, {"examples": ex.tokens, "base_rate": round(ex.base_rate, 6), "log_loss": round(logloss, 6),
                          "parity_features": X[:: max(1, X.shape[0] // PARITY_ROWS)][:PARITY_ROWS]}


def write_onnx(path: str | Path, layers: list[tuple[np.ndarray, np.ndarray]]) -> Path:
    """Write Gemm layers (weight (out, in), bias (out,)) with Tanh between them as ONNX (opset 17): input ``features``
    float32 (N, in), output ``logit`` float32 (N, out of the last layer). The graph :func:`policies.vllm.load_mlp`
    reads back."""
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    nodes, inits, x = [], [], "features"
    for i, (w, b) in enumerate(layers):
        w, b = np.asarray(w, np.float32), np.asarray(b, np.float32)
        inits += [numpy_helper.from_array(w, f"W{i}"), numpy_helper.from_array(b, f"B{i}")]
        y = "logit" if i == len(layers) - 1 else f"h{i}"
        nodes.append(helper.make_node("Gemm", [x, f"W{i}", f"B{i}"], [y], transB=1))
        if i < len(layers) - 1:
            nodes.append(helper.make_node("Tanh", [y], [f"a{i}"]))
            y = f"a{i}"
        x = y
    graph = helper.make_graph(
        nodes, "learn2draft_acceptance",
        [helper.make_tensor_value_info("features", TensorProto.FLOAT, ["N", int(np.shape(layers[0][0])[1])])],
        [helper.make_tensor_value_info("logit", TensorProto.FLOAT, ["N", int(np.shape(layers[-1][0])[0])])], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    onnx.checker.check_model(model)
    out = Path(path)
    onnx.save(model, str(out))
    return out


def export_acceptance(traces, out_dir: str | Path, l2: float = 1e-3, heldout=None, sources: dict | None = None) -> dict:
    """Fit (:func:`fit_acceptance`) and write an acceptance model folder: ``acceptance.onnx``, ``acceptance_spec.json``
    and ``parity.json`` (features → the logits of float32 arithmetic, to check a runtime).

    Args:
        traces: the training :class:`learn2draft.replay.traces.TraceSet`; heldout: optional held-out one (its AUC,
            :func:`eval.acceptance.roc_auc`, goes into the spec); sources: trace file names for the spec.

    Returns:
        the spec written.

    Raises:
        ValueError: as :func:`fit_acceptance`.
    """
    from eval.acceptance import examples, roc_auc
    from learn2draft.features import ACCEPTANCE_FEATURE_DOCS

    weight, bias, summary = fit_acceptance(traces, l2)
    parity_x = summary.pop("parity_features").astype(np.float32)
    w32, b32 = weight.astype(np.float32)[None, :], np.asarray([bias], np.float32)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    write_onnx(out / MODEL_FILE, [(w32, b32)])
    h = traces.header
    spec = {
        "format": FORMAT,
        "model": "logistic regression: P(draft token j accepted | tokens 0..j-1 accepted) = sigmoid(logit)",
        "features": [{"name": n, "index": i, "definition": ACCEPTANCE_FEATURE_DOCS[n]}
                     for i, n in enumerate(ACCEPTANCE_FEATURES)],
        "max_depth": traces.max_depth,
        "vocab_size": int(h["vocab_size"]),
        "drafter": traces.drafter,
        "target": h.get("target"),
        "draft": h.get("draft"),
        "sampling": h.get("sampling"),
        "dtype": h.get("dtype"),
        "l2": l2,
        "fit": summary,
        "vllm": {"versions": list(SUPPORTED_VLLM_VERSIONS), "source": VLLM_SOURCE},
        **({"traces": sources["traces"]} if sources and "traces" in sources else {}),
    }
    if heldout is not None:
        ex = examples(heldout)
        auc = roc_auc(ex.columns(ACCEPTANCE_FEATURES) @ weight + bias, ex.y, ex.w)
        spec["heldout"] = {"examples": ex.tokens, "base_rate": round(ex.base_rate, 6),
                           "auc": None if math.isnan(auc) else round(auc, 4),
                           **({"traces": sources["heldout"]} if sources and "heldout" in sources else {})}
    (out / SPEC_FILE).write_text(json.dumps(spec, indent=2) + "\n")
    logits = (parity_x @ w32.T + b32)[:, 0]
    (out / PARITY_FILE).write_text(json.dumps({"features": parity_x.tolist(), "logits": logits.tolist()}) + "\n")
    return spec


__all__ = ["PARITY_ROWS", "export_acceptance", "fit_acceptance", "write_onnx"]
