"""The delayed parameter update (ZeRO-Offload's DPU): step t's CPU update overlaps step t+1.

[Note: delayed parameter update]
With ``delayed_param_update`` (after ``delayed_param_update_warmup`` synchronous steps) step t's CPU
update runs in a background thread while the device computes step t+1, which uses the parameters of
update t-1; step t+1's optimizer step waits for it, uploads its result and starts update t+1. The
gradients and upload buffers are doubled so that the thread and the device never share one (events
order the uploads). The learning rate etc. are read when the update starts. ``host_state`` waits for
the thread (checkpoints see the latest masters); teardown uploads the last result. The overlap needs
the CPU op to release the GIL (torch's own kernels do); results differ from the synchronous run by
design (tests check the exact one-step staleness). :class:`DelayedStep` is this step policy (policy.py).
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from typing import Callable, Optional

from torch import Tensor

from lightning_zero.offload.cpu import adam_hyper
from lightning_zero.offload.eager import EagerStep
from lightning_zero.offload.host_optimizer import HostOptimizer, OnBucket
from lightning_zero.zero.unused import GroupPlan, UsedParams


class DelayedStep:
    """The delayed update's step policy: owns the background thread and the running step's future."""

    def __init__(self, host: HostOptimizer, warmup: int) -> None:
        self.host = host
        self.eager_steps = 0
        self._warmup = warmup
        self._steps = 0
        """Steps since the start (or the last ``finish``): the first ``warmup`` run synchronously."""
        self._pool = ThreadPoolExecutor(1, "lz-dpu")
        self._future: Optional[Future] = None
        self._buffer = 0
        """The upload buffer the background step writes."""

    @property
    def step_counted(self) -> bool:
        return False

    @property
    def lagging(self) -> bool:
        """A background step has run: the masters are ahead of the parameters (param_writes.py)."""
        return self._future is not None

    def for_backward(self, wanted: bool, backwards: int, used: UsedParams) -> Optional[EagerStep]:
        return None

    def step(self, grads: list[Tensor], coef: float, plans: Optional[list[Optional[GroupPlan]]],
             on_bucket: OnBucket) -> None:
        """Upload the previous step's result and start this step's CPU update in the background."""
        self._steps += 1
        h = self.host
        if self._steps <= self._warmup:
            h.step_now(grads, coef, plans, on_bucket)
            return
        uploads = h.uploads
        if self._future is not None:
            self._future.result()
            uploads.stepped(self._buffer)
        else:
            uploads.nothing()
        nxt = 1 - uploads.read if uploads.pending else 1 - uploads.write
        uploads.wait(nxt)
        hypers = [adam_hyper(h.optimizer, pg) for pg in h.optimizer.param_groups]  # this step's lr
        for hg in h.grads:
            hg.rotate()  # the next backward lands elsewhere
        self._buffer = nxt
        uploads.hand_to_background(nxt)
        self._future = self._pool.submit(h.cpu_step, grads, coef, nxt, hypers, None, plans)

    def before_zero_grad(self) -> None:
        pass

    def wait(self) -> None:
        if self._future is not None:
            self._future.result()  # the background step must finish first (its upload stays pending)

    def finish(self, write_back: Callable[[], None]) -> None:
        """Wait for the background step and upload its result (collective on stages 1-2: every rank
        tears down), so evaluation and export after fit see the final parameters."""
        if self._future is None:
            return
        self._future.result()
        self._future = None
        self.host.uploads.stepped(self._buffer)
        write_back()
        self._steps = 0  # a later step starts synchronously again

    def abandon(self) -> None:
        if self._future is not None:
            future, self._future = self._future, None
            try:
                future.result()
            except Exception:  # noqa: BLE001 - the failure being handled is the one to report
                pass
