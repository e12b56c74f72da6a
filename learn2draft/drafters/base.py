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

Draft trees (:class:`learn2draft.tree.TreeSpeculativeDecoder`): a drafter with
``supports_tree = True`` (model, head) also implements :meth:`Drafter.propose_topk`, which expands
the frontier of a :class:`learn2draft.tree.DraftTree` with each node's top-k children (deterministic
candidates, no q needed); :meth:`Drafter.rollback` then also forgets every tree entry.

Many rows (:class:`learn2draft.batched.BatchedSpeculativeDecoder`): a drafter with ``batched = True`` (model,
head, a hybrid over one) splits :meth:`Drafter.propose` into :meth:`Drafter.prepare` (the forward) and
:meth:`Drafter.finish` (the draw), and :meth:`Drafter.prepare_batch` runs one forward for many rows, each row's
own cache gathered into a padded batch (:func:`pad_caches`, :func:`batch_attention_mask`,
:func:`append_new_entries`); :meth:`Drafter.propose_batch` is the two together.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from transformers import DynamicCache

from learn2draft.sampling import SamplingConfig, sample_rows

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
        margin: in [0, 1]: the draft's top-2 margin (max − second probability of its raw distribution; model,
            head), or the share of the most frequent continuation of the matched n-gram minus the second's
            (lookup); 0 when unknown. The acceptance signal of vLLM's online estimator (PR #52228).
    """

    token: int
    probs: torch.Tensor | None
    confidence: float
    entropy: float
    margin: float = 0.0


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
        batched: :meth:`propose` is :meth:`prepare` (the forward) then :meth:`finish` (the draw), and
            :meth:`prepare_batch` runs one forward for many rows (the model and head drafters).

    Many rows (:class:`learn2draft.batched.BatchedSpeculativeDecoder`): :meth:`propose_batch` proposes for B rows at
    once, each with its own drafter (its own state) and generator; :meth:`spawn` gives a new row a drafter over the
    same weights.
    """

    name: str = "drafter"
    #: :meth:`prepare` / :meth:`finish` split :meth:`propose`, and :meth:`prepare_batch` runs one forward for many rows
    batched: bool = False
    needs_target_hidden: bool = False
    deterministic: bool = False
    supports_tree: bool = False

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
        verified prefix), and every draft-tree entry (drafters that draft trees)."""

    # ------------------------------------------------------------- many rows at once
    def prepare(self, seq: torch.Tensor) -> Any:
        """The forward half of :meth:`propose` (drafters with ``batched = True``): feed what ``seq`` (int64 (n,))
        adds to the drafter's state and return what :meth:`finish` draws from (the raw draft logits). Nothing is
        drawn, so a controller may still decide STOP after it (the rejected sequence is rolled back as usual).

        Raises:
            NotImplementedError: the drafter has no split forward (``batched`` is False: lookup, a hybrid over
                lookup alone).
        """
        raise NotImplementedError(f"The {self.name!r} drafter has no batched forward: call propose().")

    def finish(self, prepared: Any, seq: torch.Tensor, sampling: SamplingConfig,
               generator: torch.Generator | None) -> DraftProposal:
        """The drawing half of :meth:`propose`: ``propose(seq, ...) == finish(prepare(seq), seq, ...)``, the same
        draws from ``generator`` in the same order.

        Raises:
            NotImplementedError: the drafter has no split forward (``batched`` is False).
        """
        raise NotImplementedError(f"The {self.name!r} drafter has no batched forward: call propose().")

    @classmethod
    def prepare_batch(cls, drafters: Sequence[Drafter], seqs: Sequence[torch.Tensor]) -> list[Any]:
        """:meth:`prepare` for many rows, each drafter with its own state and ``seqs[i]`` (int64 (n_i,)); the model
        and head drafters override it with one forward over all rows that share their weights (a group of drafters
        over other weights gets its own forward), the hybrids with one forward of their neural drafter for the rows whose
        selected source it is. Default: one :meth:`prepare` per row.

        Returns:
            one prepared object per row, for :meth:`finish` of that row's drafter.

        Raises:
            ValueError: ``drafters`` and ``seqs`` differ in length.
            NotImplementedError: the drafters have no split forward.
        """
        _check_rows(drafters, seqs)
        return [d.prepare(s) for d, s in zip(drafters, seqs)]

    @classmethod
    def propose_batch(cls, drafters: Sequence[Drafter], seqs: Sequence[torch.Tensor], sampling: SamplingConfig,
                      generators: Sequence[torch.Generator | None]) -> list[DraftProposal]:
        """:meth:`propose` for many rows: row i's proposal equals ``drafters[i].propose(seqs[i], sampling,
        generators[i])`` (up to float rounding of a padded batch), its draws from its own generator. With
        ``batched`` drafters one :meth:`prepare_batch` forward, then one :meth:`finish_rows` draw for the rows; else
        one :meth:`propose` per row (lookup; a hybrid, whose rows choose their source first, batches in the batched
        decoder instead).

        Raises:
            ValueError: the lists differ in length.
        """
        _check_rows(drafters, seqs, generators)
        if drafters and all(d.batched for d in drafters):
            kind = type(drafters[0])
            return kind.finish_rows(drafters, kind.prepare_batch(drafters, seqs), seqs, generators, sampling)
        return [d.propose(s, sampling, g) for d, s, g in zip(drafters, seqs, generators)]

    @classmethod
    def finish_rows(cls, drafters: Sequence[Drafter], prepared: Sequence[Any], seqs: Sequence[torch.Tensor],
                    generators: Sequence[torch.Generator | None], sampling: SamplingConfig) -> list[DraftProposal]:
        """:meth:`finish` for many rows of this class (unchecked: one ``prepared``, int64 ``seqs[i]`` and generator
        per drafter): row i's proposal is ``drafters[i].finish(prepared[i], seqs[i], sampling, generators[i])``, its
        draw from its own generator. The model and head drafters override it with one computation over the rows
        (:func:`draw_rows`: one host read for all rows' tokens), a hybrid with one call per neural drafter type;
        default: one :meth:`finish` per row. A class method: a ``finish`` patched on one instance is not seen by an
        override (a subclass's own :meth:`finish` is: the overrides fall back to this default for it).

        Raises:
            ValueError: NaN or infinite draft logits."""
        return [d.finish(p, s, sampling, g) for d, p, s, g in zip(drafters, prepared, seqs, generators)]

    def spawn(self) -> Drafter:
        """A new drafter of the same kind over the same weights (shared, not copied), started on nothing: what a
        batch needs for each new row, so that the rows' forwards can be batched (they share one module).

        Raises:
            NotImplementedError: the drafter cannot be spawned (build one per row instead).
        """
        raise NotImplementedError(f"The {self.name!r} drafter cannot spawn a new one: build one per row.")

    def propose_topk(self, seq: torch.Tensor, tree, nodes: list[int], k: int, sampling: SamplingConfig) -> TopKProposal:
        """Draft trees: the top-``k`` children of each node in ``nodes`` (EAGLE-2 expansion).

        Called once per tree depth by :class:`learn2draft.tree.TreeSpeculativeDecoder`: first with
        ``nodes = [0]`` on a tree holding only its root (the last committed token ``seq[-1]``), then
        with the frontier of each new level (:meth:`learn2draft.tree.DraftTree.frontier`). A node's
        children are the ``k`` most likely tokens of the draft's distribution after ``seq`` + the
        node's path, processed by :func:`draft_log_probs` (deterministic: no sampling, so no q).
        The drafter keeps what it needs to expand the children later (caches of the fed nodes);
        :meth:`rollback` forgets it.

        Args:
            seq: int64 (n,), the committed tokens; the tree's root is ``seq[-1]``.
            tree: the :class:`learn2draft.tree.DraftTree` drafted so far.
            nodes: node indices of ``tree`` to expand, all on its deepest level.
            k: children per node (≥ 1).
            sampling: the settings applied to the target's p (see :func:`draft_log_probs`).

        Raises:
            NotImplementedError: the drafter does not draft trees (``supports_tree`` is False).
        """
        raise NotImplementedError(f"The {self.name!r} drafter does not draft trees: use the model or head drafter.")

    def observe_tokens(self, tokens: list[int], first_position: int) -> None:  # noqa: B027 (optional hook)
        """The decoder has written ``tokens`` (host ints) at sequence positions ``first_position ..`` of the sequence
        it passes next: the token just drafted, or the tokens committed by a verification (called after
        :meth:`rollback`). A drafter that keeps a host copy of the sequence (prompt lookup) extends it from these
        instead of reading the device tensor back (one host synchronisation per drafted token and per verification
        on a GPU). Proposals only: the output law never depends on it. No-op by default."""

    def attach_tokens(self, tokens: np.ndarray) -> None:  # noqa: B027 (optional hook)
        """Read the sequence from ``tokens`` (int64 (L,) host memory, L ≥ the longest sequence passed; its first n
        entries are the sequence of n tokens passed next), which the decoder keeps current: its token buffer itself
        on a CPU, a host mirror of it on a GPU (:class:`learn2draft.decoding.SpeculativeDecoder`). A drafter that
        searches the sequence on the host (prompt lookup) then keeps no copy of its own. No-op by default."""

    @classmethod
    def observe_rows(cls, drafters: Sequence[Drafter], tokens: Sequence[list[int]],
                     first_positions: Sequence[int]) -> None:
        """:meth:`observe_tokens` for many rows of this class: row i wrote ``tokens[i]`` at ``first_positions[i]``.
        The decoders call it once per drafter class in each verification tail (:func:`learn2draft.decoding.
        finish_rows`) and each record of drafted tokens (:func:`learn2draft.decoding.draft_rows`: a batch's chains at
        once, a token drafted token by token alone); a class whose rows' bookkeeping needs no call per row overrides it
        (prompt lookup). Unchecked: the decoders give one entry per row. A class that keeps the default no-op
        :meth:`observe_tokens` is not called per row."""
        if cls.observe_tokens is Drafter.observe_tokens:
            return
        for d, t, f in zip(drafters, tokens, first_positions):
            d.observe_tokens(t, f)

    @classmethod
    def rollback_rows(cls, drafters: Sequence[Drafter], lengths: Sequence[int]) -> None:
        """:meth:`rollback` for many rows of this class, row i to ``lengths[i]`` tokens (as :meth:`observe_rows`)."""
        for d, n in zip(drafters, lengths):
            d.rollback(n)

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


@dataclass
class TopKProposal:
    """The children :meth:`Drafter.propose_topk` proposes for W tree nodes.

    Attributes:
        tokens: int64 (W, k'), each node's top-k' tokens (k' = min(k, V)), most likely first.
        logprobs: float64 (W, k'), their draft log-probabilities under :func:`draft_log_probs`
            (-inf for tokens the processing removed: :meth:`learn2draft.tree.DraftTree.expand` drops them).
        confidence: the draft's raw max probability at the first node (the best of the frontier).
        entropy: nats, of the draft's raw distribution at the first node.
    """

    tokens: torch.Tensor
    logprobs: torch.Tensor
    confidence: float
    entropy: float


def draft_log_probs(logits: torch.Tensor, sampling: SamplingConfig, prefixes: list[torch.Tensor]) -> torch.Tensor:
    """Log-probabilities that score a draft tree's candidates: log_softmax of the draft logits after
    the logits processors of ``sampling`` (penalties, temperature, top-k, top-p, min-p; the same
    processors as the target's p), without the one-hot of greedy decoding — at temperature 0 only
    the penalties apply, so the scores stay the draft's own log-probabilities (as EAGLE-2 scores
    its tree) rather than 0 / -inf.

    Any deterministic scoring keeps the law exact (:func:`learn2draft.sampling.tree_speculative_sample`);
    this one spends the verification budget where the draft expects the target's mass.

    Args:
        logits: float (W, V), raw draft logits, row i for the node after ``prefixes[i]``.
        sampling: the sampling settings.
        prefixes: W int64 (n_i,) sequences (committed + the node's path), read by the penalties only.

    Returns:
        float32 (W, V); -inf where top-k / top-p / min-p removed a token.

    Raises:
        ValueError: NaN or infinite logits.
    """
    logits = logits.float()
    if not bool(torch.isfinite(logits.sum(dim=-1)).all()):
        raise ValueError("The draft returned NaN or infinite logits; check the draft's weights and dtype "
                         "(float16 on CPU often overflows: use float32 or bfloat16).")
    procs = sampling.processors()
    if not len(procs):
        scores = logits
    elif sampling.prefix_dependent:
        scores = torch.cat([procs(prefixes[i][None], logits[i : i + 1].clone()) for i in range(logits.shape[0])])
    else:  # temperature / top-k / top-p / min-p do not read the prefix
        scores = procs(prefixes[0][-1:].expand(logits.shape[0], 1), logits.clone())
    return torch.log_softmax(scores, dim=-1)


def topk_proposal(logits: torch.Tensor, k: int, sampling: SamplingConfig, prefixes: list[torch.Tensor],
                  raw_first: torch.Tensor | None = None) -> TopKProposal:
    """A :class:`TopKProposal` from raw draft logits float (W, V) (see :func:`draft_log_probs`);
    ``raw_first``: the raw logits the first node's confidence and entropy are read from (default
    ``logits[0]``; a head passes its draft-vocabulary logits).

    Raises:
        ValueError: ``k`` < 1, or NaN / infinite logits.
    """
    if isinstance(k, bool) or not isinstance(k, int) or k < 1:
        raise ValueError(f"k (children per node) must be an integer ≥ 1, got {k!r}.")
    lp = draft_log_probs(logits, sampling, prefixes)
    top = lp.topk(min(k, lp.shape[-1]), dim=-1)
    conf, ent, _ = raw_distribution_stats(logits[0] if raw_first is None else raw_first)
    both = torch.stack([top.indices.double(), top.values.double()]).cpu()  # one transfer (ids < 2**53 are exact)
    return TopKProposal(both[0].long(), both[1], conf, ent)


def tree_slot_mask(ancestor_slots: list[list[int]], base: int, total: int, dtype: torch.dtype,
                   device=None) -> torch.Tensor:
    """The 4D mask for feeding W tree nodes to a drafter's cache: row j attends to slots 0..base−1
    (the committed sequence), to ``ancestor_slots[j]`` (where its ancestors were fed) and to its own
    new slot ``total + j``.

    Args:
        ancestor_slots: W lists of cache slots in [base, total).
        base: cache slots holding the committed sequence.
        total: cache length before this forward.
        dtype: ``torch.bool`` (True = attend) or a float dtype (additive: 0 / ``finfo.min``).

    Returns:
        (1, 1, W, total + W) of ``dtype``.
    """
    W = len(ancestor_slots)
    mask = torch.zeros(W, total + W, dtype=torch.bool)
    mask[:, :base] = True
    for j, slots in enumerate(ancestor_slots):
        mask[j, slots] = True
        mask[j, total + j] = True
    mask = mask.to(device)[None, None]
    if dtype == torch.bool:
        return mask
    return torch.zeros(mask.shape, dtype=dtype, device=device).masked_fill_(~mask, torch.finfo(dtype).min)


def _check_rows(drafters: Sequence, seqs: Sequence, generators: Sequence | None = None) -> None:
    if len(drafters) != len(seqs) or (generators is not None and len(generators) != len(seqs)):
        n = "" if generators is None else f", {len(generators)} generators"
        raise ValueError(f"One drafter and sequence per row: got {len(drafters)} drafters, {len(seqs)} sequences{n}.")


def pad_caches(caches: Sequence[DynamicCache], lengths: Sequence[int]) -> tuple[DynamicCache | None, int]:
    """The rows' own KV caches gathered into one batch, left-padded to the longest: layer l holds keys/values
    (B, kv_heads, S, head_dim) with row i's ``lengths[i]`` entries in the last ``lengths[i]`` slots (zeros before
    them, to be masked). Rows with an empty cache contribute only padding. The rows' caches are not modified.

    Args:
        caches: one :class:`transformers.DynamicCache` per row, ``lengths[i]`` entries each (its sequence length).
        lengths: the entries of each row (int ≥ 0).

    Returns:
        (the batch cache, or None when every row is empty; S = max(lengths)).
    """
    S = max(lengths) if lengths else 0
    if S == 0:
        return None, 0
    ref = next(c for c, n in zip(caches, lengths) if n > 0)
    data = []
    for idx, layer in enumerate(ref.layers):
        _, heads, _, dim = layer.keys.shape
        keys = layer.keys.new_zeros(len(caches), heads, S, dim)
        values = layer.values.new_zeros(len(caches), heads, S, layer.values.shape[3])
        for i, (c, n) in enumerate(zip(caches, lengths)):
            if n > 0:
                keys[i, :, S - n :] = c.layers[idx].keys[0]
                values[i, :, S - n :] = c.layers[idx].values[0]
        data.append((keys, values))
    return DynamicCache(ddp_cache_data=data), S


def append_new_entries(batch: DynamicCache, caches: Sequence[DynamicCache], past: int, new: Sequence[int]) -> None:
    """Append to each row's own cache the entries a batched forward added after ``past`` padded slots: row i gets
    ``batch``'s slots ``past .. past + new[i] − 1`` (its real tokens; the padding queries' entries are dropped)."""
    for idx, layer in enumerate(batch.layers):
        for i, (c, n) in enumerate(zip(caches, new)):
            if n > 0:
                c.update(layer.keys[i : i + 1, :, past : past + n], layer.values[i : i + 1, :, past : past + n], idx)


def batch_attention_mask(lengths: Sequence[int], past: int, new: Sequence[int], dtype: torch.dtype,
                         device=None) -> torch.Tensor:
    """The 4D mask of a batched drafter forward over :func:`pad_caches`' batch: row i's query j (of T = max(new)
    right-padded new tokens) attends to the row's ``lengths[i]`` cached slots (the last of the ``past``), and to
    its new tokens 0..j; a padding query (j ≥ new[i]) sees itself only (its output is never read).

    Args:
        dtype: ``torch.bool`` (True = attend) or a float dtype (additive: 0 / ``finfo.min``).

    Returns:
        (B, 1, T, past + T) of ``dtype``.
    """
    B, T = len(new), max(new)
    cached = torch.arange(past, device=device)[None] >= (past - torch.tensor(list(lengths), device=device))[:, None]
    real = torch.arange(T, device=device)[None] < torch.tensor(list(new), device=device)[:, None]  # (B, T)
    eye = torch.eye(T, dtype=torch.bool, device=device)[None]
    causal = torch.ones(T, T, dtype=torch.bool, device=device).tril()[None]
    mask = torch.cat([cached[:, None, :].expand(B, T, past) & real[:, :, None],
                      (causal & real[:, None, :] & real[:, :, None]) | eye], dim=2)[:, None]
    if dtype == torch.bool:
        return mask
    return torch.zeros(mask.shape, dtype=dtype, device=device).masked_fill_(~mask, torch.finfo(dtype).min)


def group_by_module(drafters: Sequence, module: str) -> list[list[int]]:
    """Row indices of ``drafters`` grouped by the module they run (their attribute named ``module``, e.g.
    ``"model"``; by identity), in first-seen order: one batched forward per group."""
    groups: dict[int, list[int]] = {}
    for i, d in enumerate(drafters):
        groups.setdefault(id(getattr(d, module)), []).append(i)
    return list(groups.values())


def draw_rows(q: torch.Tensor, raw: torch.Tensor, generators: Sequence[torch.Generator | None]) -> list[DraftProposal]:
    """Draw one token per row of ``q`` and make the rows' proposals: row i's token by inverse CDF with one float64
    uniform from ``generators[i]`` (the draw :func:`~learn2draft.sampling.sample_from` makes for the row alone: the
    same generator stream), its q the row ``q[i]``, its confidence, entropy and margin those of the raw logits
    ``raw[i]`` (:func:`raw_distribution_stats_rows`). The tokens and the statistics cross to the host in one transfer
    each, whatever the number of rows. The drafters' batched draws (:meth:`Drafter.finish_rows`) end here.

    Args:
        q: float32 (B, V), the rows' processed draft distributions (need not be normalised).
        raw: float (B, K), the rows' raw draft logits (K = V, or a head's draft vocabulary).
        generators: B generators (None: the global one).

    Raises:
        ValueError: a row of ``q`` is NaN, infinite, negative or all zero.
    """
    u = torch.cat([torch.rand(1, generator=g, device=q.device, dtype=torch.float64) for g in generators])
    tokens = sample_rows(q, u)
    return [DraftProposal(t, q[i], *st) for i, (t, st) in enumerate(zip(tokens, raw_distribution_stats_rows(raw)))]


def raw_distribution_stats(logits: torch.Tensor) -> tuple[float, float, float]:
    """Max probability, entropy (nats) and top-2 margin (max − second probability) of softmax(``logits``) for
    float (V,) raw logits: :func:`raw_distribution_stats_rows` of one row."""
    return raw_distribution_stats_rows(logits[None])[0]


def raw_distribution_stats_rows(logits: torch.Tensor) -> list[tuple[float, float, float]]:
    """Per row of float (B, V) raw logits (V ≥ 1): the max probability, the entropy (nats) and the top-2 margin (max
    − second probability; the max probability when V = 1) of its softmax, computed in float32. All rows' values cross
    to the host in one transfer. The top-2 margin is the signal vLLM's online acceptance estimator reads (PR
    #52228)."""
    raw = torch.softmax(logits.float(), dim=-1)
    top = raw.topk(min(2, raw.shape[-1]), dim=-1).values
    second = top[:, 1] if top.shape[-1] > 1 else torch.zeros_like(top[:, 0])
    ent = -(raw * torch.log(raw.clamp_min(1e-30))).sum(dim=-1)
    return [(c, e, m) for c, e, m in torch.stack([top[:, 0], ent, top[:, 0] - second], dim=1).tolist()]


__all__ = ["NUM_DRAFTER_FEATURES", "DraftProposal", "Drafter", "TopKProposal", "append_new_entries",
           "draw_rows",
           "batch_attention_mask", "draft_log_probs", "group_by_module", "pad_caches", "raw_distribution_stats",
           "raw_distribution_stats_rows",
           "topk_proposal", "tree_slot_mask"]
