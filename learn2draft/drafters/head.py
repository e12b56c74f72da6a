"""A feature-level draft head over the target's last hidden states (EAGLE; FR-Spec draft vocabulary).

The head follows EAGLE (Li et al. 2024, arXiv 2401.15077) and EAGLE-3 (Li et al. 2025,
arXiv 2503.01840): at sequence position t its input is the concatenation of

* f_t — the target's last hidden state at t (``hidden_states[-1]``, which in transformers 5.x is
  taken *after* the model's final norm: ``lm_head(hidden_states[-1])`` are the target's logits), and
* e(x_{t+1}) — the target's own (frozen) input embedding of the next token,

projected by a linear layer ``fc`` (2H → H), then ONE Llama decoder layer (transformers'
``LlamaDecoderLayer`` with its rotary embedding and its own KV cache), then an RMSNorm
(initialised from the target's final norm). The output g_t is a predicted feature f'_{t+1}: it is
scored by the target's frozen LM-head rows of a frequent-token *draft vocabulary* only (FR-Spec,
Zhao et al. 2025, arXiv 2502.14856; EAGLE-3's draft-to-target map ``d2t``), and it is fed back as
the feature of the next position when the head drafts further than one token ahead.

The draft vocabulary ``d2t`` (int64 (K,), sorted target ids) is part of the head's weights; the
embedding and the LM-head rows come from the target when the head is attached, so a saved head
holds only ``fc``, the decoder layer, the norm and ``d2t``.

Training recipe: :mod:`train.recipes.head` (``python -m train.recipes.head``).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from torch import nn
from transformers import DynamicCache, LlamaConfig, PreTrainedModel
from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRMSNorm, LlamaRotaryEmbedding

from learn2draft.drafters.base import (
    Drafter,
    DraftProposal,
    TopKProposal,
    _check_rows,
    append_new_entries,
    batch_attention_mask,
    draw_rows,
    group_by_module,
    pad_caches,
    raw_distribution_stats,
    topk_proposal,
    tree_slot_mask,
)
from learn2draft.models import DEFAULT_TARGET, ModelLoadError
from learn2draft.sampling import SamplingConfig, sample_from

#: Directory of the head shipped for the embedded default target (SmolLM2-135M-Instruct).
DEFAULT_HEAD_DIR = Path(__file__).resolve().parent.parent / "assets" / "smollm2-135m-head"
HEAD_WEIGHTS = "head.safetensors"
HEAD_CONFIG = "config.json"
HEAD_FORMAT = "learn2draft-eagle-head-v1"


def head_llama_config(target_config, intermediate_size: int | None = None) -> LlamaConfig:
    """The LlamaConfig of the head's decoder layer: the target's width, heads, rotary settings and norm
    epsilon (so the head reads the target's features at their own scale), one layer.

    Args:
        target_config: the target's config (``hidden_size``, ``num_attention_heads``, ...).
        intermediate_size: MLP width (default: the target's).
    """
    tc = target_config
    H = tc.hidden_size
    heads = getattr(tc, "num_attention_heads", None) or max(1, H // 64)
    rope = getattr(tc, "rope_parameters", None) or {"rope_type": "default", "rope_theta": 10000.0}
    cfg = LlamaConfig(
        vocab_size=tc.vocab_size, hidden_size=H,
        intermediate_size=int(intermediate_size or getattr(tc, "intermediate_size", 4 * H)),
        num_hidden_layers=1, num_attention_heads=heads,
        num_key_value_heads=getattr(tc, "num_key_value_heads", None) or heads,
        head_dim=getattr(tc, "head_dim", None) or H // heads,
        max_position_embeddings=getattr(tc, "max_position_embeddings", 2048),
        rms_norm_eps=getattr(tc, "rms_norm_eps", 1e-5), rope_parameters=dict(rope),
        attention_bias=False, mlp_bias=False, hidden_act=getattr(tc, "hidden_act", "silu"),
    )
    cfg._attn_implementation = "sdpa"
    return cfg


class DraftHead(nn.Module):
    """EAGLE-style draft head: fc(2H → H) → one Llama decoder layer → RMSNorm → draft-vocabulary logits.

    Args:
        config: the decoder layer's :class:`LlamaConfig` (see :func:`head_llama_config`); its
            ``vocab_size`` is the target's embedding rows.
        d2t: int64 (K,), the draft vocabulary: sorted, unique target token ids.

    Buffers set by :meth:`attach_target` (not saved): ``embed`` float (V_emb, H), the target's input
    embedding; ``lm_rows`` float (K, H), the target's LM-head rows of ``d2t``.
    """

    def __init__(self, config: LlamaConfig, d2t: torch.Tensor):
        super().__init__()
        self.config = config
        H = config.hidden_size
        self.fc = nn.Linear(2 * H, H, bias=False)
        self.layer = LlamaDecoderLayer(config, layer_idx=0)
        self.norm = LlamaRMSNorm(H, eps=config.rms_norm_eps)
        self.rotary = LlamaRotaryEmbedding(config=config)
        d2t = torch.as_tensor(d2t, dtype=torch.long).reshape(-1)
        self.register_buffer("d2t", d2t.clone())
        self.register_buffer("embed", torch.zeros(0, H), persistent=False)
        self.register_buffer("lm_rows", torch.zeros(0, H), persistent=False)

    @property
    def draft_vocab_size(self) -> int:
        return int(self.d2t.numel())

    @torch.no_grad()
    def attach_target(self, target: PreTrainedModel, init_norm: bool = False) -> DraftHead:
        """Take the target's frozen input embedding (shared, not copied) and the LM-head rows of ``d2t``
        (a copy), without gradients.

        Args:
            target: the target causal LM.
            init_norm: also copy the target's final norm weight into the head's norm (a fresh head).

        Raises:
            ModelLoadError: the target's width or vocabulary does not fit the head.
        """
        emb = target.get_input_embeddings().weight
        out = target.get_output_embeddings().weight
        H = self.config.hidden_size
        if emb.shape[1] != H or out.shape[1] != H:
            raise ModelLoadError(
                f"The head was trained for hidden size {H}, the target has {out.shape[1]}: this head belongs to "
                "another target. Train one for it with `python -m train.recipes.head --target ... --out DIR`."
            )
        if int(self.d2t.max()) >= out.shape[0] or emb.shape[0] != self.config.vocab_size:
            raise ModelLoadError(
                f"The head's vocabulary (embedding rows {self.config.vocab_size}, draft ids up to {int(self.d2t.max())}) "
                f"does not fit the target's ({emb.shape[0]} embedding rows, {out.shape[0]} output rows): this head "
                "belongs to another target. Train one with `python -m train.recipes.head --target ... --out DIR`."
            )
        dev, dt = self.fc.weight.device, self.fc.weight.dtype
        # Shared with the target (no copy when device and dtype match): several drafters over one target
        # (a γ grid builds one per method) must not each hold the whole embedding. Never modified in place.
        self.embed = emb.detach().to(dev, dt)
        self.lm_rows = out.detach()[self.d2t.to(out.device)].to(dev, dt).clone()
        if init_norm:
            norm = getattr(getattr(target, "model", None), "norm", None)
            if norm is not None and getattr(norm, "weight", None) is not None and norm.weight.shape == (H,):
                self.norm.weight.copy_(norm.weight.detach().to(dev, dt))
        return self

    def forward(
        self,
        features: torch.Tensor,
        next_tokens: torch.Tensor,
        position_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        cache: DynamicCache | None = None,
    ) -> torch.Tensor:
        """Predicted features.

        Args:
            features: float (B, T, H), f_t (true target features or the head's own predictions).
            next_tokens: int64 (B, T), x_{t+1}.
            position_ids: int64 (B, T) or (1, T), t.
            attention_mask: bool (B, 1, T, S) with True = attend over the S keys (cached + these T),
                or None for T = 1 (attend to everything cached).
            cache: the head's KV cache; the T new keys/values are appended to it.

        Returns:
            float (B, T, H): g_t, the predicted f_{t+1} (post-norm feature space).
        """
        x = self.fc(torch.cat([features, F.embedding(next_tokens, self.embed)], dim=-1))
        pe = self.rotary(x, position_ids=position_ids)
        h = self.layer(x, attention_mask=attention_mask, position_ids=position_ids, cache=cache,
                       use_cache=cache is not None, position_embeddings=pe)
        return self.norm(h)

    def logits(self, g: torch.Tensor) -> torch.Tensor:
        """Draft-vocabulary logits float (..., K) of predicted features g float (..., H)."""
        return F.linear(g, self.lm_rows)

    # ------------------------------------------------------------------ persistence
    def head_state_dict(self) -> dict[str, torch.Tensor]:
        """The head's own weights (fc, layer, norm, d2t): what :meth:`save` writes."""
        return {k: v for k, v in self.state_dict().items() if not k.startswith("rotary.")}

    def save(self, path: str | Path, extra: dict | None = None, dtype: torch.dtype = torch.float16) -> None:
        """Write ``config.json`` and ``head.safetensors`` (float weights in ``dtype``, d2t int64) to ``path``."""
        p = Path(path)
        p.mkdir(parents=True, exist_ok=True)
        sd = {k: (v.to(dtype) if v.is_floating_point() else v).contiguous().cpu()
              for k, v in self.head_state_dict().items()}
        save_file(sd, str(p / HEAD_WEIGHTS))
        cfg = {"format": HEAD_FORMAT, "draft_vocab_size": self.draft_vocab_size,
               "llama_config": self.config.to_dict(), **(extra or {})}
        (p / HEAD_CONFIG).write_text(json.dumps(cfg, indent=2))

    @classmethod
    def load(cls, path: str | Path, device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32) -> DraftHead:
        """Load a head written by :meth:`save` (not yet attached to a target).

        Raises:
            ModelLoadError: missing or malformed files (:func:`check_head_dir`), or weights that do not fit
                the head's config.
        """
        p = Path(path)
        meta, lc = check_head_dir(p)
        try:
            sd = load_file(str(p / HEAD_WEIGHTS))
            head = cls(lc, sd["d2t"])
            missing, unexpected = head.load_state_dict(sd, strict=False)
            missing = [k for k in missing if not k.startswith("rotary.")]
            if missing or unexpected:
                raise ValueError(f"missing weights {missing[:3]}, unexpected {unexpected[:3]}")
        except Exception as e:  # noqa: BLE001 (KeyError, ValueError, RuntimeError, SafetensorError, ...)
            raise ModelLoadError(f"The draft head in {p} is malformed ({e.__class__.__name__}: {e}); {HEAD_REBUILD}.") from None
        head.meta = meta
        return head.to(device=device, dtype=dtype).eval()


#: What to do about a damaged head directory.
HEAD_REBUILD = ("rebuild it with `python -m train.recipes.head --target TARGET --out DIR` (the shipped head of the "
                "default target: restore it with git checkout, or `python -m train.recipes.head`)")


def check_head_dir(path: str | Path) -> tuple[dict, LlamaConfig]:
    """Cheap checks of a head directory written by :meth:`DraftHead.save`, before any slow work: ``config.json``
    is a JSON object of this format whose ``llama_config`` transformers accepts, and ``head.safetensors`` is a
    whole safetensors file (its header only is read).

    Returns:
        (the config's fields, the head's ``LlamaConfig``).

    Raises:
        ModelLoadError: names the missing or damaged file and says how to rebuild the head.
    """
    from learn2draft.models import check_safetensors_file, read_json_object

    p = Path(path)
    if not (p / HEAD_CONFIG).is_file() or not (p / HEAD_WEIGHTS).is_file():
        raise ModelLoadError(
            f"No draft head in {p} (it needs the files {HEAD_CONFIG} and {HEAD_WEIGHTS}). Build one with "
            "`python -m train.recipes.head --target TARGET --out DIR` (the default target's head: `python -m train.recipes.head`)."
        )
    cfg_file = p / HEAD_CONFIG
    meta = read_json_object(cfg_file, HEAD_REBUILD)
    if meta.get("format") != HEAD_FORMAT:
        raise ModelLoadError(f"The draft head in {p} is malformed: {cfg_file} is not a draft head's config (format "
                             f"{meta.get('format')!r}, expected "
                             f"{HEAD_FORMAT!r}): pass a directory written by `python -m train.recipes.head`, or "
                             f"{HEAD_REBUILD}.")
    if not isinstance(meta.get("llama_config"), dict):
        raise ModelLoadError(f"{cfg_file}: 'llama_config' is missing or not a JSON object; {HEAD_REBUILD}.")
    try:
        lc = LlamaConfig.from_dict(meta["llama_config"])
    except Exception as e:  # noqa: BLE001 (transformers' dataclass validation errors, TypeError, ValueError)
        msg = " ".join(str(e).split())
        raise ModelLoadError(f"{cfg_file}: its llama_config is not a config transformers accepts "
                             f"({e.__class__.__name__}: {msg}); {HEAD_REBUILD}.") from None
    lc._attn_implementation = "sdpa"
    check_safetensors_file(p / HEAD_WEIGHTS, HEAD_REBUILD)
    return meta, lc


def causal_mask(q_len: int, past: int, device=None) -> torch.Tensor:
    """bool (1, 1, q_len, past + q_len): query i (at sequence slot past + i) attends to keys 0..past + i."""
    k = torch.arange(past + q_len, device=device)
    q = torch.arange(q_len, device=device) + past
    return (k[None, :] <= q[:, None])[None, None]


class HeadDrafter(Drafter):
    """Chain drafting with a :class:`DraftHead` that reads the target's last hidden states.

    State, for the committed sequence x_0 .. x_{n−1}:

    * ``feats``: float (n_f, H), the target's features f_0 .. f_{n_f−1} of verified positions
      (observed through :meth:`observe_target`; rows of rejected tokens are dropped by :meth:`rollback`);
    * the head's KV cache: positions 0 .. ``cache_len`` − 1 built from TRUE features (position t
      reads f_t and x_{t+1}), followed by ``spec_len`` positions built this cycle from the head's
      own predicted features.

    :meth:`propose` on ``seq`` (length n) needs the head's output at position n − 2: it first
    feeds the pending true positions (``cache_len`` .. min(n_f, n − 1) − 1) in one batched forward,
    then, one position at a time, positions whose true feature is not known yet, with the head's
    previous output as their feature (as EAGLE drafts). :meth:`rollback` drops the predicted
    entries, so the next cycle rebuilds those positions from the target's true features.

    Draft trees (:meth:`propose_topk`, as EAGLE-2): the root's output comes from :meth:`predict`; a
    tree node f with parent a is fed with the head's output at a as its feature and f's token, at
    position n − 2 + depth(f), with a tree attention mask (the committed positions, f's ancestors'
    slots, itself). Its output predicts f's children. Tree entries count as predicted entries
    (``spec_len``), so :meth:`rollback` drops them.

    Many rows (:meth:`prepare_batch`): drafters sharing one head module (:meth:`spawn`) feed their pending
    positions in one forward per round; each keeps its own features, outputs and cache (gathered into a padded
    batch for the call, appended to after it).

    Args:
        head: a :class:`DraftHead` attached to the target (:meth:`DraftHead.attach_target`).
        vocab_size: V, the target's real vocabulary; proposals are (V,) distributions, zero outside ``d2t``.

    Raises:
        ValueError (from :meth:`observe_target`): features for a position past a gap.
    """

    name = "head"
    needs_target_hidden = True
    supports_tree = True
    batched = True

    def __init__(self, head: DraftHead, vocab_size: int, head_dir: str = ""):
        if head.lm_rows.numel() == 0:
            raise ValueError("The head is not attached to a target: call head.attach_target(target) first.")
        self.head = head.eval()
        self.vocab_size = int(vocab_size)
        if int(head.d2t.max()) >= self.vocab_size:
            raise ModelLoadError(f"The head's draft vocabulary has ids ≥ the target's vocabulary size {vocab_size}.")
        self.head_dir = str(head_dir)
        # Logit of tokens outside the draft vocabulary: finite (SamplingConfig.probs refuses non-finite logits and
        # checks a row's sum, which V × finfo.min would overflow), and far below any real logit, so q is exactly 0
        # there after any temperature / penalty.
        self.masked_logit = -torch.finfo(torch.float32).max / (4 * self.vocab_size)
        p = next(head.parameters())
        self.device, self.dtype = p.device, p.dtype
        self.start(torch.zeros(0, dtype=torch.long))

    def start(self, prompt_ids: torch.Tensor) -> None:
        self.feats = torch.zeros(0, self.head.config.hidden_size, device=self.device, dtype=self.dtype)
        self.cache = DynamicCache()
        self.cache_len = 0  # head positions built from true features
        self.spec_len = 0  # head positions after them built from predicted features
        self.last_g: torch.Tensor | None = None  # (H,) the head's output at position cache_len + spec_len − 1
        self.true_g: torch.Tensor | None = None  # (H,) the head's output at position cache_len − 1
        self.tree_g: dict[int, torch.Tensor] = {}  # tree node → the head's output there (H,)
        self.tree_slots: dict[int, int] = {}  # tree node (not the root) → cache slot
        self.tree_base = 0  # cache entries before the tree's (the committed sequence's positions)

    def observe_target(self, hidden: torch.Tensor, first_position: int) -> None:
        if first_position > self.feats.shape[0]:
            raise ValueError(
                f"Target features for position {first_position} but only {self.feats.shape[0]} positions known: "
                "the decoder must pass every target forward's hidden states."
            )
        if first_position < self.cache_len:  # positions the head has read are replaced: forget their cache entries
            self.cache.crop(-(self.cache_len + self.spec_len - first_position))
            self.cache_len, self.spec_len = first_position, 0
            self.last_g = self.true_g = None
        self.feats = torch.cat([self.feats[:first_position], hidden.detach().to(self.device, self.dtype)])

    def can_propose(self, seq: torch.Tensor) -> bool:
        return self.feats.shape[0] > 0 and seq.numel() >= 2

    def _forward(self, feats: torch.Tensor, tokens: torch.Tensor, first: int) -> torch.Tensor:
        """Feed positions first .. first + T − 1 (feats (T, H), tokens (T,)); return g (T, H)."""
        T = tokens.numel()
        pos = torch.arange(first, first + T, device=self.device)[None]
        mask = causal_mask(T, first, self.device) if T > 1 else None
        return self.head(feats[None], tokens[None], pos, attention_mask=mask, cache=self.cache)[0]

    def _begin_predict(self, seq: torch.Tensor) -> tuple[torch.Tensor, int]:
        """Check ``seq`` and bring the state to a prefix of it; returns (``seq`` on the head's device, the end: the
        head is fed positions < n − 1, whose last output predicts the token after ``seq``)."""
        n = seq.numel()
        if not self.can_propose(seq):
            raise RuntimeError("The head drafter needs the target's features of the prompt (call observe_target) "
                               "and a sequence of ≥ 2 tokens.")
        seq = seq.to(self.device)
        end = n - 1
        if self.cache_len + self.spec_len > end:  # a shorter sequence than last time without a rollback: rebuild
            self.rollback(end)
        if self.spec_len == 0 and min(self.feats.shape[0], end) <= self.cache_len and self.last_g is None \
                and self.cache_len > 0:
            self.cache.crop(-1)  # the output at the last cached position was not kept: recompute it
            self.cache_len -= 1
        return seq, end

    def _next_segment(self, seq: torch.Tensor, end: int) -> tuple[torch.Tensor, torch.Tensor, int, bool] | None:
        """The next positions to feed before the head's output at ``end`` − 1 is known: (features (T, H), tokens
        (T,), first position, True for true target features), or None when it is known. First the pending
        positions with true features (cache_len .. min(n_f, end) − 1, one segment), then one position at a time
        with the head's previous output as the feature (EAGLE's drafting rule)."""
        if self.spec_len == 0:
            true_end = min(self.feats.shape[0], end)
            if true_end > self.cache_len:
                return (self.feats[self.cache_len:true_end], seq[self.cache_len + 1:true_end + 1], self.cache_len,
                        True)
        done = self.cache_len + self.spec_len
        if done >= end:
            return None
        if self.last_g is None:
            raise RuntimeError("The head drafter has no feature to continue from.")
        return self.last_g[None], seq[done + 1:done + 2], done, False

    def _absorb_segment(self, segment: tuple[torch.Tensor, torch.Tensor, int, bool], g: torch.Tensor) -> None:
        """Record that ``segment`` was fed and gave the outputs ``g`` (T, H)."""
        _, tokens, first, true = segment
        self.last_g = g[-1]
        if true:
            self.cache_len, self.true_g = first + tokens.numel(), g[-1]
        else:
            self.spec_len += 1

    @torch.inference_mode()
    def predict(self, seq: torch.Tensor) -> torch.Tensor:
        """Draft-vocabulary logits float32 (K,) for the token after ``seq`` (int64 (n,), n ≥ 2).

        Raises:
            RuntimeError: no target features observed yet.
        """
        seq, end = self._begin_predict(seq)
        while (seg := self._next_segment(seq, end)) is not None:
            self._absorb_segment(seg, self._forward(seg[0], seg[1], seg[2]))
        return self.head.logits(self.last_g).float()

    def propose(self, seq: torch.Tensor, sampling: SamplingConfig, generator: torch.Generator | None) -> DraftProposal:
        return self.finish(self.prepare(seq), seq, sampling, generator)

    def prepare(self, seq: torch.Tensor) -> torch.Tensor:
        """:meth:`predict` (after dropping a draft tree left without a rollback): draft-vocabulary logits float32
        (K,) after ``seq``."""
        if self.tree_g:  # a draft tree was left without a rollback: its entries are not on this sequence
            self.rollback(seq.numel())
        return self.predict(seq)

    def finish(self, prepared: torch.Tensor, seq: torch.Tensor, sampling: SamplingConfig,
               generator: torch.Generator | None) -> DraftProposal:
        """Draw the token from q = ``sampling.probs`` of the (V,) row holding ``prepared`` (K,) at ``d2t`` and
        :attr:`masked_logit` elsewhere (one draw from ``generator``).

        Raises:
            ValueError: NaN or infinite head logits.
        """
        row = torch.full((self.vocab_size,), self.masked_logit, device=prepared.device)
        row[self.head.d2t] = prepared
        try:
            q = sampling.probs(row[None], seq)[0]
        except ValueError as e:
            raise ValueError(f"The draft head: {e}") from None
        token = sample_from(q, generator)
        return DraftProposal(token, q, *raw_distribution_stats(prepared))

    @classmethod
    @torch.inference_mode()
    def finish_rows(cls, drafters, prepared, seqs, generators, sampling) -> list[DraftProposal]:
        """:meth:`finish` for many rows sharing one head in one computation (:meth:`Drafter.finish_rows`): the rows'
        draft-vocabulary logits (``prepared[i]``: float32 (K,)) stacked into (B, K) and placed at ``d2t`` in (B, V)
        rows of :attr:`masked_logit`, q of all rows in one :meth:`~learn2draft.sampling.SamplingConfig.probs_rows`
        call, and the draws and statistics of :func:`~learn2draft.drafters.base.draw_rows` (each row's uniform from
        its own generator: the draw :meth:`finish` makes for it alone). Per row (:meth:`finish`) for one row, rows of
        several heads or vocabularies, a penalty that reads each row's prefix, or a subclass with its own
        :meth:`finish`.

        Raises:
            ValueError: NaN or infinite head logits.
        """
        first = drafters[0] if drafters else None
        if (cls.finish is not HeadDrafter.finish or len(prepared) < 2 or sampling.prefix_dependent
                or any([d.head is not first.head or d.vocab_size != first.vocab_size for d in drafters])):
            return super().finish_rows(drafters, prepared, seqs, generators, sampling)
        raw = torch.stack(list(prepared))
        rows = torch.full((len(drafters), first.vocab_size), first.masked_logit, device=raw.device)
        rows[:, first.head.d2t] = raw
        try:
            q = sampling.probs_rows(rows, source="draft")
        except ValueError as e:
            raise ValueError(f"The draft head: {e}") from None
        return draw_rows(q, raw, generators)

    @classmethod
    @torch.inference_mode()
    def prepare_batch(cls, drafters, seqs) -> list[torch.Tensor]:
        """:meth:`prepare` for many rows: one head forward per round for the rows sharing a head module (one group
        for :meth:`spawn`-ed drafters).

        A round feeds each row's next segment (:meth:`_next_segment`: the true-feature positions at the first draft
        step of a cycle, T_i ≥ 1 of them; one predicted position after): the rows' caches (cache_len_i + spec_len_i
        entries) left-padded into one batch (:func:`~learn2draft.drafters.base.pad_caches`), features (B, T, H) and
        tokens (B, T) right-padded to T = max T_i at positions first_i + j, with a bool 4D mask
        (:func:`~learn2draft.drafters.base.batch_attention_mask`); the new entries are appended to each row's
        cache. A chain drafted by the head alone needs one round; a row catching up on tokens another source
        drafted (a hybrid) takes more, each round batched. Row i gets what its own :meth:`prepare` would, up to
        float rounding.

        Returns:
            per row, draft-vocabulary logits float32 (K,).

        Raises:
            ValueError: ``drafters`` and ``seqs`` differ in length.
            RuntimeError: a row has no target features yet (see :meth:`predict`).
        """
        _check_rows(drafters, seqs)
        out: list[torch.Tensor | None] = [None] * len(drafters)
        for group in group_by_module(drafters, "head"):
            if len(group) == 1:
                out[group[0]] = drafters[group[0]].prepare(seqs[group[0]])
                continue
            ds = [drafters[i] for i in group]
            begun = []
            for d, i in zip(ds, group):
                if d.tree_g:
                    d.rollback(seqs[i].numel())
                begun.append(d._begin_predict(seqs[i]))
            while True:
                segs = [(d, d._next_segment(sq, end)) for d, (sq, end) in zip(ds, begun)]
                segs = [(d, seg) for d, seg in segs if seg is not None]
                if not segs:
                    break
                if len(segs) == 1:
                    d, seg = segs[0]
                    d._absorb_segment(seg, d._forward(seg[0], seg[1], seg[2]))
                    continue
                _batched_head_forward(ds[0].head, segs)
            logits = ds[0].head.logits(torch.stack([d.last_g for d in ds])).float()  # one LM-head product
            for j, i in enumerate(group):
                out[i] = logits[j]
        return out

    def spawn(self) -> HeadDrafter:
        """A new drafter over the same head module (shared), with no features and an empty cache."""
        return HeadDrafter(self.head, self.vocab_size, head_dir=self.head_dir)

    @torch.inference_mode()
    def propose_topk(self, seq: torch.Tensor, tree, nodes: list[int], k: int, sampling: SamplingConfig) -> TopKProposal:
        nodes = [int(i) for i in nodes]
        if tree.max_depth == 0:  # a new tree: the root's output from the committed sequence
            if self.tree_g:
                self.rollback(seq.numel())
            logits = self.predict(seq)[None]
            self.tree_g, self.tree_slots = {0: self.last_g}, {}
            self.tree_base = self.cache_len + self.spec_len
        else:
            if any(tree.path(f)[-2:-1] and tree.path(f)[-2] not in self.tree_g for f in nodes) or 0 not in self.tree_g:
                raise RuntimeError("Tree nodes are expanded before their parents: expand the tree level by level, "
                                   "starting from the root.")
            par = tree.parents[nodes].tolist()
            total = self.tree_base + len(self.tree_slots)
            anc = [[self.tree_slots[a] for a in tree.path(f)[:-1]] for f in nodes]
            mask = tree_slot_mask(anc, self.tree_base, total, torch.bool, self.device)
            feats = torch.stack([self.tree_g[a] for a in par])[None]
            toks = tree.tokens[nodes].to(self.device)[None]
            pos = (tree.depth[nodes] + (seq.numel() - 2)).to(self.device)[None]
            g = self.head(feats, toks, pos, attention_mask=mask, cache=self.cache)[0]
            for j, f in enumerate(nodes):
                self.tree_g[f] = g[j]
                self.tree_slots[f] = total + j
            self.spec_len += len(nodes)
            logits = self.head.logits(g).float()
        rows = torch.full((len(nodes), self.vocab_size), self.masked_logit, device=logits.device)
        rows[:, self.head.d2t] = logits
        prefixes = ([torch.cat([seq, tree.tokens[tree.path(f)].to(seq.device)]) for f in nodes]
                    if sampling.prefix_dependent else [seq])
        try:
            return topk_proposal(rows, k, sampling, prefixes, raw_first=logits[0])
        except ValueError as e:
            raise ValueError(f"The draft head: {e}") from None

    def rollback(self, length: int) -> None:
        self.tree_g, self.tree_slots = {}, {}
        if self.feats.shape[0] > length:
            self.feats = self.feats[:length]
        total = self.cache_len + self.spec_len
        keep = min(self.cache_len, length)  # predicted entries never survive a rollback
        if total > keep:
            self.cache.crop(-(total - keep))
        self.last_g = self.true_g if keep == self.cache_len else None
        self.true_g = self.last_g
        self.cache_len, self.spec_len = keep, 0

    def extra_config(self) -> dict:
        """``head``: the head's directory, or None for the shipped one (:data:`DEFAULT_HEAD_DIR`; what
        :func:`load_head_drafter` loads for None), so that a profile or trace header written in one checkout
        names no path of it."""
        shipped = bool(self.head_dir) and Path(self.head_dir).resolve() == DEFAULT_HEAD_DIR
        return {"drafter": self.name, "head": None if shipped else self.head_dir,
                "draft_vocab_size": self.head.draft_vocab_size}


def _batched_head_forward(head: DraftHead, segs: list) -> None:
    """Feed each (drafter, segment) pair's segment in one forward of ``head`` over the drafters' padded caches and
    record the outputs in each drafter (see :meth:`HeadDrafter.prepare_batch`)."""
    ds = [d for d, _ in segs]
    dev = ds[0].device
    lengths = [seg[2] for _, seg in segs]  # a segment starts right after the row's cached entries
    new = [int(seg[1].numel()) for _, seg in segs]
    T, H = max(new), head.config.hidden_size
    feats = torch.zeros(len(ds), T, H, dtype=ds[0].dtype, device=dev)
    toks = torch.zeros(len(ds), T, dtype=torch.long, device=dev)
    for j, (_, seg) in enumerate(segs):
        feats[j, : new[j]], toks[j, : new[j]] = seg[0], seg[1]
    cache, past = pad_caches([d.cache for d in ds], lengths)
    cache = cache if cache is not None else DynamicCache()
    pos = torch.tensor(lengths, device=dev)[:, None] + torch.arange(T, device=dev)[None]
    mask = batch_attention_mask(lengths, past, new, torch.bool, dev)
    g = head(feats, toks, pos, attention_mask=mask, cache=cache)
    append_new_entries(cache, [d.cache for d in ds], past, new)
    for j, (d, seg) in enumerate(segs):
        d._absorb_segment(seg, g[j, : new[j]])


def load_head_drafter(pair, path: str | Path | None = None, dtype: torch.dtype | None = None) -> HeadDrafter:
    """Load a trained head from ``path`` and attach it to ``pair.target``.

    Args:
        pair: a :class:`learn2draft.ModelPair` (only ``pair.target`` and ``pair.vocab_size`` are used).
        path: a directory written by ``python -m train.recipes.head`` (``config.json`` + ``head.safetensors``);
            default: the shipped head of the embedded target, :data:`DEFAULT_HEAD_DIR`.
        dtype: the head's dtype (default: the target's).

    Raises:
        learn2draft.ModelLoadError: the directory is missing or malformed, the default head is asked for a
            target other than the embedded one, or the head does not fit the target (hidden size, vocabulary).
    """
    target = pair.target
    default = path is None
    p = DEFAULT_HEAD_DIR if default else Path(path).expanduser()
    if not p.exists():
        how = "`python -m train.recipes.head`" if default else f"`python -m train.recipes.head --target TARGET --out {p}`"
        raise ModelLoadError(f"Draft head directory not found: {p}. Build one with {how} (see docs/guides/embedded-pair.md).")
    dt = dtype or next(target.parameters()).dtype
    head = DraftHead.load(p, device=target.device, dtype=dt)
    tname = head.meta.get("target", "")
    if default and pair.target_name not in ("", DEFAULT_TARGET) and tname == DEFAULT_TARGET:
        tc = target.config
        if tc.hidden_size != head.config.hidden_size or tc.vocab_size != head.config.vocab_size:
            raise ModelLoadError(
                f"The shipped head is for {DEFAULT_TARGET}, not {pair.target_name!r}: train one with "
                f"`python -m train.recipes.head --target {pair.target_name} --out DIR` and pass --head DIR."
            )
    head.attach_target(target)
    return HeadDrafter(head, pair.vocab_size, head_dir=str(p))


__all__ = ["DEFAULT_HEAD_DIR", "DraftHead", "HeadDrafter", "causal_mask", "check_head_dir", "head_llama_config", "load_head_drafter"]
