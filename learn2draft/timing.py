"""Device-synchronised wall-clock timing.

CUDA (and MPS) kernels run asynchronously: reading ``time.perf_counter()`` without first waiting
for the device measures only the launch. :class:`DeviceClock` synchronises before every reading.
"""

from __future__ import annotations

import time

import torch


class DeviceClock:
    """A clock that waits for ``device`` before reading ``time.perf_counter()`` (seconds)."""

    def __init__(self, device: torch.device | str):
        self.device = torch.device(device)
        if self.device.type == "cuda":
            self._sync = lambda: torch.cuda.synchronize(self.device)
        elif self.device.type == "mps":
            self._sync = torch.mps.synchronize
        else:
            self._sync = lambda: None

    def now(self) -> float:
        """Seconds (float, arbitrary origin) after all queued work on the device has finished."""
        self._sync()
        return time.perf_counter()
