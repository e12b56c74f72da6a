"""PPO training of a draft-depth policy on the real speculative decoder.

:func:`run` takes an already loaded :class:`learn2draft.ModelPair` (so tests can pass tiny models)
and a :class:`TrainConfig`; ``python -m train`` (:mod:`train.__main__`) loads the pair from names
and calls it. Reading order: :class:`TrainConfig` → :func:`run` (top to bottom).

What one run does:

1. checks the output directory (never replaces results unless ``overwrite``, and never anything
   it did not write; ``resume`` continues an interrupted run);
2. warms the models up and measures the autoregressive per-cycle tokens/s of the pair on training
   prompts; with ``reward_scale=None`` that rate becomes the reward scale, so a reward of 1.0 means
   "as fast as plain decoding" (a fixed scale keeps the exported policy free of normalisation state);
3. trains stable-baselines3 PPO on :class:`envs.SpecDecodeEnv` in ``episode="cycle"`` mode with
   discount 1 — the return of each decision is the scaled tokens/s of its cycle (see
   :mod:`envs.spec_decode` for why summing per-cycle rates over a whole generation would favour
   short cycles);
4. logs SB3's ``rollout/*``, ``train/*``, ``time/*`` and the per-cycle tokens/s, depth and τ to a CSV
   file and to Weights & Biases (offline by default);
5. saves ``model.zip``, ``config.json``, checkpoints, and the ONNX export (``policy/``) with its check;
6. optionally compares the exported policy with fixed depths on a few held-out prompts
   (a quick sanity check, not a benchmark: see ``python -m eval``).

With ``replay`` and ``profile`` (``--replay TRACES --profile PROFILE``) steps 2–3 run on
:class:`envs.replay.SpecDecodeReplayEnv` instead — recorded traces and a latency profile, no model
(:func:`apply_replay_settings`); the reward scale is the replayed autoregressive rate, and step 6
compares the policy with fixed depths and the hindsight oracle in replay.
"""

from __future__ import annotations

import json
import os
import platform
import re
import shutil
import signal
import sys
import threading
import time
from collections import deque
from dataclasses import asdict
from pathlib import Path
from typing import Any

import numpy as np
import torch

from learn2draft.cli import check_wandb  # noqa: F401 (re-exported)
from learn2draft.decoding import DraftController, FixedDepthController, SpeculativeDecoder
from learn2draft.drafters import make_drafter
from learn2draft.features import engine_feature_spec, feature_spec, profile_feature_spec
from learn2draft.models import ModelPair
from train.config import (  # noqa: F401 (re-exported)
    ENV_ID,
    REPLAY_ENV_ID,
    WANDB_MODES,
    TrainConfig,
    default_out_dir,
    read_run_config,
)

RESULT_FILES = ("config.json", "model.zip", "metrics.json", "policy")


#: Everything a run writes into ``out`` (``--overwrite`` replaces these; W&B's ``wandb/`` is kept).
RUN_ITEMS = (*RESULT_FILES, "feature_spec.json", "checkpoints", "logs", "eval",
             "size_model.zip", "size_policy", "tree.json")  # the last three: tree runs (train.tree)


def latest_checkpoint(out: Path) -> tuple[Path, int] | None:
    """The newest ``checkpoints/ppo_<steps>_steps.zip`` of the run in ``out`` and its step count."""
    found = []
    for p in (Path(out) / "checkpoints").glob("ppo_*_steps.zip"):
        m = re.fullmatch(r"ppo_(\d+)_steps\.zip", p.name)
        if m:
            found.append((int(m.group(1)), p))
    if not found:
        return None
    steps, path = max(found)
    return path, steps


def run_state(out: str | Path) -> str:
    """What ``out`` holds: ``"new"`` (absent or no results of a run), ``"complete"`` (a finished run),
    ``"interrupted"`` (a run stopped by a signal or a kill: no ``metrics.json``, or one saying
    ``interrupted``), ``"foreign"`` (result-like files that :func:`run` did not write, e.g. a model's
    ``config.json``) or ``"file"`` (not a directory)."""
    out = Path(out)
    if out.exists() and not out.is_dir():
        return "file"
    if not out.is_dir() or not any((out / name).exists() for name in RUN_ITEMS):
        return "new"
    if read_run_config(out) is None:
        return "foreign"
    try:
        metrics = json.loads((out / "metrics.json").read_text())
    except (OSError, ValueError):
        return "interrupted"
    return "interrupted" if metrics.get("interrupted") else "complete"


def prepare_out_dir(out: str | Path, overwrite: bool = False, resume: bool = False) -> Path:
    """Check that ``out`` may receive a run, create it and test that it is writable. Deletes nothing.

    ``out`` may be new (or hold no results), or — with ``overwrite`` — an earlier training run (its
    results are replaced by :func:`run` only once the new run has loaded and warmed up, see
    :class:`_Replacement`), or — with ``resume`` — a run to continue.

    Raises:
        FileExistsError: ``out`` is a file; holds files that ``python -m train`` did not write (never
            replaced, even with ``overwrite``); holds a finished run and not ``overwrite``; holds an
            interrupted run and neither ``resume`` nor ``overwrite`` (the message says ``--resume``).
        FileNotFoundError: ``resume`` but ``out`` holds no training run.
        PermissionError: ``out`` cannot be created or written (message names the path).
    """
    out = Path(out)
    state = run_state(out)
    if state == "file":
        raise FileExistsError(f"--out {out} exists and is not a directory: choose another path.")
    if state == "foreign":
        found = [name for name in RUN_ITEMS if (out / name).exists()]
        raise FileExistsError(
            f"{out} holds files that python -m train did not write ({', '.join(found)}; its config.json is not a "
            "training run's): refusing to use or replace them; choose another --out."
        )
    if resume and state == "new":
        raise FileNotFoundError(f"--resume: {out} holds no training run to continue: start one without --resume.")
    if state == "interrupted" and not (resume or overwrite):
        ckpt = latest_checkpoint(out)
        where = f"last checkpoint at {ckpt[1]} timesteps" if ckpt else "no checkpoint yet"
        raise FileExistsError(f"{out} holds an interrupted run ({where}): pass --resume to continue it, "
                              "or --overwrite to start over.")
    if state == "complete" and not (overwrite or resume):
        found = [name for name in RESULT_FILES if (out / name).exists()]
        raise FileExistsError(
            f"{out} already holds results ({', '.join(found)}): pass --overwrite to replace them, "
            "or choose another --out."
        )
    try:
        out.mkdir(parents=True, exist_ok=True)
        probe = out / f".write-test-{os.getpid()}"
        probe.write_text("ok")
        probe.unlink()
    except OSError as e:
        raise PermissionError(f"Cannot write to output directory {out}: {e.strerror or e}.") from None
    return out


class _Replacement:
    """Replace a run directory's results without ever leaving it with neither the old nor the new run.

    :meth:`begin` (called once everything that can fail early has passed) moves the earlier run's
    :data:`RUN_ITEMS` into ``out/.replaced/``; :meth:`commit` (once the new run has saved a model)
    deletes them; :meth:`rollback` (the new run failed or was interrupted before that) removes what
    the new run wrote and puts the earlier results back. A run killed in between leaves the earlier
    results in ``.replaced/`` and the new run resumable with ``--resume``, which commits them away.
    """

    def __init__(self, out: Path, overwrite: bool, resume: bool) -> None:
        self.out, self.overwrite, self.resume = out, overwrite, resume
        self.aside = out / ".replaced"
        self.committed = False

    def begin(self) -> None:
        if not self.overwrite:
            return
        if self.aside.exists():  # left by a killed earlier replacement: that run is now being replaced
            shutil.rmtree(self.aside)
        self.aside.mkdir()
        for name in RUN_ITEMS:
            if (self.out / name).exists():
                os.replace(self.out / name, self.aside / name)

    def commit(self) -> None:
        self.committed = True
        if self.aside.exists():
            shutil.rmtree(self.aside)

    def rollback(self) -> None:
        if self.committed or self.resume:
            return
        for name in RUN_ITEMS:
            path = self.out / name
            if path.is_dir():
                shutil.rmtree(path)
            else:
                path.unlink(missing_ok=True)
        if self.aside.exists():
            for item in self.aside.iterdir():
                os.replace(item, self.out / item.name)
            self.aside.rmdir()


# --------------------------------------------------------------------------- logging
def _numeric(v: Any) -> float | None:
    """A loggable float from a number or a one-element array/tensor; None for anything else."""
    if isinstance(v, torch.Tensor):
        return float(v.item()) if v.numel() == 1 else None
    if isinstance(v, np.ndarray):
        return float(v.item()) if v.size == 1 else None
    if isinstance(v, (bool, int, float, np.bool_, np.integer, np.floating)):
        return float(v)
    return None


def make_wandb_output_format(run: Any):
    """An SB3 logger output format (``KVWriter``) that forwards every numeric value to ``run.log``.

    SB3's own ``WandbCallback`` does not send ``rollout/*`` / ``train/*`` (it relies on tensorboard
    syncing); adding this writer to the SB3 ``Logger`` does. It also keeps the last value of every
    key in ``last_values`` (used for ``metrics.json``). ``run`` may be None (only ``last_values``).
    """
    from stable_baselines3.common.logger import KVWriter

    class WandbOutputFormat(KVWriter):
        def __init__(self) -> None:
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

    return WandbOutputFormat()


def _cycle_stats_callback(wandb_run: Any, window: int = 500):
    """SB3 callback: per-cycle tokens/s, depth, τ into the SB3 logger (means per rollout) and W&B (every cycle)."""
    from stable_baselines3.common.callbacks import BaseCallback

    class CycleStatsCallback(BaseCallback):
        def __init__(self) -> None:
            super().__init__()
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
                if wandb_run is not None:
                    wandb_run.log(log)
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

    return CycleStatsCallback()


def _init_wandb(cfg: TrainConfig, out: Path, run_config: dict):
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


# --------------------------------------------------------------------------- measurements
def measure_rate(
    pair: ModelPair, prompt_ids: list[torch.Tensor], controller, cfg: TrainConfig, seed: int = 0
) -> dict:
    """Generate for each prompt with ``controller`` (a :class:`DraftController`, or a function of the
    decoder returning one, e.g. a :class:`policies.vllm.ProtocolController`) and the drafter ``cfg.drafter``.

    Returns:
        ``tokens_per_s`` (total tokens / total wall seconds, prefill and the controller's decisions
        included), ``cycle_tokens_per_s`` (total tokens / total cycle seconds, the quantity the
        environment rewards), ``tokens``, ``seconds``, ``mean_depth`` and ``mean_accepted`` (τ) per cycle.
    """
    dec = SpeculativeDecoder(pair, cfg.sampling(), max_new_tokens=cfg.max_new_tokens, max_depth=cfg.max_depth,
                             drafter=make_drafter(cfg.drafter, pair, head=cfg.head))
    if not isinstance(controller, DraftController):  # a factory of a controller that reads the decoder
        controller = controller(dec)
    toks = secs = cycle_secs = 0.0
    depths, taus = [], []
    for i, ids in enumerate(prompt_ids):
        g = dec.generate(ids, controller, seed=seed + i)
        toks += len(g.tokens)
        secs += g.wall_seconds
        cycle_secs += sum(c.seconds for c in g.cycles)
        depths += [c.depth for c in g.cycles]
        taus += [c.num_accepted for c in g.cycles]
    return {
        "tokens_per_s": toks / secs if secs > 0 else 0.0,
        "cycle_tokens_per_s": toks / cycle_secs if cycle_secs > 0 else 0.0,
        "tokens": int(toks),
        "seconds": secs,
        "mean_depth": float(np.mean(depths)) if depths else 0.0,
        "mean_accepted": float(np.mean(taus)) if taus else 0.0,
    }


def _versions() -> dict:
    import gymnasium
    import stable_baselines3
    import transformers

    return {"python": platform.python_version(), "torch": torch.__version__, "transformers": transformers.__version__,
            "gymnasium": gymnasium.__version__, "stable_baselines3": stable_baselines3.__version__}


# --------------------------------------------------------------------------- replay
def apply_replay_settings(cfg: TrainConfig):
    """For ``cfg.replay``: load the traces and the profile, take the traces' models, drafter, sampling,
    ``max_new_tokens`` and ``max_depth`` into ``cfg`` (settings left at their defaults) and build the replay
    environment (:class:`envs.replay.SpecDecodeReplayEnv`, ``episode=cfg.episode``, reward scale 1). Several
    profiles (``cfg.profile`` joined by commas) make one environment over all of them, with the profile
    features in the observation when ``cfg.features == "profile"``.

    Returns:
        the environment.

    Raises:
        FileNotFoundError: a trace or profile file is missing.
        ValueError: a setting given explicitly differs from the traces' (the message names the flag), or
            ``max_new_tokens`` / ``max_depth`` exceed the traces', or the profile lacks the traces' drafter.
    """
    from envs.replay import SpecDecodeReplayEnv
    from learn2draft.latency import load_profiles
    from learn2draft.traces import load_traces

    traces = load_traces(cfg.replay)
    profiles = load_profiles(cfg.profile)
    h, defaults = traces.header, TrainConfig()

    def take(name: str, value) -> None:
        current = getattr(cfg, name)
        if current == value:
            return
        if current != getattr(defaults, name):
            raise ValueError(f"--{name.replace('_', '-')} {current!r}, but the traces {cfg.replay} were recorded with "
                             f"{value!r}: drop --{name.replace('_', '-')}, or record traces with it (python -m eval.record).")
        setattr(cfg, name, value)

    take("target", h.get("target") or cfg.target)
    take("draft", h.get("draft") or cfg.draft)
    take("drafter", traces.drafter)
    for k in ("temperature", "top_k", "top_p"):
        take(k, type(getattr(defaults, k))(h["sampling"][k]))
    if cfg.drafter == "head":
        head = (h.get("drafter") or {}).get("head") or None
        if cfg.head is None:
            cfg.head = head
        elif head and Path(cfg.head).resolve() != Path(head).resolve():
            raise ValueError(f"--head {cfg.head}, but the traces were recorded with the head in {head}: drop --head.")
    if cfg.max_new_tokens == defaults.max_new_tokens:
        cfg.max_new_tokens = traces.max_new_tokens
    if cfg.max_depth == defaults.max_depth:
        cfg.max_depth = traces.max_depth
    cfg.validate()
    return SpecDecodeReplayEnv(traces, profiles, max_new_tokens=cfg.max_new_tokens, max_depth=cfg.max_depth,
                               episode=cfg.episode, profile_features=cfg.features == "profile")


def _replay_source(env, cfg: TrainConfig) -> dict:
    """What a replay-trained policy was trained on (saved in ``config.json`` and ``policy_config.json``)."""
    h = env.traces.header
    given = [p.strip() for p in str(cfg.profile).split(",") if p.strip()]
    where = [str(Path(p).resolve()) if Path(p).is_file() else p for p in given]
    src = {"traces": [str(Path(p).resolve()) for p in str(cfg.replay).split(",") if p.strip()],
           "trace_format_version": h.get("format_version"), "trace_prompts": len(env.traces),
           "trace_prompt_source": h.get("prompt_source"), "trace_machine": h.get("machine"),
           "profile": ",".join(where),
           "profile_name": ",".join(p.name for p in env.profiles), "profile_source": env.profiles[0].source,
           "profile_machine": env.profiles[0].machine}
    if len(env.profiles) > 1:
        src["profiles"] = [{"profile": w, "name": p.name, "source": p.source, "machine": p.machine}
                           for w, p in zip(where, env.profiles)]
        src["profile_features"] = env.profile_features
    return src


def _replay_evaluation(env, policy_dir: Path, cfg: TrainConfig) -> dict:
    """The final check in replay, on the training traces (in-sample): the policy and the fixed depths of
    ``cfg.fixed_gammas()`` as :func:`envs.replay.replay_controller` scores them, with the hindsight oracle and the
    best fixed depth of :func:`eval.oracle.oracle_report` (T > 0: 5 generations per prompt). With several
    profiles, once per profile, the rows named ``"<profile>/<method>"``."""
    from envs.replay import SpecDecodeReplayEnv
    from policies.load import load_policy

    # the loop's features only: a profile-conditioned controller appends its profile's (load_policy(profile=))
    plain = env if not env.profile_features else SpecDecodeReplayEnv(
        env.traces, env.profiles, max_new_tokens=env.max_new_tokens, max_depth=env.max_depth)
    if len(env.profiles) == 1:
        return _replay_evaluation_on(plain, load_policy(policy_dir, profile=env.profiles[0]), cfg, 0)
    evaluation: dict = {}
    for k, prof in enumerate(env.profiles):
        ev = _replay_evaluation_on(plain, load_policy(policy_dir, profile=prof), cfg, k)
        evaluation.update({f"{prof.name}/{name}": row for name, row in ev.items() if isinstance(row, dict)})
        evaluation["prompts"] = ev["prompts"]
    evaluation["source"] = ("replay of the training traces (in-sample) with profiles "
                            + ", ".join(p.name for p in env.profiles))
    return evaluation


def _replay_evaluation_on(env, policy, cfg: TrainConfig, profile_index: int) -> dict:
    """:func:`_replay_evaluation` on the env's profile ``profile_index``."""
    from eval.oracle import oracle_report

    ctrls = {f"fixed_gamma_{g}": FixedDepthController(g) for g in cfg.fixed_gammas()}
    ctrls["policy"] = policy
    rep = oracle_report(env, ctrls, repeats=5, seed=cfg.seed + 1000, profile_index=profile_index)
    m = rep["methods"]
    evaluation = {name: {"tokens_per_s": m[name]["tokens_per_s"], "mean_depth": m[name]["mean_depth"],
                         "mean_accepted": m[name]["mean_accepted"], "ratio_to_oracle": m[name]["ratio_to_oracle"]}
                  for name in ctrls}
    oracle = m["oracle (hindsight DP)"]
    evaluation["oracle"] = {"tokens_per_s": oracle["tokens_per_s"], "kind": rep["oracle_kind"]}
    evaluation["best_fixed"] = {"method": rep["best_fixed"], "tokens_per_s": m[rep["best_fixed"]]["tokens_per_s"],
                                "ratio_to_oracle": m[rep["best_fixed"]]["ratio_to_oracle"]}
    evaluation["prompts"] = rep["prompts"]
    evaluation["source"] = f"replay of the training traces (in-sample) with profile {env.profiles[profile_index].name}"
    return evaluation


# --------------------------------------------------------------------------- the run
def run(pair: ModelPair | None, config: TrainConfig | None = None, prompts: list[str] | None = None,
        eval_prompts: list[str] | None = None) -> dict:
    """Train a PPO depth policy for ``pair``; write everything to ``config.out``. With ``config.tree``,
    train draft-tree policies instead (:func:`train.tree.train_tree`: ``policy/``, ``size_policy/``, ``tree.json``).

    Args:
        pair: loaded target/draft models (e.g. from :func:`learn2draft.load_pair`, or tiny test models);
            None (not used) with ``config.replay``, which trains on recorded traces (see :func:`apply_replay_settings`).
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
        FileExistsError / PermissionError: see :func:`prepare_out_dir`.
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
    results back (see :class:`_Replacement`).
    """
    t_start = time.perf_counter()
    cfg = config or TrainConfig()
    cfg.validate()
    check_wandb(cfg.wandb_mode)
    out = prepare_out_dir(cfg.out, cfg.overwrite, cfg.resume)
    saved = read_run_config(out) if cfg.resume else None
    replacement = _Replacement(out, cfg.overwrite, cfg.resume)
    stop = _SignalStop()
    with stop:  # SIGTERM (timeout, containers, schedulers) stops the run like Ctrl-C
        try:
            if cfg.tree:  # draft trees: the depth and size policies, alternating (train.tree)
                from train.tree import train_tree

                metrics = train_tree(pair, cfg, out, replacement, stop, prompts, eval_prompts, t_start)
            else:
                metrics = _train(pair, cfg, out, saved, replacement, stop, prompts, eval_prompts, t_start)
        except BaseException:
            replacement.rollback()  # a run that saved no model leaves ``out`` as it found it
            raise
    return metrics


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


class _SignalStop:
    """Context manager: while active, SIGTERM raises KeyboardInterrupt (as Ctrl-C does), and
    ``signal_name`` records which signal stopped the run (``"SIGINT"`` / ``"SIGTERM"``; None if none).
    Outside the main thread (where handlers cannot be set) it only records Ctrl-C."""

    def __init__(self) -> None:
        self.signal_name: str | None = None
        self._old: dict[int, Any] = {}

    def _handler(self, signum, frame) -> None:
        self.signal_name = signal.Signals(signum).name
        raise KeyboardInterrupt(self.signal_name)

    def __enter__(self) -> _SignalStop:
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGINT, signal.SIGTERM):
                self._old[sig] = signal.signal(sig, self._handler)
        return self

    def __exit__(self, *exc) -> None:
        for sig, old in self._old.items():
            signal.signal(sig, old)
        if exc[0] is KeyboardInterrupt and self.signal_name is None:
            self.signal_name = "SIGINT"


def _train(pair: ModelPair, cfg: TrainConfig, out: Path, saved: dict | None, replacement: _Replacement,
           stop: _SignalStop, prompts, eval_prompts, t_start: float) -> dict:
    """The body of :func:`run` (phases: environment, reference rate, replace, PPO, export, check)."""
    from stable_baselines3 import PPO
    from stable_baselines3.common.callbacks import CallbackList, CheckpointCallback
    from stable_baselines3.common.logger import Logger, make_output_format
    from stable_baselines3.common.monitor import Monitor
    from stable_baselines3.common.utils import set_random_seed
    from stable_baselines3.common.vec_env import DummyVecEnv

    from envs.spec_decode import SpecDecodeEnv
    from learn2draft.prompts import load_prompts
    from policies.export import export_policy
    from policies.load import load_policy

    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    set_random_seed(cfg.seed)
    if cfg.replay:  # recorded traces and a latency profile: no model runs
        env = apply_replay_settings(cfg)
        prompts = [None] * len(env.prompt_indices)
    else:
        if prompts is None:
            prompts = [p for sp in cfg.prompt_split.split(",") for p in load_prompts(sp)]
        prompts = list(prompts)
        # The environment tokenises and checks every prompt up front.
        env = SpecDecodeEnv(pair, prompts, cfg.sampling(), max_new_tokens=cfg.max_new_tokens, max_depth=cfg.max_depth,
                            episode=cfg.episode, drafter=make_drafter(cfg.drafter, pair, head=cfg.head))
    sampling = cfg.sampling()
    if saved is not None:  # resume: the same reward scale, so old and new rewards mean the same
        ar, reward_scale = saved["autoregressive_warmup"], saved["reward_scale_used"]
    elif cfg.replay:  # the replayed autoregressive rate, measured as measure_rate measures it on the real loop
        ar = {"cycle_tokens_per_s": env.autoregressive_rate(0), "source": f"replay with profile {env.profiles[0].name}"
              + ("" if len(env.profiles) == 1 else " (the others' rewards are relative to their own autoregressive rates)")}
        reward_scale = cfg.reward_scale or ar["cycle_tokens_per_s"] or 1.0
    else:
        # Warm-up prompts spread over the list (a mixed list, e.g. train,copy_train, is warmed on both kinds).
        step = max(1, len(env.prompt_ids) // cfg.warmup_prompts)
        warm_ids = env.prompt_ids[::step][: cfg.warmup_prompts]
        # Warm-up (first forwards allocate) and the autoregressive reference rate.
        measure_rate(pair, warm_ids[:1], FixedDepthController(min(2, cfg.max_depth)), cfg, seed=cfg.seed)
        ar = measure_rate(pair, warm_ids, FixedDepthController(0), cfg, seed=cfg.seed)
        reward_scale = cfg.reward_scale or ar["cycle_tokens_per_s"] or 1.0
    env.reward_scale = float(reward_scale)

    run_config = {
        **asdict(cfg),
        "target": (pair.target_name if pair is not None else "") or cfg.target,
        "draft": (pair.draft_name if pair is not None else "") or cfg.draft,
        "drafter": cfg.drafter,
        "head": str(Path(cfg.head).resolve()) if cfg.head else None,
        "sampling": sampling.to_dict(),
        "reward_scale_used": reward_scale,
        "autoregressive_warmup": ar,
        "n_prompts": len(prompts),
        "vocab_size": pair.vocab_size if pair is not None else env.vocab_size,
        "torch_threads": torch.get_num_threads(),
        "versions": _versions(),
        "env_id": REPLAY_ENV_ID if cfg.replay else ENV_ID,
        **({"replay_source": _replay_source(env, cfg)} if cfg.replay else {}),
        "wandb_run_id": saved.get("wandb_run_id") if saved else None,
        "resumed": [*(saved or {}).get("resumed", []), *([{"from_timesteps": None}] if saved else [])],
    }
    if not run_config["wandb_run_id"]:
        from wandb.sdk.lib.runid import generate_id

        run_config["wandb_run_id"] = generate_id()
    checkpoint = latest_checkpoint(out) if saved is not None else None
    if checkpoint is not None:
        run_config["resumed"][-1]["from_timesteps"] = checkpoint[1]

    replacement.begin()  # from here on ``out`` belongs to the new run
    (out / "config.json").write_text(json.dumps(run_config, indent=2, default=str))
    spec = (engine_feature_spec(cfg.max_depth) if cfg.features == "engine" else profile_feature_spec(cfg.max_depth)
            if cfg.features == "profile" else feature_spec(cfg.max_depth))
    (out / "feature_spec.json").write_text(json.dumps(spec, indent=2))

    wandb_run = _init_wandb(cfg, out, run_config)
    try:
        if cfg.features == "engine":  # what vLLM's draft-length policy protocol shows a policy
            from envs.engine_view import EngineViewWrapper

            vec_env = DummyVecEnv([lambda: Monitor(EngineViewWrapper(env))])
        else:
            vec_env = DummyVecEnv([lambda: Monitor(env)])
        if checkpoint is not None:  # PPO weights, optimiser state and step count
            model = PPO.load(str(checkpoint[0]), env=vec_env, device="cpu")
        else:
            model = PPO(
                "MlpPolicy", vec_env, n_steps=cfg.n_steps, batch_size=cfg.batch_size, n_epochs=cfg.n_epochs,
                learning_rate=cfg.learning_rate, gamma=cfg.discount, gae_lambda=cfg.gae_lambda, ent_coef=cfg.ent_coef,
                clip_range=cfg.clip_range, policy_kwargs={"net_arch": list(cfg.net_arch)}, seed=cfg.seed,
                device="cpu", verbose=0,
            )
        log_dir = out / "logs"
        wandb_format = make_wandb_output_format(wandb_run)
        # SB3's CSV writer truncates its file: a resumed run logs to progress-resumed-<steps>.csv.
        suffix = f"-resumed-{model.num_timesteps}" if saved is not None else ""
        model.set_logger(Logger(str(log_dir), [make_output_format("csv", str(log_dir), suffix), wandb_format]))

        cycle_cb = _cycle_stats_callback(wandb_run)
        callbacks = [cycle_cb]
        if cfg.checkpoint_every:
            # CheckpointCallback counts calls (= vector-env steps), not timesteps.
            callbacks.append(CheckpointCallback(max(1, cfg.checkpoint_every // vec_env.num_envs),
                                                str(out / "checkpoints"), name_prefix="ppo"))
        interrupted = False
        t_train = time.perf_counter()
        steps_before = model.num_timesteps
        try:
            if cfg.timesteps > model.num_timesteps:
                model.learn(cfg.timesteps - model.num_timesteps, callback=CallbackList(callbacks),
                            # a bar only on a terminal: a log file gets no carriage-return frames
                            progress_bar=cfg.progress_bar and sys.stderr.isatty(),
                            reset_num_timesteps=checkpoint is None)
        except KeyboardInterrupt:
            interrupted = True  # keep what was learnt: checkpoint it (for --resume) and export it below
            stop.signal_name = stop.signal_name or "SIGINT"
            drop_partial_optimizer_state(model.policy.optimizer)
        train_seconds = time.perf_counter() - t_train
        model.logger.dump(step=model.num_timesteps)  # the last update's train/* values
        model.logger.close()  # flushes and closes logs/progress*.csv
        if interrupted:
            model.save(str(out / "checkpoints" / f"ppo_{model.num_timesteps}_steps.zip"))
        model.save(str(out / "model.zip"))
        replacement.commit()

        export = export_policy(
            model, out / "policy", cfg.max_depth,
            config={"sampling": sampling.to_dict(), "target": run_config["target"], "draft": run_config["draft"],
                    "drafter": cfg.drafter, "head": str(Path(cfg.head).resolve()) if cfg.head else None,
        "head": str(Path(cfg.head).resolve()) if cfg.head else None,
                    "max_new_tokens": cfg.max_new_tokens, "reward_scale": reward_scale, "training": asdict(cfg),
                    "trained_on": ({"env": REPLAY_ENV_ID, **run_config["replay_source"]} if cfg.replay
                                   else {"env": ENV_ID})},
            observations=model.rollout_buffer.observations, seed=cfg.seed,
        )

        evaluation = None
        if cfg.eval_prompts and not interrupted and cfg.replay:
            evaluation = _replay_evaluation(env, out / "policy", cfg)
        elif cfg.eval_prompts and not interrupted:
            texts = eval_prompts if eval_prompts is not None else load_prompts("heldout")[: cfg.eval_prompts]
            ids = [env.encode(p) for p in texts]
            if cfg.features == "engine":  # driven through vLLM's protocol, as the engine would
                from policies.vllm import LearnedDraftLengthPolicy, ProtocolController

                engine_policy = LearnedDraftLengthPolicy(out / "policy")
                policy = lambda dec: ProtocolController(engine_policy, dec)  # noqa: E731
            else:
                policy = load_policy(out / "policy")
            evaluation = {}
            # Interleave methods prompt by prompt so that load drifts hit all of them alike.
            ctrls = {f"fixed_gamma_{g}": FixedDepthController(g) for g in cfg.fixed_gammas()}
            ctrls["policy"] = policy
            per = {k: [] for k in ctrls}
            for i, p in enumerate(ids):
                for name, c in ctrls.items():
                    per[name].append(measure_rate(pair, [p], c, cfg, seed=cfg.seed + 1000 + i))
            for name, rows in per.items():
                tok = sum(r["tokens"] for r in rows)
                sec = sum(r["seconds"] for r in rows)
                evaluation[name] = {
                    "tokens_per_s": tok / sec if sec > 0 else 0.0,
                    "mean_depth": float(np.mean([r["mean_depth"] for r in rows])),
                    "mean_accepted": float(np.mean([r["mean_accepted"] for r in rows])),
                }
            evaluation["prompts"] = len(ids)

        ep_rewards = [ep["r"] for ep in model.ep_info_buffer] if model.ep_info_buffer else []
        metrics = {
            "wall_seconds": time.perf_counter() - t_start,
            "train_seconds": train_seconds,
            "timesteps": int(model.num_timesteps),
            "timesteps_requested": cfg.timesteps,
            "steps_per_second": (model.num_timesteps - steps_before) / train_seconds if train_seconds > 0 else 0.0,
            "interrupted": interrupted,
            "interrupted_by": stop.signal_name if interrupted else None,
            "resumed_from_timesteps": steps_before if saved is not None else None,
            "reward_scale": reward_scale,
            "autoregressive_warmup": ar,
            "ep_rew_mean": float(np.mean(ep_rewards)) if ep_rewards else None,
            "sb3_last": wandb_format.last_values,
            "cycles": cycle_cb.summary(),
            "export_check": export.check,
            "evaluation": evaluation,
            "paths": {"out": str(out), "model": str(out / "model.zip"), "policy": str(out / "policy"),
                      "logs": str(log_dir), "wandb": str(out / "wandb") if wandb_run is not None else None},
        }
        (out / "metrics.json").write_text(json.dumps(metrics, indent=2, default=str))
        if wandb_run is not None:
            wandb_run.summary.update({k: v for k, v in metrics.items() if isinstance(v, (int, float))})
            if evaluation:
                for name, row in evaluation.items():
                    if isinstance(row, dict):
                        wandb_run.summary[f"eval/{name}/tokens_per_s"] = row["tokens_per_s"]
            import wandb

            art = wandb.Artifact(re.sub(r"[^A-Za-z0-9_.-]", "-", f"policy-{out.name}"), type="policy",
                                 metadata={"max_depth": cfg.max_depth})
            art.add_dir(str(out / "policy"))
            wandb_run.log_artifact(art)
        return metrics
    finally:
        if wandb_run is not None:
            wandb_run.finish(exit_code=1 if stop.signal_name else 0)


__all__ = ["ENV_ID", "REPLAY_ENV_ID", "RESULT_FILES", "RUN_ITEMS", "TrainConfig", "apply_replay_settings", "check_wandb", "default_out_dir", "latest_checkpoint",
           "make_wandb_output_format", "measure_rate", "prepare_out_dir", "read_run_config", "run", "run_state"]
