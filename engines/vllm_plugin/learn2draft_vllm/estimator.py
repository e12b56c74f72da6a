"""The learned acceptance estimate, as vLLM's Model Runner V2 calls its acceptance estimator.

Interface (vLLM 0.34.0, commit 62d4bc3c7, ``vllm/v1/worker/gpu/spec_decode/speculator.py`` and
``acceptance_estimator.py``): ``BaseSpeculator.load_model`` builds ``OnlineAcceptanceEstimator(max_num_reqs,
num_speculative_steps, device)`` when ``speculative_config.enable_adaptive_verification`` is set and the drafter has
no confidence head; then, per engine step:

* ``observe_verification`` → ``step(idx_mapping, num_sampled, num_rejected)``, eagerly, before the next ``propose``:
  ``idx_mapping`` int ``[num_reqs]`` (persistent request slots), ``num_sampled`` int32 ``[num_reqs]`` (accepted
  drafts + 1 bonus), ``num_rejected`` int32 ``[num_reqs]`` (admitted drafts − accepted);
* ``sample_draft`` → ``_maybe_predict_acceptance`` → ``predict(logits, idx_mapping, draft_step, confidence_probs,
  temperature)`` **inside the captured draft CUDA graph**, once per draft position for autoregressive drafters
  (draft model, EAGLE, MTP: ``draft_step`` a 0-dim int64 tensor, one logits row per request) or once per block
  (DFlash2, Xpress: ``draft_step`` int ``[num_tokens]``, the ``num_speculative_steps`` rows of a request
  consecutive): ``logits`` ``[num_tokens, vocab]`` the draft's logits *before* temperature (model dtype),
  ``idx_mapping`` int ``[num_tokens]`` (−1 on CUDA-graph padding rows, possibly a strided view), ``confidence_probs``
  float32 ``[max_num_reqs, num_speculative_steps]`` (the speculator's ``draft_token_confidence_probs``, written at
  ``[batch row, draft step]``), ``temperature`` float32 ``[max_num_reqs]``;
* ``warmup()`` once after the kernels are warmed up (``vllm/v1/worker/gpu/warmup.py``).

The model runner then hands ``draft_token_confidence_probs[:num_reqs]`` to
``AdaptiveVerificationManager.record_confidences``, whose survival products rank the slots
(``assign_draft_token_budget``) and size the budget (``get_num_tokens``: expected accepted tokens per profiled ms).

:class:`LearnedAcceptance` is the part that runs in the captured graph: tensor operations only, no host
synchronisation (no ``.item()``, ``.cpu()``, data-dependent shapes or Python branches on tensor values), no
onnxruntime. Like vLLM's own feature, every feature describes the draft *distribution* at a position (and the
request's earlier positions), never the token drawn from it, so trimming never conditions on the trimmed token.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch

from learn2draft_vllm import ACCEPTANCE_FEATURES, FORMAT, MODEL_FILE, SPEC_FILE


class AcceptanceMLP(torch.nn.Module):
    """An exported acceptance graph as torch layers: Gemm layers with Tanh between them, the last one of width 1 (a
    logistic regression is a single Gemm). Weights are buffers (moved with ``.to(device)``, never trained here).

    Args:
        layers: ``[(weight float32 (out, in), bias float32 (out,)), …]`` as :func:`policies.vllm.load_mlp` reads them.

    Raises:
        ValueError: no layer, widths that do not chain, or a last layer wider than 1.
    """

    def __init__(self, layers: list[tuple[torch.Tensor, torch.Tensor]]):
        super().__init__()
        if not layers:
            raise ValueError("An acceptance model needs at least one Gemm layer.")
        for (w, _), (w2, _) in zip(layers, layers[1:]):
            if w2.shape[1] != w.shape[0]:
                raise ValueError(f"Layer widths do not chain: {tuple(w.shape)} then {tuple(w2.shape)}.")
        if layers[-1][0].shape[0] != 1:
            raise ValueError(f"The last layer must have one output (the log-odds of acceptance), not "
                             f"{layers[-1][0].shape[0]}.")
        self.num_layers = len(layers)
        self.in_features = int(layers[0][0].shape[1])
        for i, (w, b) in enumerate(layers):
            self.register_buffer(f"weight{i}", w.detach().to(torch.float32).clone())
            self.register_buffer(f"bias{i}", b.detach().to(torch.float32).clone())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """float32 ``(N, in_features)`` features → float32 ``(N,)`` log-odds of acceptance."""
        for i in range(self.num_layers):
            x = x @ getattr(self, f"weight{i}").T + getattr(self, f"bias{i}")
            if i < self.num_layers - 1:
                x = torch.tanh(x)
        return x[:, 0]


class AcceptanceModel:
    """An acceptance model folder (``python -m learn2draft_vllm export-acceptance --out DIR``): ``acceptance.onnx``
    (input ``features`` float32 (N, 6), output ``logit`` float32 (N, 1)), ``acceptance_spec.json`` (format, features,
    ``max_depth`` D the depth feature is scaled by, ``vocab_size`` V the entropy is scaled by, the traces it was fitted
    on) and ``parity.json`` (features → logits, to check a runtime).

    Attributes:
        path: the folder; spec: the parsed ``acceptance_spec.json``; layers: the graph's float32 (weight, bias) layers;
        max_depth: D; vocab_size: V.

    Raises:
        FileNotFoundError: a missing folder or file.
        ValueError: another format, other features than :data:`learn2draft_vllm.ACCEPTANCE_FEATURES`, or a graph
            that is not a Gemm/Tanh MLP of that input width and one output (the message names the file).
    """

    def __init__(self, path: str | Path):
        from policies.vllm import load_mlp

        d = Path(path)
        if not d.is_dir():
            raise FileNotFoundError(f"{d} is not a folder: pass an acceptance model written by `python -m "
                                    "learn2draft_vllm export-acceptance --out DIR`.")
        for name in (MODEL_FILE, SPEC_FILE):
            if not (d / name).is_file():
                raise FileNotFoundError(f"{d / name} is missing: is {d} an acceptance model (export-acceptance --out)?")
        spec = json.loads((d / SPEC_FILE).read_text())
        names = [f.get("name") for f in spec.get("features", [])]
        if spec.get("format") != FORMAT or names != list(ACCEPTANCE_FEATURES):
            raise ValueError(f"{d / SPEC_FILE}: format {spec.get('format')!r} with features {names}; this plugin reads "
                             f"{FORMAT!r} with {list(ACCEPTANCE_FEATURES)}: re-export with this version.")
        self.max_depth, self.vocab_size = int(spec["max_depth"]), int(spec["vocab_size"])
        if self.max_depth < 1 or self.vocab_size < 2:
            raise ValueError(f"{d / SPEC_FILE}: max_depth {self.max_depth} and vocab_size {self.vocab_size} must be "
                             "≥ 1 and ≥ 2.")
        self.layers = load_mlp(d / MODEL_FILE)
        try:
            AcceptanceMLP(self.layers)
        except ValueError as e:
            raise ValueError(f"{d / MODEL_FILE}: {e}") from None
        if self.layers[0][0].shape[1] != len(ACCEPTANCE_FEATURES):
            raise ValueError(f"{d / MODEL_FILE} reads {self.layers[0][0].shape[1]} features, not "
                             f"{len(ACCEPTANCE_FEATURES)}.")
        self.path, self.spec = d, spec

    def module(self) -> AcceptanceMLP:
        """A new :class:`AcceptanceMLP` of this model (on the CPU)."""
        return AcceptanceMLP(self.layers)

    def __repr__(self) -> str:
        return f"AcceptanceModel(path={str(self.path)!r}, max_depth={self.max_depth}, vocab_size={self.vocab_size})"


class LearnedAcceptance(torch.nn.Module):
    """The graph-capturable body of ``predict``: from the draft's logits to per-slot acceptance probabilities.

    Per logits row (request slot ``s``, draft position ``k``, 0-based), with ``q = softmax(logits)`` (raw: no
    temperature, as this project's traces record the draft's distribution): ``depth`` (k + 1) / D,
    ``draft_confidence`` max q, ``draft_entropy`` H(q) / ln V, ``draft_margin`` max q − second q,
    ``cum_confidence`` and ``mean_confidence`` the product and mean of ``draft_confidence`` over positions 0..k of
    slot ``s`` (earlier positions kept in :attr:`top1` by earlier calls of the same ``propose``, or by this call for
    block drafters), each clipped to [0, 1] as in training; the acceptance probability is σ(MLP(features)).

    Args:
        mlp: the acceptance model's layers (:class:`AcceptanceMLP`).
        max_num_reqs: vLLM's persistent request slots (``max_num_seqs``).
        num_speculative_steps: vLLM's ``num_speculative_tokens`` S (≤ the model's ``max_depth``).
        max_depth: D, the model's depth scale; vocab_size: V, its entropy scale.

    Attributes (buffers, float32, rows = request slots, row ``max_num_reqs`` the sink of padding rows):
        top1: ``(max_num_reqs + 1, S)`` the draft's max probability per slot and position.
        predictions: ``(max_num_reqs + 1, S)`` the acceptance probability predicted per slot and position.

    Raises:
        ValueError: S > D (the model never saw those depths), S or ``max_num_reqs`` < 1.
    """

    def __init__(self, mlp: AcceptanceMLP, max_num_reqs: int, num_speculative_steps: int, max_depth: int,
                 vocab_size: int):
        super().__init__()
        if max_num_reqs < 1 or num_speculative_steps < 1:
            raise ValueError(f"Need max_num_reqs ≥ 1 and num_speculative_steps ≥ 1, got {max_num_reqs} and "
                             f"{num_speculative_steps}.")
        if num_speculative_steps > max_depth:
            raise ValueError(f"num_speculative_tokens={num_speculative_steps}, but the acceptance model was fitted on "
                             f"chains of at most {max_depth} tokens: record traces with --max-depth ≥ "
                             f"{num_speculative_steps} and re-export, or serve with num_speculative_tokens ≤ {max_depth}.")
        self.mlp = mlp
        self.max_num_reqs, self.num_steps = int(max_num_reqs), int(num_speculative_steps)
        self.max_depth, self.vocab_size = int(max_depth), int(vocab_size)
        self.register_buffer("top1", torch.zeros(max_num_reqs + 1, num_speculative_steps))
        self.register_buffer("predictions", torch.zeros(max_num_reqs + 1, num_speculative_steps))
        self.register_buffer("steps", torch.arange(num_speculative_steps))

    def features(self, logits: torch.Tensor, slot: torch.Tensor, step: torch.Tensor) -> torch.Tensor:
        """float32 ``(N, 6)`` features (:data:`learn2draft_vllm.ACCEPTANCE_FEATURES`) of ``logits`` ``(N, V)`` at
        slots ``slot`` int64 ``(N,)`` (padding rows already sent to the sink row) and positions ``step`` int64
        ``(N,)``; records each row's max probability in :attr:`top1` (the chain features read it)."""
        logp = torch.log_softmax(logits.float(), dim=-1)
        q = logp.exp()
        top2 = q.topk(2, dim=-1).values
        conf = top2[:, 0]
        entropy = -torch.where(q > 0, q * logp, torch.zeros_like(q)).sum(dim=-1) / math.log(self.vocab_size)
        self.top1.index_put_((slot, step), conf)
        upto = self.steps[None, :] <= step[:, None]
        rows = self.top1[slot]
        cum = torch.where(upto, rows, torch.ones_like(rows)).prod(dim=-1)
        mean = torch.where(upto, rows, torch.zeros_like(rows)).sum(dim=-1) / (step + 1).float()
        depth = (step + 1).float() / self.max_depth
        x = torch.stack([depth, conf, entropy, top2[:, 0] - top2[:, 1], cum, mean], dim=-1)
        return x.clamp(0.0, 1.0)

    def forward(self, logits: torch.Tensor, idx_mapping: torch.Tensor, draft_step: torch.Tensor,
                confidence_probs: torch.Tensor) -> torch.Tensor:
        """Write the acceptance probabilities of ``logits``' rows into ``confidence_probs`` and :attr:`predictions`.

        Args:
            logits: ``(N, V)`` the draft's raw logits, any float dtype.
            idx_mapping: int ``(N,)`` request slot per row, −1 on padding rows (left untouched).
            draft_step: 0-dim int (one position for every row; batch row = row) or int ``(N,)`` (one per row; rows
                grouped S per request, batch row = row // S).
            confidence_probs: float32 ``(rows ≥ batch rows, S)``, written in place at ``[batch row, position]``.

        Returns:
            float32 ``(N,)`` the probabilities (padding rows included; they are written nowhere but the sink row).
        """
        n = logits.shape[0]
        idx = idx_mapping.long()
        valid = idx >= 0
        slot = torch.where(valid, idx, torch.full_like(idx, self.max_num_reqs))
        rows = torch.arange(n, device=logits.device)
        if draft_step.dim() > 0:
            step, batch = draft_step.long(), rows // self.num_steps
        else:
            step, batch = draft_step.long().expand(n), rows
        batch = batch.clamp(max=confidence_probs.shape[0] - 1)
        prob = torch.sigmoid(self.mlp(self.features(logits, slot, step)))
        self.predictions.index_put_((slot, step), prob)
        old = confidence_probs[batch, step]
        confidence_probs.index_put_((batch, step), torch.where(valid, prob, old).to(confidence_probs.dtype))
        return prob


class LearnedAcceptanceEstimator:
    """Drop-in for vLLM 0.34.0's ``OnlineAcceptanceEstimator`` (same constructor and methods, see the module
    docstring) whose ``predict`` is :class:`LearnedAcceptance` for the model bound with :meth:`bind`. It does not
    refit: ``step`` only counts, per draft position, the verified slots, their predicted and their observed
    acceptance (:meth:`calibration`), with vLLM's own definition of an observed slot (accepted, or the first
    rejected one among the admitted). ``needs_full_verification`` is False: trimming starts at once.

    Args:
        max_num_reqs, num_speculative_steps, device: as vLLM passes them.

    Raises:
        RuntimeError: the class was not bound to a model (:meth:`bind`).
        ValueError: as :class:`LearnedAcceptance`.
    """

    model: AcceptanceModel | None = None
    needs_full_verification = False

    @classmethod
    def bind(cls, model: AcceptanceModel) -> type[LearnedAcceptanceEstimator]:
        """A subclass whose instances use ``model`` (what the plugin puts in vLLM's place)."""
        return type(cls.__name__, (cls,), {"model": model, "__doc__": cls.__doc__})

    def __init__(self, max_num_reqs: int, num_speculative_steps: int, device: torch.device | str):
        if self.model is None:
            raise RuntimeError("LearnedAcceptanceEstimator has no acceptance model: use LearnedAcceptanceEstimator."
                               "bind(AcceptanceModel(DIR)) (the plugin does, from $LEARN2DRAFT_VLLM_ACCEPTANCE_MODEL).")
        self.num_speculative_steps, self.device = int(num_speculative_steps), torch.device(device)
        self.module = LearnedAcceptance(self.model.module(), max_num_reqs, num_speculative_steps,
                                        self.model.max_depth, self.model.vocab_size).to(self.device)
        self.observed = torch.zeros(num_speculative_steps, device=self.device)
        self.predicted = torch.zeros(num_speculative_steps, device=self.device)
        self.accepted = torch.zeros(num_speculative_steps, device=self.device)

    @property
    def predictions(self) -> torch.Tensor:
        """float32 ``(max_num_reqs + 1, S)``: the last predicted acceptance per slot and position (the last row is
        the padding sink)."""
        return self.module.predictions

    def predict(self, logits: torch.Tensor, idx_mapping: torch.Tensor, draft_step: torch.Tensor,
                confidence_probs: torch.Tensor, temperature: torch.Tensor) -> None:
        """vLLM's ``predict`` (inside the captured draft graph): writes ``confidence_probs[batch row, position]``.
        ``temperature`` is accepted and not read: the model was fitted on the draft's raw distribution at the
        sampling settings of its traces (record them at the temperature you serve)."""
        self.module(logits, idx_mapping, draft_step, confidence_probs)

    def step(self, idx_mapping: torch.Tensor, num_sampled: torch.Tensor, num_rejected: torch.Tensor) -> None:
        """vLLM's ``step`` (eager, after verification): fold the verdicts on the last drafts into the calibration
        counts. Tensor operations only."""
        idx = idx_mapping.long().clamp(min=0)
        accepted = (num_sampled.long() - 1).clamp(min=0)
        admitted = accepted + num_rejected.long()
        steps = self.module.steps[None, :]
        observed = (steps <= accepted[:, None]) & (steps < admitted[:, None])
        pred = self.module.predictions[idx]
        self.observed += observed.float().sum(dim=0)
        self.predicted += torch.where(observed, pred, torch.zeros_like(pred)).sum(dim=0)
        self.accepted += (observed & (steps < accepted[:, None])).float().sum(dim=0)

    def warmup(self) -> None:
        """vLLM's ``warmup`` (after the dummy runs): drop what they counted."""
        for t in (self.observed, self.predicted, self.accepted):
            t.zero_()

    def calibration(self) -> list[dict]:
        """Per draft position since the last :meth:`warmup`: ``observed`` verified slots, ``predicted`` their mean
        predicted acceptance, ``accepted`` their observed acceptance rate (None without observations). Copies to the
        host: a diagnostic, not for the serving path."""
        obs, pred, acc = (t.cpu().tolist() for t in (self.observed, self.predicted, self.accepted))
        return [{"position": k, "observed": int(o), "predicted": (p / o if o else None), "accepted": (a / o if o else None)}
                for k, (o, p, a) in enumerate(zip(obs, pred, acc))]


__all__ = ["AcceptanceMLP", "AcceptanceModel", "LearnedAcceptance", "LearnedAcceptanceEstimator"]
