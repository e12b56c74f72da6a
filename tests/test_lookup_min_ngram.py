"""Prompt lookup's shortest n-gram match (``--lookup-min-ngram``) is a recorded drafter setting: the flag builds the
drafter with it, the trace header records it, training in replay takes it from the traces into the policy's config,
and every command that runs the policy drafts with it unless told otherwise."""

from __future__ import annotations

import argparse
import json
import warnings

import pytest

from learn2draft import SpeculativeDecoder
from learn2draft.cli import add_drafter_arg, lookup_min_ngram
from learn2draft.decoding import FixedDepthController
from learn2draft.drafters import LookupDrafter, make_drafter
from learn2draft.sampling import SamplingConfig
from learn2draft.traces import record_traces

PROMPTS = ["w1 w2 w3 w4 w1 w5 w1", "w5 w6 w5 w7 w5", "w7 w8 w9 w7 w10 w7"]


def _args(*argv: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    add_drafter_arg(p, "lookup")
    return p.parse_args(list(argv))


def test_make_drafter_passes_min_ngram_to_lookup_and_hybrids_only(tiny_pair):
    assert make_drafter("lookup", tiny_pair).min_ngram == 2  # the default
    assert make_drafter("lookup", tiny_pair, min_ngram=1).min_ngram == 1
    hybrid = make_drafter("lookup+model", tiny_pair, min_ngram=1)
    assert hybrid.lookup.min_ngram == 1 and hybrid.extra_config()["lookup"]["min_ngram"] == 1
    assert hybrid.spawn().lookup.min_ngram == 1  # the batched decoder's rows keep it
    assert make_drafter("model", tiny_pair, min_ngram=1).name == "model"  # no lookup: ignored
    with pytest.raises(ValueError, match="min_ngram"):
        make_drafter("lookup", tiny_pair, min_ngram=5)


def test_the_flag_is_checked_and_the_policys_setting_is_the_default():
    assert lookup_min_ngram(_args(), "lookup") is None  # neither: the drafter's default
    assert lookup_min_ngram(_args(), "lookup", trained=1) == 1  # the policy's
    assert lookup_min_ngram(_args("--lookup-min-ngram", "1"), "lookup+head") == 1
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert lookup_min_ngram(_args("--lookup-min-ngram", "1"), "lookup", trained=1) == 1  # agrees: no warning
    with pytest.warns(UserWarning, match="--lookup-min-ngram 2, but the policy in P was trained with 1"):
        assert lookup_min_ngram(_args("--lookup-min-ngram", "2"), "lookup", trained=1, what="the policy in P") == 2
    for bad in ("0", "5"):
        with pytest.raises(ValueError, match="--lookup-min-ngram must be between 1 and 4"):
            lookup_min_ngram(_args("--lookup-min-ngram", bad), "lookup")
    with pytest.raises(ValueError, match="only applies to prompt lookup .* not --drafter model"):
        lookup_min_ngram(_args("--lookup-min-ngram", "1", "--drafter", "model"), "model")


def test_unigram_lookup_keeps_greedy_output_and_drafts_more(tiny_pair):
    """min_ngram 1 changes what is drafted, never what is emitted: greedy output equals autoregressive's; on these
    repetitive prompts it drafts tokens where min_ngram 2 finds no match."""
    drafted = {}
    for m in (1, 2):
        for text in PROMPTS:
            ids = tiny_pair.encode_prompt(text, chat=False)
            ar = SpeculativeDecoder(tiny_pair, max_new_tokens=12, max_depth=4,
                                    drafter=LookupDrafter(min_ngram=m)).generate(ids, FixedDepthController(0))
            res = SpeculativeDecoder(tiny_pair, max_new_tokens=12, max_depth=4,
                                     drafter=LookupDrafter(min_ngram=m)).generate(ids, FixedDepthController(4))
            assert res.tokens == ar.tokens, (m, text)
            drafted[m] = drafted.get(m, 0) + sum(c.depth for c in res.cycles)
    assert drafted[1] > drafted[2]


def test_traces_record_it_and_replay_training_takes_it_into_the_policy(tiny_pair, tmp_path):
    import train
    from policies.load import policy_lookup_min_ngram
    from train.chain import apply_replay_settings
    from train.config import TrainConfig

    uni, bi = tmp_path / "uni.npz", tmp_path / "bi.npz"
    for path, m in ((uni, 1), (bi, 2)):
        record_traces(tiny_pair, make_drafter("lookup", tiny_pair, min_ngram=m), PROMPTS, SamplingConfig(),
                      max_new_tokens=8, max_depth=4, progress=False).save(path)
    assert json.loads(uni.with_suffix(".json").read_text())["drafter"]["min_ngram"] == 1
    cfg = TrainConfig(replay=str(uni), profile="cpu-2core")
    apply_replay_settings(cfg)
    assert cfg.drafter == "lookup" and cfg.lookup_min_ngram == 1
    with pytest.raises(ValueError, match="--lookup-min-ngram 2, but the traces .* were recorded with 1"):
        apply_replay_settings(TrainConfig(replay=str(uni), profile="cpu-2core", lookup_min_ngram=2))
    cfg = TrainConfig(replay=str(bi), profile="cpu-2core")
    apply_replay_settings(cfg)
    assert cfg.lookup_min_ngram == 2

    out = tmp_path / "run"
    train.run(None, TrainConfig(out=str(out), timesteps=64, n_steps=32, batch_size=16, n_epochs=1, net_arch=(8,),
                                wandb_mode="disabled", progress_bar=False, checkpoint_every=0, replay=str(uni),
                                profile="cpu-2core", eval_gammas=(0, 2)))
    pcfg = json.loads((out / "policy" / "policy_config.json").read_text())
    assert pcfg["lookup_min_ngram"] == 1 and pcfg["training"]["lookup_min_ngram"] == 1
    assert policy_lookup_min_ngram(out) == 1


def test_policies_that_predate_the_setting_read_as_the_default(tmp_path):
    import json
    import shutil

    from policies.layout import DEFAULT_POLICIES_DIR
    from policies.load import policy_lookup_min_ngram

    old = tmp_path / "lookup"  # the shipped lookup policy as written before the setting existed
    shutil.copytree(DEFAULT_POLICIES_DIR / "lookup", old)
    cfg = json.loads((old / "policy_config.json").read_text())
    cfg.pop("lookup_min_ngram")
    cfg["training"].pop("lookup_min_ngram")
    (old / "policy_config.json").write_text(json.dumps(cfg))
    assert policy_lookup_min_ngram(old) == 2
    assert policy_lookup_min_ngram(DEFAULT_POLICIES_DIR / "lookup") == 1  # trained with single-token matches
    assert policy_lookup_min_ngram(DEFAULT_POLICIES_DIR / "lookup+model-bfloat16") == 2
    assert policy_lookup_min_ngram(DEFAULT_POLICIES_DIR / "model") is None


def test_commands_refuse_a_bad_setting_before_loading_models(capsys):
    from eval.record import main as record_main

    assert record_main(["--drafter", "lookup", "--lookup-min-ngram", "7", "--target", "no-such-model"]) == 2
    assert "--lookup-min-ngram must be between 1 and 4" in capsys.readouterr().err
    assert record_main(["--drafter", "model", "--lookup-min-ngram", "1", "--target", "no-such-model"]) == 2
    assert "only applies to prompt lookup" in capsys.readouterr().err


def test_the_benchmark_runs_the_policys_setting(tmp_path):
    """eval.benchmark resolves the policy's n-gram setting before any model loads (every lookup row drafts with it),
    and --lookup-min-ngram overrides it with a warning."""
    from eval.benchmark import _resolve_policy, build_parser
    from policies.layout import DEFAULT_POLICIES_DIR

    policy = str(DEFAULT_POLICIES_DIR / "lookup")
    args = build_parser().parse_args(["--policy", policy])
    drafter, min_ngram = _resolve_policy(args)[3:6:2]
    assert drafter == "lookup" and min_ngram == 1  # the shipped policy matches single tokens
    assert args.drafter is None and args.lookup_min_ngram is None  # the parsed flags stay as given
    args = build_parser().parse_args(["--policy", policy, "--lookup-min-ngram", "2"])
    with pytest.warns(UserWarning, match="trained with 1"):
        assert _resolve_policy(args)[5] == 2
