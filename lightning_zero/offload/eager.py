"""The CPU optimizer step run range by range while backward is still running.

[Note: step during backward]
With optimizer offload the synchronous step is: backward (gradients stream to the host as buckets are
reduced), then the CPU Adam pass over the whole partition, then the upload. The CPU pass is the
longest of the three on a GPU machine (GPT-1.3B: ~0.35 s on 16 cores against a 0.29 s forward and
backward), and most of it need not wait for backward to end: Adam is elementwise, so a bucket's
range can be stepped as soon as its reduced gradient has landed in host memory, while the device
computes the gradients of the layers before it.

That is only the same step when nothing needs *all* the gradients first. The strategy therefore asks
for it (the engine's ``step_in_backward``) only when the step's coefficient is known to be 1 before
backward: no gradient clipping (it needs the global norm), no fp16 loss scaling (it may skip the step
on overflow), ``nonfinite='ignore'`` (skipping or stopping at a non-finite step needs the global
norm before the update: zero/engine.py [Note: non-finite steps]), no gradient accumulation (the step
sees one micro-batch), automatic optimisation with Lightning's own ``optimizer_step`` and
``configure_gradient_clipping``, an Adam-family optimizer (hyper-parameters and learning rate are
read when backward reaches the first bucket: the scheduler steps after the optimizer, so that is
this step's rate), and neither the delayed update (which overlaps the step with the next step
already) nor NVMe optimizer states (whose chunk pipeline runs
the step itself). Results are bitwise those of the synchronous step (tests compare the two), and the
update is committed when the step is reached: a run that skips the step *after* backward (an
exception between backward and step) still has the updated masters, which are then uploaded.

A bucket holding a parameter that got no gradient on this rank is left to the step, which knows whether
any rank used it (offload/masked.py, zero/unused.py [Note: parameters unused on every rank]).

Ranges run on one worker thread in the order their gradients landed (on CUDA each waits for its
device-to-host copy's event); the compiled op releases the GIL and uses all but one core, leaving
one to the thread driving backward.
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Callable, Optional

import torch
from torch import Tensor

from lightning_zero.offload.cpu import adam_hyper
from lightning_zero.offload.host_optimizer import HostOptimizer, OnBucket
from lightning_zero.zero.unused import GroupPlan, UsedParams

UpdateRange = Callable[[int, int, int], None]
"""(param group, first element, end element) -> None: step that range of the group's partition."""


class EagerStep:
    """One optimizer step of one backward, submitted range by range (see the module note)."""

    def __init__(self, pool: ThreadPoolExecutor, update: UpdateRange) -> None:
        self._pool = pool
        self._update = update
        self._futures: list[Future] = []
        self._by_start: dict[tuple[int, int], Future] = {}
        self.covered: list[tuple[int, int, int]] = []

    def submit(self, gi: int, lo: int, hi: int, landed: Optional[Any] = None) -> None:
        """Step ``[lo, hi)`` of group ``gi`` once ``landed`` (a CUDA event, or None: already there) is done."""
        self.covered.append((gi, lo, hi))
        future = self._pool.submit(self._run, gi, lo, hi, landed)
        self._futures.append(future)
        self._by_start[(gi, lo)] = future

    def run_now(self, gi: int, lo: int, hi: int) -> None:
        """Step a range in the calling thread (one the backward never reached)."""
        self.covered.append((gi, lo, hi))
        self._update(gi, lo, hi)

    def _run(self, gi: int, lo: int, hi: int, landed: Optional[Any]) -> None:
        if landed is not None:
            landed.synchronize()
        self._update(gi, lo, hi)

    def wait(self, gi: int, lo: int) -> None:
        """Wait until the range of group ``gi`` starting at ``lo`` is stepped (if it was submitted; a
        failure is not raised here but by ``finish``, once every range has ended)."""
        future = self._by_start.get((gi, lo))
        if future is not None:
            future.exception()

    def finish(self) -> None:
        """Wait for every submitted range; the first failure is raised here, in the training thread."""
        errors = []
        for f in self._futures:
            try:
                f.result()
            except BaseException as err:  # every range must have finished before anything is re-raised
                errors.append(err)
        self._futures.clear()
        self._by_start.clear()
        if errors:
            raise errors[0]


def uncovered(sizes: list[int], covered: list[tuple[int, int, int]]) -> list[tuple[int, int, int]]:
    """The ranges of each group's ``[0, size)`` that ``covered`` misses (normally none: ``post_backward``
    reduces every bucket; this keeps the step complete whatever happened)."""
    out = []
    for gi, size in enumerate(sizes):
        spans = sorted((lo, hi) for g, lo, hi in covered if g == gi)
        pos = 0
        for lo, hi in spans:
            if lo < pos:
                raise RuntimeError(f"step_in_backward: param group {gi} range [{lo}, {hi}) stepped twice")
            if lo > pos:
                out.append((gi, pos, lo))
            pos = hi
        if pos < size:
            out.append((gi, pos, size))
    return out


class StepDuringBackward:
    """The step policy (policy.py) that runs the CPU step during backward when the strategy asks
    (``wanted``), and after backward otherwise. Owns the worker thread and the running step: started at
    a backward's first bucket, finished (and the uploads started) when the step comes."""

    def __init__(self, host: HostOptimizer) -> None:
        self.host = host
        self.eager_steps = 0
        """Steps that ran during backward (tests and benchmarks read it)."""
        self._eager: Optional[EagerStep] = None
        self._pool: Optional[ThreadPoolExecutor] = None

    @property
    def step_counted(self) -> bool:
        return self._eager is not None

    lagging = False

    def for_backward(self, wanted: bool, backwards: int, used: UsedParams) -> Optional[EagerStep]:
        """This backward's step-during-backward, started at its first bucket (None: step after backward)."""
        if self._eager is not None:
            if backwards > 0:
                raise RuntimeError(
                    "step_in_backward: a second backward before the optimizer step; the update ran during the "
                    "first one. Set ZeroStrategy(offload_step_in_backward=False) for this training loop."
                )
            return self._eager
        if not (wanted and backwards == 0):
            return None
        h = self.host
        uploads = h.uploads
        uploads.wait(uploads.write)  # the upload buffer about to be written: its last upload must be done
        threads = max(1, torch.get_num_threads() - 1)  # one core stays with the thread driving backward
        ranges = []
        for gi, pg in enumerate(h.optimizer.param_groups):
            hyper = adam_hyper(h.optimizer, pg)  # this step's learning rate
            out = uploads.buffer(gi, uploads.write)
            assert hyper is not None and (out is None or out.dtype != torch.float32 or h.compact is not None), \
                "see policy.choose_step_policy"
            whole = h.begin_host_adam(gi, h.grads[gi].landing, out, hyper, 1.0, threads)
            ranges.append(h.masked.lagging_ranges(gi, out, hyper, threads, used) or whole)

        def update(gi: int, lo: int, hi: int) -> None:
            ranges[gi](lo, hi)

        if self._pool is None:
            self._pool = ThreadPoolExecutor(1, "lz-step-in-backward")
        self._eager = EagerStep(self._pool, update)
        return self._eager

    def step(self, grads: list[Tensor], coef: float, plans: Optional[list[Optional[GroupPlan]]],
             on_bucket: OnBucket) -> None:
        if self._eager is None:
            self.host.step_now(grads, coef, plans, on_bucket)
            return
        self._finish_eager(coef, plans, on_bucket)
        self.host.step_device_share(coef, plans)

    def _finish_eager(self, coef: float, plans: Optional[list[Optional[GroupPlan]]], on_bucket: OnBucket) -> None:
        """The step that ran during backward: wait for it, step any range it missed, mark the upload."""
        eager, self._eager = self._eager, None
        assert eager is not None
        eager.finish()
        if coef != 1.0:
            raise RuntimeError(
                f"step_in_backward: the step's gradient coefficient is {coef} (clipping or loss scaling), but the "
                "update already ran during backward with 1. Set ZeroStrategy(offload_step_in_backward=False)."
            )
        h = self.host
        h.masked.run_uncovered(eager.run_now, uncovered(h.splits, eager.covered), plans)
        uploads = h.uploads
        uploads.begin(uploads.write)
        for gi, fg in enumerate(h.groups):  # each bucket's upload starts as soon as its range is stepped
            for bi, b in enumerate(fg.layout.buckets):
                if b.shard_offset < h.splits[gi]:
                    eager.wait(gi, b.shard_offset)
                    on_bucket(gi, bi)
        uploads.stepped(uploads.write)
        self.eager_steps += 1

    def before_zero_grad(self) -> None:
        if self._eager is not None:
            raise RuntimeError(
                "optimizer.zero_grad() between backward and step: with offload_step_in_backward the update already "
                "ran during backward. Set ZeroStrategy(offload_step_in_backward=False) for this training loop."
            )

    def wait(self) -> None:
        pass

    def finish(self, write_back: Callable[[], None]) -> None:
        """Backward ran, the step never came (an exception): let the thread finish; the result is uploaded
        by the next write-back."""
        if self._eager is not None:
            eager, self._eager = self._eager, None
            eager.finish()
            self.host.uploads.stepped(self.host.uploads.write)

    def abandon(self) -> None:
        if self._eager is not None:
            eager, self._eager = self._eager, None
            try:
                eager.finish()
            except Exception:  # noqa: BLE001 - the failure being handled is the one to report
                pass
