"""A load-aware learn2draft policy as SGLang's adaptive speculation policy: :class:`LearnedAdaptiveSpecPolicy`
implements the ``AdaptiveSpecPolicy`` protocol of SGLang's ``python/sglang/srt/speculative/adaptive_runtime_state.py``
(introduced by SGLang PR #37274; read in the SGLang 0.5.22 and 0.5.23 release wheels, whose files of that protocol are
identical, see :data:`SGLANG_SOURCE`).

What SGLang does (0.5.22 / 0.5.23, ``--speculative-adaptive [--speculative-adaptive-config FILE]``, EAGLE / EAGLE3
with topk = 1 only, ``adaptive_spec_params.adaptive_unsupported_reason``):

* ``EAGLEWorkerV2.__init__`` (``speculative/eagle_worker_v2.py``) builds ``AdaptiveController(self,
  AdaptiveSpeculativeParams(initial_steps=self.speculative_num_steps, cfg_path=<the config file or None>))``: the
  policy class is named there, not chosen by a setting; the plugin package ``engines/sglang_plugin``
  (``learn2draft_sglang``) replaces that class through SGLang's plugin hooks.
* At start-up ``AdaptiveController.init_states(cuda_graph_bs)`` calls ``set_cuda_graph_bs``, then for every step
  count ``s`` of ``candidate_steps`` builds one runtime state (``s`` draft steps, ``s + 1`` draft tokens) with CUDA
  graphs captured at ``cuda_graph_bs_for_step(s)`` only. A step outside ``candidate_steps`` has no state: activating
  it raises ``ValueError("Missing adaptive runtime state ...")``.
* Before each decode step ``activate_step_by_batch(batch.seq_lens.shape[0])`` activates ``get_steps_for_batch(B)``.
* After each verify, in the scheduler process (``managers/scheduler_components/batch_result_processor.py``,
  ``_resolve_spec_v2_tokens``), ``on_verify_complete(num_correct_drafts_per_req, batch_size=len(batch.reqs))``:
  a Python ``list[int]`` already on the CPU (``accept_lens`` is asserted to be a CPU tensor and turned into a
  list there), one entry per request, each the accepted *draft* tokens of that request's last verify (``accept_len``
  minus the one non-draft token, so 0..steps). A returned int is activated at once; ``None`` keeps the state.

How the learned policy is fed (:data:`learn2draft.features.SERVE_FEATURE_NAMES`), and what SGLang does not expose:

================================  =============================================================================
feature                           source in SGLang
================================  =============================================================================
running_fraction                  the batch size SGLang passes (exact; capped at the policy's ``batch_scale``)
mean_last_tau                     the last verify's per-request accepted drafts (exact for the requests in it)
mean_last_accept_fraction         those counts / the step count that was active (tracked by the adapter)
waiting_fraction                  **not exposed**: 0 (SGLang's queue is not passed to the policy)
tokens_in_flight, mean_context,   **not exposed**: every row is assumed to hold ``context_len`` tokens (default:
max_context                       the policy's ``context_scale``, where these features saturate)
mean_draftable                    **not exposed**: ``draftable`` tokens (default ``max_depth``: an EAGLE head can
                                  always propose a full chain)
mean_tokens_left                  **not exposed**: ``tokens_left`` × the policy's ``max_new_tokens`` (default 0.5)
verify_growth, draft_cost         the policy's latency profile at min(B, the profile's largest batch) rows and
                                  ``context_len`` (the machine it was trained on unless another is passed)
================================  =============================================================================

The exported graph runs with onnxruntime on the CPU (:class:`policies.controllers.LoadAwarePolicy`, loaded by
:func:`policies.load.load_serve_policy`); nothing here touches a device tensor, so the adapter adds no device
synchronisation: a tensor on another device than the CPU is refused (:class:`TypeError`). The policy's γ (0..its
``max_depth``) is snapped to the nearest step count SGLang captured for that batch size (the smaller on a tie):
only those have runtime states and CUDA graphs.
"""

from __future__ import annotations

import bisect
import json
import os
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

#: The SGLang releases whose adaptive-speculation and plugin sources this adapter was written against.
SUPPORTED_SGLANG_VERSIONS: tuple[str, ...] = ("0.5.22", "0.5.23")

#: Where each behaviour relied on is read (the release wheels record no git commit: their ``sglang/_version.py``
#: holds ``commit_id = None``; sha256 of the wheels read: 0.5.23 cp311 manylinux_2_34 00b3cd5b…d859937, 0.5.22
#: cc9a0f15…1717b9037b).
SGLANG_SOURCE = (
    "SGLang 0.5.22 and 0.5.23 (PyPI wheels): python/sglang/srt/speculative/adaptive_runtime_state.py "
    "(AdaptiveSpecPolicy, AdaptiveController), speculative/adaptive_spec_params.py (AdaptiveSpeculativeParams, "
    "DEFAULT_ADAPTIVE_CONFIG, _load_adaptive_config, routing), speculative/eagle_worker_v2.py (where the policy is "
    "built and activate_step_by_batch is called), managers/scheduler_components/batch_result_processor.py "
    "(on_verify_complete_cpu), srt/plugins/__init__.py and hook_registry.py (the sglang.srt.plugins entry points)"
)

#: The key of the ``--speculative-adaptive-config`` JSON object that holds this adapter's settings. SGLang's own
#: reader (``_load_adaptive_config``) skips every key that is not an integer string, so the file stays valid for it.
CONFIG_KEY = "learn2draft"
#: Environment variable naming a policy folder (used when the config file names none, or there is no config file).
ENV_POLICY = "LEARN2DRAFT_SGLANG_POLICY"
#: Environment variable: "1" puts :class:`policies.rules.SpeculationGuard` in front of the policy.
ENV_GUARD = "LEARN2DRAFT_SGLANG_GUARD"

#: SGLang's default candidate step counts per batch-size slot (``DEFAULT_ADAPTIVE_CONFIG`` of
#: ``adaptive_spec_params.py``, 0.5.22 / 0.5.23), used when no config file is given.
SGLANG_DEFAULT_CANDIDATES: dict[int, list[int]] = {1: [1, 3, 5, 7], 8: [0, 1, 3], 32: [0, 1], 64: [0]}

#: The settings the ``"learn2draft"`` object of the config may hold.
SETTING_KEYS = ("policy", "guard", "context_len", "tokens_left", "draftable", "profile")

#: Reports kept per policy (``LoadAwarePolicy.gammas``, ``SpeculationGuard.decisions``) in a long-running server.
_KEEP_REPORTS = 1024


class PolicyFolderError(ValueError):
    """A policy folder given to the SGLang adapter that cannot be run: missing, not a load-aware export, or damaged.
    The message names the folder and the reason."""


def snap_to_candidates(gamma: int, candidates: Sequence[int]) -> int:
    """The step count of ``candidates`` nearest to ``gamma`` (the smaller one on a tie).

    Args:
        gamma: the policy's draft length (tokens, ≥ 0).
        candidates: the step counts SGLang captured for the batch size (non-empty).

    Raises:
        ValueError: ``candidates`` is empty.
    """
    if not candidates:
        raise ValueError("No candidate step counts to choose from.")
    return min(candidates, key=lambda s: (abs(int(s) - int(gamma)), int(s)))


def read_adaptive_config(cfg_path: str | os.PathLike | None) -> tuple[dict, dict[int, list[int]]]:
    """Read an SGLang ``--speculative-adaptive-config`` file as SGLang 0.5.22 / 0.5.23 does
    (``adaptive_spec_params._load_adaptive_config``): integer-string keys are batch-size slots, each with a non-empty
    ``candidate_steps`` list of ints ≥ 0; other keys are not slots (this adapter's settings live under
    :data:`CONFIG_KEY`).

    Args:
        cfg_path: the file; None: SGLang's default table (:data:`SGLANG_DEFAULT_CANDIDATES`).

    Returns:
        (the whole JSON object, {slot batch size: sorted unique candidate steps}).

    Raises:
        FileNotFoundError: no such file.
        ValueError: not a JSON object, a slot without valid ``candidate_steps``, or no slot at all.
    """
    if cfg_path is None:
        return {}, {bs: list(steps) for bs, steps in SGLANG_DEFAULT_CANDIDATES.items()}
    path = Path(cfg_path)
    try:
        cfg = json.loads(path.read_text())
    except FileNotFoundError:
        raise FileNotFoundError(f"No SGLang adaptive config at {path}.") from None
    except ValueError as e:
        raise ValueError(f"{path}: not valid JSON ({e}).") from None
    if not isinstance(cfg, dict):
        raise ValueError(f"{path}: the adaptive config must be a JSON object, got {type(cfg).__name__}.")
    table: dict[int, list[int]] = {}
    for key, entry in cfg.items():
        if not key.isdigit():
            continue
        steps = entry.get("candidate_steps") if isinstance(entry, dict) else None
        if not isinstance(steps, list) or not steps or not all(
                isinstance(s, int) and not isinstance(s, bool) and s >= 0 for s in steps):
            raise ValueError(f"{path}: batch size {key}: candidate_steps must be a non-empty list of ints ≥ 0, got "
                             f"{steps!r}.")
        table[int(key)] = sorted(set(steps))
    if not table:
        raise ValueError(f"{path}: no batch-size slot (an integer-string key such as \"1\": {{\"candidate_steps\": "
                         f"[1, 3, 7]}}); keys found: {list(cfg)}.")
    return cfg, table


def adapter_settings(cfg_path: str | os.PathLike | None, environ: Mapping[str, str] | None = None) -> dict | None:
    """The adapter's settings for one SGLang run: the :data:`CONFIG_KEY` object of the adaptive config (a relative
    ``policy`` is read from the config file's folder), else the policy folder named by :data:`ENV_POLICY`
    (:data:`ENV_GUARD` = "1" adds the guard). None when neither names a policy: SGLang's own policy runs.

    Raises:
        ValueError: the config's :data:`CONFIG_KEY` entry is not an object, holds an unknown setting, or names no
            ``policy``; the config is not a JSON object (as :func:`read_adaptive_config`).
    """
    env = os.environ if environ is None else environ
    cfg, _ = read_adaptive_config(cfg_path)
    settings = cfg.get(CONFIG_KEY)
    if settings is not None:
        if not isinstance(settings, dict):
            raise ValueError(f"{cfg_path}: {CONFIG_KEY!r} must be an object such as {{\"policy\": \"DIR\"}}, got "
                             f"{settings!r}.")
        unknown = sorted(set(settings) - set(SETTING_KEYS))
        if unknown:
            raise ValueError(f"{cfg_path}: unknown {CONFIG_KEY!r} setting(s) {unknown}; known: {list(SETTING_KEYS)}.")
        out = dict(settings)
        if not out.get("policy"):
            out["policy"] = env.get(ENV_POLICY) or None
        if not out["policy"]:
            raise ValueError(f"{cfg_path}: {CONFIG_KEY!r} names no policy: add \"policy\": \"DIR\" (a load-aware "
                             f"export) or set {ENV_POLICY}.")
        policy = Path(str(out["policy"])).expanduser()
        beside = Path(cfg_path).resolve().parent / policy
        if not policy.is_absolute() and out["policy"] == settings.get("policy") and beside.exists():
            policy = beside  # relative to the config file; else as given (the working directory, a shipped name)
        out["policy"] = str(policy)
        return out
    if env.get(ENV_POLICY):
        return {"policy": env[ENV_POLICY], "guard": env.get(ENV_GUARD, "") == "1"}
    return None


def _load_step_policy(policy_dir: str | os.PathLike, profile: Any = None) -> Any:
    """:func:`policies.load.load_serve_policy`, every failure as one :class:`PolicyFolderError` naming the folder."""
    from policies.load import load_serve_policy

    d = Path(policy_dir)
    shipped = Path(__file__).resolve().parent / "defaults" / str(policy_dir)
    if not d.exists() and os.sep not in str(policy_dir) and shipped.is_dir():
        d = shipped  # a shipped policy by name, e.g. "lookup-serve-float32"
    try:
        return load_serve_policy(d, profile=profile)
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise PolicyFolderError(
            f"learn2draft SGLang policy folder {str(policy_dir)!r} cannot be used: {e} (it must be a load-aware "
            "export, python -m train --serve-loads ..., e.g. policies/defaults/lookup-serve-float32).") from None


class _MemoProfile:
    """A latency profile whose batched prices are memoised per (batch size, tokens, context): the adapter asks the
    same few every decode step (its context is fixed), and each lookup costs about 0.3 ms of interpolation and path
    checks. Every other attribute is the profile's."""

    def __init__(self, profile: Any):
        self._profile = profile
        self._verify: dict[tuple, Any] = {}
        self._draft: dict[tuple, Any] = {}

    def verify_batched(self, batch_size: int, tokens: Any, context: Any, extrapolate: bool = False) -> Any:
        key = (int(batch_size), float(tokens), float(context), bool(extrapolate))
        if key not in self._verify:
            self._verify[key] = self._profile.verify_batched(batch_size, tokens, context, extrapolate=extrapolate)
        return self._verify[key]

    def draft_step_batched(self, drafter: str, batch_size: int, context: Any) -> Any:
        key = (drafter, int(batch_size), float(context))
        if key not in self._draft:
            self._draft[key] = self._profile.draft_step_batched(drafter, batch_size, context)
        return self._draft[key]

    def __getattr__(self, name: str) -> Any:
        return getattr(self._profile, name)


class LearnedAdaptiveSpecPolicy:
    """SGLang's ``AdaptiveSpecPolicy`` (``speculative/adaptive_runtime_state.py``, SGLang 0.5.22 / 0.5.23) driven by a
    load-aware learn2draft policy (:class:`policies.controllers.LoadAwarePolicy`), optionally behind
    :class:`policies.rules.SpeculationGuard`.

    One decision per new (batch size, verify result): ``get_steps_for_batch(B)`` (SGLang calls it before every decode
    step with ``batch.seq_lens.shape[0]``) and ``on_verify_complete`` (after every verify) ask the same cached
    decision; the features are those of the module docstring. Batch sizes are routed to a slot of the candidate table
    exactly as SGLang's ``AdaptiveSpeculativeParams._route`` does: up to the next captured CUDA-graph batch size
    (``bisect_left``; unchanged beyond the largest or without CUDA graphs), then the largest slot ≤ it (the smallest
    slot below all). The returned step is always one of that slot's candidates.

    Args:
        policy_dir: a load-aware export (``python -m train --serve-loads``; a shipped one by name, e.g.
            ``"lookup-serve-float32"``).
        candidates: {slot batch size: candidate step counts} (:func:`read_adaptive_config`); None: SGLang's default
            table.
        initial_steps: the step count SGLang starts on (``EAGLEWorkerV2.speculative_num_steps``; ``init_states``
            activates it).
        guard: put a :class:`SpeculationGuard` in front (it measures wall-clock tokens/s between verify callbacks;
            it can run plain decoding only where 0 is a candidate). Refused when ``torch.distributed`` runs more than
            one rank: its timings differ between ranks, and ranks must choose the same step.
        context_len: the context assumed for every row (tokens > 0); None: the policy's ``context_scale``.
        tokens_left: the fraction of the policy's ``max_new_tokens`` assumed left for every row (0..1).
        draftable: the tokens assumed proposable per row (0..max_depth); None: ``max_depth``.
        profile: another latency profile with the batch axis (path or ``LatencyProfile``) to price the steps; None:
            the one the policy was trained on.
        clock: seconds for the guard's measurements (default ``time.perf_counter``).

    Raises:
        PolicyFolderError: ``policy_dir`` is missing, not a load-aware export or damaged (one error naming it).
        ValueError: a setting out of range, an empty candidate table, or ``guard`` under several ranks.
    """

    def __init__(self, policy_dir: str | os.PathLike, candidates: Mapping[int, Sequence[int]] | None = None,
                 initial_steps: int = 1, guard: bool = False, context_len: float | None = None,
                 tokens_left: float = 0.5, draftable: int | None = None, profile: Any = None,
                 clock: Callable[[], float] = time.perf_counter):
        table = {int(bs): sorted({int(s) for s in steps}) for bs, steps in
                 (SGLANG_DEFAULT_CANDIDATES if candidates is None else candidates).items()}
        if not table or any(not steps or min(steps) < 0 for steps in table.values()):
            raise ValueError(f"candidates must map batch sizes to non-empty lists of step counts ≥ 0, got {table}.")
        self.policy = _load_step_policy(policy_dir, profile)
        self.policy.profile = _MemoProfile(self.policy.profile)  # the same prices, asked once per batch size
        self.policy_dir = str(policy_dir)
        D = self.max_depth = int(self.policy.max_depth)
        self.context_len = float(self.policy.context_scale if context_len is None else context_len)
        self.tokens_left = float(tokens_left)
        self.draftable = D if draftable is None else int(draftable)
        if not self.context_len > 0 or not 0.0 <= self.tokens_left <= 1.0 or not 0 <= self.draftable <= D:
            raise ValueError(f"Need context_len > 0, 0 ≤ tokens_left ≤ 1 and 0 ≤ draftable ≤ max_depth ({D}), got "
                             f"{context_len!r}, {tokens_left!r}, {draftable!r}.")
        self.step_policy = self.policy
        if guard:
            try:
                import torch.distributed as dist

                ranks = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
            except ImportError:
                ranks = 1
            if ranks > 1:
                raise ValueError(f"The speed guard measures wall-clock time, which differs between the {ranks} ranks "
                                 "of this SGLang run, and every rank must choose the same step count: run the "
                                 "learned policy without the guard (tensor/pipeline parallel), or on one GPU.")
            from policies.rules import SpeculationGuard

            self.step_policy = SpeculationGuard(self.policy)
        self._table = table
        self._bs_list = sorted(table)
        self._cuda_graph_bs: list[int] | None = None
        self._max_batch = int(self.policy.profile.max_batch_size)
        self._clock = clock
        self._active = int(initial_steps)  # the step count SGLang runs now
        self._version = 0  # verify results seen
        self._taus: tuple[float, ...] = ()  # the last verify's accepted drafts per request
        self._depth = 0  # the step count that verify ran with
        self._measure: tuple[int, int, float] | None = None  # (batch, tokens, seconds) of the last verify, unread
        self._last_verify_at: float | None = None
        self._decided: tuple[tuple[int, int], int] | None = None  # ((B, version), γ)
        #: (batch size, policy γ, step) of each decision computed (one per batch size and verify result; the most
        #: recent ones only in a long run), for reports
        self.decisions: list[tuple[int, int, int]] = []

    # ------------------------------------------------------------------ SGLang's AdaptiveSpecPolicy protocol
    @property
    def candidate_steps(self) -> list[int]:
        """The union of every slot's step counts, sorted: SGLang builds one runtime state for each."""
        return sorted({s for steps in self._table.values() for s in steps})

    def set_cuda_graph_bs(self, cuda_graph_bs: list[int] | None) -> None:
        """The batch sizes SGLang captures decode CUDA graphs for (None: CUDA graphs off); called once by
        ``AdaptiveController.init_states`` before any state is built."""
        self._cuda_graph_bs = sorted(cuda_graph_bs) if cuda_graph_bs else None

    def cuda_graph_bs_for_step(self, step: int) -> list[int] | None:
        """The captured batch sizes whose slot lists ``step`` (SGLang captures ``step``'s graphs at those only);
        None without CUDA graphs."""
        if self._cuda_graph_bs is None:
            return None
        return [v for v in self._cuda_graph_bs if step in self._table[self._slot_key(v)]]

    def get_steps_for_batch(self, batch_size: int) -> int:
        """The step count for a decode step of ``batch_size`` requests (SGLang: ``batch.seq_lens.shape[0]``, before
        drafting): the policy's γ snapped to the batch's slot's candidates."""
        step = self.decide(batch_size)
        self._active = step
        return step

    def on_verify_complete(self, num_correct_drafts_per_req: Sequence[int], batch_size: int,
                           num_steps: int | None = None) -> int | None:
        """Record a verify result and return the step count to switch to, or None to keep the current one.

        Args:
            num_correct_drafts_per_req: per request of the verified batch, its accepted draft tokens (0..steps, the
                bonus token excluded): SGLang passes a ``list[int]`` on the CPU. A list, tuple, numpy array or CPU
                tensor is read; an empty one is ignored (None), as SGLang's own policy does.
            batch_size: the verified batch's requests (SGLang: ``len(batch.reqs)``).
            num_steps: the step count the verify ran with, where the engine says it (later SGLang versions pass it);
                None: the step count this adapter last returned or was told (:meth:`on_state_activated`).

        Raises:
            TypeError: a tensor on a device other than the CPU (reading it would synchronise the device).
            ValueError: counts that are not finite numbers ≥ 0.
        """
        device = getattr(num_correct_drafts_per_req, "device", None)
        if device is not None and getattr(device, "type", str(device)) != "cpu":
            raise TypeError(f"on_verify_complete got a tensor on {device}: SGLang passes the accepted counts as a "
                            "CPU list (batch_result_processor); reading a device tensor here would synchronise it.")
        if hasattr(num_correct_drafts_per_req, "tolist"):
            num_correct_drafts_per_req = num_correct_drafts_per_req.tolist()
        acc = np.asarray(list(num_correct_drafts_per_req), dtype=np.float64).reshape(-1)
        if acc.size == 0:
            return None
        if not np.all(np.isfinite(acc)) or acc.min() < 0:
            raise ValueError(f"Accepted draft counts must be finite and ≥ 0, got {acc.tolist()}.")
        now = self._clock()
        seconds = 0.0 if self._last_verify_at is None else max(now - self._last_verify_at, 0.0)
        self._last_verify_at = now
        self._taus = tuple(acc.tolist())
        self._depth = int(self._active if num_steps is None else num_steps)
        self._measure = (int(batch_size), int(acc.sum()) + int(acc.size), seconds)
        self._version += 1
        step = self.decide(batch_size)
        if step == self._active:
            return None
        self._active = step
        return step

    def on_state_activated(self, steps: int) -> None:
        """The step count SGLang has just activated (called by later SGLang versions; kept in step here)."""
        self._active = int(steps)

    # ------------------------------------------------------------------ the learned decision
    def load_state(self, batch_size: int) -> Any:
        """The :class:`learn2draft.state.LoadState` the next decision at ``batch_size`` rows reads: the SGLang view of
        the module docstring (B capped at the profile's largest batch size for pricing). The last verify's
        measurement (``last_step_*``, for the guard) is carried by the first load state built after it only.

        Raises:
            ValueError: ``batch_size`` < 1.
        """
        from learn2draft.state import LoadState

        B = int(batch_size)
        if B < 1:
            raise ValueError(f"batch_size must be ≥ 1, got {batch_size!r}.")
        Bp = min(B, self._max_batch)  # the profile prices at most its largest batch; running_fraction caps at 1
        taus = self._taus or (0.0,)
        depths = (self._depth,) * len(taus) if self._taus else (0,)
        measured, self._measure = self._measure, None
        mb, mt, ms = measured if measured is not None else (0, 0, 0.0)
        return LoadState(batch_size=Bp, max_batch=self._max_batch, context_lens=(self.context_len,) * Bp, waiting=0,
                         last_taus=taus, last_depths=depths, draftable=(self.draftable,) * Bp,
                         tokens_left=(self.tokens_left * self.policy.max_new_tokens,) * Bp, max_depth=self.max_depth,
                         max_new_tokens=int(self.policy.max_new_tokens), last_step_batch=min(mb, self._max_batch),
                         last_step_tokens=mt, last_step_seconds=ms)

    def features(self, batch_size: int) -> np.ndarray:
        """float32 (len(SERVE_FEATURE_NAMES),): the observation the policy reads at ``batch_size`` rows now (does not
        consume the guard's measurement)."""
        saved = self._measure
        try:
            return self.policy.features(self.load_state(batch_size))
        finally:
            self._measure = saved

    def decide(self, batch_size: int) -> int:
        """The step count for ``batch_size`` requests: the policy's γ (behind the guard when on) for the current
        view, snapped to the slot's candidates; computed once per (batch size, verify result).

        Raises:
            ValueError: ``batch_size`` < 1.
        """
        B = int(batch_size)
        key = (B, self._version)
        if self._decided is not None and self._decided[0] == key:
            gamma = self._decided[1]
        else:
            gamma = int(self.step_policy.gamma(self.load_state(B)))
            self._decided = (key, gamma)
            self.decisions.append((B, gamma, snap_to_candidates(gamma, self.slot_candidates(B))))
            self._trim()
        return snap_to_candidates(gamma, self.slot_candidates(B))

    def slot_candidates(self, batch_size: int) -> list[int]:
        """The candidate step counts SGLang has states (and CUDA graphs) for at ``batch_size`` requests."""
        return self._table[self._slot_key(self._pad_to_cuda_graph_bs(int(batch_size)))]

    def summary(self) -> dict:
        """The policy folder, the candidate table, the step count active now, the recent decisions' steps counted
        per batch size (:attr:`decisions`), and the guard's :meth:`SpeculationGuard.summary` when on (for logs and reports)."""
        counts: dict[int, dict[int, int]] = {}
        for B, _, step in self.decisions:
            counts.setdefault(B, {}).setdefault(step, 0)
            counts[B][step] += 1
        out = {"policy": self.policy_dir, "candidates": self._table, "active_steps": self._active,
               "recent_steps_by_batch": counts}
        if self.step_policy is not self.policy:
            out["guard"] = self.step_policy.summary()
        return out

    # ------------------------------------------------------------------ internals
    def _pad_to_cuda_graph_bs(self, batch_size: int) -> int:
        if self._cuda_graph_bs is None:
            return batch_size
        i = bisect.bisect_left(self._cuda_graph_bs, batch_size)
        return self._cuda_graph_bs[i] if i < len(self._cuda_graph_bs) else batch_size

    def _slot_key(self, target: int) -> int:
        i = bisect.bisect_right(self._bs_list, target) - 1
        return self._bs_list[max(0, i)]

    def _trim(self) -> None:
        """Bound the per-decision reports of a long-running server."""
        for lst in (self.decisions, getattr(self.policy, "gammas", None), getattr(self.step_policy, "decisions", None)):
            if isinstance(lst, list) and len(lst) > 4 * _KEEP_REPORTS:
                del lst[:-_KEEP_REPORTS]

    @classmethod
    def from_sglang_config(cls, initial_steps: int, cfg_path: str | os.PathLike | None,
                           environ: Mapping[str, str] | None = None) -> LearnedAdaptiveSpecPolicy | None:
        """The adapter SGLang's ``AdaptiveSpeculativeParams(initial_steps=..., cfg_path=...)`` call should get: built
        from :func:`adapter_settings` and the config's candidate table; None when no learned policy is selected.

        Raises:
            PolicyFolderError: the selected folder cannot be used.
            ValueError, FileNotFoundError: a bad config (as :func:`read_adaptive_config` and :func:`adapter_settings`).
        """
        settings = adapter_settings(cfg_path, environ)
        if settings is None:
            return None
        _, table = read_adaptive_config(cfg_path)
        guard = settings.get("guard", False)
        if not isinstance(guard, bool):
            raise ValueError(f"{cfg_path}: {CONFIG_KEY}.guard must be true or false, got {guard!r}.")
        return cls(settings["policy"], table, initial_steps=initial_steps, guard=guard,
                   context_len=settings.get("context_len"), tokens_left=settings.get("tokens_left", 0.5),
                   draftable=settings.get("draftable"), profile=settings.get("profile"))

    def __repr__(self) -> str:
        guard = ", guard" if self.step_policy is not self.policy else ""
        return f"LearnedAdaptiveSpecPolicy({self.policy_dir!r}, candidates={self._table}{guard})"


__all__ = ["CONFIG_KEY", "ENV_GUARD", "ENV_POLICY", "LearnedAdaptiveSpecPolicy", "PolicyFolderError",
           "SGLANG_DEFAULT_CANDIDATES", "SGLANG_SOURCE", "SUPPORTED_SGLANG_VERSIONS", "adapter_settings",
           "read_adaptive_config", "snap_to_candidates"]
