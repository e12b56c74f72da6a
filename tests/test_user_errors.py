"""What a new user trips over (issue 18 item 4): damaged model, draft and head files, malformed ``--random-weights``
configs and bad command-line input each give one clear error that names the file or flag and says what to do —
no traceback, nothing of the user's lost. Tiny models only (tests/conftest.py)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from conftest import tiny_llama

from learn2draft.drafters.head import DraftHead, check_head_dir, head_llama_config
from learn2draft.models import ModelLoadError, load_model, load_tokenizer, resolve_model_source


def _damage(path, how: str) -> None:
    """Damage the file ``path`` as a user's copy gets damaged."""
    data = path.read_bytes()
    if how == "truncated":
        path.write_bytes(data[: len(data) // 2])
    elif how == "garbage":
        path.write_bytes(bytes((7 * i + 3) % 256 for i in range(len(data))))
    elif how == "empty":
        path.write_bytes(b"")
    elif how == "list":
        path.write_text("[1, 2]")
    elif how == "wrong type":
        fields = json.loads(data)
        fields["hidden_size"] = "big"
        path.write_text(json.dumps(fields))
    elif how == "no model_type":
        fields = json.loads(data)
        del fields["model_type"]
        path.write_text(json.dumps(fields))
    else:
        raise AssertionError(how)


@pytest.fixture
def model_copy(tiny_model_dirs, tmp_path):
    """A copy of the tiny target's model directory, free to damage."""
    dst = tmp_path / "target"
    shutil.copytree(tiny_model_dirs[0], dst)
    return dst


# ----------------------------------------------------------------------------- damaged target / draft model files
@pytest.mark.parametrize("file,how", [("model.safetensors", "truncated"), ("model.safetensors", "garbage"),
                                      ("model.safetensors", "empty"), ("config.json", "truncated"),
                                      ("config.json", "empty"), ("config.json", "list"), ("config.json", "wrong type"),
                                      ("config.json", "no model_type")])
def test_a_damaged_model_file_is_named_before_any_loading(model_copy, file, how):
    _damage(model_copy / file, how)
    with pytest.raises(ModelLoadError) as e:
        resolve_model_source(str(model_copy))  # the cheap check the commands run before the slow loading
    msg = str(e.value)
    assert str(model_copy / file) in msg and ("download" in msg or "save_pretrained" in msg)
    for load in (load_tokenizer, load_model):  # the loaders raise the same one error, not a library traceback
        with pytest.raises(ModelLoadError, match=file):
            load(str(model_copy))


def test_a_damaged_weight_index_is_named(model_copy):
    (model_copy / "model.safetensors.index.json").write_text('{"weight_map": ')
    with pytest.raises(ModelLoadError, match="model.safetensors.index.json"):
        resolve_model_source(str(model_copy))


def test_a_file_that_is_not_gguf_is_named(tmp_path):
    bad = tmp_path / "model.gguf"
    bad.write_text("not a gguf file")
    with pytest.raises(ModelLoadError, match="is not a GGUF file"):
        resolve_model_source(str(bad))


def test_generate_reports_a_damaged_draft_as_one_error_line(tiny_model_dirs, tmp_path, capsys):
    from policies.generate import main

    draft = tmp_path / "draft"
    shutil.copytree(tiny_model_dirs[1], draft)
    _damage(draft / "model.safetensors", "truncated")
    rc = main(["--target", tiny_model_dirs[0], "--draft", str(draft), "--drafter", "model", "--num-draft-tokens", "2",
               "--no-chat", "--max-new-tokens", "2", "w1"])
    err = capsys.readouterr().err
    assert rc != 0 and "Traceback" not in err
    assert f"{draft / 'model.safetensors'} is damaged" in err


# ----------------------------------------------------------------------------- damaged head directories
@pytest.fixture
def head_dir(tiny_tok, tmp_path):
    target = tiny_llama(len(tiny_tok), 0, device="cpu")
    head = DraftHead(head_llama_config(target.config), torch.arange(3, len(tiny_tok), 2)).attach_target(target)
    head.save(tmp_path / "head", extra={"target": "tiny"}, dtype=torch.float32)
    return tmp_path / "head"


@pytest.mark.parametrize("file,how", [("head.safetensors", "truncated"), ("head.safetensors", "garbage"),
                                      ("head.safetensors", "empty"), ("config.json", "truncated"),
                                      ("config.json", "list")])
def test_a_damaged_head_file_is_named(head_dir, file, how):
    _damage(head_dir / file, how)
    for check in (check_head_dir, DraftHead.load):
        with pytest.raises(ModelLoadError) as e:
            check(head_dir)
        assert str(head_dir / file) in str(e.value) and "train.recipes.head" in str(e.value)


@pytest.mark.parametrize("llama_config", [[1], {"hidden_size": "x"}, None])
def test_an_odd_head_config_is_named(head_dir, llama_config):
    meta = json.loads((head_dir / "config.json").read_text())
    if llama_config is None:
        del meta["llama_config"]
    elif isinstance(llama_config, dict):
        meta["llama_config"].update(llama_config)
    else:
        meta["llama_config"] = llama_config
    (head_dir / "config.json").write_text(json.dumps(meta))
    with pytest.raises(ModelLoadError, match="llama_config"):
        DraftHead.load(head_dir)


def test_generate_checks_the_head_before_loading_the_target(tiny_model_dirs, head_dir, capsys, monkeypatch):
    import learn2draft.models
    from policies.generate import main

    def no_loading(*a, **k):
        raise AssertionError("a model was loaded before the head was checked")

    monkeypatch.setattr(learn2draft.models, "load_model", no_loading)
    _damage(head_dir / "head.safetensors", "truncated")
    rc = main(["--target", tiny_model_dirs[0], "--drafter", "head", "--head", str(head_dir), "--num-draft-tokens", "2",
               "--no-chat", "w1"])
    err = capsys.readouterr().err
    assert rc != 0 and "Traceback" not in err and "was loaded" not in err
    assert f"{head_dir / 'head.safetensors'} is damaged" in err


# ----------------------------------------------------------------------------- --random-weights configs
GOOD_SHAPE = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
                  num_key_value_heads=2, vocab_size=64, max_position_embeddings=128)


@pytest.mark.parametrize("change,field", [
    ({"hidden_size": "32"}, "hidden_size"), ({"hidden_size": 32.5}, "hidden_size"), ({"hidden_size": -32}, "hidden_size"),
    ({"hidden_size": None}, "hidden_size"), ({"num_hidden_layers": 0}, "num_hidden_layers"),
    ({"num_hidden_layers": True}, "num_hidden_layers"), ({"num_attention_heads": 0}, "num_attention_heads"),
    ({"num_attention_heads": 5}, "num_attention_heads"), ({"num_key_value_heads": 3}, "num_key_value_heads"),
    ({"intermediate_size": -1}, "intermediate_size"), ({"vocab_size": 0}, "vocab_size"),
    ({"vocab_size": "64"}, "vocab_size"), ({"max_position_embeddings": -1}, "max_position_embeddings"),
    ({"head_dim": 0}, "head_dim"), ({"model_type": "nonsense"}, "model_type"), ({"model_type": 5}, "model_type"),
    ({"rope_parameters": "x"}, "rope_parameters"), ({"hidden_size": "drop"}, "no hidden_size")])
def test_a_malformed_random_weights_config_names_its_field(tmp_path, change, field):
    from eval.shapes import random_model, shape_config

    fields = {**GOOD_SHAPE, **change}
    fields = {k: v for k, v in fields.items() if v != "drop"}
    f = tmp_path / "config.json"
    f.write_text(json.dumps(fields))
    with pytest.raises(ValueError, match=field) as e:
        shape_config(str(f))
    assert str(f) in str(e.value)
    with pytest.raises(ValueError, match=field):
        random_model(str(f))


def test_a_good_random_weights_config_builds(tmp_path):
    from eval.shapes import random_model

    f = tmp_path / "config.json"
    f.write_text(json.dumps(GOOD_SHAPE))
    assert random_model(str(f)).config.hidden_size == 32
    f.write_text(json.dumps({"model_type": "gpt2", "n_embd": 32, "n_layer": 1, "n_head": 4, "vocab_size": 64}))
    assert random_model(str(f)).config.hidden_size == 32  # GPT-2's names for the sizes


@pytest.mark.parametrize("content", [b"", b"{hidden_size: 32", bytes(range(256)), b"[1, 2]", b"{}"])
def test_a_random_weights_file_that_is_no_config_is_named(tmp_path, content):
    from eval.shapes import shape_config

    f = tmp_path / "config.json"
    f.write_bytes(content)
    with pytest.raises(ValueError, match=str(f)):
        shape_config(str(f))


# ----------------------------------------------------------------------------- bad flags and output paths
def test_absurd_thread_and_seed_counts_name_their_flag():
    import argparse

    from learn2draft.cli import sampling_config, threads_of

    with pytest.raises(ValueError, match="--threads 100000"):
        threads_of(argparse.Namespace(threads=100000))
    with pytest.raises(ValueError, match="--seed"):
        sampling_config(argparse.Namespace(seed=10**23, temperature=0.0))
    assert sampling_config(argparse.Namespace(seed=-1, temperature=0.0)).greedy  # a negative seed still works


def test_generate_refuses_a_huge_seed_before_loading(tiny_model_dirs, capsys):
    from policies.generate import main

    rc = main(["--target", tiny_model_dirs[0], "--drafter", "lookup", "--num-draft-tokens", "2", "--seed", str(10**23),
               "w1"])
    err = capsys.readouterr().err
    assert rc == 2 and "--seed" in err and "Overflow" not in err


def test_a_folder_without_a_policy_is_named(tmp_path):
    from policies.load import policy_drafter

    with pytest.raises(FileNotFoundError, match="holds no policy"):
        policy_drafter(tmp_path)


def test_record_refuses_max_depth_0_and_a_json_out_that_names_an_existing_trace(tmp_path, capsys):
    from eval.record import main

    prompts = tmp_path / "p.json"
    prompts.write_text('["w1 w2"]')
    assert main(["--max-depth", "0", "--prompts", str(prompts), "--out", str(tmp_path / "t.npz")]) == 2
    assert "--max-depth must be ≥ 1" in capsys.readouterr().err
    (tmp_path / "t.npz").write_bytes(b"a user's trace")
    (tmp_path / "t.json").write_text("{}")
    assert main(["--prompts", str(prompts), "--out", str(tmp_path / "t.json")]) == 2  # the header's name: same trace
    assert "already holds a trace" in capsys.readouterr().err
    assert (tmp_path / "t.npz").read_bytes() == b"a user's trace" and not (tmp_path / "t.json.npz").exists()
    assert main(["--prompts", str(prompts), "--out", str(tmp_path)]) == 2  # a folder: not "<folder>.npz" beside it
    assert "is a directory" in capsys.readouterr().err


@pytest.mark.parametrize("flags,message", [(["--repeats", "0"], "--repeats must be ≥ 1"),
                                           (["--seed", "-1"], "--seed must be ≥ 0"),
                                           (["--json", "DIR"], "--json .* is a directory"),
                                           (["--json", "FILE/x.json"], "--json .*cannot write there")])
def test_oracle_checks_its_flags_before_reading_the_traces(tmp_path, capsys, flags, message):
    from eval.oracle import main

    (tmp_path / "FILE").write_text("a user's file")
    flags = [f.replace("DIR", str(tmp_path)).replace("FILE", str(tmp_path / "FILE")) for f in flags]
    assert main(["--profile", "cpu-2core", str(tmp_path / "no-traces.npz"), *flags]) == 2
    import re

    assert re.search(message, capsys.readouterr().err)
    assert (tmp_path / "FILE").read_text() == "a user's file"


def test_simreal_and_profile_check_their_output_before_any_work(tmp_path, capsys):
    from eval.profile import main as profile_main
    from eval.simreal import main as simreal_main

    (tmp_path / "file").write_text("x")
    assert simreal_main(["--profile", "cpu-2core", str(tmp_path / "no-traces.npz"), "--json",
                         str(tmp_path / "file" / "r.json")]) == 2
    assert "--json" in capsys.readouterr().err  # not the missing traces: the output is checked first
    assert profile_main(["--target", str(tmp_path / "no-model"), "--out", str(tmp_path)]) == 2
    assert f"--out {tmp_path} is a directory" in capsys.readouterr().err
    # before any model is built (the target does not exist: loading it would fail with another message)
    assert profile_main(["--target", str(tmp_path / "no-model"), "--tokens", "2,4"]) == 2
    assert "--tokens must include 1" in capsys.readouterr().err
    assert profile_main(["--target", str(tmp_path / "no-model"), "--name", "cpu-2core",
                         "--out", str(tmp_path / "p.json")]) == 2
    err = capsys.readouterr().err
    assert "--name cpu-2core is a shipped profile's name" in err and not (tmp_path / "p.json").exists()
    for name in ("CPU-2CORE", "cpu-2core.json"):  # the same shipped name, spelt otherwise
        assert profile_main(["--target", str(tmp_path / "no-model"), "--name", name]) == 2
        assert "is a shipped profile's name" in capsys.readouterr().err
    assert profile_main(["--target", str(tmp_path / "no-model"), "--name", " "]) == 2
    assert "--name is empty" in capsys.readouterr().err
    assert profile_main(["--target", str(tmp_path / "no-model"), "--tokens", "1,,2"]) == 2
    assert "--tokens '1,,2'" in capsys.readouterr().err
    earlier = tmp_path / "earlier.json"
    earlier.write_text("{}")
    assert profile_main(["--target", str(tmp_path / "no-model"), "--out", str(earlier)]) == 2
    assert "exists (an earlier profile): pass --overwrite" in capsys.readouterr().err and earlier.read_text() == "{}"


@pytest.mark.parametrize("module,argv,words", [
    ("eval.record", ["--tree", "--verify-sizes", "1,,4"], "--verify-sizes '1,,4': expected comma-separated integers"),
    ("eval.record", ["--tree", "--verify-sizes", "1,4,"], "--verify-sizes '1,4,': expected comma-separated integers"),
    ("eval.record", ["--prompt-split", "train,,heldout"], "--prompt-split 'train,,heldout': empty item; use one"),
    ("eval.record", ["--prompt-split", "train,"], "--prompt-split 'train,': empty item"),
    ("eval.simreal", ["--profile", "cpu-2core", "t.npz", "--gammas", "0,,2"], "--gammas '0,,2': expected comma-"),
    ("eval.simreal", ["--profile", "cpu-2core", "a.npz,,b.npz"], "traces 'a.npz,,b.npz': empty item"),
    ("eval.oracle", ["--profile", "cpu-2core", "a.npz,"], "traces 'a.npz,': empty item"),
    ("eval.acceptance", ["--traces", "a.npz,,b.npz", "--heldout", "c.npz"], "--traces 'a.npz,,b.npz': empty item"),
    ("eval.acceptance", ["--traces", "a.npz", "--heldout", "c.npz,"], "--heldout 'c.npz,': empty item"),
    ("eval.acceptance", ["--traces", "a.npz", "--heldout", "c.npz", "--sets", "draft,,target"],
     "--sets 'draft,,target': empty item"),
    ("eval.serve", ["--device", "cpu", "--sim-traces", "a.npz,,b.npz"], "--sim-traces 'a.npz,,b.npz': empty item"),
    ("eval.serve", ["--device", "cpu", "--methods", "nospec,,fixed"], "--methods 'nospec,,fixed': empty item"),
    ("eval.profile", ["--target", "no-model", "--drafter", "model,,lookup"], "--drafter 'model,,lookup': empty item"),
    ("eval.gpu_check", ["--dry-run", "--skip", "loop,"], "--skip 'loop,': empty item"),
    ("train", ["--replay", "a.npz,,b.npz", "--profile", "cpu-2core"], "--replay 'a.npz,,b.npz': empty item"),
    ("train", ["--replay", "a.npz", "--profile", "cpu-2core,"], "--profile 'cpu-2core,': empty item"),
    ("train", ["--prompt-split", "train,,heldout"], "--prompt-split 'train,,heldout': empty item"),
    ("train", ["--net-arch", "64,,64"], "argument --net-arch: expected comma-separated integers, got '64,,64'"),
    ("train", ["--eval-gammas", "0,2,"], "argument --eval-gammas: expected comma-separated integers, got '0,2,'"),
    ("train", ["--tree", "--policies", "depth,,size"], "argument --policies: expected names joined by single commas"),
    ("train", ["--tree", "--verify-sizes", "1,2,,4"], "argument --verify-sizes: expected comma-separated integers"),
])
def test_an_empty_item_in_a_comma_list_names_its_flag_before_anything_loads(module, argv, words, tmp_path, capsys,
                                                                           monkeypatch):
    """``1,,4`` or a trailing comma is refused (not read as ``1,4``): one error naming the flag, before any model,
    trace or profile is read and before anything is written."""
    import importlib

    import learn2draft.models

    for name in ("load_pair", "load_model", "check_device"):  # gpu_check's first step past its flags: check_device
        monkeypatch.setattr(learn2draft.models, name, lambda *a, **k: pytest.fail("went past the flags"))
    monkeypatch.chdir(tmp_path)  # the commands' default outputs would land here
    if module == "train":
        module, argv = "train.__main__", [*argv, "--wandb-mode", "disabled"]
    try:
        rc = importlib.import_module(module).main(argv)
    except SystemExit as e:  # python -m train exits through its parser
        rc = e.code
    err = capsys.readouterr().err
    assert rc == 2 and words in err and "Traceback" not in err, err
    assert sum("error" in line for line in err.splitlines()) == 1, err  # one error line (argparse adds its usage)
    assert list(tmp_path.iterdir()) == []  # nothing written


def test_comma_lists_without_empty_items_parse_as_before():
    """The lists the shared splitter now reads: blanks around items, ``--traces a.npz, b.npz`` and empty defaults
    are read as before."""
    from eval.acceptance import _trace_files
    from learn2draft.cli import comma_items
    from learn2draft.replay.latency import load_profiles
    from train.__main__ import _int_list, _name_list
    from train.config import TrainConfig, serve_loads

    assert comma_items(" a.npz , b.npz ", "--replay") == ["a.npz", "b.npz"] and comma_items(" ") == []
    with pytest.raises(ValueError, match=r"^--replay 'a,,b': empty item; join them\.$"):
        comma_items("a,,b", "--replay", "join them")
    assert _trace_files(["a.npz,", "b.npz"], "--traces") == ["a.npz", "b.npz"]  # "--traces a.npz, b.npz"
    assert _trace_files(["a.npz,b.npz", "c.npz"], "--traces") == ["a.npz", "b.npz", "c.npz"]
    assert _int_list("64,64") == (64, 64) and _int_list("") == () and _name_list("depth,size") == ("depth", "size")
    assert serve_loads("1,2, 4") == [1, 2, 4]
    assert [p.name for p in load_profiles("cpu-2core,gpu-like")] == ["cpu-2core", "gpu-like"]
    TrainConfig(prompt_split="train,copy_train").validate()
    with pytest.raises(ValueError, match="prompt_split must be one or more"):
        TrainConfig(prompt_split="").validate()


@pytest.mark.parametrize("flag,value,field", [("--ent-coef", "nan", "ent_coef"), ("--clip-range", "0", "clip_range"),
                                              ("--seed", str(10**23), "seed")])
def test_train_refuses_bad_ppo_settings_before_anything_is_written(tiny_model_dirs, tmp_path, capsys, flag, value, field):
    from train.__main__ import main

    out = tmp_path / "run"
    with pytest.raises(SystemExit) as e:
        main(["--target", tiny_model_dirs[0], "--drafter", "lookup", flag, value, "--out", str(out),
              "--wandb-mode", "disabled"])
    assert e.value.code == 2 and f"error: {flag} must be" in capsys.readouterr().err  # the error names the flag
    assert not out.exists()


def test_train_leaves_no_empty_out_folder_when_loading_fails(tiny_model_dirs, tmp_path, capsys, monkeypatch):
    import learn2draft.models
    from train.__main__ import main

    def fail(*a, **k):
        raise ModelLoadError("cannot load (test)")

    monkeypatch.setattr(learn2draft.models, "load_pair", fail)
    out = tmp_path / "run"
    with pytest.raises(SystemExit):
        main(["--target", tiny_model_dirs[0], "--drafter", "lookup", "--out", str(out), "--wandb-mode", "disabled"])
    assert "cannot load (test)" in capsys.readouterr().err
    assert not out.exists()
    out.mkdir()  # a folder the user made is left alone
    with pytest.raises(SystemExit):
        main(["--target", tiny_model_dirs[0], "--drafter", "lookup", "--out", str(out), "--wandb-mode", "disabled"])
    assert out.is_dir()


def test_resume_names_a_damaged_run_config_instead_of_saying_there_is_no_run(tmp_path, capsys):
    from train.__main__ import main

    out = tmp_path / "run"
    out.mkdir()
    (out / "config.json").write_text('{"env_id": "learn2draft/Spec')  # cut short
    (out / "model.zip").write_bytes(b"a user's model")
    with pytest.raises(SystemExit) as e:
        main(["--out", str(out), "--resume"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and "config.json is damaged" in err and "without --resume" not in err
    assert (out / "model.zip").read_bytes() == b"a user's model"


def test_a_gguf_file_cut_short_is_named_with_what_to_do(tmp_path):
    bad = tmp_path / "model.gguf"
    bad.write_bytes(b"GGUF" + bytes(range(64)))  # starts as a GGUF file does, then stops
    with pytest.raises(ModelLoadError, match=f"{bad} may be damaged or cut short"):
        load_tokenizer(str(bad))


def test_a_trace_header_or_a_path_without_npz_gets_the_file_to_pass(tmp_path, tiny_pair):
    from learn2draft.drafters import make_drafter
    from learn2draft.replay.traces import load_traces
    from learn2draft.sampling import SamplingConfig
    from learn2draft.traces import record_traces

    path = record_traces(tiny_pair, make_drafter("lookup", tiny_pair), ["w1 w2 w1 w2"], SamplingConfig(),
                         max_new_tokens=6, max_depth=2, progress=False).save(tmp_path / "t.npz")
    assert len(load_traces(path)) == 1  # the .npz itself loads
    with pytest.raises(ValueError, match=r"JSON header .* pass the trace itself: .*t\.npz"):
        load_traces(tmp_path / "t.json")
    with pytest.raises(FileNotFoundError, match=r"did you mean .*t\.npz"):
        load_traces(tmp_path / "t")
    with pytest.raises(FileNotFoundError, match=r"--out .*other\.npz"):
        load_traces(tmp_path / "other")


def test_a_prompt_too_long_is_named_by_its_number(tiny_pair):
    from eval.runner import encode_all

    with pytest.raises(ValueError, match=r"prompt 2 of 2 \('w1 w1"):
        encode_all(tiny_pair, ["w1 w2", " ".join(["w1"] * 600)], max_new_tokens=8)


def test_resume_continues_a_finished_run_from_its_final_model(tmp_path, tiny_pair):
    """A finished run that saved no checkpoint (--checkpoint-every 0) is extended from its final model, not trained
    again from step 0; a run with neither a checkpoint nor a final model is refused."""
    import json

    from test_replay import linear_profile

    import train
    from learn2draft.drafters import make_drafter
    from learn2draft.sampling import SamplingConfig
    from learn2draft.traces import record_traces
    from train.config import TrainConfig

    prof = linear_profile().save(tmp_path / "p.json")
    path = record_traces(tiny_pair, make_drafter("lookup", tiny_pair), ["w1 w2 w1 w2 w1", "w3 w4 w3 w4"],
                         SamplingConfig(), max_new_tokens=8, max_depth=2, progress=False).save(tmp_path / "t.npz")
    cfg = TrainConfig(out=str(tmp_path / "run"), timesteps=64, n_steps=32, batch_size=32, n_epochs=1, net_arch=(8,),
                      wandb_mode="disabled", progress_bar=False, checkpoint_every=0, replay=str(path),
                      profile=str(prof), eval_prompts=0)
    train.run(None, cfg)
    more = TrainConfig.from_run(tmp_path / "run")
    more.timesteps = 96
    m = train.run(None, more)
    assert m["resumed_from_timesteps"] == 64 and m["timesteps"] == 96
    (tmp_path / "run" / "model.zip").unlink()
    (tmp_path / "run" / "metrics.json").unlink()
    with pytest.raises(ValueError, match="no checkpoint and no finished model"):
        train.run(None, TrainConfig.from_run(tmp_path / "run"))
    assert json.loads((tmp_path / "run" / "config.json").read_text())["max_depth"] == 2  # the run's config is kept


def test_an_out_folder_created_for_a_failed_run_is_removed_at_exit(tmp_path):
    import subprocess
    import sys

    out = tmp_path / "new" / "eval"
    code = ("import sys; from pathlib import Path; from eval.__main__ import make_out_dir; "
            f"make_out_dir(Path({str(out)!r})); sys.exit(2)")
    subprocess.run([sys.executable, "-c", code], check=False, cwd=str(Path(__file__).resolve().parent.parent))
    assert not out.exists()  # created, then found empty at exit: removed
    kept = tmp_path / "kept"
    kept.mkdir()
    code = ("from pathlib import Path; from eval.__main__ import make_out_dir; "
            f"make_out_dir(Path({str(kept)!r}))")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=str(Path(__file__).resolve().parent.parent))
    assert kept.is_dir()  # there before: never removed


def test_random_weights_profiles_resolve_auto_on_the_run_device_threads_and_widths(tmp_path, monkeypatch):
    """eval.profile --random-weights resolves --dtype auto as load_models does: on --device, at the run's threads and
    forward widths (its largest --batch-sizes, at the default depth the commands that use a profile draft to), not
    with the CPU defaults."""
    import torch

    import eval.shapes
    import learn2draft.models as models
    from eval.profile import main

    asked, built = [], []

    class Built(Exception):
        pass

    def fake_fastest(device, threads=None, rows=(1, 9)):
        asked.append((str(device), threads, tuple(rows)))
        return "bfloat16"

    def fake_pair(shape, drafters, device, dtype, **kw):
        built.append(dtype)
        raise Built

    monkeypatch.setattr(models, "fastest_dtype", fake_fastest)
    monkeypatch.setattr(eval.shapes, "random_pair", fake_pair)
    f = tmp_path / "config.json"
    f.write_text(json.dumps(GOOD_SHAPE))
    before = torch.get_num_threads()
    try:
        with pytest.raises(Built):
            main(["--random-weights", str(f), "--drafter", "lookup", "--device", "cpu", "--threads", "1",
                  "--batch-sizes", "1,4", "--tokens", "1,3", "--out", str(tmp_path / "p.json")])
    finally:
        torch.set_num_threads(before)  # the command set 1 thread
    from learn2draft.names import DEFAULT_MAX_DEPTH

    assert built == [torch.bfloat16] and asked == [("cpu", 1, models.forward_rows(4, DEFAULT_MAX_DEPTH))]


def test_a_precision_warning_is_one_line_on_a_command(capsys):
    """A command's PrecisionMismatchWarning prints as one ``warning:`` line, not Python's file:line + source line."""
    import argparse
    import warnings

    from learn2draft.cli import run_cli
    from learn2draft.control import PrecisionMismatchWarning

    def run(args):
        warnings.warn("policy X was trained in bfloat16 and now runs in float32", PrecisionMismatchWarning, stacklevel=1)
        return 0

    with warnings.catch_warnings():
        warnings.simplefilter("always")
        before = warnings.showwarning
        assert run_cli(argparse.ArgumentParser(prog="x"), run, []) == 0
        assert warnings.showwarning is before  # restored after the command
    err = capsys.readouterr().err
    assert err == "warning: policy X was trained in bfloat16 and now runs in float32\n"


@pytest.mark.parametrize("command, name", [("eval.__main__", "results.json"), ("eval.benchmark", "benchmark.md")])
def test_eval_and_benchmark_keep_an_earlier_runs_results_unless_overwrite(tmp_path, capsys, monkeypatch, command,
                                                                         name):
    """An --out that holds an earlier run's results is refused before any model loads (as record, profile, serve and
    train do); the earlier file is untouched; --overwrite lets the run go on (to the model load, stopped here)
    without the earlier results."""
    import importlib

    import learn2draft.cli as cli_mod

    main = importlib.import_module(command).main
    out = tmp_path / "earlier"
    out.mkdir()
    (out / name).write_text("an earlier run")
    args = ["--drafter", "lookup", "--device", "cpu", "--dtype", "float32", "--out", str(out)]

    class Reached(Exception):
        pass

    def no_load(*a, **k):
        raise Reached("the model load was reached")

    monkeypatch.setattr(cli_mod, "load_models", no_load)
    assert main(args) == 2
    err = capsys.readouterr().err
    assert f"--out {out} holds the results of an earlier run ({name})" in err and "--overwrite" in err
    assert (out / name).read_text() == "an earlier run"
    with pytest.raises(Reached):
        main([*args, "--overwrite"])
    # --overwrite removes the earlier results when the run starts (before the model load), so that none of them
    # (a plot this run does not draw, say) is later read or reported as this run's
    assert not (out / name).exists() and out.is_dir()
