"""The settings a command runs with, resolved once, after its flags are parsed (and its policy read):
:class:`RunSettings` — the device, the precision (``auto`` measured once, at the command's own forward widths),
the torch threads, those widths, the model pair, the drafter and prompt lookup's n-gram. A command builds it with
:meth:`RunSettings.resolve` from explicit values (its own flags, its policy's settings) and passes it on: to
:func:`learn2draft.cli.load_models`, to the report header, to its measurement loops. Nothing downstream reads or
writes another command's flags.

Also here, because the resolution needs them and they need nothing above the engine: :func:`resolve_device`,
:func:`run_threads` and :func:`forward_widths`. No torch import at module level (``--help`` stays instant).
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterable
from dataclasses import dataclass

from learn2draft.names import DEFAULT_DRAFT, DEFAULT_MAX_DEPTH, DEFAULT_TARGET

#: ``--threads`` above this many per CPU core is refused (100 000 threads fail to allocate their stacks).
MAX_THREADS_PER_CORE = 8


def largest_int(value) -> int | None:
    """The largest int of a flag's value: an int, a comma-separated list of ints, a range ``a-b`` (its end), or a
    list of any of these; None when absent (None), a bool, or unreadable (``"1,x"``: the command's own check names
    the flag and says why)."""
    if value is None or isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value
    if isinstance(value, (list, tuple)):
        return max((v for v in (largest_int(x) for x in value) if v is not None), default=None)
    try:
        ints = [int(v) for v in re.split(r"[,-]", str(value)) if v.strip()]
    except ValueError:
        return None
    return max(ints) if ints else None


def forward_widths(batch=None, depths: Iterable = ()) -> tuple[int, int]:
    """The target forward widths of a run, what ``--dtype auto`` is measured at
    (:func:`learn2draft.models.forward_rows`): ``(B, B · (D + 1))`` tokens, a decode step and a full verification.

    Args:
        batch: the run's largest batch B (sequences decoded at once): an int or a flag value read by
            :func:`largest_int` (``"1,2,16"`` → 16); None → 1.
        depths: the depths the run drafts to (tokens of a chain; a tree's verification sizes count as depths), each
            an int, a flag value or None (not given); the largest is D, else
            :data:`learn2draft.names.DEFAULT_MAX_DEPTH`. The caller passes only the flags its run uses (e.g. the
            tree's ``--verify-sizes`` only with ``--tree``).

    Returns:
        ``(rows of a decode step, rows of a full verification)``.
    """
    from learn2draft.models import forward_rows

    b = largest_int(batch)
    found = [d for d in (largest_int(x) for x in depths) if d is not None]
    return forward_rows(1 if b is None else b, max(found) if found else DEFAULT_MAX_DEPTH)


def run_threads(threads: int | None, trained_with: int | None = None) -> int:
    """The torch CPU threads a run computes on: ``threads`` (``--threads``), else ``trained_with`` (its policy's
    training setting), else 1.

    Raises:
        ValueError: ``threads`` < 1, or more than :data:`MAX_THREADS_PER_CORE` per CPU core (naming ``--threads``).
    """
    if threads is not None and threads < 1:
        raise ValueError(f"--threads must be ≥ 1, got {threads}.")
    cores = os.cpu_count() or 1
    if threads is not None and threads > MAX_THREADS_PER_CORE * cores:
        raise ValueError(f"--threads {threads}: this machine has {cores} CPU core(s); pass at most "
                         f"{MAX_THREADS_PER_CORE * cores} (usually {cores}, one per core).")
    return int(threads or trained_with or 1)


def resolve_device(name: str | None, check: bool = True) -> str:
    """The device of ``--device``: ``auto`` (or None) is ``"cuda"`` when this torch can use a GPU, else
    ``"cpu"`` (:func:`learn2draft.models.default_device`); any other name is kept.

    Raises:
        learn2draft.ModelLoadError: naming ``--device``: the name is not a torch device; with ``check``, also a
            device that is unavailable here.
    """
    from learn2draft import models

    device = models.default_device() if name in (None, "auto") else name
    try:
        if check:
            models.check_device(device)
        else:  # the name must still be a torch device (``--device bogus`` is an error even where nothing loads)
            import torch

            try:
                torch.device(device)
            except (RuntimeError, TypeError):
                raise models.ModelLoadError(f"Unknown device {device!r}: use cpu, cuda, cuda:N or mps.") from None
    except models.ModelLoadError as e:  # the error names the flag it came from
        raise models.ModelLoadError(f"--device {name}: {e}") from None
    return device


@dataclass(frozen=True)
class RunSettings:
    """What a command runs with, resolved once (:meth:`resolve`); frozen: a later step cannot change what an
    earlier one measured or recorded.

    Attributes:
        device: the torch device (``"cpu"``, ``"cuda"``, ``"cuda:1"``, ``"mps"``), never ``"auto"``.
        dtype: the canonical precision of the models' weights and activations (``"float32"``, ``"bfloat16"``,
            ``"float16"``), never ``"auto"``; what the report headers record.
        threads: torch CPU threads the run computes on (and ``auto`` was measured on).
        forward_rows: the target forward widths ``(B, B · (D + 1))`` in tokens (:func:`forward_widths`), where
            ``auto`` was measured; the report headers record them.
        target, draft: the model names as given (alias, hub id, local directory or ``.gguf`` file); the draft
            model is loaded only where the drafter (or the command) needs it.
        drafter: the drafter name the run drafts with (``"lookup"``, ``"model"``, ``"lookup+head"``, …); None
            where the command takes several (``eval.profile``) or none.
        lookup_min_ngram: prompt lookup's shortest n-gram match (1 to 4); None: the drafter's default
            (:data:`learn2draft.drafters.lookup.DEFAULT_MIN_NGRAM`).
    """

    device: str
    dtype: str
    threads: int
    forward_rows: tuple[int, int]
    target: str = DEFAULT_TARGET
    draft: str = DEFAULT_DRAFT
    drafter: str | None = None
    lookup_min_ngram: int | None = None

    @classmethod
    def resolve(cls, *, device: str | None = "auto", dtype: str = "auto", threads: int | None = None, batch=None,
                depths: Iterable = (), target: str | None = None, draft: str | None = None,
                drafter: str | None = None, lookup_min_ngram: int | None = None,
                check_device: bool = True) -> RunSettings:
        """Resolve a command's settings from explicit values, once: ``auto`` device and precision, the widths.

        Args:
            device: ``--device`` (``auto`` or None: :func:`resolve_device`).
            dtype: ``--dtype``: ``auto`` (measured: :func:`learn2draft.models.resolve_dtype` on ``device``, on
                ``threads`` threads, at the forward widths), a canonical name or an alias (``bf16``, ``fp32``,
                ``fp16``).
            threads: the torch threads the run computes on (what the command set:
                :func:`learn2draft.cli.set_threads`); None: torch's current setting.
            batch, depths: the run's largest batch and the depths it drafts to (:func:`forward_widths`).
            target, draft: the model names (:func:`learn2draft.cli.model_names`); None: the embedded pair.
            drafter, lookup_min_ngram: as the attributes, already checked by the command
                (:func:`learn2draft.cli.lookup_min_ngram`).
            check_device: also refuse a device this machine does not have (else only a name torch does not know).

        Raises:
            learn2draft.ModelLoadError: an unknown ``device``, or (``check_device``) one unavailable here.
            ValueError: an unknown ``dtype`` (naming ``--dtype``), or ``threads`` out of range (naming
                ``--threads``).
        """
        import torch

        from learn2draft.models import resolve_dtype

        dev = resolve_device(device, check=check_device)
        n = torch.get_num_threads() if threads is None else run_threads(threads)
        rows = forward_widths(batch, depths)
        try:
            name = resolve_dtype(dtype, dev, n, rows)
        except ValueError:
            raise ValueError(f"--dtype {dtype!r}: unknown precision; use auto, float32, bfloat16 or float16.") from None
        return cls(dev, name, int(n), rows, target or DEFAULT_TARGET, draft or DEFAULT_DRAFT, drafter,
                   lookup_min_ngram)


__all__ = ["MAX_THREADS_PER_CORE", "RunSettings", "forward_widths", "largest_int", "resolve_device", "run_threads"]
