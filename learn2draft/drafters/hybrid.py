"""A hybrid drafter: prompt lookup and a neural drafter (draft model or head), the source chosen before each token.

Every shipped hybrid picks its source by a fixed rule: vLLM's ngram-eagle (PR #24344: the n-gram proposal when it
matches, else EAGLE), ArcticInference (the suffix draft when its score, an estimated accepted length, exceeds the
model drafter's k), llama.cpp's fixed priority. Here the controller chooses, before each draft token, STOP or
CONTINUE with one of the two sources (:data:`learn2draft.control.CONTINUE_LOOKUP`,
:data:`learn2draft.control.CONTINUE_NEURAL`), so a policy can learn the source jointly with the depth from a
wall-clock reward; the rules are controllers too (:mod:`policies.rules`).

The law: the source of token j is chosen from what is known before token j is drawn (the tokens drafted so far,
the lookup's match statistics, the target's view of the last committed token), and token j carries the q it was
drawn from — a point mass for lookup, the neural drafter's processed distribution otherwise — so the exact sampler
(:func:`learn2draft.sampling.speculative_sample`, one row of q per position) keeps the target's law whatever the
mix (tests: exact enumeration and Monte Carlo with a per-step switch).

State across sources: the neural drafter catches up on the tokens lookup proposed the next time it drafts — a draft
model feeds them to its KV cache in one forward, the head runs its decoder layer over them with its own predicted
features (EAGLE's drafting rule), so its state after a lookup run is the one it would have after drafting those
tokens itself. After verification both are rolled back to the committed length.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from learn2draft.drafters.base import Drafter, DraftProposal, _check_rows
from learn2draft.drafters.lookup import LookupDrafter
from learn2draft.sampling import SamplingConfig

#: Source indices of :attr:`HybridDrafter.sources`.
LOOKUP_SOURCE, NEURAL_SOURCE = 0, 1


class HybridDrafter(Drafter):
    """Prompt lookup + a neural drafter behind one :class:`Drafter`; :meth:`select` sets the next token's source.

    Args:
        lookup: the :class:`LookupDrafter` (model-free, deterministic proposals).
        neural: a :class:`learn2draft.drafters.model.ModelDrafter` or :class:`learn2draft.drafters.head.HeadDrafter`.

    Many rows (:meth:`prepare_batch`, ``batched`` when the neural drafter is): the source of each row is chosen
    first (the controller's answer), then the rows drafting with the neural drafter run one forward of it.

    Attributes:
        name: ``"lookup+model"`` or ``"lookup+head"``.
        sources: ``("lookup", neural.name)``; index :data:`LOOKUP_SOURCE` / :data:`NEURAL_SOURCE`.
        selected: the source of the next :meth:`propose` (set by :meth:`select`; lookup by default).

    Raises:
        ValueError: ``lookup`` is not a LookupDrafter, or ``neural`` is a lookup or hybrid drafter.
    """

    supports_tree = False

    def __init__(self, lookup: LookupDrafter, neural: Drafter):
        if not isinstance(lookup, LookupDrafter):
            raise ValueError(f"A hybrid drafter's first source must be a LookupDrafter, got {type(lookup).__name__}.")
        if isinstance(neural, (LookupDrafter, HybridDrafter)):
            raise ValueError("A hybrid drafter's second source must be a neural drafter (model or head).")
        self.lookup, self.neural = lookup, neural
        self.parts = (lookup, neural)
        self.sources = ("lookup", neural.name)
        self.name = f"lookup+{neural.name}"
        self.needs_target_hidden = neural.needs_target_hidden
        self.batched = neural.batched  # the neural proposals of many rows batch (once their sources are chosen)
        self.selected = LOOKUP_SOURCE
        self.last_source = LOOKUP_SOURCE  # the source of the last proposal (read by the decoder after each one)
        self._lookahead: tuple[int, list[int], list[float], bool] | None = None

    def start(self, prompt_ids: torch.Tensor) -> None:
        self.lookup.start(prompt_ids)
        self.neural.start(prompt_ids)
        self.selected = LOOKUP_SOURCE
        self._lookahead = None

    def observe_target(self, hidden: torch.Tensor, first_position: int) -> None:
        self.neural.observe_target(hidden, first_position)

    def attach_tokens(self, tokens: np.ndarray) -> None:
        """Attach the decoder's host tokens to the prompt lookup (:meth:`LookupDrafter.attach_tokens`)."""
        self.lookup.attach_tokens(tokens)

    def observe_tokens(self, tokens: list[int], first_position: int) -> None:
        self.lookup.observe_tokens(tokens, first_position)
        self.neural.observe_tokens(tokens, first_position)
        if tokens and self._lookahead is not None and first_position < self._lookahead[0]:
            self._lookahead = None  # a position before the cached chain's start rewritten: the chain is stale

    def select(self, source: int) -> None:
        """Draft the next token with ``sources[source]``.

        Raises:
            ValueError: not 0 or 1.
        """
        if source not in (LOOKUP_SOURCE, NEURAL_SOURCE):
            raise ValueError(f"A hybrid drafter has sources 0 = lookup and 1 = {self.sources[1]}, got {source!r}.")
        self.selected = int(source)

    def can_propose_with(self, source: int, seq: torch.Tensor) -> bool:
        """Whether ``sources[source]`` has a proposal after ``seq`` (int64 (n,))."""
        return self.parts[source].can_propose(seq)

    def can_propose(self, seq: torch.Tensor) -> bool:
        return self.lookup.can_propose(seq) or self.neural.can_propose(seq)

    def propose(self, seq: torch.Tensor, sampling: SamplingConfig, generator: torch.Generator | None) -> DraftProposal:
        """The selected source's proposal; when it has none, the other's (the controller's choice is a preference:
        lookup without a match cannot propose, so CONTINUE_LOOKUP then drafts with the neural drafter).

        Raises:
            RuntimeError: neither source has a proposal.
        """
        src = self._source(seq)
        self.last_source = src
        return self.parts[src].propose(seq, sampling, generator)

    def _source(self, seq: torch.Tensor) -> int:
        """The source of the next proposal: the selected one if it has a proposal, else the other.

        Raises:
            RuntimeError: neither source has a proposal.
        """
        src = self.selected if self.parts[self.selected].can_propose(seq) else 1 - self.selected
        if not self.parts[src].can_propose(seq):
            raise RuntimeError("Neither source of the hybrid drafter has a proposal (check can_propose() first).")
        return src

    def prepare(self, seq: torch.Tensor) -> tuple[int, Any]:
        """The source of the next proposal (after :meth:`select`) and, for the neural one, its
        :meth:`~learn2draft.drafters.Drafter.prepare` (the forward); lookup prepares nothing.

        Raises:
            NotImplementedError: the neural drafter has no split forward.
            RuntimeError: neither source has a proposal.
        """
        src = self._source(seq)
        return src, (self.neural.prepare(seq) if src == NEURAL_SOURCE else None)

    def finish(self, prepared: tuple[int, Any], seq: torch.Tensor, sampling: SamplingConfig,
               generator: torch.Generator | None) -> DraftProposal:
        """The proposal of the source :meth:`prepare` chose: lookup's, or the neural drafter's draw."""
        src, inner = prepared
        self.last_source = src
        if src == NEURAL_SOURCE:
            return self.neural.finish(inner, seq, sampling, generator)
        return self.lookup.propose(seq, sampling, generator)

    @classmethod
    def finish_rows(cls, drafters, prepared, seqs, generators, sampling) -> list[DraftProposal]:
        """:meth:`finish` for many rows (:meth:`Drafter.finish_rows`): the rows whose prepared source is the neural
        drafter draw together, one :meth:`~learn2draft.drafters.Drafter.finish_rows` call per neural drafter type
        (each row from its own generator); the lookup rows propose one by one (a point mass, no draw). A subclass
        with its own :meth:`finish` has it called per row."""
        if cls.finish is not HybridDrafter.finish:
            return super().finish_rows(drafters, prepared, seqs, generators, sampling)
        out: list[DraftProposal | None] = [None] * len(drafters)
        by_type: dict[type, list[int]] = {}
        for i, (d, (src, _)) in enumerate(zip(drafters, prepared)):
            d.last_source = src
            if src == NEURAL_SOURCE:
                by_type.setdefault(type(d.neural), []).append(i)
            else:
                out[i] = d.lookup.propose(seqs[i], sampling, generators[i])
        for kind, idx in by_type.items():
            props = kind.finish_rows([drafters[i].neural for i in idx], [prepared[i][1] for i in idx],
                                     [seqs[i] for i in idx], [generators[i] for i in idx], sampling)
            for i, p in zip(idx, props):
                out[i] = p
        return out

    @classmethod
    def prepare_batch(cls, drafters, seqs) -> list[tuple[int, Any]]:
        """:meth:`prepare` for many rows, their sources already selected: the rows whose source is the neural
        drafter run one :meth:`~learn2draft.drafters.Drafter.prepare_batch` forward of it (per neural drafter type).

        Raises:
            ValueError: ``drafters`` and ``seqs`` differ in length.
            RuntimeError: a row has no proposal from either source.
        """
        _check_rows(drafters, seqs)
        srcs = [d._source(s) for d, s in zip(drafters, seqs)]
        out: list[tuple[int, Any]] = [(src, None) for src in srcs]
        by_type: dict[type, list[int]] = {}
        for i, src in enumerate(srcs):
            if src == NEURAL_SOURCE:
                by_type.setdefault(type(drafters[i].neural), []).append(i)
        for kind, idx in by_type.items():
            for i, p in zip(idx, kind.prepare_batch([drafters[i].neural for i in idx], [seqs[i] for i in idx])):
                out[i] = (NEURAL_SOURCE, p)
        return out

    def rollback(self, length: int) -> None:
        self.lookup.rollback(length)
        self.neural.rollback(length)
        self._lookahead = None

    def features(self, seq: torch.Tensor) -> np.ndarray:
        """The lookup's ``match_len``, ``match_count`` (float32 (NUM_DRAFTER_FEATURES,)): 0 when lookup has no match."""
        return self.lookup.features(seq)

    def lookahead(self, seq: torch.Tensor, k: int) -> tuple[list[int], list[float]]:
        """The chain lookup would draft after ``seq`` (int64 (n,)) if all of it were accepted, up to ``k`` tokens:
        its tokens and confidences (the share of the n-gram's occurrences continuing with each). Deterministic and
        model-free, so reading it before a decision draws nothing (ArcticInference scores its suffix draft the same
        way). Cached per cycle: while the drafted tokens follow the chain, the suffix is reused.

        Returns:
            (tokens, confidences), both of length ≤ ``k`` (empty without a match).
        """
        n = seq.numel()
        c = self._lookahead
        if c is not None and c[0] <= n:
            start, toks, confs, exhausted = c
            off = n - start
            if off <= len(toks) and (off + k <= len(toks) or exhausted) and seq[start:].tolist() == toks[:off]:
                return toks[off:off + k], confs[off:off + k]
        toks, confs = self.lookup.lookahead(seq, k)
        self._lookahead = (n, toks, confs, len(toks) < k)  # exhausted: the chain ended before k tokens
        return toks, confs

    def spawn(self) -> HybridDrafter:
        """A new hybrid of spawned sources (the neural drafter's weights shared): ``batched`` as the neural drafter's.
        A batch first lets each row's controller choose its source, then the rows that chose the neural drafter share
        one forward (:meth:`prepare_batch`); lookup proposes per row."""
        return HybridDrafter(self.lookup.spawn(), self.neural.spawn())

    def extra_config(self) -> dict:
        return {"drafter": self.name, "lookup": self.lookup.extra_config(), "neural": self.neural.extra_config()}


__all__ = ["LOOKUP_SOURCE", "NEURAL_SOURCE", "HybridDrafter"]
