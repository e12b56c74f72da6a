"""Distil a small draft model for any Hugging Face causal LM target.

Recipe (``python -m train.recipes.draft_model --help``):

1. **Data**: the target answers a varied prompt set (``train/recipes/data/distill_prompts.json``,
   disjoint from the policy prompts in ``prompts.json``) through its chat template, greedily and
   with sampling, in batches (``target.generate``). Its raw next-token logits at every response
   position are kept as top-k log-probabilities. The generated data is cached on disk, batch by
   batch, so a rerun (or a resumed run) does not regenerate it.
2. **Draft**: a small ``LlamaForCausalLM`` sharing the target's tokenizer and vocabulary, with a
   tied embedding initialised from the target's output embedding projected to the draft width by
   a truncated PCA (``torch.pca_lowrank``, uncentred).
3. **Training**: knowledge distillation, loss = (1 − w)·KL(p_target ‖ q_draft) + w·CE(argmax p_target),
   the KL taken over the target's top-k tokens plus one "rest" bucket. AdamW, warmup + cosine.
   Checkpoints are written to the work directory periodically and resumed automatically.
4. **Measurement** (:func:`measure_draft`): acceptance rate α on the held-out prompts at
   temperature 0 (top-1 agreement on the target's own greedy continuations) and at temperature 1
   (mean Σ_x min(p, q)), and the cost of one draft forward relative to one target forward.
5. **Output**: a ``save_pretrained`` directory (config, float16 safetensors, the target's
   tokenizer) plus ``build_report.json`` (measured numbers, timings, the exact command).

The defaults are the recipe of the shipped draft ``learn2draft/assets/smollm2-135m-draft`` for
SmolLM2-135M-Instruct; the build goes to ``<work-dir>/draft`` unless ``--out`` names another
directory (``--out learn2draft/assets/smollm2-135m-draft`` rebuilds the shipped draft in place).
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import logging
import math
import os
import random
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from learn2draft.cli import HelpFormatter
from learn2draft.names import DEFAULT_DRAFT_DIR, DEFAULT_TARGET
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

DEFAULT_WORK_DIR = Path("runs") / "distill"  # relative to the working directory


class DistillError(RecipeError):
    """Bad input to the distillation recipe; the message says what to change."""


# ----------------------------------------------------------------------------- config
@dataclass
class DistillConfig:
    """All settings of one build. The defaults are the recipe of the shipped default draft.

    Sizes: ``hidden`` / ``layers`` / ``intermediate`` / ``heads`` / ``kv_heads`` / ``head_dim``
    define the draft's Llama architecture. Generation: ``max_new_tokens`` per response,
    ``num_prompts`` (0 = all), ``sampled_fraction`` of the prompts also answered once with
    sampling at ``sample_temperature`` / ``sample_top_p``. Training: ``steps`` optimizer steps of
    ``batch_size`` sequences, ``lr``, ``warmup``, ``ce_weight`` w, ``topk`` teacher tokens kept,
    ``max_train_minutes`` wall-clock cap (0 = none). Evaluation: ``eval_max_new_tokens``,
    ``timing_repeats`` (per model and context), ``eval_prompts`` (0 = all held-out prompts).
    Paths: ``out`` ("" = ``<work_dir>/draft``), ``work_dir`` ("" = ``runs/distill/<target>``).
    """

    target: str = DEFAULT_TARGET
    out: str = ""
    work_dir: str = ""
    prompts_file: str = str(DISTILL_PROMPTS_FILE)
    seed: int = 0
    hidden: int = 160
    layers: int = 1
    intermediate: int = 1024
    heads: int = 4
    kv_heads: int = 2
    head_dim: int = 40
    num_prompts: int = 0
    max_new_tokens: int = 128
    sampled_fraction: float = 0.25
    sample_temperature: float = 0.8
    sample_top_p: float = 0.95
    gen_batch_size: int = 64
    topk: int = 20
    steps: int = 900
    batch_size: int = 16
    lr: float = 3e-3
    warmup: int = 30
    weight_decay: float = 0.01
    ce_weight: float = 0.5
    bf16: bool = True
    ckpt_every: int = 50
    max_train_minutes: float = 16.0
    eval_max_new_tokens: int = 128
    eval_prompts: int = 0
    timing_repeats: int = 30
    save_dtype: str = "float16"
    wandb_mode: str = field(default_factory=lambda: os.environ.get("WANDB_MODE", "offline"))
    wandb_project: str = "learn2draft-distill"

    def validate(self) -> None:
        """Raise :class:`DistillError` (one line naming the flag) for any setting that would fail, or
        silently do something else, after the slow data generation."""
        for k in ("hidden", "layers", "intermediate", "heads", "kv_heads", "head_dim", "max_new_tokens", "topk",
                  "steps", "batch_size", "gen_batch_size", "ckpt_every", "eval_max_new_tokens", "timing_repeats"):
            if getattr(self, k) <= 0:
                raise DistillError(f"--{k.replace('_', '-')} must be positive, got {getattr(self, k)}.")
        checks = [
            (self.hidden % self.heads == 0, f"--hidden ({self.hidden}) must be a multiple of --heads ({self.heads})."),
            (self.heads % self.kv_heads == 0, f"--heads ({self.heads}) must be a multiple of --kv-heads ({self.kv_heads})."),
            (0 <= self.sampled_fraction <= 1, f"--sampled-fraction must be in [0, 1], got {self.sampled_fraction}."),
            (math.isfinite(self.lr) and self.lr > 0, f"--lr must be > 0, got {self.lr}."),
            (self.warmup >= 0, f"--warmup must be ≥ 0, got {self.warmup}."),
            (math.isfinite(self.weight_decay) and self.weight_decay >= 0, f"--weight-decay must be ≥ 0, got {self.weight_decay}."),
            (0 <= self.ce_weight <= 1, f"--ce-weight must be in [0, 1], got {self.ce_weight}."),
            (math.isfinite(self.sample_temperature) and self.sample_temperature > 0,
             f"--sample-temperature must be > 0, got {self.sample_temperature}."),
            (0 < self.sample_top_p <= 1, f"--sample-top-p must be in (0, 1], got {self.sample_top_p}."),
            (self.num_prompts >= 0, f"--num-prompts must be ≥ 0 (0 = all), got {self.num_prompts}."),
            (self.eval_prompts >= 0, f"--eval-prompts must be ≥ 0 (0 = all), got {self.eval_prompts}."),
            (self.max_train_minutes >= 0, f"--max-train-minutes must be ≥ 0 (0 = no cap), got {self.max_train_minutes}."),
            (self.wandb_mode in ("offline", "online", "disabled"),
             f"--wandb-mode must be offline, online or disabled, got {self.wandb_mode!r}."),
        ]
        for ok, msg in checks:
            if not ok:
                raise DistillError(msg)
        from learn2draft.models import parse_dtype

        try:
            parse_dtype(self.save_dtype)
        except ValueError as e:
            raise DistillError(f"--save-dtype: {e}") from None

    def data_key(self, prompts: list[str]) -> str:
        """Hash of everything that determines the generated data (target, prompts, generation settings)."""
        d = {k: getattr(self, k) for k in ("target", "seed", "max_new_tokens", "sampled_fraction",
                                            "sample_temperature", "sample_top_p", "gen_batch_size", "topk")}
        d["prompts"] = prompts
        return hashlib.sha256(json.dumps(d, sort_keys=True).encode()).hexdigest()[:16]

    def train_key(self, data_key: str) -> str:
        """Hash of everything that determines training (a checkpoint is only resumed if it matches)."""
        d = {k: getattr(self, k) for k in ("hidden", "layers", "intermediate", "heads", "kv_heads", "head_dim",
                                            "steps", "batch_size", "lr", "warmup", "weight_decay", "ce_weight",
                                            "seed", "bf16", "max_train_minutes")}
        d["data"] = data_key
        return hashlib.sha256(json.dumps(d, sort_keys=True).encode()).hexdigest()[:16]


def parse_args(argv: list[str] | None = None) -> tuple[DistillConfig, argparse.Namespace]:
    """Parse the command line into a :class:`DistillConfig` (defaults = the shipped draft's recipe)."""
    from learn2draft.cli import prepare_parser

    a = prepare_parser(build_parser()).parse_args(argv)
    return config_from_args(DistillConfig, a), a


def build_parser() -> argparse.ArgumentParser:
    """The command line of ``python -m train.recipes.draft_model`` (every :class:`DistillConfig` setting has a flag)."""
    d = DistillConfig()
    ap = argparse.ArgumentParser(
        prog="python -m train.recipes.draft_model", allow_abbrev=False,
        description="Distil a small Llama draft model for a Hugging Face causal LM target (knowledge distillation "
                    "on the target's own responses), measure its acceptance rate and cost, save it.",
        formatter_class=HelpFormatter,
    )
    ap.add_argument("--target", default=d.target, help="target: alias, hub id, local directory or .gguf file")
    ap.add_argument("--out", default=d.out,
                    help="output directory, save_pretrained format (default: <work-dir>/draft; "
                         f"--out {DEFAULT_DRAFT_DIR.relative_to(DEFAULT_DRAFT_DIR.parents[2])} rebuilds the shipped draft)")
    ap.add_argument("--work-dir", default="", help="cache / checkpoint directory (default runs/distill/<target>)")
    ap.add_argument("--prompts-file", default=d.prompts_file, help="JSON list of distillation prompts")
    ap.add_argument("--restart", action="store_true", help="ignore an existing training checkpoint (data cache is kept)")
    ap.add_argument("--wandb-mode", default=d.wandb_mode, choices=["offline", "online", "disabled"],
                    help="W&B mode (default: $WANDB_MODE, else offline)")
    ap.add_argument("-v", "--verbose", action="store_true", help="log progress (INFO level)")
    ap.add_argument("--no-bf16", dest="bf16", action="store_false",
                    help="train in float32 instead of bfloat16 autocast")
    helps = {
        "seed": "seeds data sampling, initialisation and training",
        "hidden": "draft hidden size (a multiple of --heads)",
        "layers": "draft transformer layers",
        "intermediate": "draft MLP size",
        "heads": "draft attention heads (a multiple of --kv-heads)",
        "kv_heads": "draft key/value heads",
        "head_dim": "size of one attention head",
        "num_prompts": "distillation prompts used (0 = all)",
        "max_new_tokens": "tokens per target answer",
        "sampled_fraction": "fraction of prompts also answered once with sampling, in [0, 1]",
        "sample_temperature": "temperature of those sampled answers",
        "sample_top_p": "top-p of those sampled answers",
        "gen_batch_size": "prompts per target.generate batch",
        "topk": "teacher tokens kept per position (the rest is one bucket)",
        "steps": "optimizer steps",
        "batch_size": "sequences per step",
        "lr": "peak AdamW learning rate",
        "warmup": "linear warm-up steps",
        "weight_decay": "AdamW weight decay",
        "ce_weight": "w in (1 − w)·KL + w·CE, in [0, 1]",
        "ckpt_every": "steps between training checkpoints",
        "max_train_minutes": "wall-clock cap on training (0 = none)",
        "eval_max_new_tokens": "tokens per held-out prompt when measuring α",
        "eval_prompts": "held-out prompts measured (0 = all)",
        "timing_repeats": "forwards timed per model and context",
        "save_dtype": "dtype of the saved weights",
        "wandb_project": "W&B project name",
    }
    add_recipe_flags(ap, d, helps)
    return ap


if __name__ == "__main__":
    # ``python -m train.recipes.draft_model --help`` (or a mistyped flag) answers here, before torch and
    # transformers are imported below; main() parses the command line again.
    build_parser().parse_args()


import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM, PreTrainedModel, PreTrainedTokenizerBase  # noqa: E402

from learn2draft.cli import progress as progress_display  # noqa: E402
from learn2draft.models import ModelPair, encode_text, eos_token_ids, make_pair, parse_dtype  # noqa: E402
from learn2draft.timing import DeviceClock  # noqa: E402


# ----------------------------------------------------------------------------- data
def _generation_batches(encoded: list[tuple[list[int], bool]], batch_size: int) -> list[list[int]]:
    """Index batches of ``encoded`` (prompt ids, sampled?) sorted by prompt length (less padding),
    each all-greedy or all-sampled."""
    order = sorted(range(len(encoded)), key=lambda i: (encoded[i][1], len(encoded[i][0])))
    batches = []
    for i in range(0, len(order), batch_size):
        idx = order[i:i + batch_size]
        for flag in (False, True):
            sub = [j for j in idx if encoded[j][1] == flag]
            if sub:
                batches.append(sub)
    return batches


def _teacher_batch(target: PreTrainedModel, prompts: list[list[int]], sampled: bool, cfg: DistillConfig,
                   pad_id: int, eos: set[int], vocab_size: int, seed: int) -> list[dict]:
    """The target's answers to one batch of encoded ``prompts`` with its top-k log-probabilities at
    every answer position (see :func:`generate_data`); generation seeded with ``seed``."""
    ids, mask = pad_left(prompts, pad_id)
    torch.manual_seed(seed)
    kw = dict(do_sample=True, temperature=cfg.sample_temperature, top_p=cfg.sample_top_p, top_k=0) if sampled \
        else dict(do_sample=False, temperature=None, top_p=None, top_k=None)
    out = target.generate(
        input_ids=ids.to(target.device), attention_mask=mask.to(target.device), max_new_tokens=cfg.max_new_tokens,
        output_logits=True, return_dict_in_generate=True, pad_token_id=pad_id, **kw,
    )
    new = out.sequences[:, ids.shape[1]:].cpu()
    logits = torch.stack(out.logits, dim=1)  # (B, R, Vm)
    chunk = []
    for r, prompt in enumerate(prompts):
        toks = new[r].tolist()
        n = answer_length(toks, eos)
        if n == 0:
            continue
        lp = torch.log_softmax(logits[r, :n, :vocab_size].float(), dim=-1)
        tl, ti = lp.topk(cfg.topk, dim=-1)
        chunk.append({
            "ids": torch.tensor(prompt + toks[:n], dtype=torch.long),
            "prompt_len": len(prompt),
            "top_idx": ti.to(torch.int32),
            "top_logp": tl.to(torch.float16),
            "sampled": sampled,
        })
    return chunk


@torch.inference_mode()
def generate_data(
    target: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, prompts: list[str], cfg: DistillConfig,
    cache_dir: Path,
) -> list[dict]:
    """Have the target answer ``prompts`` (greedy for all, plus one sampled answer for a
    ``cfg.sampled_fraction`` share) and record its next-token distributions.

    Batches are cached as ``cache_dir/batch_XXXX.pt``; existing batches are loaded, not regenerated.

    Returns:
        one dict per response: ``ids`` int64 (P + R,) prompt then response tokens (EOS included when
        emitted), ``prompt_len`` P, ``top_idx`` int32 (R, k) and ``top_logp`` float16 (R, k): the
        target's k most likely next tokens and their log-probabilities (full softmax, temperature 1)
        at each response position (row r predicts response token r), ``sampled`` bool.
    """
    cache_dir.mkdir(parents=True, exist_ok=True)
    rng = random.Random(cfg.seed)
    jobs = [(p, False) for p in prompts]
    n_s = round(cfg.sampled_fraction * len(prompts))
    jobs += [(p, True) for p in rng.sample(prompts, n_s)]
    encoded = [(encode_text(tokenizer, p), s) for p, s in jobs]  # as the loop encodes prompts
    pad_id = pad_token_id(tokenizer)
    eos = set(eos_token_ids(target, tokenizer))  # the loop's EOS set
    data: list[dict] = []
    # a bar on a terminal, plain lines in a log file
    bar = progress_display(_generation_batches(encoded, cfg.gen_batch_size), desc="generate", unit="batch")
    for b, idx in enumerate(bar):
        sampled = encoded[idx[0]][1]
        data += cached_batch(cache_dir / f"batch_{b:04d}.pt", lambda idx=idx, sampled=sampled, b=b: _teacher_batch(
            target, [encoded[j][0] for j in idx], sampled, cfg, pad_id, eos, len(tokenizer), cfg.seed * 100003 + b))
        bar.set_postfix(tokens=sum(len(d["top_idx"]) for d in data))
    return data


# ----------------------------------------------------------------------------- draft
def make_draft(target: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, cfg: DistillConfig) -> LlamaForCausalLM:
    """A randomly initialised Llama draft with the target's vocabulary and special ids, whose tied
    embedding is the target's output embedding projected on its top ``cfg.hidden`` principal
    directions (uncentred PCA; extra columns, if the draft is wider than the target, stay random).

    Raises:
        DistillError: inconsistent or non-positive sizes (see :meth:`DistillConfig.validate`).
    """
    cfg.validate()
    tcfg = target.config
    W = target.get_output_embeddings().weight.detach().float().cpu()  # (Vm, Ht)
    rope = getattr(tcfg, "rope_parameters", None) or {"rope_type": "default", "rope_theta": 10000.0}
    dcfg = LlamaConfig(
        vocab_size=W.shape[0], hidden_size=cfg.hidden, intermediate_size=cfg.intermediate,
        num_hidden_layers=cfg.layers, num_attention_heads=cfg.heads, num_key_value_heads=cfg.kv_heads,
        head_dim=cfg.head_dim, max_position_embeddings=getattr(tcfg, "max_position_embeddings", 2048),
        rms_norm_eps=1e-5, rope_parameters=dict(rope), tie_word_embeddings=True,
        bos_token_id=tcfg.bos_token_id, eos_token_id=tcfg.eos_token_id, pad_token_id=tcfg.pad_token_id,
    )
    torch.manual_seed(cfg.seed)
    draft = LlamaForCausalLM(dcfg)
    q = min(cfg.hidden, W.shape[1], W.shape[0])
    _, _, Vp = torch.pca_lowrank(W, q=q, center=False, niter=4)
    proj = W @ Vp  # (Vm, q)
    proj = proj * (W.norm(dim=1).mean() / proj.norm(dim=1).mean().clamp_min(1e-8))
    with torch.no_grad():
        emb = draft.get_input_embeddings().weight
        emb[:, :q] = proj
    draft.tie_weights()
    with torch.no_grad():  # start with moderate logits (std ≈ 2) rather than the target's norm scale
        draft.model.norm.weight.fill_(2.0 / float(emb.norm(dim=1).mean().clamp_min(1e-8)))
    draft.generation_config.eos_token_id = target.generation_config.eos_token_id
    draft.generation_config.bos_token_id = target.generation_config.bos_token_id
    draft.generation_config.pad_token_id = target.generation_config.pad_token_id
    return draft


def _batch(data: list[dict], idx: list[int]) -> dict:
    """Right-padded training batch: input ids (B, T), attention mask, and for each response
    position its (batch, position) index and teacher top-k."""
    seqs = [data[i]["ids"][:-1] for i in idx]  # the last token is never an input
    T = max(len(s) for s in seqs)
    ids = torch.zeros(len(seqs), T, dtype=torch.long)
    mask = torch.zeros(len(seqs), T, dtype=torch.long)
    rows, cols, ti, tl = [], [], [], []
    for b, i in enumerate(idx):
        d = data[i]
        s = seqs[b]
        ids[b, :len(s)] = s
        mask[b, :len(s)] = 1
        P, R = d["prompt_len"], len(d["top_idx"])
        cols.append(torch.arange(P - 1, P - 1 + R))
        rows.append(torch.full((R,), b))
        ti.append(d["top_idx"].long())
        tl.append(d["top_logp"].float())
    return {"ids": ids, "mask": mask, "rows": torch.cat(rows), "cols": torch.cat(cols),
            "top_idx": torch.cat(ti), "top_logp": torch.cat(tl)}


def distill_loss(logits: torch.Tensor, top_idx: torch.Tensor, top_logp: torch.Tensor, ce_weight: float) -> dict:
    """KD loss at N positions.

    Args:
        logits: float (N, V) draft logits.
        top_idx: int64 (N, k) the target's k most likely tokens, column 0 its argmax.
        top_logp: float (N, k) their target log-probabilities (full softmax).
        ce_weight: w in [0, 1]; loss = (1 − w)·KL + w·CE, in nats per position.

    Returns:
        dict of scalar tensors ``loss``, ``kl`` (over the k tokens + a "rest" bucket, a lower bound of
        the full KL), ``ce`` (on the target's argmax), ``top1`` (draft/target argmax agreement, float).
    """
    logq = torch.log_softmax(logits.float(), dim=-1)
    lq = logq.gather(1, top_idx)
    p = top_logp.exp()
    p_rest = (1 - p.sum(-1)).clamp_min(1e-8)
    q_rest = (1 - lq.exp().sum(-1)).clamp_min(1e-8)
    kl = (p * (top_logp - lq)).sum(-1) + p_rest * (p_rest.log() - q_rest.log())
    ce = -lq[:, 0]
    kl, ce = kl.mean(), ce.mean()
    top1 = (logits.argmax(-1) == top_idx[:, 0]).float().mean()
    return {"loss": (1 - ce_weight) * kl + ce_weight * ce, "kl": kl, "ce": ce, "top1": top1}


def _order(n: int, epoch: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed * 7919 + epoch)
    return torch.randperm(n, generator=g).tolist()


def _draft_step(draft: LlamaForCausalLM, b: dict, cfg: DistillConfig) -> dict:
    """The KD loss of one batch from :func:`_batch` (matmuls under bfloat16 autocast on the CPU when ``cfg.bf16``)."""
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=cfg.bf16 and b["ids"].device.type == "cpu"):
        h = draft.model(input_ids=b["ids"], attention_mask=b["mask"], use_cache=False).last_hidden_state
        logits = draft.lm_head(h[b["rows"], b["cols"]])
    return distill_loss(logits, b["top_idx"], b["top_logp"], cfg.ce_weight)


def train_draft(draft: LlamaForCausalLM, data: list[dict], cfg: DistillConfig, work_dir: Path, train_key: str,
                restart: bool = False, wandb_run=None) -> dict:
    """Train ``draft`` in place on ``data`` (from :func:`generate_data`) for ``cfg.steps`` steps.

    A checkpoint (model, optimizer, step, training seconds so far) is written to
    ``work_dir/checkpoint.pt`` every ``cfg.ckpt_every`` steps, on Ctrl-C between weight updates
    (:class:`train.recipes.common.CheckpointOnInterrupt`) and at the end; a later call with the same
    ``train_key`` resumes from it unless ``restart``.

    Time cap: progress = max(step / ``cfg.steps``, training seconds / ``cfg.max_train_minutes``);
    the learning rate follows it (cosine) and training ends when it reaches 1, so a slow machine
    does fewer steps but still finishes the schedule. With the cap not binding the run is
    deterministic given the seed. Matmuls run under bfloat16 autocast when ``cfg.bf16``.

    Returns:
        dict with ``start_step`` (the step resumed from, 0 for a fresh run), ``step`` (steps done
        in total), ``train_seconds`` (this call), ``total_train_seconds`` (all calls), ``last`` (the
        last logged metrics), ``stopped_by_time`` (bool: the time cap ended training before ``cfg.steps``).

    Raises:
        DistillError: no training data.
    """
    if not data:
        raise DistillError("No training data: the target produced no response tokens.")
    ckpt_path = work_dir / CKPT_NAME
    opt = torch.optim.AdamW(draft.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay, betas=(0.9, 0.98))
    step, prior_s = 0, 0.0
    ck = load_checkpoint(ckpt_path, (train_key,), restart)
    if ck is not None:
        draft.load_state_dict(ck["model"])
        opt.load_state_dict(ck["optimizer"])
        step, prior_s = ck["step"], ck.get("train_seconds", 0.0)
    start_step = step

    def save():
        save_atomic({"model": draft.state_dict(), "optimizer": opt.state_dict(), "step": step,
                     "train_key": train_key, "config": asdict(cfg),
                     "train_seconds": prior_s + time.perf_counter() - t0}, ckpt_path)

    n = len(data)
    per_epoch = max(1, n // cfg.batch_size)
    draft.train()
    t0 = time.perf_counter()
    last: dict = {}
    stopped = False
    bar = progress_display(total=cfg.steps, initial=step, desc="distil", unit="step")
    # Ctrl-C keeps the steps done since the last checkpoint (not inside a weight update)
    with CheckpointOnInterrupt(save) as guard, contextlib.closing(bar):
        while step < cfg.steps:
            done = progress(step, cfg.steps, prior_s + time.perf_counter() - t0, cfg.max_train_minutes)
            if done >= 1.0:
                stopped = True
                log.warning("stopping at step %d: --max-train-minutes %.1f reached", step, cfg.max_train_minutes)
                break
            epoch, k = divmod(step, per_epoch)
            order = _order(n, epoch, cfg.seed)
            b = _batch(data, order[k * cfg.batch_size:(k + 1) * cfg.batch_size])
            ts = time.perf_counter()
            m = _draft_step(draft, b, cfg)
            with guard.updating():
                optimizer_step(opt, draft.parameters(), m["loss"], lr_at(step, done, cfg.lr, cfg.warmup))
            step += 1
            last = {k2: float(v.detach()) for k2, v in m.items()}
            last.update(lr=opt.param_groups[0]["lr"], epoch=epoch, positions=int(len(b["rows"])),
                        positions_per_s=len(b["rows"]) / (time.perf_counter() - ts))
            if wandb_run is not None:
                wandb_run.log({f"train/{k2}": v for k2, v in last.items()}, step=step)
            bar.update(1)
            bar.set_postfix(loss=f"{last['loss']:.3f}", top1=f"{last['top1']:.3f}")
            if step % cfg.ckpt_every == 0:
                save()
    save()
    draft.eval()
    return {"start_step": start_step, "step": step, "train_seconds": time.perf_counter() - t0,
            "total_train_seconds": prior_s + time.perf_counter() - t0, "last": last, "stopped_by_time": stopped}


# ----------------------------------------------------------------------------- measurement
def _greedy_agreement(pair: ModelPair, prompts: list[str], max_new_tokens: int, show_progress: bool) -> dict:
    """Acceptance phase of :func:`measure_draft`: per prompt the target's greedy continuation, then
    one forward of each model over prompt + continuation. Returns the sums ``agree`` (argmax hits)
    and ``mins`` (Σ_x min(p, q) at temperature 1) over ``positions``, ``per_prompt`` (the hit share
    of each prompt that produced tokens) and ``seqs`` (int64 (P + R,) each, for the timing phase).

    Raises:
        ValueError: a prompt longer than the context window, or no tokens produced at all.
    """
    V = pair.vocab_size
    eos = set(pair.eos_token_ids)
    agree, mins, per_prompt, seqs = 0.0, 0.0, [], []
    npos = 0
    for p in progress_display(prompts, desc="measure α", unit="prompt", enabled=show_progress):
        ids = pair.encode_prompt(p)
        pair.check_length(ids.numel(), max_new_tokens)
        out = pair.target.generate(ids[None], attention_mask=torch.ones_like(ids[None]), max_new_tokens=max_new_tokens,
                                   do_sample=False, temperature=None, top_p=None, top_k=None,
                                   pad_token_id=pair.tokenizer.pad_token_id or next(iter(eos), 0))
        new = out[0, ids.numel():].tolist()
        new = new[:answer_length(new, eos)]
        if not new:
            continue
        seq = out[0, : ids.numel() + len(new)]
        seqs.append(seq)
        P, R = ids.numel(), len(new)
        tl = pair.target(input_ids=seq[None]).logits[0, P - 1:P - 1 + R, :V].float()
        dl = pair.draft(input_ids=seq[None]).logits[0, P - 1:P - 1 + R, :V].float()
        y = torch.tensor(new, device=dl.device)
        a = (dl.argmax(-1) == y).float()
        m = torch.minimum(torch.softmax(tl, -1), torch.softmax(dl, -1)).sum(-1)
        agree += float(a.sum())
        mins += float(m.sum())
        npos += R
        per_prompt.append(float(a.mean()))
    if npos == 0:
        raise ValueError("The target produced no tokens for any prompt.")
    return {"agree": agree, "mins": mins, "positions": npos, "per_prompt": per_prompt, "seqs": seqs}


def _forward_costs(pair: ModelPair, seqs: list[torch.Tensor], repeats: int, contexts: int) -> dict:
    """Timing phase of :func:`measure_draft`: one new token with a KV cache, draft and target
    interleaved, on ``contexts`` of ``seqs`` (after 3 warm-up rounds), and the draft's output
    projection alone. Returns ``samples`` (seconds per model), ``head`` (seconds), ``ctx_lens``."""
    clock = DeviceClock(pair.device)  # the loop's clock: synchronised with the device
    samples = {"draft": [], "target": []}
    ctx_lens = []
    for seq in sorted(seqs, key=len)[:: max(1, len(seqs) // max(1, contexts))][:contexts]:
        ctx_lens.append(int(seq.numel()))
        caches = {}
        for name, model in (("draft", pair.draft), ("target", pair.target)):
            c = DynamicCache()
            model(input_ids=seq[None, :-1], cache=c, use_cache=True)
            caches[name] = c
        last = seq[None, -1:]
        for r in range(repeats + 3):
            for name, model in (("draft", pair.draft), ("target", pair.target)):
                c = caches[name]
                t0 = clock.now()
                model(input_ids=last, cache=c, use_cache=True)
                dt = clock.now() - t0
                c.crop(-1)
                if r >= 3:
                    samples[name].append(dt)
    W = pair.draft.get_output_embeddings().weight
    x = torch.randn(1, W.shape[1], dtype=W.dtype, device=W.device)
    head = []
    for r in range(repeats + 3):
        t0 = clock.now()
        F.linear(x, W)
        if r >= 3:
            head.append(clock.now() - t0)
    return {"samples": samples, "head": head, "ctx_lens": ctx_lens}


@torch.inference_mode()
def measure_draft(
    pair: ModelPair, prompts: list[str], max_new_tokens: int = 128, timing_repeats: int = 30,
    timing_contexts: int = 4, show_progress: bool = True,
) -> dict:
    """Measure a draft against its target on ``prompts`` (fp32 or whatever the pair was loaded in).

    Acceptance: for each prompt (through the chat template), the target's greedy continuation
    (``max_new_tokens``, batch size 1, stops at EOS) is computed; then both models read prompt +
    continuation in one forward. ``alpha_greedy`` is the mean over continuation positions of
    Σ_x min(p, q) at temperature 0, i.e. the share of positions where the draft's argmax equals the
    target's token; ``alpha_t1`` is the same mean at temperature 1 (softmax of the raw logits).

    Cost: on ``timing_contexts`` of those sequences, each model's cache is prefilled with all but
    the last token, then one-token forwards (cache cropped back after each) are timed
    ``timing_repeats`` times per context, draft and target interleaved, after a warm-up.
    ``cost_ratio`` = median draft time / median target time. ``lm_head_ms`` times the draft's
    output projection alone (one hidden vector × vocabulary).

    Returns:
        dict: ``alpha_greedy``, ``alpha_t1`` (floats in [0, 1]), ``alpha_greedy_per_prompt`` (list),
        ``positions``, ``prompts``, ``draft_ms``, ``target_ms``, ``cost_ratio``, ``lm_head_ms``,
        ``timing_context_lens``, ``timing_samples`` (per model), ``threads``, ``dtype``, ``device``.

    Raises:
        ValueError: no prompts, or a prompt longer than the context window.
    """
    if not prompts:
        raise ValueError("measure_draft needs at least one prompt.")
    acc = _greedy_agreement(pair, prompts, max_new_tokens, show_progress)
    cost = _forward_costs(pair, acc["seqs"], timing_repeats, timing_contexts)
    d_ms = 1000 * statistics.median(cost["samples"]["draft"])
    t_ms = 1000 * statistics.median(cost["samples"]["target"])
    return {
        "alpha_greedy": acc["agree"] / acc["positions"],
        "alpha_t1": acc["mins"] / acc["positions"],
        "alpha_greedy_per_prompt": acc["per_prompt"],
        "positions": acc["positions"],
        "prompts": len(acc["per_prompt"]),
        "max_new_tokens": max_new_tokens,
        "draft_ms": d_ms,
        "target_ms": t_ms,
        "cost_ratio": d_ms / t_ms,
        "lm_head_ms": 1000 * statistics.median(cost["head"]),
        "timing_context_lens": cost["ctx_lens"],
        "timing_samples": len(cost["samples"]["draft"]),
        "threads": torch.get_num_threads(),
        "dtype": str(next(pair.draft.parameters()).dtype),
        "device": str(pair.device),
    }


# ----------------------------------------------------------------------------- driver
def _draft_report(cfg: DistillConfig, out: Path, command: str | None, draft: LlamaForCausalLM, n_params: int,
                  data: list[dict], prompts: list[str], tr: dict, meas: dict, seconds: dict) -> dict:
    """The build report (``build_report.json`` without its size): settings, the draft's
    architecture, the data, training and measurement summaries and the phases' seconds."""
    return {
        "target": cfg.target,
        "out": str(out),
        "command": command or "",
        "config": asdict(cfg),
        "draft_parameters": n_params,
        "draft_architecture": {k: getattr(draft.config, k) for k in ("hidden_size", "num_hidden_layers",
                                                                      "intermediate_size", "num_attention_heads",
                                                                      "num_key_value_heads", "head_dim", "vocab_size")},
        "data": {"responses": len(data), "response_tokens": sum(len(d["top_idx"]) for d in data),
                 "prompts": len(prompts), "sampled_responses": sum(d["sampled"] for d in data)},
        "training": {k: tr[k] for k in ("start_step", "step", "train_seconds", "total_train_seconds",
                                          "stopped_by_time")} | {"last": tr["last"]},
        "measure": meas,
        "measure_prompts": measure_prompts_note(cfg.eval_prompts),
        "seconds": seconds,
        **environment(),
    }


def build_draft(
    cfg: DistillConfig, target: PreTrainedModel | None = None, tokenizer: PreTrainedTokenizerBase | None = None,
    prompts: list[str] | None = None, eval_prompts: list[str] | None = None, restart: bool = False,
    command: str | None = None,
) -> dict:
    """Run the whole recipe and write the draft to ``cfg.out``; return the build report.

    Args:
        cfg: settings.
        target, tokenizer: already loaded target and tokenizer (tests); loaded from ``cfg.target``
            via :func:`learn2draft.models.load_model` / ``load_tokenizer`` when None.
        prompts: distillation prompts (default: ``cfg.prompts_file``; checked disjoint from prompts.json).
        eval_prompts: prompts for :func:`measure_draft` (default: the held-out split).
        restart: ignore an existing training checkpoint.
        command: the command line recorded in the report.

    Returns:
        the report dict also written to ``<out>/build_report.json``.

    Raises:
        DistillError: bad settings or paths. ModelLoadError: the target cannot be loaded.
    """
    t_start = time.perf_counter()
    cfg.validate()
    try:
        check_wandb(cfg.wandb_mode)
    except ValueError as e:
        raise DistillError(str(e)) from None
    work = work_dir_for(cfg.work_dir, DEFAULT_WORK_DIR, cfg.target)
    out = (Path(cfg.out).expanduser() if cfg.out else work / "draft").resolve()
    check_out_dir(out, cfg.target)
    save_dtype = parse_dtype(cfg.save_dtype)
    torch.manual_seed(cfg.seed)
    random.seed(cfg.seed)
    prompts = select_distill_prompts(prompts, cfg.prompts_file, cfg.num_prompts)
    target, tokenizer = load_target(cfg.target, target, tokenizer)
    if target.get_output_embeddings().weight.shape[0] < len(tokenizer):
        raise DistillError("The target has fewer output rows than its tokenizer has tokens.")

    # ---- data
    work.mkdir(parents=True, exist_ok=True)
    dkey = cfg.data_key(prompts)
    tkey = cfg.train_key(dkey)
    t0 = time.perf_counter()
    data = generate_data(target, tokenizer, prompts, cfg, work / "data" / dkey)
    gen_s = time.perf_counter() - t0
    n_tok = sum(len(d["top_idx"]) for d in data)
    log.info("data: %d responses, %d response tokens (%.0f s)", len(data), n_tok, gen_s)
    run = start_wandb(cfg, work, tkey, restart, "distill")
    if run is not None:
        run.log({"data/responses": len(data), "data/tokens": n_tok, "data/seconds": gen_s})

    # ---- draft and training
    draft = make_draft(target, tokenizer, cfg)
    n_params = sum(p.numel() for p in draft.parameters())
    tr = train_draft(draft, data, cfg, work, tkey, restart=restart, wandb_run=run)

    # ---- measurement
    draft = draft.float().eval()
    pair = make_pair(target, draft, tokenizer, tokenizer, target_name=cfg.target, draft_name=str(out))
    eval_prompts = select_eval_prompts(eval_prompts, cfg.eval_prompts)
    t0 = time.perf_counter()
    meas = measure_draft(pair, eval_prompts, cfg.eval_max_new_tokens, cfg.timing_repeats)
    eval_s = time.perf_counter() - t0

    # ---- output: written to a fresh directory, then swapped in
    tmp = fresh_build_dir(out)
    draft.to(save_dtype).save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    report = _draft_report(cfg, out, command, draft, n_params, data, prompts, tr, meas,
                           {"generate": gen_s, "train": tr["train_seconds"], "measure": eval_s})
    report["seconds"]["total"] = time.perf_counter() - t_start
    publish_build(tmp, out, report, 4096, run)  # + 4096: the report itself (approx.)
    return report


def check_out_dir(out: Path, target: str) -> None:
    """Refuse an ``--out`` whose contents this tool did not write, before any slow work.

    The directory is replaced at the end of a build, so it must be new, empty, or an earlier build
    (it holds ``build_report.json``). The default ``--out`` is the shipped SmolLM2 draft, which only
    a build for the default target may replace.

    Raises:
        DistillError: ``out`` is a file, is not writable, holds other files, or is the shipped draft
            while ``target`` is another model.
    """
    _check_out_dir(out, target, shipped=DEFAULT_DRAFT_DIR, what="draft",
                   is_ours=lambda d: (d / "build_report.json").is_file(), error=DistillError,
                   foreign="already holds files that this tool did not write (no build_report.json); they would "
                           "be deleted: choose a new or empty directory.")


def main(argv: list[str] | None = None) -> int:
    """CLI entry point; returns the exit status (2 on bad input, with a one-line message)."""
    cfg, a = parse_args(argv)
    setup_logging(a.verbose)
    cmd = command_line("python -m train.recipes.draft_model", argv)

    def body() -> int:
        rep = build_draft(cfg, restart=a.restart, command=cmd)
        m = rep["measure"]
        print(json.dumps({"out": rep["out"], "alpha_greedy": round(m["alpha_greedy"], 4),
                          "alpha_t1": round(m["alpha_t1"], 4), "cost_ratio": round(m["cost_ratio"], 4),
                          "size_mb": round(rep["size_bytes"] / 1e6, 2), "seconds": round(rep["seconds"]["total"], 1)}))
        return 0

    return run_recipe(body)


if __name__ == "__main__":
    sys.exit(main())
