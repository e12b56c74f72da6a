"""The phases chain runs (:mod:`train.chain`) and tree runs (:mod:`train.tree`) share, in the order a run
goes through them:

1. :func:`seed_and_threads`, :func:`training_prompts` — settings and prompts;
2. :func:`reference_rate` — warm-up, then the autoregressive per-cycle tokens/s on warm-up prompts
   (:func:`warmup_prompt_ids`), the reward scale when ``cfg.reward_scale`` is None;
3. :func:`run_config`, :func:`write_run_start` — ``config.json`` and ``feature_spec.json``;
4. :func:`new_ppo`, :func:`set_logger`, :func:`checkpoint_callback`, :func:`learn` — stable-baselines3 PPO
   with the CSV / W&B logger and the callbacks of :mod:`train.callbacks`, stopped cleanly by Ctrl-C or SIGTERM;
5. :func:`export_config` — what every export's ``policy_config.json`` records;
6. :func:`quick_check` — the final held-out sanity check, interleaved per prompt, through eval's measurement
   runner (:mod:`eval.runner`), as :func:`measure_rate` measures the warm-up.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Callable, Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

import numpy as np
import torch
from stable_baselines3 import PPO
from stable_baselines3.common.callbacks import CallbackList, CheckpointCallback
from stable_baselines3.common.logger import HumanOutputFormat, Logger, make_output_format
from stable_baselines3.common.utils import set_random_seed

from eval.runner import DecoderMethod, RunRecord, TreeShape, run_interleaved
from learn2draft.cli import comma_items, is_terminal
from learn2draft.decoding import DraftController, FixedDepthController
from learn2draft.models import ModelPair
from learn2draft.names import HELDOUT_SEED_OFFSET
from learn2draft.replay.outcome import tokens_per_second
from train.callbacks import RolloutProgress, WandbOutputFormat, drop_partial_optimizer_state, versions
from train.config import TrainConfig


# --------------------------------------------------------------------------- 1. settings and prompts
def seed_and_threads(cfg: TrainConfig) -> None:
    """Set torch's CPU threads (``cfg.threads``, when given) and every random seed (``cfg.seed``)."""
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    set_random_seed(cfg.seed)


def training_prompts(cfg: TrainConfig, prompts: Sequence | None) -> list:
    """``prompts`` as a list, else the prompts of the file ``cfg.prompts`` (``--prompts FILE``), else the shipped
    prompts of ``cfg.prompt_split`` (several joined by commas).

    Raises:
        FileNotFoundError / ValueError: ``cfg.prompts`` is missing or not a prompt file
            (:func:`learn2draft.prompts.load_prompt_file`).
    """
    if prompts is None and cfg.prompts:
        from learn2draft.prompts import load_prompt_file

        prompts = load_prompt_file(cfg.prompts)
    elif prompts is None:
        from learn2draft.prompts import load_prompts

        prompts = [p for sp in comma_items(cfg.prompt_split) for p in load_prompts(sp)]
    return list(prompts)


def eval_prompt_ids(cfg: TrainConfig, eval_prompts: Sequence | None, encode: Callable) -> list[torch.Tensor]:
    """The final check's prompts, encoded with the env's ``encode``: ``eval_prompts``, or the first
    ``cfg.eval_prompts`` held-out prompts."""
    from learn2draft.prompts import load_prompts

    texts = eval_prompts if eval_prompts is not None else load_prompts("heldout")[: cfg.eval_prompts]
    return [encode(p) for p in texts]


# --------------------------------------------------------------------------- measurement (eval's runner)
def decoder_method(name: str, pair: ModelPair, controller, cfg: TrainConfig, tree: bool = False) -> DecoderMethod:
    """An :class:`eval.runner.DecoderMethod` with ``cfg``'s sampling, ``max_new_tokens``, drafter and (with
    ``tree``) tree shape. ``controller``: a :class:`DraftController`, or a function of the decoder returning
    one (e.g. a :class:`policies.vllm.ProtocolController`), whose decoder is built with ``cfg.max_depth``."""
    shape = TreeShape(cfg.tree_width, cfg.tree_top_k) if tree else None
    if isinstance(controller, DraftController):
        return DecoderMethod(name, pair, controller, cfg.sampling(), cfg.max_new_tokens, drafter=cfg.drafter,
                             head=cfg.head, tree=shape)
    method = DecoderMethod(name, pair, FixedDepthController(cfg.max_depth), cfg.sampling(), cfg.max_new_tokens,
                           drafter=cfg.drafter, head=cfg.head, tree=shape)
    method.controller = controller(method.decoder)  # a controller that reads the decoder it drives
    return method


def rate_summary(records: Sequence[RunRecord], tree: bool = False) -> dict:
    """Pooled over ``records``: ``tokens_per_s`` (tokens / wall seconds, prefill and the controller's
    decisions included), for a chain ``cycle_tokens_per_s`` (tokens / cycle seconds, the quantity the
    environments reward), ``tokens``, ``seconds``, ``mean_depth``, for a tree ``mean_verify_size``, and
    ``mean_accepted`` (τ) per cycle."""
    toks = sum(r.new_tokens for r in records)
    secs = sum(r.wall_seconds for r in records)
    cycle_secs = sum(r.cycle_seconds for r in records)
    cycles = sum(r.cycles for r in records)

    def per_cycle(total: float) -> float:
        return float(total / cycles) if cycles else 0.0

    return {"tokens_per_s": tokens_per_second(toks, secs),
            **({} if tree else {"cycle_tokens_per_s": tokens_per_second(toks, cycle_secs)}),
            "tokens": int(toks), "seconds": secs, "mean_depth": per_cycle(sum(r.drafted for r in records)),
            **({"mean_verify_size": per_cycle(sum(r.verified for r in records))} if tree else {}),
            "mean_accepted": per_cycle(sum(r.accepted for r in records))}


def measure_rate(pair: ModelPair, prompt_ids: list[torch.Tensor], controller, cfg: TrainConfig, seed: int = 0,
                 tree: bool = False) -> dict:
    """Generate once per prompt (prompt i with seed ``seed + i``) with ``controller`` (see
    :func:`decoder_method`) through eval's runner; returns :func:`rate_summary` of the runs."""
    method = decoder_method("measure", pair, controller, cfg, tree)
    return rate_summary(run_interleaved([method], prompt_ids, repeats=1, seed=seed, progress=False), tree)


def warmup_prompt_ids(prompt_ids: Sequence[torch.Tensor], cfg: TrainConfig) -> list[torch.Tensor]:
    """``cfg.warmup_prompts`` prompts spread over the list (a mixed list, e.g. train,copy_train, is warmed on both kinds)."""
    step = max(1, len(prompt_ids) // cfg.warmup_prompts)
    return list(prompt_ids[::step][: cfg.warmup_prompts])


# --------------------------------------------------------------------------- 2. reference rate
def reference_rate(pair: ModelPair, prompt_ids: Sequence[torch.Tensor], cfg: TrainConfig,
                   warm_controller: DraftController, tree: bool = False) -> tuple[dict, float]:
    """Warm-up (first forwards allocate) with ``warm_controller`` on one prompt, then the autoregressive
    reference rate on :func:`warmup_prompt_ids`.

    Returns:
        ``(ar, reward_scale)``: the chain :func:`measure_rate` of γ = 0, and ``cfg.reward_scale`` or
        ``ar["cycle_tokens_per_s"]`` (1.0 when that is 0), so that a reward of 1.0 means "as fast as plain decoding".
    """
    warm_ids = warmup_prompt_ids(prompt_ids, cfg)
    measure_rate(pair, warm_ids[:1], warm_controller, cfg, seed=cfg.seed, tree=tree)
    ar = measure_rate(pair, warm_ids, FixedDepthController(0), cfg, seed=cfg.seed)
    return ar, cfg.reward_scale or ar["cycle_tokens_per_s"] or 1.0


# --------------------------------------------------------------------------- 3. run config
def run_config(cfg: TrainConfig, pair: ModelPair | None, reward_scale: float, ar: dict, n_prompts: int,
               vocab_size: int, env_id: str, extra: dict | None = None, saved: dict | None = None) -> dict:
    """What ``config.json`` records: the settings, models, sampling, reward scale and its measurement,
    versions, the environment id, ``extra`` (e.g. the replay source, a tree run's phases) and, for a resumed
    run (``saved``: the earlier ``config.json``), the W&B run id and the resume history."""
    return {
        **asdict(cfg),
        "target": (pair.target_name if pair is not None else "") or cfg.target,
        "draft": (pair.draft_name if pair is not None else "") or cfg.draft,
        "drafter": cfg.drafter,
        "head": str(Path(cfg.head).resolve()) if cfg.head else None,
        "sampling": cfg.sampling().to_dict(),
        "reward_scale_used": reward_scale,
        "autoregressive_warmup": ar,
        "n_prompts": n_prompts,
        "vocab_size": vocab_size,
        "torch_threads": torch.get_num_threads(),
        "versions": versions(),
        "env_id": env_id,
        **(extra or {}),
        "wandb_run_id": saved.get("wandb_run_id") if saved else None,
        "resumed": [*(saved or {}).get("resumed", []), *([{"from_timesteps": None}] if saved else [])],
    }


def write_run_start(out: Path, run_config: dict, spec: dict) -> None:
    """Write ``config.json`` and ``feature_spec.json`` (the observation of the depth policy, with the target's
    ``vocab_size`` of ``run_config``: the entropy feature is divided by its log) into ``out``."""
    (out / "config.json").write_text(json.dumps(run_config, indent=2, default=str))
    (out / "feature_spec.json").write_text(json.dumps({**spec, "vocab_size": run_config["vocab_size"]}, indent=2))


# --------------------------------------------------------------------------- 4. PPO
def new_ppo(cfg: TrainConfig, vec_env) -> PPO:
    """A fresh stable-baselines3 PPO ``MlpPolicy`` on ``vec_env`` with ``cfg``'s hyper-parameters (CPU)."""
    return PPO(
        "MlpPolicy", vec_env, n_steps=cfg.n_steps, batch_size=cfg.batch_size, n_epochs=cfg.n_epochs,
        learning_rate=cfg.learning_rate, gamma=cfg.discount, gae_lambda=cfg.gae_lambda, ent_coef=cfg.ent_coef,
        clip_range=cfg.clip_range, policy_kwargs={"net_arch": list(cfg.net_arch)}, seed=cfg.seed,
        device="cpu", verbose=0,
    )


def set_logger(model: PPO, log_dir: Path, wandb_run: Any, suffix: str = "", verbose: bool = False) -> WandbOutputFormat:
    """Log ``model`` to ``log_dir/progress<suffix>.csv`` and W&B, and with ``verbose`` SB3's table of each update to
    standard error (standard output keeps the run's JSON summary); returns the W&B format (its ``last_values``)."""
    wandb_format = WandbOutputFormat(wandb_run)
    formats = [make_output_format("csv", str(log_dir), suffix), wandb_format]
    if verbose:
        formats.append(HumanOutputFormat(sys.stderr))
    model.set_logger(Logger(str(log_dir), formats))
    return wandb_format


def save_model(model, path: str | Path) -> None:
    """``model.save`` (stable-baselines3) to ``path`` whole or not at all: written beside it as ``.<name>.partial``,
    then renamed, so that a run killed while it writes keeps its previous checkpoint and never leaves a truncated
    ``.zip`` that ``--resume`` would fail on."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.partial")
    with open(tmp, "wb") as f:
        model.save(f)
    os.replace(tmp, path)


class AtomicCheckpointCallback(CheckpointCallback):
    """SB3's :class:`CheckpointCallback` (model only) whose checkpoints are written by :func:`save_model`."""

    def _on_step(self) -> bool:
        if self.n_calls % self.save_freq == 0:
            save_model(self.model, self._checkpoint_path(extension="zip"))
        return True


def checkpoint_callback(cfg: TrainConfig, directory: Path, prefix: str, num_envs: int = 1) -> CheckpointCallback:
    """Checkpoints every ``cfg.checkpoint_every`` timesteps (SB3 counts calls = vector-env steps, hence ``num_envs``),
    each written whole or not at all (:class:`AtomicCheckpointCallback`)."""
    return AtomicCheckpointCallback(max(1, cfg.checkpoint_every // num_envs), str(directory), name_prefix=prefix)


def learn(model: PPO, cfg: TrainConfig, callbacks: list, steps: int, stop, reset_num_timesteps: bool = False) -> bool:
    """Run ``model.learn`` for ``steps`` timesteps (none when ``steps`` ≤ 0), then flush and close its logger.

    Ctrl-C or SIGTERM (``stop``: a :class:`train.callbacks.SignalStop`) ends it cleanly: what was learnt is
    kept, the optimizer state an interrupt left half-built is dropped. Returns whether it was interrupted. With
    ``cfg.progress_bar``: SB3's bar on a terminal, one plain line per rollout otherwise (:class:`RolloutProgress`).
    """
    interrupted = False
    bar = cfg.progress_bar and is_terminal(sys.stderr)
    if cfg.progress_bar and not bar:  # a log file: one plain line per rollout, no carriage-return frames
        callbacks = [*callbacks, RolloutProgress()]
    try:
        if steps > 0:
            model.learn(steps, callback=CallbackList(callbacks), reset_num_timesteps=reset_num_timesteps,
                        progress_bar=bar)
    except KeyboardInterrupt:
        interrupted = True
        stop.signal_name = stop.signal_name or "SIGINT"
        drop_partial_optimizer_state(model.policy.optimizer)
    model.logger.dump(step=model.num_timesteps)  # the last update's train/* values
    model.logger.close()  # flushes and closes the CSV file
    return interrupted


def episode_reward_mean(model: PPO) -> float | None:
    """The mean episode reward of SB3's recent-episode buffer (None before the first episode ends)."""
    ep = [e["r"] for e in model.ep_info_buffer] if model.ep_info_buffer else []
    return float(np.mean(ep)) if ep else None


# --------------------------------------------------------------------------- 5. export
def export_config(cfg: TrainConfig, run_config: dict, reward_scale: float) -> dict:
    """What every export of the run records in its ``policy_config.json`` (sampling, models, drafter, head,
    ``max_new_tokens``, reward scale and the training settings); callers add ``trained_on`` (and ``tree``)."""
    return {"sampling": run_config["sampling"], "target": run_config["target"], "draft": run_config["draft"],
            "drafter": cfg.drafter, "head": run_config["head"], **_lookup_setting(cfg),
            "max_new_tokens": cfg.max_new_tokens, "reward_scale": reward_scale, "training": asdict(cfg)}


def _lookup_setting(cfg: TrainConfig) -> dict:
    """``{"lookup_min_ngram": n}`` for a drafter with prompt lookup (the setting it ran, the default when none was
    given), else {}: what :func:`policies.load.policy_lookup_min_ngram` reads back."""
    if "lookup" not in cfg.drafter:
        return {}
    from learn2draft.drafters.lookup import DEFAULT_MIN_NGRAM

    return {"lookup_min_ngram": cfg.lookup_min_ngram or DEFAULT_MIN_NGRAM}


# --------------------------------------------------------------------------- 6. the final check
def quick_check(pair: ModelPair, prompt_ids: list[torch.Tensor], controllers: dict, cfg: TrainConfig,
                tree: bool = False) -> dict:
    """Each controller (see :func:`decoder_method`) on each prompt once, interleaved per prompt (a rotated order)
    through eval's runner, prompt i with seed ``cfg.seed + 1000 + i`` (a sanity check, not a benchmark).

    Returns:
        per controller name ``tokens_per_s`` (tokens / wall seconds over all prompts) and the per-prompt means of
        ``mean_depth``, for a tree ``mean_verify_size``, and ``mean_accepted``; ``prompts``: their number.
    """
    methods = [decoder_method(name, pair, c, cfg, tree) for name, c in controllers.items()]
    records = run_interleaved(methods, prompt_ids, repeats=1, seed=cfg.seed + HELDOUT_SEED_OFFSET, progress=False)
    means = ("mean_depth", "mean_verify_size", "mean_accepted") if tree else ("mean_depth", "mean_accepted")
    evaluation: dict = {}
    for name in controllers:
        rows = [r for r in records if r.method == name]
        per_prompt = [rate_summary([r], tree) for r in rows]
        evaluation[name] = {"tokens_per_s": rate_summary(rows, tree)["tokens_per_s"],
                            **{m: float(np.mean([p[m] for p in per_prompt])) for m in means}}
    evaluation["prompts"] = len(prompt_ids)
    return evaluation


class InterruptedAfterTraining(KeyboardInterrupt):
    """Ctrl-C or SIGTERM after the policy was trained and saved (``model.zip``), during its export or evaluation.
    Attributes: ``out`` (the run folder), ``timesteps`` (trained), ``signal_name`` (``"SIGINT"`` / ``"SIGTERM"``),
    ``resumable`` (whether ``--resume`` finishes the run: chains, not trees)."""

    def __init__(self, out: Path, timesteps: int, signal_name: str, resumable: bool = True) -> None:
        super().__init__(signal_name)
        self.out, self.timesteps, self.signal_name = Path(out), int(timesteps), signal_name
        self.resumable = resumable


def write_metrics(out: Path, metrics: dict) -> None:
    """Write ``metrics.json`` (the run's summary) into ``out``."""
    (out / "metrics.json").write_text(json.dumps(metrics, indent=2, default=str))


__all__ = ["AtomicCheckpointCallback", "InterruptedAfterTraining", "checkpoint_callback", "decoder_method", "episode_reward_mean", "eval_prompt_ids", "export_config", "learn", "save_model",
           "measure_rate", "new_ppo", "quick_check", "rate_summary", "reference_rate", "run_config", "seed_and_threads",
           "set_logger", "training_prompts", "warmup_prompt_ids", "write_metrics", "write_run_start"]
