"""PPO training of draft-tree policies (``python -m train --tree``), as Learning to Draft (arXiv 2603.01639) does it.

:func:`train_tree` is what :func:`train.launch.run` runs for ``config.tree``; the phases it shares with chain runs
are in :mod:`train.phases`, the callbacks in :mod:`train.callbacks`. Reading order, top to bottom:

1. environments: :class:`envs.tree.TreeSizeEnv` for the size policy and :class:`envs.tree.TreeDepthEnv` for the
   depth policy, each with its own drafter (each keeps its own generation going between phases);
2. warm-up and the autoregressive reference rate (the reward scale, as for chains);
3. phases — with ``--policies depth,size``: per round, the size policy under the current depth
   controller (uniformly random depths in round 1, as LTD's first phase; the trained depth policy after),
   then the depth policy under the trained size policy; the same two PPO models continue across rounds.
   ``--policies size`` or ``depth`` alone: one phase, the other decision fixed (``tree_depth`` or random
   depths; ``verify_size``). Each phase is a stable-baselines3 PPO run with the chain's machinery (CSV and
   Weights & Biases logs — one W&B run per phase — per-cycle statistics, checkpoints), plus
   :class:`train.callbacks.ActionDistributionCallback`: each policy's action distribution per rollout, and a
   :class:`train.callbacks.PolicyCollapseWarning` (printed ``WARNING:``) when one action takes more than 95% of a rollout
   (LTD's size policy was reported to collapse to a constant);
4. saves ``model.zip`` (depth) / ``size_model.zip`` (size) and exports ``policy/`` and ``size_policy/``
   (:func:`policies.export.export_policy`, parity vectors included) and ``tree.json`` (the tree settings,
   :mod:`policies.layout`);
5. optionally a quick held-out check: the learned tree (:func:`policies.load.load_tree_policy`) against a fixed
   tree and autoregressive decoding, interleaved per prompt through eval's runner (a sanity check, not a benchmark).
"""

from __future__ import annotations

import json
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
from stable_baselines3.common.monitor import Monitor
from stable_baselines3.common.vec_env import DummyVecEnv

from learn2draft.drafters import make_drafter
from learn2draft.features import feature_spec
from learn2draft.models import ModelPair
from learn2draft.tree import FixedTreeController
from policies.controllers import SB3Controller
from policies.export import export_policy
from policies.layout import DEPTH_DIR, SIZE_DIR, TREE_FILE, TREE_FORMAT
from policies.load import load_tree_policy
from train import callbacks, phases
from train.callbacks import ActionDistributionCallback, CycleStatsCallback
from train.config import TREE_ENV_IDS, TrainConfig

#: What each action of each policy means (the size policy's: see :func:`_meanings`).
DEPTH_MEANINGS = {0: "STOP (verify now)", 1: "CONTINUE (draft one more tree level)"}


class _SizeFromModel:
    """``size_features -> V``: an SB3 size model's deterministic action mapped to the V set (the decoder
    caps V at the nodes drafted)."""

    def __init__(self, model: Any, verify_sizes: tuple[int, ...]):
        self.model, self.verify_sizes = model, tuple(verify_sizes)

    def __call__(self, size_features: np.ndarray) -> int:
        a, _ = self.model.predict(np.asarray(size_features, dtype=np.float32), deterministic=True)
        return self.verify_sizes[int(np.asarray(a).reshape(-1)[0])]


def phase_schedule(cfg: TrainConfig) -> list[tuple[str, int]]:
    """``[(policy, round), ...]``: size then depth per round for both policies; one phase for one."""
    pols = tuple(cfg.policies)
    if set(pols) == {"depth", "size"}:
        return [(p, r) for r in range(cfg.rounds) for p in ("size", "depth")]
    return [(pols[0], 0)]


def tree_settings(cfg: TrainConfig, trained: list[str], run_config: dict) -> dict:
    """The ``tree.json`` written next to the exports (read by :func:`policies.load.load_tree_policy`)."""
    return {
        "format": TREE_FORMAT,
        "policies": trained,
        "width": cfg.tree_width, "top_k": cfg.tree_top_k, "max_depth": cfg.max_depth,
        "verify_sizes": list(cfg.verify_sizes),
        "verify_size": None if "size" in trained else cfg.verify_size,
        "tree_depth": None if "depth" in trained else cfg.tree_depth,
        "drafter": cfg.drafter, "head": run_config["head"], "target": run_config["target"],
        "draft": run_config["draft"], "sampling": run_config["sampling"], "max_new_tokens": cfg.max_new_tokens,
        "reward_scale": run_config["reward_scale_used"],
        "trained_with": "python -m train --tree",
    }


# --------------------------------------------------------------------------- the tree run, phase by phase
def _tree_envs(pair: ModelPair, cfg: TrainConfig, prompts: list) -> dict[str, Any]:
    """One environment per trained policy, each with its own drafter (a drafter holds the state of one
    generation): :class:`envs.tree.TreeSizeEnv` (``"size"``) and :class:`envs.tree.TreeDepthEnv` (``"depth"``)."""
    from envs.tree import TreeDepthEnv, TreeSizeEnv

    pols = tuple(cfg.policies)
    common = dict(sampling=cfg.sampling(), max_new_tokens=cfg.max_new_tokens, max_depth=cfg.max_depth,
                  width=cfg.tree_width, top_k=cfg.tree_top_k)
    envs: dict[str, Any] = {}
    if "size" in pols:
        envs["size"] = TreeSizeEnv(pair, prompts, drafter=make_drafter(cfg.drafter, pair, head=cfg.head),
                                   depth=cfg.tree_depth, verify_sizes=cfg.verify_sizes, **common)
    if "depth" in pols:
        envs["depth"] = TreeDepthEnv(pair, prompts, drafter=make_drafter(cfg.drafter, pair, head=cfg.head),
                                     size=cfg.verify_size, episode=cfg.episode, **common)
    return envs


def _meanings(cfg: TrainConfig) -> dict[str, dict[int, str]]:
    """Per policy, action → description (for the action-distribution callback)."""
    return {"depth": DEPTH_MEANINGS, "size": {i: f"V={v}" for i, v in enumerate(cfg.verify_sizes)}}


def _run_phase(policy: str, rnd: int, env, models: dict, cfg: TrainConfig, out: Path, config: dict,
               stop) -> tuple[dict, list[dict], bool]:
    """One PPO phase of ``policy`` in round ``rnd`` (0-based) under the other policy as trained so far, with its
    own W&B run and logs (``logs/<policy>-round<r>``); the policy's PPO model is created on its first phase
    and continues after.

    Returns:
        ``(row, collapses, interrupted)``: the phase's summary for ``metrics.json``, its collapse warnings
        and whether Ctrl-C or SIGTERM stopped it.
    """
    from wandb.sdk.lib.runid import generate_id

    other = "size" if policy == "depth" else "depth"
    if other in models:  # the other policy as trained so far decides its part
        if policy == "size":
            env.set_depth(SB3Controller(models["depth"], max_depth=cfg.max_depth))
        else:
            env.set_size(_SizeFromModel(models["size"], cfg.verify_sizes))
    name = f"{policy}-round{rnd + 1}"
    if policy not in models:
        models[policy] = phases.new_ppo(cfg, DummyVecEnv([lambda env=env: Monitor(env)]))
    model = models[policy]
    wandb_run = callbacks.init_wandb(replace(cfg, run_name=f"{cfg.run_name or out.name}-{name}"), out,
                                     {**config, "phase": name, "wandb_run_id": generate_id()})
    interrupted = False
    try:
        phases.set_logger(model, out / "logs" / name, wandb_run, verbose=cfg.verbose)
        cycle_cb = CycleStatsCallback(wandb_run)
        action_cb = ActionDistributionCallback(policy, _meanings(cfg)[policy], wandb_run=wandb_run)
        cbs = [cycle_cb, action_cb] + ([phases.checkpoint_callback(cfg, out / "checkpoints" / name, f"ppo_{policy}")]
                                       if cfg.checkpoint_every else [])
        steps = (cfg.size_timesteps or cfg.timesteps) if policy == "size" else cfg.timesteps
        t0, before = time.perf_counter(), model.num_timesteps
        print(f"[{name}] PPO for {steps} timesteps …", file=sys.stderr)
        interrupted = phases.learn(model, cfg, cbs, steps, stop)
        row = {"phase": name, "policy": policy, "round": rnd + 1, "timesteps": int(model.num_timesteps - before),
               "seconds": time.perf_counter() - t0, "ep_rew_mean": phases.episode_reward_mean(model),
               "cycles": cycle_cb.summary(), "action_fractions": action_cb.last_fractions,
               "collapsed": bool(action_cb.collapses)}
        if wandb_run is not None:
            wandb_run.summary.update({k: v for k, v in row.items() if isinstance(v, (int, float))})
        return row, [{"phase": name, **c} for c in action_cb.collapses], interrupted
    finally:
        if wandb_run is not None:
            wandb_run.finish(exit_code=1 if interrupted else 0)


def _save_and_export(models: dict, cfg: TrainConfig, out: Path, config: dict, reward_scale: float,
                     replacement) -> dict:
    """Save ``model.zip`` (depth) / ``size_model.zip`` (size), commit the replacement of an earlier run, export
    ``policy/`` and ``size_policy/`` and write ``tree.json``. Returns the export checks per policy."""
    if "depth" in models:
        phases.save_model(models["depth"], out / "model.zip")
    if "size" in models:
        phases.save_model(models["size"], out / "size_model.zip")
    replacement.commit()
    trained = [p for p in ("depth", "size") if p in models]
    tree = tree_settings(cfg, trained, config)
    base = {**phases.export_config(cfg, config, reward_scale), "tree": tree}
    checks = {}
    if "depth" in models:
        checks["depth"] = export_policy(
            models["depth"], out / DEPTH_DIR, cfg.max_depth, observations=models["depth"].rollout_buffer.observations,
            seed=cfg.seed, vocab_size=config["vocab_size"], config={**base, "trained_on": {"env": TREE_ENV_IDS[0]}}).check
    if "size" in models:
        checks["size"] = export_policy(
            models["size"], out / SIZE_DIR, cfg.max_depth, observations=models["size"].rollout_buffer.observations,
            seed=cfg.seed, verify_sizes=tuple(cfg.verify_sizes), vocab_size=config["vocab_size"],
            config={**base, "trained_on": {"env": TREE_ENV_IDS[1]}}).check
    (out / TREE_FILE).write_text(json.dumps(tree, indent=2, default=str))
    return checks


def _tree_check(pair: ModelPair, cfg: TrainConfig, out: Path, encode, eval_prompts) -> dict:
    """The learned tree (:func:`policies.load.load_tree_policy`) against a fixed tree and autoregressive
    decoding on held-out prompts (:func:`train.phases.quick_check`)."""
    fixed_depth = min(4, cfg.max_depth)
    ctrls = {"autoregressive": FixedTreeController(0, 0),
             f"fixed_tree_d{fixed_depth}_v{cfg.verify_size}": FixedTreeController(fixed_depth, cfg.verify_size),
             "learned_tree": load_tree_policy(out)}
    return phases.quick_check(pair, phases.eval_prompt_ids(cfg, eval_prompts, encode), ctrls, cfg, tree=True)


def train_tree(pair: ModelPair, cfg: TrainConfig, out: Path, replacement, stop, prompts, eval_prompts,
               t_start: float) -> dict:
    """The body of :func:`train.launch.run` for ``cfg.tree`` (see the module docstring for the phases).

    Returns:
        the summary written to ``metrics.json`` (the keys of a chain run, and ``phases``, ``collapses``,
        per-policy ``cycles`` and ``export_check``).

    Raises:
        policies.export.ExportCheckError: an ONNX export disagrees with its PyTorch policy.
        ValueError: a prompt does not fit the context window.
    """
    phases.seed_and_threads(cfg)
    prompts = phases.training_prompts(cfg, prompts)
    # 1. environments, each with its own drafter
    envs = _tree_envs(pair, cfg, prompts)
    any_env = next(iter(envs.values()))
    # 2. warm-up and the autoregressive reference rate
    warm = FixedTreeController(min(2, cfg.max_depth), 8)
    ar, reward_scale = phases.reference_rate(pair, any_env.prompt_ids, cfg, warm, tree=True)
    for env in envs.values():
        env.reward_scale = float(reward_scale)
    config = phases.run_config(cfg, pair, reward_scale, ar, len(prompts), pair.vocab_size,
                               TREE_ENV_IDS[0] if "depth" in cfg.policies else TREE_ENV_IDS[1],
                               extra={"env_ids": {"depth": TREE_ENV_IDS[0], "size": TREE_ENV_IDS[1]},
                                      "phases": [f"{p}-round{r + 1}" for p, r in phase_schedule(cfg)]})
    replacement.begin()  # from here on ``out`` belongs to the new run
    phases.write_run_start(out, config, feature_spec(cfg.max_depth))

    # 3. the phases
    models: dict[str, Any] = {}
    rows: list[dict] = []
    collapses: list[dict] = []
    interrupted = False
    t_train = time.perf_counter()
    for policy, rnd in phase_schedule(cfg):
        row, found, interrupted = _run_phase(policy, rnd, envs[policy], models, cfg, out, config, stop)
        rows.append(row)
        collapses += found
        if interrupted:
            break
    train_seconds = time.perf_counter() - t_train

    # 4. save and export; 5. a quick held-out check
    try:
        checks = _save_and_export(models, cfg, out, config, reward_scale, replacement)
        evaluation = (_tree_check(pair, cfg, out, any_env.encode, eval_prompts)
                      if cfg.eval_prompts and not interrupted else None)
    except KeyboardInterrupt:
        if not replacement.committed:  # stopped before the models were saved: nothing of this run is kept
            raise
        sig = stop.signal_name or "SIGINT"
        steps = sum(int(m.num_timesteps) for m in models.values())
        phases.write_metrics(out, {"wall_seconds": time.perf_counter() - t_start, "train_seconds": train_seconds,
                                   "timesteps": steps, "interrupted": True, "interrupted_by": sig,
                                   "unfinished": "export and evaluation", "evaluation": None, "phases": rows})
        raise phases.InterruptedAfterTraining(out, steps, sig, resumable=False) from None
    metrics = {
        "wall_seconds": time.perf_counter() - t_start,
        "train_seconds": train_seconds,
        "timesteps": sum(int(m.num_timesteps) for m in models.values()),
        "timesteps_requested": {"depth": cfg.timesteps, "size": cfg.size_timesteps or cfg.timesteps},
        "interrupted": interrupted,
        "interrupted_by": stop.signal_name if interrupted else None,
        "reward_scale": reward_scale,
        "autoregressive_warmup": ar,
        "ep_rew_mean": rows[-1]["ep_rew_mean"] if rows else None,
        "phases": rows,
        "collapses": collapses,
        "cycles": {row["policy"]: row["cycles"] for row in rows},
        "export_check": {"agreement": min(c["agreement"] for c in checks.values()) if checks else None, **checks},
        "evaluation": evaluation,
        "paths": {"out": str(out), "model": str(out / "model.zip") if "depth" in models else None,
                  "size_model": str(out / "size_model.zip") if "size" in models else None,
                  "policy": str(out / DEPTH_DIR) if "depth" in models else None,
                  "size_policy": str(out / SIZE_DIR) if "size" in models else None,
                  "tree": str(out / TREE_FILE), "logs": str(out / "logs"),
                  "wandb": str(out / "wandb") if cfg.wandb_mode != "disabled" else None},
    }
    phases.write_metrics(out, metrics)
    return metrics


__all__ = ["DEPTH_MEANINGS", "phase_schedule", "train_tree", "tree_settings"]
