"""The target's KV cache for many rows, kept per row by length, and the ragged forward that feeds it.

Ragged verification: in one target forward, row i feeds only its own k_i new tokens (its last committed token and its
γ_i drafted tokens), and the rows' tokens are *packed* into one sequence of N = Σ k_i tokens, not padded to
B × max k_i. Every token-wise layer (embeddings, projections, MLP, norms, the LM head) runs on the N packed tokens;
only attention needs the rows, and it runs per row against the row's own cache. This is the flattened-batch layout of
vLLM's model runner (``query_start_loc``, varlen attention) and of SGLang's ragged prefill, built here from the
Hugging Face model's own modules through ``transformers.AttentionInterface``: an attention function registered under
:data:`ATTENTION_NAME` receives each layer's packed queries, keys and values (after the rotary embedding, from the
per-token ``position_ids``), writes the new keys and values into the rows' caches, and attends.

The cache (:class:`BatchCache`) holds, per layer, keys and values of shape (rows, kv_heads, slots, head_dim) in the
target's dtype. Row r's slots 0 … ``lengths[r]`` − 1 hold the keys of its tokens at positions 0 … ``lengths[r]`` − 1:
slot = position, so rolling back rejected drafts is setting the row's length (no copy), and a token written at a
slot ≥ the length (a rejected draft's) is never attended to: query j of row r attends to slots
0 … ``start_r`` + j only, ``start_r`` being the row's length before the forward. The running rows are always rows
0 … B − 1 (a leaving row's place is taken by another: :meth:`BatchCache.keep_rows`), so a step's attention reads views of the cache, never copies.

Per forward and layer: two ``index_put_`` for the new keys and values, then per group of rows the queries as a
(rows, max k, heads, head_dim) block (a view of the packed queries when every row of the group feeds the same number
of tokens, else one scatter into a zero block and one gather back) and one ``scaled_dot_product_attention`` with a
boolean mask. Grouped-query attention runs on the key/value heads: the ``heads // kv_heads`` query heads that share a
key/value head are stacked as that head's queries (``rep × k`` of them per row), so the cache's keys and values are
read as they are, never repeated per query head. This is ``transformers``' ``pack_gqa`` for one query token (its SDPA
path while decoding), extended to k tokens by repeating the row's mask ``rep`` times: the attention that SDPA's
``enable_gqa`` computes (outputs equal to float rounding), which on the CPU is several times slower
(``docs/results/2026-12-07-packed-gqa-attention.md``).

Rows feeding at most :data:`SHORT_ROW_TOKENS` tokens (verification) form one group; a longer row (a prompt's prefill,
mixed into a step or not) is a group of its own, so the padding of a block stays within rows of like length and never
reaches the token-wise layers that cost the most. A group of one row that starts at slot 0 (a prompt's prefill on an
empty row: a sequence decoded alone, or a request that joins alone) attends causally over its own tokens without a
mask (``is_causal``, the kernel Hugging Face's own prefill runs: with a boolean mask a 4,000-token prefill was
1.4× slower on a 2-core CPU).

One ragged forward at a time per process: a forward routes the model's attention to this module for its duration
(the config's ``_attn_implementation``) and the layers read the forward's plan from this module, so forwards from
several threads (two decoders generating at once, e.g. a server calling ``generate()`` from its request threads) take
turns behind one lock instead of reading each other's plan.

Supported targets: decoder-only Hugging Face models whose attention layers call ``ALL_ATTENTION_FUNCTIONS`` with
their ``layer_idx`` and use full (not sliding-window) causal attention: Llama (the embedded SmolLM2), Qwen2/3,
Mistral without a sliding window, and others of that shape. :func:`check_supported` says which.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from contextlib import contextmanager
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from transformers import AttentionInterface, PreTrainedModel

#: The name of the ragged attention function in ``transformers.AttentionInterface``.
ATTENTION_NAME = "learn2draft_ragged"


#: A row feeding more new tokens than this (a prompt's prefill) gets its own attention call: the query block of a
#: group of rows is padded to its longest row, so a prompt among verification rows would pad every row to its length.
SHORT_ROW_TOKENS = 32


@dataclass
class _Group:
    """Rows of one attention call: ``row0``/``nrows`` (cache rows, contiguous), the packed tokens ``first`` … ``last``
    − 1 that are theirs, each token's row within the group ``token_row`` and index within its row ``token_off``
    (int64 (n,)), the longest row's tokens ``kmax``, the slots read ``slots``, ``mask`` bool
    (nrows, 1, rep × kmax, slots): which slots each (row, query) attends to, repeated for the ``rep`` query heads that
    share a key/value head (query j of head r of a key/value head at ``r × kmax + j``), and ``uniform``: every row feeds
    ``kmax`` tokens (the group's packed queries are its block, row by row)."""

    row0: int
    nrows: int
    first: int
    last: int
    kmax: int
    slots: int
    token_row: torch.Tensor
    token_off: torch.Tensor
    mask: torch.Tensor
    uniform: bool


@dataclass
class _Plan:
    """What every layer's attention needs for one ragged forward (built once per forward, read by each layer):
    ``cache_row`` and ``slot`` int64 (N,), where each packed token's key and value are written (slot = position), and
    the attention groups (:class:`_Group`)."""

    cache: BatchCache
    cache_row: torch.Tensor
    slot: torch.Tensor
    groups: list[_Group]


_ACTIVE: list[_Plan] = []  # the plan of the forward now running (a stack of at most one)
_FORWARD_LOCK = threading.Lock()  # one ragged forward at a time: _ACTIVE and the config's attention are shared


def _ragged_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                      attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                      **kwargs) -> tuple[torch.Tensor, None]:
    """The attention function of a ragged forward (the ``transformers.AttentionInterface`` signature).

    Args:
        module: the attention layer; its ``layer_idx`` picks the cache layer.
        query: float (1, heads, N, head_dim); key, value: float (1, kv_heads, N, head_dim), the N packed tokens after
            the rotary embedding.

    Returns:
        (float (1, N, heads, head_dim), None), as Hugging Face's attention functions return.

    Raises:
        RuntimeError: called outside :meth:`BatchCache.forward` (the model's config was left on this implementation).
    """
    if not _ACTIVE:
        raise RuntimeError(f"The {ATTENTION_NAME!r} attention runs only inside BatchCache.forward.")
    plan = _ACTIVE[-1]
    c = plan.cache
    keys, values = c.keys[module.layer_idx], c.values[module.layer_idx]
    keys[plan.cache_row, :, plan.slot] = key[0].transpose(0, 1)  # (N, kv_heads, head_dim) into each (row, slot)
    values[plan.cache_row, :, plan.slot] = value[0].transpose(0, 1)
    heads, d, kv = query.shape[1], query.shape[3], keys.shape[1]
    qs = query[0].transpose(0, 1)  # (N, heads, head_dim)
    outs = []
    for g in plan.groups:
        r = slice(g.row0, g.row0 + g.nrows)
        if g.nrows == 1 and g.slots == g.kmax:  # a prompt's prefill on an empty row: causal over its own tokens
            out = F.scaled_dot_product_attention(query[:, :, g.first : g.last], keys[r, :, : g.slots],
                                                 values[r, :, : g.slots], is_causal=True, scale=scaling,
                                                 enable_gqa=True)
            outs.append(out[0].transpose(0, 1))  # (k, heads, head_dim)
            continue
        if g.uniform:  # the packed queries are the block already
            q = qs[g.first : g.last].view(g.nrows, g.kmax, heads, d)
        else:
            q = query.new_zeros(g.nrows, g.kmax, heads, d)
            q[g.token_row, g.token_off] = qs[g.first : g.last]
        # head h reads key/value head h // rep: the rep heads of a key/value head become rep × kmax queries of it
        q = q.permute(0, 2, 1, 3).reshape(g.nrows, kv, heads // kv * g.kmax, d)
        out = F.scaled_dot_product_attention(q, keys[r, :, : g.slots], values[r, :, : g.slots], attn_mask=g.mask,
                                             scale=scaling)
        out = out.reshape(g.nrows, heads, g.kmax, d).transpose(1, 2)  # (nrows, kmax, heads, head_dim)
        outs.append(out.reshape(-1, heads, d) if g.uniform else out[g.token_row, g.token_off])
    return (outs[0] if len(outs) == 1 else torch.cat(outs))[None], None  # (1, N, heads, head_dim)


AttentionInterface.register(ATTENTION_NAME, _ragged_attention)


def check_supported(model: PreTrainedModel) -> None:
    """Refuse a target the ragged forward cannot run exactly.

    Raises:
        ValueError: the model is an encoder-decoder, has sliding-window or non-attention layers, or its attention
            layers do not carry a ``layer_idx`` (it does not dispatch through ``transformers.AttentionInterface``).
    """
    cfg = model.config
    name = getattr(cfg, "model_type", type(model).__name__)
    if getattr(cfg, "is_encoder_decoder", False):
        raise ValueError(f"The batched decoder needs a decoder-only target; {name!r} is an encoder-decoder.")
    types = set(getattr(cfg, "layer_types", None) or ["full_attention"])
    window = getattr(cfg, "sliding_window", None) if getattr(cfg, "use_sliding_window", True) else None
    if types != {"full_attention"} or window:
        raise ValueError(f"The batched decoder's ragged attention is full causal attention; target {name!r} has "
                         f"layers {sorted(types)}" + (f" and a sliding window of {window}" if window else "") + ".")
    attn = [m for m in model.modules() if hasattr(m, "layer_idx") and hasattr(m, "num_key_value_groups")]
    if len(attn) != cfg.num_hidden_layers:
        raise ValueError(f"The batched decoder cannot find the {cfg.num_hidden_layers} attention layers of target "
                         f"{name!r} (each with a layer_idx, dispatching through transformers' AttentionInterface).")


def is_supported(model: PreTrainedModel) -> bool:
    """Whether the ragged forward runs ``model`` (:func:`check_supported` raises nothing): where the chain decoder
    keeps its target cache in a :class:`BatchCache` row, and so where a latency profile times one."""
    try:
        check_supported(model)
    except ValueError:
        return False
    return True


class BatchCache:
    """The target's KV cache of B rows, per row by length, and :meth:`forward`, the ragged forward over it.

    Args:
        model: the target (a supported Hugging Face causal LM, :func:`check_supported`).

    Attributes:
        lengths: per row, how many slots hold its tokens (the tokens the target has seen).
        keys, values: per layer, float (row capacity, kv_heads, slot capacity, head_dim) in the model's dtype; rows
            0 … B − 1 are the running rows. Capacities grow by doubling.

    Raises:
        ValueError: an unsupported model (:func:`check_supported`).
    """

    def __init__(self, model: PreTrainedModel):
        check_supported(model)
        cfg = model.config
        self.model = model
        self.kv_heads = cfg.num_key_value_heads
        self.rep = cfg.num_attention_heads // cfg.num_key_value_heads  # query heads per key/value head
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        self.num_layers = cfg.num_hidden_layers
        self.lengths: list[int] = []
        self.keys: list[torch.Tensor] = []
        self.values: list[torch.Tensor] = []
        self._alloc(0, 0)

    @property
    def rows(self) -> int:
        return len(self.lengths)

    @torch.inference_mode()
    def _alloc(self, rows: int, slots: int) -> None:
        """(Re)allocate the per-layer tensors at ``rows`` × ``slots`` capacity, keeping the running rows' slots."""
        dev, dtype = self.model.device, self.model.dtype
        shape = (rows, self.kv_heads, slots, self.head_dim)
        old_k, old_v = self.keys, self.values
        # zeros, not empty: a masked slot must hold a finite number (0 × NaN would reach a softmax)
        self.keys = [torch.zeros(shape, dtype=dtype, device=dev) for _ in range(self.num_layers)]
        self.values = [torch.zeros(shape, dtype=dtype, device=dev) for _ in range(self.num_layers)]
        if old_k and self.rows:
            b, s = self.rows, min(old_k[0].shape[2], slots)
            for new, old in zip(self.keys + self.values, old_k + old_v):
                new[:b, :, :s] = old[:b, :, :s]

    def reserve(self, rows: int, slots: int) -> None:
        """Make room for ``rows`` rows of ``slots`` slots (capacities doubled as needed)."""
        cap_r, cap_s = self.keys[0].shape[0], self.keys[0].shape[2]
        if rows > cap_r or slots > cap_s:
            self._alloc(max(2 * cap_r, rows) if rows > cap_r else cap_r,
                        max(2 * cap_s, slots, 64) if slots > cap_s else cap_s)

    def add_rows(self, n: int) -> range:
        """Open ``n`` empty rows after the running ones; returns their row indices."""
        b = self.rows
        self.reserve(b + n, self.keys[0].shape[2])
        self.lengths.extend([0] * n)
        return range(b, b + n)

    @torch.inference_mode()
    def keep_rows(self, keep: Sequence[int]) -> None:
        """Keep rows ``keep`` (distinct row indices, in any order), moved to rows 0 … len(keep) − 1 in that order;
        only the rows whose index changes are copied (the others stay where they are).

        Raises:
            ValueError: a repeated index, or one that is not a running row's.
        """
        keep = list(keep)
        if len(set(keep)) != len(keep) or any([not 0 <= k < len(self.lengths) for k in keep]):
            raise ValueError(f"keep_rows takes distinct indices of running rows (0 … {len(self.lengths) - 1}), "
                             f"got {keep!r}.")
        moves = [(d, s) for d, s in enumerate(keep) if d != s]
        if moves:
            dev = self.model.device
            dst = torch.tensor([d for d, _ in moves], dtype=torch.long, device=dev)
            src = torch.tensor([s for _, s in moves], dtype=torch.long, device=dev)
            n = max([self.lengths[s] for _, s in moves])
            for t in self.keys + self.values:
                t[dst, :, :n] = t[src, :, :n]  # the right side is gathered first: a source may also be a destination
        self.lengths = [self.lengths[i] for i in keep]

    def set_length(self, row: int, length: int) -> None:
        """Roll row ``row`` back to its first ``length`` slots (the tokens after them are forgotten):
        :meth:`set_lengths` for one row.

        Raises:
            ValueError: ``length`` is beyond what the row holds, or a bad row or length (:meth:`set_lengths`).
        """
        self.set_lengths([row], [length])

    def set_lengths(self, rows: Sequence[int], lengths: Sequence[int]) -> None:
        """Roll rows ``rows`` back to their first ``lengths`` slots (row ``rows[i]`` to ``lengths[i]``; the tokens
        after them are forgotten).

        Raises:
            ValueError: not one length per row, a row that is not an index of a running row (0 ≤ row < rows), a
                length that is not an integer, or beyond what its row holds; no row is changed then.
        """
        held = self.lengths
        rows, lengths = list(rows), list(lengths)
        if len(rows) != len(lengths):
            raise ValueError(f"set_lengths needs one length per row ({len(rows)} rows, {len(lengths)} lengths).")
        for r, n in zip(rows, lengths):
            if isinstance(r, bool) or not isinstance(r, (int, np.integer)) or not 0 <= r < len(held):
                raise ValueError(f"No row {r!r}: the cache holds rows 0 … {len(held) - 1}.")
            if isinstance(n, bool) or not isinstance(n, (int, np.integer)) or not 0 <= n <= held[r]:
                raise ValueError(f"Row {r} holds {held[r]} slots; cannot set its length to {n!r}.")
        for r, n in zip(rows, lengths):
            held[r] = int(n)

    @contextmanager
    def _ragged(self):
        """The model's attention dispatched to :data:`ATTENTION_NAME` for the duration of one forward."""
        cfg = self.model.config
        before = cfg._attn_implementation
        cfg._attn_implementation = ATTENTION_NAME
        try:
            yield
        finally:
            cfg._attn_implementation = before

    @torch.inference_mode()
    def forward(self, row0: int, tokens: Sequence[torch.Tensor], keep: torch.Tensor | None = None,
                output_hidden: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Feed row ``row0 + i`` its new tokens ``tokens[i]`` (int64 (k_i,), k_i ≥ 1) after its cached slots, all rows
        in one packed target forward; each row's length grows by k_i.

        Args:
            row0: the first row fed; the rows fed are ``row0 … row0 + len(tokens) − 1``.
            keep: int64 (n,) indices into the N = Σ k_i packed tokens whose logits are computed (None: all of them).
            output_hidden: also return the last hidden states (a drafter reads them).

        Returns:
            logits float (n or N, V) of the packed tokens (row 0's first, in order), and hidden float (N, H) or None.

        Raises:
            ValueError: a row fed no token.
        """
        counts = [int(t.numel()) for t in tokens]
        if min(counts, default=0) < 1:
            raise ValueError("Every row of a ragged forward feeds at least one token.")
        dev = self.model.device
        b = len(tokens)
        starts = self.lengths[row0 : row0 + b]
        self.reserve(self.rows, max([s + k for s, k in zip(starts, counts)]))
        # the index tensors built on the host and sent in one copy (no device sync for a data-dependent size)
        counts_a, starts_a = np.asarray(counts), np.asarray(starts)
        token_row = np.repeat(np.arange(b), counts_a)
        first_tok = np.cumsum(counts_a) - counts_a
        token_off = np.arange(token_row.size) - first_tok[token_row]
        slot = starts_a[token_row] + token_off
        # groups of contiguous rows: the short ones (verification) together, each long one (a prefill) alone
        bounds, i = [], 0
        while i < b:
            j = i + 1
            if counts[i] <= SHORT_ROW_TOKENS:
                while j < b and counts[j] <= SHORT_ROW_TOKENS:
                    j += 1
            bounds.append((i, j))
            i = j
        n = token_row.size
        host = [row0 + token_row, slot]
        for i, j in bounds:
            lo, hi = int(first_tok[i]), int(first_tok[j - 1] + counts[j - 1])
            host += [token_row[lo:hi] - i, token_off[lo:hi], starts_a[i:j], counts_a[i:j]]
        idx = torch.from_numpy(np.concatenate(host).astype(np.int64)).to(dev, non_blocking=True)
        cache_row, slot_t, at = idx[:n], idx[n : 2 * n], 2 * n
        groups = []
        for i, j in bounds:
            lo, hi = int(first_tok[i]), int(first_tok[j - 1] + counts[j - 1])
            m, nr = hi - lo, j - i
            g_row, g_off = idx[at : at + m], idx[at + m : at + 2 * m]
            s_t, k_t = idx[at + 2 * m : at + 2 * m + nr], idx[at + 2 * m + nr : at + 2 * m + 2 * nr]
            at += 2 * m + 2 * nr
            kmax_g = max(counts[i:j])
            slots_g = max([starts[r] + counts[r] for r in range(i, j)])
            # query q of a row attends to slots ≤ start + q; a padding query (q ≥ k) to those of the row's last token
            last = s_t[:, None] + torch.minimum(torch.arange(kmax_g, device=dev)[None], (k_t - 1)[:, None])
            mask = torch.arange(slots_g, device=dev)[None, None] <= last[:, :, None]  # (nr, kmax, slots)
            mask = mask[:, None, None].expand(nr, 1, self.rep, kmax_g, slots_g).reshape(nr, 1, -1, slots_g)
            groups.append(_Group(row0 + i, nr, lo, hi, kmax_g, slots_g, g_row, g_off, mask,
                                 min(counts[i:j]) == kmax_g))
        plan = _Plan(self, cache_row, slot_t, groups)
        ids = torch.cat([t.to(dev) for t in tokens])[None]
        with _FORWARD_LOCK:  # another thread's forward would read this plan, or restore the config under this one
            _ACTIVE.append(plan)
            try:
                with self._ragged():
                    out = self.model(input_ids=ids, position_ids=slot_t[None], use_cache=False,
                                     output_hidden_states=output_hidden, logits_to_keep=0 if keep is None else keep)
            finally:
                _ACTIVE.pop()
        for i, k in enumerate(counts):
            self.lengths[row0 + i] += k
        return out.logits[0], (out.hidden_states[-1][0] if output_hidden else None)


__all__ = ["ATTENTION_NAME", "BatchCache", "check_supported", "is_supported"]
