"""learn2draft: RL-trained adaptive drafting for speculative decoding — the engine.

The engine knows nothing about reinforcement learning: model pairs (:mod:`.models`), the exact
sampler (:mod:`.sampling`), the draft/verify loop (:mod:`.decoding`), timing (:mod:`.timing`)
and the features a policy sees (:mod:`.features`).
"""

from learn2draft._lazy import lazy_exports

# Exports load on first use (PEP 562), so that ``import learn2draft.<light module>`` — e.g. a
# command's ``--help`` — does not import torch.
_EXPORTS = {
    "learn2draft.decoding": ("CycleResult", "DraftAction", "DraftController", "FixedDepthController",
                             "GenerationResult", "SpeculativeDecoder", "autoregressive_controller",
                             "expected_tokens_per_cycle"),
    "learn2draft.features": ("FEATURE_NAMES", "build_features", "feature_spec"),
    "learn2draft.models": ("ModelLoadError", "ModelPair", "TokenizerMismatchError", "load_pair", "make_pair"),
    "learn2draft.names": ("DEFAULT_DRAFT", "DEFAULT_TARGET"),
    "learn2draft.sampling": ("SamplingConfig", "speculative_sample"),
}
_WHERE = {name: module for module, names in _EXPORTS.items() for name in names}
__getattr__ = lazy_exports(__name__, _WHERE)


def __dir__() -> list[str]:
    return sorted([*globals(), *_WHERE])


__version__ = "0.1.0"

__all__ = [
    "DEFAULT_DRAFT", "DEFAULT_TARGET", "FEATURE_NAMES", "CycleResult", "DraftAction", "DraftController",
    "FixedDepthController", "GenerationResult", "ModelLoadError", "ModelPair", "SamplingConfig",
    "SpeculativeDecoder", "TokenizerMismatchError", "autoregressive_controller", "build_features",
    "expected_tokens_per_cycle", "feature_spec", "load_pair", "make_pair", "speculative_sample",
]
