"""What the draft-model recipe (:mod:`train.recipes.draft_model`) and the head recipe
(:mod:`train.recipes.head`) share, once: their prompt set and its disjointness from the policy
prompts, work and output directories, target loading, batched generation helpers (left padding,
the EOS cut, cached batches), the learning-rate schedule and time cap, one optimiser step,
checkpoint resumption, the W&B run, the command line, and writing the build.

torch and transformers are imported inside the functions that need them, so that a recipe's
``--help`` answers without them.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import math
import os
import shlex
import shutil
import sys
import uuid
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING, Any

from learn2draft.names import DEFAULT_TARGET
from learn2draft.prompts import PROMPTS_FILE, load_prompts

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)

DISTILL_PROMPTS_FILE = Path(__file__).resolve().parent / "data" / "distill_prompts.json"
CKPT_NAME = "checkpoint.pt"


class RecipeError(ValueError):
    """Bad input to a recipe; the message says what to change."""


# ----------------------------------------------------------------------------- prompts
def load_distill_prompts(path: str | Path = DISTILL_PROMPTS_FILE) -> list[str]:
    """Load a distillation prompt list (a JSON list of strings, or ``{"prompts": [...]}``).

    Raises:
        RecipeError: the file is missing, malformed, empty, or shares a prompt with
            ``prompts.json`` (the policy train / heldout prompts).
    """
    p = Path(path)
    if not p.is_file():
        raise RecipeError(f"Prompt file not found: {p}.")
    try:
        data = json.loads(p.read_text())
    except json.JSONDecodeError as e:
        raise RecipeError(f"Prompt file {p} is not valid JSON: {e}.") from None
    prompts = data.get("prompts") if isinstance(data, dict) else data
    if not isinstance(prompts, list) or not prompts or not all(isinstance(s, str) and s.strip() for s in prompts):
        raise RecipeError(f"Prompt file {p} must hold a non-empty list of non-empty strings.")
    check_disjoint(prompts)
    return list(prompts)


def select_distill_prompts(prompts: list[str] | None, prompts_file: str | Path, num_prompts: int) -> list[str]:
    """The prompts a recipe (draft model or head) trains on: ``prompts`` if given (checked disjoint
    from the policy prompts), else those of ``prompts_file``; the first ``num_prompts`` (0 = all).

    Raises:
        RecipeError: the file is unreadable, or a prompt is also a policy prompt.
    """
    if prompts is None:
        prompts = load_distill_prompts(prompts_file)
    else:
        check_disjoint(prompts)
    return prompts[:num_prompts] if num_prompts else prompts


def check_disjoint(prompts: list[str]) -> None:
    """Raise :class:`RecipeError` if any prompt also appears in ``prompts.json`` (train or heldout).

    Comparison ignores case and surrounding whitespace.
    """
    norm = lambda s: " ".join(s.lower().split())  # noqa: E731
    policy = {norm(s) for split in ("train", "heldout") for s in load_prompts(split)}
    shared = [s for s in prompts if norm(s) in policy]
    if shared:
        raise RecipeError(
            f"{len(shared)} distillation prompt(s) also appear in {PROMPTS_FILE.name}, e.g. {shared[0]!r}: "
            "the draft must not be trained on the policy / evaluation prompts."
        )


def select_eval_prompts(eval_prompts: list[str] | None, count: int) -> list[str]:
    """The prompts the built drafter is measured on: ``eval_prompts``, else the held-out policy
    prompts; the first ``count`` of them (0 = all)."""
    if eval_prompts is None:
        eval_prompts = load_prompts("heldout")
    return eval_prompts[:count] if count else eval_prompts


def measure_prompts_note(count: int) -> str:
    """How the build report names the measurement prompts (see :func:`select_eval_prompts`)."""
    return "learn2draft.prompts.load_prompts('heldout')" if count == 0 else f"first {count} held-out prompts"


# ----------------------------------------------------------------------------- directories and the target
def slug(name: str) -> str:
    """A file-name-safe short form of a model name (its last path component, ≤ 60 characters)."""
    return "".join(c if c.isalnum() or c in "-_." else "_" for c in Path(name).name or name)[:60]


def work_dir_for(work: str, default_root: Path, target: str) -> Path:
    """The cache / checkpoint directory: ``work`` if given, else ``default_root/<slug of target>``."""
    return Path(work).expanduser() if work else default_root / slug(target)


def dir_size_bytes(path: Path) -> int:
    """Total size in bytes of the regular files under ``path``."""
    return sum(f.stat().st_size for f in Path(path).rglob("*") if f.is_file())


def check_out_dir(out: Path, target: str, *, shipped: Path, what: str, is_ours: Callable[[Path], bool],
                  foreign: str, error: type[RecipeError]) -> None:
    """Refuse an ``--out`` whose contents the recipe did not write, before any slow work.

    The directory is replaced at the end of a build, so it must be new, empty, or an earlier build
    (``is_ours``); the shipped ``shipped`` directory (the default target's ``what``: "draft" or
    "head") may only be replaced by a build for the default target. Writability is tested by
    writing beside ``out``, where the build is written before it is swapped in.

    Raises:
        error: ``out`` is a file, cannot be written beside, holds other files (message ``foreign``,
            after the path), or is the shipped directory while ``target`` is another model.
    """
    if out.exists() and not out.is_dir():
        raise error(f"--out {out} exists and is not a directory: pass a directory path.")
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        probe = out.parent / f".{out.name}.write-test-{os.getpid()}"
        probe.write_text("ok")
        probe.unlink()
    except OSError as e:
        raise error(f"Cannot write beside --out {out} ({e.strerror or e}): pass an --out directory you can "
                    "write to.") from None
    if out.is_dir() and any(out.iterdir()) and not is_ours(out):
        raise error(f"--out {out} {foreign}")
    if out == shipped.resolve() and target != DEFAULT_TARGET:
        raise error(f"--out defaults to the shipped {what} of {DEFAULT_TARGET}; for target {target!r} pass "
                    "--out NEW_DIR.")


def load_target(name: str, target=None, tokenizer=None, dtype: str = "float32") -> tuple[Any, Any]:
    """The target model (in eval mode) and its tokenizer: those given (tests), else loaded from
    ``name`` with :func:`learn2draft.models.load_model` (weights in ``dtype``, a canonical name of
    :data:`learn2draft.names.DTYPE_NAMES` other than ``auto``) / ``load_tokenizer``.

    Raises:
        ModelLoadError: ``name`` cannot be loaded.
    """
    import torch

    from learn2draft.models import load_model, load_tokenizer

    if tokenizer is None:
        tokenizer = load_tokenizer(name)
    if target is None:
        log.info("loading target %s in %s", name, dtype)
        target = load_model(name, dtype=getattr(torch, dtype))
    target.eval()
    return target, tokenizer


# ----------------------------------------------------------------------------- generation helpers
def pad_left(seqs: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-padded batch of token lists: ids int64 (B, L) and attention mask int64 (B, L), L the longest."""
    import torch

    L = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), L), pad_id, dtype=torch.long)
    mask = torch.zeros((len(seqs), L), dtype=torch.long)
    for i, s in enumerate(seqs):
        ids[i, L - len(s):] = torch.tensor(s, dtype=torch.long)
        mask[i, L - len(s):] = 1
    return ids, mask


def pad_token_id(tokenizer) -> int:
    """The tokenizer's pad id, else its EOS id, else 0."""
    return tokenizer.pad_token_id if tokenizer.pad_token_id is not None else (tokenizer.eos_token_id or 0)


def answer_length(tokens: list[int], eos: set[int]) -> int:
    """Tokens of a generated answer up to and including its first EOS (all of them without one)."""
    for t, tok in enumerate(tokens):
        if tok in eos:
            return t + 1
    return len(tokens)


def save_atomic(obj, path: Path) -> None:
    """``torch.save`` to ``path`` whole or not at all (written beside it, then renamed)."""
    import torch

    tmp = path.with_suffix(".tmp")
    torch.save(obj, tmp)
    os.replace(tmp, path)


def cached_batch(path: Path | None, compute: Callable[[], list[dict]]) -> list[dict]:
    """The examples of one data batch: loaded from ``path`` when it exists, else ``compute()`` and
    saved there (:func:`save_atomic`; no cache when ``path`` is None)."""
    import torch

    if path is not None and path.exists():
        return torch.load(path, weights_only=False)
    chunk = compute()
    if path is not None:
        save_atomic(chunk, path)
    return chunk


# ----------------------------------------------------------------------------- training helpers
def lr_at(step: int, progress: float, lr: float, warmup: int) -> float:
    """Linear warm-up over ``warmup`` steps, then cosine decay from ``lr`` to 5% of it as ``progress`` goes 0 → 1."""
    if step < warmup:
        return lr * (step + 1) / warmup
    t = min(1.0, max(0.0, progress))
    return lr * (0.05 + 0.95 * 0.5 * (1 + math.cos(math.pi * t)))


def progress(step: int, steps: int, seconds: float, max_minutes: float) -> float:
    """Training progress in [0, ∞): max(step / steps, seconds / the time cap); the cap 0 = none.
    It drives the cosine schedule, and training ends when it reaches 1."""
    cap = 60 * max_minutes
    return max(step / steps, seconds / cap if cap else 0.0)


def optimizer_step(opt, params, loss: torch.Tensor, lr: float) -> None:
    """One AdamW step at learning rate ``lr`` on ``loss``, gradients clipped to norm 1."""
    import torch

    for g in opt.param_groups:
        g["lr"] = lr
    opt.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(params, 1.0)
    opt.step()


class CheckpointOnInterrupt:
    """Ctrl-C in a training loop keeps the steps done: on KeyboardInterrupt inside the ``with`` block it calls
    ``save()`` (then lets the interrupt go on to :func:`run_recipe`), unless it came inside :meth:`updating` (the
    backward pass and weight update: some weights may have changed, so the last checkpoint is kept).

    Example::

        with CheckpointOnInterrupt(save) as guard:
            while step < steps:
                ...
                with guard.updating():
                    optimizer_step(opt, params, loss, lr)
                step += 1
    """

    def __init__(self, save: Callable[[], None]):
        self.save = save
        self._updating = False

    @contextlib.contextmanager
    def updating(self):
        """The block where an interrupt leaves the weights half-updated (nothing is saved if one comes there). An
        exception leaves the flag set on purpose: the enclosing ``__exit__`` must see where it came from."""
        self._updating = True
        yield
        self._updating = False

    def __enter__(self) -> CheckpointOnInterrupt:
        return self

    def __exit__(self, kind, exc, tb) -> bool:
        if kind is KeyboardInterrupt and not self._updating:
            log.warning("interrupted: saving the steps done to the checkpoint")
            self.save()
        return False


def load_checkpoint(path: Path, keys: tuple[str, ...], restart: bool) -> dict | None:
    """The checkpoint at ``path`` if it exists, ``restart`` is off and its ``train_key`` is one of
    ``keys`` (a checkpoint made with other settings is ignored, with a warning); else None."""
    import torch

    if not path.exists() or restart:
        return None
    ck = torch.load(path, weights_only=False)
    if ck.get("train_key") in keys:
        log.info("resuming from %s at step %d", path, ck["step"])
        return ck
    log.warning("ignoring checkpoint %s: it was made with other settings", path)
    return None


# ----------------------------------------------------------------------------- W&B
def start_wandb(cfg, work: Path, train_key: str, restart: bool, kind: str):
    """A W&B run for a build (None with ``cfg.wandb_mode == "disabled"``): project
    ``cfg.wandb_project``, config ``asdict(cfg)``, named ``<kind>-<target>``, files under ``work``.
    A rerun with the same ``train_key`` resumes the same run unless ``restart``."""
    if cfg.wandb_mode == "disabled":
        return None
    import wandb

    id_file = work / f"wandb_id_{train_key}.txt"
    run_id = id_file.read_text().strip() if id_file.exists() and not restart else uuid.uuid4().hex[:8]
    id_file.write_text(run_id)
    return wandb.init(project=cfg.wandb_project, mode=cfg.wandb_mode, dir=str(work), id=run_id, resume="allow",
                      config=asdict(cfg), name=f"{kind}-{slug(cfg.target)}")


# ----------------------------------------------------------------------------- the written build
def fresh_build_dir(out: Path) -> Path:
    """An empty ``<out>.tmp`` path (an earlier one removed) to write the build into before it replaces ``out``."""
    tmp = out.with_name(out.name + ".tmp")
    if tmp.exists():
        shutil.rmtree(tmp)
    return tmp


def environment() -> dict:
    """The report's ``torch_threads`` and ``versions`` (torch, transformers)."""
    import torch
    import transformers

    return {"torch_threads": torch.get_num_threads(),
            "versions": {"torch": torch.__version__, "transformers": transformers.__version__}}


#: The project's folder: paths inside it are written relative to it in build reports (a clone elsewhere reads them).
PROJECT_DIR = Path(__file__).resolve().parents[2]


def portable_paths(settings: dict, root: Path = PROJECT_DIR) -> dict:
    """``settings`` with every string value that is an absolute path inside ``root`` made relative to it
    (``/home/u/learn2draft/learn2draft/data/x.json`` → ``learn2draft/data/x.json``); other values unchanged."""
    out = {}
    for k, v in settings.items():
        if isinstance(v, str) and Path(v).is_absolute():
            try:
                v = Path(v).resolve().relative_to(root.resolve()).as_posix()
            except ValueError:  # outside the project: kept as it is
                pass
        out[k] = v
    return out


def publish_build(tmp: Path, out: Path, report: dict, slack: int, run=None) -> None:
    """Write ``report`` as ``tmp/build_report.json`` with its ``size_bytes`` (the directory's, the
    report included: first estimated with ``slack`` bytes, then measured), replace ``out`` by
    ``tmp``, and close the W&B ``run`` with the report's numeric measurements. Paths of its ``config`` inside the
    project are written relative to it (:func:`portable_paths`)."""
    if isinstance(report.get("config"), dict):
        report["config"] = portable_paths(report["config"])
    report["size_bytes"] = dir_size_bytes(tmp) + slack
    (tmp / "build_report.json").write_text(json.dumps(report, indent=2))
    report["size_bytes"] = dir_size_bytes(tmp)
    (tmp / "build_report.json").write_text(json.dumps(report, indent=2))
    if out.exists():
        shutil.rmtree(out)
    os.replace(tmp, out)
    if run is not None:
        run.summary.update({f"measure/{k}": v for k, v in report["measure"].items() if isinstance(v, (int, float))})
        run.finish()


# ----------------------------------------------------------------------------- the command line
def add_recipe_flags(ap: argparse.ArgumentParser, defaults, helps: dict[str, str]) -> None:
    """One ``--name`` flag per ``helps`` entry, typed and defaulted by that field of ``defaults``
    (a recipe's config dataclass)."""
    for name, text in helps.items():
        v = getattr(defaults, name)
        ap.add_argument("--" + name.replace("_", "-"), type=type(v), default=v, help=text)


def config_from_args(cls, args: argparse.Namespace):
    """The config dataclass ``cls`` with every field read from the parsed ``args``."""
    return cls(**{k: getattr(args, k) for k in cls.__dataclass_fields__})


def command_line(prog: str, argv: list[str] | None) -> str:
    """The command recorded in a build report: ``prog`` and the arguments (``sys.argv`` when ``argv`` is None)."""
    args = sys.argv[1:] if argv is None else argv
    return prog + ("" if argv is None and len(sys.argv) <= 1 else " " + shlex.join(args))


def setup_logging(verbose: bool) -> None:
    """WARNING level (INFO with ``-v``) for the root logger; the recipes' own progress at INFO."""
    logging.basicConfig(level=logging.INFO if verbose else logging.WARNING, format="%(levelname)s %(message)s")
    logging.getLogger(__package__).setLevel(logging.INFO)


def run_recipe(body: Callable[[], int]) -> int:
    """``body()``'s exit status; bad input (ValueError, including ModelLoadError and RecipeError) or
    an OSError becomes one ``error:`` line on stderr and exit status 2; Ctrl-C (KeyboardInterrupt)
    one line saying how to resume, exit status 130."""
    try:
        return body()
    except KeyboardInterrupt:
        print("interrupted: the data cache and the last checkpoint are kept; run the same command again to "
              "resume (--restart starts the training over)", file=sys.stderr)
        return 130
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except OSError as e:
        print(f"error: {e.__class__.__name__}: {e}", file=sys.stderr)
        return 2
