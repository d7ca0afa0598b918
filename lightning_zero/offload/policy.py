"""When the CPU step runs: the step policy, chosen once when the offload engine is built.

[Note: step policies]
Three policies, one per way the CPU step can be placed in time; the engine holds exactly one and calls
the same events on it whatever it is (``for_backward`` at each bucket's gradient landing, ``step`` at the
optimizer step, ``wait`` before the states are read, ``finish`` at teardown, ``abandon`` after a failure):

* :class:`SyncStep`: after backward, in the training thread (the host optimizer's ``step_now``);
* :class:`~lightning_zero.offload.eager.StepDuringBackward`: range by range while backward runs, when the
  strategy says this step's coefficient is known before backward (eager.py [Note: step during
  backward]); otherwise as ``SyncStep``. It owns the worker thread and the running step;
* :class:`~lightning_zero.offload.delayed.DelayedStep`: step t in a background thread during step t+1
  (delayed.py [Note: delayed parameter update]), after its warm-up steps. It owns the thread and the future.

:func:`choose_step_policy` decides from the config and what the host optimizer can do (Adam-family
hyper-parameters, int8 states' block alignment), as pipeline/schedule.py decides its schedule in data
before anything runs; nothing re-derives the choice per step.
"""

from __future__ import annotations

from typing import Callable, Optional, Protocol

from torch import Tensor

from lightning_zero.config.offload import OffloadConfig
from lightning_zero.offload.delayed import DelayedStep
from lightning_zero.offload.eager import EagerStep, StepDuringBackward
from lightning_zero.offload.host_optimizer import HostOptimizer, OnBucket
from lightning_zero.zero.unused import GroupPlan, UsedParams


class StepPolicy(Protocol):
    """The events the offload engine sends to its step policy (see [Note: step policies])."""

    eager_steps: int
    """Steps that ran during backward (tests and benchmarks read it through the engine)."""

    @property
    def step_counted(self) -> bool:
        """Whether the optimizer state's ``step`` already counts the coming step (it ran during backward)."""
        ...

    @property
    def lagging(self) -> bool:
        """Whether the masters are a step ahead of the parameters (the delayed update, once it runs)."""
        ...

    def for_backward(self, wanted: bool, backwards: int, used: UsedParams) -> Optional[EagerStep]:
        """At a bucket's reduce-scatter: the step running during this backward, if any (``wanted``: the
        strategy's ``step_in_backward``; ``backwards``: backwards already reduced since the last step)."""
        ...

    def step(self, grads: list[Tensor], coef: float, plans: Optional[list[Optional[GroupPlan]]],
             on_bucket: OnBucket) -> None:
        """The optimizer step: run, finish or start the CPU step; the upload state says what to upload."""
        ...

    def before_zero_grad(self) -> None:
        """``optimizer.zero_grad()``: refuse it where it would drop an update already made."""
        ...

    def wait(self) -> None:
        """Background work on the masters finished (before they are read: checkpoints)."""
        ...

    def finish(self, write_back: Callable[[], None]) -> None:
        """End of fit/validate/test: complete any started step (``write_back`` uploads its result)."""
        ...

    def abandon(self) -> None:
        """After a failure: join the threads, report nothing (the failure being handled is the one to report)."""
        ...


class SyncStep:
    """The CPU step after backward, in the training thread."""

    def __init__(self, host: HostOptimizer) -> None:
        self.host = host
        self.eager_steps = 0

    @property
    def step_counted(self) -> bool:
        return False

    lagging = False

    def for_backward(self, wanted: bool, backwards: int, used: UsedParams) -> Optional[EagerStep]:
        return None

    def step(self, grads: list[Tensor], coef: float, plans: Optional[list[Optional[GroupPlan]]],
             on_bucket: OnBucket) -> None:
        self.host.step_now(grads, coef, plans, on_bucket)

    def before_zero_grad(self) -> None:
        pass

    def wait(self) -> None:
        pass

    def finish(self, write_back: Callable[[], None]) -> None:
        pass

    def abandon(self) -> None:
        pass


def choose_step_policy(host: HostOptimizer, offload: OffloadConfig) -> StepPolicy:
    """The engine's one step policy (see [Note: step policies])."""
    o = offload
    if o.delayed_param_update:
        return DelayedStep(host, o.delayed_param_update_warmup)
    int8 = host.compact is not None and host.compact.aligned
    if o.offload_step_in_backward and o.offload_optimizer == "cpu" and host.hypers_ok and not int8:
        return StepDuringBackward(host)
    return SyncStep(host)
