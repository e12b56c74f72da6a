"""Draft trees (EAGLE-2 style): the tree structure, top-V selection, tree attention mask and
positions, and the cache gather after acceptance.

A draft tree is drafted as in EAGLE-2 (Li et al. 2024, arXiv 2406.16858) and Learning to Draft
(arXiv 2603.01639, ``eagle/model/cnets.py::topK_genrate``): at each depth the W best nodes of the
deepest level (by cumulative draft log-probability) are expanded with their top-k children, and
every scored node is kept. Candidates are deterministic (top-k, not sampled), which is what makes
:func:`learn2draft.sampling.tree_speculative_sample` exact whatever the depth and verification-size
policies decide, as long as they read only draft-side information.

Verification sends the top-V nodes by score (ancestors included) to the target in one forward:

* node 0, the *root*, is the last committed token (not yet fed to the target), at sequence slot L
  = the target's cache length; node i is fed at slot L + i;
* :func:`tree_attention_mask`: node i attends to the cached prefix, its ancestors and itself;
* :func:`tree_position_ids`: node i sits at position L + depth(i) (its place in its own path);
* after acceptance, :func:`gather_cache` keeps the prefix, the root and the accepted path's
  entries, in order, so no cache keeps a rejected branch.

Node order convention (relied on by the sampler): a parent precedes its children, and the children
of a node appear in decreasing score, so increasing node index = the order in which the sampler
tries siblings.

The structure and its helpers are pure bookkeeping on small host tensors; :func:`gather_cache`
moves key/value entries on the cache's device. The tree cycle itself — drafting, the size
decision, verification, acceptance, cache gather — is :class:`TreeSpeculativeDecoder` (the one
cycle of :class:`learn2draft.decoding.SpeculativeDecoder` with a tree's shape: its draft step expands
a tree level), with :class:`learn2draft.control.FixedTreeController` for a fixed (depth, V).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from transformers.cache_utils import DynamicLayer

from learn2draft.control import FixedTreeController, decides_verification_size
from learn2draft.decoding import SpeculativeDecoder
from learn2draft.models import ModelPair
from learn2draft.names import DECODER_MAX_DEPTH
from learn2draft.sampling import SamplingConfig, tree_speculative_sample


def _as_long(name: str, t, ndim: int | None = 1) -> torch.Tensor:
    t = torch.as_tensor(t)
    if t.dtype.is_floating_point or t.dtype.is_complex or t.dtype == torch.bool:
        raise ValueError(f"{name} must hold integer ids (int64), got dtype {t.dtype}.")
    if ndim is not None and t.dim() != ndim:
        raise ValueError(f"{name} must be {ndim}-D, got shape {tuple(t.shape)}.")
    return t.long()


def check_parents(parents) -> list[int]:
    """Validate a parent array and return it as a list.

    Args:
        parents: int64 (N+1,) with ``parents[0] = -1`` and ``0 ≤ parents[i] < i`` (parent first).

    Raises:
        ValueError: not a 1-D integer array of that form.
    """
    par = _as_long("parents", parents).tolist()
    if not par or par[0] != -1:
        raise ValueError(f"parents must start with -1 (node 0 is the root), got {par[:3]}.")
    for i in range(1, len(par)):
        if not 0 <= par[i] < i:
            raise ValueError(f"parents[{i}] = {par[i]} must be in [0, {i}): number the nodes so that a parent precedes "
                             "its children (select_top_nodes returns such an order).")
    return par


@dataclass(frozen=True)
class DraftTree:
    """A draft tree; node 0 is the root (the last committed token), nodes 1..N are drafted.

    Attributes:
        parents: int64 (N+1,), ``parents[0] = -1``, ``0 ≤ parents[i] < i``.
        tokens: int64 (N+1,), node i's token id (entry 0: the root's token, or -1 when unknown).
        scores: float64 (N+1,), cumulative draft log-probability of node i's path (root 0; ≤ 0,
            non-increasing along a path).
        depth: int64 (N+1,), node i's distance from the root (root 0).

    Build one with :meth:`root` and :meth:`expand`; all tensors live on the CPU (host bookkeeping).
    Instances are immutable: :meth:`expand` and :meth:`subtree` return new trees.

    Raises (on construction):
        ValueError: the four arrays are not 1-D of one length ≥ 1, or ``parents[0] ≠ -1``.
    """

    parents: torch.Tensor
    tokens: torch.Tensor
    scores: torch.Tensor
    depth: torch.Tensor

    def __post_init__(self):
        n = self.parents.numel()
        if n == 0 or any(t.dim() != 1 or t.numel() != n for t in (self.parents, self.tokens, self.scores, self.depth)):
            raise ValueError("parents, tokens, scores and depth must all have shape (N+1,), N ≥ 0.")
        if int(self.parents[0]) != -1:
            raise ValueError("parents[0] must be -1: node 0 is the root.")

    @classmethod
    def root(cls, token: int = -1) -> DraftTree:
        """A tree with only the root (the last committed token ``token``)."""
        return cls(torch.tensor([-1]), torch.tensor([int(token)]), torch.zeros(1, dtype=torch.float64),
                   torch.zeros(1, dtype=torch.long))

    @property
    def num_nodes(self) -> int:
        """N, the drafted nodes (the root excluded)."""
        return self.parents.numel() - 1

    @property
    def max_depth(self) -> int:
        """The deepest level (0 for the root alone): the number of draft forwards that built the tree."""
        return int(self.depth.max())

    def children(self) -> list[list[int]]:
        """Children lists, ``children()[i]`` in increasing node index."""
        out: list[list[int]] = [[] for _ in range(self.parents.numel())]
        for i, p in enumerate(self.parents.tolist()[1:], start=1):
            out[p].append(i)
        return out

    def path(self, node: int) -> list[int]:
        """Node indices from the root's child down to ``node`` (empty for the root)."""
        par = self.parents.tolist()
        out = []
        while node > 0:
            out.append(node)
            node = par[node]
        return out[::-1]

    def path_tokens(self, node: int) -> list[int]:
        """Token ids along :meth:`path` (what the node's row of target probabilities follows)."""
        toks = self.tokens.tolist()
        return [toks[i] for i in self.path(node)]

    def frontier(self, width: int) -> torch.Tensor:
        """The ``width`` best nodes of the deepest level by score (ties: lower index first): the
        nodes EAGLE-2 expands next. int64 (≤ width,), in decreasing score.

        Raises:
            ValueError: ``width`` < 1.
        """
        if isinstance(width, bool) or not isinstance(width, int) or width < 1:
            raise ValueError(f"width must be an integer ≥ 1, got {width!r}.")
        level = torch.nonzero(self.depth == self.max_depth).reshape(-1)
        order = np.lexsort((level.numpy(), -self.scores[level].numpy()))  # score desc, then index
        return level[torch.as_tensor(order[:width], dtype=torch.long)]

    def expand(self, nodes, child_tokens, child_logprobs) -> DraftTree:
        """Append children: row j of ``child_tokens`` / ``child_logprobs`` are children of ``nodes[j]``.

        Children are appended parent by parent in the given order, each parent's children in
        decreasing log-probability (sorted here, ties by the given order), so siblings follow the
        node order convention. A child's score is its parent's score + its draft log-probability.
        Children with log-probability -inf (draft probability 0) are dropped.

        Args:
            nodes: int64 (W,), existing node indices.
            child_tokens: int64 (W, k).
            child_logprobs: float (W, k), draft log-probabilities (≤ 0, or -inf).

        Returns:
            the new tree (nodes 0..N unchanged, the children at N+1 ...).

        Raises:
            ValueError: shapes disagree, a node index is out of range, a log-probability is NaN or > 0.
        """
        nodes = _as_long("nodes", nodes)
        toks = _as_long("child_tokens", child_tokens, ndim=2).cpu()
        lp = torch.as_tensor(child_logprobs).detach().to("cpu", torch.float64)
        if lp.shape != toks.shape or toks.shape[0] != nodes.numel():
            raise ValueError(f"child_tokens and child_logprobs must have shape (W, k) with W = len(nodes) = "
                             f"{nodes.numel()}, got {tuple(toks.shape)} and {tuple(lp.shape)}.")
        if nodes.numel() and not (0 <= int(nodes.min()) and int(nodes.max()) <= self.num_nodes):
            raise ValueError(f"nodes must be indices in [0, {self.num_nodes}], got {nodes.tolist()}.")
        if bool(torch.isnan(lp).any()) or bool((lp > 1e-6).any()):
            raise ValueError("child_logprobs must be log-probabilities (≤ 0 or -inf), got NaN or a positive value.")
        lp, order = lp.sort(dim=1, descending=True, stable=True)
        toks = toks.gather(1, order)
        keep = lp > -torch.inf
        par = nodes.cpu()[:, None].expand_as(toks)[keep]
        return DraftTree(
            torch.cat([self.parents, par]),
            torch.cat([self.tokens, toks[keep]]),
            torch.cat([self.scores, self.scores[par] + lp.clamp_max(0.0)[keep]]),
            torch.cat([self.depth, self.depth[par] + 1]),
        )

    def subtree(self, nodes) -> DraftTree:
        """The tree restricted to ``nodes`` and renumbered 0..M in their order.

        Args:
            nodes: int64 (M+1,): starts with the root 0, closed under parents, a parent before its
                children (:func:`select_top_nodes` returns such a list).

        Raises:
            ValueError: ``nodes`` is not of that form.
        """
        nodes = _as_long("nodes", nodes)
        idx = nodes.tolist()
        if not idx or idx[0] != 0 or len(set(idx)) != len(idx) or min(idx) < 0 or max(idx) > self.num_nodes:
            raise ValueError("nodes must start with the root 0 and list distinct node indices of this tree.")
        new = {old: j for j, old in enumerate(idx)}
        par = self.parents.tolist()
        new_par = [-1]
        for j, old in enumerate(idx[1:], start=1):
            p = new.get(par[old])
            if p is None or p >= j:
                raise ValueError(f"node {old}'s parent {par[old]} must be listed before it.")
            new_par.append(p)
        return DraftTree(torch.tensor(new_par), self.tokens[nodes], self.scores[nodes], self.depth[nodes])


def select_top_nodes(tree: DraftTree, size: int) -> torch.Tensor:
    """The nodes to verify: the root, the ``size`` best drafted nodes by score (ties: lower index)
    and their ancestors, in the node order convention (by depth, then decreasing score, then index).

    Scores are cumulative log-probabilities, non-increasing along a path, so the ancestors of a
    top-``size`` node are themselves in the top ``size`` and the result has min(size, N) + 1
    nodes; with other scores, missing ancestors are added beyond ``size``.

    Args:
        tree: the drafted tree.
        size: V, the verification size (≥ 0; 0 keeps the root only, ≥ N keeps everything).

    Returns:
        int64 (M+1,) node indices of ``tree``, ``[0, ...]``; pass them to :meth:`DraftTree.subtree`.

    Raises:
        ValueError: ``size`` is not an integer ≥ 0.
    """
    if isinstance(size, bool) or not isinstance(size, (int, np.integer)) or size < 0:
        raise ValueError(f"size must be an integer ≥ 0 (nodes to verify), got {size!r}.")
    n = tree.num_nodes
    scores, depth = tree.scores.numpy(), tree.depth.numpy()
    drafted = np.arange(1, n + 1)
    best = drafted[np.lexsort((drafted, -scores[1:]))][: int(size)]
    chosen = np.zeros(n + 1, dtype=bool)
    chosen[0] = True
    par = tree.parents.numpy()
    for i in best.tolist():
        while not chosen[i]:
            chosen[i] = True
            i = par[i]
    idx = np.flatnonzero(chosen)
    return torch.as_tensor(idx[np.lexsort((idx, -scores[idx], depth[idx]))], dtype=torch.long)


def ancestor_matrix(parents) -> torch.Tensor:
    """bool (N+1, N+1): entry (i, j) is True when node j is node i or one of its ancestors.

    Raises:
        ValueError: ``parents`` is not a parent-first tree (:func:`check_parents`).
    """
    par = check_parents(parents)
    n = len(par)
    anc = np.zeros((n, n), dtype=bool)
    for i in range(n):
        if i:
            anc[i] = anc[par[i]]
        anc[i, i] = True
    return torch.from_numpy(anc)


def tree_attention_mask(parents, prefix_len: int, dtype: torch.dtype = torch.bool,
                        device: torch.device | str | None = None) -> torch.Tensor:
    """The 4D attention mask for verifying a tree after a cached prefix of ``prefix_len`` tokens.

    Query i (node i, at slot L + i) attends to every prefix slot 0..L−1 and to the slots of its
    ancestors and itself. transformers (5.x, ``masking_utils._preprocess_mask_arguments``) passes
    a 4D mask through unchanged: the ``sdpa`` attention takes bool (True = attend) or an additive
    float mask; ``eager`` adds the mask to the scores, so it needs the additive float form; flash
    attention does not take custom masks.

    Args:
        parents: int64 (N+1,), parent-first (:func:`check_parents`).
        prefix_len: L ≥ 0, the tokens already in the target's cache.
        dtype: ``torch.bool`` (True = attend) or a float dtype (0 = attend, ``finfo(dtype).min``
            = masked; pass the model's dtype).
        device: where to build it.

    Returns:
        (1, 1, N+1, L+N+1) of ``dtype``.

    Raises:
        ValueError: bad ``parents``, ``prefix_len`` < 0, or a dtype that is neither bool nor floating.
    """
    if isinstance(prefix_len, bool) or not isinstance(prefix_len, (int, np.integer)) or prefix_len < 0:
        raise ValueError(f"prefix_len must be an integer ≥ 0, got {prefix_len!r}.")
    if dtype != torch.bool and not dtype.is_floating_point:
        raise ValueError(f"dtype must be torch.bool or a floating dtype (additive mask), got {dtype}.")
    anc = ancestor_matrix(parents).to(device)
    n = anc.shape[0]
    mask = torch.cat([torch.ones(n, int(prefix_len), dtype=torch.bool, device=device), anc], dim=1)[None, None]
    if dtype == torch.bool:
        return mask
    out = torch.zeros(mask.shape, dtype=dtype, device=device)
    return out.masked_fill_(~mask, torch.finfo(dtype).min)


def tree_position_ids(depth, prefix_len: int, device: torch.device | str | None = None) -> torch.Tensor:
    """int64 (1, N+1): position L + depth(i) of node i (the root is at L, the slot after the prefix).

    Raises:
        ValueError: ``depth`` not a 1-D integer array, or ``prefix_len`` < 0.
    """
    depth = _as_long("depth", depth)
    if isinstance(prefix_len, bool) or not isinstance(prefix_len, (int, np.integer)) or prefix_len < 0:
        raise ValueError(f"prefix_len must be an integer ≥ 0, got {prefix_len!r}.")
    return (depth.to(device) + int(prefix_len))[None]


def path_cache_indices(accepted, prefix_len: int) -> torch.Tensor:
    """Cache slots to keep after a tree verification: the prefix 0..L−1, the root's slot L and the
    accepted nodes' slots L + i, in order.

    Args:
        accepted: node indices of the accepted path, increasing (as the sampler returns them).
        prefix_len: L, the cache length before the verification forward.

    Returns:
        int64 (L + 1 + τ,).

    Raises:
        ValueError: ``accepted`` not strictly increasing positive node indices, or ``prefix_len`` < 0.
    """
    acc = _as_long("accepted", torch.as_tensor(list(accepted), dtype=torch.long))
    if acc.numel() and (int(acc[0]) < 1 or bool((acc[1:] <= acc[:-1]).any())):
        raise ValueError(f"accepted must be increasing node indices ≥ 1 (a path from the root), got {acc.tolist()}.")
    if isinstance(prefix_len, bool) or not isinstance(prefix_len, (int, np.integer)) or prefix_len < 0:
        raise ValueError(f"prefix_len must be an integer ≥ 0, got {prefix_len!r}.")
    return torch.cat([torch.arange(int(prefix_len) + 1), acc + int(prefix_len)])


def gather_cache(cache, prefix_len: int, accepted) -> int:
    """Keep only the accepted path's key/value entries after a tree verification, in place.

    The cache held ``prefix_len`` (L) entries, then the verified nodes at slots L + i; afterwards it
    holds the prefix, the root (slot L) and the accepted nodes, in order (:func:`path_cache_indices`),
    so it equals the cache of a plain forward over the committed sequence. Entries are moved with one
    indexed copy per layer and tensor (nothing when the accepted nodes are already 1..τ), then cropped.

    Args:
        cache: a transformers ``DynamicCache`` whose layers are full-attention ``DynamicLayer``s
            (``layers[i].keys / .values`` of shape (batch, kv_heads, seq, head_dim)).
        prefix_len: L.
        accepted: increasing node indices (from :func:`learn2draft.sampling.tree_speculative_sample`).

    Returns:
        the new cache length L + 1 + τ.

    Raises:
        ValueError: a layer is not a full-attention DynamicLayer (sliding-window or static caches cannot
            be gathered this way), or the cache is shorter than the slots read.
    """
    keep = path_cache_indices(accepted, prefix_len)
    new_len = keep.numel()
    L, tau = int(prefix_len), len(keep) - int(prefix_len) - 1
    move = tau > 0 and keep[L + 1 :].tolist() != list(range(L + 1, L + 1 + tau))
    with torch.inference_mode():
        for i, layer in enumerate(cache.layers):
            if type(layer) is not DynamicLayer:
                raise ValueError(f"Cache layer {i} is a {type(layer).__name__}: tree verification needs full-attention "
                                 "DynamicLayer caches (a plain DynamicCache of a model without sliding windows).")
            if not layer.is_initialized:
                continue
            S = layer.keys.shape[-2]
            if S < int(keep[-1]) + 1:
                raise ValueError(f"Cache layer {i} holds {S} entries but slot {int(keep[-1])} is kept: "
                                 "wrong prefix_len?")
            if move:
                src = keep[L + 1 :].to(layer.keys.device)
                layer.keys[:, :, L + 1 : new_len] = layer.keys.index_select(2, src)
                layer.values[:, :, L + 1 : new_len] = layer.values.index_select(2, src)
            if S > new_len:
                layer.crop(-(S - new_len))
    return new_len


class TreeSpeculativeDecoder(SpeculativeDecoder):
    """Speculative decoding with a draft *tree* (EAGLE-2 drafting, Learning to Draft's cycle).

    One cycle (:meth:`run_cycle`):

    1. before each depth the controller says CONTINUE or STOP (:meth:`DraftController.decide`
       on :meth:`state`, as for a chain; the confidences are the best frontier node's); each
       :meth:`draft_step` expands the ``width`` best nodes of the deepest level with their top-``top_k``
       children (:meth:`learn2draft.drafters.Drafter.propose_topk`), every scored node kept;
    2. the size decision: a controller that overrides :meth:`DraftController.verification_size`
       gets :meth:`size_features` (:func:`learn2draft.features.size_feature_spec`) and the depth and
       returns V; any other controller leaves V to this decoder's ``verify_size``;
    3. :meth:`verify`: the top-V nodes by score (:func:`select_top_nodes`, ancestors included) and
       the root go through the target in ONE forward with :func:`tree_attention_mask` and
       :func:`tree_position_ids`; :func:`learn2draft.sampling.tree_speculative_sample` accepts a
       path and emits one corrected or bonus token; τ + 1 tokens are committed;
    4. :func:`gather_cache` keeps the accepted path's entries in the target's cache (length =
       committed − 1, as for a chain); the drafter gets the accepted path's target hidden states
       (head) and rolls back to the committed length, forgetting its tree entries.

    Works with the ``model`` and ``head`` drafters (``drafter.supports_tree``). The cycle itself —
    the drafting loop, the size decision, :meth:`step`, :meth:`run_cycle`, the verification tail,
    commit, timing, :meth:`features` and :meth:`size_features` — is the one of
    :class:`~learn2draft.decoding.SpeculativeDecoder`; this class supplies only the tree's shape
    (a level per :meth:`draft_step`, top-V selection and mask, one tree forward, the tree sampler,
    the cache gather).
    :attr:`tree_timings` holds, per cycle, the seconds of the tree's own work (``select_mask``:
    selection, mask and positions; ``sample``: probabilities' processing excluded, the sampler;
    ``gather``: cache gather and drafter rollback) next to ``draft``, ``forward`` and ``cycle``.

    Args:
        pair, sampling, max_new_tokens, max_depth, seed, drafter: as :class:`SpeculativeDecoder`
            (``max_depth``: the most tree levels per cycle).
        width: W, frontier nodes expanded per level (≥ 1).
        top_k: k, children per expanded node (≥ 1).
        verify_size: V when the controller does not decide it; None = every drafted node.
        tree_sampler: the acceptance rule (:func:`tree_speculative_sample` unless a test swaps it).

    Raises:
        ValueError: ``width``, ``top_k`` or ``verify_size`` out of range, a drafter without trees
            (lookup), or a target whose attention cannot take a custom mask (flash attention).
    """

    def __init__(
        self,
        pair: ModelPair,
        sampling: SamplingConfig | None = None,
        max_new_tokens: int = 128,
        max_depth: int = DECODER_MAX_DEPTH,
        seed: int = 0,
        drafter=None,
        width: int = 4,
        top_k: int = 4,
        verify_size: int | None = None,
        tree_sampler=tree_speculative_sample,
    ):
        super().__init__(pair, sampling, max_new_tokens, max_depth, seed, drafter=drafter)
        for name, v in (("width", width), ("top_k", top_k)):
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{name} must be an integer ≥ 1, got {v!r}.")
        if verify_size is not None and (isinstance(verify_size, bool) or not isinstance(verify_size, int)
                                        or verify_size < 0):
            raise ValueError(f"verify_size must be an integer ≥ 0 or None (every node), got {verify_size!r}.")
        if not self.drafter.supports_tree:
            raise ValueError(f"The {self.drafter.name!r} drafter does not draft trees: use the model or head drafter "
                             "(or SpeculativeDecoder for a chain).")
        impl = str(getattr(pair.target.config, "_attn_implementation", "") or "")
        if "flash" in impl:
            raise ValueError(f"The target uses {impl!r} attention, which takes no custom tree mask: load it with "
                             "attn_implementation='sdpa' or 'eager'.")
        self.width, self.top_k, self.verify_size = width, top_k, verify_size
        self.tree_sampler = tree_sampler
        self.tree_timings: list[dict] = []

    # ------------------------------------------------------------------ state
    shape = "tree"

    def _begin_cycle(self) -> None:
        super()._begin_cycle()
        self.tree: DraftTree | None = None

    @property
    def depth(self) -> int:
        """Tree levels drafted this cycle (draft forwards)."""
        return 0 if self.tree is None else self.tree.max_depth

    def _tree_scores(self) -> np.ndarray:
        return self.tree.scores[1:].numpy() if self.tree is not None else np.zeros(0)

    def _record_timing(self, timing: dict[str, float]) -> None:
        super()._record_timing(timing)
        self.tree_timings.append(timing)

    # --------------------------------------------------------------- drafting
    def draft_step(self):
        """Expand one tree level: the ``width`` best deepest nodes get their top-``top_k`` children.

        Returns:
            the :class:`learn2draft.drafters.base.TopKProposal` of this level.

        Raises:
            RuntimeError: not started, finished, the depth limit is reached, or the drafter cannot
                propose (check :meth:`can_draft`).
        """
        self._check_running()
        if self.depth >= self.depth_limit:
            raise RuntimeError(f"Depth limit {self.depth_limit} reached: call verify().")
        if not self.drafter.can_propose(self.ids):
            raise RuntimeError("The drafter has no proposal now: call verify().")
        t0 = self.clock.now()
        if self.tree is None:
            self.tree = DraftTree.root(int(self.ids[-1]))
        nodes = self.tree.frontier(self.width)
        prop = self.drafter.propose_topk(self.ids, self.tree, nodes.tolist(), self.top_k, self.sampling)
        self.tree = self.tree.expand(nodes, prop.tokens, prop.logprobs)
        self.confidences.append(prop.confidence)
        self.entropies.append(prop.entropy)
        self._cycle_draft += self.clock.now() - t0
        return prop

    # ------------------------------------------------------------ verification
    @torch.inference_mode()
    def _tree_forward(self, tokens: torch.Tensor, mask: torch.Tensor | None, pos: torch.Tensor):
        out = self.pair.target(input_ids=tokens[None], attention_mask=mask, position_ids=pos, cache=self.target_cache,
                               use_cache=True, output_hidden_states=self.drafter.needs_target_hidden)
        hidden = out.hidden_states[-1][0] if self.drafter.needs_target_hidden else None
        return out.logits[0, :, : self.pair.vocab_size], hidden

    def _tree_probs(self, logits: torch.Tensor, sub: DraftTree) -> torch.Tensor:
        """float (M+1, V): row i = the target's processed distribution after committed + path(i)."""
        if not self.sampling.prefix_dependent:  # the prefix is not read: one batched call
            dummy = self.ids.new_zeros(max(logits.shape[0] - 1, 0))
            return self.sampling.probs(logits, self.ids, dummy, source="target")
        rows = []
        for i in range(logits.shape[0]):
            path = torch.tensor(sub.path_tokens(i), dtype=torch.long, device=self.ids.device)
            rows.append(self.sampling.probs(logits[i : i + 1], torch.cat([self.ids, path]), source="target"))
        return torch.cat(rows)

    def _prepare_verification(self, verify_size: int | None) -> dict:
        """Select the top-V nodes (ancestors included), build the tree mask and positions.

        Args:
            verify_size: V, drafted nodes sent to the target (≥ 0; None: this decoder's
                ``verify_size``, or every node). Clipped to the nodes drafted.

        Raises:
            ValueError: ``verify_size`` not an integer ≥ 0.
        """
        if verify_size is None:
            verify_size = self.verify_size
        tree = self.tree if self.tree is not None else DraftTree.root(int(self.ids[-1]))
        size = tree.num_nodes if verify_size is None else verify_size
        if isinstance(size, bool) or not isinstance(size, (int, np.integer)) or size < 0:
            raise ValueError(f"verify_size must be an integer ≥ 0 (tree nodes to verify), got {verify_size!r}.")
        dev = self.pair.device
        sub = tree.subtree(select_top_nodes(tree, min(int(size), tree.num_nodes)))
        L = self.target_len
        tokens = sub.tokens.clone()
        tokens[0] = int(self.ids[-1])
        if sub.num_nodes:
            mask = tree_attention_mask(sub.parents, L, dtype=self.pair.target.dtype, device=dev)
            pos = tree_position_ids(sub.depth, L, device=dev)
        else:  # the root alone: a plain one-token forward
            mask, pos = None, None
        return {"sub": sub, "prefix_len": L, "tokens": tokens.to(dev), "mask": mask, "pos": pos}

    def _verification_forward(self, plan: dict) -> torch.Tensor:
        logits, plan["hidden"] = self._tree_forward(plan["tokens"], plan["mask"], plan["pos"])
        return self._tree_probs(logits, plan["sub"])

    def _accept(self, plan: dict, p: torch.Tensor) -> tuple[list[int], int]:
        sub = plan["sub"]
        plan["accepted"], nxt = self.tree_sampler(sub.parents, sub.tokens, p, self.generator)
        toks = sub.tokens.tolist()
        return [toks[a] for a in plan["accepted"]], nxt

    def _rollback(self, plan: dict, committed_before: int, accepted: int) -> None:
        """Gather the accepted path's entries into the target's cache, hand the drafter the path's
        target hidden states (head) and roll it back to the committed length."""
        L, path = plan["prefix_len"], plan["accepted"]
        self.target_len = gather_cache(self.target_cache, L, path)
        hidden = plan["hidden"]
        if hidden is not None:
            keep = torch.tensor([0, *path], dtype=torch.long, device=hidden.device)
            self.drafter.observe_target(hidden.index_select(0, keep), L)
        self.drafter.rollback(committed_before + len(path))

    def _verified_count(self, plan: dict) -> int:
        return plan["sub"].num_nodes


__all__ = [
    "DraftTree", "FixedTreeController", "TreeSpeculativeDecoder", "ancestor_matrix", "check_parents",
    "decides_verification_size", "gather_cache", "path_cache_indices", "select_top_nodes", "tree_attention_mask",
    "tree_position_ids",
]
