"""Loading a policy folder (the layout of :mod:`policies.layout`) as a controller, and reading what it
was trained with. Needs onnxruntime and the engine only (no torch graph, no stable-baselines3).

* :func:`load_policy` — a chain depth policy's export (or the training run holding it) as an
  :class:`policies.controllers.OnnxController`;
* :func:`load_tree_policy` — a draft-tree run or shipped tree folder as a :class:`policies.tree.TreePolicyController`;
* :func:`run_settings`, :func:`policy_drafter`, :func:`policy_head`, :func:`tree_settings` — the settings recorded
  beside the export (``config.json``, ``policy_config.json``, ``tree.json``).
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

from learn2draft.features import (
    FEATURE_NAMES,
    FEATURE_VERSION,
    HYBRID_FEATURE_NAMES,
    HYBRID_FEATURE_VERSION,
    PROFILE_FEATURE_NAMES,
    PROFILE_FEATURE_VERSION,
    SIZE_FEATURE_NAMES,
    SIZE_FEATURE_VERSION,
    profile_features,
)
from policies.controllers import OnnxController
from policies.layout import (
    DEPTH_DIR,
    FEATURE_SPEC_FILE,
    ONNX_FILE,
    POLICY_CONFIG_FILE,
    RUN_CONFIG_FILE,
    SIZE_DIR,
    TREE_FILE,
    config_problems,
    export_drafter,
    read_json,
    resolve_export_dir,
    tree_root,
)
from policies.tree import TreePolicyController


def load_policy(directory: str | Path, intra_op_num_threads: int = 1, profile=None) -> OnnxController:
    """Load an export directory (or a training run directory holding one in ``policy/``) as an
    :class:`OnnxController` (onnxruntime only; no SB3, no torch graph).

    Reads ``max_depth`` from ``policy_config.json`` and checks ``feature_spec.json`` against this
    version's features.

    Args:
        profile: for a profile-conditioned policy (``python -m train --features profile``), the latency
            profile of the machine it runs on (a :class:`learn2draft.replay.latency.LatencyProfile`, a file from
            ``python -m eval.profile``, or a shipped name such as ``"gpu-like"``): its
            :func:`learn2draft.features.profile_features` for the policy's drafter complete every observation.
            Other policies do not read it (it is still loaded, so a wrong path is an error).

    Raises:
        FileNotFoundError: the directory or one of its files is missing; ``profile`` names no file.
        ValueError: a JSON file does not parse (the message names it), ``max_depth`` is not an integer ≥ 1 equal to
            the feature specification's, an unknown drafter (:func:`policies.layout.config_problems`), the feature specification differs from this learn2draft version's, the directory
            holds draft-tree policies (``tree.json``), or a profile-conditioned policy is loaded without
            ``profile`` (or with one lacking its drafter's costs).
    """
    if (Path(directory) / TREE_FILE).is_file():
        raise ValueError(f"{directory} holds draft-tree policies (tree.json: a depth and a size policy): load it with "
                         "policies.load.load_tree_policy and decode with learn2draft.tree.TreeSpeculativeDecoder "
                         "(python -m eval --tree --tree-policy DIR); chain tools cannot run it.")
    d = resolve_export_dir(directory)
    for name in (ONNX_FILE, FEATURE_SPEC_FILE, POLICY_CONFIG_FILE):
        if not (d / name).is_file():
            raise FileNotFoundError(f"{d / name} is missing: is {d} a policy export directory (see policies.export)?")
    cfg = read_json(d / POLICY_CONFIG_FILE)
    spec = read_json(d / FEATURE_SPEC_FILE)
    names = [f.get("name") if isinstance(f, dict) else f for f in spec.get("features", [])]
    if names == list(SIZE_FEATURE_NAMES):
        raise ValueError(f"{d} is a draft tree's verification-size policy: load it with "
                         "policies.load.load_tree_policy (its training run or the folder above it).")
    if spec.get("kind") == "serve":
        raise ValueError(f"{d} is a load-aware policy (one γ per batched step, trained with --serve-loads): load it "
                         "with policies.load.load_serve_policy and run it in the batched decoder "
                         "(python -m eval.serve --policy DIR).")
    if spec.get("kind") == "engine":
        raise ValueError(f"{d} reads engine-visible features only (trained with --features engine, for vLLM): run it "
                         "with policies.vllm.LearnedDraftLengthPolicy (in this project's loop: "
                         "policies.vllm.ProtocolController), not as a loop controller.")
    conditioned = spec.get("kind") == "profile"
    hybrid = spec.get("kind") == "hybrid"  # a hybrid drafter's policy: three actions, the hybrid features appended
    expected = ([*FEATURE_NAMES, *PROFILE_FEATURE_NAMES] if conditioned
                else [*FEATURE_NAMES, *HYBRID_FEATURE_NAMES] if hybrid else list(FEATURE_NAMES))
    if (spec.get("version") != FEATURE_VERSION or names != expected
            or (conditioned and spec.get("profile_version") != PROFILE_FEATURE_VERSION)
            or (hybrid and spec.get("hybrid_version") != HYBRID_FEATURE_VERSION)):
        raise ValueError(
            f"{d / FEATURE_SPEC_FILE} describes feature version {spec.get('version')} {names}, but this learn2draft "
            f"builds version {FEATURE_VERSION} {expected}: re-export the policy or use a matching version."
        )
    problems = config_problems(d, cfg, spec)
    if problems:
        raise ValueError("; ".join(problems) + ".")
    extra = prof = None
    if profile is not None:  # loaded (and so checked) even for a policy that does not read it
        from learn2draft.replay.latency import LatencyProfile, load_profile

        prof = profile if isinstance(profile, LatencyProfile) else load_profile(profile)
    if conditioned:
        if prof is None:
            raise ValueError(f"{d} is profile-conditioned (trained with --features profile): it reads the latency profile "
                             "of the machine it runs on. Pass one: --profile P on the command line (generate, eval, "
                             "eval.benchmark, eval.oracle, eval.simreal), load_policy(dir, profile=P) in Python; P is a "
                             "shipped name (cpu-2core, gpu-like) or this machine's, measured with "
                             "`python -m eval.profile --out FILE`.")
        extra = profile_features(prof, export_drafter(cfg, d / POLICY_CONFIG_FILE))
    ctrl = OnnxController(d / ONNX_FILE, max_depth=cfg["max_depth"], intra_op_num_threads=intra_op_num_threads,
                          profile_features=extra, n_features=len(expected) - (len(PROFILE_FEATURE_NAMES) if conditioned else 0),
                          n_actions=3 if hybrid else 2)
    ctrl.drafter = export_drafter(cfg, d / POLICY_CONFIG_FILE)  # a hybrid policy runs with its hybrid drafter only
    ctrl.profile_name = prof.name if conditioned else None
    ctrl.trained_dtype = (cfg.get("training") or {}).get("dtype") or cfg.get("dtype")  # the precision it learned
    return ctrl


def load_serve_policy(directory: str | Path, profile=None, intra_op_num_threads: int = 1):
    """Load a load-aware policy export (``python -m train --serve-loads …``; or its training run) as a
    :class:`policies.controllers.LoadAwarePolicy` for :class:`learn2draft.batched.BatchedSpeculativeDecoder`: call it
    for one controller per request (what :func:`learn2draft.batched.serve` takes).

    Args:
        profile: the latency profile (with the batch axis) that prices each step's features; default the one it was
            trained on (``profile.json`` in the export). Another machine's profile changes what the policy sees.

    Raises:
        FileNotFoundError: a file of the export is missing.
        ValueError: not a load-aware export, a feature specification of another version, or a profile without
            the batch axis.
    """
    from learn2draft.features import SERVE_FEATURE_NAMES, SERVE_FEATURE_VERSION
    from learn2draft.replay.latency import LatencyProfile, load_profile
    from policies.controllers import LoadAwarePolicy
    from policies.layout import SERVE_PROFILE_FILE

    if not Path(directory).is_dir():
        raise FileNotFoundError(f"No policy directory {directory} (a load-aware export or its training run).")
    d = resolve_export_dir(directory)
    for name in (ONNX_FILE, FEATURE_SPEC_FILE, POLICY_CONFIG_FILE):
        if not (d / name).is_file():
            raise FileNotFoundError(f"{d / name} is missing: is {d} a policy export directory (see policies.export)?")
    cfg, spec = read_json(d / POLICY_CONFIG_FILE), read_json(d / FEATURE_SPEC_FILE)
    names = [f.get("name") if isinstance(f, dict) else f for f in spec.get("features", [])]
    if spec.get("kind") != "serve":
        raise ValueError(f"{d} is not a load-aware policy (its feature_spec.json kind is {spec.get('kind')!r}): load it "
                         "with policies.load.load_policy; load-aware policies are trained with python -m train "
                         "--serve-loads.")
    if spec.get("version") != SERVE_FEATURE_VERSION or names != list(SERVE_FEATURE_NAMES):
        raise ValueError(f"{d / FEATURE_SPEC_FILE} describes serve features version {spec.get('version')} {names}, but "
                         f"this learn2draft builds version {SERVE_FEATURE_VERSION} {list(SERVE_FEATURE_NAMES)}: "
                         "retrain or use a matching version.")
    if profile is None:
        if not (d / SERVE_PROFILE_FILE).is_file():
            raise FileNotFoundError(f"{d / SERVE_PROFILE_FILE} is missing: pass the latency profile it was trained "
                                    "with (profile=... / --profile).")
        profile = d / SERVE_PROFILE_FILE
    prof = profile if isinstance(profile, LatencyProfile) else load_profile(profile)
    prof.require_batch_axis(2)  # a profile without the batch axis cannot price a batched step
    serve = cfg.get("serve") or {}
    policy = LoadAwarePolicy(d / ONNX_FILE, int(cfg["max_depth"]), prof, serve.get("drafter") or cfg.get("drafter"),
                             int(spec["batch_scale"]), float(spec["context_scale"]),
                             int(serve.get("max_new_tokens") or cfg.get("max_new_tokens")),
                             serve.get("batch_context", "max"))
    policy.trained_dtype = (cfg.get("training") or {}).get("dtype") or cfg.get("dtype")
    return policy


def load_tree_policy(run_or_dir: str | Path, intra_op_num_threads: int = 1) -> TreePolicyController:
    """Load the depth and size policies of a tree training run (``python -m train --tree --out RUN``) or a
    shipped tree folder (``policies/defaults/head-tree``) as a :class:`TreePolicyController`.

    Build the decoder with the controller's settings::

        ctrl = load_tree_policy("policies/defaults/head-tree")
        dec = TreeSpeculativeDecoder(pair, max_depth=ctrl.depth_feature_scale, width=ctrl.width, top_k=ctrl.top_k,
                                     drafter=make_drafter("head", pair))
        dec.generate(prompt_ids, ctrl)

    Args:
        run_or_dir: the run / shipped folder, or one of its ``policy`` / ``size_policy`` sub-folders.

    Raises:
        FileNotFoundError: no ``tree.json``, or an export it names is missing.
        ValueError: a feature specification of another version, or a size export whose V set differs
            from ``tree.json``'s.
    """
    root = tree_root(run_or_dir)
    cfg = read_json(root / TREE_FILE)
    trained = list(cfg.get("policies", []))
    depth_policy = size_policy = None
    if "depth" in trained:
        depth_policy = load_policy(root / DEPTH_DIR, intra_op_num_threads=intra_op_num_threads)
    sizes = tuple(cfg.get("verify_sizes", ()))
    if "size" in trained:
        d = root / SIZE_DIR
        for name in (ONNX_FILE, FEATURE_SPEC_FILE, POLICY_CONFIG_FILE):
            if not (d / name).is_file():
                raise FileNotFoundError(f"{d / name} is missing: the size policy's export is incomplete.")
        spec = read_json(d / FEATURE_SPEC_FILE)
        names = [f["name"] for f in spec.get("features", [])]
        if spec.get("version") != SIZE_FEATURE_VERSION or names != list(SIZE_FEATURE_NAMES):
            raise ValueError(f"{d / FEATURE_SPEC_FILE} describes size features version {spec.get('version')} {names}, "
                             f"but this learn2draft builds version {SIZE_FEATURE_VERSION} {list(SIZE_FEATURE_NAMES)}: "
                             "re-export the size policy or use a matching version.")
        pcfg = read_json(d / POLICY_CONFIG_FILE)
        if tuple(pcfg.get("verify_sizes", ())) != sizes:
            raise ValueError(f"{d / POLICY_CONFIG_FILE} lists verify_sizes {pcfg.get('verify_sizes')}, "
                             f"{root / TREE_FILE} {list(sizes)}: the folder mixes two runs.")
        size_policy = OnnxController(d / ONNX_FILE, max_depth=int(cfg["max_depth"]),
                                     intra_op_num_threads=intra_op_num_threads, n_features=len(SIZE_FEATURE_NAMES))
    if depth_policy is None and size_policy is None:
        raise FileNotFoundError(f"{root / TREE_FILE} lists no trained policy (policies: {trained}).")
    return TreePolicyController(depth_policy, size_policy, sizes, max_depth=int(cfg["max_depth"]),
                                width=int(cfg["width"]), top_k=int(cfg["top_k"]), verify_size=cfg.get("verify_size"),
                                tree_depth=cfg.get("tree_depth"))


def tree_settings(run_or_dir: str | Path) -> dict:
    """The ``tree.json`` of a tree run or shipped folder (``width``, ``top_k``, ``max_depth``, ``verify_sizes``,
    ``verify_size``, ``tree_depth``, ``policies``, ``drafter``, ``sampling``, …).

    Raises:
        FileNotFoundError: no ``tree.json`` in ``run_or_dir`` or its parent.
    """
    return read_json(tree_root(run_or_dir) / TREE_FILE)


def run_settings(directory: str | Path) -> dict:
    """The settings a policy was trained with: the training run's ``config.json`` when ``directory``
    is a run (``python -m train --out``), else the export's ``policy_config.json`` (``target``,
    ``draft``, ``drafter``, ``max_new_tokens``, ``threads``, … whatever was recorded).

    Raises:
        FileNotFoundError: neither file exists.
    """
    d = Path(directory)
    for f in (d / RUN_CONFIG_FILE, resolve_export_dir(d) / POLICY_CONFIG_FILE):
        if f.is_file():
            return read_json(f)
    raise FileNotFoundError(f"No config.json or {POLICY_CONFIG_FILE} in {d}: is it a training run or a policy export?")


def default_policy_for(drafter: str, dtype: str = "auto", device: str | None = "auto", threads: int | None = None,
                       batch=None, depths: Iterable = ()) -> tuple[Path, str]:
    """The shipped policy of ``drafter`` for the precision this run computes in
    (:func:`policies.layout.default_policy_dir`), and that precision: what ``eval``, ``eval.benchmark`` and
    ``policies.generate`` run without ``--policy``, and the ``dtype`` they then resolve their
    :class:`learn2draft.settings.RunSettings` with (a name: nothing is measured again).

    ``auto`` is measured (:func:`learn2draft.models.fastest_dtype`) at the thread count the run will set —
    ``threads``, else the picked policy's training threads, else 1 (:func:`learn2draft.settings.run_threads`) — and
    at the run's forward widths with the policy's depth (:func:`learn2draft.settings.forward_widths`). The policy
    depends on the precision and the thread count on the policy, so this alternates: measure, pick, and measure again
    at the pick's threads and depth until the pick stays; where it does not settle in 3 rounds (a machine where each
    precision's own policy's thread count favours the other precision), the float32 policy in float32.

    Args:
        drafter: the drafter name (``"lookup"``, ``"model"``, …).
        dtype, device, threads: the command's ``--dtype``, ``--device`` and ``--threads``.
        batch, depths: the run's largest batch and the depths its own flags draft to (as
            :func:`learn2draft.settings.forward_widths`); the policy's depth is added.

    Returns:
        ``(policy directory, canonical precision name)``.

    Raises:
        FileNotFoundError: no policy is shipped for ``drafter``.
        ValueError: an unknown ``dtype``, or a bad ``threads``.
        learn2draft.ModelLoadError: ``device`` is not a torch device.
    """
    from learn2draft.models import resolve_dtype
    from learn2draft.settings import forward_widths, resolve_device, run_threads
    from policies.layout import default_policy_dir

    depths = tuple(depths)
    if dtype != "auto":
        name = resolve_dtype(dtype, resolve_device(device, check=False))  # a canonical name, nothing measured
        return default_policy_dir(drafter, name), name
    at: tuple = (run_threads(threads), None)  # (threads, depth) of the next measurement
    dev = resolve_device(device, check=False)
    for _ in range(3):
        name = resolve_dtype("auto", dev, at[0], forward_widths(batch, (at[1], *depths)))
        chosen = default_policy_dir(drafter, name)
        settings = run_settings(chosen)
        then = (run_threads(threads, settings.get("threads")), settings.get("max_depth"))
        if then == at:
            return chosen, name
        at = then
    return default_policy_dir(drafter, "float32"), "float32"


def policy_drafter(directory: str | Path) -> str:
    """The drafter a policy export (or training run) was trained with; ``"model"`` for exports
    that predate drafters (:func:`policies.layout.export_drafter`).

    Raises:
        FileNotFoundError: no ``policy_config.json`` there (not a policy folder).
        ValueError: the config does not parse, names an unknown drafter, or is no export's (e.g. ``{}``).
    """
    path = resolve_export_dir(directory) / POLICY_CONFIG_FILE
    if not path.is_file():
        raise FileNotFoundError(f"{directory} holds no policy ({path.name} is missing): pass a run of `python -m train` "
                                "(its --out folder) or a policy export (python -m policies.export).")
    return export_drafter(read_json(path), path)


def policy_head(directory: str | Path) -> str | None:
    """The head directory a policy trained with the head drafter recorded (None: the shipped head)."""
    return read_json(resolve_export_dir(directory) / POLICY_CONFIG_FILE).get("head")


def policy_lookup_min_ngram(directory: str | Path) -> int | None:
    """The prompt-lookup ``min_ngram`` a policy with a lookup drafter (``lookup``, ``lookup+model``, ``lookup+head``)
    was trained with: its ``policy_config.json``'s ``lookup_min_ngram``, else its training settings', else
    :data:`learn2draft.drafters.lookup.DEFAULT_MIN_NGRAM` (policies trained before the setting was recorded all
    used it); None for a drafter without prompt lookup.

    Raises:
        FileNotFoundError, ValueError: as :func:`policy_drafter`.
    """
    from learn2draft.drafters.lookup import DEFAULT_MIN_NGRAM

    if "lookup" not in policy_drafter(directory):
        return None
    cfg = read_json(resolve_export_dir(directory) / POLICY_CONFIG_FILE)
    value = cfg.get("lookup_min_ngram", (cfg.get("training") or {}).get("lookup_min_ngram"))
    return DEFAULT_MIN_NGRAM if value is None else int(value)


__all__ = ["default_policy_for", "load_policy", "load_serve_policy", "load_tree_policy", "policy_drafter", "policy_head", "policy_lookup_min_ngram", "run_settings", "tree_settings"]
