"""The classic drafter: a small draft language model with its own KV cache (Leviathan et al. 2023)."""

from __future__ import annotations

import torch
from transformers import DynamicCache, PreTrainedModel

from learn2draft.drafters.base import (
    Drafter,
    DraftProposal,
    TopKProposal,
    _check_rows,
    append_new_entries,
    batch_attention_mask,
    draw_rows,
    group_by_module,
    pad_caches,
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

    Many rows (:meth:`prepare_batch`): drafters that share one model (:meth:`spawn`) run one forward for all rows;
    each keeps its own cache, gathered into a padded batch for the call and appended to after it.

    Args:
        model: the draft model (e.g. :attr:`learn2draft.ModelPair.draft`), in eval mode.
        vocab_size: V, the real vocabulary size; logits are sliced to ``[:, :V]`` (padded rows masked).

    Raises:
        ValueError: (from ``sampling.probs``) the draft returned NaN or infinite logits.
    """

    name = "model"
    supports_tree = True
    batched = True

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

    def propose(self, seq: torch.Tensor, sampling: SamplingConfig, generator: torch.Generator | None) -> DraftProposal:
        return self.finish(self.prepare(seq), seq, sampling, generator)

    @torch.inference_mode()
    def prepare(self, seq: torch.Tensor) -> torch.Tensor:
        """Feed ``seq[cache_len:]`` (int64, ≥ 1 token) to the draft's cache; returns the raw logits float (V,) after
        ``seq``, in the model's dtype."""
        self._drop_tree()
        out = self.model(input_ids=seq[self.cache_len :].unsqueeze(0), cache=self.cache, use_cache=True)
        self.cache_len = seq.numel()
        return out.logits[0, -1, : self.vocab_size]

    def finish(self, prepared: torch.Tensor, seq: torch.Tensor, sampling: SamplingConfig,
               generator: torch.Generator | None) -> DraftProposal:
        """Draw the token from q = ``sampling.probs(prepared, seq)`` (one draw from ``generator``)."""
        q = sampling.probs(prepared[None], seq, source="draft")[0]
        token = sample_from(q, generator)
        return DraftProposal(token, q, *raw_distribution_stats(prepared))

    @classmethod
    @torch.inference_mode()
    def finish_rows(cls, drafters, prepared, seqs, generators, sampling) -> list[DraftProposal]:
        """:meth:`finish` for many rows in one computation (:meth:`Drafter.finish_rows`): the rows' raw logits
        (``prepared[i]``: float (V,), as :meth:`prepare_batch` returns them) stacked into (B, V), q of all rows in one
        :meth:`~learn2draft.sampling.SamplingConfig.probs_rows` call (float32 (B, V); row i's q is its row), row i's
        token drawn by inverse CDF with one float64 uniform from its own generator — the draw :func:`sample_from`
        makes for it alone — all rows' tokens crossing to the host in one transfer
        (:func:`~learn2draft.sampling.sample_rows`), and the rows' confidence, entropy and margin in one more
        (:func:`~learn2draft.drafters.base.raw_distribution_stats_rows`): 3 host reads for the rows instead of 3 per
        row (:func:`~learn2draft.drafters.base.draw_rows`). Per row (:meth:`finish`) for one row, a penalty that reads each row's prefix, logits of other lengths or
        devices, or a subclass with its own :meth:`finish`.

        Raises:
            ValueError: NaN or infinite draft logits.
        """
        if (cls.finish is not ModelDrafter.finish or len(prepared) < 2 or sampling.prefix_dependent
                or len({(p.shape, p.device) for p in prepared}) != 1):
            return super().finish_rows(drafters, prepared, seqs, generators, sampling)
        logits = torch.stack(list(prepared))
        return draw_rows(sampling.probs_rows(logits, source="draft"), logits, generators)

    @classmethod
    @torch.inference_mode()
    def prepare_batch(cls, drafters, seqs) -> list[torch.Tensor]:
        """One draft forward per group of rows sharing a model (one for a batch of :meth:`spawn`-ed drafters).

        Row i feeds its ``seqs[i][cache_len_i:]`` (n_i ≥ 1 tokens: the tokens committed since its last cycle at the
        first draft step, one token after): its cache (cache_len_i entries) is left-padded into one batch
        (:func:`~learn2draft.drafters.base.pad_caches`), the new tokens right-padded to T = max n_i at positions
        cache_len_i + j, with a 4D additive mask in the model's dtype
        (:func:`~learn2draft.drafters.base.batch_attention_mask`); the rows' new entries are appended to their own
        caches. Row i gets what its own :meth:`prepare` would, up to float rounding.

        Returns:
            per row, the raw logits float (V,) after ``seqs[i]``, in the model's dtype.

        Raises:
            ValueError: ``drafters`` and ``seqs`` differ in length.
        """
        _check_rows(drafters, seqs)
        out: list[torch.Tensor | None] = [None] * len(drafters)
        for group in group_by_module(drafters, "model"):
            if len(group) == 1:
                out[group[0]] = drafters[group[0]].prepare(seqs[group[0]])
                continue
            ds = [drafters[i] for i in group]
            for d in ds:
                if d.tree_slots:  # a tree's entries (none in a chain: no call per row)
                    d._drop_tree()
            model, dev = ds[0].model, seqs[group[0]].device
            lengths = [d.cache_len for d in ds]
            new = [int(seqs[i].numel()) - n for i, n in zip(group, lengths)]
            T = max(new)
            ids = torch.zeros(len(ds), T, dtype=torch.long, device=dev)
            for j, (i, n) in enumerate(zip(group, lengths)):
                ids[j, : new[j]] = seqs[i][n:]
            cache, past = pad_caches([d.cache for d in ds], lengths)
            cache = cache if cache is not None else DynamicCache()
            pos = torch.tensor(lengths, device=dev)[:, None] + torch.arange(T, device=dev)[None]
            mask = batch_attention_mask(lengths, past, new, model.dtype, dev)
            keep = sorted({n - 1 for n in new})  # the LM head only at the rows' last real positions
            res = model(input_ids=ids, attention_mask=mask, position_ids=pos, cache=cache, use_cache=True,
                        logits_to_keep=torch.tensor(keep, device=dev))
            append_new_entries(cache, [d.cache for d in ds], past, new)
            col = torch.tensor([keep.index(n - 1) for n in new], device=dev)
            logits = res.logits[torch.arange(len(ds), device=dev), col, : ds[0].vocab_size]
            for j, (i, d) in enumerate(zip(group, ds)):
                d.cache_len = int(seqs[i].numel())
                out[i] = logits[j]
        return out

    def spawn(self) -> ModelDrafter:
        """A new drafter over the same draft model (shared), with an empty cache."""
        return ModelDrafter(self.model, self.vocab_size)

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
        ModelDrafter._rollback([self], [length])

    @classmethod
    def rollback_rows(cls, drafters, lengths) -> None:
        """:meth:`rollback` for many rows in one call (:meth:`Drafter.rollback_rows`; unchecked): each row's cache
        cropped to its length. A subclass that overrides :meth:`rollback` has it called per row."""
        if cls.rollback is not ModelDrafter.rollback:
            super().rollback_rows(drafters, lengths)
        else:
            ModelDrafter._rollback(drafters, lengths)

    @staticmethod
    def _rollback(drafters, lengths) -> None:
        """The one implementation of :meth:`rollback` over rows: drop a row's tree entries, crop its cache past
        ``lengths[i]`` tokens."""
        for d, n in zip(drafters, lengths):
            if d.tree_slots:
                d._drop_tree()
            if d.cache_len > n:
                d.cache.crop(-(d.cache_len - n))
                d.cache_len = n

    def extra_config(self) -> dict:
        from learn2draft.models import canonical_model_name

        name = getattr(self.model, "name_or_path", "")
        return {"drafter": self.name, "draft_model": canonical_model_name(name) if name else ""}


__all__ = ["ModelDrafter"]
