"""A learned depth policy inside Hugging Face ``generate(assistant_model=...)`` (assisted generation).

Two added lines give a user's existing assisted-generation call the learned policy::

    from policies.hf import use_policy
    use_policy(model, "policies/defaults/model")          # an export dir or a training run dir
    out = model.generate(**inputs, assistant_model=draft, max_new_tokens=64)

or, to undo it at the end of a block, ``with use_policy(model, path): ...`` (the returned
:class:`PolicyHook` also has :meth:`PolicyHook.remove`; :func:`remove_policy` undoes it by model).

How it plugs in. transformers 5.x ``generate()`` takes no candidate-generator argument; assisted
generation asks the *model instance* for one through its (private) method
``_get_candidate_generator(...)``. :func:`use_policy` shadows that method on the one model instance
it is given (nothing is patched on the class), calls the original, and replaces the result only when
transformers picked the plain :class:`~transformers.generation.candidate_generator.AssistedCandidateGenerator`
(a draft model sharing the target's tokenizer); every other case (no assistant, prompt lookup,
assistant early exit, different tokenizers, MTP, …) gets transformers' own generator unchanged.

What the policy decides. :class:`PolicyCandidateGenerator` asks the policy before each draft token
(:meth:`learn2draft.control.DraftController.decide`), with a :class:`learn2draft.state.DraftState` whose
float32 feature vector of :mod:`learn2draft.features` is the one this project's loop builds:
at depth 0 in ``get_candidates`` — STOP returns zero candidates, and transformers' loop then does a
plain target step (greedy argmax, or a draw from the target's processed distribution) — and after each
drafted token inside the assistant's own ``generate()`` call, through a
:class:`~transformers.StoppingCriteria` (the place transformers' ``ConfidenceCriteria`` uses for
``assistant_confidence_threshold``). The policy's ``max_depth`` caps the candidates per cycle;
the draft's ``num_assistant_tokens``, schedule and confidence threshold are not used while a policy
is installed. Acceptance is transformers' own code (greedy: argmax matching; sampling: the
speculative sampling rule, Leviathan et al. 2023, Algorithm 1, with the assistant's processed scores
as q): the policy chooses only how many candidates to propose, always before the next one is drawn,
so greedy output is unchanged and sampling keeps the target's law.

Features against this project's loop (:meth:`learn2draft.SpeculativeDecoder.features`):

* ``context_len``, ``depth``, ``progress``: the same definitions (committed = the ``input_ids`` the
  loop holds, prompt included; ``max_new_tokens`` = transformers' ``max_length`` − prompt length).
* ``accepted_len_t-*``, ``last_accept_fraction``: from the ``num_matches`` and the candidate count
  transformers reports to ``update_candidate_strategy`` after each verification.
* ``last_confidence``, ``last_entropy``, ``cum_confidence``, ``mean_confidence``: from the assistant's
  logits before temperature, top-k and top-p (a logits processor placed first among the custom ones).
  Processors that transformers builds *before* the custom ones from the generation config
  (repetition penalty, no-repeat n-gram, bad words, …) are already applied there; this project's loop
  reads fully raw logits. The entropy is divided by ln of the assistant's logits width (this project
  uses the tokenizer's length; equal for the shipped pair).
* ``match_len``, ``match_count``: 0, as for this project's model drafter (prompt-lookup features).
* Cycles are aligned differently: transformers verifies the first candidates with the prefill
  forward, so its first decision sees ``generated = 0``; this project's loop emits the first token
  from the prefill and decides from ``generated = 1``. After a drafted EOS transformers' assistant
  stops drafting (this project's drafter may go on; the extra tokens would be cut at the EOS anyway).

Limits: batch size 1 (as transformers' assisted generation); a draft model that shares the target's
tokenizer (with ``tokenizer=``/``assistant_tokenizer=`` for different tokenizers transformers builds
another generator and the policy is not used: a warning says so); decoder-only models tested;
policies trained for the ``model`` drafter (a ``head`` or ``lookup`` policy reads features an
assistant model does not give); one hook per model instance; :attr:`PolicyHook.last_cycles` records
the latest call only (not meant for concurrent ``generate`` calls on one model).
Tested with transformers 5.24 (:data:`TESTED_TRANSFORMERS`); :func:`use_policy` refuses other versions
because the hook is a private method whose signature may change.
"""

from __future__ import annotations

import inspect
import types
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from transformers import LogitsProcessor, LogitsProcessorList, StoppingCriteria, StoppingCriteriaList
from transformers.generation.candidate_generator import AssistedCandidateGenerator

from learn2draft.control import as_action
from learn2draft.decoding import DraftController
from learn2draft.drafters.base import NUM_DRAFTER_FEATURES
from learn2draft.state import DraftState
from policies.controllers import CONTINUE, STOP
from policies.rules import MatchLengthController

#: The transformers versions this hook is tested with: ``>= first, < second``.
TESTED_TRANSFORMERS = ("5.24", "6")
_HOOK = "_get_candidate_generator"
_HOOK_PARAMS = ("generation_config", "input_ids", "inputs_tensor", "logits_processor", "model_kwargs",
                "assistant_model")
_GENERATOR_METHODS = ("_calculate_new_tokens", "_update_past_and_masks", "_prepare_generation_args",
                      "_generate_candidates")


class UnsupportedTransformersError(RuntimeError):
    """The installed transformers is outside :data:`TESTED_TRANSFORMERS`, or lacks the hook it needs."""


def check_transformers_version(version: str | None = None) -> str:
    """Check that transformers ``version`` (default: the installed one) is in :data:`TESTED_TRANSFORMERS`
    and has the assisted-generation internals the hook relies on.

    Returns:
        the version string.

    Raises:
        UnsupportedTransformersError: outside the tested range, or the internals changed.
    """
    from packaging.version import Version
    from transformers import GenerationMixin

    if version is None:
        import transformers

        version = transformers.__version__
    lo, hi = TESTED_TRANSFORMERS
    if not Version(lo) <= Version(version) < Version(hi):
        raise UnsupportedTransformersError(
            f"policies.hf is tested with transformers >= {lo}, < {hi}; transformers {version} is installed. Install a "
            f"tested version (pip install 'transformers>={lo},<{hi}') or use this project's own loop "
            "(learn2draft.SpeculativeDecoder), which needs no transformers internals."
        )
    hook = getattr(GenerationMixin, _HOOK, None)
    params = inspect.signature(hook).parameters if callable(hook) else {}
    missing = [p for p in _HOOK_PARAMS if p not in params] + [
        m for m in _GENERATOR_METHODS if not hasattr(AssistedCandidateGenerator, m)]
    if missing:
        raise UnsupportedTransformersError(
            f"transformers {version} lacks what policies.hf hooks into ({', '.join(missing)}): "
            f"install transformers >= {lo}, < {hi}."
        )
    return version


def _batch_error(batch_size: int) -> ValueError:
    return ValueError(f"A learned policy drives assisted generation of one sequence at a time, got a batch of "
                      f"{batch_size}: call generate() once per prompt (transformers' assisted generation supports "
                      "batch size 1 only).")


@dataclass
class HFCycle:
    """One assisted-generation cycle under a policy (one target forward).

    Attributes:
        start: committed tokens (prompt included) when the cycle began.
        limit: the most candidates allowed this cycle: min(policy ``max_depth``, tokens left − 1).
        features: float32 ``(len(FEATURE_NAMES),)`` per policy decision, in order.
        actions: the policy's action per decision (0 = STOP, 1 = CONTINUE).
        proposed: candidates returned to transformers (= the number of CONTINUE actions).
        candidates: their token ids.
        stopped_by: ``"policy"`` (a STOP action), ``"limit"`` (``limit`` reached, no decision asked)
            or ``"eos"`` (the assistant drafted an end-of-sequence token).
        verified: candidates transformers verified, as it reported them to ``update_candidate_strategy``
            (None until then).
        accepted: accepted length τ, transformers' ``num_matches`` (None until verified).
    """

    start: int
    limit: int
    features: list[np.ndarray] = field(default_factory=list, repr=False)
    actions: list[int] = field(default_factory=list)
    proposed: int = 0
    candidates: list[int] = field(default_factory=list)
    stopped_by: str = "policy"
    verified: int | None = None
    accepted: int | None = None


class _DraftLogitsStats(LogitsProcessor):
    """A logits processor that records the max probability and the entropy (nats) of the assistant's
    logits it receives, and returns them unchanged. Placed first among the custom processors, it sees
    the logits before temperature, top-k and top-p."""

    def __init__(self, owner: PolicyCandidateGenerator):
        self.owner = owner

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        p = torch.softmax(scores[0].float(), dim=-1)
        ent = -(p * torch.log(p.clamp_min(1e-30))).sum()
        conf, entropy = torch.stack([p.max(), ent]).tolist()  # one device sync per draft token
        self.owner._draft_token_stats(conf, entropy, scores.shape[-1])
        return scores


class _PolicyStop(StoppingCriteria):
    """A stopping criterion for the assistant's ``generate()``: after each drafted token, stop unless
    the policy says CONTINUE (asked only below the cycle's limit and after a non-EOS token)."""

    def __init__(self, owner: PolicyCandidateGenerator):
        self.owner = owner

    def __call__(self, input_ids: torch.LongTensor, scores: Any, **kwargs) -> torch.BoolTensor:
        stop = self.owner._stop_after_token(input_ids)
        return torch.full((input_ids.shape[0],), stop, dtype=torch.bool, device=input_ids.device)


class PolicyCandidateGenerator(AssistedCandidateGenerator):
    """transformers' ``AssistedCandidateGenerator`` with the number of candidates per cycle chosen by a
    depth policy (see the module docstring for the features and the exactness argument).

    Args:
        input_ids: int64 ``(1, L)``, the prompt (transformers passes it).
        assistant_model, generation_config, model_kwargs, inputs_tensor, logits_processor: as
            transformers passes them to ``AssistedCandidateGenerator``.
        controller: a :class:`learn2draft.decoding.DraftController` (e.g. the ONNX policy from
            :func:`policies.load_policy`), asked ``decide(state)`` (:meth:`state`) before each draft token;
            its ``max_depth`` caps the candidates per cycle, and the depth features are divided by its
            ``depth_feature_scale`` (the ``max_depth`` it was trained with; its ``max_depth`` if absent).

    Attributes:
        cycles: one :class:`HFCycle` per cycle of this ``generate()`` call.

    Raises:
        ValueError: batch size is not 1.
    """

    def __init__(self, input_ids, assistant_model, generation_config, model_kwargs, inputs_tensor=None,
                 logits_processor=None, *, controller: DraftController):
        if input_ids.shape[0] != 1:
            raise _batch_error(input_ids.shape[0])
        super().__init__(input_ids, assistant_model, generation_config, model_kwargs, inputs_tensor, logits_processor)
        self.controller = controller
        self.max_depth = int(controller.max_depth)
        self.depth_scale = max(int(controller.depth_feature_scale or self.max_depth), 1)
        self.num_assistant_tokens = self.max_depth  # read by _calculate_new_tokens: the cap per cycle
        # No ConfidenceCriteria in the assistant's generate(): the policy decides when to stop.
        self.generation_config.assistant_confidence_threshold = 0.0  # None would be filled with the default 0.4
        eos = self.generation_config.eos_token_id
        self._eos = set() if eos is None else set(eos if isinstance(eos, (list, tuple)) else
                                                  torch.as_tensor(eos).reshape(-1).tolist())
        self.prompt_len = int(input_ids.shape[-1])
        self.max_new_tokens = max(1, int(self.main_model_max_length) - self.prompt_len)
        self.accepted_history: list[int] = []
        self.last_accept_fraction = 1.0
        self.cycles: list[HFCycle] = []
        self._stats = _DraftLogitsStats(self)
        self._stop = _PolicyStop(self)
        self._cur_len = self.prompt_len
        self._confidences: list[float] = []
        self._entropies: list[float] = []
        self._vocab = 2
        controller.reset()

    # ----------------------------------------------------------- policy
    def state(self, depth: int) -> DraftState:
        """The :class:`learn2draft.state.DraftState` before drafting token ``depth + 1`` of this cycle (HF's draft
        model has no lookup features, so they are zeros), on the controller's depth-feature scale."""
        return DraftState(
            depth=depth, max_depth=self.depth_scale, committed_len=self._cur_len,
            generated=self._cur_len - self.prompt_len, max_new_tokens=self.max_new_tokens,
            accepted_history=tuple(self.accepted_history), last_accept_fraction=self.last_accept_fraction,
            confidences=tuple(self._confidences), entropies=tuple(self._entropies), vocab_size=self._vocab,
            drafter_features=np.zeros(NUM_DRAFTER_FEATURES, dtype=np.float32),
        )

    def features(self, depth: int) -> np.ndarray:
        """float32 ``(len(FEATURE_NAMES),)``: the observation before drafting token ``depth + 1`` of this cycle, built
        by :meth:`learn2draft.state.DraftState.features` (the one feature builder) from :meth:`state`."""
        return self.state(depth).features()

    def _decide(self, depth: int) -> bool:
        """Ask the controller whether to draft one more token at ``depth`` (:meth:`DraftController.decide` on
        :meth:`state`); record the decision and the state's observation."""
        cycle = self.cycles[-1]
        state = self.state(depth)
        go = bool(as_action(self.controller.decide(state), n_actions=2))  # one clear error for a bad answer
        cycle.features.append(state.features())
        cycle.actions.append(CONTINUE if go else STOP)
        return go

    def _draft_token_stats(self, confidence: float, entropy: float, vocab: int) -> None:
        self._confidences.append(confidence)
        self._entropies.append(entropy)
        self._vocab = max(int(vocab), 2)

    def _stop_after_token(self, input_ids: torch.LongTensor) -> bool:
        depth = input_ids.shape[-1] - self._cur_len
        cycle = self.cycles[-1]
        if int(input_ids[0, -1]) in self._eos:
            cycle.stopped_by = "eos"
            return True
        if depth >= cycle.limit:
            cycle.stopped_by = "limit"
            return False  # transformers' max-length criterion stops here
        return not self._decide(depth)

    # ------------------------------------------------ transformers' interface
    def get_candidates(self, input_ids: torch.LongTensor, **kwargs) -> tuple[torch.LongTensor, torch.Tensor | None]:
        """Candidates for this cycle: the policy's decisions before each draft token.

        Args:
            input_ids: int64 ``(1, n)``, the committed sequence.

        Returns:
            ``(ids, logits)``: ids int64 ``(1, n + k)`` with k ≥ 0 candidates, and the assistant's processed
            scores float ``(1, k, V)`` — or ``(input_ids, None)`` when k = 0 (transformers then does a
            plain target step).
        """
        input_ids = input_ids.to(self.assistant_model.device)
        min_new, max_new = self._calculate_new_tokens(input_ids)
        self._cur_len = int(input_ids.shape[-1])
        self._confidences, self._entropies = [], []
        cycle = HFCycle(start=self._cur_len, limit=max(0, int(max_new)))
        self.cycles.append(cycle)
        if cycle.limit == 0:
            cycle.stopped_by = "limit"
            return input_ids, None
        if not self._decide(0):
            return input_ids, None
        self._update_past_and_masks(input_ids)
        args = self._prepare_generation_args(input_ids, min_new, max_new)
        args["logits_processor"] = LogitsProcessorList([self._stats, *self.logits_processor])
        args["stopping_criteria"] = StoppingCriteriaList([self._stop])
        ids, logits = self._generate_candidates(args)
        cycle.candidates = ids[0, input_ids.shape[-1]:].tolist()
        cycle.proposed = len(cycle.candidates)
        return ids, logits

    def _update_past_and_masks(self, input_ids, remove_from_pkv: int = 0, num_added_tokens: int = 1) -> bool:
        has_cache = super()._update_past_and_masks(input_ids, remove_from_pkv, num_added_tokens)
        if not has_cache:
            # The assistant has not run yet (the policy stopped at depth 0 so far): its mask and positions
            # must still cover the whole sequence it is about to read.
            from transformers.generation.candidate_generator import (
                _prepare_attention_mask,
                _prepare_position_ids,
                _prepare_token_type_ids,
            )

            enc_dec = self.assistant_model.config.is_encoder_decoder
            n = input_ids.shape[-1]
            self.assistant_kwargs = _prepare_attention_mask(self.assistant_kwargs, n, enc_dec)
            self.assistant_kwargs = _prepare_position_ids(self.assistant_kwargs, n, enc_dec)
            self.assistant_kwargs = _prepare_token_type_ids(self.assistant_kwargs, n)
        return has_cache

    def update_candidate_strategy(self, input_ids: torch.LongTensor, scores: torch.Tensor, num_matches: int) -> None:
        """Record the cycle's outcome for the next features: τ = ``num_matches``, candidates verified =
        ``scores.shape[1] − 1`` (``scores``: float ``(1, k + 1, V)``). No schedule is adapted."""
        verified = int(scores.shape[1]) - 1
        tau = int(num_matches)
        self.accepted_history.append(tau)
        self.last_accept_fraction = tau / verified if verified else 1.0
        if self.cycles:
            self.cycles[-1].verified, self.cycles[-1].accepted = verified, tau


# ------------------------------------------------------------------ the hook
def _as_controller(policy: str | Path | DraftController | None) -> tuple[DraftController, Path | None]:
    """Load ``policy`` (an export / run directory, None for the shipped ``model`` policy, or a controller)."""
    from policies.layout import ONNX_FILE, POLICY_CONFIG_FILE, default_policy_dir, resolve_export_dir
    from policies.load import load_policy, policy_drafter

    if isinstance(policy, DraftController):
        if isinstance(policy, MatchLengthController):
            raise ValueError("MatchLengthController decides from the prompt-lookup match length, which an assistant "
                             "model does not have: use a policy trained with --drafter model, or "
                             "ConfidenceThresholdController.")
        if not isinstance(getattr(policy, "max_depth", None), int) or policy.max_depth < 0:
            raise ValueError(f"{policy!r} needs an integer max_depth ≥ 0 (the most candidates per cycle).")
        return policy, None
    if policy is None:
        policy = default_policy_dir("model")
    if not isinstance(policy, (str, Path)):
        raise ValueError(f"policy must be a policy export directory, a training run directory or a DraftController, "
                         f"got {type(policy).__name__}.")
    d = resolve_export_dir(policy)
    if not d.is_dir() or not (d / ONNX_FILE).is_file() or not (d / POLICY_CONFIG_FILE).is_file():
        raise FileNotFoundError(
            f"No policy export at {policy}: pass a directory holding {ONNX_FILE}, {POLICY_CONFIG_FILE} and "
            "feature_spec.json (written by `python -m train --out RUN_DIR`, in RUN_DIR/policy), or a training run "
            "directory."
        )
    drafter = policy_drafter(d)
    if drafter != "model":
        raise ValueError(
            f"The policy in {d} was trained for the {drafter!r} drafter: it reads features that an assistant model "
            f"does not give ({'the target hidden-state head' if drafter == 'head' else 'prompt-lookup matches'}). "
            "Hugging Face assisted generation drafts with a model: use a policy trained with `python -m train "
            "--drafter model` (the shipped one is policies/defaults/model)."
        )
    return load_policy(d), d


class PolicyHook:
    """A learned policy installed on one model instance by :func:`use_policy`.

    Use it as a context manager (``with use_policy(model, path): ...``) or call :meth:`remove`.

    Attributes:
        model: the target model whose ``generate()`` uses the policy.
        controller: the policy (a :class:`learn2draft.decoding.DraftController`).
        policy_dir: the export directory it was loaded from (None for a controller passed in).
        last_cycles: the :class:`HFCycle` records of the latest assisted ``generate()`` call.
        calls: assisted ``generate()`` calls served by the policy so far.
    """

    def __init__(self, model: Any, controller: DraftController, policy_dir: Path | None):
        self.model, self.controller, self.policy_dir = model, controller, policy_dir
        self.last_cycles: list[HFCycle] = []
        self.calls = 0
        self._original = getattr(model, _HOOK)  # the class's bound method
        self._signature = inspect.signature(self._original)
        self._installed = False

    @property
    def installed(self) -> bool:
        """Whether the model's ``generate()`` currently uses this policy."""
        return self._installed

    def _get_candidate_generator(self, *args, **kwargs):
        """The model's ``_get_candidate_generator`` while installed: transformers' choice, with the plain
        ``AssistedCandidateGenerator`` replaced by a :class:`PolicyCandidateGenerator`."""
        a = self._signature.bind(*args, **kwargs).arguments
        assistant = a.get("assistant_model")
        if assistant is not None and a["input_ids"].shape[0] != 1:
            raise _batch_error(a["input_ids"].shape[0])
        generator = self._original(*args, **kwargs)
        if type(generator) is not AssistedCandidateGenerator:
            if assistant is not None:
                warnings.warn(f"policies.hf: transformers chose {type(generator).__name__} for this call (e.g. "
                              "different tokenizers): the learned policy is not used.", stacklevel=2)
            return generator
        ours = PolicyCandidateGenerator(
            a["input_ids"], assistant, a["generation_config"], a["model_kwargs"], a.get("inputs_tensor"),
            a.get("logits_processor"), controller=self.controller,
        )
        self.last_cycles = ours.cycles
        self.calls += 1
        return ours

    def _install(self) -> None:
        setattr(self.model, _HOOK, types.MethodType(_hooked_method, self.model))
        self.model._learn2draft_policy_hook = self
        self._installed = True

    def remove(self) -> None:
        """Give the model back transformers' own ``_get_candidate_generator`` (no-op if already removed)."""
        if not self._installed:
            return
        if getattr(self.model, "_learn2draft_policy_hook", None) is self:
            vars(self.model).pop(_HOOK, None)
            vars(self.model).pop("_learn2draft_policy_hook", None)
        self._installed = False

    def __enter__(self) -> PolicyHook:
        return self

    def __exit__(self, *exc) -> None:
        self.remove()

    def __repr__(self) -> str:
        src = self.policy_dir if self.policy_dir is not None else self.controller
        return f"PolicyHook(model={type(self.model).__name__}, policy={src}, installed={self._installed})"


def _hooked_method(model, *args, **kwargs):
    return model._learn2draft_policy_hook._get_candidate_generator(*args, **kwargs)


def use_policy(model: Any, policy: str | Path | DraftController | None = None, *,
               check_version: bool = True) -> PolicyHook:
    """Make ``model.generate(..., assistant_model=draft)`` propose as many candidates per cycle as a
    learned depth policy decides.

    Args:
        model: the target, a transformers ``PreTrainedModel`` with ``generate()`` (decoder-only tested).
        policy: a policy export directory (``policy.onnx``, ``feature_spec.json``, ``policy_config.json``),
            a training run directory holding one in ``policy/``, a :class:`learn2draft.decoding.DraftController`
            (e.g. ``ConfidenceThresholdController(0.4, max_depth=8)``, or a profile-conditioned policy loaded with
            ``policies.load.load_policy(dir, profile=...)``), or None for the shipped policy of the
            embedded pair (``policies/defaults/model``).
        check_version: refuse transformers outside :data:`TESTED_TRANSFORMERS` (set False at your own risk).

    Returns:
        a :class:`PolicyHook` (installed; a context manager; :meth:`PolicyHook.remove` undoes it).

    Raises:
        FileNotFoundError: no policy export at ``policy``.
        ValueError: the policy was trained for the head or lookup drafter; the model has no assisted
            generation; a policy is already installed on this model.
        UnsupportedTransformersError: transformers outside the tested range (with ``check_version``).
    """
    if check_version:
        check_transformers_version()
    if not callable(getattr(model, "generate", None)) or not callable(getattr(model, _HOOK, None)):
        raise ValueError(f"{type(model).__name__} has no transformers assisted generation (generate() and {_HOOK}): "
                         "pass the target model, e.g. AutoModelForCausalLM.from_pretrained(...).")
    if _HOOK in vars(model):
        raise ValueError(f"{type(model).__name__} already has a candidate-generator hook"
                         f"{' (a learned policy)' if hasattr(model, '_learn2draft_policy_hook') else ''}: call "
                         "remove_policy(model) (or the hook's remove()) before installing another policy.")
    controller, policy_dir = _as_controller(policy)
    hook = PolicyHook(model, controller, policy_dir)
    hook._install()
    return hook


def remove_policy(model: Any) -> bool:
    """Undo :func:`use_policy` on ``model``. Returns True if a policy was installed, False if none was."""
    hook = getattr(model, "_learn2draft_policy_hook", None)
    if hook is None:
        return False
    hook.remove()
    return True


__all__ = [
    "TESTED_TRANSFORMERS", "HFCycle", "PolicyCandidateGenerator", "PolicyHook", "UnsupportedTransformersError",
    "check_transformers_version", "remove_policy", "use_policy",
]
