"""``learn2draft <command> [flags]``: every command of the project behind one console script.

Each command is the module that ``python -m <module>`` runs, with the same parser and flags; only the chosen
command's module is imported (``learn2draft --help`` answers at once). The console script imports the installed
packages whatever the current folder holds, so a user's own ``train.py`` or ``eval.py`` there cannot replace this
project's ``train`` or ``eval`` (``python -m train`` puts the current folder first on ``sys.path``).

The table :data:`COMMANDS` names modules by string: this engine package imports none of the layers above it
(train, eval, policies) at import time; the dispatcher imports the one a user asks for when it runs.
"""

from __future__ import annotations

import sys
from typing import NamedTuple


class Command(NamedTuple):
    """One subcommand: the module whose ``main(argv)`` runs it (and whose ``build_parser()`` builds its parser) and
    the one line ``learn2draft --help`` shows."""

    module: str
    summary: str


#: Every ``learn2draft`` subcommand, in the order ``learn2draft --help`` lists them.
COMMANDS: dict[str, Command] = {
    "generate": Command("policies.generate", "speculative decoding of one prompt, streamed as it is generated"),
    "train": Command("train.__main__", "train a PPO draft-depth policy (live or on recorded traces) and export it"),
    "eval": Command("eval.__main__", "compare a learned policy with the best fixed γ, and check the output law"),
    "benchmark": Command("eval.benchmark", "this project against plain and assisted Hugging Face generation, in one run"),
    "serve": Command("eval.serve", "speculation under load: many requests sharing one target forward per step"),
    "record": Command("eval.record", "record drafting traces for the replay environment"),
    "profile": Command("eval.profile", "measure a latency profile of this machine for the replay environment"),
    "oracle": Command("eval.oracle", "how far a depth policy is from the best possible one, in replay"),
    "simreal": Command("eval.simreal", "the replay's predicted tokens/s next to the real loop's measured tokens/s"),
    "acceptance": Command("eval.acceptance", "which features predict that a drafted token is accepted, on held-out traces"),
    "export": Command("policies.export", "re-export a training run's policy (ONNX, feature spec, check vectors)"),
    "check": Command("policies.check", "check a policy export against its parity vectors"),
    "head": Command("train.recipes.head", "train an EAGLE-style draft head on the target's hidden states"),
    "draft-model": Command("train.recipes.draft_model", "distil a small draft model for any Hugging Face causal LM target"),
}

PROG = "learn2draft"


def overview() -> str:
    """The text of ``learn2draft --help``: usage, then every command with its one line."""
    width = max(len(n) for n in COMMANDS)
    lines = [f"usage: {PROG} <command> [flags]   ({PROG} <command> --help for the command's flags)", "",
             "One console script for every command of learn2draft (each is also `python -m <module>`).", "",
             "commands:"]
    lines += [f"  {name:<{width}}  {cmd.summary}" for name, cmd in COMMANDS.items()]
    return "\n".join(lines) + "\n"


def command_module(name: str):
    """Import and return the module of command ``name`` (see :data:`COMMANDS`).

    Raises:
        KeyError: ``name`` is not a command.
    """
    import importlib

    return importlib.import_module(COMMANDS[name].module)


def command_parser(name: str):
    """The ``argparse.ArgumentParser`` of command ``name``, as ``learn2draft <name>`` uses it (its ``prog`` is
    ``learn2draft <name>``; abbreviated flags refused).

    Raises:
        KeyError: ``name`` is not a command.
    """
    from learn2draft import cli

    parser = command_module(name).build_parser()
    cli.set_command_prog(f"{PROG} {name}")
    try:
        return cli.prepare_parser(parser)
    finally:
        cli.set_command_prog(None)


def main(argv: list[str] | None = None) -> int:
    """Run ``learn2draft <command> [flags]``: the command's ``main`` with the remaining arguments, under the program
    name ``learn2draft <command>``. Returns its exit status; 2 with one ``error:`` line for an unknown command,
    0 after ``--help`` (or no arguments: the overview, exit status 2)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv:
        sys.stderr.write(overview())
        return 2
    name, rest = argv[0], argv[1:]
    if name in ("-h", "--help", "help"):
        if name == "help" and rest and rest[0] in COMMANDS:
            return main([rest[0], "--help"])
        sys.stdout.write(overview())
        return 0
    if name not in COMMANDS:
        import difflib

        close = difflib.get_close_matches(name, list(COMMANDS), n=1)
        hint = f" (did you mean `{PROG} {close[0]}`?)" if close else ""
        print(f"{PROG}: error: unknown command {name!r}{hint}; the commands are: {', '.join(COMMANDS)} "
              f"(`{PROG} --help` says what each does).", file=sys.stderr)
        return 2
    from learn2draft import cli

    cli.set_command_prog(f"{PROG} {name}")
    try:
        status = command_module(name).main(rest)
    except SystemExit as e:  # argparse's --help and usage errors
        code = e.code
        if isinstance(code, str):  # sys.exit("message")
            print(code, file=sys.stderr)
        return code if isinstance(code, int) else (0 if code is None else 1)
    finally:
        cli.set_command_prog(None)
    return int(status or 0)


if __name__ == "__main__":
    sys.exit(main())
