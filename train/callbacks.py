"""What a training run hangs on stable-baselines3 and on the process, at module level: the W&B output
format of SB3's logger, the progress lines of a log file (:class:`RolloutProgress`), the per-cycle statistics callback, the action-distribution (collapse) callback,
the signal stop and the W&B run itself. Chain runs (:mod:`train.chain`) and tree runs (:mod:`train.tree`)
use the same ones, through :mod:`train.phases`.
"""

from __future__ import annotations

import platform
import re
import signal
import sys
import threading
import warnings
from collections import deque
from typing import Any

import numpy as np
import torch
from stable_baselines3.common.callbacks import BaseCallback
from stable_baselines3.common.logger import KVWriter

#: A policy is reported collapsed when one action takes more than this share of a rollout.
COLLAPSE_THRESHOLD = 0.95


# --------------------------------------------------------------------------- progress in a log file
class RolloutProgress(BaseCallback):
    """One plain progress line per rollout (``train: 2048/12288 timesteps (17%), 95 s, ep_rew_mean=1.234``) through
    :class:`learn2draft.cli.LineProgress`, for a standard error that is not a terminal (a log file), where SB3's
    progress bar would print nothing readable (its frames end in carriage returns).

    Args:
        desc: the lines' label; ``stream``: where they go (default standard error).
    """

    def __init__(self, desc: str = "train", stream=None) -> None:
        super().__init__()
        self.desc, self.stream, self.bar = desc, stream, None

    def _on_training_start(self) -> None:
        from learn2draft.cli import LineProgress

        # _total_timesteps: the count at the end of this learn() call (a resumed run's earlier steps included)
        self.bar = LineProgress(total=self.model._total_timesteps, desc=self.desc, unit="timesteps",
                                initial=self.model.num_timesteps, stream=self.stream, min_interval=0.0)

    def _on_step(self) -> bool:
        return True

    def _on_rollout_end(self) -> None:
        ep = [e["r"] for e in self.model.ep_info_buffer] if self.model.ep_info_buffer else []
        if ep:
            self.bar.set_postfix(ep_rew_mean=f"{float(np.mean(ep)):.4g}")
        self.bar.update(self.model.num_timesteps - self.bar.n)

    def _on_training_end(self) -> None:
        if self.bar is not None:
            self.bar.close()


# --------------------------------------------------------------------------- W&B
def _numeric(v: Any) -> float | None:
    """A loggable float from a number or a one-element array/tensor; None for anything else."""
    if isinstance(v, torch.Tensor):
        return float(v.item()) if v.numel() == 1 else None
    if isinstance(v, np.ndarray):
        return float(v.item()) if v.size == 1 else None
    if isinstance(v, (bool, int, float, np.bool_, np.integer, np.floating)):
        return float(v)
    return None


class WandbOutputFormat(KVWriter):
    """An SB3 logger output format that forwards every numeric value to ``run.log``.

    SB3's own ``WandbCallback`` does not send ``rollout/*`` / ``train/*`` (it relies on tensorboard
    syncing); adding this writer to the SB3 ``Logger`` does. It also keeps the last value of every
    key in ``last_values`` (used for ``metrics.json``). ``run`` may be None (only ``last_values``).
    """

    def __init__(self, run: Any) -> None:
        self.run = run
        self.last_values: dict[str, float] = {}

    def write(self, key_values: dict[str, Any], key_excluded: dict[str, tuple[str, ...]], step: int = 0) -> None:
        data = {}
        for k, v in key_values.items():
            if "wandb" in key_excluded.get(k, ()):
                continue
            x = _numeric(v)
            if x is not None:
                data[k] = x
        self.last_values.update(data)
        if self.run is not None and data:
            self.run.log({**data, "global_step": step})

    def close(self) -> None:
        pass


def make_wandb_output_format(run: Any) -> WandbOutputFormat:
    """A :class:`WandbOutputFormat` for the W&B ``run`` (None: only ``last_values`` is kept)."""
    return WandbOutputFormat(run)


def init_wandb(cfg, out, run_config: dict):
    """Start a W&B run in ``cfg.wandb_mode`` (None when disabled); the mode is never hard-coded.

    The run id is ``run_config["wandb_run_id"]``, saved in ``config.json``, so ``--resume`` continues
    the same W&B run."""
    if cfg.wandb_mode == "disabled":
        return None
    import wandb

    run = wandb.init(
        project=cfg.wandb_project, name=cfg.run_name or out.name, dir=str(out), mode=cfg.wandb_mode,
        config=run_config, job_type="train", id=run_config["wandb_run_id"], resume="allow",
        settings=wandb.Settings(console="off", x_disable_stats=True, silent=True),
    )
    run.define_metric("global_step")
    run.define_metric("*", step_metric="global_step")
    return run


def versions() -> dict:
    """The versions of Python and the libraries a run depends on (saved in ``config.json``)."""
    import gymnasium
    import stable_baselines3
    import transformers

    return {"python": platform.python_version(), "torch": torch.__version__, "transformers": transformers.__version__,
            "gymnasium": gymnasium.__version__, "stable_baselines3": stable_baselines3.__version__}


# --------------------------------------------------------------------------- per-cycle statistics
class CycleStatsCallback(BaseCallback):
    """SB3 callback: per-cycle tokens/s, depth, τ into the SB3 logger (means per rollout) and W&B (every cycle).

    Reads the ``infos`` of verified cycles (``tokens_per_second``, ``depth``, ``accepted``, ``tokens``,
    ``seconds``, ``generation_finished``); :meth:`summary` gives the means over the last ``window`` cycles.
    """

    def __init__(self, wandb_run: Any = None, window: int = 500) -> None:
        super().__init__()
        self.wandb_run = wandb_run
        self.cycles = 0
        self.generations = 0
        self.recent: deque[tuple[float, int, int, int, float]] = deque(maxlen=window)
        self.recent_generations: deque[float] = deque(maxlen=max(10, window // 20))
        self._gen_tokens = 0
        self._gen_seconds = 0.0

    def _on_step(self) -> bool:
        for info in self.locals.get("infos", ()):
            if not info.get("verified"):
                continue
            self.cycles += 1
            row = (info["tokens_per_second"], info["depth"], info["accepted"], info["tokens"], info["seconds"])
            self.recent.append(row)
            for key, v in zip(("tokens_per_s", "depth", "accepted", "tokens", "seconds"), row):
                self.logger.record_mean(f"cycle/{key}", v)
            self._gen_tokens += info["tokens"]
            self._gen_seconds += info["seconds"]
            log = {"cycle/tokens_per_s": row[0], "cycle/depth": row[1], "cycle/accepted": row[2],
                   "cycle/index": self.cycles, "global_step": self.num_timesteps}
            if info.get("generation_finished"):
                rate = self._gen_tokens / self._gen_seconds if self._gen_seconds > 0 else 0.0
                self.generations += 1
                self.recent_generations.append(rate)
                self.logger.record_mean("generation/tokens_per_s", rate)
                log["generation/tokens_per_s"] = rate
                self._gen_tokens, self._gen_seconds = 0, 0.0
            if self.wandb_run is not None:
                self.wandb_run.log(log)
        return True

    def summary(self) -> dict:
        """Means over the last ``window`` cycles (and recent generations)."""
        if not self.recent:
            return {"cycles": 0, "generations": self.generations}
        arr = np.asarray(self.recent, dtype=np.float64)
        return {
            "cycles": self.cycles,
            "generations": self.generations,
            "window_cycles": len(self.recent),
            "cycle_tokens_per_s_mean": float(arr[:, 0].mean()),
            "cycle_depth_mean": float(arr[:, 1].mean()),
            "cycle_accepted_mean": float(arr[:, 2].mean()),
            "tokens_per_cycle_mean": float(arr[:, 3].mean()),
            "window_tokens_per_s": float(arr[:, 3].sum() / arr[:, 4].sum()) if arr[:, 4].sum() > 0 else 0.0,
            "generation_tokens_per_s_mean": float(np.mean(self.recent_generations)) if self.recent_generations else None,
        }


# --------------------------------------------------------------------------- action distribution
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


class ActionDistributionCallback(BaseCallback):
    """SB3 callback: at the end of each rollout, the policy's action shares go to the SB3 logger
    (``actions/<policy>/<action>``, hence the CSV and W&B) and, above ``threshold`` for one action, a
    :class:`PolicyCollapseWarning` is issued and ``WARNING: …`` printed to stderr; ``collapses`` lists them.

    Args:
        policy: the policy's name ("depth", "size"); meanings: action → description (one per action).
        threshold: the share above which one action counts as a collapse.
        wandb_run: where the step of a collapse is summarised (None: nowhere).
    """

    def __init__(self, policy: str, meanings: dict[int, str], threshold: float = COLLAPSE_THRESHOLD,
                 wandb_run: Any = None) -> None:
        super().__init__()
        self.policy, self.meanings, self.threshold, self.wandb_run = policy, meanings, threshold, wandb_run
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
            if self.wandb_run is not None:
                self.wandb_run.summary[f"actions/{self.policy}/collapsed_at"] = int(self.num_timesteps)


# --------------------------------------------------------------------------- interruption
class SignalStop:
    """Context manager: while active, SIGTERM raises KeyboardInterrupt (as Ctrl-C does), and
    ``signal_name`` records which signal stopped the run (``"SIGINT"`` / ``"SIGTERM"``; None if none).
    Outside the main thread (where handlers cannot be set) it only records Ctrl-C."""

    def __init__(self) -> None:
        self.signal_name: str | None = None
        self._old: dict[int, Any] = {}

    def _handler(self, signum, frame) -> None:
        self.signal_name = signal.Signals(signum).name
        raise KeyboardInterrupt(self.signal_name)

    def __enter__(self) -> SignalStop:
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGINT, signal.SIGTERM):
                self._old[sig] = signal.signal(sig, self._handler)
        return self

    def __exit__(self, *exc) -> None:
        for sig, old in self._old.items():
            signal.signal(sig, old)
        if exc[0] is KeyboardInterrupt and self.signal_name is None:
            self.signal_name = "SIGINT"


def drop_partial_optimizer_state(optimizer) -> int:
    """Forget the optimizer state of parameters whose state an interrupt left half-built.

    A signal can land inside Adam's lazy per-parameter initialisation (``step`` set, ``exp_avg`` not
    yet); such a state saved in a checkpoint makes the resumed run fail with ``KeyError: 'exp_avg'``.
    Dropping it lets Adam initialise that parameter afresh on the next step. Returns how many were dropped.
    """
    partial = [p for p, st in optimizer.state.items() if st and not {"exp_avg", "exp_avg_sq"} <= set(st)]
    for p in partial:
        del optimizer.state[p]
    return len(partial)


__all__ = ["COLLAPSE_THRESHOLD", "ActionDistributionCallback", "CycleStatsCallback", "PolicyCollapseWarning", "SignalStop",
           "WandbOutputFormat", "action_fractions", "collapse_message", "drop_partial_optimizer_state", "init_wandb",
           "make_wandb_output_format", "versions"]
