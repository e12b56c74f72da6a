"""Recording drafting traces with real models (``python -m eval.record``): the chain a drafter drafts and
what the target accepts of it, at every output position, for every depth (chains) or every (depth,
verification size) (draft trees) a policy could choose.

What the arrays mean, the file format, loading and checking are :mod:`learn2draft.replay.traces`
(numpy only); this module drives the models (torch) and fills those structures:

* :func:`record_traces` / :func:`record_prompt` — chain traces (any temperature; any drafter);
* :func:`record_tree_traces` / :func:`record_tree_prompt` — draft-tree traces at temperature 0, drafted
  and verified by :class:`learn2draft.tree.TreeSpeculativeDecoder` itself through a recording hook.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import numpy as np

from learn2draft.features import FEATURE_NAMES, FEATURE_VERSION
from learn2draft.names import DEFAULT_MAX_DEPTH, DEFAULT_VERIFY_SIZES, check_verify_sizes
from learn2draft.replay.traces import (
    APPROXIMATION_T_POSITIVE,
    CHAIN,
    NUM_DRAFTER_FEATURES,
    TRACE_FORMAT,
    TRACE_FORMAT_VERSION,
    TREE,
    TREE_T_POSITIVE_REFUSAL,
    TREE_TRACE_FORMAT_VERSION,
    PromptTrace,
    TraceSet,
    TreePromptTrace,
    TreeTraceSet,
)


# --------------------------------------------------------------------------- recording
class _ChainRecorder:
    """The chain recording's hook: the ``sampler`` of a :class:`learn2draft.SpeculativeDecoder` that runs
    every cycle at the longest depth. At each verification it stores the drafted chain, its confidences,
    entropies and top-2 margins, the drafter features before every step, the target's statistics at the last
    committed token and each drafted token's acceptance probability min(1, p(x)/q(x)), then accepts nothing
    and emits the target's next token (argmax at T = 0, a draw from p at T > 0), so the decoder commits
    exactly one token per position and rolls back as after a rejection at the first drafted token.

    The margins come from the drafter's proposals (:class:`_ProposalTap`). The target statistics are read from
    :meth:`learn2draft.SpeculativeDecoder.target_stats` inside the hook, before the decoder commits this
    verification's token: they are still those of the row that drew the last committed token ``g_{t-1}``."""

    def __init__(self, max_depth: int):
        self.decoder = None
        self.D = max_depth
        self.margins: list[float] = []  # this cycle's proposals' top-2 margins (filled by _ProposalTap)
        self.rows: dict[str, list] = {k: [] for k in ("chain_len", "draft_tokens", "confidence", "entropy",
                                                      "drafter_features", "accept_prob", "target_stats",
                                                      "draft_margin")}

    def add_row(self, chain, confs, ents, dfeats, accepts, target_stats=None, margins=()) -> None:
        """Append one position row (every list of length ``len(chain)``; ``dfeats``: one vector more);
        ``target_stats``: (3,), NaN when None (row 0)."""
        D, L, rows = self.D, len(chain), self.rows
        rows["chain_len"].append(L)
        rows["draft_tokens"].append(np.pad(np.asarray(chain, dtype=np.int64), (0, D - L), constant_values=-1))
        rows["confidence"].append(np.pad(np.asarray(confs, dtype=np.float64), (0, D - L)))
        rows["entropy"].append(np.pad(np.asarray(ents, dtype=np.float64), (0, D - L)))
        f = np.zeros((D + 1, NUM_DRAFTER_FEATURES), dtype=np.float32)
        f[: len(dfeats)] = np.asarray(dfeats, dtype=np.float32).reshape(len(dfeats), NUM_DRAFTER_FEATURES)
        rows["drafter_features"].append(f)
        rows["accept_prob"].append(np.pad(np.asarray(accepts, dtype=np.float64), (0, D - L), constant_values=np.nan))
        rows["target_stats"].append(np.full(3, np.nan) if target_stats is None
                                    else np.asarray(target_stats, dtype=np.float64).reshape(3))
        rows["draft_margin"].append(np.pad(np.asarray(margins, dtype=np.float64).reshape(-1), (0, D - L)))

    def drafter_features(self, drafted: list[int]) -> list[np.ndarray]:
        """The drafter's features before each of the chain's steps and after its last one."""
        d = self.decoder
        seq = d._seq()  # committed + the drafted chain, still in the decoder's token buffer
        n = d.ids.numel()
        return [np.asarray(d.drafter.features(seq[: n + k]), dtype=np.float32) for k in range(len(drafted) + 1)]

    def __call__(self, p, q, drafted, generator=None) -> tuple[int, int]:
        from learn2draft.sampling import sample_from

        d = self.decoder
        chain = [int(x) for x in drafted.tolist()]
        if chain:
            idx = drafted.view(-1, 1)
            px = p[: len(chain)].gather(1, idx).view(-1).tolist()
            qx = q.gather(1, idx).view(-1).tolist()
            accepts = [min(1.0, a / b) for a, b in zip(px, qx)]
        else:
            accepts = []
        if len(self.margins) != len(chain):
            raise RuntimeError("Chain recording: the drafter's proposals this cycle do not match the drafted chain.")
        self.add_row(chain, d.confidences, d.entropies, self.drafter_features(chain), accepts, d.target_stats(),
                     self.margins)
        self.margins = []
        return 0, sample_from(p[0], generator)


class _ProposalTap:
    """Wraps a drafter's ``propose`` for one recording and hands each proposal's top-2 margin
    (:attr:`learn2draft.drafters.base.DraftProposal.margin`) to a :class:`_ChainRecorder`; a context manager that
    restores the drafter's own method on exit (the decoder keeps only confidences and entropies per token)."""

    def __init__(self, drafter, recorder: _ChainRecorder):
        self.drafter, self.recorder = drafter, recorder

    def __call__(self, seq, sampling, generator):
        prop = type(self.drafter).propose(self.drafter, seq, sampling, generator)
        self.recorder.margins.append(float(prop.margin))
        return prop

    def __enter__(self) -> _ProposalTap:
        self.drafter.propose = self
        return self

    def __exit__(self, *exc) -> None:
        del self.drafter.propose


def record_prompt(pair, drafter, prompt_ids, sampling, max_new_tokens: int, max_depth: int, seed: int = 0) -> PromptTrace:
    """Record the trace of one prompt (see the module docstring).

    The loop is the speculative decoder's own (:class:`learn2draft.SpeculativeDecoder` under a fixed
    γ = ``max_depth``): at every position it drafts the longest chain a policy could ask for, verifies it with
    one target forward (the same forward a real verification of that chain runs, kept for its acceptance
    probabilities), and its recording hook (the decoder's ``sampler``) then commits exactly one token — the
    target's next token (argmax at T = 0, a draw from p at T > 0) — so that every position gets a chain.

    Args:
        pair: a :class:`learn2draft.ModelPair`.
        drafter: a :class:`learn2draft.drafters.Drafter` for ``pair`` (its state is reset here).
        prompt_ids: int64 (L,) token ids (e.g. :meth:`ModelPair.encode_prompt`).
        sampling: :class:`learn2draft.sampling.SamplingConfig` for target and draft.
        max_new_tokens: tokens generated (≥ 1); ``max_depth``: longest chain recorded (≥ 0).
        seed: seeds the torch generator of the draft draws and of the trajectory.

    Returns:
        :class:`PromptTrace`; costs n target forwards of ≤ ``max_depth`` + 1 tokens and ≤ n · ``max_depth``
        draft steps.

    Raises:
        ValueError: bad ``max_new_tokens`` / ``max_depth``, an empty or too long prompt.
    """
    import torch

    from learn2draft.control import FixedDepthController
    from learn2draft.decoding import SpeculativeDecoder

    if max_new_tokens < 1 or max_depth < 0:
        raise ValueError(f"Need max_new_tokens ≥ 1 and max_depth ≥ 0, got {max_new_tokens} and {max_depth}.")
    prompt = torch.as_tensor(prompt_ids, dtype=torch.long).reshape(-1)
    if prompt.numel() == 0:
        raise ValueError("Empty prompt: pass at least one token.")
    hook = _ChainRecorder(max_depth)
    dec = SpeculativeDecoder(pair, sampling, max_new_tokens=max_new_tokens, max_depth=max_depth, seed=int(seed),
                             sampler=hook, drafter=drafter)
    hook.decoder = dec
    longest = FixedDepthController(max_depth)
    hook.add_row([], [], [], [np.zeros(NUM_DRAFTER_FEATURES)], [])  # row 0: never a decision
    with _ProposalTap(drafter, hook):
        dec.start(prompt)
        while not dec.finished:
            if len(dec.run_cycle(longest).tokens) != 1:
                raise RuntimeError("Chain recording: the decoder committed more than one token per cycle.")
    hook.add_row([], [], [], hook.drafter_features([]), [], dec.target_stats())  # the end: no decision
    arr = {k: np.stack(v) if k != "chain_len" else np.asarray(v, dtype=np.int64) for k, v in hook.rows.items()}
    out = dec.ids[dec.prompt_len :].cpu().numpy().astype(np.int64)
    return PromptTrace(
        prompt_ids=dec.ids[: dec.prompt_len].cpu().numpy().astype(np.int64), output=out,
        ended_by_eos=int(out[-1]) in set(pair.eos_token_ids), seed=int(seed), **arr,
    )


def greedy_inconsistencies(trace: PromptTrace) -> int:
    """Positions whose recorded acceptances (T = 0) disagree with the recorded greedy output: the accepted run
    should be the common prefix of the chain and the continuation ``output[t:]``. Nonzero only through
    floating-point near-ties between differently batched target forwards."""
    run = trace.accepted_run()
    bad = 0
    for t in range(1, trace.n):
        L = int(trace.chain_len[t])
        cont = trace.output[t: t + L]
        chain = trace.draft_tokens[t, : len(cont)]
        lcp = int(np.argmin(chain == cont)) if not np.all(chain == cont) else len(cont)
        bad += int(lcp != min(int(run[t]), len(cont)))  # nothing after an EOS counts
    return bad


def record_traces(pair, drafter, prompts: Sequence, sampling, max_new_tokens: int = 64, max_depth: int = DEFAULT_MAX_DEPTH,
                  seed: int = 0, header: dict | None = None, progress: bool = True) -> TraceSet:
    """Record one :class:`PromptTrace` per prompt with :func:`record_prompt` (prompt i seeded with ``seed + i``).

    Args:
        pair, drafter, sampling, max_new_tokens, max_depth: as :func:`record_prompt`.
        prompts: token-id sequences (int64 (L,)) or strings (encoded with :meth:`ModelPair.encode_prompt`).
        header: extra header entries (prompt split, machine, …).
        progress: a tqdm bar on a terminal.

    Returns:
        :class:`TraceSet` whose header names the format, models, drafter, sampling, feature version,
        ``max_depth``, ``max_new_tokens``, the recording time and, at T = 0, ``greedy_inconsistencies``.
    """
    from tqdm.auto import tqdm

    t0 = time.perf_counter()
    ids = [pair.encode_prompt(p, max_new_tokens=max_new_tokens) for p in prompts]
    traces = []
    for i, x in enumerate(tqdm(ids, desc="record", disable=None if progress else True, leave=False)):
        traces.append(record_prompt(pair, drafter, x, sampling, max_new_tokens, max_depth, seed=seed + i))
    head = {
        "format": TRACE_FORMAT,
        "format_version": TRACE_FORMAT_VERSION,
        "structure": CHAIN,
        "feature_version": FEATURE_VERSION,
        "feature_names": list(FEATURE_NAMES),
        "target": pair.target_name,
        "draft": pair.draft_name,
        "drafter": drafter.extra_config(),
        "vocab_size": int(pair.vocab_size),
        "eos_token_ids": [int(e) for e in pair.eos_token_ids],
        "sampling": sampling.to_dict(),
        "max_new_tokens": int(max_new_tokens),
        "max_depth": int(max_depth),
        "seed": int(seed),
        "device": str(pair.device),
        "dtype": str(next(pair.target.parameters()).dtype).replace("torch.", ""),
        "record_seconds": time.perf_counter() - t0,
        **(header or {}),
    }
    if sampling.greedy:
        head["greedy_inconsistencies"] = int(sum(greedy_inconsistencies(tr) for tr in traces))
    else:
        head["approximation"] = APPROXIMATION_T_POSITIVE
    return TraceSet(head, traces)


# --------------------------------------------------------------------------- draft trees


class _RootOnlySampler:
    """The recording's acceptance hook for :class:`learn2draft.tree.TreeSpeculativeDecoder`: it keeps the tree the
    decoder drafted and the target's argmax after every node, and accepts no node, emitting the root's argmax (the
    greedy next token), so that the recording commits exactly one token per position."""

    def __init__(self):
        self.decoder = None
        self.tree = None
        self.argmax: np.ndarray | None = None
        self.order: np.ndarray | None = None

    def __call__(self, parents, tokens, probs, generator=None):
        from learn2draft.tree import select_top_nodes

        tree = self.decoder.tree
        if tree is None:  # the root alone
            from learn2draft.tree import DraftTree

            tree = DraftTree.root(int(tokens[0]))
        order = select_top_nodes(tree, tree.num_nodes).numpy()  # the decoder's own node order for this subtree
        if order.shape[0] != parents.numel() or not _torch_equal(tree.tokens[order[1:]], tokens[1:]):
            raise RuntimeError("Tree recording: the verified subtree is not the whole drafted tree.")
        am = probs.argmax(dim=1).cpu().numpy()
        self.tree, self.order = tree, order
        self.argmax = np.empty(order.shape[0], dtype=np.int64)
        self.argmax[order] = am  # argmax after tree node i, in the tree's numbering
        return [], int(am[0])


def _torch_equal(a, b) -> bool:
    import torch

    return bool(torch.equal(torch.as_tensor(a).cpu(), torch.as_tensor(b).cpu()))


def tree_accepted_lengths(tree, argmax: np.ndarray, max_depth: int, verify_sizes: Sequence[int]) -> np.ndarray:
    """Accepted length τ(d, V) at temperature 0 of every depth d = 0..``max_depth`` and verification size V of one
    drafted tree, given the target's argmax after every node.

    For depth d the eligible nodes are those of levels ≤ min(d, tree depth) (the tree a depth-d cycle drafts:
    EAGLE-2 expansion builds level by level, so it is a node-index prefix of the deeper tree); the verified set is
    :func:`learn2draft.tree.select_top_nodes` over them with size min(V, eligible), as
    :meth:`TreeSpeculativeDecoder.verify` selects; τ is the length of the path from the root that follows, at each
    node, the verified child whose token is the target's argmax there — what
    :func:`learn2draft.sampling.tree_speculative_sample` accepts with one-hot target rows.

    Args:
        tree: :class:`learn2draft.tree.DraftTree`, N+1 nodes.
        argmax: int64 (N+1,), the target's greedy next token after node i's path (row i of one tree forward).
        max_depth: D; ``verify_sizes``: S sizes ≥ 1.

    Returns:
        int64 (D+1, S); row 0 (plain decoding) is 0.
    """
    from learn2draft.tree import select_top_nodes

    depth = tree.depth.numpy()
    toks = tree.tokens.numpy()
    children = tree.children()
    if depth.size > 1 and np.any(np.diff(depth) < 0):
        raise ValueError("Tree nodes must be numbered level by level (as TreeSpeculativeDecoder drafts them).")
    out = np.zeros((max_depth + 1, len(verify_sizes)), dtype=np.int64)
    for d in range(1, max_depth + 1):
        de = min(d, tree.max_depth)
        n_d = int(np.count_nonzero(depth <= de)) - 1
        sub = tree.subtree(list(range(n_d + 1))) if n_d < tree.num_nodes else tree
        for s, v in enumerate(verify_sizes):
            chosen = np.zeros(depth.size, dtype=bool)
            chosen[select_top_nodes(sub, min(int(v), n_d)).numpy()] = True
            node, tau = 0, 0
            while True:
                nxt = [c for c in children[node] if chosen[c] and toks[c] == argmax[node]]
                if not nxt:
                    break
                node, tau = nxt[0], tau + 1
            out[d, s] = tau
    return out


def record_tree_prompt(pair, drafter, prompt_ids, sampling, max_new_tokens: int, max_depth: int,
                       verify_sizes: Sequence[int], width: int, top_k: int, seed: int = 0) -> TreePromptTrace:
    """Record the draft-tree trace of one prompt at temperature 0 (see :data:`TREE_ARRAY_DOCS`).

    At temperature 0 the committed text is the greedy output whatever the actions, so one trajectory serves every
    (depth, V). At each output position a :class:`learn2draft.tree.TreeSpeculativeDecoder` runs one real cycle with
    :class:`learn2draft.tree.FixedTreeController` (``max_depth``, every node): it drafts the tree level by level
    exactly as in a real run (``width`` frontier nodes × ``top_k`` children), verifies *all* its nodes in ONE target
    forward with the tree attention mask, and its acceptance hook records the target's argmax after every node and
    accepts nothing, so the decoder commits one token (the greedy next token), gathers its caches and rolls the
    drafter back as after a rejection at the root. :func:`tree_accepted_lengths` then gives τ(d, V) for every depth
    and size.

    Args:
        pair: a :class:`learn2draft.ModelPair`; ``drafter``: a drafter that drafts trees (model or head).
        prompt_ids: int64 (L,) token ids; ``sampling``: a greedy :class:`SamplingConfig` (temperature 0; penalties
            allowed).
        max_new_tokens: tokens generated (≥ 1); ``max_depth``: deepest tree recorded (≥ 1).
        verify_sizes: the verification sizes V recorded (distinct increasing integers ≥ 1).
        width, top_k: the tree shape W and k (≥ 1).
        seed: the decoder's seed (unused at temperature 0, stored).

    Returns:
        :class:`TreePromptTrace`; costs n target forwards of up to 1 + k + (max_depth − 1)·W·k tokens and up to
        n · max_depth drafting levels.

    Raises:
        ValueError: temperature > 0 (:data:`TREE_T_POSITIVE_REFUSAL`), a drafter without trees (lookup), bad
            ``max_new_tokens`` / ``max_depth`` / ``verify_sizes`` / ``width`` / ``top_k``, an empty or too long prompt.
    """
    import torch

    from learn2draft.tree import FixedTreeController, TreeSpeculativeDecoder

    if not sampling.greedy:
        raise ValueError(TREE_T_POSITIVE_REFUSAL)
    if not getattr(drafter, "supports_tree", False):
        raise ValueError(f"The {drafter.name!r} drafter drafts no trees (prompt lookup proposes one chain): record "
                         "tree traces with the model or head drafter, or chain traces without --tree.")
    if max_new_tokens < 1 or max_depth < 1:
        raise ValueError(f"Tree traces need max_new_tokens ≥ 1 and max_depth ≥ 1, got {max_new_tokens} and "
                         f"{max_depth}.")
    vs = check_verify_sizes(verify_sizes)
    hook = _RootOnlySampler()
    dec = TreeSpeculativeDecoder(pair, sampling, max_new_tokens=max_new_tokens, max_depth=max_depth, seed=seed,
                                 drafter=drafter, width=width, top_k=top_k, tree_sampler=hook)
    hook.decoder = dec
    everything = FixedTreeController(max_depth, 10 ** 9)  # every drafted node (verify clips V to the tree)
    D, S = max_depth, len(vs)
    depths, levels, taus = [0], [np.zeros(D, dtype=np.int64)], [np.zeros((D + 1, S), dtype=np.int64)]
    paths: list[list[int]] = [[]]
    dec.start(torch.as_tensor(prompt_ids, dtype=torch.long).reshape(-1))
    prompt = dec.ids.cpu().numpy().astype(np.int64)
    while not dec.finished:
        hook.tree = None
        res = dec.run_cycle(everything)
        if len(res.tokens) != 1 or hook.tree is None:
            raise RuntimeError("Tree recording: the decoder did not run the recording hook.")
        tree = hook.tree
        depth = tree.depth.numpy()
        depths.append(int(tree.max_depth))
        levels.append(np.bincount(depth[1:], minlength=D + 1)[1: D + 1].astype(np.int64))
        taus.append(tree_accepted_lengths(tree, hook.argmax, D, vs))
        paths.append(_greedy_path(tree, hook.argmax))
    depths.append(0)
    levels.append(np.zeros(D, dtype=np.int64))
    taus.append(np.zeros((D + 1, S), dtype=np.int64))
    out = dec.ids[dec.prompt_len:].cpu().numpy().astype(np.int64)
    # The whole tree's accepted path at t should be the recorded continuation (nothing after its end counts).
    bad = sum(int(path[: len(out) - t] != out[t: t + len(path)].tolist()) for t, path in enumerate(paths) if t)
    return TreePromptTrace(prompt_ids=prompt[: dec.prompt_len], output=out,
                           ended_by_eos=int(out[-1]) in set(pair.eos_token_ids),
                           tree_depth=np.asarray(depths, np.int64), level_nodes=np.stack(levels), tau=np.stack(taus),
                           seed=int(seed), greedy_inconsistencies=bad)


def _greedy_path(tree, argmax: np.ndarray) -> list[int]:
    """Tokens of the path from the root following the target's argmax through every node of ``tree``."""
    children, toks, node, out = tree.children(), tree.tokens.tolist(), 0, []
    while True:
        nxt = [c for c in children[node] if toks[c] == argmax[node]]
        if not nxt:
            return out
        node = nxt[0]
        out.append(toks[node])


def record_tree_traces(pair, drafter, prompts: Sequence, sampling, max_new_tokens: int = 64, max_depth: int = DEFAULT_MAX_DEPTH,
                       verify_sizes: Sequence[int] = DEFAULT_VERIFY_SIZES, width: int = 4, top_k: int = 4,
                       seed: int = 0, header: dict | None = None, progress: bool = True) -> TreeTraceSet:
    """Record one :class:`TreePromptTrace` per prompt with :func:`record_tree_prompt` (temperature 0 only).

    Args:
        pair, drafter, sampling, max_new_tokens, max_depth, verify_sizes, width, top_k: as :func:`record_tree_prompt`.
        prompts: token-id sequences (int64 (L,)) or strings (encoded with :meth:`ModelPair.encode_prompt`).
        seed: prompt i gets seed + i; ``header``: extra header entries; ``progress``: a tqdm bar on a terminal.

    Returns:
        :class:`TreeTraceSet` whose header names the format (``structure`` and ``kind`` ``"tree"``), version, models,
        drafter, sampling, tree shape (``width``, ``top_k``, ``max_depth``, ``verify_sizes``), ``max_new_tokens``,
        recording time and ``greedy_inconsistencies`` (positions where the full tree's accepted path disagrees with
        the recorded greedy output: floating-point near-ties between differently batched forwards; 0 expected).

    Raises:
        ValueError: as :func:`record_tree_prompt` (checked before any model runs).
    """
    from tqdm.auto import tqdm

    if not sampling.greedy:
        raise ValueError(TREE_T_POSITIVE_REFUSAL)
    if not getattr(drafter, "supports_tree", False):
        raise ValueError(f"The {drafter.name!r} drafter drafts no trees (prompt lookup proposes one chain): record "
                         "tree traces with the model or head drafter, or chain traces without --tree.")
    vs = check_verify_sizes(verify_sizes)
    t0 = time.perf_counter()
    ids = [pair.encode_prompt(p, max_new_tokens=max_new_tokens) for p in prompts]
    traces = []
    for i, x in enumerate(tqdm(ids, desc="record trees", disable=None if progress else True, leave=False)):
        traces.append(record_tree_prompt(pair, drafter, x, sampling, max_new_tokens, max_depth, vs, width, top_k,
                                         seed=seed + i))
    head = {
        "format": TRACE_FORMAT,
        "format_version": TREE_TRACE_FORMAT_VERSION,
        "structure": TREE,
        "kind": TREE,
        "target": pair.target_name,
        "draft": pair.draft_name,
        "drafter": drafter.extra_config(),
        "vocab_size": int(pair.vocab_size),
        "eos_token_ids": [int(e) for e in pair.eos_token_ids],
        "sampling": sampling.to_dict(),
        "max_new_tokens": int(max_new_tokens),
        "max_depth": int(max_depth),
        "verify_sizes": vs,
        "width": int(width),
        "top_k": int(top_k),
        "seed": int(seed),
        "device": str(pair.device),
        "dtype": str(next(pair.target.parameters()).dtype).replace("torch.", ""),
        "record_seconds": time.perf_counter() - t0,
        "greedy_inconsistencies": int(sum(tr.greedy_inconsistencies for tr in traces)),
        **(header or {}),
    }
    return TreeTraceSet(head, traces)


__all__ = [
    "greedy_inconsistencies", "record_prompt", "record_traces", "record_tree_prompt",
    "record_tree_traces", "tree_accepted_lengths",
]
