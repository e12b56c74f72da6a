"""The entry of a training run: :func:`run`, what ``python -m train`` calls. It checks the settings and
the output directory (:mod:`train.outdir`), turns SIGTERM into a clean stop (:class:`train.callbacks.SignalStop`)
and runs a chain (:func:`train.chain.train_chain`) or a tree run (:func:`train.tree.train_tree`); a failure
before a model is saved puts an earlier run's results back.

(Not ``train/run.py``: a submodule named ``run`` would replace the lazily exported :func:`train.run`
function by the module as soon as it is imported.)
"""

from __future__ import annotations

import time

from learn2draft.models import ModelPair
from train.callbacks import SignalStop
from train.config import TrainConfig, read_run_config
from train.outdir import Replacement, prepare_out_dir
from train.wandb_setup import check_wandb


def run(pair: ModelPair | None, config: TrainConfig | None = None, prompts: list[str] | None = None,
        eval_prompts: list[str] | None = None) -> dict:
    """Train a PPO depth policy for ``pair``; write everything to ``config.out``. With ``config.tree``,
    train draft-tree policies instead (:func:`train.tree.train_tree`: ``policy/``, ``size_policy/``, ``tree.json``).

    Args:
        pair: loaded target/draft models (e.g. from :func:`learn2draft.load_pair`, or tiny test models);
            None (not used) with ``config.replay``, which trains on recorded traces (see :func:`train.chain.apply_replay_settings`).
        config: settings (default :class:`TrainConfig`).
        prompts: training prompts (strings or token-id lists); default ``load_prompts(config.prompt_split)``.
        eval_prompts: prompts for the final sanity check; default the first ``config.eval_prompts``
            of ``load_prompts("heldout")``.

    Returns:
        The summary written to ``metrics.json``: wall seconds, the measured autoregressive rate and
        reward scale, final SB3 metrics (``train/*``, ``rollout/*``), per-cycle means over the last
        cycles, the export check and the evaluation (if any), and the output paths.

    Raises:
        ValueError: a setting is out of range, or a prompt does not fit the context window.
        FileExistsError / PermissionError: see :func:`train.outdir.prepare_out_dir`.
        policies.export.ExportCheckError: the ONNX export disagrees with the PyTorch policy.
        KeyboardInterrupt: Ctrl-C or SIGTERM before training began (``out`` is left as it was found).

    Interruption and resume: Ctrl-C or SIGTERM during training stops it cleanly — the policy so far
    is checkpointed (``checkpoints/ppo_<steps>_steps.zip``), saved (``model.zip``) and exported, and
    ``metrics.json`` says ``"interrupted": true`` and ``"interrupted_by"``. With ``config.resume``
    (``--resume``) a run continues the run in ``out`` — interrupted, killed, or finished and to be
    extended to a larger ``timesteps`` — from its newest checkpoint (PPO weights, optimiser state,
    step count), with its saved reward scale and the same W&B run id; ``timesteps`` is the total.

    ``overwrite`` replaces an earlier run of ``out`` only once the new run has checked its prompts
    and measured its reference rate; until the new run saves a model, a failure puts the earlier
    results back (see :class:`train.outdir.Replacement`).
    """
    t_start = time.perf_counter()
    cfg = config or TrainConfig()
    cfg.validate()
    check_wandb(cfg.wandb_mode)
    out = prepare_out_dir(cfg.out, cfg.overwrite, cfg.resume)
    saved = read_run_config(out) if cfg.resume else None
    replacement = Replacement(out, cfg.overwrite, cfg.resume)
    stop = SignalStop()
    with stop:  # SIGTERM (timeout, containers, schedulers) stops the run like Ctrl-C
        try:
            if cfg.tree:  # draft trees: the depth and size policies, alternating (train.tree)
                from train.tree import train_tree

                metrics = train_tree(pair, cfg, out, replacement, stop, prompts, eval_prompts, t_start)
            else:
                from train.chain import train_chain

                metrics = train_chain(pair, cfg, out, saved, replacement, stop, prompts, eval_prompts, t_start)
        except BaseException:
            replacement.rollback()  # a run that saved no model leaves ``out`` as it found it
            raise
    return metrics


__all__ = ["run"]
