"""The ``vllm.general_plugins`` entry point (``pyproject.toml``: ``learn2draft_vllm = learn2draft_vllm.plugin:register``).

vLLM 0.34.0 (``vllm/plugins/__init__.py``, ``load_general_plugins``) calls every installed general plugin once in
each process (front end, engine core, workers) before building the model; an exception raised by the plugin function
stops that process (only a failure to *import* the entry point is logged and skipped). :func:`register`:

1. does nothing unless ``$LEARN2DRAFT_VLLM_ACCEPTANCE_MODEL`` names an acceptance model folder;
2. refuses a vLLM version outside :data:`learn2draft_vllm.SUPPORTED_VLLM_VERSIONS` (RuntimeError; set
   ``$LEARN2DRAFT_VLLM_SKIP_VERSION_CHECK=1`` to try anyway), as ArcticInference refuses any vLLM but its pinned one;
3. checks that ``vllm.v1.worker.gpu.spec_decode.speculator.OnlineAcceptanceEstimator`` still has the constructor and
   methods the replacement provides (:data:`EXPECTED_SIGNATURES`);
4. loads the model (a clear error now rather than at the first draft) and replaces that module-level name with
   :class:`learn2draft_vllm.estimator.LearnedAcceptanceEstimator` bound to it: ``BaseSpeculator.load_model`` looks the
   name up in its module when it builds the estimator, so every speculator built afterwards in this process uses it.

Calling it twice is harmless (vLLM may load plugins more than once per process).
"""

from __future__ import annotations

import inspect
import os
import sys
from types import ModuleType

from learn2draft_vllm import ENV_MODEL, ENV_SKIP_VERSION_CHECK, SUPPORTED_VLLM_VERSIONS, VLLM_SOURCE

#: The vLLM module whose ``OnlineAcceptanceEstimator`` name is replaced.
SPECULATOR_MODULE = "vllm.v1.worker.gpu.spec_decode.speculator"

#: Parameters (after ``self``) of ``OnlineAcceptanceEstimator``'s methods in vLLM 0.34.0
#: (``vllm/v1/worker/gpu/spec_decode/acceptance_estimator.py``); the replacement implements exactly these.
EXPECTED_SIGNATURES: dict[str, tuple[str, ...]] = {
    "__init__": ("max_num_reqs", "num_speculative_steps", "device"),
    "predict": ("logits", "idx_mapping", "draft_step", "confidence_probs", "temperature"),
    "step": ("idx_mapping", "num_sampled", "num_rejected"),
    "warmup": (),
}


def check_vllm_version(version: str) -> None:
    """Refuse a vLLM release this plugin was not written against.

    Raises:
        RuntimeError: ``version`` is not in :data:`learn2draft_vllm.SUPPORTED_VLLM_VERSIONS` and
            ``$LEARN2DRAFT_VLLM_SKIP_VERSION_CHECK`` is not 1 (the message says both ways out).
    """
    if version in SUPPORTED_VLLM_VERSIONS or os.environ.get(ENV_SKIP_VERSION_CHECK) == "1":
        return
    raise RuntimeError(
        f"learn2draft-vllm supports vllm=={' or '.join(SUPPORTED_VLLM_VERSIONS)} (read from {VLLM_SOURCE}), but "
        f"vllm=={version} is installed: install `learn2draft-vllm[vllm]` (it pins vLLM), unset {ENV_MODEL} to serve "
        f"without the learned estimate, or set {ENV_SKIP_VERSION_CHECK}=1 to try this version at your own risk "
        "(the replaced class is private to vLLM).")


def check_interface(speculator_module: ModuleType) -> type:
    """The ``OnlineAcceptanceEstimator`` class of ``speculator_module``, checked to take what
    :data:`EXPECTED_SIGNATURES` says.

    Raises:
        RuntimeError: the class is missing or a method's parameters differ (the message names them).
    """
    cls = getattr(speculator_module, "OnlineAcceptanceEstimator", None)
    original = getattr(cls, "_learn2draft_replaces", cls)  # already patched: check what it replaced
    if not isinstance(original, type):
        raise RuntimeError(f"{speculator_module.__name__} has no OnlineAcceptanceEstimator class: this vLLM is not "
                           f"the one learn2draft-vllm was written against ({VLLM_SOURCE}).")
    for name, params in EXPECTED_SIGNATURES.items():
        fn = getattr(original, name, None)
        got = None if fn is None else tuple(p for p in inspect.signature(fn).parameters if p != "self")
        if got != params:
            raise RuntimeError(f"{speculator_module.__name__}.OnlineAcceptanceEstimator.{name} takes {got}, not "
                               f"{params} as in {VLLM_SOURCE}: this vLLM changed the estimator's interface.")
    return original


def register() -> None:
    """The entry point vLLM calls (see the module docstring).

    Raises:
        RuntimeError: an unsupported vLLM version or interface.
        FileNotFoundError, ValueError: ``$LEARN2DRAFT_VLLM_ACCEPTANCE_MODEL`` is not a valid acceptance model.
    """
    path = os.environ.get(ENV_MODEL)
    if not path:
        return
    import importlib

    import vllm

    check_vllm_version(getattr(vllm, "__version__", "unknown"))
    module = importlib.import_module(SPECULATOR_MODULE)
    original = check_interface(module)

    from learn2draft_vllm.estimator import AcceptanceModel, LearnedAcceptanceEstimator

    model = AcceptanceModel(path)
    cls = LearnedAcceptanceEstimator.bind(model)
    cls._learn2draft_replaces = original
    module.OnlineAcceptanceEstimator = cls
    print(f"learn2draft-vllm: adaptive verification reads the learned acceptance model {model.path} "
          f"(fitted on {model.spec.get('drafter')} traces of {model.spec.get('target')}).", file=sys.stderr)


__all__ = ["EXPECTED_SIGNATURES", "SPECULATOR_MODULE", "check_interface", "check_vllm_version", "register"]
