"""Drafters behind one interface (:class:`Drafter`): a small draft model, a feature-level draft
head over the target's hidden states, and model-free prompt lookup.

``make_drafter(name, pair)`` builds one by name; the decoder takes it as
``SpeculativeDecoder(pair, ..., drafter=...)``.
"""

from __future__ import annotations

from learn2draft.drafters.base import NUM_DRAFTER_FEATURES, Drafter, DraftProposal
from learn2draft.drafters.lookup import LookupDrafter
from learn2draft.drafters.model import ModelDrafter
from learn2draft.names import DRAFTERS, HYBRID_DRAFTERS


def make_drafter(name: str, pair, head: str | None = None, min_ngram: int | None = None, **kwargs) -> Drafter:
    """Build the drafter ``name`` for a :class:`learn2draft.ModelPair`.

    Args:
        name: ``"model"`` (``pair.draft``: the pair must hold a draft model), ``"head"`` (a trained feature-level head for
            ``pair.target``; ``head`` is its directory, default: the shipped head of the embedded
            target) or ``"lookup"`` (prompt lookup; ``kwargs`` go to :class:`LookupDrafter`).
        pair: the loaded models.
        min_ngram: prompt lookup's shortest n-gram match (:class:`LookupDrafter`; ``--lookup-min-ngram``), for
            ``"lookup"`` and the hybrids; None: the drafter's default (2). Ignored by the model and head drafters.

    A hybrid name (``"lookup+model"``, ``"lookup+head"``, :data:`learn2draft.names.HYBRID_DRAFTERS`) builds a
    :class:`learn2draft.drafters.hybrid.HybridDrafter` of prompt lookup (``kwargs``) and that neural drafter.

    Raises:
        ValueError: unknown name, or a bad ``min_ngram``.
        learn2draft.models.NoDraftModelError: ``"model"`` for a pair loaded without a draft model.
        learn2draft.ModelLoadError: the head cannot be found or does not fit the target.
    """
    if min_ngram is not None and (name == "lookup" or name in HYBRID_DRAFTERS):
        kwargs["min_ngram"] = min_ngram
    if name in HYBRID_DRAFTERS:
        from learn2draft.drafters.hybrid import HybridDrafter

        return HybridDrafter(LookupDrafter(**kwargs), make_drafter(name.split("+")[1], pair, head))
    if name == "model":
        return ModelDrafter(pair.draft, pair.vocab_size)
    if name == "lookup":
        return LookupDrafter(**kwargs)
    if name == "head":
        from learn2draft.drafters.head import load_head_drafter

        return load_head_drafter(pair, head, **kwargs)
    raise ValueError(f"Unknown drafter {name!r}: use one of {', '.join(DRAFTERS + HYBRID_DRAFTERS)}.")


__all__ = ["DRAFTERS", "HYBRID_DRAFTERS", "NUM_DRAFTER_FEATURES", "DraftProposal", "Drafter", "LookupDrafter", "ModelDrafter",
           "make_drafter"]
