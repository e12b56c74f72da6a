"""Names of the embedded default pair — no heavy imports, so a command's ``--help`` can show them
without loading torch (:mod:`learn2draft.models` re-exports them)."""

from __future__ import annotations

from pathlib import Path

DEFAULT_TARGET = "smollm2-135m-instruct"
DEFAULT_DRAFT = "smollm2-135m-draft"
DEFAULT_DRAFT_DIR = Path(__file__).resolve().parent / "assets" / DEFAULT_DRAFT

__all__ = ["DEFAULT_DRAFT", "DEFAULT_DRAFT_DIR", "DEFAULT_TARGET"]
