"""The estimator's formula with 16-bit device states (offload/estimator.py ``device_state_coefficients``, issue
#33) against the storage a real one-rank run holds at the step: parameters, gradients, masters, gradient
shards and Adam state, each storage once, counted when the engine's 16-bit step starts (it does not call
``optimizer.step()``, so torch's step pre-hooks do not fire); within 5%, as the fp32 states' own test
(tests/offload/test_estimator_storage.py)."""

from __future__ import annotations

import lightning.pytorch as pl
import pytest
import torch

from lightning_zero.offload import estimator as est
from tests.helpers.memory import storage_bytes
from tests.offload.helpers import fit
from tests.offload.test_single import Wide


class AtStates16Step(pl.Callback):
    def on_train_start(self, trainer, pl_module) -> None:
        self.bytes = 0
        self.params = sum(p.numel() for p in pl_module.parameters())
        for engine in trainer.strategy.engines:
            step = engine.states16.step

            def counted(grads, coef, plans, step=step, engine=engine) -> None:
                self._count(pl_module, engine)
                step(grads, coef, plans)

            engine.states16.step = counted

    def _count(self, pl_module, engine) -> None:
        tensors = list(pl_module.parameters()) + [p.grad for p in pl_module.parameters() if p.grad is not None]
        for fg in engine.groups:
            tensors += [getattr(fg, n, None) for n in ("master", "shard16", "grad_shard", "flat_grad")]
        tensors += [v for st in engine.optimizer.state.values() for v in st.values() if torch.is_tensor(v) and v.dim()]
        self.bytes = max(self.bytes, storage_bytes(t for t in tensors if t is not None))


@pytest.mark.parametrize("stage, sp, gs", [
    (1, "bf16_sr", "fp32"), (2, "bf16_kahan", "fp32"), (2, "bf16_sr", "bf16"), (3, "bf16_sr", "bf16"),
    (3, "bf16_kahan", "fp32"),
])
def test_device_state_matches_the_formula(stage: int, sp: str, gs: str) -> None:
    probe = AtStates16Step()
    fit(steps=2, callbacks=[probe], model=Wide(), precision="bf16-mixed", stage=stage, state_precision=sp,
        grad_shard_precision=gs)
    states, grads = {"bf16_sr": 6.0, "bf16_kahan": 8.0}[sp], {"fp32": 4.0, "bf16": 2.0}[gs]
    full, shard = est.device_state_coefficients(est.Setting(stage), 2, ranks=1, states=states, grads=grads)
    expected = (full + shard) * probe.params  # one rank: N = 1
    assert abs(probe.bytes - expected) <= 0.05 * expected, (stage, sp, gs, probe.bytes / probe.params, full + shard)
