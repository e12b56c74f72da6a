"""The feature-level draft head (learn2draft.drafters.head) and its recipe (train.recipes.head), on tiny
random Llama models; one slow test on the real target with the shipped head."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch
from conftest import TINY_VOCAB, tiny_llama

from learn2draft.decoding import FixedDepthController, SpeculativeDecoder
from learn2draft.drafters import make_drafter
from learn2draft.drafters.head import DraftHead, HeadDrafter, head_llama_config, load_head_drafter
from learn2draft.models import ModelLoadError
from learn2draft.sampling import SamplingConfig
from train.recipes.head import HeadConfig, build_head, head_losses, main, make_batch, ttt_mask


def _head(target, d2t=None, seed=0) -> DraftHead:
    torch.manual_seed(seed)
    V = target.config.vocab_size
    d2t = torch.arange(3, V, 2) if d2t is None else d2t
    head = DraftHead(head_llama_config(target.config), d2t).attach_target(target, init_norm=True)
    with torch.no_grad():  # peakier logits than the random init gives
        head.norm.weight.mul_(20.0)
    return head.eval()


def _features(target, seq: torch.Tensor) -> torch.Tensor:
    with torch.inference_mode():
        return target(input_ids=seq[None], output_hidden_states=True).hidden_states[-1][0]


@pytest.fixture(scope="module")
def trained_head_dir(tiny_tok, tmp_path_factory):
    """A head trained briefly by the recipe on the tiny target (also the recipe's end-to-end test)."""
    target = tiny_llama(len(tiny_tok), 0)
    rng = random.Random(0)
    prompts = [" ".join(rng.choice(TINY_VOCAB) for _ in range(rng.randint(3, 8))) for _ in range(16)]
    docs = [" ".join(rng.choice(TINY_VOCAB) for _ in range(150)) for _ in range(2)]
    base = tmp_path_factory.mktemp("head")
    cfg = HeadConfig(target="tiny", out=str(base / "head"), work_dir=str(base / "work"), num_prompts=0,
                     max_new_tokens=24, gen_batch_size=8, docs_tokens=200, docs_chunk=32, docs_batch=4, draft_vocab=48,
                     steps=60, batch_tokens=512, lr=3e-3, warmup=5, eval_every=20, ckpt_every=20, timing_repeats=2,
                     wandb_mode="disabled", heldout_fraction=0.15)
    rep = build_head(cfg, target=target, tokenizer=tiny_tok, prompts=prompts, eval_prompts=prompts[:2], docs=docs)
    return base / "head", rep


# ----------------------------------------------------------------------------- drafter state
def test_rollback_matches_fresh_drafter(tiny_pair):
    """Every proposal of a drafter driven through cycles with rollbacks equals the proposal of a fresh
    drafter given the same sequence and the same verified target features."""
    target = tiny_pair.target
    head = _head(target)
    calls = []

    class Checked(HeadDrafter):
        def predict(self, seq):
            out = super().predict(seq)
            n_f = self.feats.shape[0]
            fresh = HeadDrafter(head, tiny_pair.vocab_size)
            fresh.start(seq[:1])
            fresh.observe_target(_features(target, seq[:n_f]), 0)
            ref = fresh.predict(seq)
            calls.append((seq.numel(), n_f))
            torch.testing.assert_close(out, ref, atol=1e-4, rtol=1e-4)
            return out

    drafter = Checked(head, tiny_pair.vocab_size)
    dec = SpeculativeDecoder(tiny_pair, SamplingConfig(temperature=1.0), max_new_tokens=30, drafter=drafter, seed=3)
    dec.generate(torch.tensor([1, 5, 9, 12, 7]), FixedDepthController(3))
    assert len(calls) >= 10
    assert any(n - 1 > nf for n, nf in calls)  # some proposals read the head's own features


def test_rollback_drops_features_and_predicted_entries(tiny_pair):
    head = _head(tiny_pair.target)
    d = HeadDrafter(head, tiny_pair.vocab_size)
    seq = torch.tensor([1, 4, 8, 15, 16, 23, 42 % 63])
    d.start(seq[:5])
    d.observe_target(_features(tiny_pair.target, seq[:5]), 0)
    d.predict(seq[:6])
    d.predict(seq)  # one predicted position
    assert (d.cache_len, d.spec_len) == (5, 1)
    d.observe_target(_features(tiny_pair.target, seq)[5:], 5)  # a verify forward
    d.rollback(6)
    assert d.feats.shape[0] == 6 and d.spec_len == 0 and d.cache_len == 5
    assert d.cache.get_seq_length() == 5
    with pytest.raises(ValueError, match="only 6 positions known"):
        d.observe_target(torch.zeros(1, head.config.hidden_size), 9)
    d.observe_target(_features(tiny_pair.target, seq[:6])[3:], 3)  # features replaced: the cache follows
    assert d.cache_len == 3 and d.cache.get_seq_length() == 3
    fresh = HeadDrafter(head, tiny_pair.vocab_size)
    fresh.observe_target(_features(tiny_pair.target, seq[:6]), 0)
    torch.testing.assert_close(d.predict(seq), fresh.predict(seq), atol=1e-4, rtol=1e-4)


def test_ttt_unroll_matches_chain_drafting(tiny_pair):
    """The training-time-test forward (step k at position t) computes what the drafter computes at draft step k."""
    target = tiny_pair.target
    head = _head(target)
    seq = torch.tensor([1, 6, 11, 30, 2 + 3, 17, 44, 9, 21, 33])
    feats = _features(target, seq)
    ex = {"ids": seq, "hidden": feats, "start": 0}
    b = make_batch([ex])
    m = b["feat"].shape[1]
    from transformers import DynamicCache

    cache, outs, x, g = DynamicCache(), [], b["feat"], None
    with torch.no_grad():
        for k in range(1, 4):
            if k > 1:
                x = torch.cat([torch.zeros_like(g[:, :1]), g[:, :-1]], dim=1)
            g = head(x, b["tok"], torch.arange(m)[None], attention_mask=ttt_mask(m, k, b["lengths"]), cache=cache)
            outs.append(head.logits(g[0]))
    n = 5  # committed x_0..x_4, features f_0..f_3; draft steps predict x_5, x_6, x_7 (true tokens fed back)
    d = HeadDrafter(head, tiny_pair.vocab_size)
    d.start(seq[:n])
    d.observe_target(feats[: n - 1], 0)
    for k in range(1, 4):
        got = d.predict(seq[: n + k - 1])
        torch.testing.assert_close(got, outs[k - 1][n + k - 3], atol=1e-4, rtol=1e-4)


def test_q_is_zero_outside_draft_vocabulary(tiny_pair):
    head = _head(tiny_pair.target)
    d = HeadDrafter(head, tiny_pair.vocab_size)
    seq = torch.tensor([1, 7, 9, 3])
    d.start(seq)
    d.observe_target(_features(tiny_pair.target, seq[:-1]), 0)
    outside = torch.ones(tiny_pair.vocab_size, dtype=torch.bool)
    outside[head.d2t] = False
    g = torch.Generator().manual_seed(0)
    fresh = HeadDrafter(head, tiny_pair.vocab_size)  # the features read the head's raw distribution, whatever q is
    fresh.observe_target(_features(tiny_pair.target, seq[:-1]), 0)
    raw = torch.softmax(fresh.predict(seq).double(), -1)
    for s in (SamplingConfig(temperature=1.0), SamplingConfig(temperature=0.7, top_p=0.9, repetition_penalty=1.3),
              SamplingConfig()):
        prop = d.propose(seq, s, g)
        assert prop.probs.shape == (tiny_pair.vocab_size,)
        assert float(prop.probs[outside].abs().sum()) == 0.0
        assert abs(float(prop.probs.sum()) - 1) < 1e-5
        assert bool(torch.isin(torch.tensor(prop.token), head.d2t))
        assert prop.confidence == pytest.approx(float(raw.max()), abs=1e-5)
        assert prop.entropy == pytest.approx(float(-(raw * raw.log()).sum()), abs=1e-4)
        top2 = raw.topk(2).values
        assert prop.margin == pytest.approx(float(top2[0] - top2[1]), abs=1e-5)  # over the draft vocabulary


# ----------------------------------------------------------------------------- output law (greedy)
@pytest.mark.parametrize("gamma", [1, 3, 5])
def test_greedy_speculative_equals_autoregressive(tiny_pair, trained_head_dir, gamma):
    d = load_head_drafter(tiny_pair, trained_head_dir[0])
    prompt = torch.tensor([1, 9, 14, 22, 5])
    ar = SpeculativeDecoder(tiny_pair, max_new_tokens=40).generate(prompt, FixedDepthController(0))
    sp = SpeculativeDecoder(tiny_pair, max_new_tokens=40, drafter=d).generate(prompt, FixedDepthController(gamma))
    assert sp.tokens == ar.tokens
    assert sum(c.depth for c in sp.cycles) > 0


# ----------------------------------------------------------------------------- persistence and errors
def test_save_load_round_trip(tiny_pair, tmp_path):
    head = _head(tiny_pair.target)
    head.save(tmp_path / "h", extra={"target": "tiny"}, dtype=torch.float32)
    d = load_head_drafter(tiny_pair, tmp_path / "h")
    assert torch.equal(d.head.d2t, head.d2t)
    for k, v in head.head_state_dict().items():
        torch.testing.assert_close(d.head.head_state_dict()[k], v)
    x = torch.randn(1, 4, head.config.hidden_size)
    tok = torch.tensor([[3, 5, 7, 9]])
    pos = torch.arange(4)[None]
    from learn2draft.drafters.head import causal_mask

    with torch.no_grad():
        torch.testing.assert_close(d.head(x, tok, pos, causal_mask(4, 0)), head(x, tok, pos, causal_mask(4, 0)))
    names = {p.name for p in (tmp_path / "h").iterdir()}
    assert names == {"config.json", "head.safetensors"}
    assert make_drafter("head", tiny_pair, head=str(tmp_path / "h")).name == "head"


def test_mismatched_or_missing_head_is_refused(tiny_pair, tiny_tok, tmp_path):
    with pytest.raises(ModelLoadError, match="train.recipes.head"):
        load_head_drafter(tiny_pair, tmp_path / "nothing")
    wide = tiny_llama(len(tiny_tok), 5, hidden=48)
    _head(wide).save(tmp_path / "wide", extra={"target": "wide"})
    with pytest.raises(ModelLoadError, match="hidden size 48"):
        load_head_drafter(tiny_pair, tmp_path / "wide")
    big = tiny_llama(200, 6)
    _head(big, d2t=torch.tensor([3, 150, 190])).save(tmp_path / "big", extra={"target": "big"})
    with pytest.raises(ModelLoadError, match="vocabulary"):
        load_head_drafter(tiny_pair, tmp_path / "big")
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "config.json").write_text("{}")
    (tmp_path / "bad" / "head.safetensors").write_bytes(b"xx")
    with pytest.raises(ModelLoadError, match="malformed"):
        load_head_drafter(tiny_pair, tmp_path / "bad")


# ----------------------------------------------------------------------------- the recipe
def test_recipe_writes_a_loadable_head(trained_head_dir, tiny_pair):
    path, rep = trained_head_dir
    assert {p.name for p in path.iterdir()} == {"config.json", "head.safetensors", "build_report.json"}
    saved = json.loads((path / "build_report.json").read_text())
    m = saved["measure"]
    for k in ("alpha_step1", "alpha_step2", "alpha_step3", "cost_ratio", "head_ms", "target_ms"):
        assert k in m
    assert 0 <= m["alpha_step1"] <= 1 and saved["size_bytes"] > 0 and saved["training"]["step"] == 60
    assert saved["data"]["answers"] > 0 and saved["data"]["docs_tokens"] > 0
    # paths inside the project are written relative to it (a clone elsewhere reads them); others as given
    assert saved["config"]["prompts_file"] == "train/recipes/data/distill_prompts.json"
    assert saved["config"]["out"] == str(path) and Path(saved["config"]["out"]).is_absolute()  # tmp: outside
    d = load_head_drafter(tiny_pair, path)
    assert d.head.draft_vocab_size <= 48 + 1


def test_recipe_resumes_with_a_longer_time_cap(trained_head_dir, tiny_tok):
    path, rep = trained_head_dir
    cfg = HeadConfig(**rep["config"])
    cfg.max_train_minutes += 1.0
    target = tiny_llama(len(tiny_tok), 0)
    rng = random.Random(0)
    prompts = [" ".join(rng.choice(TINY_VOCAB) for _ in range(rng.randint(3, 8))) for _ in range(16)]
    docs = [" ".join(rng.choice(TINY_VOCAB) for _ in range(150)) for _ in range(2)]
    rep2 = build_head(cfg, target=target, tokenizer=tiny_tok, prompts=prompts, eval_prompts=prompts[:2], docs=docs)
    assert rep2["training"]["start_step"] == 60 == rep2["training"]["step"]
    assert rep2["data"] == rep["data"]


def test_training_steps_walk_epochs_of_different_batch_counts():
    """Each epoch packs its own shuffle into a different number of batches (the 2026-12-04 full
    build crashed at its first epoch boundary, indexing epoch 1 with epoch 0's count): the steps walk
    epoch 0's batches, then epoch 1's, ..., and a resume at any step finds the same batch."""
    from train.recipes.head import _batch_at, _batches

    rng = random.Random(3)
    data = [{"ids": [0] * rng.randint(2, 40)} for _ in range(60)]
    epochs = [_batches(data, 64, 0, e) for e in range(4)]
    assert len({len(b) for b in epochs}) > 1  # the case that crashed
    walked, state = [], {}
    for step in range(sum(len(b) for b in epochs)):
        idx, epoch = _batch_at(data, 64, 0, step, state)
        walked.append((epoch, idx))
    assert walked == [(e, b) for e, bs in enumerate(epochs) for b in bs]
    for step in (0, len(epochs[0]) - 1, len(epochs[0]), len(walked) - 1):
        assert _batch_at(data, 64, 0, step, {}) == walked[step][::-1]  # a resume: a fresh walk


def test_ctrl_c_in_training_keeps_the_steps_done_and_says_how_to_resume(tiny_pair, tmp_path, monkeypatch, capsys):
    """Ctrl-C between optimizer steps checkpoints the steps done (not only those up to the last
    ``ckpt_every``), and the recipe's entry point prints one line and exits 130."""
    import train.recipes.head as rh
    from train.recipes.common import run_recipe

    head = _head(tiny_pair.target, d2t=torch.arange(63))
    g = torch.Generator().manual_seed(0)
    seqs = [torch.randint(3, 63, (20,), generator=g) for _ in range(4)]
    data = [{"ids": s, "hidden": _features(tiny_pair.target, s), "start": 0} for s in seqs]
    cfg = HeadConfig(steps=50, ckpt_every=1000, eval_every=1000, max_train_minutes=0, batch_tokens=64)
    real, calls = rh.head_losses, []

    def interrupted(*a, **k):
        calls.append(1)
        if len(calls) == 8:
            raise KeyboardInterrupt
        return real(*a, **k)

    monkeypatch.setattr(rh, "head_losses", interrupted)
    with pytest.raises(KeyboardInterrupt):
        rh.train_head(head, data, [], cfg, tmp_path, "key")
    assert torch.load(tmp_path / rh.CKPT_NAME, weights_only=False)["step"] == 7

    def body():
        raise KeyboardInterrupt

    assert run_recipe(body) == 130
    assert "run the same command again to resume" in capsys.readouterr().err


def test_training_loss_decreases(tiny_pair):
    head = _head(tiny_pair.target, d2t=torch.arange(63))
    g = torch.Generator().manual_seed(0)
    seqs = [torch.randint(3, 63, (20,), generator=g) for _ in range(4)]
    data = [{"ids": s, "hidden": _features(tiny_pair.target, s), "start": 0} for s in seqs]
    b = make_batch(data)
    head.train()
    opt = torch.optim.Adam([p for p in head.parameters() if p.requires_grad], lr=3e-3)
    first = None
    for _ in range(30):
        m = head_losses(head, b, 2, 0.8, 0.2)
        first = first if first is not None else float(m["loss"].detach())
        opt.zero_grad()
        m["loss"].backward()
        opt.step()
    assert float(m["loss"].detach()) < 0.7 * first


@pytest.mark.parametrize("autocast", [False, True])
def test_training_loss_decreases_under_bf16_autocast_too(tiny_pair, autocast):
    """The recipe's bfloat16 training (autocast on the CPU) learns like float32: the loss of one batch falls below
    0.7 of its first value in 30 Adam steps (tolerance: the same bound as float32), and the KL stays float32."""
    head = _head(tiny_pair.target, d2t=torch.arange(63))
    g = torch.Generator().manual_seed(0)
    seqs = [torch.randint(3, 63, (20,), generator=g) for _ in range(4)]
    b = make_batch([{"ids": s, "hidden": _features(tiny_pair.target, s), "start": 0} for s in seqs])
    head.train()
    opt = torch.optim.Adam([p for p in head.parameters() if p.requires_grad], lr=3e-3)
    losses = []
    for _ in range(30):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            m = head_losses(head, b, 2, 0.8, 0.2)
        assert m["loss"].dtype == torch.float32 and m["kl1"].dtype == torch.float32
        losses.append(float(m["loss"].detach()))
        opt.zero_grad()
        m["loss"].backward()
        opt.step()
    assert head.fc.weight.dtype == torch.float32 and losses[-1] < 0.7 * losses[0]


def test_dtype_is_in_every_data_and_training_key():
    """Answers generated, documentation forwarded or a head trained in another precision are never reused."""
    a, b = HeadConfig(dtype="float32"), HeadConfig(dtype="bfloat16")
    assert a.gen_key(["p"]) != b.gen_key(["p"]) and a.docs_key() != b.docs_key() and a.docs_key(1) != b.docs_key(1)
    assert a.train_key("k") != b.train_key("k")
    assert HeadConfig(dtype="float32").gen_key(["p"]) == a.gen_key(["p"])


def test_dtype_resolution(tiny_pair):
    from train.recipes.head import HeadTrainError, resolve_head_dtype

    assert resolve_head_dtype(HeadConfig(dtype="bf16")).dtype == "bfloat16"
    assert resolve_head_dtype(HeadConfig(dtype="fp32")).dtype == "float32"
    assert resolve_head_dtype(HeadConfig(dtype="auto")).dtype in ("float32", "bfloat16")
    assert resolve_head_dtype(HeadConfig(), tiny_pair.target).dtype == "float32"  # a given target's own dtype
    with pytest.raises(HeadTrainError, match="--dtype bfloat16 but the given target is in float32"):
        resolve_head_dtype(HeadConfig(dtype="bfloat16"), tiny_pair.target)


def test_recipe_in_bfloat16_records_its_precision(tiny_tok, tmp_path):
    """A build with a bfloat16 target trains under autocast, measures the head in bfloat16 and records the
    precision in the report; the saved head loads over a bfloat16 target."""
    target = tiny_llama(len(tiny_tok), 0).to(torch.bfloat16)
    rng = random.Random(1)
    prompts = [" ".join(rng.choice(TINY_VOCAB) for _ in range(rng.randint(3, 8))) for _ in range(8)]
    cfg = HeadConfig(target="tiny", out=str(tmp_path / "head"), work_dir=str(tmp_path / "work"), num_prompts=0,
                     max_new_tokens=16, gen_batch_size=8, docs_tokens=0, draft_vocab=48, steps=10, batch_tokens=256,
                     warmup=2, eval_every=5, ckpt_every=5, timing_repeats=2, wandb_mode="disabled",
                     heldout_fraction=0.25)
    rep = build_head(cfg, target=target, tokenizer=tiny_tok, prompts=prompts, eval_prompts=prompts[:2], docs=[])
    assert rep["config"]["dtype"] == "bfloat16" and rep["measure"]["dtype"] == "bfloat16"
    assert rep["training"]["step"] == 10 and 0 <= rep["measure"]["alpha_step1"] <= 1
    from learn2draft.models import make_pair

    pair = make_pair(target, None, tiny_tok, tiny_tok)
    assert load_head_drafter(pair, tmp_path / "head").head.fc.weight.dtype == torch.bfloat16


def test_cli_refuses_bad_args_before_loading(capsys, tmp_path):
    assert main(["--steps", "0", "--wandb-mode", "disabled"]) == 2
    assert "--steps" in capsys.readouterr().err
    assert main(["--dtype", "int8", "--wandb-mode", "disabled"]) == 2
    assert "--dtype must be auto, float32, bfloat16 or float16" in capsys.readouterr().err
    (tmp_path / "x.txt").write_text("x")
    assert main(["--out", str(tmp_path), "--wandb-mode", "disabled"]) == 2
    assert "did not write" in capsys.readouterr().err


# ----------------------------------------------------------------------------- real target
@pytest.mark.slow
def test_real_target_greedy_with_shipped_head_equals_autoregressive(default_pair):
    from learn2draft.prompts import load_prompts

    d = make_drafter("head", default_pair)
    for prompt in load_prompts("heldout")[:2]:
        ids = default_pair.encode_prompt(prompt)
        ar = SpeculativeDecoder(default_pair, max_new_tokens=48).generate(ids, FixedDepthController(0))
        sp = SpeculativeDecoder(default_pair, max_new_tokens=48, drafter=d).generate(ids, FixedDepthController(3))
        assert sp.tokens == ar.tokens
        assert sp.acceptance_rate > 0


def test_head_recipe_refuses_to_replace_a_draft_model_folder(tmp_path):
    """A draft model written by train.recipes.draft_model also has a build_report.json: it is not a head."""
    from learn2draft.models import DEFAULT_DRAFT_DIR
    from train.recipes.head import HeadTrainError, check_out_dir

    with pytest.raises(HeadTrainError, match="did not write"):
        check_out_dir(DEFAULT_DRAFT_DIR, "smollm2-135m-instruct")
    fake = tmp_path / "d"
    fake.mkdir()
    (fake / "build_report.json").write_text("{}")
    (fake / "config.json").write_text('{"model_type": "llama"}')
    with pytest.raises(HeadTrainError, match="did not write"):
        check_out_dir(fake, "smollm2-135m-instruct")


def test_head_recipe_refuses_wandb_online_without_credentials_before_any_work(tmp_path, capsys, monkeypatch):
    import train.recipes.head as recipe

    monkeypatch.setattr(recipe, "build_head", lambda *a, **k: (_ for _ in ()).throw(AssertionError("slow work")))
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.setenv("NETRC", str(tmp_path / "no-netrc"))
    monkeypatch.setenv("WANDB_CONFIG_DIR", str(tmp_path / "wandb-config"))
    assert recipe.main(["--out", str(tmp_path / "h"), "--wandb-mode", "online"]) == 2
    err = capsys.readouterr().err
    assert "credentials" in err and len(err.strip().splitlines()) == 1
