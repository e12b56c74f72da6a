"""``python -m train``: train a PPO draft-depth policy on the real speculative decoder (or, with
``--replay TRACES --profile PROFILE``, on recorded traces and a latency profile: see :mod:`envs.replay`).

Defaults train on the embedded pair (SmolLM2-135M-Instruct target + shipped draft) with the
'train' prompts, sized to finish in about 6.5 minutes on a 2-core CPU (measured: see the README), and log to Weights & Biases
offline (``wandb sync <out>/wandb/offline-run-*`` uploads later). Everything lands in ``--out``:
``model.zip``, ``config.json``, ``feature_spec.json``, ``metrics.json``, ``logs/progress.csv``,
``checkpoints/`` and ``policy/`` (ONNX export, ``feature_spec.json``, ``policy_config.json``,
``export_check.json``). Run ``python -m train --help`` for every flag.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import sys
from pathlib import Path

from learn2draft import cli
from learn2draft.cli import HelpFormatter
from train.config import WANDB_MODES, TrainConfig, default_out_dir

#: Settings that ``--resume`` may change; any other flag must repeat the saved value.
_RESUME_MAY_CHANGE = ("timesteps", "progress_bar", "verbose", "wandb_mode", "resume")

_WANDB_ALIASES = {"dryrun": "offline", "run": "online"}


def _int_list(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(x) for x in cli.comma_items(text))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None


def _name_list(text: str) -> tuple[str, ...]:
    try:
        return tuple(cli.comma_items(text))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected names joined by single commas, got {text!r}") from None


def build_parser() -> argparse.ArgumentParser:
    """The command-line interface (every :class:`TrainConfig` setting has a flag)."""
    d = TrainConfig()
    env_mode = _WANDB_ALIASES.get(os.environ.get("WANDB_MODE", ""), os.environ.get("WANDB_MODE") or "offline")
    p = argparse.ArgumentParser(
        prog="python -m train", allow_abbrev=False,
        description="Train a PPO policy that chooses the draft depth of speculative decoding, rewarded by "
                    "measured tokens/s, then export it to ONNX.",
        formatter_class=HelpFormatter,
    )
    cli.add_model_args(p)
    cli.add_sampling_args(p)
    cli.add_device_args(p)
    g = p.add_argument_group("decoding")
    g.add_argument("--max-new-tokens", type=int, default=d.max_new_tokens, help="tokens per generation (episode)")
    g.add_argument("--max-depth", type=int, default=d.max_depth, help="most tokens drafted per cycle")
    cli.add_drafter_arg(g, d.drafter)
    g.add_argument("--features", default=d.features, choices=["full", "engine", "profile"],
                   help="what the policy observes: full (this loop's features), engine (only the draft step and "
                        "top-1 draft probabilities, as vLLM's draft-length policy protocol passes them; run the "
                        "export with policies.vllm.LearnedDraftLengthPolicy) or profile (with --replay: the loop's "
                        "features and the latency profile's, so one policy serves several machines; load it with "
                        "load_policy(DIR, profile=...))")
    g = p.add_argument_group("PPO")
    g.add_argument("--timesteps", type=int, default=d.timesteps, help="environment steps (draft decisions) to train")
    g.add_argument("--n-steps", type=int, default=d.n_steps, help="steps per rollout")
    g.add_argument("--batch-size", type=int, default=d.batch_size, help="minibatch size of a PPO update")
    g.add_argument("--n-epochs", type=int, default=d.n_epochs, help="passes over each rollout per update")
    g.add_argument("--learning-rate", type=float, default=d.learning_rate, help="Adam learning rate")
    g.add_argument("--discount", type=float, default=d.discount,
                   help="PPO discount factor, SB3's gamma (1.0: a decision's return is its cycle's rate)")
    g.add_argument("--gae-lambda", type=float, default=d.gae_lambda, help="GAE λ (bias/variance of the advantages)")
    g.add_argument("--ent-coef", type=float, default=d.ent_coef, help="entropy bonus coefficient (exploration)")
    g.add_argument("--clip-range", type=float, default=d.clip_range, help="PPO ratio clipping ε")
    g.add_argument("--net-arch", type=_int_list, default=d.net_arch, help="hidden sizes, e.g. 64,64")
    g.add_argument("--reward-scale", type=float, default=None,
                   help="divide tokens/s rewards by this (default: the measured autoregressive per-cycle tokens/s)")
    g.add_argument("--episode", choices=["cycle", "generation"], default=d.episode,
                   help="episode = one draft/verify cycle (per-cycle objective) or one whole generation")
    g.add_argument("--seed", type=int, default=d.seed, help="seeds PPO, the prompt order and sampling")
    g = p.add_argument_group("run")
    cli.add_out_arg(g, "the run directory (default runs/default, where python -m eval looks)")
    g.add_argument("--overwrite", action="store_true",
                   help="replace the earlier training run in --out (never a directory python -m train did not write, "
                        "nor files of yours inside the run's folders: they are listed and the run refused)")
    g.add_argument("--resume", action="store_true",
                   help="continue the run in --out from its last checkpoint, with its saved settings "
                        "(--timesteps: the new total)")
    g.add_argument("--name", default=None, help="W&B run name (default: the --out folder name)")
    g.add_argument("--checkpoint-every", type=int, default=d.checkpoint_every, help="timesteps between checkpoints; 0 = off")
    g.add_argument("--wandb-mode", default=env_mode, help=f"one of {', '.join(WANDB_MODES)} (default: $WANDB_MODE or offline)")
    g.add_argument("--wandb-project", default=d.wandb_project, help="W&B project name")
    g.add_argument("--no-progress-bar", action="store_true",
                   help="hide the progress display (the bar on a terminal, one line per rollout in a log file)")
    loud = g.add_mutually_exclusive_group()
    loud.add_argument("-q", "--quiet", action="store_true",
                      help="standard error gets errors and interruptions only: no progress display (as "
                           "--no-progress-bar), no loading lines, no W&B hint; standard output keeps the JSON summary")
    loud.add_argument("-v", "--verbose", action="store_true",
                      help="also print SB3's table of each PPO update (losses, rewards) on standard error")
    g.add_argument("--prompt-split", default=d.prompt_split,
                   help="training prompts: train, heldout, copy_train or copy_heldout, or several joined by commas "
                        "(e.g. train,copy_train: open and copy-heavy prompts, so a lookup policy learns when not to draft)")
    g.add_argument("--prompts", default=None, metavar="FILE",
                   help="train on the prompts of this file instead (.jsonl with a 'prompt' field per line, or a JSON "
                        "list of strings, as python -m eval --prompts reads); not with --replay")
    g.add_argument("--warmup-prompts", type=int, default=d.warmup_prompts,
                   help="generations that warm up and measure the autoregressive rate")
    g.add_argument("--eval-prompts", type=int, default=d.eval_prompts,
                   help="held-out prompts for the final policy-vs-fixed-depth check; 0 = skip")
    g.add_argument("--eval-gammas", type=_int_list, default=None,
                   help="fixed depths in that check, each ≤ --max-depth (default: 0 and min(4, --max-depth))")
    g = p.add_argument_group("replay (train in minutes without running a model)")
    g.add_argument("--replay", default=None, metavar="TRACES",
                   help="train on learn2draft/SpecDecodeReplay-v0 from these trace files (python -m eval.record; several "
                        "joined by commas; a lookup and a model or head trace set together train the hybrid drafter "
                        "lookup+model / lookup+head on HybridReplay-v0); models, drafter, sampling and --max-new-tokens "
                        "come from them; --max-depth is kept when the traces hold it (lowered to theirs otherwise)")
    cli.add_profile_arg(g)
    g.add_argument("--serve-loads", default=None, metavar="LEVELS",
                   help="with --replay and --profile: train a load-aware policy (one γ per batched step for every "
                        "running row) on learn2draft/ServeReplay-v0, episodes drawn at these closed-loop concurrency "
                        "levels (e.g. 1,2,4,8); the profile needs the batch axis (python -m eval.profile --batch-sizes "
                        "1,2,4,8,16); run the export with python -m eval.serve --policy RUN")
    g.add_argument("--serve-requests", type=int, default=d.serve_requests,
                   help="with --serve-loads: requests per simulated stream")
    g = p.add_argument_group("draft trees (Learning to Draft: a depth policy and a verification-size policy)")
    g.add_argument("--tree", action="store_true",
                   help="draft EAGLE-2 trees (--drafter model or head) and train the --policies, alternating as LTD "
                        "does; exports RUN/policy (depth) and RUN/size_policy (size), load with "
                        "policies.tree.load_tree_policy RUN")
    g.add_argument("--policies", type=_name_list, default=d.policies,
                   help="with --tree: depth,size (alternate: size under random depths first, then depth under the "
                        "trained size policy, per round), depth (V fixed by --verify-size) or size (depths random or "
                        "--tree-depth)")
    g.add_argument("--rounds", type=int, default=d.rounds, help="with --tree: rounds of the size/depth alternation")
    g.add_argument("--verify-sizes", type=_int_list, default=d.verify_sizes,
                   help="with --tree: the size policy's choices of V (tree nodes verified); a V above the nodes "
                        "drafted verifies them all")
    g.add_argument("--verify-size", type=int, default=d.verify_size,
                   help="with --tree --policies depth: the fixed V")
    g.add_argument("--tree-depth", type=int, default=None,
                   help="with --tree --policies size: a fixed tree depth (default: uniformly random in [1, --max-depth])")
    g.add_argument("--size-timesteps", type=int, default=None,
                   help="with --tree: cycles per size phase (default: --timesteps, which is per depth phase)")
    cli.add_tree_shape_args(p)
    return p


def config_from_args(args: argparse.Namespace, time_auto: bool = True) -> TrainConfig:
    """Map parsed arguments to a :class:`TrainConfig` (not yet validated). ``--dtype auto`` is measured here
    (:func:`learn2draft.models.resolve_dtype` at the run's threads and widths) unless ``time_auto`` is False or
    ``--replay`` is given: then ``dtype`` stays ``"auto"`` (under ``--replay``
    :func:`train.chain.apply_replay_settings` takes the profile's precision)."""
    from learn2draft.cli import resolve_device
    from learn2draft.models import resolve_dtype
    from learn2draft.settings import forward_widths

    d = TrainConfig()

    def given_or_default(name: str):
        value = getattr(args, name)
        return getattr(d, name) if value is None else value

    mode = _WANDB_ALIASES.get(args.wandb_mode, args.wandb_mode)
    return TrainConfig(
        target=args.target or d.target, draft=args.draft or d.draft,
        device=resolve_device(args.device, check=False),
        # with --replay no model runs and the profile says which precision its costs are (apply_replay_settings):
        # auto is not timed here, before the flags are checked
        dtype=args.dtype if (args.replay or not time_auto) and args.dtype == "auto" else resolve_dtype(
            args.dtype, resolve_device(args.device, check=False), args.threads or d.threads,
            forward_widths(args.serve_loads, (args.max_depth, *((args.verify_sizes,) if args.tree else ())))),
        **{k: getattr(args, k) for k in cli.SAMPLING_DEFAULTS},
        max_new_tokens=args.max_new_tokens, max_depth=args.max_depth,
        timesteps=args.timesteps, n_steps=args.n_steps, batch_size=args.batch_size, n_epochs=args.n_epochs,
        learning_rate=args.learning_rate, discount=args.discount, gae_lambda=args.gae_lambda, ent_coef=args.ent_coef,
        clip_range=args.clip_range, net_arch=tuple(args.net_arch), reward_scale=args.reward_scale,
        episode=args.episode, seed=args.seed, out=args.out or default_out_dir(), overwrite=args.overwrite,
        resume=args.resume,
        checkpoint_every=args.checkpoint_every, wandb_mode=mode, wandb_project=args.wandb_project,
        run_name=args.name, progress_bar=not (args.no_progress_bar or args.quiet), verbose=args.verbose,
        threads=given_or_default("threads"), prompt_split=args.prompt_split, prompts=args.prompts, drafter=args.drafter, head=args.head,
        lookup_min_ngram=args.lookup_min_ngram, features=args.features,
        warmup_prompts=args.warmup_prompts, eval_prompts=args.eval_prompts,
        eval_gammas=None if args.eval_gammas is None else tuple(args.eval_gammas),
        replay=args.replay, profile=args.profile, serve_loads=args.serve_loads, serve_requests=args.serve_requests,
        tree=args.tree, policies=tuple(args.policies), rounds=args.rounds, tree_width=given_or_default("tree_width"),
        tree_top_k=given_or_default("tree_top_k"), verify_sizes=tuple(args.verify_sizes), verify_size=args.verify_size,
        tree_depth=args.tree_depth, size_timesteps=args.size_timesteps,
    )


def _as_flag(message: str, parser) -> str:
    """A :meth:`TrainConfig.validate` message that opens with a setting's name (``threads must be > 0, …``) opened
    with the command-line flag that sets it instead (``--threads must be > 0, …``), when the parser has that flag."""
    m = re.match(r"([a-z_]+) (must|applies)", message)
    if m:
        flag = "--" + m.group(1).replace("_", "-")
        if flag in parser._option_string_actions:
            return flag + message[len(m.group(1)):]
    return message


def _given_flags(argv: list[str] | None) -> set[str]:
    """The ``TrainConfig`` fields set explicitly on the command line (not left at their default)."""
    p = build_parser()
    for action in p._actions:
        action.default = argparse.SUPPRESS
    given = vars(p.parse_args(argv))
    renames = {"name": "run_name", "no_progress_bar": "progress_bar", "quiet": "progress_bar"}
    return {renames.get(k, k) for k in given}


def resume_config(args: argparse.Namespace, argv: list[str] | None) -> TrainConfig:
    """For ``--resume``: the saved settings of ``--out``, with a new ``--timesteps`` total if given.

    Raises:
        FileNotFoundError: ``--out`` holds no training run.
        ValueError: a flag other than ``--timesteps``, ``--no-progress-bar`` / ``-q``, ``-v`` or ``--wandb-mode`` asks for
            a setting other than the saved one (the run would silently change its recipe).
    """
    out = args.out or default_out_dir()
    if args.overwrite:
        raise ValueError("--overwrite and --resume exclude each other: --resume continues the run in --out, "
                         "--overwrite starts it over.")
    cfg = TrainConfig.from_run(out)
    asked = config_from_args(args, time_auto=False)  # a resumed run keeps its precision: nothing to measure
    changed = sorted(k for k in _given_flags(argv) - {"out", *_RESUME_MAY_CHANGE}
                     if getattr(asked, k, None) != getattr(cfg, k, None)
                     and not (k == "dtype" and asked.dtype == "auto"))  # auto: whatever the run was in
    if changed:
        k = changed[0]
        raise ValueError(f"--resume continues {out} with its saved settings: {k} is {getattr(cfg, k)!r} there, "
                         f"{getattr(asked, k)!r} here; drop --{k.replace('_', '-')} (or start a new run).")
    given = _given_flags(argv)
    for k in ("timesteps", "progress_bar", "verbose", "wandb_mode"):
        if k in given:
            setattr(cfg, k, getattr(asked, k))
    return cfg


def wandb_sync_hint(wandb_dir: str) -> str:
    """The command that uploads the offline W&B runs in ``wandb_dir``, with the path quoted for a POSIX shell (a space
    or ``$`` in ``--out`` stays one argument) and the glob outside the quotes."""
    import shlex

    return f"wandb sync {shlex.quote(str(wandb_dir))}/offline-run-*"


def _signal_status(sig: str) -> int:
    """The exit status of a run stopped by signal ``sig`` (``"SIGTERM"`` → 143); 130 for an unknown name."""
    return 128 + signal.Signals[sig].value if sig in signal.Signals.__members__ else 130


def _drop_if_empty(args: argparse.Namespace, created: bool | None) -> None:
    """Remove ``--out`` when this run created it and a failure before training left it empty (no empty folder for a
    run that never started); a folder that was there before, or holds anything, is left alone."""
    if not created:
        return
    out = Path(args.out or default_out_dir())
    try:
        if out.is_dir() and not any(out.iterdir()):
            out.rmdir()
    except OSError:
        pass


def _raise_interrupt_on_sigterm(signum, frame) -> None:
    raise KeyboardInterrupt(signal.Signals(signum).name)


def main(argv: list[str] | None = None) -> int:
    """Parse ``argv``, load the models, train, export; return 0 (:func:`run_command`). From its start SIGTERM stops
    it as Ctrl-C does (one ``interrupted`` line, an ``--out`` it created and left empty removed), not by the default
    silent kill."""
    import threading

    old = None
    if threading.current_thread() is threading.main_thread():
        old = signal.signal(signal.SIGTERM, _raise_interrupt_on_sigterm)
    try:
        return run_command(argv)
    finally:
        if old is not None:
            signal.signal(signal.SIGTERM, old)


def run_command(argv: list[str] | None = None) -> int:
    """Parse ``argv``, load the models, train, export; return 0.

    Bad settings, unknown models, an unwritable or already used ``--out``, ``--wandb-mode online``
    without credentials end with a one-line ``error:`` message and exit status 2 (``SystemExit``),
    before anything is written or loaded; a failed ONNX check exits with 1. A run stopped by Ctrl-C
    or SIGTERM saves and exports the policy so far, prints its summary with ``"interrupted": true``
    and how to ``--resume``, and returns 128 + the signal number (130 / 143).
    """
    cli.exit_if_shadowed("train", "learn2draft train")
    parser = cli.prepare_parser(build_parser())
    args = parser.parse_args(argv)
    cli.quiet_library_noise()

    try:  # importing torch, transformers and stable-baselines3 takes seconds: a Ctrl-C here is an interruption, not a traceback
        import torch

        from learn2draft.models import (
            ModelLoadError,
            TokenizerMismatchError,
            load_pair,
            parse_dtype,
            resolve_model_source,
        )
        from learn2draft.names import needs_draft_model
        from learn2draft.prompts import load_prompt_file
        from policies.export import ExportCheckError
        from train.chain import apply_replay_settings, check_resume_total
        from train.launch import run
        from train.outdir import prepare_out_dir
        from train.phases import InterruptedAfterTraining
        from train.wandb_setup import check_wandb
    except KeyboardInterrupt as e:
        sig = str(e) or "SIGINT"
        parser.exit(_signal_status(sig), f"{parser.prog}: interrupted ({sig}) while starting; nothing was written.\n")

    new_out = False  # whether this run creates --out (then a failure before training removes it again if empty)
    try:
        cfg = resume_config(args, argv) if args.resume else config_from_args(args)
        try:
            cfg.validate()
        except ValueError as e:
            raise ValueError(_as_flag(str(e), parser)) from None
        if args.resume and not cfg.tree:
            check_resume_total(Path(cfg.out), cfg.timesteps)  # nothing to train: refused, metrics.json kept
        given = _given_flags(argv)
        if cfg.tree and "verify_size" in given and "size" in cfg.policies:
            raise ValueError("--verify-size is the fixed V used when the size policy is not trained: drop it, or "
                             "train --policies depth.")
        if cfg.tree and "tree_depth" in given and "depth" in cfg.policies:
            raise ValueError("--tree-depth is the fixed depth used when the depth policy is not trained: drop it, or "
                             "train --policies size.")
        check_wandb(cfg.wandb_mode)
        if cfg.prompts:
            if "prompt_split" in given:
                raise ValueError("--prompts FILE replaces --prompt-split: pass one of them.")
            load_prompt_file(cfg.prompts)  # a missing or malformed file: one error before the models load
        if cfg.replay:
            apply_replay_settings(cfg, given)  # reads the traces and the profile: no model is loaded
        else:
            for name in (cfg.target, cfg.draft) if needs_draft_model(cfg.drafter) else (cfg.target,):
                resolve_model_source(name)  # cheap existence and damage checks, before anything is created
            if "head" in cfg.drafter and cfg.head:
                from learn2draft.drafters.head import check_head_dir

                check_head_dir(Path(cfg.head).expanduser())
        new_out = not Path(cfg.out).exists()
        prepare_out_dir(cfg.out, cfg.overwrite, cfg.resume)  # fail before the (slow) model loading
        if cfg.threads:
            torch.set_num_threads(cfg.threads)
        if not cfg.resume and not cfg.tree and cfg.timesteps % cfg.n_steps:
            trains = -(-cfg.timesteps // cfg.n_steps) * cfg.n_steps
            print(f"note: PPO trains in whole rollouts of --n-steps {cfg.n_steps} steps: --timesteps {cfg.timesteps} "
                  f"becomes {trains} timesteps (pass a multiple of --n-steps, or a smaller --n-steps, to train exactly "
                  f"{cfg.timesteps}).", file=sys.stderr, flush=True)
        say = (lambda text: None) if args.quiet else (lambda text: print(text, file=sys.stderr, flush=True))
        if cfg.replay:
            say(f"Replaying traces {cfg.replay} with the latency profile {cfg.profile} …")
            pair = None
        else:
            draft = cfg.draft if needs_draft_model(cfg.drafter) else None  # head and lookup need no draft model
            say(f"Loading target {cfg.target!r}" + (f" and draft {draft!r}" if draft else "")
                + f" on {cfg.device} ({cfg.dtype}) …")
            pair = load_pair(cfg.target, draft, device=cfg.device, dtype=parse_dtype(cfg.dtype))
        metrics = run(pair, cfg)
    except ExportCheckError as e:
        parser.exit(1, f"{parser.prog}: error: {e}\n")
    except (ModelLoadError, TokenizerMismatchError, ValueError, FileExistsError, FileNotFoundError,
            PermissionError) as e:
        _drop_if_empty(args, new_out)
        parser.exit(2, f"{parser.prog}: error: {e}\n")
    except OSError as e:
        _drop_if_empty(args, new_out)
        parser.exit(2, f"{parser.prog}: error: {e.__class__.__name__}: {e}\n")
    except InterruptedAfterTraining as e:
        then = (f"finish them (no more training) with `learn2draft train --out {e.out} --resume`" if e.resumable else
                "tree runs cannot be resumed: the saved models are the trained ones")
        parser.exit(_signal_status(e.signal_name),
                    f"{parser.prog}: interrupted ({e.signal_name}) after training: the trained policy "
                    f"({e.timesteps} timesteps) is saved in {e.out} (model.zip{'' if e.resumable else ', size_model.zip'}), but its export check and evaluation "
                    f"did not finish; {then}.\n")
    except KeyboardInterrupt as e:
        _drop_if_empty(args, new_out)
        sig = str(e) or "SIGINT"
        parser.exit(128 + signal.Signals[sig].value if sig in signal.Signals.__members__ else 130,
                    f"{parser.prog}: interrupted ({sig}) before training began; {args.out or default_out_dir()} is as it was.\n")
    summary = {
        "out": metrics["paths"]["out"],
        "wall_seconds": round(metrics["wall_seconds"], 1),
        "timesteps": metrics["timesteps"],
        "interrupted": metrics["interrupted"],
        "ep_rew_mean": metrics["ep_rew_mean"],
        "cycles": metrics["cycles"],
        "onnx_agreement": metrics["export_check"]["agreement"],
        "evaluation": metrics["evaluation"],
    }
    print(json.dumps(summary, indent=2, default=str))
    if metrics["paths"]["wandb"] and cfg.wandb_mode == "offline" and not args.quiet:
        print(f"W&B offline run in {metrics['paths']['wandb']}: upload with `{wandb_sync_hint(metrics['paths']['wandb'])}`",
              file=sys.stderr)
    if metrics["interrupted"]:
        sig = metrics["interrupted_by"] or "SIGINT"
        if cfg.tree:  # tree runs have no --resume: start them over
            print(f"Interrupted by {sig}: what was trained so far is saved and exported in {cfg.out}; tree runs cannot "
                  f"be resumed: start again with `--out {cfg.out} --overwrite`.", file=sys.stderr)
        else:
            print(f"Interrupted by {sig} at {metrics['timesteps']} of {cfg.timesteps} timesteps: the policy so far is "
                  f"saved and exported; continue with `learn2draft train --out {cfg.out} --resume`.", file=sys.stderr)
        return 128 + signal.Signals[sig].value
    return 0


if __name__ == "__main__":
    sys.exit(main())
