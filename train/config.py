"""The settings of a training run (:class:`TrainConfig`), importable without torch so that
``python -m train --help`` answers at once; :func:`train.launch.run` runs them."""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, field
from pathlib import Path

from learn2draft.cli import comma_items
from learn2draft.names import (
    DEFAULT_DRAFT,
    DEFAULT_MAX_DEPTH,
    DEFAULT_TARGET,
    DEFAULT_TREE_TOP_K,
    DEFAULT_TREE_WIDTH,
    DEFAULT_VERIFY_SIZES,
)
from learn2draft.prompts import SPLITS

WANDB_MODES = ("offline", "online", "disabled")
#: The environment a run trains on; ``config.json`` names it, which marks a directory as a training run.
ENV_ID = "learn2draft/SpecDecode-v0"
#: The environment of a run with ``replay`` (recorded traces and a latency profile, :mod:`envs.replay`).
REPLAY_ENV_ID = "learn2draft/SpecDecodeReplay-v0"
#: The environments of a ``tree`` run (:mod:`envs.tree`); ``config.json`` names the first.
TREE_ENV_IDS = ("learn2draft/TreeDepth-v0", "learn2draft/TreeSize-v0")
#: The policies a ``tree`` run can train (``--policies``).
TREE_POLICIES = ("depth", "size")


def _loads_ok(text: str) -> bool:
    """Whether ``text`` is concurrency levels (integers ≥ 1) joined by commas."""
    try:
        levels = [int(x) for x in comma_items(str(text))]
    except ValueError:
        return False
    return bool(levels) and all(x >= 1 for x in levels)


def serve_loads(text: str) -> list[int]:
    """The concurrency levels of ``--serve-loads`` (checked by :meth:`TrainConfig.validate`)."""
    return [int(x) for x in comma_items(str(text))]


@dataclass
class TrainConfig:
    """All settings of a training run (saved as ``config.json``).

    Model / decoding: ``target``, ``draft`` (names, recorded; :func:`run` uses the pair it is given),
    ``device``, ``dtype``, sampling (``temperature`` 0 = greedy, ``top_k``, ``top_p``, ``min_p``,
    ``repetition_penalty``, ``presence_penalty``: the fields of :class:`learn2draft.sampling.SamplingConfig`),
    ``max_new_tokens`` per generation, ``max_depth`` tokens per cycle, ``drafter`` (``"model"``,
    ``"head"`` or ``"lookup"``, see :func:`learn2draft.drafters.make_drafter`), ``head`` (the head
    directory for the head drafter; None = the shipped head of the embedded target), ``lookup_min_ngram``
    (prompt lookup's shortest n-gram match, for lookup and the hybrids; None = the traces' under ``replay``, else
    :data:`learn2draft.drafters.lookup.DEFAULT_MIN_NGRAM`).

    PPO (stable-baselines3): ``timesteps`` (environment steps = draft decisions), ``n_steps`` per
    rollout, ``batch_size``, ``n_epochs``, ``learning_rate``, ``discount`` (SB3's ``gamma``, named
    apart from the draft depth γ; 1.0: undiscounted cycles),
    ``gae_lambda``, ``ent_coef``, ``clip_range``, ``net_arch`` (hidden sizes of the actor and critic MLPs).

    Reward: ``reward_scale`` (None = the measured autoregressive per-cycle tokens/s), ``episode``
    (``"cycle"`` or ``"generation"``, see :mod:`envs.spec_decode`).

    Run: ``seed``, ``out`` (output directory), ``overwrite`` (replace the earlier run in ``out``),
    ``resume`` (continue the run in ``out`` from its last checkpoint, see :func:`run`),
    ``checkpoint_every`` (timesteps; 0 = off),
    ``wandb_mode`` (offline / online / disabled), ``wandb_project``, ``run_name``, ``progress_bar`` (SB3's bar on a
    terminal, one plain line per rollout in a log file), ``verbose`` (SB3's table of each PPO update on standard error),
    ``threads`` (torch CPU threads; None = torch's default. 1 by default: on a shared 2-core CPU a
    second thread waiting on a busy core made a SmolLM2-135M forward ~6x slower and much noisier,
    and noisy clocks are noisy rewards; evaluate with the same setting), ``prompt_split`` (one split of
    :func:`learn2draft.prompts.load_prompts` or several joined by commas, e.g. ``"train,copy_train"``), ``prompts`` (a
    user's prompt file instead, read by :func:`learn2draft.prompts.load_prompt_file`), ``warmup_prompts``
    (generations used to warm up and measure the autoregressive rate), ``eval_prompts`` (held-out
    prompts for the final sanity check; 0 = skip) and ``eval_gammas`` (fixed depths compared there,
    each ≤ ``max_depth``; None = 0 and min(4, ``max_depth``)).

    Observation: ``features`` ``"full"`` (the loop's features, :data:`learn2draft.features.FEATURE_NAMES`) or
    ``"engine"`` (only what vLLM's draft-length policy protocol passes, :data:`learn2draft.features.ENGINE_FEATURE_NAMES`,
    through :class:`envs.engine_view.EngineViewWrapper`; the export then runs with :mod:`policies.vllm`) or
    ``"profile"`` (replay only: the loop's features and the hardware-profile features of
    :func:`learn2draft.features.profile_features`, so that one policy serves every profile it was trained on;
    load the export with ``load_policy(dir, profile=...)``).

    Load-aware (replay only): ``serve_loads`` (closed-loop concurrency levels joined by commas, e.g. ``"1,2,4,8"``)
    trains one γ per batched step for every running row on ``learn2draft/ServeReplay-v0``
    (:class:`envs.serve.ServeReplayEnv`, ``serve_requests`` requests per stream) from chain traces and a profile with
    the batch axis; the export runs with :func:`policies.load.load_serve_policy` (``python -m eval.serve --policy``).

    Replay (no model runs): ``replay`` (trace files written by ``python -m eval.record``, several joined by
    commas) and ``profile`` (a latency profile file or a shipped name, :func:`learn2draft.replay.latency.load_profile`;
    several joined by commas: each generation replays on one of them, see :mod:`envs.replay`) train on ``learn2draft/SpecDecodeReplay-v0`` instead of the real loop; the models, drafter, sampling and
    ``max_new_tokens`` then come from the traces (a setting left at its default takes the traces' value; one
    set to another value is an error, except ``max_new_tokens`` below the traces'); ``max_depth`` is kept when
    the traces hold it (any depth up to the recorded one replays) and, left at its default above it, lowered
    to the traces' (see :func:`train.chain.apply_replay_settings`), and the final check compares the policy with fixed depths and the oracle in replay, on the
    training traces.

    Draft trees (``tree``, :mod:`train.tree`): ``policies`` (``("depth", "size")`` or one of them),
    ``rounds`` (LTD's alternation: size policy, then depth policy, repeated), ``tree_width`` / ``tree_top_k``
    (W frontier nodes expanded per level with their top-k children), ``verify_sizes`` (the size policy's V
    set), ``verify_size`` (the fixed V when the size policy is not trained), ``tree_depth`` (the fixed depth
    when the depth policy is not trained; None = uniformly random depths in [1, ``max_depth``], as LTD's
    first phase), ``size_timesteps`` (cycles per size phase; None = ``timesteps``). With ``tree``,
    ``timesteps`` is per depth phase (decisions), ``max_depth`` the most tree levels per cycle, and
    ``eval_gammas`` unused.
    """

    target: str = DEFAULT_TARGET
    draft: str = DEFAULT_DRAFT
    device: str = "cpu"
    dtype: str = "float32"
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    max_new_tokens: int = 64
    max_depth: int = DEFAULT_MAX_DEPTH
    timesteps: int = 8192
    n_steps: int = 256
    batch_size: int = 64
    n_epochs: int = 10
    learning_rate: float = 3e-4
    discount: float = 1.0
    gae_lambda: float = 0.95
    ent_coef: float = 0.01
    clip_range: float = 0.2
    net_arch: tuple[int, ...] = (64, 64)
    reward_scale: float | None = None
    episode: str = "cycle"
    seed: int = 0
    out: str = "runs/ppo"
    overwrite: bool = False
    resume: bool = False
    checkpoint_every: int = 2048
    wandb_mode: str = "offline"
    wandb_project: str = "learn2draft"
    run_name: str | None = None
    progress_bar: bool = True
    verbose: bool = False
    threads: int | None = 1
    prompt_split: str = "train"
    prompts: str | None = None
    drafter: str = "model"
    head: str | None = None
    lookup_min_ngram: int | None = None
    features: str = "full"
    warmup_prompts: int = 2
    eval_prompts: int = 3
    eval_gammas: tuple[int, ...] | None = None
    replay: str | None = None
    profile: str | None = None
    serve_loads: str | None = None
    serve_requests: int = 16
    tree: bool = False
    policies: tuple[str, ...] = TREE_POLICIES
    rounds: int = 2
    tree_width: int = DEFAULT_TREE_WIDTH
    tree_top_k: int = DEFAULT_TREE_TOP_K
    verify_sizes: tuple[int, ...] = DEFAULT_VERIFY_SIZES
    verify_size: int = 16
    tree_depth: int | None = None
    size_timesteps: int | None = None
    extra: dict = field(default_factory=dict)

    def fixed_gammas(self) -> tuple[int, ...]:
        """The fixed depths of the final check: ``eval_gammas``, or 0 and min(4, ``max_depth``)."""
        return tuple(self.eval_gammas) if self.eval_gammas is not None else (0, min(4, self.max_depth))

    def sampling(self):
        """The :class:`learn2draft.sampling.SamplingConfig` of these settings."""
        from learn2draft.sampling import SamplingConfig

        return SamplingConfig(temperature=self.temperature, top_k=self.top_k, top_p=self.top_p, min_p=self.min_p,
                              repetition_penalty=self.repetition_penalty, presence_penalty=self.presence_penalty)

    def validate(self) -> None:
        """Raise ValueError with a clear message for any setting out of range."""
        from learn2draft.drafters import DRAFTERS, HYBRID_DRAFTERS

        # the comma lists: an empty item ("a.npz,,b.npz", a trailing comma) is one error naming the flag
        splits = comma_items(self.prompt_split, "--prompt-split",
                             f"use one or more of {', '.join(SPLITS)} joined by commas")
        for flag, value, what, example in (("--replay", self.replay, "trace files", "lookup.npz,model.npz"),
                                           ("--profile", self.profile, "profiles", "cpu-2core,gpu-like")):
            if isinstance(value, str):
                comma_items(value, flag, f"join the {what} with single commas, e.g. {example}")
        checks = [
            (self.timesteps > 0, f"timesteps must be > 0, got {self.timesteps}."),
            (self.max_new_tokens > 0, f"max_new_tokens must be > 0, got {self.max_new_tokens}."),
            (self.max_depth >= 1, f"max_depth must be ≥ 1 (a policy needs something to decide), got {self.max_depth}."),
            (self.n_steps > 1, f"n_steps must be > 1, got {self.n_steps}."),
            (0 < self.batch_size <= self.n_steps, f"batch_size must be in [1, n_steps={self.n_steps}], got {self.batch_size}."),
            (self.n_epochs > 0, f"n_epochs must be > 0, got {self.n_epochs}."),
            (self.learning_rate > 0, f"learning_rate must be > 0, got {self.learning_rate}."),
            (0 < self.discount <= 1, f"discount must be in (0, 1], got {self.discount}."),
            (0 <= self.gae_lambda <= 1, f"gae_lambda must be in [0, 1], got {self.gae_lambda}."),
            (math.isfinite(self.ent_coef) and self.ent_coef >= 0, f"ent_coef must be a finite number ≥ 0, got {self.ent_coef}."),
            (math.isfinite(self.clip_range) and self.clip_range > 0,
             f"clip_range must be a finite number > 0 (0 would freeze the policy), got {self.clip_range}."),
            (0 <= self.seed < 2**32, f"seed must be in [0, 2**32) (numpy and stable-baselines3 seeds), got {self.seed}."),
            (self.reward_scale is None or (math.isfinite(self.reward_scale) and self.reward_scale > 0),
             f"reward_scale must be > 0 (or None = auto), got {self.reward_scale}."),
            (self.episode in ("cycle", "generation"), f"episode must be 'cycle' or 'generation', got {self.episode!r}."),
            (self.checkpoint_every >= 0, f"checkpoint_every must be ≥ 0, got {self.checkpoint_every}."),
            (self.wandb_mode in WANDB_MODES, f"wandb_mode must be one of {WANDB_MODES}, got {self.wandb_mode!r}."),
            (self.threads is None or self.threads > 0, f"threads must be > 0, got {self.threads}."),
            (self.warmup_prompts >= 1, f"warmup_prompts must be ≥ 1, got {self.warmup_prompts}."),
            (self.eval_prompts >= 0, f"eval_prompts must be ≥ 0, got {self.eval_prompts}."),
            (all(0 <= g <= self.max_depth for g in self.fixed_gammas()),
             f"eval_gammas must be in [0, max_depth={self.max_depth}] (a larger fixed depth cannot run), "
             f"got {self.eval_gammas}."),
            (len(self.net_arch) > 0 and all(h > 0 for h in self.net_arch), f"net_arch must be positive sizes, got {self.net_arch}."),
            (self.drafter in DRAFTERS + HYBRID_DRAFTERS,
             f"drafter must be one of {', '.join(DRAFTERS + HYBRID_DRAFTERS)}, got {self.drafter!r}."),
            (self.lookup_min_ngram is None or (("lookup" in self.drafter or self.replay)  # replay: the traces' drafter
                                               and 1 <= self.lookup_min_ngram <= 4),
             f"--lookup-min-ngram applies to prompt lookup (--drafter lookup, lookup+model, lookup+head) and must be "
             f"between 1 and 4, got {self.lookup_min_ngram} with --drafter {self.drafter}."),
            (self.drafter not in HYBRID_DRAFTERS or (self.replay and self.features == "full" and not self.tree),
             f"--drafter {self.drafter} trains in replay: record lookup and {self.drafter.split('+')[-1]} traces on the "
             f"same prompts (python -m eval.record --drafter lookup / --drafter {self.drafter.split('+')[-1]} "
             "--temperature 0) and pass --replay LOOKUP.npz,NEURAL.npz --profile P (features full, no --tree)."),
            (self.serve_loads is None or (self.replay and self.drafter not in HYBRID_DRAFTERS
                                          and self.features == "full" and not self.tree),
             "--serve-loads trains a load-aware policy in replay (learn2draft/ServeReplay-v0): pass chain traces of one "
             "drafter and a latency profile with the batch axis: --replay TRACES --profile P (measured with "
             "python -m eval.profile --batch-sizes 1,2,4,8,16); not with a hybrid drafter, --features or --tree."),
            (self.serve_loads is None or _loads_ok(self.serve_loads),
             f"--serve-loads must be concurrency levels ≥ 1 joined by commas (e.g. 1,2,4,8), got {self.serve_loads!r}."),
            (isinstance(self.serve_requests, int) and self.serve_requests >= 1,
             f"--serve-requests must be an integer ≥ 1, got {self.serve_requests!r}."),
            (bool(splits) and all(sp in SPLITS for sp in splits),
             f"prompt_split must be one or more of {', '.join(SPLITS)} joined by commas, got {self.prompt_split!r}."),
        ]
        checks.append((self.features in ("full", "engine", "profile"),
                       f"features must be 'full', 'engine' or 'profile', got {self.features!r}."))
        checks.append((self.features != "profile" or self.replay,
                       "--features profile trains in replay: add --replay TRACES --profile P1,P2 (the latency profiles "
                       "of the machines the policy should serve)."))
        checks.append((not (self.features == "engine" and self.replay),
                       "--features engine trains on the real loop only (the replay environment builds the loop's "
                       "features): drop --replay, or train --features full."))
        checks.append(((self.replay is None) == (self.profile is None),
                       "--replay TRACES and --profile PROFILE go together: replay needs both the traces and the "
                       "latency profile (e.g. --profile cpu-2core)."))
        checks.append((not self.replay or (self.min_p, self.repetition_penalty, self.presence_penalty) == (0.0, 1.0, 0.0),
                       "--min-p, --repetition-penalty and --presence-penalty with --replay: the sampling comes from the "
                       "traces (python -m eval.record takes these flags): drop them."))
        checks.append((not (self.prompts and self.replay),
                       "--prompts with --replay: replay trains on the prompts the traces were recorded on (python -m "
                       "eval.record --prompts FILE records a user's own): drop --prompts."))
        checks.append((not (self.overwrite and self.resume),
                       "--overwrite and --resume exclude each other: --resume continues the run in --out, "
                       "--overwrite starts it over."))
        if self.tree:
            checks += self._tree_checks()
        for ok, msg in checks:
            if not ok:
                raise ValueError(msg)
        self.sampling()  # SamplingConfig validates the sampling settings

    def _tree_checks(self) -> list[tuple[bool, str]]:
        """The checks of a ``tree`` run's settings, as (ok, message) pairs."""
        pols = tuple(self.policies)
        unknown = [p for p in pols if p not in TREE_POLICIES]
        sizes = tuple(self.verify_sizes)
        return [
            (self.drafter != "lookup", "--tree needs a drafter that drafts trees: prompt lookup proposes one continuation, "
                                       "not top-k children; use --drafter model or --drafter head."),
            (not unknown and len(pols) > 0 and len(set(pols)) == len(pols),
             f"--policies must be depth, size or depth,size, got {','.join(pols) or 'nothing'!r}"
             + (f" (unknown: {', '.join(unknown)})" if unknown else "") + "."),
            (self.rounds >= 1, f"rounds must be ≥ 1, got {self.rounds}."),
            (self.tree_width >= 1 and self.tree_top_k >= 1,
             f"--width and --tree-top-k must be ≥ 1, got {self.tree_width} and {self.tree_top_k}."),
            (len(sizes) > 0, "--verify-sizes is empty: give the size policy's V set, e.g. 1,2,4,8,16,32,48,64."),
            (all(v >= 1 for v in sizes) and all(b > a for a, b in zip(sizes, sizes[1:])),
             f"--verify-sizes must be strictly increasing integers ≥ 1, got {list(sizes)}."),
            (self.verify_size >= 1, f"--verify-size must be ≥ 1 (tree nodes verified), got {self.verify_size}."),
            (self.tree_depth is None or 1 <= self.tree_depth <= self.max_depth,
             f"--tree-depth must be in [1, --max-depth={self.max_depth}], got {self.tree_depth}."),
            (self.size_timesteps is None or self.size_timesteps > 0,
             f"size_timesteps must be > 0, got {self.size_timesteps}."),
            (not self.replay, "--tree trains on the real loop only: drop --replay (traces record chains)."),
            (self.features == "full", f"--tree trains on the loop's features: drop --features {self.features}."),
            (not self.resume, "--resume does not continue tree runs yet: start over with --overwrite."),
        ]

    @classmethod
    def from_run(cls, out: str | Path) -> TrainConfig:
        """The settings saved in ``out/config.json`` by an earlier run (for ``--resume``).

        Raises:
            FileNotFoundError: ``out`` holds no ``config.json``.
            ValueError: its ``config.json`` is damaged or not a training run's.
        """
        saved = read_run_config(Path(out))
        if saved is None:
            cfg_file = Path(out) / "config.json"
            if cfg_file.is_file():  # there, but damaged or not a run's: "start one without --resume" would not help
                try:
                    json.loads(cfg_file.read_text())
                    why = "is not the config.json of a python -m train run"
                except (OSError, ValueError) as e:
                    why = f"is damaged ({e.__class__.__name__}: {e})"
                raise ValueError(f"--resume: {cfg_file} {why}: restore it from a copy to continue the run (its "
                                 "checkpoints and model.zip are left as they are), or train into another --out.")
            raise FileNotFoundError(f"--resume: {out} holds no training run (no config.json written by "
                                    "python -m train): start one without --resume.")
        saved = {"discount": saved.get("gamma"), **saved} if "gamma" in saved else saved  # runs before the rename
        kw = {k: saved[k] for k in cls.__dataclass_fields__ if k in saved}
        for k in ("net_arch", "eval_gammas"):
            if kw.get(k) is not None:
                kw[k] = tuple(kw[k])
        kw.update(out=str(out), overwrite=False, resume=True)
        return cls(**kw)


def read_run_config(out: Path) -> dict | None:
    """``out/config.json`` if :func:`run` wrote it (it names the environment a run trains on: :data:`ENV_ID`,
    :data:`REPLAY_ENV_ID`, a load-aware run's ``envs.serve.SERVE_ENV_ID`` or a tree run's), else None."""
    from envs.serve import SERVE_ENV_ID

    try:
        saved = json.loads((Path(out) / "config.json").read_text())
    except (OSError, ValueError):
        return None
    known = (ENV_ID, REPLAY_ENV_ID, SERVE_ENV_ID, *TREE_ENV_IDS)
    return saved if isinstance(saved, dict) and saved.get("env_id") in known else None


def default_out_dir() -> str:
    """``runs/default``: where ``python -m eval`` looks by default."""
    return os.path.join("runs", "default")



__all__ = ["ENV_ID", "REPLAY_ENV_ID", "TREE_ENV_IDS", "TREE_POLICIES", "WANDB_MODES", "TrainConfig", "default_out_dir", "read_run_config"]
