"""vLLM integration of learned policies, three paths:

* **The zero-code path** (merged vLLM, tested against vLLM 0.34.0's source): a load-aware policy
  (``python -m train --serve-loads``) exported as ``speculative_config["num_speculative_tokens_per_batch_size"]``.
  :func:`vllm_schedule` keeps the γ the policy picks most at each batch size in replay (written by the run as
  ``policy/vllm_schedule.json``), :func:`vllm_config_schedule` turns it into the list of ``[start, end, K]`` that
  vLLM 0.34.0 accepts (``vllm/v1/spec_decode/dynamic/utils.py``: ``validate_and_normalize_dynamic_sd_schedule``; its
  ``SpeculativeConfig`` field is ``list[tuple[int, int, int]]``, so the ``{"start-end": K}`` form of
  ``vllm_schedule.json`` is refused by it), :func:`vllm_scheduled_k` reads a schedule as vLLM's dense lookup does,
  and ``python -m policies.vllm export-table POLICY_DIR --out FILE`` writes and prints a ready ``speculative_config``.
  What the table cannot carry is the policy's reaction to anything but the batch size (contexts, drafted matches,
  queue).
* **A learned acceptance estimate for adaptive verification** (merged vLLM, Model Runner V2): the plugin package in
  ``engines/vllm_plugin`` (``learn2draft_vllm``); it reads exported MLPs with :func:`load_mlp`.
* **An UNMERGED protocol**: :class:`LearnedDraftLengthPolicy` implements the ``DraftLengthPolicy`` protocol of vLLM
  pull request #35301, which was never merged: no released vLLM calls it. It is kept for that protocol only, tested
  against the protocol's documented behaviour and in this project's own loop (:class:`ProtocolController`).

The #35301 protocol (``vllm/v1/spec_decode/draft_length_policy.py`` in that pull request only): the proposer calls
``reset()`` at the start of each ``propose()``, drafts a *seed* token, then after each further draft token calls
``update(step, token_probs)`` with ``step`` the zero-based index of that token after the seed and ``token_probs``
float ``[batch_size]`` the draft's top-1 softmax probability per sequence; after the K steps it reads
``k_valid_gpu``, an int32 scalar on the device: the number of valid draft tokens (seed included) for the whole
batch, or None for "always K". That pull request's ``ConfidenceThresholdPolicy`` freezes ``k_valid`` to
``step + 2`` the first time the batch's mean probability falls below a threshold; :class:`LearnedDraftLengthPolicy`
does the same with a learned decision, for a policy trained on engine-visible features only
(:data:`learn2draft.features.ENGINE_FEATURE_NAMES`: ``python -m train --features engine``), its export read into a
small torch MLP on the engine's device (tensor operations only in ``update``, no device-to-host synchronisation per
draft step).

Example (where a vLLM build carrying pull request #35301 builds its policy)::

    from policies.vllm import LearnedDraftLengthPolicy
    policy = LearnedDraftLengthPolicy("policies/defaults/model-engine", device, num_speculative_tokens)
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from learn2draft.decoding import DraftController
from learn2draft.features import (
    ENGINE_FEATURE_NAMES,
    ENGINE_FEATURE_VERSION,
    ENGINE_HISTORY,
    ENGINE_MIN_DEPTH,
)
from learn2draft.state import DraftState


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
    """The ``DraftLengthPolicy`` protocol of vLLM pull request #35301 (**an unmerged protocol**: no released vLLM
    calls it; vLLM merged adaptive verification instead, see ``engines/vllm_plugin``), driven by an engine-visible
    policy export. Tested against the protocol's documented behaviour and in this project's loop, never inside vLLM.

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
    """Drive a ``DraftLengthPolicy`` of the unmerged vLLM pull request #35301 (``reset`` / ``update`` /
    ``k_valid_gpu``) inside this project's
    :class:`~learn2draft.SpeculativeDecoder` exactly as vLLM's proposer does, to test and evaluate
    engine policies on the real loop: the seed and the first token after it are always drafted;
    ``update(step, [top-1 probability])`` follows every further token; drafting stops once
    ``k_valid`` is frozen at the current depth. (``k_valid`` is read each step here — a host sync
    the engine defers — which changes nothing in the decisions.)

    Args:
        policy: a ``DraftLengthPolicy``; its ``num_spec_tokens`` is this controller's ``max_depth``.
        decoder: the decoder it drives; each decision reads that decoder's :class:`learn2draft.state.DraftState`
            (``state.depth``, and ``state.confidences``: the draft's top-1 probabilities).
    """

    def __init__(self, policy, decoder):
        self.policy = policy
        self.decoder = decoder
        self.max_depth = int(policy.num_spec_tokens)
        self.depth_feature_scale = self.max_depth
        self.k_valid: list[int] = []  # per cycle, for tests and reports

    def decide(self, state: DraftState) -> bool:
        depth = state.depth
        if depth == 0:
            self.policy.reset()
            return True
        if depth < ENGINE_MIN_DEPTH:
            return True
        step = depth - ENGINE_MIN_DEPTH
        probs = torch.tensor([state.confidences[-1]], dtype=torch.float32)
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
    """The K vLLM speculates at ``batch_size`` under ``num_speculative_tokens_per_batch_size`` = ``schedule``, as
    vLLM 0.34.0's ``build_dynamic_sd_schedule_lookup`` (``vllm/v1/spec_decode/dynamic/utils.py``, from PR #32374)
    expands it: ranges are inclusive; a batch size in no range inherits the K of the closest range below it (past the
    last range: the last K); the scheduled K is clamped to ``min(num_speculative_tokens, K)``. Below every range
    (which vLLM refuses: its first range must start at 1, and :func:`vllm_schedule` always starts there) this
    returns ``num_speculative_tokens``.

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


#: The ``speculative_config["method"]`` of this project's drafters that vLLM has (``lookup``: vLLM's n-gram prompt
#: lookup; ``model``: a separate draft model). The others (the EAGLE-style head, hybrids) have no vLLM equivalent.
VLLM_METHODS = {"lookup": "ngram", "model": "draft_model"}


def vllm_config_schedule(schedule) -> list[list[int]]:
    """``num_speculative_tokens_per_batch_size`` in the form vLLM 0.34.0 accepts: a list of ``[start, end, K]``
    (inclusive batch-size ranges, sorted), checked as vLLM's ``validate_and_normalize_dynamic_sd_schedule``
    (``vllm/v1/spec_decode/dynamic/utils.py``) checks it: 1 ≤ start ≤ end, K ≥ 0, ranges not overlapping, the first
    one starting at 1.

    Args:
        schedule: ``{"start-end": K, …}`` (``vllm_schedule.json``'s form, :func:`vllm_schedule`) or ``[[start, end,
            K], …]``.

    Returns:
        list of ``[start, end, K]`` (Python ints), sorted by start.

    Raises:
        ValueError: an empty or malformed schedule, or one vLLM would refuse (the message says which entry).
    """
    if isinstance(schedule, dict):
        items = list(schedule.items())
    elif isinstance(schedule, (list, tuple)):
        items = []
        for entry in schedule:
            if not isinstance(entry, (list, tuple)) or len(entry) != 3:
                raise ValueError(f"num_speculative_tokens_per_batch_size entry {entry!r}: expected [start, end, K].")
            items.append((f"{entry[0]}-{entry[1]}", entry[2]))
    else:
        raise ValueError(f"num_speculative_tokens_per_batch_size must be a list of [start, end, K] or a "
                         f"{{\"start-end\": K}} object, got {type(schedule).__name__}.")
    if not items:
        raise ValueError("num_speculative_tokens_per_batch_size is empty: vLLM needs at least one range.")
    rows = []
    for key, k in items:
        parts = str(key).split("-")
        try:
            if len(parts) > 2 or isinstance(k, bool) or float(k) != int(k):
                raise ValueError
            lo, hi, k = int(parts[0]), int(parts[-1]), int(k)
        except (TypeError, ValueError):
            raise ValueError(f"num_speculative_tokens_per_batch_size entry {key!r}: {k!r}: expected a range 'start-end' "
                             "(or 'bs') of integers and an integer K.") from None
        if lo < 1 or hi < lo or k < 0:
            raise ValueError(f"num_speculative_tokens_per_batch_size entry {key!r}: {k!r} is not a range 1 ≤ start ≤ "
                             "end with K ≥ 0.")
        rows.append([lo, hi, k])
    rows.sort()
    for (_, prev_end, _), (lo, hi, _) in zip(rows, rows[1:]):
        if lo <= prev_end:
            raise ValueError(f"num_speculative_tokens_per_batch_size: the range {lo}-{hi} overlaps the one ending at "
                             f"{prev_end} (vLLM needs non-overlapping ranges).")
    if rows[0][0] != 1:
        raise ValueError(f"num_speculative_tokens_per_batch_size starts at batch size {rows[0][0]}: vLLM needs the "
                         "first range to start at 1.")
    return rows


def speculative_config(policy_dir: str | Path, method: str | None = None, draft_model: str | None = None) -> dict:
    """A ready ``speculative_config`` for vLLM 0.34.0 (``vllm serve … --speculative-config JSON``) from a load-aware
    policy export: ``method``, ``num_speculative_tokens`` (the policy's ``max_depth``), the prompt-lookup window for
    ``ngram`` (``prompt_lookup_min`` = the policy's ``lookup_min_ngram``, ``prompt_lookup_max`` = this project's
    longest n-gram, 4) or ``model`` for ``draft_model``, and ``num_speculative_tokens_per_batch_size`` from its
    ``vllm_schedule.json`` (:func:`vllm_config_schedule`). Key names and value types: vLLM 0.34.0's
    ``vllm/config/speculative.py`` (``SpeculativeConfig``) and ``vllm/v1/worker/gpu/spec_decode/ngram/config.py``.

    Args:
        policy_dir: a load-aware policy export (``policies/defaults/lookup-serve-bfloat16``) or its training run.
        method: vLLM's ``method``; default from the policy's drafter (:data:`VLLM_METHODS`).
        draft_model: the draft model vLLM loads for ``draft_model`` (default: the policy's ``draft``).

    Raises:
        FileNotFoundError: ``policy_dir`` or its ``vllm_schedule.json`` / ``policy_config.json`` is missing.
        ValueError: not a load-aware policy, a malformed schedule (naming the file), or a drafter with no vLLM method
            and no ``method`` given.
    """
    from policies.layout import POLICY_CONFIG_FILE, VLLM_SCHEDULE_FILE, resolve_export_dir

    d = resolve_export_dir(policy_dir)
    if not d.is_dir():
        raise FileNotFoundError(f"{policy_dir} is not a folder: pass a load-aware policy export (e.g. "
                                "policies/defaults/lookup-serve-bfloat16) or its training run.")
    cfg_file, sched_file = d / POLICY_CONFIG_FILE, d / VLLM_SCHEDULE_FILE
    if not cfg_file.is_file():
        raise FileNotFoundError(f"{cfg_file} is missing: is {d} a policy export?")
    cfg = json.loads(cfg_file.read_text())
    if cfg.get("features") != "serve":
        raise ValueError(f"{d} is not a load-aware policy (its policy_config.json says features="
                         f"{cfg.get('features')!r}, not 'serve'): train one with `python -m train --serve-loads …`.")
    if not sched_file.is_file():
        raise FileNotFoundError(f"{sched_file} is missing: re-export the run with `python -m train --serve-loads …` "
                                "(every load-aware export writes it).")
    try:
        doc = json.loads(sched_file.read_text())
        table = vllm_config_schedule(doc["num_speculative_tokens_per_batch_size"])
        k_max = int(doc.get("num_speculative_tokens", cfg["max_depth"]))
    except (KeyError, TypeError, ValueError) as e:
        raise ValueError(f"{sched_file}: {e if not isinstance(e, KeyError) else f'no {e} entry'}") from None
    drafter = str(cfg.get("drafter"))
    method = method or VLLM_METHODS.get(drafter)
    if method is None:
        raise ValueError(f"{d} was trained for the drafter {drafter!r}, which vLLM does not have (it has "
                         f"{', '.join(f'{a} → {b}' for a, b in VLLM_METHODS.items())}): name vLLM's method with "
                         "--method, knowing the table was tuned for another drafter's acceptance.")
    out: dict = {"method": method, "num_speculative_tokens": k_max}
    if method == "ngram":
        from learn2draft.drafters.lookup import DEFAULT_MAX_NGRAM
        from policies.load import policy_lookup_min_ngram

        n_min = policy_lookup_min_ngram(d)  # None for a drafter without prompt lookup: vLLM's default then
        out.update({} if n_min is None else {"prompt_lookup_min": n_min}, prompt_lookup_max=DEFAULT_MAX_NGRAM)
    if draft_model or method == "draft_model":
        out["model"] = draft_model or cfg.get("draft")
    out["num_speculative_tokens_per_batch_size"] = table
    return out


def build_parser():
    """The parser of ``python -m policies.vllm`` (one subcommand, ``export-table``)."""
    import argparse

    from learn2draft.cli import HelpFormatter

    p = argparse.ArgumentParser(prog="python -m policies.vllm", formatter_class=HelpFormatter,
                                description="vLLM exports of learned policies.")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")
    t = sub.add_parser("export-table", formatter_class=HelpFormatter,
                       help="a load-aware policy as vLLM's num_speculative_tokens_per_batch_size and speculative_config",
                       description="Write a load-aware policy's per-batch-size table as a ready vLLM 0.34.0 "
                                   "speculative_config (JSON, printed on standard output too): use it with "
                                   "`vllm serve MODEL --speculative-config \"$(cat FILE)\"`. Exit 0 written, 2 bad input.")
    t.add_argument("policy_dir", metavar="POLICY_DIR",
                   help="a load-aware policy export (e.g. policies/defaults/lookup-serve-bfloat16) or its training run")
    t.add_argument("--out", required=True, metavar="FILE", help="the speculative_config JSON file to write")
    t.add_argument("--method", default=None,
                   help="vLLM's speculative method (default: from the policy's drafter: lookup → ngram, model → "
                        "draft_model)")
    t.add_argument("--draft-model", default=None,
                   help="the draft model vLLM loads for --method draft_model (default: the policy's draft)")
    return p


def _run(args) -> int:
    import sys

    from learn2draft.cli import check_out_file

    out = check_out_file(args.out, "--out")
    cfg = speculative_config(args.policy_dir, args.method, args.draft_model)
    text = json.dumps(cfg)
    out.write_text(text + "\n")  # one line: ready for --speculative-config "$(cat FILE)"
    print(text)
    print(f"wrote {out}: vllm serve MODEL --speculative-config \"$(cat {out})\"", file=sys.stderr)
    return 0


def main(argv: list[str] | None = None) -> int:
    """``python -m policies.vllm export-table POLICY_DIR --out FILE``; exit 0 written, 2 bad input."""
    from learn2draft.cli import run_cli

    return run_cli(build_parser(), _run, argv)


__all__ = ["LearnedDraftLengthPolicy", "ProtocolController", "VLLM_METHODS", "load_mlp", "speculative_config",
           "vllm_config_schedule", "vllm_schedule", "vllm_scheduled_k"]


if __name__ == "__main__":
    import sys

    sys.exit(main())
