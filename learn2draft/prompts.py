"""Prompt sets: the ones shipped with the package (``learn2draft/data/prompts.json``) and a user's file."""

from __future__ import annotations

import json
from functools import cache
from pathlib import Path

PROMPTS_FILE = Path(__file__).resolve().parent / "data" / "prompts.json"
SPLITS = ("train", "heldout", "copy_train", "copy_heldout")


@cache
def _load() -> dict:
    return json.loads(PROMPTS_FILE.read_text())


def check_prompt_text(text: str) -> str:
    """Return ``text`` if it is a non-blank prompt that encodes as UTF-8.

    Raises:
        ValueError: blank text, or text with undecodable bytes (lone surrogates, e.g. from invalid
            UTF-8 on a command line or standard input).
    """
    if not text.strip():
        raise ValueError("Empty prompt: pass some text to continue.")
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ValueError(f"The prompt is not valid UTF-8 (undecodable bytes at characters {e.start}-{e.end}): pass "
                         "UTF-8 text.") from None
    return text


def load_prompts(split: str) -> list[str]:
    """Prompts of a split: ``"train"`` (policy training, fixed-γ grid search), ``"heldout"``
    (evaluation), and their copy-heavy counterparts ``"copy_train"`` / ``"copy_heldout"`` (answers
    that copy from the prompt: code edits, extraction, question answering over a given text,
    reformatting — where prompt lookup pays). ``"train"`` and ``"heldout"`` are disjoint, and so
    are the texts of the two copy splits.

    Raises:
        ValueError: unknown split.
    """
    if split not in SPLITS:
        raise ValueError(f"Unknown prompt split {split!r}: use one of {', '.join(SPLITS)}.")
    return list(_load()[split])


def load_prompt_file(path: str | Path) -> list[str]:
    """Prompts from a user's file: ``.jsonl`` with a ``"prompt"`` field on every line, or a JSON
    list of strings (or of objects with a ``"prompt"`` field).

    Raises:
        FileNotFoundError: no such file.
        ValueError: the file is not in one of these formats, or holds no prompt (the message
            names the line or item).
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"No prompt file at {path}: pass a .jsonl file with a 'prompt' field per line, "
                                "or a JSON list of strings.")
    text = path.read_text(encoding="utf-8")
    prompts: list[str] = []
    if path.suffix == ".jsonl":
        for n, line in enumerate(text.splitlines(), 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{n}: not valid JSON ({e.msg}): each line must be an object with a 'prompt' field.") from None
            prompts.append(_prompt_of(row, f"{path}:{n}"))
    else:
        try:
            data = json.loads(text)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}: not valid JSON ({e.msg}): pass a JSON list of strings or a .jsonl file.") from None
        if not isinstance(data, list):
            raise ValueError(f"{path}: expected a JSON list of prompts, got {type(data).__name__}.")
        prompts = [_prompt_of(row, f"{path} item {i}") for i, row in enumerate(data)]
    if not prompts:
        raise ValueError(f"{path} holds no prompt.")
    return prompts


def _prompt_of(row, where: str) -> str:
    p = row.get("prompt") if isinstance(row, dict) else row
    if not isinstance(p, str) or not p.strip():
        raise ValueError(f"{where}: expected a non-empty string prompt (or an object with a 'prompt' field), got {row!r:.80}.")
    return p
