"""``python -m policies.check EXPORT_DIR``: replay an exported policy's parity vectors with
onnxruntime and numpy only, and say whether the export is consistent and reproduces them.

Any engine integration can run the same check on its own runtime: ``parity.json`` (written by
:func:`policies.export.export_policy`) holds observations (float32, in the order of
``feature_spec.json``), the expected ``action`` (int, 0 = STOP, 1 = CONTINUE) and ``logits``
(float32, one per action) of the PyTorch policy the graph was exported from, and the tolerance
(``logits_atol``; an action may differ only where the expected logits are within ``tie_margin``).

Standard output holds the JSON report only; PASS / FAIL goes to standard error. Checked: the four
files exist and parse; ``feature_spec.json``, ``parity.json`` and the ONNX
graph's input agree on the features; ``policy_config.json``'s ``max_depth`` is an integer ≥ 1 equal to
``feature_spec.json``'s and its drafter is known; onnxruntime's actions and logits match the vectors. Exit
status 0 when everything passes, 1 when a check fails, 2 on bad input (no such directory, a
missing file, a JSON file that does not parse). This module imports neither torch nor learn2draft's engine
(only its names, :mod:`learn2draft.names`).

Example::

    python -m policies.check policies/defaults/lookup
    python -m policies.check runs/default          # a training run: its export in policy/
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

from policies.layout import EXPORT_FILES as FILES
from policies.layout import (
    FEATURE_SPEC_FILE,
    ONNX_FILE,
    PARITY_FILE,
    POLICY_CONFIG_FILE,
    config_problems,
    read_json,
    resolve_export_dir,
)


def check_export(directory: str | Path) -> dict:
    """Run every check on an export directory (or a training run holding one in ``policy/``).

    Returns:
        ``{"directory", "passed": bool, "vectors": n, "action_mismatches": count (ties excused),
        "ties": count, "max_abs_logit_diff": float, "problems": [str, ...]}``.

    Raises:
        FileNotFoundError: the directory or one of :data:`FILES` is missing.
        ValueError: a file does not parse (the message names it), or ``parity.json`` has an unknown format.
    """
    import onnxruntime as ort

    d, spec, cfg, parity = _read_export(directory)
    names = [f.get("name") if isinstance(f, dict) else f for f in spec.get("features", [])]
    problems = config_problems(d, cfg, spec) + _feature_problems(spec, parity, names)
    sess, inp = _open_graph(ort, d, cfg, names, problems)
    obs, exp_actions, exp_logits = _parity_vectors(d, parity, problems)
    tol = parity.get("tolerance", {})
    atol, tie = float(tol.get("logits_atol", 1e-4)), float(tol.get("tie_margin", 2e-4))
    result = {"directory": str(d), "vectors": int(len(obs)), "action_mismatches": 0, "ties": 0,
              "max_abs_logit_diff": None}
    if obs.ndim != 2 or len(obs) != len(exp_actions) or exp_logits.shape[0] != len(obs):
        problems.append(f"parity.json: {len(obs)} observations, {len(exp_actions)} actions, "
                        f"{exp_logits.shape[0]} logit rows")
    elif not problems:
        _replay(sess, inp, obs, exp_actions, exp_logits, atol, tie, problems, result)
    result["problems"] = problems
    result["passed"] = not problems
    return result


def _read_export(directory: str | Path) -> tuple:
    """Find the export and read its files: ``(dir, feature spec, policy config, parity)``."""
    d = resolve_export_dir(directory)
    if d.is_file():
        raise FileNotFoundError(f"{directory} is a file: pass the export directory that holds it ({d.parent}).")
    if not d.is_dir():
        raise FileNotFoundError(f"{directory}: no such directory (an export, e.g. policies/defaults/lookup, or a "
                                "training run).")
    for name in FILES:
        if not (d / name).is_file():
            hint = (" (exports written before parity vectors existed have none: re-export the training run with "
                    "`python -m policies.export RUN_DIR`)"
                    if name == PARITY_FILE else "")
            raise FileNotFoundError(f"{d / name} is missing{hint}.")
    spec, cfg, parity = (read_json(d / name) for name in (FEATURE_SPEC_FILE, POLICY_CONFIG_FILE, PARITY_FILE))
    if not str(parity.get("format", "")).startswith("learn2draft-parity/"):
        raise ValueError(f"{d / 'parity.json'}: unknown format {parity.get('format')!r}.")
    return d, spec, cfg, parity


def _feature_problems(spec: dict, parity: dict, names: list[str]) -> list[str]:
    """Check that feature_spec.json and parity.json agree on the features."""
    problems: list[str] = []
    if parity.get("feature_names") != names:
        problems.append(f"parity.json's feature names {parity.get('feature_names')} differ from feature_spec.json's "
                        f"{names}")
    if list(spec.get("shape", [])) != [len(names)]:
        problems.append(f"feature_spec.json: shape {spec.get('shape')} but {len(names)} features listed")
    return problems


def _open_graph(ort, d: Path, cfg: dict, names: list[str], problems: list[str]) -> tuple:
    """Load the ONNX graph with onnxruntime and check its input width and outputs: ``(session, input)``."""
    onnx_cfg = cfg.get("onnx", {})
    opts = ort.SessionOptions()
    opts.intra_op_num_threads = 1
    try:
        sess = ort.InferenceSession(str(d / onnx_cfg.get("file", ONNX_FILE)), opts,
                                    providers=["CPUExecutionProvider"])
    except Exception as e:  # onnxruntime's InvalidProtobuf / InvalidGraph / Fail
        raise ValueError(f"{d / onnx_cfg.get('file', ONNX_FILE)}: onnxruntime cannot load it ({e}).") from None
    inp = sess.get_inputs()[0]
    width = inp.shape[-1]
    if isinstance(width, int) and width != len(names):
        problems.append(f"the ONNX graph takes {width} features, feature_spec.json lists {len(names)}")
    outputs = [o.name for o in sess.get_outputs()]
    for want in ("action", "logits"):
        if want not in outputs:
            problems.append(f"the ONNX graph has no output {want!r} (outputs: {outputs})")
    return sess, inp


def _parity_vectors(d: Path, parity: dict, problems: list[str]) -> tuple:
    """Read the parity vectors as arrays: ``(observations, actions, logits)``; flag non-finite values."""
    try:
        obs = np.asarray(parity["observations"], dtype=np.float32)
        exp_actions = np.asarray(parity["actions"], dtype=np.int64)
        exp_logits = np.asarray(parity["logits"], dtype=np.float32)
    except (KeyError, TypeError, ValueError) as e:
        raise ValueError(f"{d / 'parity.json'}: 'observations', 'actions' and 'logits' must be rectangular lists of "
                         f"numbers (one row per vector, every row as long) ({str(e).splitlines()[0][:120]}).") from None
    if not (np.isfinite(obs).all() and np.isfinite(exp_logits).all()):
        problems.append("parity.json holds NaN or infinite values")
    return obs, exp_actions, exp_logits


def logit_ties(logits: np.ndarray, margin: float) -> np.ndarray:
    """Which rows' best two logits are within ``margin`` of each other (there either action is right).

    Args:
        logits: float ``(n, n_actions)``, one row per observation.
        margin: the tie margin, in logit units (e.g. ``tie_margin`` of ``parity.json``).

    Returns:
        bool ``(n,)``; all False when there is a single action.
    """
    logits = np.asarray(logits)
    if logits.ndim != 2 or logits.shape[1] < 2:
        return np.zeros(len(logits), bool)
    top2 = np.sort(logits, axis=1)[:, -2:]
    return (top2[:, 1] - top2[:, 0]) < margin


def _replay(sess, inp, obs: np.ndarray, exp_actions: np.ndarray, exp_logits: np.ndarray, atol: float, tie: float,
            problems: list[str], result: dict) -> None:
    """Run the graph on the vectors and compare its actions (ties excused) and logits with the expected ones."""
    actions, logits = sess.run(["action", "logits"], {inp.name: obs})
    diff = float(np.abs(logits - exp_logits).max()) if len(obs) else 0.0
    if not np.isfinite(diff):  # NaN never compares greater than a tolerance: report it, keep the JSON valid
        problems.append("logits are NaN or infinite (in parity.json or from the graph)")
        diff = None
    is_tie = logit_ties(exp_logits, tie)
    wrong = (np.asarray(actions).reshape(-1) != exp_actions) & ~is_tie
    result.update(action_mismatches=int(wrong.sum()), ties=int(is_tie.sum()), max_abs_logit_diff=diff)
    if wrong.any():
        problems.append(f"{int(wrong.sum())} of {len(obs)} actions differ from the expected ones "
                        f"(first at vector {int(np.argmax(wrong))})")
    if diff is not None and diff > atol:
        problems.append(f"logits differ by up to {diff:.3g} (> {atol:g})")

def build_parser() -> argparse.ArgumentParser:
    """The command line of ``python -m policies.check``."""
    p = argparse.ArgumentParser(prog="python -m policies.check", description=__doc__, allow_abbrev=False,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("export_dir", help="a policy export directory, or a training run holding one in policy/")
    return p


def main(argv: list[str] | None = None) -> int:
    """CLI entry point: prints one JSON report; exit status 0 (pass), 1 (fail) or 2 (bad input)."""
    from learn2draft.cli import prepare_parser

    args = prepare_parser(build_parser()).parse_args(argv)
    try:
        report = check_export(args.export_dir)
    except (FileNotFoundError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(json.dumps(report, indent=2))  # standard output: the JSON report only
    print("PASS" if report["passed"] else "FAIL: " + "; ".join(report["problems"]), file=sys.stderr)
    return 0 if report["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
