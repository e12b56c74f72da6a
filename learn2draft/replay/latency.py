"""Latency profiles: what each part of a draft/verify cycle costs on one machine.

A profile is a small JSON file (written by ``python -m eval.profile``, or by hand for hardware one
does not have) that turns a cycle's shape into seconds:

    seconds(d, c) = d · (draft_step(c) + step_overhead) + verify(d + 1, c) + cycle_overhead

for a chain cycle that drafts d tokens at context length c (committed tokens). The terms are the
ones :class:`learn2draft.metrics.CycleResult` measures:

* ``verify(n, c)`` — ``verify_seconds``: one target forward over n = d + 1 new tokens (the last
  committed token and the d drafted ones) after c cached tokens, and the processing of its logits;
* ``draft_step(c)`` — ``draft_seconds`` / d: one :meth:`Drafter.propose` (per drafter);
* ``cycle_overhead`` + d · ``step_overhead`` — ``other_seconds``: acceptance, cache rollback, the
  next observation, and the feature vector built before every draft decision (per drafter).

A draft-tree cycle (:class:`learn2draft.tree.TreeSpeculativeDecoder`) of depth d that verifies V
nodes costs

    tree_seconds(d, V, c) = d · (tree_level(c) + step_overhead) + verify(V + 1, c) + cycle_overhead

with ``tree_level(c)`` — ``tree_level_seconds`` (optional, per drafter) — one drafting level of the
tree: the drafter's forward over the W frontier nodes and their top-k children
(:meth:`TreeSpeculativeDecoder.draft_step`), measured at the W (and k) stored beside it. A profile
without it falls back to the chain's ``draft_step(c)`` (one forward over one token), which
:meth:`LatencyProfile.has_tree_level` reports; it is a fair stand-in where the drafter's forward is
launch-bound (a GPU), an underestimate where it is compute-bound (a CPU drafting W nodes).

``verify`` is tabulated at a few token counts (e.g. 1, 2, 4, …, 64) and context lengths and
interpolated linearly in both (linearly extrapolated above the largest context, held constant below
the smallest; more tokens than tabulated is an error). ``draft_step`` is tabulated over contexts
the same way. Everything is in seconds.

File format (``format: learn2draft-profile``, ``format_version: 1``)::

    {"format": "learn2draft-profile", "format_version": 1, "name": "cpu-2core",
     "source": "how the numbers were obtained", "machine": {...},
     "target": "...", "draft": "...",
     "verify": {"tokens": [1, 2, 4, ...], "contexts": [128, 512, 1024],
                "seconds": [[...per token count...], ...per context...]},
     "drafters": {"model": {"step_seconds": {"contexts": [...], "seconds": [...]},
                            "step_overhead_seconds": 1e-4, "cycle_overhead_seconds": 1e-3,
                            "tree_level_seconds": {"contexts": [...], "seconds": [...],   # optional
                                                   "width": 4, "top_k": 4}}, ...}}

(``tree_level_seconds`` is optional and keeps ``format_version`` 1: older files read as before;
its ``width`` / ``top_k`` say which tree shape it was measured at, null when assumed independent of it.)

Batch axis (optional, issue 17; keeps ``format_version`` 1)
-----------------------------------------------------------
For replay under load (:mod:`learn2draft.replay.serve`) a profile may also hold what a *batched* step costs,
measured by ``python -m eval.profile --batch-sizes 1,2,4,8,16``::

    "verify_batch": {"batch_sizes": [1, 2, 4, 8, 16], "tokens": [1, 2, 4, 8], "contexts": [128],
                     "seconds": [[[...per token count...] ...per batch size...] ...per context...]},
    "drafters": {"model": {..., "batch_step_seconds": {"batch_sizes": [1, 2, 4, 8, 16], "contexts": [128],
                                                       "seconds": [[...per batch size...] ...per context...]}}}

``verify_batch`` seconds[c][b][n]: one target forward over B = batch_sizes[b] rows of n = tokens[n] new tokens each
(B·n batched tokens) after contexts[c] cached tokens per row, plus the processing of its logits;
``batch_step_seconds`` seconds[c][b]: one draft step of all B rows together (per row: seconds / B).

A drafter may also hold what the real batched loop costs beyond these tables (optional, measured by
``python -m eval.profile --batch-sizes ...`` running :func:`learn2draft.batched.serve` at fixed γ)::

    "batch_overhead_seconds": {"batch_sizes": [2, 4, 8, 16], "cycle_seconds": [...], "step_seconds": [...],
                               "join_seconds": [...]}

per batch size B (≥ 2) the least-squares fit ``real step seconds − (the table terms) ≈ cycle_seconds[B] +
step_seconds[B] · d`` over the loop's steps of B rows whose longest draft is d (the per-row work a padded forward
does not show: each row's acceptance, rollback and proposals, masks and cache bookkeeping), and ``join_seconds[B]``:
per request joining a closed loop of concurrency B, the loop's seconds outside its steps minus the prefill the replay
charges (:meth:`LatencyProfile.prefill_seconds`). Signed (the tables may also over-estimate).
:meth:`LatencyProfile.batch_overhead` and :meth:`LatencyProfile.join_overhead` read them, linear in B from 0 at B = 1
(the single-sequence tables and overheads are the B = 1 step) to the tabulated sizes, constant above the largest;
without the entry both are 0.

A profile may also hold the prefill itself (optional, measured with the batch axis): ``"prefill": {"tokens": [8, 32,
64, 128, 256], "seconds": [...]}``, one target forward over a prompt of n tokens and its first token's probabilities
(without it, a prefill is priced as the verification of the whole prompt, extrapolated past the verify table).
:meth:`LatencyProfile.verify_batched` and :meth:`LatencyProfile.draft_step_batched` read them: linear in the
batch size between tabulated sizes (more rows than tabulated is an error), linear in tokens over the table made
monotone (a running maximum along tokens: a median a little below its smaller neighbour is noise), and in context
like the single-sequence tables. At B = 1 both read the single-sequence tables (:meth:`verify`,
:meth:`draft_step`), so that batch-1 replay under load is the single-sequence replay exactly. A profile without the
axis still loads and serves B = 1; asked for B > 1 it raises one error naming its file and the flag to re-measure
with (:meth:`LatencyProfile.require_batch_axis`).

This module needs numpy only (the machine a profile was measured on is described by
:func:`eval.profile.machine_info`, which needs torch).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

PROFILE_FORMAT = "learn2draft-profile"
PROFILE_FORMAT_VERSION = 1
#: Where the shipped profiles live (package data of the engine, ``learn2draft/replay/profiles``): ``cpu-2core.json``
#: (measured) and ``gpu-like.json``.
SHIPPED_PROFILES_DIR = Path(__file__).resolve().parent / "profiles"
#: The terms of a drafter's ``batch_overhead_seconds`` (module docstring), one number per batch size each.
BATCH_OVERHEAD_TERMS = ("cycle_seconds", "step_seconds", "join_seconds")


def _ctx_weights(x: np.ndarray, xs: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Piecewise-linear interpolation weights over the increasing knots ``xs`` (k,) for points ``x`` (m,):
    value = (1 − w)·y[lo] + w·y[hi]. Constant below xs[0]; the last segment's slope above xs[-1] (w > 1)."""
    x = np.asarray(x, dtype=np.float64)
    k = xs.shape[0]
    if k == 1:
        z = np.zeros(x.shape, dtype=np.int64)
        return z, z, np.zeros(x.shape)
    hi = np.clip(np.searchsorted(xs, x, side="right"), 1, k - 1)
    lo = hi - 1
    w = (x - xs[lo]) / (xs[hi] - xs[lo])
    return lo, hi, np.maximum(w, 0.0)


@dataclass
class DrafterCost:
    """Per-drafter costs (seconds): ``step_contexts`` / ``step_seconds`` tabulate one draft step over context
    lengths; ``step_overhead_seconds`` per draft decision; ``cycle_overhead_seconds`` per cycle;
    ``tree_level`` (optional) one draft-tree level, ``{"contexts": [...], "seconds": [...], "width": W | None,
    "top_k": k | None}`` (None: the profile has none, tree costs fall back to the step cost); ``batch_step``
    (optional, the batch axis) one draft step of B rows together, ``{"batch_sizes": [...], "contexts": [...],
    "seconds": [[...per batch size...] ...per context...]}``; ``batch_overhead`` (optional) the real batched loop's
    per-step and per-join seconds beyond the tables, ``{"batch_sizes": [...], "cycle_seconds": [...],
    "step_seconds": [...], "join_seconds": [...]}`` (see the module docstring)."""

    step_contexts: list[float]
    step_seconds: list[float]
    step_overhead_seconds: float = 0.0
    cycle_overhead_seconds: float = 0.0
    extra: dict = field(default_factory=dict)
    tree_level: dict | None = None
    batch_step: dict | None = None  # {"batch_sizes": [...], "contexts": [...], "seconds": [[per B] per context]}
    batch_overhead: dict | None = None  # {"batch_sizes": [...], "cycle_seconds": [...], "step_seconds": [...], "join_seconds": [...]}


@dataclass
class LatencyProfile:
    """Costs of cycle parts on one machine (see the module docstring).

    Attributes:
        name: short name (``"cpu-2core"``).
        verify_tokens: token counts n (increasing, starting at 1) of the verify table.
        verify_contexts: context lengths c (increasing) of the verify table.
        verify_seconds: float (len(contexts), len(tokens)) seconds.
        drafters: per drafter name (``"model"``, ``"head"``, ``"lookup"``), its :class:`DrafterCost`.
        machine: the machine the numbers belong to (CPU/GPU model, cores, torch version, device, dtype, …).
        source: how the numbers were obtained (measured with which command, or hand-written from what).
        meta: every other top-level entry of the file (target, draft, notes, raw measurements).
        verify_batch: the batch axis of verification (see the module docstring), ``{"batch_sizes": [...],
            "tokens": [...], "contexts": [...], "seconds": (contexts, batch sizes, tokens)}``; None without it.
        prefill: ``{"tokens": [...], "seconds": [...]}``, one target forward over a prompt of n tokens after no cached
            token and the first token's probabilities (:meth:`prefill_seconds`); None without it.
        path: the file it was read from ("" when built in Python); named in errors, not written.
    """

    name: str
    verify_tokens: list[int]
    verify_contexts: list[float]
    verify_seconds: list[list[float]]
    drafters: dict[str, DrafterCost]
    machine: dict = field(default_factory=dict)
    source: str = ""
    meta: dict = field(default_factory=dict)
    verify_batch: dict | None = None
    prefill: dict | None = None
    path: str = field(default="", compare=False)

    def __post_init__(self):
        self.validate()

    # ------------------------------------------------------------------ checks
    def validate(self) -> None:
        """Raise ValueError with a clear message for a malformed profile."""
        n, c = np.asarray(self.verify_tokens, dtype=np.float64), np.asarray(self.verify_contexts, dtype=np.float64)
        rows = [len(r) for r in self.verify_seconds]
        if len(set(rows)) > 1:
            raise ValueError(f"Profile {self.name!r}: every verify seconds row needs one value per token count "
                             f"({len(self.verify_tokens)}); the rows have {rows} values.")
        s = np.asarray(self.verify_seconds, dtype=np.float64)
        if n.ndim != 1 or n.size == 0 or n[0] != 1 or np.any(np.diff(n) <= 0):
            raise ValueError(f"Profile {self.name!r}: verify tokens must be increasing and start at 1, got {self.verify_tokens}.")
        if c.ndim != 1 or c.size == 0 or np.any(np.diff(c) <= 0) or c[0] < 0:
            raise ValueError(f"Profile {self.name!r}: verify contexts must be increasing and ≥ 0, got {self.verify_contexts}.")
        if s.shape != (c.size, n.size):
            raise ValueError(f"Profile {self.name!r}: verify seconds must have shape (contexts, tokens) = "
                             f"({c.size}, {n.size}), got shape {s.shape}.")
        if not np.all(np.isfinite(s)) or np.any(s <= 0):
            bad = s[~(np.isfinite(s) & (s > 0))][0]
            raise ValueError(f"Profile {self.name!r}: verify seconds must be positive finite numbers, got {bad!r}.")
        if not self.drafters:
            raise ValueError(f"Profile {self.name!r} has no drafter costs.")
        for d, cost in self.drafters.items():
            xs, ys = np.asarray(cost.step_contexts, float), np.asarray(cost.step_seconds, float)
            if xs.ndim != 1 or xs.size == 0 or xs.shape != ys.shape or np.any(np.diff(xs) <= 0):
                raise ValueError(f"Profile {self.name!r}, drafter {d!r}: step contexts must be increasing and match "
                                 "step seconds in length.")
            vals = [*ys.tolist(), cost.step_overhead_seconds, cost.cycle_overhead_seconds]
            if cost.tree_level is not None:
                tl = cost.tree_level
                try:
                    tx, ty = np.asarray(tl["contexts"], float), np.asarray(tl["seconds"], float)
                except (KeyError, TypeError, ValueError):
                    raise ValueError(f"Profile {self.name!r}, drafter {d!r}: tree_level_seconds must be "
                                     '{"contexts": [...], "seconds": [...]} (optionally "width", "top_k").') from None
                if tx.ndim != 1 or tx.size == 0 or tx.shape != ty.shape or np.any(np.diff(tx) <= 0):
                    raise ValueError(f"Profile {self.name!r}, drafter {d!r}: tree_level_seconds contexts must be "
                                     "increasing and match its seconds in length.")
                vals += ty.tolist()
            if cost.batch_step is not None:
                vals += self._batch_table(cost.batch_step, f"drafter {d!r} batch_step_seconds", ()).reshape(-1).tolist()
            if not all(math.isfinite(v) and v >= 0 for v in vals):
                raise ValueError(f"Profile {self.name!r}, drafter {d!r}: costs must be finite seconds ≥ 0.")
            if cost.batch_overhead is not None:
                self._check_batch_overhead(d, cost.batch_overhead)
        if self.prefill is not None:
            try:
                pt = np.asarray(self.prefill["tokens"], dtype=np.float64)
                ps = np.asarray(self.prefill["seconds"], dtype=np.float64)
            except (KeyError, TypeError, ValueError):
                raise ValueError(f"Profile {self.name!r}: prefill must be {{'tokens': [...], 'seconds': [...]}}.") from None
            if pt.ndim != 1 or pt.size == 0 or pt.shape != ps.shape or pt[0] < 1 or np.any(np.diff(pt) <= 0) \
                    or np.any(pt != np.round(pt)) or not np.all(np.isfinite(ps) & (ps > 0)):
                raise ValueError(f"Profile {self.name!r}: prefill tokens must be increasing integers ≥ 1 with one "
                                 "positive number of seconds each.")
        if self.verify_batch is not None:
            vb = self._batch_table(self.verify_batch, "verify_batch", ("tokens",))
            if not np.all(vb > 0):
                raise ValueError(f"Profile {self.name!r}: verify_batch seconds must be positive finite numbers.")
            tok = np.asarray(self.verify_batch["tokens"], dtype=np.float64)
            if tok[0] != 1 or np.any(tok != np.round(tok)):
                raise ValueError(f"Profile {self.name!r}: verify_batch tokens must be integers starting at 1, got "
                                 f"{self.verify_batch['tokens']}.")

    def _check_batch_overhead(self, drafter: str, table: dict) -> None:
        """Raise ValueError unless ``table`` is a drafter's ``batch_overhead_seconds`` (module docstring): increasing
        integer batch sizes ≥ 2 and, for each of its three terms, one finite (signed) number of seconds per size."""
        what = f"Profile {self.name!r}, drafter {drafter!r}: batch_overhead_seconds"
        try:
            b = np.asarray(table["batch_sizes"], dtype=np.float64)
            terms = [np.asarray(table[k], dtype=np.float64) for k in BATCH_OVERHEAD_TERMS]
        except (KeyError, TypeError, ValueError):
            raise ValueError(f"{what} must be {{'batch_sizes': [...], " + ", ".join(f"{k!r}: [...]" for k in
                                                                              BATCH_OVERHEAD_TERMS) + "}.") from None
        if b.ndim != 1 or b.size == 0 or np.any(np.diff(b) <= 0) or b[0] < 2 or np.any(b != np.round(b)):
            raise ValueError(f"{what} batch_sizes must be increasing integers ≥ 2, got {table['batch_sizes']}.")
        for k, t in zip(BATCH_OVERHEAD_TERMS, terms):
            if t.shape != b.shape or not np.all(np.isfinite(t)):
                raise ValueError(f"{what} {k} must hold one finite number of seconds per batch size ({b.size}).")

    def _batch_table(self, table: dict, what: str, inner: tuple[str, ...]) -> np.ndarray:
        """``table["seconds"]`` as float64 (contexts, batch sizes, *inner axes), after checking its axes.

        Raises:
            ValueError: a missing axis, axes not increasing (batch sizes: integers ≥ 1), a shape that does not match
                them, or non-finite seconds.
        """
        axes = ("contexts", "batch_sizes", *inner)
        try:
            knots = [np.asarray(table[a], dtype=np.float64) for a in axes]
            secs = np.asarray(table["seconds"], dtype=np.float64)
        except (KeyError, TypeError, ValueError):
            raise ValueError(f"Profile {self.name!r}: {what} must be {{{', '.join(repr(a) + ': [...]' for a in axes)}, "
                             "'seconds': [...]} (see learn2draft.replay.latency).") from None
        for a, k in zip(axes, knots):
            if k.ndim != 1 or k.size == 0 or np.any(np.diff(k) <= 0) or k[0] < (1 if a == "batch_sizes" else 0):
                raise ValueError(f"Profile {self.name!r}: {what} {a} must be increasing"
                                 f"{' integers ≥ 1' if a == 'batch_sizes' else ' and ≥ 0'}, got {table[a]}.")
        b = knots[1]
        if np.any(b != np.round(b)):
            raise ValueError(f"Profile {self.name!r}: {what} batch_sizes must be integers, got {table['batch_sizes']}.")
        shape = tuple(k.size for k in knots)
        if secs.shape != shape:
            raise ValueError(f"Profile {self.name!r}: {what} seconds must have shape ({', '.join(axes)}) = {shape}, "
                             f"got shape {secs.shape}.")
        if not np.all(np.isfinite(secs)) or np.any(secs < 0):
            raise ValueError(f"Profile {self.name!r}: {what} seconds must be finite numbers ≥ 0.")
        return secs

    def cost(self, drafter: str) -> DrafterCost:
        """The costs of ``drafter``.

        Raises:
            ValueError: the profile has no costs for it.
        """
        if drafter not in self.drafters:
            raise ValueError(f"Profile {self.name!r} has no costs for the {drafter!r} drafter (it has "
                             f"{', '.join(self.drafters)}): measure them with `python -m eval.profile --drafter {drafter}`.")
        return self.drafters[drafter]

    # ------------------------------------------------------------------ costs
    def verify(self, tokens, context, extrapolate: bool = False) -> np.ndarray:
        """Seconds of one verification forward of ``tokens`` new tokens after ``context`` cached ones.

        Args:
            tokens: int or int array (m,), ≥ 1; ``context``: number or array broadcastable with it.
            extrapolate: allow token counts above the table, extended linearly with the steeper of the slope of its
                last two token counts and that of its upper half (from the middle token count to the last, over the
                table made monotone along tokens: a last median a little below its neighbour is noise, and a
                negative slope would price a long prompt's prefill below nothing); a tree verifying V = 64 nodes
                sends 65 tokens, a 1..64 table then needs one step past its end, and the replay under load prices a
                prefill of the whole prompt so when the profile has no prefill table.

        Returns:
            float64 array of the broadcast shape.

        Raises:
            ValueError: a token count below 1, or above the largest tabulated without ``extrapolate``.
        """
        n, c = np.broadcast_arrays(np.asarray(tokens, dtype=np.float64), np.asarray(context, dtype=np.float64))
        nmax = self.verify_tokens[-1]
        if n.size and (n.min() < 1 or (n.max() > nmax and not extrapolate)):
            raise ValueError(f"Profile {self.name!r} tabulates verification of 1..{nmax} tokens, asked for "
                             f"{int(n.min())}..{int(n.max())}: use a smaller max_depth or measure larger sizes.")
        s = np.asarray(self.verify_seconds, dtype=np.float64)  # (C, N)
        ns = np.asarray(self.verify_tokens, dtype=np.float64)
        flat_n, flat_c = n.reshape(-1), c.reshape(-1)

        by_ctx = np.stack([_along_tokens(row, ns, flat_n) for row in s])  # (C, m): interpolated in tokens
        lo, hi, w = _ctx_weights(flat_c, np.asarray(self.verify_contexts, dtype=np.float64))
        cols = np.arange(flat_n.shape[0])
        out = (1 - w) * by_ctx[lo, cols] + w * by_ctx[hi, cols]
        return out.reshape(n.shape)

    def prefill_seconds(self, tokens: int) -> float:
        """Seconds of the prefill of a prompt of ``tokens`` tokens (one target forward after no cached token and the
        first token's draw): the ``prefill`` table (linear between its lengths, the first value below them, the
        slope of its last two lengths over the monotone table above them); without it, :meth:`verify` of the
        whole prompt after no context, extrapolated past its table.

        Raises:
            ValueError: ``tokens`` < 1.
        """
        n = int(tokens)
        if n < 1:
            raise ValueError(f"A prompt has at least 1 token, got {tokens!r}.")
        if self.prefill is None:
            return float(self.verify(n, 0.0, extrapolate=True))
        ns = np.asarray(self.prefill["tokens"], dtype=np.float64)
        ys = np.maximum.accumulate(np.asarray(self.prefill["seconds"], dtype=np.float64))
        if n <= ns[-1] or ns.size == 1:
            return float(np.interp(float(n), ns, ys))
        return float(ys[-1] + (n - ns[-1]) * (ys[-1] - ys[-2]) / (ns[-1] - ns[-2]))

    def draft_step(self, drafter: str, context) -> np.ndarray:
        """Seconds of one draft step of ``drafter`` at ``context`` committed tokens (number or array)."""
        cost = self.cost(drafter)
        c = np.asarray(context, dtype=np.float64)
        ys = np.asarray(cost.step_seconds, dtype=np.float64)
        lo, hi, w = _ctx_weights(c.reshape(-1), np.asarray(cost.step_contexts, dtype=np.float64))
        return ((1 - w) * ys[lo] + w * ys[hi]).reshape(c.shape)

    # ------------------------------------------------------------------ the batch axis
    def _overhead_term(self, drafter: str, term: str, batch_size: int) -> float:
        bo = self.cost(drafter).batch_overhead
        if bo is None or int(batch_size) <= 1:
            return 0.0
        return float(np.interp(float(batch_size), [1.0, *map(float, bo["batch_sizes"])], [0.0, *map(float, bo[term])]))

    def batch_overhead(self, drafter: str, batch_size: int, depth: int) -> float:
        """Seconds the real batched loop spends in a step of ``batch_size`` rows whose longest draft is ``depth``
        tokens beyond the table terms (``cycle_seconds[B] + step_seconds[B] · depth`` of the drafter's
        ``batch_overhead_seconds``, module docstring); linear in B from 0 at B = 1, constant above the largest size;
        0 without the entry. Signed.

        Raises:
            ValueError: an unknown drafter.
        """
        return (self._overhead_term(drafter, "cycle_seconds", batch_size)
                + int(depth) * self._overhead_term(drafter, "step_seconds", batch_size))

    def join_overhead(self, drafter: str, batch_size: int) -> float:
        """Seconds a request joining a batch of ``batch_size`` rows (itself included) costs the real loop beyond the
        prefill the replay charges (``join_seconds`` of the drafter's ``batch_overhead_seconds``; interpolated as
        :meth:`batch_overhead`; 0 without it). Signed.

        Raises:
            ValueError: an unknown drafter.
        """
        return self._overhead_term(drafter, "join_seconds", batch_size)

    def step_batched(self, drafter: str, batch_size: int, depth: int, context: float,
                     verified: int | None = None) -> tuple[float, float, float]:
        """(draft, verify, other) seconds of one batched step of ``batch_size`` rows whose longest draft is ``depth``,
        ``verified`` drafted tokens over all rows, at batch context ``context`` — the one formula of
        :mod:`learn2draft.replay.serve`::

            draft = d · draft_step_batched(B, c);  verify = verify_batched(B, 1 + verified / B, c)
            other = cycle_overhead + d · step_overhead + batch_overhead(B, d)   (at least −draft: a step costs at
                                                                                  least its verification)

        (the single-sequence overheads once per step, not per row). The verification is ragged, as
        :class:`learn2draft.batched.BatchedSpeculativeDecoder` runs it: B + ``verified`` packed tokens, priced as B rows
        of their mean length (the table's B rows × n tokens, n interpolated); drafting is lockstep, so its cost follows
        the longest draft. ``verified`` None: every row padded to the longest (B × (d + 1) tokens).

        Raises:
            ValueError: as :meth:`verify_batched` and :meth:`draft_step_batched`.
        """
        d = int(depth)
        cost = self.cost(drafter)
        draft = d * float(self.draft_step_batched(drafter, batch_size, context)) if d else 0.0
        per_row = d + 1 if verified is None or batch_size == 1 else 1 + min(int(verified), batch_size * d) / batch_size
        verify = float(self.verify_batched(batch_size, per_row, context))
        other = cost.cycle_overhead_seconds + d * cost.step_overhead_seconds + self.batch_overhead(drafter, batch_size, d)
        return draft, verify, max(other, -draft)

    @property
    def has_batch_axis(self) -> bool:
        """Whether the profile holds the batch axis of verification (``verify_batch``; see the module docstring)."""
        return self.verify_batch is not None

    @property
    def max_batch_size(self) -> int:
        """The largest batch size the profile tabulates (1 without the batch axis)."""
        return int(self.verify_batch["batch_sizes"][-1]) if self.verify_batch is not None else 1

    def require_batch_axis(self, batch_size: int, drafter: str | None = None) -> None:
        """Check that the profile can cost a step of ``batch_size`` rows (and, with ``drafter``, that drafter's
        batched draft step).

        Raises:
            ValueError: ``batch_size`` < 1; > 1 on a profile without the batch axis (the message names the profile's
                file and the flag to re-measure it with); above the largest tabulated batch size.
        """
        if batch_size < 1:
            raise ValueError(f"Batch size must be ≥ 1, got {batch_size}.")
        if batch_size == 1:
            return
        if (self.verify_batch is not None and batch_size <= self.max_batch_size
                and (drafter is None or self.cost(drafter).batch_step is not None)):
            return  # the per-step path: no message is built (it resolves a path, ~0.3 ms per step in the batched loop)
        where = f" ({self.path})" if self.path else ""
        # a shipped profile is not overwritten in the package: measure into runs/ and pass that file
        shipped = bool(self.path) and Path(self.path).resolve().parent == SHIPPED_PROFILES_DIR
        out = f"runs/{self.name}-batched.json" if shipped or not self.path else self.path
        then = f" and pass --profile {out}" if out != self.path else ""

        def flag(extra: str = "") -> str:
            return f"`python -m eval.profile --batch-sizes 1,2,4,8,16{extra} --out {out}`{then}"

        if self.verify_batch is None:
            raise ValueError(f"Profile {self.name!r}{where} has no batch axis (verification and draft costs per batch "
                             f"size), needed for a batch of {batch_size} rows: re-measure it with {flag()}.")
        if drafter is not None and self.cost(drafter).batch_step is None:
            raise ValueError(f"Profile {self.name!r}{where} has no batched draft cost of the {drafter!r} drafter "
                             f"(batch_step_seconds), needed for a batch of {batch_size} rows: re-measure it with "
                             f"{flag(' --drafter ' + drafter)}.")
        if batch_size > self.max_batch_size:
            raise ValueError(f"Profile {self.name!r}{where} tabulates batches of up to {self.max_batch_size} rows, asked "
                             f"for {batch_size}: lower the concurrency (max_batch) or measure larger sizes with "
                             f"`python -m eval.profile --batch-sizes ...`.")

    def verify_batched(self, batch_size: int, tokens, context, extrapolate: bool = False) -> np.ndarray:
        """Seconds of one batched verification forward: ``batch_size`` rows of ``tokens`` new tokens each (rows padded
        to one length: B·tokens batched tokens) after ``context`` cached tokens per row.

        B = 1 is :meth:`verify` (the single-sequence table), exactly. B > 1 reads ``verify_batch``: linear in B
        between the tabulated batch sizes, linear in tokens over the table made monotone along tokens (a running
        maximum), in context as :meth:`verify` (constant below the smallest, the last slope above the largest).

        Args:
            batch_size: rows B (int ≥ 1); ``tokens``: int or int array (m,) ≥ 1, new tokens per row; ``context``:
                number or array broadcastable with it.
            extrapolate: allow token counts above the table (linear, as :meth:`verify`).

        Returns:
            float64 array of the broadcast shape (seconds), non-decreasing in ``tokens`` for B > 1 (B = 1 is the
            single-sequence table as measured).

        Raises:
            ValueError: B > 1 without the batch axis or above its largest size (:meth:`require_batch_axis`); a token
                count below 1 or above the table without ``extrapolate``.
        """
        B = int(batch_size)
        self.require_batch_axis(B)
        if B == 1:
            return self.verify(tokens, context, extrapolate=extrapolate)
        vb = self.verify_batch
        n, c = np.broadcast_arrays(np.asarray(tokens, dtype=np.float64), np.asarray(context, dtype=np.float64))
        ns = np.asarray(vb["tokens"], dtype=np.float64)
        if n.size and (n.min() < 1 or (n.max() > ns[-1] and not extrapolate)):
            raise ValueError(f"Profile {self.name!r} tabulates batched verification of 1..{int(ns[-1])} tokens per row, "
                             f"asked for {int(n.min())}..{int(n.max())}: use a smaller max_depth or measure larger "
                             "sizes (python -m eval.profile --tokens).")
        secs = np.maximum.accumulate(np.asarray(vb["seconds"], dtype=np.float64), axis=2)  # (C, B, N), monotone in n
        at_b = _along(secs, np.asarray(vb["batch_sizes"], dtype=np.float64), float(B), axis=1)  # (C, N)
        flat_n, flat_c = n.reshape(-1), c.reshape(-1)
        by_ctx = np.stack([_along_tokens(row, ns, flat_n) for row in at_b])  # (C, m)
        lo, hi, w = _ctx_weights(flat_c, np.asarray(vb["contexts"], dtype=np.float64))
        cols = np.arange(flat_n.shape[0])
        return ((1 - w) * by_ctx[lo, cols] + w * by_ctx[hi, cols]).reshape(n.shape)

    def draft_step_batched(self, drafter: str, batch_size: int, context) -> np.ndarray:
        """Seconds of one draft step of ``drafter`` for ``batch_size`` rows together at ``context`` committed tokens
        per row (number or array): :meth:`draft_step` at B = 1, exactly; else ``batch_step_seconds``, linear in B
        between tabulated sizes and in context as :meth:`draft_step`.

        Raises:
            ValueError: an unknown drafter; B > 1 without the batch axis, without the drafter's batched step cost, or
                above the largest tabulated batch size (:meth:`require_batch_axis`).
        """
        B = int(batch_size)
        self.require_batch_axis(B, drafter)
        if B == 1:
            return self.draft_step(drafter, context)
        bs = self.cost(drafter).batch_step
        at_b = _along(np.asarray(bs["seconds"], dtype=np.float64), np.asarray(bs["batch_sizes"], dtype=np.float64),
                      float(B), axis=1)  # (C,)
        c = np.asarray(context, dtype=np.float64)
        lo, hi, w = _ctx_weights(c.reshape(-1), np.asarray(bs["contexts"], dtype=np.float64))
        return ((1 - w) * at_b[lo] + w * at_b[hi]).reshape(c.shape)

    def has_tree_level(self, drafter: str) -> bool:
        """Whether ``drafter`` has a measured (or stated) ``tree_level_seconds``; if not, :meth:`tree_level` falls
        back to its chain draft step.

        Raises:
            ValueError: the profile has no costs for ``drafter``.
        """
        return self.cost(drafter).tree_level is not None

    def tree_level(self, drafter: str, context) -> np.ndarray:
        """Seconds of one draft-tree level of ``drafter`` (the drafter's forward over the W frontier nodes plus the
        top-k) at ``context`` committed tokens (number or array), interpolated like :meth:`draft_step`; without
        ``tree_level_seconds`` in the profile, the chain draft step (:meth:`draft_step`).

        Raises:
            ValueError: the profile has no costs for ``drafter``.
        """
        cost = self.cost(drafter)
        if cost.tree_level is None:
            return self.draft_step(drafter, context)
        c = np.asarray(context, dtype=np.float64)
        ys = np.asarray(cost.tree_level["seconds"], dtype=np.float64)
        lo, hi, w = _ctx_weights(c.reshape(-1), np.asarray(cost.tree_level["contexts"], dtype=np.float64))
        return ((1 - w) * ys[lo] + w * ys[hi]).reshape(c.shape)

    def tree_cycle_seconds(self, drafter: str, context, depth, verified) -> np.ndarray:
        """Seconds of a draft-tree cycle: ``depth · (tree_level(c) + step_overhead) + verify(verified + 1, c) +
        cycle_overhead`` (see the module docstring); ``depth`` = levels drafted, ``verified`` = drafted nodes sent
        to the target (the root comes along). Verification above the table's largest token count is extrapolated
        linearly (:meth:`verify`).

        Args:
            drafter: its costs are used; ``context``, ``depth``, ``verified``: numbers or broadcastable arrays.

        Returns:
            float64 array of the broadcast shape.

        Raises:
            ValueError: unknown drafter, negative depth or verified count.
        """
        c, d, v = np.broadcast_arrays(np.asarray(context, dtype=np.float64), np.asarray(depth, dtype=np.float64),
                                      np.asarray(verified, dtype=np.float64))
        if d.size and (d.min() < 0 or v.min() < 0):
            raise ValueError("Tree depth and verified node count must be ≥ 0.")
        cost = self.cost(drafter)
        return (d * (self.tree_level(drafter, c) + cost.step_overhead_seconds) + self.verify(v + 1, c, extrapolate=True)
                + cost.cycle_overhead_seconds)

    def cycle_table(self, drafter: str, contexts, max_depth: int) -> dict[str, np.ndarray]:
        """The cost of every depth at every context, for fast replay.

        Args:
            drafter: its costs are used; ``contexts``: int (m,) committed tokens; ``max_depth``: d = 0..max_depth.

        Returns:
            ``{"draft": , "verify": , "other": , "total": }``, each float64 (m, max_depth + 1) seconds.

        Raises:
            ValueError: unknown drafter, or max_depth + 1 beyond the verify table.
        """
        c = np.asarray(contexts, dtype=np.float64).reshape(-1)
        d = np.arange(max_depth + 1, dtype=np.float64)
        cost = self.cost(drafter)
        verify = self.verify(d[None, :] + 1, c[:, None])
        draft = self.draft_step(drafter, c)[:, None] * d[None, :]
        other = cost.cycle_overhead_seconds + cost.step_overhead_seconds * np.broadcast_to(d, (c.size, d.size))
        return {"draft": draft, "verify": verify, "other": other, "total": draft + verify + other}

    def relative_verify_cost(self, tokens=(2, 4, 8, 16, 32, 64), context: float | None = None) -> dict[int, float]:
        """verify(n) / verify(1) at ``context`` (default: the first tabulated one), for n within the table."""
        c = self.verify_contexts[0] if context is None else context
        one = float(self.verify(1, c))
        return {int(n): float(self.verify(n, c)) / one for n in tokens if n <= self.verify_tokens[-1]}

    # ------------------------------------------------------------------ files
    def to_dict(self) -> dict:
        return {
            "format": PROFILE_FORMAT, "format_version": PROFILE_FORMAT_VERSION, "name": self.name,
            "source": self.source, "machine": self.machine, **self.meta,
            "verify": {"tokens": list(self.verify_tokens), "contexts": list(self.verify_contexts),
                       "seconds": [list(map(float, r)) for r in self.verify_seconds]},
            "drafters": {k: {"step_seconds": {"contexts": list(v.step_contexts), "seconds": list(map(float, v.step_seconds))},
                             "step_overhead_seconds": float(v.step_overhead_seconds),
                             "cycle_overhead_seconds": float(v.cycle_overhead_seconds),
                             **({"tree_level_seconds": dict(v.tree_level)} if v.tree_level is not None else {}),
                             **({"batch_step_seconds": dict(v.batch_step)} if v.batch_step is not None else {}),
                             **({"batch_overhead_seconds": dict(v.batch_overhead)}
                                if v.batch_overhead is not None else {}),
                             **v.extra}
                         for k, v in self.drafters.items()},
            **({"verify_batch": dict(self.verify_batch)} if self.verify_batch is not None else {}),
            **({"prefill": dict(self.prefill)} if self.prefill is not None else {}),
        }

    def save(self, path: str | Path) -> Path:
        """Write the profile as indented JSON to ``path``."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(self.to_dict(), indent=2) + "\n")
        return path

    @classmethod
    def from_dict(cls, data: dict, where: str = "profile") -> LatencyProfile:
        """Build from the JSON structure of the module docstring.

        Raises:
            ValueError: wrong format / version (``format_version`` must be the integer), a missing entry, or bad numbers
                (strings such as ``"0.01"`` included; the message names ``where``).
        """
        if not isinstance(data, dict) or data.get("format") != PROFILE_FORMAT:
            raise ValueError(f"{where} is not a learn2draft latency profile (format {data.get('format') if isinstance(data, dict) else None!r}, "
                             f"expected {PROFILE_FORMAT!r}): write one with `python -m eval.profile`.")
        version = data.get("format_version")
        if isinstance(version, bool) or not isinstance(version, int):
            raise ValueError(f"{where}: format_version must be the integer {PROFILE_FORMAT_VERSION}, got {version!r} "
                             "(a hand-edited file?).")
        if version != PROFILE_FORMAT_VERSION:
            raise ValueError(f"{where}: profile format version {version}, this learn2draft reads "
                             f"version {PROFILE_FORMAT_VERSION}: measure the profile again with `python -m eval.profile`.")
        try:
            v = data["verify"]
            drafters = {}
            for k, d in data["drafters"].items():
                extra = {kk: vv for kk, vv in d.items()
                         if kk not in ("step_seconds", "step_overhead_seconds", "cycle_overhead_seconds",
                                       "tree_level_seconds", "batch_step_seconds", "batch_overhead_seconds")}
                tl = d.get("tree_level_seconds")
                if tl is not None and not isinstance(tl, dict):
                    raise TypeError("'tree_level_seconds' must be an object")
                if tl is not None:
                    tl = {**tl, **{key: _numbers(tl[key], f"drafter {k!r} tree_level_seconds {key}", where)
                                   for key in ("contexts", "seconds") if key in tl}}
                bst = d.get("batch_step_seconds")
                if bst is not None:
                    bst = _batch_numbers(bst, f"drafter {k!r} batch_step_seconds", where, ())
                bov = d.get("batch_overhead_seconds")
                if bov is not None:
                    if not isinstance(bov, dict):
                        raise TypeError("'batch_overhead_seconds' must be an object")
                    missing = [key for key in ("batch_sizes", *BATCH_OVERHEAD_TERMS) if key not in bov]
                    if missing:
                        raise ValueError(f"{where}: drafter {k!r} batch_overhead_seconds lacks {', '.join(missing)} "
                                         "(see learn2draft.replay.latency).")
                    bov = {**bov, **{key: _numbers(bov[key], f"drafter {k!r} batch_overhead_seconds {key}", where,
                                                   integer=key == "batch_sizes")
                                     for key in ("batch_sizes", *BATCH_OVERHEAD_TERMS)}}
                # Every cost is required: a missing (or misspelt) one would silently be a free operation.
                step = d["step_seconds"]
                drafters[k] = DrafterCost(_numbers(step["contexts"], f"drafter {k!r} step_seconds contexts", where),
                                          _numbers(step["seconds"], f"drafter {k!r} step_seconds seconds", where),
                                          *_numbers([d["step_overhead_seconds"], d["cycle_overhead_seconds"]],
                                                    f"drafter {k!r} step/cycle overhead seconds", where),
                                          extra, tl, bst, bov)
            vb = data.get("verify_batch")
            if vb is not None:
                vb = _batch_numbers(vb, "verify_batch", where, ("tokens",))
            pf = data.get("prefill")
            if pf is not None:
                if not isinstance(pf, dict):
                    raise TypeError("'prefill' must be an object")
                if "tokens" not in pf or "seconds" not in pf:
                    raise ValueError(f"{where}: prefill must be {{'tokens': [...], 'seconds': [...]}}.")
                pf = {**pf, "tokens": _numbers(pf["tokens"], "prefill tokens", where, integer=True),
                      "seconds": _numbers(pf["seconds"], "prefill seconds", where)}
            known = {"format", "format_version", "name", "source", "machine", "verify", "drafters", "verify_batch",
                     "prefill"}
            return cls(name=str(data.get("name", Path(where).stem)),
                       verify_tokens=[int(x) for x in _numbers(v["tokens"], "verify tokens", where, integer=True)],
                       verify_contexts=_numbers(v["contexts"], "verify contexts", where),
                       verify_seconds=[_numbers(r, f"verify seconds row {i}", where) for i, r in enumerate(v["seconds"])],
                       drafters=drafters, machine=dict(data.get("machine", {})), source=str(data.get("source", "")),
                       meta={k: val for k, val in data.items() if k not in known}, verify_batch=vb, prefill=pf,
                       path=where if where != "profile" else "")
        except ValueError as e:  # validate()'s messages name the profile; name the file too
            if where != "profile" and not str(e).startswith(where):
                raise ValueError(f"{where}: {e}") from None
            raise
        except (KeyError, TypeError, AttributeError) as e:
            raise ValueError(f"{where}: malformed profile (missing or wrong entry {e}); see learn2draft.replay.latency for the "
                             "format, or write one with `python -m eval.profile`.") from None


def _numbers(values, what: str, where: str, integer: bool = False) -> list[float]:
    """``values`` (a JSON list) as floats, refusing anything but JSON numbers (a string such as ``"0.01"``, a boolean,
    null), integers only with ``integer``.

    Raises:
        ValueError: naming ``where`` and ``what``.
    """
    if not isinstance(values, list):
        raise ValueError(f"{where}: {what} must be a list of numbers, got {values!r}.")
    for x in values:
        if isinstance(x, bool) or not isinstance(x, (int, float)) or (integer and not float(x).is_integer()):
            kind = "integers" if integer else "numbers"
            raise ValueError(f"{where}: {what} must be {kind} (JSON numbers, not strings), got {x!r}.")
    return [float(x) for x in values]


def _batch_numbers(table, what: str, where: str, inner: tuple[str, ...]) -> dict:
    """A batch-axis table of a profile file (``verify_batch`` or a drafter's ``batch_step_seconds``) with its axes and
    seconds as JSON numbers only (:func:`_numbers`); the shapes are checked by :meth:`LatencyProfile.validate`.

    Raises:
        ValueError: not an object, or a missing axis or a non-number (naming ``where`` and ``what``).
    """
    if not isinstance(table, dict):
        raise ValueError(f"{where}: {what} must be an object with contexts, batch_sizes{', tokens' if inner else ''} "
                         "and seconds.")
    out = dict(table)
    for a in ("contexts", "batch_sizes", *inner):
        out[a] = _numbers(table[a], f"{what} {a}", where, integer=a != "contexts")
    secs = table["seconds"]
    if not isinstance(secs, list):
        raise ValueError(f"{where}: {what} seconds must be a nested list of numbers.")
    if inner:
        if not all(isinstance(per_ctx, list) for per_ctx in secs):
            raise ValueError(f"{where}: {what} seconds must be a list (per context) of lists (per batch size) of "
                             "numbers (per token count).")
        out["seconds"] = [[_numbers(r, f"{what} seconds", where) for r in per_ctx] for per_ctx in secs]
    else:
        out["seconds"] = [_numbers(r, f"{what} seconds", where) for r in secs]
    return out


def _along_tokens(row: np.ndarray, ns: np.ndarray, n: np.ndarray) -> np.ndarray:
    """Seconds ``row`` (float (N,), tabulated at token counts ``ns``) at token counts ``n`` (float (m,)): linear
    between them; above the last, linear from the monotone table's last value (a running maximum) with the steeper
    of two slopes, the last two token counts' (the rule of earlier versions) and the upper half's of the monotone
    table (middle token count to the last), so never below the last value even where the last median dips."""
    y = np.interp(n, ns, row)
    above = n > ns[-1]
    if ns.size > 1 and above.any():
        mono, mid = np.maximum.accumulate(row), (ns.size - 1) // 2
        slope = max((mono[-1] - mono[mid]) / (ns[-1] - ns[mid]), (row[-1] - row[-2]) / (ns[-1] - ns[-2]))
        y[above] = mono[-1] + (n[above] - ns[-1]) * slope
    return y


def _along(values: np.ndarray, knots: np.ndarray, x: float, axis: int) -> np.ndarray:
    """``values`` linearly interpolated at ``x`` along ``axis`` over the increasing ``knots`` (``x`` within them)."""
    v = np.moveaxis(values, axis, 0)
    if knots.size == 1 or x <= knots[0]:
        return v[0]
    hi = int(min(np.searchsorted(knots, x, side="left"), knots.size - 1))
    lo = hi - 1
    w = (x - knots[lo]) / (knots[hi] - knots[lo])
    return (1 - w) * v[lo] + w * v[hi]


def load_profile(path: str | Path) -> LatencyProfile:
    """Read a profile JSON file. A bare name (``cpu-2core``, ``gpu-like``) means a shipped profile in
    :data:`SHIPPED_PROFILES_DIR`.

    Raises:
        FileNotFoundError: no such file or shipped profile.
        ValueError: not a valid profile (see :meth:`LatencyProfile.from_dict`).
    """
    p = Path(path)
    if "," in str(path) and not p.is_file():
        raise ValueError(f"{path!r}: one latency profile here (a file or a shipped name: cpu-2core, gpu-like), not a "
                         "comma-separated list; only `python -m train --replay … --profile A,B` takes several.")
    if not p.is_file() and len(p.parts) == 1 and (SHIPPED_PROFILES_DIR / f"{p.name}.json").is_file():
        p = SHIPPED_PROFILES_DIR / f"{p.name}.json"  # a shipped name (``h200-llama-3.1-8b`` has dots: no suffix test)
    if not p.is_file():
        shipped = sorted(x.stem for x in SHIPPED_PROFILES_DIR.glob("*.json"))
        raise FileNotFoundError(f"No latency profile at {path} (shipped: {', '.join(shipped) or 'none'}): measure one with "
                                "`python -m eval.profile --out FILE`.")
    try:
        data = json.loads(p.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{p}: not valid JSON ({e.msg}).") from None
    return LatencyProfile.from_dict(data, str(p))


def load_profiles(profiles) -> list[LatencyProfile]:
    """One or several profiles: a :class:`LatencyProfile`, a file or shipped name, several of them joined by
    commas (``"cpu-2core,gpu-like"``), or a list of any of these.

    Returns:
        the profiles, in the order given.

    Raises:
        FileNotFoundError / ValueError: as :func:`load_profile`; ValueError for an empty list, an empty item
            between commas (``"cpu-2core,,gpu-like"``) or the same profile name twice (replay tells profiles apart by
            name).
    """
    from learn2draft.cli import comma_items

    items = [profiles] if isinstance(profiles, (LatencyProfile, Path)) else (
        comma_items(profiles, "profiles", "join the profiles with single commas, e.g. cpu-2core,gpu-like")
        if isinstance(profiles, str) else list(profiles))
    out = []
    for item in items:
        if isinstance(item, str):
            item = item.strip()
            if not item:
                continue
        out.append(item if isinstance(item, LatencyProfile) else load_profile(item))
    if not out:
        raise ValueError(f"No latency profile in {profiles!r}: name a file or a shipped profile (cpu-2core, gpu-like).")
    names = [p.name for p in out]
    if len(set(names)) < len(names):
        raise ValueError(f"The profiles {names} repeat a name: give each profile once (rename a measured one with "
                         "`python -m eval.profile --name`).")
    return out


__all__ = ["PROFILE_FORMAT", "PROFILE_FORMAT_VERSION", "SHIPPED_PROFILES_DIR", "DrafterCost", "LatencyProfile",
           "load_profile", "load_profiles"]
