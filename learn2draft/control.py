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
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from learn2draft.metrics import CycleResult, GenerationResult
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

    #: Whether :meth:`decide` reads its state. False: the controller says CONTINUE at every depth below its
    #: :attr:`step_depth` (a fixed γ, a per-step γ), where the depth rule stops anyway, so the decoder neither builds
    #: the :class:`~learn2draft.state.DraftState` nor asks (its CONTINUE drafts with a hybrid's lookup). A subclass
    #: whose :meth:`decide` comes from nearer in its MRO than this flag (its own, a mixin's) reads it again unless it
    #: sets this itself, and so does an instance given a ``decide`` of its own (:func:`asks`).
    reads_state: bool = True

    @property
    def step_depth(self) -> int:
        """The most tokens this controller lets the current cycle draft: :attr:`max_depth`, or, for a per-step
        controller (a per-batch-size table, a load-aware step policy), the step's γ read in :meth:`observe_load`.
        The depth rule (:func:`keeps_drafting`) stops there without building the state or asking :meth:`decide`
        (at γ = 0, a step of plain decoding costs what one without a controller does)."""
        return self.max_depth

    @classmethod
    def step_depths(cls, controllers: Sequence[DraftController]) -> list[int]:
        """The :attr:`step_depth` of each of ``controllers`` (all of this class), in one call for a batch's rows
        (:func:`step_caps`): their ``max_depth`` when the class keeps this class's :attr:`step_depth`, else each
        row's own. A class with a step depth of its own overrides this to read its rows together."""
        if cls.step_depth is DraftController.step_depth:
            return [c.max_depth for c in controllers]
        return [c.step_depth for c in controllers]

    def reset(self) -> None:  # noqa: B027 (optional hook, a no-op by default)
        """Called at the start of each generation."""

    def observe_load(self, load: LoadState) -> None:  # noqa: B027 (optional hook, a no-op by default)
        """Called by the batched decoder before each step's drafting with the step's
        :class:`learn2draft.state.LoadState` (rows, contexts, the previous step's measured tokens and seconds), when
        :attr:`reads_load` is set: a per-batch-size table or a load-aware step policy picks the step's γ here."""

    @classmethod
    def observe_loads(cls, controllers: Sequence[DraftController], load: LoadState) -> None:
        """:meth:`observe_load` of each of ``controllers`` (all of this class; one call for a step's rows:
        :func:`observe_loads`). A class whose rows share one decision overrides this to decide once."""
        for c in controllers:
            c.observe_load(load)

    def __init_subclass__(cls, **kwargs: Any) -> None:
        """Refuse, where it is defined, a controller written for the protocol's former method: one that defines
        ``continue_drafting(features)`` but no :meth:`decide`.

        Raises:
            TypeError: naming the class and what to write instead.
        """
        super().__init_subclass__(**kwargs)
        mro = cls.__mro__
        decides = next(i for i, k in enumerate(mro) if "decide" in k.__dict__)
        if decides < next(i for i, k in enumerate(mro) if "reads_state" in k.__dict__):
            cls.reads_state = True  # a decision nearer than the flag (its own, a mixin's): asked, whatever it extends
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

    reads_state = False  # CONTINUE below max_depth: the depth rule stops there

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

    reads_state = False  # CONTINUE below max_depth: the depth rule stops there

    def decide(self, state: DraftState) -> bool:
        return True  # the decoder stops at max_depth

    def verification_size(self, features: np.ndarray, depth: int) -> int:
        return self.verify_size

    def __repr__(self) -> str:
        return f"FixedTreeController(depth={self.max_depth}, verify_size={self.verify_size})"


def step_cap(controller: DraftController) -> int:
    """The most tokens ``controller`` lets the current cycle draft: its :attr:`~DraftController.step_depth`, or the
    ``max_depth`` of a controller-like object without one."""
    return getattr(controller, "step_depth", controller.max_depth)


def asks(controller: Any) -> bool:
    """Whether the cycle asks ``controller`` (builds the state and calls ``decide``): :func:`asks_rows` of one."""
    return asks_rows([controller])[0]


def asks_rows(controllers: Sequence[Any]) -> list[bool]:
    """Whether the cycle asks each of ``controllers`` (builds the state and calls ``decide``), in one call for a batch:
    unless its ``reads_state`` is False (a controller-like object without one is asked) and no ``decide`` was set on
    the instance itself."""
    return [getattr(c, "reads_state", True) or "decide" in getattr(c, "__dict__", ()) for c in controllers]


def per_class(objects: Sequence[Any], hook: str, *per_row: Sequence[Any], shared: tuple = (),
              default: Callable[..., Any] | None = None) -> list[Any] | None:
    """Call the class hook ``hook`` (a classmethod over a list of instances of its class, e.g.
    :meth:`DraftController.step_depths`, :meth:`learn2draft.drafters.Drafter.observe_rows`) once per class of
    ``objects``, with that class's objects, their entries of each ``per_row`` sequence and then the ``shared``
    arguments, so that a batch's rows cost one call per class, not one per row. A class without the hook (a
    controller-like object) gets ``default`` called the same way.

    Returns:
        the hooks' answers, one per object in the order of ``objects`` (None where a hook answered None), or None
        when every hook answered None or ``objects`` is empty.

    Raises:
        AttributeError: a class without the hook and no ``default``.
    """
    if not objects:
        return None
    kinds = {type(o) for o in objects}
    if len(kinds) == 1:
        kind = kinds.pop()
        fn = getattr(kind, hook, None) if default is not None else getattr(kind, hook)
        return (fn or default)(objects, *per_row, *shared)
    out: list[Any] = [None] * len(objects)
    answered = False
    for kind in kinds:
        idx = [i for i, o in enumerate(objects) if type(o) is kind]
        fn = getattr(kind, hook, None) if default is not None else getattr(kind, hook)
        got = (fn or default)([objects[i] for i in idx], *[[a[i] for i in idx] for a in per_row], *shared)
        if got is not None:
            answered = True
            for i, v in zip(idx, got):
                out[i] = v
    return out if answered else None


def step_caps(controllers: Sequence[Any]) -> list[int]:
    """:func:`step_cap` of each of ``controllers`` (a batch's rows), one :meth:`DraftController.step_depths` call per
    controller class (a controller-like object without it: its ``step_depth``, else its ``max_depth``); [] for none.

    Raises:
        AttributeError: a controller-like object with neither ``step_depth`` nor ``max_depth``.
    """
    return per_class(controllers, "step_depths", default=lambda cs: [step_cap(c) for c in cs]) or []


def observe_loads(controllers: Sequence[DraftController], load: LoadState) -> None:
    """Give ``load`` (the step's :class:`~learn2draft.state.LoadState`) to each of ``controllers`` (a batch's rows),
    one :meth:`DraftController.observe_loads` call per controller class (a controller-like object without it: its
    own ``observe_load``).

    Raises:
        AttributeError: a controller-like object without ``observe_load``.
    """
    per_class(controllers, "observe_loads", shared=(load,), default=DraftController.observe_loads)


def keeps_drafting(controller: DraftController, depth: int, can_draft: Callable[[], bool], decide: Callable[[], bool],
                   min_depth: int = 0) -> bool:
    """The one depth rule of a cycle, on the real loop and in replay: draft one more step when the depth is
    below the controller's :attr:`~DraftController.step_depth` (its ``max_depth``, or a step policy's γ), a draft is
    possible (``can_draft()``: below the decoder's depth limit, and the drafter has a proposal) and the controller
    says CONTINUE (``decide()``, asked only then); the first ``min_depth`` steps are drafted without asking (a size
    decision needs a tree)."""
    return depth < max(step_cap(controller), min_depth) and can_draft() and (depth < min_depth or decide())


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


class CycleDriver:
    """How a controller drives a cycle, once for every backend: the real decoder
    (:class:`learn2draft.decoding.SpeculativeDecoder`, its tree subclass) and the replay backend
    (:class:`learn2draft.replay.backend.ReplayDecoder`, no model: a trace and a latency profile). A backend keeps its
    own state and cycle parts; this class asks the controller and applies its answers, so a controller, an
    environment (:mod:`envs.spec_decode`) or a comparison (:mod:`eval.simreal`) drives both through the same calls.

    What a backend provides:

    * ``clock`` (``now()``: seconds; the replay's advances by the replayed seconds) and ``_cycle_other`` (float
      seconds, the cycle's time outside the forwards, to which decisions are charged);
    * ``_hybrid`` (a hybrid drafter: a CONTINUE's source is selected with ``drafter.select``), ``shape``
      (``"chain"`` or ``"tree"``), ``max_depth``, ``prompt_len``, ``_started``, ``finished``, ``depth`` (tokens
      drafted this cycle) and ``ids`` (the committed prompt + generated ids, sliceable, with ``tolist()``);
    * ``start(prompt_ids, seed)``, ``can_draft()``, ``draft_step()``, ``verify(verify_size)`` →
      :class:`learn2draft.metrics.CycleResult`, ``state()`` → :class:`learn2draft.state.DraftState`,
      ``size_features()`` (a tree's only) and ``target_dtype`` (the precision a policy is checked against; None: none).
    """

    def add_other_seconds(self, seconds: float) -> None:
        """Charge time spent outside the decoder (e.g. a controller's decision) to the current cycle."""
        self._cycle_other += seconds

    def _check_running(self) -> None:
        """Raise RuntimeError before ``start`` (``_started`` False) or after the generation finished."""
        if not self._started:
            raise RuntimeError("Call start(prompt_ids) first.")
        if self.finished:
            raise RuntimeError("Generation finished (EOS or max_new_tokens): call start() for a new prompt.")

    # ----------------------------------------------------------------- decisions
    def decide(self, controller: DraftController) -> int:
        """Ask ``controller`` STOP or CONTINUE on ``state()`` (:meth:`DraftController.decide`; a rule reads its
        fields, a learned policy builds :meth:`~learn2draft.state.DraftState.features` from it), its time charged to
        the cycle — building the state included; returns the action (:func:`as_action`: 0 STOP, 1 CONTINUE — with
        lookup on a hybrid drafter — or 2 CONTINUE with a hybrid's neural drafter), truthy when drafting goes on. A
        controller whose ``reads_state`` is False is not asked: CONTINUE (1).

        Raises:
            ValueError: the controller returned something else.
        """
        if not asks(controller):
            return 1  # CONTINUE below its step depth, asked or not (DraftController.reads_state)
        t0 = self.clock.now()
        action = as_action(controller.decide(self.state()))
        self._cycle_other += self.clock.now() - t0
        return action

    def _choose(self, action: int) -> bool:
        """Apply a CONTINUE's source (a hybrid drafter: 1 lookup, 2 neural; one drafter: any CONTINUE) before the
        draw; returns whether the action drafts."""
        if action and self._hybrid:
            self.drafter.select(action - 1)
        return bool(action)

    def decide_size(self, decider: SizeDecider | None) -> int | None:
        """A tree's verification size V from ``decider(size_features, depth)``, its time charged to the
        cycle; None (the decoder's default) without a decider or for a chain, which verifies every token.

        Raises:
            ValueError: the decider did not return one integer ≥ 0.
        """
        if decider is None or self.shape == "chain":
            return None
        t0 = self.clock.now()
        v = as_size(decider(self.size_features(), self.depth))
        self._cycle_other += self.clock.now() - t0
        return v

    # ----------------------------------------------------------------- driving
    def step(self, draft_more: bool, size: SizeDecider | None = None) -> CycleResult | None:
        """Apply one depth decision: draft one more token (``draft_more`` and ``can_draft()``), or verify.

        When a drafted token reaches the cycle's limit (depth limit, or no further proposal from
        the drafter), verification happens in the same call. The gymnasium environments drive the
        cycle through this step, one agent decision per call.

        Args:
            draft_more: CONTINUE (True / 1; with lookup on a hybrid drafter), CONTINUE with a hybrid's neural
                drafter (2), or STOP (False / 0).
            size: a tree's size decider, asked when this call verifies (None: the decoder's ``verify_size``).

        Returns:
            the :class:`~learn2draft.metrics.CycleResult` when this call verified, else None.

        Raises:
            RuntimeError: not started or finished.
        """
        if self._choose(as_action(draft_more)) and self.can_draft():
            self.draft_step()
            if self.can_draft():
                return None
        return self.verify(self.decide_size(size))

    def draft(self, controller: DraftController, min_depth: int = 0) -> None:
        """The drafting half of a cycle: draft while the controller says CONTINUE, up to the decoder's and
        the controller's ``max_depth`` and while the drafter has proposals. The first ``min_depth`` steps
        are drafted without asking (a size decision needs a tree). Decision times are charged to the cycle."""
        while self.wants_draft(controller, min_depth):
            self.draft_step()

    def wants_draft(self, controller: DraftController, min_depth: int = 0) -> bool:
        """Whether the cycle drafts one more token now: :func:`keeps_drafting` (the one depth rule) on this
        decoder's depth and ``can_draft()``, asking ``controller`` (its time charged to the cycle) only when the rule
        needs its answer; a hybrid's CONTINUE selects its source."""
        return keeps_drafting(controller, self.depth, self.can_draft, lambda: self._choose(self.decide(controller)),
                              min_depth)

    def run_cycle(self, controller: DraftController) -> CycleResult:
        """One whole cycle under ``controller``: :meth:`draft`, then the size decision when the controller
        makes one (a tree controller), then ``verify``; returns its :class:`~learn2draft.metrics.CycleResult`."""
        self.draft(controller)
        size = controller.verification_size if decides_verification_size(controller) else None
        return self.verify(self.decide_size(size))

    def generate(self, prompt_ids, controller: DraftController, seed: int | None = None,
                 on_tokens: Callable[[list[int], CycleResult | None], bool | None] | None = None) -> GenerationResult:
        """Generate up to ``max_new_tokens`` after ``prompt_ids`` (int64 (L,) or (1, L)); stop at EOS
        (emitted, nothing after).

        The wall clock (``clock``) covers prefill, every cycle and the controller's decisions; TTFT is the
        prefill (on the real decoder one target forward over the prompt and the first token's draw; in replay 0).

        Args:
            on_tokens: called as tokens are committed, for streaming: ``on_tokens(tokens, None)``
                with the first token after the prefill, then ``on_tokens(cycle.tokens, cycle)``
                after every cycle. Returning True stops the generation there (e.g. a stop string
                was seen); its time is charged to the wall clock.

        Returns:
            a :class:`learn2draft.metrics.GenerationResult`.

        Raises:
            ValueError: ``controller`` reads the depth features on the scale of a ``max_depth``
                (its ``depth_feature_scale``, e.g. a trained policy's) other than this decoder's.

        Warns:
            PrecisionMismatchWarning: ``controller`` was trained in another precision than the target runs in
                (once per policy: :func:`warn_precision_mismatch`).
        """
        check_depth_feature_scale(controller, self.max_depth)
        if self.target_dtype is not None:
            warn_precision_mismatch(controller, self.target_dtype)  # once per policy, not per generation
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


__all__ = [
    "ACTION_MEANINGS", "CONTINUE", "CONTINUE_LOOKUP", "CycleDriver", "CONTINUE_NEURAL", "HYBRID_ACTION_MEANINGS", "STOP", "as_action", "DraftController", "PrecisionMismatchWarning", "precision_mismatch", "warn_precision_mismatch", "FixedDepthController", "FixedTreeController",
    "SizeDecider", "as_size", "check_depth_feature_scale", "decides_verification_size", "keeps_drafting",
    "size_decider", "step_cap", "step_caps", "asks_rows", "observe_loads", "per_class",
]
