"""What every command line shares: a ``--help`` formatter that shows each default once, plain
text from reST docstrings, and one error line instead of a traceback for bad input (no torch
import here, so ``--help`` answers at once). The W&B credentials check is training's:
:func:`train.wandb_setup.check_wandb`."""

from __future__ import annotations

import argparse
import re
import sys


class HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """Keep the description's line breaks, and append ``(default: …)`` to an option's help unless
    the help already says its default, or there is none worth showing (None; an on/off flag)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if ("default" in text or action.default is None or isinstance(action.default, bool)
                or action.default == argparse.SUPPRESS or not action.option_strings):
            return text
        return f"{text} (default: %(default)s)" if text else "(default: %(default)s)"


def plain_doc(text: str | None) -> str:
    """A docstring as plain text for ``--help``: ````x```` → x, ``:func:`x``` → x, ``**x**`` → x."""
    text = text or ""
    text = re.sub(r":[a-z]+:`~?([^`]+)`", r"\1", text)
    text = re.sub(r"``([^`]+)``", r"\1", text)
    return re.sub(r"\*\*([^*]+)\*\*", r"\1", text)


def run_cli(parser: argparse.ArgumentParser, run, argv: list[str] | None) -> int:
    """Parse ``argv`` and call ``run(args)``; bad input (ValueError, OSError, RuntimeError)
    becomes one ``error:`` line on stderr and exit code 2 instead of a traceback, and Ctrl-C one
    ``interrupted`` line and exit code 130 (files are written whole or not at all by the commands)."""
    args = parser.parse_args(argv)
    try:
        return run(args)
    except (ValueError, OSError, RuntimeError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"{parser.prog}: interrupted (Ctrl-C) before it finished; nothing more was written.", file=sys.stderr)
        return 130


__all__ = ["HelpFormatter", "plain_doc", "run_cli"]
