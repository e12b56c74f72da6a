"""The replay outcome model: what one draft/verify cycle accepts, emits and costs, from a trace and a profile.

Given a recorded prompt (:mod:`learn2draft.replay.traces`), a latency profile
(:mod:`learn2draft.replay.latency`) and a decision at output position t (t tokens generated; the prefill
emits the first), the cycle's

* accepted length τ — chains (depth j): at temperature 0 ``τ = min(j, accepted_run[t])``; at T > 0 drawn
  with a given RNG from the recorded acceptance probabilities (drafted token i accepted with probability
  ``accept_prob[t, i]`` once tokens < i were), or every outcome with its probability where an expectation
  is needed (:meth:`ChainReplay.outcomes`); draft trees (depth d, verification size V, temperature 0 only):
  the recorded ``τ(min(d, tree depth), V)``;
* tokens emitted — ``min(τ + 1, n − t)``: the bonus or corrected token, cut at EOS / ``max_new_tokens``
  (n = tokens of the replayed generation), τ then counting only emitted tokens (as
  :meth:`learn2draft.decoding.SpeculativeDecoder.verify` counts it);
* seconds — chains: :meth:`LatencyProfile.cycle_table`, ``j · (draft_step(c) + step_overhead) +
  verify(j + 1, c) + cycle_overhead`` at context c = prompt + t; trees:
  :meth:`LatencyProfile.tree_cycle_seconds` with the levels actually drafted and the nodes actually verified.

The next cycle starts at t + emitted. Whatever scores replayed cycles uses this module: the replay
environment (:class:`envs.replay.SpecDecodeReplayEnv`), the oracle's dynamic programs
(:mod:`eval.oracle`) and, through the environment, sim-vs-real (:mod:`eval.simreal`); their rates are
:func:`tokens_per_second` of all generated tokens over summed cycle seconds.

Numpy only.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from learn2draft.metrics import tokens_per_second  # noqa: F401  (the replay's rates: all generated tokens over the summed cycle seconds)
from learn2draft.replay.latency import LatencyProfile
from learn2draft.replay.traces import PromptTrace, TreePromptTrace


# --------------------------------------------------------------------------- chains
@dataclass
class ChainReplay:
    """Every chain decision's outcome and cost at every position of one replayed generation.

    Rows t = 0..n (row 0 unused: the prefill emits the first token; row n is the end), columns j = 0..D
    (D = the replay's ``max_depth``).

    Attributes:
        n: tokens generated in this replay (≤ the trace's n: ``max_new_tokens`` may be smaller).
        eos: the generation ends with EOS (else at ``max_new_tokens``).
        avail: int64 (n+1,), the most tokens a cycle at t can draft: the recorded chain, capped by ``max_depth``
            and the tokens left (``max_new_tokens − t − 1``), as :attr:`SpeculativeDecoder.depth_limit` caps it.
        run: int64 (n+1,), the accepted run at T = 0 (≤ avail).
        accept: float64 (n+1, D), the recorded acceptance probabilities (NaN past the chain).
        draft, verify, other, total: float64 (n+1, D+1) seconds of a cycle at t with depth j (the terms of
            :meth:`LatencyProfile.cycle_table`).
    """

    n: int
    eos: bool
    avail: np.ndarray
    run: np.ndarray
    accept: np.ndarray
    draft: np.ndarray
    verify: np.ndarray
    other: np.ndarray
    total: np.ndarray

    def cycle(self, t: int, depth: int, rng: np.random.Generator | None = None) -> tuple[int, int, float]:
        """The outcome of one cycle at position ``t`` (1 ≤ t < n) that verifies ``depth`` drafted tokens
        (0 ≤ depth ≤ ``avail[t]``).

        Args:
            rng: None at temperature 0 (τ from the accepted run); at T > 0 the generator τ is drawn with, one
                ``rng.random()`` per drafted token examined.

        Returns:
            (τ accepted and emitted, tokens emitted, seconds).
        """
        if rng is None:
            tau = min(depth, int(self.run[t]))
        else:
            tau, acc = 0, self.accept[t]
            while tau < depth and rng.random() < acc[tau]:
                tau += 1
        emitted = min(tau + 1, self.n - t)
        return min(tau, emitted), emitted, float(self.total[t, depth])

    def outcomes(self, t: int, depth: int, deterministic: bool) -> list[tuple[float, int, int]]:
        """Every outcome of the cycle of :meth:`cycle` with its probability: ``(probability, τ, emitted)``,
        one entry at temperature 0 (``deterministic``), ``depth + 1`` at T > 0 (τ = 0..depth before the cut at
        the tokens left). Its seconds are ``total[t, depth]`` whatever the outcome."""
        left = self.n - t
        if deterministic:
            tau = min(depth, int(self.run[t]))
            return [(1.0, min(tau, left), min(tau + 1, left))]
        out, reach = [], 1.0
        for i in range(depth):
            a = float(self.accept[t, i])
            out.append((reach * (1.0 - a), min(i, left), min(i + 1, left)))
            reach *= a
        out.append((reach, min(depth, left), min(depth + 1, left)))
        return out


def chain_replay(pt: PromptTrace, costs: LatencyProfile | dict[str, np.ndarray], drafter: str, max_depth: int,
                 max_new_tokens: int) -> ChainReplay:
    """The :class:`ChainReplay` of one chain trace prompt.

    Args:
        pt: the prompt's trace (recorded with ``max_depth`` and ``max_new_tokens`` at least these).
        costs: a :class:`LatencyProfile`, or the precomputed :meth:`LatencyProfile.cycle_table` of this prompt's
            contexts ``prompt_len + t``, t = 0..min(n, max_new_tokens), and depths 0..max_depth.
        drafter: whose costs (with a profile).
        max_depth: the most tokens drafted per cycle (D); ``max_new_tokens``: tokens per replayed generation.

    Raises:
        ValueError: the profile lacks the drafter or verifies too few tokens for ``max_depth``
            (:meth:`LatencyProfile.cycle_table`).
    """
    D, N = max_depth, max_new_tokens
    n = min(pt.n, N)
    t = np.arange(n + 1)
    avail = np.minimum(np.minimum(pt.chain_len[: n + 1], D), np.maximum(N - t - 1, 0)).astype(np.int64)
    avail[n] = 0
    run = np.minimum(pt.accepted_run()[: n + 1], avail)
    tab = costs.cycle_table(drafter, pt.prompt_len + t, D) if isinstance(costs, LatencyProfile) else costs
    return ChainReplay(n, pt.ended_by_eos and pt.n <= N, avail, run, pt.accept_prob[: n + 1, :D], tab["draft"],
                       tab["verify"], tab["other"], tab["total"])


# --------------------------------------------------------------------------- draft trees (T = 0)
@dataclass
class TreeReplay:
    """Every tree action's outcome and cost at every position of one recorded generation (temperature 0).

    Attributes:
        n: tokens generated (the replayed generation's length).
        actions: A actions ``(d, V)``; ``actions[0] = (0, 0)`` is plain decoding.
        depth: int64 (n+1, A), levels a cycle at position t actually drafts (min(d, available)).
        verified: int64 (n+1, A), drafted nodes it verifies (min(V, nodes of the depth-d tree)).
        emitted: int64 (n+1, A), tokens it emits, min(τ + 1, n − t).
        seconds: float64 (n+1, A), its cost from the profile (:meth:`LatencyProfile.tree_cycle_seconds`).
        tau: int64 (n+1, A), its accepted length τ, counting only emitted tokens (min(τ, emitted)).
        Rows 0 and n are unused (the prefill emits the first token; position n is the end).
    """

    n: int
    actions: list
    depth: np.ndarray
    verified: np.ndarray
    emitted: np.ndarray
    seconds: np.ndarray
    tau: np.ndarray

    def cycle(self, t: int, action: int) -> tuple[int, int, float]:
        """(τ, tokens emitted, seconds) of a cycle at position ``t`` (1 ≤ t < n) taking ``actions[action]``."""
        return int(self.tau[t, action]), int(self.emitted[t, action]), float(self.seconds[t, action])


def tree_replay_data(pt: TreePromptTrace, profile: LatencyProfile, drafter: str, verify_sizes: Sequence[int],
                     max_depth: int | None = None, max_new_tokens: int | None = None,
                     recorded_max_new_tokens: int | None = None) -> TreeReplay:
    """The :class:`TreeReplay` of one :class:`learn2draft.replay.traces.TreePromptTrace`.

    Args:
        pt: the prompt's tree trace; ``verify_sizes``: the trace set's V grid (``TreeTraceSet.verify_sizes``).
        profile: a :class:`learn2draft.replay.latency.LatencyProfile`; ``drafter``: whose costs to use.
        max_depth: largest depth considered (default and maximum: the recorded one).
        max_new_tokens: replay shorter generations (≤ ``recorded_max_new_tokens``; default: as recorded).

    Raises:
        ValueError: ``max_depth`` or ``max_new_tokens`` beyond the recording, or a drafter the profile lacks.
    """
    D = pt.tau.shape[1] - 1
    Dm = D if max_depth is None else int(max_depth)
    if not 1 <= Dm <= D:
        raise ValueError(f"--max-depth {max_depth}: must be in [1, {D}] for these tree traces (recorded up to depth "
                         f"{D}; depth 0, plain decoding, is always reported).")
    rec_N = recorded_max_new_tokens if recorded_max_new_tokens is not None else pt.n
    N = rec_N if max_new_tokens is None else int(max_new_tokens)
    if not 1 <= N <= rec_N:
        raise ValueError(f"--max-new-tokens {max_new_tokens}: the tree traces were recorded with {rec_N} new tokens.")
    n = min(pt.n, N)
    t = np.arange(n + 1)
    avail = np.minimum(pt.tree_depth[: n + 1], np.maximum(N - t - 1, 0)).astype(np.int64)
    avail[n] = 0
    nodes = pt.nodes_up_to()[: n + 1]
    actions = [(0, 0)] + [(d, int(v)) for d in range(1, Dm + 1) for v in verify_sizes]
    A = len(actions)
    depth = np.zeros((n + 1, A), dtype=np.int64)
    verified = np.zeros((n + 1, A), dtype=np.int64)
    tau = np.zeros((n + 1, A), dtype=np.int64)
    for a, (d, v) in enumerate(actions):
        if d == 0:
            continue
        s = list(verify_sizes).index(v)
        de = np.minimum(d, avail)
        depth[:, a] = de
        verified[:, a] = np.minimum(v, nodes[t, de])
        tau[:, a] = pt.tau[t, de, s]
    emitted = np.minimum(tau + 1, np.maximum(n - t, 0)[:, None])
    seconds = profile.tree_cycle_seconds(drafter, (pt.prompt_len + t)[:, None], depth, verified)
    return TreeReplay(n, actions, depth, verified, emitted, seconds, np.minimum(tau, emitted))


__all__ = ["ChainReplay", "TreeReplay", "chain_replay", "tokens_per_second", "tree_replay_data"]
