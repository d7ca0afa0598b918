"""The delayed parameter update (ZeRO-Offload's DPU): step t's CPU update overlaps step t+1.

[Note: delayed parameter update]
With ``delayed_param_update`` (after ``delayed_param_update_warmup`` synchronous steps) step t's CPU
update runs in a background thread while the device computes step t+1, which uses the parameters of
update t-1; step t+1's ``_step_masters`` waits for it, uploads its result and starts update t+1. The
gradients and upload buffers are doubled so that the thread and the device never share one (events
order the uploads). The learning rate etc. are read when the update starts. ``host_state`` waits for
the thread (checkpoints see the latest masters); teardown uploads the last result. The overlap needs
the CPU op to release the GIL (torch's own kernels do); results differ from the synchronous run by
design (tests check the exact one-step staleness).
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from typing import Optional

from torch import Tensor

from lightning_zero.offload.cpu import adam_hyper


class DelayedUpdateMixin:
    """The delayed update's part of the offload engine (engine.py's OffloadMixin derives from it)."""

    _dpu_pool: Optional[ThreadPoolExecutor]
    _dpu_future: Optional[Future]

    def _step_delayed(self, grads: list[Tensor], coef: float) -> None:
        """Upload the previous step's result and start this step's CPU update in the background."""
        if self._dpu_future is not None:
            self._dpu_future.result()
            self._upload_from, self._upload_pending = self._dpu_up, True
        else:
            self._upload_pending = False
        nxt = 1 - self._upload_from if self._upload_pending else 1 - self._up
        self._wait_h2d(nxt)
        hypers = [adam_hyper(self.optimizer, pg) for pg in self.optimizer.param_groups]  # this step's lr
        for hg in self._grads:
            hg.rotate()  # the next backward lands elsewhere
        self._dpu_up = self._up = nxt
        assert self._dpu_pool is not None
        self._dpu_future = self._dpu_pool.submit(self._cpu_step, grads, coef, nxt, hypers, False, self._plans)

    def _finish_delayed_update(self) -> None:
        """Wait for the background step and upload its result (collective on stages 1-2: every rank
        tears down), so evaluation and export after fit see the final parameters."""
        if self._dpu_future is None:
            return
        self._dpu_future.result()
        self._dpu_future = None
        self._upload_from, self._upload_pending = self._dpu_up, True
        self._write_back()  # type: ignore[attr-defined]
        self._steps = 0  # a later step starts synchronously again
