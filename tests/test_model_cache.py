"""The converted-model cache (learn2draft.model_cache): where it lives, an entry built once and reused, a damaged or
partial entry rebuilt with one line on standard error, a failed conversion leaving nothing, and the real target's
logits from the cache equal to those of the GGUF file itself."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from learn2draft import model_cache


def _fake_gguf(tmp_path: Path, data: bytes = b"GGUF fake weights") -> Path:
    f = tmp_path / "src" / "m.gguf"
    f.parent.mkdir(parents=True, exist_ok=True)
    f.write_bytes(data)
    return f


def _converter(calls: list):
    def convert(folder: Path) -> None:
        calls.append(folder)
        (folder / "model.safetensors").write_bytes(b"w" * 1000)
        (folder / "config.json").write_text('{"a": 1}')
    return convert


def test_cache_root_follows_the_environment(monkeypatch, tmp_path):
    monkeypatch.setenv("LEARN2DRAFT_CACHE", str(tmp_path / "c"))
    assert model_cache.cache_root() == tmp_path / "c"
    monkeypatch.setenv("LEARN2DRAFT_CACHE", "off")
    assert model_cache.cache_root() is None
    monkeypatch.delenv("LEARN2DRAFT_CACHE")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert model_cache.cache_root() == tmp_path / "xdg" / "learn2draft"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert model_cache.cache_root() == tmp_path / "home" / ".cache" / "learn2draft"


def test_the_tests_never_write_into_the_users_home_cache():
    root = model_cache.cache_root()
    assert root is not None and not str(root).startswith(str(Path.home() / ".cache")), root


def test_an_entry_is_built_once_keyed_by_the_files_hash_and_reused(monkeypatch, tmp_path, capsys):
    monkeypatch.setenv("LEARN2DRAFT_CACHE", str(tmp_path / "cache"))
    src, calls = _fake_gguf(tmp_path), []
    a = model_cache.cached_dir(src, _converter(calls))
    b = model_cache.cached_dir(src, _converter(calls))
    assert capsys.readouterr().err.count("converting m.gguf once") == 1  # said once, when it converts
    assert a == b and len(calls) == 1 and model_cache.entry_is_whole(a, deep=True)
    import hashlib

    assert a.name.startswith(hashlib.sha256(src.read_bytes()).hexdigest())
    manifest = json.loads((a / model_cache.MANIFEST).read_text())
    assert set(manifest["files"]) == {"model.safetensors", "config.json"}
    assert not [p for p in a.parent.iterdir() if p.name.startswith(".")], "no temporary folder is left"
    src.write_bytes(b"GGUF other weights, another size")  # another file: another entry
    c = model_cache.cached_dir(src, _converter(calls))
    assert c != a and len(calls) == 2


def test_the_hash_is_remembered_by_path_size_and_mtime(monkeypatch, tmp_path):
    root = tmp_path / "cache"
    src = _fake_gguf(tmp_path)
    first = model_cache.file_hash(src, root)
    import learn2draft.model_cache as mc

    monkeypatch.setattr(mc, "_sha256", lambda path: pytest.fail("hashed again"))
    assert model_cache.file_hash(src, root) == first
    monkeypatch.undo()
    src.write_bytes(b"changed")
    assert model_cache.file_hash(src, root) != first


@pytest.mark.parametrize("damage", ["truncate", "remove_file", "remove_manifest", "bad_manifest"])
def test_a_damaged_or_partial_entry_is_rebuilt_with_one_line(monkeypatch, tmp_path, capsys, damage):
    monkeypatch.setenv("LEARN2DRAFT_CACHE", str(tmp_path / "cache"))
    src, calls = _fake_gguf(tmp_path), []
    entry = model_cache.cached_dir(src, _converter(calls))
    capsys.readouterr()
    if damage == "truncate":
        (entry / "model.safetensors").write_bytes(b"w" * 10)
    elif damage == "remove_file":
        (entry / "config.json").unlink()
    elif damage == "remove_manifest":
        (entry / model_cache.MANIFEST).unlink()
    else:
        (entry / model_cache.MANIFEST).write_text("{not json")
    again = model_cache.cached_dir(src, _converter(calls))
    err = capsys.readouterr().err.strip().splitlines()
    assert again == entry and len(calls) == 2 and model_cache.entry_is_whole(entry, deep=True)
    assert len(err) == 1 and "damaged or incomplete" in err[0], err


def test_a_failed_conversion_leaves_nothing_in_the_cache(monkeypatch, tmp_path):
    monkeypatch.setenv("LEARN2DRAFT_CACHE", str(tmp_path / "cache"))
    src = _fake_gguf(tmp_path)

    def broken(folder: Path) -> None:
        (folder / "model.safetensors").write_bytes(b"half")
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        model_cache.cached_dir(src, broken)
    models_dir = tmp_path / "cache" / "models"
    assert not models_dir.exists() or not any(models_dir.iterdir())


def test_an_unwritable_cache_falls_back_to_the_gguf_file_with_one_line(monkeypatch, tmp_path, capsys):
    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    monkeypatch.setenv("LEARN2DRAFT_CACHE", str(blocker / "cache"))
    assert model_cache.cached_dir(_fake_gguf(tmp_path), _converter([])) is None
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "cannot write the model cache" in err[0]


def test_an_entry_that_does_not_load_is_converted_again(monkeypatch, tmp_path, capsys, tiny_pair):
    """Sizes intact, bytes damaged (the manifest check passes): the load fails, the entry is rebuilt once."""
    from transformers import AutoModelForCausalLM

    from learn2draft import models

    monkeypatch.setenv("LEARN2DRAFT_CACHE", str(tmp_path / "cache"))
    src = _fake_gguf(tmp_path)
    calls = []

    def convert(s, g, folder):
        calls.append(folder)
        tiny_pair.target.save_pretrained(str(folder))

    monkeypatch.setattr(models, "convert_gguf", convert)
    m = models._from_gguf_cache(str(src.parent), src.name, AutoModelForCausalLM.from_pretrained)
    assert m is not None and len(calls) == 1
    entry = calls[0].parent / model_cache.entry_dir(Path("x"), model_cache.file_hash(src)).name
    weights = entry / "model.safetensors"
    weights.write_bytes(b"\xff" * weights.stat().st_size)
    capsys.readouterr()
    m = models._from_gguf_cache(str(src.parent), src.name, AutoModelForCausalLM.from_pretrained)
    err = [x for x in capsys.readouterr().err.splitlines() if x.startswith("learn2draft:")]  # (not the fake's bars)
    assert m is not None and len(calls) == 2 and len(err) == 1 and "does not load" in err[0], err


@pytest.mark.slow
def test_the_cached_target_gives_the_logits_of_the_gguf_file(monkeypatch, tmp_path):
    """The embedded target converted and reloaded from the cache: the same tokenizer and the same fp32 logits as
    transformers' own GGUF load, and a second load does not convert again."""
    import torch

    from learn2draft import models
    from learn2draft.names import DEFAULT_TARGET

    monkeypatch.setenv("LEARN2DRAFT_CACHE", "off")
    direct, direct_tok = models.load_model(DEFAULT_TARGET), models.load_tokenizer(DEFAULT_TARGET)
    monkeypatch.setenv("LEARN2DRAFT_CACHE", str(tmp_path / "cache"))
    cached = models.load_model(DEFAULT_TARGET)
    monkeypatch.setattr(models, "convert_gguf", lambda *a: pytest.fail("converted twice"))
    cached_tok = models.load_tokenizer(DEFAULT_TARGET)
    text = "Name three colours. def fib(n): return n if n < 2 else fib(n - 1) + fib(n - 2)  ünïcødé"
    ids = direct_tok(text, return_tensors="pt").input_ids
    assert torch.equal(ids, cached_tok(text, return_tensors="pt").input_ids)
    assert direct_tok.get_vocab() == cached_tok.get_vocab()
    assert getattr(direct_tok, "chat_template", None) == getattr(cached_tok, "chat_template", None)
    with torch.no_grad():
        a, b = direct(ids).logits, cached(ids).logits
    assert torch.equal(a, b), (a - b).abs().max()
    assert os.listdir(tmp_path / "cache" / "models")
