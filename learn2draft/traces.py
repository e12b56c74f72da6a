"""Recorded drafting traces: what the drafter and the target *agree on*, stored once, replayed for any policy.

A speculative-decoding reward (tokens/s) is the product of two things: how many drafted tokens the
target accepts (a property of the models and the text) and what each forward costs (a property of
the hardware, :mod:`learn2draft.latency`). A trace stores the first, for every depth a chain policy
could have chosen, so that :class:`envs.replay.SpecDecodeReplayEnv` can replay any depth policy
without running a model.

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

At temperature 0 these probabilities are 0 or 1, and the accepted length of a cycle that starts at t
with depth d is ``τ = min(d, accepted_run[t])`` — the number of leading ones — exactly what the
real loop computes, because its verification forward sees the same tokens (equality holds up to
floating-point near-ties between differently batched forwards; :func:`record_traces` counts the
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
format and its version, the structure (``"chain"``; a draft-tree format will add ``tree_*`` arrays
and ``"structure": "tree"``), the models, the drafter, the sampling settings, the feature version,
``max_depth``, ``max_new_tokens`` and the machine it was recorded on.
"""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from learn2draft.features import FEATURE_NAMES, FEATURE_VERSION

TRACE_FORMAT = "learn2draft-trace"
#: Version of the file layout; :meth:`TraceSet.load` refuses other versions.
TRACE_FORMAT_VERSION = 1
CHAIN = "chain"
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
}

APPROXIMATION_T_POSITIVE = (
    "T > 0: accepted lengths are drawn with the exact acceptance law given the recorded prefix; after each cycle the "
    "replay continues along the recorded trajectory, not along the accepted draft tokens and the corrected token a "
    "real run would commit (same marginal law, but not conditioned on the acceptance outcome)."
)


@dataclass
class PromptTrace:
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

    @property
    def n(self) -> int:
        """Tokens generated (the prefill's first token included)."""
        return int(self.output.shape[0])

    @property
    def prompt_len(self) -> int:
        return int(self.prompt_ids.shape[0])

    def accepted_run(self) -> np.ndarray:
        """int64 (n+1,): per position, the number of leading drafted tokens accepted with probability 1 — at
        T = 0 the accepted length τ of a cycle drafting the whole chain (τ = min(d, run) at depth d)."""
        ok = np.nan_to_num(self.accept_prob, nan=0.0) >= 1.0
        first_fail = np.where(ok.all(axis=1), ok.shape[1], np.argmin(ok, axis=1))
        return np.minimum(first_fail, self.chain_len).astype(np.int64)


@dataclass
class TraceSet:
    """Traces of several prompts with the header that says where they came from.

    Attributes:
        header: JSON-serialisable dict (``format``, ``format_version``, ``structure``, ``target``, ``draft``,
            ``drafter``, ``sampling``, ``feature_version``, ``max_depth``, ``max_new_tokens``, ``machine``, …).
        prompts: one :class:`PromptTrace` per prompt.
    """

    header: dict
    prompts: list[PromptTrace] = field(default_factory=list)

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

    @property
    def deterministic(self) -> bool:
        """Recorded at temperature 0: every acceptance probability is 0 or 1."""
        return float(self.header["sampling"]["temperature"]) == 0.0

    def __len__(self) -> int:
        return len(self.prompts)

    # ------------------------------------------------------------------ files
    def save(self, path: str | Path) -> Path:
        """Write ``path`` (``.npz`` added if missing) and the header beside it as ``<stem>.json``.

        Returns:
            the ``.npz`` path.
        """
        path = Path(path)
        if path.suffix != ".npz":
            path = path.with_name(path.name + ".npz")
        path.parent.mkdir(parents=True, exist_ok=True)
        D = self.max_depth
        ps = self.prompts

        def offsets(lengths):
            return np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)

        arrays = {
            "prompt_offsets": offsets([p.prompt_len for p in ps]),
            "prompt_tokens": _cat([p.prompt_ids for p in ps], np.int64, (0,)),
            "output_offsets": offsets([p.n for p in ps]),
            "output_tokens": _cat([p.output for p in ps], np.int64, (0,)),
            "row_offsets": offsets([p.n + 1 for p in ps]),
            "chain_len": _cat([p.chain_len for p in ps], np.int64, (0,)),
            "draft_tokens": _cat([p.draft_tokens for p in ps], np.int64, (0, D)),
            "confidence": _cat([p.confidence for p in ps], np.float64, (0, D)),
            "entropy": _cat([p.entropy for p in ps], np.float64, (0, D)),
            "drafter_features": _cat([p.drafter_features for p in ps], np.float32, (0, D + 1, NUM_DRAFTER_FEATURES)),
            "accept_prob": _cat([p.accept_prob for p in ps], np.float64, (0, D)),
            "ended_by_eos": np.asarray([p.ended_by_eos for p in ps], dtype=bool),
            "seeds": np.asarray([p.seed for p in ps], dtype=np.int64),
        }
        header = {**self.header, "arrays": ARRAY_DOCS, "num_prompts": len(ps)}
        text = json.dumps(header, indent=2, default=str)
        np.savez_compressed(path, header=np.array(text), **arrays)
        path.with_suffix(".json").write_text(text + "\n")
        self.header = header
        return path

    @classmethod
    def load(cls, path: str | Path) -> TraceSet:
        """Read a trace file written by :meth:`save` (``python -m eval.record``).

        Raises:
            FileNotFoundError: no such file.
            ValueError: not a trace file, another format version, a structure this version cannot replay
                (draft trees), a feature version other than this learn2draft's, or inconsistent arrays.
        """
        path = Path(path)
        if not path.is_file():
            raise FileNotFoundError(f"No trace file at {path}: record one with `python -m eval.record --out {path}`.")
        try:
            data = np.load(path, allow_pickle=False)
            header = json.loads(str(data["header"]))
            arrays = {k: data[k] for k in ARRAY_DOCS}
        except (KeyError, ValueError, OSError) as e:
            raise ValueError(f"{path} is not a learn2draft trace file ({e.__class__.__name__}: {e}); record one with "
                             "`python -m eval.record`.") from None
        if header.get("format") != TRACE_FORMAT:
            raise ValueError(f"{path}: format {header.get('format')!r}, expected {TRACE_FORMAT!r}.")
        if header.get("format_version") != TRACE_FORMAT_VERSION:
            raise ValueError(f"{path}: trace format version {header.get('format_version')}, this learn2draft reads "
                             f"version {TRACE_FORMAT_VERSION}: re-record it with `python -m eval.record`.")
        if header.get("structure") != CHAIN:
            raise ValueError(f"{path}: structure {header.get('structure')!r}; this version replays chain traces only.")
        if header.get("feature_version") != FEATURE_VERSION:
            raise ValueError(f"{path} was recorded with feature version {header.get('feature_version')}, this "
                             f"learn2draft builds version {FEATURE_VERSION}: re-record it with `python -m eval.record`.")
        D = int(header["max_depth"])
        po, oo, ro = arrays["prompt_offsets"], arrays["output_offsets"], arrays["row_offsets"]
        P = po.shape[0] - 1
        if not (oo.shape[0] == ro.shape[0] == P + 1 and arrays["ended_by_eos"].shape == (P,)
                and np.array_equal(np.diff(ro), np.diff(oo) + 1) and arrays["draft_tokens"].shape == (int(ro[-1]), D)
                and arrays["drafter_features"].shape[:2] == (int(ro[-1]), D + 1)):
            raise ValueError(f"{path}: inconsistent array shapes (a truncated or hand-edited file?); re-record it.")
        prompts = []
        for p in range(P):
            r0, r1 = int(ro[p]), int(ro[p + 1])
            prompts.append(PromptTrace(
                prompt_ids=arrays["prompt_tokens"][po[p]:po[p + 1]],
                output=arrays["output_tokens"][oo[p]:oo[p + 1]],
                ended_by_eos=bool(arrays["ended_by_eos"][p]),
                chain_len=arrays["chain_len"][r0:r1],
                draft_tokens=arrays["draft_tokens"][r0:r1],
                confidence=arrays["confidence"][r0:r1],
                entropy=arrays["entropy"][r0:r1],
                drafter_features=arrays["drafter_features"][r0:r1],
                accept_prob=arrays["accept_prob"][r0:r1],
                seed=int(arrays["seeds"][p]),
            ))
        return cls(header, prompts)


def load_traces(paths: str | Path | Sequence[str | Path]) -> TraceSet:
    """Load one trace file, or several recorded with the same settings (their prompts concatenated).

    ``paths`` may be one path, a comma-separated string of paths, or a sequence of paths.

    Raises:
        FileNotFoundError, ValueError: as :meth:`TraceSet.load`; also when the files differ in models,
            drafter, sampling, ``max_depth`` or ``max_new_tokens``.
    """
    if isinstance(paths, (str, Path)):
        paths = [s for s in str(paths).split(",") if s.strip()]
    sets = [TraceSet.load(p) for p in paths]
    if not sets:
        raise ValueError("No trace file given.")
    first = sets[0]
    keys = ("target", "draft", "drafter", "sampling", "max_depth", "max_new_tokens", "chat")
    for p, s in zip(paths[1:], sets[1:]):
        diff = [k for k in keys if s.header.get(k) != first.header.get(k)]
        if diff:
            raise ValueError(f"{p} was recorded with other {', '.join(diff)} than {paths[0]}: replay them separately.")
    if len(sets) == 1:
        return first
    header = {**first.header, "sources": [str(p) for p in paths], "num_prompts": sum(len(s) for s in sets)}
    return TraceSet(header, [pt for s in sets for pt in s.prompts])


def _cat(parts, dtype, empty_shape) -> np.ndarray:
    return np.concatenate([np.asarray(x, dtype=dtype) for x in parts]) if parts else np.zeros(empty_shape, dtype=dtype)


# --------------------------------------------------------------------------- recording
def record_prompt(pair, drafter, prompt_ids, sampling, max_new_tokens: int, max_depth: int, seed: int = 0) -> PromptTrace:
    """Record the trace of one prompt (see the module docstring).

    The loop is the speculative decoder's with one change: at every position it drafts the longest chain a
    policy could ask for, verifies it with one target forward (the same forward a real verification of that
    chain runs, kept for its acceptance probabilities), and then commits exactly one token — the target's
    next token (argmax at T = 0, a draw from p at T > 0) — so that every position gets a chain.

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
    from transformers import DynamicCache

    from learn2draft.sampling import sample_from

    if max_new_tokens < 1 or max_depth < 0:
        raise ValueError(f"Need max_new_tokens ≥ 1 and max_depth ≥ 0, got {max_new_tokens} and {max_depth}.")
    dev = pair.device
    prompt = torch.as_tensor(prompt_ids, dtype=torch.long).reshape(-1).to(dev)
    if prompt.numel() == 0:
        raise ValueError("Empty prompt: pass at least one token.")
    pair.check_length(prompt.numel(), max_new_tokens)
    P, D, V = prompt.numel(), max_depth, pair.vocab_size
    gen = torch.Generator(device=dev).manual_seed(int(seed))
    eos = set(pair.eos_token_ids)
    cache = DynamicCache()
    need_hidden = drafter.needs_target_hidden

    def forward(tokens: torch.Tensor, first: int) -> torch.Tensor:
        out = pair.target(input_ids=tokens.unsqueeze(0), cache=cache, use_cache=True, output_hidden_states=need_hidden)
        if need_hidden:
            drafter.observe_target(out.hidden_states[-1][0], first)
        return out.logits[0, :, :V]

    rows = {k: [] for k in ("chain_len", "draft_tokens", "confidence", "entropy", "drafter_features", "accept_prob")}

    def add_row(chain, confs, ents, dfeats, accepts):
        L = len(chain)
        rows["chain_len"].append(L)
        rows["draft_tokens"].append(np.pad(np.asarray(chain, dtype=np.int64), (0, D - L), constant_values=-1))
        rows["confidence"].append(np.pad(np.asarray(confs, dtype=np.float64), (0, D - L)))
        rows["entropy"].append(np.pad(np.asarray(ents, dtype=np.float64), (0, D - L)))
        f = np.zeros((D + 1, NUM_DRAFTER_FEATURES), dtype=np.float32)
        f[: len(dfeats)] = np.asarray(dfeats, dtype=np.float32).reshape(len(dfeats), NUM_DRAFTER_FEATURES)
        rows["drafter_features"].append(f)
        rows["accept_prob"].append(np.pad(np.asarray(accepts, dtype=np.float64), (0, D - L), constant_values=np.nan))

    with torch.inference_mode():
        drafter.start(prompt)
        logits = forward(prompt, 0)[-1:]
        p = sampling.probs(logits, prompt, source="target")
        out = [sample_from(p[0], gen)]
        target_len = P  # the target has seen every committed token but the last
        add_row([], [], [], [np.zeros(NUM_DRAFTER_FEATURES)], [])  # row 0: never a decision
        while True:
            t = len(out)
            seq = torch.cat([prompt, torch.tensor(out, dtype=torch.long, device=dev)])
            finished = out[-1] in eos or t >= max_new_tokens
            budget = 0 if finished else min(D, max_new_tokens - t - 1)
            chain, confs, ents, qx = [], [], [], []
            dfeats = [np.asarray(drafter.features(seq), dtype=np.float32)]
            s = seq
            for _ in range(budget):
                if not drafter.can_propose(s):
                    break
                prop = drafter.propose(s, sampling, gen)
                chain.append(int(prop.token))
                confs.append(float(prop.confidence))
                ents.append(float(prop.entropy))
                qx.append(1.0 if prop.probs is None else float(prop.probs[prop.token]))
                s = torch.cat([s, torch.tensor([prop.token], dtype=torch.long, device=dev)])
                dfeats.append(np.asarray(drafter.features(s), dtype=np.float32))
            if finished:
                add_row([], [], [], dfeats[:1], [])
                break
            drafted = s[seq.numel():]
            logits = forward(s[target_len:], target_len)  # last committed token + the chain: L + 1 rows
            p = sampling.probs(logits, seq, drafted, source="target")
            if chain:
                px = p[: len(chain)].gather(1, drafted.view(-1, 1)).view(-1).tolist()
                accepts = [min(1.0, a / q) for a, q in zip(px, qx)]
            else:
                accepts = []
            add_row(chain, confs, ents, dfeats, accepts)
            nxt = sample_from(p[0], gen)
            # Keep the committed prefix only (as the decoder's rollback after a rejection at the first token).
            keep = seq.numel()
            if s.numel() > keep:
                cache.crop(-(s.numel() - keep))
            target_len = keep
            drafter.rollback(keep)
            out.append(nxt)
    arr = {k: np.stack(v) if k not in ("chain_len",) else np.asarray(v, dtype=np.int64) for k, v in rows.items()}
    return PromptTrace(
        prompt_ids=prompt.cpu().numpy().astype(np.int64), output=np.asarray(out, dtype=np.int64),
        ended_by_eos=out[-1] in eos, seed=int(seed), **arr,
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


def record_traces(pair, drafter, prompts: Sequence, sampling, max_new_tokens: int = 64, max_depth: int = 8,
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


__all__ = [
    "APPROXIMATION_T_POSITIVE", "ARRAY_DOCS", "CHAIN", "TRACE_FORMAT", "TRACE_FORMAT_VERSION", "PromptTrace",
    "TraceSet", "greedy_inconsistencies", "load_traces", "record_prompt", "record_traces",
]
