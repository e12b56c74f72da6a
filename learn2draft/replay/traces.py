"""Recorded drafting traces: what the drafter and the target *agree on*, stored once, replayed for any policy.

A speculative-decoding reward (tokens/s) is the product of two things: how many drafted tokens the
target accepts (a property of the models and the text) and what each forward costs (a property of
the hardware, :mod:`learn2draft.replay.latency`). A trace stores the first, for every depth a chain policy
could have chosen, so that :class:`envs.replay.SpecDecodeReplayEnv` can replay any depth policy
without running a model (through the outcome model, :mod:`learn2draft.replay.outcome`).

This module is the format: what a trace holds, its files, loading and checking them (numpy only).
Recording traces with real models is :mod:`learn2draft.traces` (``python -m eval.record``).

What is recorded (chains, format version 1)
-------------------------------------------
Per prompt, along one generation ``g_0 .. g_{n-1}`` of the target (at temperature 0 the greedy
output, which speculative decoding reproduces whatever the depth policy does; at T > 0 one sampled
trajectory), and for every output position t (t tokens already generated, 1 ≤ t < n; the prefill
emits g_0):

* the chain the drafter drafts from the prefix ``prompt + g_0 .. g_{t-1}``, up to
  ``min(max_depth, max_new_tokens − t − 1)`` tokens or until the drafter has no proposal
  (``chain_len[t]``): its tokens, and the draft-side features seen before each decision — the
  draft's raw confidence and entropy of every drafted token and the drafter's own features
  (``match_len``, ``match_count``) before every draft step;
* ``accept_prob[t, j]``: the probability that the exact sampler accepts drafted token j given that
  tokens 0..j−1 were accepted — ``min(1, p(x)/q(x))`` with p the target's and q the draft's processed
  distribution at that position (Leviathan et al. 2023, Algorithm 1), ``p(x)`` for a deterministic
  proposal (a point mass, the lookup drafter). p comes from one target forward over
  ``g_{t-1}`` and the whole chain, the same forward a real verification of that chain runs.

* the acceptance features (:data:`ACCEPTANCE_ARRAYS`, written since issue 16; a file without them still
  loads, with NaN in their place, and :attr:`TraceSet.has_acceptance_features` is False):
  ``target_stats[t]``, the target's own view of the last committed token ``g_{t-1}`` — top-1
  probability, entropy and top-2 margin of the target's raw softmax at the position that drew it
  (:meth:`learn2draft.SpeculativeDecoder.target_stats`, free from the forward that produced it); and
  ``draft_margin[t, j]``, the draft's top-2 margin at each drafted token
  (:attr:`learn2draft.drafters.base.DraftProposal.margin`).

At temperature 0 these probabilities are 0 or 1, and the accepted length of a cycle that starts at t
with depth d is ``τ = min(d, accepted_run[t])`` — the number of leading ones — exactly what the
real loop computes, because its verification forward sees the same tokens (equality holds up to
floating-point near-ties between differently batched forwards; :func:`learn2draft.traces.record_traces` counts the
positions where the chain's acceptances disagree with the recorded greedy output in
``header["greedy_inconsistencies"]``).

At T > 0 the replay draws τ from these probabilities (accept token j with probability
``accept_prob[t, j]`` while the previous ones were accepted). That is the exact law of τ for a cycle
starting at t **given the recorded prefix**. What it does not reproduce: after a cycle the real
loop continues from the tokens it accepted (the draft's) and the corrected token it drew, while
the replay continues along the recorded trajectory ``g``. Both continuations are samples of the
target's law, but the real one is correlated with the acceptance event (text the draft agreed with
is over-represented after long accepted runs), so replayed rates at T > 0 are an approximation;
``header["approximation"]`` says so in every T > 0 trace.

File format
-----------
One ``.npz`` (numpy, ``allow_pickle=False``) holding the header as a JSON string (``header``) and
the arrays of :data:`ARRAY_DOCS`, ragged per prompt and concatenated with offset arrays; a copy of
the header is written beside it as ``<name>.json`` for reading without numpy. The header names the
format and its version, the structure (``"chain"``), the models, the drafter, the sampling settings,
the feature version, ``max_depth``, ``max_new_tokens`` and the machine it was recorded on.

Draft-tree traces (temperature 0; ``structure`` = ``kind`` = ``"tree"``)
----------------------------------------------------------------------
:func:`learn2draft.traces.record_tree_traces` (``python -m eval.record --tree``) stores, along the greedy generation
(at T = 0 the committed text is the greedy output whatever the actions, so one trajectory serves
every action), the accepted length τ(d, V) of every depth d = 0..``max_depth`` and every
verification size V of ``verify_sizes`` at every output position, with the nodes per tree level
(:data:`TREE_ARRAY_DOCS`). The tree is drafted by :class:`learn2draft.tree.TreeSpeculativeDecoder`
itself (EAGLE-2: ``width`` frontier nodes × ``top_k`` children per level) and verified whole in one
target forward with the tree mask; τ(d, V) follows the target's argmax through the top-V nodes of
the first d levels, as the decoder selects them. Same file layout (its own arrays and version,
:data:`TREE_TRACE_FORMAT_VERSION`); :class:`TraceSet` refuses tree files and :class:`TreeTraceSet`
chain files, each with a message naming the other. At T > 0 a tree's acceptance depends on the
residual law at every verified node, which is not recorded: refused (:data:`TREE_T_POSITIVE_REFUSAL`).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import ClassVar

import numpy as np

from learn2draft.features import FEATURE_VERSION
from learn2draft.names import check_verify_sizes

TRACE_FORMAT = "learn2draft-trace"
#: Version of the file layout; :meth:`TraceSet.load` refuses other versions.
TRACE_FORMAT_VERSION = 1
CHAIN = "chain"
TREE = "tree"
#: Drafter features per decision (``match_len``, ``match_count``); equals drafters.base.NUM_DRAFTER_FEATURES.
NUM_DRAFTER_FEATURES = 2

#: Every array of a chain trace file. P prompts, R = Σ (n_p + 1) position rows, D = max_depth.
ARRAY_DOCS: dict[str, str] = {
    "prompt_offsets": "int64 (P+1,): prompt p's token ids are prompt_tokens[prompt_offsets[p]:prompt_offsets[p+1]]",
    "prompt_tokens": "int64 (Σ L_p,): the prompts' token ids (chat template applied) as the loop ran them",
    "output_offsets": "int64 (P+1,): prompt p's generated tokens are output_tokens[output_offsets[p]:output_offsets[p+1]]",
    "output_tokens": "int64 (Σ n_p,): the recorded generation g (greedy output at T=0, one sampled trajectory at T>0)",
    "row_offsets": "int64 (P+1,): prompt p owns position rows row_offsets[p] .. row_offsets[p+1]-1, row t = t tokens "
                   "generated (n_p + 1 rows; row 0 is unused: the prefill emits the first token; row n_p is the end)",
    "chain_len": "int64 (R,): tokens drafted from that position (≤ min(max_depth, max_new_tokens − t − 1); fewer "
                 "when the drafter had no proposal)",
    "draft_tokens": "int64 (R, D): the drafted chain (−1 past chain_len)",
    "confidence": "float64 (R, D): the draft's raw max probability at each drafted token (lookup: share of matches "
                  "continuing with it); 0 past chain_len",
    "entropy": "float64 (R, D): entropy (nats) of the draft's raw distribution at each drafted token; 0 past chain_len",
    "drafter_features": "float32 (R, D+1, 2): Drafter.features (match_len, match_count) before decision j = 0..D "
                        "(0 past chain_len)",
    "accept_prob": "float64 (R, D): P(drafted token j accepted | tokens < j accepted) = min(1, p(x)/q(x)), or p(x) for "
                   "a point-mass proposal; NaN past chain_len",
    "ended_by_eos": "bool (P,): the generation ended with an EOS token (else at max_new_tokens)",
    "seeds": "int64 (P,): the sampling seed of each prompt's recording",
    "target_stats": "float64 (R, 3), optional: (top-1 probability, entropy in nats, top-2 margin) of the target's raw "
                    "softmax at the position that drew the last committed token g_{t-1} of row t (the prefill's last "
                    "row for t = 1), known before any decision at t; NaN in row 0 (nothing generated yet)",
    "draft_margin": "float64 (R, D), optional: the draft's top-2 margin at each drafted token (max − second "
                    "probability of its raw softmax; lookup: share of the most frequent continuation of the matched "
                    "n-gram minus the second's); 0 past chain_len",
}
#: The optional arrays of :data:`ARRAY_DOCS` (the acceptance features): traces recorded before them load with NaN.
ACCEPTANCE_ARRAYS: tuple[str, ...] = ("target_stats", "draft_margin")

APPROXIMATION_T_POSITIVE = (
    "T > 0: accepted lengths are drawn with the exact acceptance law given the recorded prefix; after each cycle the "
    "replay continues along the recorded trajectory, not along the accepted draft tokens and the corrected token a "
    "real run would commit (same marginal law, but not conditioned on the acceptance outcome)."
)


class _PromptLengths:
    """``n`` and ``prompt_len`` of a prompt's trace (chain or tree), from its ``output`` and ``prompt_ids``."""

    output: np.ndarray
    prompt_ids: np.ndarray

    @property
    def n(self) -> int:
        """Tokens generated (the prefill's first token included)."""
        return int(self.output.shape[0])

    @property
    def prompt_len(self) -> int:
        return int(self.prompt_ids.shape[0])


@dataclass
class PromptTrace(_PromptLengths):
    """The trace of one prompt (see the module docstring). n = generated tokens, D = max_depth.

    Attributes:
        prompt_ids: int64 (L,).
        output: int64 (n,), the recorded generation.
        ended_by_eos: the generation ended with EOS (else at ``max_new_tokens``).
        chain_len: int64 (n+1,), drafted tokens available at position t.
        draft_tokens: int64 (n+1, D), −1 padded.
        confidence, entropy: float64 (n+1, D) (entropy in nats), 0 padded.
        drafter_features: float32 (n+1, D+1, 2), before each decision.
        accept_prob: float64 (n+1, D), NaN padded.
        seed: the recording's sampling seed.
        target_stats: float64 (n+1, 3), the target's (top-1 probability, entropy, top-2 margin) where ``g_{t-1}``
            was drawn (row 0 NaN); None or all NaN for a trace recorded without it.
        draft_margin: float64 (n+1, D), the draft's top-2 margin per drafted token (0 padded); None or all NaN
            likewise.
    """

    prompt_ids: np.ndarray
    output: np.ndarray
    ended_by_eos: bool
    chain_len: np.ndarray
    draft_tokens: np.ndarray
    confidence: np.ndarray
    entropy: np.ndarray
    drafter_features: np.ndarray
    accept_prob: np.ndarray
    seed: int = 0
    target_stats: np.ndarray | None = None
    draft_margin: np.ndarray | None = None

    @property
    def has_acceptance_features(self) -> bool:
        """The trace holds the acceptance features (``target_stats`` and ``draft_margin``, recorded since issue 16)."""
        return (self.target_stats is not None and self.draft_margin is not None
                and bool(np.isfinite(self.target_stats[1:]).all()) and not np.isnan(self.draft_margin).any())

    def accepted_run(self) -> np.ndarray:
        """int64 (n+1,): per position, the number of leading drafted tokens accepted with probability 1 — at
        T = 0 the accepted length τ of a cycle drafting the whole chain (τ = min(d, run) at depth d)."""
        ok = np.nan_to_num(self.accept_prob, nan=0.0) >= 1.0
        first_fail = np.where(ok.all(axis=1), ok.shape[1], np.argmin(ok, axis=1))
        return np.minimum(first_fail, self.chain_len).astype(np.int64)


@dataclass
class _TraceFile:
    """What chain and tree trace sets share: the header, the prompts, the header's settings, and writing the file
    (the per-prompt arrays of :func:`_prompt_arrays` plus the structure's own, :meth:`_arrays`)."""

    header: dict
    prompts: list = field(default_factory=list)
    _array_docs: ClassVar[dict[str, str]] = {}  # each structure's array docs (ARRAY_DOCS, TREE_ARRAY_DOCS)

    @property
    def max_depth(self) -> int:
        return int(self.header["max_depth"])

    @property
    def max_new_tokens(self) -> int:
        return int(self.header["max_new_tokens"])

    @property
    def drafter(self) -> str:
        """The drafter's name (``"model"``, ``"head"``, ``"lookup"``)."""
        d = self.header.get("drafter", {})
        return str(d.get("drafter", d) if isinstance(d, dict) else d)

    def __len__(self) -> int:
        return len(self.prompts)

    def _arrays(self) -> dict[str, np.ndarray]:
        raise NotImplementedError

    def save(self, path: str | Path) -> Path:
        """Write ``path`` (``.npz`` added if missing) and the header beside it as ``<stem>.json``.

        Returns:
            the ``.npz`` path.
        """
        path = Path(path)
        if path.suffix != ".npz":
            path = path.with_name(path.name + ".npz")
        path.parent.mkdir(parents=True, exist_ok=True)
        arrays = {**_prompt_arrays(self.prompts), **self._arrays()}
        header = {**self.header, "arrays": self._array_docs, "num_prompts": len(self.prompts)}
        text = json.dumps(header, indent=2, default=str)
        _write_npz(path, text, arrays)
        path.with_suffix(".json").write_text(text + "\n")
        self.header = header
        return path

    @classmethod
    def _from_arrays(cls, header: dict, arrays: dict, prompt_cls, per_row: tuple[str, ...]):
        """The set of the checked arrays of a file: one ``prompt_cls`` per prompt, with its rows of ``per_row``."""
        return cls(header, [prompt_cls(**common, **{k: arrays[k][rs] for k in per_row})
                            for common, rs in _split_prompts(arrays)])


@dataclass
class TraceSet(_TraceFile):
    """Traces of several prompts with the header that says where they came from.

    Attributes:
        header: JSON-serialisable dict (``format``, ``format_version``, ``structure``, ``target``, ``draft``,
            ``drafter``, ``sampling``, ``feature_version``, ``max_depth``, ``max_new_tokens``, ``machine``, …).
        prompts: one :class:`PromptTrace` per prompt.

    ``max_depth``, ``max_new_tokens``, ``drafter``, ``len()`` and :meth:`save` (``path``, ``.npz`` added if
    missing, and the header beside it as ``<stem>.json``; returns the ``.npz`` path) read and write the header.
    """

    prompts: list[PromptTrace] = field(default_factory=list)
    _array_docs = ARRAY_DOCS

    @property
    def deterministic(self) -> bool:
        """Recorded at temperature 0: every acceptance probability is 0 or 1."""
        return float(self.header["sampling"]["temperature"]) == 0.0

    @property
    def has_acceptance_features(self) -> bool:
        """Every prompt holds the acceptance features (:data:`ACCEPTANCE_ARRAYS`); False for traces recorded before
        them (or an empty set)."""
        return bool(self.prompts) and all(p.has_acceptance_features for p in self.prompts)

    # ------------------------------------------------------------------ files
    def _arrays(self) -> dict[str, np.ndarray]:
        D, ps = self.max_depth, self.prompts
        return {
            "chain_len": _cat([p.chain_len for p in ps], np.int64, (0,)),
            "draft_tokens": _cat([p.draft_tokens for p in ps], np.int64, (0, D)),
            "confidence": _cat([p.confidence for p in ps], np.float64, (0, D)),
            "entropy": _cat([p.entropy for p in ps], np.float64, (0, D)),
            "drafter_features": _cat([p.drafter_features for p in ps], np.float32, (0, D + 1, NUM_DRAFTER_FEATURES)),
            "accept_prob": _cat([p.accept_prob for p in ps], np.float64, (0, D)),
            "target_stats": _cat([_or_nan(p.target_stats, (p.n + 1, 3)) for p in ps], np.float64, (0, 3)),
            "draft_margin": _cat([_or_nan(p.draft_margin, (p.n + 1, D)) for p in ps], np.float64, (0, D)),
        }

    @classmethod
    def load(cls, path: str | Path) -> TraceSet:
        """Read a trace file written by :meth:`save` (``python -m eval.record``).

        Raises:
            FileNotFoundError: no such file.
            ValueError: not a trace file, another format version, a draft-tree trace file (read those with
                :meth:`TreeTraceSet.load`), a feature version other than this learn2draft's, or inconsistent arrays
                (shifted offsets, a NaN acceptance probability of a drafted token, a ``vocab_size`` that is no
                integer ≥ 2 or token ids outside [0, vocab_size)), or damaged acceptance features (one of the two
                arrays alone, another shape, a non-finite or out-of-range value where one was recorded).
        """
        path = Path(path)
        data, header = _open_trace(path)
        if header.get("structure") == TREE:
            raise ValueError(f"{path} holds draft-tree traces (recorded with --tree): replay (train --replay, "
                             "SpecDecodeReplay-v0, eval.simreal) needs chain traces: record them without --tree. "
                             "python -m eval.oracle reads either kind, one kind per run; in Python, "
                             "learn2draft.replay.traces.TreeTraceSet.load reads this file.")
        if header.get("format_version") != TRACE_FORMAT_VERSION:
            raise ValueError(f"{path}: trace format version {header.get('format_version')}, this learn2draft reads "
                             f"version {TRACE_FORMAT_VERSION}: re-record it with `python -m eval.record`.")
        if header.get("structure") != CHAIN:
            raise ValueError(f"{path}: structure {header.get('structure')!r}; this version replays chain traces only.")
        arrays = _read_arrays(path, data, [k for k in ARRAY_DOCS if k not in ACCEPTANCE_ARRAYS])
        if header.get("feature_version") != FEATURE_VERSION:
            raise ValueError(f"{path} was recorded with feature version {header.get('feature_version')}, this "
                             f"learn2draft builds version {FEATURE_VERSION}: re-record it with `python -m eval.record`.")
        D = int(header["max_depth"])
        rows = _checked_rows(path, arrays)
        if not (arrays["draft_tokens"].shape == (rows, D) and arrays["drafter_features"].shape[:2] == (rows, D + 1)):
            raise ValueError(f"{path}: inconsistent array shapes (a truncated or hand-edited file?); re-record it.")
        cl, ap = arrays["chain_len"], arrays["accept_prob"]
        if (cl.size and (cl.min() < 0 or cl.max() > D)) or (ap.size and not np.all(np.isnan(ap) | ((ap >= 0) & (ap <= 1)))):
            raise ValueError(f"{path}: chain lengths outside [0, max_depth] or acceptance probabilities outside [0, 1] "
                             "(NaN marks no draft; a hand-edited file?); re-record it.")
        drafted = np.arange(D)[None, :] < cl[:, None]  # (R, D): the positions of drafted tokens
        if np.isnan(ap[drafted]).any():
            raise ValueError(f"{path}: NaN acceptance probability of a drafted token (NaN marks only the positions past "
                             "chain_len; a hand-edited or damaged file?); re-record it.")
        dt = arrays["draft_tokens"]
        _check_ids(path, header, arrays, dt[drafted])
        if np.any(dt[~drafted] != -1):
            raise ValueError(f"{path}: draft_tokens past chain_len must be -1 (a hand-edited file?); re-record it.")
        arrays.update(_acceptance_arrays(path, data, arrays, rows, D, drafted))
        return cls._from_arrays(header, arrays, PromptTrace, ("chain_len", "draft_tokens", "confidence", "entropy",
                                                              "drafter_features", "accept_prob", *ACCEPTANCE_ARRAYS))


def _acceptance_arrays(path: Path, data, arrays, rows: int, D: int, drafted: np.ndarray) -> dict[str, np.ndarray]:
    """The acceptance features of a chain trace file (:data:`ACCEPTANCE_ARRAYS`), checked; NaN arrays of their shapes
    for a file recorded before them.

    Args:
        path: the file (named in errors); ``data``: its open .npz; ``arrays``: its checked arrays (offsets).
        rows: R; ``D``: max_depth; ``drafted``: bool (R, D), the positions of drafted tokens.

    Raises:
        ValueError: one array without the other, another shape, or — where a value was recorded (rows t ≥ 1 of
            target_stats, drafted positions of draft_margin) — a non-finite value, a probability or margin outside
            [0, 1], a negative entropy or a margin above the top-1 probability.
    """
    present = [k for k in ACCEPTANCE_ARRAYS if k in data.files]
    if not present:
        return {"target_stats": np.full((rows, 3), np.nan), "draft_margin": np.full((rows, D), np.nan)}
    if len(present) < len(ACCEPTANCE_ARRAYS):
        raise ValueError(f"{path}: holds {present[0]} without {[k for k in ACCEPTANCE_ARRAYS if k not in present][0]} "
                         "(a damaged or hand-edited file?); re-record it with `python -m eval.record`.")
    got = _read_arrays(path, data, ACCEPTANCE_ARRAYS)
    ts, dm = got["target_stats"].astype(np.float64), got["draft_margin"].astype(np.float64)
    if ts.shape != (rows, 3) or dm.shape != (rows, D):
        raise ValueError(f"{path}: acceptance features of shapes target_stats {ts.shape}, draft_margin {dm.shape}, "
                         f"expected ({rows}, 3) and ({rows}, {D}) (a truncated or hand-edited file?); re-record it.")
    first = np.zeros(rows, dtype=bool)
    first[arrays["row_offsets"][:-1]] = True  # row 0 of every prompt: nothing generated yet, no statistics
    t, m, eps = ts[~first], dm[drafted], 1e-6
    if not (np.isfinite(t).all() and np.isfinite(m).all() and np.all((t[:, 0] >= -eps) & (t[:, 0] <= 1 + eps))
            and np.all(t[:, 1] >= -eps) and np.all((t[:, 2] >= -eps) & (t[:, 2] <= t[:, 0] + eps))
            and np.all((m >= -eps) & (m <= 1 + eps))):
        raise ValueError(f"{path}: acceptance features hold a non-finite value, a probability or margin outside [0, 1], "
                         "a negative entropy or a margin above its top-1 probability (a damaged or hand-edited file?); "
                         "re-record it with `python -m eval.record`.")
    return {"target_stats": ts, "draft_margin": dm}


def _or_nan(x: np.ndarray | None, shape: tuple[int, ...]) -> np.ndarray:
    """``x``, or a NaN array of ``shape`` for a trace without it."""
    return np.full(shape, np.nan) if x is None else x


def load_traces(paths: str | Path | Sequence[str | Path]) -> TraceSet:
    """Load one trace file, or several recorded with the same settings (their prompts concatenated).

    ``paths`` may be one path, a comma-separated string of paths, or a sequence of paths.

    Raises:
        FileNotFoundError, ValueError: as :meth:`TraceSet.load`; also when the files differ in models,
            drafter, sampling, ``max_depth`` or ``max_new_tokens``, or a comma-separated string has an empty item
            (``"a.npz,,b.npz"``, a trailing comma).
    """
    return _load_many(TraceSet, paths, ("target", "draft", "drafter", "sampling", "max_depth", "max_new_tokens", "chat"))


def _load_many(cls, paths, keys: tuple[str, ...]):
    """``cls.load`` of one path, a comma-separated string of paths or a sequence of them; several are
    concatenated after checking that their headers agree on ``keys``."""
    if isinstance(paths, (str, Path)):
        from learn2draft.cli import comma_items

        paths = comma_items(str(paths), "trace files", "join the trace files with single commas, e.g. a.npz,b.npz")
    sets = [cls.load(p) for p in paths]
    if not sets:
        raise ValueError("No trace file given.")
    first = sets[0]
    for p, s in zip(paths[1:], sets[1:]):
        diff = [k for k in keys if s.header.get(k) != first.header.get(k)]
        if diff:
            raise ValueError(f"{p} was recorded with other {', '.join(diff)} than {paths[0]}: replay them separately.")
    if len(sets) == 1:
        return first
    header = {**first.header, "sources": [str(p) for p in paths], "num_prompts": sum(len(s) for s in sets)}
    return cls(header, [pt for s in sets for pt in s.prompts])


def _prompt_arrays(prompts) -> dict[str, np.ndarray]:
    """The arrays every trace file holds, whatever its structure: prompt and output tokens with their
    offsets, the per-position row offsets (n + 1 rows per prompt), EOS flags and seeds."""
    def offsets(lengths):
        return np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)

    return {
        "prompt_offsets": offsets([p.prompt_len for p in prompts]),
        "prompt_tokens": _cat([p.prompt_ids for p in prompts], np.int64, (0,)),
        "output_offsets": offsets([p.n for p in prompts]),
        "output_tokens": _cat([p.output for p in prompts], np.int64, (0,)),
        "row_offsets": offsets([p.n + 1 for p in prompts]),
        "ended_by_eos": np.asarray([p.ended_by_eos for p in prompts], dtype=bool),
        "seeds": np.asarray([p.seed for p in prompts], dtype=np.int64),
    }


def _checked_rows(path: Path, arrays) -> int:
    """The number of per-position rows, after checking the arrays of :func:`_prompt_arrays` agree (their
    offsets start at 0, never decrease and end at the length of the arrays they cut).

    Raises:
        ValueError: inconsistent shapes or offsets (a truncated, shifted or hand-edited file).
    """
    po, oo, ro = arrays["prompt_offsets"], arrays["output_offsets"], arrays["row_offsets"]
    P = po.shape[0] - 1
    if not (oo.shape[0] == ro.shape[0] == P + 1 and arrays["ended_by_eos"].shape == (P,)
            and np.array_equal(np.diff(ro), np.diff(oo) + 1)):
        raise ValueError(f"{path}: inconsistent array shapes (a truncated or hand-edited file?); re-record it.")
    _check_offsets(path, arrays, "prompt_offsets", arrays["prompt_tokens"].shape[0])
    _check_offsets(path, arrays, "output_offsets", arrays["output_tokens"].shape[0])
    _check_offsets(path, arrays, "row_offsets", int(ro[-1]) if ro.size else 0)
    return int(ro[-1]) if ro.size else 0


def _check_offsets(path: Path, arrays, name: str, length: int) -> None:
    """``arrays[name]`` must start at 0, never decrease and end at ``length`` (the array it cuts into prompts).

    Raises:
        ValueError: naming ``path`` and the offsets.
    """
    o = arrays[name]
    if not (o.ndim == 1 and o.size and o[0] == 0 and o[-1] == length and np.all(np.diff(o) >= 0)):
        raise ValueError(f"{path}: {name} must start at 0, never decrease and end at {length} (the length of the array "
                         f"it cuts into prompts), got {o[:4].tolist()}…{o[-2:].tolist()} (a shifted or hand-edited "
                         "file?); re-record it.")


def _check_ids(path: Path, header: dict, arrays, drafted=None) -> None:
    """The header's ``vocab_size`` is an integer ≥ 2 and every token id (prompts, outputs, ``drafted``) is in
    [0, vocab_size).

    Raises:
        ValueError: naming ``path``.
    """
    V = header.get("vocab_size")
    if isinstance(V, bool) or not isinstance(V, int) or V < 2:
        raise ValueError(f"{path}: header vocab_size must be an integer ≥ 2 (the target's vocabulary), got {V!r} "
                         "(a hand-edited file?); re-record it.")
    for name, ids in (("prompt_tokens", arrays["prompt_tokens"]), ("output_tokens", arrays["output_tokens"]),
                      ("draft_tokens", drafted)):
        if ids is not None and ids.size and (ids.min() < 0 or ids.max() >= V):
            raise ValueError(f"{path}: {name} holds ids outside the vocabulary [0, {V}) (ids {int(ids.min())}.."
                             f"{int(ids.max())}): a wrong vocab_size or a damaged file; re-record it.")


def _split_prompts(arrays):
    """Per prompt: (the keyword arguments every prompt trace takes, the slice of its rows)."""
    po, oo, ro = arrays["prompt_offsets"], arrays["output_offsets"], arrays["row_offsets"]
    for p in range(po.shape[0] - 1):
        yield ({"prompt_ids": arrays["prompt_tokens"][po[p]:po[p + 1]], "output": arrays["output_tokens"][oo[p]:oo[p + 1]],
                "ended_by_eos": bool(arrays["ended_by_eos"][p]), "seed": int(arrays["seeds"][p])},
               slice(int(ro[p]), int(ro[p + 1])))


def _write_npz(path: Path, header_text: str, arrays: dict) -> None:
    """Write the .npz through a temporary file in the same folder, then rename it: an interrupted write
    leaves the earlier file (or none), never a truncated one. The file gets the permissions of any new file
    (0666 less the umask), as its ``.json`` header does."""
    import os
    import tempfile

    fd, tmp = tempfile.mkstemp(suffix=".npz", prefix=f".{path.stem}-", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            np.savez_compressed(f, header=np.array(header_text), **arrays)
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)  # mkstemp's 0600 → the permissions of any new file (its .json header's)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def check_writable(path: str | Path) -> Path:
    """Check, before a long recording, that the ``.npz`` at ``path`` (``.npz`` added if missing) can be written:
    its folder is created if missing and a temporary file is written there and removed.

    Returns:
        the ``.npz`` path.

    Raises:
        ValueError: the folder cannot be created or written (the message names ``path``).
    """
    import tempfile

    path = Path(path)
    if path.suffix != ".npz":
        path = path.with_name(path.name + ".npz")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=path.parent, prefix=f".{path.stem}-", suffix=".probe"):
            pass
    except OSError as e:
        raise ValueError(f"--out {path}: cannot write there ({e.strerror or e}); choose another path before "
                         "recording.") from None
    if path.is_dir():
        raise ValueError(f"--out {path} is a directory: give a file name such as {path / 'traces.npz'}.")
    return path


def _open_trace(path: Path):
    """(the open .npz, its header dict) of a learn2draft trace file of any structure.

    Raises:
        FileNotFoundError: no such file. ValueError: not a learn2draft trace file.
    """
    if path.suffix == ".json" and path.with_suffix(".npz").is_file():
        raise ValueError(f"{path} is a trace's JSON header (for reading without numpy); pass the trace itself: "
                         f"{path.with_suffix('.npz')}.")
    if not path.is_file():
        npz = path.with_suffix(".npz") if path.suffix != ".npz" else path
        hint = (f"did you mean {npz}?" if npz.is_file() else
                f"record one with `python -m eval.record --out {npz}`.")
        raise FileNotFoundError(f"No trace file at {path}: {hint}")
    import zipfile

    try:
        data = np.load(path, allow_pickle=False)
        header = json.loads(str(data["header"]))
    except (KeyError, ValueError, OSError, EOFError, zipfile.BadZipFile) as e:
        raise ValueError(f"{path} is not a learn2draft trace file ({e.__class__.__name__}: {e}); record one with "
                         "`python -m eval.record`.") from None
    if not isinstance(header, dict) or header.get("format") != TRACE_FORMAT:
        fmt = header.get("format") if isinstance(header, dict) else None
        raise ValueError(f"{path}: format {fmt!r}, expected {TRACE_FORMAT!r}.")
    return data, header


def _read_arrays(path: Path, data, names) -> dict[str, np.ndarray]:
    import zipfile

    try:
        return {k: data[k] for k in names}
    except (KeyError, ValueError, OSError, EOFError, zipfile.BadZipFile) as e:
        raise ValueError(f"{path} is not a complete learn2draft trace file ({e.__class__.__name__}: {e}); re-record it "
                         "with `python -m eval.record`.") from None


def trace_structure(path: str | Path) -> str:
    """The structure of a trace file, read from its header only: ``"chain"`` or ``"tree"``.

    Raises:
        FileNotFoundError: no such file. ValueError: not a learn2draft trace file.
    """
    return str(_open_trace(Path(path))[1].get("structure"))


def _cat(parts, dtype, empty_shape) -> np.ndarray:
    return np.concatenate([np.asarray(x, dtype=dtype) for x in parts]) if parts else np.zeros(empty_shape, dtype=dtype)


# --------------------------------------------------------------------------- draft trees
#: Version of the tree trace layout; :meth:`TreeTraceSet.load` refuses other versions.
TREE_TRACE_FORMAT_VERSION = 1

TREE_T_POSITIVE_REFUSAL = (
    "Tree traces are recorded at temperature 0 only: replaying a tree's acceptance at T > 0 needs, per verified "
    "node, the residual law after its rejected siblings (EAGLE-2's recursive rejection), which a trace of accepted "
    "lengths does not record. Pass temperature 0 (--temperature 0)."
)

#: Every array of a tree trace file. P prompts, R = Σ (n_p + 1) position rows, D = max_depth, S = len(verify_sizes).
TREE_ARRAY_DOCS: dict[str, str] = {
    "prompt_offsets": ARRAY_DOCS["prompt_offsets"],
    "prompt_tokens": ARRAY_DOCS["prompt_tokens"],
    "output_offsets": ARRAY_DOCS["output_offsets"],
    "output_tokens": "int64 (Σ n_p,): the recorded greedy generation g",
    "row_offsets": ARRAY_DOCS["row_offsets"],
    "tree_depth": "int64 (R,): tree levels drafted from that position, min(max_depth, max_new_tokens − t − 1) (0 in "
                  "rows 0 and n_p); a cycle asking for depth d drafts min(d, tree_depth[t]) levels",
    "level_nodes": "int64 (R, D): drafted nodes on level 1..D of that position's tree (0 past tree_depth); a tree of "
                   "depth d holds the first d levels (EAGLE-2 expansion never revisits a level)",
    "tau": "int64 (R, D+1, S): accepted length τ of a cycle at that position with depth d = 0..D and verification "
           "size verify_sizes[s] (the top-V nodes of the depth-d tree by score, ancestors included); d = 0 is plain "
           "decoding (τ = 0); uncapped: emitted = min(τ + 1, n_p − t)",
    "ended_by_eos": ARRAY_DOCS["ended_by_eos"],
    "seeds": ARRAY_DOCS["seeds"],
}


@dataclass
class TreePromptTrace(_PromptLengths):
    """The draft-tree trace of one prompt at temperature 0. n = generated tokens, D = max_depth,
    S = len(verify_sizes).

    Attributes:
        prompt_ids: int64 (L,).
        output: int64 (n,), the greedy generation.
        ended_by_eos: the generation ended with EOS (else at ``max_new_tokens``).
        tree_depth: int64 (n+1,), tree levels drafted at position t (rows 0 and n: 0).
        level_nodes: int64 (n+1, D), nodes on each level of the tree drafted at t.
        tau: int64 (n+1, D+1, S), accepted length of a cycle at t with depth d and verification size
            ``verify_sizes[s]``; d above ``tree_depth[t]`` repeats the value at ``tree_depth[t]`` (the decoder
            drafts no deeper); not capped at the tokens left (emitted = min(τ + 1, n − t)).
        seed: the recording's seed.
        greedy_inconsistencies: positions whose whole tree's accepted path (every node verified) disagrees with the
            recorded greedy output (set by :func:`learn2draft.traces.record_tree_prompt`; not stored per prompt, summed in the header).
    """

    prompt_ids: np.ndarray
    output: np.ndarray
    ended_by_eos: bool
    tree_depth: np.ndarray
    level_nodes: np.ndarray
    tau: np.ndarray
    seed: int = 0
    greedy_inconsistencies: int = 0

    def nodes_up_to(self) -> np.ndarray:
        """int64 (n+1, D+1): entry (t, d) = drafted nodes of levels ≤ d at position t (column 0: 0), the nodes a
        depth-d tree holds; a cycle with verification size V verifies min(V, nodes_up_to[t, d]) of them."""
        cum = np.cumsum(self.level_nodes, axis=1)
        return np.concatenate([np.zeros((cum.shape[0], 1), dtype=np.int64), cum], axis=1).astype(np.int64)


@dataclass
class TreeTraceSet(_TraceFile):
    """Draft-tree traces of several prompts with their header (``structure`` = ``kind`` = ``"tree"``, ``width``,
    ``top_k``, ``verify_sizes``, ``max_depth``, ``max_new_tokens``, models, drafter, sampling, machine, …).

    Attributes:
        header: JSON-serialisable dict.
        prompts: one :class:`TreePromptTrace` per prompt.

    ``max_depth``, ``max_new_tokens``, ``drafter`` (``"model"`` or ``"head"``), ``len()`` and :meth:`save` as
    :class:`TraceSet`'s.
    """

    prompts: list[TreePromptTrace] = field(default_factory=list)
    _array_docs = TREE_ARRAY_DOCS
    deterministic = True  # temperature 0 only

    @property
    def verify_sizes(self) -> list[int]:
        return [int(v) for v in self.header["verify_sizes"]]

    @property
    def width(self) -> int:
        return int(self.header["width"])

    @property
    def top_k(self) -> int:
        return int(self.header["top_k"])

    def _arrays(self) -> dict[str, np.ndarray]:
        D, S, ps = self.max_depth, len(self.verify_sizes), self.prompts
        return {
            "tree_depth": _cat([p.tree_depth for p in ps], np.int64, (0,)),
            "level_nodes": _cat([p.level_nodes for p in ps], np.int64, (0, D)),
            "tau": _cat([p.tau for p in ps], np.int64, (0, D + 1, S)),
        }

    @classmethod
    def load(cls, path: str | Path) -> TreeTraceSet:
        """Read a tree trace file written by :meth:`save` (``python -m eval.record --tree``).

        Raises:
            FileNotFoundError: no such file.
            ValueError: not a trace file, a chain trace file, another tree format version, or inconsistent arrays
                (shifted offsets, token ids outside [0, vocab_size)).
        """
        path = Path(path)
        data, header = _open_trace(path)
        if header.get("structure") != TREE:
            raise ValueError(f"{path} holds {header.get('structure')!r} traces, not draft-tree traces: load it with "
                             "learn2draft.replay.traces.TraceSet.load, or record tree traces with "
                             "`python -m eval.record --tree`.")
        if header.get("format_version") != TREE_TRACE_FORMAT_VERSION:
            raise ValueError(f"{path}: tree trace format version {header.get('format_version')}, this learn2draft "
                             f"reads version {TREE_TRACE_FORMAT_VERSION}: re-record it with "
                             "`python -m eval.record --tree`.")
        arrays = _read_arrays(path, data, TREE_ARRAY_DOCS)
        D, S = int(header["max_depth"]), len(header["verify_sizes"])

        try:
            check_verify_sizes(header["verify_sizes"])
        except ValueError as e:
            raise ValueError(f"{path}: header {e} (a hand-edited file?); re-record it.") from None
        R = _checked_rows(path, arrays)
        _check_ids(path, header, arrays)
        if not (arrays["tree_depth"].shape == (R,) and arrays["level_nodes"].shape == (R, D)
                and arrays["tau"].shape == (R, D + 1, S)):
            raise ValueError(f"{path}: inconsistent array shapes (a truncated or hand-edited file?); re-record it.")
        tau, depth = arrays["tau"], np.arange(D + 1)[None, :, None]
        if tau.size and (tau.min() < 0 or np.any(tau > depth) or arrays["tree_depth"].min() < 0
                         or arrays["tree_depth"].max() > D or arrays["level_nodes"].min() < 0):
            raise ValueError(f"{path}: accepted lengths outside [0, depth] or negative tree sizes (a hand-edited "
                             "file?); re-record it.")
        return cls._from_arrays(header, arrays, TreePromptTrace, ("tree_depth", "level_nodes", "tau"))


def load_tree_traces(paths: str | Path | Sequence[str | Path]) -> TreeTraceSet:
    """Load one tree trace file, or several recorded with the same settings (their prompts concatenated).

    ``paths`` may be one path, a comma-separated string of paths, or a sequence of paths.

    Raises:
        FileNotFoundError, ValueError: as :meth:`TreeTraceSet.load`; also when the files differ in models, drafter,
            tree shape (width, top_k, max_depth, verify_sizes) or max_new_tokens.
    """
    return _load_many(TreeTraceSet, paths, ("target", "draft", "drafter", "sampling", "max_depth", "max_new_tokens",
                                            "verify_sizes", "width", "top_k", "chat"))


__all__ = [
    "ACCEPTANCE_ARRAYS", "APPROXIMATION_T_POSITIVE", "ARRAY_DOCS", "CHAIN", "NUM_DRAFTER_FEATURES", "TRACE_FORMAT", "TRACE_FORMAT_VERSION",
    "TREE", "TREE_ARRAY_DOCS", "TREE_TRACE_FORMAT_VERSION", "TREE_T_POSITIVE_REFUSAL", "PromptTrace", "TraceSet",
    "TreePromptTrace", "TreeTraceSet", "check_writable", "load_traces", "load_tree_traces", "trace_structure",
]
