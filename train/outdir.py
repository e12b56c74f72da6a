"""A training run's output directory: what a run writes there (:data:`RUN_ITEMS`), what it holds
(:func:`run_state`), whether it may receive a run (:func:`prepare_out_dir`), the newest checkpoint to
resume from (:func:`latest_checkpoint`) and the replacement of an earlier run's results (:class:`Replacement`).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import zipfile
from fnmatch import fnmatchcase
from pathlib import Path

from policies.layout import CHECK_FILE, EXPORT_FILES
from train.config import read_run_config

RESULT_FILES = ("config.json", "model.zip", "metrics.json", "policy")


#: Everything a run writes into ``out`` (``--overwrite`` replaces these; W&B's ``wandb/`` is kept).
RUN_ITEMS = (*RESULT_FILES, "feature_spec.json", "checkpoints", "logs", "eval",
             "size_model.zip", "size_policy", "tree.json")  # the last three: tree runs (train.tree)


#: The files a run (and ``python -m eval`` on it) writes inside the folders of :data:`RUN_ITEMS`, as glob patterns
#: relative to ``out`` (tree runs keep one sub-folder per phase in ``checkpoints/`` and ``logs/``).
#: ``--overwrite`` refuses to replace a run whose folders hold anything else (:func:`foreign_files`).
RUN_OWN_FILES = (
    *(f"{d}/{name}" for d in ("policy", "size_policy") for name in (*EXPORT_FILES, CHECK_FILE)),
    "checkpoints/ppo_*_steps.zip", "checkpoints/*/ppo_*_steps.zip",
    # a checkpoint being written when the run was killed (train.phases.save_model renames it once whole)
    "checkpoints/.ppo_*_steps.zip.partial", "checkpoints/*/.ppo_*_steps.zip.partial",
    "logs/progress*.csv", "logs/*/progress*.csv",
    "eval/results.md", "eval/results.json", "eval/results.png",
)
#: Where :class:`Replacement` keeps the run being replaced until the new one has saved a model.
REPLACED_DIR = ".replaced"


def foreign_files(out: str | Path) -> list[str]:
    """The files inside the run folders of ``out`` (``policy/``, ``checkpoints/``, ``logs/``, ``eval/``, …) that a
    run did not write (:data:`RUN_OWN_FILES`): a user's notes, a hand-picked checkpoint. Paths relative to
    ``out``, sorted."""
    out = Path(out)
    found = []
    for name in RUN_ITEMS:
        if (out / name).is_dir():
            found += [p.relative_to(out).as_posix() for p in (out / name).rglob("*") if not p.is_dir()]
    return sorted(f for f in found if not any(fnmatchcase(f, pat) for pat in RUN_OWN_FILES))


def latest_checkpoint(out: Path) -> tuple[Path, int] | None:
    """The newest whole ``checkpoints/ppo_<steps>_steps.zip`` of the run in ``out`` and its step count; a file that
    is not a zip archive (truncated by a kill while an older version wrote it in place) is passed over."""
    found = []
    for p in (Path(out) / "checkpoints").glob("ppo_*_steps.zip"):
        m = re.fullmatch(r"ppo_(\d+)_steps\.zip", p.name)
        if m and zipfile.is_zipfile(p):
            found.append((int(m.group(1)), p))
    if not found:
        return None
    steps, path = max(found)
    return path, steps


def run_state(out: str | Path) -> str:
    """What ``out`` holds: ``"new"`` (absent or no results of a run), ``"complete"`` (a finished run),
    ``"interrupted"`` (a run stopped by a signal or a kill: no ``metrics.json``, or one saying
    ``interrupted``), ``"foreign"`` (result-like files that :func:`run` did not write, e.g. a model's
    ``config.json``) or ``"file"`` (not a directory)."""
    out = Path(out)
    if out.exists() and not out.is_dir():
        return "file"
    if not out.is_dir() or not any((out / name).exists() for name in RUN_ITEMS):
        return "new"
    if read_run_config(out) is None:
        return "foreign"
    try:
        metrics = json.loads((out / "metrics.json").read_text())
    except (OSError, ValueError):
        return "interrupted"
    return "interrupted" if metrics.get("interrupted") else "complete"


def prepare_out_dir(out: str | Path, overwrite: bool = False, resume: bool = False) -> Path:
    """Check that ``out`` may receive a run, create it and test that it is writable. Deletes nothing.

    ``out`` may be new (or hold no results), or — with ``overwrite`` — an earlier training run (its
    results are replaced by :func:`run` only once the new run has loaded and warmed up, see
    :class:`Replacement`), or — with ``resume`` — a run to continue.

    Raises:
        FileExistsError: ``out`` is a file; holds files that ``python -m train`` did not write (never
            replaced, even with ``overwrite``: a foreign ``config.json``, or files inside the run's folders that are
            not :data:`RUN_OWN_FILES`, listed); holds a finished run and not ``overwrite``; holds an
            interrupted run and neither ``resume`` nor ``overwrite`` (the message says ``--resume``, and names
            ``.replaced/`` when a killed overwrite left the earlier run there); ``overwrite`` while ``.replaced/``
            holds such an earlier run (it would be deleted).
        FileNotFoundError: ``resume`` but ``out`` holds no training run.
        PermissionError: ``out`` cannot be created or written (message names the path).
    """
    out = Path(out)
    state = run_state(out)
    if state == "file":
        raise FileExistsError(f"--out {out} exists and is not a directory: choose another path.")
    if state == "foreign":
        found = [name for name in RUN_ITEMS if (out / name).exists()]
        raise FileExistsError(
            f"{out} holds files that python -m train did not write ({', '.join(found)}; its config.json is not a "
            "training run's): refusing to use or replace them; choose another --out."
        )
    if resume and state == "new":
        raise FileNotFoundError(f"--resume: {out} holds no training run to continue: start one without --resume.")
    aside = out / REPLACED_DIR
    kept = (f" The run it was replacing is kept in {aside}/ (that overwrite was killed before the new run saved a "
            f"model): --resume deletes it once the resumed run saves one, --overwrite refuses while it is there; "
            f"move it out of {out} to keep it.") if aside.is_dir() else ""
    if state == "interrupted" and not (resume or overwrite):
        ckpt = latest_checkpoint(out)
        where = f"last checkpoint at {ckpt[1]} timesteps" if ckpt else "no checkpoint yet"
        raise FileExistsError(f"{out} holds an interrupted run ({where}): pass --resume to continue it, "
                              f"or --overwrite to start over.{kept}")
    if overwrite and state in ("complete", "interrupted"):
        if aside.is_dir():
            raise FileExistsError(f"{aside}/ holds the run an earlier --overwrite was replacing when it was killed: "
                                  f"--overwrite would delete it. Move it out of {out} (to keep it) or delete it, then "
                                  "run again; or pass --resume to continue the interrupted new run.")
        foreign = foreign_files(out)
        if foreign:
            shown = ", ".join(foreign[:10]) + (f" and {len(foreign) - 10} more" if len(foreign) > 10 else "")
            raise FileExistsError(f"--overwrite would delete files in {out} that python -m train did not write: "
                                  f"{shown}. Move them out of {out}, or choose another --out.")
    if state == "complete" and not (overwrite or resume):
        found = [name for name in RESULT_FILES if (out / name).exists()]
        raise FileExistsError(
            f"{out} already holds results ({', '.join(found)}): pass --overwrite to replace them, "
            "or choose another --out."
        )
    try:
        out.mkdir(parents=True, exist_ok=True)
        probe = out / f".write-test-{os.getpid()}"
        probe.write_text("ok")
        probe.unlink()
    except OSError as e:
        raise PermissionError(f"Cannot write to output directory {out}: {e.strerror or e}.") from None
    return out


class Replacement:
    """Replace a run directory's results without ever leaving it with neither the old nor the new run.

    :meth:`begin` (called once everything that can fail early has passed) moves the earlier run's
    :data:`RUN_ITEMS` into ``out/.replaced/``; :meth:`commit` (once the new run has saved a model)
    deletes them; :meth:`rollback` (the new run failed or was interrupted before that) removes what
    the new run wrote and puts the earlier results back. A run killed in between leaves the earlier
    results in ``.replaced/`` and the new run resumable with ``--resume``, which commits them away.
    """

    def __init__(self, out: Path, overwrite: bool, resume: bool) -> None:
        self.out, self.overwrite, self.resume = out, overwrite, resume
        self.aside = out / REPLACED_DIR
        self.committed = False

    def begin(self) -> None:
        if not self.overwrite:
            return
        # A .replaced/ left by a killed earlier replacement holds that earlier run: prepare_out_dir refuses to
        # overwrite while it is there, and mkdir fails rather than deleting it.
        self.aside.mkdir()
        for name in RUN_ITEMS:
            if (self.out / name).exists():
                os.replace(self.out / name, self.aside / name)

    def commit(self) -> None:
        self.committed = True
        if self.aside.exists():
            shutil.rmtree(self.aside)

    def rollback(self) -> None:
        if self.committed or self.resume:
            return
        for name in RUN_ITEMS:
            path = self.out / name
            if path.is_dir():
                shutil.rmtree(path)
            else:
                path.unlink(missing_ok=True)
        if self.aside.exists():
            for item in self.aside.iterdir():
                os.replace(item, self.out / item.name)
            self.aside.rmdir()


__all__ = ["REPLACED_DIR", "RESULT_FILES", "RUN_ITEMS", "RUN_OWN_FILES", "Replacement", "foreign_files",
           "latest_checkpoint", "prepare_out_dir", "run_state"]
