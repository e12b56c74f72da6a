"""What decides a cycle: the controller protocol, the fixed controllers and the two actions.

A :class:`DraftController` is asked two things by the one cycle of
:class:`learn2draft.decoding.SpeculativeDecoder` (chain and tree alike):

1. before each draft step, :meth:`DraftController.decide` on the typed
   :class:`learn2draft.state.DraftState` of :meth:`SpeculativeDecoder.state` — :data:`CONTINUE` (draft
   one more token, or one more tree level) or :data:`STOP` (verify now). A hand rule reads the state's
   integers and floats (``state.depth``, ``state.confidences``, ``state.drafter_features``); a learned
   policy reads the float32 observation :meth:`DraftState.features` builds (the one feature builder,
   which an exported ONNX graph takes). The decision precedes the draw, which keeps the output law
   exact (Leviathan et al. 2023; for deterministic tree candidates, the recursive accept-or-remove
   rule);
2. for a draft tree only, and only when the controller overrides it,
   :meth:`DraftController.verification_size` on :meth:`SpeculativeDecoder.size_features`: how many
   tree nodes V to send to the target (Learning to Draft, arXiv 2603.01639). A chain verifies every
   drafted token.

The gymnasium environments (:mod:`envs`) use the same two actions (``Discrete(2)``: 0 = STOP,
1 = CONTINUE), and every learned controller in :mod:`policies` implements this protocol.
"""

from __future__ import annotations

import numbers
import warnings
from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import numpy as np

from learn2draft.names import DECODER_MAX_DEPTH

if TYPE_CHECKING:
    from learn2draft.state import DraftState, LoadState

#: Verify the tokens drafted so far (at depth 0: a plain autoregressive target step).
STOP = 0
#: Draft one more token (a chain) or one more tree level (a tree).
CONTINUE = 1
ACTION_MEANINGS = {STOP: "STOP (verify now)", CONTINUE: "CONTINUE (draft one more token)"}
#: A hybrid drafter (:class:`learn2draft.drafters.hybrid.HybridDrafter`): draft the next token with prompt lookup
#: (equal to :data:`CONTINUE`, so a chain controller's CONTINUE drafts lookup-first) …
CONTINUE_LOOKUP = CONTINUE
#: … or with the neural drafter (the draft model or the head). On a single drafter it means CONTINUE.
CONTINUE_NEURAL = 2
HYBRID_ACTION_MEANINGS = {STOP: "STOP (verify now)", CONTINUE_LOOKUP: "CONTINUE with prompt lookup",
                          CONTINUE_NEURAL: "CONTINUE with the neural drafter (model or head)"}


def as_action(value: Any, n_actions: int = 3) -> int:
    """One action from what a controller or policy returned (a Python or numpy scalar, a 0-d or 1-element array):
    False/0 → :data:`STOP`, True/1 → :data:`CONTINUE` (:data:`CONTINUE_LOOKUP` on a hybrid drafter), and with
    ``n_actions=3`` 2 → :data:`CONTINUE_NEURAL`.

    Raises:
        ValueError: not one value, or not an action below ``n_actions``.
    """
    arr = np.asarray(value)
    if arr.size != 1:
        raise ValueError(f"A policy must return one action (0 = STOP, 1 = CONTINUE), got shape {arr.shape}.")
    v = arr.reshape(()).item()
    if v not in range(n_actions):
        valid = ("STOP (0 / False), CONTINUE (1 / True) or, for a hybrid drafter, CONTINUE_NEURAL (2)" if n_actions == 3
                 else "0 = STOP and 1 = CONTINUE")
        raise ValueError(f"Invalid action {v!r}: valid actions are {valid}.")
    return int(v)


class DraftController(ABC):
    """Decides, before each draft step, whether to draft one more token (and, for a tree, V).

    Attributes:
        max_depth: the most tokens (tree levels) this controller lets a cycle draft.
        depth_feature_scale: the ``max_depth`` the controller reads its depth features on (the
            ``depth`` and ``accepted_len_*`` features are divided by the decoder's ``max_depth``),
            or None when it reads no scaled feature (fixed and rule controllers). A trained policy
            sets it to the ``max_depth`` it was trained with, and a decoder or replay env with
            another ``max_depth`` refuses it (:func:`check_depth_feature_scale`).

    Subclasses implement :meth:`decide`. Implementations: :class:`FixedDepthController` (fixed γ),
    :class:`FixedTreeController` (fixed (depth, V)), the rules, PPO policies and ONNX exports of :mod:`policies`.
    """

    max_depth: int = DECODER_MAX_DEPTH
    depth_feature_scale: int | None = None
    #: The precision (``"float32"``, ``"bfloat16"``, …) the controller's policy was trained in, or None (fixed
    #: and rule controllers). A policy rewarded by measured tokens/s learned that precision's costs — in bf16 on
    #: an AMX CPU verifying 8 tokens costs 1.13× one, in fp32 2.00× — so a decoder run in another precision warns
    #: (:func:`precision_mismatch`).
    trained_dtype: str | None = None

    #: Whether :meth:`observe_load` reads the load: the batched decoder builds the step's
    #: :class:`learn2draft.state.LoadState` (a lookahead per row) only when a row's controller sets this, or a
    #: verification budget runs.
    reads_load: bool = False

    @property
    def step_depth(self) -> int:
        """The most tokens this controller lets the current cycle draft: :attr:`max_depth`, or, for a per-step
        controller (a per-batch-size table, a load-aware step policy), the step's γ read in :meth:`observe_load`.
        The depth rule (:func:`keeps_drafting`) stops there without building the state or asking :meth:`decide`
        (at γ = 0, a step of plain decoding costs what one without a controller does)."""
        return self.max_depth

    def reset(self) -> None:  # noqa: B027 (optional hook, a no-op by default)
        """Called at the start of each generation."""

    def observe_load(self, load: LoadState) -> None:  # noqa: B027 (optional hook, a no-op by default)
        """Called by the batched decoder before each step's drafting with the step's
        :class:`learn2draft.state.LoadState` (rows, contexts, the previous step's measured tokens and seconds), when
        :attr:`reads_load` is set: a per-batch-size table or a load-aware step policy picks the step's γ here."""

    def __init_subclass__(cls, **kwargs: Any) -> None:
        """Refuse, where it is defined, a controller written for the protocol's former method: one that defines
        ``continue_drafting(features)`` but no :meth:`decide`.

        Raises:
            TypeError: naming the class and what to write instead.
        """
        super().__init_subclass__(**kwargs)
        if "continue_drafting" in cls.__dict__ and getattr(cls.decide, "__isabstractmethod__", False):
            raise TypeError(f"{cls.__name__} defines continue_drafting(features), which controllers no longer have: "
                            "implement decide(self, state) instead (state is a learn2draft.state.DraftState; "
                            "state.features() is the float32 vector continue_drafting took, state.depth the depth).")

    @abstractmethod
    def decide(self, state: DraftState) -> int | bool:
        """The depth decision before the next draft step, from ``state`` (a :class:`learn2draft.state.DraftState`:
        the decoder's, or a replay environment's for the same position). A rule reads its fields (``state.depth``
        is the integer depth); a learned policy reads ``state.features()``, float32 (len(FEATURE_NAMES) + k,) (a
        hybrid drafter's k = len(HYBRID_FEATURE_NAMES) features after :data:`learn2draft.features.FEATURE_NAMES`).

        Returns:
            STOP (False / 0) or CONTINUE (True / 1); a hybrid controller may return :data:`CONTINUE_NEURAL` (2)
            (checked by :func:`as_action`, which raises ValueError on anything else)."""

    def verification_size(self, features: np.ndarray, depth: int) -> int:
        """Tree nodes V to verify, from float32 (len(SIZE_FEATURE_NAMES),) size features and the
        tree's depth. Only tree controllers override it (see :func:`decides_verification_size`);
        this default — every drafted token — is what a chain does."""
        return depth


def check_depth_feature_scale(controller: Any, max_depth: int, holder: str = "this decoder",
                              rebuild: str = "the decoder") -> None:
    """Refuse a controller that reads the ``depth`` feature on another scale than ``max_depth``.

    Args:
        controller: a :class:`DraftController`; its ``depth_feature_scale`` (None: no particular scale, never
            refused) is the ``max_depth`` its depth feature is divided by.
        max_depth: the ``max_depth`` of what builds the features (a decoder, a replay environment).
        holder, rebuild: how the message names that (``"this decoder"``) and what to rebuild (``"the decoder"``).

    Raises:
        ValueError: the scales differ (the message says which ``max_depth`` to build with).
    """
    scale = getattr(controller, "depth_feature_scale", None)  # any controller-like object (a test's fake) may come
    if scale is not None and scale != max_depth:
        raise ValueError(f"{controller!r} reads depth features scaled by max_depth={scale}, but {holder} has "
                         f"max_depth={max_depth}: build {rebuild} with max_depth={scale}.")


class PrecisionMismatchWarning(UserWarning):
    """A learned policy runs in another precision than it was trained in: its decisions fit other costs."""


def precision_mismatch(controller: Any, dtype: str) -> str | None:
    """The warning text when ``controller`` was trained in another precision than ``dtype`` (a canonical name:
    ``"float32"``, ``"bfloat16"``, ``"float16"``), else None."""
    trained = getattr(controller, "trained_dtype", None)
    if trained is None or str(trained) == str(dtype):
        return None
    return (f"{controller!r} was trained in {trained} and now runs in {dtype}: its depth decisions were learned for "
            f"{trained} costs (verification is much cheaper relative to one token in bfloat16 on AMX CPUs and GPUs). "
            f"Run it with --dtype {trained}, or use a policy trained in {dtype} (python -m train --dtype {dtype}, or "
            "--replay with traces and a latency profile measured in it).")


def warn_precision_mismatch(controller: Any, dtype: Any, stacklevel: int = 3) -> None:
    """Warn (:class:`PrecisionMismatchWarning`) when ``controller`` was trained in another precision than ``dtype``
    (a ``torch.dtype`` or its name), once per policy and precision.

    The per-row controllers of a step policy (:class:`policies.controllers.LoadAwarePolicy`, and those of a
    :class:`policies.rules.SpeculationGuard`, whose ``step_policy`` is the policy it guards) name it as their
    ``step_policy``; the chain is followed to the policy that was trained, which the message names and the warning
    is counted on, so a stream of requests warns once, not once per request, and a guarded policy run beside itself
    once. Called by :meth:`learn2draft.decoding.SpeculativeDecoder.generate` and by the batched decoder's ``add`` and
    ``add_many``."""
    owner = controller
    for _ in range(8):  # a row → its guard → the guarded policy
        up = getattr(owner, "step_policy", None)
        if up is None or up is owner:
            break
        owner = up
    name = str(dtype).replace("torch.", "")
    mismatch = precision_mismatch(owner, name)
    warned = getattr(owner, "_precision_warned", None)
    if not mismatch or (isinstance(warned, set) and name in warned):
        return
    warnings.warn(mismatch, PrecisionMismatchWarning, stacklevel=stacklevel)
    try:
        owner._precision_warned = (warned if isinstance(warned, set) else set()) | {name}
    except AttributeError:  # an object that takes no attributes warns each time rather than never
        pass


class FixedDepthController(DraftController):
    """Always draft γ = ``num_draft_tokens`` tokens (γ = 0 is autoregressive decoding: no speculation).

    The one fixed-γ class, for the real loop and the replay alike: a :class:`DraftController` of the decoders (the
    cycle stops at ``max_depth`` = γ, or earlier where the drafter has no proposal), and, called as
    ``controller(load, rows)``, a policy of the request-stream replay (:data:`learn2draft.replay.serve.Policy`) that
    gives every running row γ (the simulator caps each row at what it can draft).

    Raises:
        ValueError: ``num_draft_tokens`` is not an integer ≥ 0 (a Python or numpy integer, not a bool).
    """

    def __init__(self, num_draft_tokens: int):
        if isinstance(num_draft_tokens, bool) or not isinstance(num_draft_tokens, numbers.Integral) \
                or num_draft_tokens < 0:
            raise ValueError(f"num_draft_tokens must be an integer ≥ 0, got {num_draft_tokens!r}.")
        self.num_draft_tokens = self.max_depth = int(num_draft_tokens)

    def decide(self, state: DraftState) -> bool:
        return True  # the decoder stops at max_depth

    def __call__(self, load: Any, rows: Any) -> np.ndarray:
        """The replay simulator's face (:data:`learn2draft.replay.serve.Policy`): γ for each of the ``load.running``
        rows (a :class:`learn2draft.replay.serve.LoadFeatures`; ``rows`` is not read); int64 (B,)."""
        return np.full(int(load.running), self.num_draft_tokens, dtype=np.int64)

    def __repr__(self) -> str:
        return f"FixedDepthController(num_draft_tokens={self.num_draft_tokens})"


class FixedTreeController(DraftController):
    """Draft ``depth`` tree levels and verify the best ``verify_size`` nodes: a fixed (depth, V).

    Raises:
        ValueError: ``depth`` < 0 or ``verify_size`` < 0.
    """

    def __init__(self, depth: int, verify_size: int):
        for name, v in (("depth", depth), ("verify_size", verify_size)):
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise ValueError(f"{name} must be an integer ≥ 0, got {v!r}.")
        self.max_depth, self.verify_size = int(depth), int(verify_size)

    def decide(self, state: DraftState) -> bool:
        return True  # the decoder stops at max_depth

    def verification_size(self, features: np.ndarray, depth: int) -> int:
        return self.verify_size

    def __repr__(self) -> str:
        return f"FixedTreeController(depth={self.max_depth}, verify_size={self.verify_size})"


def keeps_drafting(controller: DraftController, depth: int, can_draft: Callable[[], bool], decide: Callable[[], bool],
                   min_depth: int = 0) -> bool:
    """The one depth rule of a cycle, on the real loop and in replay: draft one more step when the depth is
    below the controller's :attr:`~DraftController.step_depth` (its ``max_depth``, or a step policy's γ), a draft is
    possible (``can_draft()``: below the decoder's depth limit, and the drafter has a proposal) and the controller
    says CONTINUE (``decide()``, asked only then); the first ``min_depth`` steps are drafted without asking (a size
    decision needs a tree)."""
    cap = getattr(controller, "step_depth", controller.max_depth)  # a controller-like object without DraftController
    return depth < max(cap, min_depth) and can_draft() and (depth < min_depth or decide())


def decides_verification_size(controller: DraftController) -> bool:
    """Whether ``controller`` overrides :meth:`DraftController.verification_size` (a size policy, a
    :class:`FixedTreeController`); a chain controller (fixed γ, a depth policy) does not."""
    return type(controller).verification_size is not DraftController.verification_size


#: ``(size_features float32 (len(SIZE_FEATURE_NAMES),), depth) -> V``: what the cycle asks for a tree's V.
SizeDecider = Callable[[np.ndarray, int], int]


def size_decider(size: int | DraftController | Callable[[np.ndarray], Any] | None) -> SizeDecider | None:
    """Turn a size controller into a :data:`SizeDecider`.

    Args:
        size: an int V ≥ 0 (fixed), a :class:`DraftController` that overrides ``verification_size``
            (:class:`FixedTreeController`, a trained tree policy), a callable ``size_features -> V``,
            or None (the decoder's own ``verify_size``: every drafted node by default).

    Raises:
        ValueError: a negative or non-integer V, or a controller that makes no size decision.
    """
    if size is None:
        return None
    if isinstance(size, (int, np.integer)) and not isinstance(size, bool):
        if size < 0:
            raise ValueError(f"A fixed verification size must be ≥ 0, got {size}.")
        v = int(size)
        return lambda feats, depth: v
    if isinstance(size, DraftController):
        if not decides_verification_size(size):
            raise ValueError(f"{size!r} makes no verification-size decision (it does not override "
                             "verification_size): pass a FixedTreeController, a TreePolicyController, an int V or a "
                             "callable.")
        return size.verification_size
    if callable(size):
        return lambda feats, depth: size(feats)
    raise ValueError(f"size must be an int V, a size-deciding DraftController or a callable features -> V, "
                     f"got {size!r}.")


def as_size(value: Any) -> int:
    """One verification size V from what a size decider returned (a Python or numpy scalar).

    Raises:
        ValueError: not one integer ≥ 0.
    """
    arr = np.asarray(value)
    if arr.size != 1 or not np.issubdtype(arr.dtype, np.number):
        raise ValueError(f"A size controller must return one integer V ≥ 0, got {value!r}.")
    v = arr.reshape(()).item()
    if v != int(v) or v < 0:
        raise ValueError(f"A size controller must return an integer V ≥ 0, got {v!r}.")
    return int(v)


__all__ = [
    "ACTION_MEANINGS", "CONTINUE", "CONTINUE_LOOKUP", "CONTINUE_NEURAL", "HYBRID_ACTION_MEANINGS", "STOP", "as_action", "DraftController", "PrecisionMismatchWarning", "precision_mismatch", "warn_precision_mismatch", "FixedDepthController", "FixedTreeController",
    "SizeDecider", "as_size", "check_depth_feature_scale", "decides_verification_size", "keeps_drafting",
    "size_decider",
]
