"""``python -m policies.generate``: streaming text (UTF-8 safe, stop strings), the per-cycle view,
the metrics line, and clear errors for bad input."""

from __future__ import annotations

import io
import json

import pytest
import torch

import policies.generate as gen
from learn2draft.decoding import FixedDepthController, SpeculativeDecoder
from learn2draft.drafters import make_drafter
from learn2draft.models import DEFAULT_TARGET, load_tokenizer
from policies.layout import default_policy_dir
from policies.load import load_policy

MIXED = "Café 🙂 naïve 日本語 done. STOP here, more text"


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer(DEFAULT_TARGET)


def _stream_one_by_one(tok, ids, stop=()):
    s = gen.TextStream(tok, stop=list(stop))
    chunks = [s.put([i]) for i in ids]
    chunks.append(s.end())
    return s, chunks


def test_stream_prints_split_characters_once_whole(tok):
    ids = tok(MIXED, add_special_tokens=False).input_ids
    assert any("\ufffd" in tok.decode([i]) for i in ids), "the test needs a character split across tokens"
    s, chunks = _stream_one_by_one(tok, ids)
    assert "".join(chunks) == tok.decode(ids)
    assert not any("\ufffd" in c for c in chunks)
    assert "日" in "".join(chunks)


@pytest.mark.parametrize("stop", ["STOP", "語 do", "e, m", "日本"])
def test_stream_stops_before_the_stop_string_even_across_tokens(tok, stop):
    ids = tok(MIXED, add_special_tokens=False).input_ids
    s, chunks = _stream_one_by_one(tok, ids, stop=[stop, "never-there"])
    out = "".join(chunks)
    assert s.stopped
    assert out == MIXED[: MIXED.index(stop)]


def test_stream_holds_a_possible_stop_prefix_then_releases_it(tok):
    s = gen.TextStream(tok, stop=["STOPX"])
    ids = tok("go STOP", add_special_tokens=False).input_ids
    printed = "".join(s.put([i]) for i in ids)
    assert not printed.endswith("STOP")  # could still become STOPX
    assert printed + s.end() == "go STOP" and not s.stopped


def _run_cli(monkeypatch, capsys, argv, stdin_text=None, pair=None):
    if stdin_text is not None:
        monkeypatch.setattr("sys.stdin", io.StringIO(stdin_text))
    if pair is not None:
        monkeypatch.setattr("learn2draft.models.load_pair", lambda *a, **k: pair)
    rc = gen.main(argv)
    out = capsys.readouterr()
    return rc, out.out, out.err


def test_cli_streams_the_same_tokens_as_the_decoder(default_pair, monkeypatch, capsys):
    """Real pair, shipped lookup policy: the printed text is the decoded generation, the cycle lines
    add up to it, and the metrics line agrees with them."""
    prompt = "Rewrite as a JSON list: apples, pears, plums."
    argv = ["--max-new-tokens", "24", "--show-cycles", "--metrics", "--dtype", "float32"]  # the fp32 pair: its policy
    rc, out, err = _run_cli(monkeypatch, capsys, argv, stdin_text=prompt, pair=default_pair)
    assert rc == 0, err
    from policies.load import policy_lookup_min_ngram

    pol = load_policy(default_policy_dir("lookup"))
    dec = SpeculativeDecoder(default_pair, max_new_tokens=24, max_depth=pol.max_depth,  # the policy's n-gram setting
                             drafter=make_drafter("lookup", default_pair,
                                                  min_ngram=policy_lookup_min_ngram(default_policy_dir("lookup"))))
    res = dec.generate(default_pair.encode_prompt(prompt, max_new_tokens=24), pol)
    assert out == default_pair.tokenizer.decode(res.tokens, skip_special_tokens=True) + "\n"
    lines = err.strip().splitlines()
    metrics = json.loads(lines[-1])
    assert lines[0].startswith("prefill: target=")  # the first token, drawn from the prefill
    cycle_lines = [ln for ln in lines if ln.startswith("cycle ")]
    assert len(cycle_lines) == metrics["cycles"] == len(res.cycles)
    assert metrics["new_tokens"] == len(res.tokens)
    assert metrics["drafted_tokens"] == sum(c.depth for c in res.cycles)
    assert metrics["stop_reason"] in {"eos", "max_new_tokens"}
    for ln, c in zip(cycle_lines, res.cycles):
        assert f"depth {c.depth}, accepted {c.num_accepted}" in ln
        kind = "target=" if c.depth == 0 else ("bonus=" if c.num_accepted == c.depth else "corrected=")
        assert kind in ln


def test_cli_fixed_gamma_on_local_models_with_a_stop_string(tiny_model_dirs, monkeypatch, capsys):
    target, draft = tiny_model_dirs
    base = ["w1 w2 w3", "--target", target, "--draft", draft, "--drafter", "model", "--no-chat",
            "--max-new-tokens", "12", "--num-draft-tokens", "2"]
    rc, full, err = _run_cli(monkeypatch, capsys, base + ["--metrics"])
    assert rc == 0, err
    words = full.split()
    assert len(words) >= 3, full
    stop = " " + words[2]
    rc, cut, err = _run_cli(monkeypatch, capsys, base + ["--stop", stop, "--metrics"])
    assert rc == 0, err
    assert cut == full[: full.index(stop)] + "\n"
    assert json.loads(err.strip().splitlines()[-1])["stop_reason"] == "stop_string"


@pytest.mark.parametrize("argv, stdin_text, match", [
    ([], "   \n", "Empty prompt"),
    (["hi", "--policy", "/nonexistent/policy"], None, "no such directory"),
    (["hi", "--policy", "x", "--num-draft-tokens", "2"], None, "not both"),
    (["hi", "--num-draft-tokens", "-1"], None, "≥ 0"),
    (["hi", "--max-new-tokens", "0"], None, "≥ 1"),
    (["hi", "--head", "somewhere"], None, "--drafter head"),
    (["hi", "--drafter", "model", "--policy", str(default_policy_dir("lookup"))], None, "trained with the 'lookup'"),
    (["hi", "--temperature", "-1", "--num-draft-tokens", "1"], None, "temperature"),
    (["hi", "--num-draft-tokens", "1", "--target", "/no/such/model"], None, "/no/such/model"),
    (["Hi \udcff there"], None, "not valid UTF-8"),
    (["hi", "--policy", str(default_policy_dir("lookup") / "policy.onnx")], None, "is a file"),
])
def test_cli_bad_input_is_one_error_line(monkeypatch, capsys, argv, stdin_text, match):
    rc, out, err = _run_cli(monkeypatch, capsys, argv, stdin_text=stdin_text)
    assert rc == 2
    assert err.startswith("error:") and match in err and "Traceback" not in err


def test_cli_with_a_closed_stdin_says_how_to_pass_a_prompt(monkeypatch, capsys):
    monkeypatch.setattr("sys.stdin", None)
    assert gen.main([]) == 2 and "No prompt" in capsys.readouterr().err


def test_cli_with_a_damaged_policy_file_is_one_error_line(tmp_path, monkeypatch, capsys):
    import shutil

    d = tmp_path / "pol"
    shutil.copytree(default_policy_dir("lookup"), d)
    (d / "policy.onnx").write_bytes((d / "policy.onnx").read_bytes()[:5000])
    rc, out, err = _run_cli(monkeypatch, capsys, ["hi", "--policy", str(d)])
    assert rc == 2 and "onnxruntime cannot load it" in err and "Traceback" not in err


def test_cli_without_prompt_on_a_terminal_says_how_to_pass_one(monkeypatch, capsys):
    class Tty(io.StringIO):
        def isatty(self):
            return True

    monkeypatch.setattr("sys.stdin", Tty(""))
    rc = gen.main([])
    assert rc == 2 and "No prompt" in capsys.readouterr().err


def test_describe_cycle_prints_a_character_split_across_cycles_whole(tok):
    from learn2draft.metrics import CycleResult

    ids = tok(" 日本", add_special_tokens=False).input_ids
    assert len(ids) >= 3
    cyc = CycleResult(ids[1:], 0, 0, 0, 0.0, 0.0, 0.0, False)  # the first byte came in an earlier cycle
    line = gen.describe_cycle(tok, cyc, 2, before=ids[:1])
    assert "\ufffd" not in line and "日" in line


def test_describe_cycle_marks_corrected_and_bonus(tok):
    from learn2draft.metrics import CycleResult

    ids = tok(" a b c", add_special_tokens=False).input_ids
    full = CycleResult(ids, 2, 2, 2, 0.0, 0.0, 0.0, False)
    part = CycleResult(ids[:2], 3, 3, 1, 0.0, 0.0, 0.0, False)
    assert "bonus=' c'" in gen.describe_cycle(tok, full, 1)
    assert "accepted=' a'" in gen.describe_cycle(tok, part, 2) and "corrected=' b'" in gen.describe_cycle(tok, part, 2)
    mixed = CycleResult(ids[:2], 3, 3, 1, 0.0, 0.0, 0.0, False, neural_drafted=2)
    assert "depth 3 (lookup 1, neural 2), accepted 1" in gen.describe_cycle(tok, mixed, 3, hybrid=True)
    assert "lookup" not in gen.describe_cycle(tok, mixed, 3)  # a single drafter: no source


def test_on_tokens_can_stop_a_generation_early(tiny_pair):
    dec = SpeculativeDecoder(tiny_pair, max_new_tokens=20, max_depth=2)
    seen = []

    def on_tokens(tokens, cycle):
        seen.extend(tokens)
        return len(seen) >= 3

    res = dec.generate(torch.tensor([5, 6, 7]), FixedDepthController(2), on_tokens=on_tokens)
    assert res.tokens == seen and 3 <= len(seen) <= 5


def test_stream_cut_inside_a_character_prints_whole_characters_and_says_so(tok):
    """--max-new-tokens may end the generation inside a multi-byte character (an emoji ZWJ sequence, Japanese):
    the stream ends with the whole characters only (no U+FFFD) and records that it was cut."""
    text = "ok 👩‍💻 日本語"
    ids = tok(text, add_special_tokens=False).input_ids
    cut = next(n for n in range(len(ids), 0, -1) if tok.decode(ids[:n]).endswith("\ufffd"))
    s, chunks = _stream_one_by_one(tok, ids[:cut])
    out = "".join(chunks)
    assert "\ufffd" not in out and text.startswith(out) and s.cut_character
    s, chunks = _stream_one_by_one(tok, ids)
    assert "".join(chunks) == text and not s.cut_character


def test_a_bad_policy_path_is_refused_before_torch_is_imported():
    """A new user's mistyped --policy used to wait for torch, transformers and the model code (~20 s under load)."""
    import subprocess
    import sys

    code = ("import sys; from policies.generate import main; rc = main(['hi', '--policy', '/nonexistent/policy']); "
            "print(rc, 'torch' in sys.modules)")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.stdout.split() == ["2", "False"], r.stdout + r.stderr
    assert "--policy /nonexistent/policy: no such directory" in r.stderr
