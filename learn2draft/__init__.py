"""learn2draft: RL-trained adaptive drafting for speculative decoding — the engine.

The engine knows nothing about reinforcement learning: model pairs (:mod:`.models`), the exact
sampler (:mod:`.sampling`), the one draft/verify cycle (:mod:`.decoding`, trees in :mod:`.tree`, many requests
at once with continuous batching in :mod:`.batched`), the
controller protocol and actions (:mod:`.control`), what a policy sees (:mod:`.state`, :mod:`.features`)
and timing (:mod:`.timing`).
"""

from learn2draft._lazy import lazy_exports

# Exports load on first use (PEP 562), so that ``import learn2draft.<light module>`` — e.g. a
# command's ``--help`` — does not import torch.
_EXPORTS = {
    "learn2draft.batched": ("BatchedSpeculativeDecoder",),
    "learn2draft.control": ("CONTINUE", "STOP", "DraftController", "FixedDepthController", "FixedTreeController"),
    "learn2draft.decoding": ("SpeculativeDecoder",),
    "learn2draft.metrics": ("CycleResult", "DraftAction", "GenerationResult"),
    "learn2draft.state": ("DraftState", "LoadState"),
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
    "BatchedSpeculativeDecoder", "LoadState", "CONTINUE", "DEFAULT_DRAFT", "DEFAULT_TARGET", "FEATURE_NAMES", "STOP", "CycleResult", "DraftAction",
    "DraftController", "DraftState", "FixedDepthController", "FixedTreeController", "GenerationResult",
    "ModelLoadError", "ModelPair", "SamplingConfig", "SpeculativeDecoder", "TokenizerMismatchError",
    "build_features", "feature_spec", "load_pair", "make_pair", "speculative_sample",
]
