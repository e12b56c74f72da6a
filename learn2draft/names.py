"""Names of the embedded default pair, the drafters and the model dtypes — no heavy imports, so a
command's ``--help`` can show them without loading torch (:mod:`learn2draft.models` re-exports the
pair's names, :mod:`learn2draft.drafters` the drafters)."""

from __future__ import annotations

from pathlib import Path

DEFAULT_TARGET = "smollm2-135m-instruct"
DEFAULT_DRAFT = "smollm2-135m-draft"
DEFAULT_DRAFT_DIR = Path(__file__).resolve().parent / "assets" / DEFAULT_DRAFT

#: The drafters :func:`learn2draft.drafters.make_drafter` builds; only ``"model"`` needs a draft model.
DRAFTERS = ("model", "head", "lookup")
#: Model dtype names (and their short aliases) → the canonical name, the attribute of ``torch``.
DTYPE_NAMES = {"float32": "float32", "fp32": "float32", "bfloat16": "bfloat16", "bf16": "bfloat16",
               "float16": "float16", "fp16": "float16"}

__all__ = ["DEFAULT_DRAFT", "DEFAULT_DRAFT_DIR", "DEFAULT_TARGET", "DRAFTERS", "DTYPE_NAMES"]
