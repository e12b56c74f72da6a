"""The draft/verify loop with KV-cache rollback (speculative decoding, Leviathan et al. 2023;
Chen et al. 2023), built so that a policy can decide the draft depth one step at a time.

Prefill: the whole prompt goes through the target in one forward; its last logits give the first
token, as Hugging Face ``generate()`` does (time to first token = one prefill forward).

One *cycle*:

1. a :class:`learn2draft.drafters.Drafter` (draft model, feature-level head or prompt lookup)
   proposes tokens one at a time (:meth:`SpeculativeDecoder.draft_step`); before each step a
   :class:`DraftController` sees the features (:mod:`learn2draft.features`) and says CONTINUE or
   STOP — the decision precedes the draw, which keeps the output law exact;
2. the target verifies the γ drafted tokens plus the bonus position in one forward pass
   (:meth:`SpeculativeDecoder.verify`);
3. :func:`learn2draft.sampling.speculative_sample` accepts a prefix of length τ and emits one
   corrected or bonus token, so τ + 1 tokens are committed (fewer at EOS / ``max_new_tokens``);
4. the target's KV cache is cropped back to the committed length and the drafter rolled back.

:meth:`SpeculativeDecoder.step` is the one step function both :meth:`~SpeculativeDecoder.run_cycle`
and the gymnasium environment (:mod:`envs`) drive.

Cache invariant: the target's cache holds keys/values for a prefix of the sequence
``committed + drafted``; every forward feeds exactly the tokens after that prefix. After
verification the valid prefix is ``committed + accepted`` minus the last token, which has not
been fed to the target yet. Draft *trees* (EAGLE-2 drafting, top-V verification with a tree
attention mask, the accepted path's entries gathered into the cache) are
:class:`learn2draft.tree.TreeSpeculativeDecoder`, a subclass of this decoder; the
:class:`DraftAction` a cycle executes (its ``CycleResult.action``) carries the verification size
(equal to the depth for a chain, the tree nodes verified for a tree).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch
from transformers import DynamicCache

from learn2draft.drafters.base import Drafter
from learn2draft.drafters.model import ModelDrafter
from learn2draft.features import build_features
from learn2draft.models import ModelPair, check_prompt_ids
from learn2draft.sampling import SamplingConfig, sample_from, speculative_sample
from learn2draft.timing import DeviceClock

Sampler = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Generator | None], tuple[int, int]]


@dataclass(frozen=True)
class DraftAction:
    """What one cycle does: draft ``depth`` tokens, verify ``verify_size`` of them (a chain
    controller decides it step by step; :attr:`CycleResult.action` records it).

    For a chain drafter ``verify_size == depth``. For a draft tree (EAGLE-2 style) ``depth`` is
    the number of sequential draft forwards and ``verify_size`` the number of tree nodes sent
    to the target.
    """

    depth: int
    verify_size: int


class DraftController(ABC):
    """Decides, before each draft step, whether to draft one more token.

    Implementations: :class:`FixedDepthController` (fixed γ), the PPO policy and its ONNX
    export in :mod:`policies`.
    """

    max_depth: int = 12
    #: The ``max_depth`` the depth feature this controller reads is divided by (depth / max_depth), e.g. the
    #: one a trained policy was trained with: its decoder must be built with the same (a mismatch is refused,
    #: :func:`learn2draft.features.check_depth_feature_scale`). None: the controller does not read the depth
    #: feature on any particular scale (fixed depths), so any decoder's ``max_depth`` serves.
    depth_feature_scale: int | None = None

    def reset(self) -> None:  # noqa: B027 (optional hook, a no-op by default)
        """Called at the start of each generation."""

    @abstractmethod
    def continue_drafting(self, features: np.ndarray) -> bool:
        """``features``: float32 (n_features,) from :func:`learn2draft.features.build_features`."""

    def verification_size(self, features: np.ndarray, depth: int) -> int:
        """Number of drafted tokens to verify; a chain verifies all of them."""
        return depth


class FixedDepthController(DraftController):
    """Always draft γ = ``num_draft_tokens`` tokens (γ = 0 is autoregressive decoding)."""

    def __init__(self, num_draft_tokens: int):
        if isinstance(num_draft_tokens, bool) or not isinstance(num_draft_tokens, int) or num_draft_tokens < 0:
            raise ValueError(f"num_draft_tokens must be an integer ≥ 0, got {num_draft_tokens!r}.")
        self.num_draft_tokens = self.max_depth = int(num_draft_tokens)

    def continue_drafting(self, features: np.ndarray) -> bool:
        return True  # the decoder stops at max_depth

    def __repr__(self) -> str:
        return f"FixedDepthController(num_draft_tokens={self.num_draft_tokens})"


@dataclass
class DraftStep:
    """One drafted token. ``confidence``: max raw draft probability; ``entropy`` in nats."""

    token: int
    confidence: float
    entropy: float


@dataclass
class CycleResult:
    """The outcome of one draft/verify cycle.

    Attributes:
        tokens: ids emitted this cycle (τ + 1, fewer at EOS or ``max_new_tokens``).
        depth: tokens drafted (γ); ``verify_size``: tokens verified.
        num_accepted: accepted length τ (accepted prefix only, and only tokens actually emitted:
            drafted tokens accepted after an EOS do not count).
        draft_seconds, verify_seconds: device-synchronised seconds in the draft / target forwards
            and the sampling that goes with them; ``other_seconds``: the rest of the cycle
            (acceptance, cache rollback, features, controller decisions when timed).
        finished: generation ended (EOS emitted or ``max_new_tokens`` reached).
        features: observation for the next decision (start of the next cycle).
    """

    tokens: list[int]
    depth: int
    verify_size: int
    num_accepted: int
    draft_seconds: float
    verify_seconds: float
    other_seconds: float
    finished: bool
    features: np.ndarray = field(repr=False, default=None)

    @property
    def action(self) -> DraftAction:
        """The (depth, verification size) this cycle executed."""
        return DraftAction(self.depth, self.verify_size)

    @property
    def seconds(self) -> float:
        """Cycle seconds: draft + verify + other."""
        return self.draft_seconds + self.verify_seconds + self.other_seconds

    @property
    def tokens_per_second(self) -> float:
        return len(self.tokens) / self.seconds if self.seconds > 0 else 0.0


@dataclass
class GenerationResult:
    """A whole generation. Times in seconds, ``tokens_per_second`` = new tokens / wall seconds
    (prefill included), ``ttft_seconds`` = time to the first emitted token."""

    prompt_ids: list[int]
    tokens: list[int]
    cycles: list[CycleResult]
    wall_seconds: float
    ttft_seconds: float

    @property
    def tokens_per_second(self) -> float:
        return len(self.tokens) / self.wall_seconds if self.wall_seconds > 0 else 0.0

    @property
    def mean_accepted(self) -> float:
        """Mean accepted length τ over cycles that drafted at least one token (0 if none did)."""
        t = [c.num_accepted for c in self.cycles if c.depth > 0]
        return float(np.mean(t)) if t else 0.0

    @property
    def acceptance_rate(self) -> float:
        """Accepted / drafted tokens over the generation."""
        d = sum(c.depth for c in self.cycles)
        return sum(c.num_accepted for c in self.cycles) / d if d else 0.0

    @property
    def overhead_fraction(self) -> float:
        """Share of cycle time outside the two models' forwards."""
        tot = sum(c.seconds for c in self.cycles)
        return sum(c.other_seconds for c in self.cycles) / tot if tot else 0.0

    @property
    def mean_inter_token_seconds(self) -> float:
        """(wall − TTFT) / (new tokens − 1)."""
        n = len(self.tokens)
        return (self.wall_seconds - self.ttft_seconds) / (n - 1) if n > 1 else 0.0


class SpeculativeDecoder:
    """Speculative decoding of one sequence (batch size 1): a target (from a :class:`ModelPair`)
    and a :class:`~learn2draft.drafters.Drafter`.

    Args:
        pair: the models; ``pair.target`` verifies, ``pair.draft`` drafts unless ``drafter`` is given.
        sampling: settings applied identically to target and draft (greedy by default).
        max_new_tokens: generation stops after this many tokens (> 0).
        max_depth: the most tokens drafted in one cycle (≥ 0).
        seed: seeds the sampling generator; the same seed gives the same output.
        sampler: the acceptance rule; :func:`speculative_sample` unless a test swaps in another.
        drafter: what proposes draft tokens; default ``ModelDrafter(pair.draft, pair.vocab_size)``
            (see :func:`learn2draft.drafters.make_drafter` for ``"model" | "head" | "lookup"``).

    Raises:
        ValueError: ``max_new_tokens`` ≤ 0 or ``max_depth`` < 0.
    """

    def __init__(
        self,
        pair: ModelPair,
        sampling: SamplingConfig | None = None,
        max_new_tokens: int = 128,
        max_depth: int = 12,
        seed: int = 0,
        sampler: Sampler = speculative_sample,
        drafter: Drafter | None = None,
    ):
        if not isinstance(max_new_tokens, int) or max_new_tokens <= 0:
            raise ValueError(f"max_new_tokens must be a positive integer, got {max_new_tokens!r}.")
        if max_depth < 0:
            raise ValueError(f"max_depth must be ≥ 0, got {max_depth}.")
        self.pair = pair
        self.sampling = sampling or SamplingConfig()
        self.max_new_tokens = max_new_tokens
        self.max_depth = max_depth
        self.seed = seed
        self.sampler = sampler
        self.drafter = drafter if drafter is not None else ModelDrafter(pair.draft, pair.vocab_size)
        self.clock = DeviceClock(pair.device)
        self._eos = torch.tensor(pair.eos_token_ids, dtype=torch.long)
        self._started = False

    # ------------------------------------------------------------------ state
    def start(self, prompt_ids: torch.Tensor, seed: int | None = None) -> None:
        """Reset the state for a new prompt, prefill the target with the whole prompt in one forward
        and emit the first token from its last logits (the prefill is the first verification).

        After :meth:`start`, :attr:`finished` may already be True (the first token was EOS, or
        ``max_new_tokens`` = 1).

        Args:
            prompt_ids: int64 (L,) or (1, L), L ≥ 1. Batch size 1 only: for several prompts call
                :meth:`generate` once per prompt (a batched loop is not implemented).

        Raises:
            ValueError: a batch of more than one prompt, a tensor of more than 2 dimensions, a
                non-integer tensor, an empty prompt, an id outside the vocabulary, or prompt +
                ``max_new_tokens`` beyond the context window.
        """
        prompt_ids = check_prompt_ids(prompt_ids, self.pair.vocab_size).to(self.pair.device)
        self.pair.check_length(prompt_ids.numel(), self.max_new_tokens)
        self.prompt_len = prompt_ids.numel()
        self.ids = prompt_ids
        self.generator = torch.Generator(device=self.pair.device).manual_seed(self.seed if seed is None else seed)
        self.target_cache = DynamicCache()
        self.target_len = 0
        self.accepted_history: list[int] = []
        self.last_accept_fraction = 1.0
        self.finished = False
        self._begin_cycle()
        self._started = True
        self.drafter.start(prompt_ids)
        logits = self._target_forward(self.ids)[-1:]
        self.target_len = self.prompt_len
        p = self.sampling.probs(logits, self.ids, source="target")
        first = sample_from(p[0], self.generator)
        self._commit([first])
        # The target has now seen every committed token but the first generated one: the invariant holds.
        self._cycle_other = 0.0  # prefill is not part of a cycle; generate() counts it in wall/TTFT

    def _begin_cycle(self) -> None:
        self.drafted: list[int] = []
        self.draft_probs: list[torch.Tensor | None] = []
        self.confidences: list[float] = []
        self.last_entropy = 0.0
        self._cycle_draft = self._cycle_verify = self._cycle_other = 0.0

    @property
    def generated(self) -> int:
        return self.ids.numel() - self.prompt_len

    @property
    def depth(self) -> int:
        return len(self.drafted)

    @property
    def depth_limit(self) -> int:
        """The most tokens this cycle may draft: ``max_depth`` capped so that τ + 1 ≤ tokens left."""
        return max(0, min(self.max_depth, self.max_new_tokens - self.generated - 1))

    def can_draft(self) -> bool:
        """Whether :meth:`draft_step` may run now: below the depth limit and the drafter has a
        proposal (a prompt lookup without a match has none)."""
        return self.depth < self.depth_limit and self.drafter.can_propose(self._seq())

    def features(self) -> np.ndarray:
        """Observation for the next decision, float32 (n_features,); see :mod:`learn2draft.features`."""
        return build_features(
            context_len=self.ids.numel() + self.depth,
            depth=self.depth,
            max_depth=max(self.max_depth, 1),
            accepted_history=self.accepted_history,
            confidences=self.confidences,
            last_entropy=self.last_entropy,
            vocab_size=self.pair.vocab_size,
            last_accept_fraction=self.last_accept_fraction,
            generated=self.generated,
            max_new_tokens=self.max_new_tokens,
            drafter_features=self.drafter.features(self._seq()),
        )

    # --------------------------------------------------------------- forwards
    @torch.inference_mode()
    def _target_forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """Feed ``tokens`` (int64 (n,)) to the target after its cached prefix (``target_len``
        tokens); return logits float (n, V). Passes the last hidden states to the drafter when it
        reads them."""
        need_hidden = self.drafter.needs_target_hidden
        out = self.pair.target(
            input_ids=tokens.unsqueeze(0), cache=self.target_cache, use_cache=True, output_hidden_states=need_hidden
        )
        if need_hidden:
            self.drafter.observe_target(out.hidden_states[-1][0], self.target_len)
        return out.logits[0, :, : self.pair.vocab_size]

    def _seq(self) -> torch.Tensor:
        if not self.drafted:
            return self.ids
        return torch.cat([self.ids, torch.tensor(self.drafted, dtype=torch.long, device=self.ids.device)])

    def draft_step(self) -> DraftStep:
        """Draft one token with the drafter.

        Raises:
            RuntimeError: not started, finished, the depth limit is reached, or the drafter has
                no proposal (check :meth:`can_draft`).
        """
        self._check_running()
        if self.depth >= self.depth_limit:
            raise RuntimeError(f"Depth limit {self.depth_limit} reached: call verify().")
        t0 = self.clock.now()
        prop = self.drafter.propose(self._seq(), self.sampling, self.generator)
        self.drafted.append(prop.token)
        self.draft_probs.append(prop.probs)
        self.confidences.append(prop.confidence)
        self.last_entropy = prop.entropy
        self._cycle_draft += self.clock.now() - t0
        return DraftStep(prop.token, prop.confidence, prop.entropy)

    def verify(self, verify_size: int | None = None) -> CycleResult:
        """Verify the drafted chain with one target forward, accept, commit and roll back the caches.

        Args:
            verify_size: must equal the depth for a chain (None means the depth).

        Raises:
            ValueError: ``verify_size`` differs from the depth.
            RuntimeError: not started or already finished.
        """
        self._check_running()
        gamma = self.depth
        if verify_size is not None and verify_size != gamma:
            raise ValueError(f"A chain drafter verifies all drafted tokens: verify_size must be {gamma}, got {verify_size}.")
        t0 = self.clock.now()
        seq = self._seq()
        logits = self._target_forward(seq[self.target_len :])[-(gamma + 1) :]
        self.target_len = seq.numel()
        drafted = seq[self.ids.numel() :]
        p = self.sampling.probs(logits, self.ids, drafted, source="target")
        t1 = self.clock.now()
        q = self._draft_q(p) if gamma else p.new_zeros(0, p.shape[1])
        tau, nxt = self.sampler(p, q, drafted, self.generator)
        n_old = self.ids.numel()
        emitted = self._commit(self.drafted[:tau] + [nxt])
        # Roll back: entries are valid for committed-old + accepted drafts (same tokens in both sequences).
        valid = n_old + tau
        if self.target_len > valid:
            self.target_cache.crop(-(self.target_len - valid))
            self.target_len = valid
        self.drafter.rollback(valid)
        tau = min(tau, len(emitted))  # drafted tokens accepted after an EOS are not emitted: not counted
        self.accepted_history.append(tau)
        self.last_accept_fraction = tau / gamma if gamma else 1.0
        draft_s, other_s = self._cycle_draft, self._cycle_other
        verify_s = t1 - t0
        self._begin_cycle()
        feats = self.features()
        other_s += self.clock.now() - t1
        return CycleResult(emitted, gamma, gamma, tau, draft_s, verify_s, other_s, self.finished, feats)

    def _draft_q(self, p: torch.Tensor) -> torch.Tensor:
        """float (γ, V): the draft distributions, with a point mass for deterministic proposals."""
        rows = []
        for tok, q in zip(self.drafted, self.draft_probs):
            if q is None:
                q = p.new_zeros(p.shape[1])
                q[tok] = 1.0
            rows.append(q)
        return torch.stack(rows)

    def _commit(self, tokens: list[int]) -> list[int]:
        """Append ``tokens`` to the committed sequence, cut at EOS and ``max_new_tokens``; set
        :attr:`finished`. Returns the tokens actually committed."""
        emitted = tokens[: self.max_new_tokens - self.generated]
        eos_at = [i for i, t in enumerate(emitted) if t in self.pair.eos_token_ids]
        if eos_at:
            emitted = emitted[: eos_at[0] + 1]
        self.ids = torch.cat([self.ids, torch.tensor(emitted, dtype=torch.long, device=self.ids.device)])
        self.finished = bool(eos_at) or self.generated >= self.max_new_tokens
        return emitted

    def _check_running(self) -> None:
        if not self._started:
            raise RuntimeError("Call start(prompt_ids) first.")
        if self.finished:
            raise RuntimeError("Generation finished (EOS or max_new_tokens): call start() for a new prompt.")

    def add_other_seconds(self, seconds: float) -> None:
        """Charge time spent outside the decoder (e.g. a controller's decision) to the current cycle."""
        self._cycle_other += seconds

    # ----------------------------------------------------------------- driving
    def step(self, draft_more: bool) -> CycleResult | None:
        """Apply one decision: draft one more token (``draft_more`` and :meth:`can_draft`), or verify.

        When a drafted token reaches the cycle's limit (depth limit, or no further proposal from
        the drafter), verification happens in the same call. This is the one step function that
        :meth:`run_cycle` and :class:`envs.SpecDecodeEnv` drive.

        Returns:
            the :class:`CycleResult` when this call verified, else None.

        Raises:
            RuntimeError: not started or finished.
        """
        if draft_more and self.can_draft():
            self.draft_step()
            if self.can_draft():
                return None
        return self.verify()

    def run_cycle(self, controller: DraftController) -> CycleResult:
        """Draft while the controller says CONTINUE (up to the decoder's and the controller's
        ``max_depth``, and while the drafter has proposals), then verify; through :meth:`step`.
        The controller's decision time is charged to ``other_seconds``."""
        while True:
            go = False
            if self.depth < controller.max_depth and self.can_draft():
                t0 = self.clock.now()
                go = controller.continue_drafting(self.features())
                self._cycle_other += self.clock.now() - t0
            res = self.step(go)
            if res is not None:
                return res

    def generate(
        self,
        prompt_ids: torch.Tensor,
        controller: DraftController,
        seed: int | None = None,
        on_tokens: Callable[[list[int], CycleResult | None], bool | None] | None = None,
    ) -> GenerationResult:
        """Generate up to ``max_new_tokens`` after ``prompt_ids`` (int64 (L,) or (1, L)); stop at EOS
        (emitted, nothing after).

        The wall clock covers prefill, every cycle and the controller's decisions; TTFT is the
        prefill (one target forward over the prompt and the first token's draw).

        Args:
            on_tokens: called as tokens are committed, for streaming: ``on_tokens(tokens, None)``
                with the first token after the prefill, then ``on_tokens(cycle.tokens, cycle)``
                after every cycle. Returning True stops the generation there (e.g. a stop string
                was seen); its time is charged to the wall clock.

        Raises:
            ValueError: ``controller`` reads the depth features on the scale of a ``max_depth``
                (its ``depth_feature_scale``, e.g. a trained policy's) other than this decoder's.
        """
        scale = getattr(controller, "depth_feature_scale", None)
        if scale is not None and scale != self.max_depth:
            raise ValueError(f"{controller!r} reads depth features scaled by max_depth={scale}, but this decoder has "
                             f"max_depth={self.max_depth}: build the decoder with max_depth={scale}.")
        controller.reset()
        t0 = self.clock.now()
        self.start(prompt_ids, seed)
        ttft = self.clock.now() - t0
        cycles = []
        stop = bool(on_tokens and on_tokens(self.ids[self.prompt_len :].tolist(), None))
        while not self.finished and not stop:
            cycles.append(self.run_cycle(controller))
            stop = bool(on_tokens and on_tokens(cycles[-1].tokens, cycles[-1]))
        wall = self.clock.now() - t0
        return GenerationResult(
            prompt_ids=self.ids[: self.prompt_len].tolist(),
            tokens=self.ids[self.prompt_len :].tolist(),
            cycles=cycles,
            wall_seconds=wall,
            ttft_seconds=ttft,
        )


def autoregressive_controller() -> FixedDepthController:
    """The autoregressive baseline: γ = 0, one target forward per token, timed by the same loop."""
    return FixedDepthController(0)


def expected_tokens_per_cycle(alpha: float, gamma: int) -> float:
    """E[τ + 1] = (1 − α^(γ+1)) / (1 − α) for i.i.d. acceptance α (Leviathan et al. 2023, eq. 1)."""
    if alpha >= 1.0:
        return float(gamma + 1)
    return (1 - alpha ** (gamma + 1)) / (1 - alpha)


__all__ = [
    "CycleResult", "DraftAction", "DraftController", "DraftStep", "FixedDepthController", "GenerationResult",
    "SpeculativeDecoder", "autoregressive_controller", "expected_tokens_per_cycle",
]
