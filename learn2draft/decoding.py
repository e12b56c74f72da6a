"""The draft/verify loop with KV-cache rollback (speculative decoding, Leviathan et al. 2023;
Chen et al. 2023), built so that a policy can decide the draft depth one step at a time.

Prefill: the whole prompt goes through the target in one forward; its last logits give the first
token, as Hugging Face ``generate()`` does (time to first token = one prefill forward).

One *cycle*:

1. a :class:`learn2draft.drafters.Drafter` (draft model, feature-level head or prompt lookup)
   proposes tokens one at a time (:meth:`SpeculativeDecoder.draft_step`); before each step a
   :class:`DraftController` sees the :class:`learn2draft.state.DraftState` (a learned policy its
   :mod:`learn2draft.features` vector) and says CONTINUE or STOP — the decision precedes the draw,
   which keeps the output law exact;
2. the target verifies the γ drafted tokens plus the bonus position in one forward pass
   (:meth:`SpeculativeDecoder.verify`);
3. :func:`learn2draft.sampling.speculative_sample` accepts a prefix of length τ and emits one
   corrected or bonus token, so τ + 1 tokens are committed (fewer at EOS / ``max_new_tokens``);
4. the target's KV cache is rolled back to the committed length (a batch cache row: its length set; a
   ``DynamicCache``: cropped) and the drafter rolled back.

The cycle exists once, here: :meth:`~SpeculativeDecoder.draft_step` and :meth:`~SpeculativeDecoder.verify`
(prepare, one target forward, accept, commit, roll back, time). Recording drafted tokens (:func:`draft_rows`) and the
verification's tail (:func:`finish_rows`: commit, roll back, time, results) are functions over B ≥ 1 rows: a
sequence decoded alone is a batch of one, and :class:`learn2draft.batched.BatchedSpeculativeDecoder` runs them once
per step for all its rows. How a controller drives them — the drafting loop
(ask the controller, draft, repeat), the size decision, :meth:`~SpeculativeDecoder.run_cycle` (deployment,
evaluation, trace recording), :meth:`~SpeculativeDecoder.step` (one agent decision, for the gymnasium environments,
:mod:`envs`) and :meth:`~SpeculativeDecoder.generate` — is :class:`learn2draft.control.CycleDriver`, which the
replay backend (:class:`learn2draft.replay.backend.ReplayDecoder`: a trace and a latency profile, no model) shares. A trace recorder plugs in through the
``sampler`` hook. Controllers and actions: :mod:`learn2draft.control`; what a policy sees:
:class:`learn2draft.state.DraftState`.

Cache invariant: the target's cache holds keys/values for a prefix of the sequence
``committed + drafted``; every forward feeds exactly the tokens after that prefix. After
verification the valid prefix is ``committed + accepted`` minus the last token, which has not
been fed to the target yet. A chain keeps it in one row of :class:`learn2draft.batch_cache.BatchCache`, the batched
decoder's cache, and feeds it through the same ragged forward: a sequence decoded alone is a batch of one, and rolling
back is setting the row's length (a target that forward does not support, and a tree, keep Hugging Face's
``DynamicCache``). Draft *trees* (EAGLE-2 drafting, top-V verification with a tree
attention mask, the accepted path's entries gathered into the cache) are
:class:`learn2draft.tree.TreeSpeculativeDecoder`, a subclass of this decoder; the
:class:`~learn2draft.metrics.DraftAction` a cycle executes (its ``CycleResult.action``) carries the verification size
(equal to the depth for a chain, the tree nodes verified for a tree).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch
from transformers import DynamicCache

from learn2draft.batch_cache import BatchCache, is_supported
from learn2draft.control import CycleDriver, DraftController, FixedDepthController, per_class
from learn2draft.drafters.base import Drafter, raw_distribution_stats
from learn2draft.drafters.hybrid import NEURAL_SOURCE, HybridDrafter
from learn2draft.drafters.model import ModelDrafter
from learn2draft.features import build_hybrid_features
from learn2draft.metrics import CycleResult
from learn2draft.models import ModelPair, check_prompt_ids
from learn2draft.names import DECODER_MAX_DEPTH
from learn2draft.sampling import SamplingConfig, sample_from, speculative_sample
from learn2draft.state import DraftState
from learn2draft.timing import DeviceClock

Sampler = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Generator | None], tuple[int, int]]


def check_decoder_settings(max_new_tokens: int, max_depth: int) -> None:
    """The checks every decoder makes of its settings.

    Raises:
        ValueError: ``max_new_tokens`` is not a positive integer, or ``max_depth`` < 0.
    """
    if not isinstance(max_new_tokens, int) or max_new_tokens <= 0:
        raise ValueError(f"max_new_tokens must be a positive integer, got {max_new_tokens!r}.")
    if max_depth < 0:
        raise ValueError(f"max_depth must be ≥ 0, got {max_depth}.")


class SpeculativeDecoder(CycleDriver):
    """Speculative decoding of one sequence (batch size 1): a target (from a :class:`ModelPair`)
    and a :class:`~learn2draft.drafters.Drafter`. This class is THE cycle: a chain here, a draft
    tree in :class:`learn2draft.tree.TreeSpeculativeDecoder`, which overrides only the shape's
    parts (:meth:`draft_step`, :meth:`depth`, :meth:`_prepare_verification`,
    :meth:`_verification_forward`, :meth:`_accept`, :meth:`_rollback`); the verification tail and the timing
    live here once, and the decisions' loop (:meth:`draft`, :meth:`step`, :meth:`run_cycle`, :meth:`generate`) is
    :class:`learn2draft.control.CycleDriver`'s, shared with the replay backend.

    Args:
        pair: the models; ``pair.target`` verifies, ``pair.draft`` drafts unless ``drafter`` is given.
        sampling: settings applied identically to target and draft (greedy by default).
        max_new_tokens: generation stops after this many tokens (> 0).
        max_depth: the most tokens drafted in one cycle (≥ 0); the scale of the depth features.
        seed: seeds the sampling generator; the same seed gives the same output.
        sampler: the acceptance rule; :func:`speculative_sample` unless a test or a trace recorder
            swaps in another (a recording hook: it sees p, q and the drafted tokens of every cycle).
        drafter: what proposes draft tokens; default ``ModelDrafter(pair.draft, pair.vocab_size)``
            (see :func:`learn2draft.drafters.make_drafter` for ``"model" | "head" | "lookup"``).

    Raises:
        ValueError: ``max_new_tokens`` ≤ 0 or ``max_depth`` < 0.
    """

    #: A chain verifies every drafted token; a tree (``"tree"``) decides how many nodes V.
    shape = "chain"

    def __init__(
        self,
        pair: ModelPair,
        sampling: SamplingConfig | None = None,
        max_new_tokens: int = 128,
        max_depth: int = DECODER_MAX_DEPTH,
        seed: int = 0,
        sampler: Sampler = speculative_sample,
        drafter: Drafter | None = None,
    ):
        check_decoder_settings(max_new_tokens, max_depth)
        self.pair = pair
        self.sampling = sampling or SamplingConfig()
        self.max_new_tokens = max_new_tokens
        self.max_depth = max_depth
        self.seed = seed
        self.sampler = sampler
        self.drafter = drafter if drafter is not None else ModelDrafter(pair.draft, pair.vocab_size)
        self._hybrid = isinstance(self.drafter, HybridDrafter)
        #: where the last committed token was drawn: (raw target logits float (n, V), the row), read on demand
        self._target_row: tuple[torch.Tensor, int] | None = None
        self._target_stats: tuple[tuple, np.ndarray] | None = None  # (that reference, its stats), computed once
        self.clock = DeviceClock(pair.device)
        #: The target's cache: a row (:attr:`cache_row`) of a :class:`~learn2draft.batch_cache.BatchCache` for a chain
        #: on a target its ragged forward supports, else a ``DynamicCache``; reused from one :meth:`start` to the next.
        self.target_cache: BatchCache | DynamicCache | None = None
        self.cache_row = 0
        self._ragged: bool | None = None  # whether the ragged forward runs the target (checked at the first start)
        #: Seconds of the last cycle's parts: ``draft``, ``select_mask`` (preparing the verification),
        #: ``forward`` (target forward and its probabilities), ``sample`` (acceptance), ``gather`` (commit,
        #: cache rollback and drafter rollback) and ``cycle``.
        self.last_timing: dict[str, float] = {}
        self._started = False

    # ------------------------------------------------------------------ state
    def start(self, prompt_ids: torch.Tensor, seed: int | None = None, prefill: bool = True) -> None:
        """Reset the state for a new prompt, prefill the target with the whole prompt in one forward
        and emit the first token from its last logits (the prefill is the first verification).

        After :meth:`start`, :attr:`finished` may already be True (the first token was EOS, or
        ``max_new_tokens`` = 1).

        Args:
            prompt_ids: int64 (L,) or (1, L), L ≥ 1. Batch size 1 here: many requests at once are
                :class:`learn2draft.batched.BatchedSpeculativeDecoder`'s.
            prefill: False resets the state without the prefill forward (a batched prefill runs it for many rows,
                then calls :meth:`_first_token` per row).

        Raises:
            ValueError: a batch of more than one prompt, a tensor of more than 2 dimensions, a
                non-integer tensor, an empty prompt, an id outside the vocabulary, or prompt +
                ``max_new_tokens`` beyond the context window.
        """
        checked = check_prompt_ids(prompt_ids, self.pair.vocab_size)
        prompt_ids = checked.to(self.pair.device)
        self.pair.check_length(prompt_ids.numel(), self.max_new_tokens)
        self.prompt_len = prompt_ids.numel()
        # One preallocated token buffer: committed tokens, then this cycle's drafted chain. ids and _seq()
        # are views of it, so drafting a token writes one entry instead of rebuilding the sequence tensor. It is a row
        # of a token store, so that a verification commits the tokens of all rows sharing it in one write. A store
        # off the host has a host mirror (_store_host) that the same writes keep equal to it.
        self._store, self._store_host, self._store_row = self._open_buffer(self.prompt_len + self.max_new_tokens + 1)
        self._buf = self._store[self._store_row]
        self._buf[: self.prompt_len] = prompt_ids
        if self._store_host is not None:
            self._store_host[self._store_row, : self.prompt_len] = checked.reshape(-1).cpu().numpy()
        self._n = self.prompt_len
        self.generator = torch.Generator(device=self.pair.device).manual_seed(self.seed if seed is None else seed)
        self.target_cache = self._open_target_cache()
        self.target_len = 0
        self._target_row = None
        self._verify_logits: torch.Tensor | None = None
        self.accepted_history: list[int] = []
        self.last_accept_fraction = 1.0
        self.finished = False
        self._begin_cycle()
        self._started = True
        self.drafter.start(prompt_ids)
        self.drafter.attach_tokens(self.host_tokens())
        if prefill:
            self._first_token(self._target_forward(self.ids, last_only=True))

    def _open_buffer(self, length: int) -> tuple[torch.Tensor, np.ndarray | None, int]:
        """The token store this sequence's buffer is a row of (int64 (R, ≥ ``length``)), its host mirror
        (:func:`host_mirror`) and that row: a sequence decoded alone has its own one-row store; a batch's rows share
        one (:class:`learn2draft.batched.BatchedSpeculativeDecoder`)."""
        store = torch.empty(1, length, dtype=torch.long, device=self.pair.device)
        return store, host_mirror(store), 0

    def host_tokens(self) -> np.ndarray:
        """This sequence's token buffer in host memory, int64 (capacity,): its first ``len(ids) + len(drafted)``
        entries are the committed and drafted tokens (the rest is unset). On a CPU the buffer itself (no copy), else
        its host mirror. Valid until the next :meth:`start`, and for a batch's row until the batch's token store grows
        (it then copies the rows into a larger store and re-attaches each row's drafter to its new row).
        The drafters that search the sequence on the host read it (:meth:`~learn2draft.drafters.Drafter.
        attach_tokens`)."""
        host = self._store_host
        return self._buf.numpy() if host is None else host[self._store_row]

    def _open_target_cache(self) -> BatchCache | DynamicCache:
        """The target's cache for a new sequence: one row of a :class:`~learn2draft.batch_cache.BatchCache` (this
        decoder's, reused, with room for the prompt and ``max_new_tokens``) for a chain on a target whose attention the
        ragged forward runs (:func:`~learn2draft.batch_cache.is_supported`), else an empty ``DynamicCache``."""
        cache = self.target_cache
        if not isinstance(cache, BatchCache):
            if self._ragged is None:
                self._ragged = self.shape == "chain" and is_supported(self.pair.target)
            if not self._ragged:
                return DynamicCache()
            cache = BatchCache(self.pair.target)
        cache.keep_rows([])
        cache.add_rows(1)
        cache.reserve(1, self.prompt_len + self.max_new_tokens + 1)
        self.cache_row = 0
        return cache

    def _first_token(self, logits: torch.Tensor, token: int | None = None) -> list[int]:
        """Draw and commit the first token from the prefill's last logits (float (1, V)); a batched prefill
        (:meth:`learn2draft.batched.BatchedSpeculativeDecoder.add_many`) calls it per row with ``token``, the row's
        draw from its own generator already made for all joining rows at once. Returns the committed tokens."""
        self._target_row = (logits, logits.shape[0] - 1)
        self.target_len = self.prompt_len
        if token is None:
            token = sample_from(self.sampling.probs(logits, self.ids, source="target")[0], self.generator)
        emitted = commit_rows([self], [[token]])[0]
        self.drafter.observe_tokens(emitted, self.prompt_len)
        # The target has now seen every committed token but the first generated one: the invariant holds.
        self._cycle_other = 0.0  # prefill is not part of a cycle; generate() counts it in wall/TTFT
        return emitted

    def _begin_cycle(self) -> None:
        """Forget the drafted tokens of the cycle that ended (the committed state stays): :func:`begin_cycles` of
        this row; a subclass with per-cycle state of its own (a tree) extends this."""
        begin_cycles([self])

    @property
    def last_entropy(self) -> float:
        """Entropy (nats) of the draft at the last drafted token this cycle (0 at depth 0)."""
        return self.entropies[-1] if self.entropies else 0.0

    def target_stats(self) -> np.ndarray:
        """The target's own view of the last committed token, free from the forward that produced it: float32 (3,)
        = (top-1 probability, entropy in nats, top-2 margin) of the target's raw softmax at the position where the
        last committed token was drawn (the prefill's last row, then the corrected or bonus row of each chain
        verification); zeros before :meth:`start` and after a tree cycle. Computed on demand (one softmax over V).
        Every value is known before the next decision, so a policy may read it without touching the law."""
        at = self._target_row
        if at is None:
            return np.zeros(3, dtype=np.float32)
        cached = self._target_stats
        if cached is None or cached[0] is not at:  # once per committed row, however many decisions read it
            cached = self._target_stats = (at, np.asarray(raw_distribution_stats(at[0][at[1]]), dtype=np.float32))
        return cached[1].copy()

    @property
    def ids(self) -> torch.Tensor:
        """int64 (L + generated,): the committed sequence (prompt + generated), a view of the token buffer."""
        return self._buf[: self._n]

    @property
    def generated(self) -> int:
        return self._n - self.prompt_len

    @property
    def depth(self) -> int:
        """Tokens drafted this cycle."""
        return len(self.drafted)

    @property
    def depth_limit(self) -> int:
        """The most tokens this cycle may draft: ``max_depth`` capped so that τ + 1 ≤ tokens left
        (:func:`depth_limits` of this row)."""
        return depth_limits([self])[0]

    def can_draft(self) -> bool:
        """Whether :meth:`draft_step` may run now: below the depth limit and the drafter has a
        proposal (a prompt lookup without a match has none)."""
        return self.depth < self.depth_limit and self.drafter.can_propose(self._seq())

    def _tree_scores(self) -> np.ndarray:
        """float64 (N,) drafted tree nodes' scores; none for a chain."""
        return np.zeros(0)

    def state(self) -> DraftState:
        """What a policy may see at the next decision (:class:`learn2draft.state.DraftState`)."""
        return DraftState(
            depth=self.depth, max_depth=self.max_depth, committed_len=self.ids.numel(), generated=self.generated,
            max_new_tokens=self.max_new_tokens, accepted_history=tuple(self.accepted_history),
            last_accept_fraction=self.last_accept_fraction, confidences=tuple(self.confidences),
            entropies=tuple(self.entropies), vocab_size=self.pair.vocab_size,
            drafter_features=self.drafter.features(self._seq()), tree_scores=self._tree_scores(),
            extra_features=self._hybrid_features() if self._hybrid else np.zeros(0, dtype=np.float32),
        )

    def _hybrid_features(self) -> np.ndarray:
        """float32 (len(HYBRID_FEATURE_NAMES),): a hybrid drafter's source-choice features
        (:func:`learn2draft.features.build_hybrid_features`)."""
        left = max(self.depth_limit - self.depth, 0)
        _, confs = self.drafter.lookahead(self._seq(), left) if left else ([], [])
        last_neural = bool(self.drafted_sources) and self.drafted_sources[-1] == NEURAL_SOURCE
        return build_hybrid_features(confs, max(self.max_depth, 1), last_neural, self.target_stats(),
                                     self.pair.vocab_size)

    def features(self) -> np.ndarray:
        """Observation for the next depth decision, float32 (n_features,); see :mod:`learn2draft.features`."""
        return self.state().features()

    def size_features(self) -> np.ndarray:
        """Observation for a tree's verification-size decision, float32 (len(SIZE_FEATURE_NAMES),); see
        :func:`learn2draft.features.size_feature_spec`."""
        return self.state().size_features()

    # --------------------------------------------------------------- forwards
    @torch.inference_mode()
    def _target_forward(self, tokens: torch.Tensor, last_only: bool = False) -> torch.Tensor:
        """Feed ``tokens`` (int64 (n,)) to the target after its cached prefix (``target_len``
        tokens); return logits float (n, V), or (1, V) for the last token alone (``last_only``: a prefill).
        Passes the last hidden states (all n) to the drafter when it reads them."""
        need_hidden = self.drafter.needs_target_hidden
        cache = self.target_cache
        if isinstance(cache, BatchCache):
            keep = torch.tensor([tokens.numel() - 1], device=tokens.device) if last_only else None
            logits, hidden = cache.forward(self.cache_row, [tokens], keep=keep, output_hidden=need_hidden)
        else:
            out = self.pair.target(input_ids=tokens.unsqueeze(0), cache=cache, use_cache=True,
                                   output_hidden_states=need_hidden)
            logits, hidden = out.logits[0, -1:] if last_only else out.logits[0], (
                out.hidden_states[-1][0] if need_hidden else None)
        if need_hidden:
            self.drafter.observe_target(hidden, self.target_len)
        return logits[:, : self.pair.vocab_size]

    def _seq(self) -> torch.Tensor:
        """int64 (L + generated + γ,): committed + this cycle's drafted chain (a view of the token buffer; a batch's
        rows: :func:`draft_sequences`)."""
        return self._buf[: self._n + len(self.drafted)]

    def draft_step(self, prepared: Any = None) -> Any:
        """Draft one token with the drafter and record it (the one copy of a drafted token's bookkeeping).

        Args:
            prepared: None: the drafter proposes (:meth:`~learn2draft.drafters.Drafter.propose`). Else what a
                batched forward already computed for this row (:meth:`~learn2draft.drafters.Drafter.prepare_batch`,
                run by :class:`learn2draft.batched.BatchedSpeculativeDecoder`): the drafter only draws from it
                (:meth:`~learn2draft.drafters.Drafter.finish`, the same draw as ``propose``); the forward's
                seconds are charged by the caller.

        Returns:
            the drafter's :class:`learn2draft.drafters.base.DraftProposal`.

        Raises:
            RuntimeError: not started, finished, the depth limit is reached, or the drafter has
                no proposal (check :meth:`can_draft`).
        """
        self._check_running()
        if self.depth >= self.depth_limit:
            raise RuntimeError(f"Depth limit {self.depth_limit} reached: call verify().")
        if prepared is not None:
            return draft_prepared([self], [prepared])[0]
        t0 = self.clock.now()
        prop = self.drafter.propose(self._seq(), self.sampling, self.generator)
        if self._hybrid:
            self.drafted_sources.append(self.drafter.last_source)
        draft_rows([self], [[prop]])
        self._cycle_draft += self.clock.now() - t0
        return prop

    def truncate_draft(self, keep: int) -> None:
        """Keep only the first ``keep`` drafted tokens of this cycle (a verification budget's cut, decided from the
        draft side alone — e.g. vLLM's adaptive verification — so the output law is unchanged) and roll the drafter
        back to them.

        Raises:
            ValueError: ``keep`` outside 0..depth.
        """
        if not 0 <= keep <= self.depth:
            raise ValueError(f"keep must be in 0..{self.depth} (the tokens drafted), got {keep}.")
        if keep == self.depth:
            return
        for name in ("drafted", "draft_probs", "confidences", "entropies", "margins", "drafted_sources"):
            del getattr(self, name)[keep:]
        self.drafter.rollback(self.ids.numel() + keep)

    # ------------------------------------------------------------ verification
    def _prepare_verification(self, verify_size: int | None) -> Any:
        """Check the verification size and return what the shape's forward needs (a chain: the
        committed + drafted sequence, int64 (L + γ,)).

        Raises:
            ValueError: ``verify_size`` differs from the depth (a chain verifies every drafted token).
        """
        gamma = self.depth
        if verify_size is not None and verify_size != gamma:
            raise ValueError(f"A chain drafter verifies all drafted tokens: verify_size must be {gamma}, got {verify_size}.")
        return self._seq()

    def _verification_tokens(self, plan: Any) -> torch.Tensor:
        """int64 (γ+1,) for a chain: what the verification forward feeds after the target's cached prefix (the last
        committed token and the drafted chain)."""
        return plan[self.target_len :]

    def _verification_forward(self, plan: Any) -> torch.Tensor:
        """One target forward over the last committed token + the chain; float (γ+1, V) target
        probabilities after the same processing as the draft's."""
        return self._verification_probs(plan, self._target_forward(self._verification_tokens(plan)))

    def _verification_probs(self, plan: Any, logits: torch.Tensor, probs: torch.Tensor | None = None) -> torch.Tensor:
        """The target's probabilities from the verification forward's logits (float (n ≥ γ+1, V), its rows for
        :meth:`_verification_tokens`); the target has then seen the whole chain. A batched decoder
        (:class:`learn2draft.batched.BatchedSpeculativeDecoder`) runs the forward for many rows and calls this per row,
        with ``probs`` (float32 (n, V), the same rows already processed by
        :meth:`~learn2draft.sampling.SamplingConfig.probs_rows` for the whole batch) when no processor reads the prefix.

        Returns:
            float (γ+1, V), after the same processing as the draft's.
        """
        logits = self._observe_verification(plan, logits)
        if probs is not None:
            return probs[-(self.depth + 1) :]
        return self.sampling.probs(logits, self.ids, plan[self.ids.numel() :], source="target")

    def _observe_verification(self, plan: Any, logits: torch.Tensor) -> torch.Tensor:
        """Keep the logits the next token is drawn from without forming probabilities: what
        :meth:`_verification_probs` does first, and all a batched greedy step needs (its acceptance reads the
        logits' argmax for all rows at once, :func:`learn2draft.sampling.greedy_accept_rows`).
        Returns the chain's logits, float (γ+1, V)."""
        logits = logits[-(self.depth + 1) :]
        self._verify_logits = logits  # the target's cache length is set by the tail (finish_rows)
        return logits

    def _accept(self, plan: Any, p: torch.Tensor) -> tuple[list[int], int]:
        """The exact sampler on the chain: the accepted draft tokens and the corrected/bonus token."""
        x = plan[self.ids.numel() :]
        if self.sampler is speculative_sample:  # q None for point masses (prompt lookup): no one-hot rows; p and q
            # are softmaxes of logits already checked finite, so the sampler's value checks are skipped
            q = None if all(q is None for q in self.draft_probs) else self._draft_q(p)
            tau, nxt = speculative_sample(p, q, x, self.generator, validate=False)
        else:  # a recording or control sampler reads dense q
            q = self._draft_q(p) if self.drafted else p.new_zeros(0, p.shape[1])
            tau, nxt = self.sampler(p, q, x, self.generator)
        return self.drafted[:tau], nxt

    def _rollback(self, plan: Any, committed_before: int, accepted: int) -> None:
        """Roll the target's cache back to the committed prefix + the accepted drafts (a batch cache row: its length,
        so the rejected drafts' slots, and a padded verification's padding, are never attended to; a ``DynamicCache``:
        cropped) and roll the drafter back."""
        valid = committed_before + accepted  # same tokens in the drafted and the committed sequence
        cache = self.target_cache
        if isinstance(cache, BatchCache):
            self.target_len = min(self.target_len, valid)
            cache.set_length(self.cache_row, self.target_len)
        elif self.target_len > valid:
            cache.crop(-(self.target_len - valid))
            self.target_len = valid
        self.drafter.rollback(valid)

    def _verified_count(self, plan: Any) -> int:
        """Tokens (tree: nodes) this verification sends beside the last committed token."""
        return self.depth

    def _record_timing(self, timing: dict[str, float]) -> None:
        self.last_timing = timing

    def verify(self, verify_size: int | None = None) -> CycleResult:
        """Verify what was drafted with one target forward, accept, commit and roll back the caches.

        Args:
            verify_size: a chain must verify every drafted token (None means the depth); a tree
                takes V, the drafted nodes sent to the target (None: its ``verify_size``).

        Raises:
            ValueError: a bad ``verify_size`` for the shape.
            RuntimeError: not started or already finished.
        """
        self._check_running()
        t0 = self.clock.now()
        plan = self._prepare_verification(verify_size)
        t1 = self.clock.now()
        p = self._verification_forward(plan)
        return self._finish_verification(plan, p, t0, t1, self.clock.now())

    def _finish_verification(self, plan: Any, p: torch.Tensor, t0: float, t1: float, t2: float) -> CycleResult:
        """The verification's tail once the target's probabilities ``p`` are known: accept (:meth:`_accept`), then
        :func:`finish_rows` for this one row. ``t0``/``t1``/``t2``: clock readings before preparing, before the forward
        and after it (seconds)."""
        return finish_rows([self], [plan], [self._accept(plan, p)], t0, t1, t2, features=True)[0]

    def _draft_q(self, p: torch.Tensor) -> torch.Tensor:
        """float (γ, V): the draft distributions, with a point mass for deterministic proposals (all of them
        deterministic, as prompt lookup's: one scatter, not a zeros-and-write per token — on a GPU, 2 kernels per
        verification instead of 2 per drafted token)."""
        if all(q is None for q in self.draft_probs):
            idx = self._buf[self._n : self._n + len(self.drafted), None].to(p.device)  # the drafted ids, on the device
            return p.new_zeros(len(self.drafted), p.shape[1]).scatter_(1, idx, 1.0)
        rows = []
        for tok, q in zip(self.drafted, self.draft_probs):
            if q is None:
                q = p.new_zeros(p.shape[1])
                q[tok] = 1.0
            rows.append(q)
        return torch.stack(rows)

    @property
    def target_dtype(self):
        """The target's precision (a ``torch.dtype``), which :meth:`generate` checks a trained policy against."""
        return self.pair.target.dtype


#: The hooks a chain decoder's subclass may override; a class that overrides none of them runs the tail's shared
#: path (its rows' lengths, timings and counts handled for all rows at once), else each row calls its own.
_CHAIN_HOOKS = ("_prepare_verification", "_verification_tokens", "_rollback", "_verified_count", "_record_timing",
                "depth")
_PLAIN: dict[type, bool] = {}


def _plain_chain(cls: type) -> bool:
    """Whether ``cls`` (a :class:`SpeculativeDecoder` class) is a chain that overrides none of :data:`_CHAIN_HOOKS`."""
    plain = _PLAIN.get(cls)
    if plain is None:
        plain = _PLAIN[cls] = cls.shape == "chain" and all(
            getattr(cls, h) is getattr(SpeculativeDecoder, h) for h in _CHAIN_HOOKS)
    return plain


def chain_verification(rows: Sequence[SpeculativeDecoder]) -> tuple[list[Any], list[torch.Tensor]]:
    """Each row's verification plan (a chain: its committed + drafted sequence, int64 (L_i + γ_i,), as
    :meth:`SpeculativeDecoder._prepare_verification` returns it) and what its forward feeds after its cached prefix
    (its last committed token and its chain, int64 (γ_i + 1,)): views of the token buffers, no copy. A row of a class
    that overrides those hooks plans with its own."""
    plans, tokens = [], []
    for r, seq in zip(rows, draft_sequences(rows)):
        if _PLAIN.get(type(r)) or _plain_chain(type(r)):
            p = seq
            t = p[r.target_len :]
        else:
            p = r._prepare_verification(None)
            t = r._verification_tokens(p)
        plans.append(p)
        tokens.append(t)
    return plans, tokens


def _write_rows(rows: Sequence[SpeculativeDecoder], counts: Sequence[int], store_rows: list[int], pos: list[int],
                vals: list[int]) -> None:
    """Write ``vals`` (token ids) at (``store_rows``, ``pos``) of the rows' token stores (row i's ``counts[i]`` entries
    in order): one indexed write when the rows share a store (a batch, or one sequence), copied to the device without
    waiting for it (a synchronous copy would sync a CUDA stream); else each row its own. A store's host mirror
    (:func:`host_mirror`) gets the same values from the host lists (no device read)."""
    if not vals:
        return
    store, host = rows[0]._store, rows[0]._store_host
    if len(vals) == 1:  # one token (a drafted token, a first token): a scalar write, no index tensor
        r = rows[[k > 0 for k in counts].index(True)]
        r._store[store_rows[0], pos[0]] = vals[0]
        if r._store_host is not None:
            r._store_host[store_rows[0], pos[0]] = vals[0]
        return
    idx = torch.tensor([store_rows, pos, vals], dtype=torch.long).to(store.device, non_blocking=True)
    shared = True
    for r in rows:
        shared = shared and r._store is store
    if shared:
        store[idx[0], idx[1]] = idx[2]
        if host is not None:
            host[store_rows, pos] = vals
        return
    a = 0
    for r, k in zip(rows, counts):
        r._store[r._store_row, idx[1, a : a + k]] = idx[2, a : a + k]
        if r._store_host is not None:
            r._store_host[r._store_row, pos[a : a + k]] = vals[a : a + k]
        a += k


def host_mirror(store: torch.Tensor) -> np.ndarray | None:
    """The host mirror a token store (int64 (R, L)) needs: None on a CPU (the store's own memory is read, through
    ``numpy()``), else a new int64 (R, L) numpy array, which every write to the store (the prompt at
    :meth:`SpeculativeDecoder.start`, :func:`_write_rows`) also writes, from the host values it writes."""
    return None if store.device.type == "cpu" else np.zeros(tuple(store.shape), dtype=np.int64)


def _tell_drafters(rows: Sequence[SpeculativeDecoder], hook: str, *per_row: Sequence) -> None:
    """Call the drafters' class hook ``hook`` (``"observe_rows"``, ``"rollback_rows"``: :class:`~learn2draft.
    drafters.Drafter`) once per drafter class over ``rows``, with that class's rows' entries of each ``per_row``
    (:func:`learn2draft.control.per_class`)."""
    if len(rows) == 1:  # a sequence decoded alone
        getattr(type(rows[0].drafter), hook)([rows[0].drafter], *per_row)
        return
    per_class([r.drafter for r in rows], hook, *per_row)


def draft_sequences(rows: Sequence[SpeculativeDecoder]) -> list[torch.Tensor]:
    """Each row's committed tokens and this cycle's drafted chain, int64 (L_i + generated_i + γ_i,): views of the
    rows' token buffers (no copy), in one call for a batch's rows (:meth:`SpeculativeDecoder._seq` of each)."""
    return [r._buf[: r._n + len(r.drafted)] for r in rows]


def depth_limits(rows: Sequence[SpeculativeDecoder]) -> list[int]:
    """The most tokens each row's current cycle may draft (:attr:`SpeculativeDecoder.depth_limit`), in one call for a
    batch's rows: its ``max_depth`` capped so that τ + 1 ≤ its tokens left (``max_new_tokens`` − generated − 1,
    generated = committed length − prompt length), never below 0. It reads the rows' fields, not a subclass's own
    ``depth_limit`` property."""
    return [max(0, min(r.max_depth, r.max_new_tokens - (r._n - r.prompt_len) - 1)) for r in rows]


def begin_cycles(rows: Sequence[SpeculativeDecoder]) -> None:
    """Forget, for each of ``rows``, the drafted tokens of the cycle that ended (the committed state stays): the
    drafted tokens, their q (float32 (V,) or None), confidences, entropies, top-2 margins
    (:class:`~learn2draft.drafters.base.DraftProposal`), a hybrid's source of each, and the cycle's seconds. One call
    for a batch's chain rows (:func:`finish_rows`); :meth:`SpeculativeDecoder._begin_cycle` is one row's. It resets
    the fields and does not call a subclass's own ``_begin_cycle``: :func:`finish_rows` calls that per row instead."""
    for r in rows:
        r.drafted = []
        r.draft_probs = []
        r.confidences = []
        r.entropies = []
        r.margins = []
        r.drafted_sources = []
        r._cycle_draft = r._cycle_verify = r._cycle_other = 0.0


def draft_rows(rows: Sequence[SpeculativeDecoder], proposals: Sequence[Sequence[Any]]) -> None:
    """Record drafted tokens (the one copy of a drafted token's bookkeeping): row i's ``proposals[i]``
    (:class:`~learn2draft.drafters.base.DraftProposal`, in drafting order) after the tokens it drafted this cycle —
    their tokens written to the token stores at once (:func:`_write_rows`), their q (float32 (V,) or None for a point
    mass), confidence, entropy and margin kept, and the rows' drafters told, one call per drafter class
    (:meth:`~learn2draft.drafters.Drafter.observe_rows`). :meth:`SpeculativeDecoder.draft_step` records its one
    proposal here; a batch records prompt lookup's chains here
    (:meth:`learn2draft.batched.BatchedSpeculativeDecoder._draft_chains`). A hybrid's source is recorded by the caller.

    Args:
        rows: started, unfinished decoders (B ≥ 0).
        proposals: one sequence of proposals per row (possibly empty).

    Raises:
        ValueError: not one sequence of proposals per row, or a row would draft beyond its depth limit.
    """
    if len(proposals) != len(rows):
        raise ValueError(f"draft_rows needs one sequence of proposals per row ({len(rows)} rows, {len(proposals)}).")
    counts, store_rows, pos, vals, firsts, told = [], [], [], [], [], []
    for r, props in zip(rows, proposals):
        n0 = r._n + len(r.drafted)
        if len(r.drafted) + len(props) > r.max_depth or n0 + len(props) >= r.prompt_len + r.max_new_tokens:
            raise ValueError(f"draft_rows: {len(props)} more drafted tokens exceed the row's depth limit.")
        toks = []
        for prop in props:
            toks.append(prop.token)
            r.draft_probs.append(prop.probs)
            r.confidences.append(prop.confidence)
            r.entropies.append(prop.entropy)
            r.margins.append(float(prop.margin))
        r.drafted += toks
        counts.append(len(toks))
        firsts.append(n0)
        told.append(toks)
        store_rows += [r._store_row] * len(toks)
        pos += range(n0, n0 + len(toks))
        vals += toks
    _write_rows(rows, counts, store_rows, pos, vals)
    if rows:
        _tell_drafters(rows, "observe_rows", told, firsts)


def draft_prepared(rows: Sequence[SpeculativeDecoder], prepared: Sequence[Any]) -> list[Any]:
    """Draft one token in each of ``rows`` from what one batched drafter forward prepared for it (``prepared[i]``:
    row i's entry of :meth:`~learn2draft.drafters.Drafter.prepare_batch`): the drafters draw, one
    :meth:`~learn2draft.drafters.Drafter.finish_rows` call per drafter class when the rows share one
    :class:`~learn2draft.sampling.SamplingConfig` object (a batch's; else one
    :meth:`~learn2draft.drafters.Drafter.finish` per row), each row from its own generator (the
    draws it makes alone); a hybrid's source is recorded, the tokens in one :func:`draft_rows` call, and the call's
    seconds split equally over the rows' draft seconds (:func:`charge_draft`). The rows must be able to draft
    (``can_draft()``: the controller decided before the forward's draw; unchecked here,
    :meth:`SpeculativeDecoder.draft_step` checks one row).

    Returns:
        the rows' :class:`~learn2draft.drafters.base.DraftProposal`, in order.

    Raises:
        ValueError: not one prepared entry per row; NaN or infinite draft logits.
    """
    if len(prepared) != len(rows):
        raise ValueError(f"draft_prepared needs one prepared entry per row ({len(rows)} rows, {len(prepared)}).")
    if not rows:
        return []
    clock = rows[0].clock
    t0 = clock.now()
    seqs = draft_sequences(rows)
    sampling = rows[0].sampling
    if all([r.sampling is sampling for r in rows]):
        props = per_class([r.drafter for r in rows], "finish_rows", prepared, seqs, [r.generator for r in rows],
                          shared=(sampling,))
    else:
        props = [r.drafter.finish(p, s, r.sampling, r.generator) for r, p, s in zip(rows, prepared, seqs)]
    for r in rows:
        if r._hybrid:
            r.drafted_sources.append(r.drafter.last_source)
    draft_rows(rows, [[p] for p in props])
    charge_draft(rows, clock.now() - t0)
    return props


def charge_draft(rows: Sequence[SpeculativeDecoder], seconds: float) -> None:
    """Split ``seconds`` (a batched drafter forward or draw, a search over the rows, a chain record) equally over
    ``rows``' draft seconds this cycle."""
    share = seconds / max(len(rows), 1)
    for r in rows:
        r._cycle_draft += share


def commit_rows(rows: Sequence[SpeculativeDecoder], tokens: Sequence[list[int]]) -> list[list[int]]:
    """Append ``tokens[i]`` (host ints) to row i's committed sequence, cut at its first EOS and at its
    ``max_new_tokens``, and set each row's ``finished``; the rows that share a token store (a batch's rows, or one
    sequence) get theirs in one indexed write (:func:`_write_rows`).

    Args:
        rows: the decoders (B ≥ 0), started and not finished.
        tokens: per row, the tokens to commit (τ_i accepted drafts and the next token, or a first token).

    Returns:
        per row, the tokens it actually committed.

    Raises:
        ValueError: not one list of tokens per row.
        RuntimeError: a row not started, or finished.
    """
    if len(tokens) != len(rows):
        raise ValueError(f"commit_rows needs one list of tokens per row ({len(rows)} rows, {len(tokens)} lists).")
    out, counts, store_rows, pos, vals = [], [], [], [], []
    for r, toks in zip(rows, tokens):
        if not r._started or r.finished:
            r._check_running()
        emitted = toks[: r.max_new_tokens - (r._n - r.prompt_len)]
        eos, ended = r.pair.eos_token_ids, False
        for i, t in enumerate(emitted):
            if t in eos:
                emitted, ended = emitted[: i + 1], True
                break
        n, k = r._n, len(emitted)
        counts.append(k)
        store_rows += [r._store_row] * k
        pos += range(n, n + k)
        vals += emitted
        r._n = n + k
        r.finished = ended or r._n - r.prompt_len >= r.max_new_tokens
        out.append(emitted)
    _write_rows(rows, counts, store_rows, pos, vals)
    return out


def rollback_rows(rows: Sequence[SpeculativeDecoder], plans: Sequence[Any], before: Sequence[int],
                  accepted: Sequence[int]) -> None:
    """Roll each row's target cache back to its committed prefix ``before[i]`` + its ``accepted[i]`` accepted drafts,
    and its drafter back to them. Chains in rows of one :class:`~learn2draft.batch_cache.BatchCache` (a batch, or a
    sequence alone on a target the ragged forward runs) set their lengths at once
    (:meth:`~learn2draft.batch_cache.BatchCache.set_lengths`: rejected drafts' positions, and a padded verification's
    padding, are never attended to again); another cache (a ``DynamicCache``, a tree's) or a class with its own
    ``_rollback`` rolls back row by row (:meth:`SpeculativeDecoder._rollback`).

    Args:
        rows: the decoders (B ≥ 1), after their verification forward; plans: their verification plans;
        before: each row's committed length before this cycle's commit; accepted: each row's τ.

    Raises:
        ValueError: no row, or mismatched lengths.
    """
    if not rows or not len(rows) == len(plans) == len(before) == len(accepted):
        raise ValueError(f"rollback_rows needs B ≥ 1 rows and one plan, length and τ per row ({len(rows)} rows).")
    cache = rows[0].target_cache
    together = isinstance(cache, BatchCache)
    for r in rows:
        together = together and (_PLAIN.get(type(r)) or _plain_chain(type(r))) and r.target_cache is cache
    if not together:
        for r, plan, b, a in zip(rows, plans, before, accepted):
            r._rollback(plan, b, a)
        return
    valid = [b + a for b, a in zip(before, accepted)]  # the same tokens in the drafted and the committed sequence
    lengths = []
    for r, v in zip(rows, valid):
        r.target_len = min(r.target_len, v)
        lengths.append(r.target_len)
    cache.set_lengths([r.cache_row for r in rows], lengths)
    _tell_drafters(rows, "rollback_rows", valid)


def finish_rows(rows: Sequence[SpeculativeDecoder], plans: Sequence[Any], decided: Sequence[tuple[list[int], int]],
                t0: float, t1: float, t2: float, logits: torch.Tensor | None = None,
                starts: Sequence[int] | None = None, features: bool = False) -> list[CycleResult]:
    """THE verification tail, for B ≥ 1 rows verified by one target forward (a sequence decoded alone is a batch of
    one): record that each chain's target has seen its chain and where each row's next token was drawn, commit every
    row's accepted drafts and next token (:func:`commit_rows`), roll the target's cache and the drafters back
    (:func:`rollback_rows`), feed each drafter its committed tokens, time, and build each row's
    :class:`~learn2draft.metrics.CycleResult`. A class that overrides the chain's hooks (:data:`_CHAIN_HOOKS`; a
    tree) has its own called per row.

    Args:
        rows: the decoders, each with its cycle drafted and verified.
        plans: each row's verification plan (:func:`chain_verification`, :meth:`SpeculativeDecoder._prepare_verification`).
        decided: per row, the sampler's result: the accepted drafted tokens and the next (corrected or bonus) token.
        t0, t1, t2: clock readings (seconds) before preparing the verification, before its forward and after it.
        logits, starts: chains fed in one packed forward (a batch): the raw target logits float (Σ (γ_i + 1), V) and
            where row i's γ_i + 1 rows start. None: each row kept its own
            (:meth:`SpeculativeDecoder._observe_verification`; a tree keeps none: no target statistics).
        features: put the next decision's observation in each result (the environments read it; a batch's
            controllers build their own when they decide).

    Returns:
        the rows' results, in order. τ counts only drafted tokens actually emitted (none after an EOS).

    Raises:
        ValueError: no row, or not one plan and one result per row.
    """
    if not rows or not len(rows) == len(plans) == len(decided):
        raise ValueError(f"finish_rows needs B ≥ 1 rows and one plan and one sampler result per row ({len(rows)} rows, "
                         f"{len(plans)} plans, {len(decided)} results).")
    clock = rows[0].clock
    t3 = clock.now()
    before = [r._n for r in rows]
    accepted = [len(a) for a, _ in decided]
    plain = [(_PLAIN.get(type(r)) or _plain_chain(type(r))) for r in rows]
    for i, (r, a) in enumerate(zip(rows, accepted)):
        if plain[i] or r.shape == "chain":  # the target has seen the last committed token and the chain
            r.target_len = r._n + len(r.drafted)
        if logits is not None:  # the corrected or bonus token was drawn at the row's τ-th position
            r._target_row = (logits, starts[i] + a)
        else:
            at = r._verify_logits
            r._target_row, r._verify_logits = (None if at is None else (at, a)), None
    emitted = commit_rows(rows, [list(a) + [n] for a, n in decided])
    rollback_rows(rows, plans, before, accepted)
    _tell_drafters(rows, "observe_rows", emitted, before)
    t4 = clock.now()
    out = []
    for r, plan, e, a, chain in zip(rows, plans, emitted, accepted, plain):
        tau = min(a, len(e))
        depth = len(r.drafted) if chain else r.depth
        verified = depth if chain else r._verified_count(plan)
        neural = r.drafted_sources.count(NEURAL_SOURCE)
        r.accepted_history.append(tau)
        r.last_accept_fraction = tau / depth if depth else 1.0
        draft_s, other_s = r._cycle_draft, r._cycle_other
        timing = {"draft": draft_s, "select_mask": t1 - t0, "forward": t2 - t1, "sample": t3 - t2,
                  "gather": t4 - t3}
        own_reset = not chain or type(r)._begin_cycle is not SpeculativeDecoder._begin_cycle  # a tree, a subclass
        if features or own_reset:  # the next observation reads the new cycle; a class's own reset is called
            r._begin_cycle()
        feats = r.features() if features else None
        other_s += (t1 - t0) + (t4 - t2) + (r.clock.now() - t4)
        timing["cycle"] = draft_s + (t2 - t1) + other_s
        if chain:
            r.last_timing = timing
        else:
            r._record_timing(timing)
        out.append(CycleResult(e, depth, verified, tau, draft_s, t2 - t1, other_s, r.finished, feats, neural))
    if not features:  # the other chain rows' next cycles, in one call
        begin_cycles([r for r, chain in zip(rows, plain)
                      if chain and type(r)._begin_cycle is SpeculativeDecoder._begin_cycle])
    return out


__all__ = ["DraftController", "FixedDepthController", "SpeculativeDecoder", "begin_cycles", "chain_verification",
           "charge_draft", "commit_rows", "depth_limits", "draft_prepared", "draft_rows", "draft_sequences", "finish_rows", "rollback_rows"]
