"""The 16-bit upload buffers of the offloaded optimizer and their state machine.

[Note: the upload state]
The CPU step writes its 16-bit result (or, fp32 compute, a copy of the masters) into a pinned host
*upload buffer*, from which the device's partitions are refreshed (stages 1-2: uploaded and all-gathered
bucket by bucket, offload/flat.py; stage 3: uploaded into the gather sources, offload/sharded.py). The
delayed update keeps two buffers (the background step writes one while the other is uploaded); without a
buffer (fp32 compute, or stage 3 with pinned host partitions) the upload reads the masters or the
partitions directly. What remains to be done is this module's :class:`Uploads`, and only its methods
change it (its fields are read-only properties; tests/unit/test_offload_structure.py checks it):

* ``write``: the buffer the next step writes (synchronous step, during backward, or in the background);
* ``read``: the buffer the next upload reads (set to ``write`` when a step begins, so stages 1-2 upload
  each bucket as soon as it is stepped: flat.py [Note: uploads follow the CPU step]);
* ``state``, one of :class:`UploadState`::

      CURRENT --stepped(i)--> PENDING --take()--> CURRENT
      CURRENT/PENDING --loaded()--> STALE --refill(masters)--> PENDING   (a checkpoint load)
      any --nothing()--> CURRENT   (the delayed update's first step: no earlier result to upload)

  PENDING: buffer ``read`` holds a step's result the device has not received; STALE: the masters were
  replaced (a checkpoint load) after the buffer was written, so it is refilled from them first.

Each upload records a CUDA event per buffer; a buffer is rewritten only after its last upload finished
(``wait``): no other synchronisation is added to the step.
"""

from __future__ import annotations

import enum
from typing import Any, Callable, Optional

import torch
from torch import Tensor


class UploadState(enum.Enum):
    """What the device's 16-bit partitions lack (see [Note: the upload state])."""

    CURRENT = "current"
    """Nothing to upload: the device has the latest step's values."""
    PENDING = "pending"
    """Buffer ``read`` holds a result not yet uploaded."""
    STALE = "stale"
    """The masters were loaded after the buffers were written: refill from them, then upload."""


class Uploads:
    """The upload buffers of every param group, which one is written and read, and the upload state."""

    def __init__(self, buffers: list[list[Tensor]], fallback: Callable[[int], Optional[Tensor]],
                 device: torch.device) -> None:
        self.buffers = buffers
        """Per param group: 0, 1 or 2 (delayed update) host buffers of the 16-bit partition."""
        self._fallback = fallback
        """Where group ``gi`` uploads from without a buffer (stage 3's host partition, or None: the master)."""
        self._device = device
        self._write = 0
        self._read = 0
        self._state = UploadState.CURRENT
        self._events: dict[int, Any] = {}

    # read-only outside this class: the transitions below are the only writers
    @property
    def write(self) -> int:
        """The buffer the next step writes."""
        return self._write

    @property
    def read(self) -> int:
        """The buffer the next upload reads."""
        return self._read

    @property
    def state(self) -> UploadState:
        return self._state

    # ---------------------------------------------------------------- buffers
    def buffer(self, gi: int, index: int) -> Optional[Tensor]:
        """Where a step writing buffer ``index`` puts group ``gi``'s 16-bit result (None: upload straight
        from the master)."""
        bufs = self.buffers[gi]
        if bufs:
            return bufs[index % len(bufs)]
        return self._fallback(gi)

    def source(self, gi: int, master: Tensor) -> Tensor:
        """What the next upload of group ``gi`` reads."""
        out = self.buffer(gi, self._read)
        return out if out is not None else master

    # ---------------------------------------------------------------- transitions (the only writers)
    def begin(self, index: int) -> None:
        """A step starts writing buffer ``index``; uploads during it read the same buffer."""
        self._write = self._read = index

    def stepped(self, index: int) -> None:
        """A step's result is complete in buffer ``index``: PENDING."""
        self._read = index
        self._state = UploadState.PENDING

    def nothing(self) -> None:
        """No result to upload (the delayed update's first background step): CURRENT."""
        self._state = UploadState.CURRENT

    def hand_to_background(self, index: int) -> None:
        """The delayed update's next step writes buffer ``index`` in the background."""
        self._write = index

    def loaded(self) -> None:
        """The masters were loaded (a checkpoint): STALE until ``refill``."""
        self._state = UploadState.STALE

    def refill(self, masters: list[Tensor]) -> None:
        """STALE: copy the loaded masters into the buffers the upload reads, then PENDING."""
        if self._state is not UploadState.STALE:
            return
        for gi, master in enumerate(masters):
            out = self.buffer(gi, self._read)
            if out is not None:
                out.copy_(master)
        self._state = UploadState.PENDING

    def take(self) -> bool:
        """Whether an upload is due; it is then considered done (the caller performs it): CURRENT."""
        if self._state is UploadState.CURRENT:
            return False
        self._state = UploadState.CURRENT
        return True

    @property
    def pending(self) -> bool:
        return self._state is not UploadState.CURRENT

    # ---------------------------------------------------------------- ordering with the device
    def record(self, index: int) -> None:
        """The uploads from buffer ``index`` were issued: remember when they end (CUDA)."""
        if self._device.type == "cuda":
            ev = torch.cuda.Event()
            ev.record()
            self._events[index] = ev

    def wait(self, index: int) -> None:
        """Buffer ``index`` is about to be rewritten: its previous upload must have finished."""
        ev = self._events.pop(index, None)
        if ev is not None:
            ev.synchronize()
