"""Start-up of a command, cold and warm: the seconds from starting ``learn2draft generate`` (by default
``learn2draft generate "Name three colours." --max-new-tokens 8``) in a fresh process to the first generated text on
its standard output, and to its exit. Cold: an empty model cache (``$LEARN2DRAFT_CACHE`` set to a new temporary
folder, so the embedded GGUF is converted); warm: the same cache, run ``--warm`` times. Prints the runs side by side.
Run alone on the machine (another process on the same cores slows every start-up):

    .venv/bin/python eval/scripts/startup_bench.py
    .venv/bin/python eval/scripts/startup_bench.py --warm 3 -- generate "Hello" --max-new-tokens 4
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

DEFAULT_COMMAND = ["generate", "Name three colours.", "--max-new-tokens", "8"]


def learn2draft_command() -> list[str]:
    """The ``learn2draft`` console script beside this Python (a virtual environment's ``bin``), else
    ``python -m learn2draft``."""
    script = Path(sys.executable).with_name("learn2draft")
    return [str(script)] if script.is_file() else [sys.executable, "-m", "learn2draft"]


def time_run(argv: list[str], cache: Path) -> dict:
    """Run ``argv`` with ``$LEARN2DRAFT_CACHE=cache`` and unbuffered output; return the seconds to the first
    non-blank byte of standard output (``first_token_s``; None if it printed nothing), to its exit (``total_s``),
    and its exit status (``rc``). Its standard error is kept (``stderr``, the last lines) for a failed run."""
    env = {**os.environ, "LEARN2DRAFT_CACHE": str(cache), "PYTHONUNBUFFERED": "1"}
    t0 = time.perf_counter()
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)
    first = None
    out = b""
    while True:
        chunk = os.read(proc.stdout.fileno(), 1)
        if not chunk:
            break
        out += chunk
        if first is None and chunk.strip():
            first = time.perf_counter() - t0
        if first is not None:
            out += proc.stdout.read()
            break
    err = proc.stderr.read()
    rc = proc.wait()
    return {"first_token_s": first, "total_s": time.perf_counter() - t0, "rc": rc,
            "stdout": out.decode(errors="replace"), "stderr": "\n".join(err.decode(errors="replace").splitlines()[-5:])}


def main(argv: list[str] | None = None) -> int:
    """Measure and print; returns 0, or 1 when a run failed (its standard error is printed)."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    ap.add_argument("--warm", type=int, default=2, help="warm runs after the cold one (default 2)")
    ap.add_argument("command", nargs="*", help=f"the learn2draft command and flags (default: {' '.join(DEFAULT_COMMAND)})")
    a = ap.parse_args(argv)
    cmd = learn2draft_command() + (a.command or DEFAULT_COMMAND)
    cache = Path(tempfile.mkdtemp(prefix="learn2draft-startup-"))
    try:
        runs = [("cold", time_run(cmd, cache))] + [(f"warm {i + 1}", time_run(cmd, cache)) for i in range(a.warm)]
    finally:
        shutil.rmtree(cache, ignore_errors=True)
    print(f"command: {' '.join(cmd)}")
    print(f"{'run':<8} {'first token (s)':>16} {'exit (s)':>9}")
    failed = False
    for name, r in runs:
        ft = f"{r['first_token_s']:.2f}" if r["first_token_s"] is not None else "-"
        print(f"{name:<8} {ft:>16} {r['total_s']:>9.2f}")
        if r["rc"] != 0:
            failed = True
            print(f"  exit status {r['rc']}: {r['stderr']}", file=sys.stderr)
    warm = [r["first_token_s"] for name, r in runs[1:] if r["first_token_s"] is not None]
    if warm:
        print(f"cold {runs[0][1]['first_token_s'] or float('nan'):.2f} s vs warm {min(warm):.2f} s (best of "
              f"{len(warm)}) to the first token")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
