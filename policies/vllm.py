"""A learned draft-length policy for vLLM: :class:`LearnedDraftLengthPolicy` satisfies the
``DraftLengthPolicy`` protocol of ``vllm/v1/spec_decode/draft_length_policy.py``.

The protocol (as published in vLLM's source; an open pull request at the time of writing — check
the vLLM version you run): the proposer calls ``reset()`` at the start of each ``propose()``,
drafts a *seed* token, then after each further draft token calls ``update(step, token_probs)``
with ``step`` the zero-based index of that token after the seed and ``token_probs`` float
``[batch_size]`` the draft's top-1 softmax probability per sequence; after the K steps it reads
``k_valid_gpu``, an int32 scalar on the device: the number of valid draft tokens (seed
included) for the whole batch, or None for "always K". vLLM's own ``ConfidenceThresholdPolicy``
freezes ``k_valid`` to ``step + 2`` the first time the batch's mean probability falls below a
threshold; this class does the same with a learned decision.

The policy must be trained on engine-visible features only
(:data:`learn2draft.features.ENGINE_FEATURE_NAMES`: ``python -m train --features engine``); its
export is read into a small torch MLP on the engine's device, so ``update`` runs tensor operations
only, with no device-to-host synchronisation per draft step. Batches use the mean of
``token_probs`` (one ``k_valid`` for the batch, as the protocol defines it).

What is tested here without vLLM (it cannot be installed on this CPU-only machine: its wheels need
a CUDA torch): shapes and dtypes, ``k_valid`` frozen at the first stop, equality of every decision
with the exported ONNX graph run by onnxruntime on the same features, and the adapter driven
through the protocol by :class:`ProtocolController` in this project's own decoding loop. Untested:
vLLM's proposer calling it (import path, ``step`` semantics of the merged version, CUDA graphs).

A load-aware policy (``python -m train --serve-loads``) maps onto vLLM's per-batch-size schedule
(``speculative_config["num_speculative_tokens_per_batch_size"]``, PR #32374): the γ it chooses most often at each
batch size in replay becomes the schedule (:func:`vllm_schedule`, written by the run as
``policy/vllm_schedule.json``), read by vLLM as :func:`vllm_scheduled_k` emulates. What the schedule cannot carry is
the policy's reaction to anything but the batch size (contexts, drafted matches, queue).

Example (inside vLLM's proposer, where it builds its policy)::

    from policies.vllm import LearnedDraftLengthPolicy
    policy = LearnedDraftLengthPolicy("policies/defaults/model-engine", device, num_speculative_tokens)
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch

from learn2draft.decoding import DraftController
from learn2draft.features import (
    ENGINE_FEATURE_NAMES,
    ENGINE_FEATURE_VERSION,
    ENGINE_HISTORY,
    ENGINE_MIN_DEPTH,
)


def load_mlp(onnx_path: str | Path) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The (weight (out, in), bias (out,)) float32 layers of an exported policy graph: Gemm layers
    with Tanh between them (stable-baselines3's MlpPolicy actor, see :mod:`policies.export`).

    Raises:
        ValueError: the graph is not such an MLP (hand-edited, or another exporter).
    """
    import onnx
    from onnx import numpy_helper

    model = onnx.load(str(onnx_path))
    init = {t.name: numpy_helper.to_array(t) for t in model.graph.initializer}
    layers, acts = [], []
    for node in model.graph.node:
        if node.op_type == "Gemm":
            attrs = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
            if attrs.get("transB", 0) != 1 or attrs.get("alpha", 1.0) != 1.0 or attrs.get("beta", 1.0) != 1.0:
                raise ValueError(f"{onnx_path}: unexpected Gemm attributes {attrs}.")
            w, b = init[node.input[1]], init[node.input[2]]
            layers.append((torch.tensor(w, dtype=torch.float32), torch.tensor(b, dtype=torch.float32)))
        elif node.op_type == "Tanh":
            acts.append(len(layers))
        elif node.op_type not in ("Cast", "Flatten", "ArgMax"):
            raise ValueError(f"{onnx_path}: unsupported operator {node.op_type} (expected a Gemm/Tanh MLP).")
    if not layers or acts != list(range(1, len(layers))):
        raise ValueError(f"{onnx_path}: expected Gemm layers with a Tanh after every one but the last.")
    return layers


class LearnedDraftLengthPolicy:
    """vLLM ``DraftLengthPolicy`` driven by an engine-visible policy export.

    Args:
        export_dir: a policy export (or training run) trained with ``--features engine``.
        device: where the engine keeps its tensors (``token_probs``' device).
        num_spec_tokens: vLLM's ``num_speculative_tokens`` K; must equal the policy's ``max_depth``
            (the scale of its depth feature). None: take the policy's.

    Raises:
        FileNotFoundError: missing export files.
        ValueError: the export reads other features than :data:`ENGINE_FEATURE_NAMES`, K differs or is
            not an integer.
        learn2draft.ModelLoadError: ``device`` is unknown or not available in this torch build.
    """

    def __init__(self, export_dir: str | Path, device: str | torch.device = "cpu", num_spec_tokens: int | None = None):
        from policies.layout import FEATURE_SPEC_FILE, ONNX_FILE, POLICY_CONFIG_FILE, resolve_export_dir

        d = resolve_export_dir(export_dir)
        for name in (ONNX_FILE, FEATURE_SPEC_FILE, POLICY_CONFIG_FILE):
            if not (d / name).is_file():
                raise FileNotFoundError(f"{d / name} is missing: is {d} a policy export?")
        spec = json.loads((d / FEATURE_SPEC_FILE).read_text())
        names = [f["name"] for f in spec.get("features", [])]
        if spec.get("kind") != "engine" or names != list(ENGINE_FEATURE_NAMES) or \
                spec.get("version") != ENGINE_FEATURE_VERSION:
            raise ValueError(f"{d} reads the features {names}, not the engine-visible ones {list(ENGINE_FEATURE_NAMES)}: "
                             "train a policy for vLLM with `python -m train --features engine`.")
        self.max_depth = int(json.loads((d / POLICY_CONFIG_FILE).read_text())["max_depth"])
        if num_spec_tokens is not None and (isinstance(num_spec_tokens, bool) or not isinstance(num_spec_tokens, int)):
            raise ValueError(f"num_spec_tokens must be an integer (vLLM's num_speculative_tokens), got {num_spec_tokens!r}.")
        k = self.max_depth if num_spec_tokens is None else num_spec_tokens
        if k != self.max_depth:
            raise ValueError(f"num_speculative_tokens={k}, but the policy in {d} was trained with max_depth="
                             f"{self.max_depth}: serve with num_speculative_tokens={self.max_depth} or train for {k}.")
        self.num_spec_tokens = k
        from learn2draft.models import check_device

        self.device = check_device(device)  # a clear error for an unknown device or a CUDA device without CUDA
        self.layers = [(w.to(self.device), b.to(self.device)) for w, b in load_mlp(d / ONNX_FILE)]
        self.path = d
        f32 = dict(dtype=torch.float32, device=self.device)
        self._k_valid = torch.tensor(k, dtype=torch.int32, device=self.device)
        self._exited = torch.tensor(False, device=self.device)
        self._hist = torch.zeros(ENGINE_HISTORY, **f32)  # newest first
        self._sum = torch.zeros((), **f32)
        self._min = torch.ones((), **f32)
        self._prod = torch.ones((), **f32)
        # Built once: update() indexes them by step instead of copying host values to the device each step.
        self._depth_feature = ((torch.arange(k, **f32) + ENGINE_MIN_DEPTH) / self.max_depth).reshape(-1, 1)
        self._hist_slots = torch.arange(ENGINE_HISTORY, device=self.device)

    def reset(self) -> None:
        """Start of a ``propose()``: k_valid = K, nothing seen."""
        self._k_valid.fill_(self.num_spec_tokens)
        self._exited.fill_(False)
        self._hist.zero_()
        self._sum.zero_()
        self._min.fill_(1.0)
        self._prod.fill_(1.0)

    def features(self, step: int) -> torch.Tensor:
        """float32 ``(len(ENGINE_FEATURE_NAMES),)`` on the device after ``update(step, …)``; the same
        vector as :func:`learn2draft.features.build_engine_features` (tested)."""
        n = step + 1  # probabilities seen (tokens after the seed)
        hist = self._hist * (self._hist_slots < n)
        vec = torch.cat([self._depth_feature[step], hist, (self._sum / n).reshape(1), self._min.reshape(1), self._prod.reshape(1)])
        return vec.clamp(0.0, 1.0)

    def logits(self, features: torch.Tensor) -> torch.Tensor:
        """float32 ``(..., 2)`` logits (0 = STOP, 1 = CONTINUE) of the exported MLP."""
        x = features
        for i, (w, b) in enumerate(self.layers):
            x = x @ w.T + b
            if i < len(self.layers) - 1:
                x = torch.tanh(x)
        return x

    def update(self, step: int, token_probs: torch.Tensor) -> None:
        """After draft step ``step`` (0 = the first token after the seed): ``token_probs`` float
        ``[batch_size]`` top-1 draft probabilities on the device. Tensor operations only (no sync).
        On the first STOP, ``k_valid`` is frozen to ``step + 2`` (seed + tokens up to this one).

        Raises:
            TypeError: ``token_probs`` is not a floating-point tensor.
            ValueError: an empty batch, or ``step`` outside [0, K − 1).
        """
        if not isinstance(token_probs, torch.Tensor) or not token_probs.is_floating_point():
            raise TypeError(f"token_probs must be a floating-point tensor [batch_size] of top-1 draft probabilities, got "
                            f"{type(token_probs).__name__}{'' if not isinstance(token_probs, torch.Tensor) else ' ' + str(token_probs.dtype)}.")
        if token_probs.numel() == 0:
            raise ValueError("token_probs is empty: update() needs one probability per sequence of the batch.")
        if isinstance(step, bool) or not isinstance(step, int) or not 0 <= step < self.num_spec_tokens - 1:
            raise ValueError(f"step must be an integer in [0, {self.num_spec_tokens - 1}) (the draft step after the seed), "
                             f"got {step!r}.")
        # NaN (a broken draft) counts as no confidence: the policy sees 0, not NaN features.
        p = token_probs.to(device=self.device, dtype=torch.float32).nan_to_num(0.0).mean().clamp(0.0, 1.0)
        self._hist.copy_(torch.cat([p.reshape(1), self._hist[:-1]]))
        self._sum.add_(p)
        self._min.copy_(torch.minimum(self._min, p))
        self._prod.mul_(p)
        logits = self.logits(self.features(step))
        stop = logits[0] >= logits[1]  # ONNX ArgMax returns the first index on a tie: STOP
        self._k_valid.masked_fill_(stop & ~self._exited, step + ENGINE_MIN_DEPTH)
        self._exited.logical_or_(stop)

    @property
    def k_valid_gpu(self) -> torch.Tensor:
        """int32 scalar on the device: valid draft tokens (seed included) for this ``propose()``."""
        return self._k_valid

    def __repr__(self) -> str:
        return f"LearnedDraftLengthPolicy(path={str(self.path)!r}, num_spec_tokens={self.num_spec_tokens})"


class ProtocolController(DraftController):
    """Drive a ``DraftLengthPolicy`` (``reset`` / ``update`` / ``k_valid_gpu``) inside this project's
    :class:`~learn2draft.SpeculativeDecoder` exactly as vLLM's proposer does, to test and evaluate
    engine policies on the real loop: the seed and the first token after it are always drafted;
    ``update(step, [top-1 probability])`` follows every further token; drafting stops once
    ``k_valid`` is frozen at the current depth. (``k_valid`` is read each step here — a host sync
    the engine defers — which changes nothing in the decisions.)

    Args:
        policy: a ``DraftLengthPolicy``; its ``num_spec_tokens`` is this controller's ``max_depth``.
        decoder: the decoder it drives (its draft confidences are the top-1 probabilities).
    """

    def __init__(self, policy, decoder):
        self.policy = policy
        self.decoder = decoder
        self.max_depth = int(policy.num_spec_tokens)
        self.depth_feature_scale = self.max_depth
        self.k_valid: list[int] = []  # per cycle, for tests and reports

    def continue_drafting(self, features: np.ndarray) -> bool:
        depth = self.decoder.depth
        if depth == 0:
            self.policy.reset()
            return True
        if depth < ENGINE_MIN_DEPTH:
            return True
        step = depth - ENGINE_MIN_DEPTH
        probs = torch.tensor([self.decoder.confidences[-1]], dtype=torch.float32)
        self.policy.update(step, probs)
        k = self.policy.k_valid_gpu
        k = self.max_depth if k is None else int(k)
        if k <= depth:
            self.k_valid.append(k)
            return False
        return True

    def __repr__(self) -> str:
        return f"ProtocolController({self.policy!r})"


# ------------------------------------------------------------------ a load-aware policy as vLLM's per-batch-size schedule
def vllm_scheduled_k(schedule, batch_size: int, num_speculative_tokens: int) -> int:
    """The K vLLM speculates at ``batch_size`` under ``num_speculative_tokens_per_batch_size`` = ``schedule``, as the
    merged PR #32374 documents it: range keys ``"start-end"`` (or ``"bs"``) are inclusive; a batch size in no range
    inherits the K of the closest range below it (past the last range: the last K); the scheduled K is clamped to
    ``min(num_speculative_tokens, K)``. Below every range (which the PR leaves unsaid, and which
    :func:`vllm_schedule` never writes) this returns ``num_speculative_tokens``.

    Args:
        schedule: ``{"start-end": K, …}`` (JSON's form) or vLLM's list form ``[[start, end, K], …]``.

    Raises:
        ValueError: a malformed key or K (the message names it).
    """
    rows = []
    items = schedule.items() if isinstance(schedule, dict) else ((f"{a}-{b}", k) for a, b, k in schedule)
    for key, k in items:
        parts = str(key).split("-")
        try:
            lo, hi, k = int(parts[0]), int(parts[-1]), int(k)
        except ValueError:
            raise ValueError(f"num_speculative_tokens_per_batch_size key {key!r}: expected 'start-end' or 'bs' with an "
                             f"integer K, got K={k!r}.") from None
        if len(parts) > 2 or lo < 1 or hi < lo or k < 0:
            raise ValueError(f"num_speculative_tokens_per_batch_size entry {key!r}: {k!r} is not a range 1 ≤ start ≤ "
                             "end with K ≥ 0.")
        rows.append((lo, hi, k))
    below = [k for lo, _, k in sorted(rows) if lo <= batch_size]
    return min(int(num_speculative_tokens), below[-1]) if below else int(num_speculative_tokens)


def vllm_schedule(gammas_by_batch: dict[int, int]) -> dict[str, int]:
    """``num_speculative_tokens_per_batch_size`` (vLLM's JSON form, ``{"start-end": K}``) from a γ per measured batch
    size: level b_i covers b_{i−1}+1 … b_i (the first from 1; larger batches inherit the last, as vLLM does).

    Raises:
        ValueError: no batch size, or one below 1.
    """
    sizes = sorted(int(b) for b in gammas_by_batch)
    if not sizes or sizes[0] < 1:
        raise ValueError(f"gammas_by_batch needs batch sizes ≥ 1, got {sizes}.")
    out, prev = {}, 0
    for b in sizes:
        out[f"{prev + 1}-{b}"] = int(gammas_by_batch[b])
        prev = b
    return out


__all__ = ["LearnedDraftLengthPolicy", "ProtocolController", "load_mlp", "vllm_schedule", "vllm_scheduled_k"]
