"""Prompt sets: the ones shipped with the package (``learn2draft/data/prompts.json``,
``learn2draft/data/mixed_prompts.json`` and the real-work corpus ``learn2draft/data/corpus.json``, built by
:mod:`learn2draft.corpus`) and a user's file.

Every prompt can be read as a :class:`Prompt` record (text, category, language, id), so that eval
and the benchmark report per category and per language; :func:`load_prompts` and
:func:`load_prompt_file` return the texts alone.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from functools import cache
from pathlib import Path

PROMPTS_FILE = Path(__file__).resolve().parent / "data" / "prompts.json"
#: The mixed and multilingual sets, in the MT-bench / Spec-Bench format (``question_id``, ``category``,
#: ``language``, ``turns``).
MIXED_PROMPTS_FILE = Path(__file__).resolve().parent / "data" / "mixed_prompts.json"
_PLAIN_SPLITS = ("train", "heldout", "copy_train", "copy_heldout")
_RECORD_SPLITS = ("mixed_train", "mixed_heldout", "multilingual_train", "multilingual_heldout")
#: The real-work corpus (:mod:`learn2draft.corpus`), in the same format plus ``source`` and ``document``.
CORPUS_FILE = Path(__file__).resolve().parent / "data" / "corpus.json"
#: Its splits: train / validation / test (disjoint by source document) and the leave-one-source-out test set.
CORPUS_SPLITS = ("corpus_train", "corpus_validation", "corpus_test", "corpus_loso")
SPLITS = _PLAIN_SPLITS + _RECORD_SPLITS + CORPUS_SPLITS
#: The shipped prompt sets of ``--prompt-set``: name → (training split, held-out split).
PROMPT_SETS = {"open": ("train", "heldout"), "copy": ("copy_train", "copy_heldout"),
               "mixed": ("mixed_train", "mixed_heldout"), "multilingual": ("multilingual_train", "multilingual_heldout"),
               "corpus": ("corpus_train", "corpus_test")}
#: The validation split of a prompt set that has one (where a fixed configuration is chosen); the others use
#: their training split.
_VALIDATION_SPLITS = {"corpus": "corpus_validation"}
#: Category and language of a prompt that states none (a plain string, a ``"prompt"`` object, the open splits).
DEFAULT_CATEGORY, DEFAULT_LANGUAGE = "default", "en"
#: Categories whose answers copy from the prompt (where prompt lookup pays): the copy splits' ``"copy"``, the
#: mixed set's ``"extraction"`` (editing and extraction) and ``"context_qa"`` (answers over a given text), and the
#: corpus's ``"copy_edit"`` (rewrite a JSON record, fill a template, reformat a table), ``"code_edit"`` (edit a
#: function given in full) and ``"rag"`` (answers quoting retrieved passages). Summarization and translation
#: copy less (names and placeholders) and are not counted.
COPY_CATEGORIES = ("copy", "extraction", "context_qa", "copy_edit", "code_edit", "rag")


@dataclass(frozen=True)
class Prompt:
    """One prompt: its ``text`` (the first turn of an MT-bench record), its ``category`` (e.g. ``"code"``;
    :data:`DEFAULT_CATEGORY` when none is given), its ``language`` (a code such as ``"en"``, ``"zh"``;
    :data:`DEFAULT_LANGUAGE` when none is given) and its ``id`` (``question_id``; None when none is given)."""

    text: str
    category: str = DEFAULT_CATEGORY
    language: str = DEFAULT_LANGUAGE
    id: str | None = None


@cache
def _load() -> dict:
    return json.loads(PROMPTS_FILE.read_text(encoding="utf-8"))


@cache
def _load_mixed() -> dict:
    return json.loads(MIXED_PROMPTS_FILE.read_text(encoding="utf-8"))


@cache
def _load_corpus() -> dict:
    return json.loads(CORPUS_FILE.read_text(encoding="utf-8"))


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


def load_prompt_records(split: str) -> list[Prompt]:
    """The :class:`Prompt` records of a shipped split (see :func:`load_prompts` for the splits). The open
    splits (``"train"``, ``"heldout"``) have category :data:`DEFAULT_CATEGORY`, the copy splits ``"copy"``
    (both language ``"en"``: they are mostly English, without per-prompt languages); the mixed, multilingual
    and corpus splits carry their own categories and languages.

    Raises:
        ValueError: unknown split.
    """
    if split not in SPLITS:
        raise ValueError(f"Unknown prompt split {split!r}: use one of {', '.join(SPLITS)}.")
    if split in _RECORD_SPLITS:
        return [_record_of(row, f"{MIXED_PROMPTS_FILE} {split} item {i}")
                for i, row in enumerate(_load_mixed()["splits"][split])]
    if split in CORPUS_SPLITS:
        return [_record_of(row, f"{CORPUS_FILE} {split} item {i}")
                for i, row in enumerate(_load_corpus()["splits"][split])]
    category = "copy" if split.startswith("copy_") else DEFAULT_CATEGORY
    return [Prompt(t, category, DEFAULT_LANGUAGE, f"{split}-{i + 1}") for i, t in enumerate(_load()[split])]


def load_prompts(split: str) -> list[str]:
    """Prompts of a split: ``"train"`` (policy training, fixed-γ grid search), ``"heldout"``
    (evaluation), and their copy-heavy counterparts ``"copy_train"`` / ``"copy_heldout"`` (answers
    that copy from the prompt: code edits, extraction, question answering over a given text,
    reformatting — where prompt lookup pays); ``"mixed_train"`` / ``"mixed_heldout"`` (English, 8
    categories: chat, code, extraction, summarization, qa, math, translation, context_qa) and
    ``"multilingual_train"`` / ``"multilingual_heldout"`` (chat, code, extraction, summarization, qa,
    math, each in English, Spanish, Italian and Chinese), read from :data:`MIXED_PROMPTS_FILE` (its
    ``description`` says more); the real-work corpus's ``"corpus_train"`` / ``"corpus_validation"`` /
    ``"corpus_test"`` (disjoint by source document) and ``"corpus_loso"`` (one whole source held out of the
    others), read from :data:`CORPUS_FILE` (see ``docs/corpus.md``). The training and held-out splits of each
    set are disjoint.

    Raises:
        ValueError: unknown split.
    """
    return [p.text for p in load_prompt_records(split)]


def prompt_set_splits(name: str) -> tuple[str, str]:
    """The (training, held-out) splits of a shipped prompt set of ``--prompt-set`` (:data:`PROMPT_SETS`).

    Raises:
        ValueError: unknown set.
    """
    if name not in PROMPT_SETS:
        raise ValueError(f"Unknown prompt set {name!r}: use one of {', '.join(PROMPT_SETS)}.")
    return PROMPT_SETS[name]


def prompt_set_validation(name: str) -> str:
    """The validation split of a shipped prompt set (where a fixed configuration is chosen): ``"corpus_validation"``
    for ``"corpus"``; the training split for the sets that have no validation split.

    Raises:
        ValueError: unknown set.
    """
    train, _held = prompt_set_splits(name)
    return _VALIDATION_SPLITS.get(name, train)


def load_prompt_file_records(path: str | Path) -> list[Prompt]:
    """:class:`Prompt` records from a user's file: ``.jsonl`` with one object per line, or a JSON list of
    strings or objects. An object is either ``{"prompt": text}`` (optional ``"category"``, ``"language"``,
    ``"id"``) or an MT-bench / Spec-Bench question ``{"question_id", "category", "turns": [text, ...]}``
    (optional ``"language"``; the first turn is the prompt, later turns are ignored). What a record does not
    state is :data:`DEFAULT_CATEGORY` / :data:`DEFAULT_LANGUAGE`.

    Raises:
        FileNotFoundError: no such file.
        ValueError: the file is not in one of these formats, or holds no prompt (the message names the file
            and the line or item).
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"No prompt file at {path}: pass a .jsonl file with a 'prompt' field (or MT-bench's "
                                "'turns') per line, or a JSON list of strings.")
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise ValueError(f"{path}: not UTF-8 text (byte {e.start}): save the prompt file as UTF-8.") from None
    records: list[Prompt] = []
    if path.suffix == ".jsonl":
        for n, line in enumerate(text.splitlines(), 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{n}: not valid JSON ({e.msg}): each line must be an object with a 'prompt' "
                                 "field, or an MT-bench question with 'turns'.") from None
            records.append(_record_of(row, f"{path}:{n}"))
    else:
        try:
            data = json.loads(text)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}: not valid JSON ({e.msg} at line {e.lineno}): pass a JSON list of strings or "
                             "objects, or a .jsonl file.") from None
        if not isinstance(data, list):
            raise ValueError(f"{path}: expected a JSON list of prompts, got {type(data).__name__}.")
        records = [_record_of(row, f"{path} item {i}") for i, row in enumerate(data)]
    if not records:
        raise ValueError(f"{path} holds no prompt.")
    return records


def load_prompt_file(path: str | Path) -> list[str]:
    """The prompt texts of a user's file (:func:`load_prompt_file_records`: ``.jsonl`` or a JSON list of
    strings, ``{"prompt": ...}`` objects or MT-bench questions, whose first turn is the prompt).

    Raises:
        FileNotFoundError: no such file.
        ValueError: as :func:`load_prompt_file_records` (the message names the line or item).
    """
    return [p.text for p in load_prompt_file_records(path)]


def prompt_distribution(records) -> dict:
    """How many of ``records`` (:class:`Prompt`) fall in each category and language:
    ``{"total": n, "categories": {category: n}, "languages": {language: n}}``, in order of first appearance."""
    cats: dict[str, int] = {}
    langs: dict[str, int] = {}
    for p in records:
        cats[p.category] = cats.get(p.category, 0) + 1
        langs[p.language] = langs.get(p.language, 0) + 1
    return {"total": len(records), "categories": cats, "languages": langs}


def _text_field(value, where: str, name: str, row) -> str:
    if not isinstance(value, str) or not value.strip():
        raise ValueError(f"{where}: expected a non-empty string {name}, got {row!r:.80}.")
    return value


def _record_of(row, where: str) -> Prompt:
    """One :class:`Prompt` from a file's string or object, ``where`` naming its file and line or item."""
    if isinstance(row, str):
        return Prompt(_text_field(row, where, "prompt", row))
    if not isinstance(row, dict):
        raise ValueError(f"{where}: expected a non-empty string prompt, an object with a 'prompt' field or an "
                         f"MT-bench question with 'turns', got {row!r:.80}.")
    if "turns" in row:
        turns = row["turns"]
        if not isinstance(turns, list) or not turns:
            raise ValueError(f"{where}: 'turns' must be a non-empty list of strings (the first turn is the prompt), "
                             f"got {turns!r:.80}.")
        text = _text_field(turns[0], where, "first turn", row)
    elif "prompt" in row:
        text = _text_field(row["prompt"], where, "prompt", row)
    else:
        raise ValueError(f"{where}: expected a non-empty string prompt: an object needs a 'prompt' field or "
                         f"MT-bench's 'turns' (a list of strings), got {row!r:.80}.")
    fields = {}
    for name in ("category", "language"):
        if row.get(name) is not None:
            fields[name] = _text_field(row[name], where, f"'{name}'", row).strip()
    qid = row.get("question_id", row.get("id"))
    if qid is not None and (isinstance(qid, bool) or not isinstance(qid, (str, int))):
        raise ValueError(f"{where}: 'question_id' must be a string or an integer, got {qid!r:.80}.")
    return Prompt(text, id=None if qid is None else str(qid), **fields)
