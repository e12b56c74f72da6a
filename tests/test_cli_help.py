"""Every command's ``--help``: a help line for every option, each default shown once, no reST markup,
and an answer without importing torch."""

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
    from train.recipes.draft_model import build_parser as distill_parser
    from policies.generate import build_parser as generate_parser
    from train.__main__ import build_parser as train_parser

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
