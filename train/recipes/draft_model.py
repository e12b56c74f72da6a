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
import hashlib
import json
import logging
import math
import os
import random
import shlex
import shutil
import statistics
import sys
import time
import uuid
from dataclasses import asdict, dataclass, field
from pathlib import Path

from learn2draft.cli import HelpFormatter
from learn2draft.names import DEFAULT_DRAFT_DIR, DEFAULT_TARGET

log = logging.getLogger(__name__)

DISTILL_PROMPTS_FILE = Path(__file__).resolve().parent / "data" / "distill_prompts.json"
DEFAULT_WORK_DIR = Path("runs") / "distill"  # relative to the working directory
CKPT_NAME = "checkpoint.pt"


class DistillError(ValueError):
    """Bad input to the distillation recipe; the message says what to change."""


# ----------------------------------------------------------------------------- prompts
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
    a = build_parser().parse_args(argv)
    cfg = DistillConfig(**{k: getattr(a, k) for k in DistillConfig.__dataclass_fields__})
    return cfg, a


def build_parser() -> argparse.ArgumentParser:
    """The command line of ``python -m train.recipes.draft_model`` (every :class:`DistillConfig` setting has a flag)."""
    d = DistillConfig()
    ap = argparse.ArgumentParser(
        prog="python -m train.recipes.draft_model",
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
    for name, text in helps.items():
        v = getattr(d, name)
        ap.add_argument("--" + name.replace("_", "-"), type=type(v), default=v, help=text)
    return ap


if __name__ == "__main__":
    # ``python -m train.recipes.draft_model --help`` (or a mistyped flag) answers here, before torch and
    # transformers are imported below; main() parses the command line again.
    build_parser().parse_args()


import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from tqdm.auto import tqdm  # noqa: E402
from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM, PreTrainedModel, PreTrainedTokenizerBase  # noqa: E402

from learn2draft.models import (  # noqa: E402
    ModelLoadError,
    ModelPair,
    encode_text,
    eos_token_ids,
    load_model,
    load_tokenizer,
    make_pair,
    parse_dtype,
)
from learn2draft.prompts import PROMPTS_FILE, load_prompts  # noqa: E402
from learn2draft.timing import DeviceClock  # noqa: E402
from train.wandb_setup import check_wandb  # noqa: E402


def load_distill_prompts(path: str | Path = DISTILL_PROMPTS_FILE) -> list[str]:
    """Load a distillation prompt list (a JSON list of strings, or ``{"prompts": [...]}``).

    Raises:
        DistillError: the file is missing, malformed, empty, or shares a prompt with
            ``prompts.json`` (the policy train / heldout prompts).
    """
    p = Path(path)
    if not p.is_file():
        raise DistillError(f"Prompt file not found: {p}.")
    try:
        data = json.loads(p.read_text())
    except json.JSONDecodeError as e:
        raise DistillError(f"Prompt file {p} is not valid JSON: {e}.") from None
    prompts = data.get("prompts") if isinstance(data, dict) else data
    if not isinstance(prompts, list) or not prompts or not all(isinstance(s, str) and s.strip() for s in prompts):
        raise DistillError(f"Prompt file {p} must hold a non-empty list of non-empty strings.")
    check_disjoint(prompts)
    return list(prompts)


def select_distill_prompts(prompts: list[str] | None, prompts_file: str | Path, num_prompts: int) -> list[str]:
    """The prompts a distillation recipe (draft model or head) trains on: ``prompts`` if given (checked
    disjoint from the policy prompts), else those of ``prompts_file``; the first ``num_prompts`` (0 = all).

    Raises:
        DistillError: the file is unreadable, or a prompt is also a policy prompt.
    """
    if prompts is None:
        prompts = load_distill_prompts(prompts_file)
    else:
        check_disjoint(prompts)
    return prompts[:num_prompts] if num_prompts else prompts


def check_disjoint(prompts: list[str]) -> None:
    """Raise :class:`DistillError` if any prompt also appears in ``prompts.json`` (train or heldout).

    Comparison ignores case and surrounding whitespace.
    """
    norm = lambda s: " ".join(s.lower().split())  # noqa: E731
    policy = {norm(s) for split in ("train", "heldout") for s in load_prompts(split)}
    shared = [s for s in prompts if norm(s) in policy]
    if shared:
        raise DistillError(
            f"{len(shared)} distillation prompt(s) also appear in {PROMPTS_FILE.name}, e.g. {shared[0]!r}: "
            "the draft must not be trained on the policy / evaluation prompts."
        )


def make_distill_prompts(seed: int = 0) -> list[str]:  # noqa: C901 (a flat list of prompt families)
    """Build the shipped distillation prompt set from templates × topics (deterministic given ``seed``).

    This is how ``train/recipes/data/distill_prompts.json`` was written; prompts that collide with
    ``prompts.json`` are dropped.
    """
    rng = random.Random(seed)
    out: list[str] = []
    langs = ["Python", "JavaScript", "C", "Rust", "Go", "Java", "C++", "TypeScript", "Ruby", "Bash"]
    code_tasks = [
        "reverses a string", "computes the factorial of n", "checks whether a string is a palindrome",
        "finds the largest element of a list", "counts the vowels in a word", "merges two sorted arrays",
        "removes duplicates from a list", "converts Celsius to Fahrenheit", "computes the greatest common divisor",
        "reads a file and prints its lines", "sorts a list of numbers with bubble sort", "sums the digits of a number",
        "checks whether a year is a leap year", "implements binary search", "flattens a nested list",
        "counts word frequencies in a text", "returns the n-th Fibonacci number iteratively",
        "checks whether two strings are anagrams", "transposes a matrix", "validates a password's strength",
        "computes the average of a list of numbers", "capitalizes the first letter of every word",
        "finds the second largest number in an array", "converts a decimal number to binary",
        "parses a date string and prints the weekday", "implements a simple stack class",
        "shuffles a list randomly", "computes the distance between two points",
        "checks whether a number is a perfect square", "returns the most frequent element of a list",
    ]
    for task in code_tasks:
        for lang in langs:
            out.append(f"Write a {lang} function that {task}.")
    code_q = [
        "What does the `yield` keyword do in Python?", "Explain the difference between `==` and `===` in JavaScript.",
        "What is a pointer in C?", "How do I create a virtual environment in Python?",
        "Explain what a closure is in JavaScript with an example.", "What is the borrow checker in Rust?",
        "How do I read a CSV file with pandas?", "Write a regular expression that matches an email address.",
        "Explain big-O notation with two examples.", "What is the difference between a stack and a queue?",
        "Write a SQL query that finds the average salary per department in a table called employees.",
        "Write a Python class for a bank account with deposit and withdraw methods.",
        "Explain what an API is to a beginner.", "How does git rebase differ from git merge?",
        "Write an HTML page with a heading and a button.", "Write a CSS rule that centers a div.",
    ]
    out += code_q
    people = [
        "Ada Lovelace", "Isaac Newton", "Leonardo da Vinci", "Cleopatra", "Nelson Mandela", "Galileo Galilei",
        "Frida Kahlo", "Charles Darwin", "Nikola Tesla", "Jane Austen", "Mahatma Gandhi", "Wolfgang Amadeus Mozart",
        "Alan Turing", "Rosalind Franklin", "Napoleon Bonaparte", "Simone de Beauvoir", "Genghis Khan",
        "Katherine Johnson", "William Shakespeare", "Confucius", "Ludwig van Beethoven", "Amelia Earhart",
        "Abraham Lincoln", "Grace Hopper", "Marco Polo", "Joan of Arc", "Pablo Picasso", "Martin Luther King Jr.",
        "Queen Victoria", "Johannes Gutenberg", "Florence Nightingale", "Louis Pasteur", "Vincent van Gogh",
        "Aristotle", "Julius Caesar", "Harriet Tubman", "Srinivasa Ramanujan", "Emmy Noether", "Ibn Battuta",
        "Hypatia of Alexandria",
    ]
    bio_t = ["Who was {}?", "Write a short biography of {}.", "What is {} best known for?",
             "Give three interesting facts about {}."]
    for person in people:
        for t in bio_t:
            out.append(t.format(person))
    topics = [
        "volcanoes", "the Roman Empire", "black holes", "the human heart", "climate change", "the internet",
        "honeybees", "the French Revolution", "electricity", "earthquakes", "the moon landing", "vaccines",
        "the printing press", "coral reefs", "the stock market", "DNA", "solar panels", "the Great Wall of China",
        "tides", "the Renaissance", "machine learning", "glaciers", "the immune system", "democracy",
        "rainforests", "the Industrial Revolution", "nuclear energy", "the Olympic Games", "bacteria",
        "the Silk Road", "hurricanes", "recycling", "the solar system", "ancient Egypt", "smartphones",
        "the water table", "photosynthesis in algae", "the Cold War", "wind turbines", "the brain",
        "inflation", "the Amazon river", "bicycles", "cryptography", "dinosaurs", "the periodic table",
        "social media", "the Mayan civilization", "deserts", "electric cars", "the human skeleton",
        "jazz music", "the Moon", "antibiotics",
    ]
    prose_t = ["Explain {} in simple terms.", "Write a short paragraph about {}.",
               "Why are {} important? Answer briefly.", "Describe {} for a high-school student.",
               "What are the main facts about {}?", "List five facts about {}.",
               "Write a short blog post introduction about {}.", "What are common misconceptions about {}?"]
    for topic in topics:
        for t in prose_t:
            out.append(t.format(topic))
    list_t = [
        "List five benefits of regular exercise.", "List ten common fruits.", "Name five famous painters.",
        "List the steps to change a flat tire.", "Give me seven ideas for a birthday party.",
        "List five countries in South America and their capitals.", "Name six programming languages and one use of each.",
        "List four healthy breakfast options.", "Give five tips for learning a new language.",
        "List the days of the week in French.", "Name five musical instruments.", "List eight animals that live in the ocean.",
        "Give me a packing list for a weekend camping trip.", "List five ways to save money on groceries.",
        "Name the seven continents.", "List six board games for families.",
        "Give five tips for writing a good resume.", "List three causes of the First World War.",
    ]
    out += list_t
    howto = [
        "How do I boil an egg?", "How do I plant tomatoes in a garden?", "How do I make a paper airplane?",
        "How do I tie a tie?", "How can I improve my sleep?", "How do I bake bread at home?",
        "How do I write a cover letter?", "How do I start running as a beginner?", "How do I clean a cast iron pan?",
        "How do I make a cup of green tea?", "How can I learn to play the guitar?", "How do I prepare for a job interview?",
        "How do I set up a home aquarium?", "How do I make a budget?", "How do I train a puppy to sit?",
        "Give me a recipe for guacamole.", "Give me a recipe for a chocolate cake.", "Give me a recipe for fried rice.",
    ]
    out += howto
    math_q = []
    for _ in range(24):
        a, b = rng.randint(12, 99), rng.randint(3, 40)
        kind = rng.choice(["add", "mul", "pct", "eq", "area"])
        if kind == "add":
            math_q.append(f"What is {a} + {b * 7}? Show your work.")
        elif kind == "mul":
            math_q.append(f"Calculate {a} times {b} step by step.")
        elif kind == "pct":
            math_q.append(f"What is {b}% of {a * 10}?")
        elif kind == "eq":
            math_q.append(f"Solve for x: {b}x + {a} = {a + b * rng.randint(2, 9)}.")
        else:
            math_q.append(f"What is the area of a rectangle that is {a} cm long and {b} cm wide?")
    math_q += [
        "Explain the Pythagorean theorem with an example.", "What is a prime number? Give examples.",
        "Explain what a derivative is in calculus.", "How do you convert a fraction to a decimal?",
        "What is the difference between mean and median?", "Explain what a logarithm is.",
    ]
    out += math_q
    creative = [
        "Write a haiku about a mountain lake.", "Write a short poem about the city at dawn.",
        "Write a limerick about a cat.", "Write the opening of a fantasy story about a dragon.",
        "Write a short dialogue between a robot and a child.", "Write a product description for a water bottle.",
        "Write a tweet announcing a new coffee shop.", "Write a short speech for a friend's wedding.",
        "Write a formal letter requesting a refund.", "Write a short review of a movie you like.",
        "Write a motivational message for students before exams.", "Write a short fable with a moral.",
        "Summarize the story of Cinderella in three sentences.", "Summarize the plot of Macbeth briefly.",
    ]
    out += creative
    foreign = [
        "Explique-moi comment fonctionne la photosynthèse.", "Écris un court poème sur la mer.",
        "Quels sont les avantages du vélo en ville ?", "Donne-moi une recette de crêpes.",
        "Qui était Victor Hugo ?", "Traduis en anglais : « Je voudrais un café, s'il vous plaît. »",
        "Comment apprendre une nouvelle langue rapidement ?", "Décris la ville de Paris en quelques phrases.",
        "¿Qué es la inteligencia artificial?", "Escribe un poema corto sobre la luna.",
        "¿Quién fue Miguel de Cervantes?", "Dame una receta de paella.",
        "¿Cómo puedo mejorar mi memoria?", "Traduce al inglés: 'Mañana vamos a la playa con mis amigos.'",
        "Explica qué es el cambio climático.", "Describe la ciudad de Madrid.",
        "Was ist der Unterschied zwischen Wetter und Klima?", "Schreibe ein kurzes Gedicht über den Winter.",
        "Wer war Johann Wolfgang von Goethe?", "Erkläre, wie ein Computer funktioniert.",
        "Gib mir ein Rezept für Apfelstrudel.", "Wie lerne ich am besten für eine Prüfung?",
        "Übersetze ins Englische: 'Ich wohne seit drei Jahren in Berlin.'", "Beschreibe die Stadt München.",
        "Translate to German: 'Where is the nearest train station?'",
        "Translate to French: 'My brother plays football every Saturday.'",
        "Translate to Spanish: 'We are going to visit our grandparents this weekend.'",
    ]
    out += foreign
    seen, uniq = set(), []
    policy = {" ".join(s.lower().split()) for sp in ("train", "heldout") for s in load_prompts(sp)}
    for s in out:
        k = " ".join(s.lower().split())
        if k not in seen and k not in policy:
            seen.add(k)
            uniq.append(s)
    rng.shuffle(uniq)
    return uniq


# ----------------------------------------------------------------------------- config
def _slug(name: str) -> str:
    return "".join(c if c.isalnum() or c in "-_." else "_" for c in Path(name).name or name)[:60]


# ----------------------------------------------------------------------------- data
def encode_chat(tokenizer: PreTrainedTokenizerBase, prompt: str) -> list[int]:
    """Deprecated alias of :func:`learn2draft.models.encode_text` (kept for :mod:`train.recipes.head`)."""
    return encode_text(tokenizer, prompt)


def _eos_ids(target: PreTrainedModel, tokenizer: PreTrainedTokenizerBase) -> set[int]:
    """Deprecated alias of :func:`learn2draft.models.eos_token_ids`, as a set (kept for :mod:`train.recipes.head`)."""
    return set(eos_token_ids(target, tokenizer))


def _pad_left(seqs: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    L = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), L), pad_id, dtype=torch.long)
    mask = torch.zeros((len(seqs), L), dtype=torch.long)
    for i, s in enumerate(seqs):
        ids[i, L - len(s):] = torch.tensor(s, dtype=torch.long)
        mask[i, L - len(s):] = 1
    return ids, mask


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
    # Sort by prompt length (less padding) but keep greedy and sampled jobs in separate batches.
    order = sorted(range(len(encoded)), key=lambda i: (encoded[i][1], len(encoded[i][0])))
    batches = []
    for i in range(0, len(order), cfg.gen_batch_size):
        idx = order[i:i + cfg.gen_batch_size]
        # a batch must be all-greedy or all-sampled
        for flag in (False, True):
            sub = [j for j in idx if encoded[j][1] == flag]
            if sub:
                batches.append(sub)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else (tokenizer.eos_token_id or 0)
    eos = set(eos_token_ids(target, tokenizer))  # the loop's EOS set
    V = len(tokenizer)
    device = target.device
    data: list[dict] = []
    bar = tqdm(batches, desc="generate", unit="batch", disable=None)  # None: no bar when not a terminal
    for b, idx in enumerate(bar):
        path = cache_dir / f"batch_{b:04d}.pt"
        if path.exists():
            data += torch.load(path, weights_only=False)
            continue
        sampled = encoded[idx[0]][1]
        ids, mask = _pad_left([encoded[j][0] for j in idx], pad_id)
        torch.manual_seed(cfg.seed * 100003 + b)
        kw = dict(do_sample=True, temperature=cfg.sample_temperature, top_p=cfg.sample_top_p, top_k=0) if sampled \
            else dict(do_sample=False, temperature=None, top_p=None, top_k=None)
        out = target.generate(
            input_ids=ids.to(device), attention_mask=mask.to(device), max_new_tokens=cfg.max_new_tokens,
            output_logits=True, return_dict_in_generate=True, pad_token_id=pad_id, **kw,
        )
        L = ids.shape[1]
        new = out.sequences[:, L:].cpu()
        logits = torch.stack(out.logits, dim=1)  # (B, R, Vm)
        chunk = []
        for r, j in enumerate(idx):
            toks = new[r].tolist()
            n = len(toks)
            for t, tok in enumerate(toks):
                if tok in eos:
                    n = t + 1
                    break
            if n == 0:
                continue
            lp = torch.log_softmax(logits[r, :n, :V].float(), dim=-1)
            tl, ti = lp.topk(cfg.topk, dim=-1)
            chunk.append({
                "ids": torch.tensor(encoded[j][0] + toks[:n], dtype=torch.long),
                "prompt_len": len(encoded[j][0]),
                "top_idx": ti.to(torch.int32),
                "top_logp": tl.to(torch.float16),
                "sampled": sampled,
            })
        del out, logits
        tmp = path.with_suffix(".tmp")
        torch.save(chunk, tmp)
        os.replace(tmp, path)
        data += chunk
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


def _lr_at(step: int, progress: float, cfg: DistillConfig) -> float:
    """Linear warmup over ``cfg.warmup`` steps, then cosine decay to 5% as ``progress`` goes 0 → 1."""
    if step < cfg.warmup:
        return cfg.lr * (step + 1) / cfg.warmup
    t = min(1.0, max(0.0, progress))
    return cfg.lr * (0.05 + 0.95 * 0.5 * (1 + math.cos(math.pi * t)))


def _order(n: int, epoch: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed * 7919 + epoch)
    return torch.randperm(n, generator=g).tolist()


def train_draft(draft: LlamaForCausalLM, data: list[dict], cfg: DistillConfig, work_dir: Path, train_key: str,
                restart: bool = False, wandb_run=None) -> dict:
    """Train ``draft`` in place on ``data`` (from :func:`generate_data`) for ``cfg.steps`` steps.

    A checkpoint (model, optimizer, step, training seconds so far) is written to
    ``work_dir/checkpoint.pt`` every ``cfg.ckpt_every`` steps and at the end; a later call with the
    same ``train_key`` resumes from it unless ``restart``.

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
    if ckpt_path.exists() and not restart:
        ck = torch.load(ckpt_path, weights_only=False)
        if ck.get("train_key") == train_key:
            draft.load_state_dict(ck["model"])
            opt.load_state_dict(ck["optimizer"])
            step = ck["step"]
            prior_s = ck.get("train_seconds", 0.0)
            log.info("resuming from %s at step %d", ckpt_path, step)
        else:
            log.warning("ignoring checkpoint %s: it was made with other settings", ckpt_path)
    start_step = step

    def save():
        tmp = ckpt_path.with_suffix(".tmp")
        torch.save({"model": draft.state_dict(), "optimizer": opt.state_dict(), "step": step,
                    "train_key": train_key, "config": asdict(cfg),
                    "train_seconds": prior_s + time.perf_counter() - t0}, tmp)
        os.replace(tmp, ckpt_path)

    n = len(data)
    per_epoch = max(1, n // cfg.batch_size)
    draft.train()
    t0 = time.perf_counter()
    last: dict = {}
    stopped = False
    bar = tqdm(total=cfg.steps, initial=step, desc="distil", unit="step", disable=None)
    cap = 60 * cfg.max_train_minutes
    while step < cfg.steps:
        elapsed = prior_s + time.perf_counter() - t0
        progress = max(step / cfg.steps, elapsed / cap if cap else 0.0)
        if progress >= 1.0:
            stopped = True
            log.warning("stopping at step %d: --max-train-minutes %.1f reached", step, cfg.max_train_minutes)
            break
        epoch, k = divmod(step, per_epoch)
        order = _order(n, epoch, cfg.seed)
        b = _batch(data, order[k * cfg.batch_size:(k + 1) * cfg.batch_size])
        for g in opt.param_groups:
            g["lr"] = _lr_at(step, progress, cfg)
        ts = time.perf_counter()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=cfg.bf16 and b["ids"].device.type == "cpu"):
            h = draft.model(input_ids=b["ids"], attention_mask=b["mask"], use_cache=False).last_hidden_state
            logits = draft.lm_head(h[b["rows"], b["cols"]])
        m = distill_loss(logits, b["top_idx"], b["top_logp"], cfg.ce_weight)
        opt.zero_grad(set_to_none=True)
        m["loss"].backward()
        torch.nn.utils.clip_grad_norm_(draft.parameters(), 1.0)
        opt.step()
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
    bar.close()
    save()
    draft.eval()
    return {"start_step": start_step, "step": step, "train_seconds": time.perf_counter() - t0,
            "total_train_seconds": prior_s + time.perf_counter() - t0, "last": last, "stopped_by_time": stopped}


# ----------------------------------------------------------------------------- measurement
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
    V = pair.vocab_size
    eos = set(pair.eos_token_ids)
    agree, mins, per_prompt, seqs = 0.0, 0.0, [], []
    npos = 0
    for p in tqdm(prompts, desc="measure α", disable=None if show_progress else True):
        ids = pair.encode_prompt(p)
        pair.check_length(ids.numel(), max_new_tokens)
        out = pair.target.generate(ids[None], attention_mask=torch.ones_like(ids[None]), max_new_tokens=max_new_tokens,
                                   do_sample=False, temperature=None, top_p=None, top_k=None,
                                   pad_token_id=pair.tokenizer.pad_token_id or next(iter(eos), 0))
        new = out[0, ids.numel():].tolist()
        for t, tok in enumerate(new):
            if tok in eos:
                new = new[:t + 1]
                break
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

    # ---- timing: one new token with a KV cache, interleaved
    clock = DeviceClock(pair.device)  # the loop's clock: synchronised with the device
    samples = {"draft": [], "target": []}
    ctx_lens = []
    for seq in sorted(seqs, key=len)[:: max(1, len(seqs) // max(1, timing_contexts))][:timing_contexts]:
        ctx_lens.append(int(seq.numel()))
        caches = {}
        for name, model in (("draft", pair.draft), ("target", pair.target)):
            c = DynamicCache()
            model(input_ids=seq[None, :-1], cache=c, use_cache=True)
            caches[name] = c
        last = seq[None, -1:]
        for r in range(timing_repeats + 3):
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
    for r in range(timing_repeats + 3):
        t0 = clock.now()
        F.linear(x, W)
        if r >= 3:
            head.append(clock.now() - t0)
    d_ms = 1000 * statistics.median(samples["draft"])
    t_ms = 1000 * statistics.median(samples["target"])
    return {
        "alpha_greedy": agree / npos,
        "alpha_t1": mins / npos,
        "alpha_greedy_per_prompt": per_prompt,
        "positions": npos,
        "prompts": len(per_prompt),
        "max_new_tokens": max_new_tokens,
        "draft_ms": d_ms,
        "target_ms": t_ms,
        "cost_ratio": d_ms / t_ms,
        "lm_head_ms": 1000 * statistics.median(head),
        "timing_context_lens": ctx_lens,
        "timing_samples": len(samples["draft"]),
        "threads": torch.get_num_threads(),
        "dtype": str(next(pair.draft.parameters()).dtype),
        "device": str(pair.device),
    }


def dir_size_bytes(path: Path) -> int:
    """Total size in bytes of the regular files under ``path``."""
    return sum(f.stat().st_size for f in Path(path).rglob("*") if f.is_file())


# ----------------------------------------------------------------------------- driver
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
    work = Path(cfg.work_dir).expanduser() if cfg.work_dir else DEFAULT_WORK_DIR / _slug(cfg.target)
    out = (Path(cfg.out).expanduser() if cfg.out else work / "draft").resolve()
    check_out_dir(out, cfg.target)
    save_dtype = parse_dtype(cfg.save_dtype)
    torch.manual_seed(cfg.seed)
    random.seed(cfg.seed)
    prompts = select_distill_prompts(prompts, cfg.prompts_file, cfg.num_prompts)
    if tokenizer is None:
        tokenizer = load_tokenizer(cfg.target)
    if target is None:
        log.info("loading target %s", cfg.target)
        target = load_model(cfg.target)
    target.eval()
    if target.get_output_embeddings().weight.shape[0] < len(tokenizer):
        raise DistillError("The target has fewer output rows than its tokenizer has tokens.")

    work.mkdir(parents=True, exist_ok=True)
    dkey = cfg.data_key(prompts)
    tkey = cfg.train_key(dkey)

    t0 = time.perf_counter()
    data = generate_data(target, tokenizer, prompts, cfg, work / "data" / dkey)
    gen_s = time.perf_counter() - t0
    n_tok = sum(len(d["top_idx"]) for d in data)
    log.info("data: %d responses, %d response tokens (%.0f s)", len(data), n_tok, gen_s)

    run = None
    if cfg.wandb_mode != "disabled":
        import wandb

        id_file = work / f"wandb_id_{tkey}.txt"
        run_id = id_file.read_text().strip() if id_file.exists() and not restart else uuid.uuid4().hex[:8]
        id_file.write_text(run_id)
        run = wandb.init(project=cfg.wandb_project, mode=cfg.wandb_mode, dir=str(work), id=run_id, resume="allow",
                         config=asdict(cfg), name=f"distill-{_slug(cfg.target)}")
        run.log({"data/responses": len(data), "data/tokens": n_tok, "data/seconds": gen_s})

    draft = make_draft(target, tokenizer, cfg)
    n_params = sum(p.numel() for p in draft.parameters())
    tr = train_draft(draft, data, cfg, work, tkey, restart=restart, wandb_run=run)

    draft = draft.float().eval()
    pair = make_pair(target, draft, tokenizer, tokenizer, target_name=cfg.target, draft_name=str(out))
    if eval_prompts is None:
        eval_prompts = load_prompts("heldout")
    if cfg.eval_prompts:
        eval_prompts = eval_prompts[: cfg.eval_prompts]
    t0 = time.perf_counter()
    meas = measure_draft(pair, eval_prompts, cfg.eval_max_new_tokens, cfg.timing_repeats)
    eval_s = time.perf_counter() - t0

    # write to a fresh directory, then swap it in
    tmp = out.with_name(out.name + ".tmp")
    if tmp.exists():
        shutil.rmtree(tmp)
    draft.to(save_dtype).save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    report = {
        "target": cfg.target,
        "out": str(out),
        "command": command or "",
        "config": asdict(cfg),
        "draft_parameters": n_params,
        "draft_architecture": {k: getattr(draft.config, k) for k in ("hidden_size", "num_hidden_layers",
                                                                      "intermediate_size", "num_attention_heads",
                                                                      "num_key_value_heads", "head_dim", "vocab_size")},
        "data": {"responses": len(data), "response_tokens": n_tok, "prompts": len(prompts),
                 "sampled_responses": sum(d["sampled"] for d in data)},
        "training": {k: tr[k] for k in ("start_step", "step", "train_seconds", "total_train_seconds",
                                          "stopped_by_time")} | {"last": tr["last"]},
        "measure": meas,
        "measure_prompts": "learn2draft.prompts.load_prompts('heldout')" if cfg.eval_prompts == 0 else
                           f"first {cfg.eval_prompts} held-out prompts",
        "seconds": {"generate": gen_s, "train": tr["train_seconds"], "measure": eval_s},
        "torch_threads": torch.get_num_threads(),
        "versions": {"torch": torch.__version__, "transformers": __import__("transformers").__version__},
    }
    report["seconds"]["total"] = time.perf_counter() - t_start
    report["size_bytes"] = dir_size_bytes(tmp) + 4096  # + the report itself (approx.)
    (tmp / "build_report.json").write_text(json.dumps(report, indent=2))
    report["size_bytes"] = dir_size_bytes(tmp)
    (tmp / "build_report.json").write_text(json.dumps(report, indent=2))
    if out.exists():
        shutil.rmtree(out)
    os.replace(tmp, out)
    if run is not None:
        run.summary.update({f"measure/{k}": v for k, v in meas.items() if isinstance(v, (int, float))})
        run.finish()
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
    if out.exists() and not out.is_dir():
        raise DistillError(f"--out {out} exists and is not a directory: pass a directory path.")
    try:  # the build is written beside ``out`` (``<out>.tmp``) and swapped in: write there, don't ask
        out.parent.mkdir(parents=True, exist_ok=True)
        probe = out.parent / f".{out.name}.write-test-{os.getpid()}"
        probe.write_text("ok")
        probe.unlink()
    except OSError as e:
        raise DistillError(f"Cannot write beside --out {out} ({e.strerror or e}): pass an --out directory you can "
                           "write to.") from None
    if out.is_dir() and any(out.iterdir()) and not (out / "build_report.json").is_file():
        raise DistillError(
            f"--out {out} already holds files that this tool did not write (no build_report.json); they would be "
            "deleted: choose a new or empty directory."
        )
    if out == DEFAULT_DRAFT_DIR.resolve() and target != DEFAULT_TARGET:
        raise DistillError(
            f"--out defaults to the shipped draft of {DEFAULT_TARGET}; for target {target!r} pass --out NEW_DIR."
        )


def main(argv: list[str] | None = None) -> int:
    """CLI entry point; returns the exit status (2 on bad input, with a one-line message)."""
    cfg, a = parse_args(argv)
    logging.basicConfig(level=logging.INFO if a.verbose else logging.WARNING, format="%(levelname)s %(message)s")
    logging.getLogger(__name__).setLevel(logging.INFO)
    cmd = "python -m train.recipes.draft_model" + ("" if argv is None and len(sys.argv) <= 1 else " " + shlex.join(
        sys.argv[1:] if argv is None else argv))
    try:
        rep = build_draft(cfg, restart=a.restart, command=cmd)
    except (DistillError, ModelLoadError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except OSError as e:
        print(f"error: {e.__class__.__name__}: {e}", file=sys.stderr)
        return 2
    m = rep["measure"]
    print(json.dumps({"out": rep["out"], "alpha_greedy": round(m["alpha_greedy"], 4), "alpha_t1": round(m["alpha_t1"], 4),
                      "cost_ratio": round(m["cost_ratio"], 4), "size_mb": round(rep["size_bytes"] / 1e6, 2),
                      "seconds": round(rep["seconds"]["total"], 1)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
