"""Model-pair loading: sources, clear errors for bad input, tokenizer agreement."""

import pytest
import torch

from learn2draft.models import (
    DEFAULT_TARGET,
    ModelLoadError,
    TokenizerMismatchError,
    check_tokenizers,
    load_model,
    load_tokenizer,
    make_pair,
    parse_dtype,
    resolve_model_source,
    smollm2_gguf_path,
)
from tests.conftest import tiny_llama, tiny_tokenizer


def test_default_target_resolves_to_gguf_in_wheel():
    src, gguf = resolve_model_source(DEFAULT_TARGET)
    assert gguf == "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert smollm2_gguf_path().is_file()


@pytest.mark.parametrize("bad", ["", "   ", "./no/such/dir", "/no/such/model.gguf"])
def test_bad_model_names_give_clear_errors(bad):
    with pytest.raises(ModelLoadError) as e:
        resolve_model_source(bad)
    assert "path" in str(e.value).lower() or "empty" in str(e.value).lower()


def test_directory_without_config_is_refused(tmp_path):
    with pytest.raises(ModelLoadError, match="config.json"):
        resolve_model_source(str(tmp_path))


def test_unknown_hub_id_offline_is_a_clear_error(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(ModelLoadError, match="Could not load"):
        load_tokenizer("no-such-org/no-such-model-xyz")


def test_local_directory_round_trip(tmp_path, tiny_tok):
    m = tiny_llama(len(tiny_tok), 3)
    m.save_pretrained(tmp_path)
    tiny_tok.save_pretrained(tmp_path)
    loaded = load_model(str(tmp_path))
    x = torch.tensor([[1, 5, 7]])
    with torch.no_grad():
        assert torch.allclose(loaded(x).logits, m(x).logits, atol=1e-6)
    assert load_tokenizer(str(tmp_path)).get_vocab() == tiny_tok.get_vocab()


def test_tokenizer_mismatch_is_refused_and_names_ids(tiny_tok):
    other = tiny_tokenizer([f"w{i}" for i in range(59)] + ["zz"])
    with pytest.raises(TokenizerMismatchError, match="id 62"):
        check_tokenizers(tiny_tok, other)
    with pytest.raises(TokenizerMismatchError):
        make_pair(tiny_llama(63, 0), tiny_llama(63, 1), tiny_tok, other)


def test_padded_draft_vocabulary_is_accepted(tiny_tok):
    """A draft with extra (padding) embedding rows but the same tokenizer is fine: V is the tokenizer's."""
    pair = make_pair(tiny_llama(63, 0), tiny_llama(80, 1), tiny_tok, tiny_tok)
    assert pair.vocab_size == 63


def test_model_smaller_than_tokenizer_is_refused(tiny_tok):
    with pytest.raises(ValueError, match="output rows"):
        make_pair(tiny_llama(63, 0), tiny_llama(40, 1), tiny_tok, tiny_tok)


def test_prompt_errors(tiny_pair):
    with pytest.raises(ValueError, match="Empty prompt"):
        tiny_pair.encode_prompt("   ")
    with pytest.raises(ValueError, match="context window"):
        tiny_pair.encode_prompt(" ".join(["w1"] * 600))


def test_parse_dtype():
    assert parse_dtype("bf16") is torch.bfloat16
    with pytest.raises(ValueError, match="float32"):
        parse_dtype("int8")


def test_unavailable_device_is_a_clear_error():
    from learn2draft.models import check_device

    with pytest.raises(ModelLoadError, match="device"):
        check_device("gpu")
    if not torch.cuda.is_available():
        with pytest.raises(ModelLoadError, match="--device cpu"):
            check_device("cuda")


def test_local_paths_are_recorded_absolute(tiny_model_dirs, monkeypatch):
    from pathlib import Path

    from learn2draft.models import canonical_model_name, load_pair

    root = Path(tiny_model_dirs[0]).parent
    monkeypatch.chdir(root)
    pair = load_pair("target", "draft")  # as typed in a shell in that directory
    assert pair.target_name == str(root / "target") and pair.draft_name == str(root / "draft")
    assert canonical_model_name("smollm2-135m-instruct") == "smollm2-135m-instruct"
    assert canonical_model_name("org/model") == "org/model"
    # the shipped draft's directory, as a loaded model's name_or_path gives it, is recorded by its alias: a
    # profile or policy measured in one checkout must not carry that checkout's path (seen in the H200 profiles)
    from learn2draft.models import DEFAULT_DRAFT, DEFAULT_DRAFT_DIR

    assert canonical_model_name(str(DEFAULT_DRAFT_DIR)) == DEFAULT_DRAFT
    monkeypatch.chdir(DEFAULT_DRAFT_DIR.parent)
    assert canonical_model_name(DEFAULT_DRAFT_DIR.name) == DEFAULT_DRAFT


def test_a_name_that_is_no_path_fails_fast_when_the_hub_is_unreachable(monkeypatch):
    import socket
    import time

    def unreachable(*a, **k):
        raise OSError(101, "Network is unreachable")

    from huggingface_hub import constants

    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)  # make test sets HF_HUB_OFFLINE=1; read at import
    monkeypatch.setattr(socket, "create_connection", unreachable)
    t0 = time.perf_counter()
    for name in ("tiny_target", "no-such-org/no-such-model-xyz"):  # a relative dir from another directory, a hub id
        with pytest.raises(ModelLoadError, match="neither a local path nor a cached hub model.*unreachable"):
            resolve_model_source(name)
    assert time.perf_counter() - t0 < 2.0


def test_a_context_limit_set_by_the_draft_names_the_draft(tiny_tok):
    from learn2draft.models import make_pair

    V = len(tiny_tok)
    target, short_draft = tiny_llama(V, 0), tiny_llama(V, 1, layers=1)
    short_draft.config.max_position_embeddings = 64
    pair = make_pair(target, short_draft, tiny_tok, tiny_tok, draft_name="small-draft")
    assert pair.max_context == 64 and pair.max_context_by == "draft"
    with pytest.raises(ValueError, match="draft's context window of 64 tokens.*'small-draft'"):
        pair.check_length(60, 10)
    same = make_pair(target, tiny_llama(V, 1, layers=1), tiny_tok, tiny_tok)
    with pytest.raises(ValueError, match="exceeds the context window of 512") as e:
        same.check_length(500, 20)
    assert "draft" not in str(e.value)
    short_draft.config.max_position_embeddings = 0  # a draft stating no window does not lift the target's
    assert make_pair(target, short_draft, tiny_tok, tiny_tok).max_context == 512


def test_nan_logits_name_the_model_that_gave_them(tiny_pair):
    from learn2draft import FixedDepthController, SpeculativeDecoder
    from learn2draft.sampling import SamplingConfig

    with pytest.raises(ValueError, match="The draft returned NaN"):
        SamplingConfig().probs(torch.full((1, 5), float("nan")), torch.tensor([1]), source="draft")
    target = tiny_llama(len(tiny_pair.tokenizer), 0)
    with torch.no_grad():
        target.lm_head.weight.fill_(float("nan"))
    from learn2draft.models import make_pair

    broken = make_pair(target, tiny_pair.draft, tiny_pair.tokenizer, tiny_pair.tokenizer)
    with pytest.raises(ValueError, match="The target returned NaN"):
        SpeculativeDecoder(broken, max_new_tokens=4, max_depth=2).generate(torch.tensor([1, 5, 9]),
                                                                          FixedDepthController(2))


def test_loading_draws_no_progress_bar_into_a_log_file(tiny_model_dirs, capfd):
    """stderr is not a terminal here (as when redirected to a file): no carriage-return frames."""
    capfd.readouterr()
    load_model(tiny_model_dirs[0])
    load_tokenizer(tiny_model_dirs[0])
    assert "\r" not in capfd.readouterr().err
    from transformers.utils import logging as hf_logging

    assert hf_logging.is_progress_bar_enabled()  # restored afterwards


def test_one_prompt_encoder_for_text_and_ids(tiny_pair):
    """ModelPair.encode_prompt is the one place a prompt (text or ids) becomes the loop's tensor."""
    from learn2draft.models import encode_text

    text = tiny_pair.encode_prompt("w1 w2 w3")
    assert text.tolist() == encode_text(tiny_pair.tokenizer, "w1 w2 w3")
    for ids in (text.tolist(), text, text[None]):
        assert torch.equal(tiny_pair.encode_prompt(ids), text)
    for empty in ("  ", []):
        with pytest.raises(ValueError, match="Empty prompt"):
            tiny_pair.encode_prompt(empty)
    with pytest.raises(ValueError, match="context window"):
        tiny_pair.encode_prompt(text, max_new_tokens=600)


def test_stop_continue_eos_and_prompt_encoding_are_defined_once(tiny_pair, monkeypatch):
    """One module of the project binds STOP and CONTINUE at its top level (the others import them), one
    module calls the chat template (the one prompt encoder's), and the draft recipe times with the
    loop's device clock."""
    import ast
    import inspect
    from pathlib import Path

    import envs.spec_decode
    import policies.controllers
    import train.recipes.draft_model
    from learn2draft import models
    from learn2draft.timing import DeviceClock

    assert envs.spec_decode.STOP == policies.controllers.STOP and envs.spec_decode.CONTINUE == policies.controllers.CONTINUE
    root, bound, chat = Path(models.__file__).resolve().parents[1], {}, []
    for path in sorted(p for pkg in ("learn2draft", "envs", "policies", "train", "eval")
                       for p in (root / pkg).rglob("*.py")):
        tree = ast.parse(path.read_text(), str(path))
        for node in tree.body:
            targets = (node.targets if isinstance(node, ast.Assign)
                       else [node.target] if isinstance(node, ast.AnnAssign) else [])
            names = {n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name)}  # also a, b = ...
            for name in names & {"STOP", "CONTINUE"}:
                bound.setdefault(name, []).append(path)
        if any(isinstance(n, ast.Attribute) and n.attr == "apply_chat_template" for n in ast.walk(tree)):
            chat.append(path)
    assert len(bound["STOP"]) == 1 and bound["CONTINUE"] == bound["STOP"], bound
    assert chat == [Path(inspect.getsourcefile(models.encode_text)).resolve()], chat
    assert train.recipes.draft_model.encode_text is models.encode_text
    assert train.recipes.draft_model.eos_token_ids is models.eos_token_ids
    devices, ticks = [], iter(range(10**6))  # every reading of the device clock advances it by 2^-10 s
    monkeypatch.setattr(DeviceClock, "now", lambda self: (devices.append(self.device), next(ticks) * 2.0**-10)[1])
    m = train.recipes.draft_model.measure_draft(tiny_pair, ["w1 w2 w3"], max_new_tokens=4, timing_repeats=2,
                                          timing_contexts=1, show_progress=False)
    assert m["draft_ms"] == m["target_ms"] == m["lm_head_ms"] == 1000 * 2.0**-10 and m["cost_ratio"] == 1.0
    assert devices and set(devices) == {torch.device(tiny_pair.device)}


def test_a_pair_without_a_draft_serves_the_lookup_and_head_drafters(tiny_model_dirs, monkeypatch):
    """load_pair(target, None) loads the target only; the lookup and head drafters decode with it (greedy:
    the target's own output), and only the model drafter asks for the draft, with one clear error."""
    from helpers_loop import tiny_head_drafter

    import learn2draft.models as models
    from learn2draft.decoding import FixedDepthController, SpeculativeDecoder
    from learn2draft.drafters import make_drafter

    loaded = []
    real_load_model = models.load_model
    monkeypatch.setattr(models, "load_model", lambda name, *a, **k: loaded.append(name) or real_load_model(name, *a, **k))
    pair = models.load_pair(tiny_model_dirs[0], None)
    assert loaded == [tiny_model_dirs[0]] and not pair.has_draft and pair.draft_name == ""
    prompt = torch.tensor([1, 5, 9, 5, 9])
    plain = SpeculativeDecoder(pair, max_new_tokens=8, drafter=make_drafter("lookup", pair)).generate(
        prompt, FixedDepthController(0)).tokens
    for drafter in (make_drafter("lookup", pair), tiny_head_drafter(pair)):
        res = SpeculativeDecoder(pair, max_new_tokens=8, max_depth=3, drafter=drafter).generate(
            prompt, FixedDepthController(3))
        assert res.tokens == plain and sum(c.depth for c in res.cycles) > 0
    from eval.law import law_check  # the real-model law check runs on such a pair too

    law = law_check(pair, {"lookup γ=3": FixedDepthController(3)}, [prompt], num_tokens=1, num_samples=10,
                    drafter="lookup")
    assert {a["arm"] for a in law["arms"]} >= {"lookup γ=3"}
    with pytest.raises(models.NoDraftModelError, match="only the 'model' drafter needs one"):
        make_drafter("model", pair)
    with pytest.raises(models.NoDraftModelError):
        SpeculativeDecoder(pair)  # the decoder's default drafter is the model drafter
    both = models.load_pair(*tiny_model_dirs)  # an explicit draft loads as before
    assert both.has_draft and both.draft is both.draft_model and both.draft_name == tiny_model_dirs[1]


def test_auto_precision_on_a_cpu_without_amx_follows_the_measurement(monkeypatch):
    """With AMX ``auto`` is bf16 without measuring; without it (AVX512-BF16 alone included) it is bf16 only where a
    bf16 forward measured at least BF16_MIN_SPEEDUP× faster than fp32, at the run's own forward widths."""
    import learn2draft.models as M

    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: False, raising=False)
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: False, raising=False)
    seen = []
    monkeypatch.setattr(M, "bf16_forward_timing",
                        lambda threads=None, rows=(1, 9), trial=0:
                        seen.append((threads, rows, trial)) or {"speedup": 1.3, "min_speedup": 1.1})
    assert M.fastest_dtype("cpu") == "bfloat16" and M.resolve_dtype("auto", "cpu", threads=3) == "bfloat16"
    # measured on the run's own thread count when it is given; a bf16 win is confirmed by a second measurement
    assert seen == [(None, (1, 9), 0), (None, (1, 9), 1), (3, (1, 9), 0), (3, (1, 9), 1)]
    # a win that the confirming measurement does not repeat (a near-tie read on its lucky side) stays fp32
    monkeypatch.setattr(M, "bf16_forward_timing",
                        lambda threads=None, rows=(1, 9), trial=0:
                        {"speedup": 1.3 if trial == 0 else 1.02, "min_speedup": 1.1})
    assert M.fastest_dtype("cpu") == "float32"
    assert M.bf16_auto_timing(2, (1, 9)) == {"speedup": 1.02, "min_speedup": 1.1, "trials": 2}
    monkeypatch.setattr(M, "bf16_forward_timing",
                        lambda threads=None, rows=(1, 9), trial=0:
                        {"speedup": 1.3, "min_speedup": 1.1 if trial == 0 else 0.9})
    assert M.fastest_dtype("cpu") == "float32"
    monkeypatch.setattr(M, "bf16_forward_timing",
                        lambda threads=None, rows=(1, 9), trial=0: {"speedup": M.BF16_MIN_SPEEDUP - 0.05, "min_speedup": 1.0})
    assert M.fastest_dtype("cpu") == "float32"
    # faster over the widths but clearly slower at one of them (the decode step, on a Xeon VM without AMX): fp32
    monkeypatch.setattr(M, "bf16_forward_timing",
                        lambda threads=None, rows=(1, 9), trial=0: {"speedup": 1.2, "min_speedup": 0.85})
    assert M.fastest_dtype("cpu") == "float32"
    # as measured on a Zen 3 EPYC: bf16 wins one sequence's decode step and loses wide (batched) forwards
    monkeypatch.setattr(M, "bf16_forward_timing",
                        lambda threads=None, rows=(1, 9), trial=0:
                        {"speedup": 1.5 if max(rows) <= 9 else 0.3, "min_speedup": 1.0})
    assert M.resolve_dtype("auto", "cpu", 2, M.forward_rows(1, 8)) == "bfloat16"
    assert M.resolve_dtype("auto", "cpu", 2, M.forward_rows(16, 8)) == "float32"
    # AVX512-BF16 without AMX is measured too: on a Xeon VM without AMX bf16 lost the one-token forward (0.82×)
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: True, raising=False)
    assert M.resolve_dtype("auto", "cpu", 2, M.forward_rows(16, 8)) == "float32"
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: True, raising=False)
    monkeypatch.setattr(M, "bf16_forward_timing", lambda threads=None, rows=(1, 9), trial=0: pytest.fail("measured with AMX"))
    assert M.fastest_dtype("cpu") == "bfloat16"


def test_auto_precision_is_measured_at_each_commands_forward_widths():
    """A command's batch (eval.serve: --max-batch, else its largest --concurrency; eval.profile: --batch-sizes; train:
    --serve-loads) and deepest draft (its policy's, --max-depth, --gammas, --verify-sizes with --tree) give the widths
    ``auto`` is timed at: a decode step and a full verification of the batch. Each command passes its own flags
    (learn2draft.settings.forward_widths); flag values are read as the flags give them."""
    from learn2draft.models import forward_rows
    from learn2draft.names import DEFAULT_MAX_DEPTH
    from learn2draft.settings import forward_widths

    assert forward_rows(16, 8) == (16, 144) and forward_rows(1, 0) == (1, 1)
    assert forward_widths() == (1, DEFAULT_MAX_DEPTH + 1)
    assert forward_widths("1,2,16,4", (None,)) == forward_rows(16, 8)
    # eval.serve without --max-depth drafts up to the largest of --gammas; ranges count by their end
    assert forward_widths("1-16", (None, "1,2,4,12")) == (16, 16 * 13)
    assert forward_widths(None, (16, "1-12")) == (1, 17)  # the policy's
    assert forward_widths(None, ([1, 2], "4,16")) == (1, 17)
    # eval / eval.benchmark default --verify-sizes 4,8,16 for --tree: without --tree the command leaves them out
    assert forward_widths(None, (8, "1,2")) == (1, 9)
    assert forward_widths(None, (8, "1,2", "4,8,16")) == (1, 17)
    assert forward_widths(6, (4,)) == (6, 30)  # --max-batch 6 (eval.serve passes it as the batch)
    assert forward_widths("1,8", (16,)) == (8, 136)
    assert forward_widths("1,4", (8,)) == (4, 36)
    assert forward_widths("1,x", (3,)) == (1, 4)  # the command's own check says why


def test_the_bf16_forward_timing_times_both_precisions_at_every_shape():
    from learn2draft.models import bf16_forward_timing

    before, rng = torch.get_num_threads(), torch.random.get_rng_state()
    t = bf16_forward_timing(layers=1, rows=[1, 3], context=8, repeats=2, threads=1)  # small
    assert torch.get_num_threads() == before and t["threads"] == 1  # measured on 1 thread, the setting restored
    assert torch.equal(torch.random.get_rng_state(), rng)  # the proxy's random weights leave the caller's RNG alone
    t["speedup"] = -1.0  # a caller's change does not reach the next caller
    t = bf16_forward_timing(layers=1, rows=(1, 3), context=8, repeats=2, threads=1)
    assert set(t["float32"]) == set(t["bfloat16"]) == {1, 3}
    assert all(0 < v < 1 for d in ("float32", "bfloat16") for v in t[d].values())
    assert t["speedup"] == pytest.approx(sum(t["float32"].values()) / sum(t["bfloat16"].values()))
    assert t["min_speedup"] == pytest.approx(min(t["float32"][n] / t["bfloat16"][n] for n in (1, 3)))


def test_the_default_policy_and_auto_are_chosen_at_the_threads_the_run_will_set(monkeypatch, tmp_path):
    """eval, the benchmark and generate pick the shipped policy of ``auto``'s precision before they set the policy's
    thread count: policies.load.default_policy_for measures at the thread count the run will set (--threads, else
    the picked policy's recorded threads, else 1 — not torch's current setting) and the picked policy's depth,
    returns that precision with it, and falls back to the float32 policy where the two never agree. The models then
    load in that precision without measuring again."""
    import json

    import learn2draft.models as models
    import policies.layout as layout
    from learn2draft.names import DEFAULT_MAX_DEPTH
    from policies.load import default_policy_for

    for name, threads, depth in (("lookup", 1, 8), ("lookup-bfloat16", 2, 16), ("model", None, 8)):
        (tmp_path / name).mkdir()
        (tmp_path / name / layout.ONNX_FILE).write_bytes(b"")
        (tmp_path / name / layout.RUN_CONFIG_FILE).write_text(json.dumps({"threads": threads, "max_depth": depth}))
    monkeypatch.setattr(layout, "DEFAULT_POLICIES_DIR", tmp_path)
    calls = []

    def machine(bf16_at):
        def fastest(device, threads=None, rows=(1, 9)):
            calls.append((threads, tuple(rows)))
            return "bfloat16" if threads == bf16_at else "float32"
        return fastest

    def pick(threads, bf16_at, drafter="lookup"):
        monkeypatch.setattr(models, "fastest_dtype", machine(bf16_at))
        calls.clear()
        d, dtype = default_policy_for(drafter, "auto", "cpu", threads)
        assert models.resolve_dtype(dtype, "cpu") == dtype  # a name now: the run's settings measure nothing
        return d.name, dtype

    before = torch.get_num_threads()
    torch.set_num_threads(2)  # torch's setting is not what the run will use
    try:
        assert pick(None, bf16_at=2) == ("lookup", "float32")
        assert calls == [(1, models.forward_rows(1, DEFAULT_MAX_DEPTH)), (1, models.forward_rows(1, 8))]  # 1 thread
        assert pick(2, bf16_at=2) == ("lookup-bfloat16", "bfloat16") and calls[-1] == (2, models.forward_rows(1, 16))
        # bf16 wins on 1 thread, but the bf16 policy runs on 2, where fp32 wins: never settles → fp32, its policy
        assert pick(None, bf16_at=1) == ("lookup", "float32") and {t for t, _ in calls} == {1, 2}
        assert pick(None, bf16_at=1, drafter="model") == ("model", "bfloat16")  # one precision shipped: the fastest
    finally:
        torch.set_num_threads(before)
    d, dtype = default_policy_for("lookup", "bf16", "cpu")
    assert d.name == "lookup-bfloat16" and dtype == "bfloat16"
