"""torch sees every optimizer step, so an LR scheduler never warns that it ran first (issue #14).

The offload engines step the masters themselves (compiled CPU Adam, during or after backward, or in
the delayed-update thread), never through ``optimizer.step()``; torch's scheduler then warned on
every offload run that ``lr_scheduler.step()`` came before ``optimizer.step()`` and that the first
learning rate was skipped. See [Note: the LR scheduler sees the CPU step] in offload/engine.py.
One rank, in process, every stage with and without offload.
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest

from tests.offload.helpers import fit

WARNING = "lr_scheduler.step()"


class LrProbe(pl.Callback):
    """The learning rate of the first param group at each step's start (what the step will use)."""

    def __init__(self) -> None:
        self.lrs: list[float] = []

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: Any, batch: Any, batch_idx: int) -> None:
        self.lrs.append(trainer.optimizers[0].param_groups[0]["lr"])


CASES = {
    "zero1": dict(stage=1),
    "zero2": dict(stage=2),
    "zero3": dict(stage=3),
    "zero1_offload": dict(stage=1, offload_optimizer="cpu"),
    "zero2_offload": dict(stage=2, offload_optimizer="cpu"),
    "zero2_offload_step_in_backward": dict(stage=2, offload_optimizer="cpu", clip=None, nonfinite="ignore"),
    "zero2_offload_delayed": dict(stage=2, offload_optimizer="cpu", delayed_param_update=True,
                                  delayed_param_update_warmup=0),
    "zero3_offload": dict(stage=3, offload_optimizer="cpu", offload_params="cpu"),
    "zero3_offload_nvme": dict(stage=3, offload_optimizer="nvme", offload_params="nvme", nvme_chunk_mb=0.004),
}


@pytest.mark.parametrize("name", list(CASES))
def test_no_scheduler_order_warning_and_the_schedule_is_followed(name: str, tmp_path: Path) -> None:
    kwargs = dict(CASES[name])
    if kwargs.get("offload_optimizer") == "nvme":
        kwargs["nvme_path"] = str(tmp_path)
    probe = LrProbe()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        t, _ = fit(steps=4, callbacks=[probe], **kwargs)
    assert not [str(w.message) for w in caught if WARNING in str(w.message)], name
    scheduler = t.lr_scheduler_configs[0].scheduler
    base = scheduler.base_lrs[0]
    # ParityNet's LambdaLR: step k runs at base * lambda(k), the first value included (nothing skipped)
    assert probe.lrs == pytest.approx([base * scheduler.lr_lambdas[0](k) for k in range(4)]), name
    if kwargs.get("offload_optimizer") == "cpu" and kwargs.get("clip", 0.5) is None:
        assert t.strategy.engines[0].eager_steps == 4  # the step really ran during backward
