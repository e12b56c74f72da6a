"""The prompt sets shipped with the package (``learn2draft/data/prompts.json``)."""

from __future__ import annotations

import json
from functools import cache
from pathlib import Path

PROMPTS_FILE = Path(__file__).resolve().parent / "data" / "prompts.json"


@cache
def _load() -> dict:
    return json.loads(PROMPTS_FILE.read_text())


def load_prompts(split: str) -> list[str]:
    """Prompts of a split: ``"train"`` (policy training, fixed-γ grid search) or ``"heldout"`` (evaluation).

    Raises:
        ValueError: unknown split.
    """
    data = _load()
    if split not in ("train", "heldout"):
        raise ValueError(f"Unknown prompt split {split!r}: use 'train' or 'heldout'.")
    return list(data[split])
