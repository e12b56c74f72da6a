"""What decides the draft depth: policy-driven controllers (:mod:`policies.controllers`), the hand rules
(:mod:`policies.rules`), ONNX export and loading, and the adapters for the engines users run (:mod:`policies.hf`,
:mod:`policies.llamacpp`, :mod:`policies.vllm` with the ``engines/vllm_plugin`` package, :mod:`policies.sglang` with
``engines/sglang_plugin``).

Exports load on first use (PEP 562): importing :mod:`policies` — e.g. for ``python -m
policies.check``, which needs only numpy and onnxruntime — pulls in neither torch,
stable-baselines3 nor onnxruntime. A policy folder's file names are in :mod:`policies.layout`;
:mod:`policies.export` (writing an export) needs torch and onnx; :mod:`policies.load` loads one with
onnxruntime and the engine alone.
"""

from learn2draft._lazy import lazy_exports

_EXPORTS = {
    "policies.controllers": ("CONTINUE", "STOP", "LoadAwarePolicy", "OnnxController", "PolicyController", "SB3Controller"),
    "policies.rules": ("ConfidenceThresholdController", "MatchLengthController", "SpeculationGuard"),
    "policies.load": ("load_policy", "load_serve_policy", "load_tree_policy"),
}
_WHERE = {name: module for module, names in _EXPORTS.items() for name in names}
__getattr__ = lazy_exports(__name__, _WHERE)


def __dir__() -> list[str]:
    return sorted([*globals(), *_WHERE])


__all__ = [
    "CONTINUE", "STOP", "ConfidenceThresholdController", "LoadAwarePolicy", "MatchLengthController", "OnnxController",
    "PolicyController", "SB3Controller", "SpeculationGuard", "load_policy", "load_serve_policy", "load_tree_policy",
]
