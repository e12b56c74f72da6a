"""What decides the draft depth: policy-driven controllers, baselines, ONNX export and loading.

Importing :mod:`policies` pulls in neither stable-baselines3 nor onnxruntime; :mod:`policies.export`
(imported lazily through :func:`load_policy` / :func:`export_policy`) needs torch and onnx, and its
exported graphs run with onnxruntime alone.
"""

from policies.controllers import (
    CONTINUE,
    STOP,
    ConfidenceThresholdController,
    MatchLengthController,
    OnnxController,
    PolicyController,
    SB3Controller,
)


def load_policy(directory, intra_op_num_threads: int = 1) -> OnnxController:
    """Load an exported policy directory; see :func:`policies.export.load_policy`."""
    from policies.export import load_policy as _load

    return _load(directory, intra_op_num_threads)


__all__ = [
    "CONTINUE", "STOP", "ConfidenceThresholdController", "MatchLengthController", "OnnxController", "PolicyController",
    "SB3Controller", "load_policy",
]
