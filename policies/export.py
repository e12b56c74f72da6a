"""Export a stable-baselines3 PPO depth policy (or a draft tree's verification-size policy) to ONNX,
check it, and load it back.

The observation width says which: ``len(FEATURE_NAMES)`` (the loop's depth features),
``len(ENGINE_FEATURE_NAMES)`` (engine-visible depth features) or ``len(SIZE_FEATURE_NAMES)`` (a size
policy: ``logits`` has one entry per verification size V of ``policy_config.json``'s ``verify_sizes``,
``action`` indexes them; load it with :func:`policies.load.load_tree_policy`).

An export directory holds

* ``policy.onnx`` — input ``obs`` float32 ``(batch, len(FEATURE_NAMES))``; outputs ``action`` int64
  ``(batch,)`` = argmax of ``logits`` float32 ``(batch, 2)`` (0 = STOP, 1 = CONTINUE). The graph is the
  policy's actor only (features extractor → actor MLP → action head); no observation normalisation
  is involved because the features are already in [0, 1].
* ``feature_spec.json`` — :func:`learn2draft.features.feature_spec`: how to build ``obs``.
* ``policy_config.json`` — ``max_depth``, the sampling settings, model names and training settings.
* ``export_check.json`` — the result of :func:`check_onnx` (agreement of onnxruntime's actions with
  the PyTorch policy's deterministic actions).
* ``parity.json`` — parity vectors (:func:`parity_vectors`): observations with the PyTorch policy's
  expected actions and logits, which any engine integration can replay with
  ``python -m policies.check EXPORT_DIR`` (numpy and onnxruntime only, :mod:`policies.check`).

The exporter is ``torch.onnx.export(..., dynamo=False)`` (TorchScript-based; the dynamo exporter
needs ``onnxscript``). The folder's names are in :mod:`policies.layout`; :func:`policies.load.load_policy` loads an
export with onnxruntime and the engine only.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from learn2draft.control import HYBRID_ACTION_MEANINGS
from learn2draft.features import (
    ENGINE_FEATURE_NAMES,
    FEATURE_NAMES,
    HYBRID_FEATURE_NAMES,
    PROFILE_FEATURE_NAMES,
    SERVE_FEATURE_NAMES,
    SIZE_FEATURE_NAMES,
    engine_feature_spec,
    feature_spec,
    hybrid_feature_spec,
    profile_feature_spec,
    serve_feature_spec,
    size_feature_spec,
)
from policies.check import logit_ties
from policies.controllers import OnnxController
from policies.layout import (
    CHECK_FILE,
    DEPTH_DIR,
    FEATURE_SPEC_FILE,
    ONNX_FILE,
    PARITY_FILE,
    POLICY_CONFIG_FILE,
    read_json,
)
from policies.load import run_settings

PARITY_FORMAT = "learn2draft-parity/1"
#: |logit_runtime − logit_expected| allowed by the parity check: float32 MLPs on other kernels
#: (GPU, other BLAS, fused ops) differ by ~1e-6 here; 1e-4 leaves room without hiding a wrong graph.
PARITY_LOGIT_ATOL = 1e-4
OPSET = 17


class ExportCheckError(RuntimeError):
    """onnxruntime's actions differ from the PyTorch policy's on some observations."""


class OnnxablePolicy(nn.Module):
    """The deterministic actor of an SB3 ``ActorCriticPolicy`` with a ``Discrete`` action space.

    ``forward(obs)``: obs float32 ``(batch, n_features)`` → ``(action int64 (batch,), logits float32 (batch, n_actions))``,
    with ``action = argmax(logits)`` — what ``policy.predict(obs, deterministic=True)`` returns.
    """

    def __init__(self, policy: nn.Module):
        super().__init__()
        from stable_baselines3.common.policies import ActorCriticPolicy, BaseModel

        if not isinstance(policy, ActorCriticPolicy):
            raise TypeError(f"Expected an SB3 ActorCriticPolicy (e.g. PPO's), got {type(policy).__name__}.")
        self._base_extract = BaseModel.extract_features
        self.policy = policy

    def forward(self, obs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        p = self.policy
        features = self._base_extract(p, obs, p.pi_features_extractor)
        logits = p.action_net(p.mlp_extractor.forward_actor(features))
        return torch.argmax(logits, dim=-1), logits


def export_onnx(model: Any, path: str | Path, opset: int = OPSET) -> Path:
    """Write the deterministic actor of an SB3 PPO ``model`` to ``path`` as ONNX (dynamic batch size).

    Raises:
        TypeError: the model's policy is not an ``ActorCriticPolicy``.
        ValueError: the observation space is not a flat Box of one of the feature sets' widths, or the
            action space is not ``Discrete``.
    """
    from gymnasium import spaces

    obs_space, act_space = model.observation_space, model.action_space
    n = len(FEATURE_NAMES)
    widths = (n, n + len(PROFILE_FEATURE_NAMES), n + len(HYBRID_FEATURE_NAMES), len(ENGINE_FEATURE_NAMES),
              len(SIZE_FEATURE_NAMES), len(SERVE_FEATURE_NAMES))
    if not (isinstance(obs_space, spaces.Box) and len(obs_space.shape) == 1 and obs_space.shape[0] in widths):
        raise ValueError(f"Expected a Box observation space of shape ({n},) (the loop's features), "
                         f"({n + len(PROFILE_FEATURE_NAMES)},) (those and the profile features), "
                         f"({n + len(HYBRID_FEATURE_NAMES)},) (those and a hybrid drafter's), "
                         f"({len(ENGINE_FEATURE_NAMES)},) (engine-visible features), ({len(SIZE_FEATURE_NAMES)},) "
                         f"(a tree's verification-size features) or ({len(SERVE_FEATURE_NAMES)},) (a load-aware "
                         f"policy's), got {obs_space}.")
    if not isinstance(act_space, spaces.Discrete):
        raise ValueError(f"Expected a Discrete action space, got {act_space}.")
    path = Path(path)
    module = OnnxablePolicy(model.policy).to("cpu").eval()
    dummy = torch.zeros(1, obs_space.shape[0], dtype=torch.float32)
    with torch.no_grad():
        torch.onnx.export(
            module, (dummy,), str(path), input_names=["obs"], output_names=["action", "logits"],
            dynamic_axes={"obs": {0: "batch"}, "action": {0: "batch"}, "logits": {0: "batch"}},
            opset_version=opset, dynamo=False,
        )
    import onnx

    onnx.checker.check_model(onnx.load(str(path)))
    return path


def check_onnx(model: Any, onnx_path: str | Path, observations: np.ndarray) -> dict:
    """Compare onnxruntime's actions with the PyTorch policy's deterministic actions.

    Args:
        model: the SB3 model (reference: ``model.predict(obs, deterministic=True)``).
        onnx_path: the exported graph.
        observations: float32 ``(n, len(FEATURE_NAMES))``.

    An action that differs where the PyTorch logits' best two are within the parity tie margin
    (``2 × PARITY_LOGIT_ATOL``) is a tie, not a disagreement: float rounding may pick either there
    (seen in CI: one of 2,112 observations, |Δlogit| 3.7e-9).

    Returns:
        ``{"n": n, "agreement": share of observations whose actions match or tie, in [0, 1],
        "disagreements": count of differing actions that are not ties, "ties": count of differing actions
        at a tie, "max_abs_logit_diff": max |logits_onnx − logits_torch|, "stop_fraction": share of STOP
        actions}``.
    """
    n_features = model.observation_space.shape[0]
    obs = np.asarray(observations, dtype=np.float32).reshape(-1, n_features)
    ref_actions, _ = model.predict(obs, deterministic=True)
    ref_actions = np.asarray(ref_actions).reshape(-1)
    module = OnnxablePolicy(model.policy).to("cpu").eval()
    with torch.no_grad():
        _, ref_logits = module(torch.as_tensor(obs))
    ctrl = OnnxController(onnx_path, n_features=n_features)
    logits = ctrl.logits(obs)
    actions = ctrl.actions(obs)
    differ = actions != ref_actions
    tied = differ & logit_ties(ref_logits.numpy(), 2 * PARITY_LOGIT_ATOL)
    wrong = differ & ~tied
    return {
        "n": int(obs.shape[0]),
        "agreement": float(1.0 - wrong.mean()) if obs.shape[0] else 1.0,
        "disagreements": int(wrong.sum()),
        "ties": int(tied.sum()),
        "max_abs_logit_diff": float(np.abs(logits - ref_logits.numpy()).max()) if obs.shape[0] else 0.0,
        "stop_fraction": float((actions == 0).mean()) if obs.shape[0] else 0.0,
    }


def _spread(rows: list[int], count: int) -> list[int]:
    """Up to ``count`` entries of ``rows`` evenly spaced over it (all of them when it is short enough)."""
    if len(rows) <= count:
        return list(rows)
    return [rows[i] for i in np.linspace(0, len(rows) - 1, count).round().astype(int)]


def parity_vectors(model: Any, observations: np.ndarray, max_vectors: int = 128,
                   feature_names: tuple[str, ...] = FEATURE_NAMES) -> dict:
    """Parity vectors for an exported policy: observations with the PyTorch policy's expected actions
    and logits, for :mod:`policies.check` and any engine integration to replay.

    The vectors are the all-zeros and all-ones observations plus up to ``max_vectors`` − 2 rows of
    ``observations``: rows whose action is the rarer one (up to half), so that both actions appear
    whenever the policy takes both, then rows evenly spaced over the rest, so that every part of a
    rollout is represented (e.g. each hardware profile of a profile-conditioned policy).

    Args:
        model: the SB3 model (reference: its deterministic actor, :class:`OnnxablePolicy`).
        observations: float32 ``(n, n_features)``.
        feature_names: the names of the ``n_features`` observation entries, in order.

    Returns:
        a JSON-serialisable dict: ``format``, ``input`` ("obs"), ``feature_names``,
        ``observations`` (list of lists of float32 values), ``actions`` (ints), ``logits`` (lists),
        ``tolerance`` (``logits_atol``; actions must match exactly except where the expected logits
        are within ``tie_margin`` of each other).
    """
    n_feat = len(feature_names)
    obs = np.asarray(observations, dtype=np.float32).reshape(-1, n_feat)
    obs = np.concatenate([np.zeros((1, n_feat), np.float32), np.ones((1, n_feat), np.float32), obs])
    module = OnnxablePolicy(model.policy).to("cpu").eval()
    with torch.no_grad():
        actions, logits = module(torch.as_tensor(obs))
    actions = actions.numpy()
    if len(obs) > max_vectors:
        values, counts = np.unique(actions[2:], return_counts=True)
        rare = values[np.argmin(counts)] if len(values) > 1 else None
        rare_rows = [i for i in range(2, len(obs)) if actions[i] == rare]
        keep = [0, 1] + _spread(rare_rows, max_vectors // 2)
        taken = set(keep)
        keep += _spread([i for i in range(2, len(obs)) if i not in taken], max_vectors - len(keep))
        keep.sort()
        obs, actions, logits = obs[keep], actions[keep], logits[keep]
    return {
        "format": PARITY_FORMAT,
        "input": "obs",
        "outputs": ["action", "logits"],
        "feature_names": list(feature_names),
        "reference": "the PyTorch policy (stable-baselines3 actor, deterministic) at export time",
        "observations": obs.tolist(),
        "actions": [int(a) for a in actions],
        "logits": logits.numpy().tolist(),
        "tolerance": {"logits_atol": PARITY_LOGIT_ATOL, "tie_margin": 2 * PARITY_LOGIT_ATOL},
    }


def write_parity(model: Any, out_dir: str | Path, observations: np.ndarray, max_vectors: int = 128,
                 feature_names: tuple[str, ...] = FEATURE_NAMES) -> Path:
    """Write :func:`parity_vectors` to ``out_dir/parity.json``; returns the path."""
    path = Path(out_dir) / PARITY_FILE
    path.write_text(json.dumps(parity_vectors(model, observations, max_vectors, feature_names)))
    return path


@dataclass
class ExportResult:
    """Where an export went and how its check went (``check``: see :func:`check_onnx`)."""

    directory: Path
    onnx_path: Path
    check: dict


def export_policy(
    model: Any,
    out_dir: str | Path,
    max_depth: int,
    config: dict | None = None,
    observations: np.ndarray | None = None,
    n_random: int = 2048,
    seed: int = 0,
    verify_sizes: tuple[int, ...] | None = None,
    vocab_size: int | None = None,
    serve: dict | None = None,
) -> ExportResult:
    """Export ``model`` to ``out_dir`` (``policy.onnx``, ``feature_spec.json``, ``policy_config.json``,
    ``export_check.json``, ``parity.json``) and check it.

    Args:
        model: a trained SB3 PPO model on :class:`envs.SpecDecodeEnv` (or the replay env; its observation
            width says what it reads: the loop's features, those plus the profile features, the engine-visible
            or the tree-size ones; the feature spec written follows it).
        out_dir: created if missing; existing export files are overwritten.
        max_depth: the training environment's ``max_depth`` (the decoder must use the same).
        config: extra JSON-serialisable settings stored in ``policy_config.json`` (sampling, model
            names, training settings, …).
        observations: recorded observations float32 ``(n, len(FEATURE_NAMES))`` to check on (e.g. the
            last rollout buffer); ``n_random`` uniform [0, 1] observations drawn with ``seed`` are added.
        verify_sizes: for a size policy (observation width ``len(SIZE_FEATURE_NAMES)``), the V of each
            action (required there; listed in ``policy_config.json`` as ``verify_sizes`` and ``actions``).
        vocab_size: the target's vocabulary size V the policy was trained with, recorded in ``feature_spec.json``
            (``last_entropy`` is divided by ln V); None records none.
        serve: for a load-aware policy (:class:`envs.serve.ServeReplayEnv`: observation
            :data:`learn2draft.features.SERVE_FEATURE_NAMES`, actions γ = 0..max_depth), ``{"serve": {"batch_scale",
            "context_scale", …}}`` as recorded in ``policy_config.json``: its feature scales.

    Returns:
        :class:`ExportResult`.

    Raises:
        ExportCheckError: onnxruntime disagrees with the PyTorch policy on any observation
            (the files stay on disk for inspection, with the check result).
        ValueError: a size policy without ``verify_sizes``, or with as many sizes as it has actions; a load-aware
            policy without ``serve``.
    """
    n_features = model.observation_space.shape[0]
    load_aware = n_features == len(SERVE_FEATURE_NAMES) and model.action_space.n == max_depth + 1
    if load_aware and not serve:
        raise ValueError("A load-aware policy (serve features, one γ per step) needs serve={'serve': {'batch_scale': "
                         "…, 'context_scale': …}}: its feature scales.")
    size = n_features == len(SIZE_FEATURE_NAMES)
    if size and (verify_sizes is None or len(verify_sizes) != model.action_space.n):
        raise ValueError(f"A verification-size policy ({model.action_space.n} actions) needs verify_sizes, one V per "
                         f"action, got {verify_sizes!r}.")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    onnx_path = export_onnx(model, out / ONNX_FILE)
    engine = n_features == len(ENGINE_FEATURE_NAMES)
    conditioned = n_features == len(FEATURE_NAMES) + len(PROFILE_FEATURE_NAMES)
    # a hybrid drafter's policy: the loop's and the hybrid features, three actions (STOP, lookup, neural)
    hybrid = n_features == len(FEATURE_NAMES) + len(HYBRID_FEATURE_NAMES) and model.action_space.n == 3
    if load_aware:
        return _export_load_aware(model, out, onnx_path, max_depth, config, observations, n_random, seed, serve)
    names = (ENGINE_FEATURE_NAMES if engine else SIZE_FEATURE_NAMES if size
             else (*FEATURE_NAMES, *PROFILE_FEATURE_NAMES) if conditioned
             else (*FEATURE_NAMES, *HYBRID_FEATURE_NAMES) if hybrid else FEATURE_NAMES)
    spec = (engine_feature_spec(max_depth) if engine else size_feature_spec(max_depth) if size
            else profile_feature_spec(max_depth) if conditioned
            else hybrid_feature_spec(max_depth) if hybrid else feature_spec(max_depth))
    if vocab_size is not None:
        spec["vocab_size"] = int(vocab_size)
    (out / FEATURE_SPEC_FILE).write_text(json.dumps(spec, indent=2))
    actions = ({str(i): f"verify V = {int(v)} tree nodes (capped at the nodes drafted)" for i, v in enumerate(verify_sizes)}
               if size else {str(k): v for k, v in HYBRID_ACTION_MEANINGS.items()} if hybrid
               else {"0": "STOP (verify now)", "1": "CONTINUE (draft one more token)"})
    policy_config = {
        "format": "learn2draft-policy/1",
        "features": ("engine" if engine else "size" if size else "profile" if conditioned
                     else "hybrid" if hybrid else "full"),
        "max_depth": int(max_depth),
        "actions": actions,
        **({"verify_sizes": [int(v) for v in verify_sizes]} if size else {}),
        "onnx": {"file": ONNX_FILE, "input": "obs", "outputs": ["action", "logits"], "opset": OPSET},
        **(config or {}),
    }
    (out / POLICY_CONFIG_FILE).write_text(json.dumps(policy_config, indent=2, default=str))

    rng = np.random.default_rng(seed)
    parts = [rng.random((n_random, n_features), dtype=np.float32)]
    if observations is not None and len(observations):
        parts.insert(0, np.asarray(observations, dtype=np.float32).reshape(-1, n_features))
    obs = np.concatenate(parts)
    check = check_onnx(model, onnx_path, obs)
    check["recorded"] = int(obs.shape[0] - n_random)
    check["random"] = int(n_random)
    (out / CHECK_FILE).write_text(json.dumps(check, indent=2))
    # parity vectors from the recorded observations when there are enough of them, else with the random ones too
    write_parity(model, out, parts[0] if len(parts) == 2 and len(parts[0]) >= 128 else obs, feature_names=names)
    if check["agreement"] < 1.0:
        raise ExportCheckError(
            f"ONNX export disagrees with the PyTorch policy on {check['disagreements']} of {check['n']} "
            f"observations ({check['ties']} more differ at a logit tie; agreement {check['agreement']:.6f}, "
            f"max |Δlogit| {check['max_abs_logit_diff']:.2e}); "
            f"see {out / CHECK_FILE}."
        )
    return ExportResult(out, onnx_path, check)


def _export_load_aware(model: Any, out: Path, onnx_path: Path, max_depth: int, config: dict | None,
                       observations: np.ndarray | None, n_random: int, seed: int, serve: dict) -> ExportResult:
    """:func:`export_policy` for a load-aware policy: the serve feature spec (with its scales), γ actions, the
    check and the parity vectors (see :func:`export_policy`)."""
    sc = serve["serve"]
    spec = serve_feature_spec(max_depth, sc["batch_scale"], sc["context_scale"])
    (out / FEATURE_SPEC_FILE).write_text(json.dumps(spec, indent=2))
    policy_config = {
        "format": "learn2draft-policy/1", "features": "serve", "max_depth": int(max_depth),
        "actions": {str(k): f"γ = {k}: every running row drafts up to {k} tokens this step" for k in range(max_depth + 1)},
        "onnx": {"file": ONNX_FILE, "input": "obs", "outputs": ["action", "logits"], "opset": OPSET},
        **(config or {}),
    }
    (out / POLICY_CONFIG_FILE).write_text(json.dumps(policy_config, indent=2, default=str))
    n_features = len(SERVE_FEATURE_NAMES)
    parts = [np.random.default_rng(seed).random((n_random, n_features), dtype=np.float32)]
    if observations is not None and len(observations):
        parts.insert(0, np.asarray(observations, dtype=np.float32).reshape(-1, n_features))
    obs = np.concatenate(parts)
    check = check_onnx(model, onnx_path, obs)
    check["recorded"], check["random"] = int(obs.shape[0] - n_random), int(n_random)
    (out / CHECK_FILE).write_text(json.dumps(check, indent=2))
    write_parity(model, out, parts[0] if len(parts) == 2 and len(parts[0]) >= 128 else obs,
                 feature_names=SERVE_FEATURE_NAMES)
    if check["agreement"] < 1.0:
        raise ExportCheckError(f"ONNX export disagrees with the PyTorch policy on {check['disagreements']} of "
                               f"{check['n']} observations; see {out / CHECK_FILE}.")
    return ExportResult(out, onnx_path, check)


def _load_run_model(path: Path):
    """The PPO model of a run's ``model.zip``.

    Raises:
        ValueError: the file is not a whole model archive (a copy cut short, a kill while it was written, another
            file): one sentence saying so and what to do (no doubled ``Error:`` from stable-baselines3's message).
    """
    import zipfile

    from stable_baselines3 import PPO

    checkpoints = sorted(path.parent.glob("checkpoints/ppo_*_steps.zip"), key=lambda p: p.stat().st_mtime)
    advice = (f"copy the newest whole checkpoint over it (e.g. `cp {checkpoints[-1]} {path}`) and export again, "
              f"or retrain" if checkpoints else "retrain the run (learn2draft train --out RUN --overwrite)")
    if not zipfile.is_zipfile(path):
        raise ValueError(f"{path} is damaged: not a whole zip archive (a copy cut short or a kill while it was written "
                         f"leaves it so); {advice}.")
    try:
        return PPO.load(str(path), device="cpu")
    except Exception as e:  # noqa: BLE001 (a damaged archive member: ValueError, KeyError, RuntimeError, EOFError, ...)
        msg = " ".join(str(e).split())
        msg = msg[len("error:"):].strip() if msg.lower().startswith("error:") else msg
        raise ValueError(f"{path} is damaged ({msg or e.__class__.__name__}); {advice}.") from None


def reexport_run(run_dir: str | Path) -> ExportResult:
    """Export a training run's ``model.zip`` again into ``run_dir/policy`` with this version's export
    (e.g. to add the parity vectors of exports written before they existed), keeping the settings
    recorded in the earlier ``policy_config.json`` (or the run's ``config.json``).

    Raises:
        FileNotFoundError: ``run_dir`` holds no ``model.zip`` (only training runs can be re-exported).
        ValueError: its ``model.zip`` is damaged (the message says what to do).
        ExportCheckError: as :func:`export_policy`.
    """
    run = Path(run_dir)
    if not (run / "model.zip").is_file():
        raise FileNotFoundError(f"{run / 'model.zip'} is missing: only a training run (python -m train --out RUN) can "
                                "be re-exported; retrain, or check the export you have with python -m policies.check.")
    old = run / DEPTH_DIR / POLICY_CONFIG_FILE
    config = json.loads(old.read_text()) if old.is_file() else run_settings(run)
    max_depth = int(config.get("max_depth") or run_settings(run)["max_depth"])
    for key in ("format", "features", "max_depth", "actions", "onnx"):  # written by export_policy itself
        config.pop(key, None)
    old_spec = run / DEPTH_DIR / FEATURE_SPEC_FILE
    vocab_size = (read_json(old_spec) if old_spec.is_file() else {}).get("vocab_size") or run_settings(run).get("vocab_size")
    model = _load_run_model(run / "model.zip")
    return export_policy(model, run / DEPTH_DIR, max_depth, config=config, vocab_size=vocab_size)


def build_parser():
    """The command line of ``python -m policies.export`` (an ``argparse.ArgumentParser``)."""
    import argparse

    p = argparse.ArgumentParser(prog="python -m policies.export", allow_abbrev=False,
                                description="Re-export a training run's policy (model.zip) into RUN_DIR/policy with "
                                            "this version's export: ONNX, feature spec, config, check, parity vectors.")
    p.add_argument("run_dir", help="a directory written by python -m train")
    return p


def main(argv: list[str] | None = None) -> int:
    """``python -m policies.export RUN_DIR``: re-export a training run's policy (see :func:`reexport_run`)."""
    import sys

    from learn2draft.cli import prepare_parser

    args = prepare_parser(build_parser()).parse_args(argv)
    try:
        res = reexport_run(args.run_dir)
    except (FileNotFoundError, ValueError, ExportCheckError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(json.dumps({"policy": str(res.directory), "check": res.check}, indent=2))
    return 0


__all__ = ["ExportCheckError", "ExportResult", "OnnxablePolicy", "check_onnx", "export_onnx", "export_policy", "build_parser", "main",
           "parity_vectors", "reexport_run", "write_parity"]


if __name__ == "__main__":
    raise SystemExit(main())
