"""The command-line reference, ``docs/cli.md``, rendered from the parsers themselves: ``learn2draft --help`` and every
command's ``learn2draft <command> --help``. Regenerate it after changing a flag::

    python -m learn2draft.clidoc > docs/cli.md

(a test fails when the file is stale). The help is rendered at a fixed width (:data:`WIDTH` columns) with the
environment variables that change a default (``WANDB_MODE``) unset, and paths inside the checkout written relative to
it, so the text is the same on every machine and clone.
"""

from __future__ import annotations

import contextlib
import os
import sys

#: The terminal width the help is rendered at (argparse reads ``$COLUMNS``).
WIDTH = 100

#: Environment variables that some parsers read for a default; unset while rendering.
_ENV_DEFAULTS = ("WANDB_MODE", "WANDB_PROJECT")


@contextlib.contextmanager
def _fixed_environment():
    saved = {k: os.environ.get(k) for k in ("COLUMNS", *_ENV_DEFAULTS)}
    os.environ["COLUMNS"] = str(WIDTH)
    for k in _ENV_DEFAULTS:
        os.environ.pop(k, None)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def command_help(name: str) -> str:
    """The ``--help`` text of ``learn2draft <name>`` at :data:`WIDTH` columns (imports the command's module).

    Raises:
        KeyError: ``name`` is not a command of :data:`learn2draft.__main__.COMMANDS`.
    """
    from pathlib import Path

    from learn2draft.__main__ import command_parser

    root = str(Path(__file__).resolve().parent.parent) + os.sep  # defaults inside the checkout: relative to it
    with _fixed_environment():  # the parser reads some defaults (WANDB_MODE) from the environment when it is built
        return relative_help(command_parser(name), root)


def relative_help(parser, root: str) -> str:
    """``parser``'s help at :data:`WIDTH` columns with ``root`` (a folder path ending in a separator) removed from its
    defaults and help texts *before* argparse wraps them (a wrapped path, split at a hyphen, no longer matches)."""
    for action in parser._actions:
        if isinstance(action.default, str):
            action.default = action.default.replace(root, "")
        if isinstance(action.help, str):
            action.help = action.help.replace(root, "")
    with _fixed_environment():
        text = parser.format_help()
    return text.replace(root, "")


def render() -> str:
    """The whole reference (Markdown): the overview of ``learn2draft --help``, then each command's help in a text
    block under its own heading, in the order of :data:`learn2draft.__main__.COMMANDS`."""
    from learn2draft.__main__ import COMMANDS, overview

    parts = ["# Command-line reference", "",
             "Generated from the parsers by `python -m learn2draft.clidoc > docs/cli.md`; do not edit by hand. Every "
             "command is also `python -m <module>` with the same flags.", "",
             "```text", overview().rstrip(), "```", ""]
    for name, cmd in COMMANDS.items():
        parts += [f"## learn2draft {name}", "", f"{cmd.summary[0].upper()}{cmd.summary[1:]}. Also "
                  f"`python -m {cmd.module.removesuffix('.__main__')}`.", "",
                  "```text", command_help(name).rstrip(), "```", ""]
    return "\n".join(parts)


def main(argv: list[str] | None = None) -> int:
    """Print :func:`render` on standard output; returns 0."""
    sys.stdout.write(render())
    return 0


if __name__ == "__main__":
    sys.exit(main())
