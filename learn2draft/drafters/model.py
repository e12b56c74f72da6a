"""The classic drafter: a small draft language model with its own KV cache (Leviathan et al. 2023)."""

from __future__ import annotations

import torch
from transformers import DynamicCache, PreTrainedModel

from learn2draft.drafters.base import DraftProposal, Drafter, raw_confidence_entropy
from learn2draft.sampling import SamplingConfig, sample_from


class ModelDrafter(Drafter):
    """Draft with a small causal LM that shares the target's tokenizer.

    Cache invariant: the draft's KV cache holds a prefix of the current sequence; each
    :meth:`propose` feeds the tokens after that prefix (one new token per step inside a cycle,
    the committed tokens of the last cycle at the first step of the next).

    Args:
        model: the draft model (e.g. :attr:`learn2draft.ModelPair.draft`), in eval mode.
        vocab_size: V, the real vocabulary size; logits are sliced to ``[:, :V]`` (padded rows masked).

    Raises:
        ValueError: (from ``sampling.probs``) the draft returned NaN or infinite logits.
    """

    name = "model"

    def __init__(self, model: PreTrainedModel, vocab_size: int):
        self.model = model
        self.vocab_size = int(vocab_size)
        self.cache = DynamicCache()
        self.cache_len = 0

    def start(self, prompt_ids: torch.Tensor) -> None:
        self.cache = DynamicCache()
        self.cache_len = 0

    @torch.inference_mode()
    def propose(self, seq: torch.Tensor, sampling: SamplingConfig, generator: torch.Generator | None) -> DraftProposal:
        out = self.model(input_ids=seq[self.cache_len :].unsqueeze(0), cache=self.cache, use_cache=True)
        self.cache_len = seq.numel()
        logits = out.logits[0, -1:, : self.vocab_size]
        q = sampling.probs(logits, seq, source="draft")[0]
        token = sample_from(q, generator)
        conf, ent = raw_confidence_entropy(logits[0])
        return DraftProposal(token, q, conf, ent)

    def rollback(self, length: int) -> None:
        if self.cache_len > length:
            self.cache.crop(-(self.cache_len - length))
            self.cache_len = length

    def extra_config(self) -> dict:
        return {"drafter": self.name, "draft_model": getattr(self.model, "name_or_path", "")}


__all__ = ["ModelDrafter"]
