"""The classic drafter: a small draft language model with its own KV cache (Leviathan et al. 2023)."""

from __future__ import annotations

import torch
from transformers import DynamicCache, PreTrainedModel

from learn2draft.drafters.base import (
    Drafter,
    DraftProposal,
    TopKProposal,
    raw_distribution_stats,
    topk_proposal,
    tree_slot_mask,
)
from learn2draft.sampling import SamplingConfig, sample_from


class ModelDrafter(Drafter):
    """Draft with a small causal LM that shares the target's tokenizer.

    Cache invariant: the draft's KV cache holds a prefix of the current sequence; each
    :meth:`propose` feeds the tokens after that prefix (one new token per step inside a cycle,
    the committed tokens of the last cycle at the first step of the next).

    Draft trees (:meth:`propose_topk`): the first expansion feeds the committed tokens not yet cached
    (the root last); each later one feeds the W frontier nodes in one forward with a tree attention
    mask (each attends to the committed tokens, its ancestors' slots and itself) at positions
    n − 1 + depth. Those entries sit after the committed ones and :meth:`rollback` crops them all.

    Args:
        model: the draft model (e.g. :attr:`learn2draft.ModelPair.draft`), in eval mode.
        vocab_size: V, the real vocabulary size; logits are sliced to ``[:, :V]`` (padded rows masked).

    Raises:
        ValueError: (from ``sampling.probs``) the draft returned NaN or infinite logits.
    """

    name = "model"
    supports_tree = True

    def __init__(self, model: PreTrainedModel, vocab_size: int):
        self.model = model
        self.vocab_size = int(vocab_size)
        self.start(torch.zeros(0, dtype=torch.long))

    def start(self, prompt_ids: torch.Tensor) -> None:
        self.cache = DynamicCache()
        self.cache_len = 0  # cache entries of the committed sequence (tree entries come after them)
        self.tree_slots: dict[int, int] = {}  # tree node → cache slot (the root: its committed slot)

    def _drop_tree(self) -> None:
        fed = len(self.tree_slots) - 1 if self.tree_slots else 0
        if fed > 0:
            self.cache.crop(-fed)
        self.tree_slots = {}

    @torch.inference_mode()
    def propose(self, seq: torch.Tensor, sampling: SamplingConfig, generator: torch.Generator | None) -> DraftProposal:
        self._drop_tree()
        out = self.model(input_ids=seq[self.cache_len :].unsqueeze(0), cache=self.cache, use_cache=True)
        self.cache_len = seq.numel()
        logits = out.logits[0, -1:, : self.vocab_size]
        q = sampling.probs(logits, seq, source="draft")[0]
        token = sample_from(q, generator)
        return DraftProposal(token, q, *raw_distribution_stats(logits[0]))

    @torch.inference_mode()
    def propose_topk(self, seq: torch.Tensor, tree, nodes: list[int], k: int, sampling: SamplingConfig) -> TopKProposal:
        nodes = [int(i) for i in nodes]
        if tree.max_depth == 0:  # a new tree: feed the committed tokens not cached yet, the root last
            self._drop_tree()
            if seq.numel() <= self.cache_len:
                self.rollback(seq.numel() - 1)
            out = self.model(input_ids=seq[self.cache_len :].unsqueeze(0), cache=self.cache, use_cache=True)
            self.cache_len = seq.numel()
            self.tree_slots = {0: self.cache_len - 1}
            logits = out.logits[0, -1:, : self.vocab_size]
        else:
            missing = [f for f in nodes if any(a not in self.tree_slots for a in tree.path(f)[:-1])]
            if missing or not self.tree_slots:
                raise RuntimeError(f"Tree nodes {missing or nodes} are expanded before their ancestors: expand the "
                                   "tree level by level, starting from the root.")
            total = self.cache_len + len(self.tree_slots) - 1
            anc = [[self.tree_slots[a] for a in tree.path(f)[:-1]] for f in nodes]
            dev = seq.device
            mask = tree_slot_mask(anc, self.cache_len, total, self.model.dtype, dev)
            pos = (tree.depth[nodes] + (self.cache_len - 1)).to(dev)[None]
            toks = tree.tokens[nodes].to(dev)[None]
            out = self.model(input_ids=toks, attention_mask=mask, position_ids=pos, cache=self.cache, use_cache=True)
            for j, f in enumerate(nodes):
                self.tree_slots[f] = total + j
            logits = out.logits[0, :, : self.vocab_size]
        prefixes = ([torch.cat([seq, tree.tokens[tree.path(f)].to(seq.device)]) for f in nodes]
                    if sampling.prefix_dependent else [seq])
        return topk_proposal(logits, k, sampling, prefixes)

    def rollback(self, length: int) -> None:
        self._drop_tree()
        if self.cache_len > length:
            self.cache.crop(-(self.cache_len - length))
            self.cache_len = length

    def extra_config(self) -> dict:
        return {"drafter": self.name, "draft_model": getattr(self.model, "name_or_path", "")}


__all__ = ["ModelDrafter"]
