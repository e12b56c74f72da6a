"""The real-work corpus (issue 38 §1): built offline and deterministically from the shipped sources, disjoint
splits by document, a leave-one-source-out set, long documents, every category in every language, nothing from
the confirmation set, and malformed sources refused with their name."""

from __future__ import annotations

import json
import shutil

import pytest

from learn2draft import corpus as C
from learn2draft.prompts import (
    COPY_CATEGORIES,
    CORPUS_SPLITS,
    PROMPT_SETS,
    load_prompt_records,
    load_prompts,
    prompt_distribution,
    prompt_set_splits,
    prompt_set_validation,
)


@pytest.fixture(scope="module")
def shipped() -> dict:
    return json.loads(C.CORPUS_FILE.read_text(encoding="utf-8"))


def _records(corpus: dict, splits=C.SPLIT_NAMES) -> list[dict]:
    return [r for name in splits for r in corpus["splits"][name]]


def test_the_shipped_corpus_equals_a_fresh_build_and_the_build_is_deterministic(tmp_path, capsys):
    a, b = tmp_path / "a.json", tmp_path / "b.json"
    assert C.main(["--out", str(a)]) == 0 and C.main(["--out", str(b)]) == 0
    assert a.read_bytes() == b.read_bytes() == C.CORPUS_FILE.read_bytes()
    assert C.main(["--check"]) == 0
    b.write_text(b.read_text(encoding="utf-8").replace("corpus-math-en-001", "corpus-math-en-999"), encoding="utf-8")
    assert C.main(["--check", "--out", str(b)]) == 1
    assert "differs from a fresh build" in capsys.readouterr().err


def test_splits_are_disjoint_by_document_and_the_held_out_source_is_in_no_other_split(shipped):
    assert set(shipped["splits"]) == set(C.SPLIT_NAMES) == set(CORPUS_SPLITS)
    where: dict[str, set[str]] = {}
    for name, rows in shipped["splits"].items():
        for r in rows:
            where.setdefault(r["document"], set()).add(name)
            assert C.split_of(r["source"], r["document"]) == name
    assert all(len(v) == 1 for v in where.values())
    assert {r["source"] for r in shipped["splits"]["corpus_loso"]} == {C.LOSO_SOURCE} == {shipped["loso_source"]}
    others = _records(shipped, ("corpus_train", "corpus_validation", "corpus_test"))
    assert C.LOSO_SOURCE not in {r["source"] for r in others}
    n = len(others)  # about 60/15/25 of the documents' prompts
    shares = [len(shipped["splits"][s]) / n for s in ("corpus_train", "corpus_validation", "corpus_test")]
    assert 0.45 <= shares[0] <= 0.72 and 0.08 <= shares[1] <= 0.22 and 0.18 <= shares[2] <= 0.35, shares
    ids = [r["question_id"] for r in _records(shipped)]
    assert len(ids) == len(set(ids))


def test_size_long_documents_categories_and_languages(shipped):
    rows = _records(shipped)
    assert len(rows) >= 600
    lengths = [len(r["turns"][0]) for r in rows]
    assert sum(n >= C.LONG_MIN for n in lengths) >= 0.25 * len(rows)
    assert max(lengths) <= C.PROMPT_MAX
    for r in rows:
        assert isinstance(r["turns"], list) and r["turns"][0].strip()
        assert r["source"] in C.SOURCES and r["document"]
        if r["category"] in C.LONG_CATEGORIES:
            assert C.LONG_MIN <= len(r["turns"][0]) <= C.PROMPT_MAX, r["question_id"]
    counts: dict[tuple[str, str], int] = {}
    for r in rows:
        counts[(r["category"], r["language"])] = counts.get((r["category"], r["language"]), 0) + 1
    assert counts == {(cat, lang): n for cat, ns in C.COUNTS.items() for lang, n in zip(C.LANGUAGES, ns)}
    assert set(C.CATEGORIES) == {"chat", "code", "code_edit", "math", "translation", "summarization", "rag",
                                 "context_qa", "extraction", "qa", "copy_edit"}
    for r in rows:
        if r["category"] == "translation":
            assert r["source_language"] == r["language"] != r["target_language"]
    # the requests are written in their language
    zh = [r for r in rows if r["language"] == "zh"]
    assert all(any("\u4e00" <= ch <= "\u9fff" for ch in r["turns"][0][:80]) for r in zh)


def test_nothing_from_the_confirmation_set(shipped):
    sources = {r["source"] for r in _records(shipped)}
    assert sources == set(C.SOURCES)
    assert not sources & set(C.FORBIDDEN_SOURCES)
    assert not {name.lower() for name in C.SOURCES} & {"gsm8k-test", "mt-bench", "wmt14", "cnn-dailymail"}
    assert "kept apart" in shipped["description"]
    notes = (C.SOURCES_DIR / "SOURCES.md").read_text(encoding="utf-8")
    for name, (licence, data_file, licence_file) in C.SOURCES.items():
        assert name in notes and (C.SOURCES_DIR / licence_file).is_file() and (C.SOURCES_DIR / data_file).is_file()
    for gone in ("MT-bench", "WMT14", "CNN/DailyMail", "Natural", "DPR", "GSM8K *test*"):
        assert gone in notes


def _corrupt_line(path, n, text):
    lines = path.read_text(encoding="utf-8").splitlines()
    lines[n - 1] = text
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")


@pytest.mark.parametrize("damage, message", [
    (lambda d: _corrupt_line(d / "gsm8k-train/train.jsonl", 3, '{"index": 3, "question": '),
     r"gsm8k-train/train\.jsonl:3: not valid JSON"),
    (lambda d: _corrupt_line(d / "humaneval/HumanEval.jsonl", 2, '{"task_id": "x", "prompt": "p", '
                                                                  '"canonical_solution": "s"}'),
     r"humaneval/HumanEval\.jsonl:2: missing field 'entry_point'"),
    (lambda d: _corrupt_line(d / "cpython-stdlib/functions.jsonl", 5, '{"module": 1, "qualname": "q", "kind": "k", '
                                                                       '"source": "s", "docstring": ""}'),
     r"cpython-stdlib/functions\.jsonl:5: field 'module' must be str"),
    (lambda d: (d / "django-locale/messages.jsonl").write_bytes(
        (d / "django-locale/messages.jsonl").read_bytes() + b'{"domain": "\xff"}\n'),
     r"django-locale/messages\.jsonl:719: not UTF-8"),
    (lambda d: (d / "faker/LICENSE").unlink(), r"faker/LICENSE: missing corpus source file"),
    (lambda d: (d / "pydoc-topics/topics.json").write_text('{"a": "b",\n', encoding="utf-8"),
     r"pydoc-topics/topics\.json:2: not valid JSON"),
])
def test_a_malformed_source_file_is_refused_with_its_name(tmp_path, capsys, damage, message):
    copy = tmp_path / "sources"
    shutil.copytree(C.SOURCES_DIR, copy)
    damage(copy)
    with pytest.raises(C.CorpusSourceError, match=message):
        C.build(copy)
    assert C.main(["--sources", str(copy), "--out", str(tmp_path / "c.json")]) == 1
    assert not (tmp_path / "c.json").exists()
    err = capsys.readouterr().err
    assert err.startswith("error: ") and str(copy) in err


def test_the_splits_load_as_prompt_records_ordered_round_robin():
    assert PROMPT_SETS["corpus"] == prompt_set_splits("corpus") == ("corpus_train", "corpus_test")
    assert prompt_set_validation("corpus") == "corpus_validation"
    assert prompt_set_validation("mixed") == "mixed_train" and prompt_set_validation("open") == "train"
    with pytest.raises(ValueError, match="corpus"):
        prompt_set_validation("nope")
    test = load_prompt_records("corpus_test")
    dist = prompt_distribution(test)
    assert dist["total"] >= 48 and len(dist["categories"]) >= 6 and set(dist["languages"]) == set(C.LANGUAGES)
    assert load_prompts("corpus_test") == [p.text for p in test]
    assert all(p.id.startswith("corpus-") for p in test)
    for split in ("corpus_train", "corpus_validation", "corpus_test", "corpus_loso"):
        records = load_prompt_records(split)
        cats = list(prompt_distribution(records)["categories"])
        first = records[: len(cats)]
        assert [p.category for p in first] == cats  # the first N prompts cover N categories
        assert len({p.language for p in records[:8]}) >= 3, split  # ... and several languages
    assert {"copy_edit", "code_edit", "rag", "context_qa", "extraction"} <= set(COPY_CATEGORIES)
