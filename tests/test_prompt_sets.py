"""Prompt records and the shipped mixed / multilingual sets (issue 18 item 1, issue 16 item 6), the
per-category and per-language reports, the report header and the verdict lines (issue 18 item 3)."""

from __future__ import annotations

import hashlib
import json
import statistics

import pytest

from learn2draft.prompts import (
    COPY_CATEGORIES,
    DEFAULT_CATEGORY,
    DEFAULT_LANGUAGE,
    PROMPT_SETS,
    Prompt,
    load_prompt_file,
    load_prompt_file_records,
    load_prompt_records,
    load_prompts,
    prompt_distribution,
    prompt_set_splits,
)

MIXED_CATEGORIES = {"chat", "code", "extraction", "summarization", "qa", "math", "translation", "context_qa"}
TASKS = {"chat", "code", "extraction", "summarization", "qa", "math"}
LANGUAGES = {"en", "es", "it", "zh"}


# --------------------------------------------------------------------------------- the MT-bench reader
def test_mt_bench_files_are_read_as_records_with_their_first_turn(tmp_path):
    rows = [{"question_id": 81, "category": "writing", "turns": ["First turn.", "A follow-up, ignored."]},
            {"question_id": "q2", "category": "code", "language": "zh", "turns": ["写一个函数。"]},
            {"prompt": "plain object", "category": "math"}, "a plain string"]
    (tmp_path / "q.jsonl").write_text("\n".join(json.dumps(r, ensure_ascii=False) for r in rows) + "\n\n",
                                      encoding="utf-8")
    (tmp_path / "q.json").write_text(json.dumps(rows), encoding="utf-8")
    want = [Prompt("First turn.", "writing", DEFAULT_LANGUAGE, "81"), Prompt("写一个函数。", "code", "zh", "q2"),
            Prompt("plain object", "math"), Prompt("a plain string", DEFAULT_CATEGORY, DEFAULT_LANGUAGE, None)]
    for name in ("q.jsonl", "q.json"):
        assert load_prompt_file_records(tmp_path / name) == want
        assert load_prompt_file(tmp_path / name) == [p.text for p in want]  # the texts, as before


@pytest.mark.parametrize("content, message", [
    ('{"question_id": 1, "category": "a", "turns": ["ok"]}\n{"question_id": 2, "category": "b", "turns": []}\n',
     r"bad.jsonl:2: 'turns' must be a non-empty list"),
    ('{"question_id": 1, "turns": "not a list"}\n', r"bad.jsonl:1: 'turns' must be a non-empty list"),
    ('{"question_id": 1, "turns": [3]}\n', r"bad.jsonl:1: expected a non-empty string first turn"),
    ('{"question_id": 1, "turns": ["  "]}\n', r"bad.jsonl:1: expected a non-empty string first turn"),
    ('{"turns": ["x"], "category": 7}\n', r"bad.jsonl:1: expected a non-empty string 'category'"),
    ('{"turns": ["x"], "language": ""}\n', r"bad.jsonl:1: expected a non-empty string 'language'"),
    ('{"turns": ["x"], "question_id": [1]}\n', r"bad.jsonl:1: 'question_id' must be a string or an integer"),
    ('{"question": "x"}\n', r"bad.jsonl:1: expected a non-empty string prompt.*'turns'"),
    ('{"turns": ["x"]}\n{"turns": ["y"],\n', r"bad.jsonl:2: not valid JSON"),
    ("[1]\n", r"bad.jsonl:1: expected a non-empty string prompt"),
])
def test_bad_mt_bench_lines_name_the_file_and_line(tmp_path, content, message):
    (tmp_path / "bad.jsonl").write_text(content)
    with pytest.raises(ValueError, match=message):
        load_prompt_file_records(tmp_path / "bad.jsonl")


def test_bad_json_lists_name_the_item_and_undecodable_files_say_so(tmp_path):
    (tmp_path / "l.json").write_text(json.dumps([{"turns": ["ok"]}, {"turns": ["ok"]}, {"turns": None}]))
    with pytest.raises(ValueError, match=r"l.json item 2: 'turns' must be a non-empty list"):
        load_prompt_file_records(tmp_path / "l.json")
    (tmp_path / "t.json").write_text('[{"turns": ["ok"]},\n  oops]')
    with pytest.raises(ValueError, match=r"t.json: not valid JSON .* at line 2"):
        load_prompt_file_records(tmp_path / "t.json")
    (tmp_path / "b.jsonl").write_bytes(b'{"prompt": "\xff"}\n')
    with pytest.raises(ValueError, match=r"b.jsonl: not UTF-8 text"):
        load_prompt_file_records(tmp_path / "b.jsonl")


# --------------------------------------------------------------------------------- the shipped splits
def _tokenizer():
    from tokenizers import Tokenizer

    from learn2draft.names import DEFAULT_DRAFT_DIR

    return Tokenizer.from_file(str(DEFAULT_DRAFT_DIR / "tokenizer.json"))  # the target's vocabulary (SmolLM2)


def test_prompt_sets_name_their_splits_and_refuse_unknown_ones():
    assert set(PROMPT_SETS) == {"open", "copy", "mixed", "multilingual", "corpus"}
    assert prompt_set_splits("mixed") == ("mixed_train", "mixed_heldout")
    with pytest.raises(ValueError, match="multilingual"):
        prompt_set_splits("nope")
    assert {p.category for p in load_prompt_records("copy_heldout")} == {"copy"} <= set(COPY_CATEGORIES)
    assert {p.category for p in load_prompt_records("heldout")} == {DEFAULT_CATEGORY}
    assert load_prompts("mixed_heldout") == [p.text for p in load_prompt_records("mixed_heldout")]


def test_mixed_splits_cover_every_category_disjointly_with_text_to_copy():
    train, held = load_prompt_records("mixed_train"), load_prompt_records("mixed_heldout")
    for split in (train, held):
        counts = prompt_distribution(split)["categories"]
        assert set(counts) == MIXED_CATEGORIES and all(2 <= n <= 3 for n in counts.values()), counts
        assert {p.language for p in split} == {"en"}
        assert [p.category for p in split[: len(MIXED_CATEGORIES)]] == list(counts)  # first N cover N categories
        for p in split:
            if p.category in COPY_CATEGORIES:  # copy-heavy: the text to copy from is in the prompt
                assert len(p.text) > 120 and "\n\n" in p.text, p.id
    old = set(load_prompts("train")) | set(load_prompts("heldout")) | set(load_prompts("copy_train")) | \
        set(load_prompts("copy_heldout"))
    texts = [p.text for p in train + held]
    assert len(set(texts)) == len(texts) and not set(texts) & old
    assert len({p.id for p in train + held}) == len(texts)


def test_multilingual_splits_hold_every_task_in_every_language_with_comparable_lengths():
    """Every (language, task) in both splits, the same request translated (one question_id stem per request,
    in all four languages), splits disjoint; token lengths comparable: each translation's length relative to
    English, divided by that language's median relative length (the tokenizer's fertility: Spanish and
    Italian take ~1.7×, Chinese ~2.4× the English tokens with SmolLM2's vocabulary), lies within [2/3, 3/2],
    and every prompt fits in 160 tokens."""
    tok = _tokenizer()
    train, held = load_prompt_records("multilingual_train"), load_prompt_records("multilingual_heldout")
    assert not {p.text for p in train} & {p.text for p in held}
    for split in (train, held):
        assert {(p.language, p.category) for p in split} == {(lang, t) for lang in LANGUAGES for t in TASKS}
        assert len(split) <= 2 * len(LANGUAGES) * len(TASKS)
        by_item: dict[str, dict[str, int]] = {}
        for p in split:
            stem, lang = p.id.split("/")
            assert lang == p.language and p.category in stem
            by_item.setdefault(stem, {})[lang] = len(tok.encode(p.text).ids)
        assert all(set(v) == LANGUAGES for v in by_item.values())
        assert max(n for v in by_item.values() for n in v.values()) <= 160
        for lang in LANGUAGES - {"en"}:
            rel = [v[lang] / v["en"] for v in by_item.values()]
            med = statistics.median(rel)
            assert all(2 / 3 <= r / med <= 3 / 2 for r in rel), (lang, rel)


def test_the_description_documents_the_sets():
    from learn2draft.prompts import MIXED_PROMPTS_FILE

    desc = json.loads(MIXED_PROMPTS_FILE.read_text(encoding="utf-8"))["description"]
    for word in ("MT-bench", "disjoint", "context_qa", "Chinese", "first turn"):
        assert word in desc


# --------------------------------------------------------------------------------- per-category reports
def _records():
    from eval.runner import RunRecord

    # prompts 0, 1: code (en, zh); prompt 2: chat (en). Method "a" takes 1 s for 10 tokens on code, 2 s on chat;
    # the reference "ref" always 2 s.
    out = []
    for rep in range(2):
        for pi in range(3):
            wall = 1.0 if pi < 2 else 2.0
            out.append(RunRecord("a", pi, rep, 10, wall, 0.1 * (pi + 1), 0.01, tau=float(pi), accepted_lengths=[pi, pi]))
            out.append(RunRecord("ref", pi, rep, 10, 2.0, 0.2, 0.02))
    return out


def test_groupings_and_per_group_summaries_on_hand_made_records():
    from eval.runner import groups_table, prompt_groupings, summarize_groups

    prompts = [Prompt("x", "code", "en"), Prompt("y", "code", "zh"), Prompt("z", "chat", "en")]
    groups = prompt_groupings(prompts)
    assert groups == {"category": {"code": [0, 1], "chat": [2]}, "language": {"en": [0, 2], "zh": [1]}}
    assert prompt_groupings([Prompt("x", "code"), Prompt("y", "code")]) == {}  # one value: the whole mix says it
    by = summarize_groups(_records(), groups["category"], reference="ref")
    assert by["code"]["a"]["tokens_per_second_mean"] == pytest.approx(10.0)
    assert by["chat"]["a"]["tokens_per_second_mean"] == pytest.approx(5.0)
    assert by["code"]["a"]["ratio_to_ref"]["mean"] == pytest.approx(2.0)
    assert by["chat"]["a"]["ratio_to_ref"]["mean"] == pytest.approx(1.0)
    assert by["code"]["a"]["accepted_length_histogram"] == [4, 4]  # prompts 0 and 1, two cycles each, two repeats
    assert by["chat"]["a"]["accepted_length_histogram"] == [0, 0, 4]
    assert by["code"]["a"]["ttft_seconds_percentiles"]["p50"] == pytest.approx(0.15)
    assert summarize_groups(_records(), {"none": [7]}) == {}
    lines = groups_table(by, "ref")
    assert lines[0].startswith("| category | method |") and len(lines) == 2 + 4
    assert lines[2] == ("| code | a | 10.0 ± 0.0 | 2.00 (2.00–2.00) | 0.50 | – | 150/200/200 | 10.0/10.0/10.0 | "
                        "1.00/1.00/1.00 | 0: 4, 1: 4 |")


def test_a_comparison_with_groups_reports_them_in_json_and_markdown(tiny_pair):
    from eval.compare import compare, format_markdown
    from learn2draft.decoding import FixedDepthController
    from learn2draft.sampling import SamplingConfig

    ids = [tiny_pair.encode_prompt(t, chat=False) for t in ("w1 w2 w3", "w4 w5", "w2 w3")]
    groups = {"category": {"code": [0, 1], "chat": [2]}}
    res = compare(tiny_pair, FixedDepthController(2), ids[:1], ids, SamplingConfig(), 4, gammas=(1,), repeats=1,
                  groups=groups)
    assert set(res["groups"]["category"]) == {"code", "chat"}
    assert res["groups"]["category"]["chat"]["learned policy"]["runs"] == 1
    md = format_markdown(res)
    assert "Per category" in md and "| chat | learned policy |" in md


# --------------------------------------------------------------------------------- header
def test_header_records_models_libraries_hardware_load_and_prompts(tmp_path):
    from eval.header import finish_header, header_lines, model_revision, run_header

    model = tmp_path / "m"
    model.mkdir()
    (model / "config.json").write_text("{}")
    (model / "model.safetensors").write_bytes(b"weights")
    inner = hashlib.sha256(hashlib.sha256(b"weights").hexdigest().encode()).hexdigest()[:16]
    assert model_revision(str(model)) == f"sha256 {inner} of model.safetensors"
    assert model_revision("org/some-model") == "hub id, revision unknown"

    class Loaded:
        class config:
            _commit_hash = "abc123"

    assert model_revision("org/some-model", Loaded()) == "commit abc123"
    prompts = [Prompt("a", "code", "en"), Prompt("b", "code", "zh"), Prompt("c", "chat", "en")]
    h = run_header(str(model), None, None, "float32", {"temperature": 0.0}, "cpu", prompts, "mine.jsonl")
    assert h["models"] == {"target": {"name": str(model), "revision": f"sha256 {inner} of model.safetensors"}}
    assert {"torch", "transformers", "learn2draft"} <= set(h["libraries"]) and h["libraries"]["torch"]
    assert h["precision"] == "float32" and h["threads"] >= 1
    assert {"cpu", "cores", "amx", "avx512_bf16"} <= set(h["hardware"])
    assert h["prompts"] == {"source": "mine.jsonl", "total": 3, "categories": {"code": 2, "chat": 1},
                            "languages": {"en": 2, "zh": 1}}
    assert h["load_average"]["after"] is None and len(h["load_average"]["before"]) == 3
    finish_header(h)
    assert len(h["load_average"]["after"]) == 3
    text = "\n".join(header_lines(h))
    for part in ("Models: target", "Libraries: python", "Precision: float32", "greedy", "AMX:", "Threads:",
                 "Load average (1/5/15 min): before", "categories code 2, chat 1; languages en 2, zh 1"):
        assert part in text, part


def test_header_records_the_bf16_timing_auto_decides_by_on_a_cpu_without_amx(monkeypatch):
    """Without AMX ``--dtype auto`` is a measurement; the header keeps it (over the run's widths, and at its worst
    width) so a reader sees why the run is in its precision. With AMX nothing is measured."""
    import learn2draft.models as M
    from eval.header import finish_header, hardware, header_lines, run_header

    seen = []
    monkeypatch.setattr(M, "cpu_bf16_units", lambda: {"amx": False, "avx512_bf16": True})
    monkeypatch.setattr(M, "bf16_forward_timing",
                        lambda rows=(1, 9), threads=None, trial=0: seen.append(rows) or {"speedup": 1.01, "min_speedup": 0.82})
    hw = hardware("cpu", forward_rows=(1, 17))
    assert seen == [(1, 17)] and hw["bf16_forward_rows"] == [1, 17]
    seen.clear()
    assert (hw["bf16_forward_speedup"], hw["bf16_forward_min_speedup"]) == (1.01, 0.82)
    h = finish_header(run_header("org/some-model", None, None, "float32", {"temperature": 0.0}, "cpu",
                                 [Prompt("a", "code", "en")], "mine.jsonl", forward_rows=(1, 17)))
    line = "\n".join(header_lines(h))
    assert "a bf16 forward measured 1.01× fp32's speed over [1, 17] tokens, 0.82× at its worst width" in line
    monkeypatch.setattr(M, "cpu_bf16_units", lambda: {"amx": True, "avx512_bf16": True})
    assert "bf16_forward_speedup" not in hardware("cpu", forward_rows=(1, 17)) and seen == [(1, 17)]


# --------------------------------------------------------------------------------- verdicts
def _summary(tps: dict[str, list[float]]) -> dict:
    return {name: {"tokens_per_second_mean": sum(v) / len(v), "tokens_per_second_per_repeat": v}
            for name, v in tps.items()}


def test_verdicts_pass_fail_and_not_measured():
    """Issue 38's claims: the best fixed arm in hindsight is the fastest of every fixed arm measured (HF prompt
    lookup among them), the best hand rule the fastest rule, the chosen arm is judged per category; a claim whose
    methods did not run is 'not measured', never PASS."""
    from eval.verdicts import DEFAULT_CLAIMS, FAIL, NOT_MEASURED, PASS, Claim, evaluate_claims, verdict_lines

    hindsight, rule = DEFAULT_CLAIMS[0].label, DEFAULT_CLAIMS[1].label
    chosen, every_ar, copy = DEFAULT_CLAIMS[2].label, DEFAULT_CLAIMS[3].label, DEFAULT_CLAIMS[4].label
    roles = {"learned": "L", "generate": "G", "autoregressive": "AR", "best_fixed": ["F1", "F2", "PL"],
             "chosen_fixed": "F1", "best_rule": ["R1", "R2"], "prompt_lookup": "PL"}
    whole = _summary({"L": [20.0, 20.0], "G": [10.0, 10.0], "AR": [11.0, 11.0], "F1": [16.0, 16.0],
                      "F2": [17.0, 17.0], "PL": [19.0, 19.0], "R1": [18.0, 18.0], "R2": [15.0, 15.0]})
    cats = {"code": _summary({"L": [20.0], "AR": [10.0], "F1": [19.0]}),
            "chat": _summary({"L": [9.0], "AR": [10.0], "F1": [9.5]})}
    runs = {"0.0": {"methods": whole, "categories": cats, "copy": None},
            "0.7": {"methods": _summary({"L": [12.0], "G": [10.0], "AR": [10.0]}), "categories": None, "copy": None}}
    got = {(v["claim"], v["temperature"]): v for v in evaluate_claims(runs, roles)}
    best = got[(hindsight, "0.0")]
    assert best["verdict"] == FAIL and best["against"] == "PL" and best["measured"] == pytest.approx(20 / 19)
    assert got[(hindsight, "0.7")]["verdict"] == NOT_MEASURED  # no fixed row
    r = got[(rule, "0.0")]
    assert r["verdict"] == PASS and r["against"] == "R1" and r["measured"] == pytest.approx(20 / 18)
    c = got[(chosen, "0.0")]
    assert c["verdict"] == FAIL and c["measured"] == pytest.approx(9 / 9.5) and c["against"] == "F1, on chat"
    every = got[(every_ar, "0.0")]
    assert every["verdict"] == FAIL and every["measured"] == pytest.approx(0.9)  # the smallest: chat
    assert every["against"] == "AR, on chat"
    assert got[(every_ar, "0.7")]["verdict"] == PASS  # whole mix: 1.2
    assert got[(copy, "0.0")]["verdict"] == NOT_MEASURED and got[(copy, "0.0")]["measured"] is None
    runs["0.0"]["copy"] = _summary({"L": [30.0], "G": [10.0], "PL": [28.0]})
    got = {(v["claim"], v["temperature"]): v for v in evaluate_claims(runs, roles)}
    assert got[(copy, "0.0")]["verdict"] == FAIL and got[(copy, "0.7")]["verdict"] == NOT_MEASURED
    zero_only = Claim("at T=0", "learned", "generate", 1.6, temperatures="zero")
    only_positive = evaluate_claims({"0.7": runs["0.7"]}, roles, [zero_only])
    assert only_positive == [{"claim": "at T=0", "temperature": None, "threshold": 1.6,
                              "measured": None, "verdict": NOT_MEASURED, "against": ""}]
    cats["math"] = _summary({"AR": [10.0]})  # a category where the learned policy did not run
    assert evaluate_claims(runs, roles, DEFAULT_CLAIMS[3:4])[0]["verdict"] == NOT_MEASURED
    del cats["math"]
    lines = verdict_lines(evaluate_claims(runs, roles))
    assert lines[0].split() == ["CLAIM", "threshold", "measured", "verdict"]
    col = lines[0].index("threshold")
    assert all(ln[col: col + 2] == "≥ " for ln in lines[1:])  # aligned columns
    assert any("≥ 1.05×" in ln and "1.111×" in ln and "PASS (vs R1)" in ln for ln in lines)
    assert not any("PASS" in ln and "–" in ln.split("≥")[1] for ln in lines[1:])  # not measured is never PASS
    with pytest.raises(ValueError, match="scope"):
        evaluate_claims(runs, roles, [Claim("x", "learned", "generate", 1.0, scope="some")])


def test_a_verdict_never_shows_a_failing_ratio_rounded_onto_its_threshold():
    from eval.verdicts import FAIL, PASS, verdict_lines

    rows = [{"claim": "x", "temperature": None, "threshold": 0.95, "measured": m, "verdict": v, "against": ""}
            for m, v in ((0.9495, FAIL), (0.95, PASS), (0.9581, PASS))]
    shown = [ln.split()[3] for ln in verdict_lines(rows)[1:]]  # claim, ≥, threshold, measured
    assert shown == ["0.9495×", "0.950×", "0.958×"]
