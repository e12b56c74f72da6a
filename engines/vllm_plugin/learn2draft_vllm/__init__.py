"""learn2draft's vLLM plugin: a learned per-slot acceptance estimate for vLLM's adaptive verification.

vLLM's Model Runner V2 (the default in vLLM 0.34.0) sizes each step's verification with *adaptive verification*:
every (request, draft position) slot gets an acceptance probability, ``draft_token_confidence_probs`` float32
``[max_num_reqs, num_speculative_steps]``; a slot's survival is the running product of its request's probabilities,
and the globally best slots are verified within a budget chosen from profiled cost tables
(``AdaptiveVerificationManager.get_num_tokens`` and ``assign_draft_token_budget`` in
``vllm/v1/worker/gpu/spec_decode/adaptive_verification.py``). For model-based drafters (draft models, EAGLE, MTP,
DFlash, DSpark without a confidence head) those probabilities come from ``OnlineAcceptanceEstimator``
(``vllm/v1/worker/gpu/spec_decode/acceptance_estimator.py``): a logistic on ``logit(max q)`` of the draft's
temperature-scaled distribution, with a shared slope and a per-position intercept refitted online.

This plugin replaces that estimator, through the ``vllm.general_plugins`` entry point, with
:class:`learn2draft_vllm.estimator.LearnedAcceptanceEstimator`: an acceptance model fitted offline on this project's
recorded traces (``python -m learn2draft_vllm export-acceptance``) from six features of the draft's own raw
distribution and its chain (:data:`ACCEPTANCE_FEATURES`), run on the device as a graph-capturable torch module.

Everything here was read from vLLM's source at :data:`VLLM_SOURCE` and is refused on any other vLLM version
(:func:`learn2draft_vllm.plugin.check_vllm_version`). This module imports neither torch nor vLLM.
"""

from __future__ import annotations

#: The vLLM releases this plugin was written against (``pyproject.toml``'s ``[vllm]`` extra pins the same).
SUPPORTED_VLLM_VERSIONS: tuple[str, ...] = ("0.34.0",)
#: Where the interfaces were read: the release and the git commit its wheel records (``vllm/_version.py``).
VLLM_SOURCE = "vllm 0.34.0 (PyPI wheel, commit 62d4bc3c7)"

#: Environment variable naming the acceptance model folder (``export-acceptance --out``); unset: the plugin does
#: nothing (vLLM loads every installed general plugin in every process).
ENV_MODEL = "LEARN2DRAFT_VLLM_ACCEPTANCE_MODEL"
#: Set to 1 to run on a vLLM version not in :data:`SUPPORTED_VLLM_VERSIONS` (at your own risk: the patched class is
#: private to vLLM and changes between releases).
ENV_SKIP_VERSION_CHECK = "LEARN2DRAFT_VLLM_SKIP_VERSION_CHECK"

#: The features of the acceptance model, in order: names of :data:`learn2draft.features.ACCEPTANCE_FEATURE_NAMES`
#: (their definitions there), each computable on the device from what vLLM's ``predict`` receives: the draft's raw
#: (pre-temperature) logits of the slot and the draft position, with the probabilities of the request's earlier
#: positions kept per slot.
ACCEPTANCE_FEATURES: tuple[str, ...] = (
    "depth",
    "draft_confidence",
    "draft_entropy",
    "draft_margin",
    "cum_confidence",
    "mean_confidence",
)

#: Files of an acceptance model folder.
MODEL_FILE = "acceptance.onnx"
SPEC_FILE = "acceptance_spec.json"
PARITY_FILE = "parity.json"
#: ``acceptance_spec.json``'s ``format``.
FORMAT = "learn2draft-vllm-acceptance/1"
#: Drafters whose traces carry a draft distribution (the lookup drafter's confidence is a match share instead, and
#: vLLM's n-gram speculator has no acceptance estimator).
DRAFTERS = ("model", "head")

__all__ = ["ACCEPTANCE_FEATURES", "DRAFTERS", "ENV_MODEL", "ENV_SKIP_VERSION_CHECK", "FORMAT", "MODEL_FILE",
           "PARITY_FILE", "SPEC_FILE", "SUPPORTED_VLLM_VERSIONS", "VLLM_SOURCE"]
