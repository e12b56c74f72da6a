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
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import torch
from transformers import (
    LogitsProcessor,
    LogitsProcessorList,
    MinPLogitsWarper,
    RepetitionPenaltyLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
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


@dataclass(frozen=True)
class SamplingConfig:
    """User sampling settings, applied identically to target (p) and draft (q) logits.

    Attributes:
        temperature: 0 means greedy; otherwise logits are divided by it (> 0).
        top_k: keep the k most likely tokens (0 = off).
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
        (penalties, then temperature, top-k, top-p, min-p)."""
        procs = LogitsProcessorList()
        if self.repetition_penalty != 1.0:
            procs.append(RepetitionPenaltyLogitsProcessor(self.repetition_penalty))
        if self.presence_penalty != 0.0:
            procs.append(PresencePenaltyLogitsProcessor(self.presence_penalty))
        if not self.greedy:
            if self.temperature != 1.0:
                procs.append(TemperatureLogitsWarper(self.temperature))
            if self.top_k:
                procs.append(TopKLogitsWarper(self.top_k))
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
        logits = logits.float()
        if not bool(torch.isfinite(logits.sum(dim=-1)).all()):  # one pass: any NaN or ±inf makes a row sum non-finite
            raise ValueError(
                f"The {source} returned NaN or infinite logits; check the {source}'s weights and dtype "
                "(float16 on CPU often overflows: use float32 or bfloat16)."
            )
        procs = self.processors()
        n = logits.shape[0]
        if n > 1 and (new_tokens is None or new_tokens.numel() < n - 1):
            got = None if new_tokens is None else new_tokens.numel()
            raise ValueError(
                f"{n} rows of logits need at least {n - 1} new_tokens (row i follows prefix + new_tokens[:i]), got {got}."
            )
        if self.prefix_dependent:
            rows = []
            for i in range(n):
                ids = prefix if i == 0 else torch.cat([prefix, new_tokens[:i]])
                rows.append(procs(ids.unsqueeze(0), logits[i : i + 1].clone()))
            scores = torch.cat(rows)
        else:
            dummy = prefix[-1:].expand(n, 1) if prefix.numel() else torch.zeros(n, 1, dtype=torch.long, device=logits.device)
            scores = procs(dummy, logits) if len(procs) else logits
        if self.greedy:
            out = torch.zeros_like(scores)
            return out.scatter_(1, scores.argmax(dim=-1, keepdim=True), 1.0)
        return torch.softmax(scores, dim=-1)


def sample_from(probs: torch.Tensor, generator: torch.Generator | None = None) -> int:
    """Draw one token id from a float (V,) distribution (need not be normalised), by inverse CDF
    with one float64 uniform from ``generator`` (see :func:`_inverse_cdf`).

    Raises:
        ValueError: the probabilities are NaN, infinite, negative or all zero.
    """
    lo, hi = torch.aminmax(probs)
    if not (float(lo) >= 0 and float(hi) < math.inf):
        raise ValueError("Cannot sample: probabilities are NaN, infinite or negative.")
    u = float(torch.rand(1, generator=generator, device=probs.device, dtype=torch.float64))
    idx = _inverse_cdf(probs, u)
    if idx is None:
        raise ValueError("Cannot sample: probabilities are all zero.")
    return idx


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
    draft_probs: torch.Tensor,
    draft_tokens: torch.Tensor,
    generator: torch.Generator | None = None,
) -> tuple[int, int]:
    """Exact speculative sampling for a chain of γ draft tokens (Leviathan et al., ICML 2023).

    Args:
        target_probs: float (γ+1, V); row i is p for the position of ``draft_tokens[i]``, the
            last row is p for the bonus position. Already processed (temperature, top-k, …).
        draft_probs: float (γ, V); row i is the q that ``draft_tokens[i]`` was sampled from,
            processed identically. Ignored when γ = 0.
        draft_tokens: int64 (γ,), γ ≥ 0.
        generator: optional torch.Generator on the probabilities' device, for reproducibility.

    Returns:
        ``(num_accepted, next_token)``: ``num_accepted`` τ in 0..γ is the length of the accepted
        prefix; ``next_token`` is drawn from the residual norm(max(p_τ − q_τ, 0)) after a
        rejection, or the bonus token from p_γ when all γ are accepted.

    Randomness: one call draws γ+1 float64 uniforms from ``generator``: u_i for the acceptance
    test of draft token i (accept iff ``u_i · q_i(x_i) < p_i(x_i)``, i.e. with probability
    min(1, p/q), nothing divided) and u_γ for the emitted token, drawn by inverse CDF in float64.
    Everything the decision needs crosses to the host in one small transfer, so the call costs a
    few tensor operations whatever V is (about 20 µs on CPU for small V).

    Edge cases: p = q is accepted everywhere (u·q < p for u ∈ [0, 1)), so the residual with
    Z = 0 is never formed; a token with q(x) = 0 is never proposed but stays reachable through
    the residual; a token with p(x) = 0 < q(x) is always rejected and never emitted.

    Raises:
        ValueError: inputs are not tensors, ``draft_tokens`` is not an integer tensor, shapes
            disagree, a row does not sum to 1 (±1e-3), probabilities are not finite and non-negative, a draft
            token is out of range or has zero draft probability (it cannot have been sampled
            from q).
    """
    if not all(isinstance(t, torch.Tensor) for t in (target_probs, draft_probs, draft_tokens)):
        raise ValueError("target_probs, draft_probs and draft_tokens must be torch tensors.")
    if draft_tokens.dtype.is_floating_point or draft_tokens.dtype.is_complex or draft_tokens.dtype == torch.bool:
        raise ValueError(f"draft_tokens must hold integer token ids (int64), got dtype {draft_tokens.dtype}.")
    gamma = int(draft_tokens.numel())
    _check_shape("target_probs", target_probs, gamma + 1, None)
    V = target_probs.shape[1]
    dev = target_probs.device
    u = torch.rand(gamma + 1, generator=generator, device=dev, dtype=torch.float64).tolist()
    parts = [torch.stack(torch.aminmax(target_probs))]
    if gamma:
        _check_shape("draft_probs", draft_probs, gamma, V)
        x = draft_tokens.reshape(-1).tolist()
        if min(x) < 0 or max(x) >= V:
            raise ValueError(f"draft_tokens must be ids in [0, {V}), got {x}.")
        xs = draft_tokens.reshape(gamma, 1).to(dev)
        parts += [
            torch.stack(torch.aminmax(draft_probs)),
            target_probs[:gamma].gather(1, xs).view(-1),
            draft_probs.gather(1, xs).view(-1),
        ]
    parts.append(target_probs.sum(-1))
    if gamma:
        parts.append(draft_probs.sum(-1))
    vals = torch.cat(parts).tolist()  # the only device → host transfer before the final draw
    sums = vals[len(vals) - (2 * gamma + 1):]
    vals = vals[: len(vals) - (2 * gamma + 1)]
    if not (vals[0] >= 0 and vals[1] < math.inf):  # NaN fails both comparisons
        raise _bad_probs("target_probs")
    if gamma and not (vals[2] >= 0 and vals[3] < math.inf):
        raise _bad_probs("draft_probs")
    if any(not abs(t - 1.0) <= 1e-3 for t in sums):  # NaN fails too
        raise ValueError(
            f"Every row of target_probs and draft_probs must sum to 1 (got sums {[round(t, 4) for t in sums]}): "
            "pass probabilities (softmax of processed logits), not logits or unnormalised weights."
        )
    tau = gamma
    if gamma:
        px, qx = vals[4 : 4 + gamma], vals[4 + gamma :]
        if min(qx) <= 0:
            raise ValueError("A draft token has q(x) = 0: it cannot have been sampled from draft_probs.")
        for i in range(gamma):
            if u[i] * qx[i] >= px[i]:
                tau = i
                break
    if tau == gamma:
        return tau, _inverse_cdf(target_probs[gamma], u[gamma])  # the row sums to 1 (checked above)
    token = _inverse_cdf((target_probs[tau] - draft_probs[tau]).clamp_min_(0), u[gamma])
    if token is None:
        # Only reachable through rounding when p ≈ q; p itself is then the right law.
        token = _inverse_cdf(target_probs[tau], u[gamma])
    return tau, token
