"""Names and defaults written once — no heavy imports, so a command's ``--help`` can show them
without loading torch (:mod:`learn2draft.models` re-exports the model names, :mod:`learn2draft.drafters`
the drafters).

* the embedded default pair (:data:`DEFAULT_TARGET`, :data:`DEFAULT_DRAFT`, :data:`DEFAULT_DRAFT_DIR`), the drafters
  (:data:`DRAFTERS`) and the model dtypes (:data:`DTYPE_NAMES`);
* the default ``max_depth`` of training, policies, environments and traces (:data:`DEFAULT_MAX_DEPTH`):
  the most draft steps per cycle (tokens for a chain, levels for a tree) and the scale the depth
  feature is divided by; a bare decoder's cap when no policy is involved is :data:`DECODER_MAX_DEPTH`;
* the default draft-tree shape and its verification sizes V (:data:`DEFAULT_VERIFY_SIZES`, checked by
  :func:`check_verify_sizes`);
* the seed strides of measurements and replay scoring (:func:`run_seed`, :data:`HELDOUT_SEED_OFFSET`).
"""

from __future__ import annotations

from numbers import Integral
from pathlib import Path

DEFAULT_TARGET = "smollm2-135m-instruct"
DEFAULT_DRAFT = "smollm2-135m-draft"
DEFAULT_DRAFT_DIR = Path(__file__).resolve().parent / "assets" / DEFAULT_DRAFT

#: The drafters :func:`learn2draft.drafters.make_drafter` builds; only ``"model"`` needs a draft model.
DRAFTERS = ("model", "head", "lookup")
#: Hybrid drafters (:class:`learn2draft.drafters.hybrid.HybridDrafter`): prompt lookup and a neural drafter, the
#: source chosen before each draft token. ``"lookup+model"`` needs the draft model.
HYBRID_DRAFTERS = ("lookup+model", "lookup+head")


def drafter_sources(name: str) -> tuple[str, ...]:
    """The single drafters a drafter name is made of: ``("lookup", "model")`` for ``"lookup+model"``, ``(name,)``
    for a single drafter."""
    return tuple(str(name).split("+"))


def needs_draft_model(name: str) -> bool:
    """Whether drafter ``name`` (single or hybrid) drafts with a draft model."""
    return "model" in drafter_sources(name)
#: Model dtype names (and their short aliases) → the canonical name, the attribute of ``torch``; ``"auto"`` is the
#: precision the machine computes fastest (:func:`learn2draft.models.fastest_dtype`).
DTYPE_NAMES = {"auto": "auto", "float32": "float32", "fp32": "float32", "bfloat16": "bfloat16", "bf16": "bfloat16",
               "float16": "float16", "fp16": "float16"}

#: Default ``max_depth`` of a training run, a policy, an environment and a trace recording: the most
#: draft steps per cycle, and the scale of the ``depth`` feature (depth / max_depth).
DEFAULT_MAX_DEPTH = 8
#: Default ``max_depth`` of a bare decoder (:class:`learn2draft.decoding.SpeculativeDecoder`,
#: :class:`learn2draft.tree.TreeSpeculativeDecoder`): a cap only; a policy's decoder is built with its own.
DECODER_MAX_DEPTH = 12

#: Default draft-tree shape: the ``width`` best frontier nodes each get their ``top_k`` children.
DEFAULT_TREE_WIDTH = 4
DEFAULT_TREE_TOP_K = 4
#: The verification sizes V a size policy chooses from and a tree trace records by default (LTD's range,
#: on a power-of-two grid, with 48: the V of the shipped tree policy).
DEFAULT_VERIFY_SIZES: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 48, 64)

#: Seed stride between repeats: prompt i of repeat k is generated (or replayed) with :func:`run_seed`.
SEED_REPEAT_STRIDE = 1000
#: A training run's final check draws its seeds this far above the training seed (``seed + 1000 + i``
#: for held-out prompt i), so they differ from the warm-up's.
HELDOUT_SEED_OFFSET = 1000


def run_seed(seed: int, repeat: int, prompt_index: int) -> int:
    """The seed of prompt ``prompt_index`` in repeat ``repeat``: ``seed + 1000·repeat + prompt_index``
    (:data:`SEED_REPEAT_STRIDE`), the same in eval's runner, replay scoring and sim-vs-real."""
    return int(seed) + SEED_REPEAT_STRIDE * int(repeat) + int(prompt_index)


def check_verify_sizes(verify_sizes) -> tuple[int, ...]:
    """Validate a set of verification sizes V (tree nodes sent to the target) and return it as a tuple of ints.

    Raises:
        ValueError: not a sequence, empty, not integers ≥ 1 (bools refused; numpy integers accepted),
            or not strictly increasing.
    """
    try:
        sizes = tuple(verify_sizes)
    except TypeError:
        raise ValueError(f"verify_sizes must be a sequence of integers ≥ 1, got {verify_sizes!r}.") from None
    if not sizes:
        raise ValueError("verify_sizes is empty: give at least one verification size V ≥ 1, "
                         "e.g. 1,2,4,8,16,32,48,64.")
    if any(isinstance(v, bool) or not isinstance(v, Integral) or v < 1 for v in sizes):
        raise ValueError(f"verify_sizes must be integers ≥ 1 (tree nodes to verify), got {list(sizes)}.")
    if any(b <= a for a, b in zip(sizes, sizes[1:])):
        raise ValueError(f"verify_sizes must be strictly increasing, got {list(sizes)}.")
    return tuple(int(v) for v in sizes)


__all__ = ["DECODER_MAX_DEPTH", "DEFAULT_DRAFT", "DEFAULT_DRAFT_DIR", "DEFAULT_MAX_DEPTH", "DEFAULT_TARGET", "DRAFTERS",
           "HYBRID_DRAFTERS", "drafter_sources", "needs_draft_model",
           "DTYPE_NAMES",
           "DEFAULT_TREE_TOP_K", "DEFAULT_TREE_WIDTH", "DEFAULT_VERIFY_SIZES", "HELDOUT_SEED_OFFSET",
           "SEED_REPEAT_STRIDE", "check_verify_sizes", "run_seed"]
