"""Replaying a hybrid drafter (prompt lookup + a neural drafter, the source chosen per token) from two chain traces.

At temperature 0 the committed text is the target's greedy output whatever the drafting, and a drafted token is
accepted exactly when every earlier one of its cycle was and it equals the greedy token. A hybrid cycle starting at
position t (t tokens generated) that drafts token j with source s therefore has that token accepted iff tokens < j
were and source s proposes ``g[t+j]`` after ``prompt + g[:t+j]``. Two chain traces of the same prompts (one per
source, :mod:`learn2draft.replay.traces`, ``python -m eval.record --drafter lookup`` and ``--drafter model|head``)
give that for every (t, j):

* **lookup** — deterministic and a function of the sequence only: its proposal at depth j of a cycle from t is its
  depth-0 proposal at row t + j (exact);
* **draft model** — a language model conditioned on the sequence: likewise its depth-0 row t + j (exact up to
  floating-point near-ties between differently batched forwards);
* **head** — its state also depends on where the cycle started (true target features up to t, its own predicted
  features after): exact from its own chain at row t when that chain followed the greedy tokens up to j − 1 (the
  head then saw the same inputs as in the hybrid cycle); otherwise from the latest row t' in (t, t + j] whose chain
  did (the fewest predicted-feature steps that the trace holds) — an approximation, stated in the env's info.

Where the two recordings' greedy outputs part (a bf16 near-tie broken differently by differently batched
forwards), the prompt is replayed up to that position only (:func:`agreed_length`).

Costs, from a latency profile (:mod:`learn2draft.replay.latency`) at context c = prompt + t: a lookup token costs
``draft_step("lookup", c) + step_overhead("lookup")``; a neural token ``draft_step(neural, c) + step_overhead(neural)``,
and a head that follows k lookup tokens first runs its layer over them (k more head steps; a draft model feeds them
in the same forward, no extra step); verification ``verify(d + 1, c)``; the cycle overhead is the neural drafter's
when it drafted this cycle, else the lookup's.

What a replay cannot know after a wrong token (lookup's availability and the features on a prefix that is not the
greedy one) is read at the greedy prefix; those tokens are rejected whatever happens, so only their cost and the
decisions about them are approximate. Numpy only.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from learn2draft.replay.latency import LatencyProfile
from learn2draft.replay.traces import PromptTrace, TraceSet, load_traces

#: Hybrid replays are exact at temperature 0 only (a sampled trajectory's acceptance of a mixed chain is not recorded).
HYBRID_T_POSITIVE_REFUSAL = ("Hybrid drafters replay from temperature-0 traces only: at T > 0 a mixed chain's acceptance "
                             "depends on draws the single-drafter traces do not hold. Record with --temperature 0.")


def split_hybrid_traces(traces: Sequence[str | Path] | str) -> tuple[TraceSet, TraceSet]:
    """Load trace files and split them by drafter: the lookup traces and the neural (model or head) traces, each in the
    order given (several files of one drafter are concatenated, as :func:`learn2draft.replay.traces.load_traces` does).

    Raises:
        ValueError: not exactly one neural drafter besides lookup, a drafter missing, T > 0 traces, the two sets
            holding different prompts (the message names what to record), or an empty item between commas.
    """
    from learn2draft.cli import comma_items

    paths = (comma_items(traces, "trace files", "join the trace files with single commas, e.g. lookup.npz,model.npz")
             if isinstance(traces, str) else [p for p in map(str, traces) if p])
    groups: dict[str, list[str]] = {}
    for p in paths:
        groups.setdefault(load_traces(p).drafter, []).append(p)
    neural = sorted(set(groups) - {"lookup"})
    if "lookup" not in groups or len(neural) != 1:
        raise ValueError(f"A hybrid drafter replays from lookup traces and the traces of ONE neural drafter (model or "
                         f"head), got traces of {sorted(groups) or 'nothing'}: record both with python -m eval.record "
                         "--drafter lookup and --drafter model (or head) on the same prompts, then pass them joined "
                         "by commas.")
    return check_hybrid_traces(load_traces(groups["lookup"]), load_traces(groups[neural[0]]))


def check_hybrid_traces(look: TraceSet, neu: TraceSet) -> tuple[TraceSet, TraceSet]:
    """Check that ``look`` (prompt lookup's traces) and ``neu`` (one neural drafter's) can replay a hybrid drafter
    together, and return them.

    Raises:
        ValueError: ``look`` is not lookup's or ``neu`` not a neural drafter's, T > 0 traces, the two recorded with
            different settings or holding a different number of prompts (the message names what to record).
    """
    if look.drafter != "lookup" or neu.drafter not in ("model", "head"):
        raise ValueError(f"A hybrid replay takes (lookup traces, model or head traces), got ({look.drafter!r}, "
                         f"{neu.drafter!r}) traces.")
    neural = [neu.drafter]
    for ts in (look, neu):
        if not ts.deterministic:
            raise ValueError(HYBRID_T_POSITIVE_REFUSAL)
    for key in ("target", "dtype", "sampling", "max_new_tokens", "chat"):
        a, b = look.header.get(key), neu.header.get(key)
        if a is not None and b is not None and a != b:
            raise ValueError(f"The lookup traces and the {neural[0]} traces were recorded with different {key} ({a!r} vs "
                             f"{b!r}): record both with the same settings (python -m eval.record).")
    if len(look) != len(neu):
        raise ValueError(f"The lookup traces hold {len(look)} prompts and the {neural[0]} traces {len(neu)}: record both "
                         "on the same prompts in the same order.")
    return look, neu


@dataclass
class HybridReplay:
    """Every per-token source decision's outcome and cost along one replayed greedy generation.

    Rows t = 0..n (row 0 unused: the prefill emits the first token), depth columns j = 0..D − 1.

    Attributes:
        n: tokens generated in this replay; ``eos``: it ends with EOS.
        limit: int64 (n+1,), the most tokens a cycle at t may draft (``max_depth`` and the tokens left).
        look_avail, look_ok: bool (n+1,), lookup has a proposal at position t / it is the greedy token.
        look_conf: float64 (n+1,), its confidence; ``look_feats``: float32 (n+1, 2), (match_len, match_count).
        look_chain: float64 (n+1, D), the confidences of the lookup chain from row t (NaN past it): its lookahead.
        neural_ok: bool (n+1, D), the neural token at depth j of a cycle from t is the greedy one.
        neural_conf, neural_ent: float64 (n+1, D), its raw confidence and entropy (nats).
        approx: bool (n+1, D), ``neural_ok`` there is the head approximation of the module docstring.
        look_step, neural_step: float64 (n+1,), seconds of one draft token (step overhead included) at row t.
        verify: float64 (n+1, D+1), seconds of verifying d tokens at row t.
        look_cycle, neural_cycle: cycle overheads (seconds) of a lookup-only / a neural-using cycle.
        head: the neural drafter is a head (catch-up steps cost).
        target: float32 (n+1, 3), the target's (top-1, entropy, margin) at the last committed token (zeros without).
    """

    n: int
    eos: bool
    limit: np.ndarray
    look_avail: np.ndarray
    look_ok: np.ndarray
    look_conf: np.ndarray
    look_feats: np.ndarray
    look_chain: np.ndarray
    neural_ok: np.ndarray
    neural_conf: np.ndarray
    neural_ent: np.ndarray
    approx: np.ndarray
    look_step: np.ndarray
    neural_step: np.ndarray
    verify: np.ndarray
    look_cycle: float
    neural_cycle: float
    head: bool
    target: np.ndarray

    def token(self, t: int, j: int, source: int) -> tuple[int, bool]:
        """The source that actually drafts token j of a cycle from t when ``source`` (0 lookup, 1 neural) is asked
        (lookup without a proposal falls back to the neural drafter, as :class:`HybridDrafter` does), and whether its
        token is the greedy one."""
        if source == 0 and self.look_avail[t + j]:
            return 0, bool(self.look_ok[t + j])
        return 1, bool(self.neural_ok[t, j])

    def draft_seconds(self, t: int, source: int, since_neural: int) -> float:
        """Seconds of one draft token at row t: ``since_neural`` lookup tokens precede it since the neural drafter
        last ran this cycle (a head runs its layer over them first)."""
        if source == 0:
            return float(self.look_step[t])
        return float(self.neural_step[t]) * (1 + (since_neural if self.head else 0))

    def cycle_seconds(self, t: int, depth: int, used_neural: bool, draft_seconds: float) -> float:
        """Seconds of a cycle at t that drafted ``depth`` tokens for ``draft_seconds``."""
        return draft_seconds + float(self.verify[t, depth]) + (self.neural_cycle if used_neural else self.look_cycle)


def _head_ok(neural: PromptTrace, n: int, D: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """``neural_ok``, ``conf``, ``ent``, ``approx`` of a head (see the module docstring)."""
    run = neural.accepted_run()
    acc = np.nan_to_num(neural.accept_prob, nan=0.0) >= 1.0
    ok = np.zeros((n + 1, D), dtype=bool)
    conf = np.zeros((n + 1, D))
    ent = np.zeros((n + 1, D))
    approx = np.zeros((n + 1, D), dtype=bool)
    rows = neural.chain_len.shape[0]
    for t in range(1, n + 1):
        for j in range(D):
            pos = t + j
            if pos >= rows:
                break
            # the earliest start t' in [t, t+j] whose own chain followed the greedy tokens up to position t + j − 1
            src = next((s for s in range(t, pos + 1) if run[s] >= pos - s and neural.chain_len[s] > pos - s), None)
            if src is None:
                continue
            k = pos - src
            ok[t, j], conf[t, j], ent[t, j] = acc[src, k], neural.confidence[src, k], neural.entropy[src, k]
            approx[t, j] = src != t
    return ok, conf, ent, approx


def agreed_length(lookup: PromptTrace, neural: PromptTrace) -> int:
    """The generated tokens on which two greedy recordings of one prompt agree: both traces' length where they are
    equal, else the first position where they differ. In bf16 the verification forwards of different chains round
    differently, so a near-tie may break another way in each recording; the replay stops there (what follows is not
    one trajectory)."""
    n = min(lookup.n, neural.n)
    diff = np.flatnonzero(lookup.output[:n] != neural.output[:n])
    return int(diff[0]) if diff.size else n


def hybrid_replay(lookup: PromptTrace, neural: PromptTrace, profile: LatencyProfile, neural_name: str, max_depth: int,
                  max_new_tokens: int) -> HybridReplay:
    """The :class:`HybridReplay` of one prompt from its lookup trace and its neural-drafter trace.

    Args:
        lookup, neural: the prompt's traces (temperature 0, same prompt and greedy output), recorded with ``max_depth``
            and ``max_new_tokens`` at least these.
        profile: costs of ``"lookup"`` and of ``neural_name`` (``"model"`` or ``"head"``).
        max_depth: D, the most tokens per cycle; ``max_new_tokens``: tokens per replayed generation.

    Raises:
        ValueError: the two traces hold different prompts or outputs, or the profile lacks a drafter.
    """
    if not np.array_equal(lookup.prompt_ids, neural.prompt_ids):
        raise ValueError("The lookup and neural traces hold different prompts: record both with the same prompts, "
                         "--temperature 0 and --max-new-tokens (python -m eval.record).")
    D, N = max_depth, max_new_tokens
    n = min(agreed_length(lookup, neural), N)
    t = np.arange(n + 1)
    limit = np.minimum(D, np.maximum(N - t - 1, 0)).astype(np.int64)
    limit[n] = 0
    limit = np.minimum(limit, n - t)  # never past the end of the recorded generation
    rows = np.minimum(t, lookup.chain_len.shape[0] - 1)
    look_avail = lookup.chain_len[rows] > 0
    look_ok = look_avail & (np.nan_to_num(lookup.accept_prob[rows, 0], nan=0.0) >= 1.0)
    chain = np.full((n + 1, D), np.nan)
    width = min(D, lookup.confidence.shape[1])
    chain[:, :width] = np.where(np.arange(width)[None] < lookup.chain_len[rows, None], lookup.confidence[rows, :width],
                                np.nan)
    if neural_name == "head":
        ok, conf, ent, approx = _head_ok(neural, n, D)
    else:
        acc0 = np.nan_to_num(neural.accept_prob[:, 0], nan=0.0) >= 1.0
        ok = np.zeros((n + 1, D), dtype=bool)
        conf = np.zeros((n + 1, D))
        ent = np.zeros((n + 1, D))
        for j in range(D):
            pos = np.minimum(t + j, neural.chain_len.shape[0] - 1)
            ok[:, j], conf[:, j], ent[:, j] = acc0[pos], neural.confidence[pos, 0], neural.entropy[pos, 0]
        approx = np.zeros((n + 1, D), dtype=bool)
    c = (lookup.prompt_len + t).astype(np.float64)
    lc, nc = profile.cost("lookup"), profile.cost(neural_name)
    look_step = profile.draft_step("lookup", c) + lc.step_overhead_seconds
    neural_step = profile.draft_step(neural_name, c) + nc.step_overhead_seconds
    verify = profile.verify(np.arange(D + 1)[None, :] + 1.0, c[:, None])
    target = getattr(lookup, "target_stats", None)
    target = (np.asarray(target, dtype=np.float32)[rows] if target is not None
              else np.zeros((n + 1, 3), dtype=np.float32))
    return HybridReplay(
        n=n, eos=bool(lookup.ended_by_eos and lookup.n <= N and n == lookup.n), limit=limit, look_avail=look_avail, look_ok=look_ok,
        look_conf=lookup.confidence[rows, 0], look_feats=lookup.drafter_features[rows, 0], look_chain=chain,
        neural_ok=ok, neural_conf=conf, neural_ent=ent, approx=approx, look_step=look_step, neural_step=neural_step,
        verify=verify, look_cycle=lc.cycle_overhead_seconds, neural_cycle=nc.cycle_overhead_seconds,
        head=neural_name == "head", target=np.nan_to_num(target),
    )


def hybrid_oracle_seconds(r: HybridReplay) -> tuple[float, np.ndarray]:
    """The hindsight oracle of one replayed generation: the fewest seconds that produce its n tokens when every cycle
    knows which source is right at each position (temperature 0: the total tokens are fixed, so the best rate is the
    least time). A cycle at t drafts d ≤ ``limit[t]`` tokens, each with the cheapest source whose token is right
    (lookup when it is, since it costs least; a position where neither is right ends the useful draft), and emits
    d + 1; dynamic programming over t.

    Returns:
        (seconds, depth chosen per row: int64 (n+1,)).
    """
    n = r.n
    best = np.full(n + 2, np.inf)
    best[n] = 0.0
    choice = np.zeros(n + 1, dtype=np.int64)
    for t in range(n - 1, 0, -1):
        cand = r.cycle_seconds(t, 0, False, 0.0) + best[min(t + 1, n)]
        pick, draft, since, used = 0, 0.0, 0, False
        for d in range(1, int(r.limit[t]) + 1):
            j = d - 1
            if r.look_avail[t + j] and r.look_ok[t + j]:
                draft += r.draft_seconds(t, 0, since)
                since += 1
            elif r.neural_ok[t, j]:
                draft += r.draft_seconds(t, 1, since)
                since, used = 0, True
            else:
                break
            s = r.cycle_seconds(t, d, used, draft) + best[min(t + d + 1, n)]
            if s < cand:
                cand, pick = s, d
        best[t], choice[t] = cand, pick
    return float(best[1]), choice


__all__ = ["HYBRID_T_POSITIVE_REFUSAL", "HybridReplay", "agreed_length", "check_hybrid_traces", "hybrid_oracle_seconds",
           "hybrid_replay", "split_hybrid_traces"]
