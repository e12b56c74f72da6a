"""Tools for testing the real draft/verify loop: logit hooks that force or forbid a token at given
absolute positions, a cache-free greedy reference, scripted controllers and a recording sampler."""

from __future__ import annotations

import copy
from collections.abc import Iterable

import numpy as np
import torch
from transformers import DynamicCache

from learn2draft.decoding import DraftController
from learn2draft.sampling import SamplingConfig, speculative_sample
from learn2draft.state import DraftState


def draft_state(depth: int = 0, max_depth: int = 8, confidences: Iterable[float] = (),
                drafter_features: Iterable[float] = (0.0, 0.0), extra_features: Iterable[float] = (),
                observation: np.ndarray | None = None, **fields) -> DraftState:
    """A :class:`DraftState` for a controller's ``decide`` outside a decoder: the given depth, confidences,
    drafter features (float32 (2,)), extra (hybrid) features and precomputed ``observation``; the other fields
    (``committed_len``, ``generated``, ``max_new_tokens``, ``accepted_history``, ``last_accept_fraction``,
    ``entropies``, ``vocab_size``) plausible defaults unless given in ``fields``."""
    confidences = tuple(float(c) for c in confidences)
    kw = {"committed_len": 16, "generated": 0, "max_new_tokens": 64, "accepted_history": (),
          "last_accept_fraction": 1.0, "entropies": (0.0,) * len(confidences), "vocab_size": 32, **fields}
    return DraftState(depth=depth, max_depth=max_depth, confidences=confidences,
                      drafter_features=np.asarray(list(drafter_features), dtype=np.float32),
                      extra_features=np.asarray(list(extra_features), dtype=np.float32),
                      observation=None if observation is None else np.asarray(observation, dtype=np.float32), **kw)


def bias_token(model: torch.nn.Module, token: int, bias: float, positions: Iterable[int] | None = None) -> list:
    """Add ``bias`` to ``token``'s logit wherever the model predicts the token at an absolute
    sequence index in ``positions`` (all positions when None).

    Row j of a forward's logits predicts the index after its token's position: ``position_ids[j] + 1`` when the
    forward passes positions (the ragged forward of :class:`learn2draft.batch_cache.BatchCache`: slot = position),
    else c + j + 1 for a forward that feeds n tokens after a ``cache=`` of length c; ``logits_to_keep`` (an int: the
    last ones; a tensor: those indices) is applied to those rows. Returns the hook handles (``.remove()``).
    """
    pos = None if positions is None else set(positions)
    state = {}

    def pre(module, args, kwargs):
        ids, given = kwargs["input_ids"], kwargs.get("position_ids")
        if given is not None:
            predicts = given[0] + 1
        else:
            cache = kwargs.get("cache")
            past = cache.get_seq_length() if cache is not None else 0
            predicts = past + torch.arange(ids.shape[1]) + 1
        keep = kwargs.get("logits_to_keep", 0)
        if isinstance(keep, torch.Tensor):
            predicts = predicts[keep.to(predicts.device)]
        elif keep:
            predicts = predicts[-keep:]
        state["predicts"] = predicts.tolist()

    def post(module, args, kwargs, out):
        for j, index in enumerate(state["predicts"]):
            if pos is None or index in pos:
                out.logits[:, j, token] += bias
        return out

    return [model.register_forward_pre_hook(pre, with_kwargs=True), model.register_forward_hook(post, with_kwargs=True)]


def tiny_head_drafter(pair):
    """A feature-level head drafter on a tiny target (seeded, draft vocabulary = every other token id
    from 3, a sharpened norm so its top-k has clear winners)."""
    from learn2draft.drafters.head import DraftHead, HeadDrafter, head_llama_config

    torch.manual_seed(0)
    V = pair.target.config.vocab_size
    head = DraftHead(head_llama_config(pair.target.config), torch.arange(3, V, 2)).to(pair.device, pair.target.dtype)
    head.attach_target(pair.target, init_norm=True)
    with torch.no_grad():
        head.norm.weight.mul_(20.0)
    return HeadDrafter(head.eval(), pair.vocab_size)


def drafter_for(name: str, pair):
    """The drafter ``name`` for ``pair``: :func:`tiny_head_drafter` for ``"head"``, else ``make_drafter``."""
    from learn2draft.drafters import make_drafter

    return tiny_head_drafter(pair) if name == "head" else make_drafter(name, pair)


def noisy_copy(model: torch.nn.Module, scale: float, seed: int) -> torch.nn.Module:
    """A deep copy with Gaussian noise (relative ``scale``) on every weight: a draft that agrees
    with the target most of the time, so cycles see both acceptances and rejections."""
    m = copy.deepcopy(model)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for prm in m.parameters():
            prm.add_(torch.randn(prm.shape, generator=g).to(prm.device) * scale * prm.std().clamp_min(1e-3))
    return m


@torch.inference_mode()
def greedy_reference(model, prompt: torch.Tensor, n: int, V: int, eos: Iterable[int] = (),
                     sampling: SamplingConfig = SamplingConfig()) -> list[int]:
    """Plain greedy decoding, the reference the speculative loop must reproduce: the prompt once,
    then one token per forward with a cache that only ever grows (no drafting, no rollback), the
    argmax of ``sampling.probs`` (so penalties apply). Stops after ``n`` tokens or an EOS (included)."""
    ids = prompt.clone().to(model.device)
    cache = DynamicCache()
    feed = ids
    out: list[int] = []
    eos = set(eos)
    for _ in range(n):
        logits = model(input_ids=feed[None], cache=cache, use_cache=True).logits[0, -1:, :V]
        tok = int(sampling.probs(logits, ids)[0].argmax())
        out.append(tok)
        feed = torch.tensor([tok], device=ids.device)
        ids = torch.cat([ids, feed])
        if tok in eos:
            break
    return out


class ScheduleController(DraftController):
    """Drafts ``schedule[c % len(schedule)]`` tokens in cycle c (cycles counted at depth 0).

    The depth is the state's (``state.depth``); its ``max_depth`` is the largest entry."""

    def __init__(self, schedule: list[int]):
        self.schedule, self.max_depth = list(schedule), max(schedule)
        self.reset()

    def reset(self) -> None:
        self.cycle, self.planned = -1, []

    def decide(self, state: DraftState) -> bool:
        if state.depth == 0:
            self.cycle += 1
            self.planned.append(self.schedule[self.cycle % len(self.schedule)])
        return state.depth < self.planned[-1]


class ConfidencePolicy(DraftController):
    """Keeps drafting while the draft's confidence in its last token is ≥ ``threshold`` (always
    drafts the first token): its depth varies with the features, and it decides before each draw."""

    def __init__(self, threshold: float = 0.5, max_depth: int = 8):
        self.threshold, self.max_depth = threshold, max_depth

    def decide(self, state: DraftState) -> bool:
        if state.depth == 0:
            return True
        return state.last_confidence >= self.threshold

    def __repr__(self) -> str:
        return f"ConfidencePolicy(threshold={self.threshold}, max_depth={self.max_depth})"


class RecordingSampler:
    """Wraps a sampler (default: the real :func:`speculative_sample`) and records every call:
    ``(drafted tokens, τ, next token, V)``. ``transform(p, q, x)`` may rewrite p before the call."""

    def __init__(self, inner=speculative_sample, transform=None):
        self.inner, self.transform, self.calls = inner, transform, []

    def __call__(self, p, q, x, generator=None):
        if self.transform is not None:
            p = self.transform(p, q, x)
        tau, y = self.inner(p, q, x, generator)
        self.calls.append((x.tolist(), tau, y, p.shape[1]))
        return tau, y
