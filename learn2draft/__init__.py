"""learn2draft: RL-trained adaptive drafting for speculative decoding — the engine.

The engine knows nothing about reinforcement learning: model pairs (:mod:`.models`), the exact
sampler (:mod:`.sampling`), the draft/verify loop (:mod:`.decoding`), timing (:mod:`.timing`)
and the features a policy sees (:mod:`.features`).
"""

from learn2draft.decoding import (
    CycleResult,
    DraftAction,
    DraftController,
    FixedDepthController,
    GenerationResult,
    SpeculativeDecoder,
    autoregressive_controller,
    expected_tokens_per_cycle,
)
from learn2draft.features import FEATURE_NAMES, build_features, feature_spec
from learn2draft.models import (
    DEFAULT_DRAFT,
    DEFAULT_TARGET,
    ModelLoadError,
    ModelPair,
    TokenizerMismatchError,
    load_pair,
    make_pair,
)
from learn2draft.sampling import SamplingConfig, speculative_sample

__version__ = "0.1.0"

__all__ = [
    "DEFAULT_DRAFT", "DEFAULT_TARGET", "FEATURE_NAMES", "CycleResult", "DraftAction", "DraftController",
    "FixedDepthController", "GenerationResult", "ModelLoadError", "ModelPair", "SamplingConfig",
    "SpeculativeDecoder", "TokenizerMismatchError", "autoregressive_controller", "build_features",
    "expected_tokens_per_cycle", "feature_spec", "load_pair", "make_pair", "speculative_sample",
]
