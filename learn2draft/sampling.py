"""Sampling settings and the exact speculative sampler.

The rule is Leviathan, Kalman & Matias, "Fast Inference from Transformers via Speculative
Decoding" (ICML 2023), Algorithm 1 / Appendix A.1, for a chain of γ drafted tokens:
accept draft token x_i ~ q_i with probability min(1, p_i(x_i) / q_i(x_i)); at the first
rejection emit a token from the residual distribution norm(max(p_i − q_i, 0)); if all γ are
accepted, emit a bonus token from p_{γ+1}. The emitted tokens then follow p exactly.

``p`` and ``q`` must be the distributions actually sampled from: the same logits processors
(repetition / presence penalty, temperature, top-k, top-p, min-p) with the same prefix are
applied to target and draft logits by :meth:`SamplingConfig.probs`. Temperature 0 (greedy)
is the limit where p and q are one-hot on their argmax; the same rule then accepts a draft
token iff it is the target's argmax.

For a draft *tree* of deterministic (top-k) candidates, :func:`tree_speculative_sample` applies
EAGLE-2/3's recursive point-mass rule instead: it needs no q and is exact for any tree the
draft side builds.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass

import torch
from transformers import (
    LogitsProcessor,
    LogitsProcessorList,
    MinPLogitsWarper,
    RepetitionPenaltyLogitsProcessor,
    TemperatureLogitsWarper,
    TopPLogitsWarper,
)

#: The smallest temperature above 0 (greedy): logits / T stay finite in float32 for |logits| < 3e34.
TEMPERATURE_MIN = 1e-4
#: The largest |presence_penalty| and repetition_penalty (and 1 / the smallest repetition_penalty).
PENALTY_MAX = 1e6


class PresencePenaltyLogitsProcessor(LogitsProcessor):
    """Subtract ``penalty`` from the logit of every token already in the prefix (OpenAI / vLLM
    ``presence_penalty``; transformers has no such processor).

    Args (call): input_ids int64 (B, L); scores float (B, V). Returns scores (B, V).
    """

    def __init__(self, penalty: float):
        self.penalty = float(penalty)

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        mask = torch.zeros_like(scores, dtype=torch.bool).scatter_(1, input_ids, True)
        return scores - self.penalty * mask.to(scores.dtype)


class TopKLogitsProcessor(LogitsProcessor):
    """Keep exactly the ``k`` highest logits of each row, ties broken by the lowest token id (``-inf`` elsewhere).

    transformers' ``TopKLogitsWarper`` keeps every token tied with the k-th, so ``top_k = 1`` over tied logits
    was not argmax (the seed chose among the tied tokens); here ``top_k = 1`` is argmax with
    ``torch.argmax``'s tie-break. Deterministic, so p and q processed by it keep the same tokens.

    Args (call): input_ids int64 (B, L) (unused); scores float (B, V). Returns scores (B, V).
    """

    def __init__(self, k: int):
        self.k = int(k)

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        k = min(self.k, scores.shape[-1])
        # A stable descending sort keeps tied tokens in id order: the first k are the k best, lowest ids first.
        order = torch.sort(scores, dim=-1, descending=True, stable=True).indices[..., :k]
        keep = torch.zeros_like(scores, dtype=torch.bool).scatter_(-1, order, True)
        return scores.masked_fill(~keep, -math.inf)


@dataclass(frozen=True)
class SamplingConfig:
    """User sampling settings, applied identically to target (p) and draft (q) logits.

    Attributes:
        temperature: 0 means greedy; otherwise logits are divided by it (> 0).
        top_k: keep the k most likely tokens (0 = off); ties are broken by the lowest token id
            (:class:`TopKLogitsProcessor`), so ``top_k = 1`` is argmax.
        top_p: nucleus sampling mass (1.0 = off), in (0, 1].
        min_p: drop tokens below ``min_p * max prob`` (0 = off), in [0, 1).
        repetition_penalty: CTRL-style penalty (Keskar et al. 2019) on tokens in the prefix (1.0 = off).
        presence_penalty: additive penalty on tokens in the prefix (0 = off).

    Bounds (:data:`TEMPERATURE_MIN`, :data:`PENALTY_MAX`): a temperature in (0, 1e-4) or a
    penalty beyond 1e6 (a repetition penalty outside [1e-6, 1e6]) would overflow float32 logits into
    NaN in the middle of a generation; they are refused here (use temperature 0 for greedy).

    Raises (on construction):
        ValueError: a setting is out of range.
    """

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0

    def __post_init__(self):
        for name in ("temperature", "top_p", "min_p", "repetition_penalty", "presence_penalty"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
                raise ValueError(f"{name} must be a finite number, got {v!r}.")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int):
            raise ValueError(f"top_k must be an integer (0 = off), got {self.top_k!r}.")
        if not self.temperature >= 0:
            raise ValueError(f"temperature must be ≥ 0 (0 = greedy), got {self.temperature}.")
        if 0 < self.temperature < TEMPERATURE_MIN:
            raise ValueError(f"temperature must be 0 (greedy) or ≥ {TEMPERATURE_MIN:.0e} (smaller ones overflow float32 "
                             f"logits; their limit is greedy: pass 0), got {self.temperature:g}.")
        if not abs(self.presence_penalty) <= PENALTY_MAX:
            raise ValueError(f"presence_penalty must be in [-{PENALTY_MAX:.0e}, {PENALTY_MAX:.0e}] (larger ones overflow "
                             f"float32 logits), got {self.presence_penalty:g}.")
        if not 1 / PENALTY_MAX <= self.repetition_penalty <= PENALTY_MAX:
            raise ValueError(f"repetition_penalty must be in [{1 / PENALTY_MAX:.0e}, {PENALTY_MAX:.0e}] (1 = off; others "
                             f"overflow float32 logits), got {self.repetition_penalty:g}.")
        if self.top_k < 0:
            raise ValueError(f"top_k must be ≥ 0 (0 = off), got {self.top_k}.")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1] (1 = off), got {self.top_p}.")
        if not 0 <= self.min_p < 1:
            raise ValueError(f"min_p must be in [0, 1) (0 = off), got {self.min_p}.")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def prefix_dependent(self) -> bool:
        """True when a processor reads the prefix (penalties): positions are then processed one by one."""
        return self.repetition_penalty != 1.0 or self.presence_penalty != 0.0

    def to_dict(self) -> dict:
        return asdict(self)

    def processors(self) -> LogitsProcessorList:
        """The transformers logits processors for these settings, in generate()'s order
        (penalties, then temperature, top-k, top-p, min-p); top-k is :class:`TopKLogitsProcessor` (exactly k
        tokens, ties to the lowest id)."""
        procs = LogitsProcessorList()
        if self.repetition_penalty != 1.0:
            procs.append(RepetitionPenaltyLogitsProcessor(self.repetition_penalty))
        if self.presence_penalty != 0.0:
            procs.append(PresencePenaltyLogitsProcessor(self.presence_penalty))
        if not self.greedy:
            if self.temperature != 1.0:
                procs.append(TemperatureLogitsWarper(self.temperature))
            if self.top_k:
                procs.append(TopKLogitsProcessor(self.top_k))
            if self.top_p < 1.0:
                procs.append(TopPLogitsWarper(self.top_p))
            if self.min_p > 0:
                procs.append(MinPLogitsWarper(self.min_p))
        return procs

    def probs(self, logits: torch.Tensor, prefix: torch.Tensor, new_tokens: torch.Tensor | None = None,
              source: str = "model") -> torch.Tensor:
        """Turn raw logits into the distributions that are sampled from.

        Args:
            logits: float (n, V), row i predicts the token after ``prefix + new_tokens[:i]``.
            prefix: int64 (L,), the committed tokens.
            new_tokens: int64 (≥ n−1,), tokens drafted after the prefix (None when n = 1).
            source: which model gave ``logits`` (e.g. ``"draft"``, ``"target"``), named in the error.

        Returns:
            float32 (n, V), rows summing to 1; one-hot on the argmax when greedy.

        Raises:
            ValueError: NaN or infinite logits.
        """
        _check_finite(logits, source)
        procs = self.processors()
        n = logits.shape[0]
        if n > 1 and (new_tokens is None or new_tokens.numel() < n - 1):
            got = None if new_tokens is None else new_tokens.numel()
            raise ValueError(
                f"{n} rows of logits need at least {n - 1} new_tokens (row i follows prefix + new_tokens[:i]), got {got}."
            )
        if self.prefix_dependent:
            logits = logits.float()
            rows = []
            for i in range(n):
                ids = prefix if i == 0 else torch.cat([prefix, new_tokens[:i]])
                rows.append(procs(ids.unsqueeze(0), logits[i : i + 1].clone()))
            return self._normalise(torch.cat(rows))
        return self._row_probs(logits, procs)

    def probs_rows(self, logits: torch.Tensor, source: str = "model") -> torch.Tensor:
        """:meth:`probs` of many rows at once when no processor reads the prefix (temperature, top-k, top-p, min-p
        and greedy work row by row): one call for a batch's verification logits instead of one per row.

        Args:
            logits: float (..., V), any leading shape (e.g. (B, k, V) of a batched verification).
            source: which model gave ``logits``, named in the error.

        Returns:
            float32 (..., V): each row exactly what :meth:`probs` gives for it.

        Raises:
            ValueError: NaN or infinite logits; a repetition or presence penalty (:attr:`prefix_dependent`: call
                :meth:`probs` per row with its prefix).
        """
        if self.prefix_dependent:
            raise ValueError("A repetition or presence penalty reads each row's prefix: call probs() per row.")
        shape = logits.shape
        flat = logits.reshape(-1, shape[-1])
        _check_finite(flat, source)
        return self._row_probs(flat, self.processors()).reshape(shape)

    def _row_probs(self, logits: torch.Tensor, procs) -> torch.Tensor:
        """float32 (n, V) from (n, V) logits of any float dtype, processors that act on each row alone. Without a
        processor (greedy, or T = 1 without truncation) the raw logits are read directly: the argmax of a bf16 row is
        that of its exact float32 copy, and the softmax casts to float32 first, so no float32 copy is made."""
        if not len(procs):
            return self._normalise(logits)
        dummy = torch.zeros(logits.shape[0], 1, dtype=torch.long, device=logits.device)  # no processor reads it
        return self._normalise(procs(dummy, logits.float()))

    def _normalise(self, scores: torch.Tensor) -> torch.Tensor:
        """The processed scores (n, V) as the float32 distributions sampled from: one-hot on the argmax when greedy,
        else their softmax (computed in float32)."""
        if self.greedy:
            out = torch.zeros(scores.shape, dtype=torch.float32, device=scores.device)
            # max(dim).indices: the first maximal index, as argmax (both documented so), but ~2× faster on a CPU
            return out.scatter_(1, scores.max(dim=-1, keepdim=True).indices, 1.0)
        return torch.softmax(scores, dim=-1, dtype=torch.float32)


def _check_finite(logits: torch.Tensor, source: str) -> None:
    """Raise ValueError when a row of ``logits`` (n, V) holds NaN or ±inf: one pass, a float32-accumulated row sum
    (any NaN or inf makes it non-finite), without a float32 copy of the logits."""
    if not bool(torch.isfinite(logits.sum(dim=-1, dtype=torch.float32)).all()):
        raise ValueError(
            f"The {source} returned NaN or infinite logits; check the {source}'s weights and dtype "
            "(float16 on CPU often overflows: use float32 or bfloat16)."
        )


def sample_from(probs: torch.Tensor, generator: torch.Generator | None = None) -> int:
    """Draw one token id from a float (V,) distribution (need not be normalised): one row of :func:`sample_rows`,
    with one float64 uniform from ``generator`` on the probabilities' device.

    Raises:
        ValueError: the probabilities are NaN, infinite, negative or all zero.
    """
    u = torch.rand(1, generator=generator, device=probs.device, dtype=torch.float64)
    return sample_rows(probs.reshape(1, -1), u)[0]


def sample_rows(probs: torch.Tensor, uniforms: torch.Tensor) -> list[int]:
    """Draw one token id per row of ``probs`` by inverse CDF in float64: row i's token is the first index whose
    cumulative weight exceeds ``uniforms[i]`` × its total (the rule of :func:`_inverse_cdf`; a zero weight is never
    drawn), computed on the probabilities' device so that the checks and every row's token cross to the host in ONE
    transfer (one host synchronisation on a GPU whatever the number of rows).

    Args:
        probs: float (P, V) weights, rows need not be normalised.
        uniforms: float64 (P,) in [0, 1) on the same device, e.g. row i's ``torch.rand(1, generator=g_i,
            dtype=torch.float64)`` (what :func:`sample_from` draws for it alone).

    Returns:
        P token ids (host ints).

    Raises:
        ValueError: a weight is NaN, infinite or negative, a row is all zero, or ``uniforms`` has not P values.
    """
    if probs.dim() != 2 or uniforms.numel() != probs.shape[0]:
        raise ValueError(f"sample_rows needs probs (P, V) and P uniforms, got {tuple(probs.shape)} and "
                         f"{uniforms.numel()} uniforms.")
    lo, hi = torch.aminmax(probs)
    c = probs.double().cumsum(-1)
    total = c[:, -1:].contiguous()
    found = torch.searchsorted(c, total * uniforms.reshape(-1, 1).to(c), right=True).squeeze(1)
    # u · total rounded up to the total: the first index where the cumsum reaches it (a token with mass)
    found = torch.where(found < c.shape[1], found, torch.searchsorted(c, total).squeeze(1))
    vals = torch.cat([lo.double().view(1), hi.double().view(1), total.min().view(1), found.double()]).tolist()
    if not (vals[0] >= 0 and vals[1] < math.inf):
        raise ValueError("Cannot sample: probabilities are NaN, infinite or negative.")
    if not vals[2] > 0:
        raise ValueError("Cannot sample: probabilities are all zero.")
    return [int(v) for v in vals[3:]]


def _check_shape(name: str, t: torch.Tensor, rows: int, V: int | None) -> None:
    if t.dim() != 2 or t.shape[0] != rows or t.shape[1] == 0 or (V is not None and t.shape[1] != V):
        want = f"({rows}, V)" + ("" if V is None else f" with V={V}")
        raise ValueError(f"{name} must have shape {want}, got {tuple(t.shape)}.")


def _bad_probs(name: str) -> ValueError:
    return ValueError(
        f"{name} has NaN, infinite or negative entries: pass probabilities (softmax of processed logits)."
    )


def _inverse_cdf(weights: torch.Tensor, u: float) -> int | None:
    """Index i with probability weights[i] / sum(weights), from one uniform ``u`` in [0, 1).

    Inverse-CDF sampling in float64: the first i with cumsum[i] > u · total. A zero weight is
    never chosen (its cumsum equals its predecessor's). Returns None when the weights sum to 0.
    """
    c = weights.double().cumsum(0)
    idx = int(torch.searchsorted(c, c[-1:] * u, right=True))
    if idx < c.numel():
        return idx
    if float(c[-1]) > 0:  # u · total rounded up to total: the last token with mass
        return int((weights > 0).nonzero()[-1, 0])
    return None


def speculative_sample(
    target_probs: torch.Tensor,
    draft_probs: torch.Tensor | None,
    draft_tokens: torch.Tensor,
    generator: torch.Generator | None = None,
    validate: bool = True,
) -> tuple[int, int]:
    """Exact speculative sampling for a chain of γ draft tokens (Leviathan et al., ICML 2023): one row of
    :func:`speculative_sample_rows`.

    Args:
        target_probs: float (γ+1, V); row i is p for the position of ``draft_tokens[i]``, the
            last row is p for the bonus position. Already processed (temperature, top-k, …).
        draft_probs: float (γ, V); row i is the q that ``draft_tokens[i]`` was sampled from,
            processed identically; None: every drafted token is a point mass (prompt lookup). Ignored when γ = 0.
        draft_tokens: int64 (γ,), γ ≥ 0.
        generator: optional torch.Generator on the probabilities' device, for reproducibility.
        validate: check the inputs' values (:func:`speculative_sample_rows`); the decoder passes False for
            probabilities it computed from logits it checked.

    Returns:
        ``(num_accepted, next_token)``: ``num_accepted`` τ in 0..γ is the length of the accepted
        prefix; ``next_token`` is drawn from the residual norm(max(p_τ − q_τ, 0)) after a
        rejection, or the bonus token from p_γ when all γ are accepted.

    Randomness: one call draws γ+1 float64 uniforms from ``generator`` on the probabilities' device: u_i for the
    acceptance test of draft token i (accept iff ``u_i · q_i(x_i) < p_i(x_i)``, i.e. with probability min(1, p/q),
    nothing divided) and u_γ for the emitted token, drawn by inverse CDF in float64. The decision, the draw and the
    input checks cross to the host in one transfer.

    Edge cases: p = q is accepted everywhere (u·q < p for u ∈ [0, 1)), so the residual with
    Z = 0 is never formed; a token with q(x) = 0 is never proposed but stays reachable through
    the residual; a token with p(x) = 0 < q(x) is always rejected and never emitted.

    Raises:
        ValueError: inputs are not tensors, ``draft_tokens`` is not an integer tensor, shapes
            disagree, a row does not sum to 1 (±1e-3), probabilities are not finite and non-negative, a draft
            token is out of range or has zero draft probability (it cannot have been sampled
            from q).
    """
    if not all(isinstance(t, torch.Tensor) for t in (target_probs, draft_tokens)) or not (
            draft_probs is None or isinstance(draft_probs, torch.Tensor)):
        raise ValueError("target_probs, draft_probs and draft_tokens must be torch tensors (draft_probs may be None).")
    if draft_tokens.dtype.is_floating_point or draft_tokens.dtype.is_complex or draft_tokens.dtype == torch.bool:
        raise ValueError(f"draft_tokens must hold integer token ids (int64), got dtype {draft_tokens.dtype}.")
    gamma = int(draft_tokens.numel())
    _check_shape("target_probs", target_probs, gamma + 1, None)
    u = torch.rand(gamma + 1, generator=generator, device=target_probs.device, dtype=torch.float64)
    taus, tokens = speculative_sample_rows(target_probs, draft_probs, draft_tokens, [gamma], u, validate)
    return taus[0], tokens[0]


def speculative_sample_rows(
    target_probs: torch.Tensor,
    draft_probs: torch.Tensor | None,
    draft_tokens: torch.Tensor,
    num_draft: Sequence[int],
    uniforms: torch.Tensor,
    validate: bool = True,
) -> tuple[list[int], list[int]]:
    """Exact speculative sampling (Leviathan et al., ICML 2023) for B chains at once, over flattened rows.

    Row i drafted γ_i = ``num_draft[i]`` tokens. The rows are packed as in vLLM's rejection sampler
    (``vllm/v1/sample/rejection_sampler.py``: flattened draft tokens, ``cu_num_draft_tokens``, ``draft_probs`` None
    for point masses): row i's γ_i tokens follow those of rows 0..i−1. Every row's acceptance tests, its residual and
    its draw are tensor operations over all rows, and everything the host needs (each row's τ and next token, and
    the input checks) crosses in ONE transfer, whatever B and γ_i are (one more only when a residual rounds to zero,
    below). Its index tensors are built on the host and copied to the device without waiting (``non_blocking``).

    Args:
        target_probs: float (Σ (γ_i + 1), V); row i's γ_i + 1 rows are p at its drafted positions, then at the bonus
            position. Already processed (temperature, top-k, …).
        draft_probs: float (Σ γ_i, V), the q each drafted token was sampled from (processed identically), or None:
            every drafted token is a point mass (a deterministic proposal, e.g. prompt lookup: q(x) = 1, and the
            residual max(p − q, 0) is p with p(x) set to 0).
        draft_tokens: int64 (Σ γ_i,), the drafted tokens, packed like ``draft_probs``.
        num_draft: γ_i ≥ 0 of each of the B ≥ 1 rows (host ints).
        uniforms: float64 (Σ (γ_i + 1),) on the probabilities' device; row i's γ_i + 1 uniforms in [0, 1): u_ij for
            the acceptance test of its drafted token j (accept iff ``u_ij · q(x_j) < p(x_j)``, i.e. with probability
            min(1, p/q), nothing divided), then the one for the emitted token, drawn by inverse CDF in float64 (the
            first index whose cumulative weight exceeds u × the total). Row i's are ``torch.rand(γ_i + 1,
            generator=g_i, dtype=torch.float64)`` for its own generator g_i, so a row draws what it draws alone
            (:func:`speculative_sample`).
        validate: check the values (uniforms in [0, 1); probabilities finite, non-negative, rows summing to
            1 ± 1e-3; drafted ids in range with q(x) > 0), read back in the same transfer as the draw. A decoder
            whose probabilities are softmaxes of logits it already checked for NaN and ±inf, and whose ids its own
            drafter proposed, passes False: nothing is checked then, and a bad id fails in the indexing.

    Returns:
        ``(num_accepted, next_tokens)``, host lists of B ints: τ_i in 0..γ_i, the length of row i's accepted prefix,
        and the token drawn from the residual norm(max(p_τ − q_τ, 0)) after a rejection, or the bonus token from
        p_γ when all γ_i are accepted. A residual that rounds to zero everywhere (only when p ≈ q) is replaced by p
        (one more transfer, for those rows only).

    Raises:
        ValueError: inputs that are not tensors, ``draft_tokens`` not integer ids, ``num_draft`` empty or negative,
            shapes disagree with it; with ``validate``: uniforms outside [0, 1), a row does not sum to 1 (±1e-3),
            probabilities that are not finite and non-negative, a drafted token out of range or with q(x) = 0 (it
            cannot have been sampled from q).
    """
    if not all(isinstance(t, torch.Tensor) for t in (target_probs, draft_tokens, uniforms)) or not (
            draft_probs is None or isinstance(draft_probs, torch.Tensor)):
        raise ValueError("target_probs, draft_probs, draft_tokens and uniforms must be torch tensors (draft_probs may "
                         "be None).")
    if draft_tokens.dtype.is_floating_point or draft_tokens.dtype.is_complex or draft_tokens.dtype == torch.bool:
        raise ValueError(f"draft_tokens must hold integer token ids (int64), got dtype {draft_tokens.dtype}.")
    gammas = _draft_counts(num_draft)
    B, M = len(gammas), sum(gammas)
    N = M + B
    _check_shape("target_probs", target_probs, N, None)
    V, dev = target_probs.shape[1], target_probs.device
    if draft_tokens.numel() != M:
        raise ValueError(f"draft_tokens must hold Σ γ_i = {M} ids, got {draft_tokens.numel()}.")
    if draft_probs is not None and M:
        _check_shape("draft_probs", draft_probs, M, V)
    if uniforms.numel() != N:
        raise ValueError(f"uniforms must hold Σ (γ_i + 1) = {N} values, got {uniforms.numel()}.")
    start_t, start_d, gam, tok_row, t_rows, tok_j = _packed_index(gammas, dev)
    u = uniforms.to(dev, torch.float64).reshape(-1)
    checks = []
    if validate:
        checks = [torch.stack(torch.aminmax(u)), torch.stack(torch.aminmax(target_probs)).double(),
                  (target_probs.sum(-1).double() - 1).abs().max().view(1)]
    tau = gam
    if M:
        x = draft_tokens.reshape(-1).to(dev)
        if validate:
            checks.append(torch.stack(torch.aminmax(x)).double())
            x = x.clamp(0, V - 1)  # an id out of range is reported below, after the one transfer
        px = target_probs[t_rows, x].double()
        if draft_probs is None:
            reject = u[t_rows] >= px
        else:
            qx = draft_probs[torch.arange(M, device=dev), x].double()
            reject = u[t_rows] * qx >= px
            if validate:
                checks += [torch.stack(torch.aminmax(draft_probs)).double(),
                           (draft_probs.sum(-1).double() - 1).abs().max().view(1), qx.min().view(1)]
        tau = _first_rejected(reject, gam, tok_row, tok_j)
    w = target_probs[start_t + tau]  # (B, V): p where each row's token is drawn
    if M:
        rejected = (tau < gam).unsqueeze(1)
        at = (start_d + tau).clamp(max=M - 1)  # the rejected token's index (clamped for rows with nothing rejected)
        if draft_probs is None:  # the residual: p(x) set to 0 in a rejected row, the rest of p unchanged
            xa = x[at].unsqueeze(1)
            w = w.scatter(1, xa, w.gather(1, xa) * ~rejected)
        else:  # max(p − q, 0) in a rejected row, p − 0 = p elsewhere
            w = (w - draft_probs[at] * rejected).clamp_min(0)
    c = w.double().cumsum(-1)
    total = c[:, -1:].contiguous()
    drawn = torch.searchsorted(c, total * u[start_t + gam].unsqueeze(1), right=True)
    # u · total rounded up to the total: the first index where the cumsum reaches it (a token with mass)
    drawn = torch.where(drawn < V, drawn, torch.searchsorted(c, total)).squeeze(1)
    vals = torch.cat([tau.double(), drawn.double(), total.view(-1), *checks]).tolist()  # the one transfer
    taus, tokens, totals, checked = (vals[:B], [int(v) for v in vals[B : 2 * B]], vals[2 * B : 3 * B],
                                     vals[3 * B :])
    if validate:
        _raise_bad_rows(checked, M, V, draft_probs is not None)
    taus = [int(t) for t in taus]
    empty = [i for i, t in enumerate(totals) if not t > 0]
    if empty:  # a residual that rounded to zero (p ≤ q everywhere, within rounding): p itself is the law
        rows = torch.tensor(empty, device=dev)
        for i, tok in zip(empty, sample_rows(target_probs[start_t[rows] + tau[rows]], u[(start_t + gam)[rows]])):
            tokens[i] = tok
    return taus, tokens


def _draft_counts(num_draft: Sequence[int]) -> list[int]:
    """``num_draft`` as B ≥ 1 host ints γ_i ≥ 0; raises ValueError for none, a negative or a fractional count."""
    gammas = [int(g) for g in num_draft]
    if not gammas or min(gammas) < 0 or any([g != v for g, v in zip(gammas, num_draft)]):
        raise ValueError(f"num_draft must hold B ≥ 1 integer counts γ_i ≥ 0, got {list(num_draft)}.")
    return gammas


def _packed_index(gammas: list[int], dev: torch.device) -> tuple[torch.Tensor, ...]:
    """The index tensors of B packed chains (row i: γ_i = ``gammas[i]`` drafted tokens and γ_i + 1 target rows, after
    those of rows 0..i−1), built on the host and copied in one transfer: int64 ``start_t`` (B,) each row's first
    target row, ``start_d`` (B,) its first drafted token, ``gam`` (B,) γ_i; per drafted token, ``tok_row`` (M,) its
    row, ``t_rows`` (M,) its target row and ``tok_j`` (M,) its position j in the chain (M = Σ γ_i)."""
    B, M = len(gammas), sum(gammas)
    start_t, start_d, acc = [], [], 0
    for g in gammas:
        start_t.append(acc + len(start_t))
        start_d.append(acc)
        acc += g
    tok_row = [i for i, g in enumerate(gammas) for _ in range(g)]
    t_rows = [start_t[i] + j for i, g in enumerate(gammas) for j in range(g)]
    tok_j = [j for g in gammas for j in range(g)]
    idx = torch.tensor(start_t + start_d + gammas + tok_row + t_rows + tok_j, dtype=torch.long).to(dev,
                                                                                                  non_blocking=True)
    return (idx[:B], idx[B : 2 * B], idx[2 * B : 3 * B], idx[3 * B : 3 * B + M], idx[3 * B + M : 3 * B + 2 * M],
            idx[3 * B + 2 * M :])


def _first_rejected(reject: torch.Tensor, gam: torch.Tensor, tok_row: torch.Tensor, tok_j: torch.Tensor) -> torch.Tensor:
    """int64 (B,) τ_i: the position of row i's first rejected drafted token (``reject`` bool (M,), packed as
    :func:`_packed_index`), else γ_i."""
    return gam.scatter_reduce(0, tok_row, torch.where(reject, tok_j, gam[tok_row]), reduce="amin")


def greedy_accept_rows(target_logits: torch.Tensor, draft_tokens: torch.Tensor, num_draft: Sequence[int],
                       source: str = "target") -> tuple[list[int], list[int]]:
    """The exact acceptance of B packed chains when the target decodes greedily (temperature 0, no processor that
    reads the prefix), from the raw logits: what :func:`speculative_sample_rows` returns for the greedy
    :class:`SamplingConfig`'s probabilities (one-hot on each row's first maximal logit), whatever the draft's q, without
    forming them. With p one-hot at a = argmax, a drafted x is accepted iff u · q(x) < p(x), i.e. iff x = a (u < 1);
    after a rejection the residual max(p − q, 0) is the point mass at a (q(a) = 0 there, else x = a), and the bonus
    token is the argmax: so τ_i is the length of the prefix where the drafted tokens equal the target's argmax, and the
    next token is the argmax at position τ_i — no uniform is drawn (vLLM's ``rejection_greedy_sample_kernel`` does
    the same). One host read returns every τ_i, every next token and the finiteness check.

    Args:
        target_logits: float (Σ (γ_i + 1), V), any float dtype, the target's raw logits packed as in
            :func:`speculative_sample_rows` (row i's γ_i + 1 rows after those of rows 0..i−1).
        draft_tokens: int64 (Σ γ_i,), the drafted tokens, packed alike.
        num_draft: γ_i ≥ 0 of each of the B ≥ 1 rows (host ints).
        source: the model named in the error.

    Returns:
        ``(num_accepted, next_tokens)``, host lists of B ints.

    A drafted id outside [0, V) is never accepted (it differs from every argmax) and is not refused: the decoders
    pass their drafters' ids (:func:`speculative_sample_rows` with ``validate=True`` refuses it).

    Raises:
        ValueError: inputs that are not tensors, logits that are not floating point, drafted ids that are not
            integers, ``num_draft`` empty, negative or fractional, shapes that disagree with it, or NaN / infinite
            logits.
    """
    if not (isinstance(target_logits, torch.Tensor) and isinstance(draft_tokens, torch.Tensor)):
        raise ValueError("target_logits and draft_tokens must be torch tensors.")
    if not target_logits.dtype.is_floating_point:
        raise ValueError(f"target_logits must be floating-point logits, got dtype {target_logits.dtype}.")
    if draft_tokens.dtype.is_floating_point or draft_tokens.dtype.is_complex or draft_tokens.dtype == torch.bool:
        raise ValueError(f"draft_tokens must hold integer token ids (int64), got dtype {draft_tokens.dtype}.")
    gammas = _draft_counts(num_draft)
    B, M = len(gammas), sum(gammas)
    _check_shape("target_logits", target_logits, M + B, None)
    if draft_tokens.numel() != M:
        raise ValueError(f"draft_tokens must hold Σ γ_i = {M} ids, got {draft_tokens.numel()}.")
    dev = target_logits.device
    start_t, _, gam, tok_row, t_rows, tok_j = _packed_index(gammas, dev)
    top = target_logits.max(dim=-1).indices  # the first maximal index, as SamplingConfig's greedy one-hot
    finite = torch.isfinite(target_logits.sum(dim=-1, dtype=torch.float32)).all().view(1)
    tau = gam
    if M:
        tau = _first_rejected(top[t_rows] != draft_tokens.reshape(-1).to(dev), gam, tok_row, tok_j)
    vals = torch.cat([tau, top[start_t + tau], finite.long()]).tolist()  # the one transfer
    if not vals[-1]:
        raise ValueError(f"The {source} returned NaN or infinite logits; check the {source}'s weights and dtype "
                         "(float16 on CPU often overflows: use float32 or bfloat16).")
    return vals[:B], vals[B : 2 * B]


def _raise_bad_rows(checked: list[float], M: int, V: int, dense_q: bool) -> None:
    """The checks of :func:`speculative_sample_rows` (read back with its draw) as one clear error, in the order:
    uniforms, drafted ids, target probabilities, draft probabilities, row sums, q(x) = 0."""
    u_lo, u_hi = checked[:2]
    if not (0 <= u_lo and u_hi < 1):
        raise ValueError(f"uniforms must lie in [0, 1), got values from {u_lo} to {u_hi}.")
    checked = checked[2:]
    p_lo, p_hi, p_sum = checked[:3]
    if M:
        x_lo, x_hi = checked[3:5]
        if x_lo < 0 or x_hi >= V:
            raise ValueError(f"draft_tokens must be ids in [0, {V}), got values from {int(x_lo)} to {int(x_hi)}.")
    if not (p_lo >= 0 and p_hi < math.inf):  # NaN fails both comparisons
        raise _bad_probs("target_probs")
    q_sum = 0.0
    if M and dense_q:
        q_lo, q_hi, q_sum, qx_min = checked[5:9]
        if not (q_lo >= 0 and q_hi < math.inf):
            raise _bad_probs("draft_probs")
    if not (p_sum <= 1e-3 and q_sum <= 1e-3):  # NaN fails too
        raise ValueError(
            f"Every row of target_probs and draft_probs must sum to 1 (the worst row is off by "
            f"{max(p_sum, q_sum):.4g}): pass probabilities (softmax of processed logits), not logits or unnormalised "
            "weights."
        )
    if M and dense_q and not qx_min > 0:
        raise ValueError("A draft token has q(x) = 0: it cannot have been sampled from draft_probs.")


def tree_speculative_sample(
    parents: torch.Tensor,
    tokens: torch.Tensor,
    target_probs: torch.Tensor,
    generator: torch.Generator | None = None,
) -> tuple[list[int], int]:
    """Exact speculative sampling for a draft *tree* of deterministic candidates (EAGLE-2/3's rule).

    The rule is the recursive point-mass rejection of EAGLE-2 (Li et al. 2024, arXiv 2406.16858)
    and EAGLE-3 (arXiv 2503.01840; ``SafeAILab/EAGLE eagle/model/utils.py::evaluate_posterior``):
    starting at the root, with p_res = the target's distribution at the current node, visit the
    node's children in order; accept child x with probability p_res(x) (p_res normalised); on
    rejection set p_res(x) = 0 and renormalise. An accepted child becomes the current node (a
    fresh p_res from its own row). When every child is rejected, the next token is drawn from
    p_res; when the current node is a leaf, it is a bonus token drawn from its row. Because the
    candidates are *deterministic* (top-k of the draft, not sampled), this rule emits the target's
    law whatever the tree shape, and whatever depth and size policies built it as long as they read
    only draft-side information. It needs no draft distribution q; at temperature 0 (one-hot rows)
    it accepts the child equal to the target's argmax.

    Numerics: only the rejected children's mass matters, p_res = p with the rejected tokens
    zeroed, so child x is accepted iff ``u · (S − R) < p(x)``, with S the sum of the node's row (in
    the row's dtype: float32 rounding, ~1e-7 relative, the precision of p itself), R the float64 sum
    of p over the node's already-rejected children and u a float64 uniform: probability
    p(x) / (S − R) = p_res(x) with nothing renormalised over the vocabulary. The emitted token is
    drawn by inverse CDF in float64 (as :func:`speculative_sample` does).

    Args:
        parents: int64 (N+1,); ``parents[0] = -1`` (node 0 is the root: the position after the
            last committed token) and ``0 ≤ parents[i] < i`` for the drafted nodes 1..N (a parent
            precedes its children).
        tokens: int64 (N+1,), node i's token id; entry 0 is unused.
        target_probs: float (N+1, V); row i is the target's processed next-token distribution after
            node i's path (root row: after the committed tokens), processed like every sampled
            distribution (:meth:`SamplingConfig.probs`).
        generator: optional torch.Generator on ``target_probs``' device.

    Children order: the children of a node are visited in increasing node index. Build the tree
    so that this is decreasing draft score (:class:`learn2draft.tree.DraftTree` and
    :func:`learn2draft.tree.select_top_nodes` do): the most likely candidate is tried first. The
    order changes which candidate is accepted, never the output law.

    Returns:
        ``(accepted, next_token)``: ``accepted`` the accepted node indices from the root's child
        down (a path; τ = ``len(accepted)``), ``next_token`` the token drawn from p_res after the
        last accepted node's children were all rejected, or the bonus token from a leaf's row.

    Randomness: one call draws N+1 float64 uniforms from ``generator`` whatever happens: u_i for
    the acceptance test of node i (i ≥ 1) and u_0 for the emitted token (inverse CDF in float64).

    Edge cases: a child with p(x) = 0 is always rejected and its token never emitted; a token no
    child proposes stays reachable through p_res; a sibling repeating an already-rejected token has
    p_res = 0 and is rejected. Z = 0 (p_res without mass after every child was rejected) cannot
    happen in exact arithmetic — the last rejected child with p(x) > 0 had p_res(x) = 1 — and is
    reached only through float rounding; that child's token is then emitted as ``next_token``, which
    is what the exact rule emits (accepting it would emit the same token, and the next cycle draws
    what follows from the same target conditional).

    Validation reads only what the rule reads, to stay at a few tensor operations whatever N is
    (a full check of an (N+1, V) matrix costs ~1 ms at V = 49,152): the children's probabilities
    (one gather), and for each node the walk reaches, its row (finite, non-negative, sums to 1).

    Raises:
        ValueError: inputs are not tensors or not integer where ids are expected; shapes disagree;
            ``parents`` is not a tree in parent-first order; a token is out of [0, V); a read row
            or a child's probability is NaN, infinite or negative; a read row does not sum to 1
            (±1e-3).
    """
    if not all(isinstance(t, torch.Tensor) for t in (parents, tokens, target_probs)):
        raise ValueError("parents, tokens and target_probs must be torch tensors.")
    for name, t in (("parents", parents), ("tokens", tokens)):
        if t.dtype.is_floating_point or t.dtype.is_complex or t.dtype == torch.bool:
            raise ValueError(f"{name} must hold integer node / token ids (int64), got dtype {t.dtype}.")
    if parents.dim() != 1 or parents.numel() == 0 or tokens.shape != parents.shape:
        raise ValueError(f"parents and tokens must both have shape (N+1,) with the root at 0, got "
                         f"{tuple(parents.shape)} and {tuple(tokens.shape)}.")
    n1 = parents.numel()
    _check_shape("target_probs", target_probs, n1, None)
    if target_probs.dtype.is_complex or not target_probs.dtype.is_floating_point:
        raise ValueError(f"target_probs must be floating point probabilities, got dtype {target_probs.dtype}.")
    V = target_probs.shape[1]
    par, tok = parents.tolist(), tokens.tolist()
    if par[0] != -1:
        raise ValueError(f"parents[0] must be -1 (node 0 is the root), got {par[0]}.")
    children: list[list[int]] = [[] for _ in range(n1)]
    for i in range(1, n1):
        if not 0 <= par[i] < i:
            raise ValueError(f"parents[{i}] = {par[i]} must be in [0, {i}): number the nodes so that a parent precedes "
                             "its children (learn2draft.tree.select_top_nodes returns such an order).")
        children[par[i]].append(i)
    if n1 > 1 and (min(tok[1:]) < 0 or max(tok[1:]) >= V):
        raise ValueError(f"tokens[1:] must be ids in [0, {V}), got min {min(tok[1:])}, max {max(tok[1:])}.")
    dev = target_probs.device
    u = torch.rand(n1, generator=generator, device=dev, dtype=torch.float64).tolist()
    px = [0.0]
    if n1 > 1:
        px += target_probs[parents[1:].to(dev), tokens[1:].to(dev)].double().tolist()  # p(x) of every child, one gather
        if not (min(px) >= 0 and max(px) < math.inf):  # NaN fails both
            raise _bad_probs("target_probs")
    sums: dict[int, float] = {}

    def row_sum(i: int) -> float:
        if i not in sums:
            row = target_probs[i]
            lo, s = torch.stack([row.min(), row.sum()]).tolist()  # one transfer; a NaN or ±inf shows in one of them
            if not (lo >= 0 and s < math.inf):
                raise _bad_probs("target_probs")
            if not abs(s - 1.0) <= 1e-3:
                raise ValueError(f"Row {i} of target_probs sums to {s:.4g}, not 1: pass probabilities (softmax of "
                                 "processed logits), not logits or unnormalised weights.")
            sums[i] = s
        return sums[i]

    accepted, node, rejected, last_positive = _tree_walk(
        children, tok, px, row_sum, lambda i, num, den: u[i] * den < num)
    row_sum(node)  # validates the row the emitted token is drawn from
    if not rejected:
        return accepted, _inverse_cdf(target_probs[node], u[0])  # a leaf: the bonus token
    res = target_probs[node].clone()
    res[torch.tensor(rejected, dtype=torch.long, device=dev)] = 0
    nxt = _inverse_cdf(res, u[0])
    if nxt is None:  # Z = 0: only through rounding (see the docstring)
        nxt = last_positive
    return accepted, nxt


def _tree_walk(
    children: list[list[int]],
    tokens: list[int],
    px: list[float],
    row_sum: Callable[[int], float],
    bernoulli: Callable[[int, float, float], bool],
) -> tuple[list[int], int, list[int], int | None]:
    """The accept/reject walk of :func:`tree_speculative_sample`, with the randomness passed in.

    ``bernoulli(i, num, den)`` decides node i's acceptance test, True with probability
    min(1, num / den) (``u_i · den < num`` in the sampler; the exact-enumeration tests pass an
    oracle that explores both answers with their probabilities). ``px[i]``: the target's p of
    node i's token in its parent's row; ``row_sum(i)``: the sum S of node i's row.

    Returns:
        ``(accepted, node, rejected, last_positive)``: the accepted path, the node whose row the
        next token comes from, the tokens rejected among its children (p_res = that row with them
        zeroed; empty for a leaf) and the last rejected token with p(x) > 0 (the Z = 0 fallback).
    """
    node, accepted = 0, []
    while True:
        kids = children[node]
        if not kids:
            return accepted, node, [], None
        total = row_sum(node)
        mass, rejected, seen, last_positive = 0.0, [], set(), None
        for c in kids:
            x = tokens[c]
            if x in seen:  # p_res(x) = 0 already: rejected for sure
                continue
            if bernoulli(c, px[c], total - mass):
                accepted.append(c)
                node = c
                break
            seen.add(x)
            rejected.append(x)
            mass += px[c]
            if px[c] > 0:
                last_positive = x
        else:
            return accepted, node, rejected, last_positive
