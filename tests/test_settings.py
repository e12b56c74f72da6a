"""learn2draft.settings.RunSettings: a command's settings, resolved once from explicit values (issue 41, item 5)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import learn2draft.models as models
from learn2draft.names import DEFAULT_DRAFT, DEFAULT_MAX_DEPTH, DEFAULT_TARGET
from learn2draft.settings import RunSettings, forward_widths, run_threads


@pytest.fixture
def timed(monkeypatch):
    """``auto``'s measurement replaced: bf16 wins at one sequence, loses from 4 rows on; the calls are recorded."""
    calls = []

    def fastest(device, threads=None, rows=(1, 9)):
        calls.append((str(device), threads, tuple(rows)))
        return "bfloat16" if rows[0] < 4 else "float32"

    monkeypatch.setattr(models, "fastest_dtype", fastest)
    return calls


def test_auto_is_measured_once_on_the_device_threads_and_widths_given(timed):
    s = RunSettings.resolve(device="cpu", dtype="auto", threads=1, depths=(4, None, "1-12"))
    assert s.dtype == "bfloat16" and s.device == "cpu" and s.threads == 1
    assert s.forward_rows == models.forward_rows(1, 12) and timed == [("cpu", 1, (1, 13))]
    # eval.serve passes its largest batch (--max-batch, else its largest concurrency): auto is timed at it
    s = RunSettings.resolve(device="cpu", threads=1, batch=16, depths=(6,))
    assert s.dtype == "float32" and s.forward_rows == (16, 16 * 7) and timed[-1] == ("cpu", 1, (16, 112))


def test_a_named_precision_is_canonical_and_measures_nothing(timed):
    for alias, name in (("bf16", "bfloat16"), ("fp32", "float32"), ("float16", "float16")):
        assert RunSettings.resolve(device="cpu", dtype=alias).dtype == name
    assert timed == []


def test_without_threads_the_current_setting_is_the_runs(timed):
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        s = RunSettings.resolve(device="cpu")
    finally:
        torch.set_num_threads(before)
    assert s.threads == 2 and timed == [("cpu", 2, (1, DEFAULT_MAX_DEPTH + 1))]


def test_the_defaults_are_the_embedded_pair_at_the_default_widths():
    s = RunSettings.resolve(device="cpu", dtype="float32", threads=1)
    assert (s.target, s.draft, s.drafter, s.lookup_min_ngram) == (DEFAULT_TARGET, DEFAULT_DRAFT, None, None)
    assert s.forward_rows == forward_widths() == (1, DEFAULT_MAX_DEPTH + 1)
    s = RunSettings.resolve(device="cpu", dtype="float32", threads=1, target="t", draft="d", drafter="lookup",
                            lookup_min_ngram=1)
    assert (s.target, s.draft, s.drafter, s.lookup_min_ngram) == ("t", "d", "lookup", 1)


def test_the_settings_are_frozen():
    s = RunSettings.resolve(device="cpu", dtype="float32", threads=1)
    with pytest.raises(dataclasses.FrozenInstanceError):
        s.dtype = "bfloat16"
    assert dataclasses.replace(s, device="cpu") == s  # a changed copy is a new object (eval.record's workers)


@pytest.mark.parametrize("kw, flag", [({"dtype": "fp8"}, "--dtype 'fp8'"), ({"threads": 0}, "--threads must be ≥ 1"),
                                      ({"threads": 10**6}, "--threads 1000000")])
def test_a_bad_value_is_named_by_its_flag(kw, flag):
    with pytest.raises(ValueError) as e:
        RunSettings.resolve(device="cpu", **{"dtype": "float32", **kw})
    assert str(e.value).startswith(flag)


def test_a_bad_device_is_refused():
    from learn2draft import ModelLoadError

    with pytest.raises(ModelLoadError, match="bogus"):
        RunSettings.resolve(device="bogus", dtype="float32", threads=1)


def test_run_threads_takes_the_flag_else_the_policys_else_one():
    assert run_threads(None) == 1 and run_threads(None, 4) == 4 and run_threads(2, 4) == 2


def test_commands_no_longer_write_into_their_parsed_flags():
    """No command writes a resolved value back into its argparse Namespace: they resolve a RunSettings (or a local)."""
    import re
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    found = [f"{p.relative_to(root)}:{i}" for pkg in ("learn2draft", "eval", "train", "policies", "envs")
             for p in sorted((root / pkg).rglob("*.py"))
             for i, line in enumerate(p.read_text(encoding="utf-8").splitlines(), 1)
             if re.search(r"\bargs\.\w+(\s*,\s*args\.\w+)*\s*=[^=]|setattr\(args\b", line)]
    assert found == []
