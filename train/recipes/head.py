"""``python -m train.recipes.head``: train an EAGLE-style draft head for a target by self-distillation.

The head is :class:`learn2draft.drafters.head.DraftHead` (EAGLE, arXiv 2401.15077; EAGLE-3,
arXiv 2503.01840; FR-Spec draft vocabulary, arXiv 2502.14856). The recipe, in phases:

1. **Data** (cached in the work directory, shard by shard, so a rerun or a resumed run reuses it):
   (a) the target answers the distillation prompts (``train/recipes/data/distill_prompts.json``,
   disjoint from the policy prompts) greedily in batches, and its last hidden states (post final
   norm) are recorded in the same ``generate()`` call; (b) teacher-forced text available offline —
   package descriptions (``*.dist-info/METADATA``), markdown files and docstrings of the installed
   Python packages — one batched target forward per group of chunks, far cheaper per token than
   generating. Only hidden states are stored (float16); the target's next-token distribution is
   recomputed from them with its LM head.
2. **Draft vocabulary**: the K most frequent target-token ids of the training data (``d2t``);
   coverage for several K is reported.
3. **Training**: loss per position = KL(p ‖ q) + ``reg_weight`` · smooth-L1(g, f), where p is the
   target's distribution restricted to the draft vocabulary and renormalised (softmax of its
   LM-head rows on the true next feature f), q the head's, g the head's predicted feature.
   Gaussian noise on the input features; training-time test (EAGLE-3): each batch is unrolled
   ``ttt_steps`` times, step k feeding the head its own step-(k−1) predictions with the attention
   pattern the drafter sees at draft step k (true-feature keys up to t − k + 1, then the head's own
   keys at t − k + 2 .. t). AdamW, warmup + cosine, a wall-clock cap. Held-out answers (a share of
   the prompts) are scored periodically; the best state is kept (early stopping). Checkpoints in
   the work directory; a rerun with the same settings, or with a longer ``--max-train-minutes`` (which
   continues the cosine schedule over the longer time), resumes.
4. **Measurement**: α at temperature 0 on the held-out policy prompts
   (``learn2draft.prompts.load_prompts("heldout")``): along the target's own greedy continuation,
   the share of positions where the head's top-1 equals the target's greedy next token, for draft
   step 1 (true features) and steps 2, 3 (the head's own features, the true tokens — the
   conditional acceptance of a step given that the earlier ones were accepted); the head's cost per
   draft step relative to one target forward (batch 1, KV caches, median of interleaved timings).
5. **Output**: ``config.json``, ``head.safetensors`` (the head's own weights only) and
   ``build_report.json`` in ``--out``.

The defaults build the shipped head ``learn2draft/assets/smollm2-135m-head`` for
SmolLM2-135M-Instruct.
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import copy
import dataclasses
import hashlib
import json
import logging
import os
import random
import site
import statistics
import sys
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from transformers import DynamicCache, PreTrainedModel, PreTrainedTokenizerBase

from learn2draft.cli import progress as progress_display
from learn2draft.drafters.head import DEFAULT_HEAD_DIR, HEAD_CONFIG, HEAD_FORMAT, DraftHead, head_llama_config
from learn2draft.models import DEFAULT_TARGET, encode_text, eos_token_ids, resolve_dtype
from learn2draft.names import DTYPE_NAMES
from train.recipes.common import (
    CKPT_NAME,
    DISTILL_PROMPTS_FILE,
    CheckpointOnInterrupt,
    RecipeError,
    add_recipe_flags,
    answer_length,
    cached_batch,
    command_line,
    config_from_args,
    environment,
    fresh_build_dir,
    load_checkpoint,
    load_target,
    lr_at,
    measure_prompts_note,
    optimizer_step,
    pad_left,
    pad_token_id,
    progress,
    publish_build,
    run_recipe,
    save_atomic,
    select_distill_prompts,
    select_eval_prompts,
    setup_logging,
    start_wandb,
    work_dir_for,
)
from train.recipes.common import check_out_dir as _check_out_dir
from train.wandb_setup import check_wandb

log = logging.getLogger(__name__)

DEFAULT_WORK_DIR = Path("runs") / "head"  # relative to the working directory
GEN_BLOCK = 480  # prompts per cached generation block
DOCS_BLOCK = 64_000  # documentation tokens per cached block


class HeadTrainError(RecipeError):
    """Bad input to the head recipe; the message says what to change."""


# ----------------------------------------------------------------------------- config
@dataclass
class HeadConfig:
    """All settings of one head build; the defaults are the recipe of the shipped head.

    Data: ``num_prompts`` distillation prompts answered (0 = all) with ``max_new_tokens`` each, in
    batches of ``gen_batch_size``; ``heldout_fraction`` of them kept for early stopping;
    ``docs_tokens`` teacher-forced tokens of package documentation in chunks of ``docs_chunk``
    tokens, ``docs_batch`` chunks per target forward. Head: ``draft_vocab`` K, ``intermediate``
    MLP width (0 = the target's). Precision: ``dtype`` of the target's weights for the data and the
    measurement (``auto``: :func:`learn2draft.models.fastest_dtype`, resolved before any key is
    computed); with ``bfloat16`` the head trains under bfloat16 autocast on the CPU (its weights,
    the KL and the regression stay float32). Training: ``steps`` optimizer steps of about ``batch_tokens``
    positions, ``lr``, ``warmup``, ``weight_decay``, ``ttt_steps`` unrolled draft steps with weights
    ``ttt_decay``^(k−1), ``reg_weight`` of the feature regression, ``feat_noise`` (std of the input
    noise relative to the features' RMS), ``eval_every`` steps between held-out scores,
    ``max_train_minutes`` wall-clock cap (0 = none). Measurement: ``eval_prompts`` held-out policy
    prompts (0 = all), ``eval_max_new_tokens``, ``timing_repeats``.
    """

    target: str = DEFAULT_TARGET
    out: str = str(DEFAULT_HEAD_DIR)
    work_dir: str = ""
    prompts_file: str = str(DISTILL_PROMPTS_FILE)
    seed: int = 0
    threads: int = 2
    dtype: str = "auto"
    num_prompts: int = 960
    max_new_tokens: int = 256
    gen_batch_size: int = 48
    heldout_fraction: float = 0.04
    docs_tokens: int = 640_000
    docs_chunk: int = 192
    docs_batch: int = 16
    draft_vocab: int = 8192
    intermediate: int = 0
    steps: int = 6000
    batch_tokens: int = 1024
    lr: float = 1.5e-3
    warmup: int = 30
    weight_decay: float = 0.0
    ttt_steps: int = 2
    ttt_decay: float = 0.8
    reg_weight: float = 0.2
    feat_noise: float = 0.05
    eval_every: int = 50
    ckpt_every: int = 50
    max_train_minutes: float = 30.0
    eval_prompts: int = 0
    eval_max_new_tokens: int = 128
    timing_repeats: int = 30
    save_dtype: str = "float16"
    wandb_mode: str = field(default_factory=lambda: os.environ.get("WANDB_MODE", "offline"))
    wandb_project: str = "learn2draft-head"

    def gen_key(self, prompts: list[str]) -> str:
        """Hash of what determines the generated answers to ``prompts`` (one block of them)."""
        d = {k: getattr(self, k) for k in ("target", "dtype", "max_new_tokens", "gen_batch_size")} | {"prompts": prompts}
        return hashlib.sha256(json.dumps(d, sort_keys=True).encode()).hexdigest()[:16]

    def docs_key(self, block: int = 0) -> str:
        """Hash of what determines block ``block`` of the teacher-forced documentation data."""
        d = {k: getattr(self, k) for k in ("target", "dtype", "seed", "docs_chunk", "docs_batch")} | {"docs_tokens": DOCS_BLOCK}
        if block:
            d["block"] = block
        return hashlib.sha256(json.dumps(d, sort_keys=True).encode()).hexdigest()[:16]

    def train_key(self, data_key: str) -> str:
        """Hash of what determines training (a checkpoint is resumed only if it matches)."""
        d = {k: getattr(self, k) for k in ("seed", "draft_vocab", "intermediate", "steps", "batch_tokens", "lr",
                                            "warmup", "weight_decay", "ttt_steps", "ttt_decay", "reg_weight",
                                            "feat_noise", "heldout_fraction", "max_train_minutes", "dtype")}
        d["data"] = data_key
        return hashlib.sha256(json.dumps(d, sort_keys=True).encode()).hexdigest()[:16]

    def check(self) -> None:
        """Raise :class:`HeadTrainError` for settings out of range (before any slow work)."""
        pos = ("max_new_tokens", "gen_batch_size", "docs_chunk", "docs_batch", "draft_vocab", "steps", "batch_tokens",
               "ttt_steps", "eval_every", "ckpt_every", "timing_repeats", "threads", "eval_max_new_tokens")
        for k in pos:
            if getattr(self, k) <= 0:
                raise HeadTrainError(f"--{k.replace('_', '-')} must be positive, got {getattr(self, k)}.")
        for k in ("num_prompts", "docs_tokens", "intermediate", "warmup", "eval_prompts", "max_train_minutes",
                  "weight_decay", "reg_weight", "feat_noise"):
            if getattr(self, k) < 0:
                raise HeadTrainError(f"--{k.replace('_', '-')} must be ≥ 0, got {getattr(self, k)}.")
        if not 0 < self.lr < 1:
            raise HeadTrainError(f"--lr must be in (0, 1), got {self.lr}.")
        if not 0 <= self.heldout_fraction < 0.5:
            raise HeadTrainError(f"--heldout-fraction must be in [0, 0.5), got {self.heldout_fraction}.")
        if not 0 < self.ttt_decay <= 1:
            raise HeadTrainError(f"--ttt-decay must be in (0, 1], got {self.ttt_decay}.")
        if self.docs_chunk < 8:
            raise HeadTrainError(f"--docs-chunk must be ≥ 8 tokens, got {self.docs_chunk}.")
        if self.dtype not in DTYPE_NAMES:
            raise HeadTrainError(f"--dtype must be auto, float32, bfloat16 or float16, got {self.dtype!r}.")
        if self.save_dtype not in ("float16", "bfloat16", "float32"):
            raise HeadTrainError(f"--save-dtype must be float16, bfloat16 or float32, got {self.save_dtype!r}.")
        if self.wandb_mode not in ("offline", "online", "disabled"):
            raise HeadTrainError(f"--wandb-mode must be offline, online or disabled, got {self.wandb_mode!r}.")


# ----------------------------------------------------------------------------- data
# One example: ``ids`` int64 (L,), ``hidden`` float16 (n_h, H) the target's last hidden states
# (post final norm) at positions 0 .. n_h − 1 (n_h ≤ L), ``start``: the first position t whose
# prediction (of token t + 2) is trained. Head position t reads hidden[t] and ids[t + 1]; its
# teacher is hidden[t + 1]; so t runs over start .. n_h − 2.


def _answer_batch(target: PreTrainedModel, prompts: list[list[int]], max_new_tokens: int, pad_id: int,
                  eos: set[int]) -> list[dict]:
    """Greedy answers and hidden states for one batch of encoded ``prompts`` (see
    :func:`generate_answers`); an example's ``prompt`` is its row in this batch."""
    t0 = time.perf_counter()
    ids, mask = pad_left(prompts, pad_id)
    dev = target.device
    out = target.generate(
        input_ids=ids.to(dev), attention_mask=mask.to(dev), max_new_tokens=max_new_tokens, do_sample=False,
        temperature=None, top_p=None, top_k=None, output_hidden_states=True, return_dict_in_generate=True,
        pad_token_id=pad_id,
    )
    Lp = ids.shape[1]
    new = out.sequences[:, Lp:].cpu()
    steps = [out.hidden_states[0][-1].cpu()] + [h[-1].cpu() for h in out.hidden_states[1:]]
    gen_h = torch.cat(steps[1:], dim=1) if len(steps) > 1 else torch.zeros(ids.shape[0], 0, steps[0].shape[-1])
    chunk = []
    for r, prompt in enumerate(prompts):
        toks = new[r].tolist()
        n = answer_length(toks, eos)
        if n < 2:
            continue
        P = len(prompt)
        hid = torch.cat([steps[0][r, Lp - P:], gen_h[r, :n - 1]]).to(torch.float16)
        chunk.append({"ids": torch.tensor(prompt + toks[:n], dtype=torch.long), "hidden": hid,
                      "start": max(0, P - 2), "prompt_len": P, "prompt": r})
    secs = time.perf_counter() - t0
    for c in chunk:
        c["seconds"] = secs / max(1, len(chunk))
    return chunk


@torch.inference_mode()
def generate_answers(
    target: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, prompts: list[str], max_new_tokens: int,
    batch_size: int, cache_dir: Path | None = None, desc: str = "generate",
) -> list[dict]:
    """Greedy answers of ``target`` to ``prompts`` (chat template), with its last hidden states.

    Prompts are sorted by length and left-padded in batches; ``generate(output_hidden_states=True)``
    records the last layer's hidden states of the prompt (prefill) and of every generated token
    fed back. Answers stop after the first EOS (kept).

    Returns:
        one example per prompt with a non-empty answer (see the module's data format): ``ids`` =
        prompt + answer, ``hidden`` (L − 1, H) float16, ``start`` = prompt length − 2 (the first
        trained prediction is the answer's second token), plus ``prompt_len`` and ``prompt`` (index
        into ``prompts``). Batches are cached as ``cache_dir/gen_XXXX.pt`` when given.
    """
    encoded = [encode_text(tokenizer, p) for p in prompts]
    order = sorted(range(len(prompts)), key=lambda i: len(encoded[i]))
    pad_id = pad_token_id(tokenizer)
    eos = set(eos_token_ids(target, tokenizer))
    data: list[dict] = []
    batches = [order[i:i + batch_size] for i in range(0, len(order), batch_size)]
    bar = progress_display(batches, desc=desc, unit="batch")  # a bar on a terminal, plain lines in a log file
    for b, idx in enumerate(bar):

        def answer(idx=idx) -> list[dict]:
            chunk = _answer_batch(target, [encoded[j] for j in idx], max_new_tokens, pad_id, eos)
            for c in chunk:
                c["prompt"] = idx[c["prompt"]]  # row in the batch → index into ``prompts``
            return chunk

        data += cached_batch(cache_dir / f"gen_{b:04d}.pt" if cache_dir is not None else None, answer)
        bar.set_postfix(tokens=sum(len(d["ids"]) - d["prompt_len"] for d in data))
    return data


def _docstrings(path: Path) -> list[str]:
    try:
        tree = ast.parse(path.read_text(encoding="utf-8"))
    except (SyntaxError, UnicodeDecodeError, ValueError, OSError, RecursionError):
        return []
    out = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            doc = ast.get_docstring(node)
            if doc and len(doc) >= 300:
                out.append(doc)
    return out


def collect_docs_text(max_chars: int, seed: int = 0, roots: list[str] | None = None) -> list[str]:
    """Documentation text shipped with the installed Python packages, deterministic given ``seed``.

    Sources, under the site-packages directories (``roots``): package descriptions
    (``*.dist-info/METADATA`` bodies, usually the README), markdown / reStructuredText files, and
    docstrings (≥ 300 characters) of ``.py`` files. Mostly-ASCII documents of ≥ 300 characters,
    deduplicated, shuffled; collection stops at about ``max_chars`` characters.

    Returns:
        a list of documents (strings).
    """
    roots = roots if roots is not None else [p for p in site.getsitepackages() if Path(p).is_dir()]
    files: list[Path] = []
    for r in roots:
        rp = Path(r)
        files += sorted(rp.glob("*.dist-info/METADATA"))
        files += sorted(p for ext in ("md", "rst") for p in rp.rglob(f"*.{ext}"))
        files += sorted(rp.rglob("*.py"))
    rng = random.Random(seed)
    rng.shuffle(files)
    seen, docs, total = set(), [], 0
    for f in files:
        if total >= max_chars:
            break
        if f.suffix == ".py":
            texts = _docstrings(f)
        else:
            try:
                t = f.read_text(encoding="utf-8", errors="ignore")
            except OSError:
                continue
            if f.name == "METADATA":
                t = t.split("\n\n", 1)[1] if "\n\n" in t else ""
            texts = [t]
        for t in texts:
            t = t.strip()
            if len(t) < 300 or sum(c.isascii() for c in t) < 0.95 * len(t):
                continue
            h = hashlib.sha1(t.encode()).hexdigest()
            if h in seen:
                continue
            seen.add(h)
            docs.append(t[:20_000])
            total += len(docs[-1])
    return docs


def _docs_batch(target: PreTrainedModel, chunks: list[list[int]], pad_id: int) -> list[dict]:
    """One batched target forward over documentation ``chunks`` (right-padded: causal attention
    never looks at the pads); one example per chunk (see :func:`forward_docs`)."""
    t0 = time.perf_counter()
    L = max(len(c) for c in chunks)
    ids = torch.full((len(chunks), L), pad_id, dtype=torch.long)
    mask = torch.zeros((len(chunks), L), dtype=torch.long)
    for r, c in enumerate(chunks):
        ids[r, :len(c)] = torch.tensor(c)
        mask[r, :len(c)] = 1
    h = target.model(input_ids=ids.to(target.device), attention_mask=mask.to(target.device)).last_hidden_state.cpu()
    secs = time.perf_counter() - t0
    return [{"ids": torch.tensor(c, dtype=torch.long), "hidden": h[r, :len(c)].to(torch.float16), "start": 0,
             "seconds": secs / len(chunks)} for r, c in enumerate(chunks)]


@torch.inference_mode()
def forward_docs(
    target: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, docs: list[str], max_tokens: int, chunk: int,
    batch: int, cache_dir=None, block_tokens: int = 0,
) -> list[dict]:
    """Teacher-forced target features on documentation text: chunks of ``chunk`` tokens, ``batch``
    chunks per forward, about ``max_tokens`` tokens in all.

    The chunks, in document order, form blocks of about ``block_tokens`` tokens (0: one block);
    within a block they are sorted by length and batched. Block i is cached as
    ``cache_dir(i)/docs_XXXX.pt`` (``cache_dir``: a callable block index → Path, or None), so a
    larger ``max_tokens`` reuses the blocks already computed.

    Returns:
        examples (see the data format) with ``hidden`` (chunk, H) float16 and ``start`` 0.
    """
    chunks: list[list[int]] = []
    for d in docs:
        ids = tokenizer(d, add_special_tokens=False)["input_ids"]
        for i in range(0, len(ids) - 16, chunk):
            piece = ids[i:i + chunk]
            if len(piece) >= 16:
                chunks.append(piece)
        if sum(map(len, chunks)) >= max_tokens:
            break
    blocks: list[list[list[int]]] = [[]]
    n_tok = n_blk = 0
    for c in chunks:
        if n_tok >= max_tokens:
            break
        if block_tokens and n_blk >= block_tokens:
            blocks.append([])
            n_blk = 0
        blocks[-1].append(c)
        n_tok += len(c)
        n_blk += len(c)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    data: list[dict] = []
    for bi, keep in enumerate(blocks):
        keep = sorted(keep, key=len)
        cdir = cache_dir(bi) if cache_dir is not None else None
        if cdir is not None:
            cdir.mkdir(parents=True, exist_ok=True)
        groups = [keep[i:i + batch] for i in range(0, len(keep), batch)]
        bar = progress_display(groups, desc=f"docs forward {bi + 1}/{len(blocks)}", unit="batch")
        for b, g in enumerate(bar):
            path = cdir / f"docs_{b:04d}.pt" if cdir is not None else None
            data += cached_batch(path, lambda g=g: _docs_batch(target, g, pad_id))
            bar.set_postfix(tokens=sum(len(d["ids"]) for d in data))
    return data


def build_d2t(data: list[dict], K: int, vocab_size: int, extra: list[int] = ()) -> tuple[torch.Tensor, dict]:
    """The draft vocabulary: the K most frequent token ids of ``data`` (ties by id), plus ``extra``
    ids (EOS) — sorted int64 (≤ K,). Also returns the coverage (share of training tokens inside the
    top-k set) for several k."""
    cnt: Counter = Counter()
    for d in data:
        cnt.update(d["ids"][d.get("start", 0):].tolist())
    ranked = [t for t, _ in sorted(cnt.items(), key=lambda kv: (-kv[1], kv[0])) if t < vocab_size]
    total = sum(cnt.values())
    ext = [int(e) for e in extra if int(e) < vocab_size]
    top = ranked[: max(0, K - len(ext))]
    d2t = torch.tensor(sorted(set(top) | set(ext)), dtype=torch.long)
    cov = {}
    for k in (1024, 2048, 4096, 8192, 16384, 32768):
        if k <= vocab_size:
            cov[str(k)] = sum(cnt[t] for t in ranked[:k]) / max(1, total)
    cov["distinct_tokens"] = len(ranked)
    return d2t, cov


# ----------------------------------------------------------------------------- training
def ttt_mask(m: int, k: int, lengths: torch.Tensor) -> torch.Tensor:
    """Attention of draft step k (1-based) in a training-time-test unroll, bool (B, 1, m, k·m).

    Keys are laid out step by step ([step 1 keys (m) | step 2 keys (m) | ...]); a step-k query at
    position t sees the step-1 (true feature) keys at positions ≤ t − k + 1 and the step-s key at
    position t − (k − s) for s = 2 .. k — what the drafter's cache holds at draft step k. Keys at
    positions ≥ the sequence's length (padding) are masked.
    """
    t = torch.arange(m)
    j = torch.arange(m)
    blocks = [(j[None, :] <= t[:, None] - k + 1)]
    for s in range(2, k + 1):
        blocks.append(j[None, :] == t[:, None] - (k - s))
    base = torch.cat(blocks, dim=1)  # (m, k·m)
    valid = (j[None, :] < lengths[:, None]).repeat(1, k)  # (B, k·m)
    mask = base[None] & valid[:, None, :]
    mask[:, :, -m:] |= torch.eye(m, dtype=torch.bool)[None]  # a query always sees itself (no empty rows)
    return mask[:, None]


def make_batch(examples: list[dict], max_len: int = 0) -> dict:
    """Right-padded batch of m = max(n_h) − 1 head positions.

    Returns: ``feat`` float32 (B, m, H) = hidden[t], ``tok`` int64 (B, m) = ids[t + 1],
    ``teach`` float32 (B, m, H) = hidden[t + 1], ``lengths`` int64 (B,), ``loss_mask`` bool (B, m)
    (start ≤ t ≤ n_h − 2).
    """
    ms = [min(d["hidden"].shape[0], len(d["ids"]), max_len or 10**9) - 1 for d in examples]
    m = max(ms)
    B, H = len(examples), examples[0]["hidden"].shape[1]
    feat = torch.zeros(B, m, H)
    teach = torch.zeros(B, m, H)
    tok = torch.zeros(B, m, dtype=torch.long)
    lm = torch.zeros(B, m, dtype=torch.bool)
    for b, (d, n) in enumerate(zip(examples, ms)):
        h = d["hidden"][: n + 1].float()
        feat[b, :n] = h[:n]
        teach[b, :n] = h[1:n + 1]
        tok[b, :n] = d["ids"][1:n + 1]
        lm[b, d["start"]:n] = True
    return {"feat": feat, "tok": tok, "teach": teach, "lengths": torch.tensor(ms), "loss_mask": lm}


def head_losses(head: DraftHead, batch: dict, ttt_steps: int, ttt_decay: float, reg_weight: float,
                noise_std: float = 0.0, generator: torch.Generator | None = None) -> dict:
    """Training-time-test unroll of ``ttt_steps`` draft steps over a batch (see :func:`ttt_mask`).

    Step k's input feature at position t is the step-(k−1) output at t − 1 (step 1: the true
    feature plus Gaussian noise of std ``noise_std``); all steps at t share the token x_{t+1} and the
    teacher f_{t+1}. Under a bfloat16 autocast the matmuls run in bfloat16; the log-softmaxes, the KL and
    the regression in float32. Loss of a step = KL(p ‖ q) + ``reg_weight`` · smooth-L1(g, f_{t+1}) averaged over its
    valid positions (t ≥ k − 1 and in the loss mask); total = Σ_k ``ttt_decay``^(k−1) · loss_k / Σ weights.

    Returns:
        dict of scalar tensors: ``loss``, and per step k ``kl{k}``, ``reg{k}``, ``top1_{k}`` (the head's top-1 equals
        the target's top-1 within the draft vocabulary), ``n{k}`` (positions).
    """
    feat, tok, teach, lengths, lmask = batch["feat"], batch["tok"], batch["teach"], batch["lengths"], batch["loss_mask"]
    B, m, _ = feat.shape
    pos = torch.arange(m)[None].expand(B, m)
    with torch.no_grad():
        p_logits = head.logits(teach).float()
        logp = torch.log_softmax(p_logits, dim=-1)
        p = logp.exp()
        p_top = p_logits.argmax(-1)
    x = feat
    if noise_std > 0:
        x = x + noise_std * torch.randn(x.shape, generator=generator)
    cache = DynamicCache()
    out: dict = {}
    total, wsum = 0.0, 0.0
    g = None  # the previous step's prediction, fed back from step 2 on
    for k in range(1, ttt_steps + 1):
        if k > 1:
            x = torch.cat([torch.zeros_like(g[:, :1]), g[:, :-1]], dim=1)  # feature at t = prediction at t − 1
        g = head(x, tok, pos, attention_mask=ttt_mask(m, k, lengths), cache=cache)
        sel = lmask & (pos >= k - 1)
        n = int(sel.sum())
        if n == 0:
            continue
        lq = torch.log_softmax(head.logits(g[sel]).float(), dim=-1)  # float32 under a bfloat16 autocast too
        kl = (p[sel] * (logp[sel] - lq)).sum(-1).mean()
        reg = F.smooth_l1_loss(g[sel].float(), teach[sel])
        w = ttt_decay ** (k - 1)
        total = total + w * (kl + reg_weight * reg)
        wsum += w
        out[f"kl{k}"], out[f"reg{k}"] = kl.detach(), reg.detach()
        out[f"top1_{k}"] = (lq.argmax(-1) == p_top[sel]).float().mean().detach()
        out[f"n{k}"] = torch.tensor(float(n))
    out["loss"] = total / max(wsum, 1e-9)
    return out


def _batches(data: list[dict], batch_tokens: int, seed: int, epoch: int) -> list[list[int]]:
    """Index batches of about ``batch_tokens`` positions, examples of similar length together, shuffled."""
    rng = random.Random(seed * 7919 + epoch)
    idx = list(range(len(data)))
    rng.shuffle(idx)
    idx.sort(key=lambda i: len(data[i]["ids"]) // 16)  # stable: shuffled within length buckets
    out, cur, cur_max = [], [], 0
    for i in idx:
        n = len(data[i]["ids"])
        if cur and max(cur_max, n) * (len(cur) + 1) > batch_tokens:
            out.append(cur)
            cur, cur_max = [], 0
        cur.append(i)
        cur_max = max(cur_max, n)
    if cur:
        out.append(cur)
    rng.shuffle(out)
    return out


def _batch_at(data: list[dict], batch_tokens: int, seed: int, step: int, state: dict) -> tuple[list[int], int]:
    """The index batch of training step ``step`` and its epoch: the steps walk epoch 0's
    :func:`_batches`, then epoch 1's, and so on. Each epoch packs its own shuffle, so epochs hold
    different numbers of batches; ``state`` caches the current epoch (``{}`` to start, also on
    resume: the walk from epoch 0 finds the epoch of any ``step``)."""
    if not state or step < state["base"]:
        state.update(epoch=0, base=0, batches=_batches(data, batch_tokens, seed, 0))
    while step >= state["base"] + len(state["batches"]):
        state.update(epoch=state["epoch"] + 1, base=state["base"] + len(state["batches"]),
                     batches=_batches(data, batch_tokens, seed, state["epoch"] + 1))
    return state["batches"][step - state["base"]], state["epoch"]


@torch.no_grad()
def evaluate_heldout(head: DraftHead, data: list[dict], ttt_steps: int, batch_tokens: int = 4096) -> dict:
    """Top-1 agreement with the target's argmax within the draft vocabulary, per draft step, on ``data``."""
    head.eval()
    agree = [0.0] * ttt_steps
    n = [0] * ttt_steps
    for idx in _batches(data, batch_tokens, 0, 0):
        m = head_losses(head, make_batch([data[i] for i in idx]), ttt_steps, 1.0, 0.0)
        for k in range(1, ttt_steps + 1):
            if f"n{k}" in m:
                agree[k - 1] += float(m[f"top1_{k}"]) * float(m[f"n{k}"])
                n[k - 1] += int(m[f"n{k}"])
    head.train()
    return {f"top1_{k + 1}": agree[k] / max(1, n[k]) for k in range(ttt_steps)} | {"positions": n[0]}


class _BestHeldout:
    """The held-out scores of a head training run (:func:`evaluate_heldout`), and the best one with
    the head state that reached it (early stopping: the sum of the per-step top-1 agreements).
    Without held-out data the latest state counts as the best."""

    def __init__(self, heldout: list[dict], ttt_steps: int, best: dict | None = None, best_state: dict | None = None,
                 history: list[dict] | None = None):
        self.heldout, self.ttt_steps = heldout, ttt_steps
        self.best, self.best_state, self.history = best, best_state, history if history is not None else []

    def score(self, head: DraftHead, step: int, wandb_run=None) -> None:
        """Score ``head`` at ``step``, keep its state if it is the best so far, log to W&B."""
        if not self.heldout:
            self.best_state = {k: v.clone() for k, v in head.head_state_dict().items()}
            self.best = {"step": step}
            return
        ev = evaluate_heldout(head, self.heldout, self.ttt_steps) | {"step": step}
        self.history.append(ev)
        key = sum(ev[f"top1_{k}"] for k in range(1, self.ttt_steps + 1))
        if self.best is None or key > self.best["_key"]:
            self.best = ev | {"_key": key}
            self.best_state = {k: v.clone() for k, v in head.head_state_dict().items()}
        if wandb_run is not None:
            wandb_run.log({f"heldout/{k}": v for k, v in ev.items()}, step=step)
        log.info("held-out at step %d: %s", step, {k: round(v, 4) for k, v in ev.items() if k.startswith("top1")})


def train_head(head: DraftHead, train: list[dict], heldout: list[dict], cfg: HeadConfig, work_dir: Path,
               train_key: str, restart: bool = False, wandb_run=None, also_resume: tuple[str, ...] = ()) -> dict:
    """Train ``head`` in place (see the module docstring, phase 3); keep the best held-out state.

    Checkpoints (head, optimizer, step, best state, seconds) go to ``work_dir/checkpoint.pt`` every
    ``cfg.ckpt_every`` steps and on Ctrl-C between weight updates (:class:`train.recipes.common.CheckpointOnInterrupt`);
    a call with the same ``train_key`` (or one of ``also_resume``: the same run with another time cap) resumes
    unless ``restart``.
    Progress = max(step / steps, seconds / cap) drives the cosine schedule and ends training at 1.

    Returns:
        dict: ``start_step``, ``step``, ``train_seconds`` (this call), ``total_train_seconds``,
        ``best`` (held-out metrics of the kept state, with its ``step``), ``history`` (held-out
        scores), ``last`` (last training metrics), ``stopped_by_time``.

    Raises:
        HeadTrainError: no training data.
    """
    if not train:
        raise HeadTrainError("No training data: the target produced no answers and no documentation was found.")
    ckpt = work_dir / CKPT_NAME
    params = [p for n, p in head.named_parameters()]
    opt = torch.optim.AdamW(params, lr=cfg.lr, weight_decay=cfg.weight_decay, betas=(0.9, 0.95))
    step, prior_s, tracker = 0, 0.0, _BestHeldout(heldout, cfg.ttt_steps)
    ck = load_checkpoint(ckpt, (train_key, *also_resume), restart)
    if ck is not None:
        head.load_state_dict(ck["head"], strict=False)
        opt.load_state_dict(ck["optimizer"])
        step, prior_s = ck["step"], ck["train_seconds"]
        tracker = _BestHeldout(heldout, cfg.ttt_steps, ck["best"], ck["best_state"], ck["history"])
    start_step = step
    rms = float(torch.cat([d["hidden"][:64].float() for d in train[:200]]).pow(2).mean().sqrt())
    noise_std = cfg.feat_noise * rms
    gen = torch.Generator().manual_seed(cfg.seed + step)
    t0 = time.perf_counter()

    def save():
        save_atomic({"head": head.head_state_dict(), "optimizer": opt.state_dict(), "step": step,
                     "train_seconds": prior_s + time.perf_counter() - t0, "best": tracker.best,
                     "best_state": tracker.best_state, "history": tracker.history, "train_key": train_key,
                     "config": asdict(cfg)}, ckpt)

    head.train()
    last: dict = {}
    stopped = False
    walk: dict = {}
    bar = progress_display(total=cfg.steps, initial=step, desc="train head", unit="step")
    # Ctrl-C keeps the steps done since the last checkpoint (not inside a weight update)
    with CheckpointOnInterrupt(save) as guard, contextlib.closing(bar):
        while step < cfg.steps:
            done = progress(step, cfg.steps, prior_s + time.perf_counter() - t0, cfg.max_train_minutes)
            if done >= 1.0:
                stopped = step < cfg.steps
                break
            idx, epoch = _batch_at(train, cfg.batch_tokens, cfg.seed, step, walk)
            batch = make_batch([train[i] for i in idx])
            ts = time.perf_counter()
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=cfg.dtype == "bfloat16"):
                m = head_losses(head, batch, cfg.ttt_steps, cfg.ttt_decay, cfg.reg_weight, noise_std, gen)
            with guard.updating():
                optimizer_step(opt, params, m["loss"], lr_at(step, done, cfg.lr, cfg.warmup))
            step += 1
            last = {k2: float(v.detach()) for k2, v in m.items()} | {
                "lr": opt.param_groups[0]["lr"], "epoch": epoch,
                "positions_per_s": float(batch["loss_mask"].sum()) / (time.perf_counter() - ts)}
            if wandb_run is not None:
                wandb_run.log({f"train/{k2}": v for k2, v in last.items()}, step=step)
            bar.update(1)
            bar.set_postfix(loss=f"{last['loss']:.3f}", top1=f"{last.get('top1_1', 0):.3f}", ep=epoch)
            if step % cfg.eval_every == 0:
                tracker.score(head, step, wandb_run)
            if step % cfg.ckpt_every == 0:
                save()
    if not tracker.history or tracker.history[-1]["step"] != step:
        tracker.score(head, step, wandb_run)
    save()
    if tracker.best_state is not None:
        head.load_state_dict(tracker.best_state, strict=False)
    head.eval()
    return {"start_step": start_step, "step": step, "train_seconds": time.perf_counter() - t0,
            "total_train_seconds": prior_s + time.perf_counter() - t0,
            "best": {k: v for k, v in (tracker.best or {}).items() if k != "_key"}, "history": tracker.history,
            "last": last, "stopped_by_time": stopped}


# ----------------------------------------------------------------------------- measurement
@torch.no_grad()
def measure_alpha(head: DraftHead, examples: list[dict], steps: int = 3) -> dict:
    """α at temperature 0 along the target's own greedy continuations ``examples`` (from
    :func:`generate_answers`, float features): per draft step k, the share of answer positions where
    the head's top-1 (over the full vocabulary: ids outside the draft vocabulary are never
    proposed) equals the target's greedy token. Step 1 reads true features; step k > 1 the head's
    own step-(k−1) features (true tokens: the acceptance of step k given that the earlier steps
    were accepted), with the drafter's attention pattern (:func:`ttt_mask`). The head runs in its
    own dtype (the features are cast to it).

    Returns:
        dict: ``alpha_step{k}``, ``alpha_greedy`` (= step 1), ``alpha_per_prompt`` (step 1), ``positions``.
    """
    head.eval()
    agree = [0] * steps
    n = [0] * steps
    per_prompt = []
    for d in examples:
        b = make_batch([d])
        m = b["feat"].shape[1]
        pos = torch.arange(m)[None]
        cache = DynamicCache()
        x = b["feat"].to(head.fc.weight.dtype)
        target_next = torch.full((m,), -1, dtype=torch.long)  # position t predicts token t + 2
        nxt = d["ids"][2:m + 2]
        target_next[: nxt.numel()] = nxt
        a_p, n_p = 0, 0
        g = None  # the previous step's prediction, fed back from step 2 on
        for k in range(1, steps + 1):
            if k > 1:
                x = torch.cat([torch.zeros_like(g[:, :1]), g[:, :-1]], dim=1)
            g = head(x, b["tok"], pos, attention_mask=ttt_mask(m, k, b["lengths"]), cache=cache)
            pred = head.d2t[head.logits(g[0]).argmax(-1)]
            sel = b["loss_mask"][0] & (torch.arange(m) >= k - 1) & (target_next >= 0)
            hit = int((pred[sel] == target_next[sel]).sum())
            agree[k - 1] += hit
            n[k - 1] += int(sel.sum())
            if k == 1:
                a_p, n_p = hit, int(sel.sum())
        per_prompt.append(a_p / max(1, n_p))
    res = {f"alpha_step{k + 1}": agree[k] / max(1, n[k]) for k in range(steps)}
    res |= {"alpha_greedy": res["alpha_step1"], "alpha_per_prompt": per_prompt, "positions": n[0]}
    return res


@torch.inference_mode()
def measure_cost(head: DraftHead, target: PreTrainedModel, tokenizer, examples: list[dict], vocab_size: int,
                 repeats: int = 30, contexts: int = 4) -> dict:
    """Cost of one draft step of the head (HeadDrafter.propose at a predicted position: one decoder
    position with KV cache, LM-head rows, scatter to V, greedy processing, draw) against one
    target forward of one token with KV cache, on ``contexts`` of the held-out sequences,
    interleaved, median after a warm-up.

    Returns:
        dict: ``head_ms``, ``target_ms``, ``cost_ratio``, ``head_forward_ms`` (decoder + LM-head rows only),
        ``timing_context_lens``, ``timing_samples``, ``threads``.
    """
    from learn2draft.drafters.head import HeadDrafter
    from learn2draft.sampling import SamplingConfig

    drafter = HeadDrafter(head, vocab_size)
    greedy = SamplingConfig()
    seqs = sorted(examples, key=lambda d: len(d["ids"]))
    seqs = seqs[:: max(1, len(seqs) // contexts)][:contexts]
    samples = {"head": [], "target": [], "fwd": []}
    lens = []
    for d in seqs:
        ids = d["ids"].to(target.device)
        lens.append(int(ids.numel()))
        c = DynamicCache()
        out = target(input_ids=ids[None, :-1], cache=c, use_cache=True, output_hidden_states=True)
        drafter.start(ids)
        drafter.observe_target(out.hidden_states[-1][0], 0)
        drafter.predict(ids)  # fills the head cache with true positions; the next call is a draft step
        n = ids.numel()
        seq2 = torch.cat([ids, ids[-1:]])
        for r in range(repeats + 3):
            t0 = time.perf_counter()
            drafter.propose(seq2, greedy, None)
            t1 = time.perf_counter()
            drafter.rollback(n - 1)
            drafter.predict(ids)
            t2 = time.perf_counter()
            target(input_ids=ids[None, -1:], cache=c, use_cache=True)
            t3 = time.perf_counter()
            c.crop(-1)
            g = drafter.last_g[None, None]
            t4 = time.perf_counter()
            head.logits(head(g, ids[None, -1:], torch.tensor([[n]]), cache=drafter.cache))
            t5 = time.perf_counter()
            drafter.cache.crop(-1)
            if r >= 3:
                samples["head"].append(t1 - t0)
                samples["target"].append(t3 - t2)
                samples["fwd"].append(t5 - t4)
    h = 1000 * statistics.median(samples["head"])
    t = 1000 * statistics.median(samples["target"])
    return {"head_ms": h, "target_ms": t, "cost_ratio": h / t, "head_forward_ms": 1000 * statistics.median(samples["fwd"]),
            "timing_context_lens": lens, "timing_samples": len(samples["head"]), "threads": torch.get_num_threads()}


# ----------------------------------------------------------------------------- driver
def _is_head_dir(path: Path) -> bool:
    """A directory this recipe wrote: a head ``config.json`` of :data:`HEAD_FORMAT` and a build report
    (a draft model written by ``train.recipes.draft_model`` also has a build report, but no head config)."""
    try:
        meta = json.loads((path / HEAD_CONFIG).read_text())
    except (OSError, ValueError):
        return False
    return isinstance(meta, dict) and meta.get("format") == HEAD_FORMAT and (path / "build_report.json").is_file()


def check_out_dir(out: Path, target: str) -> None:
    """Refuse an ``--out`` whose contents this tool did not write (it is replaced at the end), before slow work.

    Raises:
        HeadTrainError: ``out`` is a file, not writable, holds other files, or is the shipped head
            while ``target`` is not the embedded target.
    """
    _check_out_dir(out, target, shipped=DEFAULT_HEAD_DIR, what="head", is_ours=_is_head_dir, error=HeadTrainError,
                   foreign="holds files this tool did not write (no draft head with its build_report.json): choose "
                           "a new or empty directory.")


def split_heldout(examples: list[dict], fraction: float, seed: int) -> tuple[list[dict], list[dict]]:
    """Split generated answers by prompt: a ``fraction`` share (at least one when > 0) is held out."""
    if fraction <= 0 or len(examples) < 2:
        return examples, []
    rng = random.Random(seed + 1)
    idx = list(range(len(examples)))
    rng.shuffle(idx)
    k = max(1, round(fraction * len(examples)))
    held = set(idx[:k])
    return [e for i, e in enumerate(examples) if i not in held], [e for i, e in enumerate(examples) if i in held]


def _head_data(cfg: HeadConfig, target: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, prompts: list[str],
               docs: list[str] | None, work: Path) -> dict:
    """Phase 1 of :func:`build_head`: the target's answers to ``prompts`` (in cached blocks of
    :data:`GEN_BLOCK` prompts: a larger ``--num-prompts`` reuses them) and its features on
    documentation text. Returns ``answers``, ``docs`` (examples), ``key`` (hash of both data sets)
    and the seconds of each part (``generate``, ``docs_forward``)."""
    t0 = time.perf_counter()
    answers, gkeys = [], []
    for i in range(0, len(prompts), GEN_BLOCK):
        gkeys.append(cfg.gen_key(prompts[i:i + GEN_BLOCK]))
        (work / "gen" / gkeys[-1]).mkdir(parents=True, exist_ok=True)
        answers += generate_answers(target, tokenizer, prompts[i:i + GEN_BLOCK], cfg.max_new_tokens, cfg.gen_batch_size,
                                    work / "gen" / gkeys[-1], desc=f"generate {i // GEN_BLOCK + 1}")
    gkey = hashlib.sha256("".join(gkeys).encode()).hexdigest()[:16]
    gen_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    dkey = hashlib.sha256(f"{cfg.docs_key()}:{cfg.docs_tokens}".encode()).hexdigest()[:16]
    doc_data: list[dict] = []
    if cfg.docs_tokens > 0:
        if docs is None:
            docs = collect_docs_text(max_chars=cfg.docs_tokens * 6, seed=cfg.seed)
        doc_data = forward_docs(target, tokenizer, docs, cfg.docs_tokens, cfg.docs_chunk, cfg.docs_batch,
                                lambda i: work / "docs" / cfg.docs_key(i), block_tokens=DOCS_BLOCK)
    return {"answers": answers, "docs": doc_data, "key": gkey + dkey, "generate": gen_s,
            "docs_forward": time.perf_counter() - t0}


def _data_info(prompts: list[str], answers: list[dict], held: list[dict], doc_data: list[dict],
               train: list[dict]) -> dict:
    """The build report's ``data`` entry: counts of prompts, answers, tokens and training positions,
    and the generation / forward seconds recorded in the cached data (earlier sittings included)."""
    return {"prompts": len(prompts), "answers": len(answers),
            "answer_tokens": sum(len(d["ids"]) - d["prompt_len"] for d in answers),
            "heldout_answers": len(held), "docs_chunks": len(doc_data), "docs_tokens": sum(len(d["ids"]) for d in doc_data),
            "train_positions": sum(max(0, d["hidden"].shape[0] - 1 - d["start"]) for d in train),
            "generation_seconds_recorded": sum(d.get("seconds", 0.0) for d in answers),
            "docs_seconds_recorded": sum(d.get("seconds", 0.0) for d in doc_data)}


def _continued_keys(cfg: HeadConfig, work: Path, data_key: str, restart: bool) -> tuple[str, ...]:
    """Training keys of the checkpoint in ``work`` that this run may continue besides its own: the
    same run with a shorter ``--max-train-minutes`` (a longer cap continues a finished run)."""
    if not (work / CKPT_NAME).exists() or restart:
        return ()
    old = torch.load(work / CKPT_NAME, weights_only=False).get("config", {}).get("max_train_minutes")
    if isinstance(old, (int, float)) and old <= cfg.max_train_minutes:
        return (dataclasses.replace(cfg, max_train_minutes=old).train_key(data_key),)
    return ()


def _measure_head(head: DraftHead, target: PreTrainedModel, tokenizer: PreTrainedTokenizerBase,
                  eval_prompts: list[str], cfg: HeadConfig, vocab_size: int) -> dict:
    """Phase 4 of :func:`build_head`: α per draft step (:func:`measure_alpha`) and the cost per
    draft step (:func:`measure_cost`) along the target's greedy answers to ``eval_prompts``, with the
    head in the target's dtype (as :func:`learn2draft.drafters.head.load_head_drafter` runs it)."""
    dt = next(target.parameters()).dtype
    if dt != head.fc.weight.dtype:
        head = copy.deepcopy(head).to(dt).attach_target(target)
    ev = generate_answers(target, tokenizer, eval_prompts, cfg.eval_max_new_tokens, len(eval_prompts), None,
                          desc="held-out answers")
    for d in ev:
        d["hidden"] = d["hidden"].float()
        d["start"] = d["prompt_len"] - 1  # from the answer's second token (the first comes from the prefill)
    alpha = measure_alpha(head, ev, steps=max(3, cfg.ttt_steps))
    return alpha | measure_cost(head, target, tokenizer, ev, vocab_size, repeats=cfg.timing_repeats) | {
        "dtype": str(dt).removeprefix("torch.")}


def _head_report(cfg: HeadConfig, command: str | None, n_params: int, lcfg, d2t: torch.Tensor, coverage: dict,
                 data_info: dict, tr: dict, measure: dict, seconds: dict) -> dict:
    """The build report (``build_report.json`` without its size): settings, the head's architecture
    and draft vocabulary, the data, training and measurement summaries and the phases' seconds."""
    return {
        "target": cfg.target,
        "command": command or "",
        "config": asdict(cfg),
        "head_parameters": n_params,
        "head_architecture": {"hidden_size": lcfg.hidden_size, "intermediate_size": lcfg.intermediate_size,
                              "num_attention_heads": lcfg.num_attention_heads,
                              "num_key_value_heads": lcfg.num_key_value_heads, "draft_vocab_size": int(d2t.numel()),
                              "layers": 1},
        "draft_vocab_coverage": coverage,
        "data": data_info,
        "training": {k: tr[k] for k in ("start_step", "step", "train_seconds", "total_train_seconds",
                                          "stopped_by_time", "best", "history", "last")},
        "measure": measure,
        "measure_prompts": measure_prompts_note(cfg.eval_prompts),
        "seconds": seconds,
        **environment(),
    }


def resolve_head_dtype(cfg: HeadConfig, target: PreTrainedModel | None = None) -> HeadConfig:
    """``cfg`` with ``dtype`` resolved to a canonical name (before any data key is computed): ``auto`` →
    :func:`learn2draft.models.resolve_dtype` on the CPU at ``cfg.threads`` threads, or the dtype of an
    already loaded ``target`` (tests).

    Raises:
        HeadTrainError: an unknown ``--dtype``, or one that differs from the given ``target``'s.
    """
    try:
        name = None if cfg.dtype == "auto" else resolve_dtype(cfg.dtype)
    except ValueError as e:
        raise HeadTrainError(f"--dtype: {e}") from None
    if target is not None:
        have = str(next(target.parameters()).dtype).removeprefix("torch.")
        if name is not None and name != have:
            raise HeadTrainError(f"--dtype {cfg.dtype} but the given target is in {have}: pass --dtype {have} or auto.")
        name = have
    return dataclasses.replace(cfg, dtype=name or resolve_dtype("auto", "cpu", cfg.threads))


def build_head(cfg: HeadConfig, target: PreTrainedModel | None = None, tokenizer: PreTrainedTokenizerBase | None = None,
               prompts: list[str] | None = None, eval_prompts: list[str] | None = None,
               docs: list[str] | None = None, restart: bool = False, command: str | None = None,
               data_only: bool = False) -> dict:
    """Run the whole recipe and write the head to ``cfg.out``; return the build report.

    Args:
        cfg: settings (checked first; ``dtype`` resolved by :func:`resolve_head_dtype`).
        target, tokenizer: already loaded (tests); loaded from ``cfg.target`` when None.
        prompts: distillation prompts (default ``cfg.prompts_file``; checked disjoint from prompts.json).
        eval_prompts: prompts for the α measurement (default: the held-out policy prompts).
        docs: documentation texts (default: :func:`collect_docs_text` over site-packages).
        restart: ignore an existing training checkpoint (cached data is kept).
        command: the command line recorded in the report.
        data_only: stop after phase 1 (fill the data cache) and return the data summary.

    Raises:
        HeadTrainError: bad settings or paths. ModelLoadError: the target cannot be loaded.
    """
    t_start = time.perf_counter()
    cfg.check()
    cfg = resolve_head_dtype(cfg, target)
    out = Path(cfg.out).expanduser().resolve()
    check_out_dir(out, cfg.target)
    torch.manual_seed(cfg.seed)
    random.seed(cfg.seed)
    prompts = select_distill_prompts(prompts, cfg.prompts_file, cfg.num_prompts)
    eval_prompts = select_eval_prompts(eval_prompts, cfg.eval_prompts)
    target, tokenizer = load_target(cfg.target, target, tokenizer, cfg.dtype)
    V = len(tokenizer)
    work = work_dir_for(cfg.work_dir, DEFAULT_WORK_DIR, cfg.target)
    work.mkdir(parents=True, exist_ok=True)

    # ---- phase 1: data
    data = _head_data(cfg, target, tokenizer, prompts, docs, work)
    train_ans, held_ans = split_heldout(data["answers"], cfg.heldout_fraction, cfg.seed)
    train = train_ans + data["docs"]
    data_info = _data_info(prompts, data["answers"], held_ans, data["docs"], train)
    log.info("data: %s", data_info)
    if data_only:
        return {"data": data_info, "seconds": {"generate": data["generate"], "docs_forward": data["docs_forward"]}}

    # ---- phase 2: draft vocabulary and head
    eos = sorted(eos_token_ids(target, tokenizer))
    d2t, coverage = build_d2t(train, cfg.draft_vocab, V, extra=eos)
    lcfg = head_llama_config(target.config, cfg.intermediate or None)
    torch.manual_seed(cfg.seed)
    head = DraftHead(lcfg, d2t).attach_target(target, init_norm=True)
    n_params = sum(p.numel() for p in head.parameters())
    tkey = cfg.train_key(data["key"])
    also = _continued_keys(cfg, work, data["key"], restart)
    run = start_wandb(cfg, work, tkey, restart, "head")
    if run is not None:
        run.log({f"data/{k}": v for k, v in data_info.items()})

    # ---- phase 3: training
    tr = train_head(head, train, held_ans, cfg, work, tkey, restart=restart, wandb_run=run, also_resume=also)

    # ---- phase 4: measurement on the held-out policy prompts
    t0 = time.perf_counter()
    measure = _measure_head(head, target, tokenizer, eval_prompts, cfg, V)
    eval_s = time.perf_counter() - t0

    # ---- phase 5: output
    tmp = fresh_build_dir(out)
    save_dtype = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}[cfg.save_dtype]
    head.save(tmp, extra={"target": cfg.target, "target_hidden_size": target.config.hidden_size,
                          "target_vocab_size": V}, dtype=save_dtype)
    report = _head_report(cfg, command, n_params, lcfg, d2t, coverage, data_info, tr, measure,
                          {"generate": data["generate"], "docs_forward": data["docs_forward"],
                           "train": tr["train_seconds"], "measure": eval_s})
    report["seconds"]["total"] = time.perf_counter() - t_start
    # What a build from scratch costs: the recorded time of every cached data shard (earlier sittings included),
    # all training sittings, this measurement.
    report["seconds"]["from_scratch"] = (data_info["generation_seconds_recorded"] + data_info["docs_seconds_recorded"]
                                         + tr["total_train_seconds"] + eval_s)
    publish_build(tmp, out, report, 8192, run)
    return report


def build_parser() -> argparse.ArgumentParser:
    """The command line of ``python -m train.recipes.head`` (defaults = the shipped head's recipe)."""
    d = HeadConfig()
    ap = argparse.ArgumentParser(
        prog="python -m train.recipes.head", allow_abbrev=False,
        description="Train an EAGLE-style draft head (one decoder layer over the target's hidden states, frequent-token "
                    "draft vocabulary) by self-distillation, measure its acceptance rate and cost, save it.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    ap.add_argument("--target", default=d.target, help="target: alias, hub id, local directory or .gguf file")
    ap.add_argument("--out", default=d.out, help="output directory (config.json, head.safetensors, build_report.json)")
    ap.add_argument("--work-dir", default="", help="data cache / checkpoint directory (empty: runs/head/<target>)")
    ap.add_argument("--prompts-file", default=d.prompts_file, help="JSON list of distillation prompts")
    ap.add_argument("--restart", action="store_true", help="ignore an existing training checkpoint (data cache is kept)")
    ap.add_argument("--wandb-mode", default=d.wandb_mode, choices=["offline", "online", "disabled"],
                    help="W&B mode ($WANDB_MODE if set)")
    ap.add_argument("--data-only", action="store_true", help="only generate / cache the training data, then stop")
    ap.add_argument("-v", "--verbose", action="store_true", help="log progress details")
    helps = {
        "seed": "random seed (data order, held-out split, initialisation)",
        "threads": "torch CPU threads (run builds alone: 2 on a 2-core CPU)",
        "dtype": "target weights' dtype for the data and the measurement (auto: the fastest on this machine); "
                 "bfloat16 also trains the head under bfloat16 autocast",
        "num_prompts": "distillation prompts the target answers",
        "max_new_tokens": "tokens per generated answer",
        "gen_batch_size": "answers generated per batched target.generate call",
        "heldout_fraction": "share of answers held out for early stopping",
        "docs_tokens": "teacher-forced documentation tokens from installed packages",
        "docs_chunk": "tokens per documentation chunk (one target forward each)",
        "docs_batch": "documentation chunks per batched target forward",
        "draft_vocab": "size K of the frequent-token draft vocabulary (FR-Spec)",
        "intermediate": "MLP width of the head's decoder layer (0 = the target's)",
        "steps": "most optimiser steps",
        "batch_tokens": "training positions per optimiser step",
        "lr": "AdamW learning rate",
        "warmup": "linear warm-up steps",
        "weight_decay": "AdamW weight decay",
        "ttt_steps": "training-time-test steps unrolled on the head's own features (EAGLE-3)",
        "ttt_decay": "loss weight decay per unrolled step",
        "reg_weight": "weight of the feature-regression (smooth L1) loss next to the KL loss",
        "feat_noise": "relative Gaussian noise on the input features",
        "eval_every": "steps between held-out evaluations (early stopping)",
        "ckpt_every": "steps between checkpoints (resume)",
        "max_train_minutes": "wall-clock budget for training, minutes (a longer one resumes a finished run)",
        "eval_prompts": "held-out policy prompts for the final α measurement (0 = all)",
        "eval_max_new_tokens": "tokens per prompt in the final α measurement",
        "timing_repeats": "repeats of the head-step / target-forward cost measurement",
        "save_dtype": "dtype of the saved weights",
        "wandb_project": "W&B project",
    }
    add_recipe_flags(ap, d, helps)
    return ap


def parse_args(argv: list[str] | None = None) -> tuple[HeadConfig, argparse.Namespace]:
    """Parse the command line into a :class:`HeadConfig` (defaults = the shipped head's recipe)."""
    from learn2draft.cli import prepare_parser

    a = prepare_parser(build_parser()).parse_args(argv)
    return config_from_args(HeadConfig, a), a


def main(argv: list[str] | None = None) -> int:
    """CLI entry point; returns the exit status (2 on bad input, with a one-line message)."""
    cfg, a = parse_args(argv)
    setup_logging(a.verbose)
    cmd = command_line("python -m train.recipes.head", argv)

    def body() -> int:
        cfg.check()
        check_wandb(cfg.wandb_mode)  # before ~30 min of data generation
        torch.set_num_threads(cfg.threads)
        rep = build_head(cfg, restart=a.restart, command=cmd, data_only=a.data_only)
        if a.data_only:
            print(json.dumps(rep))
            return 0
        m = rep["measure"]
        print(json.dumps({"out": cfg.out, "alpha_step1": round(m["alpha_step1"], 4),
                          "alpha_step2": round(m["alpha_step2"], 4), "alpha_step3": round(m["alpha_step3"], 4),
                          "cost_ratio": round(m["cost_ratio"], 4), "size_mb": round(rep["size_bytes"] / 1e6, 2),
                          "seconds": round(rep["seconds"]["total"], 1)}))
        return 0

    return run_recipe(body)


if __name__ == "__main__":
    sys.exit(main())
