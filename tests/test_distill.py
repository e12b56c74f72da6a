"""The distillation recipe on tiny random models, resume, CLI errors, the prompt sets and the shipped draft."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import TINY_VOCAB, tiny_llama

from learn2draft.models import DEFAULT_DRAFT_DIR, load_model, load_tokenizer
from learn2draft.prompts import load_prompts
from train.recipes import draft_model as distill
from train.recipes.common import RecipeError, check_disjoint, load_distill_prompts
from train.recipes.draft_model import DistillConfig, DistillError, build_draft, distill_loss, make_draft

PROMPTS = [" ".join(TINY_VOCAB[i:i + 5]) for i in range(0, 40, 4)]


def tiny_cfg(tmp_path, **kw) -> DistillConfig:
    base = dict(target="tiny", out=str(tmp_path / "draft"), work_dir=str(tmp_path / "work"), hidden=16, layers=1,
                intermediate=32, heads=2, kv_heads=1, head_dim=8, max_new_tokens=10, gen_batch_size=4, steps=12,
                batch_size=4, warmup=2, ckpt_every=4, eval_max_new_tokens=6, timing_repeats=2, topk=5,
                max_train_minutes=0, wandb_mode="disabled")
    base.update(kw)
    return DistillConfig(**base)


@pytest.fixture(scope="module")
def tiny_target(tiny_tok):
    return tiny_llama(len(tiny_tok), 0)


def test_end_to_end_tiny(tmp_path, tiny_tok, tiny_target):
    cfg = tiny_cfg(tmp_path)
    rep = build_draft(cfg, target=tiny_target, tokenizer=tiny_tok, prompts=PROMPTS, eval_prompts=PROMPTS[:2],
                      command="test")
    out = tmp_path / "draft"
    for f in ("config.json", "model.safetensors", "tokenizer.json", "build_report.json"):
        assert (out / f).is_file(), f
    saved = json.loads((out / "build_report.json").read_text())
    assert saved["command"] == "test"
    assert saved["training"]["step"] == 12 and saved["training"]["start_step"] == 0
    m = saved["measure"]
    assert 0.0 <= m["alpha_greedy"] <= 1.0 and 0.0 <= m["alpha_t1"] <= 1.0
    assert m["positions"] > 0 and m["cost_ratio"] > 0
    assert rep["data"]["responses"] == len(PROMPTS) + round(DistillConfig().sampled_fraction * len(PROMPTS))
    # loadable through the package loader, float16 on disk, same vocabulary as the target
    d = load_model(str(out))
    assert d.config.vocab_size == tiny_target.config.vocab_size
    assert d.config.hidden_size == 16 and d.config.num_hidden_layers == 1
    assert load_tokenizer(str(out)).get_vocab() == tiny_tok.get_vocab()
    from safetensors import safe_open

    with safe_open(str(out / "model.safetensors"), "pt") as f:
        assert all(f.get_tensor(k).dtype == torch.float16 for k in f.keys())


def test_rerun_uses_cached_data_and_checkpoint(tmp_path, tiny_tok, tiny_target, monkeypatch):
    cfg = tiny_cfg(tmp_path, steps=8, ckpt_every=4)
    build_draft(cfg, target=tiny_target, tokenizer=tiny_tok, prompts=PROMPTS, eval_prompts=PROMPTS[:1])
    assert torch.load(tmp_path / "work" / distill.CKPT_NAME, weights_only=False)["step"] == 8

    def no_generate(*a, **k):
        raise AssertionError("target.generate called although the data is cached")

    monkeypatch.setattr(tiny_target, "generate", no_generate)
    monkeypatch.setattr(distill, "measure_draft", lambda *a, **k: {"alpha_greedy": 0.0, "alpha_t1": 0.0,
                                                                   "cost_ratio": 1.0})
    rep = build_draft(cfg, target=tiny_target, tokenizer=tiny_tok, prompts=PROMPTS, eval_prompts=PROMPTS[:1])
    assert rep["training"]["start_step"] == 8 and rep["training"]["step"] == 8
    # other training settings: the checkpoint is not reused (but the data still is)
    rep = build_draft(tiny_cfg(tmp_path, steps=9, ckpt_every=4), target=tiny_target, tokenizer=tiny_tok,
                      prompts=PROMPTS, eval_prompts=PROMPTS[:1])
    assert rep["training"]["start_step"] == 0 and rep["training"]["step"] == 9


def test_interrupted_run_resumes(tmp_path, tiny_tok, tiny_target, monkeypatch):
    """A run cut short by Ctrl-C checkpoints the steps done (7, not the last ``ckpt_every`` multiple 6) and
    continues from there, not from 0."""
    cfg = tiny_cfg(tmp_path, steps=10, ckpt_every=3)
    prompts = PROMPTS[:6]
    monkeypatch.setattr(distill, "measure_draft", lambda *a, **k: {"alpha_greedy": 0.0, "alpha_t1": 0.0,
                                                                   "cost_ratio": 1.0})
    calls = {"n": 0}
    real_batch = distill._batch

    def interrupt_after_7(*a, **k):
        calls["n"] += 1
        if calls["n"] > 7:
            raise KeyboardInterrupt
        return real_batch(*a, **k)

    monkeypatch.setattr(distill, "_batch", interrupt_after_7)
    with pytest.raises(KeyboardInterrupt):
        build_draft(cfg, target=tiny_target, tokenizer=tiny_tok, prompts=prompts, eval_prompts=prompts[:1])
    assert torch.load(tmp_path / "work" / distill.CKPT_NAME, weights_only=False)["step"] == 7
    monkeypatch.setattr(distill, "_batch", real_batch)
    rep = build_draft(cfg, target=tiny_target, tokenizer=tiny_tok, prompts=prompts, eval_prompts=prompts[:1])
    assert rep["training"]["start_step"] == 7 and rep["training"]["step"] == 10
    # --restart ignores the checkpoint
    rep = build_draft(cfg, target=tiny_target, tokenizer=tiny_tok, prompts=prompts, eval_prompts=prompts[:1],
                      restart=True)
    assert rep["training"]["start_step"] == 0


def test_pca_embedding_init(tiny_tok, tiny_target, tmp_path):
    d = make_draft(tiny_target, tiny_tok, tiny_cfg(tmp_path))
    W = tiny_target.get_output_embeddings().weight.detach()
    E = d.get_input_embeddings().weight.detach()
    assert E.shape == (W.shape[0], 16)
    assert d.get_output_embeddings().weight.data_ptr() == E.data_ptr()  # tied
    # the projection preserves the geometry: cosine similarities of rows correlate with the target's
    cw = torch.nn.functional.normalize(W, dim=1) @ torch.nn.functional.normalize(W, dim=1).T
    ce = torch.nn.functional.normalize(E, dim=1) @ torch.nn.functional.normalize(E, dim=1).T
    assert torch.corrcoef(torch.stack([cw.flatten(), ce.flatten()]))[0, 1] > 0.5


def test_distill_loss_zero_when_matching():
    torch.manual_seed(0)
    logits = torch.randn(5, 30)
    lp = torch.log_softmax(logits, -1)
    tl, ti = lp.topk(30, dim=-1)
    m = distill_loss(logits, ti, tl, ce_weight=0.0)
    assert m["kl"].abs() < 1e-5 and m["top1"] == 1.0
    m2 = distill_loss(torch.randn(5, 30), ti, tl, ce_weight=0.0)
    assert m2["kl"] > 0.01


def test_distill_prompts_disjoint_from_policy_prompts():
    prompts = load_distill_prompts()
    assert len(prompts) >= 200 and len(set(prompts)) == len(prompts)
    policy = {s.strip().lower() for split in ("train", "heldout") for s in load_prompts(split)}
    assert not policy & {s.strip().lower() for s in prompts}
    with pytest.raises(RecipeError, match="also appear"):
        check_disjoint(prompts[:3] + [load_prompts("heldout")[0]])


def test_cli_bad_input(tmp_path, capsys):
    assert distill.main(["--target", str(tmp_path / "nope"), "--wandb-mode", "disabled",
                         "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error:") and "Traceback" not in err
    f = tmp_path / "file"
    f.write_text("x")
    assert distill.main(["--out", str(f), "--wandb-mode", "disabled"]) == 2
    assert "not a directory" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        distill.main(["--help"])
    assert "--target" in capsys.readouterr().out


# ------------------------------------------------------------------ the shipped default draft
def test_shipped_draft_files_and_size():
    assert (DEFAULT_DRAFT_DIR / "config.json").is_file(), "default draft missing: run python -m train.recipes.draft_model"
    size = sum(f.stat().st_size for f in DEFAULT_DRAFT_DIR.rglob("*") if f.is_file())
    assert size <= 25 * 1024 * 1024 and size <= 25_000_000
    rep = json.loads((DEFAULT_DRAFT_DIR / "build_report.json").read_text())
    # the shipped draft was built before the recipe moved from learn2draft.distill to train.recipes.draft_model
    assert rep["command"].split()[:3] in (["python", "-m", "train.recipes.draft_model"], ["python", "-m", "learn2draft.distill"])
    for k in ("alpha_greedy", "cost_ratio", "draft_ms", "target_ms"):
        assert k in rep["measure"]


@pytest.mark.slow
def test_shipped_draft_loads_with_target(default_pair):
    pair = default_pair
    assert pair.draft.config.model_type == "llama"
    assert pair.draft.config.vocab_size == pair.target.config.vocab_size
    assert load_tokenizer("smollm2-135m-draft").get_vocab() == load_tokenizer("smollm2-135m-instruct").get_vocab()
    ids = pair.encode_prompt("Write a Python function that adds two numbers.")
    with torch.inference_mode():
        logits = pair.draft(input_ids=ids[None]).logits
    assert logits.shape[-1] >= pair.vocab_size and torch.isfinite(logits).all()


def test_out_dir_that_this_tool_did_not_write_is_refused_before_any_work(tmp_path):
    from train.recipes.draft_model import check_out_dir

    (tmp_path / "mine.txt").write_text("keep")
    with pytest.raises(DistillError, match="did not write"):
        check_out_dir(tmp_path, "smollm2-135m-instruct")
    assert (tmp_path / "mine.txt").read_text() == "keep"
    with pytest.raises(DistillError, match="pass --out"):
        check_out_dir(DEFAULT_DRAFT_DIR.resolve(), "some/other-model")
    (tmp_path / "build_report.json").write_text("{}")
    check_out_dir(tmp_path, "smollm2-135m-instruct")  # an earlier build may be replaced


@pytest.mark.parametrize("args, flag", [
    (["--hidden", "161", "--heads", "4"], "--hidden"),
    (["--sampled-fraction", "1.5"], "--sampled-fraction"),
    (["--lr", "-0.001"], "--lr"),
    (["--heads", "3", "--kv-heads", "2", "--hidden", "6"], "--heads"),
    (["--sample-top-p", "0"], "--sample-top-p"),
])
def test_bad_settings_are_refused_before_any_work(args, flag, tmp_path, capsys, monkeypatch):
    def no_slow_work(*a, **k):
        raise AssertionError("slow work started")

    monkeypatch.setattr(distill, "load_target", no_slow_work)
    monkeypatch.setattr(distill, "generate_data", no_slow_work)
    assert distill.main([*args, "--out", str(tmp_path / "o"), "--work-dir", str(tmp_path / "w"),
                         "--wandb-mode", "disabled"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error:") and flag in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "w").exists()


def test_default_out_is_not_the_shipped_draft_and_writability_is_tested_by_writing(tmp_path):
    from train.recipes.draft_model import DistillConfig, check_out_dir, parse_args

    assert DistillConfig().out == "" and parse_args([])[0].out == ""  # → <work-dir>/draft, never the asset
    (tmp_path / "file").write_text("x")
    with pytest.raises(DistillError, match="Cannot write"):
        check_out_dir(tmp_path / "file" / "sub" / "draft", "smollm2-135m-instruct")


def test_wandb_online_without_credentials_is_refused_before_any_work(tmp_path, capsys, monkeypatch):
    def no_slow_work(*a, **k):
        raise AssertionError("slow work started")

    monkeypatch.setattr(distill, "load_target", no_slow_work)
    monkeypatch.setattr(distill, "generate_data", no_slow_work)
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.setenv("NETRC", str(tmp_path / "no-netrc"))
    monkeypatch.setenv("WANDB_CONFIG_DIR", str(tmp_path / "wandb-config"))
    assert distill.main(["--out", str(tmp_path / "o"), "--work-dir", str(tmp_path / "w"), "--wandb-mode", "online"]) == 2
    err = capsys.readouterr().err
    assert "credentials" in err and len(err.strip().splitlines()) == 1 and not (tmp_path / "w").exists()


def test_ctrl_c_inside_a_weight_update_keeps_the_last_checkpoint(tmp_path, tiny_tok, tiny_target, monkeypatch):
    """An interrupt that lands in the backward pass / weight update may leave the weights half-updated: the
    checkpoint stays the last periodic one (step 6 of ckpt_every 3), not the interrupted state."""
    cfg = tiny_cfg(tmp_path, steps=10, ckpt_every=3)
    prompts = PROMPTS[:6]
    monkeypatch.setattr(distill, "measure_draft", lambda *a, **k: {"alpha_greedy": 0.0, "alpha_t1": 0.0,
                                                                   "cost_ratio": 1.0})
    real_step, calls = distill.optimizer_step, {"n": 0}

    def interrupted_update(*a, **k):
        calls["n"] += 1
        if calls["n"] == 8:
            raise KeyboardInterrupt
        return real_step(*a, **k)

    monkeypatch.setattr(distill, "optimizer_step", interrupted_update)
    with pytest.raises(KeyboardInterrupt):
        build_draft(cfg, target=tiny_target, tokenizer=tiny_tok, prompts=prompts, eval_prompts=prompts[:1])
    assert torch.load(tmp_path / "work" / distill.CKPT_NAME, weights_only=False)["step"] == 6
