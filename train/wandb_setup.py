"""Weights & Biases set-up shared by every training command (``python -m train`` and the draft-model
and head recipes in :mod:`train.recipes`): the credentials check made before any work. wandb is
imported only when it is needed, so ``--help`` answers without it."""

from __future__ import annotations

import os


def check_wandb(mode: str) -> None:
    """Raise ValueError, before anything is written or computed, when ``mode`` is ``"online"`` and no
    W&B credentials are configured (``WANDB_API_KEY`` or ``wandb login``). Offline / disabled: no check."""
    if mode != "online":
        return
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


__all__ = ["check_wandb"]
