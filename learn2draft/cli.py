"""What every command line shares: a ``--help`` formatter that shows each default once, plain
text from reST docstrings, and the W&B credentials check made before any work (no torch import
here, so ``--help`` answers at once)."""

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


def check_wandb(mode: str) -> None:
    """Raise ValueError, before anything is written or computed, when ``mode`` is ``"online"`` and no
    W&B credentials are configured (``WANDB_API_KEY`` or ``wandb login``). Offline / disabled: no check."""
    if mode != "online":
        return
    import os

    import wandb

    # An explicit --wandb-mode online overrides $WANDB_MODE (wandb.init(mode=...) does too); with
    # WANDB_MODE=disabled in the environment wandb.login() would return without checking anything.
    saved = os.environ.pop("WANDB_MODE", None)
    try:
        wandb.login(verify=False)
    except Exception as e:  # wandb.errors.UsageError: "No API key configured"
        raise ValueError(f"--wandb-mode online needs W&B credentials ({e}): run `wandb login` or set "
                         "WANDB_API_KEY, or use --wandb-mode offline and upload later with `wandb sync`.") from None
    finally:
        if saved is not None:
            os.environ["WANDB_MODE"] = saved


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


__all__ = ["HelpFormatter", "check_wandb", "plain_doc", "run_cli"]
