"""PPO training of a draft-depth policy (a chain) on the real speculative decoder, or in replay.

:func:`train.launch.run` takes an already loaded :class:`learn2draft.ModelPair` (so tests can pass tiny
models) and a :class:`TrainConfig`, prepares the output directory and calls :func:`train_chain` (this
module) or :func:`train.tree.train_tree`; ``python -m train`` (:mod:`train.__main__`) loads the pair from
names and calls it. Reading order: :class:`TrainConfig` → :func:`train_chain` (top to bottom); the phases it
shares with tree runs are in :mod:`train.phases`, the callbacks in :mod:`train.callbacks`.

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

import re
import time
from collections.abc import Collection
from pathlib import Path

from stable_baselines3 import PPO
from stable_baselines3.common.monitor import Monitor
from stable_baselines3.common.vec_env import DummyVecEnv

from envs.serve import SERVE_ENV_ID
from eval.oracle import oracle_report
from learn2draft.cli import comma_items
from learn2draft.decoding import FixedDepthController
from learn2draft.drafters import make_drafter
from learn2draft.features import (
    engine_feature_spec,
    feature_spec,
    hybrid_feature_spec,
    profile_feature_spec,
    serve_feature_spec,
)
from learn2draft.models import ModelPair
from learn2draft.names import HELDOUT_SEED_OFFSET, HYBRID_DRAFTERS
from policies.export import export_policy
from policies.layout import SERVE_PROFILE_FILE, VLLM_SCHEDULE_FILE
from policies.load import load_policy
from train import callbacks, phases
from train.callbacks import CycleStatsCallback, SignalStop
from train.config import ENV_ID, REPLAY_ENV_ID, TrainConfig
from train.outdir import Replacement, latest_checkpoint
from train.phases import InterruptedAfterTraining

#: (traces, profile, traces' precision) whose precision mismatch this process has already reported.
_PRECISION_SAID: set[tuple[str, str, str]] = set()


def apply_replay_settings(cfg: TrainConfig, given: Collection[str] | None = None):
    """For ``cfg.replay``: load the traces and the profile, take the traces' models, drafter, sampling and
    ``max_new_tokens`` into ``cfg`` (settings left at their defaults), and ``max_depth`` when it was left at its
    default and exceeds the traces' (a ``max_depth`` the traces hold is kept: replay runs any depth up to the
    recorded one; given explicitly above it, it is refused), the precision the policy records (``dtype``: the
    profile's, else the traces', unless given by name; ``auto`` with neither measured on this machine), and build the replay
    environment (:class:`envs.replay.SpecDecodeReplayEnv`, ``episode=cfg.episode``, reward scale 1). Several
    profiles (``cfg.profile`` joined by commas) make one environment over all of them, with the profile
    features in the observation when ``cfg.features == "profile"``.

    Args:
        given: the :class:`TrainConfig` fields set explicitly (e.g. on the command line); None: those that
            differ from their defaults.

    Returns:
        the environment.

    Raises:
        FileNotFoundError: a trace or profile file is missing.
        ValueError: a setting given explicitly differs from the traces' (the message names the flag), or
            ``max_new_tokens`` / ``max_depth`` exceed the traces' (``max_depth``: given explicitly), or the profile
            lacks the traces' drafter.
    """
    from envs.hybrid import HybridReplayEnv, split_hybrid_traces
    from envs.replay import SpecDecodeReplayEnv
    from learn2draft.replay.latency import load_profiles
    from learn2draft.replay.traces import load_traces

    paths = comma_items(str(cfg.replay), "--replay",
                        "join the trace files with single commas, e.g. lookup.npz,model.npz")
    hybrid = cfg.drafter in HYBRID_DRAFTERS or len({load_traces(p).drafter for p in paths}) > 1
    if hybrid:  # a lookup trace set and a neural one: the hybrid drafter of the two
        look, neural = split_hybrid_traces(paths)
        traces, h, drafter = look, neural.header, f"lookup+{neural.drafter}"
    else:
        traces = load_traces(cfg.replay)
        h, drafter = traces.header, traces.drafter
    profiles = load_profiles(cfg.profile)
    if hybrid and len(profiles) > 1:
        raise ValueError("A hybrid drafter replays on one latency profile: pass one --profile.")
    defaults = TrainConfig()

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
    take("drafter", drafter)
    if "lookup" in cfg.drafter:  # the lookup traces' n-gram setting (traces recorded before it was: the default)
        from learn2draft.drafters.lookup import DEFAULT_MIN_NGRAM

        take("lookup_min_ngram", int((traces.header.get("drafter") or {}).get("min_ngram", DEFAULT_MIN_NGRAM)))
    elif cfg.lookup_min_ngram is not None:
        raise ValueError(f"--lookup-min-ngram {cfg.lookup_min_ngram}, but the traces {cfg.replay} were recorded with "
                         f"the {cfg.drafter} drafter, which has no prompt lookup: drop --lookup-min-ngram.")
    for k in ("temperature", "top_k", "top_p"):
        take(k, type(getattr(defaults, k))(h["sampling"][k]))
    if cfg.drafter in ("head", "lookup+head"):
        head = (h.get("drafter") or {}).get("head") or None
        if cfg.head is None:
            cfg.head = head
        elif head and Path(cfg.head).resolve() != Path(head).resolve():
            raise ValueError(f"--head {cfg.head}, but the traces were recorded with the head in {head}: drop --head.")
    if cfg.max_new_tokens == defaults.max_new_tokens:
        cfg.max_new_tokens = traces.max_new_tokens
    # The precision the replayed costs were measured in (the profile's; else the traces'): the policy records it.
    measured = profiles[0].machine.get("dtype") or h.get("dtype")
    recorded = h.get("dtype")
    key = (str(cfg.replay), profiles[0].name, str(recorded))
    if recorded and profiles[0].machine.get("dtype") and str(recorded) != str(profiles[0].machine["dtype"]) \
            and key not in _PRECISION_SAID:  # once: the command checks its settings, then builds the environment
        _PRECISION_SAID.add(key)
        from learn2draft.cli import stderr_line

        stderr_line(f"warning: the traces {cfg.replay} were recorded in {recorded}, but the profile "
                    f"{profiles[0].name!r} was measured in {profiles[0].machine['dtype']}: the policy learns "
                    f"{profiles[0].machine['dtype']} costs and records that precision (it warns when run in {recorded}). "
                    f"For a {recorded} policy pass a profile measured in {recorded} (python -m eval.profile --dtype "
                    f"{recorded}); for a {profiles[0].machine['dtype']} one, record the traces in it (python -m eval.record "
                    f"--dtype {profiles[0].machine['dtype']}).")
    if measured and (given is None or "dtype" not in given or cfg.dtype == "auto"):
        cfg.dtype = str(measured)
    if cfg.dtype == "auto":  # neither the profile nor the traces say: the precision this machine would run them in
        from learn2draft.models import resolve_dtype
        from learn2draft.settings import forward_widths

        cfg.dtype = resolve_dtype("auto", cfg.device, cfg.threads, forward_widths(cfg.serve_loads, (cfg.max_depth,)))
    if cfg.max_depth > traces.max_depth:
        if ("max_depth" in given) if given is not None else cfg.max_depth != defaults.max_depth:
            raise ValueError(f"--max-depth {cfg.max_depth}, but the traces {cfg.replay} hold chains up to max_depth="
                             f"{traces.max_depth}: pass --max-depth {traces.max_depth} or less (or drop it), or record "
                             f"deeper traces (python -m eval.record --max-depth {cfg.max_depth}).")
        cfg.max_depth = traces.max_depth  # the default, deeper than the traces: as deep as they go
    cfg.validate()
    if cfg.serve_loads:  # a load-aware policy: one γ per batched step of a simulated request stream
        from envs.serve import ServeReplayEnv
        from train.config import serve_loads

        return ServeReplayEnv(traces, profiles[0], loads=serve_loads(cfg.serve_loads), num_requests=cfg.serve_requests,
                              max_depth=cfg.max_depth, max_new_tokens=cfg.max_new_tokens, episode="step",
                              balance=True)
    if hybrid:
        return HybridReplayEnv((look, neural), profiles[0], max_new_tokens=cfg.max_new_tokens, max_depth=cfg.max_depth,
                               episode=cfg.episode)
    return SpecDecodeReplayEnv(traces, profiles, max_new_tokens=cfg.max_new_tokens, max_depth=cfg.max_depth,
                               episode=cfg.episode, profile_features=cfg.features == "profile")


def _replay_source(env, cfg: TrainConfig) -> dict:
    """What a replay-trained policy was trained on (saved in ``config.json`` and ``policy_config.json``)."""
    h = env.traces.header
    given = comma_items(str(cfg.profile))  # checked by TrainConfig.validate
    where = [str(Path(p).resolve()) if Path(p).is_file() else p for p in given]
    src = {"traces": [str(Path(p).resolve()) for p in comma_items(str(cfg.replay))],
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
    ctrls = {f"fixed_gamma_{g}": FixedDepthController(g) for g in cfg.fixed_gammas()}
    ctrls["policy"] = policy
    rep = oracle_report(env, ctrls, repeats=5, seed=cfg.seed + HELDOUT_SEED_OFFSET, profile_index=profile_index)
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


def _hybrid_evaluation(env, policy_dir: Path, cfg: TrainConfig) -> dict:
    """The final check of a hybrid run in replay (on the training traces, in-sample):
    :func:`eval.oracle.hybrid_report` of the policy against the hand configurations and the oracle."""
    from eval.oracle import hybrid_report

    gammas = sorted({1, 2, 3, 4, 6, 8, 12, 16} | set(cfg.fixed_gammas()))
    evaluation = hybrid_report(env, {"policy": load_policy(policy_dir)}, gammas, seed=cfg.seed + HELDOUT_SEED_OFFSET)
    evaluation["source"] = f"hybrid replay of the training traces (in-sample) with profile {env.profile.name}"
    return evaluation


def _serve_export(env) -> dict:
    """What a load-aware export records beside the usual settings: its scales, loads and the batched context rule."""
    return {"serve": {"batch_scale": int(env.batch_scale), "context_scale": float(env.context_scale),
                      "loads": [x.label for x in env.loads], "num_requests": env.num_requests,
                      "batch_context": env._kw["batch_context"], "drafter": env.drafter,
                      "profile": env.profile.name, "max_new_tokens": env.max_new_tokens}}


def _write_vllm_schedule(env, policy_dir: Path) -> None:
    """The export to vLLM (``policy/vllm_schedule.json``, written with every export, an interrupted run's too): the γ
    the policy picks most at each concurrency in replay, as ``num_speculative_tokens_per_batch_size`` in the list form
    ``[[start, end, K], …]`` that vLLM 0.34.0 accepts (:func:`policies.vllm.vllm_config_schedule`)."""
    import json

    from envs.serve import batch_gammas
    from policies.load import load_serve_policy
    from policies.vllm import vllm_config_schedule, vllm_schedule

    graph = load_serve_policy(policy_dir).graph
    gammas = batch_gammas(env, lambda obs: int(graph.actions(obs)[0]))
    schedule = {"num_speculative_tokens": int(env.max_depth), "num_speculative_tokens_per_batch_size":
                vllm_config_schedule(vllm_schedule(gammas)), "derived_from": f"the policy's most frequent γ at each concurrency in replay "
                                                       f"(profile {env.profile.name})"}
    (policy_dir / VLLM_SCHEDULE_FILE).write_text(json.dumps(schedule, indent=2))


def _serve_evaluation(env, policy_dir: Path) -> dict:
    """The final check of a load-aware run in replay (in-sample): the learned policy against no speculation, the best
    fixed γ, the grid-tuned per-batch-size table and vLLM's adaptive verification at every training load
    (:func:`learn2draft.replay.serve.compare_baselines`, the same requests and seeds)."""
    import json

    from learn2draft.replay.serve import compare_baselines
    from policies.load import load_serve_policy

    graph = load_serve_policy(policy_dir).graph
    learned = env.policy(lambda obs: int(graph.actions(obs)[0]))
    schedule = json.loads((policy_dir / VLLM_SCHEDULE_FILE).read_text())
    res = compare_baselines(env.traces, env.profile, env.loads, env.num_requests, max_depth=env.max_depth,
                            max_new_tokens=env.max_new_tokens, policies={"learned": learned})
    rates = {name: [r["tokens_per_s"] for r in reps] for name, reps in res["methods"].items()}
    return {"source": f"serve replay of the training traces (in-sample) with profile {env.profile.name}",
            "loads": res["loads"], "tokens_per_s": rates, "best_gamma": res["best_gamma"], "table": res["table"],
            "vllm_schedule": schedule["num_speculative_tokens_per_batch_size"]}


# --------------------------------------------------------------------------- the chain run, phase by phase
def _chain_env(pair: ModelPair | None, cfg: TrainConfig, prompts) -> tuple:
    """The training environment and its prompts: :class:`envs.replay.SpecDecodeReplayEnv` with ``cfg.replay``
    (one None per trace prompt), else :class:`envs.SpecDecodeEnv` on ``prompts`` (tokenised and checked up front)."""
    from envs.spec_decode import SpecDecodeEnv

    if cfg.replay:  # recorded traces and a latency profile: no model runs
        env = apply_replay_settings(cfg)
        n = len(env.traces.prompts) if cfg.serve_loads else len(env.prompt_indices)
        return env, [None] * n
    prompts = phases.training_prompts(cfg, prompts)
    env = SpecDecodeEnv(pair, prompts, cfg.sampling(), max_new_tokens=cfg.max_new_tokens, max_depth=cfg.max_depth,
                        episode=cfg.episode,
                        drafter=make_drafter(cfg.drafter, pair, head=cfg.head, min_ngram=cfg.lookup_min_ngram))
    return env, prompts


def _feature_spec(cfg: TrainConfig, env=None) -> dict:
    """The ``feature_spec.json`` of the run's observation (``cfg.features``: full, engine or profile; a load-aware run:
    the serve features with ``env``'s scales)."""
    if cfg.serve_loads:
        return serve_feature_spec(env.max_depth, env.batch_scale, env.context_scale)
    if cfg.features == "engine":
        return engine_feature_spec(cfg.max_depth)
    if cfg.drafter in HYBRID_DRAFTERS:
        return hybrid_feature_spec(cfg.max_depth)
    return profile_feature_spec(cfg.max_depth) if cfg.features == "profile" else feature_spec(cfg.max_depth)


def _chain_reference(pair: ModelPair | None, cfg: TrainConfig, env, saved: dict | None) -> tuple[dict, float]:
    """``(ar, reward_scale)``: a resumed run's saved ones (old and new rewards mean the same), the replayed
    autoregressive rate (measured as :func:`train.phases.measure_rate` measures it on the real loop), or
    :func:`train.phases.reference_rate` on the real loop."""
    if saved is not None:
        return saved["autoregressive_warmup"], saved["reward_scale_used"]
    if cfg.serve_loads:
        ar = {"tokens_per_s": env.reward_scale, "source": f"replay of plain decoding at concurrency 1 with profile "
                                                           f"{env.profile.name}"}
        return ar, cfg.reward_scale or env.reward_scale
    if cfg.replay:
        ar = {"cycle_tokens_per_s": env.autoregressive_rate(0), "source": f"replay with profile {env.profiles[0].name}"
              + ("" if len(env.profiles) == 1 else " (the others' rewards are relative to their own autoregressive rates)")}
        return ar, cfg.reward_scale or ar["cycle_tokens_per_s"] or 1.0
    return phases.reference_rate(pair, env.prompt_ids, cfg, FixedDepthController(min(2, cfg.max_depth)))


def _chain_model(cfg: TrainConfig, env, checkpoint: tuple[Path, int] | None) -> PPO:
    """PPO on ``env`` (through :class:`envs.engine_view.EngineViewWrapper` for ``features="engine"``: what vLLM's
    draft-length policy protocol shows a policy), loaded from ``checkpoint`` (weights, optimiser state, step count)
    when resuming."""
    if cfg.features == "engine":
        from envs.engine_view import EngineViewWrapper

        vec_env = DummyVecEnv([lambda: Monitor(EngineViewWrapper(env))])
    else:
        vec_env = DummyVecEnv([lambda: Monitor(env)])
    if checkpoint is not None:
        return PPO.load(str(checkpoint[0]), env=vec_env, device="cpu")
    return phases.new_ppo(cfg, vec_env)


def _chain_check(pair: ModelPair | None, cfg: TrainConfig, env, policy_dir: Path, eval_prompts) -> dict:
    """The final check: in replay :func:`_replay_evaluation`, else the exported policy (driven through vLLM's
    protocol for ``features="engine"``, as the engine would) against the fixed depths of ``cfg.fixed_gammas()``
    on held-out prompts (:func:`train.phases.quick_check`)."""
    if cfg.serve_loads:
        return _serve_evaluation(env, policy_dir)
    if cfg.replay:
        return _hybrid_evaluation(env, policy_dir, cfg) if cfg.drafter in HYBRID_DRAFTERS else \
            _replay_evaluation(env, policy_dir, cfg)
    ids = phases.eval_prompt_ids(cfg, eval_prompts, env.encode)
    if cfg.features == "engine":
        from policies.vllm import LearnedDraftLengthPolicy, ProtocolController

        engine_policy = LearnedDraftLengthPolicy(policy_dir)
        policy = lambda dec: ProtocolController(engine_policy, dec)  # noqa: E731
    else:
        policy = load_policy(policy_dir)
    ctrls = {f"fixed_gamma_{g}": FixedDepthController(g) for g in cfg.fixed_gammas()}
    ctrls["policy"] = policy
    return phases.quick_check(pair, ids, ctrls, cfg)


def _finished_model(out: Path) -> tuple[Path, int] | None:
    """``(model.zip, its timesteps)`` of a run in ``out`` that finished (``metrics.json`` written after the model), else
    None."""
    import json

    model, metrics = out / "model.zip", out / "metrics.json"
    if not (model.is_file() and metrics.is_file()):
        return None
    try:
        steps = int(json.loads(metrics.read_text())["timesteps"])
    except (ValueError, KeyError, TypeError, OSError):
        return None
    return model, steps


#: The ``metrics.json`` key of a run whose training finished but whose export check or evaluation was interrupted:
#: ``--resume`` finishes them without training more.
UNFINISHED = "unfinished"


def evaluation_pending(out: Path) -> bool:
    """Whether the run in ``out`` was trained but stopped during its export or evaluation (``metrics.json`` says
    :data:`UNFINISHED`): ``--resume`` then finishes them."""
    import json

    try:
        return bool(json.loads((Path(out) / "metrics.json").read_text()).get(UNFINISHED))
    except (OSError, ValueError, AttributeError):
        return False


def check_resume_total(out: Path, timesteps: int) -> None:
    """Refuse a ``--resume`` of the run in ``out`` that would train nothing: it wrote its ``metrics.json`` (finished,
    or interrupted during training), its newest model (a checkpoint, or ``model.zip``) already holds ``timesteps`` or
    more, and its evaluation is not pending (:func:`evaluation_pending`). A run killed before writing its results is
    let through: ``--resume`` then writes them. Reads only small files; nothing is written.

    Raises:
        ValueError: names the steps done and the flag to pass.
    """
    out = Path(out)
    if not (out / "metrics.json").is_file():  # killed before its results were written: --resume finishes them
        return
    done = [c[1] for c in (latest_checkpoint(out), _finished_model(out)) if c is not None]
    if done and max(done) >= timesteps and not evaluation_pending(out):
        raise ValueError(f"--resume: {out} already holds a policy trained for {max(done)} timesteps, and --timesteps "
                         f"{timesteps} is the total to reach: nothing to train, and its results are kept as they are. "
                         f"Pass a larger total to train on (e.g. --timesteps {max(done) + max(timesteps, 1)}).")


def _log_summary(wandb_run, metrics: dict, out: Path, cfg: TrainConfig) -> None:
    """The run's numbers into the W&B summary and its export as a ``policy`` artifact."""
    import wandb

    wandb_run.summary.update({k: v for k, v in metrics.items() if isinstance(v, (int, float))})
    ev = metrics["evaluation"] or {}
    if cfg.serve_loads:  # a load-aware run: tokens/s per method and load
        for name, rates in (ev.get("tokens_per_s") or {}).items():
            for load, rate in zip(ev.get("loads", []), rates):
                wandb_run.summary[f"eval/{name}/{load}/tokens_per_s"] = rate
    else:
        for name, row in ev.items():
            if isinstance(row, dict) and isinstance(row.get("tokens_per_s"), (int, float)):
                wandb_run.summary[f"eval/{name}/tokens_per_s"] = row["tokens_per_s"]
    art = wandb.Artifact(re.sub(r"[^A-Za-z0-9_.-]", "-", f"policy-{out.name}"), type="policy",
                         metadata={"max_depth": cfg.max_depth})
    art.add_dir(str(out / "policy"))
    wandb_run.log_artifact(art)


def train_chain(pair: ModelPair | None, cfg: TrainConfig, out: Path, saved: dict | None, replacement: Replacement,
                stop: SignalStop, prompts, eval_prompts, t_start: float) -> dict:
    """The body of :func:`train.launch.run` for a chain (phases: environment, reference rate, run config,
    replace, PPO, export, check; see the module docstring).

    Returns:
        the summary written to ``metrics.json``.

    Raises:
        policies.export.ExportCheckError: the ONNX export disagrees with the PyTorch policy.
        ValueError: a prompt does not fit the context window, or a replay setting conflicts with the traces.
    """
    phases.seed_and_threads(cfg)
    env, prompts = _chain_env(pair, cfg, prompts)
    ar, reward_scale = _chain_reference(pair, cfg, env, saved)
    env.reward_scale = float(reward_scale)

    vocab_size = pair.vocab_size if pair is not None else env.vocab_size
    env_id = SERVE_ENV_ID if cfg.serve_loads else REPLAY_ENV_ID if cfg.replay else ENV_ID
    config = phases.run_config(cfg, pair, reward_scale, ar, len(prompts), vocab_size, env_id,
                               extra={"replay_source": _replay_source(env, cfg)} if cfg.replay else None, saved=saved)
    if not config["wandb_run_id"]:
        from wandb.sdk.lib.runid import generate_id

        config["wandb_run_id"] = generate_id()
    checkpoint = latest_checkpoint(out) if saved is not None else None
    if saved is not None:  # a finished run continues from its final model unless a later checkpoint exists (a checkpoint
        # of the same step count predates that rollout's PPO update, which model.zip holds)
        finished = _finished_model(out)
        if finished is not None and (checkpoint is None or checkpoint[1] <= finished[1]):
            checkpoint = finished
    if saved is not None and checkpoint is None:
        raise ValueError(f"--resume: {out} holds no checkpoint and no finished model to continue from (it was "
                         "interrupted before its first --checkpoint-every steps); start it over with --overwrite.")
    if saved is not None:
        check_resume_total(out, cfg.timesteps)  # nothing to train: refused before anything is written
    if checkpoint is not None:
        config["resumed"][-1]["from_timesteps"] = checkpoint[1]
    replacement.begin()  # from here on ``out`` belongs to the new run
    phases.write_run_start(out, config, _feature_spec(cfg, env))

    wandb_run = callbacks.init_wandb(cfg, out, config)
    try:
        model = _chain_model(cfg, env, checkpoint)
        log_dir = out / "logs"
        # SB3's CSV writer truncates its file: a resumed run logs to progress-resumed-<steps>.csv.
        suffix = f"-resumed-{model.num_timesteps}" if saved is not None else ""
        wandb_format = phases.set_logger(model, log_dir, wandb_run, suffix, verbose=cfg.verbose)
        cycle_cb = CycleStatsCallback(wandb_run)
        cbs = [cycle_cb] + ([phases.checkpoint_callback(cfg, out / "checkpoints", "ppo", model.get_env().num_envs)]
                            if cfg.checkpoint_every else [])
        t_train, steps_before = time.perf_counter(), model.num_timesteps
        interrupted = phases.learn(model, cfg, cbs, cfg.timesteps - model.num_timesteps, stop,
                                   reset_num_timesteps=checkpoint is None)
        train_seconds = time.perf_counter() - t_train
        if interrupted:  # keep what was learnt: checkpoint it (for --resume) and export it below
            phases.save_model(model, out / "checkpoints" / f"ppo_{model.num_timesteps}_steps.zip")
        phases.save_model(model, out / "model.zip")
        replacement.commit()
        try:
            return _chain_finish(model, pair, cfg, env, out, config, reward_scale, env_id, vocab_size, eval_prompts,
                                 interrupted, stop, wandb_run, cycle_cb, wandb_format, log_dir, saved, t_start,
                                 train_seconds, steps_before, ar)
        except KeyboardInterrupt:  # the trained policy is saved: say so, and let --resume finish the rest
            sig = stop.signal_name or "SIGINT"
            phases.write_metrics(out, {
                "wall_seconds": time.perf_counter() - t_start, "train_seconds": train_seconds,
                "timesteps": int(model.num_timesteps), "timesteps_requested": cfg.timesteps, "interrupted": True,
                "interrupted_by": sig, UNFINISHED: "export and evaluation", "evaluation": None,
                "resumed_from_timesteps": steps_before if saved is not None else None, "reward_scale": reward_scale,
                "paths": {"out": str(out), "model": str(out / "model.zip"), "policy": str(out / "policy"),
                          "logs": str(log_dir)}})
            raise InterruptedAfterTraining(out, model.num_timesteps, sig) from None
    finally:
        if wandb_run is not None:
            wandb_run.finish(exit_code=1 if stop.signal_name else 0)


def _chain_finish(model, pair, cfg: TrainConfig, env, out: Path, config: dict, reward_scale: float, env_id: str,
                  vocab_size: int, eval_prompts, interrupted: bool, stop: SignalStop, wandb_run, cycle_cb,
                  wandb_format, log_dir: Path, saved: dict | None, t_start: float, train_seconds: float,
                  steps_before: int, ar: dict) -> dict:
    """After training (``model.zip`` saved): export and check the policy, evaluate it, write ``metrics.json``."""
    trained_on = {"env": env_id, **config["replay_source"]} if cfg.replay else {"env": ENV_ID}
    serve = _serve_export(env) if cfg.serve_loads else None
    export = export_policy(model, out / "policy", cfg.max_depth, vocab_size=vocab_size,
                           config={**phases.export_config(cfg, config, reward_scale), "trained_on": trained_on,
                                   **(serve or {})},
                           observations=model.rollout_buffer.observations, seed=cfg.seed, serve=serve)
    if serve is not None:  # the policy prices its steps with the profile it learned on: it travels with it
        env.profile.save(out / "policy" / SERVE_PROFILE_FILE)
        _write_vllm_schedule(env, out / "policy")
    evaluation = (_chain_check(pair, cfg, env, out / "policy", eval_prompts)
                  if cfg.eval_prompts and not interrupted else None)
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
        "ep_rew_mean": phases.episode_reward_mean(model),
        "sb3_last": wandb_format.last_values,
        "cycles": cycle_cb.summary(),
        "export_check": export.check,
        "evaluation": evaluation,
        "paths": {"out": str(out), "model": str(out / "model.zip"), "policy": str(out / "policy"),
                  "logs": str(log_dir), "wandb": str(out / "wandb") if wandb_run is not None else None},
    }
    phases.write_metrics(out, metrics)
    if wandb_run is not None:
        _log_summary(wandb_run, metrics, out, cfg)
    return metrics


__all__ = ["UNFINISHED", "InterruptedAfterTraining", "apply_replay_settings", "check_resume_total",
           "evaluation_pending", "train_chain"]
