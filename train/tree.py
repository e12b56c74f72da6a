"""PPO training of draft-tree policies (``python -m train --tree``), as Learning to Draft (arXiv 2603.01639) does it.

:func:`train_tree` is what :func:`train.training.run` runs for ``config.tree``. Reading order, top to bottom:

1. environments: :class:`envs.tree.TreeSizeEnv` for the size policy and :class:`envs.tree.TreeDepthEnv` for the
   depth policy, each with its own drafter (each keeps its own generation going between phases);
2. warm-up and the autoregressive reference rate (the reward scale, as for chains);
3. phases — with ``--policies depth,size``: per round, the size policy under the current depth
   controller (uniformly random depths in round 1, as LTD's first phase; the trained depth policy after),
   then the depth policy under the trained size policy; the same two PPO models continue across rounds.
   ``--policies size`` or ``depth`` alone: one phase, the other decision fixed (``tree_depth`` or random
   depths; ``verify_size``). Each phase is a stable-baselines3 PPO run with the chain's machinery (CSV and
   Weights & Biases logs — one W&B run per phase — per-cycle statistics, checkpoints), plus
   :class:`ActionDistributionCallback`: each policy's action distribution per rollout, and a
   :class:`PolicyCollapseWarning` (printed ``WARNING:``) when one action takes more than 95% of a rollout
   (LTD's size policy was reported to collapse to a constant);
4. saves ``model.zip`` (depth) / ``size_model.zip`` (size) and exports ``policy/`` and ``size_policy/``
   (:func:`policies.export.export_policy`, parity vectors included) and ``tree.json`` (the tree settings,
   :mod:`policies.tree`);
5. optionally a quick held-out check: the learned tree (:func:`policies.load.load_tree_policy`) against a fixed
   tree and autoregressive decoding, interleaved per prompt (a sanity check, not a benchmark).
"""

from __future__ import annotations

import json
import re
import sys
import time
import warnings
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch

from learn2draft.decoding import FixedDepthController
from learn2draft.drafters import make_drafter
from learn2draft.features import feature_spec
from learn2draft.models import ModelPair
from learn2draft.tree import FixedTreeController, TreeSpeculativeDecoder
from train.config import TREE_ENV_IDS, TrainConfig

#: A policy is reported collapsed when one action takes more than this share of a rollout.
COLLAPSE_THRESHOLD = 0.95


class PolicyCollapseWarning(UserWarning):
    """A policy took (almost) a single action over a whole rollout."""


def action_fractions(actions: np.ndarray, n_actions: int) -> np.ndarray:
    """float64 ``(n_actions,)``: the share of each action among ``actions`` (int, any shape); zeros if empty."""
    a = np.asarray(actions).reshape(-1).astype(np.int64)
    counts = np.bincount(a, minlength=n_actions)[:n_actions].astype(np.float64)
    return counts / counts.sum() if counts.sum() else counts


def collapse_message(policy: str, fractions: np.ndarray, meanings: dict[int, str],
                     threshold: float = COLLAPSE_THRESHOLD) -> str | None:
    """A warning text when one action's share exceeds ``threshold``, else None.

    Args:
        policy: the policy's name ("depth", "size"). fractions: from :func:`action_fractions`.
        meanings: action → description.
    """
    fr = np.asarray(fractions, dtype=np.float64)
    if fr.size == 0 or fr.sum() == 0:
        return None
    top = int(np.argmax(fr))
    if fr[top] <= threshold:
        return None
    return (f"the {policy} policy collapsed to one action: {fr[top]:.1%} of the last rollout's actions were "
            f"{top} = {meanings.get(top, top)} (> {threshold:.0%}); it no longer adapts to the state (LTD's size "
            "policy was reported to do this): try more --ent-coef, more timesteps, or another --verify-sizes set.")


def _short(meaning: str) -> str:
    return re.sub(r"[^A-Za-z0-9=]+", "_", meaning.split(" (")[0]).strip("_")


def _action_callback(policy: str, meanings: dict[int, str], threshold: float = COLLAPSE_THRESHOLD,
                     wandb_run: Any = None):
    """An :class:`ActionDistributionCallback` (built lazily: SB3 is imported only here)."""
    from stable_baselines3.common.callbacks import BaseCallback

    class ActionDistributionCallback(BaseCallback):
        """SB3 callback: at the end of each rollout, the policy's action shares go to the SB3 logger
        (``actions/<policy>/<action>``, hence the CSV and W&B) and, above ``threshold`` for one action, a
        :class:`PolicyCollapseWarning` is issued and ``WARNING: …`` printed to stderr; ``collapses`` lists them."""

        def __init__(self) -> None:
            super().__init__()
            self.policy, self.meanings, self.threshold = policy, meanings, threshold
            self.last_fractions: dict[str, float] = {}
            self.collapses: list[dict] = []

        def _on_step(self) -> bool:
            return True

        def _on_rollout_end(self) -> None:
            buf = self.model.rollout_buffer
            fr = action_fractions(buf.actions[: buf.buffer_size if buf.full else buf.pos], len(self.meanings))
            self.last_fractions = {self.meanings[i]: float(f) for i, f in enumerate(fr)}
            for i, f in enumerate(fr):
                self.logger.record(f"actions/{self.policy}/{_short(self.meanings[i])}", float(f))
            msg = collapse_message(self.policy, fr, self.meanings, self.threshold)
            self.logger.record(f"actions/{self.policy}/collapsed", float(msg is not None))
            if msg is not None:
                self.collapses.append({"timesteps": int(self.num_timesteps), "fractions": self.last_fractions})
                warnings.warn(msg, PolicyCollapseWarning, stacklevel=2)
                print(f"WARNING: {msg}", file=sys.stderr)
                if wandb_run is not None:
                    wandb_run.summary[f"actions/{self.policy}/collapsed_at"] = int(self.num_timesteps)

    return ActionDistributionCallback()


class _SizeFromModel:
    """``size_features -> V``: an SB3 size model's deterministic action mapped to the V set (the decoder
    caps V at the nodes drafted)."""

    def __init__(self, model: Any, verify_sizes: tuple[int, ...]):
        self.model, self.verify_sizes = model, tuple(verify_sizes)

    def __call__(self, size_features: np.ndarray) -> int:
        a, _ = self.model.predict(np.asarray(size_features, dtype=np.float32), deterministic=True)
        return self.verify_sizes[int(np.asarray(a).reshape(-1)[0])]


def tree_rate(pair: ModelPair, prompt_ids: list[torch.Tensor], controller, cfg: TrainConfig, seed: int = 0) -> dict:
    """Generate for each prompt with a :class:`TreeSpeculativeDecoder` (``cfg``'s tree shape and drafter)
    driven by ``controller``; returns ``tokens_per_s`` (wall, prefill and decisions included), ``tokens``,
    ``seconds``, ``mean_depth``, ``mean_verify_size``, ``mean_accepted`` (τ) per cycle."""
    dec = TreeSpeculativeDecoder(pair, cfg.sampling(), max_new_tokens=cfg.max_new_tokens, max_depth=cfg.max_depth,
                                 drafter=make_drafter(cfg.drafter, pair, head=cfg.head), width=cfg.tree_width,
                                 top_k=cfg.tree_top_k)
    toks = secs = 0.0
    depths, sizes, taus = [], [], []
    for i, ids in enumerate(prompt_ids):
        g = dec.generate(ids, controller, seed=seed + i)
        toks += len(g.tokens)
        secs += g.wall_seconds
        depths += [c.depth for c in g.cycles]
        sizes += [c.verify_size for c in g.cycles]
        taus += [c.num_accepted for c in g.cycles]
    return {"tokens_per_s": toks / secs if secs > 0 else 0.0, "tokens": int(toks), "seconds": secs,
            "mean_depth": float(np.mean(depths)) if depths else 0.0,
            "mean_verify_size": float(np.mean(sizes)) if sizes else 0.0,
            "mean_accepted": float(np.mean(taus)) if taus else 0.0}


def phase_schedule(cfg: TrainConfig) -> list[tuple[str, int]]:
    """``[(policy, round), ...]``: size then depth per round for both policies; one phase for one."""
    pols = tuple(cfg.policies)
    if set(pols) == {"depth", "size"}:
        return [(p, r) for r in range(cfg.rounds) for p in ("size", "depth")]
    return [(pols[0], 0)]


def tree_settings(cfg: TrainConfig, trained: list[str], run_config: dict) -> dict:
    """The ``tree.json`` written next to the exports (read by :func:`policies.load.load_tree_policy`)."""
    return {
        "format": "learn2draft-tree/1",
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


def train_tree(pair: ModelPair, cfg: TrainConfig, out: Path, replacement, stop, prompts, eval_prompts,
               t_start: float) -> dict:
    """The body of :func:`train.training.run` for ``cfg.tree`` (see the module docstring for the phases).

    Returns:
        the summary written to ``metrics.json`` (the keys of a chain run, and ``phases``, ``collapses``,
        per-policy ``cycles`` and ``export_check``).

    Raises:
        policies.export.ExportCheckError: an ONNX export disagrees with its PyTorch policy.
        ValueError: a prompt does not fit the context window.
    """
    from stable_baselines3 import PPO
    from stable_baselines3.common.callbacks import CallbackList, CheckpointCallback
    from stable_baselines3.common.logger import Logger, make_output_format
    from stable_baselines3.common.monitor import Monitor
    from stable_baselines3.common.utils import set_random_seed
    from stable_baselines3.common.vec_env import DummyVecEnv

    from envs.tree import TreeDepthEnv, TreeSizeEnv
    from learn2draft.prompts import load_prompts
    from policies.controllers import SB3Controller
    from policies.export import export_policy
    from policies.load import load_tree_policy
    from train.training import (
        _cycle_stats_callback,
        _init_wandb,
        _versions,
        drop_partial_optimizer_state,
        make_wandb_output_format,
        measure_rate,
    )

    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    set_random_seed(cfg.seed)
    sampling = cfg.sampling()
    if prompts is None:
        prompts = [p for sp in cfg.prompt_split.split(",") for p in load_prompts(sp)]
    prompts = list(prompts)
    pols = tuple(cfg.policies)
    common = dict(sampling=sampling, max_new_tokens=cfg.max_new_tokens, max_depth=cfg.max_depth, width=cfg.tree_width,
                  top_k=cfg.tree_top_k)
    # 1. environments, each with its own drafter (a drafter holds the state of one generation)
    envs: dict[str, Any] = {}
    if "size" in pols:
        envs["size"] = TreeSizeEnv(pair, prompts, drafter=make_drafter(cfg.drafter, pair, head=cfg.head),
                                   depth=cfg.tree_depth, verify_sizes=cfg.verify_sizes, **common)
    if "depth" in pols:
        envs["depth"] = TreeDepthEnv(pair, prompts, drafter=make_drafter(cfg.drafter, pair, head=cfg.head),
                                     size=cfg.verify_size, episode=cfg.episode, **common)
    any_env = next(iter(envs.values()))

    # 2. warm-up and the autoregressive reference rate
    step = max(1, len(any_env.prompt_ids) // cfg.warmup_prompts)
    warm_ids = any_env.prompt_ids[::step][: cfg.warmup_prompts]
    tree_rate(pair, warm_ids[:1], FixedTreeController(min(2, cfg.max_depth), 8), cfg, seed=cfg.seed)
    ar = measure_rate(pair, warm_ids, FixedDepthController(0), cfg, seed=cfg.seed)
    reward_scale = cfg.reward_scale or ar["cycle_tokens_per_s"] or 1.0
    for env in envs.values():
        env.reward_scale = float(reward_scale)

    run_config = {
        **asdict(cfg),
        "target": pair.target_name or cfg.target, "draft": pair.draft_name or cfg.draft,
        "head": str(Path(cfg.head).resolve()) if cfg.head else None,
        "sampling": sampling.to_dict(), "reward_scale_used": reward_scale, "autoregressive_warmup": ar,
        "n_prompts": len(prompts), "vocab_size": pair.vocab_size, "torch_threads": torch.get_num_threads(),
        "versions": _versions(), "env_id": TREE_ENV_IDS[0] if "depth" in pols else TREE_ENV_IDS[1],
        "env_ids": {"depth": TREE_ENV_IDS[0], "size": TREE_ENV_IDS[1]},
        "phases": [f"{p}-round{r + 1}" for p, r in phase_schedule(cfg)],
        "wandb_run_id": None, "resumed": [],
    }
    replacement.begin()  # from here on ``out`` belongs to the new run
    (out / "config.json").write_text(json.dumps(run_config, indent=2, default=str))
    (out / "feature_spec.json").write_text(json.dumps(feature_spec(cfg.max_depth), indent=2))

    # 3. the phases
    from wandb.sdk.lib.runid import generate_id

    meanings = {"depth": {0: "STOP (verify now)", 1: "CONTINUE (draft one more tree level)"},
                "size": {i: f"V={v}" for i, v in enumerate(cfg.verify_sizes)}}
    models: dict[str, Any] = {}
    cycle_stats: dict[str, dict] = {}
    phases: list[dict] = []
    collapses: list[dict] = []
    interrupted = False
    t_train = time.perf_counter()
    for policy, rnd in phase_schedule(cfg):
        env = envs[policy]
        other = "size" if policy == "depth" else "depth"
        if other in models:  # the other policy as trained so far decides its part
            if policy == "size":
                env.set_depth(SB3Controller(models["depth"], max_depth=cfg.max_depth))
            else:
                env.set_size(_SizeFromModel(models["size"], cfg.verify_sizes))
        name = f"{policy}-round{rnd + 1}"
        if policy not in models:
            vec_env = DummyVecEnv([lambda env=env: Monitor(env)])
            models[policy] = PPO(
                "MlpPolicy", vec_env, n_steps=cfg.n_steps, batch_size=cfg.batch_size, n_epochs=cfg.n_epochs,
                learning_rate=cfg.learning_rate, gamma=cfg.discount, gae_lambda=cfg.gae_lambda, ent_coef=cfg.ent_coef,
                clip_range=cfg.clip_range, policy_kwargs={"net_arch": list(cfg.net_arch)}, seed=cfg.seed,
                device="cpu", verbose=0,
            )
        model = models[policy]
        wandb_run = _init_wandb(replace(cfg, run_name=f"{cfg.run_name or out.name}-{name}"), out,
                                {**run_config, "phase": name, "wandb_run_id": generate_id()})
        try:
            log_dir = out / "logs" / name
            wandb_format = make_wandb_output_format(wandb_run)
            model.set_logger(Logger(str(log_dir), [make_output_format("csv", str(log_dir)), wandb_format]))
            cycle_cb = _cycle_stats_callback(wandb_run)
            action_cb = _action_callback(policy, meanings[policy], wandb_run=wandb_run)
            callbacks = [cycle_cb, action_cb]
            if cfg.checkpoint_every:
                callbacks.append(CheckpointCallback(cfg.checkpoint_every, str(out / "checkpoints" / name),
                                                    name_prefix=f"ppo_{policy}"))
            steps = (cfg.size_timesteps or cfg.timesteps) if policy == "size" else cfg.timesteps
            t0, before = time.perf_counter(), model.num_timesteps
            print(f"[{name}] PPO for {steps} timesteps …", file=sys.stderr)
            try:
                model.learn(steps, callback=CallbackList(callbacks), reset_num_timesteps=False,
                            progress_bar=cfg.progress_bar and sys.stderr.isatty())
            except KeyboardInterrupt:
                interrupted = True
                stop.signal_name = stop.signal_name or "SIGINT"
                drop_partial_optimizer_state(model.policy.optimizer)
            model.logger.dump(step=model.num_timesteps)
            model.logger.close()
            ep = [e["r"] for e in model.ep_info_buffer] if model.ep_info_buffer else []
            cycle_stats[policy] = cycle_cb.summary()
            row = {"phase": name, "policy": policy, "round": rnd + 1, "timesteps": int(model.num_timesteps - before),
                   "seconds": time.perf_counter() - t0, "ep_rew_mean": float(np.mean(ep)) if ep else None,
                   "cycles": cycle_stats[policy], "action_fractions": action_cb.last_fractions,
                   "collapsed": bool(action_cb.collapses)}
            phases.append(row)
            collapses += [{"phase": name, **c} for c in action_cb.collapses]
            if wandb_run is not None:
                wandb_run.summary.update({k: v for k, v in row.items() if isinstance(v, (int, float))})
        finally:
            if wandb_run is not None:
                wandb_run.finish(exit_code=1 if interrupted else 0)
        if interrupted:
            break
    train_seconds = time.perf_counter() - t_train

    # 4. save and export
    if "depth" in models:
        models["depth"].save(str(out / "model.zip"))
    if "size" in models:
        models["size"].save(str(out / "size_model.zip"))
    replacement.commit()
    trained = [p for p in ("depth", "size") if p in models]
    tree = tree_settings(cfg, trained, run_config)
    base = {"sampling": sampling.to_dict(), "target": run_config["target"], "draft": run_config["draft"],
            "drafter": cfg.drafter, "head": run_config["head"], "max_new_tokens": cfg.max_new_tokens,
            "reward_scale": reward_scale, "training": asdict(cfg), "tree": tree}
    checks = {}
    if "depth" in models:
        checks["depth"] = export_policy(
            models["depth"], out / "policy", cfg.max_depth, observations=models["depth"].rollout_buffer.observations,
            seed=cfg.seed, config={**base, "trained_on": {"env": TREE_ENV_IDS[0]}}).check
    if "size" in models:
        checks["size"] = export_policy(
            models["size"], out / "size_policy", cfg.max_depth, observations=models["size"].rollout_buffer.observations,
            seed=cfg.seed, verify_sizes=tuple(cfg.verify_sizes),
            config={**base, "trained_on": {"env": TREE_ENV_IDS[1]}}).check
    (out / "tree.json").write_text(json.dumps(tree, indent=2, default=str))

    # 5. a quick held-out check (interleaved per prompt)
    evaluation = None
    if cfg.eval_prompts and not interrupted:
        texts = eval_prompts if eval_prompts is not None else load_prompts("heldout")[: cfg.eval_prompts]
        ids = [any_env.encode(p) for p in texts]
        fixed_depth = min(4, cfg.max_depth)
        ctrls = {"autoregressive": FixedTreeController(0, 0),
                 f"fixed_tree_d{fixed_depth}_v{cfg.verify_size}": FixedTreeController(fixed_depth, cfg.verify_size),
                 "learned_tree": load_tree_policy(out)}
        per: dict[str, list] = {k: [] for k in ctrls}
        for i, p in enumerate(ids):
            for k, c in ctrls.items():
                per[k].append(tree_rate(pair, [p], c, cfg, seed=cfg.seed + 1000 + i))
        evaluation = {}
        for k, rows in per.items():
            tok, sec = sum(r["tokens"] for r in rows), sum(r["seconds"] for r in rows)
            evaluation[k] = {"tokens_per_s": tok / sec if sec > 0 else 0.0,
                             **{m: float(np.mean([r[m] for r in rows]))
                                for m in ("mean_depth", "mean_verify_size", "mean_accepted")}}
        evaluation["prompts"] = len(ids)

    total = sum(int(m.num_timesteps) for m in models.values())
    last_ep = phases[-1]["ep_rew_mean"] if phases else None
    metrics = {
        "wall_seconds": time.perf_counter() - t_start,
        "train_seconds": train_seconds,
        "timesteps": total,
        "timesteps_requested": {"depth": cfg.timesteps, "size": cfg.size_timesteps or cfg.timesteps},
        "interrupted": interrupted,
        "interrupted_by": stop.signal_name if interrupted else None,
        "reward_scale": reward_scale,
        "autoregressive_warmup": ar,
        "ep_rew_mean": last_ep,
        "phases": phases,
        "collapses": collapses,
        "cycles": cycle_stats,
        "export_check": {"agreement": min(c["agreement"] for c in checks.values()) if checks else None, **checks},
        "evaluation": evaluation,
        "paths": {"out": str(out), "model": str(out / "model.zip") if "depth" in models else None,
                  "size_model": str(out / "size_model.zip") if "size" in models else None,
                  "policy": str(out / "policy") if "depth" in models else None,
                  "size_policy": str(out / "size_policy") if "size" in models else None,
                  "tree": str(out / "tree.json"), "logs": str(out / "logs"),
                  "wandb": str(out / "wandb") if cfg.wandb_mode != "disabled" else None},
    }
    (out / "metrics.json").write_text(json.dumps(metrics, indent=2, default=str))
    return metrics


__all__ = ["COLLAPSE_THRESHOLD", "PolicyCollapseWarning", "action_fractions", "collapse_message", "phase_schedule",
           "train_tree", "tree_rate", "tree_settings"]
