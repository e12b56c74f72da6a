"""The ``learn2draft`` console script: every command behind it with one line in its overview, each command's help
under the name ``learn2draft <command>``, nothing imported but the chosen command's module, immune to a user's own
``train.py`` in the current folder; abbreviated flags refused; and docs/cli.md current with the parsers."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import tomllib

REPO = Path(__file__).resolve().parent.parent
SCRIPT = Path(sys.executable).with_name("learn2draft")


def test_the_console_script_is_registered():
    scripts = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["scripts"]
    assert scripts["learn2draft"] == "learn2draft.__main__:main"
    assert {"learn2draft-train", "learn2draft-eval", "learn2draft-generate"} <= set(scripts)  # the old ones stay


def test_the_overview_lists_every_command_with_one_line(capsys):
    from learn2draft.__main__ import COMMANDS, main

    assert main(["--help"]) == 0
    out = capsys.readouterr().out
    expected = {"generate", "train", "eval", "benchmark", "serve", "record", "profile", "oracle", "simreal",
                "acceptance", "export", "check", "head", "draft-model"}
    assert set(COMMANDS) == expected
    for name in expected:
        lines = [x for x in out.splitlines() if x.split()[:1] == [name]]
        assert len(lines) == 1 and len(lines[0].split()) > 2, (name, out)


@pytest.mark.parametrize("name", ["generate", "train", "eval", "benchmark", "serve", "record", "profile", "oracle",
                                  "simreal", "acceptance", "export", "check", "head", "draft-model"])
def test_each_commands_help_is_its_modules_under_the_learn2draft_name(name, capsys):
    from learn2draft.__main__ import main

    assert main([name, "--help"]) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"usage: learn2draft {name} "), out[:200]
    assert "python -m" not in out.splitlines()[0]


def test_an_unknown_command_is_one_error_with_the_nearest_name(capsys):
    from learn2draft.__main__ import main

    assert main(["trian", "--timesteps", "5"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("learn2draft: error:") and len(err.splitlines()) == 1 and "learn2draft train" in err


def test_the_overview_imports_no_command_module():
    code = ("import sys, io, contextlib\nfrom learn2draft.__main__ import main\n"
            "with contextlib.redirect_stdout(io.StringIO()): main(['--help'])\n"
            "print(sorted({m.split('.')[0] for m in sys.modules} & {'torch', 'transformers', 'train', 'eval', "
            "'policies', 'envs'}))")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd=REPO)
    assert r.returncode == 0 and r.stdout.strip() == "[]", r.stdout + r.stderr


@pytest.mark.parametrize("argv", [["--time", "5"], ["--timestep", "5"], ["--n-step", "8"]])
def test_train_refuses_an_abbreviated_flag(argv, capsys):
    """``--time 5`` was taken as ``--timesteps 5``; a prefix is now an unknown flag, before anything is loaded."""
    from train.__main__ import main

    with pytest.raises(SystemExit) as e:
        main(argv + ["--out", "/nonexistent/never-written"])
    assert e.value.code == 2
    assert f"unrecognized arguments: {argv[0]}" in capsys.readouterr().err


def test_every_commands_parser_refuses_abbreviations():
    from learn2draft.__main__ import COMMANDS, command_parser

    for name in COMMANDS:
        parser = command_parser(name)
        assert parser.allow_abbrev is False, name
        assert parser.prog == f"learn2draft {name}"


def test_run_cli_refuses_abbreviations_in_every_command_using_it(capsys):
    import argparse

    from learn2draft.cli import run_cli

    p = argparse.ArgumentParser(prog="x")
    p.add_argument("--timesteps", type=int)
    with pytest.raises(SystemExit):
        run_cli(p, lambda a: 0, ["--time", "5"])
    assert "unrecognized arguments: --time" in capsys.readouterr().err


@pytest.mark.skipif(not SCRIPT.is_file(), reason="the console script is not installed (pip install -e .)")
def test_the_console_script_is_immune_to_a_users_train_py(tmp_path):
    for name in ("train", "eval", "policies"):
        (tmp_path / f"{name}.py").write_text("print('THE USER CODE RAN')\nraise SystemExit(7)\n")
    r = subprocess.run([str(SCRIPT), "train", "--help"], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and "THE USER CODE RAN" not in r.stdout + r.stderr, r.stdout[-300:] + r.stderr[-1000:]
    assert r.stdout.startswith("usage: learn2draft train")


def test_python_m_train_names_learn2draft_train_when_shadowed(tmp_path):
    (tmp_path / "eval.py").write_text("print('THE USER CODE RAN')\n")
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    r = subprocess.run([sys.executable, "-m", "train", "--help"], cwd=tmp_path, env=env, capture_output=True,
                       text=True, timeout=60)
    err = r.stderr.strip()
    assert r.returncode == 2 and "THE USER CODE RAN" not in r.stdout + err
    assert err.startswith("error:") and "`learn2draft train`" in err and "eval.py" in err, err


def test_docs_cli_md_is_current_with_the_parsers():
    """docs/cli.md is rendered from the parsers: regenerate it with `python -m learn2draft.clidoc > docs/cli.md`."""
    from learn2draft.clidoc import render

    doc = REPO / "docs" / "cli.md"
    assert doc.is_file(), "docs/cli.md is missing: python -m learn2draft.clidoc > docs/cli.md"
    assert doc.read_text() == render(), "docs/cli.md is stale: run `python -m learn2draft.clidoc > docs/cli.md`"


def test_the_cli_reference_is_the_same_at_any_terminal_width_and_wandb_mode(monkeypatch):
    from learn2draft.clidoc import command_help

    monkeypatch.setenv("COLUMNS", "40")
    monkeypatch.setenv("WANDB_MODE", "disabled")
    narrow = command_help("train")
    monkeypatch.setenv("COLUMNS", "200")
    monkeypatch.delenv("WANDB_MODE")
    assert narrow == command_help("train") and os.environ["COLUMNS"] == "200"


def test_the_cli_reference_writes_checkout_paths_relative_even_where_argparse_wraps_them():
    """A clone at /tmp/fresh-review: a default path inside it was wrapped at the hyphen before the checkout prefix was
    removed, so docs/cli.md read stale in that clone only."""
    import argparse

    from learn2draft.clidoc import relative_help

    root = "/tmp/fresh-review/"
    for pad in range(0, 60, 3):  # wherever the wrap falls
        p = argparse.ArgumentParser(prog="learn2draft x")
        p.add_argument("--prompts", default=f"{root}train/recipes/data/distill_prompts.json",
                       help="x" * pad + " JSON list of distillation prompts (default: %(default)s)")
        text = relative_help(p, root)
        assert "fresh" not in text and "train/recipes/data/distill_prompts.json" in text.replace("\n", " "), text
