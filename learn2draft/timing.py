"""Device-synchronised wall-clock timing.

CUDA (and MPS) kernels run asynchronously: reading ``time.perf_counter()`` without first waiting
for the device measures only the launch. :class:`DeviceClock` synchronises before every reading.
"""

from __future__ import annotations

import time

import torch


class DeviceClock:
    """A clock that waits for ``device`` before reading ``time.perf_counter()`` (seconds).

    Args:
        device: the device whose queued work a reading waits for.
        synchronize: False reads the host's clock without waiting (no device synchronisation): for host-side
            bookkeeping inside a step whose own clock waits, e.g. the rows of a batched step
            (:class:`learn2draft.batched.BatchedSpeculativeDecoder`), where a waiting reading per row would
            synchronise a GPU several times per row and step.
    """

    def __init__(self, device: torch.device | str, synchronize: bool = True):
        self.device = torch.device(device)
        #: whether a reading waits for the device (on the CPU there is nothing to wait for either way)
        self.waits = bool(synchronize)
        if not synchronize:
            self._sync = lambda: None
            # the host's clock itself: a reading is then one C call, no Python frame (a batched step reads each
            # row's clock several times per row)
            self.now = time.perf_counter
        elif self.device.type == "cuda":
            self._sync = lambda: torch.cuda.synchronize(self.device)
        elif self.device.type == "mps":
            self._sync = torch.mps.synchronize
        else:
            self._sync = lambda: None

    def now(self) -> float:
        """Seconds (float, arbitrary origin) after all queued work on the device has finished."""
        self._sync()
        return time.perf_counter()
