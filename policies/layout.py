"""The layout of a policy folder: file and sub-folder names, where a training run keeps its export, and
where the shipped policies live, and reading and checking an export's JSON files (:func:`read_json`,
:func:`export_drafter`, :func:`config_problems`). Standard library and :mod:`learn2draft.names` only
(:mod:`policies.check` reads it without torch or the engine); :mod:`policies.export` writes these files,
:mod:`policies.load` reads them.

A chain policy export (``python -m train --out RUN`` writes it to ``RUN/policy/``) holds

* ``policy.onnx`` (:data:`ONNX_FILE`) — the graph: input ``obs`` float32 ``(batch, n_features)``, outputs
  ``action`` int64 ``(batch,)`` and ``logits`` float32 ``(batch, n_actions)``;
* ``feature_spec.json`` (:data:`FEATURE_SPEC_FILE`) — how to build ``obs``;
* ``policy_config.json`` (:data:`POLICY_CONFIG_FILE`) — ``max_depth``, sampling, models, training settings;
* ``export_check.json`` (:data:`CHECK_FILE`) — onnxruntime against the PyTorch policy at export time;
* ``parity.json`` (:data:`PARITY_FILE`) — parity vectors for ``python -m policies.check``.

A draft-tree run (``python -m train --tree --out RUN``) or shipped tree folder holds ``tree.json``
(:data:`TREE_FILE`) with the depth policy's export in ``policy/`` (:data:`DEPTH_DIR`) and the size policy's
in ``size_policy/`` (:data:`SIZE_DIR`).
"""

from __future__ import annotations

import json
from pathlib import Path

from learn2draft.names import DRAFTERS, HYBRID_DRAFTERS

ONNX_FILE = "policy.onnx"
FEATURE_SPEC_FILE = "feature_spec.json"
POLICY_CONFIG_FILE = "policy_config.json"
CHECK_FILE = "export_check.json"
PARITY_FILE = "parity.json"
#: A load-aware export's latency profile (with the batch axis): the costs it prices each step with.
SERVE_PROFILE_FILE = "profile.json"
#: A load-aware export's per-batch-size schedule for vLLM (``speculative_config`` entries, :mod:`policies.vllm`).
VLLM_SCHEDULE_FILE = "vllm_schedule.json"
#: The files every export holds (``export_check.json`` aside: not needed to run or check it).
EXPORT_FILES = (ONNX_FILE, FEATURE_SPEC_FILE, POLICY_CONFIG_FILE, PARITY_FILE)
#: A training run's ``config.json`` (beside its export folder).
RUN_CONFIG_FILE = "config.json"

TREE_FILE = "tree.json"
TREE_FORMAT = "learn2draft-tree/1"
DEPTH_DIR = "policy"
SIZE_DIR = "size_policy"

#: Trained policies for the embedded default pair, shipped with the package: ``<drafter>`` (chain depth
#: policies) and ``<drafter>-tree`` (draft-tree policies).
DEFAULT_POLICIES_DIR = Path(__file__).resolve().parent / "defaults"
DEFAULT_TREE_SUFFIX = "-tree"


def resolve_export_dir(path: str | Path) -> Path:
    """A training run directory (``python -m train --out``) holds its export in ``policy/``; an
    export directory is returned as is."""
    path = Path(path)
    return path / DEPTH_DIR if (path / DEPTH_DIR).is_dir() else path


def tree_root(path: str | Path) -> Path:
    """The folder holding ``tree.json``: ``path`` itself or, for a ``policy`` / ``size_policy`` sub-folder, its parent.

    Raises:
        FileNotFoundError: neither holds a ``tree.json``.
    """
    path = Path(path)
    for d in (path, path.parent):
        if (d / TREE_FILE).is_file():
            return d
    raise FileNotFoundError(f"{path} holds no {TREE_FILE}: pass a tree training run (python -m train --tree --out RUN) "
                            "or a shipped tree policy folder (e.g. policies/defaults/head-tree).")


def default_policy_dir(drafter: str = "model", dtype: str | None = None) -> Path:
    """The shipped export directory of the depth policy trained for ``drafter`` on the embedded
    default pair: ``policies/defaults/<drafter>-<dtype>`` when one is shipped for that precision (e.g.
    ``lookup-bfloat16``, trained on the costs of a bf16 CPU), else ``policies/defaults/<drafter>`` (float32).

    Args:
        dtype: the precision the decoder runs in (a canonical name, :func:`learn2draft.models.resolve_dtype`).

    Raises:
        FileNotFoundError: none is shipped for this drafter.
    """
    d = DEFAULT_POLICIES_DIR / drafter
    if dtype and (DEFAULT_POLICIES_DIR / f"{drafter}-{dtype}" / ONNX_FILE).is_file():
        d = DEFAULT_POLICIES_DIR / f"{drafter}-{dtype}"
    if not (d / ONNX_FILE).is_file():
        shipped = sorted(p.name for p in DEFAULT_POLICIES_DIR.glob("*") if (p / ONNX_FILE).is_file())
        raise FileNotFoundError(
            f"No shipped policy for drafter {drafter!r} (shipped: {', '.join(shipped) or 'none'}): train one with "
            + ("`python -m train --replay LOOKUP.npz,NEURAL.npz --profile P` (traces of its two drafters, see "
               "docs/guides/replay-training.md)" if "+" in drafter else f"`python -m train --drafter {drafter}`")
            + " and pass --policy RUN_DIR."
        )
    return d


def read_json(path: str | Path) -> dict:
    """The JSON object in ``path`` (a policy folder's ``feature_spec.json``, ``policy_config.json``, ``tree.json``, …).

    Raises:
        FileNotFoundError: no such file.
        ValueError: the file does not parse (truncated or damaged) or holds no JSON object; the message names it.
    """
    path = Path(path)
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: not valid JSON ({e.msg} at line {e.lineno}, column {e.colno}: a truncated or damaged "
                         "file?); re-export the policy (python -m policies.export RUN_DIR) or restore the file.") from None
    except UnicodeDecodeError:
        raise ValueError(f"{path}: not UTF-8 text (a damaged file?); re-export the policy or restore the file.") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a JSON object, got {type(data).__name__} (a damaged file?).")
    return data


def export_drafter(cfg: dict, path: str | Path) -> str:
    """The drafter an export's ``policy_config.json`` (``cfg``, read from ``path``) names: one of
    :data:`learn2draft.names.DRAFTERS`; ``"model"`` for an export (a ``format`` entry) written before drafters
    were recorded.

    Raises:
        ValueError: an unknown drafter name, or a config that is no export's (no ``format``, no ``drafter``).
    """
    if "drafter" not in cfg:
        if "format" not in cfg:
            raise ValueError(f"{path} names no drafter and is no policy export's config (no 'format' entry): "
                             "re-export the run (python -m policies.export RUN_DIR) or restore the file.")
        return "model"  # exports written before drafters were recorded all drafted with the draft model
    drafter = cfg["drafter"]
    if drafter not in DRAFTERS + HYBRID_DRAFTERS:
        raise ValueError(f"{path}: unknown drafter {drafter!r} (one of {', '.join(DRAFTERS + HYBRID_DRAFTERS)}): a damaged "
                         "file, or one "
                         "written by another learn2draft version.")
    return str(drafter)


def config_problems(directory: str | Path, cfg: dict, spec: dict) -> list[str]:
    """What is wrong with an export's ``policy_config.json`` (``cfg``) beside its ``feature_spec.json`` (``spec``):
    ``max_depth`` must be an integer ≥ 1 and, where the spec records one, the spec's (the depth features' scale);
    the drafter must be known (:func:`export_drafter`). Returns one message per problem ([] when none)."""
    d = Path(directory)
    conf, where = d / POLICY_CONFIG_FILE, d / FEATURE_SPEC_FILE
    problems = []
    depth = cfg.get("max_depth")
    if isinstance(depth, bool) or not isinstance(depth, int):
        problems.append(f"{conf}: max_depth must be an integer ≥ 1 (the most draft steps per cycle), got {depth!r}")
    elif depth < 1:
        problems.append(f"{conf}: max_depth must be ≥ 1 (the most draft steps per cycle), got {depth}")
    elif "max_depth" in spec and spec["max_depth"] != depth:
        problems.append(f"{conf}: max_depth {depth} differs from the {spec['max_depth']!r} of {where} (the scale the "
                        "policy's depth features were built on): the folder mixes two exports; re-export the run")
    try:
        export_drafter(cfg, conf)
    except ValueError as e:
        problems.append(str(e).rstrip("."))
    return problems


def default_tree_policy_dir(drafter: str = "head") -> Path:
    """The shipped tree policies for ``drafter`` on the embedded default pair (``policies/defaults/<drafter>-tree``).

    Raises:
        FileNotFoundError: none is shipped for this drafter.
    """
    d = DEFAULT_POLICIES_DIR / f"{drafter}{DEFAULT_TREE_SUFFIX}"
    if not (d / TREE_FILE).is_file():
        shipped = sorted(p.name for p in DEFAULT_POLICIES_DIR.glob(f"*{DEFAULT_TREE_SUFFIX}")
                         if (p / TREE_FILE).is_file())
        raise FileNotFoundError(f"No shipped tree policy for drafter {drafter!r} (shipped: "
                                f"{', '.join(shipped) or 'none'}): train one with "
                                f"`python -m train --tree --drafter {drafter}`.")
    return d


__all__ = ["CHECK_FILE", "DEFAULT_POLICIES_DIR", "DEFAULT_TREE_SUFFIX", "DEPTH_DIR", "EXPORT_FILES", "FEATURE_SPEC_FILE",
           "ONNX_FILE", "PARITY_FILE", "POLICY_CONFIG_FILE", "RUN_CONFIG_FILE", "SERVE_PROFILE_FILE", "SIZE_DIR",
           "VLLM_SCHEDULE_FILE", "TREE_FILE",
           "TREE_FORMAT",
           "config_problems", "default_policy_dir", "default_tree_policy_dir", "export_drafter", "read_json",
           "resolve_export_dir", "tree_root"]
