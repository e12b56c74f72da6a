"""Continuous batching of speculative decoding: B ≥ 1 requests share one target forward per step.

Each request is a *row* with its own committed sequence, drafter, controller, sampling generator and
accepted length τ; rows join (after their prefill) and leave (at EOS or ``max_new_tokens``) between
steps, as in vLLM's and SGLang's schedulers. One step:

1. every running row drafts with its own controller and the one depth rule
   (:meth:`learn2draft.decoding.SpeculativeDecoder.wants_draft`), depth by depth for all rows at once
   (:meth:`BatchedSpeculativeDecoder._draft`; below);
2. **one** target forward verifies all rows: row i feeds its last committed token and its γ_i drafted
   tokens, k_i = γ_i + 1, and the rows' tokens are packed into one sequence of Σ k_i tokens (ragged verification,
   :mod:`learn2draft.batch_cache`; no padding to B × max k_i; a row with γ_i = 0 is plain decoding, so B rows at
   γ = 0 is batched autoregressive decoding);
3. every row accepts with the exact sampler on its own rows of the probabilities, all rows in one call
   (:func:`learn2draft.sampling.speculative_sample_rows`: tensor operations over the packed rows, one host read per
   step whatever B is, each row drawing its uniforms from its own generator), and commits τ_i + 1 tokens
   (:func:`learn2draft.decoding.finish_rows`, the one verification tail, over all rows at once: every row's tokens
   in one write to the rows' token store, their cache rows rolled back by length together): the law holds per row
   whatever the other rows do (Leviathan et al. 2023, applied to each row's own p and q).

The target's KV cache (:class:`learn2draft.batch_cache.BatchCache`) is kept per row by length: row i's slot s holds
the key of its token at position s, the row attends to its first ``target_len`` slots and the new tokens, and rolling
back rejected drafts sets the row's length, so no rejected entry is ever attended to. A row that leaves gives its place
to the last row (the cache copies that row alone; :meth:`BatchedSpeculativeDecoder._drop`).

Prefill runs when a request joins (its time is the request's TTFT): alone (:meth:`BatchedSpeculativeDecoder.add`,
the same one-forward prefill as batch 1), or for requests that join together in one packed forward
(:meth:`~BatchedSpeculativeDecoder.add_many`).

Drafting is lockstep: at each depth, the rows the depth rule lets draft without asking their controller
(below their controller's and the decoder's depth limit) are fed in ONE drafter forward when the drafter is
batched (the model and head drafters, :meth:`learn2draft.drafters.Drafter.prepare_batch`: each row's own KV
cache gathered into a left-padded batch, its new tokens right-padded, a 4D mask and per-row ``position_ids``, the
new entries appended to each row's cache); then each row's controller decides, and the rows that continue draw
their tokens from their own logits together, each with its own generator (:func:`learn2draft.decoding.
draft_prepared`; the model drafter's rows in one computation whose tokens and confidences cross to the host once for
all rows, :meth:`learn2draft.drafters.model.ModelDrafter.finish_rows`). The decision still precedes the draw, and a
row's draws are those it makes alone, in the same order, so at a fixed seed a row's tokens are those of the row
decoded alone (up to float rounding of the padded batch). The batched forward's seconds are split equally over the
rows it fed (their ``draft_seconds``). A row that says STOP at a depth
below its controller's ``max_depth`` was fed one token for nothing (rolled back after verification); a lone
candidate decides first and proposes alone. A hybrid's rows decide first (the source follows the controller's
answer), then the rows drafting with its neural drafter share one forward. Prompt lookup's rows (at least
:data:`~learn2draft.drafters.lookup.MIN_ROWS_SEARCHED_TOGETHER` of them) find their chains in one array search over
the rows before the first depth (:meth:`BatchedSpeculativeDecoder._lookahead_rows`); those whose controller does not
read the state (``reads_state`` False: a fixed γ, a per-batch-size table, a load-aware step policy's rows) draft their
whole chains, up to their step depth, in one call for all of them (:meth:`BatchedSpeculativeDecoder._draft_chains`,
:func:`learn2draft.decoding.draft_rows`), and the others decide and propose per row along them. Drafter
forwards per step: max_i γ_i (+1 when the last rows stop below their controller's ``max_depth``) instead of
Σ_i γ_i; only rows whose drafters share one module batch (a drafter name spawns every row's from one drafter).
Trees are not batched (the batch runs chains).
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from learn2draft.batch_cache import BatchCache
from learn2draft.control import (
    DraftController,
    asks_rows,
    check_depth_feature_scale,
    keeps_drafting,
    observe_loads,
    step_caps,
    warn_precision_mismatch,
)
from learn2draft.decoding import (
    SpeculativeDecoder,
    chain_verification,
    charge_draft,
    check_decoder_settings,
    depth_limits,
    draft_prepared,
    draft_rows,
    draft_sequences,
    finish_rows,
    host_mirror,
)
from learn2draft.drafters import make_drafter
from learn2draft.drafters.base import Drafter
from learn2draft.drafters.lookup import MIN_ROWS_SEARCHED_TOGETHER, LookupDrafter
from learn2draft.metrics import BatchStep, CycleResult, RequestResult
from learn2draft.models import ModelPair
from learn2draft.names import DECODER_MAX_DEPTH
from learn2draft.sampling import (
    SamplingConfig,
    greedy_accept_rows,
    sample_rows,
    speculative_sample,
    speculative_sample_rows,
)
from learn2draft.state import LoadState
from learn2draft.timing import DeviceClock

#: ``budget(margins, load) -> counts``: per row, how many drafted tokens to verify (see
#: :meth:`BatchedSpeculativeDecoder.step`).
VerificationBudget = Callable[[list[np.ndarray], LoadState], Sequence[int]]


class _Row(SpeculativeDecoder):
    """One request of a batch: :class:`SpeculativeDecoder`'s per-row state and cycle. Its target cache is a row
    (:attr:`~SpeculativeDecoder.cache_row`) of the batch's :class:`learn2draft.batch_cache.BatchCache`, which the
    batch feeds in one forward for all rows; rolling back sets that row's length, as for a sequence decoded alone.
    Its clock reads the host's time without waiting for the device: the batch's own clock waits where a step's work
    is timed (the step, the batched drafter forwards), and a row's readings (its decisions, draws and verification
    tail, host work after the step's one host read) would otherwise synchronise a GPU several times per row."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.clock = DeviceClock(self.pair.device, synchronize=False)

    def _open_target_cache(self) -> BatchCache:
        return self.target_cache  # the batch's, set before start(); the batch opens the row and numbers it

    def _open_buffer(self, length: int) -> tuple[torch.Tensor, np.ndarray | None, int]:
        return self.token_rows.open(self, length)  # the batch's store: a step commits every row in one write


class _TokenRows:
    """The rows' token buffers as the rows of one int64 (R, L) tensor (the token store), so that a step commits every
    row's tokens in one indexed write (:func:`learn2draft.decoding.commit_rows`). A request's buffer is a view of its
    store row (``_store_row``; not a KV-cache slot, which is a position); a store row is freed when its request leaves
    and reused by a later one; a request that needs more than L columns, or more rows than there are, makes the tensor
    grow (capacities doubled, the tokens copied and the requests' views re-pointed, their drafters re-attached). Off
    the host the store has a host mirror (:func:`learn2draft.decoding.host_mirror`), grown with it."""

    def __init__(self, device: torch.device):
        self.data = torch.empty(0, 0, dtype=torch.long, device=device)
        self.host = host_mirror(self.data)  # None on a CPU
        self.view = self.data.numpy() if self.host is None else self.host  # the tokens in host memory, (R, L)
        self.owners: dict[int, SpeculativeDecoder] = {}  # store row → the request's row that holds it
        self._free: list[int] = []

    def open(self, row: SpeculativeDecoder, length: int) -> tuple[torch.Tensor, np.ndarray | None, int]:
        """A store row of at least ``length`` tokens for ``row``; returns (the store, its host mirror or None, that
        store row)."""
        held, width = self.data.shape
        if length > width or not self._free:
            rows = held if self._free else max(2 * held, 1)
            grown = torch.empty(rows, max(2 * width, length) if length > width else width, dtype=torch.long,
                                device=self.data.device)
            grown[:held, :width] = self.data
            host = host_mirror(grown)
            if host is not None:
                host[:held, :width] = self.host
            self._free += range(rows - 1, held - 1, -1)
            self.data, self.host = grown, host
            self.view = grown.numpy() if host is None else host
            for i, r in self.owners.items():
                r._store, r._store_host, r._buf = grown, host, grown[i]
                r.drafter.attach_tokens(r.host_tokens())
        i = self._free.pop()
        self.owners[i] = row
        return self.data, self.host, i

    def close(self, rows: Sequence[SpeculativeDecoder]) -> None:
        """Free the store rows of ``rows`` (requests that left the batch)."""
        for r in rows:
            if self.owners.get(r._store_row) is r:
                del self.owners[r._store_row]
                self._free.append(r._store_row)


class BatchedSpeculativeDecoder:
    """Speculative decoding of many requests at once, with continuous batching (rows join and leave between steps).

    Args:
        pair: the models; ``pair.target`` verifies every row in one forward per step.
        drafter: a drafter name for :func:`learn2draft.drafters.make_drafter` (``"model"``, ``"head"``, ``"lookup"``,
            a hybrid; each row's drafter is :meth:`~learn2draft.drafters.Drafter.spawn`-ed from one, over the same
            weights), or a callable returning a new :class:`~learn2draft.drafters.Drafter` per row (drafters hold
            per-sequence state: never share one between rows; share the weights, e.g. with ``spawn``, so that the
            model and head drafters' forwards batch).
        sampling: the settings of every row (greedy by default).
        max_new_tokens: per request (> 0).
        max_depth: the most tokens a row drafts in one step (≥ 0).
        max_batch: the most rows at once (≥ 1); :meth:`add` beyond it raises.
        head: the head directory for the ``"head"`` drafters (None: the shipped head).
        min_ngram: prompt lookup's shortest n-gram match for a lookup or hybrid drafter name (None: the default).
        batched_drafting: run the model and head drafters' forwards for all rows of a draft position at once (the
            default); False drafts row by row (the same tokens; for measuring what batching gains,
            ``eval/scripts/batched_drafting_bench.py``).
        verification: ``"ragged"`` (the default): each row feeds only its own k_i = γ_i + 1 tokens, packed
            (:mod:`learn2draft.batch_cache`); ``"padded"``: every row is padded to the longest, B × max k_i tokens (the
            same tokens and law; for measuring what packing gains).

    Raises:
        ValueError: ``max_new_tokens`` ≤ 0, ``max_depth`` < 0, ``max_batch`` < 1, an unknown drafter name or
            ``verification``, or a target the ragged forward does not support
            (:func:`learn2draft.batch_cache.check_supported`).
    """

    def __init__(self, pair: ModelPair, drafter: str | Callable[[], Drafter] = "lookup",
                 sampling: SamplingConfig | None = None, max_new_tokens: int = 128,
                 max_depth: int = DECODER_MAX_DEPTH, max_batch: int = 64, head: str | None = None,
                 batched_drafting: bool = True, min_ngram: int | None = None, verification: str = "ragged"):
        if not isinstance(max_batch, int) or max_batch < 1:
            raise ValueError(f"max_batch must be an integer ≥ 1, got {max_batch!r}.")
        check_decoder_settings(max_new_tokens, max_depth)
        self.pair = pair
        self.sampling = sampling or SamplingConfig()
        self.max_new_tokens = max_new_tokens
        self.max_depth = max_depth
        self.max_batch = max_batch
        self.batched_drafting = bool(batched_drafting)
        # a name: one drafter built here (an unknown name / a missing draft model fails before any request), and each
        # row's spawned from it, over the same weights, so that the model and head rows' forwards batch
        self._make_drafter = drafter if callable(drafter) else make_drafter(drafter, pair, head, min_ngram=min_ngram).spawn
        self._make_drafter()
        self.clock = DeviceClock(pair.device)
        self.rows: list[_Row] = []
        self._ids: list[int] = []  # request id of each row, in batch order
        self._controllers: dict[int, DraftController] = {}
        self._results: dict[int, RequestResult] = {}
        self._next_id = 0
        #: requests added with ``mixed=True`` whose prefill rides on the next step: (row, controller, request id)
        self._joining: list[tuple[_Row, DraftController, int]] = []
        #: the target's KV cache, per row by length (row i of the cache is ``rows[i]``)
        self.cache = BatchCache(pair.target)
        self.token_rows = _TokenRows(pair.device)
        if verification not in ("ragged", "padded"):
            raise ValueError(f"verification must be 'ragged' or 'padded', got {verification!r}.")
        self.verification = verification
        #: steps taken, and their :class:`~learn2draft.metrics.BatchStep` summaries (seconds, batch size, tokens)
        self.steps: list[BatchStep] = []

    # ---------------------------------------------------------------- requests
    @property
    def running(self) -> list[int]:
        """Request ids of the rows in the batch, in batch order."""
        return list(self._ids)

    @property
    def batch_size(self) -> int:
        return len(self.rows)

    def add(self, prompt_ids: torch.Tensor, controller: DraftController, seed: int = 0,
            arrival: float | None = None) -> int:
        """Prefill a request (one target forward over the prompt, the first token drawn from its last logits, as at
        batch size 1) and add it to the batch from the next step.

        Args:
            prompt_ids: int64 (L,) or (1, L).
            controller: this row's depth controller (reset here; one per row when it keeps state).
            seed: the row's sampling seed (the same seed and prompt give the same tokens at any batch).
            arrival: the clock reading when the request arrived (TTFT counts from it; None: now).

        Returns:
            the request id (an int), the key of :meth:`result`.

        Raises:
            RuntimeError: the batch holds ``max_batch`` rows.
            ValueError: a bad prompt (see :meth:`SpeculativeDecoder.start`), or a controller whose depth features
                are scaled for another ``max_depth``.

        Warns:
            PrecisionMismatchWarning: the controller's policy was trained in another precision than the target runs
                in (once per policy: :func:`learn2draft.control.warn_precision_mismatch`).
        """
        if len(self.rows) + len(self._joining) >= self.max_batch:
            raise RuntimeError(f"The batch is full ({self.max_batch} rows): step() until a request finishes.")
        return self.add_many([prompt_ids], [controller], [seed], None if arrival is None else [arrival])[0]

    def add_many(self, prompts: Sequence[torch.Tensor], controllers: Sequence[DraftController],
                 seeds: Sequence[int] | None = None, arrivals: Sequence[float] | None = None,
                 mixed: bool = False) -> list[int]:
        """:meth:`add` for requests that join together: one prefill forward over the prompts, packed (each row's own
        tokens, no padding: :meth:`learn2draft.batch_cache.BatchCache.forward`), instead of one forward each.

        Args:
            prompts: int64 (L_i,) each; controllers: one per prompt; seeds: one per prompt (default 0);
            arrivals: clock readings (default: now).
            mixed: defer the prefill to the next :meth:`step`, whose one target forward then carries the prompts'
                tokens beside the running rows' verification (a mixed prefill-and-decode batch, as vLLM's and SGLang's
                schedulers run joins): the batch does not stall for a prefill forward of its own. The requests get
                their first token at the end of that step and join the batch from the step after. With
                ``verification="padded"`` or no running row the prefill runs now, as without it.

        Returns:
            the request ids, in the order of ``prompts`` (none for no prompts).

        Raises:
            RuntimeError: the rows would exceed ``max_batch``.
            ValueError: a bad prompt, mismatched lengths, or a controller scaled for another ``max_depth``.

        Warns:
            PrecisionMismatchWarning: as :meth:`add`.
        """
        n = len(prompts)
        if n == 0:
            return []
        seeds = [0] * n if seeds is None else list(seeds)
        if len(controllers) != n or len(seeds) != n or (arrivals is not None and len(arrivals) != n):
            raise ValueError(f"add_many needs one controller, seed and arrival per prompt ({n} prompts).")
        for c in controllers:
            check_depth_feature_scale(c, self.max_depth)
            warn_precision_mismatch(c, self.pair.target.dtype)  # once per policy, not per request
        if len(self.rows) + len(self._joining) + n > self.max_batch:
            raise RuntimeError(f"{n} requests do not fit: {len(self._joining)} more are joining the batch of "
                               f"{len(self.rows)} of {self.max_batch} rows.")
        now = self.clock.now()
        rows = []
        try:
            for prompt, c, seed in zip(prompts, controllers, seeds):
                rows.append(self._new_row(prompt, c, seed))
        except BaseException:  # a bad prompt: the requests before it never joined either
            self.token_rows.close(rows)
            raise
        self.cache.add_rows(n)  # after the running rows and those already joining
        rids = [self._record(r, now if arrivals is None else float(arrivals[i]), None) for i, r in enumerate(rows)]
        self._joining += list(zip(rows, controllers, rids))
        if not (mixed and self.rows and self.verification == "ragged"):
            self._prefill_joining()
        return rids

    def _prefill_joining(self) -> None:
        """Prefill the joining rows in one forward of their own (packed) and admit them."""
        rows = [r for r, _, _ in self._joining]
        last = torch.tensor([r.prompt_len for r in rows], device=self.pair.device).cumsum(0) - 1
        try:
            logits, hidden = self.cache.forward(len(self.rows), [r.ids for r in rows], keep=last,
                                                output_hidden=self._needs_hidden(rows))
        except BaseException:  # e.g. out of memory on a long prompt: the requests never joined; the batch goes on
            self._forget_joining()
            raise
        done = self._admit(logits, hidden)
        if done:
            self._drop(done)

    def _forget_joining(self) -> None:
        """Drop the joining requests (their results and their cache rows), as if they had never been added."""
        for _, _, rid in self._joining:
            del self._results[rid]
        self.token_rows.close([r for r, _, _ in self._joining])
        self._joining = []
        self.cache.keep_rows(list(range(len(self.rows))))

    @staticmethod
    def _needs_hidden(rows: Sequence[_Row]) -> bool:
        """Whether a forward over ``rows`` must return the target's last hidden states (a row's drafter reads them)."""
        return any([r.drafter.needs_target_hidden for r in rows])

    def _admit(self, last_logits: torch.Tensor, hidden: torch.Tensor | None) -> list[int]:
        """The joining rows after their prefill: each draws its first token from its prompt's last logits
        (``last_logits`` float (P, V), one row per joining request), is recorded, and joins the batch.

        Args:
            hidden: the prompts' last hidden states, packed (Σ L_j, H), for a drafter that reads them (else None).

        Returns:
            the batch positions of those that finished at once (EOS first, or ``max_new_tokens`` = 1), to drop.
        """
        last_logits = last_logits[:, : self.pair.vocab_size]
        firsts: list[int | None] = [None] * len(self._joining)
        if not self.sampling.prefix_dependent:  # every row's first token in one draw (one host read)
            u = torch.cat([torch.rand(1, generator=r.generator, device=last_logits.device, dtype=torch.float64)
                           for r, _, _ in self._joining])
            firsts = sample_rows(self.sampling.probs_rows(last_logits, source="target"), u)
        t = self.clock.now()
        done, off = [], 0
        for i, (r, c, rid) in enumerate(self._joining):
            if hidden is not None and r.drafter.needs_target_hidden:
                r.drafter.observe_target(hidden[off : off + r.prompt_len], 0)
            off += r.prompt_len
            emitted = r._first_token(last_logits[i : i + 1], firsts[i])
            res = self._results[rid]
            res.tokens, res.first_token, res.finish = list(emitted), t, t
            res.token_times = [t] * r.generated
            if r.finished:
                done.append(len(self.rows))
            r.cache_row = len(self.rows)  # the joining rows' cache rows follow the running ones, in order
            self.rows.append(r)
            self._ids.append(rid)
            self._controllers[rid] = c
        self._joining = []
        return done

    def _new_row(self, prompt_ids: torch.Tensor, controller: DraftController, seed: int) -> _Row:
        """A new row with its own drafter, started on ``prompt_ids`` without its prefill (the batch opens its cache
        row and runs the prefill, alone or mixed into a step: :meth:`add_many`); the controller is reset."""
        row = _Row(self.pair, self.sampling, self.max_new_tokens, self.max_depth, seed=seed,
                   drafter=self._make_drafter())
        row.target_cache, row.token_rows = self.cache, self.token_rows
        controller.reset()
        row.start(prompt_ids, seed, prefill=False)
        return row

    def _record(self, row: _Row, arrival: float, first_token: float | None) -> int:
        """Open the :class:`~learn2draft.metrics.RequestResult` of a row (its first token committed at
        ``first_token``; None: not yet prefilled, set by :meth:`_admit`); returns its request id."""
        rid = self._next_id
        self._next_id += 1
        t = float("nan") if first_token is None else first_token
        self._results[rid] = RequestResult(rid, row.ids[: row.prompt_len].tolist(), row.ids[row.prompt_len :].tolist(),
                                           [], arrival, t, t, [t] * row.generated)
        return rid

    def result(self, request_id: int) -> RequestResult:
        """The request's result so far (complete once it is no longer :attr:`running`).

        Raises:
            KeyError: an unknown request id.
        """
        if request_id not in self._results:
            raise KeyError(f"No request {request_id!r} in this decoder.")
        return self._results[request_id]

    def remove(self, request_id: int) -> RequestResult:
        """Stop a running request (e.g. the client left) and drop its row; the other rows are not touched.

        Returns:
            the request's :class:`~learn2draft.metrics.RequestResult` (its tokens so far).

        Raises:
            KeyError: the request is not running.
        """
        if request_id not in self._ids:
            raise KeyError(f"Request {request_id!r} is not running.")
        self._drop([self._ids.index(request_id)])
        return self._results[request_id]

    def _drop(self, indices: list[int]) -> None:
        """Remove rows ``indices`` (batch positions) from the batch and the cache: the last rows that stay take the
        places of those that leave (as vLLM's persistent batch condenses), so the cache copies one row per row that
        left, not every row after it; the other rows keep their places."""
        gone = set(indices)
        b = len(self.rows)
        n = b - len(gone)
        keep = list(range(n))
        for hole, row in zip(sorted(i for i in gone if i < n), [i for i in range(n, b) if i not in gone]):
            keep[hole] = row
        for i in indices:
            self._controllers.pop(self._ids[i], None)
        self.token_rows.close([self.rows[i] for i in indices])
        self.rows = [self.rows[i] for i in keep]
        self._ids = [self._ids[i] for i in keep]
        self.cache.keep_rows(keep + list(range(b, b + len(self._joining))))  # joining rows' slots follow
        for i, row in enumerate(self.rows):
            row.cache_row = i

    # -------------------------------------------------------------------- step
    def _batched_forward(self, tokens: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor | None, int]:
        """Feed row i's ``tokens[i]`` (int64 (k_i,)) after its cached slots in one target forward: packed
        (``verification="ragged"``) or each row padded to max k_i (``"padded"``; the padding's slots lie past the
        row's length and are never attended to).

        Returns:
            the rows' logits float (Σ k_i, V) and last hidden states (Σ k_i, H) when a drafter reads them (else None),
            packed (row i's k_i rows after those of the rows before it), and the tokens the forward fed.
        """
        need_hidden = self._needs_hidden(self.rows)
        if self.verification == "ragged":
            logits, hidden = self.cache.forward(0, tokens, output_hidden=need_hidden)
            return logits[:, : self.pair.vocab_size], hidden, int(logits.shape[0])

        k = max([int(t.numel()) for t in tokens])
        padded = [torch.cat([t, t[-1:].expand(k - t.numel())]) for t in tokens]
        real = torch.cat([torch.arange(t.numel()) + i * k for i, t in enumerate(tokens)]).to(self.pair.device)
        logits, hidden = self.cache.forward(0, padded, output_hidden=need_hidden)
        return logits[real, : self.pair.vocab_size], None if hidden is None else hidden[real], k * len(tokens)

    def _mixed_forward(self, tokens: list[torch.Tensor]):
        """:meth:`_batched_forward` (ragged) with the joining requests' prompts packed after the rows' verification
        tokens, in the same target forward; only the prompts' last logits are computed.

        Returns:
            the rows' logits (Σ k_i, V) and hidden states (or None), the tokens fed (Σ k_i + Σ L_j), the joining
            requests' last logits (P, V) and their prompts' hidden states packed (Σ L_j, H) (or None).
        """
        dev = self.pair.device
        n = sum(int(t.numel()) for t in tokens)
        prompts = [r.ids for r, _, _ in self._joining]
        ends = torch.tensor([int(p.numel()) for p in prompts], device=dev).cumsum(0) - 1
        keep = torch.cat([torch.arange(n, device=dev), n + ends])
        need = self._needs_hidden(self.rows + [r for r, _, _ in self._joining])
        logits, hidden = self.cache.forward(0, list(tokens) + prompts, keep=keep, output_hidden=need)
        logits = logits[:, : self.pair.vocab_size]
        fed = n + sum(int(p.numel()) for p in prompts)
        return (logits[:n], None if hidden is None else hidden[:n], fed, logits[n:],
                None if hidden is None else hidden[n:])

    def load(self, waiting: int = 0) -> LoadState:
        """The :class:`learn2draft.state.LoadState` of the running rows (``waiting``: queued requests) and the
        previous step's measured tokens and seconds; every field is known before the step's drafting."""
        last = [self._results[rid].cycles[-1] if self._results[rid].cycles else None for rid in self._ids]
        rows = self.rows  # no per-row call: each row's committed length _n, its ids a view of its token buffer
        return LoadState(
            len(rows), self.max_batch, tuple([r._n for r in rows]), waiting,
            last_taus=tuple([c.num_accepted if c else 0 for c in last]),
            last_depths=tuple([c.depth if c else 0 for c in last]),
            draftable=_Lazy([(r, r._buf[: r._n], m) for r, m in zip(rows, depth_limits(rows))], self.token_rows),
            row_ids=tuple(self._ids), tokens_left=tuple([self.max_new_tokens - (r._n - r.prompt_len) for r in rows]),
            max_depth=self.max_depth, max_new_tokens=self.max_new_tokens,
            **({} if not self.steps else dict(last_step_batch=self.steps[-1].batch_size,
                                              last_step_tokens=self.steps[-1].tokens,
                                              last_step_seconds=self.steps[-1].seconds,
                                              last_step_prefill_tokens=self.steps[-1].prefill_tokens,
                                              last_step_row_ids=tuple(self.steps[-1].rows),
                                              last_step_row_tokens=tuple([len(c.tokens) for c in
                                                                          self.steps[-1].rows.values()]),
                                              last_step_row_drafted=tuple([c.verify_size for c in
                                                                           self.steps[-1].rows.values()]))))

    def _draft(self, ctrls: list[DraftController], load: LoadState | None = None) -> None:
        """The drafting half of a step, depth by depth (lockstep) for every row with its own controller ``ctrls[i]``.

        At each depth, the rows that :func:`learn2draft.control.keeps_drafting` (the one depth rule) lets draft
        without the controller's answer are the candidates. With a batched drafter (``Drafter.batched``: model,
        head) and two or more candidates, their forwards run as ONE :meth:`~learn2draft.drafters.Drafter.prepare_batch`
        call (per drafter type), whose seconds are split equally over the candidates' draft seconds; then each row's
        controller decides (:meth:`~learn2draft.decoding.SpeculativeDecoder.wants_draft`), and the rows that
        continue draw their tokens from their prepared logits together (:func:`~learn2draft.decoding.draft_prepared`:
        one :meth:`~learn2draft.drafters.Drafter.finish_rows` call per drafter type, each row from its own
        generator). A row whose controller is not asked and whose drafter always has a proposal drafts up to its cap
        (step depth and depth limit) with no call per row: what the depth rule gives it. The forward comes before the
        decision, the draw after it, so the decision still precedes the draw (the law), a row's draws are those it
        makes alone, in the same order, and a row that stops has only fed one more token to its drafter (rolled back
        after verification). A single candidate decides first and proposes alone (batch-1 cost). A hybrid's forward
        depends on the source its controller chooses: its rows decide first, then those drafting with a batched
        neural drafter run one forward. Prompt lookup's rows find their chains in one search over the rows first
        (:meth:`_lookahead_rows`; or the load state's ``draftable`` did this step), then decide and propose per row
        along them (no row searches again)."""
        rows = self.rows
        # what each row may draft this step: its step depth capped by its depth limit (at 0 the depth rule drafts
        # nothing: can_draft() is False below the limit's end, and the controller is not asked)
        caps = [min(k, m) if k > 0 else 0 for k, m in zip(step_caps(ctrls), depth_limits(rows))]
        if load is not None and isinstance(load.draftable, _Lazy) and load.draftable.searched:
            # the load state's draftable found these rows' chains this step, each up to its depth limit
            searched = {i: caps[i] for i in load.draftable.searched}
        else:
            searched = self._lookahead_rows(caps)
        active = [i for i, k in enumerate(caps) if k > 0]
        asked = asks_rows(ctrls)
        if searched:
            active = self._draft_chains(searched, active, asked)
        # the rows the depth rule drafts to their cap with no decision: a controller that is not asked, a batched
        # drafter (not a hybrid) that always has a proposal (Drafter.can_propose's default); at round `level` such
        # a row has drafted `level` tokens and drafts one more while level < its cap (the cap is its step depth and
        # depth limit: what keeps_drafting and can_draft() read), without a call per row
        to_cap = {i for i in active if not asked[i] and rows[i].drafter.batched and not rows[i]._hybrid
                  and type(rows[i].drafter).can_propose is Drafter.can_propose}
        level = 0
        while active:
            cand = [i for i in active if (caps[i] > level if i in to_cap else (
                rows[i].drafter.batched and not rows[i]._hybrid
                and keeps_drafting(ctrls[i], len(rows[i].drafted), rows[i].can_draft, lambda: True)))]
            prepared = self._prepare_drafts(cand) if len(cand) > 1 else {}  # a lone row proposes alone
            nxt, ready, chosen = [], [], []
            for i in active:  # a non-candidate's rule says no without asking its controller
                if i in to_cap:
                    if caps[i] > level:
                        ready.append(i)
                        nxt.append(i)
                elif rows[i].wants_draft(ctrls[i]):
                    if i in prepared:
                        ready.append(i)  # drawn below with the other prepared rows
                    elif not (rows[i]._hybrid and rows[i].drafter.batched):
                        rows[i].draft_step()
                    else:
                        chosen.append(i)  # a hybrid whose source is chosen: batched below
                    nxt.append(i)
            if ready:
                self._draw_prepared(ready, prepared)
            if chosen:
                self._draw_prepared(chosen, self._prepare_drafts(chosen))
            active = nxt
            level += 1

    def _draft_chains(self, searched: dict[int, int], active: list[int], asked: list[bool]) -> list[int]:
        """Draft, in one :func:`~learn2draft.decoding.draft_rows` call, the whole chain of every prompt-lookup row
        whose chain this step's search found (``searched``: row index → the most tokens it may draft, its step depth
        capped by its depth limit; from :meth:`_lookahead_rows` or the load state's ``draftable``) and whose
        controller is not asked (``asked[i]`` False, :func:`~learn2draft.control.asks_rows`; ``reads_state`` False: a
        fixed γ, a
        per-batch-size table, a load-aware step policy's rows): such a row drafts its chain up to its step depth and
        depth limit, which is what the depth rule lets it draft token by token, without asking. The call's seconds
        are split equally over those rows' draft seconds. Returns the rows of ``active`` left to draft token by token:
        the others, less the rows whose chain is empty (they have no proposal)."""
        rows = self.rows
        cand = [i for i in searched if not asked[i]]
        chains = LookupDrafter.chain_rows([rows[i].drafter for i in cand], [rows[i]._n for i in cand],
                                          [searched[i] for i in cand])  # the searched rows draft with prompt lookup
        chained, props, done = [], [], set()
        for i, chain in zip(cand, chains):
            if chain is None:  # its search stopped below this limit: token by token
                continue
            done.add(i)
            if chain:
                chained.append(rows[i])
                props.append(chain)
        if chained:
            clock = chained[0].clock  # host work: a clock that does not wait for the device
            t0 = clock.now()
            draft_rows(chained, props)
            charge_draft(chained, clock.now() - t0)
        return [i for i in active if i not in done]

    def _lookahead_rows(self, caps: list[int]) -> dict[int, int]:
        """Prompt lookup's chains for the rows at once (:meth:`learn2draft.drafters.lookup.LookupDrafter.
        lookahead_store`: one array search over the rows per chain position, on the rows of the token store in host
        memory, instead of one search per row and depth),
        each up to ``caps[i]`` tokens (its controller's step depth capped by its depth limit), when at least
        :data:`~learn2draft.drafters.lookup.MIN_ROWS_SEARCHED_TOGETHER` rows draft with prompt lookup this step. Each
        drafter keeps its chain, so the rows' drafting along it does not search again; the call's seconds are split
        equally over those rows' draft seconds. The tokens drafted are those of each row alone. Returns the rows
        searched, row index → its limit (none when fewer use prompt lookup)."""
        rows = self.rows
        if sum([type(r.drafter) is LookupDrafter for r in rows]) < MIN_ROWS_SEARCHED_TOGETHER:
            return {}
        caps = [k if type(r.drafter) is LookupDrafter else 0 for r, k in zip(rows, caps)]
        idx = _searched_together(rows, caps)
        if not idx:
            return {}
        clock = rows[idx[0]].clock  # host work: a clock that does not wait for the device
        t0 = clock.now()
        # at depth 0: each row's committed tokens
        _search_chains(self.token_rows.view, [rows[i] for i in idx], [rows[i]._n for i in idx], [caps[i] for i in idx])
        charge_draft([rows[i] for i in idx], clock.now() - t0)
        return {i: caps[i] for i in idx}

    def _prepare_drafts(self, idx: list[int]) -> dict[int, Any]:
        """One :meth:`~learn2draft.drafters.Drafter.prepare_batch` call per drafter type over rows ``idx`` (none for
        fewer than two rows: a lone row proposes alone); each row is charged an equal share of its call's seconds.
        Returns row index → what the row draws from (:meth:`_draw_prepared`)."""
        if len(idx) < 2 or not self.batched_drafting:
            return {}
        by_type: dict[type, list[int]] = {}
        for i in idx:
            by_type.setdefault(type(self.rows[i].drafter), []).append(i)
        prepared: dict[int, Any] = {}
        for kind, group in by_type.items():
            t0 = self.clock.now()
            out = kind.prepare_batch([self.rows[i].drafter for i in group],
                                     draft_sequences([self.rows[i] for i in group]))
            charge_draft([self.rows[i] for i in group], self.clock.now() - t0)
            prepared.update(zip(group, out))
        return prepared

    def _draw_prepared(self, idx: list[int], prepared: dict[int, Any]) -> None:
        """Draft one token in each row of ``idx``: the rows with a ``prepared`` entry (:meth:`_prepare_drafts`) draw
        from it together (:func:`~learn2draft.decoding.draft_prepared`: one draw call per drafter class, each row from
        its own generator), the others propose alone."""
        ready = [i for i in idx if i in prepared]
        if ready:
            draft_prepared([self.rows[i] for i in ready], [prepared[i] for i in ready])
        for i in idx:
            if i not in prepared:
                self.rows[i].draft_step()

    def _accept_rows(self, logits: torch.Tensor, probs: torch.Tensor | None,
                     tokens: list[torch.Tensor]) -> list[tuple[list[int], int]] | None:
        """Every row's acceptance in one call, one host read returning every τ_i and next token:
        :func:`~learn2draft.sampling.speculative_sample_rows` on ``probs`` (row i's uniforms drawn from its own
        generator, what it draws alone; q None for point masses, as prompt lookup's, dense when any row has a
        drafter's q), or, for greedy decoding (``probs`` None), :func:`~learn2draft.sampling.greedy_accept_rows` on
        the raw ``logits`` (the same result for the greedy one-hot probabilities, none formed, no uniform drawn).

        Args:
            logits: float (Σ (γ_i + 1), V), the rows' raw target logits, packed as ``tokens`` (row i's γ_i + 1
                verification tokens: its last committed token and its drafted chain).
            probs: float32, the same rows' processed target probabilities; None: the sampling is greedy.

        Returns:
            per row, its accepted drafted tokens and its next (corrected or bonus) token; None when a row's sampler
            is not :func:`~learn2draft.sampling.speculative_sample` (a recording or control sampler: row by row).

        Raises:
            RuntimeError: a row fed other than γ_i + 1 tokens (the target would have missed a committed token).
        """
        rows = self.rows
        if any([r.sampler is not speculative_sample for r in rows]):
            return None
        dev = logits.device
        gammas = [len(r.drafted) for r in rows]  # chains: the depth is the drafted tokens
        if any([int(t.numel()) != g + 1 for t, g in zip(tokens, gammas)]):
            raise RuntimeError("A row's verification fed other than its γ + 1 tokens: the target's cache is out of step "
                               "with its committed tokens.")
        x = torch.tensor([t for r in rows for t in r.drafted], dtype=torch.long).to(dev, non_blocking=True)
        if probs is None:
            taus, nxt = greedy_accept_rows(logits, x, gammas)
            return [(r.drafted[:t], n) for r, t, n in zip(rows, taus, nxt)]
        u = torch.cat([torch.rand(g + 1, generator=r.generator, device=dev, dtype=torch.float64)
                       for r, g in zip(rows, gammas)])
        q = None
        if any(q is not None for r in rows for q in r.draft_probs):
            q = torch.cat([r._draft_q(probs) for r in rows if r.drafted])
        taus, nxt = speculative_sample_rows(probs, q, x, gammas, u, validate=False)  # softmaxes of checked logits
        return [(r.drafted[:t], n) for r, t, n in zip(rows, taus, nxt)]

    def step(self, budget: VerificationBudget | None = None, waiting: int = 0) -> BatchStep:
        """One step for every running row: draft (each row's controller), one batched verification, accept and
        commit per row; finished rows leave the batch.

        Before drafting, every row's controller is given the step's :class:`~learn2draft.state.LoadState`
        (:meth:`~learn2draft.control.DraftController.observe_load`; built when a controller ``reads_load`` — a
        per-batch-size table, a load-aware policy — or a budget runs).

        Args:
            budget: after drafting, ``budget(margins, load)`` (``margins``: per row, float64 (γ_i,) the drafted
                tokens' top-2 margins) returns how many of each row's drafted tokens to verify (a global
                verification budget, e.g. vLLM's adaptive verification); the rest are dropped before the forward.
                It reads only the draft side, so the law is unchanged. None: verify every drafted token.
            waiting: requests queued behind the batch (for the load state).

        Returns:
            the :class:`~learn2draft.metrics.BatchStep` (each row's :class:`~learn2draft.metrics.CycleResult`, the
            step's seconds).

        Raises:
            RuntimeError: no row is running.
            ValueError: the budget returned a wrong number of rows or a count outside 0..γ_i.
        """
        if self._joining and (not self.rows or self.verification == "padded"):
            self._prefill_joining()  # nothing to mix them with, or a padded step: their prefill runs alone first
        if not self.rows:
            raise RuntimeError("No request is running: add() one first.")
        t_start = self.clock.now()
        ctrls = [self._controllers[rid] for rid in self._ids]
        # the load state only when something reads it (it runs a lookahead per row)
        load = self.load(waiting) if budget is not None or any([c.reads_load for c in ctrls]) else None
        if load is not None:
            observe_loads(ctrls, load)
        self._draft(ctrls, load)
        if budget is not None:
            keep = list(budget([np.asarray(r.margins, dtype=np.float64) for r in self.rows], load))
            if len(keep) != len(self.rows):
                raise ValueError(f"The verification budget returned {len(keep)} counts for {len(self.rows)} rows.")
            for row, n in zip(self.rows, keep):
                row.truncate_draft(int(n))
        t0 = self.clock.now()
        plans, tokens = chain_verification(self.rows)
        t1 = self.clock.now()
        joining = bool(self._joining)
        if joining:
            logits, hidden, fed, join_logits, join_hidden = self._mixed_forward(tokens)
        else:
            logits, hidden, fed = self._batched_forward(tokens)
        t2 = self.clock.now()
        # every row's acceptance in one call when no processor reads a row's prefix (else row by row); greedy
        # decoding reads the logits' argmax and forms no probabilities
        at_once = not self.sampling.prefix_dependent
        greedy = at_once and self.sampling.greedy and all([r.sampler is speculative_sample for r in self.rows])
        probs = self.sampling.probs_rows(logits, source="target") if at_once and not greedy else None
        decided = self._accept_rows(logits, probs, tokens) if at_once else None
        rows = self.rows
        starts = [0]
        for t in tokens:
            starts.append(starts[-1] + int(t.numel()))
        if hidden is not None:  # the target's hidden states for the drafters that read them, before the tail
            for row, a, b in zip(rows, starts, starts[1:]):
                if row.drafter.needs_target_hidden:
                    row.drafter.observe_target(hidden[a:b], row.target_len)
        if decided is None:  # a processor reads each row's prefix, or a row has its own sampler: row by row
            decided = [row._accept(plan, row._verification_probs(plan, logits[a:b], None if probs is None
                                                                 else probs[a:b]))
                       for row, plan, a, b in zip(rows, plans, starts, starts[1:])]
            cycles = finish_rows(rows, plans, decided, t0, t1, t2)
        else:
            cycles = finish_rows(rows, plans, decided, t0, t1, t2, logits=logits, starts=starts)
        results: dict[int, CycleResult] = dict(zip(self._ids, cycles))
        done = [i for i, c in enumerate(cycles) if c.finished]
        now = self.clock.now()  # every row's tokens of this step are committed: one reading, not one per row
        for rid, res in results.items():
            r = self._results[rid]
            r.tokens.extend(res.tokens)
            r.cycles.append(res)
            r.token_times.extend([now] * len(res.tokens))
            r.finish = now
        k = max([int(t.numel()) for t in tokens])
        batch = len(self.rows)
        if joining:  # the requests whose prefill rode on this forward draw their first token and join
            done += self._admit(join_logits, join_hidden)
        if done:
            self._drop(done)
        prefill = fed - sum(int(t.numel()) for t in tokens) if joining else 0  # the joining prompts' tokens
        step = BatchStep(results, self.clock.now() - t_start, batch, k, fed, prefill)
        self.steps.append(step)
        return step


class _Lazy(Sequence):
    """A load state's ``draftable``, computed on read: per row, the tokens its drafter can propose after the committed
    tokens the row held when the load state was built (:func:`_draftable`; the ids and depth limit are kept then,
    committed tokens are never rewritten while the row runs: a row that leaves frees its slot of the token store for a
    later request). Each row runs a lookahead (prompt lookup's n-gram search, ~0.3 ms a row on
    a 2-core CPU), so nothing is computed before a read: a step whose controllers never read it (a fixed table) pays
    nothing. A read of a row computes that row alone, except where
    :data:`~learn2draft.drafters.lookup.MIN_ROWS_SEARCHED_TOGETHER` or more rows draft with prompt lookup: the first
    read of one of them finds all their chains in one array search over the rows of the token store ``store``
    (:meth:`learn2draft.drafters.lookup.LookupDrafter.lookahead_store`), which the step's drafting then reuses (its
    seconds are the reader's, e.g. a controller's decision, as a row's own lookahead's were). Reads as, compares
    equal to and pickles as the tuple of ints."""

    def __init__(self, rows: list, store: _TokenRows):
        self._rows, self._values, self._store = rows, [None] * len(rows), store
        self._lookup = _searched_together([r for r, _, _ in rows], [limit for _, _, limit in rows])
        #: the rows (indices) whose prompt-lookup chains a read found in one search (each up to its depth limit: the
        #: step's drafting then searches nothing); empty before such a read
        self.searched: list[int] = []

    def _at(self, i: int) -> int:
        if self._values[i] is None:
            if self._lookup and i in self._lookup:
                rows = [self._rows[j] for j in self._lookup]
                chains = _search_chains(self._store.view, [r for r, _, _ in rows], [s.numel() for _, s, _ in rows],
                                        [limit for _, _, limit in rows])
                for j, (toks, _) in zip(self._lookup, chains):
                    self._values[j] = len(toks)
                self._lookup, self.searched = [], self._lookup
            else:
                self._values[i] = _draftable(*self._rows[i])
        return self._values[i]

    def _get(self) -> tuple[int, ...]:
        return tuple(self._at(i) for i in range(len(self._values)))

    def __getitem__(self, i):
        if isinstance(i, slice):
            return self._get()[i]
        return self._at(range(len(self._values))[i])

    def __len__(self) -> int:
        return len(self._values)

    def __eq__(self, other) -> bool:
        return self._get() == (other._get() if isinstance(other, _Lazy) else other)

    def __hash__(self) -> int:
        return hash(self._get())

    def __reduce__(self):
        return tuple, (self._get(),)

    def __repr__(self) -> str:
        return repr(self._get())


def _search_chains(tokens: np.ndarray, rows: Sequence[SpeculativeDecoder], lengths: Sequence[int],
                   limits: Sequence[int]) -> list[tuple[list[int], list[float]]]:
    """Prompt lookup's chains after the first ``lengths[i]`` tokens of ``rows`` (prompt-lookup rows of one batch), each
    up to ``limits[i]`` tokens: one :meth:`~learn2draft.drafters.lookup.LookupDrafter.lookahead_store` over ``tokens``,
    the batch's token store in host memory (:attr:`_TokenRows.view`: the store itself on a CPU, its host mirror off
    it)."""
    return LookupDrafter.lookahead_store([r.drafter for r in rows], tokens, [r._store_row for r in rows], lengths,
                                         limits)


def _searched_together(rows: Sequence[SpeculativeDecoder], limits: Sequence[int]) -> list[int]:
    """The rows whose prompt-lookup chains one search finds together (:meth:`~learn2draft.drafters.lookup.LookupDrafter.
    lookahead_store`): those drafting with prompt lookup (not a hybrid) with a limit above 0, when there are at least
    :data:`~learn2draft.drafters.lookup.MIN_ROWS_SEARCHED_TOGETHER` of them; else none (each searches alone)."""
    idx = [i for i, (r, k) in enumerate(zip(rows, limits)) if type(r.drafter) is LookupDrafter and k > 0]
    return idx if len(idx) >= MIN_ROWS_SEARCHED_TOGETHER else []


def _draftable(row: SpeculativeDecoder, seq: torch.Tensor, limit: int) -> int:
    """The tokens ``row``'s drafter can propose after its committed tokens ``seq`` (int64 (n,)), at most ``limit`` (its
    depth limit then): a lookahead's chain (prompt lookup, the hybrids' lookup), else the limit when it has a
    proposal."""
    if limit <= 0:
        return 0
    if hasattr(row.drafter, "lookahead"):
        return len(row.drafter.lookahead(seq, limit)[0])
    return limit if row.drafter.can_propose(seq) else 0


@dataclass
class Request:
    """A request of a stream: its prompt ids (int64 (L,)), its arrival time in seconds after the stream's start
    (0 for a closed loop) and its sampling seed."""

    prompt_ids: torch.Tensor
    arrival: float = 0.0
    seed: int = 0


def serve(decoder: BatchedSpeculativeDecoder, requests: Sequence[Request],
          controller: Callable[[], DraftController], concurrency: int | None = None,
          on_step: Callable[[BatchStep], None] | None = None,
          budget: VerificationBudget | None = None, mixed_prefill: bool = True) -> list[RequestResult]:
    """Run a request stream through ``decoder`` with continuous batching.

    With ``concurrency`` c (a closed loop, as a fixed-concurrency load generator): c requests run at once and a
    finished request is replaced by the next one at once (arrivals ignored; every request's ``arrival`` is the
    stream's start, so its TTFT and latency include the wait for a free row, as a client that sent them all at once
    measures them; ``eval.serve.admissions`` gives when each was let in). Without it (an open loop, e.g. Poisson
    arrivals): a request joins at the first step boundary after its ``arrival`` (seconds after the start), up to the
    decoder's ``max_batch``; while nothing runs the loop waits (sleeps) for the next arrival.

    Args:
        concurrency: the closed loop's c, capped at the decoder's ``max_batch`` (None: an open loop).
        controller: builds one controller per request (controllers keep per-sequence state).
        on_step: called after every step.
        budget: the verification budget of every step (:meth:`BatchedSpeculativeDecoder.step`).
        mixed_prefill: requests that join while others run are prefilled inside the next step's forward
            (:meth:`BatchedSpeculativeDecoder.add_many` with ``mixed=True``); False: in a forward of their own first.

    Returns:
        the :class:`~learn2draft.metrics.RequestResult` of every request, in the order of ``requests``.

    Raises:
        ValueError: ``concurrency`` < 1.
        TypeError: ``controller`` is a controller itself, or not callable, instead of a factory.
    """
    import time

    if concurrency is not None and (not isinstance(concurrency, int) or concurrency < 1):
        raise ValueError(f"concurrency must be an integer ≥ 1, got {concurrency!r}.")
    if isinstance(controller, DraftController) or not callable(controller):
        raise TypeError(f"serve() takes a factory that builds one controller per request (controllers keep "
                        f"per-request state), e.g. `lambda: FixedDepthController(2)`, a controller class, or a "
                        f"SpeculationGuard; got {controller!r}.")
    t0 = decoder.clock.now()
    queue = [(0.0 if concurrency else float(r.arrival), i) for i, r in enumerate(requests)]
    heapq.heapify(queue)
    ids: dict[int, int] = {}
    limit = min(concurrency or decoder.max_batch, decoder.max_batch)
    while queue or decoder.rows:
        now = decoder.clock.now() - t0
        joining = []
        while queue and queue[0][0] <= now and decoder.batch_size + len(joining) < limit:
            joining.append(heapq.heappop(queue))
        if joining:  # requests joining at one step boundary share one prefill forward
            reqs = [requests[i] for _, i in joining]
            rids = decoder.add_many([r.prompt_ids for r in reqs], [controller() for _ in reqs], [r.seed for r in reqs],
                                    [t0 + a for a, _ in joining], mixed=mixed_prefill)
            ids.update({i: rid for (_, i), rid in zip(joining, rids)})
        if decoder.rows:
            step = decoder.step(budget, waiting=sum(1 for a, _ in queue if a <= now))
            if on_step is not None:
                on_step(step)
        elif queue:
            time.sleep(max(0.0, queue[0][0] - (decoder.clock.now() - t0)))
    return [decoder.result(ids[i]) for i in range(len(requests))]


__all__ = ["BatchedSpeculativeDecoder", "Request", "VerificationBudget", "serve"]
