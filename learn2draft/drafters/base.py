"""The :class:`Drafter` interface: what proposes draft tokens to the speculative decoder.

A drafter proposes the next draft token after a sequence (committed tokens + tokens drafted
so far this cycle) together with the distribution q it was sampled from, or no q when the
proposal is deterministic (q is then a point mass on the proposed token, which the exact
sampler of :func:`learn2draft.sampling.speculative_sample` handles: the token is accepted with
probability p(x) and the residual is p with x removed). After verification the decoder rolls the
drafter back to the committed length.

Three drafters implement it (:mod:`learn2draft.drafters`):

* :class:`~learn2draft.drafters.model.ModelDrafter` — a small draft language model with its own KV cache;
* :class:`~learn2draft.drafters.head.HeadDrafter` — a feature-level draft head (EAGLE, Li et al.
  2024, arXiv 2401.15077) reading the target's last hidden states;
* :class:`~learn2draft.drafters.lookup.LookupDrafter` — model-free prompt lookup (n-gram matching
  over prompt and generated tokens, as Hugging Face's ``prompt_lookup_num_tokens``).

The decoder keeps the law; a drafter only has to say truthfully which q its token came from.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import numpy as np
import torch

from learn2draft.sampling import SamplingConfig

#: Number of drafter-specific features every drafter reports (see :meth:`Drafter.features`).
NUM_DRAFTER_FEATURES = 2


@dataclass
class DraftProposal:
    """One proposed draft token.

    Attributes:
        token: the proposed token id.
        probs: float32 (V,) — the processed draft distribution q the token was sampled from
            (same logits processors as the target's p), or None for a deterministic proposal
            (a point mass on ``token``).
        confidence: in [0, 1]: the draft's raw max probability (model, head) or the share of
            n-gram matches that continue with ``token`` (lookup).
        entropy: nats, of the draft's raw distribution (0 for a point mass).
    """

    token: int
    probs: torch.Tensor | None
    confidence: float
    entropy: float


class Drafter(ABC):
    """Proposes draft tokens one at a time for :class:`learn2draft.SpeculativeDecoder`.

    Life cycle per prompt: :meth:`start` (prompt ids), then per cycle any number of
    :meth:`propose` calls on a growing sequence, then :meth:`rollback` to the committed length
    after verification. Drafters with ``needs_target_hidden = True`` also receive the target's
    last hidden states through :meth:`observe_target`.

    Attributes:
        name: ``"model"``, ``"head"`` or ``"lookup"``.
        needs_target_hidden: the decoder asks the target for its last hidden states and passes them on.
        deterministic: proposals carry no q (point masses).
    """

    name: str = "drafter"
    needs_target_hidden: bool = False
    deterministic: bool = False

    @abstractmethod
    def start(self, prompt_ids: torch.Tensor) -> None:
        """Reset for a new prompt. ``prompt_ids``: int64 (L,), on the decoder's device."""

    def can_propose(self, seq: torch.Tensor) -> bool:
        """Whether :meth:`propose` has a token for ``seq`` (int64 (n,)); a lookup without a match has none."""
        return True

    @abstractmethod
    def propose(
        self, seq: torch.Tensor, sampling: SamplingConfig, generator: torch.Generator | None
    ) -> DraftProposal:
        """Propose the token after ``seq`` (int64 (n,): committed + drafted this cycle).

        A sampling drafter draws from q = ``sampling.probs(its logits, prefix)`` with ``generator``.

        Raises:
            RuntimeError: called when :meth:`can_propose` is False.
        """

    @abstractmethod
    def rollback(self, length: int) -> None:
        """Forget everything past the first ``length`` tokens of the sequence (the committed,
        verified prefix)."""

    def observe_target(self, hidden: torch.Tensor, first_position: int) -> None:  # noqa: B027 (optional hook)
        """Receive the target's last hidden states (float (n, H)) for sequence positions
        ``first_position .. first_position + n − 1`` (only when ``needs_target_hidden``)."""

    def features(self, seq: torch.Tensor) -> np.ndarray:
        """Drafter-specific features for the next decision, float32 (NUM_DRAFTER_FEATURES,) in [0, 1]
        (see :data:`learn2draft.features.FEATURE_DOCS`: ``match_len``, ``match_count``); zeros by default."""
        return np.zeros(NUM_DRAFTER_FEATURES, dtype=np.float32)

    def extra_config(self) -> dict:
        """JSON-serialisable settings that identify this drafter (stored with trained policies)."""
        return {"drafter": self.name}


def raw_confidence_entropy(logits: torch.Tensor) -> tuple[float, float]:
    """Max probability and entropy (nats) of softmax(``logits``) for float (V,) raw logits."""
    raw = torch.softmax(logits.float(), dim=-1)
    conf = float(raw.max())
    ent = float(-(raw * torch.log(raw.clamp_min(1e-30))).sum())
    return conf, ent


__all__ = ["NUM_DRAFTER_FEATURES", "DraftProposal", "Drafter", "raw_confidence_entropy"]
