"""Every command's ``--help``: a help line for every option, each default shown once, no reST markup,
and an answer without importing torch; the flags every command shares (learn2draft.cli's groups) with
one name, default and help everywhere; the draft model loaded only where a command drafts with it."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent


def _parsers():
    from eval.__main__ import build_parser as eval_parser
    from eval.benchmark import build_parser as bench_parser
    from policies.generate import build_parser as generate_parser
    from train.__main__ import build_parser as train_parser
    from train.recipes.draft_model import build_parser as distill_parser

    return {"train": train_parser(), "eval": eval_parser(), "eval.benchmark": bench_parser(),
            "train.recipes.draft_model": distill_parser(), "policies.generate": generate_parser()}


@pytest.mark.parametrize("command", ["train", "eval", "eval.benchmark", "train.recipes.draft_model", "policies.generate"])
def test_every_option_has_a_help_line_and_shows_its_default_once(command):
    parser = _parsers()[command]
    fmt = parser._get_formatter()
    for action in parser._actions:
        if not action.option_strings or action.help == "show this help message and exit":
            continue
        assert action.help and action.help.strip(), f"{command} {action.option_strings[0]} has no help"
        shown = fmt._get_help_string(action)
        assert len(re.findall(r"\(default[: ]", shown)) <= 1, f"{command} {action.option_strings[0]}: {shown!r}"
    help_text = parser.format_help()
    assert not re.search(r"``|:(class|func|mod|meth|data|attr):`", help_text), help_text


@pytest.mark.parametrize("command", ["train", "eval", "eval.benchmark", "train.recipes.draft_model", "policies.generate"])
def test_help_answers_without_importing_torch(command):
    code = (f"import runpy, sys\nsys.argv = ['x', '--help']\ntry:\n    runpy.run_module({command!r}, run_name='__main__')\n"
            "except SystemExit:\n    pass\nprint('TORCH' if 'torch' in sys.modules else 'NO-TORCH', file=sys.stderr)")
    r = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert "usage:" in r.stdout and r.stderr.strip().endswith("NO-TORCH"), r.stderr


# ----------------------------------------------------------------------------- shared flags, built from the parsers
SAMPLING_COMMANDS = ("train", "eval", "eval.benchmark", "eval.record", "policies.generate")
ALL_COMMANDS = (*SAMPLING_COMMANDS, "eval.profile", "eval.simreal", "eval.oracle", "eval.tree_bench",
                "eval.acceptance")


def _parser(command: str):
    import importlib

    module = importlib.import_module("train.__main__" if command == "train" else
                                     "eval.__main__" if command == "eval" else command)
    return module.build_parser()


def _options(parser) -> dict:
    return {o: a for a in parser._actions for o in a.option_strings}


def test_every_sampling_command_takes_the_same_sampling_flags_with_the_same_defaults():
    """One flag per SamplingConfig field in every command that samples, each with the same option strings,
    type, default (the field's default) and help; eval.benchmark sweeps --temperatures instead of taking
    --temperature; parsing no flags gives the default SamplingConfig."""
    import dataclasses

    from learn2draft.cli import sampling_config
    from learn2draft.sampling import SamplingConfig

    fields = {f.name: f.default for f in dataclasses.fields(SamplingConfig)}
    seen = {}
    for command in SAMPLING_COMMANDS:
        parser = _parser(command)
        actions = {a.dest: a for a in parser._actions if a.dest in fields}
        expected = set(fields) - ({"temperature"} if command == "eval.benchmark" else set())
        assert set(actions) == expected, command
        for dest, a in actions.items():
            assert a.default == fields[dest] and type(a.default) is type(fields[dest]), (command, dest)
            spec = (tuple(a.option_strings), a.type, a.default, a.help)
            assert seen.setdefault(dest, spec) == spec, f"{command} defines {a.option_strings[0]} its own way"
        args = parser.parse_args(["x"] if command == "policies.generate" else [])
        assert sampling_config(args, temperature=0.0 if command == "eval.benchmark" else None) == SamplingConfig()
    assert "--temperatures" in _options(_parser("eval.benchmark"))


@pytest.mark.parametrize("flag", ["--target", "--draft", "--head", "--device", "--threads", "--dtype", "--tree-width",
                                  "--width", "--tree-top-k", "--drafter", "--profile", "--out"])
def test_shared_flags_are_one_definition(flag):
    """A shared flag has the same dest, type, choices, metavar and help in every command that takes it (the
    default too, except --drafter's, which names the command's drafter, and --out's help, which says what the
    command writes)."""
    specs = {}
    for command in ALL_COMMANDS:
        a = _options(_parser(command)).get(flag)
        if a is None:
            continue
        spec = {"dest": a.dest, "type": a.type, "choices": a.choices, "metavar": a.metavar, "default": a.default,
                "help": a.help}
        if flag == "--drafter" and command == "eval.profile":
            continue  # measures several drafters: a comma-separated list of the same names
        if flag == "--drafter":
            del spec["default"]
        if flag == "--out":
            del spec["help"]
        specs[command] = spec
    assert len(specs) >= 2, f"{flag} is shared by fewer than two commands"
    first = next(iter(specs.values()))
    assert all(spec == first for spec in specs.values()), specs


def test_device_auto_is_every_commands_default_and_resolves_to_this_machine():
    """--device defaults to auto everywhere; auto is cuda when this torch sees a GPU, else cpu (here: cpu on the
    CI machine); python -m train records the resolved device."""
    import torch

    from learn2draft.cli import resolve_device
    from train.__main__ import config_from_args

    here = "cuda" if torch.cuda.is_available() else "cpu"
    for command in ALL_COMMANDS:
        a = _options(_parser(command)).get("--device")
        if a is not None:
            assert a.default == "auto", command
    assert resolve_device("auto") == here and resolve_device("cpu") == "cpu"
    assert config_from_args(_parser("train").parse_args([])).device == here


def test_dtype_aliases_are_read_as_the_canonical_names():
    parser = _parser("eval.record")
    assert parser.parse_args(["--dtype", "bf16"]).dtype == "bfloat16"
    with pytest.raises(SystemExit):
        parser.parse_args(["--dtype", "float8"])


@pytest.mark.parametrize("command, argv, loads_draft", [
    ("policies.generate", ["hi", "--num-draft-tokens", "2"], False),  # lookup, the default drafter
    ("policies.generate", ["hi", "--num-draft-tokens", "2", "--drafter", "head"], False),
    ("policies.generate", ["hi", "--num-draft-tokens", "2", "--drafter", "model"], True),
    ("eval.record", ["--drafter", "lookup"], False),
    ("eval.record", ["--drafter", "model"], True),
    ("eval.profile", ["--drafter", "head,lookup"], False),
    ("eval.profile", ["--drafter", "lookup,model"], True),
    ("eval", ["--drafter", "lookup"], False),
    ("eval.benchmark", ["--drafter", "lookup"], True),  # the Hugging Face assisted rows draft with it
    ("train", ["--drafter", "lookup"], False),
    ("train", ["--drafter", "model"], True),
])
def test_the_draft_model_loads_only_where_it_drafts(command, argv, loads_draft, tmp_path, monkeypatch, capsys):
    import importlib

    import learn2draft.models

    seen = []

    def fake_load_pair(target, draft, device="cpu", dtype=None):
        seen.append(draft)
        raise ValueError("stop: models would load here")

    monkeypatch.setattr(learn2draft.models, "load_pair", fake_load_pair)
    monkeypatch.setattr(learn2draft.models, "resolve_model_source", lambda name: (name, None))
    out = [] if command == "policies.generate" else [
        "--out", str(tmp_path / ("out.npz" if command == "eval.record" else "out.json" if command == "eval.profile"
                                 else "out"))]
    if command == "train":
        from train.__main__ import main

        with pytest.raises(SystemExit) as e:
            main([*argv, *out, "--wandb-mode", "disabled"])
        assert e.value.code == 2
    else:
        main = importlib.import_module("eval.__main__" if command == "eval" else command).main
        assert main([*argv, *out]) == 2
    assert "stop: models would load here" in capsys.readouterr().err
    assert len(seen) == 1 and (seen[0] is not None) == loads_draft, seen


def test_console_scripts_name_an_existing_entry_point():
    """Each ``[project.scripts]`` entry of pyproject.toml (``learn2draft-generate`` among them) names a
    module of this checkout and a callable in it, so the installed script starts."""
    import importlib

    tomllib = pytest.importorskip("tomllib")  # Python ≥ 3.11
    scripts = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["scripts"]
    assert "learn2draft-generate" in scripts
    for name, target in scripts.items():
        module, _, func = target.partition(":")
        mod = importlib.import_module(module)
        assert Path(mod.__file__).resolve().is_relative_to(REPO), f"{name} = {target!r}: {mod.__file__} is not in {REPO}"
        assert callable(getattr(mod, func, None)), f"{name} = {target!r}"


@pytest.mark.parametrize("command, script, shadow", [("train", "learn2draft train", "eval"),
                                                     ("eval", "learn2draft eval", "policies")])
def test_a_users_file_shadowing_a_package_is_one_clear_error(tmp_path, command, script, shadow):
    """``python -m train`` puts the current folder first on sys.path: a user's own eval.py there (or policies.py for
    ``python -m eval``) would be imported instead of this project's package. The command says so and names the
    console script, which is not shadowed."""
    import os

    (tmp_path / f"{shadow}.py").write_text("print('THE USER CODE RAN')\n")
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    r = subprocess.run([sys.executable, "-m", command, "--help"], cwd=tmp_path, env=env, capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 2 and "THE USER CODE RAN" not in r.stdout + r.stderr, r.stdout[-500:] + r.stderr[-2000:]
    err = r.stderr.strip()
    assert err.startswith("error:") and len(err.splitlines()) == 1 and script in err and f"{shadow}.py" in err, err


def test_progress_off_a_terminal_is_plain_lines_and_a_bar_on_one():
    import io

    from learn2draft.cli import LineProgress, progress

    log = io.StringIO()
    with progress(total=3, desc="train", unit="timesteps", stream=log, min_interval=0.0) as bar:
        assert isinstance(bar, LineProgress)
        for _ in range(3):
            bar.update(1)
            bar.set_postfix(reward=1.5)
    lines = log.getvalue().splitlines()
    assert "\r" not in log.getvalue() and len(lines) == 3 and lines[0].startswith("train: 1/3 timesteps (33%)")
    assert lines[-1].startswith("train: 3/3 timesteps (100%)") and "reward=1.5" in lines[-1]
    quiet = io.StringIO()
    bar = progress(range(100), desc="x", stream=quiet, min_interval=3600.0)
    assert list(bar) == list(range(100))  # the first and the last line only, within the interval
    assert [line.split(" ")[1] for line in quiet.getvalue().splitlines()] == ["1/100", "100/100"]

    class Tty(io.StringIO):
        def isatty(self):
            return True

    assert not isinstance(progress(total=2, desc="y", stream=Tty()), LineProgress)  # tqdm's bar on a terminal
    silent = io.StringIO()
    list(progress(range(3), desc="z", stream=silent, enabled=False))
    assert silent.getvalue() == ""
