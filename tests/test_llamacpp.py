"""The llama.cpp engine (issue 40): the learned lookup policy as llama-cpp-python's draft model.

These tests run llama.cpp itself (llama-cpp-python, built by ``make llamacpp``, which ``make test`` runs first): a
missing engine is an error here, not a skip. What they prove:

* the adapter's accepted length τ, inferred from the history, is what the target kept (scripted histories);
* asking the policy about a run of depths in one batched call decides exactly as asking before every token;
* greedy output through llama.cpp with the learned policy (and with llama.cpp's own prompt lookup) equals plain
  llama.cpp's, token for token, on an F32 GGUF written from the embedded weights; on the Q4_1 file itself the
  quantised kernels compute a batch of n tokens with other arithmetic than one token, so there the outputs may part
  (measured and reported by the benchmark, not asserted);
* the output law at T = 0.7 through the engine (chi-square per position, Bonferroni, fixed seeds), with a control
  that the same check rejects a different law;
* the profile, the benchmark and the generate command run end to end, and refuse bad input before loading.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import llama_cpp  # a missing engine fails this file (never a skip): make test builds it first (make llamacpp)
import numpy as np
import pytest

from policies.llamacpp import (
    PolicyDraftModel,
    generate_tokens,
    load_llama,
    prompt_ids,
    write_dequantized_gguf,
)

ROOT = Path(__file__).resolve().parent.parent
POLICY = ROOT / "policies" / "defaults" / "lookup-llamacpp"

REPEATED = ("Copy this list exactly, then copy it again: alpha 1, beta 2, gamma 3, delta 4, epsilon 5, zeta 6, "
            "eta 7, theta 8. alpha 1, beta 2, gamma 3, delta 4,")


@pytest.fixture(scope="module")
def f32_gguf(tmp_path_factory) -> Path:
    return write_dequantized_gguf(None, tmp_path_factory.mktemp("gguf") / "smollm2-f32.gguf", "f32")


@pytest.fixture(scope="module")
def q4_llm():
    return load_llama(threads=1, n_ctx=2048)


class ScriptedPolicy:
    """A controller that continues up to a fixed depth (its decisions do not depend on the features)."""

    def __init__(self, depth: int, max_depth: int = 8):
        self.depth, self.max_depth, self.asked = depth, max_depth, 0

    def decide(self, state) -> bool:
        self.asked += 1
        return state.depth < self.depth


def test_accepted_length_is_inferred_from_the_history():
    """τ of each cycle = the drafted tokens the next history kept (before the correction or bonus token)."""
    d = PolicyDraftModel(ScriptedPolicy(3), min_ngram=1)
    hist = [5, 6, 7, 8, 5, 6, 7, 8, 5, 6]
    d.start(len(hist) - 1, 64)
    p1 = d(np.asarray(hist, dtype=np.intc)).tolist()
    assert p1 == [7, 8, 5]  # the lookup's chain, cut at depth 3
    hist2 = hist + p1[:2] + [99]  # two accepted, then a correction
    p2 = d(np.asarray(hist2, dtype=np.intc)).tolist()
    assert d.cycles[0].accepted == 2 and d.cycles[0].depth == 3
    hist3 = hist2 + p2 + [42]  # all accepted, then the bonus token
    d(np.asarray(hist3, dtype=np.intc))
    assert d.cycles[1].accepted == len(p2)
    d.finish(hist3 + [1])  # a last step that drafted nothing kept nothing
    assert [c.accepted for c in d.cycles] == [2, len(p2), 0]


def test_a_history_that_does_not_extend_the_last_starts_a_new_generation():
    d = PolicyDraftModel(num_pred_tokens=2, min_ngram=1)
    d(np.asarray([1, 2, 1, 2, 1], dtype=np.intc))
    d(np.asarray([9, 9, 9, 9], dtype=np.intc))  # another prompt, no start(): a new generation
    assert d._gen.prompt_len == 3 and d._gen.accepted_history == []


def test_batched_decisions_equal_asking_before_every_token():
    """The adapter asks the exported policy about chunks of depths in one call; a wrapper that hides the ONNX
    controller forces one question per token: the proposals must be identical along real histories."""
    from learn2draft.models import DEFAULT_TARGET, encode_text, load_tokenizer
    from learn2draft.prompts import load_prompt_records
    from policies.load import load_policy

    class OneByOne:
        def __init__(self, c):
            self.c, self.max_depth = c, c.max_depth

        def decide(self, state):
            return bool(self.c.decide(state))

    tok = load_tokenizer(DEFAULT_TARGET)
    calls, depths = 0, []
    for r in load_prompt_records("corpus_validation")[:6]:
        ids = encode_text(tok, r.text)
        half = len(ids) // 2
        a, b = PolicyDraftModel(POLICY), PolicyDraftModel(OneByOne(load_policy(POLICY)), min_ngram=a_min(POLICY))
        for m in (a, b):
            m.start(half - 1, 1 << 16)
        pos = half
        while pos < len(ids) - 1:  # the prompt's own second half plays the target's output
            h = np.asarray(ids[:pos], dtype=np.intc)
            pa, pb = a(h).tolist(), b(h).tolist()
            assert pa == pb, f"prompt {r.text[:30]!r}, position {pos}"
            calls, depths = calls + 1, depths + [len(pa)]
            kept = 0
            while kept < len(pa) and pos + kept < len(ids) and pa[kept] == ids[pos + kept]:
                kept += 1
            pos += kept + 1
    assert calls > 300 and max(depths) >= 4  # the policy drafted long chains too, so the chunks were exercised


def a_min(policy: Path) -> int:
    from policies.load import run_settings

    return int(run_settings(policy)["lookup_min_ngram"])


def test_dequantized_gguf_holds_the_same_numbers(f32_gguf):
    import gguf

    from learn2draft.models import smollm2_gguf_path

    q = {t.name: t for t in gguf.GGUFReader(str(smollm2_gguf_path())).tensors}
    f = {t.name: t for t in gguf.GGUFReader(str(f32_gguf)).tensors}
    assert q.keys() == f.keys()
    name = "blk.0.attn_q.weight"
    ref = gguf.quants.dequantize(q[name].data, q[name].tensor_type)
    assert f[name].tensor_type == gguf.GGMLQuantizationType.F32
    np.testing.assert_array_equal(np.asarray(f[name].data).reshape(ref.shape), ref)


def test_greedy_output_equals_plain_llamacpp_on_f32(f32_gguf):
    """Exactness at T = 0: the learned policy, a fixed γ and llama.cpp's own prompt lookup all give plain llama.cpp's
    tokens on the F32 weights (the drafts vary, the output may not)."""
    from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

    from learn2draft.prompts import load_prompt_records

    plain = llama_cpp.Llama(model_path=str(f32_gguf), n_ctx=4096, n_threads=1, verbose=False)
    spec = load_llama(f32_gguf, threads=1)
    texts = [REPEATED] + [r.text for r in load_prompt_records("corpus_validation") if len(r.text) < 700][:2]
    drafted = 0
    for text in texts:
        ids = prompt_ids(spec, text)
        base = generate_tokens(plain, ids, 40, 0.0).tokens
        for d in (PolicyDraftModel(POLICY), PolicyDraftModel(num_pred_tokens=6, min_ngram=1),
                  LlamaPromptLookupDecoding(num_pred_tokens=10)):
            spec.draft_model = d
            got = generate_tokens(spec, ids, 40, 0.0, draft_model=d if isinstance(d, PolicyDraftModel) else None)
            assert got.tokens == base, f"{d!r} on {text[:30]!r}"
            if isinstance(d, PolicyDraftModel):
                drafted += sum(c.depth for c in got.cycles)
    assert drafted > 20  # the speculative path ran


def test_prompt_ids_match_the_hugging_face_chat_template(q4_llm):
    from learn2draft.models import DEFAULT_TARGET, encode_text, load_tokenizer

    tok = load_tokenizer(DEFAULT_TARGET)
    for text in ("Name three colours.", "¿Dónde está la biblioteca? 图书馆在哪里？"):
        assert prompt_ids(q4_llm, text) == encode_text(tok, text)


def test_law_through_the_engine_at_temperature_0_7():
    """Plain llama.cpp against llama.cpp + a fixed γ = 4 of prompt lookup, first 6 tokens × 100 draws on a copy-heavy
    prompt (the draft is up to 4 tokens from the first call on, so drafted tokens are accepted and refused),
    seeds fixed: no position's chi-square test rejects at Bonferroni α = 0.01. The control: the same check, on the
    same sample size, rejects plain T = 0.7 against plain T = 1.3 (a test that cannot fail would prove nothing)."""
    from eval.law import two_sample_test
    from eval.llamacpp import law_check_llamacpp

    llm = load_llama(threads=1, n_ctx=256)
    ids = prompt_ids(llm, REPEATED)
    res = law_check_llamacpp(lambda: PolicyDraftModel(num_pred_tokens=4, min_ngram=1), [ids], temperature=0.7,
                             num_tokens=6, num_samples=100, seed=0, threads=1)
    assert res["drafted"] > 200 and res["accepted"] > 20, {k: v for k, v in res.items() if k != "tests"}
    assert res["pass"], res["tests"]
    draws = {}
    for T in (0.7, 1.3):
        draws[T] = [(generate_tokens(llm, ids, 6, T, seed=1000 + s, reuse_prompt_cache=True).tokens + [-1] * 6)[:6]
                    for s in range(100)]
    control = [two_sample_test([d[k] for d in draws[0.7]], [d[k] for d in draws[1.3]])["p_value"] for k in range(6)]
    assert min(control) < 0.01 / 6, control


def test_profile_measures_llamacpp_costs(tmp_path):
    from eval.llamacpp_profile import measure_llamacpp_profile
    from learn2draft.replay.latency import LatencyProfile

    data = measure_llamacpp_profile(None, threads=1, contexts=(32, 96), tokens=(1, 2, 4), repeats=1, name="t")
    prof = LatencyProfile.from_dict(data)
    assert prof.meta["engine"] == "llama.cpp" and prof.verify_tokens == [1, 2, 4]
    assert all(s > 0 for row in prof.verify_seconds for s in row)
    assert len(prof.verify_seconds) == 2 and all(len(row) == 3 for row in prof.verify_seconds)  # 2 contexts × 3 sizes
    assert prof.cost("lookup").step_seconds[0] > 0


def _cli(*args: str, stdin: str | None = None, timeout: int = 600) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", *args], cwd=ROOT, capture_output=True, text=True, input=stdin,
                          timeout=timeout, env={**__import__("os").environ, "WANDB_MODE": "disabled"})


def test_generate_cli_streams_through_llamacpp():
    r = _cli("policies.generate", "--engine", "llama.cpp", REPEATED, "--max-new-tokens", "24", "--temperature", "0",
             "--metrics", "--show-cycles", "--threads", "1")
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip()
    metrics = json.loads(r.stderr.strip().splitlines()[-1])
    assert metrics["engine"] == "llama.cpp" and metrics["new_tokens"] == 24
    assert "lookup-llamacpp" in metrics["controller"]
    assert any(line.startswith("cycle 1: depth") for line in r.stderr.splitlines())


@pytest.mark.parametrize("argv, message", [
    (["--engine", "llama.cpp", "--gguf", "/no/such.gguf", "hi"], "--gguf /no/such.gguf: no such file"),
    (["--engine", "llama.cpp", "--drafter", "model", "hi"], "drafts by prompt lookup"),
    (["--engine", "llama.cpp", "--gguf", "/tmp", "hi"], "--gguf /tmp: a directory"),
    (["--engine", "llama.cpp", "--top-k", "5", "hi"], "plain law"),
    (["--gguf", "x.gguf", "hi"], "--gguf applies to --engine llama.cpp"),
])
def test_generate_refuses_bad_engine_flags(argv, message):
    r = _cli("policies.generate", *argv, timeout=120)
    assert r.returncode == 2 and message in r.stderr, r.stderr


def test_generate_refuses_a_policy_of_another_drafter():
    r = _cli("policies.generate", "--engine", "llama.cpp", "--policy", "policies/defaults/head", "hi", timeout=120)
    assert r.returncode == 2 and "llama.cpp's adapter drafts by prompt lookup" in r.stderr, r.stderr


def test_benchmark_cli_end_to_end(tmp_path):
    out = tmp_path / "bench"
    r = _cli("eval.benchmark", "--engine", "llama.cpp", "--prompt-set", "corpus", "--num-prompts", "2",
             "--validation-prompts", "1", "--gammas", "2,6", "--temperatures", "0", "--repeats", "1",
             "--max-new-tokens", "12", "--threads", "1", "--no-hf-reference", "--out", str(out))
    assert r.returncode == 0, r.stderr[-2000:]
    report = json.loads((out / "benchmark.json").read_text())
    run = report["runs"]["0.0"]
    assert set(run["methods"]) == {"llama.cpp plain", "llama.cpp prompt lookup (2)", "llama.cpp prompt lookup (6)",
                                   "llama.cpp + learned policy"}
    assert run["validation"]["chosen"] in run["methods"] and run["greedy_equal_to_plain"]["llama.cpp + learned policy"]["of"] == 2
    assert {v["claim"] for v in report["verdicts"]} and (out / "benchmark.png").is_file()
    assert "Verdicts" in (out / "benchmark.md").read_text()


@pytest.mark.parametrize("argv, message", [
    (["--engine", "llama.cpp", "--gguf", "/no/such.gguf"], "--gguf /no/such.gguf: no such file"),
    (["--engine", "llama.cpp", "--drafter", "model"], "measures prompt lookup only"),
    (["--engine", "llama.cpp", "--policy", "/no/such/dir"], "--policy /no/such/dir: no such directory"),
])
def test_benchmark_refuses_bad_engine_flags(argv, message, tmp_path):
    r = _cli("eval.benchmark", *argv, "--out", str(tmp_path / "b"), timeout=120)
    assert r.returncode == 2 and message in r.stderr, r.stderr
    assert not (tmp_path / "b").exists()  # refused before anything was written


def test_profile_cli_refuses_hf_only_flags(tmp_path):
    r = _cli("eval.profile", "--engine", "llama.cpp", "--batch-sizes", "1,2", "--out", str(tmp_path / "p.json"),
             timeout=120)
    assert r.returncode == 2 and "--engine llama.cpp measures a GGUF model" in r.stderr, r.stderr


def test_check_build_reports_a_working_engine():
    r = _cli("policies.llamacpp", "--check", timeout=300)
    assert r.returncode == 0 and "decodes on this CPU" in r.stdout, r.stderr
