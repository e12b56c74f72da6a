"""Model-free prompt lookup: propose the token that followed the latest earlier occurrence of
the sequence's last n tokens (Saxena 2023, "Prompt Lookup Decoding"; Hugging Face
``prompt_lookup_num_tokens``; vLLM's n-gram proposer). SuffixDecoding (Oliaro et al. 2024,
arXiv 2411.04975) sets its draft length from the match length and frequency: those two numbers
are this drafter's features, so a policy can learn the same.

Proposals are deterministic (no q: a point mass), so the exact sampler accepts token x with
probability p(x) and otherwise draws from p with x removed.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
from numpy.lib.stride_tricks import sliding_window_view

from learn2draft.drafters.base import NUM_DRAFTER_FEATURES, Drafter, DraftProposal

#: The fewest rows :meth:`LookupDrafter.lookahead_rows` searches together (:func:`find_rows`); fewer are searched
#: row by row, whose cost is below the array search's fixed cost (``eval/scripts/lookup_rows_bench.py``).
MIN_ROWS_SEARCHED_TOGETHER = 4
MATCH_LEN_SCALE = 16  # feature match_len = min(match length, 16) / 16
MATCH_COUNT_SCALE = 8  # feature match_count = min(occurrences, 8) / 8
DEFAULT_MAX_NGRAM = 4  # the longest n-gram tried (Hugging Face prompt lookup: max_matching_ngram_size, default 2)
DEFAULT_MIN_NGRAM = 2  # the shortest (see LookupDrafter; HF prompt lookup goes down to 1); --lookup-min-ngram sets it


class LookupDrafter(Drafter):
    """N-gram prompt lookup over the prompt and everything generated (and drafted) so far.

    For n from ``max_ngram`` down to ``min_ngram``: find the earlier occurrences of the last n
    tokens; if any, propose the token that followed the latest one. The match is then extended
    backwards to its full length (capped at 16) — the ``match_len`` feature — and the number of
    occurrences of the n-gram is ``match_count``; the share of occurrences followed by the
    proposed token is the proposal's confidence, and the share of the most frequent continuation
    minus the second's (0 for a second that never occurs) its top-2 margin. Without a match there is no proposal
    (:meth:`can_propose` is False) and the decoder verifies what it has.

    Cost: one vectorised comparison over the sequence per n (tens of µs at 1k tokens on a CPU). It searches host
    memory: the decoder's token buffer (or its host mirror on a GPU) when the decoder attaches it
    (:meth:`attach_tokens`), else its own copy of the tokens, extended from what the decoder tells it
    (:meth:`observe_tokens`). Attached, it never reads the device; with its copy, only where the copy falls short of
    the sequence it is given (the decoders tell it every token they write, so on a GPU they cause no read).

    Args:
        max_ngram, min_ngram: n-gram sizes tried, longest first (1 ≤ min_ngram ≤ max_ngram). The
            default ``min_ngram=2`` leaves out single-token matches: along the embedded target's own
            greedy answers they were right 19–23% of the time (against 41–61% for two tokens and
            58–96% for three or more), too little to pay for their verification on a CPU.

    Raises:
        ValueError: bad n-gram sizes.
    """

    name = "lookup"
    deterministic = True

    def __init__(self, max_ngram: int = DEFAULT_MAX_NGRAM, min_ngram: int = DEFAULT_MIN_NGRAM):
        if not (isinstance(max_ngram, int) and isinstance(min_ngram, int) and 1 <= min_ngram <= max_ngram):
            raise ValueError(f"Need integers 1 ≤ min_ngram ≤ max_ngram, got min_ngram={min_ngram}, max_ngram={max_ngram}.")
        self.max_ngram, self.min_ngram = max_ngram, min_ngram
        self._host = np.zeros(0, dtype=np.int64)  # the host copy of the tokens: its first _size entries
        self._size = 0
        # the decoder's host tokens (attach_tokens), read instead of the copy; _size counts the tokens known either way
        self._view: np.ndarray | None = None
        self._match: tuple[int, tuple[int, int, int, float, float] | None] | None = None  # (length, match) cache
        self._ahead: tuple[int, np.ndarray, list] | None = None  # the last lookahead: (length, its tokens, its matches)

    def start(self, prompt_ids: torch.Tensor) -> None:
        """Start on ``prompt_ids`` (int64 (L,)) with a copy of its own (a decoder attaches its tokens after this)."""
        self._size, self._view = 0, None
        self._write(prompt_ids.reshape(-1).tolist(), 0)
        self._match = self._ahead = None

    def attach_tokens(self, tokens: np.ndarray) -> None:
        """Search ``tokens`` (int64 (L,), host memory the decoder keeps current: its first n entries are the sequence
        of n tokens passed next) instead of a copy (:meth:`Drafter.attach_tokens`); :meth:`start` detaches it.

        The tokens known so far (the prompt, and what was observed since) must stand at the array's start; a cached
        match or chain is dropped.

        Raises:
            ValueError: not a one-dimensional int64 numpy array, or shorter than the tokens known.
        """
        if not (isinstance(tokens, np.ndarray) and tokens.ndim == 1 and tokens.dtype == np.int64):
            raise ValueError(f"attach_tokens needs a one-dimensional int64 numpy array, got {type(tokens).__name__} "
                             f"{getattr(tokens, 'dtype', '')} {getattr(tokens, 'shape', '')}.")
        if tokens.size < self._size:
            raise ValueError(f"attach_tokens: the array holds {tokens.size} tokens, fewer than the {self._size} known.")
        self._view, self._host = tokens, np.zeros(0, dtype=np.int64)  # the copy is not kept while attached
        self._match = self._ahead = None

    def _write(self, tokens: list[int], at: int) -> None:
        """Put ``tokens`` at position ``at`` (≤ the copy's length) of the host copy, which then ends after them: the
        buffer doubles when full, so extending it by k tokens costs O(k), not a copy of the sequence."""
        end = at + len(tokens)
        if end > self._host.size:
            grown = np.empty(max(2 * self._host.size, end, 64), dtype=np.int64)
            grown[:at] = self._host[:at]
            self._host = grown
        self._host[at:end] = tokens
        self._size = end

    def _sync(self, seq: torch.Tensor) -> np.ndarray:
        """The host tokens of ``seq`` (int64 (n,)): the first n of the attached tokens, else of the copy; where the
        tokens known (written by the decoder: ``_size``) are fewer, the rest is read from ``seq`` (a device read),
        into the copy (none for attached tokens: a copy of them)."""
        n = seq.numel()
        if self._view is not None:
            if self._size >= n:
                return self._view[:n]
            return np.concatenate((self._view[: self._size], seq[self._size :].cpu().numpy().astype(np.int64)))
        if self._size < n:
            self._write(seq[self._size :].tolist(), self._size)
        return self._host[:n]

    def observe_tokens(self, tokens: list[int], first_position: int) -> None:
        """The decoder wrote ``tokens`` at ``first_position``: a cached match or lookahead that read a position from
        there on is dropped, and the host copy (none when tokens are attached) is extended with them when it reaches
        that position; a copy that is shorter is left to :meth:`_sync` (it reads the device).

        Raises:
            ValueError: ``first_position`` is not an integer ≥ 0.
        """
        if isinstance(first_position, bool) or not isinstance(first_position, (int, np.integer)) or first_position < 0:
            raise ValueError(f"observe_tokens: first_position must be an integer ≥ 0, got {first_position!r}.")
        LookupDrafter._observe([self], [tokens], [first_position])

    @classmethod
    def observe_rows(cls, drafters: Sequence[LookupDrafter], tokens: Sequence[list[int]],
                     first_positions: Sequence[int]) -> None:
        """:meth:`observe_tokens` for many rows in one call (:meth:`Drafter.observe_rows`; unchecked): with attached
        tokens a row's bookkeeping is dropping its caches, no copy. A subclass that overrides :meth:`observe_tokens`
        has it called per row."""
        if cls.observe_tokens is not LookupDrafter.observe_tokens:
            super().observe_rows(drafters, tokens, first_positions)
        else:
            LookupDrafter._observe(drafters, tokens, first_positions)

    @staticmethod
    def _observe(drafters: Sequence[LookupDrafter], tokens: Sequence[list[int]], first_positions: Sequence[int]) -> None:
        """The one implementation of :meth:`observe_tokens` over rows (unchecked)."""
        for d, toks, f in zip(drafters, tokens, first_positions):
            if not toks:
                continue
            if d._match is not None and f < d._match[0]:  # the match read a rewritten position
                d._match = None
            if d._ahead is not None and f < d._ahead[0]:  # the lookahead's own sequence changed
                d._ahead = None
            if f > d._size:  # beyond the tokens known: left to _sync
                continue
            if d._view is None:
                d._write(toks, f)
            else:
                d._size = f + len(toks)

    def lookup(self, seq: torch.Tensor) -> tuple[int, int, int, float, float] | None:
        """The match for the token after ``seq`` (int64 (n,)): ``(token, match_len, count, confidence, margin)``
        or None when no n-gram of the allowed sizes occurs earlier. ``confidence``: share of the n-gram's
        occurrences followed by ``token``; ``margin``: share of the most frequent continuation minus the
        second most frequent's (the second's share is 0 when every occurrence continues alike)."""
        n = seq.numel()
        if self._match is not None and self._match[0] == n:
            return self._match[1]
        t = self._sync(seq)
        ahead = self._ahead_match(t)
        found = self._find(t) if ahead is None else ahead[0]
        self._match = (n, found)
        return found

    def _ahead_match(self, t: np.ndarray):
        """``(match,)`` (the match may be None) for the token after ``t`` when the last :meth:`lookahead` computed it:
        ``t`` is its sequence extended by a prefix of its proposed tokens (the drafter's tokens before the
        lookahead's start are unchanged since: :meth:`rollback` below it, or :meth:`observe_tokens` rewriting a
        position below it, drops the cache), so the match is the same computation; else None."""
        if self._ahead is None:
            return None
        n0, toks, matches = self._ahead
        i = t.size - n0
        if not 0 <= i < len(matches) or not np.array_equal(t[n0:], toks[:i]):
            return None
        return (matches[i],)

    def _find(self, t: np.ndarray) -> tuple[int, int, int, float, float] | None:
        """The match for the token after ``t`` (int64 (n,)): as :meth:`lookup`, without its cache."""
        n, found = t.size, None
        for k in range(min(self.max_ngram, n - 1), self.min_ngram - 1, -1):
            windows = sliding_window_view(t[: n - 1], k)  # window i = t[i:i+k], followed by t[i+k] (i + k ≤ n − 1)
            hits = np.flatnonzero((windows == t[n - k :]).all(axis=1))
            if hits.size == 0:
                continue
            last = int(hits[-1])
            token = int(t[last + k])
            nexts = t[hits + k]
            conf = float((nexts == token).mean())
            counts = np.sort(np.unique(nexts, return_counts=True)[1])[::-1]
            margin = float((counts[0] - (counts[1] if counts.size > 1 else 0)) / nexts.size)
            length = k  # extend the latest match backwards
            while length < MATCH_LEN_SCALE and last - (length - k) - 1 >= 0 \
                    and t[last - (length - k) - 1] == t[n - length - 1]:
                length += 1
            found = (token, length, int(hits.size), conf, margin)
            break
        return found

    def lookahead(self, seq: torch.Tensor, k: int) -> tuple[list[int], list[float]]:
        """The chain this drafter would propose after ``seq`` (int64 (n,)) if every token were accepted, up to ``k``
        tokens: (tokens, confidences). Deterministic; the drafter proposes the same afterwards (its matches are kept,
        so that drafting along the chain does not search again): :meth:`lookahead_rows` for this one row (a ``k``
        below 0 reads as 0)."""
        return LookupDrafter.lookahead_rows([self], [seq], [max(int(k), 0)])[0]

    @staticmethod
    def lookahead_rows(drafters: Sequence[LookupDrafter], seqs: Sequence[torch.Tensor],
                       limits: Sequence[int]) -> list[tuple[list[int], list[float]]]:
        """:meth:`lookahead` for many rows at once: row i's chain after ``seqs[i]`` (int64 (n_i,)) up to
        ``limits[i]`` tokens, found by one array computation over all rows per chain position
        (:func:`find_rows`) instead of one search per row — the same tokens, confidences and matches as each
        drafter's own :meth:`lookahead` (each drafter keeps its chain's matches, so its drafting along the chain
        does not search again). Once fewer than :data:`MIN_ROWS_SEARCHED_TOGETHER` rows are still extending their
        chains, those search row by row. The drafters may have different n-gram sizes.

        Args:
            drafters: one prompt lookup per row (distinct objects: each keeps its own row's state), each started on
                its row (:meth:`start`: as for :meth:`lookahead`, a drafter reads its own tokens, its copy or its
                attached tokens, so ``seqs[i]`` must continue what drafter i was started on and has observed).
            seqs: the rows' sequences (committed + drafted so far), int64 (n_i,).
            limits: the most tokens per row (integers ≥ 0).

        Returns:
            per row, (tokens, confidences) as :meth:`lookahead` returns them.

        Raises:
            ValueError: mismatched lengths, a drafter given for two rows, or a limit that is not an integer ≥ 0.
        """
        b = len(drafters)
        if len(seqs) != b or len(limits) != b:
            raise ValueError(f"lookahead_rows needs one sequence and one limit per drafter ({b} drafters, "
                             f"{len(seqs)} sequences, {len(limits)} limits).")
        hosts = [d._sync(s) for d, s in zip(drafters, seqs)]
        lens = [h.size for h in hosts]
        tokens = np.zeros((b, max(lens, default=0)), dtype=np.int64)
        for i, h in enumerate(hosts):
            tokens[i, : h.size] = h
        return LookupDrafter.lookahead_store(drafters, tokens, range(b), lens, limits)

    @staticmethod
    def lookahead_store(drafters: Sequence[LookupDrafter], tokens: np.ndarray, store_rows: Sequence[int],
                        lengths: Sequence[int], limits: Sequence[int]) -> list[tuple[list[int], list[float]]]:
        """:meth:`lookahead_rows` for rows whose sequences are rows of one host token array (a batch's token store:
        :meth:`learn2draft.decoding.SpeculativeDecoder.host_tokens`): row i's sequence is
        ``tokens[store_rows[i], :lengths[i]]``, gathered for all rows by one indexing, with no per-row copy or read of
        the drafters' own tokens. The same chains, confidences and kept matches as :meth:`lookahead_rows` on those
        sequences. Each drafter keeps its chain for the sequence it proposes after next (:meth:`lookup`,
        :meth:`chain`), so row i's tokens must be drafter i's own sequence (what it was started on and observed, or
        its attached tokens); another sequence leaves it proposing that one's chain (proposals only: never the law).

        Args:
            drafters: one prompt lookup per row (distinct), as for :meth:`lookahead_rows`.
            tokens: int64 (R, L) host token ids.
            store_rows: each row's row of ``tokens`` (integers in 0..R − 1); lengths: each row's length (integers in
                0..L); limits: the most tokens per row (integers ≥ 0).

        Raises:
            ValueError: ``tokens`` not a two-dimensional int64 numpy array, mismatched lengths, a drafter given for two
                rows, or a store row, length or limit that is not an integer in its range.
        """
        b = len(drafters)
        if not (isinstance(tokens, np.ndarray) and tokens.ndim == 2 and tokens.dtype == np.int64):
            raise ValueError(f"lookahead_store needs tokens as a two-dimensional int64 numpy array, got "
                             f"{type(tokens).__name__} {getattr(tokens, 'dtype', '')} {getattr(tokens, 'shape', '')}.")
        if not len(store_rows) == len(lengths) == len(limits) == b:
            raise ValueError(f"lookahead_store needs one store row, length and limit per drafter ({b} drafters, "
                             f"{len(store_rows)} store rows, {len(lengths)} lengths, {len(limits)} limits).")
        if len({id(d) for d in drafters}) != b:
            raise ValueError("lookahead: a drafter is given for two rows; each row needs its own (spawn() one).")
        held, width = tokens.shape
        for name, values, hi in (("limits", limits, None), ("lengths", lengths, width), ("store rows", store_rows, held - 1)):
            if not all([isinstance(v, (int, np.integer)) and not isinstance(v, bool) and 0 <= v and (hi is None or v <= hi)
                        for v in values]):
                span = "≥ 0" if hi is None else f"in 0..{hi}"
                raise ValueError(f"lookahead: {name} must be integers {span}, got {list(values)!r}.")
        lens = np.asarray(lengths, dtype=np.int64).reshape(b)
        where = np.asarray(store_rows, dtype=np.int64).reshape(b)
        ks = np.asarray(limits, dtype=np.int64).reshape(b)
        kmax = int(ks.max()) if b else 0
        t = np.full((b, (int(lens.max()) if b else 0) + kmax), -1, dtype=np.int64)  # -1 pads: never a token
        if b:
            w = min(t.shape[1], width)
            t[:, :w] = tokens[where, :w]
            t[np.arange(t.shape[1])[None, :] >= lens[:, None]] = -1  # past each row's length
        return LookupDrafter._chains(drafters, t, lens, ks)

    @staticmethod
    def _chains(drafters: Sequence[LookupDrafter], t: np.ndarray, lens: np.ndarray,
                ks: np.ndarray) -> list[tuple[list[int], list[float]]]:
        """The chains of :meth:`lookahead_rows` from the rows' tokens ``t`` (int64 (B, ≥ max(lens) + max(ks)), −1
        past each row's length; extended in place along the chains), lengths ``lens`` and limits ``ks`` (int64
        (B,)); each drafter keeps its chain's matches."""
        b = len(drafters)
        out: list[tuple[list[int], list[float]]] = [([], []) for _ in range(b)]
        matches: list[list] = [[] for _ in range(b)]
        kmax = int(ks.max()) if b else 0
        if kmax > 0:
            sizes = np.asarray([[d.max_ngram, d.min_ngram] for d in drafters], dtype=np.int64)
            active = ks > 0
            cur = lens.copy()
            for _ in range(kmax):
                idx = np.flatnonzero(active)
                if idx.size == 0:
                    break
                if idx.size >= MIN_ROWS_SEARCHED_TOGETHER:
                    found = find_rows(t[idx], cur[idx], sizes[idx, 0], sizes[idx, 1])
                else:  # a few rows left: each alone costs less than the array search's fixed cost
                    found = [drafters[i]._find(t[i, : cur[i]]) for i in idx]
                for j, i in enumerate(idx):
                    m = found[j]
                    matches[i].append(m)
                    if m is None:
                        active[i] = False
                        continue
                    t[i, cur[i]] = m[0]
                    out[i][0].append(m[0])
                    out[i][1].append(m[3])
                    cur[i] += 1
                    active[i] = len(out[i][0]) < ks[i]
        for d, n, (toks, _), m in zip(drafters, lens.tolist(), out, matches):
            d._ahead = (n, np.asarray(toks, dtype=np.int64), m)
        return out

    def chain(self, n: int, k: int) -> list[DraftProposal] | None:
        """The first ``k`` proposals (fewer where no n-gram matches) along the chain of the last :meth:`lookahead`
        (or :meth:`lookahead_rows`, :meth:`lookahead_store`), made after a sequence of ``n`` tokens: what
        :meth:`propose` returns along it, token after token. None when that lookahead was made after another length,
        or stopped at a limit below ``k`` (it does not know what follows).

        Raises:
            ValueError: ``k`` is not an integer ≥ 0.
        """
        if isinstance(k, bool) or not isinstance(k, (int, np.integer)) or k < 0:
            raise ValueError(f"chain: k must be an integer ≥ 0, got {k!r}.")
        return self.chain_rows([self], [n], [k])[0]

    @classmethod
    def chain_rows(cls, drafters: Sequence[LookupDrafter], lengths: Sequence[int],
                   ks: Sequence[int]) -> list[list[DraftProposal] | None]:
        """:meth:`chain` for many rows in one call: row i's first ``ks[i]`` proposals along its kept chain, made after
        ``lengths[i]`` tokens (unchecked: integers ≥ 0, one per drafter; a batch's step records them at once)."""
        out: list[list[DraftProposal] | None] = []
        for d, n, k in zip(drafters, lengths, ks):
            ahead = d._ahead
            if ahead is None or ahead[0] != n:
                out.append(None)
                continue
            matches, props = ahead[2], []
            for m in matches[:k]:
                if m is not None:
                    props.append(_proposal(m))
            out.append(None if len(props) < k and not (matches and matches[-1] is None) else props)
        return out

    def can_propose(self, seq: torch.Tensor) -> bool:
        return self.lookup(seq) is not None

    def propose(self, seq, sampling, generator) -> DraftProposal:
        m = self.lookup(seq)
        if m is None:
            raise RuntimeError("No n-gram match: nothing to propose (check can_propose() first).")
        return _proposal(m)

    def rollback(self, length: int) -> None:
        LookupDrafter._rollback([self], [length])

    @classmethod
    def rollback_rows(cls, drafters: Sequence[LookupDrafter], lengths: Sequence[int]) -> None:
        """:meth:`rollback` for many rows in one call (:meth:`Drafter.rollback_rows`; unchecked). A subclass that
        overrides :meth:`rollback` has it called per row."""
        if cls.rollback is not LookupDrafter.rollback:
            super().rollback_rows(drafters, lengths)
        else:
            LookupDrafter._rollback(drafters, lengths)

    @staticmethod
    def _rollback(drafters: Sequence[LookupDrafter], lengths: Sequence[int]) -> None:
        """The one implementation of :meth:`rollback` over rows (unchecked)."""
        for d, n in zip(drafters, lengths):
            if d._size > n:
                d._size = max(int(n), 0)
            d._match = None
            if d._ahead is not None and n < d._ahead[0]:
                d._ahead = None

    def features(self, seq: torch.Tensor) -> np.ndarray:
        m = self.lookup(seq)
        out = np.zeros(NUM_DRAFTER_FEATURES, dtype=np.float32)
        if m is not None:
            out[0] = min(m[1], MATCH_LEN_SCALE) / MATCH_LEN_SCALE
            out[1] = min(m[2], MATCH_COUNT_SCALE) / MATCH_COUNT_SCALE
        return out

    def spawn(self) -> LookupDrafter:
        """A new prompt lookup with the same n-gram sizes, started on nothing."""
        return LookupDrafter(self.max_ngram, self.min_ngram)

    def extra_config(self) -> dict:
        return {"drafter": self.name, "max_ngram": self.max_ngram, "min_ngram": self.min_ngram}


def _proposal(m: tuple[int, int, int, float, float]) -> DraftProposal:
    """A match ``(token, match_len, count, confidence, margin)`` as a proposal: a point mass (no q), no entropy."""
    return DraftProposal(m[0], None, m[3], 0.0, m[4])


def find_rows(t: np.ndarray, lens: np.ndarray, max_ngram: np.ndarray,
              min_ngram: np.ndarray) -> list[tuple[int, int, int, float, float] | None]:
    """:meth:`LookupDrafter._find` for many rows in one array computation: row i's match for the token after
    ``t[i, :lens[i]]``, the same ``(token, match_len, count, confidence, margin)`` (or None) as the search of that
    row alone.

    For every position e of a row, the length of the common suffix of ``t[:e+1]`` and the row's sequence (up to the
    largest n-gram size; one shifted comparison per size): the window of n tokens ending at e matches the last n
    tokens when it is ≥ n. The row's n is the largest of its sizes with a match (a match of n is also one of every
    smaller n, so that is its longest common suffix, capped), the latest match gives the token, the matches' next
    tokens give the share followed by it (confidence) and the top-2 margin (their counts, from the next tokens
    sorted), and the latest match's common suffix, read further back up to ``MATCH_LEN_SCALE``, its length.

    Args:
        t: int64 (B, L) the rows' tokens, padded past ``lens`` with −1 (never a token id).
        lens: int64 (B,) each row's length (1 ≤ lens[i] ≤ L).
        max_ngram, min_ngram: int64 (B,) each row's n-gram sizes (1 ≤ min_ngram ≤ max_ngram).

    Returns:
        per row, its match or None.

    The arrays are not checked (the one caller builds them: ``LookupDrafter._chains``); other shapes or values
    give numpy's errors or wrong matches.
    """
    b, width = t.shape
    out: list = [None] * b
    if b == 0 or width < 2:
        return out
    nmax = int(max_ngram.max())
    r = np.arange(b)
    # e: the last position of a window, followed by a token inside the row (e ≤ len − 2)
    e = np.arange(width - 1)
    inside = e[None, :] <= (lens - 2)[:, None]
    tail = np.take_along_axis(t, np.maximum(lens[:, None] - 1 - np.arange(nmax), 0), axis=1)  # (B, nmax) last tokens
    run = np.zeros((b, width - 1), dtype=np.int64)  # common suffix length, up to nmax
    same = inside.copy()
    for j in range(min(nmax, width - 1)):  # position e compares t[e − j] with the row's j-th last token
        same[:, :j] = False
        same[:, j:] &= t[:, : width - 1 - j] == tail[:, j : j + 1]
        run += same
    n = np.minimum(np.minimum(run.max(axis=1), max_ngram), lens - 1)  # the longest size with a match
    ok = n >= min_ngram
    if not ok.any():
        return out
    sel = r[ok]
    t, lens, run, n = t[sel], lens[sel], run[sel], n[sel]
    rs = np.arange(sel.size)
    hits = run >= n[:, None]
    count = hits.sum(axis=1)
    last = width - 2 - np.argmax(hits[:, ::-1], axis=1)  # the latest window's last position
    nexts = t[:, 1:]
    token = nexts[rs, last]
    conf = (hits & (nexts == token[:, None])).sum(axis=1) / count
    # top-2 counts of the matches' next tokens: each row's next tokens at its matches, sorted, counted by runs of
    # equal tokens (O(h log h) a row, h the most matches of a row; the padding sorts last and counts 0)
    h = int(count.max())
    valid = np.arange(h) < count[:, None]
    order = np.argsort(~hits, axis=1, kind="stable")[:, :h]  # the matches first
    hv = np.sort(np.where(valid, np.take_along_axis(nexts, order, axis=1), np.iinfo(np.int64).max), axis=1)
    at = np.arange(h)
    starts = np.ones((sel.size, h), dtype=bool)
    starts[:, 1:] = hv[:, 1:] != hv[:, :-1]  # a run of equal tokens starts here
    ends = np.ones((sel.size, h), dtype=bool)
    ends[:, :-1] = starts[:, 1:]  # … and ends here
    first = np.maximum.accumulate(np.where(starts, at, 0), axis=1)
    final = np.minimum.accumulate(np.where(ends, at, h)[:, ::-1], axis=1)[:, ::-1]
    cnt = np.where(valid, final - first + 1, 0)  # per match, how many matches share its next token
    top = cnt.max(axis=1)
    top_tok = hv[rs, np.argmax(cnt, axis=1)]
    second = np.where(valid & (hv != top_tok[:, None]), cnt, 0).max(axis=1)
    margin = (top - second) / count
    # the match's length: its common suffix with the sequence (n tokens at least), read back up to MATCH_LEN_SCALE
    back = np.arange(MATCH_LEN_SCALE)
    pos = last[:, None] - back
    eq = (np.take_along_axis(t, np.maximum(pos, 0), axis=1)
          == np.take_along_axis(t, np.maximum(lens[:, None] - 1 - back, 0), axis=1)) & (pos >= 0)
    length = np.maximum(np.cumprod(eq, axis=1).sum(axis=1), n)
    for i, *m in zip(sel.tolist(), token.tolist(), length.tolist(), count.tolist(), conf.tolist(), margin.tolist()):
        out[i] = tuple(m)
    return out


__all__ = ["DEFAULT_MAX_NGRAM", "DEFAULT_MIN_NGRAM", "LookupDrafter", "find_rows"]
